// The base-2 CUDA forward of lopd::topk_tail_kl_cuda_fwd ("base2" of the kernel choice
// topk_tail_kl.cuda_forward, lopd_kernels/kernel_variants.py; "natural_exp" is
// topk_tail_kl_fwd_kernel in topk_tail_kl_kernels.cuh, whose helpers and selection scheme this
// kernel shares). Same outputs, same block-per-row layout and candidate buffer; the per-entry
// work differs:
//
//   * base 2 throughout: 2^(x log2(e) / T - m) by one FFMA and one MUFU.EX2 (simt::fast_exp2,
//     2 ulp), where natural_exp runs a branchy lse_add per entry and side (compare, branch,
//     accurate expf, FMA);
//   * branch-free tails: each thread keeps (max, sum) per side, raised once per chunk of 8
//     entries (the chunk's max, one rescale exp2, skipped when the max did not move) rather than
//     per entry; the 8 terms are summed pairwise; admitted candidates are masked to -inf, which
//     adds exactly 0;
//   * the admission test: the raw teacher logit against the threshold's value scaled back by T
//     and lowered by a margin (one FSETP per entry, no multiply), one branch per chunk; only the
//     rare chunk with an entry above it scales the logit and builds the exact 64-bit key;
//   * double-buffered tiles: the next tile's 8 + 8 entries are loaded (raw, unconverted: 16
//     bytes per row for bf16 / fp16) before the current one is processed; the tile loop is
//     unrolled by two, so no register copies;
//   * full tiles take a path without bounds checks and with 32-bit offsets; a row's last,
//     partial tile is processed after the loop, with them;
//   * the compaction (sort of the candidate buffer, folding of the dropped keys in chunks of 8)
//     is a call, not inlined: rare, and inlined it raised the main loop's registers into spills;
//   * the full-vocabulary mode (top_m == 0) is a kernel of its own with the same base-2 chunked
//     state for KL = A / Z_w - log Z_w + log Z_o (math::FullKLState's terms): two exp2 per entry
//     plus up to two per chunk of 8, where natural_exp merges a one-entry state per entry (eight
//     expf).
// Everything the row's finalization needs is converted back to natural logarithms once, at the
// end, in double (topk_row_finalize of csrc/common/topk_tail_kl_math.h, shared with natural_exp
// and the CPU kernel). Compiled code: tools/kernel_report.py (registers, barriers, instructions
// per vocabulary entry).
#pragma once

#include <cfloat>
#include <type_traits>

#include "cuda/topk_tail_kl_kernels.cuh"

