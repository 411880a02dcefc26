// The CUDA implementation of lopd::topk_tail_kl_cuda_fwd / _bwd: the kernels of
// topk_tail_kl_kernels.cuh and topk_tail_kl_kernels_base2.cuh, launched by
// topk_tail_kl_launch.cuh (also run on the CPU by the SIMT-emulated test build,
// csrc/emu/topk_tail_kl_emu.cpp), registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda/topk_tail_kl_launch.cuh"

TORCH_LIBRARY_IMPL(lopd, CUDA, m) {
  m.impl("topk_tail_kl_cuda_fwd", &lopd::cuda::topk_tail_kl_fwd_cuda);
  m.impl("topk_tail_kl_cuda_bwd", &lopd::cuda::topk_tail_kl_bwd_cuda);
}
