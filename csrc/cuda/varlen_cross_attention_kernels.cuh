// CUDA-core kernels of lopd::varlen_cross_attention_cuda_fwd / _bwd (schemas:
// csrc/common/schemas.h; the math: the docstring of lopd_kernels/varlen_cross_attention.py), and
// the shapes, constants and device helpers every kernel of the op shares. The tensor-core kernels
// are varlen_cross_attention_kernels_wmma.cuh; both are launched by
// varlen_cross_attention_launch.cuh, which csrc/cuda/varlen_cross_attention.cu (nvcc, the CUDA
// op) and csrc/emu/varlen_cross_attention_emu.cpp (g++, the same kernels under the SIMT
// emulator, for CPU tests) include.
//
// Two sets of kernels, picked by the host launchers (use_wmma): bf16 / fp16 inputs with
// D % 16 == 0 and D <= 128 run the tensor-core (nvcuda::wmma) kernels of
// varlen_cross_attention_kernels_wmma.cuh; fp32 inputs and other head dims run the CUDA-core
// kernels described here: plain fp32 FMA code (inputs converted to fp32 when staged in shared memory, every dot
// product and accumulator fp32, outputs rounded once). Both share delta_kernel.
//
// Layout: q [B, Lq, Hq, D], k/v packed [total_k, Hkv, D], cu_seqlens_k int32 [B+1], out like q,
// lse fp32 [B, Hq, Lq]. Query head h uses kv head g = h / G (G = Hq / Hkv). Without a causal mask
// the G heads of a group are just G * Lq independent query rows against the same keys, so every
// kernel works on "rows" r in [0, G * Lq) of one (item b, kv head g): head h = g * G + r / Lq,
// position i = r % Lq. In the lse layout the rows of (b, g) are contiguous:
// lse[(b * Hq + g * G) * Lq + r].
//
// Forward (one block per (item, kv head, chunk of 4 * warps rows)): the block's rows are staged
// in shared memory (pre-scaled by `scale`); the item's keys stream through shared memory in tiles
// of 32. Each warp owns 4 rows. Per tile, two phases, each with the thread layout that makes its
// shared-memory reads conflict-free:
//   1. scores: lane j owns key j of the tile and computes its score against the warp's 4 rows
//      (q reads are warp broadcasts; k rows are stored with an odd stride, so the 32 lanes hit
//      32 banks). Scores go to a per-warp shared buffer; every lane then reads the tile's
//      row maximum from it, rescales the running state (online softmax) and stores p;
//   2. P @ V: lane c owns output dims c, c + 32, ... (ceil(D / 32) <= 8 of them, a template
//      parameter) and accumulates sum_j p_j v_j[d] (p reads are broadcasts).
// The row maximum is read from shared memory rather than reduced with shuffles: one __syncwarp
// per tile instead of 4 rows x 5 shuffles. The softmax denominator is kept per lane (each lane
// sums the p of its own keys, all lanes rescale by the same warp-uniform maximum) and reduced once
// at the end.
//
// Backward: delta_i = <do_i, out_i> - dlse_i (a small pre-pass kernel, one warp per row), then
//   * dQ (same grid and phases as the forward, no online softmax: p = exp(s - lse) from the saved
//     lse): ds_ij = p_ij (<do_i, v_j> - delta_i), dq_i = scale * sum_j ds_ij k_j;
//   * dK/dV (one block per (item, kv head, tile of 32 keys)): the tile's k/v stay in shared
//     memory while all G * Lq query rows of the kv head stream through in chunks of 32 (they are
//     few: 128 for the QFormer); phase 1 computes p and ds of the chunk x tile (lane = key), phase
//     2 accumulates dk, dv (each warp owns 4 keys, lane = dims). Every key belongs to exactly one
//     block, so dk/dv need no atomics, and a GQA group's query heads are summed in registers.
//
// Empty items: the forward writes out = 0, lse = -inf and dQ writes dq = 0 without reading lse, so
// no exp(-inf - -inf) NaN is ever formed; they own no keys, so dK/dV never sees them.
//
// Expected speed (never measured on a GPU): per kv head the forward does 4 * rows * T * D flops
// (scores, P @ V) on 4 * T * D bytes of bf16 k/v, i.e. `rows` flop/byte (G * Lq = 128 for the
// QFormer); the backward 14 * rows * T * D (dQ recomputes s and dp: 6, dK/dV: 8). That is far
// above the fp32 CUDA-core ridge point (~14 flop/byte on an H100/H200), so these kernels are
// bound by arithmetic (and by the shared-memory loads feeding each FMA in phase 1), where
// tensor-core kernels (Triton's tl.dot, flash-attn, the WMMA kernels) have ~15x the peak.
#pragma once

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/simt.cuh"

