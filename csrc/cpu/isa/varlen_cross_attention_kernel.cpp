// Vectorized CPU kernels of lopd::varlen_cross_attention_cpu_fwd / _bwd, compiled once per ISA
// (CPU_CAPABILITY = DEFAULT | AVX2 | AVX512, see csrc/cpu/isa_dispatch.h). The maths is in the
// docstring of lopd_kernels/varlen_cross_attention.py.
//
// One call handles the whole batch: the work units are the (item b, kv head h) pairs, taken
// longest item first from a shared counter by every thread (the items' lengths differ by 10x in
// a QFormer batch, so a static split would leave a thread idle). A unit owns the R = G * Lq query
// rows of its GQA group (row r = g * Lq + i is query position i of head h * G + g) and the keys
// cu[b] .. cu[b+1] of kv head h; it is the only writer of its rows of out / lse / dq and of its key
// rows of dk / dv, so nothing is zero-filled or accumulated across threads.
//
// Layout. Scores are kept key-major, S^T [keys, Rp] with the R query rows in vector lanes (Rp = R
// rounded up to the vector width; padded lanes are masked by an lse of +inf in the backward and
// never stored). Then the softmax over keys is a lane-wise (vertical) max / sum, no horizontal
// reductions, and every product is one of three register-blocked micro-kernels on fp32 data:
//   scores:   S^T[j, :]  = sum_d X[j, d]   Y^T[d, :]     (X = K or V rows, Y^T = (scale Q)^T, dO^T)
//   accum:    A^T[d, :] += sum_j X[j, d]   P^T[j, :]     (out^T += V^T P, dq^T += K^T dS)
//   rows:     Z[j, :]    = sum_r P^T[j, r] Y[r, :]       (dv = P^T dO, dk = dS^T Q)
// each a broadcast of one X / P entry times a vector of Y, fused multiply-added into a tile of
// kRB x kVB vector accumulators that stays in registers. Keys stream in chunks of kChunk (the
// chunk's scores, probabilities and K / V rows stay in L1/L2).
//
// Forward per unit: online softmax over the chunks (running max m and sum l per row; the output
// accumulator out^T [D, Rp] is rescaled by exp(m_old - m_new) when the max grows), then
// out = out^T / l and lse = m + log l. Backward per unit: delta = <dO, out> - dlse per row, then
// per chunk P = exp(S - lse), dP = dO V^T, dS = P (dP - delta), and dv, dk (rows of the chunk,
// written once) and dq^T (accumulated over the chunks, written at the end).
// GCC 12 reports -Wmaybe-uninitialized false positives inside its own avx512fintrin.h (the
// `_mm512_undefined_*` placeholders ATen's Vectorized uses); they are not about this file's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu/varlen_cross_attention.h"
#include "cpu/vec_exp.h"

namespace lopd::cpu::CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
// Keys per chunk: the chunk's scores ([kChunk, Rp] fp32, 8 KiB at Rp = 32) and K / V rows
// (16 KiB each at D = 64) stay in L1 while they are reused.
constexpr int64_t kChunk = 64;
// Register tile of the micro-kernels: kRB broadcast rows x kVB vectors of accumulators, 16 of 32
// zmm registers with AVX-512, 8 of 16 ymm registers with AVX2 (room for operands: no spills).
constexpr int kRB = kW >= 16 ? 8 : 4;
constexpr int kVB = 2;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- micro-kernels (fp32; all pointers to row-major data) ----------------------------------

