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

// ---- varlen_cross_attention (lopd_kernels/varlen_cross_attention.py) ----
// The hand-written CUDA kernels (csrc/cuda/varlen_cross_attention_kernels.cuh; CUDA only, no CPU
// implementation: the CPU and Triton paths are Python custom ops). Same arguments as the Triton
// ops lopd::varlen_cross_attention_triton_fwd / _bwd.
// Forward. q [B, Lq, Hq, D], k/v packed [total_k, Hkv, D] (one dtype: fp32/bf16/fp16, contiguous,
// Hq % Hkv == 0, D <= 256), cu_seqlens_k int32 [B+1] (0 = cu[0] <= ... <= cu[B] = total_k),
// max_seqlen_k >= the longest item. Math in fp32. Returns out [B, Lq, Hq, D] in q's dtype and
// lse [B, Hq, Lq] fp32 (log-sum-exp of the scaled scores); an empty item gets out = 0,
// lse = -inf.
inline constexpr const char* kVarlenCrossAttentionCudaFwd =
    "varlen_cross_attention_cuda_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_k, "
    "float scale, int max_seqlen_k) -> (Tensor out, Tensor lse)";

// Backward. grad_out like q, grad_lse fp32 [B, Hq, Lq] (honoured: delta = <do, out> - dlse),
// out and lse from the forward. Returns dq (q's dtype), dk, dv (k's dtype; for GQA summed over the
// query heads of each kv head); dq of an empty item is 0.
inline constexpr const char* kVarlenCrossAttentionCudaBwd =
    "varlen_cross_attention_cuda_bwd(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, "
    "Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_k, float scale, int max_seqlen_k) -> "
    "(Tensor dq, Tensor dk, Tensor dv)";

}  // namespace lopd::schemas