namespace lopd::cuda::varlen_xattn {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerWarp = 4;  // query rows a warp owns in the forward and dQ kernels
constexpr int kMaxWarps = 8;     // forward / dQ blocks: up to 8 warps = 32 rows
constexpr int kKeyTile = 32;     // keys per shared-memory tile (one per lane in phase 1)
constexpr int kBwdWarps = 8;     // dK/dV blocks: 256 threads
constexpr int kKeysPerWarp = kKeyTile / kBwdWarps;          // dK/dV phase 2: keys a warp owns
constexpr int kRowChunk = kBwdWarps * kRowsPerWarp;         // dK/dV: query rows per chunk
constexpr int kMaxHeadDim = 256;                            // 8 dims per lane
constexpr unsigned kFull = 0xffffffffu;
// The forward, dQ and dK/dV kernels declare __launch_bounds__(256, 2): up to 128 registers per
// thread and two 8-warp blocks per SM. Without the minimum, ptxas aimed at 64 registers and
// spilled the D <= 128 instances (the compile check fails on spills); with a minimum of 1 it took
// 130. These kernels are bound by FMAs and the shared-memory loads feeding them, so the 4-row
// register blocking matters more than occupancy beyond 16 warps per SM.

using ::lopd::simt::from_float;
using ::lopd::simt::to_float;

// Shared-memory row stride (floats) of a k/v tile: odd, so that lane j reading element d of row j
// hits bank (j * stride + d) % 32, distinct for the 32 lanes.
__host__ __device__ __forceinline__ int kv_stride(int D) { return D % 2 == 0 ? D + 1 : D; }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) x += __shfl_xor_sync(kFull, x, off);
  return x;
}

struct Shape {
  int64_t batch, lq, hq, hkv, d;
  int64_t group;  // G = hq / hkv
  int64_t rows;   // G * lq: query rows per (item, kv head)
  float scale;
};

// Offset of element 0 of query row r of (item b, kv head g) in a [B, Lq, Hq, D] tensor.
__device__ __forceinline__ int64_t q_offset(const Shape& s, int64_t b, int64_t g, int64_t r) {
  const int64_t h = g * s.group + r / s.lq;
  const int64_t i = r % s.lq;
  return ((b * s.lq + i) * s.hq + h) * s.d;
}

// Offset of the lse / delta entry of query row r of (b, g) in a [B, Hq, Lq] tensor.
__device__ __forceinline__ int64_t lse_offset(const Shape& s, int64_t b, int64_t g, int64_t r) {
  return (b * s.hq + g * s.group) * s.lq + r;
}

// Stages keys [key0, key0 + n) of kv head g from packed [total_k, Hkv, D] into a fp32 tile of
// kKeyTile rows with stride kv_stride(D); rows past n are zero (their scores are masked anyway).
// Called by the whole block.
template <typename T>
__device__ __forceinline__ void load_kv_tile(const T* __restrict__ src, float* tile,
                                             const Shape& s, int64_t key0, int n, int64_t g) {
  const int D = int(s.d);
  const int stride = kv_stride(D);
  for (int e = threadIdx.x; e < kKeyTile * D; e += blockDim.x) {
    const int j = e / D;
    const int d = e % D;
    tile[j * stride + d] =
        j < n ? to_float(src[((key0 + j) * s.hkv + g) * s.d + d]) : 0.0f;
  }
}

// Stages query-layout rows [row0, row0 + n_rows) of (b, g) as fp32 [n_rows, D] times `mul`;
// rows past s.rows are zero. Called by the whole block.
template <typename T>
__device__ __forceinline__ void load_rows(const T* __restrict__ src, float* dst, const Shape& s,
                                          int64_t b, int64_t g, int64_t row0, int n_rows,
                                          float mul) {
  const int D = int(s.d);
  for (int e = threadIdx.x; e < n_rows * D; e += blockDim.x) {
    const int rr = e / D;
    const int d = e % D;
    const int64_t r = row0 + rr;
    dst[e] = r < s.rows ? to_float(src[q_offset(s, b, g, r) + d]) * mul : 0.0f;
  }
}

