// CUDA kernels of lopd::topk_tail_kl_cuda_fwd / _bwd (schemas: csrc/common/schemas.h): the
// first forward (variant "v1" of the switch topk_tail_kl.cuda_fwd; "v2" is
// topk_tail_kl_kernels_v2.cuh), the backward, and the device helpers both forwards share. Launched by
// topk_tail_kl_launch.cuh, which csrc/cuda/topk_tail_kl.cu (nvcc, the CUDA op) and
// csrc/emu/topk_tail_kl_emu.cpp (g++, the same kernels under the SIMT emulator, for CPU tests)
// include.
// The per-row arithmetic (online log-sum-exp, bucket masses, KL, gradient coefficients) is the
// __host__ __device__ code in csrc/common/topk_tail_kl_math.h, shared with the C++ CPU kernel, so
// the CPU tests exercise exactly the arithmetic this file runs.
//
// Forward, one thread block per row, one streaming pass over both logit rows:
//   * every thread loads 8 consecutive entries of the student and of the teacher per step
//     (16-byte vector loads for 16-bit inputs, 2 x 16 bytes for fp32) when the row is aligned;
//   * the running teacher top-M is a block-wide candidate buffer of sortable 64-bit keys
//     (orderable teacher logit << 32 | ~index: larger logit first, ties to the lower index) in
//     shared memory, with an admission threshold (the key of the current M-th entry). Entries
//     below the threshold can never be selected: their student and teacher logits go straight into
//     the thread's running tail log-sum-exps (registers). Entries above it are appended to the
//     buffer. When the buffer could overflow, the block sorts it (bitonic, shared memory), keeps
//     the first M keys, folds the dropped ones into the tails and raises the threshold. On
//     non-adversarial rows the threshold settles after the first tiles, so the sort runs a handful
//     of times per row and the kernel is bound by the logits' bytes;
//   * at the end the per-thread tails are merged (warp shuffles, then shared memory) and thread 0
//     finishes the row with topk_row_finalize.
// Backward, one block per row, one streaming pass per tensor: every entry gets the tail formula
// (its share of the tail mass times the tail's factor, math::bucket_grad_factors: bucket masses
// times finite numbers, no P_b/Q_b ratios), then, after a barrier, the M selected entries and the
// target are rewritten with their own factors.
#pragma once

#include <ATen/Dispatch.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "common/topk_tail_kl_checks.h"
#include "common/topk_tail_kl_math.h"
#include "cuda/simt.cuh"