// S[j, v-tile] = sum_d X[j, d] Y^T[d, v-tile] for RB rows j; NV vectors from column vector v0.
template <int RB, int NV>
inline void scores_tile(const float* x, int64_t ldx, const float* yt, int64_t ldy, int64_t depth,
                        int64_t v0, float* s, int64_t lds) {
  Vec acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.0f);
  }
  for (int64_t d = 0; d < depth; ++d) {
    Vec y[NV];
    for (int c = 0; c < NV; ++c) y[c] = Vec::loadu(yt + d * ldy + (v0 + c) * kW);
    for (int r = 0; r < RB; ++r) {
      const Vec xb(x[r * ldx + d]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(xb, y[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c].store(s + r * lds + (v0 + c) * kW);
  }
}

// S [n, ldy lanes] = X [n, depth] (row stride ldx) times Y^T [depth, ldy]; ldy % kW == 0.
void scores(const float* x, int64_t ldx, int64_t n, const float* yt, int64_t ldy, int64_t depth,
            float* s) {
  const int64_t nvec = ldy / kW;
  int64_t j = 0;
  auto row_block = [&](auto rb_tag) {
    constexpr int RB = decltype(rb_tag)::value;
    int64_t v = 0;
    for (; v + kVB <= nvec; v += kVB) {
      scores_tile<RB, kVB>(x + j * ldx, ldx, yt, ldy, depth, v, s + j * ldy, ldy);
    }
    for (; v < nvec; ++v) scores_tile<RB, 1>(x + j * ldx, ldx, yt, ldy, depth, v, s + j * ldy, ldy);
  };
  for (; j + kRB <= n; j += kRB) row_block(std::integral_constant<int, kRB>{});
  for (; j < n; ++j) row_block(std::integral_constant<int, 1>{});
}

// A^T[d-tile, v-tile] += sum_j X[j, d] P[j, v-tile] for RB values of d from d0.
template <int RB, int NV>
inline void accum_tile(const float* x, int64_t ldx, int64_t n, const float* p, int64_t ldp,
                       int64_t d0, int64_t v0, float* at, int64_t lda) {
  Vec acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec::loadu(at + (d0 + r) * lda + (v0 + c) * kW);
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec pv[NV];
    for (int c = 0; c < NV; ++c) pv[c] = Vec::loadu(p + j * ldp + (v0 + c) * kW);
    for (int r = 0; r < RB; ++r) {
      const Vec xb(x[j * ldx + d0 + r]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(xb, pv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c].store(at + (d0 + r) * lda + (v0 + c) * kW);
  }
}

// A^T [depth, ldp] += X^T [depth, n] P [n, ldp]; X rows of stride ldx; ldp % kW == 0.
void accum(const float* x, int64_t ldx, int64_t n, int64_t depth, const float* p, int64_t ldp,
           float* at) {
  const int64_t nvec = ldp / kW;
  int64_t d = 0;
  auto d_block = [&](auto rb_tag) {
    constexpr int RB = decltype(rb_tag)::value;
    int64_t v = 0;
    for (; v + kVB <= nvec; v += kVB) accum_tile<RB, kVB>(x, ldx, n, p, ldp, d, v, at, ldp);
    for (; v < nvec; ++v) accum_tile<RB, 1>(x, ldx, n, p, ldp, d, v, at, ldp);
  };
  for (; d + kRB <= depth; d += kRB) d_block(std::integral_constant<int, kRB>{});
  for (; d < depth; ++d) d_block(std::integral_constant<int, 1>{});
}

// Z[j-tile, v-tile] = sum_{r < depth} P[j, r] Y[r, v-tile] for RB rows j.
template <int RB, int NV>
inline void rows_tile(const float* p, int64_t ldp, int64_t depth, const float* y, int64_t ldy,
                      int64_t v0, float* z, int64_t ldz) {
  Vec acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.0f);
  }
  for (int64_t k = 0; k < depth; ++k) {
    Vec yv[NV];
    for (int c = 0; c < NV; ++c) yv[c] = Vec::loadu(y + k * ldy + (v0 + c) * kW);
    for (int r = 0; r < RB; ++r) {
      const Vec pb(p[r * ldp + k]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(pb, yv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c].store(z + r * ldz + (v0 + c) * kW);
  }
}

// Z [n, ldy] = P [n, depth] (row stride ldp) times Y [depth, ldy]; ldy % kW == 0.
void rows(const float* p, int64_t ldp, int64_t n, int64_t depth, const float* y, int64_t ldy,
          float* z) {
  const int64_t nvec = ldy / kW;
  int64_t j = 0;
  auto row_block = [&](auto rb_tag) {
    constexpr int RB = decltype(rb_tag)::value;
    int64_t v = 0;
    for (; v + kVB <= nvec; v += kVB) {
      rows_tile<RB, kVB>(p + j * ldp, ldp, depth, y, ldy, v, z + j * ldy, ldy);
    }
    for (; v < nvec; ++v) rows_tile<RB, 1>(p + j * ldp, ldp, depth, y, ldy, v, z + j * ldy, ldy);
  };
  for (; j + kRB <= n; j += kRB) row_block(std::integral_constant<int, kRB>{});
  for (; j < n; ++j) row_block(std::integral_constant<int, 1>{});
}

// ---- units of work ---------------------------------------------------------------------------

struct Shape {
  int64_t batch, lq, hq, hkv, d, group, rows, rows_pad, d_pad;
  int64_t heads_per_unit;  // kv heads of one unit of work (a divisor of hkv)
};

Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
  Shape s{};
  s.batch = q.size(0);
  s.lq = q.size(1);
  s.hq = q.size(2);
  s.d = q.size(3);
  s.hkv = k.size(1);
  s.group = s.hq / s.hkv;
  s.rows = s.group * s.lq;
  s.rows_pad = round_up(std::max<int64_t>(s.rows, 1), kW);
  s.d_pad = round_up(s.d, kW);
  // A unit takes all kv heads of its item when there are enough items to keep every thread busy
  // (then a chunk of keys is one contiguous stretch of k / v, which the hardware prefetchers
  // stream); with fewer items the heads are split until there are ~2 units per thread.
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  int64_t splits = 1;
  while (s.batch * splits < want && splits < s.hkv) {
    ++splits;
    while (s.hkv % splits != 0) ++splits;
  }
  s.heads_per_unit = s.hkv / splits;
  return s;
}

// Runs fn(b, h0, scratch) for every (item b, block of kv heads from h0) on every thread, longest
// items first, each thread with its own scratch.
template <typename F>
void for_each_unit(const Shape& s, const int* cu, const F& fn) {
  std::vector<int64_t> order(static_cast<size_t>(s.batch));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cu[a + 1] - cu[a] > cu[b + 1] - cu[b];
  });
  const int64_t blocks = s.hkv / s.heads_per_unit;
  const int64_t units = s.batch * blocks;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      auto scratch = fn.make_scratch();
      for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
        fn(order[static_cast<size_t>(u / blocks)], (u % blocks) * s.heads_per_unit, scratch);
      }
    }
  });
}