// out[m] = <xs + m * row_step, y> over D for the kRowsPerWarp rows m (phase 1: one key y, the
// warp's query rows). Even and odd dims go to separate accumulators: shorter dependency chains
// (ILP) and a smaller rounding error than one running sum over D.
__device__ __forceinline__ void row_dots(const float* xs, int row_step, const float* y,
                                         float (&out)[kRowsPerWarp], int D) {
  float even[kRowsPerWarp] = {}, odd[kRowsPerWarp] = {};
  int d = 0;
  for (; d + 1 < D; d += 2) {
    const float y0 = y[d], y1 = y[d + 1];
#pragma unroll
    for (int m = 0; m < kRowsPerWarp; ++m) {
      even[m] += xs[m * row_step + d] * y0;
      odd[m] += xs[m * row_step + d + 1] * y1;
    }
  }
#pragma unroll
  for (int m = 0; m < kRowsPerWarp; ++m) {
    if (d < D) even[m] += xs[m * row_step + d] * y[d];
    out[m] = even[m] + odd[m];
  }
}

// Phase 2 (lane = dims lane, lane + 32, ...): acc[r] += w[r * kKeyTile + j] * x_j over the tile's
// n keys j (x_j at x + j * stride) for the warp's first n_rows rows; each x row is loaded once
// for all of them.
template <int NPL>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kRowsPerWarp][NPL], const float* w,
                                                const float* x, int n, int n_rows, int stride,
                                                int D, int lane) {
  for (int j = 0; j < n; ++j) {
    float xj[NPL];
#pragma unroll
    for (int c = 0; c < NPL; ++c) {
      const int d = lane + c * kWarp;
      xj[c] = d < D ? x[j * stride + d] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (r >= n_rows) continue;
      const float wr = w[r * kKeyTile + j];
#pragma unroll
      for (int c = 0; c < NPL; ++c) acc[r][c] += wr * xj[c];
    }
  }
}

// Query rows of this warp that exist: rows past s.rows are skipped by the whole warp (their
// validity is warp-uniform).
__device__ __forceinline__ int warp_rows(const Shape& s, int64_t row0, int warp) {
  const int64_t left = s.rows - (row0 + int64_t(warp) * kRowsPerWarp);
  return left < 0 ? 0 : (left > kRowsPerWarp ? kRowsPerWarp : int(left));
}

// Zeros query-layout rows [row0, row0 + n_rows) of (b, g) (an empty item's output / dq).
// Called by the whole block.
template <typename T>
__device__ __forceinline__ void zero_rows(T* dst, const Shape& s, int64_t b, int64_t g,
                                          int64_t row0, int n_rows) {
  const int D = int(s.d);
  for (int e = threadIdx.x; e < n_rows * D; e += blockDim.x) {
    const int64_t r = row0 + e / D;
    if (r < s.rows) dst[q_offset(s, b, g, r) + e % D] = from_float<T>(0.0f);
  }
}

// ---- forward -----------------------------------------------------------------------------------