namespace lopd::cuda {
namespace {

using ::lopd::simt::fast_exp2;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// A running max before any mass: finite, so that (max - new max) is never inf - inf; every
// real (scaled) logit is >= it, and -inf entries add 2^-inf = 0 against it.
constexpr float kNoMass = -FLT_MAX;

// 8 consecutive entries of one logit row as loaded, unconverted (16 bytes for 16-bit logits,
// 32 for fp32): the double buffer holds the next tile in this form, half the registers of
// fp32 for bf16 / fp16, and the conversion happens when the tile is processed.
template <typename T>
struct alignas(16) Raw8 {
  T v[kVec];
};

// Loads p[0..8) (vectorized when `aligned`), or entries up to `valid` and -inf after them (past
// the row: no mass, never admitted where the caller checks bounds).
template <typename T>
__device__ __forceinline__ void load_raw8(const T* p, int valid, bool aligned, Raw8<T>& out) {
  if (aligned && valid == kVec) {
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<float4*>(out.v)[0] = reinterpret_cast<const float4*>(p)[0];
      reinterpret_cast<float4*>(out.v)[1] = reinterpret_cast<const float4*>(p)[1];
    } else {
      *reinterpret_cast<uint4*>(out.v) = *reinterpret_cast<const uint4*>(p);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) out.v[i] = i < valid ? p[i] : from_float<T>(-INFINITY);
}

template <typename T>
__device__ __forceinline__ void to_floats(const Raw8<T>& raw, float (&out)[kVec]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // A bf16 is the top half of a float: one instruction per entry (a shift for the low half of
    // each 32-bit word, a mask for the high half), where the generic conversion spends two on
    // every other entry.
    const uint32_t* w = reinterpret_cast<const uint32_t*>(raw.v);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = to_float(raw.v[i]);
  }
}

// An online sum of 2^y in base 2: sum is relative to max (log2 units).
struct Lse2 {
  float max;
  float sum;
};

__device__ __forceinline__ Lse2 lse2_empty() { return Lse2{kNoMass, 0.0f}; }

// The factor 2^d (d <= 0) that re-expresses a sum relative to a max raised by -d: exactly 1 when
// the max did not move (the common case), so that no approximation error compounds over the
// rescales of a row.
__device__ __forceinline__ float rescale(float d) { return d == 0.0f ? 1.0f : fast_exp2(d); }

__device__ __forceinline__ void lse2_merge(Lse2& st, float o_max, float o_sum) {
  const float m = fmaxf(st.max, o_max);
  st.sum = st.sum * rescale(st.max - m) + o_sum * rescale(o_max - m);
  st.max = m;
}

// Pairwise sum of K (a power of two) values: half the rounding error of a running sum and no
// chain of dependent adds behind the exponentials.
template <int K>
__device__ __forceinline__ float tree_sum(float (&e)[K]) {
  static_assert((K & (K - 1)) == 0, "K must be a power of two");
#pragma unroll
  for (int w = K / 2; w > 0; w /= 2) {
#pragma unroll
    for (int i = 0; i < w; ++i) e[i] += e[i + w];
  }
  return e[0];
}

// Adds K values y (log2 units; -inf adds nothing) whose max is y_max: one rescale in all.
template <int K>
__device__ __forceinline__ void lse2_add_values(Lse2& st, const float (&y)[K], float y_max) {
  const float m = fmaxf(st.max, y_max);
  float e[K];
#pragma unroll
  for (int i = 0; i < K; ++i) e[i] = fast_exp2(y[i] - m);
  st.sum = st.sum * rescale(st.max - m) + tree_sum(e);
  st.max = m;
}

// Adds a chunk of raw logits x (scaled by c2 = log2(e) / T; -inf entries add 0) whose largest
// raw value is x_max: one rescale of the running sum per chunk, one FFMA + MUFU per entry.
__device__ __forceinline__ void lse2_add_chunk(Lse2& st, const float (&x)[kVec], float x_max,
                                               float c2) {
  const float m = fmaxf(st.max, x_max * c2);
  float e[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = fast_exp2(fmaf(x[i], c2, -m));  // -inf: 2^-inf = 0
  st.sum = st.sum * rescale(st.max - m) + tree_sum(e);
  st.max = m;
}

// The same mass as a natural-log state (max, sum), for topk_row_finalize; empty stays empty.
// The max is the base-2 max in natural units, rounded, and the sum is shifted by that rounding
// in double (once per row and side), so the sum keeps its magnitude: topk_row_finalize adds the
// top-M terms to it, and a sum of 1 (the state (lse, 1)) would round each small term at the
// coarsest relative step of its binade (a sorted row lost 2.5e-6 of its log-sum-exp that way).
__device__ __forceinline__ math::LseState lse2_to_natural(const Lse2& st) {
  if (!(st.sum > 0.0f)) return st.sum == 0.0f ? math::lse_empty() : math::LseState{NAN, 1.0f};
  const double max_nat = double(st.max) * 0.6931471805599453;
  const float m = static_cast<float>(max_nat);
  return math::LseState{m, static_cast<float>(double(st.sum) * exp(max_nat - double(m)))};
}

// log of a state's total mass, natural units (-inf when empty).
__device__ __forceinline__ float lse2_value(const Lse2& st) {
  return math::lse_value(lse2_to_natural(st));
}

// Merges every thread's state; the result is valid in all threads.
__device__ Lse2 block_merge2(Lse2 st, float2* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, st.max, off);
    const float os = __shfl_xor_sync(0xffffffffu, st.sum, off);
    lse2_merge(st, om, os);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = make_float2(st.max, st.sum);
  __syncthreads();
  Lse2 all = lse2_empty();
  for (int w = 0; w < kThreads / 32; ++w) lse2_merge(all, scratch[w].x, scratch[w].y);
  __syncthreads();
  return all;
}

// ---- row outputs -----------------------------------------------------------------------------------

// Writes an ignored row's outputs (all 0; its logits are never read) and returns true, or
// returns false for a row to compute. Called by the whole block. (natural_exp keeps its own copies of this
// and the next two steps: it is the previous kernel, unchanged for the GPU comparison.)
__device__ __forceinline__ bool write_ignored_row(const FwdParams& p, int64_t row, int64_t tgt) {
  if (tgt != p.ignore_index) return false;
  const int64_t K = p.width;
  float* bucket = p.bucket + row * 2 * (K + 1);
  for (int64_t i = threadIdx.x; i < 2 * (K + 1); i += blockDim.x) bucket[i] = 0.0f;
  for (int64_t i = threadIdx.x; i < K; i += blockDim.x) p.ids[row * K + i] = 0;
  if (threadIdx.x == 0) {
    p.kl[row] = p.slp[row] = p.tlp[row] = 0.0f;
    p.lse[2 * row] = p.lse[2 * row + 1] = 0.0f;
  }
  return true;
}

// A row's divergence, log-sum-exps and the target's log-probabilities (one thread).
template <typename TS, typename TT>
__device__ __forceinline__ void write_row(const FwdParams& p, int64_t row, int64_t tgt,
                                          const TS* s, const TT* t, float kl, float lse_s,
                                          float lse_t) {
  p.kl[row] = kl;
  p.lse[2 * row] = lse_s;
  p.lse[2 * row + 1] = lse_t;
  write_target_logprobs(p, row, tgt, s, t, lse_s, lse_t);
}

// The end of a top-M row: keys[0..M) are the selected entries, best first; tail_s / tail_t the
// block's merged tails (natural logarithms), all in the kernel's roles (FwdParams::swapped).
// Writes the ids, then (thread 0) the buckets and the row's outputs (finalize_topm_row). The
// selection's scaled logits go to the (now free) upper part of the key buffer, reinterpreted as
// floats. Called by the whole block.
template <typename TS, typename TT>
__device__ __forceinline__ void finish_topm_row(uint64_t* keys, const TS* s, const TT* t,
                                                const math::LseState& tail_s,
                                                const math::LseState& tail_t, const FwdParams& p,
                                                int64_t row, int64_t tgt) {
  const int64_t M = p.top_m;
  float* s_top = reinterpret_cast<float*>(keys + kBufCap / 2);
  float* t_top = s_top + M;
  for (int64_t i = threadIdx.x; i < M; i += blockDim.x) {
    const int64_t idx = key_index(keys[i]);
    p.ids[row * M + i] = idx;
    t_top[i] = key_value(keys[i]);
    s_top[i] = to_float(s[idx]) * p.inv;
  }
  __syncthreads();
  if (threadIdx.x == 0) finalize_topm_row(p, row, tgt, s, t, s_top, t_top, tail_s, tail_t);
}

// ---- full vocabulary -----------------------------------------------------------------------------

// math::FullKLState in base 2: Z relative to the maxima, A2 = sum_j 2^(w_j - m_w)
// ((w_j - m_w) - (o_j - m_o)) with w, o, m in log2 units (A of the natural state is A2 ln 2).
struct Full2 {
  float max_w, sum_w, max_o, sum_o, a;
};

__device__ __forceinline__ Full2 full2_empty() { return Full2{kNoMass, 0.0f, kNoMass, 0.0f, 0.0f}; }

// Re-expresses st relative to new maxima (>= its own). An infinite A (weighting mass against an
// other side without mass) stays infinite whatever the shift.
__device__ __forceinline__ void full2_rebase(Full2& st, float max_w, float max_o) {
  const float d_w = st.max_w - max_w;
  const float d_o = st.max_o - max_o;
  const float r = rescale(d_w);
  st.a = st.a == INFINITY ? INFINITY : r * (st.a + st.sum_w * (d_w - d_o));
  st.sum_w *= r;
  st.sum_o *= rescale(d_o);
  st.max_w = max_w;
  st.max_o = max_o;
}

__device__ __forceinline__ void full2_merge(Full2& st, Full2 part) {
  const float mw = fmaxf(st.max_w, part.max_w);
  const float mo = fmaxf(st.max_o, part.max_o);
  full2_rebase(st, mw, mo);
  full2_rebase(part, mw, mo);
  st.sum_w += part.sum_w;
  st.sum_o += part.sum_o;
  st.a += part.a;
}

// Adds a chunk of raw weighting-side logits w and other-side logits o.
__device__ __forceinline__ void full2_add_chunk(Full2& st, const float (&w)[kVec],
                                                const float (&o)[kVec], float c2) {
  float w_max = w[0], o_max = o[0];
#pragma unroll
  for (int i = 1; i < kVec; ++i) {
    w_max = fmaxf(w_max, w[i]);
    o_max = fmaxf(o_max, o[i]);
  }
  full2_rebase(st, fmaxf(st.max_w, w_max * c2), fmaxf(st.max_o, o_max * c2));
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float yw = fmaf(w[i], c2, -st.max_w);
    const float yo = fmaf(o[i], c2, -st.max_o);
    const float ew = fast_exp2(yw);
    st.sum_w += ew;
    st.sum_o += fast_exp2(yo);
    // No weighting mass: exactly 0 (not 0 * inf); mass against none: +inf, also when ew
    // underflowed.
    st.a += w[i] == -INFINITY ? 0.0f : (o[i] == -INFINITY ? INFINITY : ew * (yw - yo));
  }
}

