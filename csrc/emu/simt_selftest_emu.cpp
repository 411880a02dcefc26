// Kernels that check the SIMT emulator itself (tests/kernels/test_simt_emulator.py): that it computes
// warp and block collectives right, and that it reports what it promises to report (divergent
// barriers, threads exiting under a barrier, and, in the AddressSanitizer build, out-of-bounds
// reads). Emulated build only.
#ifndef LOPD_SIMT_EMULATION
#error "compile with -DLOPD_SIMT_EMULATION (tests/kernels/simt_emu.py does)"
#endif

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/simt.cuh"

namespace {

// out[block] = sum of x[block, :] by a warp-shuffle reduction inside each warp, then shared
// memory across warps; also out[block] gets atomicAdd-ed by each warp leader into `total`.
__global__ void block_sum_kernel(const float* x, int64_t n, float* out, float* total) {
  __shared__ float partial[32];
  const float* row = x + int64_t(blockIdx.x) * n;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += row[i];
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) {
    partial[threadIdx.x / 32] = acc;
    atomicAdd(total, acc);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}

// Thread 0 takes a different __syncthreads() than the others: undefined behaviour on a GPU.
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Odd threads return before a barrier that the even ones wait at.
__global__ void early_exit_kernel(float* out) {
  if (threadIdx.x % 2 == 1) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Reads one element past the end of x (what AddressSanitizer must catch).
__global__ void oob_read_kernel(const float* x, int64_t n, float* out) {
  if (threadIdx.x == 0) out[0] = x[n];
}

// c = alpha * a @ b (+ c_in if accumulate) for a [M, K] row-major and b given as bt = b^T [N, K]
// row-major (a col_major B fragment), M, N, K multiples of 16: one warp per 16x16 tile of c,
// WMMA m16n16k16 with fp32 accumulators; alpha applied element-wise through num_elements / x[].
template <typename T>
__global__ void wmma_gemm_kernel(const T* a, const T* bt, float* c, int M, int N, int K,
                                 float alpha, bool accumulate) {
  using namespace nvcuda;
  const int warp = threadIdx.x / 32;
  const int tiles_n = N / 16;
  for (int t = warp; t < (M / 16) * tiles_n; t += blockDim.x / 32) {
    const int i0 = (t / tiles_n) * 16, j0 = (t % tiles_n) * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    if (accumulate) {
      wmma::load_matrix_sync(acc, c + i0 * N + j0, N, wmma::mem_row_major);
    } else {
      wmma::fill_fragment(acc, 0.0f);
    }
    for (int k0 = 0; k0 < K; k0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
      wmma::load_matrix_sync(fa, a + i0 * K + k0, K);
      wmma::load_matrix_sync(fb, bt + j0 * K + k0, K);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    for (int e = 0; e < acc.num_elements; ++e) acc.x[e] *= alpha;
    wmma::store_matrix_sync(c + i0 * N + j0, acc, N, wmma::mem_row_major);
  }
}

// Only the lower half of each warp reaches mma_sync: a divergent warp collective.
__global__ void wmma_partial_warp_kernel(const __half* a, float* c) {
  using namespace nvcuda;
  if (threadIdx.x % 32 >= 16) return;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  wmma::fill_fragment(fa, 1.0f);
  wmma::fill_fragment(fb, 1.0f);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

// a [M, K], b [K, N] (fp16 or bf16), c_in [M, N] fp32 (used when accumulate): returns
// alpha * (a @ b + c_in) computed by wmma_gemm_kernel.
at::Tensor wmma_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c_in,
                     double alpha, bool accumulate, int64_t warps) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "a [M, K], b [K, N]");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "a and b: one dtype");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "M, N, K: multiples of 16");
  at::Tensor a_c = a.contiguous();
  at::Tensor bt = b.t().contiguous();
  at::Tensor c = accumulate ? c_in.to(at::kFloat).contiguous().clone()
                            : at::empty({M, N}, a.options().dtype(at::kFloat));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    LOPD_LAUNCH(wmma_gemm_kernel<T>, 1u, unsigned(32 * warps), 0,
                reinterpret_cast<const T*>(a_c.data_ptr()),
                reinterpret_cast<const T*>(bt.data_ptr()), c.data_ptr<float>(), int(M), int(N),
                int(K), float(alpha), accumulate);
  };
  if (a.scalar_type() == at::kHalf) {
    run(__half{});
  } else {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16, "a, b: float16 or bfloat16");
    run(__nv_bfloat16{});
  }
  return c;
}