// Row r of kv head h's query side: offset of q[b, i, h * G + g, 0] (r = g * Lq + i).
inline int64_t q_offset(const Shape& s, int64_t b, int64_t h, int64_t r) {
  const int64_t g = r / s.lq, i = r % s.lq;
  return ((b * s.lq + i) * s.hq + h * s.group + g) * s.d;
}

// Offset of lse[b, h * G + g, i]: the rows of kv head h are contiguous in lse.
inline int64_t lse_offset(const Shape& s, int64_t b, int64_t h) {
  return (b * s.hq + h * s.group) * s.lq;
}

// Rows first .. first + n of the unit's kv heads h0 .. h0 + hpu, as contiguous fp32 [n, D] per
// head in buf ([hpu][kChunk][D]). The packed rows of one head are Hkv * D elements apart (a
// power-of-two stride that maps a chunk onto a few L1 sets), so every head gets its own
// contiguous copy; reading the unit's heads row by row keeps the reads sequential when a unit
// has all heads.
template <typename T>
void load_kv_chunk(const T* base, const Shape& s, int64_t first, int64_t n, int64_t h0,
                   float* buf) {
  const int64_t ld = s.hkv * s.d;
  for (int64_t j = 0; j < n; ++j) {
    const T* row = base + (first + j) * ld + h0 * s.d;
    for (int64_t hh = 0; hh < s.heads_per_unit; ++hh) {
      const T* src = row + hh * s.d;
      float* dst = buf + (hh * kChunk + j) * s.d;
      if constexpr (std::is_same_v<T, float>) {
        int64_t d = 0;
        for (; d + kW <= s.d; d += kW) Vec::loadu(src + d).store(dst + d);
        if (d < s.d) {
          const int rest = static_cast<int>(s.d - d);
          Vec::loadu(src + d, rest).store(dst + d, rest);
        }
      } else {
        for (int64_t d = 0; d < s.d; ++d) dst[d] = static_cast<float>(src[d]);
      }
    }
  }
}

