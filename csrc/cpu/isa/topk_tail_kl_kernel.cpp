// Vectorized CPU kernels of lopd::topk_tail_kl_cpu_fwd / _bwd. Compiled once per ISA
// (CPU_CAPABILITY = DEFAULT | AVX2 | AVX512, see csrc/cpu/isa_dispatch.h); the per-row math is in
// csrc/common/topk_tail_kl_math.h, shared with the CUDA kernel.
//
// Forward, one row (top-M mode): a single streaming pass over both logit rows, whatever the
// support. The running top-M of the selecting row (the teacher's; the student's for
// support="student", the same code with the rows' roles swapped) lives in a binary min-heap
// (worst kept entry on top, its logit is the admission threshold). support="union" keeps both
// running top-M heaps in the same pass: a lane is a tail lane when it beats neither threshold,
// and an entry evicted from one heap joins the tails only if the other heap does not hold it
// (a scan of its M entries, on the rare evictions), so the tails are exactly the complement of
// the union at the end; each vector step costs one more compare, and the careful path runs for
// the student's candidates too. The tails of both sides are log-sum-exps over the complement of the
// selection, accumulated in ONE pass over both rows: each vector step of 32 lanes computes
// 2^(x log2(e) / T - k) after one FMA (fast_exp2), relative to a per-side stabilizer k that is
// some tail lane's own value (Base2Tail below: no underflow however small the tail is, no
// overflow however large a term is). In the common step (once the heap has warmed up nearly every
// step) no lane beats the threshold and no term exceeds 2^kSlack2: all lanes are summed. Otherwise
// the step takes the careful path: the stabilizer is raised (or set, for a side's first lane with
// mass) to the step's largest tail lane, the candidate lanes are masked out of the sums and
// offered to the heap in index order (an evicted entry, or one the risen threshold now rejects,
// joins a scalar tail state), and the threshold is refreshed. Lane sums are flushed to double per
// block of kBlock entries; the full log-sum-exps are logaddexp(lse(top), tail) at the end. Each
// logit is read once; two exponentials per vocabulary entry at about 11 vector instructions each.
// Divergences: the KLs and the generalized JSD (docs/math.md, 1b) differ only in the row's
// finalization from the bucket log-masses (math::row_finalize) and in the backward's per-bucket
// factors (math::bucket_grad_factors_div); the full-vocabulary JSD takes two passes (both
// log-sum-exps first, then the terms) and its backward one more (KL(P || M), KL(Q || M)).
// Backward, one row: one pass per tensor writes the tail formula (share of the tail mass times the
// tail's factor, see bucket_grad_factors) for every entry, then the K selected entries (a -1
// slot skipped) and the target are rewritten with their own factors.
// GCC 12 reports -Wmaybe-uninitialized false positives inside its own avx512fintrin.h (the
// `_mm512_undefined_*` placeholders ATen's Vectorized uses); they are not about this file's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/topk_tail_kl_math.h"
#include "cpu/topk_tail_kl.h"
#include "cpu/vec_exp.h"
#include "cpu/vec_helpers.h"

