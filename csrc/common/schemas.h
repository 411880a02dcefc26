// Schemas of the torch.ops.lopd.* ops implemented in C++/CUDA, shared by the library
// (csrc/ops.cpp, namespace `lopd`) and the SIMT-emulated test build of the CUDA kernels
// (csrc/emu/, namespace `lopd_simt_emu`), so both declare exactly the same signatures.
//
// Naming (lopd_kernels/_custom_ops.py, op_name): op <op>, implementation word <impl> in
// {cpu, cuda} (the Python ops add triton): `<op>_<impl>_fwd` / `<op>_<impl>_bwd`, spelled here by
// LOPD_OP_NAME. Every implementation of an op has the same schema (the Python ops' included:
// tests/kernels/test_kernel_library.py compares them); a CPU build declares the cuda ops too, without a
// kernel.
#pragma once

namespace lopd::schemas {

#define LOPD_OP_NAME(OP, IMPL, PHASE) OP "_" IMPL "_" PHASE

// ---- topk_tail_kl (lopd_kernels/topk_tail_kl.py; semantics: docs/math.md, sections 1-2) ----
// Forward. top_m == 0 means the full vocabulary (no selection, no tail bucket, support ignored);
// else 1 <= top_m < V. Logits [N, V] or [B, L, V] fp32/bf16/fp16 (the two may differ), math in
// fp32. divergence: "reverse" | "forward" | "jsd"; beta: the JSD's, in (0, 1) (TRL's convention:
// mixture (1 - beta) P + beta Q; the Python API sends "jsd" at beta 0 / 1 as "forward" /
// "reverse", and an op that gets them anyway computes those); ignored by the KLs.
// support: "teacher" | "student" | "union": the ids that get their own bucket.
// Returns kl[N] (the divergence), student_logprob[N], teacher_logprob[N] (fp32),
// topk_ids[N, K] (int64; K = M for "teacher" / "student": that side's top-M by descending logit,
// ties to the lower id; K = 2M for "union": the teacher's top-M in that order, then the student's
// top-M ids not among them in the student's order, then -1 padding; K = 0 for the full
// vocabulary), lse[N, 2] (fp32 log-sum-exp of student/T and teacher/T), bucket_logp[N, 2, K+1]
// (fp32 log P_b, log Q_b in topk_ids order, -inf on both sides at a -1 slot; index K is the
// tail, the complement of the row's ids; with top_m == 0 it holds 0, 0: one bucket of mass 1).
// Rows whose target == ignore_index are all zeros (topk_ids too); other targets lie in [0, V).
#define LOPD_TOPK_TAIL_KL_FWD_SCHEMA(IMPL)                                                         \
  LOPD_OP_NAME("topk_tail_kl", IMPL, "fwd") "(Tensor student_logits, Tensor teacher_logits, "      \
  "Tensor target_ids, int top_m, float temperature, str divergence, float beta, str support, "     \
  "int ignore_index) -> (Tensor kl, Tensor student_logprob, Tensor teacher_logprob, "              \
  "Tensor topk_ids, Tensor lse, Tensor bucket_logp)"

// Backward. grad_teacher_logprob already includes the privilege's upstream gradient. The support
// is read from topk_ids (a -1 slot is skipped), so it takes no support argument; divergence and
// beta as in the forward (the JSD's KL(P || M), KL(Q || M) are recomputed from bucket_logp, or
// by a pass over the row for the full vocabulary).
// Returns grad_student [N,V], grad_teacher [N,V] in the logits' dtypes; a side whose
// *_requires_grad is false gets an empty float32 tensor of shape [0].
#define LOPD_TOPK_TAIL_KL_BWD_SCHEMA(IMPL)                                                         \
  LOPD_OP_NAME("topk_tail_kl", IMPL, "bwd") "(Tensor grad_kl, Tensor grad_student_logprob, "       \
  "Tensor grad_teacher_logprob, Tensor student_logits, Tensor teacher_logits, Tensor target_ids, " \
  "Tensor topk_ids, Tensor kl, Tensor lse, Tensor bucket_logp, float temperature, "                \
  "str divergence, float beta, int ignore_index, bool student_requires_grad, "                     \
  "bool teacher_requires_grad) -> (Tensor grad_student, Tensor grad_teacher)"

inline constexpr const char* kTopkTailKlCpuFwd = LOPD_TOPK_TAIL_KL_FWD_SCHEMA("cpu");
inline constexpr const char* kTopkTailKlCpuBwd = LOPD_TOPK_TAIL_KL_BWD_SCHEMA("cpu");
inline constexpr const char* kTopkTailKlCudaFwd = LOPD_TOPK_TAIL_KL_FWD_SCHEMA("cuda");
inline constexpr const char* kTopkTailKlCudaBwd = LOPD_TOPK_TAIL_KL_BWD_SCHEMA("cuda");

// ---- sparse_teacher_topk_tail_kl (lopd_kernels/sparse_teacher_topk_tail_kl.py) ----
// Top-M + tail KL against a teacher given by its top-M ids and log-probs. CPU kernel only (on
// GPUs the Triton kernel runs). Forward: student_logits [N, V] fp32/bf16/fp16,
// teacher_topk_logprobs [N, M] fp32 (-inf: a padding slot), teacher_topk_ids [N, M] int64,
// target_ids [N] int64; temperature divides the student only; a teacher tail mass below
// tail_floor (in [0, 1)) is raised to it (reverse) or dropped to 0 (forward). Returns kl[N],
// student_logprob[N], lse[N] (fp32 log-sum-exp of student/T), bucket_logp[N,2,M+1] (fp32
// log P_b, log Q_b in slot order, -inf at padding slots; index M is the tail). Rows whose
// target == ignore_index are all zeros; other targets and the real slots' ids must lie in [0, V).
#define LOPD_SPARSE_TEACHER_FWD_SCHEMA(IMPL)                                                       \
  LOPD_OP_NAME("sparse_teacher_topk_tail_kl", IMPL, "fwd") "(Tensor student_logits, "              \
  "Tensor teacher_topk_logprobs, Tensor teacher_topk_ids, Tensor target_ids, float temperature, "  \
  "bool reverse, int ignore_index, float tail_floor) -> (Tensor kl, Tensor student_logprob, "      \
  "Tensor lse, Tensor bucket_logp)"

// Backward. Returns grad_student [N, V] in the student's dtype.
#define LOPD_SPARSE_TEACHER_BWD_SCHEMA(IMPL)                                                       \
  LOPD_OP_NAME("sparse_teacher_topk_tail_kl", IMPL, "bwd") "(Tensor grad_kl, "                     \
  "Tensor grad_student_logprob, Tensor student_logits, Tensor teacher_topk_ids, "                  \
  "Tensor target_ids, Tensor kl, Tensor lse, Tensor bucket_logp, float temperature, "              \
  "bool reverse, int ignore_index) -> Tensor"

inline constexpr const char* kSparseTeacherCpuFwd = LOPD_SPARSE_TEACHER_FWD_SCHEMA("cpu");
inline constexpr const char* kSparseTeacherCpuBwd = LOPD_SPARSE_TEACHER_BWD_SCHEMA("cpu");

// ---- varlen_cross_attention (lopd_kernels/varlen_cross_attention.py) ----
// The same arguments as the Triton ops lopd::varlen_cross_attention_triton_fwd / _bwd.
// Forward. q [B, Lq, Hq, D], k/v packed [total_k, Hkv, D] (one dtype: fp32/bf16/fp16, contiguous,
// Hq % Hkv == 0), cu_seqlens_k int32 [B+1] (0 = cu[0] <= ... <= cu[B] = total_k),
// max_seqlen_k >= the longest item (sizes the CUDA grid; the CPU kernel does not need it). Math
// in fp32. Returns out [B, Lq, Hq, D] in q's dtype and lse [B, Hq, Lq] fp32 (log-sum-exp of the
// scaled scores); an empty item gets out = 0, lse = -inf.
#define LOPD_VARLEN_XATTN_FWD_SCHEMA(IMPL)                                                         \
  LOPD_OP_NAME("varlen_cross_attention", IMPL, "fwd") "(Tensor q, Tensor k, Tensor v, "            \
  "Tensor cu_seqlens_k, float scale, int max_seqlen_k) -> (Tensor out, Tensor lse)"

// Backward. grad_out like q, grad_lse fp32 [B, Hq, Lq] (honoured: delta = <do, out> - dlse),
// out and lse from the forward. Returns dq (q's dtype), dk, dv (k's dtype; for GQA summed over the
// query heads of each kv head); dq of an empty item is 0.
#define LOPD_VARLEN_XATTN_BWD_SCHEMA(IMPL)                                                         \
  LOPD_OP_NAME("varlen_cross_attention", IMPL, "bwd") "(Tensor grad_out, Tensor grad_lse, "        \
  "Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_k, float scale, "       \
  "int max_seqlen_k) -> (Tensor dq, Tensor dk, Tensor dv)"

inline constexpr const char* kVarlenCrossAttentionCpuFwd = LOPD_VARLEN_XATTN_FWD_SCHEMA("cpu");
inline constexpr const char* kVarlenCrossAttentionCpuBwd = LOPD_VARLEN_XATTN_BWD_SCHEMA("cpu");
inline constexpr const char* kVarlenCrossAttentionCudaFwd = LOPD_VARLEN_XATTN_FWD_SCHEMA("cuda");
inline constexpr const char* kVarlenCrossAttentionCudaBwd = LOPD_VARLEN_XATTN_BWD_SCHEMA("cuda");

// ---- fused_linear_logprob (lopd_kernels/fused_linear_logprob.py) ----
// The C++ CPU implementation of the op whose cuda / triton implementations are Python custom ops
// with the same schema. Forward: hidden [N, d] and weight [V, d] of one dtype (fp32/bf16/fp16;
// hidden rows may be strided), bias [V] or None, targets [N] int64 (ignore_index or in [0, V)),
// temperature > 0; chunk_size token rows x vocab_block entries per float32 logit block (<= 0:
// all rows / the whole vocabulary). projection: also return P [N, d] (hidden's dtype), the
// hidden-state gradient of a unit upstream gradient (frozen head). Returns logprob [N], entropy
// [N] (with_entropy; else [0]), lse [N] (fp32), P or [0]; ignored rows are 0 everywhere.
#define LOPD_FUSED_LINEAR_LOGPROB_FWD_SCHEMA(IMPL)                                                 \
  LOPD_OP_NAME("fused_linear_logprob", IMPL, "fwd") "(Tensor hidden, Tensor weight, Tensor? bias, " \
  "Tensor targets, float temperature, int ignore_index, bool with_entropy, bool projection, "      \
  "int chunk_size, int vocab_block) -> (Tensor, Tensor, Tensor, Tensor)"

// Backward. grad_entropy [N] or [0] (no entropy gradient); proj non-empty: d_hidden =
// grad_logprob * proj (hidden and weight are then not read and may be empty). needs: which of
// [d_hidden, d_weight, d_bias] to return (in the inputs' dtypes), an unneeded one is [0].
#define LOPD_FUSED_LINEAR_LOGPROB_BWD_SCHEMA(IMPL)                                                 \
  LOPD_OP_NAME("fused_linear_logprob", IMPL, "bwd") "(Tensor grad_logprob, Tensor grad_entropy, "  \
  "Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor logprob, Tensor entropy, "   \
  "Tensor lse, Tensor proj, float temperature, int ignore_index, int chunk_size, "                 \
  "int vocab_block, bool[] needs) -> Tensor[]"

inline constexpr const char* kFusedLinearLogprobCpuFwd = LOPD_FUSED_LINEAR_LOGPROB_FWD_SCHEMA("cpu");
inline constexpr const char* kFusedLinearLogprobCpuBwd = LOPD_FUSED_LINEAR_LOGPROB_BWD_SCHEMA("cpu");

#undef LOPD_OP_NAME
#undef LOPD_TOPK_TAIL_KL_FWD_SCHEMA
#undef LOPD_TOPK_TAIL_KL_BWD_SCHEMA
#undef LOPD_SPARSE_TEACHER_FWD_SCHEMA
#undef LOPD_SPARSE_TEACHER_BWD_SCHEMA
#undef LOPD_VARLEN_XATTN_FWD_SCHEMA
#undef LOPD_VARLEN_XATTN_BWD_SCHEMA
#undef LOPD_FUSED_LINEAR_LOGPROB_FWD_SCHEMA
#undef LOPD_FUSED_LINEAR_LOGPROB_BWD_SCHEMA

}  // namespace lopd::schemas