__device__ Full2 block_merge_full2(Full2 st, Full2* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Full2 other;
    other.max_w = __shfl_xor_sync(0xffffffffu, st.max_w, off);
    other.sum_w = __shfl_xor_sync(0xffffffffu, st.sum_w, off);
    other.max_o = __shfl_xor_sync(0xffffffffu, st.max_o, off);
    other.sum_o = __shfl_xor_sync(0xffffffffu, st.sum_o, off);
    other.a = __shfl_xor_sync(0xffffffffu, st.a, off);
    full2_merge(st, other);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = st;
  __syncthreads();
  Full2 all = full2_empty();
  for (int w = 0; w < kThreads / 32; ++w) full2_merge(all, scratch[w]);
  __syncthreads();
  return all;
}

// One full-vocabulary row, one streaming pass (double-buffered); thread 0 writes the outputs.
template <typename TS, typename TT>
__device__ void fwd_full_row_base2(const TS* s, const TT* t, bool aligned, const FwdParams& p,
                                int64_t row, int64_t tgt, float* bucket) {
  __shared__ Full2 scratch[kThreads / 32];
  const int64_t V = p.vocab;
  const float c2 = p.inv * kLog2e;
  const bool reverse = p.div.kind == math::kReverse;
  Full2 st = full2_empty();
  Raw8<TS> sa, sb;
  Raw8<TT> ta, tb;
  auto load = [&](int64_t tile, Raw8<TS>& sv, Raw8<TT>& tv) {
    const int64_t base = tile + int64_t(threadIdx.x) * kVec;
    const int valid = base < V ? valid_in(V, base) : 0;  // past the row: all -inf (no mass)
    load_raw8(s + base, valid, aligned, sv);
    load_raw8(t + base, valid, aligned, tv);
  };
  // Entries past the row load as -inf on both sides (without touching memory) and add exactly
  // nothing, so every thread processes every tile, and the loop runs over pairs of tiles, without
  // bounds checks.
  auto step = [&](int64_t tile, const Raw8<TS>& s_raw, const Raw8<TT>& t_raw, Raw8<TS>& sn,
                  Raw8<TT>& tn) {
    load(tile + kTile, sn, tn);
    float sv[kVec], tv[kVec];
    to_floats(s_raw, sv);
    to_floats(t_raw, tv);
    if (reverse) {
      full2_add_chunk(st, sv, tv, c2);
    } else {
      full2_add_chunk(st, tv, sv, c2);
    }
  };
  load(0, sa, ta);
  for (int64_t tile = 0; tile < V; tile += 2 * kTile) {
    step(tile, sa, ta, sb, tb);
    step(tile + kTile, sb, tb, sa, ta);
  }
  st = block_merge_full2(st, scratch);
  if (threadIdx.x != 0) return;
  const float lse_w = lse2_value(Lse2{st.max_w, st.sum_w});
  const float lse_o = lse2_value(Lse2{st.max_o, st.sum_o});
  float kl;
  if (st.sum_w == 0.0f) {
    kl = 0.0f;  // no weighting mass
  } else if (st.sum_o == 0.0f || st.a == INFINITY) {
    kl = INFINITY;
  } else {
    kl = st.a / st.sum_w * kLn2 - logf(st.sum_w) + logf(st.sum_o);
  }
  bucket[0] = bucket[1] = 0.0f;  // the single "bucket" has mass 1 on both sides
  write_row(p, row, tgt, s, t, kl, reverse ? lse_w : lse_o, reverse ? lse_o : lse_w);
}

