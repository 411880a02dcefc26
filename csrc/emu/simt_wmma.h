// nvcuda::wmma (16x16x16 warp matrix multiply-accumulate) for the SIMT emulator: included by
// csrc/emu/simt_emulator.h (which it needs: the block state, warp barriers and sync sites),
// not on its own.
#pragma once

#include <cstring>

namespace lopd::simt_emu {

// ---- warp matrix multiply-accumulate (nvcuda::wmma, 16x16x16) ----------------------------------
//
// The WMMA API leaves the fragment-to-lane layout unspecified; here every lane holds the whole
// tile, row-major by logical (row, column) whatever the fragment's layout tag (num_elements =
// 256 per lane), so element-wise loops `for (i < f.num_elements) f.x[i] = ...` work as on the GPU
// while code that assumes a particular hardware layout does not. Every collective call
// (fill_fragment excepted, which is per-lane on the GPU too) is a warp synchronisation point:
// reached by only part of a warp, it is reported like a shuffle. Loads and stores wait for the
// whole warp before and after the memory access, so no lane's store can overwrite what another
// lane wrote to the same tile after it. mma_sync multiplies the A/B elements exactly (products of
// two fp16 / bf16 values are exact in fp32) and accumulates in fp32 over k in order, starting
// from C: the hardware adds in an unspecified order (and on some GPUs with truncation), so
// results agree with it to fp32 rounding, not bit for bit.
inline void warp_collective(const SyncSite& site) {
  arrive_and_wait(g_block->warp_barriers[g_block->current->linear / kWarpSize], site);
}

}  // namespace lopd::simt_emu

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K>
struct fragment_shape;
template <int M, int N, int K>
struct fragment_shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct fragment_shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct fragment_shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has the m16n16k16 shape only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : (std::is_same_v<T, c10::Half> ||
                                                    std::is_same_v<T, c10::BFloat16>),
                "emulated fragments: __half / __nv_bfloat16 A and B, float accumulators");
  static_assert(std::is_same_v<Use, accumulator> == std::is_same_v<Layout, void>,
                "A / B fragments need a row_major / col_major layout, accumulators none");
  static constexpr int rows = fragment_shape<Use, M, N, K>::rows;
  static constexpr int cols = fragment_shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (auto& e : f.x) e = static_cast<T>(value);
}

namespace detail {
// The hardware's requirements on every WMMA load / store (CUDA C++ Programming Guide, "Warp
// Matrix Functions"): a 256-bit aligned pointer and a leading dimension that is a multiple of
// 16 bytes. Violations are undefined behaviour on a GPU (misaligned-address faults or wrong
// data), so the emulator reports them instead of quietly working.
template <typename E>
void check_layout(const E* ptr, unsigned ldm, const ::lopd::simt_emu::SyncSite& site) {
  if (reinterpret_cast<uintptr_t>(ptr) % 32 != 0) {
    ::lopd::simt_emu::fail(::lopd::simt_emu::where(site) + ": WMMA pointer " +
                           std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
                           " is not 256-bit (32-byte) aligned");
  }
  if ((size_t(ldm) * sizeof(E)) % 16 != 0) {
    ::lopd::simt_emu::fail(::lopd::simt_emu::where(site) + ": WMMA leading dimension " +
                           std::to_string(ldm) + " is not a multiple of 16 bytes");
  }
}

template <typename F, typename E>
void load(F& f, const E* ptr, unsigned ldm, bool col_major,
          const ::lopd::simt_emu::SyncSite& site) {
  check_layout(ptr, ldm, site);
  ::lopd::simt_emu::warp_collective(site);
  for (int i = 0; i < F::rows; ++i) {
    for (int j = 0; j < F::cols; ++j) {
      f.x[i * F::cols + j] = col_major ? ptr[i + size_t(j) * ldm] : ptr[size_t(i) * ldm + j];
    }
  }
  ::lopd::simt_emu::warp_collective(site);
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync_impl(fragment<Use, M, N, K, T, Layout>& f, const T* ptr,
                                  unsigned ldm, const ::lopd::simt_emu::SyncSite& site) {
  static_assert(!std::is_same_v<Use, accumulator>, "accumulators: pass a layout_t");
  detail::load(f, ptr, ldm, std::is_same_v<Layout, col_major>, site);
}

template <int M, int N, int K>
inline void load_matrix_sync_impl(fragment<accumulator, M, N, K, float>& f, const float* ptr,
                                  unsigned ldm, layout_t layout,
                                  const ::lopd::simt_emu::SyncSite& site) {
  detail::load(f, ptr, ldm, layout == mem_col_major, site);
}

template <int M, int N, int K>
inline void store_matrix_sync_impl(float* ptr, const fragment<accumulator, M, N, K, float>& f,
                                   unsigned ldm, layout_t layout,
                                   const ::lopd::simt_emu::SyncSite& site) {
  using F = fragment<accumulator, M, N, K, float>;
  detail::check_layout(ptr, ldm, site);
  ::lopd::simt_emu::warp_collective(site);
  for (int i = 0; i < F::rows; ++i) {
    for (int j = 0; j < F::cols; ++j) {
      float& dst = layout == mem_col_major ? ptr[i + size_t(j) * ldm] : ptr[size_t(i) * ldm + j];
      dst = f.x[i * F::cols + j];
    }
  }
  ::lopd::simt_emu::warp_collective(site);
}

template <int M, int N, int K, typename T, typename LA, typename LB>
inline void mma_sync_impl(fragment<accumulator, M, N, K, float>& d,
                          const fragment<matrix_a, M, N, K, T, LA>& a,
                          const fragment<matrix_b, M, N, K, T, LB>& b,
                          const fragment<accumulator, M, N, K, float>& c,
                          const ::lopd::simt_emu::SyncSite& site) {
  ::lopd::simt_emu::warp_collective(site);
  float fa[M * K], fb[K * N], out[M * N];
  for (int e = 0; e < M * K; ++e) fa[e] = static_cast<float>(a.x[e]);
  for (int e = 0; e < K * N; ++e) fb[e] = static_cast<float>(b.x[e]);
  std::memcpy(out, c.x, sizeof(out));  // d may alias c
  // out[i][j] += a[i][kk] * b[kk][j], kk ascending for every (i, j); the j loop vectorises.
  for (int i = 0; i < M; ++i) {
    for (int kk = 0; kk < K; ++kk) {
      const float aik = fa[i * K + kk];
      for (int j = 0; j < N; ++j) out[i * N + j] += aik * fb[kk * N + j];
    }
  }
  std::memcpy(d.x, out, sizeof(out));
}

}  // namespace nvcuda::wmma
