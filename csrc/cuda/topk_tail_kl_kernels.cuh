// CUDA kernels of lopd::topk_tail_kl_cuda_fwd / _bwd (schemas: csrc/common/schemas.h): the
// natural-exponential forward ("natural_exp" of the kernel choice topk_tail_kl.cuda_forward;
// "base2" is topk_tail_kl_kernels_base2.cuh), the backward, and the device helpers both forwards
// share. Launched by
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
//     finishes the row with math::row_finalize (the KLs: topk_row_finalize; the JSD: its terms
//     over the same K + 1 bucket log-masses, no extra pass).
// The options (docs/kernels.md, "CUDA"):
//   * support="student": the same kernel instance with the rows' roles swapped (the launcher
//     passes the teacher's row first and the student's second, FwdParams::swapped): the keys are
//     built from the student's logits; the finalization maps the roles back;
//   * support="union" (template flag kUnion, a kernel instance of its own): two candidate buffers
//     and two thresholds in one pass, one on each row's keys. An entry joins the tails when
//     neither buffer admits it; a compaction sorts both buffers and folds a dropped key only when
//     the other selection does not hold it (a threshold compare on the other row's key, whose
//     logit is re-read), so each entry is folded once, when it is out of both. Then the ids:
//     the teacher's M, the student's others in student order, -1 padding to 2M. Twice the shared
//     memory (64 KB), one more key compare per entry, both buffers sorted at each compaction;
//   * full vocabulary (top_m == 0) with the JSD: two passes (both log-sum-exps, then the terms
//     beta KL(Q || M) + (1 - beta) KL(P || M)).
// Backward, one block per row, one streaming pass per tensor: every entry gets the tail formula
// (its share of the tail mass times the tail's factor, math::bucket_grad_factors_div: bucket
// masses times finite numbers, no P_b/Q_b ratios; the JSD's need KL(P || M) and KL(Q || M) of the
// row, O(K) from bucket_logp by math::jsd_mixture_kls), then, after a barrier, the K selected
// entries (a union's -1 slots skipped) and the target are rewritten with their own factors. The
// full-vocabulary JSD takes one more pass first (KL(P || M), KL(Q || M) over the row).
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
// The union (support="union"): a second buffer of kSortCap keys (the student's candidates) and
// its count and threshold after it. Its K = 2 M bucket logits per side fill the first buffer's
// upper half; the student's selection is staged (s, t, whether new) in the second's.
static_assert((kBufCap / 2) * 8 + 4 * kMaxTopM * 4 <= kSortCap * 8, "union s_top/t_top must fit");
static_assert((kBufCap / 2) * 8 + 3 * kMaxTopM * 4 <= kSortCap * 8, "union staging must fit");
constexpr size_t kUnionSmemBytes = 2 * kSortCap * sizeof(uint64_t) + 2 * sizeof(uint64_t);

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

// Sums a and b over the block; the sums are valid in all threads.
__device__ void block_sum2(float& a, float& b, float2* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = make_float2(a, b);
  __syncthreads();
  a = b = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) {
    a += scratch[w].x;
    b += scratch[w].y;
  }
  __syncthreads();
}

// ---- the generalized JSD ---------------------------------------------------------------------------

// KL(P || M) and KL(Q || M) of a full-vocabulary row (every entry its own bucket) from both rows
// and their log-sum-exps, by the shared math (math::jsd_log_mixture, kl_to_mixture_term); valid
// in all threads. The second pass of natural_exp's full-vocabulary JSD forward, the first of the backward.
template <typename TS, typename TT>
__device__ void full_jsd_kls(const TS* s, const TT* t, int64_t V, float inv, float lse_s,
                             float lse_t, float beta, bool aligned, float* k_p, float* k_q) {
  __shared__ float2 scratch[kThreads / 32];
  float kp = 0.0f, kq = 0.0f;
  for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
    const int valid = valid_in(V, base);
    float sv[kVec], tv[kVec];
    load8(s + base, valid, aligned, sv);
    load8(t + base, valid, aligned, tv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      // Past the row: -inf on both sides, which adds 0.
      const float ls = math::log_normalize(sv[i] * inv, lse_s);
      const float lt = math::log_normalize(tv[i] * inv, lse_t);
      const float lm = math::jsd_log_mixture(ls, lt, beta);
      kp += math::kl_to_mixture_term(ls, lm);
      kq += math::kl_to_mixture_term(lt, lm);
    }
  }
  block_sum2(kp, kq, scratch);
  *k_p = kp;
  *k_q = kq;
}

