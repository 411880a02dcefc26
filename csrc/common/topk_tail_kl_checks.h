// Host-side argument checks of lopd::topk_tail_kl_{cpu,cuda}_{fwd,bwd}, shared by the CPU op
// (csrc/cpu/topk_tail_kl.cpp) and the CUDA op (csrc/cuda/topk_tail_kl.cu) so both reject the
// same inputs with the same messages, each naming the bad argument.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <tuple>

#include "common/topk_tail_kl_math.h"

namespace lopd::topk_tail_kl {

// `backend` ("CPU" or "CUDA") names the implementation in messages; `device_type` is where it
// runs.
inline void check_logits(const at::Tensor& x, const char* name, c10::DeviceType device_type,
                         const char* backend) {
  TORCH_CHECK(x.device().type() == device_type, "topk_tail_kl (", backend, "): ", name,
              " must be a ", backend, " tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "topk_tail_kl: ", name,
              " must be [N, V] or [B, L, V], got shape ", x.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "topk_tail_kl (",
              backend, "): ", name, " must be float32, bfloat16 or float16, got ", dt,
              " (float64 runs only on backend='torch', the reference)");
}

// Both logits: each valid for the backend, same device, same [N, V] with V >= 1.
inline void check_logits_pair(const at::Tensor& student, const at::Tensor& teacher,
                              c10::DeviceType device_type, const char* backend) {
  check_logits(student, "student_logits", device_type, backend);
  check_logits(teacher, "teacher_logits", device_type, backend);
  TORCH_CHECK(student.device() == teacher.device(),
              "topk_tail_kl: student_logits and teacher_logits must be on the same device, got ",
              student.device(), " and ", teacher.device());
  TORCH_CHECK(student.sizes() == teacher.sizes(),
              "topk_tail_kl: student_logits and teacher_logits must have the same shape, got ",
              student.sizes(), " and ", teacher.sizes());
  TORCH_CHECK(student.size(-1) >= 1,
              "topk_tail_kl: the vocabulary (last dim of student_logits) is empty");
}

// Rows N of [N, V] or [B, L, V] logits (B * L).
inline int64_t rows_of(const at::Tensor& x) {
  return x.dim() == 2 ? x.size(0) : x.size(0) * x.size(1);
}

// The logits as the kernels read them: in place when the vocabulary axis is dense (any other
// strides: see RowLayout), else a contiguous copy.
inline at::Tensor dense_vocab(const at::Tensor& x) {
  return x.stride(-1) == 1 || x.size(-1) <= 1 ? x : x.contiguous();
}

inline RowLayout row_layout(const at::Tensor& x) {
  if (x.dim() == 2) return RowLayout{std::max<int64_t>(x.size(0), 1), 0, x.stride(0)};
  return RowLayout{std::max<int64_t>(x.size(1), 1), x.stride(0), x.stride(1)};
}

inline void check_row_vector(const at::Tensor& x, const char* name, int64_t n,
                             at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(x.device() == device, "topk_tail_kl: ", name, " must be on ", device, " like the ",
              "logits, got ", x.device());
  TORCH_CHECK(x.dim() == 1 && x.size(0) == n, "topk_tail_kl: ", name, " must have shape [", n,
              "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == dtype, "topk_tail_kl: ", name, " must be ", dtype, ", got ",
              x.scalar_type());
}

// The divergence as the kernels run it: "jsd" at beta 0 / 1 is the forward / reverse KL (TRL's
// convention, docs/math.md section 1b), so it takes their code and gives their bits.
inline DivergenceSpec parse_divergence(std::string_view divergence, double beta) {
  if (divergence == "reverse") return DivergenceSpec{kReverse, 1.0f};
  if (divergence == "forward") return DivergenceSpec{kForward, 0.0f};
  TORCH_CHECK(divergence == "jsd", "topk_tail_kl: divergence must be 'reverse', 'forward' or ",
              "'jsd', got '", divergence, "'");
  TORCH_CHECK(std::isfinite(beta) && beta >= 0.0 && beta <= 1.0,
              "topk_tail_kl: beta must be in [0, 1] for divergence='jsd', got ", beta);
  if (beta == 0.0) return DivergenceSpec{kForward, 0.0f};
  if (beta == 1.0) return DivergenceSpec{kReverse, 1.0f};
  return DivergenceSpec{kJsd, static_cast<float>(beta)};
}

inline Support parse_support(std::string_view support) {
  if (support == "teacher") return kSupportTeacher;
  if (support == "student") return kSupportStudent;
  TORCH_CHECK(support == "union", "topk_tail_kl: support must be 'teacher', 'student' or ",
              "'union', got '", support, "'");
  return kSupportUnion;
}

// K, the width of topk_ids: M, or 2M for the union; 0 for the full vocabulary.
inline int64_t support_width(int64_t top_m, Support support) {
  return support == kSupportUnion ? 2 * top_m : top_m;
}

// An implementation without a kernel for an option refuses it in one line (the Python resolver
// routes such calls elsewhere; this is for direct calls of the op).
inline void check_kernel_has(bool has, const char* backend, const char* what) {
  TORCH_CHECK(has, "topk_tail_kl (", backend, "): this build has no kernel for ", what,
              " yet; call lopd_kernels.topk_tail_kl(..., backend='auto'), which routes it to an "
              "implementation that has one");
}

inline float checked_inv_temperature(double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0,
              "topk_tail_kl: temperature must be a finite number > 0, got ", temperature);
  return static_cast<float>(1.0 / temperature);
}