namespace lopd::cpu::CPU_CAPABILITY {
namespace {

namespace math = ::lopd::topk_tail_kl;

// Vec, kVF (floats per vector), kStep (elements per vector step: two float vectors, i.e. one full
// vector of a 16-bit input type), kNegInf, load2 / store2 / hmax / hsum: csrc/cpu/vec_helpers.h.
// Entries per block: the top-M forward flushes its lane sums to double once per block (short
// fp32 sums) and prefetches the next; the full-vocabulary forward reads each block twice while it
// sits in L1 (2 x 2,048 fp32 values = 16 KiB).
constexpr int64_t kBlock = 2048;
constexpr float kLog2e = 1.44269504088896341f;
// How far (log2 units) a tail term may exceed its stabilizer in the one-pass path: every term is
// then at most 2^92 (e^64), and a lane's sum of the 2 kBlock / kStep terms of a block stays far
// below FLT_MAX.
constexpr float kSlack2 = 64.0f * kLog2e;

// Bit l set where a[l] > b[l] (ordered: a NaN lane is 0). One compare (+ a mask move on AVX2),
// where Vec's operator> builds an all-ones vector first.
inline uint32_t gt_mask(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cmp_ps_mask(__m512(a), __m512(b), _CMP_GT_OQ);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 gt = _mm256_cmp_ps(__m256(a), __m256(b), _CMP_GT_OQ);
  return static_cast<uint32_t>(_mm256_movemask_ps(gt));
#else
  float x[kVF], y[kVF];
  a.store(x);
  b.store(y);
  uint32_t m = 0;
  for (int64_t l = 0; l < kVF; ++l) m |= static_cast<uint32_t>(x[l] > y[l]) << l;
  return m;
#endif
}

// A kept top-M entry: scaled teacher logit, scaled student logit, vocabulary index.
struct Entry {
  float t;
  float s;
  int64_t idx;
};

// Strict order "a ranks before b": larger teacher logit first, ties to the lower index (the
// deterministic rule the reference implements with a stable descending sort).
inline bool ranks_before(const Entry& a, const Entry& b) {
  return a.t > b.t || (a.t == b.t && a.idx < b.idx);
}

// The same order on the student logit (the union's second selection).
inline bool ranks_before_s(const Entry& a, const Entry& b) {
  return a.s > b.s || (a.s == b.s && a.idx < b.idx);
}

// Whether heap h (m entries) holds vocabulary index idx.
inline bool holds(const Entry* h, int64_t m, int64_t idx) {
  for (int64_t i = 0; i < m; ++i) {
    if (h[i].idx == idx) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

// Per-thread scratch, O(K): the selecting heap, the union's student heap, the K bucket logits.
struct FwdScratch {
  std::vector<Entry> heap, heap_s;
  std::vector<float> s_top, t_top;
  FwdScratch(int64_t m, int64_t k, bool two_heaps)
      : heap(m), heap_s(two_heaps ? m : 0), s_top(k), t_top(k) {}
};

struct RowResult {
  float kl, lse_s, lse_t;
};

// One side's running tail sum on the vector path, in base 2: sum_j 2^(y_j) over the tail lanes
// seen so far, y_j = x_j log2(e) / T - k, relative to the stabilizer k (log2 units). k is raised
// to a tail lane's own value whenever a term would exceed 2^kSlack2, and never stands above the
// tail's largest value, so the largest term is >= 1 (nothing that matters underflows) and no
// lane sum overflows. Lane sums are flushed into a double once per block (short fp32 sums).
struct Base2Tail {
  Vec sum = Vec(0.0f);   // this block's lane sums, relative to k
  double total = 0.0;    // earlier blocks' sum, relative to k
  float k = kNegInf;     // -inf: no tail lane with mass seen yet
  Vec vk = Vec(kNegInf);

  void raise_to(float k_new) {
    if (k != kNegInf) {
      const float r = std::exp2(k - k_new);
      sum = sum * Vec(r);
      total *= r;
    }
    k = k_new;
    vk = Vec(k_new);
  }
  void flush() {
    total += hsum(sum);
    sum = Vec(0.0f);
  }
  // Adds the tail lanes (c0 / c1 unset) of one step: x raw logits, y their exponents relative to
  // the current k. Raises k first when a tail lane needs it (or sets it on the first lane with
  // mass); an all -inf step adds nothing.
  void add_masked(const Vec& x0, const Vec& x1, Vec y0, Vec y1, const Vec& c0, const Vec& c1,
                  const Vec& vc2) {
    const Vec vneg(kNegInf);
    const float top = hmax(at::vec::maximum(Vec::blendv(x0 * vc2, vneg, c0),
                                            Vec::blendv(x1 * vc2, vneg, c1)));
    if (top == kNegInf) return;
    if (k == kNegInf || top - k > kSlack2) {
      raise_to(top);
      y0 = at::vec::fmsub(x0, vc2, vk);
      y1 = at::vec::fmsub(x1, vc2, vk);
    }
    const Vec zero(0.0f);
    sum = sum + Vec::blendv(fast_exp2(y0), zero, c0) + Vec::blendv(fast_exp2(y1), zero, c1);
  }
  // Merges everything into a natural-log tail state. The stabilizer k ln 2 is rounded to float
  // for the state, and the sum is shifted by that rounding (in double), so nothing is lost.
  void merge_into(math::LseState& tail) {
    flush();
    if (k == kNegInf) return;
    const double k_nat = static_cast<double>(k) * 0.693147180559945309;
    const float m = static_cast<float>(k_nat);
    math::lse_merge(tail, m, static_cast<float>(total * std::exp(k_nat - m)));
  }
};

// One row's top-M + tail forward. kUnion == false: the heap selects on `t` (the teacher's row;
// with `swapped` the student's, `s` then being the teacher's); kUnion == true (never swapped):
// two heaps, on `t` (teacher) and on `s` (student). Writes ids_out[K] and bucket_out[2 (K + 1)].
template <bool kUnion, typename TS, typename TT>
RowResult fwd_topk_row(const TS* s, const TT* t, int64_t V, int64_t M, float inv,
                       const math::DivergenceSpec& div, bool swapped, FwdScratch& scr,
                       int64_t* ids_out, float* bucket_out) {
  Entry* heap = scr.heap.data();
  // The heap is a max-heap under ranks_before reversed, i.e. heap[0] is the worst kept entry.
  auto worse_first = [](const Entry& a, const Entry& b) { return ranks_before(a, b); };
  auto worse_first_s = [](const Entry& a, const Entry& b) { return ranks_before_s(a, b); };
  for (int64_t j = 0; j < M; ++j) {
    heap[j] = Entry{static_cast<float>(t[j]) * inv, static_cast<float>(s[j]) * inv, j};
  }
  [[maybe_unused]] Entry* heap_s = nullptr;
  if constexpr (kUnion) {
    heap_s = scr.heap_s.data();
    std::copy(heap, heap + M, heap_s);
    std::make_heap(heap_s, heap_s + M, worse_first_s);
  }
  std::make_heap(heap, heap + M, worse_first);

  // Entries that left the heap or lost against it in scalar code: natural-log states.
  math::LseState tail_s = math::lse_empty();
  math::LseState tail_t = math::lse_empty();
  // Offers entry j (larger than every index in the heap, so it must beat the worst kept logit
  // strictly); whatever does not stay in the heap is folded into both tails. The union's:
  // an entry leaves for the tails when it is in neither heap any more.
  auto offer = [&](float tj, float sj, int64_t j) {
    if constexpr (!kUnion) {
      if (tj > heap[0].t) {
        math::lse_add(tail_t, heap[0].t);
        math::lse_add(tail_s, heap[0].s);
        std::pop_heap(heap, heap + M, worse_first);
        heap[M - 1] = Entry{tj, sj, j};
        std::push_heap(heap, heap + M, worse_first);
      } else {
        math::lse_add(tail_t, tj);
        math::lse_add(tail_s, sj);
      }
    } else {
      const bool in_t = tj > heap[0].t;
      const bool in_s = sj > heap_s[0].s;
      if (!in_t && !in_s) {
        math::lse_add(tail_t, tj);
        math::lse_add(tail_s, sj);
        return;
      }
      if (in_t) {
        const Entry out = heap[0];
        std::pop_heap(heap, heap + M, worse_first);
        heap[M - 1] = Entry{tj, sj, j};
        std::push_heap(heap, heap + M, worse_first);
        if (!holds(heap_s, M, out.idx)) {
          math::lse_add(tail_t, out.t);
          math::lse_add(tail_s, out.s);
        }
      }
      if (in_s) {
        const Entry out = heap_s[0];
        std::pop_heap(heap_s, heap_s + M, worse_first_s);
        heap_s[M - 1] = Entry{tj, sj, j};
        std::push_heap(heap_s, heap_s + M, worse_first_s);
        if (!holds(heap, M, out.idx)) {
          math::lse_add(tail_t, out.t);
          math::lse_add(tail_s, out.s);
        }
      }
    }
  };

  const Vec vinv(inv);
  const Vec vc2(inv * kLog2e);
  const Vec vslack2(kSlack2);
  Base2Tail acc_t, acc_s;
  // Both stabilizers set (until then every step takes the careful path, which sets them).
  bool ready = false;
  float thr = heap[0].t;
  Vec vthr(thr);
  [[maybe_unused]] float thr_s = kUnion ? heap_s[0].s : 0.0f;
  [[maybe_unused]] Vec vthr_s(thr_s);
  int64_t j = M;
  const int64_t vec_end = M + (V - M) / kStep * kStep;
  while (j < vec_end) {
    const int64_t blk_end = std::min(j + kBlock, vec_end);
    for (int64_t k = j; k < blk_end; k += kStep) {
      __builtin_prefetch(t + k + kBlock, 0, 3);
      __builtin_prefetch(s + k + kBlock, 0, 3);
      Vec t0, t1, s0, s1;
      load2(t + k, t0, t1);
      load2(s + k, s0, s1);
      // Candidates: the scaled teacher logit, computed as the heap computes it, beats the
      // threshold. Every other lane is a tail lane (the threshold only rises).
      const Vec ts0 = t0 * vinv;
      const Vec ts1 = t1 * vinv;
      const Vec yt0 = at::vec::fmsub(t0, vc2, acc_t.vk);
      const Vec yt1 = at::vec::fmsub(t1, vc2, acc_t.vk);
      const Vec ys0 = at::vec::fmsub(s0, vc2, acc_s.vk);
      const Vec ys1 = at::vec::fmsub(s1, vc2, acc_s.vk);
      uint32_t cand = gt_mask(ts0, vthr) | gt_mask(ts1, vthr);
      [[maybe_unused]] Vec ss0, ss1;
      if constexpr (kUnion) {
        // The union's lanes are also candidates when the student logit beats its threshold.
        ss0 = s0 * vinv;
        ss1 = s1 * vinv;
        cand |= gt_mask(ss0, vthr_s) | gt_mask(ss1, vthr_s);
      }
      if (ready && (cand | gt_mask(yt0, vslack2) | gt_mask(yt1, vslack2) |
                    gt_mask(ys0, vslack2) | gt_mask(ys1, vslack2)) == 0) {
        // The common case: every lane is a tail lane and no term can overflow.
        acc_t.sum = acc_t.sum + fast_exp2(yt0) + fast_exp2(yt1);
        acc_s.sum = acc_s.sum + fast_exp2(ys0) + fast_exp2(ys1);
        continue;
      }
      Vec c0 = ts0 > vthr;
      Vec c1 = ts1 > vthr;
      if constexpr (kUnion) {
        c0 = c0 | (ss0 > vthr_s);
        c1 = c1 | (ss1 > vthr_s);
      }
      acc_t.add_masked(t0, t1, yt0, yt1, c0, c1, vc2);
      acc_s.add_masked(s0, s1, ys0, ys1, c0, c1, vc2);
      ready = acc_t.k != kNegInf && acc_s.k != kNegInf;
      if (cand != 0) {
        float tb[kStep], sb[kStep];
        ts0.store(tb);
        ts1.store(tb + kVF);
        (s0 * vinv).store(sb);
        (s1 * vinv).store(sb + kVF);
        for (int64_t l = 0; l < kStep; ++l) {
          if constexpr (kUnion) {
            if (tb[l] > thr || sb[l] > thr_s) offer(tb[l], sb[l], k + l);
          } else {
            if (tb[l] > thr) offer(tb[l], sb[l], k + l);
          }
        }
        thr = heap[0].t;
        vthr = Vec(thr);
        if constexpr (kUnion) {
          thr_s = heap_s[0].s;
          vthr_s = Vec(thr_s);
        }
      }
    }
    acc_t.flush();
    acc_s.flush();
    j = blk_end;
  }
  for (; j < V; ++j) {
    offer(static_cast<float>(t[j]) * inv, static_cast<float>(s[j]) * inv, j);
  }
  acc_t.merge_into(tail_t);
  acc_s.merge_into(tail_s);

  std::sort(heap, heap + M, ranks_before);
  float* s_top = scr.s_top.data();
  float* t_top = scr.t_top.data();
  for (int64_t i = 0; i < M; ++i) {
    ids_out[i] = heap[i].idx;
    s_top[i] = heap[i].s;
    t_top[i] = heap[i].t;
  }
  int64_t K = M;
  if constexpr (kUnion) {
    // The teacher's top-M (above), then the student's other top-M ids in student order, then -1.
    K = 2 * M;
    std::sort(heap_s, heap_s + M, ranks_before_s);
    int64_t k = M;
    for (int64_t i = 0; i < M; ++i) {
      if (holds(heap, M, heap_s[i].idx)) continue;
      ids_out[k] = heap_s[i].idx;
      s_top[k] = heap_s[i].s;
      t_top[k] = heap_s[i].t;
      ++k;
    }
    for (; k < K; ++k) {
      ids_out[k] = -1;
      s_top[k] = t_top[k] = kNegInf;
    }
  }
  RowResult r;
  if (!swapped) {
    r.kl = math::row_finalize(s_top, t_top, K, tail_s, tail_t, div, bucket_out,
                              bucket_out + (K + 1), &r.lse_s, &r.lse_t);
  } else {
    // The heap selected on the student (`t` here): its `t` values are the student's.
    r.kl = math::row_finalize(t_top, s_top, K, tail_t, tail_s, div, bucket_out,
                              bucket_out + (K + 1), &r.lse_s, &r.lse_t);
  }
  return r;
}

// Full-vocabulary row (top_m == 0). W is the weighting side (student for reverse KL, teacher for
// forward KL), O the other one; see FullKLState in the math header.
template <typename TW, typename TO>
RowResult fwd_full_row(const TW* w, const TO* o, int64_t V, float inv) {
  const Vec vinv(inv);
  const Vec vneg(kNegInf);
  const Vec vzero(0.0f);
  math::FullKLState st = math::full_kl_empty();
  int64_t j = 0;
  while (V - j >= kStep) {
    const int64_t blk_end = j + std::min<int64_t>(kBlock, (V - j) / kStep * kStep);
    Vec mx_w(kNegInf), mx_o(kNegInf);
    for (int64_t k = j; k < blk_end; k += kStep) {
      Vec w0, w1, o0, o1;
      load2(w + k, w0, w1);
      load2(o + k, o0, o1);
      mx_w = at::vec::maximum(mx_w, at::vec::maximum(w0 * vinv, w1 * vinv));
      mx_o = at::vec::maximum(mx_o, at::vec::maximum(o0 * vinv, o1 * vinv));
    }
    math::FullKLState part = math::full_kl_empty();
    part.max_w = hmax(mx_w);
    part.max_o = hmax(mx_o);
    const bool w_any = part.max_w != kNegInf;
    const bool o_any = part.max_o != kNegInf;
    if (w_any || o_any) {
      const Vec vbw(w_any ? part.max_w : 0.0f);
      const Vec vbo(o_any ? part.max_o : 0.0f);
      Vec zw(0.0f), zo(0.0f), acc(0.0f);
      for (int64_t k = j; k < blk_end; k += kStep) {
        Vec w0, w1, o0, o1;
        load2(w + k, w0, w1);
        load2(o + k, o0, o1);
        const Vec dw0 = w0 * vinv - vbw;
        const Vec dw1 = w1 * vinv - vbw;
        const Vec do0 = o0 * vinv - vbo;
        const Vec do1 = o1 * vinv - vbo;
        const Vec ew0 = fast_exp(dw0);
        const Vec ew1 = fast_exp(dw1);
        zw = zw + ew0 + ew1;
        zo = zo + fast_exp(do0) + fast_exp(do1);
        // Entries without weighting mass contribute 0, not 0 * (-inf - x).
        acc = acc + Vec::blendv(ew0 * (dw0 - do0), vzero, dw0 == vneg) +
              Vec::blendv(ew1 * (dw1 - do1), vzero, dw1 == vneg);
      }
      part.sum_w = w_any ? hsum(zw) : 0.0f;
      part.sum_o = o_any ? hsum(zo) : 0.0f;
      // Weighting mass against an all -inf other side is a true infinite divergence.
      part.a = w_any ? (o_any ? hsum(acc) : std::numeric_limits<float>::infinity()) : 0.0f;
      math::full_kl_merge(st, part);
    }
    j = blk_end;
  }
  for (; j < V; ++j) {
    math::full_kl_add(st, static_cast<float>(w[j]) * inv, static_cast<float>(o[j]) * inv);
  }
  RowResult r;
  r.kl = math::full_kl_finalize(st, &r.lse_s, &r.lse_t);  // (lse_w, lse_o): caller maps back
  return r;
}

// ---------------------------------------------------------------------------------------------
// Full-vocabulary generalized JSD (docs/math.md, 1b): every entry is its own bucket, and the
// mixture's log needs both normalizers, so the terms take a pass of their own after the
// log-sum-exps. Three fast_exp and one log1p (ATen's SLEEF) per entry.
// ---------------------------------------------------------------------------------------------

// Per lane, for normalized log-probabilities ls, lt: p = S, q = T and lm = log M =
// log((1 - beta) S + beta T) = hi + log1p(exp(lo - hi)) of the two weighted log-masses (NaN
// where both are -inf: every use is masked there).
inline void jsd_lanes(const Vec& ls, const Vec& lt, const Vec& vl1mb, const Vec& vlb, Vec& p,
                      Vec& q, Vec& lm) {
  const Vec a = ls + vl1mb;
  const Vec b = lt + vlb;
  const Vec hi = at::vec::maximum(a, b);
  lm = hi + fast_exp(at::vec::minimum(a, b) - hi).log1p();
  p = fast_exp(ls);
  q = fast_exp(lt);
}

// kp = S (log S - log M), kq = T (log T - log M), 0 for a side without mass.
inline void jsd_lane_parts(const Vec& ls, const Vec& lt, const Vec& vl1mb, const Vec& vlb,
                           Vec& kp, Vec& kq) {
  const Vec vneg(kNegInf), zero(0.0f);
  Vec p, q, lm;
  jsd_lanes(ls, lt, vl1mb, vlb, p, q, lm);
  kp = Vec::blendv(p * (ls - lm), zero, ls == vneg);
  kq = Vec::blendv(q * (lt - lm), zero, lt == vneg);
}

// A log-sum-exp as the shift of the log-probabilities: a row without mass (-inf) gives -inf
// log-probabilities (x - (+inf)), never NaN.
inline float lse_shift(float lse) {
  return lse == kNegInf ? std::numeric_limits<float>::infinity() : lse;
}

// K_P = KL(P || M), K_Q = KL(Q || M) over the vocabulary, given both log-sum-exps.
template <typename TS, typename TT>
void full_jsd_kls(const TS* s, const TT* t, int64_t V, float inv, float lse_s, float lse_t,
                  float beta, float* k_p, float* k_q) {
  const Vec vinv(inv), vls(lse_shift(lse_s)), vlt(lse_shift(lse_t));
  const Vec vl1mb(std::log1p(-beta)), vlb(std::log(beta));
  double kp_total = 0.0, kq_total = 0.0;
  int64_t j = 0;
  while (V - j >= kStep) {
    const int64_t blk_end = j + std::min<int64_t>(kBlock, (V - j) / kStep * kStep);
    Vec acc_p(0.0f), acc_q(0.0f);
    for (int64_t k = j; k < blk_end; k += kStep) {
      Vec s0, s1, t0, t1, kp, kq;
      load2(s + k, s0, s1);
      load2(t + k, t0, t1);
      jsd_lane_parts(s0 * vinv - vls, t0 * vinv - vlt, vl1mb, vlb, kp, kq);
      acc_p = acc_p + kp;
      acc_q = acc_q + kq;
      jsd_lane_parts(s1 * vinv - vls, t1 * vinv - vlt, vl1mb, vlb, kp, kq);
      acc_p = acc_p + kp;
      acc_q = acc_q + kq;
    }
    kp_total += hsum(acc_p);
    kq_total += hsum(acc_q);
    j = blk_end;
  }
  for (; j < V; ++j) {
    const float ls = math::log_normalize(static_cast<float>(s[j]) * inv, lse_s);
    const float lt = math::log_normalize(static_cast<float>(t[j]) * inv, lse_t);
    const float lm = math::jsd_log_mixture(ls, lt, beta);
    kp_total += math::kl_to_mixture_term(ls, lm);
    kq_total += math::kl_to_mixture_term(lt, lm);
  }
  *k_p = static_cast<float>(kp_total);
  *k_q = static_cast<float>(kq_total);
}

// Full-vocabulary JSD forward row: the log-sum-exps (fwd_full_row's pass; its KL discarded),
// then the terms.
template <typename TS, typename TT>
RowResult fwd_full_jsd_row(const TS* s, const TT* t, int64_t V, float inv, float beta) {
  RowResult r = fwd_full_row(s, t, V, inv);  // (lse_w, lse_o) = (lse_s, lse_t)
  float k_p, k_q;
  full_jsd_kls(s, t, V, inv, r.lse_s, r.lse_t, beta, &k_p, &k_q);
  r.kl = beta * k_q + (1.0f - beta) * k_p;
  return r;
}

template <typename TS, typename TT>
void fwd_impl(const TopKTailKLFwdArgs& a) {
  const int64_t N = a.n_rows;
  const int64_t V = a.vocab;
  const int64_t M = a.top_m;
  const int64_t K = a.width;
  const bool two_heaps = a.support == math::kSupportUnion;
  const bool on_student = a.support == math::kSupportStudent;
  const TS* s_base = a.student.data_ptr<TS>();
  const TT* t_base = a.teacher.data_ptr<TT>();
  const int64_t* target = a.target.data_ptr<int64_t>();
  float* kl = a.kl.data_ptr<float>();
  float* slp = a.student_logprob.data_ptr<float>();
  float* tlp = a.teacher_logprob.data_ptr<float>();
  int64_t* ids = a.topk_ids.data_ptr<int64_t>();
  float* lse = a.lse.data_ptr<float>();
  float* bucket = a.bucket_logp.data_ptr<float>();
  const float inv = a.inv_temperature;
  // Enough rows per task that small vocabularies do not drown in scheduling overhead.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    FwdScratch scr(M, K, two_heaps);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t tgt = target[n];
      int64_t* ids_n = ids + n * K;
      float* bucket_n = bucket + n * 2 * (K + 1);
      if (tgt == a.ignore_index) {
        kl[n] = slp[n] = tlp[n] = 0.0f;
        lse[2 * n] = lse[2 * n + 1] = 0.0f;
        std::fill(ids_n, ids_n + K, int64_t{0});
        std::fill(bucket_n, bucket_n + 2 * (K + 1), 0.0f);
        continue;
      }
      const TS* s = s_base + a.s_layout.offset(n);
      const TT* t = t_base + a.t_layout.offset(n);
      RowResult r;
      if (M > 0 && two_heaps) {
        r = fwd_topk_row<true>(s, t, V, M, inv, a.div, false, scr, ids_n, bucket_n);
      } else if (M > 0 && on_student) {
        // The same pass selecting on the student row: the rows' roles swap.
        r = fwd_topk_row<false>(t, s, V, M, inv, a.div, true, scr, ids_n, bucket_n);
      } else if (M > 0) {
        r = fwd_topk_row<false>(s, t, V, M, inv, a.div, false, scr, ids_n, bucket_n);
      } else if (a.div.kind == math::kJsd) {
        r = fwd_full_jsd_row(s, t, V, inv, a.div.beta);
      } else if (a.div.kind == math::kReverse) {
        r = fwd_full_row(s, t, V, inv);
      } else {
        r = fwd_full_row(t, s, V, inv);
        std::swap(r.lse_s, r.lse_t);
      }
      if (M == 0) {
        // Full-vocabulary mode: the single "bucket" is the whole vocabulary, of mass 1 (log 0)
        // on both sides. The backward does not read it.
        bucket_n[0] = bucket_n[1] = 0.0f;
      }
      kl[n] = r.kl;
      lse[2 * n] = r.lse_s;
      lse[2 * n + 1] = r.lse_t;
      slp[n] = math::log_normalize(static_cast<float>(s[tgt]) * inv, r.lse_s);
      tlp[n] = math::log_normalize(static_cast<float>(t[tgt]) * inv, r.lse_t);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

// One side's gradient row. k[i] is bucket i's factor (k[M]: the tail; M here is K, the width of
// ids), tail_lse the log-sum-exp of that side's tail logits. Streams grad[j] = exp(x[j] / T -
// tail_lse) * k[M] / T (the tail formula) over the whole row, then rewrites the selected entries
// (share 1: no logit read; a -1 slot, a union's padding, is skipped) and the target.
template <typename T>
void bwd_topk_side(const T* x, T* g, int64_t V, int64_t M, const int64_t* ids, const float* k,
                   float tail_lse, float u_lp, int64_t tgt, float inv) {
  const float kt = k[M] * inv;
  // exp(x / T - tail_lse) = 2^(x log2(e) / T - tail_lse log2(e)): one FMA and fast_exp2. The
  // offset is split hi + lo (lo from the double product) so that its float rounding does not
  // bias every share; tail_lse = +inf (a tail without mass) gives -inf exponents, shares 0.
  const double lse2 = static_cast<double>(tail_lse) * 1.44269504088896341;
  const float lse2_hi = static_cast<float>(lse2);
  const float lse2_lo = std::isfinite(lse2) ? static_cast<float>(lse2 - lse2_hi) : 0.0f;
  const Vec vc2(inv * kLog2e), vhi(lse2_hi), vlo(lse2_lo), vk(kt);
  int64_t j = 0;
  for (; V - j >= kStep; j += kStep) {
    Vec x0, x1;
    load2(x + j, x0, x1);
    // Selected entries may exceed tail_lse here (share > 1, even inf): they are rewritten below.
    store2(g + j, fast_exp2(at::vec::fmsub(x0, vc2, vhi) - vlo) * vk,
           fast_exp2(at::vec::fmsub(x1, vc2, vhi) - vlo) * vk);
  }
  for (; j < V; ++j) {
    g[j] = static_cast<T>(std::exp(static_cast<float>(x[j]) * inv - tail_lse) * kt);
  }
  bool target_selected = false;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t id = ids[i];
    if (id < 0) continue;
    g[id] = static_cast<T>(math::entry_grad(1.0f, k[i], u_lp, id == tgt, inv));
    target_selected |= id == tgt;
  }
  if (!target_selected) {
    const float share = std::exp(static_cast<float>(x[tgt]) * inv - tail_lse);
    g[tgt] = static_cast<T>(math::entry_grad(share, k[M], u_lp, true, inv));
  }
}

// Full-vocabulary backward: every entry is its own bucket (share 1), so both sides need both
// logits; the factors are those of math::bucket_grad_factors with P = S_j, Q = T_j.
template <typename TS, typename TT>
void bwd_full_row(const TS* s, const TT* t, TS* gs, TT* gt, int64_t V, float lse_s, float lse_t,
                  float kl, bool reverse, float u_kl, float u_ls, float u_lt, int64_t tgt,
                  float inv) {
  const Vec vinv(inv), vlse_s(lse_s), vlse_t(lse_t), vkl(kl), vukl(u_kl), vuls(u_ls), vult(u_lt);
  const Vec vneg(kNegInf), vzero(0.0f);
  auto grads = [&](const Vec& ls, const Vec& lt, Vec& out_s, Vec& out_t) {
    const Vec p = fast_exp(ls);
    const Vec q = fast_exp(lt);
    Vec ks, kt;
    if (reverse) {
      ks = Vec::blendv(p * (vukl * ((ls - lt) - vkl) - vuls), vzero, ls == vneg);
      kt = q * (vukl - vult) - vukl * p;
    } else {
      ks = p * (vukl - vuls) - vukl * q;
      kt = Vec::blendv(q * (vukl * ((lt - ls) - vkl) - vult), vzero, lt == vneg);
    }
    out_s = ks * vinv;
    out_t = kt * vinv;
  };
  int64_t j = 0;
  for (; V - j >= kStep; j += kStep) {
    Vec s0, s1, t0, t1, gs0, gs1, gt0, gt1;
    load2(s + j, s0, s1);
    load2(t + j, t0, t1);
    grads(s0 * vinv - vlse_s, t0 * vinv - vlse_t, gs0, gt0);
    grads(s1 * vinv - vlse_s, t1 * vinv - vlse_t, gs1, gt1);
    if (gs != nullptr) store2(gs + j, gs0, gs1);
    if (gt != nullptr) store2(gt + j, gt0, gt1);
  }
  auto scalar = [&](int64_t i, bool is_target) {
    const float ls = math::log_normalize(static_cast<float>(s[i]) * inv, lse_s);
    const float lt = math::log_normalize(static_cast<float>(t[i]) * inv, lse_t);
    float ks, kt;
    math::bucket_grad_factors(ls, lt, kl, reverse, u_kl, u_ls, u_lt, &ks, &kt);
    if (gs != nullptr) gs[i] = static_cast<TS>(math::entry_grad(1.0f, ks, u_ls, is_target, inv));
    if (gt != nullptr) gt[i] = static_cast<TT>(math::entry_grad(1.0f, kt, u_lt, is_target, inv));
  };
  for (; j < V; ++j) scalar(j, false);
  scalar(tgt, true);
}

// Full-vocabulary JSD backward: K_P and K_Q first (a pass), then the gradients (another).
template <typename TS, typename TT>
void bwd_full_jsd_row(const TS* s, const TT* t, TS* gs, TT* gt, int64_t V, float lse_s,
                      float lse_t, float beta, float u_kl, float u_ls, float u_lt, int64_t tgt,
                      float inv) {
  float k_p, k_q;
  full_jsd_kls(s, t, V, inv, lse_s, lse_t, beta, &k_p, &k_q);
  const Vec vinv(inv), vls(lse_shift(lse_s)), vlt(lse_shift(lse_t));
  const Vec vl1mb(std::log1p(-beta)), vlb(std::log(beta)), vneg(kNegInf), vzero(0.0f);
  // k_s = S (u_kl (1 - beta) (log S - log M - K_P) - u_ls), k_t alike (bucket_grad_factors_jsd).
  const Vec vas(u_kl * (1.0f - beta)), vat(u_kl * beta), vkp(k_p), vkq(k_q);
  const Vec vuls(u_ls), vult(u_lt);
  auto grads = [&](const Vec& ls, const Vec& lt, Vec& out_s, Vec& out_t) {
    Vec p, q, lm;
    jsd_lanes(ls, lt, vl1mb, vlb, p, q, lm);
    const Vec ks = Vec::blendv(p * (vas * ((ls - lm) - vkp) - vuls), vzero, ls == vneg);
    const Vec kt = Vec::blendv(q * (vat * ((lt - lm) - vkq) - vult), vzero, lt == vneg);
    out_s = ks * vinv;
    out_t = kt * vinv;
  };
  int64_t j = 0;
  for (; V - j >= kStep; j += kStep) {
    Vec s0, s1, t0, t1, gs0, gs1, gt0, gt1;
    load2(s + j, s0, s1);
    load2(t + j, t0, t1);
    grads(s0 * vinv - vls, t0 * vinv - vlt, gs0, gt0);
    grads(s1 * vinv - vls, t1 * vinv - vlt, gs1, gt1);
    if (gs != nullptr) store2(gs + j, gs0, gs1);
    if (gt != nullptr) store2(gt + j, gt0, gt1);
  }
  auto scalar = [&](int64_t i, bool is_target) {
    const float ls = math::log_normalize(static_cast<float>(s[i]) * inv, lse_s);
    const float lt = math::log_normalize(static_cast<float>(t[i]) * inv, lse_t);
    float ks, kt;
    math::bucket_grad_factors_jsd(ls, lt, beta, k_p, k_q, u_kl, u_ls, u_lt, &ks, &kt);
    if (gs != nullptr) gs[i] = static_cast<TS>(math::entry_grad(1.0f, ks, u_ls, is_target, inv));
    if (gt != nullptr) gt[i] = static_cast<TT>(math::entry_grad(1.0f, kt, u_lt, is_target, inv));
  };
  for (; j < V; ++j) scalar(j, false);
  scalar(tgt, true);
}

template <typename TS, typename TT>
void bwd_impl(const TopKTailKLBwdArgs& a) {
  const int64_t N = a.n_rows;
  const int64_t V = a.vocab;
  const int64_t M = a.topk_ids.size(1);  // K: M, or 2M for a union
  const TS* s_base = a.student.data_ptr<TS>();
  const TT* t_base = a.teacher.data_ptr<TT>();
  TS* gs_base = a.grad_student.defined() ? a.grad_student.data_ptr<TS>() : nullptr;
  TT* gt_base = a.grad_teacher.defined() ? a.grad_teacher.data_ptr<TT>() : nullptr;
  const int64_t* target = a.target.data_ptr<int64_t>();
  const int64_t* ids = a.topk_ids.data_ptr<int64_t>();
  const float* g_kl = a.grad_kl.data_ptr<float>();
  const float* g_ls = a.grad_student_logprob.data_ptr<float>();
  const float* g_lt = a.grad_teacher_logprob.data_ptr<float>();
  const float* kl = a.kl.data_ptr<float>();
  const float* lse = a.lse.data_ptr<float>();
  const float* bucket = a.bucket_logp.data_ptr<float>();
  const float inv = a.inv_temperature;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(M + 1), kt(M + 1);
    for (int64_t n = begin; n < end; ++n) {
      TS* gs = gs_base != nullptr ? gs_base + n * V : nullptr;
      TT* gt = gt_base != nullptr ? gt_base + n * V : nullptr;
      const int64_t tgt = target[n];
      if (tgt == a.ignore_index) {
        // Ignored rows: zero gradient, and the logits are never read.
        if (gs != nullptr) std::memset(static_cast<void*>(gs), 0, sizeof(TS) * V);
        if (gt != nullptr) std::memset(static_cast<void*>(gt), 0, sizeof(TT) * V);
        continue;
      }
      const TS* s = s_base + a.s_layout.offset(n);
      const TT* t = t_base + a.t_layout.offset(n);
      const float lse_s = lse[2 * n];
      const float lse_t = lse[2 * n + 1];
      if (M == 0 && a.div.kind == math::kJsd) {
        bwd_full_jsd_row(s, t, gs, gt, V, lse_s, lse_t, a.div.beta, g_kl[n], g_ls[n], g_lt[n],
                         tgt, inv);
        continue;
      }
      if (M == 0) {
        bwd_full_row(s, t, gs, gt, V, lse_s, lse_t, kl[n], a.div.kind == math::kReverse,
                     g_kl[n], g_ls[n], g_lt[n], tgt, inv);
        continue;
      }
      const float* logp = bucket + n * 2 * (M + 1);
      const float* logq = logp + (M + 1);
      // The JSD's factors need KL(P || M) and KL(Q || M) of the row: O(K) from the buckets.
      float k_p = 0.0f, k_q = 0.0f;
      if (a.div.kind == math::kJsd) {
        math::jsd_mixture_kls(logp, logq, M + 1, a.div.beta, &k_p, &k_q);
      }
      for (int64_t b = 0; b <= M; ++b) {
        math::bucket_grad_factors_div(logp[b], logq[b], kl[n], a.div, k_p, k_q, g_kl[n], g_ls[n],
                                      g_lt[n], &ks[b], &kt[b]);
      }
      const int64_t* ids_n = ids + n * M;
      const float tail_s = math::bucket_lse(lse_s, logp[M]);
      const float tail_t = math::bucket_lse(lse_t, logq[M]);
      if (gs != nullptr) bwd_topk_side(s, gs, V, M, ids_n, ks.data(), tail_s, g_ls[n], tgt, inv);
      if (gt != nullptr) bwd_topk_side(t, gt, V, M, ids_n, kt.data(), tail_t, g_lt[n], tgt, inv);
    }
  });
}

// Instantiates F<TS, TT> for the (student, teacher) dtype pair.
#define LOPD_DISPATCH_PAIR(S_DTYPE, T_DTYPE, NAME, F, ARGS)                                      \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, S_DTYPE, NAME, [&] {                 \
    using TS_ = scalar_t;                                                                        \
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, T_DTYPE, NAME, [&] {               \
      if constexpr (std::is_same_v<TS_, double> || std::is_same_v<scalar_t, double>) {           \
        TORCH_CHECK(false, NAME, ": float64 logits are not supported by the C++ kernel");        \
      } else {                                                                                   \
        F<TS_, scalar_t>(ARGS);                                                                  \
      }                                                                                          \
    });                                                                                          \
  })

}  // namespace

void topk_tail_kl_fwd_kernel(const TopKTailKLFwdArgs& args) {
  LOPD_DISPATCH_PAIR(args.student.scalar_type(), args.teacher.scalar_type(), "topk_tail_kl_fwd",
                     fwd_impl, args);
}

void topk_tail_kl_bwd_kernel(const TopKTailKLBwdArgs& args) {
  LOPD_DISPATCH_PAIR(args.student.scalar_type(), args.teacher.scalar_type(), "topk_tail_kl_bwd",
                     bwd_impl, args);
}

}  // namespace lopd::cpu::CPU_CAPABILITY
