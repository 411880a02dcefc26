// CUDA kernels and host launchers of lopd::varlen_cross_attention_cuda_fwd / _bwd (schemas:
// csrc/common/schemas.h; the math: the docstring of lopd_kernels/varlen_cross_attention.py).
// Included by csrc/cuda/varlen_cross_attention.cu (nvcc, the CUDA op) and by
// csrc/emu/varlen_cross_attention_emu.cpp (g++, the same kernels under the SIMT emulator, for CPU
// tests).
//
// Two sets of kernels, picked by the host launchers (use_wmma): bf16 / fp16 inputs with
// D % 16 == 0 and D <= 128 run the tensor-core (nvcuda::wmma) kernels of the section "tensor-core
// (WMMA) kernels" below; fp32 inputs and other head dims run the CUDA-core kernels described
// here: plain fp32 FMA code (inputs converted to fp32 when staged in shared memory, every dot
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
// tensor-core kernels (Triton's tl.dot, flash-attn, the WMMA kernels below) have ~15x the peak.
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

// ---- tensor-core (WMMA) kernels: bf16 / fp16, D % 16 == 0, D <= 128 ---------------------------
//
// The same three GEMM-shaped products, on tensor cores through nvcuda::wmma (m16n16k16, fp32
// accumulators: mma.sync on sm_80 and sm_90, not Hopper's wgmma), as flash-attention does it:
// q, k, v, do are staged in shared memory in the input dtype (no conversion), scores and
// accumulators are fp32, the softmax is fp32, and P / dS are rounded to the input dtype only
// where they are tensor-core inputs. Every block has 4 warps; a warp owns 16 rows (forward, dQ)
// or 16 keys (dK/dV) of the block's tile, so after the block-wide staging of a tile everything
// is warp-local (__syncwarp only). The WMMA fragment-to-lane layout is unspecified, so the
// per-row work (online softmax, rescaling the output, p and ds) is done on fp32 tiles that the
// warp stores to shared memory: lane pair (2r, 2r + 1) owns row r, each lane half of its
// columns. The output / gradient accumulators live in shared memory too (loaded into fragments,
// updated, stored back per tile): they are rescaled per row, and at D = 128 they would not fit
// in registers next to the rest with 4 warps. Shared-memory rows are padded (8 halves, 4 floats)
// against bank conflicts of the fragment loads.
//
// dK/dV splits P and dS: dV = P^T dO and dK = dS^T Q sum G * Lq products per entry, so rounding
// P and dS once to the input dtype (relative 2^-9 bf16, 2^-12 fp16 per term) shows in entries
// that cancel: measured under the emulator at GQA, D = 64 / 80, Lq = 32, it exceeded the test
// tolerances (tests/utils.py) by 1.1-1.2x for both dtypes. These two products therefore also
// multiply the rounding errors, P - rnd(P) and dS - rnd(dS), as a second operand of the input
// dtype (2 more MMAs per 16 x 16 tile step, 2 more [64][32] tiles of shared memory): ~16 / 22
// bits of P and dS. The forward (P V) and dQ (dS K) products pass with margin and round once, as
// flash-attention does.
//
// Expected speed (never measured on a GPU; a guess): several times the CUDA-core kernels, still
// behind the Triton kernels and flash-attn. Against a tuned mma.sync kernel they lose on the
// accumulators' shared-memory round trip per tile (fragments loaded and stored once per 2-4
// MMAs), synchronous staging without cp.async double buffering (only the SM's other blocks hide
// the loads), 4-warp blocks, and occupancy at D = 128: fwd / dQ ~110 KB of shared memory (2
// blocks per SM on sm_90), dK/dV ~155 KB (1 block, 4 warps per SM). Hopper's wgmma / TMA are
// not used at all.
constexpr int kTc = 16;                      // WMMA tile edge
constexpr int kTcWarps = 4;                  // warps per block
constexpr int kTcRows = kTcWarps * kTc;      // forward / dQ: query rows per block
constexpr int kTcFwdKeys = 64;               // forward: keys per tile
constexpr int kTcDqKeys = 32;                // dQ: keys per tile
constexpr int kTcKeys = kTcWarps * kTc;      // dK/dV: keys per block
constexpr int kTcRowChunk = 32;              // dK/dV: query rows per chunk
constexpr int kTcMaxHeadDim = 128;
constexpr int kPadT = 8;                     // row padding of input-dtype tiles (elements)
constexpr int kPadF = 4;                     // row padding of fp32 tiles (elements)

// Dynamic shared memory of the WMMA kernels (bytes): fp32 tiles first, then input-dtype tiles
// (2 bytes per element); every tile's size is a multiple of 32 bytes, as fragment pointers need.
__host__ __device__ __forceinline__ size_t fwd_wmma_smem(int D) {
  return 4 * size_t(kTcRows * (D + kPadF) + kTcRows * (kTcFwdKeys + kPadF)) +
         2 * size_t((kTcRows + 2 * kTcFwdKeys) * (D + kPadT) + kTcRows * (kTcFwdKeys + kPadT));
}
__host__ __device__ __forceinline__ size_t dq_wmma_smem(int D) {
  return 4 * size_t(kTcRows * (D + kPadF) + 2 * kTcRows * (kTcDqKeys + kPadF)) +
         2 * size_t((2 * kTcRows + 2 * kTcDqKeys) * (D + kPadT) + kTcRows * (kTcDqKeys + kPadT));
}
// dK/dV: p^T and ds^T tiles twice (high and low parts).
__host__ __device__ __forceinline__ size_t dkdv_wmma_smem(int D) {
  return 4 * size_t(2 * kTcKeys * (D + kPadF) + 2 * kTcKeys * (kTcRowChunk + kPadF) +
                    2 * kTcRowChunk) +
         2 * size_t((2 * kTcKeys + 2 * kTcRowChunk) * (D + kPadT) +
                    4 * kTcKeys * (kTcRowChunk + kPadT));
}