// Writes rows first .. first + n of the unit's kv heads h0 .. h0 + hpu of `dst` from `z`
// ([hpu][kChunk][d_pad] fp32) times `mult`, row by row: with all heads in the unit that is one
// sequential stretch of dst (every line written whole, once).
template <typename T>
void store_kv_chunk(const float* z, const Shape& s, int64_t first, int64_t n, int64_t h0,
                    float mult, T* dst) {
  const Vec vm(mult);
  for (int64_t j = 0; j < n; ++j) {
    T* row = dst + ((first + j) * s.hkv + h0) * s.d;
    for (int64_t hh = 0; hh < s.heads_per_unit; ++hh) {
      const float* in = z + (hh * kChunk + j) * s.d_pad;
      T* out = row + hh * s.d;
      if constexpr (std::is_same_v<T, float>) {
        int64_t d = 0;
        for (; d + kW <= s.d; d += kW) (Vec::loadu(in + d) * vm).store(out + d);
        if (d < s.d) {
          const int rest = static_cast<int>(s.d - d);
          (Vec::loadu(in + d) * vm).store(out + d, rest);
        }
      } else {
        for (int64_t d = 0; d < s.d; ++d) out[d] = static_cast<T>(in[d] * mult);
      }
    }
  }
}

// Packs kv head h's query-side rows of x ([B, Lq, Hq, D]) as fp32, transposed ([D, Rp], `t`)
// and / or row-major ([R, Dp], `rm`), times `mult`; padding is zero.
template <typename T>
void pack_rows(const T* x, const Shape& s, int64_t b, int64_t h, float mult, float* t, float* rm) {
  if (t != nullptr) std::fill(t, t + s.d * s.rows_pad, 0.0f);
  if (rm != nullptr) std::fill(rm, rm + s.rows * s.d_pad, 0.0f);
  for (int64_t r = 0; r < s.rows; ++r) {
    const T* src = x + q_offset(s, b, h, r);
    for (int64_t d = 0; d < s.d; ++d) {
      const float val = static_cast<float>(src[d]) * mult;
      if (t != nullptr) t[d * s.rows_pad + r] = val;
      if (rm != nullptr) rm[r * s.d_pad + d] = val;
    }
  }
}

// ---- forward ---------------------------------------------------------------------------------

// Per thread; per-head arrays hold heads_per_unit slices.
struct FwdScratch {
  std::vector<float> qt, ot, m, l;  // per head: [D, Rp], [D, Rp], [Rp], [Rp]
  std::vector<float> kbuf, vbuf;    // per head: [kChunk, D]
  std::vector<float> sc;            // [kChunk, Rp]
};

template <typename T>
struct FwdUnit {
  const Shape& s;
  const VarlenXattnFwdArgs& a;
  const T *q, *k, *v;
  const int* cu;
  T* out;
  float* lse;

  FwdScratch make_scratch() const {
    const int64_t hpu = s.heads_per_unit, rp = s.rows_pad;
    FwdScratch w;
    w.qt.resize(hpu * s.d * rp);
    w.ot.resize(hpu * s.d * rp);
    w.m.resize(hpu * rp);
    w.l.resize(hpu * rp);
    w.kbuf.resize(hpu * kChunk * s.d);
    w.vbuf.resize(hpu * kChunk * s.d);
    w.sc.resize(kChunk * rp);
    return w;
  }

  // One chunk of n keys for one head: online-softmax update of (m, l, out^T).
  void chunk(const float* kc, const float* vc, int64_t n, bool first_chunk, float* qt, float* ot,
             float* m, float* l, float* st) const {
    const int64_t rp = s.rows_pad, nvec = rp / kW;
    scores(kc, s.d, n, qt, rp, s.d, st);
    for (int64_t c = 0; c < nvec; ++c) {
      Vec mx = Vec::loadu(st + c * kW);
      for (int64_t j = 1; j < n; ++j) mx = at::vec::maximum(mx, Vec::loadu(st + j * rp + c * kW));
      const Vec m_old = Vec::loadu(m + c * kW);
      const Vec m_new = at::vec::maximum(m_old, mx);
      // exp(-inf - -inf) would be NaN: lanes still at -inf use 0 as their reference.
      const Vec ref = Vec::blendv(m_new, Vec(0.0f), m_new == Vec(-kInf));
      const Vec alpha = fast_exp(m_old - ref);
      Vec sum = Vec::loadu(l + c * kW) * alpha;
      for (int64_t j = 0; j < n; ++j) {
        const Vec p = fast_exp(Vec::loadu(st + j * rp + c * kW) - ref);
        p.store(st + j * rp + c * kW);
        sum = sum + p;
      }
      sum.store(l + c * kW);
      m_new.store(m + c * kW);
      if (!first_chunk) {
        for (int64_t d = 0; d < s.d; ++d) {
          float* row = ot + d * rp + c * kW;
          (Vec::loadu(row) * alpha).store(row);
        }
      }
    }
    accum(vc, s.d, n, s.d, st, rp, ot);
  }