namespace lopd::cuda {
namespace {

namespace math = ::lopd::topk_tail_kl;
namespace checks = ::lopd::topk_tail_kl;

constexpr int kThreads = 256;
constexpr int kVec = 8;                       // entries per thread per step
constexpr int kTile = kThreads * kVec;        // entries per block step
constexpr int kMaxTopM = 1024;                // largest supported top_m (selection buffer bound)
// Candidate buffer, in 64-bit keys: room for one tile of admissions on top of whatever is kept.
// A compaction leaves M <= kMaxTopM keys and runs before a tile whenever more than
// kBufCap - kTile are held, so kBufCap >= kTile + kMaxTopM guarantees progress. 4096 keys are
// 32 KB of dynamic shared memory per block: with the 48 registers ptxas reports for the forward
// (sm_90a), 5 blocks (1280 threads) fit on an SM, where a 64 KB buffer allowed only 3 (smem-
// bound); the kernel streams memory, so those resident warps are what keeps loads in flight.
constexpr int kBufCap = 4096;
constexpr int kSortCap = 4096;  // power of two >= kBufCap: the bitonic sort's padded size
static_assert(kBufCap - kTile >= kMaxTopM, "a compaction must leave room for a tile");
static_assert((kSortCap & (kSortCap - 1)) == 0 && kSortCap >= kBufCap, "sort size");
// The selection's 2 M scaled logits (floats) reuse the buffer above its first kBufCap / 2 keys,
// clear of the M selected keys at its start.
static_assert(kBufCap / 2 >= kMaxTopM, "s_top must not overlap the selected keys");
static_assert((kBufCap / 2) * 8 + 2 * kMaxTopM * 4 <= kSortCap * 8, "s_top/t_top must fit");

// ---- loading and storing 8 entries as fp32 -----------------------------------------------------

using ::lopd::simt::from_float;
using ::lopd::simt::to_float;

// Loads p[0..8) (vectorized when `aligned`), or entries up to `valid` (tail of the row; the rest
// are -inf, which every consumer treats as "no mass").
template <typename T>
__device__ __forceinline__ void load8(const T* p, int valid, bool aligned, float (&out)[kVec]) {
  if (aligned && valid == kVec) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
      out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] = to_float(v[i]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) out[i] = i < valid ? to_float(p[i]) : -INFINITY;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, int valid, bool aligned, const float (&in)[kVec]) {
  if (aligned && valid == kVec) {
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
    } else {
      uint4 raw;
      T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = from_float<T>(in[i]);
      *reinterpret_cast<uint4*>(p) = raw;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    if (i < valid) p[i] = from_float<T>(in[i]);
  }
}

// Whether 16-byte vector loads / stores may start at p (a null gradient pointer counts as
// aligned: it is never touched).
__device__ __forceinline__ bool is_aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Entries of a kVec-wide step starting at `base` that lie inside a row of V entries.
__device__ __forceinline__ int valid_in(int64_t V, int64_t base) {
  return V - base < kVec ? static_cast<int>(V - base) : kVec;
}

// ---- sortable keys -------------------------------------------------------------------------------

// Monotone map float -> uint32 (larger float, larger key); -inf maps above 0, so key 0 is free
// to mark empty slots.
__device__ __forceinline__ uint32_t orderable(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unorderable(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ uint64_t make_key(float t, int64_t idx) {
  return (static_cast<uint64_t>(orderable(t)) << 32) |
         static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(idx));
}
__device__ __forceinline__ int64_t key_index(uint64_t key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu));
}
__device__ __forceinline__ float key_value(uint64_t key) {
  return unorderable(static_cast<uint32_t>(key >> 32));
}

// Sorts keys[0..n) descending in place (n <= kSortCap); slots [n, pow2) are padded with 0.
__device__ void block_sort_desc(uint64_t* keys, int n) {
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += blockDim.x) keys[i] = 0;
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int partner = i ^ j;
        if (partner > i) {
          const bool desc = (i & k) == 0;
          const uint64_t a = keys[i];
          const uint64_t b = keys[partner];
          if (desc ? (a < b) : (a > b)) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// ---- block reductions of online log-sum-exp states ----------------------------------------------

__device__ __forceinline__ void warp_merge(math::LseState& st) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, st.max, off);
    const float os = __shfl_xor_sync(0xffffffffu, st.sum, off);
    math::lse_merge(st, om, os);
  }
}

// Merges every thread's state; the result is valid in all threads.
__device__ math::LseState block_merge(math::LseState st, float2* scratch) {
  warp_merge(st);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = make_float2(st.max, st.sum);
  __syncthreads();
  math::LseState all = math::lse_empty();
  for (int w = 0; w < kThreads / 32; ++w) math::lse_merge(all, scratch[w].x, scratch[w].y);
  __syncthreads();
  return all;
}

__device__ math::FullKLState block_merge_full(math::FullKLState st, math::FullKLState* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    math::FullKLState other;
    other.max_w = __shfl_xor_sync(0xffffffffu, st.max_w, off);
    other.sum_w = __shfl_xor_sync(0xffffffffu, st.sum_w, off);
    other.max_o = __shfl_xor_sync(0xffffffffu, st.max_o, off);
    other.sum_o = __shfl_xor_sync(0xffffffffu, st.sum_o, off);
    other.a = __shfl_xor_sync(0xffffffffu, st.a, off);
    math::full_kl_merge(st, other);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = st;
  __syncthreads();
  math::FullKLState all = math::full_kl_empty();
  for (int w = 0; w < kThreads / 32; ++w) math::full_kl_merge(all, scratch[w]);
  __syncthreads();
  return all;
}

// ---- forward ---------------------------------------------------------------------------------------

struct FwdParams {
  math::RowLayout s_layout, t_layout;  // where each logit row starts (strided rows in place)
  const int64_t* target;
  float* kl;
  float* slp;
  float* tlp;
  int64_t* ids;
  float* lse;
  float* bucket;
  int64_t n_rows, vocab, top_m, ignore_index;
  float inv;
  bool reverse;
};