// Whether the WMMA kernels take this shape and dtype (else the CUDA-core kernels above): half
// precision, D a multiple of 16 up to 128, shared memory the device grants (smem_bytes: the
// largest WMMA launch of the op; not on sm_86 / sm_89 at D = 128), and 16-byte aligned tensors
// (staged in 16-byte vectors; a view with an odd storage offset is not).
inline bool use_wmma(at::ScalarType dtype, int64_t D, size_t smem_bytes,
                     std::initializer_list<const at::Tensor*> tensors) {
  if (dtype == at::kFloat || D % kTc != 0 || D > kTcMaxHeadDim) return false;
  if (smem_bytes > ::lopd::simt::max_dynamic_smem_bytes()) return false;
  for (const at::Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  }
  return true;
}

// Copies n_rows rows of D elements (D % 8 == 0: whole 16-byte vectors) into dst (row stride
// ld); row rr comes from src + offset(rr), or is zero where offset(rr) < 0. Whole block.
template <typename T, typename Offset>
__device__ __forceinline__ void stage_rows(const T* __restrict__ src, T* dst, int n_rows, int D,
                                           int ld, Offset offset) {
  constexpr int kVec = 16 / sizeof(T);
  const int per_row = D / kVec;
  for (int e = threadIdx.x; e < n_rows * per_row; e += blockDim.x) {
    const int rr = e / per_row, c = e % per_row;
    const int64_t off = offset(rr);
    uint4 val = {0u, 0u, 0u, 0u};
    if (off >= 0) val = *reinterpret_cast<const uint4*>(src + off + c * kVec);
    *reinterpret_cast<uint4*>(dst + rr * ld + c * kVec) = val;
  }
}

template <typename T>
using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, kTc, kTc, kTc, T,
                                     nvcuda::wmma::row_major>;
template <typename T>
using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, kTc, kTc, kTc, T,
                                     nvcuda::wmma::row_major>;
template <typename T>
using FragBt = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, kTc, kTc, kTc, T,
                                      nvcuda::wmma::col_major>;
using FragC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kTc, kTc, kTc, float>;

