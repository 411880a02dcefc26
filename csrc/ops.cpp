// Declares every torch.ops.lopd.* op implemented in C++/CUDA (schemas and their documentation:
// csrc/common/schemas.h). Implementations register per dispatch key in csrc/cpu/<op>.cpp and
// csrc/cuda/<op>.cu (TORCH_LIBRARY_IMPL), so a CPU build and a CUDA build expose the same op
// names. Fake (meta) implementations for torch.compile live next to each op in
// lopd_kernels/<op>.py. fused_linear_topk_tail_kl and varlen_cross_attention's CPU and Triton
// paths are Python custom ops (lopd_kernels/) built on these and on vendor GEMMs / Triton;
// varlen_cross_attention_cuda_* have only a CUDA implementation (a CPU build declares them
// without a kernel).
#include <Python.h>
#include <torch/library.h>

#include "common/schemas.h"

TORCH_LIBRARY(lopd, m) {
  m.def(lopd::schemas::kTopkTailKlFwd);
  m.def(lopd::schemas::kTopkTailKlBwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCudaFwd);
  m.def(lopd::schemas::kVarlenCrossAttentionCudaBwd);
}

// `import lopd_kernels._C` loads this library (and with it the registrations above); the module
// itself exposes nothing: every entry point is a torch.ops.lopd.* op.
static struct PyModuleDef lopd_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&lopd_c_module); }