// Grid (B, Hkv, row chunks), block 32 * warps threads (rows per block: 4 * warps).
// Dynamic shared memory (floats): q [rpb * D] | k tile | v tile [kKeyTile * stride each] |
// scores, p [rpb * kKeyTile each].
template <typename T, int NPL>
__global__ void __launch_bounds__(kMaxWarps * kWarp, 2)
    fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const int* __restrict__ cu, T* __restrict__ out, float* __restrict__ lse,
               Shape s) {
  LOPD_EXTERN_SHARED(float, smem);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int rpb = int(blockDim.x / kWarp) * kRowsPerWarp;
  const int64_t row0 = int64_t(blockIdx.z) * rpb;
  const int D = int(s.d);
  const int stride = kv_stride(D);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t key_begin = cu[b];
  const int64_t n_keys = cu[b + 1] - key_begin;

  if (n_keys == 0) {
    // Empty item (block-uniform): out = 0, lse = -inf, no key is read.
    zero_rows(out, s, b, g, row0, rpb);
    for (int rr = threadIdx.x; rr < rpb; rr += blockDim.x) {
      if (row0 + rr < s.rows) lse[lse_offset(s, b, g, row0 + rr)] = -INFINITY;
    }
    return;
  }

  float* q_s = smem;
  float* k_s = q_s + rpb * D;
  float* v_s = k_s + kKeyTile * stride;
  float* s_w = v_s + kKeyTile * stride;     // this warp's scores: s_w[warp rows][key]
  float* p_w = s_w + rpb * kKeyTile;        // and probabilities
  s_w += warp * kRowsPerWarp * kKeyTile;
  p_w += warp * kRowsPerWarp * kKeyTile;

  load_rows(q, q_s, s, b, g, row0, rpb, s.scale);  // pre-scaled: scores are dot products
  const float* q_w = q_s + warp * kRowsPerWarp * D;
  const int n_rows = warp_rows(s, row0, warp);

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][NPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;  // running max (warp-uniform)
    l[r] = 0.0f;       // this lane's share of the running denominator
#pragma unroll
    for (int c = 0; c < NPL; ++c) acc[r][c] = 0.0f;
  }

  for (int64_t t0 = 0; t0 < n_keys; t0 += kKeyTile) {
    const int n = n_keys - t0 < kKeyTile ? int(n_keys - t0) : kKeyTile;
    __syncthreads();  // the previous tile (and q staging) is done with
    load_kv_tile(k, k_s, s, key_begin + t0, n, g);
    load_kv_tile(v, v_s, s, key_begin + t0, n, g);
    __syncthreads();

    // Phase 1: lane = key. Every tile has at least one valid key, so the tile maximum is finite.
    float sc[kRowsPerWarp];
    row_dots(q_w, D, k_s + lane * stride, sc, D);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s_w[r * kKeyTile + lane] = lane < n ? sc[r] : -INFINITY;
    __syncwarp(kFull);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (r >= n_rows) continue;
      float tile_max = -INFINITY;
      for (int j = 0; j < n; ++j) tile_max = fmaxf(tile_max, s_w[r * kKeyTile + j]);
      const float m_new = fmaxf(m[r], tile_max);
      const float corr = expf(m[r] - m_new);  // m = -inf on the first tile: 0
      const float p = lane < n ? expf(sc[r] - m_new) : 0.0f;
      l[r] = l[r] * corr + p;
      p_w[r * kKeyTile + lane] = p;
      m[r] = m_new;
#pragma unroll
      for (int c = 0; c < NPL; ++c) acc[r][c] *= corr;
    }
    __syncwarp(kFull);

    // Phase 2: lane = dims: acc += p_j v_j.
    accumulate_rows(acc, p_w, v_s, n, n_rows, stride, D, lane);
  }

  // Reductions only: no barrier below, so warps may leave in any order.
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (r >= n_rows) continue;
    const float denom = warp_sum(l[r]);  // >= 1: the maximum's own term is exp(0)
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    T* o = out + q_offset(s, b, g, row);
#pragma unroll
    for (int c = 0; c < NPL; ++c) {
      const int d = lane + c * kWarp;
      if (d < D) o[d] = from_float<T>(acc[r][c] / denom);
    }
    if (lane == 0) lse[lse_offset(s, b, g, row)] = m[r] + logf(denom);
  }
}

// ---- backward: delta ---------------------------------------------------------------------------

// delta[b, h, i] = <do[b, i, h], out[b, i, h]> - dlse[b, h, i]; one warp per entry of the
// [B, Hq, Lq] layout. Grid ceil(B * Hq * Lq / 8), block 256.
template <typename T>
__global__ void __launch_bounds__(kBwdWarps * kWarp)
    delta_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                 const float* __restrict__ dlse, float* __restrict__ delta, Shape s) {
  const int64_t n = int64_t(blockIdx.x) * kBwdWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (n >= s.batch * s.hq * s.lq) return;  // warp-uniform; no barrier in this kernel
  const int64_t i = n % s.lq;
  const int64_t h = (n / s.lq) % s.hq;
  const int64_t b = n / (s.lq * s.hq);
  const int64_t off = ((b * s.lq + i) * s.hq + h) * s.d;
  float x = 0.0f;
  for (int64_t d = lane; d < s.d; d += kWarp) x += to_float(dout[off + d]) * to_float(out[off + d]);
  x = warp_sum(x);
  if (lane == 0) delta[n] = x - dlse[n];
}

// ---- backward: dQ ------------------------------------------------------------------------------

