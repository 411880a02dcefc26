// Declares every torch.ops.lopd.* op implemented in C++/CUDA (schemas and their documentation:
// csrc/common/schemas.h). Implementations register per dispatch key in csrc/cpu/<op>.cpp and
// csrc/cuda/<op>.cu (TORCH_LIBRARY_IMPL); every build declares the same op names, a CPU build
// the `_cuda_` ops without a kernel. Fake (meta) implementations and autograd for torch.compile
// are registered by each op's CustomOps in lopd_kernels/<op>.py (lopd_kernels/_custom_ops.py).
// The Triton implementations, fused_linear_topk_tail_kl and fused_linear_logprob's cuda one are
// Python custom ops, defined there too;
// the Python module `lopd_kernels._C` itself (build information for
// `python -m lopd_kernels.info`) is csrc/module.cpp.
#include <torch/library.h>

#include "common/kernel_choices.h"
#include "common/schemas.h"

TORCH_LIBRARY(lopd, m) {
  m.def(lopd::schemas::kTopkTailKlCpuFwd);
  m.def(lopd::schemas::kTopkTailKlCpuBwd);
  m.def(lopd::schemas::kTopkTailKlCudaFwd);
  m.def(lopd::schemas::kTopkTailKlCudaBwd);
  m.def(lopd::schemas::kSparseTeacherCpuFwd);
  m.def(lopd::schemas::kSparseTeacherCpuBwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCpuFwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCpuBwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCudaFwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCudaBwd);
  m.def(lopd::schemas::kFusedLinearLogprobCpuFwd);
  m.def(lopd::schemas::kFusedLinearLogprobCpuBwd);
  // The process-wide kernel choices (csrc/common/kernel_choices.h).
  m.def("set_kernel_choice(str name, str value) -> ()");
}

TORCH_LIBRARY_IMPL(lopd, CatchAll, m) {
  m.impl("set_kernel_choice", &lopd::choices::set_kernel_choice);
}