struct Tails2 {
  Lse2 s, t;
};

// As natural_exp's compaction: sorts the candidate buffer, keeps the best M, folds the rest into this
// thread's tails (the dropped student logits re-read from global memory: a handful per row once
// the threshold has settled), and raises the threshold once M keys are kept. Called by the whole
// block. Each thread folds its (at most kBufCap / kThreads) dropped keys in chunks of 8 per side,
// one rescale each: on a sorted row, where every key is dropped in order, a rescale per key would
// compound the approximate exp2's error over thousands of steps. Not inlined: it is rare, and
// inlined (twice, in the unrolled tile loop) its sort raised the main loop's register pressure.
template <typename TS>
__device__ __noinline__ Tails2 compact_base2(uint64_t* keys, int* count, uint64_t* threshold,
                                          int64_t M, const TS* s, float c2, Tails2 tails) {
  const int n = *count;
  block_sort_desc(keys, n);
  constexpr int kPer = kBufCap / kThreads;
  static_assert(kPer % kVec == 0 && kPer * kThreads >= kBufCap, "every dropped key has a thread");
#pragma unroll
  for (int c = 0; c < kPer; c += kVec) {
    float ys[kVec], yt[kVec];
    float ms = -INFINITY, mt = -INFINITY;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int i = int(M) + int(threadIdx.x) + (c + j) * kThreads;
      const uint64_t k = i < n ? keys[i] : 0;
      yt[j] = i < n ? key_value(k) * kLog2e : -INFINITY;
      ys[j] = i < n ? to_float(s[key_index(k)]) * c2 : -INFINITY;
      mt = fmaxf(mt, yt[j]);
      ms = fmaxf(ms, ys[j]);
    }
    lse2_add_values(tails.t, yt, mt);
    lse2_add_values(tails.s, ys, ms);
  }
  __syncthreads();
  if (threadIdx.x == 0 && n >= M) {
    *count = int(M);
    *threshold = keys[M - 1];
  }
  __syncthreads();
  return tails;
}

