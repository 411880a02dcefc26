// CPU implementation of lopd::topk_tail_kl_cpu_fwd / _bwd (schemas: csrc/common/schemas.h):
// argument checks, output allocation, and the choice of the per-ISA kernel
// (csrc/cpu/isa/topk_tail_kl_kernel.cpp).
//
// Supported logit dtypes: float32, bfloat16, float16 (student and teacher independently); the
// math is float32. float64 is rejected with a message pointing to backend="torch", the float64
// reference.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "common/topk_tail_kl_checks.h"
#include "cpu/buffer_cache.h"
#include "cpu/isa_dispatch.h"
#include "cpu/topk_tail_kl.h"

namespace lopd::cpu {
namespace {

namespace checks = ::lopd::topk_tail_kl;

void check_targets(const at::Tensor& target, int64_t vocab, int64_t ignore_index) {
  const int64_t* p = target.data_ptr<int64_t>();
  for (int64_t n = 0; n < target.numel(); ++n) {
    // A ValueError in Python, as every other backend's check of the targets.
    TORCH_CHECK_VALUE(p[n] == ignore_index || (p[n] >= 0 && p[n] < vocab),
                      "topk_tail_kl: target_ids[", n, "] = ", p[n], " is outside [0, V = ", vocab,
                      ") and is not ignore_index (", ignore_index, ")");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
topk_tail_kl_fwd_cpu(const at::Tensor& student_logits, const at::Tensor& teacher_logits,
                     const at::Tensor& target_ids, int64_t top_m, double temperature,
                     c10::string_view divergence, double beta, c10::string_view support,
                     int64_t ignore_index) {
  checks::check_fwd_args(student_logits, teacher_logits, target_ids, top_m, c10::DeviceType::CPU,
                         "CPU");
  const checks::Support sup = top_m == 0 ? checks::kSupportTeacher : checks::parse_support(support);
  const int64_t n = checks::rows_of(student_logits);
  const int64_t v = student_logits.size(-1);
  TopKTailKLFwdArgs a;
  a.student = checks::dense_vocab(student_logits);  // strided rows are read in place
  a.teacher = checks::dense_vocab(teacher_logits);
  a.n_rows = n;
  a.vocab = v;
  a.s_layout = checks::row_layout(a.student);
  a.t_layout = checks::row_layout(a.teacher);
  a.target = target_ids.contiguous();
  check_targets(a.target, v, ignore_index);
  a.top_m = top_m;
  a.width = checks::support_width(top_m, sup);
  a.inv_temperature = checks::checked_inv_temperature(temperature);
  a.div = checks::parse_divergence(divergence, beta);
  a.support = sup;
  a.ignore_index = ignore_index;
  std::tie(a.kl, a.student_logprob, a.teacher_logprob, a.topk_ids, a.lse, a.bucket_logp) =
      checks::empty_fwd_outputs(n, a.width, student_logits.options());
  LOPD_CPU_ISA_CALL(topk_tail_kl_fwd_kernel, a);
  return {a.kl, a.student_logprob, a.teacher_logprob, a.topk_ids, a.lse, a.bucket_logp};
}

std::tuple<at::Tensor, at::Tensor> topk_tail_kl_bwd_cpu(
    const at::Tensor& grad_kl, const at::Tensor& grad_student_logprob,
    const at::Tensor& grad_teacher_logprob, const at::Tensor& student_logits,
    const at::Tensor& teacher_logits, const at::Tensor& target_ids, const at::Tensor& topk_ids,
    const at::Tensor& kl, const at::Tensor& lse, const at::Tensor& bucket_logp,
    double temperature, c10::string_view divergence, double beta, int64_t ignore_index,
    bool student_requires_grad, bool teacher_requires_grad) {
  checks::check_bwd_args(grad_kl, grad_student_logprob, grad_teacher_logprob, student_logits,
                         teacher_logits, target_ids, topk_ids, kl, lse, bucket_logp,
                         c10::DeviceType::CPU, "CPU");
  const int64_t v = student_logits.size(-1);
  TopKTailKLBwdArgs a;
  a.grad_kl = grad_kl.contiguous();
  a.grad_student_logprob = grad_student_logprob.contiguous();
  a.grad_teacher_logprob = grad_teacher_logprob.contiguous();
  a.student = checks::dense_vocab(student_logits);
  a.teacher = checks::dense_vocab(teacher_logits);
  a.n_rows = checks::rows_of(student_logits);
  a.vocab = v;
  a.s_layout = checks::row_layout(a.student);
  a.t_layout = checks::row_layout(a.teacher);
  a.target = target_ids.contiguous();
  check_targets(a.target, v, ignore_index);
  a.topk_ids = topk_ids.contiguous();
  a.kl = kl.contiguous();
  a.lse = lse.contiguous();
  a.bucket_logp = bucket_logp.contiguous();
  a.inv_temperature = checks::checked_inv_temperature(temperature);
  a.div = checks::parse_divergence(divergence, beta);
  a.ignore_index = ignore_index;
  // The two [N, V] gradients are the op's only large allocations: recycled buffers (see
  // cpu/buffer_cache.h: fresh pages would be zeroed by the OS before the kernel writes them),
  // dense in the logits' shape (row r at r * V).
  if (student_requires_grad) {
    a.grad_student = empty_recycled(a.student.sizes(), a.student.options());
  }
  if (teacher_requires_grad) {
    a.grad_teacher = empty_recycled(a.teacher.sizes(), a.teacher.options());
  }
  if (student_requires_grad || teacher_requires_grad) {
    LOPD_CPU_ISA_CALL(topk_tail_kl_bwd_kernel, a);
  }
  // A side without gradient gets an empty float32 [0] tensor (the same for every backend).
  const auto none = student_logits.options().dtype(at::kFloat);
  return {student_requires_grad ? a.grad_student : at::empty({0}, none),
          teacher_requires_grad ? a.grad_teacher : at::empty({0}, none)};
}

}  // namespace
}  // namespace lopd::cpu

TORCH_LIBRARY_IMPL(lopd, CPU, m) {
  m.impl("topk_tail_kl_cpu_fwd", &lopd::cpu::topk_tail_kl_fwd_cpu);
  m.impl("topk_tail_kl_cpu_bwd", &lopd::cpu::topk_tail_kl_bwd_cpu);
}