// Grid and block as fwd_kernel. Dynamic shared memory (floats): q, do [rpb * D each] |
// k tile | v tile | ds [rpb * kKeyTile].
template <typename T, int NPL>
__global__ void __launch_bounds__(kMaxWarps * kWarp, 2)
    dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const T* __restrict__ dout, const int* __restrict__ cu,
              const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq,
              Shape s) {
  LOPD_EXTERN_SHARED(float, smem);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int rpb = int(blockDim.x / kWarp) * kRowsPerWarp;
  const int64_t row0 = int64_t(blockIdx.z) * rpb;
  const int D = int(s.d);
  const int stride = kv_stride(D);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t key_begin = cu[b];
  const int64_t n_keys = cu[b + 1] - key_begin;

  if (n_keys == 0) {
    // Empty item: dq = 0; its lse (-inf) is never read.
    zero_rows(dq, s, b, g, row0, rpb);
    return;
  }

  float* q_s = smem;
  float* do_s = q_s + rpb * D;
  float* k_s = do_s + rpb * D;
  float* v_s = k_s + kKeyTile * stride;
  float* ds_w = v_s + kKeyTile * stride + warp * kRowsPerWarp * kKeyTile;

  load_rows(q, q_s, s, b, g, row0, rpb, s.scale);
  load_rows(dout, do_s, s, b, g, row0, rpb, 1.0f);
  const float* q_w = q_s + warp * kRowsPerWarp * D;
  const float* do_w = do_s + warp * kRowsPerWarp * D;
  const int n_rows = warp_rows(s, row0, warp);

  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp], acc[kRowsPerWarp][NPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    row_lse[r] = r < n_rows ? lse[lse_offset(s, b, g, row)] : 0.0f;
    row_delta[r] = r < n_rows ? delta[lse_offset(s, b, g, row)] : 0.0f;
#pragma unroll
    for (int c = 0; c < NPL; ++c) acc[r][c] = 0.0f;
  }

  for (int64_t t0 = 0; t0 < n_keys; t0 += kKeyTile) {
    const int n = n_keys - t0 < kKeyTile ? int(n_keys - t0) : kKeyTile;
    __syncthreads();
    load_kv_tile(k, k_s, s, key_begin + t0, n, g);
    load_kv_tile(v, v_s, s, key_begin + t0, n, g);
    __syncthreads();

    // Phase 1: lane = key: s = <scale q, k>, dp = <do, v>, ds = p (dp - delta).
    float sc[kRowsPerWarp], dp[kRowsPerWarp];
    row_dots(q_w, D, k_s + lane * stride, sc, D);
    row_dots(do_w, D, v_s + lane * stride, dp, D);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const bool live = lane < n && r < n_rows;
      const float p = live ? expf(sc[r] - row_lse[r]) : 0.0f;
      ds_w[r * kKeyTile + lane] = p * (dp[r] - row_delta[r]);
    }
    __syncwarp(kFull);

    // Phase 2: lane = dims: acc += ds_j k_j.
    accumulate_rows(acc, ds_w, k_s, n, n_rows, stride, D, lane);
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (r >= n_rows) continue;
    T* o = dq + q_offset(s, b, g, row0 + warp * kRowsPerWarp + r);
#pragma unroll
    for (int c = 0; c < NPL; ++c) {
      const int d = lane + c * kWarp;
      if (d < D) o[d] = from_float<T>(acc[r][c] * s.scale);
    }
  }
}

// ---- backward: dK, dV --------------------------------------------------------------------------

