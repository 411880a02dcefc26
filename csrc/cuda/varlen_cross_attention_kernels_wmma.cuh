// Tensor-core (WMMA) kernels of lopd::varlen_cross_attention_cuda_fwd / _bwd: bf16 / fp16 inputs,
// D % 16 == 0, D <= 128 (the CUDA-core kernels, the shapes and the shared helpers:
// varlen_cross_attention_kernels.cuh; launched by varlen_cross_attention_launch.cuh).
#pragma once

#include "cuda/varlen_cross_attention_kernels.cuh"

namespace lopd::cuda::varlen_xattn {
namespace {

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

// Whether the WMMA kernels take this shape and dtype (else the CUDA-core kernels): half
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

}  // namespace
}  // namespace lopd::cuda::varlen_xattn