// KL(P || M) and KL(Q || M) over a row's nb buckets (math::jsd_mixture_kls on a contiguous
// slice per thread, then summed over the block); valid in all threads.
__device__ void bucket_jsd_kls(const float* logp, const float* logq, int64_t nb, float beta,
                               float* k_p, float* k_q) {
  __shared__ float2 scratch[kThreads / 32];
  const int64_t per = (nb + kThreads - 1) / kThreads;
  const int64_t b0 = int64_t(threadIdx.x) * per;
  const int64_t n = b0 < nb ? (nb - b0 < per ? nb - b0 : per) : 0;
  float kp = 0.0f, kq = 0.0f;
  math::jsd_mixture_kls(logp + b0, logq + b0, n, beta, &kp, &kq);
  block_sum2(kp, kq, scratch);
  *k_p = kp;
  *k_q = kq;
}

// ---- forward ---------------------------------------------------------------------------------------

struct FwdParams {
  // The kernel's two rows (s, t): the student's and the teacher's, or, with `swapped`
  // (support="student"), the teacher's and the student's. The selection is always on t's logits;
  // the outputs are always (student, teacher) (finalize_topm_row, write_target_logprobs).
  math::RowLayout s_layout, t_layout;  // where each row starts (strided rows in place)
  const int64_t* target;
  float* kl;
  float* slp;
  float* tlp;
  int64_t* ids;
  float* lse;
  float* bucket;
  int64_t n_rows, vocab, top_m, ignore_index;
  int64_t width;  // K: ids per row (M; 2 M for the union; 0 for the full vocabulary)
  float inv;
  math::DivergenceSpec div;
  bool swapped;
};

// The target's log-probabilities (one thread); s, t in the kernel's roles.
template <typename TS, typename TT>
__device__ __forceinline__ void write_target_logprobs(const FwdParams& p, int64_t row, int64_t tgt,
                                                      const TS* s, const TT* t, float lse_s,
                                                      float lse_t) {
  if (!(tgt >= 0 && tgt < p.vocab)) {
    p.slp[row] = p.tlp[row] = NAN;
    return;
  }
  const float xs = to_float(s[tgt]) * p.inv;
  const float xt = to_float(t[tgt]) * p.inv;
  p.slp[row] = math::log_normalize(p.swapped ? xt : xs, lse_s);
  p.tlp[row] = math::log_normalize(p.swapped ? xs : xt, lse_t);
}

// Thread 0 of a top-M row: the K + 1 buckets and the divergence (math::row_finalize: the KLs'
// topk_row_finalize, or the JSD over the same buckets), the log-sum-exps and the target's
// log-probabilities. s_top / t_top (the K selected entries' scaled logits, -inf at a union's
// padding) and the tails are in the kernel's roles; with p.swapped they are mapped back here.
template <typename TS, typename TT>
__device__ __forceinline__ void finalize_topm_row(const FwdParams& p, int64_t row, int64_t tgt,
                                                  const TS* s, const TT* t, const float* s_top,
                                                  const float* t_top,
                                                  const math::LseState& tail_s,
                                                  const math::LseState& tail_t) {
  const int64_t K = p.width;
  const bool sw = p.swapped;
  float* bucket = p.bucket + row * 2 * (K + 1);
  float lse_s, lse_t;
  p.kl[row] = math::row_finalize(sw ? t_top : s_top, sw ? s_top : t_top, K, sw ? tail_t : tail_s,
                                 sw ? tail_s : tail_t, p.div, bucket, bucket + (K + 1), &lse_s,
                                 &lse_t);
  p.lse[2 * row] = lse_s;
  p.lse[2 * row + 1] = lse_t;
  write_target_logprobs(p, row, tgt, s, t, lse_s, lse_t);
}