// One matrix_a load from buf + offset with leading dimension ldm (elements): the emulator must
// refuse what the hardware does not allow (pointer not 32-byte aligned, ldm not 16 bytes).
__global__ void wmma_layout_kernel(const __half* buf, int offset, int ldm, float* out) {
  using namespace nvcuda;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::load_matrix_sync(fa, buf + offset, unsigned(ldm));
  if (threadIdx.x == 0) out[0] = static_cast<float>(fa.x[0]);
}

at::Tensor wmma_layout(int64_t offset, int64_t ldm) {
  at::Tensor buf = at::ones({16 * 64 + 64}, at::kHalf);  // 64-byte aligned (torch's CPU allocator)
  at::Tensor out = at::zeros({1});
  LOPD_LAUNCH(wmma_layout_kernel, 1u, 32u, 0, reinterpret_cast<const __half*>(buf.data_ptr()),
              int(offset), int(ldm), out.data_ptr<float>());
  return out;
}

// A trivial launch with the given grid and dynamic shared memory (launch-limit checks).
__global__ void noop_kernel(float* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = 1.0f;
}

at::Tensor launch_limits(int64_t grid_x, int64_t grid_y, int64_t smem_bytes) {
  at::Tensor out = at::zeros({1});
  LOPD_LAUNCH(noop_kernel, dim3(unsigned(grid_x), unsigned(grid_y)), 32u, size_t(smem_bytes),
              out.data_ptr<float>());
  return out;
}

at::Tensor wmma_partial_warp() {
  at::Tensor a = at::zeros({16, 16}, at::kHalf);
  at::Tensor c = at::zeros({16, 16});
  LOPD_LAUNCH(wmma_partial_warp_kernel, 1u, 32u, 0,
              reinterpret_cast<const __half*>(a.data_ptr()), c.data_ptr<float>());
  return c;
}

at::Tensor block_sum(const at::Tensor& x, int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [B, n] f32");
  at::Tensor out = at::empty({x.size(0)}, x.options());
  at::Tensor total = at::zeros({1}, x.options());
  LOPD_LAUNCH(block_sum_kernel, unsigned(x.size(0)), unsigned(threads), 0,
              x.data_ptr<float>(), x.size(1), out.data_ptr<float>(), total.data_ptr<float>());
  return at::cat({out, total});
}

at::Tensor divergent_barrier(int64_t threads) {
  at::Tensor out = at::zeros({threads});
  LOPD_LAUNCH(divergent_barrier_kernel, 1u, unsigned(threads), 0, out.data_ptr<float>());
  return out;
}

at::Tensor early_exit(int64_t threads) {
  at::Tensor out = at::zeros({threads});
  LOPD_LAUNCH(early_exit_kernel, 1u, unsigned(threads), 0, out.data_ptr<float>());
  return out;
}

at::Tensor oob_read(const at::Tensor& x) {
  at::Tensor out = at::zeros({1});
  LOPD_LAUNCH(oob_read_kernel, 1u, 32u, 0, x.data_ptr<float>(), x.numel(), out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lopd_simt_emu, m) {
  m.def("selftest_block_sum(Tensor x, int threads) -> Tensor");
  m.def("selftest_divergent_barrier(int threads) -> Tensor");
  m.def("selftest_early_exit(int threads) -> Tensor");
  m.def("selftest_oob_read(Tensor x) -> Tensor");
  m.def(
      "selftest_wmma_gemm(Tensor a, Tensor b, Tensor c, float alpha, bool accumulate, int warps) "
      "-> Tensor");
  m.def("selftest_wmma_partial_warp() -> Tensor");
  m.def("selftest_wmma_layout(int offset, int ldm) -> Tensor");
  m.def("selftest_launch_limits(int grid_x, int grid_y, int smem_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CPU, m) {
  m.impl("selftest_block_sum", &block_sum);
  m.impl("selftest_oob_read", &oob_read);
  m.impl("selftest_wmma_gemm", &wmma_gemm);
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CatchAll, m) {
  m.impl("selftest_divergent_barrier", &divergent_barrier);
  m.impl("selftest_early_exit", &early_exit);
  m.impl("selftest_wmma_partial_warp", &wmma_partial_warp);
  m.impl("selftest_wmma_layout", &wmma_layout);
  m.impl("selftest_launch_limits", &launch_limits);
}