// Dynamic shared memory: kSortCap uint64 keys (top-M mode only).
template <typename TS, typename TT>
__global__ void __launch_bounds__(kThreads)
    topk_tail_kl_fwd_kernel(const TS* __restrict__ student, const TT* __restrict__ teacher,
                            FwdParams p) {
  LOPD_EXTERN_SHARED(uint64_t, keys);
  __shared__ float2 lse_scratch[kThreads / 32];
  __shared__ math::FullKLState full_scratch[kThreads / 32];
  __shared__ int count;
  __shared__ uint64_t threshold;

  const int64_t row = blockIdx.x;
  const int64_t V = p.vocab;
  const int64_t M = p.top_m;
  const int64_t tgt = p.target[row];
  float* bucket = p.bucket + row * 2 * (M + 1);
  if (tgt == p.ignore_index) {
    // Every output of an ignored row is 0 and its logits are never read.
    for (int64_t i = threadIdx.x; i < 2 * (M + 1); i += blockDim.x) bucket[i] = 0.0f;
    for (int64_t i = threadIdx.x; i < M; i += blockDim.x) p.ids[row * M + i] = 0;
    if (threadIdx.x == 0) {
      p.kl[row] = p.slp[row] = p.tlp[row] = 0.0f;
      p.lse[2 * row] = p.lse[2 * row + 1] = 0.0f;
    }
    return;
  }
  const TS* s = student + p.s_layout.offset(row);
  const TT* t = teacher + p.t_layout.offset(row);
  // 8-entry vector loads at multiples of 8 from the row start: both rows 16-byte aligned.
  const bool aligned = is_aligned16(s) && is_aligned16(t);
  const float inv = p.inv;

  if (M == 0) {
    // Full vocabulary: each entry is its own bucket; one merged online state per thread.
    math::FullKLState st = math::full_kl_empty();
    for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
      const int valid = valid_in(V, base);
      float sv[kVec], tv[kVec];
      load8(s + base, valid, aligned, sv);
      load8(t + base, valid, aligned, tv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (i < valid) {
          if (p.reverse) {
            math::full_kl_add(st, sv[i] * inv, tv[i] * inv);
          } else {
            math::full_kl_add(st, tv[i] * inv, sv[i] * inv);
          }
        }
      }
    }
    st = block_merge_full(st, full_scratch);
    if (threadIdx.x == 0) {
      float lse_w, lse_o;
      const float kl = math::full_kl_finalize(st, &lse_w, &lse_o);
      const float lse_s = p.reverse ? lse_w : lse_o;
      const float lse_t = p.reverse ? lse_o : lse_w;
      p.kl[row] = kl;
      p.lse[2 * row] = lse_s;
      p.lse[2 * row + 1] = lse_t;
      bucket[0] = bucket[1] = 0.0f;  // the single "bucket" has mass 1 on both sides
      const bool ok = tgt >= 0 && tgt < V;
      p.slp[row] = ok ? math::log_normalize(to_float(s[tgt]) * inv, lse_s) : NAN;
      p.tlp[row] = ok ? math::log_normalize(to_float(t[tgt]) * inv, lse_t) : NAN;
    }
    return;
  }

  // Top-M mode.
  math::LseState tail_s = math::lse_empty();
  math::LseState tail_t = math::lse_empty();
  if (threadIdx.x == 0) {
    count = 0;
    threshold = 0;  // below every real key: everything is a candidate until M are kept
  }
  __syncthreads();

  // Sorts the buffer, keeps the best M, folds the rest into this thread's tails, and raises the
  // threshold once M keys are kept. Called by the whole block.
  auto compact = [&]() {
    const int n = count;
    block_sort_desc(keys, n);
    for (int i = int(M) + threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t k = keys[i];
      const int64_t idx = key_index(k);
      math::lse_add(tail_t, key_value(k));
      math::lse_add(tail_s, to_float(s[idx]) * inv);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (n >= M) {
        count = int(M);
        threshold = keys[M - 1];
      }
    }
    __syncthreads();
  };

  for (int64_t tile = 0; tile < V; tile += kTile) {
    // The block decides together whether to compact: every thread reads `count` and
    // `threshold`, then a barrier, and only then may a thread append (atomicAdd on `count`).
    // Without that barrier a fast thread's appends could reach a slow thread's read and the
    // block would split between compact()'s barriers and the end-of-tile one (the SIMT emulator
    // reports exactly that). The first compaction runs as soon as M candidates exist, so the
    // threshold is high from the second tile on and later tiles admit only a handful.
    const int n_candidates = count;
    const bool compact_now =
        n_candidates > kBufCap - kTile || (threshold == 0 && n_candidates >= M);
    __syncthreads();
    if (compact_now) compact();
    const uint64_t thr = threshold;
    const int64_t base = tile + int64_t(threadIdx.x) * kVec;
    if (base < V) {
      const int valid = valid_in(V, base);
      float sv[kVec], tv[kVec];
      load8(s + base, valid, aligned, sv);
      load8(t + base, valid, aligned, tv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (i < valid) {
          const float ts = tv[i] * inv;
          const uint64_t key = make_key(ts, base + i);
          if (key > thr) {
            keys[atomicAdd(&count, 1)] = key;
          } else {
            math::lse_add(tail_t, ts);
            math::lse_add(tail_s, sv[i] * inv);
          }
        }
      }
    }
    __syncthreads();
  }
  compact();

  tail_s = block_merge(tail_s, lse_scratch);
  tail_t = block_merge(tail_t, lse_scratch);

  // keys[0..M) are the selected entries, best first. Scaled logits of the selection go to the
  // (now free) upper part of the key buffer, reinterpreted as floats.
  float* s_top = reinterpret_cast<float*>(keys + kBufCap / 2);
  float* t_top = s_top + M;
  for (int64_t i = threadIdx.x; i < M; i += blockDim.x) {
    const int64_t idx = key_index(keys[i]);
    p.ids[row * M + i] = idx;
    t_top[i] = key_value(keys[i]);
    s_top[i] = to_float(s[idx]) * inv;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float lse_s, lse_t;
    p.kl[row] = math::topk_row_finalize(s_top, t_top, M, tail_s, tail_t, p.reverse, bucket,
                                        bucket + (M + 1), &lse_s, &lse_t);
    p.lse[2 * row] = lse_s;
    p.lse[2 * row + 1] = lse_t;
    const bool ok = tgt >= 0 && tgt < V;
    p.slp[row] = ok ? math::log_normalize(to_float(s[tgt]) * inv, lse_s) : NAN;
    p.tlp[row] = ok ? math::log_normalize(to_float(t[tgt]) * inv, lse_t) : NAN;
  }
}