// Full-vocabulary JSD row (natural_exp): both log-sum-exps (a pass, math::lse_add per entry), then the
// terms beta KL(Q || M) + (1 - beta) KL(P || M) (full_jsd_kls, a second pass). Whole block.
template <typename TS, typename TT>
__device__ void fwd_full_jsd_row(const FwdParams& p, int64_t row, int64_t tgt, const TS* s,
                                 const TT* t, bool aligned, float* bucket) {
  __shared__ float2 scratch[kThreads / 32];
  const int64_t V = p.vocab;
  const float inv = p.inv;
  math::LseState st_s = math::lse_empty();
  math::LseState st_t = math::lse_empty();
  for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
    const int valid = valid_in(V, base);
    float sv[kVec], tv[kVec];
    load8(s + base, valid, aligned, sv);
    load8(t + base, valid, aligned, tv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      math::lse_add(st_s, sv[i] * inv);  // past the row: -inf, adds nothing
      math::lse_add(st_t, tv[i] * inv);
    }
  }
  const float lse_s = math::lse_value(block_merge(st_s, scratch));
  const float lse_t = math::lse_value(block_merge(st_t, scratch));
  const float beta = p.div.beta;
  float k_p, k_q;
  full_jsd_kls(s, t, V, inv, lse_s, lse_t, beta, aligned, &k_p, &k_q);
  if (threadIdx.x == 0) {
    p.kl[row] = beta * k_q + (1.0f - beta) * k_p;
    p.lse[2 * row] = lse_s;
    p.lse[2 * row + 1] = lse_t;
    bucket[0] = bucket[1] = 0.0f;  // the single "bucket" has mass 1 on both sides
    write_target_logprobs(p, row, tgt, s, t, lse_s, lse_t);
  }
}