// The forward's six outputs, uninitialized, on the logits' device: kl, student_logprob,
// teacher_logprob [N] fp32, topk_ids [N, K] int64, lse [N, 2] and bucket_logp [N, 2, K + 1] fp32
// (K = support_width(M, support)).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
empty_fwd_outputs(int64_t n, int64_t width, const at::TensorOptions& logits_options) {
  const auto f32 = logits_options.dtype(at::kFloat);
  return {at::empty({n}, f32),        at::empty({n}, f32),
          at::empty({n}, f32),        at::empty({n, width}, f32.dtype(at::kLong)),
          at::empty({n, 2}, f32),     at::empty({n, 2, width + 1}, f32)};
}

// Forward arguments (target values are checked by the caller: on CPU by reading them, on CUDA
// by the Python wrapper, which avoids a device sync here).
inline void check_fwd_args(const at::Tensor& student, const at::Tensor& teacher,
                           const at::Tensor& target_ids, int64_t top_m,
                           c10::DeviceType device_type, const char* backend) {
  check_logits_pair(student, teacher, device_type, backend);
  const int64_t v = student.size(-1);
  check_row_vector(target_ids, "target_ids", rows_of(student), at::kLong, student.device());
  TORCH_CHECK(top_m == 0 || (top_m >= 1 && top_m < v), "topk_tail_kl: top_m must be 0 (full ",
              "vocabulary) or in [1, V = ", v, "), got ", top_m);
}

// Backward arguments; returns K (the width of topk_ids: M, or 2M for a union, whose -1 slots
// the kernels skip).
inline int64_t check_bwd_args(const at::Tensor& grad_kl, const at::Tensor& grad_student_logprob,
                              const at::Tensor& grad_teacher_logprob, const at::Tensor& student,
                              const at::Tensor& teacher, const at::Tensor& target_ids,
                              const at::Tensor& topk_ids, const at::Tensor& kl,
                              const at::Tensor& lse, const at::Tensor& bucket_logp,
                              c10::DeviceType device_type, const char* backend) {
  check_logits_pair(student, teacher, device_type, backend);
  const auto dev = student.device();
  const int64_t n = rows_of(student);
  const int64_t v = student.size(-1);
  check_row_vector(target_ids, "target_ids", n, at::kLong, dev);
  check_row_vector(grad_kl, "grad_kl", n, at::kFloat, dev);
  check_row_vector(grad_student_logprob, "grad_student_logprob", n, at::kFloat, dev);
  check_row_vector(grad_teacher_logprob, "grad_teacher_logprob", n, at::kFloat, dev);
  check_row_vector(kl, "kl", n, at::kFloat, dev);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == n && topk_ids.size(1) < 2 * v &&
                  topk_ids.scalar_type() == at::kLong && topk_ids.device() == dev,
              "topk_tail_kl: topk_ids must be int64 [N = ", n, ", K < 2 V = ", 2 * v, "] on ",
              dev, ", got ", topk_ids.scalar_type(), " ", topk_ids.sizes(), " on ",
              topk_ids.device());
  const int64_t m = topk_ids.size(1);
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == n && lse.size(1) == 2 &&
                  lse.scalar_type() == at::kFloat && lse.device() == dev,
              "topk_tail_kl: lse must be float32 [N = ", n, ", 2] on ", dev, ", got ",
              lse.scalar_type(), " ", lse.sizes(), " on ", lse.device());
  TORCH_CHECK(bucket_logp.dim() == 3 && bucket_logp.size(0) == n && bucket_logp.size(1) == 2 &&
                  bucket_logp.size(2) == m + 1 && bucket_logp.scalar_type() == at::kFloat &&
                  bucket_logp.device() == dev,
              "topk_tail_kl: bucket_logp must be float32 [N = ", n, ", 2, M + 1 = ", m + 1,
              "] on ", dev, ", got ", bucket_logp.scalar_type(), " ", bucket_logp.sizes(), " on ",
              bucket_logp.device());
  return m;
}

}  // namespace lopd::topk_tail_kl