// Grid (B, Hkv, key tiles of the longest item), block kBwdWarps * 32. Dynamic shared memory
// (floats): k tile | v tile [kKeyTile * stride each] | q, do [kRowChunk * D each] |
// p, ds [kRowChunk * kKeyTile each] | lse, delta [kRowChunk each].
template <typename T, int NPL>
__global__ void __launch_bounds__(kBwdWarps * kWarp, 2)
    dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ dout, const int* __restrict__ cu,
                const float* __restrict__ lse, const float* __restrict__ delta,
                T* __restrict__ dk, T* __restrict__ dv, Shape s) {
  LOPD_EXTERN_SHARED(float, smem);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int64_t t0 = int64_t(blockIdx.z) * kKeyTile;
  const int64_t key_begin = cu[b];
  const int64_t n_keys = cu[b + 1] - key_begin;
  if (t0 >= n_keys) return;  // block-uniform: this item is shorter than the longest one
  const int n = n_keys - t0 < kKeyTile ? int(n_keys - t0) : kKeyTile;
  const int D = int(s.d);
  const int stride = kv_stride(D);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;

  float* k_s = smem;
  float* v_s = k_s + kKeyTile * stride;
  float* q_s = v_s + kKeyTile * stride;
  float* do_s = q_s + kRowChunk * D;
  float* p_s = do_s + kRowChunk * D;
  float* ds_s = p_s + kRowChunk * kKeyTile;
  float* lse_s = ds_s + kRowChunk * kKeyTile;
  float* delta_s = lse_s + kRowChunk;

  load_kv_tile(k, k_s, s, key_begin + t0, n, g);
  load_kv_tile(v, v_s, s, key_begin + t0, n, g);

  // Phase 2 ownership: warp w accumulates keys w * kKeysPerWarp + kk of the tile.
  float dk_acc[kKeysPerWarp][NPL], dv_acc[kKeysPerWarp][NPL];
#pragma unroll
  for (int kk = 0; kk < kKeysPerWarp; ++kk) {
#pragma unroll
    for (int c = 0; c < NPL; ++c) dk_acc[kk][c] = dv_acc[kk][c] = 0.0f;
  }

  for (int64_t row0 = 0; row0 < s.rows; row0 += kRowChunk) {
    __syncthreads();  // k/v staged; the previous chunk's p/ds/q/do are consumed
    load_rows(q, q_s, s, b, g, row0, kRowChunk, 1.0f);
    load_rows(dout, do_s, s, b, g, row0, kRowChunk, 1.0f);
    for (int rr = threadIdx.x; rr < kRowChunk; rr += blockDim.x) {
      const bool valid = row0 + rr < s.rows;
      lse_s[rr] = valid ? lse[lse_offset(s, b, g, row0 + rr)] : 0.0f;
      delta_s[rr] = valid ? delta[lse_offset(s, b, g, row0 + rr)] : 0.0f;
    }
    __syncthreads();

    // Phase 1: lane = key j, warp w takes rows w, w + kBwdWarps, ... of the chunk.
    float sc[kRowsPerWarp], dp[kRowsPerWarp];
    row_dots(q_s + warp * D, kBwdWarps * D, k_s + lane * stride, sc, D);
    row_dots(do_s + warp * D, kBwdWarps * D, v_s + lane * stride, dp, D);
#pragma unroll
    for (int m = 0; m < kRowsPerWarp; ++m) {
      const int rr = warp + m * kBwdWarps;
      // Padded rows and keys contribute nothing; lse is finite (the item has keys).
      const bool live = lane < n && row0 + rr < s.rows;
      const float p = live ? expf(sc[m] * s.scale - lse_s[rr]) : 0.0f;
      p_s[rr * kKeyTile + lane] = p;
      ds_s[rr * kKeyTile + lane] = p * (dp[m] - delta_s[rr]);
    }
    __syncthreads();

    // Phase 2: lane = dims; dv_j += p_ij do_i, dk_j += ds_ij q_i over the chunk's rows.
    const int rows_here = s.rows - row0 < kRowChunk ? int(s.rows - row0) : kRowChunk;
    for (int rr = 0; rr < rows_here; ++rr) {
#pragma unroll
      for (int kk = 0; kk < kKeysPerWarp; ++kk) {
        const int j = warp * kKeysPerWarp + kk;
        const float p = p_s[rr * kKeyTile + j];
        const float ds = ds_s[rr * kKeyTile + j];
#pragma unroll
        for (int c = 0; c < NPL; ++c) {
          const int d = lane + c * kWarp;
          if (d < D) {
            dv_acc[kk][c] += p * do_s[rr * D + d];
            dk_acc[kk][c] += ds * q_s[rr * D + d];
          }
        }
      }
    }
  }

#pragma unroll
  for (int kk = 0; kk < kKeysPerWarp; ++kk) {
    const int j = warp * kKeysPerWarp + kk;
    if (j >= n) continue;
    const int64_t off = ((key_begin + t0 + j) * s.hkv + g) * s.d;
#pragma unroll
    for (int c = 0; c < NPL; ++c) {
      const int d = lane + c * kWarp;
      if (d < D) {
        dk[off + d] = from_float<T>(dk_acc[kk][c] * s.scale);
        dv[off + d] = from_float<T>(dv_acc[kk][c]);
      }
    }
  }
}

}  // namespace
}  // namespace lopd::cuda::varlen_xattn
