// CPU implementation of lopd::sparse_teacher_topk_tail_kl_cpu_fwd / _bwd (schemas:
// csrc/common/schemas.h; Python side and conventions: lopd_kernels/sparse_teacher_topk_tail_kl.py):
// argument checks, output allocation, and the choice of the per-ISA kernel
// (csrc/cpu/isa/sparse_teacher_topk_tail_kl_kernel.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "cpu/buffer_cache.h"
#include "cpu/isa_dispatch.h"
#include "cpu/sparse_teacher_topk_tail_kl.h"

namespace lopd::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOp = "sparse_teacher_topk_tail_kl";

void check_student(const at::Tensor& s) {
  TORCH_CHECK(s.device().is_cpu(), kOp, " (CPU): student_logits must be a CPU tensor, got ",
              s.device());
  TORCH_CHECK(s.dim() == 2 && s.size(1) >= 1, kOp,
              ": student_logits must be 2-D [N, V] with V >= 1, got shape ", s.sizes());
  const auto dt = s.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, kOp,
              " (CPU): student_logits must be float32, bfloat16 or float16, got ", dt,
              " (float64 runs only on backend='torch', the reference)");
}

void check_tensor(const at::Tensor& x, const char* name, at::IntArrayRef shape,
                  at::ScalarType dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.sizes() == shape && x.scalar_type() == dtype, kOp, ": ",
              name, " must be a CPU ", dtype, " tensor of shape ", shape, ", got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
}

// Targets in [0, V) (or ignore_index), and the real (finite log-prob) slots' ids of kept rows in
// [0, V): the kernels index the student row with both.
void check_indices(const at::Tensor& target, const at::Tensor& ids, const at::Tensor* logprobs,
                   const at::Tensor& bucket_logp, int64_t vocab, int64_t ignore_index) {
  const int64_t n = ids.size(0), m = ids.size(1);
  const int64_t* tp = target.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* lq = logprobs ? logprobs->data_ptr<float>() : bucket_logp.data_ptr<float>();
  const int64_t lq_row = logprobs ? m : 2 * (m + 1);
  const int64_t lq_off = logprobs ? 0 : m + 1;  // bucket_logp[:, 1, :M] = log Q of the slots
  for (int64_t r = 0; r < n; ++r) {
    if (tp[r] == ignore_index) continue;
    TORCH_CHECK_VALUE(tp[r] >= 0 && tp[r] < vocab, kOp, ": target_ids[", r, "] = ", tp[r],
                      " is outside [0, V = ", vocab, ") and is not ignore_index (", ignore_index,
                      ")");
    for (int64_t i = 0; i < m; ++i) {
      const bool real = lq[r * lq_row + lq_off + i] != kNegInf;
      const int64_t id = ip[r * m + i];
      TORCH_CHECK_VALUE(!real || (id >= 0 && id < vocab), kOp, ": teacher_topk_ids[", r, ", ",
                        i, "] = ", id, " is outside [0, V = ", vocab, ")");
    }
  }
}

