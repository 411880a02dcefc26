// Host side of lopd::topk_tail_kl_cuda_fwd / _bwd (schemas: csrc/common/schemas.h): argument
// checks, output allocation, the dtype dispatch and the launches of the kernels of
// topk_tail_kl_kernels.cuh (the natural_exp forward, the backward) and
// topk_tail_kl_kernels_base2.cuh (the base2 forward), the forward chosen by the process setting
// topk_tail_kl.cuda_forward (csrc/common/kernel_choices.h).
// Which forward kernel runs for which option (top-M; the full vocabulary ignores the support):
//   support="teacher": the top-M kernel <TS, TT> on (student, teacher);
//   support="student": the same kernel with the rows swapped, <TT, TS> on (teacher, student)
//                      (FwdParams::swapped: it selects on its second row, the student's);
//   support="union":   the top-M kernel's instance <TS, TT, kUnion = true> (two selections);
//   full vocabulary:   natural_exp's kernel (the JSD: two passes inside it); base2's full
//                      kernel, or topk_tail_kl_fwd_full_jsd_base2_kernel for the JSD.
// Included by csrc/cuda/topk_tail_kl.cu (nvcc) and csrc/emu/topk_tail_kl_emu.cpp (g++, the SIMT
// emulator).
#pragma once

#include "common/kernel_choices.h"
#include "cuda/topk_tail_kl_kernels.cuh"
#include "cuda/topk_tail_kl_kernels_base2.cuh"