// ---- backward --------------------------------------------------------------------------------------

struct BwdParams {
  math::RowLayout s_layout, t_layout;  // the logits' rows; the gradients are dense [N, V]
  const float* g_kl;
  const float* g_ls;
  const float* g_lt;
  const int64_t* target;
  const int64_t* ids;
  const float* kl;
  const float* lse;
  const float* bucket;
  int64_t vocab, top_m, ignore_index;
  float inv;
  bool reverse;
};

// One side (student or teacher) of a top-M row: x are that side's logits, k its bucket factors
// (k[M] = tail, see math::bucket_grad_factors), tail_lse the log-sum-exp of that side's tail.
// Streams the tail formula grad_j = exp(x_j / T - tail_lse) * k[M] / T over the whole row, then
// rewrites the M selected entries (share 1: no logit read) and the target. Called by the whole
// block.
template <typename T>
__device__ void bwd_topk_side(const T* x, T* g, int64_t V, int64_t M, const int64_t* ids,
                              const float* k, float tail_lse, float u_lp, int64_t tgt, float inv,
                              bool aligned) {
  const float kt = k[M] * inv;
  for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
    const int valid = valid_in(V, base);
    float xv[kVec], gv[kVec];
    load8(x + base, valid, aligned, xv);
    // Selected entries may exceed tail_lse here (share > 1, even inf): they are rewritten below.
#pragma unroll
    for (int i = 0; i < kVec; ++i) gv[i] = __expf(xv[i] * inv - tail_lse) * kt;
    store8(g + base, valid, aligned, gv);
  }
  // Global writes of this block are visible to the block after the barrier: the rewrites below
  // land after the streaming writes of the same addresses.
  __syncthreads();
  for (int64_t i = threadIdx.x; i <= M; i += blockDim.x) {
    if (i < M) {
      const int64_t id = ids[i];
      g[id] = from_float<T>(math::entry_grad(1.0f, k[i], u_lp, id == tgt, inv));
      continue;
    }
    // The target, unless it is one of the selected entries (then its thread handled it).
    bool selected = false;
    for (int64_t m = 0; m < M; ++m) selected |= ids[m] == tgt;
    if (!selected) {
      const float share = expf(to_float(x[tgt]) * inv - tail_lse);
      g[tgt] = from_float<T>(math::entry_grad(share, k[M], u_lp, true, inv));
    }
  }
}