float checked_inv_temperature(double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, kOp,
              ": temperature must be a finite number > 0, got ", temperature);
  return static_cast<float>(1.0 / temperature);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_teacher_fwd_cpu(
    const at::Tensor& student_logits, const at::Tensor& teacher_topk_logprobs,
    const at::Tensor& teacher_topk_ids, const at::Tensor& target_ids, double temperature,
    bool reverse, int64_t ignore_index, double tail_floor) {
  check_student(student_logits);
  const int64_t n = student_logits.size(0), v = student_logits.size(1);
  TORCH_CHECK(teacher_topk_ids.dim() == 2 && teacher_topk_ids.size(1) >= 1, kOp,
              ": teacher_topk_ids must be 2-D [N, M] with M >= 1, got ", teacher_topk_ids.sizes());
  const int64_t m = teacher_topk_ids.size(1);
  check_tensor(teacher_topk_ids, "teacher_topk_ids", {n, m}, at::kLong);
  check_tensor(teacher_topk_logprobs, "teacher_topk_logprobs", {n, m}, at::kFloat);
  check_tensor(target_ids, "target_ids", {n}, at::kLong);
  TORCH_CHECK(tail_floor >= 0.0 && tail_floor < 1.0, kOp, ": tail_floor must be in [0, 1), got ",
              tail_floor);
  const float inv_t = checked_inv_temperature(temperature);
  const at::Tensor s = student_logits.contiguous();
  const at::Tensor lp = teacher_topk_logprobs.contiguous();
  const at::Tensor ids = teacher_topk_ids.contiguous();
  const at::Tensor tgt = target_ids.contiguous();
  check_indices(tgt, ids, &lp, lp, v, ignore_index);
  const auto f32 = s.options().dtype(at::kFloat);
  at::Tensor kl = at::empty({n}, f32), slp = at::empty({n}, f32), lse = at::empty({n}, f32);
  at::Tensor bucket = at::empty({n, 2, m + 1}, f32);
  SparseTeacherFwdArgs a{s,     lp,  ids, tgt, inv_t, reverse, ignore_index,
                         static_cast<float>(tail_floor), kl, slp, lse, bucket};
  LOPD_CPU_ISA_CALL(sparse_teacher_fwd_kernel, a);
  return {kl, slp, lse, bucket};
}

at::Tensor sparse_teacher_bwd_cpu(const at::Tensor& grad_kl, const at::Tensor& grad_student_logprob,
                                  const at::Tensor& student_logits,
                                  const at::Tensor& teacher_topk_ids, const at::Tensor& target_ids,
                                  const at::Tensor& kl, const at::Tensor& lse,
                                  const at::Tensor& bucket_logp, double temperature, bool reverse,
                                  int64_t ignore_index) {
  check_student(student_logits);
  const int64_t n = student_logits.size(0), v = student_logits.size(1);
  TORCH_CHECK(teacher_topk_ids.dim() == 2, kOp, ": teacher_topk_ids must be 2-D [N, M], got ",
              teacher_topk_ids.sizes());
  const int64_t m = teacher_topk_ids.size(1);
  check_tensor(teacher_topk_ids, "teacher_topk_ids", {n, m}, at::kLong);
  check_tensor(target_ids, "target_ids", {n}, at::kLong);
  check_tensor(grad_kl, "grad_kl", {n}, at::kFloat);
  check_tensor(grad_student_logprob, "grad_student_logprob", {n}, at::kFloat);
  check_tensor(kl, "kl", {n}, at::kFloat);
  check_tensor(lse, "lse", {n}, at::kFloat);
  check_tensor(bucket_logp, "bucket_logp", {n, 2, m + 1}, at::kFloat);
  const float inv_t = checked_inv_temperature(temperature);
  const at::Tensor s = student_logits.contiguous();
  const at::Tensor ids = teacher_topk_ids.contiguous();
  const at::Tensor tgt = target_ids.contiguous();
  const at::Tensor bucket = bucket_logp.contiguous();
  check_indices(tgt, ids, nullptr, bucket, v, ignore_index);
  // The [N, V] gradient is the op's only large allocation: a recycled buffer (see
  // cpu/buffer_cache.h: fresh pages would be zeroed by the OS before the kernel writes them).
  at::Tensor grad = empty_recycled(s.sizes(), s.options());
  SparseTeacherBwdArgs a{grad_kl.contiguous(), grad_student_logprob.contiguous(), s, ids, tgt,
                         kl.contiguous(), lse.contiguous(), bucket, inv_t, reverse, ignore_index,
                         grad};
  LOPD_CPU_ISA_CALL(sparse_teacher_bwd_kernel, a);
  return grad;
}

}  // namespace
}  // namespace lopd::cpu

TORCH_LIBRARY_IMPL(lopd, CPU, m) {
  m.impl("sparse_teacher_topk_tail_kl_cpu_fwd", &lopd::cpu::sparse_teacher_fwd_cpu);
  m.impl("sparse_teacher_topk_tail_kl_cpu_bwd", &lopd::cpu::sparse_teacher_bwd_cpu);
}