// The end of a union row (whole block): keys[0..M) and keys_s[0..M) are the teacher's and the
// student's selections, best first (after the last compaction), tail_s / tail_t the block's merged
// tails (natural logarithms). Writes ids [K = 2 M]: the teacher's M (teacher order), then the
// student's ids that the teacher's selection does not hold (student order; an entry is held when
// its teacher key reaches the teacher's M-th), then -1 with -inf logits on both sides; thread 0
// then finalizes the row (finalize_topm_row). The K bucket logits per side go to the upper part of
// the teacher's buffer; the student's selection is staged in the upper part of its own.
template <typename TS, typename TT>
__device__ void finish_union_row(uint64_t* keys, uint64_t* keys_s, const TS* s, const TT* t,
                                 const math::LseState& tail_s, const math::LseState& tail_t,
                                 const FwdParams& p, int64_t row, int64_t tgt) {
  const int64_t M = p.top_m;
  const int64_t K = p.width;
  const float inv = p.inv;
  float* s_top = reinterpret_cast<float*>(keys + kBufCap / 2);
  float* t_top = s_top + K;
  float* s_new = reinterpret_cast<float*>(keys_s + kBufCap / 2);
  float* t_new = s_new + M;
  int* is_new = reinterpret_cast<int*>(t_new + M);
  const uint64_t thr_t = keys[M - 1];
  for (int64_t i = threadIdx.x; i < M; i += blockDim.x) {
    const int64_t idx = key_index(keys[i]);
    p.ids[row * K + i] = idx;
    t_top[i] = key_value(keys[i]);
    s_top[i] = to_float(s[idx]) * inv;
    const int64_t idx_s = key_index(keys_s[i]);
    s_new[i] = key_value(keys_s[i]);
    t_new[i] = to_float(t[idx_s]) * inv;
    is_new[i] = make_key(t_new[i], idx_s) < thr_t;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t k = M;
  for (int64_t i = 0; i < M; ++i) {
    if (!is_new[i]) continue;
    p.ids[row * K + k] = key_index(keys_s[i]);
    s_top[k] = s_new[i];
    t_top[k] = t_new[i];
    ++k;
  }
  for (; k < K; ++k) {
    p.ids[row * K + k] = -1;
    s_top[k] = t_top[k] = -INFINITY;
  }
  finalize_topm_row(p, row, tgt, s, t, s_top, t_top, tail_s, tail_t);
}

// Dynamic shared memory: kSortCap uint64 keys (top-M mode; none for the full vocabulary), the
// union (kUnion) kUnionSmemBytes: the teacher's buffer, the student's, then the student buffer's
// count and threshold.
template <typename TS, typename TT, bool kUnion = false>
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
  const int64_t K = p.width;
  const int64_t tgt = p.target[row];
  float* bucket = p.bucket + row * 2 * (K + 1);
  if (tgt == p.ignore_index) {
    // Every output of an ignored row is 0 and its logits are never read.
    for (int64_t i = threadIdx.x; i < 2 * (K + 1); i += blockDim.x) bucket[i] = 0.0f;
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x) p.ids[row * K + i] = 0;
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

  if (!kUnion && M == 0) {
    if (p.div.kind == math::kJsd) {
      fwd_full_jsd_row(p, row, tgt, s, t, aligned, bucket);
      return;
    }
    // Full vocabulary: each entry is its own bucket; one merged online state per thread.
    const bool reverse = p.div.kind == math::kReverse;
    math::FullKLState st = math::full_kl_empty();
    for (int64_t base = int64_t(threadIdx.x) * kVec; base < V; base += kTile) {
      const int valid = valid_in(V, base);
      float sv[kVec], tv[kVec];
      load8(s + base, valid, aligned, sv);
      load8(t + base, valid, aligned, tv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (i < valid) {
          if (reverse) {
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
      const float lse_s = reverse ? lse_w : lse_o;
      const float lse_t = reverse ? lse_o : lse_w;
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

  // Top-M mode. The union's student buffer, with its count and threshold after it.
  [[maybe_unused]] uint64_t* keys_s = keys + kSortCap;
  [[maybe_unused]] int* count_s = reinterpret_cast<int*>(keys + 2 * kSortCap);
  [[maybe_unused]] uint64_t* threshold_s = keys + 2 * kSortCap + 1;
  math::LseState tail_s = math::lse_empty();
  math::LseState tail_t = math::lse_empty();
  if (threadIdx.x == 0) {
    count = 0;
    threshold = 0;  // below every real key: everything is a candidate until M are kept
    if constexpr (kUnion) {
      *count_s = 0;
      *threshold_s = 0;
    }
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

  // The union's compaction: both buffers sorted, each keeps its best M. A key dropped from one
  // buffer joins the tails only when the other selection does not hold its entry, which is a
  // compare of the entry's key in the other row (its logit re-read) against that selection's
  // threshold: the student's after this compaction for the teacher's dropped keys, the
  // teacher's before it for the student's, so an entry dropped from both at once is folded once
  // (on the teacher's side). A threshold of 0 (fewer than M kept) holds every entry seen.
  auto compact_union = [&]() {
    const int n = count;
    const int n_s = *count_s;
    block_sort_desc(keys, n);
    block_sort_desc(keys_s, n_s);
    const uint64_t thr_t_old = threshold;
    const uint64_t thr_t_new = n >= M ? keys[M - 1] : thr_t_old;
    const uint64_t thr_s_new = n_s >= M ? keys_s[M - 1] : *threshold_s;
    for (int i = int(M) + threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t k = keys[i];
      const int64_t idx = key_index(k);
      const float ss = to_float(s[idx]) * inv;
      if (make_key(ss, idx) < thr_s_new) {
        math::lse_add(tail_t, key_value(k));
        math::lse_add(tail_s, ss);
      }
    }
    for (int i = int(M) + threadIdx.x; i < n_s; i += blockDim.x) {
      const uint64_t k = keys_s[i];
      const int64_t idx = key_index(k);
      const float ts = to_float(t[idx]) * inv;
      if (make_key(ts, idx) < thr_t_old) {
        math::lse_add(tail_t, ts);
        math::lse_add(tail_s, key_value(k));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (n >= M) {
        count = int(M);
        threshold = thr_t_new;
      }
      if (n_s >= M) {
        *count_s = int(M);
        *threshold_s = thr_s_new;
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
    bool compact_now = n_candidates > kBufCap - kTile || (threshold == 0 && n_candidates >= M);
    [[maybe_unused]] uint64_t thr_s = 0;
    if constexpr (kUnion) {
      const int n_s = *count_s;
      thr_s = *threshold_s;
      compact_now = compact_now || n_s > kBufCap - kTile || (thr_s == 0 && n_s >= M);
    }
    __syncthreads();
    if constexpr (kUnion) {
      if (compact_now) compact_union();
      thr_s = *threshold_s;
    } else {
      if (compact_now) compact();
    }
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
          if constexpr (kUnion) {
            // A candidate of either selection, or a tail entry of both.
            const float ss = sv[i] * inv;
            const uint64_t key_s = make_key(ss, base + i);
            const bool in_t = key > thr;
            const bool in_s = key_s > thr_s;
            if (in_t) keys[atomicAdd(&count, 1)] = key;
            if (in_s) keys_s[atomicAdd(count_s, 1)] = key_s;
            if (!in_t && !in_s) {
              math::lse_add(tail_t, ts);
              math::lse_add(tail_s, ss);
            }
          } else {
            if (key > thr) {
              keys[atomicAdd(&count, 1)] = key;
            } else {
              math::lse_add(tail_t, ts);
              math::lse_add(tail_s, sv[i] * inv);
            }
          }
        }
      }
    }
    __syncthreads();
  }
  if constexpr (kUnion) {
    compact_union();
  } else {
    compact();
  }

  tail_s = block_merge(tail_s, lse_scratch);
  tail_t = block_merge(tail_t, lse_scratch);

  if constexpr (kUnion) {
    finish_union_row(keys, keys_s, s, t, tail_s, tail_t, p, row, tgt);
    return;
  }
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
  if (threadIdx.x == 0) finalize_topm_row(p, row, tgt, s, t, s_top, t_top, tail_s, tail_t);
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
  int64_t vocab;
  int64_t top_m;  // K, the width of ids: M, or 2 M for a union (whose -1 slots are skipped)
  int64_t ignore_index;
  float inv;
  math::DivergenceSpec div;
};

// One side (student or teacher) of a top-M row: x are that side's logits, k its bucket factors
// (k[M] = tail, see math::bucket_grad_factors), tail_lse the log-sum-exp of that side's tail.
// Streams the tail formula grad_j = exp(x_j / T - tail_lse) * k[M] / T over the whole row, then
// rewrites the M selected entries (share 1: no logit read; a -1 slot, a union's padding, is
// skipped) and the target. M here is K, the width of ids. Called by the whole block.
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
      if (id < 0) continue;
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

// Full-vocabulary JSD row: KL(P || M) and KL(Q || M) first (full_jsd_kls, a pass), then the
// gradients (math::bucket_grad_factors_jsd per entry, every entry its own bucket). Whole block.
template <typename TS, typename TT>
__device__ void bwd_full_jsd_row(const TS* s, const TT* t, TS* gs, TT* gt, int64_t V, float lse_s,
                                 float lse_t, float beta, float u_kl, float u_ls, float u_lt,
                                 int64_t tgt, float inv, bool aligned) {
  float k_p, k_q;
  full_jsd_kls(s, t, V, inv, lse_s, lse_t, beta, aligned, &k_p, &k_q);
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
      math::bucket_grad_factors_jsd(ls, lt, beta, k_p, k_q, u_kl, u_ls, u_lt, &ks, &kt);
      const bool is_tgt = base + i == tgt;
      gsv[i] = math::entry_grad(1.0f, ks, u_ls, is_tgt, inv);
      gtv[i] = math::entry_grad(1.0f, kt, u_lt, is_tgt, inv);
    }
    if (gs != nullptr) store8(gs + base, valid, aligned, gsv);
    if (gt != nullptr) store8(gt + base, valid, aligned, gtv);
  }
}

// Dynamic shared memory: 2 * (K + 1) floats of bucket factors (K = p.top_m, the width of ids).
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

  if (M == 0 && p.div.kind == math::kJsd) {
    bwd_full_jsd_row(s, t, gs, gt, V, lse_s, lse_t, p.div.beta, u_kl, u_ls, u_lt, tgt, inv,
                     aligned);
    return;
  }
  if (M == 0) {
    const bool reverse = p.div.kind == math::kReverse;
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
        math::bucket_grad_factors(ls, lt, kl, reverse, u_kl, u_ls, u_lt, &ks, &kt);
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
  // The JSD's factors need KL(P || M) and KL(Q || M) of the row: O(K) from the buckets.
  float k_p = 0.0f, k_q = 0.0f;
  if (p.div.kind == math::kJsd) bucket_jsd_kls(logp, logq, M + 1, p.div.beta, &k_p, &k_q);
  for (int64_t b = threadIdx.x; b <= M; b += blockDim.x) {
    math::bucket_grad_factors_div(logp[b], logq[b], kl, p.div, k_p, k_q, u_kl, u_ls, u_lt, &ks[b],
                                  &kt[b]);
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
