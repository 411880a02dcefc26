// Test build: the CUDA kernels of csrc/cuda/topk_tail_kl_kernels.cuh and
// csrc/cuda/topk_tail_kl_kernels_base2.cuh, compiled by g++ and run on CPU tensors by the SIMT
// emulator (csrc/emu/simt_emulator.h), as torch.ops.lopd_simt_emu.* with the same schemas as
// torch.ops.lopd.* (and its own set_kernel_choice). Built and loaded by tests/kernels/simt_emu.py; never
// part of the installed library.
#ifndef LOPD_SIMT_EMULATION
#error "compile with -DLOPD_SIMT_EMULATION (tests/kernels/simt_emu.py does)"
#endif

#include <torch/library.h>

#include "common/schemas.h"
#include "cuda/topk_tail_kl_launch.cuh"

namespace {
void set_schedule_seed(int64_t seed) { lopd::simt_emu::set_schedule_seed(uint64_t(seed)); }
}  // namespace

TORCH_LIBRARY(lopd_simt_emu, m) {
  m.def(lopd::schemas::kTopkTailKlCudaFwd);
  m.def(lopd::schemas::kTopkTailKlCudaBwd);
  // 0: threads resume round-robin; any other value: a random order seeded by it.
  m.def("set_schedule_seed(int seed) -> ()");
  m.def("set_kernel_choice(str name, str value) -> ()");
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CPU, m) {
  m.impl("topk_tail_kl_cuda_fwd", &lopd::cuda::topk_tail_kl_fwd_cuda);
  m.impl("topk_tail_kl_cuda_bwd", &lopd::cuda::topk_tail_kl_bwd_cuda);
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CatchAll, m) {
  m.impl("set_schedule_seed", &set_schedule_seed);
  m.impl("set_kernel_choice", &lopd::choices::set_kernel_choice);
}