// The union's compaction (support="union"; the rule: natural_exp's compact_union in
// topk_tail_kl_kernels.cuh): both buffers sorted, each keeps its best M, and a dropped key joins
// the tails, in chunks of 8 per side as in compact_base2, only when the other selection does not
// hold its entry (the entry's key in the other row, its logit re-read, below that selection's
// threshold: the student's after this compaction for the teacher's dropped keys, the teacher's
// before it for the student's). Not inlined: rare.
template <typename TS, typename TT>
__device__ __noinline__ Tails2 compact_union_base2(uint64_t* keys, uint64_t* keys_s, int* count,
                                                int* count_s, uint64_t* threshold,
                                                uint64_t* threshold_s, int64_t M, const TS* s,
                                                const TT* t, float inv, Tails2 tails) {
  const int n = *count;
  const int n_s = *count_s;
  block_sort_desc(keys, n);
  block_sort_desc(keys_s, n_s);
  const uint64_t thr_t_old = *threshold;
  const uint64_t thr_t_new = n >= M ? keys[M - 1] : thr_t_old;
  const uint64_t thr_s_new = n_s >= M ? keys_s[M - 1] : *threshold_s;
  constexpr int kPer = kBufCap / kThreads;
  static_assert(kPer % kVec == 0 && kPer * kThreads >= kBufCap, "every dropped key has a thread");
#pragma unroll 1
  for (int side = 0; side < 2; ++side) {
    // side 0: the teacher's dropped keys (the other row: the student's); side 1: the student's.
    const uint64_t* buf = side == 0 ? keys : keys_s;
    const int nb = side == 0 ? n : n_s;
    const uint64_t other_thr = side == 0 ? thr_s_new : thr_t_old;
#pragma unroll 1
    for (int c = 0; c < kPer; c += kVec) {
      float y_own[kVec], y_other[kVec];
      float m_own = -INFINITY, m_other = -INFINITY;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int i = int(M) + int(threadIdx.x) + (c + j) * kThreads;
        float own = -INFINITY, other = -INFINITY;
        if (i < nb) {
          const uint64_t k = buf[i];
          const int64_t idx = key_index(k);
          const float x = side == 0 ? to_float(s[idx]) * inv : to_float(t[idx]) * inv;
          if (make_key(x, idx) < other_thr) {
            own = key_value(k);
            other = x;
          }
        }
        y_own[j] = own * kLog2e;
        y_other[j] = other * kLog2e;
        m_own = fmaxf(m_own, y_own[j]);
        m_other = fmaxf(m_other, y_other[j]);
      }
      lse2_add_values(side == 0 ? tails.t : tails.s, y_own, m_own);
      lse2_add_values(side == 0 ? tails.s : tails.t, y_other, m_other);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (n >= M) {
      *count = int(M);
      *threshold = thr_t_new;
    }
    if (n_s >= M) {
      *count_s = int(M);
      *threshold_s = thr_s_new;
    }
  }
  __syncthreads();
  return tails;
}

// Full-vocabulary mode (top_m == 0), a kernel of its own so that its registers do not count
// against the top-M kernel's occupancy. No dynamic shared memory.
template <typename TS, typename TT>
__global__ void __launch_bounds__(kThreads)
    topk_tail_kl_fwd_full_base2_kernel(const TS* __restrict__ student,
                                    const TT* __restrict__ teacher, FwdParams p) {
  const int64_t row = blockIdx.x;
  const int64_t tgt = p.target[row];
  if (write_ignored_row(p, row, tgt)) return;
  const TS* s = student + p.s_layout.offset(row);
  const TT* t = teacher + p.t_layout.offset(row);
  fwd_full_row_base2(s, t, is_aligned16(s) && is_aligned16(t), p, row, tgt, p.bucket + row * 2);
}

// One entry's KL(P || M) and KL(Q || M) terms (natural logarithms) from its log-probabilities
// ls, lt: math::jsd_log_mixture and kl_to_mixture_term with the exponentials on MUFU.EX2
// (fast_exp2) and log1pf for the mixture. l1mb = log(1 - beta), lb = log(beta).
__device__ __forceinline__ void jsd_terms_fast(float ls, float lt, float l1mb, float lb,
                                               float& kp, float& kq) {
  const float a = ls + l1mb;  // log (1 - beta) P_j
  const float b = lt + lb;    // log beta Q_j
  const float hi = fmaxf(a, b);
  // log M_j = hi + log1p(e^(lo - hi)); NaN where both sides are -inf, whose terms are 0 below.
  const float lm = hi + log1pf(fast_exp2((fminf(a, b) - hi) * kLog2e));
  kp += ls == -INFINITY ? 0.0f : fast_exp2(ls * kLog2e) * (ls - lm);
  kq += lt == -INFINITY ? 0.0f : fast_exp2(lt * kLog2e) * (lt - lm);
}

