// Process-wide choices between compiled kernels that compute the same thing by different
// algorithms (until a GPU benchmark has timed both): the compiled side of
// lopd_kernels/kernel_variants.py, whose select() sets them through the op
// `set_kernel_choice(str name, str value)` of each compiled op library (TORCH_LIBRARY(lopd) in
// csrc/ops.cpp, and the SIMT-emulated test build's). A launcher reads its choice at every call;
// nothing reads the environment.
#pragma once

#include <atomic>
#include <string_view>

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

namespace lopd::choices {

// topk_tail_kl.cuda_forward: "base2" (topk_tail_kl_kernels_base2.cuh, the default) or
// "natural_exp" (topk_tail_kl_fwd_kernel of topk_tail_kl_kernels.cuh).
inline std::atomic<bool>& cuda_topk_forward_base2() {
  static std::atomic<bool> base2{true};
  return base2;
}

inline bool cuda_topk_forward_is_base2() {
  return cuda_topk_forward_base2().load(std::memory_order_relaxed);
}

// The op behind lopd_kernels.kernel_variants.select for the compiled choices.
inline void set_kernel_choice(c10::string_view name, c10::string_view value) {
  const std::string_view n(name.data(), name.size());
  const std::string_view v(value.data(), value.size());
  if (n == "topk_tail_kl.cuda_forward") {
    TORCH_CHECK_VALUE(v == "base2" || v == "natural_exp", "topk_tail_kl.cuda_forward must be ",
                      "'natural_exp' or 'base2', got '", v, "'");
    cuda_topk_forward_base2().store(v == "base2");
    return;
  }
  TORCH_CHECK_VALUE(false, "no compiled kernel choice named '", n, "'");
}

}  // namespace lopd::choices