namespace lopd::cuda {
namespace {

// Calls F.template operator()<TS, TT>() for the (student, teacher) dtype pair.
template <typename F>
void dispatch_pair(at::ScalarType s, at::ScalarType t, F&& f) {
  auto with_t = [&](auto s_tag) {
    using TS = decltype(s_tag);
    switch (t) {
      case at::kFloat:
        f(TS{}, float{});
        break;
      case at::kHalf:
        f(TS{}, __half{});
        break;
      default:
        f(TS{}, __nv_bfloat16{});
        break;
    }
  };
  switch (s) {
    case at::kFloat:
      with_t(float{});
      break;
    case at::kHalf:
      with_t(__half{});
      break;
    default:
      with_t(__nv_bfloat16{});
      break;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
topk_tail_kl_fwd_cuda(const at::Tensor& student_logits, const at::Tensor& teacher_logits,
                      const at::Tensor& target_ids, int64_t top_m, double temperature,
                      c10::string_view divergence, double beta, c10::string_view support,
                      int64_t ignore_index) {
  checks::check_fwd_args(student_logits, teacher_logits, target_ids, top_m,
                         LOPD_SIMT_DEVICE_TYPE, LOPD_SIMT_BACKEND);
  const checks::DivergenceSpec div = checks::parse_divergence(divergence, beta);
  const checks::Support sup = top_m == 0 ? checks::kSupportTeacher : checks::parse_support(support);
  const int64_t width = checks::support_width(top_m, sup);
  const bool on_union = sup == checks::kSupportUnion;
  const bool swapped = sup == checks::kSupportStudent;
  const int64_t n = checks::rows_of(student_logits);
  const int64_t v = student_logits.size(-1);
  // The base2 forward indexes within a row in 32 bits (with room for a tile past the end).
  TORCH_CHECK(v < (int64_t(1) << 31), "topk_tail_kl (" LOPD_SIMT_BACKEND "): V must be < 2^31, got ",
              v);
  TORCH_CHECK(top_m <= kMaxTopM, "topk_tail_kl (" LOPD_SIMT_BACKEND "): top_m must be <= ", kMaxTopM, ", got ",
              top_m, " (use top_m=None for the full vocabulary)");  // a union: 2 top_m ids
  LOPD_DEVICE_GUARD(student_logits.device());
  // Rows are read in place wherever they start (a [B, L, V] view such as logits[:, :-1], rows
  // of any stride); only a vocabulary axis that is not dense is copied.
  const at::Tensor s = checks::dense_vocab(student_logits);
  const at::Tensor t = checks::dense_vocab(teacher_logits);
  const at::Tensor tgt = target_ids.contiguous();
  const bool base2 = ::lopd::choices::cuda_topk_forward_is_base2();
  auto [kl, slp, tlp, ids, lse, bucket] = checks::empty_fwd_outputs(n, width, s.options());
  if (n > 0) {
    // support="student": the kernel's rows are (teacher, student), see FwdParams.
    FwdParams prm{swapped ? checks::row_layout(t) : checks::row_layout(s),
                  swapped ? checks::row_layout(s) : checks::row_layout(t),
                  tgt.data_ptr<int64_t>(), kl.data_ptr<float>(), slp.data_ptr<float>(),
                  tlp.data_ptr<float>(), ids.data_ptr<int64_t>(), lse.data_ptr<float>(),
                  bucket.data_ptr<float>(), n, v, top_m, ignore_index, width,
                  checks::checked_inv_temperature(temperature), div, swapped};
    const size_t smem = top_m == 0 ? 0 : on_union ? kUnionSmemBytes : kSortCap * sizeof(uint64_t);
    dispatch_pair(s.scalar_type(), t.scalar_type(), [&](auto s_tag, auto t_tag) {
      using TS = decltype(s_tag);
      using TT = decltype(t_tag);
      const TS* s_ptr = reinterpret_cast<const TS*>(s.data_ptr());
      const TT* t_ptr = reinterpret_cast<const TT*>(t.data_ptr());
      if (swapped) {
        auto kernel = base2 ? topk_tail_kl_fwd_base2_kernel<TT, TS> : topk_tail_kl_fwd_kernel<TT, TS>;
        LOPD_LAUNCH(kernel, unsigned(n), kThreads, smem, t_ptr, s_ptr, prm);
        return;
      }
      auto kernel = on_union ? (base2 ? topk_tail_kl_fwd_base2_kernel<TS, TT, true>
                                      : topk_tail_kl_fwd_kernel<TS, TT, true>)
                    : !base2    ? topk_tail_kl_fwd_kernel<TS, TT>
                    : top_m > 0 ? topk_tail_kl_fwd_base2_kernel<TS, TT>
                    : div.kind == checks::kJsd ? topk_tail_kl_fwd_full_jsd_base2_kernel<TS, TT>
                                               : topk_tail_kl_fwd_full_base2_kernel<TS, TT>;
      LOPD_LAUNCH(kernel, unsigned(n), kThreads, smem, s_ptr, t_ptr, prm);
    });
  }
  return {kl, slp, tlp, ids, lse, bucket};
}

std::tuple<at::Tensor, at::Tensor> topk_tail_kl_bwd_cuda(
    const at::Tensor& grad_kl, const at::Tensor& grad_student_logprob,
    const at::Tensor& grad_teacher_logprob, const at::Tensor& student_logits,
    const at::Tensor& teacher_logits, const at::Tensor& target_ids, const at::Tensor& topk_ids,
    const at::Tensor& kl, const at::Tensor& lse, const at::Tensor& bucket_logp,
    double temperature, c10::string_view divergence, double beta, int64_t ignore_index,
    bool student_requires_grad, bool teacher_requires_grad) {
  const int64_t m = checks::check_bwd_args(
      grad_kl, grad_student_logprob, grad_teacher_logprob, student_logits, teacher_logits,
      target_ids, topk_ids, kl, lse, bucket_logp, LOPD_SIMT_DEVICE_TYPE, LOPD_SIMT_BACKEND);
  const checks::DivergenceSpec div = checks::parse_divergence(divergence, beta);
  const auto dev = student_logits.device();
  const int64_t n = checks::rows_of(student_logits);
  const int64_t v = student_logits.size(-1);
  LOPD_DEVICE_GUARD(dev);
  const at::Tensor s = checks::dense_vocab(student_logits);
  const at::Tensor t = checks::dense_vocab(teacher_logits);
  // Dense gradients in the logits' shape (row r at r * V), whatever the logits' strides.
  at::Tensor gs = student_requires_grad ? at::empty(s.sizes(), s.options()) : at::Tensor();
  at::Tensor gt = teacher_requires_grad ? at::empty(t.sizes(), t.options()) : at::Tensor();
  if (n > 0 && (student_requires_grad || teacher_requires_grad)) {
    const at::Tensor g_kl = grad_kl.contiguous(), g_ls = grad_student_logprob.contiguous(),
                     g_lt = grad_teacher_logprob.contiguous(), tgt = target_ids.contiguous(),
                     ids = topk_ids.contiguous(), kl_c = kl.contiguous(), lse_c = lse.contiguous(),
                     bucket = bucket_logp.contiguous();
    BwdParams prm{checks::row_layout(s), checks::row_layout(t), g_kl.data_ptr<float>(),
                  g_ls.data_ptr<float>(), g_lt.data_ptr<float>(),
                  tgt.data_ptr<int64_t>(), ids.data_ptr<int64_t>(), kl_c.data_ptr<float>(),
                  lse_c.data_ptr<float>(), bucket.data_ptr<float>(), v, m, ignore_index,
                  checks::checked_inv_temperature(temperature), div};
    const size_t smem = 2 * (m + 1) * sizeof(float);
    dispatch_pair(s.scalar_type(), t.scalar_type(), [&](auto s_tag, auto t_tag) {
      using TS = decltype(s_tag);
      using TT = decltype(t_tag);
      auto kernel = topk_tail_kl_bwd_kernel<TS, TT>;
      LOPD_LAUNCH(kernel, unsigned(n), kThreads, smem, reinterpret_cast<const TS*>(s.data_ptr()),
                  reinterpret_cast<const TT*>(t.data_ptr()),
                  gs.defined() ? reinterpret_cast<TS*>(gs.data_ptr()) : nullptr,
                  gt.defined() ? reinterpret_cast<TT*>(gt.data_ptr()) : nullptr, prm);
    });
  }
  // A side without gradient gets an empty float32 [0] tensor (the same for every backend).
  const auto none = student_logits.options().dtype(at::kFloat);
  return {student_requires_grad ? gs : at::empty({0}, none),
          teacher_requires_grad ? gt : at::empty({0}, none)};
}

}  // namespace
}  // namespace lopd::cuda