// Full vocabulary with the generalized JSD (top_m == 0, divergence="jsd"), a kernel of its own
// (the KLs' keeps its registers). Its terms need both log-sum-exps, so two passes over the row:
// the log-sum-exps in base 2 (lse2_add_chunk per side: one FFMA + MUFU.EX2 per entry and side),
// then the terms (jsd_terms_fast: three MUFU.EX2 and a log1pf per entry). No dynamic shared
// memory.
template <typename TS, typename TT>
__global__ void __launch_bounds__(kThreads)
    topk_tail_kl_fwd_full_jsd_base2_kernel(const TS* __restrict__ student,
                                        const TT* __restrict__ teacher, FwdParams p) {
  __shared__ float2 scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t tgt = p.target[row];
  if (write_ignored_row(p, row, tgt)) return;
  const TS* s = student + p.s_layout.offset(row);
  const TT* t = teacher + p.t_layout.offset(row);
  const bool aligned = is_aligned16(s) && is_aligned16(t);
  const int64_t V = p.vocab;
  const float inv = p.inv;
  const float c2 = inv * kLog2e;
  auto load = [&](int64_t base, float (&sv)[kVec], float (&tv)[kVec]) {
    const int valid = valid_in(V, base);  // past the row: -inf (no mass, terms 0)
    Raw8<TS> s_raw;
    Raw8<TT> t_raw;
    load_raw8(s + base, valid, aligned, s_raw);
    load_raw8(t + base, valid, aligned, t_raw);
    to_floats(s_raw, sv);
    to_floats(t_raw, tv);
  };
  Lse2 st_s = lse2_empty();
  Lse2 st_t = lse2_empty();
  for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
    float sv[kVec], tv[kVec];
    load(base, sv, tv);
    float ms = sv[0], mt = tv[0];
#pragma unroll
    for (int i = 1; i < kVec; ++i) {
      ms = fmaxf(ms, sv[i]);
      mt = fmaxf(mt, tv[i]);
    }
    lse2_add_chunk(st_s, sv, ms, c2);
    lse2_add_chunk(st_t, tv, mt, c2);
  }
  const float lse_s = lse2_value(block_merge2(st_s, scratch));
  const float lse_t = lse2_value(block_merge2(st_t, scratch));
  const float beta = p.div.beta;
  const float l1mb = log1pf(-beta);
  const float lb = logf(beta);
  float kp = 0.0f, kq = 0.0f;
  for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
    float sv[kVec], tv[kVec];
    load(base, sv, tv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      jsd_terms_fast(math::log_normalize(sv[i] * inv, lse_s),
                     math::log_normalize(tv[i] * inv, lse_t), l1mb, lb, kp, kq);
    }
  }
  block_sum2(kp, kq, scratch);
  if (threadIdx.x != 0) return;
  p.bucket[row * 2] = p.bucket[row * 2 + 1] = 0.0f;  // the single "bucket": mass 1 on both sides
  write_row(p, row, tgt, s, t, beta * kq + (1.0f - beta) * kp, lse_s, lse_t);
}

// ---- top-M -----------------------------------------------------------------------------------------