// out (fp32, row stride ldo) = a b^T for a 16 x D tile a (row stride lda) and a 16 x D tile b
// (row stride ldb): one 16 x 16 tile of scores. Whole warp.
template <typename T>
__device__ __forceinline__ void wmma_abt(const T* a, int lda, const T* b, int ldb, int D,
                                         float* out, int ldo) {
  using namespace nvcuda;
  FragC acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int d0 = 0; d0 < D; d0 += kTc) {
    FragA<T> fa;
    FragBt<T> fb;
    wmma::load_matrix_sync(fa, a + d0, lda);
    wmma::load_matrix_sync(fb, b + d0, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(out, acc, ldo, wmma::mem_row_major);
}

// acc (fp32 16 x D in shared memory, row stride ldc) += a b for a 16 x (16 * k_tiles) tile a
// (row stride lda) and a (16 * k_tiles) x D tile b (row stride ldb); with a_lo (same layout as a)
// also += a_lo b (a = hi + lo: an fp32 operand split into two of the input dtype). Whole warp.
template <typename T>
__device__ __forceinline__ void wmma_acc_ab(float* c, int ldc, const T* a, const T* a_lo,
                                            int lda, const T* b, int ldb, int k_tiles, int D) {
  using namespace nvcuda;
  for (int d0 = 0; d0 < D; d0 += kTc) {
    FragC acc;
    wmma::load_matrix_sync(acc, c + d0, ldc, wmma::mem_row_major);
    for (int kt = 0; kt < k_tiles; ++kt) {
      FragA<T> fa;
      FragB<T> fb;
      wmma::load_matrix_sync(fa, a + kt * kTc, lda);
      wmma::load_matrix_sync(fb, b + kt * kTc * ldb + d0, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
      if (a_lo != nullptr) {
        wmma::load_matrix_sync(fa, a_lo + kt * kTc, lda);
        wmma::mma_sync(acc, fa, fb, acc);
      }
    }
    wmma::store_matrix_sync(c + d0, acc, ldc, wmma::mem_row_major);
  }
}

// Grid (B, Hkv, ceil(G * Lq / 64)), block 128. Shared memory (fwd_wmma_smem): o [64][D] f32 |
// s [64][64] f32 | q [64][D] | k, v [64][D] | p [64][64] (input dtype), rows padded.
template <typename T>
__global__ void __launch_bounds__(kTcWarps * kWarp)
    fwd_wmma_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const int* __restrict__ cu, T* __restrict__ out, float* __restrict__ lse,
                    Shape s) {
  LOPD_EXTERN_SHARED(float, smem);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int64_t row0 = int64_t(blockIdx.z) * kTcRows;
  const int D = int(s.d);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t key_begin = cu[b];
  const int64_t n_keys = cu[b + 1] - key_begin;

  if (n_keys == 0) {
    // Empty item (block-uniform): out = 0, lse = -inf, no key is read.
    for (int e = threadIdx.x; e < kTcRows * D; e += blockDim.x) {
      const int64_t r = row0 + e / D;
      if (r < s.rows) out[q_offset(s, b, g, r) + e % D] = from_float<T>(0.0f);
    }
    for (int rr = threadIdx.x; rr < kTcRows; rr += blockDim.x) {
      if (row0 + rr < s.rows) lse[lse_offset(s, b, g, row0 + rr)] = -INFINITY;
    }
    return;
  }

  const int ldf = D + kPadF, ldt = D + kPadT;
  constexpr int kLdS = kTcFwdKeys + kPadF, kLdP = kTcFwdKeys + kPadT;
  float* o_s = smem;
  float* s_s = o_s + kTcRows * ldf;
  T* q_s = reinterpret_cast<T*>(s_s + kTcRows * kLdS);
  T* k_s = q_s + kTcRows * ldt;
  T* v_s = k_s + kTcFwdKeys * ldt;
  T* p_s = v_s + kTcFwdKeys * ldt;
  float* o_w = o_s + warp * kTc * ldf;  // this warp's 16 rows
  float* s_w = s_s + warp * kTc * kLdS;
  const T* q_w = q_s + warp * kTc * ldt;
  T* p_w = p_s + warp * kTc * kLdP;

  stage_rows(q, q_s, kTcRows, D, ldt, [&](int rr) -> int64_t {
    return row0 + rr < s.rows ? q_offset(s, b, g, row0 + rr) : -1;
  });
  for (int e = lane; e < kTc * ldf; e += kWarp) o_w[e] = 0.0f;
  // Softmax layout: lane pair (2r, 2r + 1) owns row r; lane 2r + h keys [32h, 32h + 32) of a
  // tile and dims [h D / 2, (h + 1) D / 2) of the output. m, l: fp32, the pair's copies equal.
  const int r = lane / 2, half = lane % 2;
  constexpr int kHalfKeys = kTcFwdKeys / 2;
  float m_run = -INFINITY, l_run = 0.0f;

  for (int64_t t0 = 0; t0 < n_keys; t0 += kTcFwdKeys) {
    const int n = n_keys - t0 < kTcFwdKeys ? int(n_keys - t0) : kTcFwdKeys;
    __syncthreads();  // the previous tile (and the staging of q, o) is done with
    const int64_t kv0 = key_begin + t0;
    auto kv_offset = [&](int j) -> int64_t { return j < n ? ((kv0 + j) * s.hkv + g) * s.d : -1; };
    stage_rows(k, k_s, kTcFwdKeys, D, ldt, kv_offset);
    stage_rows(v, v_s, kTcFwdKeys, D, ldt, kv_offset);
    __syncthreads();

    // S = Q K^T (unscaled, fp32), 16-key tiles holding at least one key.
    const int k_tiles = (n + kTc - 1) / kTc;
    for (int jt = 0; jt < k_tiles; ++jt) {
      wmma_abt(q_w, ldt, k_s + jt * kTc * ldt, ldt, D, s_w + jt * kTc, kLdS);
    }
    __syncwarp(kFull);

    // Online softmax of row r over the tile's n keys (p = 0 for padding keys up to 16 k_tiles).
    const float* srow = s_w + r * kLdS + half * kHalfKeys;
    T* prow = p_w + r * kLdP + half * kHalfKeys;
    const int n_mine = n - half * kHalfKeys;  // keys of this lane's half (may be <= 0)
    float mx = -INFINITY;
    for (int j = 0; j < kHalfKeys; ++j) {
      if (j < n_mine) mx = fmaxf(mx, srow[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));  // finite: the tile has key 0
    const float m_new = fmaxf(m_run, mx * s.scale);
    const float corr = expf(m_run - m_new);  // m_run = -inf on the first tile: 0
    float sum = 0.0f;
    for (int j = 0; j < kHalfKeys; ++j) {
      const float p = j < n_mine ? expf(srow[j] * s.scale - m_new) : 0.0f;
      sum += p;
      prow[j] = from_float<T>(p);
    }
    sum += __shfl_xor_sync(kFull, sum, 1);
    l_run = l_run * corr + sum;
    m_run = m_new;
    float* orow = o_w + r * ldf + half * (D / 2);
    for (int d = 0; d < D / 2; ++d) orow[d] *= corr;
    __syncwarp(kFull);

    // O += P V over the tile's 16-key tiles.
    wmma_acc_ab(o_w, ldf, static_cast<const T*>(p_w), static_cast<const T*>(nullptr), kLdP,
                static_cast<const T*>(v_s), ldt, k_tiles, D);
  }
  __syncwarp(kFull);

  const int64_t row = row0 + warp * kTc + r;
  if (row < s.rows) {
    // l_run >= 1: the row maximum's own term is exp(0).
    T* o = out + q_offset(s, b, g, row);
    const float* orow = o_w + r * ldf;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) {
      o[d] = from_float<T>(orow[d] / l_run);
    }
    if (half == 0) lse[lse_offset(s, b, g, row)] = m_run + logf(l_run);
  }
}

// Grid as fwd_wmma_kernel, block 128. Shared memory (dq_wmma_smem): dq [64][D] f32 |
// s, dp [64][32] f32 | q, do [64][D] | k, v [32][D] | ds [64][32] (input dtype), rows padded.
template <typename T>
__global__ void __launch_bounds__(kTcWarps * kWarp)
    dq_wmma_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const T* __restrict__ dout, const int* __restrict__ cu,
                   const float* __restrict__ lse, const float* __restrict__ delta,
                   T* __restrict__ dq, Shape s) {
  LOPD_EXTERN_SHARED(float, smem);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int64_t row0 = int64_t(blockIdx.z) * kTcRows;
  const int D = int(s.d);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t key_begin = cu[b];
  const int64_t n_keys = cu[b + 1] - key_begin;

  if (n_keys == 0) {
    // Empty item: dq = 0; its lse (-inf) is never read.
    for (int e = threadIdx.x; e < kTcRows * D; e += blockDim.x) {
      const int64_t r = row0 + e / D;
      if (r < s.rows) dq[q_offset(s, b, g, r) + e % D] = from_float<T>(0.0f);
    }
    return;
  }

  const int ldf = D + kPadF, ldt = D + kPadT;
  constexpr int kLdS = kTcDqKeys + kPadF, kLdP = kTcDqKeys + kPadT;
  float* dq_s = smem;
  float* s_s = dq_s + kTcRows * ldf;
  float* dp_s = s_s + kTcRows * kLdS;
  T* q_s = reinterpret_cast<T*>(dp_s + kTcRows * kLdS);
  T* do_s = q_s + kTcRows * ldt;
  T* k_s = do_s + kTcRows * ldt;
  T* v_s = k_s + kTcDqKeys * ldt;
  T* ds_s = v_s + kTcDqKeys * ldt;
  float* dq_w = dq_s + warp * kTc * ldf;
  float* s_w = s_s + warp * kTc * kLdS;
  float* dp_w = dp_s + warp * kTc * kLdS;
  const T* q_w = q_s + warp * kTc * ldt;
  const T* do_w = do_s + warp * kTc * ldt;
  T* ds_w = ds_s + warp * kTc * kLdP;

  auto row_offset = [&](int rr) -> int64_t {
    return row0 + rr < s.rows ? q_offset(s, b, g, row0 + rr) : -1;
  };
  stage_rows(q, q_s, kTcRows, D, ldt, row_offset);
  stage_rows(dout, do_s, kTcRows, D, ldt, row_offset);
  for (int e = lane; e < kTc * ldf; e += kWarp) dq_w[e] = 0.0f;
  // Lane pair (2r, 2r + 1) owns row r; lane 2r + h keys [16h, 16h + 16) of a tile, dims
  // [h D / 2, (h + 1) D / 2) of the result. Padding rows: lse = delta = 0, q = do = 0: ds = 0.
  const int r = lane / 2, half = lane % 2;
  constexpr int kHalfKeys = kTcDqKeys / 2;
  const int64_t row = row0 + warp * kTc + r;
  const float row_lse = row < s.rows ? lse[lse_offset(s, b, g, row)] : 0.0f;
  const float row_delta = row < s.rows ? delta[lse_offset(s, b, g, row)] : 0.0f;

  for (int64_t t0 = 0; t0 < n_keys; t0 += kTcDqKeys) {
    const int n = n_keys - t0 < kTcDqKeys ? int(n_keys - t0) : kTcDqKeys;
    __syncthreads();
    const int64_t kv0 = key_begin + t0;
    auto kv_offset = [&](int j) -> int64_t { return j < n ? ((kv0 + j) * s.hkv + g) * s.d : -1; };
    stage_rows(k, k_s, kTcDqKeys, D, ldt, kv_offset);
    stage_rows(v, v_s, kTcDqKeys, D, ldt, kv_offset);
    __syncthreads();

    const int k_tiles = (n + kTc - 1) / kTc;
    for (int jt = 0; jt < k_tiles; ++jt) {
      wmma_abt(q_w, ldt, k_s + jt * kTc * ldt, ldt, D, s_w + jt * kTc, kLdS);     // S
      wmma_abt(do_w, ldt, v_s + jt * kTc * ldt, ldt, D, dp_w + jt * kTc, kLdS);  // dP
    }
    __syncwarp(kFull);
    const int n_mine = n - half * kHalfKeys;
    for (int j = 0; j < kHalfKeys; ++j) {
      const int c = half * kHalfKeys + j;
      const float p = j < n_mine ? expf(s_w[r * kLdS + c] * s.scale - row_lse) : 0.0f;
      ds_w[r * kLdP + c] = from_float<T>(p * (dp_w[r * kLdS + c] - row_delta));
    }
    __syncwarp(kFull);
    // dQ += dS K (the scale is applied once at the end).
    wmma_acc_ab(dq_w, ldf, static_cast<const T*>(ds_w), static_cast<const T*>(nullptr), kLdP,
                static_cast<const T*>(k_s), ldt, k_tiles, D);
  }
  __syncwarp(kFull);
  if (row < s.rows) {
    T* o = dq + q_offset(s, b, g, row);
    const float* drow = dq_w + r * ldf;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) {
      o[d] = from_float<T>(drow[d] * s.scale);
    }
  }
}

