"""Named outputs of the custom ops ``torch.ops.lopd.<op>_<impl>_fwd`` / ``_bwd``.

A custom op returns a plain tuple; the Python code that calls one wraps the tuple in its type
here at once (``TopKTailKLOpOutput(*op(...))``) and reads fields by name, never by position. One
type per op and phase, the same for every implementation (they share one schema). A leaf module
(it imports only torch), so every op module, chunk math and PyTorch twin can use it.

Shapes: ``N`` rows, ``V`` vocabulary, ``K`` support width (``M``, ``2M`` for a union, 0 for the
full vocabulary), ``d`` hidden size.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = [
    "FusedLinearLogprobOpGrads",
    "FusedLinearLogprobOpOutput",
    "FusedLinearTopKTailKLLossOpOutput",
    "FusedLinearTopKTailKLOpOutput",
    "LinearPairGrads",
    "SparseTeacherTopKTailKLOpOutput",
    "TopKTailKLOpGrads",
    "TopKTailKLOpOutput",
    "VarlenCrossAttentionOpGrads",
    "VarlenCrossAttentionOpOutput",
]


class TopKTailKLOpOutput(NamedTuple):
    """``topk_tail_kl_<impl>_fwd`` (and its PyTorch twin ``bucket_math.rows_fwd_torch``)."""

    kl: Tensor  # [N] float32
    student_logprob: Tensor  # [N] float32
    teacher_logprob: Tensor  # [N] float32
    topk_ids: Tensor  # [N, K] int64
    lse: Tensor  # [N, 2] float32: log-sum-exp of student / teacher logits over T
    bucket_logp: Tensor  # [N, 2, K + 1] float32: (log P_b, log Q_b); index K is the tail


class TopKTailKLOpGrads(NamedTuple):
    """``topk_tail_kl_<impl>_bwd``: each logits' gradient, or an empty ``[0]`` where not asked."""

    student_logits: Tensor  # [N, V] (or the logits' [B, L, V])
    teacher_logits: Tensor


class FusedLinearTopKTailKLOpOutput(NamedTuple):
    """``fused_linear_topk_tail_kl_<impl>_fwd``: :class:`TopKTailKLOpOutput`'s fields, then the
    tail projections ``sum_{j not in support} softmax(x / T)_j W[j]`` (float32 ``[N, d]`` where
    asked for, else ``[0]``)."""

    kl: Tensor
    student_logprob: Tensor
    teacher_logprob: Tensor
    topk_ids: Tensor
    lse: Tensor
    bucket_logp: Tensor
    student_tail_proj: Tensor
    teacher_tail_proj: Tensor


class LinearPairGrads(NamedTuple):
    """The gradients in a student's and a teacher's LM-head inputs (``fused_linear_topk_tail_kl
    _<impl>_bwd``, the gradient half of ``fused_linear_topk_tail_kl_loss_<impl>_fwd``): an empty
    ``[0]`` where not needed, and the teacher weight's when both heads are one tensor (its
    gradient is summed into the student's)."""

    student_hidden: Tensor  # [N, d_s]
    student_weight: Tensor  # [V, d_s]
    student_bias: Tensor  # [V]
    teacher_hidden: Tensor  # [N, d_t]
    teacher_weight: Tensor  # [V, d_t]
    teacher_bias: Tensor  # [V]


class FusedLinearTopKTailKLLossOpOutput(NamedTuple):
    """``fused_linear_topk_tail_kl_loss_<impl>_fwd``: the weighted loss, the per-row outputs and
    the loss's gradients (:class:`LinearPairGrads`' fields, prefixed ``d_``)."""

    loss: Tensor  # [] float32 (float64 for float64 inputs)
    kl: Tensor
    student_logprob: Tensor
    teacher_logprob: Tensor
    topk_ids: Tensor
    bucket_logp: Tensor
    d_student_hidden: Tensor
    d_student_weight: Tensor
    d_student_bias: Tensor
    d_teacher_hidden: Tensor
    d_teacher_weight: Tensor
    d_teacher_bias: Tensor

    def grads(self) -> LinearPairGrads:
        """The six gradients as :class:`LinearPairGrads`."""
        return LinearPairGrads(
            self.d_student_hidden,
            self.d_student_weight,
            self.d_student_bias,
            self.d_teacher_hidden,
            self.d_teacher_weight,
            self.d_teacher_bias,
        )


class SparseTeacherTopKTailKLOpOutput(NamedTuple):
    """``sparse_teacher_topk_tail_kl_<impl>_fwd``."""

    kl: Tensor  # [N] float32
    student_logprob: Tensor  # [N] float32
    lse: Tensor  # [N] float32: the student's log-sum-exp of s / T
    bucket_logp: Tensor  # [N, 2, M + 1] float32 (-inf at padding slots; index M: the tail)


class FusedLinearLogprobOpOutput(NamedTuple):
    """``fused_linear_logprob_<impl>_fwd``."""

    logprob: Tensor  # [N] float32
    entropy: Tensor  # [N] float32, or [0] unless asked for
    lse: Tensor  # [N] float32, log-sum-exp of the tempered logits
    projection: Tensor  # [N, d] in the hidden states' dtype (frozen head), else [0]


class FusedLinearLogprobOpGrads(NamedTuple):
    """``fused_linear_logprob_<impl>_bwd``: an empty ``[0]`` where not needed."""

    hidden: Tensor  # [N, d]
    weight: Tensor  # [V, d]
    bias: Tensor  # [V]


class VarlenCrossAttentionOpOutput(NamedTuple):
    """``varlen_cross_attention_<impl>_fwd``."""

    out: Tensor  # [B, Lq, Hq, D] in q's dtype
    lse: Tensor  # [B, Hq, Lq] float32


class VarlenCrossAttentionOpGrads(NamedTuple):
    """``varlen_cross_attention_<impl>_bwd``."""

    q: Tensor
    k: Tensor
    v: Tensor
