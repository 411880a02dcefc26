// Test build: the CUDA kernels of csrc/cuda/varlen_cross_attention_kernels.cuh and
// csrc/cuda/varlen_cross_attention_kernels_wmma.cuh (launched by
// csrc/cuda/varlen_cross_attention_launch.cuh), compiled by g++ and run on CPU tensors by the
// SIMT emulator (csrc/emu/simt_emulator.h), as
// torch.ops.lopd_simt_emu.varlen_cross_attention_cuda_fwd / _bwd with the same schemas as
// torch.ops.lopd.*. Built and loaded by tests/kernels/simt_emu.py; never part of the installed library.
// The library block itself (TORCH_LIBRARY(lopd_simt_emu, m)) lives in topk_tail_kl_emu.cpp.
#ifndef LOPD_SIMT_EMULATION
#error "compile with -DLOPD_SIMT_EMULATION (tests/kernels/simt_emu.py does)"
#endif

#include <torch/library.h>

#include "common/schemas.h"
#include "cuda/varlen_cross_attention_launch.cuh"

TORCH_LIBRARY_FRAGMENT(lopd_simt_emu, m) {
  m.def(lopd::schemas::kVarlenCrossAttentionCudaFwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCudaBwd);
}

TORCH_LIBRARY_IMPL(lopd_simt_emu, CPU, m) {
  m.impl("varlen_cross_attention_cuda_fwd",
         &lopd::cuda::varlen_xattn::varlen_cross_attention_fwd_cuda);
  m.impl("varlen_cross_attention_cuda_bwd",
         &lopd::cuda::varlen_xattn::varlen_cross_attention_bwd_cuda);
}