// Grid (B, Hkv, ceil(max_seqlen_k / 64)), block 128; warp w owns keys [16w, 16w + 16) of the
// block's tile and accumulates their dk, dv over all G * Lq query rows of the kv head (chunks of
// 32): S^T = K Q^T, dP^T = V dO^T, then dV += P^T dO, dK += dS^T Q. Shared memory
// (dkdv_wmma_smem): dk, dv [64][D] f32 | s^T, dp^T [64][32] f32 | lse, delta [32] f32 |
// k, v [64][D] | q, do [32][D] | p^T, ds^T, their low parts [64][32] (input dtype), rows padded.
template <typename T>
__global__ void __launch_bounds__(kTcWarps * kWarp)
    dkdv_wmma_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const int* __restrict__ cu,
                     const float* __restrict__ lse, const float* __restrict__ delta,
                     T* __restrict__ dk, T* __restrict__ dv, Shape s) {
  LOPD_EXTERN_SHARED(float, smem);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int64_t t0 = int64_t(blockIdx.z) * kTcKeys;
  const int64_t key_begin = cu[b];
  const int64_t n_keys = cu[b + 1] - key_begin;
  if (t0 >= n_keys) return;  // block-uniform: this item is shorter than the longest one
  const int n = n_keys - t0 < kTcKeys ? int(n_keys - t0) : kTcKeys;
  const int D = int(s.d);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;

  const int ldf = D + kPadF, ldt = D + kPadT;
  constexpr int kLdS = kTcRowChunk + kPadF, kLdP = kTcRowChunk + kPadT;
  float* dk_s = smem;
  float* dv_s = dk_s + kTcKeys * ldf;
  float* st_s = dv_s + kTcKeys * ldf;
  float* dpt_s = st_s + kTcKeys * kLdS;
  float* lse_s = dpt_s + kTcKeys * kLdS;
  float* delta_s = lse_s + kTcRowChunk;
  T* k_s = reinterpret_cast<T*>(delta_s + kTcRowChunk);
  T* v_s = k_s + kTcKeys * ldt;
  T* q_s = v_s + kTcKeys * ldt;
  T* do_s = q_s + kTcRowChunk * ldt;
  T* pt_s = do_s + kTcRowChunk * ldt;
  T* dst_s = pt_s + kTcKeys * kLdP;
  float* dk_w = dk_s + warp * kTc * ldf;
  float* dv_w = dv_s + warp * kTc * ldf;
  float* st_w = st_s + warp * kTc * kLdS;
  float* dpt_w = dpt_s + warp * kTc * kLdS;
  const T* k_w = k_s + warp * kTc * ldt;
  const T* v_w = v_s + warp * kTc * ldt;
  T* pt_w = pt_s + warp * kTc * kLdP;
  T* dst_w = dst_s + warp * kTc * kLdP;
  // P^T and dS^T also as low parts (the rounding errors of the high parts; see the top).
  T* ptlo_w = dst_s + kTcKeys * kLdP + warp * kTc * kLdP;
  T* dstlo_w = dst_s + 2 * kTcKeys * kLdP + warp * kTc * kLdP;

  const int64_t kv0 = key_begin + t0;
  auto kv_offset = [&](int j) -> int64_t { return j < n ? ((kv0 + j) * s.hkv + g) * s.d : -1; };
  stage_rows(k, k_s, kTcKeys, D, ldt, kv_offset);
  stage_rows(v, v_s, kTcKeys, D, ldt, kv_offset);
  for (int e = lane; e < kTc * ldf; e += kWarp) dk_w[e] = dv_w[e] = 0.0f;
  // Warps whose 16 keys are all past the item's end skip the math (warp-uniform), not the
  // barriers. Lane pair (2kk, 2kk + 1) owns key kk of the warp; lane 2kk + h rows
  // [16h, 16h + 16) of a chunk and dims [h D / 2, (h + 1) D / 2) of the result.
  const bool warp_live = warp * kTc < n;
  const int kk = lane / 2, half = lane % 2;
  constexpr int kHalfRows = kTcRowChunk / 2;
  const bool key_live = warp * kTc + kk < n;

  for (int64_t row0 = 0; row0 < s.rows; row0 += kTcRowChunk) {
    const int rows_here = s.rows - row0 < kTcRowChunk ? int(s.rows - row0) : kTcRowChunk;
    __syncthreads();  // k/v staged; the previous chunk's q/do are consumed
    auto row_offset = [&](int rr) -> int64_t {
      return rr < rows_here ? q_offset(s, b, g, row0 + rr) : -1;
    };
    stage_rows(q, q_s, kTcRowChunk, D, ldt, row_offset);
    stage_rows(dout, do_s, kTcRowChunk, D, ldt, row_offset);
    for (int rr = threadIdx.x; rr < kTcRowChunk; rr += blockDim.x) {
      lse_s[rr] = rr < rows_here ? lse[lse_offset(s, b, g, row0 + rr)] : 0.0f;
      delta_s[rr] = rr < rows_here ? delta[lse_offset(s, b, g, row0 + rr)] : 0.0f;
    }
    __syncthreads();
    if (!warp_live) continue;

    const int r_tiles = (rows_here + kTc - 1) / kTc;
    for (int rt = 0; rt < r_tiles; ++rt) {
      wmma_abt(k_w, ldt, q_s + rt * kTc * ldt, ldt, D, st_w + rt * kTc, kLdS);    // S^T
      wmma_abt(v_w, ldt, do_s + rt * kTc * ldt, ldt, D, dpt_w + rt * kTc, kLdS);  // dP^T
    }
    __syncwarp(kFull);
    for (int i = 0; i < kHalfRows; ++i) {
      const int rr = half * kHalfRows + i;
      // Padding keys and rows contribute nothing; lse is finite (the item has keys).
      const bool live = key_live && rr < rows_here;
      const float p = live ? expf(st_w[kk * kLdS + rr] * s.scale - lse_s[rr]) : 0.0f;
      const float ds = p * (dpt_w[kk * kLdS + rr] - delta_s[rr]);
      const T p_hi = from_float<T>(p), ds_hi = from_float<T>(ds);
      pt_w[kk * kLdP + rr] = p_hi;
      dst_w[kk * kLdP + rr] = ds_hi;
      ptlo_w[kk * kLdP + rr] = from_float<T>(p - to_float(p_hi));
      dstlo_w[kk * kLdP + rr] = from_float<T>(ds - to_float(ds_hi));
    }
    __syncwarp(kFull);
    wmma_acc_ab(dv_w, ldf, static_cast<const T*>(pt_w), static_cast<const T*>(ptlo_w), kLdP,
                static_cast<const T*>(do_s), ldt, r_tiles, D);
    wmma_acc_ab(dk_w, ldf, static_cast<const T*>(dst_w), static_cast<const T*>(dstlo_w), kLdP,
                static_cast<const T*>(q_s), ldt, r_tiles, D);
  }
  __syncwarp(kFull);
  if (key_live) {
    const int64_t off = (kv0 + warp * kTc + kk) * s.hkv * s.d + g * s.d;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) {
      dk[off + d] = from_float<T>(dk_w[kk * ldf + d] * s.scale);
      dv[off + d] = from_float<T>(dv_w[kk * ldf + d]);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------------

#define LOPD_XATTN_CHECK(cond, ...) \
  TORCH_CHECK(cond, "varlen_cross_attention (" LOPD_SIMT_BACKEND "): ", __VA_ARGS__)

// Calls f(T{}, std::integral_constant<int, NPL>{}) for q's dtype and the per-lane dim count bucket
// of D (1, 2, 3, 4 or 8 dims per lane: D <= 32, 64, 96, 128, 256).
template <typename F>
void dispatch(at::ScalarType dtype, int64_t D, F&& f) {
  auto with_npl = [&](auto tag) {
    if (D <= 32) {
      f(tag, std::integral_constant<int, 1>{});
    } else if (D <= 64) {
      f(tag, std::integral_constant<int, 2>{});
    } else if (D <= 96) {
      f(tag, std::integral_constant<int, 3>{});
    } else if (D <= 128) {
      f(tag, std::integral_constant<int, 4>{});
    } else {
      f(tag, std::integral_constant<int, 8>{});
    }
  };
  switch (dtype) {
    case at::kFloat:
      with_npl(float{});
      break;
    case at::kHalf:
      with_npl(__half{});
      break;
    default:
      with_npl(__nv_bfloat16{});
      break;
  }
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  LOPD_XATTN_CHECK(t.device().type() == LOPD_SIMT_DEVICE_TYPE, name, " must be a ",
                   c10::DeviceTypeName(LOPD_SIMT_DEVICE_TYPE), " tensor, got one on ", t.device());
  LOPD_XATTN_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but q is on ",
                   ref.device());
  LOPD_XATTN_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Checks the forward inputs; returns the shape parameters.
Shape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& cu, double scale, int64_t max_seqlen_k) {
  check_same_device(q, q, "q");
  check_same_device(q, k, "k");
  check_same_device(q, v, "v");
  check_same_device(q, cu, "cu_seqlens_k");
  const auto dt = q.scalar_type();
  LOPD_XATTN_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "q must be float32, float16 or bfloat16, got ", dt);
  LOPD_XATTN_CHECK(k.scalar_type() == dt && v.scalar_type() == dt,
                   "k and v must have q's dtype ", dt, ", got ", k.scalar_type(), " and ",
                   v.scalar_type());
  LOPD_XATTN_CHECK(q.dim() == 4, "q must be [B, Lq, Hq, D], got shape ", q.sizes());
  LOPD_XATTN_CHECK(k.dim() == 3, "k must be packed [total_k, Hkv, D], got shape ", k.sizes());
  LOPD_XATTN_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes(), ", got ",
                   v.sizes());
  const int64_t D = q.size(3);
  LOPD_XATTN_CHECK(k.size(2) == D, "k head dim ", k.size(2), " must equal q head dim ", D);
  LOPD_XATTN_CHECK(D >= 1 && D <= kMaxHeadDim, "head dim D must be in [1, ", kMaxHeadDim,
                   "], got ", D);
  LOPD_XATTN_CHECK(k.size(1) > 0 && q.size(2) % k.size(1) == 0, "q heads (", q.size(2),
                   ") must be a positive multiple of k/v heads (", k.size(1), ")");
  LOPD_XATTN_CHECK(cu.scalar_type() == at::kInt, "cu_seqlens_k must be int32, got ",
                   cu.scalar_type());
  LOPD_XATTN_CHECK(cu.dim() == 1 && cu.size(0) == q.size(0) + 1, "cu_seqlens_k must be [B+1] = [",
                   q.size(0) + 1, "], got shape ", cu.sizes());
  LOPD_XATTN_CHECK(std::isfinite(scale) && scale > 0, "scale must be a positive finite float, got ",
                   scale);
  LOPD_XATTN_CHECK(max_seqlen_k >= 0, "max_seqlen_k must be >= 0, got ", max_seqlen_k);
  LOPD_XATTN_CHECK(k.size(0) <= INT32_MAX, "total_k must fit int32 (cu_seqlens_k), got ",
                   k.size(0));
  // Grid limits: B on x (2^31 - 1), Hkv on y, row chunks / key tiles on z (65535 each).
  LOPD_XATTN_CHECK(k.size(1) <= 65535, "at most 65535 k/v heads, got ", k.size(1));
  LOPD_XATTN_CHECK((max_seqlen_k + kKeyTile - 1) / kKeyTile <= 65535,
                   "max_seqlen_k must be <= ", int64_t(65535) * kKeyTile, ", got ", max_seqlen_k);
  if (cu.device().is_cpu() && q.size(0) > 0) {
    // The boundaries are free to check on the CPU (the emulated build); on a GPU they would cost
    // a device sync (the Python wrapper checks them where they are free).
    const int* c = cu.data_ptr<int>();
    LOPD_XATTN_CHECK(c[0] == 0 && c[q.size(0)] == k.size(0),
                     "cu_seqlens_k must start at 0 and end at total_k = ", k.size(0));
    for (int64_t i = 0; i < q.size(0); ++i) {
      LOPD_XATTN_CHECK(c[i + 1] >= c[i], "cu_seqlens_k must be non-decreasing");
      LOPD_XATTN_CHECK(c[i + 1] - c[i] <= max_seqlen_k, "max_seqlen_k=", max_seqlen_k,
                       " is below the length ", c[i + 1] - c[i], " of item ", i);
    }
  }
  Shape s{};
  s.batch = q.size(0);
  s.lq = q.size(1);
  s.hq = q.size(2);
  s.hkv = k.size(1);
  s.d = D;
  s.group = s.hq / s.hkv;
  s.rows = s.group * s.lq;
  s.scale = float(scale);
  return s;
}

