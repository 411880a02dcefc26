// The CUDA implementation of lopd::varlen_cross_attention_cuda_fwd / _bwd: the kernels of
// varlen_cross_attention_kernels.cuh (CUDA cores) and varlen_cross_attention_kernels_wmma.cuh
// (tensor cores), launched by varlen_cross_attention_launch.cuh (also run on the CPU by the
// SIMT-emulated test build, csrc/emu/varlen_cross_attention_emu.cpp), registered for the CUDA
// dispatch key.
#include <torch/library.h>

#include "cuda/varlen_cross_attention_launch.cuh"

TORCH_LIBRARY_IMPL(lopd, CUDA, m) {
  m.impl("varlen_cross_attention_cuda_fwd",
         &lopd::cuda::varlen_xattn::varlen_cross_attention_fwd_cuda);
  m.impl("varlen_cross_attention_cuda_bwd",
         &lopd::cuda::varlen_xattn::varlen_cross_attention_bwd_cuda);
}