  void operator()(int64_t b, int64_t h0, FwdScratch& w) const {
    const int64_t first = cu[b], len = cu[b + 1] - cu[b];
    const int64_t hpu = s.heads_per_unit, rp = s.rows_pad;
    if (len == 0) {
      // Attention over nothing: out = 0, lse = -inf.
      for (int64_t h = h0; h < h0 + hpu; ++h) {
        for (int64_t r = 0; r < s.rows; ++r) {
          T* dst = out + q_offset(s, b, h, r);
          std::fill(dst, dst + s.d, T(0));
          lse[lse_offset(s, b, h) + r] = -kInf;
        }
      }
      return;
    }
    for (int64_t hh = 0; hh < hpu; ++hh) {
      pack_rows(q, s, b, h0 + hh, a.scale, w.qt.data() + hh * s.d * rp,
                static_cast<float*>(nullptr));
    }
    std::fill(w.ot.begin(), w.ot.end(), 0.0f);
    std::fill(w.m.begin(), w.m.end(), -kInf);
    std::fill(w.l.begin(), w.l.end(), 0.0f);
    for (int64_t j0 = 0; j0 < len; j0 += kChunk) {
      const int64_t n = std::min(kChunk, len - j0);
      load_kv_chunk(k, s, first + j0, n, h0, w.kbuf.data());
      load_kv_chunk(v, s, first + j0, n, h0, w.vbuf.data());
      for (int64_t hh = 0; hh < hpu; ++hh) {
        chunk(w.kbuf.data() + hh * kChunk * s.d, w.vbuf.data() + hh * kChunk * s.d, n, j0 == 0,
              w.qt.data() + hh * s.d * rp, w.ot.data() + hh * s.d * rp, w.m.data() + hh * rp,
              w.l.data() + hh * rp, w.sc.data());
      }
    }
    for (int64_t hh = 0; hh < hpu; ++hh) {
      const float* ot = w.ot.data() + hh * s.d * rp;
      const float* m = w.m.data() + hh * rp;
      const float* l = w.l.data() + hh * rp;
      float* lse_h = lse + lse_offset(s, b, h0 + hh);
      for (int64_t r = 0; r < s.rows; ++r) {
        const float inv = 1.0f / l[r];
        T* dst = out + q_offset(s, b, h0 + hh, r);
        for (int64_t d = 0; d < s.d; ++d) dst[d] = static_cast<T>(ot[d * rp + r] * inv);
        lse_h[r] = m[r] + std::log(l[r]);
      }
    }
  }
};

template <typename T>
void fwd_impl(const VarlenXattnFwdArgs& a) {
  const Shape s = shape_of(a.q, a.k);
  const FwdUnit<T> unit{s,
                        a,
                        a.q.data_ptr<T>(),
                        a.k.data_ptr<T>(),
                        a.v.data_ptr<T>(),
                        a.cu.data_ptr<int>(),
                        a.out.data_ptr<T>(),
                        a.lse.data_ptr<float>()};
  for_each_unit(s, a.cu.data_ptr<int>(), unit);
}

// ---- backward --------------------------------------------------------------------------------

// Per thread; per-head arrays hold heads_per_unit slices.
struct BwdScratch {
  std::vector<float> qt, dot, dqt;  // per head: [D, Rp]
  std::vector<float> qr, dor;       // per head: [R, Dp]
  std::vector<float> lse, delta;    // per head: [Rp]
  std::vector<float> kbuf, vbuf;    // per head: [kChunk, D]
  std::vector<float> p, ds;         // [kChunk, Rp]
  std::vector<float> zk, zv;        // per head: [kChunk, Dp], the chunk's dk, dv rows
};