// Calls f(T{}) for a half-precision dtype (the WMMA kernels' inputs).
template <typename F>
void dispatch_half(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(__half{});
  } else {
    f(__nv_bfloat16{});
  }
}

// Forward / dQ blocks: enough warps for the rows of one (item, kv head), at most kMaxWarps.
int row_warps(const Shape& s) {
  const int64_t w = (s.rows + kRowsPerWarp - 1) / kRowsPerWarp;
  return int(w < 1 ? 1 : (w > kMaxWarps ? kMaxWarps : w));
}

std::tuple<at::Tensor, at::Tensor> varlen_cross_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_k,
    double scale, int64_t max_seqlen_k) {
  const Shape s = check_inputs(q, k, v, cu_seqlens_k, scale, max_seqlen_k);
  LOPD_DEVICE_GUARD(q.device());
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({s.batch, s.hq, s.lq}, q.options().dtype(at::kFloat));
  if (s.batch == 0 || s.rows == 0) return {out, lse};
  if (use_wmma(q.scalar_type(), s.d, fwd_wmma_smem(int(s.d)), {&q, &k, &v, &out})) {
    const int64_t tiles = (s.rows + kTcRows - 1) / kTcRows;
    LOPD_XATTN_CHECK(tiles <= 65535, "too many query rows per kv head (", s.rows, ")");
    dispatch_half(q.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      auto kernel = fwd_wmma_kernel<T>;
      LOPD_LAUNCH(kernel, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(tiles)),
                  kTcWarps * kWarp, fwd_wmma_smem(int(s.d)),
                  reinterpret_cast<const T*>(q.data_ptr()),
                  reinterpret_cast<const T*>(k.data_ptr()),
                  reinterpret_cast<const T*>(v.data_ptr()), cu_seqlens_k.data_ptr<int>(),
                  reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>(), s);
    });
    return {out, lse};
  }
  const int warps = row_warps(s);
  const int rpb = warps * kRowsPerWarp;
  const int64_t chunks = (s.rows + rpb - 1) / rpb;
  LOPD_XATTN_CHECK(chunks <= 65535, "too many query rows per kv head (", s.rows, ")");
  const size_t smem =
      sizeof(float) * (size_t(rpb) * s.d + 2 * kKeyTile * kv_stride(int(s.d)) + 2 * rpb * kKeyTile);
  const dim3 grid(unsigned(s.batch), unsigned(s.hkv), unsigned(chunks));
  dispatch(q.scalar_type(), s.d, [&](auto tag, auto npl) {
    using T = decltype(tag);
    auto kernel = fwd_kernel<T, decltype(npl)::value>;
    LOPD_LAUNCH(kernel, grid, warps * kWarp, smem, reinterpret_cast<const T*>(q.data_ptr()),
                reinterpret_cast<const T*>(k.data_ptr()), reinterpret_cast<const T*>(v.data_ptr()),
                cu_seqlens_k.data_ptr<int>(), reinterpret_cast<T*>(out.data_ptr()),
                lse.data_ptr<float>(), s);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_k, double scale, int64_t max_seqlen_k) {
  const Shape s = check_inputs(q, k, v, cu_seqlens_k, scale, max_seqlen_k);
  check_same_device(q, grad_out, "grad_out");
  check_same_device(q, out, "out");
  check_same_device(q, grad_lse, "grad_lse");
  check_same_device(q, lse, "lse");
  LOPD_XATTN_CHECK(grad_out.sizes() == q.sizes() && grad_out.scalar_type() == q.scalar_type(),
                   "grad_out must match q (shape ", q.sizes(), ", dtype ", q.scalar_type(),
                   "), got ", grad_out.sizes(), " ", grad_out.scalar_type());
  LOPD_XATTN_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
                   "out must match q (shape ", q.sizes(), ", dtype ", q.scalar_type(), "), got ",
                   out.sizes(), " ", out.scalar_type());
  const std::vector<int64_t> lse_shape{s.batch, s.hq, s.lq};
  LOPD_XATTN_CHECK(lse.sizes() == lse_shape && lse.scalar_type() == at::kFloat,
                   "lse must be float32 [B, Hq, Lq] = ", at::IntArrayRef(lse_shape), ", got ",
                   lse.sizes(), " ", lse.scalar_type());
  LOPD_XATTN_CHECK(grad_lse.sizes() == lse_shape && grad_lse.scalar_type() == at::kFloat,
                   "grad_lse must be float32 [B, Hq, Lq] = ", at::IntArrayRef(lse_shape),
                   ", got ", grad_lse.sizes(), " ", grad_lse.scalar_type());
  LOPD_DEVICE_GUARD(q.device());
  at::Tensor dq = at::empty_like(q);
  // Every key row belongs to exactly one item (cu_seqlens_k runs from 0 to total_k), so the
  // dK/dV kernel overwrites all of dk and dv.
  at::Tensor dk = at::empty_like(k);
  at::Tensor dv = at::empty_like(v);
  if (s.batch == 0 || s.rows == 0) {
    dk.zero_();  // no query rows: the keys get no gradient
    dv.zero_();
    return {dq, dk, dv};
  }
  at::Tensor delta = at::empty({s.batch, s.hq, s.lq}, q.options().dtype(at::kFloat));
  const int64_t n_delta = s.batch * s.hq * s.lq;
  const size_t wmma_smem = std::max(dq_wmma_smem(int(s.d)), dkdv_wmma_smem(int(s.d)));
  if (use_wmma(q.scalar_type(), s.d, wmma_smem, {&q, &k, &v, &grad_out, &out, &dq, &dk, &dv})) {
    const int64_t tiles = (s.rows + kTcRows - 1) / kTcRows;
    LOPD_XATTN_CHECK(tiles <= 65535, "too many query rows per kv head (", s.rows, ")");
    const int64_t key_tiles = (max_seqlen_k + kTcKeys - 1) / kTcKeys;
    dispatch_half(q.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* qp = reinterpret_cast<const T*>(q.data_ptr());
      const T* kp = reinterpret_cast<const T*>(k.data_ptr());
      const T* vp = reinterpret_cast<const T*>(v.data_ptr());
      const T* dop = reinterpret_cast<const T*>(grad_out.data_ptr());
      const int* cup = cu_seqlens_k.data_ptr<int>();
      auto delta_ = delta_kernel<T>;
      LOPD_LAUNCH(delta_, unsigned((n_delta + kBwdWarps - 1) / kBwdWarps), kBwdWarps * kWarp, 0,
                  dop, reinterpret_cast<const T*>(out.data_ptr()), grad_lse.data_ptr<float>(),
                  delta.data_ptr<float>(), s);
      auto dq_ = dq_wmma_kernel<T>;
      LOPD_LAUNCH(dq_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(tiles)),
                  kTcWarps * kWarp, dq_wmma_smem(int(s.d)), qp, kp, vp, dop, cup,
                  lse.data_ptr<float>(), delta.data_ptr<float>(),
                  reinterpret_cast<T*>(dq.data_ptr()), s);
      if (key_tiles > 0) {
        auto dkdv_ = dkdv_wmma_kernel<T>;
        LOPD_LAUNCH(dkdv_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(key_tiles)),
                    kTcWarps * kWarp, dkdv_wmma_smem(int(s.d)), qp, kp, vp, dop, cup,
                    lse.data_ptr<float>(), delta.data_ptr<float>(),
                    reinterpret_cast<T*>(dk.data_ptr()), reinterpret_cast<T*>(dv.data_ptr()), s);
      }
    });
    return {dq, dk, dv};
  }
  const int warps = row_warps(s);
  const int rpb = warps * kRowsPerWarp;
  const int64_t chunks = (s.rows + rpb - 1) / rpb;
  LOPD_XATTN_CHECK(chunks <= 65535, "too many query rows per kv head (", s.rows, ")");
  const int stride = kv_stride(int(s.d));
  const size_t dq_smem =
      sizeof(float) * (2 * size_t(rpb) * s.d + 2 * kKeyTile * stride + rpb * kKeyTile);
  const size_t dkdv_smem = sizeof(float) * (2 * kKeyTile * stride + 2 * kRowChunk * s.d +
                                            2 * kRowChunk * kKeyTile + 2 * kRowChunk);
  const int64_t key_tiles = (max_seqlen_k + kKeyTile - 1) / kKeyTile;
  dispatch(q.scalar_type(), s.d, [&](auto tag, auto npl) {
    using T = decltype(tag);
    constexpr int NPL = decltype(npl)::value;
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    const T* kp = reinterpret_cast<const T*>(k.data_ptr());
    const T* vp = reinterpret_cast<const T*>(v.data_ptr());
    const T* dop = reinterpret_cast<const T*>(grad_out.data_ptr());
    const int* cup = cu_seqlens_k.data_ptr<int>();
    auto dk_ = delta_kernel<T>;
    LOPD_LAUNCH(dk_, unsigned((n_delta + kBwdWarps - 1) / kBwdWarps), kBwdWarps * kWarp, 0, dop,
                reinterpret_cast<const T*>(out.data_ptr()), grad_lse.data_ptr<float>(),
                delta.data_ptr<float>(), s);
    auto dq_ = dq_kernel<T, NPL>;
    LOPD_LAUNCH(dq_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(chunks)), warps * kWarp,
                dq_smem, qp, kp, vp, dop, cup, lse.data_ptr<float>(), delta.data_ptr<float>(),
                reinterpret_cast<T*>(dq.data_ptr()), s);
    if (key_tiles > 0) {
      auto dkdv_ = dkdv_kernel<T, NPL>;
      LOPD_LAUNCH(dkdv_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(key_tiles)),
                  kBwdWarps * kWarp, dkdv_smem, qp, kp, vp, dop, cup, lse.data_ptr<float>(),
                  delta.data_ptr<float>(), reinterpret_cast<T*>(dk.data_ptr()),
                  reinterpret_cast<T*>(dv.data_ptr()), s);
    }
  });
  return {dq, dk, dv};
}

#undef LOPD_XATTN_CHECK

}  // namespace
}  // namespace lopd::cuda::varlen_xattn
