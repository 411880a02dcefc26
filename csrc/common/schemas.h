// Schemas of the torch.ops.lopd.* ops implemented in C++/CUDA, shared by the library
// (csrc/ops.cpp, namespace `lopd`) and the SIMT-emulated test build of the CUDA kernels
// (csrc/emu/, namespace `lopd_simt_emu`), so both declare exactly the same signatures.
#pragma once

namespace lopd::schemas {

// ---- topk_tail_kl (lopd_kernels/topk_tail_kl.py) ----
// Forward. top_m == 0 means the full vocabulary (no selection, no tail bucket); else
// 1 <= top_m < V. Logits [N, V] fp32/bf16/fp16 (the two may differ), math in fp32.
// Returns kl[N], student_logprob[N], teacher_logprob[N] (fp32), topk_ids[N,M] (int64, by
// descending teacher logit, ties to the lower id), lse[N,2] (fp32 log-sum-exp of student/T and
// teacher/T), bucket_logp[N,2,M+1] (fp32 log P_b, log Q_b in topk_ids order; index M is the
// tail; with top_m == 0 it holds 0, 0: one bucket of mass 1). Rows whose
// target == ignore_index are all zeros; other targets must lie in [0, V).
inline constexpr const char* kTopkTailKlFwd =
    "topk_tail_kl_fwd(Tensor student_logits, Tensor teacher_logits, Tensor target_ids, "
    "int top_m, float temperature, bool reverse, int ignore_index) -> "
    "(Tensor kl, Tensor student_logprob, Tensor teacher_logprob, Tensor topk_ids, Tensor lse, "
    "Tensor bucket_logp)";

// Backward. grad_teacher_logprob already includes the privilege's upstream gradient.
// Returns grad_student [N,V], grad_teacher [N,V] in the logits' dtypes; a side whose
// *_requires_grad is false gets an empty float32 tensor of shape [0].
inline constexpr const char* kTopkTailKlBwd =
    "topk_tail_kl_bwd(Tensor grad_kl, Tensor grad_student_logprob, Tensor grad_teacher_logprob, "
    "Tensor student_logits, Tensor teacher_logits, Tensor target_ids, Tensor topk_ids, "
    "Tensor kl, Tensor lse, Tensor bucket_logp, float temperature, bool reverse, "
    "int ignore_index, bool student_requires_grad, bool teacher_requires_grad) -> "
    "(Tensor grad_student, Tensor grad_teacher)";

}  // namespace lopd::schemas