template <typename T>
struct BwdUnit {
  const Shape& s;
  const VarlenXattnBwdArgs& a;
  const T *q, *k, *v, *dout, *out;
  const float *lse, *dlse;
  const int* cu;
  T *dq, *dk, *dv;

  BwdScratch make_scratch() const {
    const int64_t hpu = s.heads_per_unit, rp = s.rows_pad;
    BwdScratch w;
    w.qt.resize(hpu * s.d * rp);
    w.dot.resize(hpu * s.d * rp);
    w.dqt.resize(hpu * s.d * rp);
    w.qr.resize(hpu * s.rows * s.d_pad);
    w.dor.resize(hpu * s.rows * s.d_pad);
    w.lse.resize(hpu * rp);
    w.delta.resize(hpu * rp);
    w.kbuf.resize(hpu * kChunk * s.d);
    w.vbuf.resize(hpu * kChunk * s.d);
    w.p.resize(kChunk * rp);
    w.ds.resize(kChunk * rp);
    w.zk.resize(hpu * kChunk * s.d_pad);
    w.zv.resize(hpu * kChunk * s.d_pad);
    return w;
  }

  // Per-row state of head h: packed q, dO, their transposes, lse (padded lanes +inf: their
  // probabilities are exactly 0) and delta = <dO, out> - dlse.
  void prepare(int64_t b, int64_t h, int64_t hh, BwdScratch& w) const {
    const int64_t rp = s.rows_pad;
    float* dor = w.dor.data() + hh * s.rows * s.d_pad;
    pack_rows(q, s, b, h, a.scale, w.qt.data() + hh * s.d * rp, static_cast<float*>(nullptr));
    pack_rows(q, s, b, h, 1.0f, static_cast<float*>(nullptr), w.qr.data() + hh * s.rows * s.d_pad);
    pack_rows(dout, s, b, h, 1.0f, w.dot.data() + hh * s.d * rp, dor);
    float* lse_h = w.lse.data() + hh * rp;
    float* delta_h = w.delta.data() + hh * rp;
    std::fill(lse_h, lse_h + rp, kInf);
    std::fill(delta_h, delta_h + rp, 0.0f);
    const int64_t lo = lse_offset(s, b, h);
    for (int64_t r = 0; r < s.rows; ++r) {
      const T* o = out + q_offset(s, b, h, r);
      float dot = 0.0f;
      for (int64_t d = 0; d < s.d; ++d) dot += dor[r * s.d_pad + d] * static_cast<float>(o[d]);
      lse_h[r] = lse[lo + r];
      delta_h[r] = dot - dlse[lo + r];
    }
  }

  // One chunk of n keys for the unit's head slot hh: its dv, dk rows (into zv, zk) and dq^T.
  void chunk(int64_t n, int64_t hh, BwdScratch& w) const {
    const int64_t rp = s.rows_pad, nvec = rp / kW;
    const float* kc = w.kbuf.data() + hh * kChunk * s.d;
    const float* vc = w.vbuf.data() + hh * kChunk * s.d;
    float* p = w.p.data();
    float* ds = w.ds.data();
    scores(kc, s.d, n, w.qt.data() + hh * s.d * rp, rp, s.d, p);    // S^T
    scores(vc, s.d, n, w.dot.data() + hh * s.d * rp, rp, s.d, ds);  // dP^T = V dO^T
    const float* lse_h = w.lse.data() + hh * rp;
    const float* delta_h = w.delta.data() + hh * rp;
    for (int64_t c = 0; c < nvec; ++c) {
      const Vec l = Vec::loadu(lse_h + c * kW);
      const Vec dl = Vec::loadu(delta_h + c * kW);
      for (int64_t j = 0; j < n; ++j) {
        const Vec pj = fast_exp(Vec::loadu(p + j * rp + c * kW) - l);
        pj.store(p + j * rp + c * kW);
        (pj * (Vec::loadu(ds + j * rp + c * kW) - dl)).store(ds + j * rp + c * kW);
      }
    }
    float* zv = w.zv.data() + hh * kChunk * s.d_pad;
    float* zk = w.zk.data() + hh * kChunk * s.d_pad;
    rows(p, rp, n, s.rows, w.dor.data() + hh * s.rows * s.d_pad, s.d_pad, zv);  // dv = P^T dO
    rows(ds, rp, n, s.rows, w.qr.data() + hh * s.rows * s.d_pad, s.d_pad, zk);  // dk / scale
    accum(kc, s.d, n, s.d, ds, rp, w.dqt.data() + hh * s.d * rp);  // dq^T += K^T dS
  }