// Dynamic shared memory: 2 * (M + 1) floats of bucket factors.
template <typename TS, typename TT>
__global__ void __launch_bounds__(kThreads)
    topk_tail_kl_bwd_kernel(const TS* __restrict__ student, const TT* __restrict__ teacher,
                            TS* grad_student, TT* grad_teacher, BwdParams p) {
  LOPD_EXTERN_SHARED(float, factors);
  const int64_t row = blockIdx.x;
  const int64_t V = p.vocab;
  const int64_t M = p.top_m;
  const int64_t tgt = p.target[row];
  TS* gs = grad_student != nullptr ? grad_student + row * V : nullptr;
  TT* gt = grad_teacher != nullptr ? grad_teacher + row * V : nullptr;
  const TS* s = student + p.s_layout.offset(row);
  const TT* t = teacher + p.t_layout.offset(row);
  const bool aligned =
      is_aligned16(s) && is_aligned16(t) && is_aligned16(gs) && is_aligned16(gt);
  if (tgt == p.ignore_index || tgt < 0 || tgt >= V) {
    // Ignored rows get zero gradient without reading their logits (out-of-range targets were
    // rejected by the op; this guard only keeps the kernel in bounds).
    const float zero[kVec] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
      const int valid = valid_in(V, base);
      if (gs != nullptr) store8(gs + base, valid, aligned, zero);
      if (gt != nullptr) store8(gt + base, valid, aligned, zero);
    }
    return;
  }
  const float lse_s = p.lse[2 * row];
  const float lse_t = p.lse[2 * row + 1];
  const float kl = p.kl[row];
  const float u_kl = p.g_kl[row];
  const float u_ls = p.g_ls[row];
  const float u_lt = p.g_lt[row];
  const float inv = p.inv;

  if (M == 0) {
    for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
      const int valid = valid_in(V, base);
      float sv[kVec], tv[kVec], gsv[kVec], gtv[kVec];
      load8(s + base, valid, aligned, sv);
      load8(t + base, valid, aligned, tv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float ls = math::log_normalize(sv[i] * inv, lse_s);
        const float lt = math::log_normalize(tv[i] * inv, lse_t);
        float ks, kt;
        math::bucket_grad_factors(ls, lt, kl, p.reverse, u_kl, u_ls, u_lt, &ks, &kt);
        const bool is_tgt = base + i == tgt;
        gsv[i] = math::entry_grad(1.0f, ks, u_ls, is_tgt, inv);
        gtv[i] = math::entry_grad(1.0f, kt, u_lt, is_tgt, inv);
      }
      if (gs != nullptr) store8(gs + base, valid, aligned, gsv);
      if (gt != nullptr) store8(gt + base, valid, aligned, gtv);
    }
    return;
  }

  const float* logp = p.bucket + row * 2 * (M + 1);
  const float* logq = logp + (M + 1);
  float* ks = factors;
  float* kt = factors + (M + 1);
  for (int64_t b = threadIdx.x; b <= M; b += blockDim.x) {
    math::bucket_grad_factors(logp[b], logq[b], kl, p.reverse, u_kl, u_ls, u_lt, &ks[b], &kt[b]);
  }
  __syncthreads();
  const int64_t* ids = p.ids + row * M;
  const float tail_s = math::bucket_lse(lse_s, logp[M]);
  const float tail_t = math::bucket_lse(lse_t, logq[M]);
  if (gs != nullptr) bwd_topk_side(s, gs, V, M, ids, ks, tail_s, u_ls, tgt, inv, aligned);
  if (gt != nullptr) bwd_topk_side(t, gt, V, M, ids, kt, tail_t, u_lt, tgt, inv, aligned);
}

}  // namespace
}  // namespace lopd::cuda