// top_m >= 1. Dynamic shared memory: kSortCap uint64 keys. Three blocks per SM (24 warps, up
// to 85 registers): ptxas left to itself capped some instances at 64 registers with spills.
// support="student": the same instance, rows swapped by the launcher (FwdParams::swapped).
// support="union" (kUnion): kUnionSmemBytes of dynamic shared memory (the student's buffer, its
// count and threshold after the teacher's buffer); each entry is tested against both thresholds
// (raw logits first, as for the teacher alone), a candidate of either selection is masked out of
// both tails, and the compaction is compact_union_base2. Its launch bounds ask for 2 blocks per SM
// (up to 128 registers; it takes 116-120): left to itself ptxas capped the float instance at 64
// registers with spills, and at 3 blocks (80 registers) all but the bf16 one spill. 2 blocks is
// also what sm_80's shared memory holds of its 64 KB. A minimum of 0 leaves the teacher's instances
// exactly as they were (same registers and SASS as without the bound).
template <typename TS, typename TT, bool kUnion = false>
__global__ void __launch_bounds__(kThreads, kUnion ? 2 : 0)
    topk_tail_kl_fwd_base2_kernel(const TS* __restrict__ student, const TT* __restrict__ teacher,
                               FwdParams p) {
  LOPD_EXTERN_SHARED(uint64_t, keys);
  __shared__ float2 lse_scratch[kThreads / 32];
  __shared__ int count;
  __shared__ uint64_t threshold;

  const int64_t row = blockIdx.x;
  const int64_t V = p.vocab;
  const int64_t M = p.top_m;
  const int64_t tgt = p.target[row];
  if (write_ignored_row(p, row, tgt)) return;
  const TS* s = student + p.s_layout.offset(row);
  const TT* t = teacher + p.t_layout.offset(row);
  const bool aligned = is_aligned16(s) && is_aligned16(t);
  // Offsets within the row in 32 bits (the launcher checks V < 2^31).
  const uint32_t V32 = static_cast<uint32_t>(V);

  const float inv = p.inv;
  const float temperature = 1.0f / inv;  // for the raw-logit threshold (a 2^-20 margin covers it)
  const float c2 = inv * kLog2e;
  Lse2 tail_s = lse2_empty();
  Lse2 tail_t = lse2_empty();
  // The union's student buffer, with its count and threshold after it.
  [[maybe_unused]] uint64_t* keys_s = keys + kSortCap;
  [[maybe_unused]] int* count_s = reinterpret_cast<int*>(keys + 2 * kSortCap);
  [[maybe_unused]] uint64_t* threshold_s = keys + 2 * kSortCap + 1;
  if (threadIdx.x == 0) {
    count = 0;
    threshold = 0;  // below every real key: everything is a candidate until M are kept
    if constexpr (kUnion) {
      *count_s = 0;
      *threshold_s = 0;
    }
  }
  __syncthreads();

  auto compact = [&]() {
    Tails2 tails;
    if constexpr (kUnion) {
      tails = compact_union_base2(keys, keys_s, &count, count_s, &threshold, threshold_s, M, s, t,
                               inv, Tails2{tail_s, tail_t});
    } else {
      tails = compact_base2(keys, &count, &threshold, M, s, c2, Tails2{tail_s, tail_t});
    }
    tail_s = tails.s;
    tail_t = tails.t;
  };

  // One tile's 8 entries of this thread: admits the candidates (their logits become -inf for
  // the tails) and adds the teacher's chunk to its tail, then the student's (converted only
  // then, so that both sides' 8 floats are never live at once). The common case, no entry at or
  // above the threshold, costs one float compare per entry and one branch per chunk. kFull: all
  // 8 inside the row (no bounds checks).
  auto process = [&](auto full_tag, uint32_t base, int valid, const Raw8<TS>& s_raw,
                     const Raw8<TT>& t_raw, uint64_t thr, float thr_value, float thr_raw) {
    constexpr bool kFull = decltype(full_tag)::value;
    float x[kVec];
    float x_max = -INFINITY;
    bool any = false;
    to_floats(t_raw, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) any |= (kFull || i < valid) && x[i] >= thr_raw;
    uint32_t admitted = 0;  // bit i: entry i joined the candidates
    if (any) {
      // Rare once the threshold has settled: the exact 64-bit order (value, then lower id).
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float ts = x[i] * inv;
        if ((kFull || i < valid) && ts >= thr_value) {
          const uint64_t key = make_key(ts, base + i);
          if (key > thr) {
            keys[atomicAdd(&count, 1)] = key;
            admitted |= 1u << i;
            x[i] = -INFINITY;
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) x_max = fmaxf(x_max, x[i]);
    lse2_add_chunk(tail_t, x, x_max, c2);
    to_floats(s_raw, x);
    if (admitted != 0) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) x[i] = (admitted >> i) & 1u ? -INFINITY : x[i];
    }
    x_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kVec; ++i) x_max = fmaxf(x_max, x[i]);
    lse2_add_chunk(tail_s, x, x_max, c2);
  };

  // The union's tile: both rows' 8 entries converted at once (a candidate of either selection
  // leaves both tails), then as `process` per side.
  auto process_union = [&](auto full_tag, uint32_t base, int valid, const Raw8<TS>& s_raw,
                           const Raw8<TT>& t_raw, uint64_t thr, float thr_value, float thr_raw,
                           uint64_t thr_s, float thr_s_value, float thr_s_raw) {
    constexpr bool kFull = decltype(full_tag)::value;
    float x[kVec], y[kVec];
    to_floats(t_raw, x);
    to_floats(s_raw, y);
    bool any = false;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      any |= (kFull || i < valid) && (x[i] >= thr_raw || y[i] >= thr_s_raw);
    }
    if (any) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (!(kFull || i < valid)) continue;
        const float ts = x[i] * inv;
        const float ss = y[i] * inv;
        bool held = false;
        if (ts >= thr_value) {
          const uint64_t key = make_key(ts, base + i);
          if (key > thr) {
            keys[atomicAdd(&count, 1)] = key;
            held = true;
          }
        }
        if (ss >= thr_s_value) {
          const uint64_t key = make_key(ss, base + i);
          if (key > thr_s) {
            keys_s[atomicAdd(count_s, 1)] = key;
            held = true;
          }
        }
        if (held) x[i] = y[i] = -INFINITY;
      }
    }
    float x_max = -INFINITY, y_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      x_max = fmaxf(x_max, x[i]);
      y_max = fmaxf(y_max, y[i]);
    }
    lse2_add_chunk(tail_t, x, x_max, c2);
    lse2_add_chunk(tail_s, y, y_max, c2);
  };

  auto load = [&](uint32_t tile, Raw8<TS>& sv, Raw8<TT>& tv) {
    const uint32_t base = tile + threadIdx.x * kVec;
    // Past the row: -inf, never admitted (the partial tile checks bounds).
    const int valid = base >= V32 ? 0 : (V32 - base < kVec ? int(V32 - base) : kVec);
    load_raw8(s + base, valid, aligned, sv);
    load_raw8(t + base, valid, aligned, tv);
  };

  // One tile: the block decides together whether to compact (see natural_exp: every thread reads count
  // and threshold, then a barrier, and only then may a thread append), the next tile's loads
  // are issued (full tiles), the current tile is processed, and a barrier closes the tile.
  // Full tiles (every thread's 8 entries inside the row) are the main loop, without bounds
  // checks; a row's last, partial tile is processed after it, with them.
  auto step = [&](auto full_tag, uint32_t tile, const Raw8<TS>& s_raw, const Raw8<TT>& t_raw,
                  Raw8<TS>& sn, Raw8<TT>& tn) {
    constexpr bool kFull = decltype(full_tag)::value;
    const int n_candidates = count;
    bool compact_now = n_candidates > kBufCap - kTile || (threshold == 0 && n_candidates >= M);
    if constexpr (kUnion) {
      const int n_s = *count_s;
      compact_now = compact_now || n_s > kBufCap - kTile || (*threshold_s == 0 && n_s >= M);
    }
    __syncthreads();
    if (compact_now) compact();
    const uint64_t thr = threshold;
    // The threshold's value as a float: an entry whose scaled logit is below it can never be
    // admitted. Before the first compaction every entry is a candidate, -inf ones included.
    const float thr_value = thr == 0 ? -INFINITY : key_value(thr);
    // The same bound on the raw logit, lowered by 2^-20 of its size and by FLT_MIN: every x with
    // x * inv >= thr_value (rounded, and also where the product underflows to -0) has
    // x >= thr_raw, so the common path compares raw logits (no multiply); the few x above it
    // that do not reach thr_value once scaled are rejected by the exact test.
    const float thr_div = thr_value * temperature;
    const float thr_raw = thr_div - fabsf(thr_div) * 0x1p-20f - FLT_MIN;
    const uint32_t base = tile + threadIdx.x * kVec;
    if constexpr (kFull) {
      load(tile + kTile, sn, tn);  // past the row: nothing is read
    }
    if constexpr (kUnion) {
      // The student's selection: the same bounds on its own threshold.
      const uint64_t thr_s = *threshold_s;
      const float thr_s_value = thr_s == 0 ? -INFINITY : key_value(thr_s);
      const float thr_s_div = thr_s_value * temperature;
      const float thr_s_raw = thr_s_div - fabsf(thr_s_div) * 0x1p-20f - FLT_MIN;
      if (kFull || base < V32) {
        process_union(full_tag, base, kFull ? kVec : valid_in(V32, base), s_raw, t_raw, thr,
                      thr_value, thr_raw, thr_s, thr_s_value, thr_s_raw);
      }
    } else if constexpr (kFull) {
      process(std::true_type{}, base, kVec, s_raw, t_raw, thr, thr_value, thr_raw);
    } else {
      if (base < V32) {
        process(std::false_type{}, base, valid_in(V32, base), s_raw, t_raw, thr, thr_value,
                thr_raw);
      }
    }
    __syncthreads();
  };

  Raw8<TS> sa, sb;
  Raw8<TT> ta, tb;
  load(0, sa, ta);
  const uint32_t full_end = V32 / kTile * kTile;  // tiles [0, full_end) hold kTile entries
  uint32_t tile = 0;
  for (; tile + 2 * kTile <= full_end; tile += 2 * kTile) {
    step(std::true_type{}, tile, sa, ta, sb, tb);
    step(std::true_type{}, tile + kTile, sb, tb, sa, ta);
  }
  if (tile < full_end) {  // an odd number of full tiles: the next data lands in (sb, tb)
    step(std::true_type{}, tile, sa, ta, sb, tb);
    if (tile + kTile < V32) step(std::false_type{}, tile + kTile, sb, tb, sa, ta);
  } else if (tile < V32) {
    step(std::false_type{}, tile, sa, ta, sb, tb);
  }
  compact();

  tail_s = block_merge2(tail_s, lse_scratch);
  tail_t = block_merge2(tail_t, lse_scratch);

  if constexpr (kUnion) {
    finish_union_row(keys, keys_s, s, t, lse2_to_natural(tail_s), lse2_to_natural(tail_t), p, row,
                     tgt);
  } else {
    finish_topm_row(keys, s, t, lse2_to_natural(tail_s), lse2_to_natural(tail_t), p, row, tgt);
  }
}

}  // namespace
}  // namespace lopd::cuda
