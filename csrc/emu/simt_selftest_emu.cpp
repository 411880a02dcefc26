// Kernels that check the SIMT emulator itself (tests/test_simt_emulator.py): that it computes
// warp and block collectives right, and that it reports what it promises to report (divergent
// barriers, threads exiting under a barrier, and, in the AddressSanitizer build, out-of-bounds
// reads). Emulated build only.
#ifndef LOPD_SIMT_EMULATION
#error "compile with -DLOPD_SIMT_EMULATION (tests/simt_emu.py does)"
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
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CPU, m) {
  m.impl("selftest_block_sum", &block_sum);
  m.impl("selftest_oob_read", &oob_read);
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CatchAll, m) {
  m.impl("selftest_divergent_barrier", &divergent_barrier);
  m.impl("selftest_early_exit", &early_exit);
}