  void operator()(int64_t b, int64_t h0, BwdScratch& w) const {
    const int64_t first = cu[b], len = cu[b + 1] - cu[b];
    const int64_t hpu = s.heads_per_unit, rp = s.rows_pad;
    if (len == 0) {
      for (int64_t h = h0; h < h0 + hpu; ++h) {
        for (int64_t r = 0; r < s.rows; ++r) {
          T* dst = dq + q_offset(s, b, h, r);
          std::fill(dst, dst + s.d, T(0));
        }
      }
      return;
    }
    for (int64_t hh = 0; hh < hpu; ++hh) prepare(b, h0 + hh, hh, w);
    std::fill(w.dqt.begin(), w.dqt.end(), 0.0f);
    for (int64_t j0 = 0; j0 < len; j0 += kChunk) {
      const int64_t n = std::min(kChunk, len - j0);
      load_kv_chunk(k, s, first + j0, n, h0, w.kbuf.data());
      load_kv_chunk(v, s, first + j0, n, h0, w.vbuf.data());
      for (int64_t hh = 0; hh < hpu; ++hh) chunk(n, hh, w);
      store_kv_chunk(w.zv.data(), s, first + j0, n, h0, 1.0f, dv);
      store_kv_chunk(w.zk.data(), s, first + j0, n, h0, a.scale, dk);  // dk = scale dS^T Q
    }
    for (int64_t hh = 0; hh < hpu; ++hh) {
      const float* dqt = w.dqt.data() + hh * s.d * rp;
      for (int64_t r = 0; r < s.rows; ++r) {
        T* dst = dq + q_offset(s, b, h0 + hh, r);
        for (int64_t d = 0; d < s.d; ++d) dst[d] = static_cast<T>(dqt[d * rp + r] * a.scale);
      }
    }
  }
};

template <typename T>
void bwd_impl(const VarlenXattnBwdArgs& a) {
  const Shape s = shape_of(a.q, a.k);
  const BwdUnit<T> unit{s,
                        a,
                        a.q.data_ptr<T>(),
                        a.k.data_ptr<T>(),
                        a.v.data_ptr<T>(),
                        a.grad_out.data_ptr<T>(),
                        a.out.data_ptr<T>(),
                        a.lse.data_ptr<float>(),
                        a.grad_lse.data_ptr<float>(),
                        a.cu.data_ptr<int>(),
                        a.dq.data_ptr<T>(),
                        a.dk.data_ptr<T>(),
                        a.dv.data_ptr<T>()};
  for_each_unit(s, a.cu.data_ptr<int>(), unit);
}

#define LOPD_XATTN_DISPATCH(DTYPE, NAME, F, ARGS)                                          \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, DTYPE, NAME, [&] {             \
    if constexpr (std::is_same_v<scalar_t, double>) {                                      \
      TORCH_CHECK(false, NAME, ": float64 inputs are not supported by the C++ kernel");    \
    } else {                                                                               \
      F<scalar_t>(ARGS);                                                                   \
    }                                                                                      \
  })

}  // namespace

void varlen_cross_attention_fwd_kernel(const VarlenXattnFwdArgs& args) {
  LOPD_XATTN_DISPATCH(args.q.scalar_type(), "varlen_cross_attention_cpu_fwd", fwd_impl, args);
}

void varlen_cross_attention_bwd_kernel(const VarlenXattnBwdArgs& args) {
  LOPD_XATTN_DISPATCH(args.q.scalar_type(), "varlen_cross_attention_cpu_bwd", bwd_impl, args);
}

}  // namespace lopd::cpu::CPU_CAPABILITY
