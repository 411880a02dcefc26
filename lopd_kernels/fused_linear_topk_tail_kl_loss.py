"""``fused_linear_topk_tail_kl_loss``: the fused top-M + tail divergence reduced to one weighted
scalar, with its gradients computed in the forward.

When the per-row weights of the loss are known before the call (a token mean, a per-trajectory
mean, LOPD's ``- beta * A_i`` on the teacher's log-prob), the gradient of

    loss = sum_n  w_kl[n] * kl[n] + w_s[n] * log pS(a_n) + w_t[n] * log pT(a_n)

is known in the forward too. The chunked path then differentiates each token chunk while its two
``[C, V]`` logit blocks are still in memory: two logit GEMMs, the per-row forward and backward
kernels of ``topk_tail_kl``, and the ``dh = ds W`` / ``dW += ds^T h`` GEMMs, i.e. the six GEMMs
of the materialized path (``topk_tail_kl(h_s @ W_s.T, h_t @ W_t.T)`` under autograd) and none of
its ``[N, V]`` traffic. :func:`lopd_kernels.fused_linear_topk_tail_kl` must leave the gradient for
the backward, where it recomputes the logit blocks (eight GEMMs). The backward of this op scales
the kept gradients by the upstream scalar, in place (Liger's fused linear losses work the same
way).

Implementation (``torch.ops.lopd.fused_linear_topk_tail_kl_loss_chunked_fwd/_bwd``):
``"chunked"``, the chunk loop (:mod:`lopd_kernels.fused_linear_topk_tail_kl_chunked`'s chunk
math), any device. ``backend="torch"`` and ``"triton"`` (and float64 inputs under ``"auto"``)
weight the outputs of :func:`fused_linear_topk_tail_kl` under autograd: the same loss and
gradients, without the saving.

Memory: the forward keeps the gradients of every input that requires one (``[N, d]`` hidden
states, ``[V, d]`` float32 weights) until the backward, which the unfused backward would
allocate anyway; the per-row outputs it returns carry no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from lopd_kernels._custom_ops import CustomOps, input_grads
from lopd_kernels._reduction import check_module_options
from lopd_kernels.bucket_math import effective_top_m, op_divergence, support_width
from lopd_kernels.fused_linear_topk_tail_kl import (
    BACKENDS,
    fake_grads,
    fused_linear_topk_tail_kl,
)
from lopd_kernels.fused_linear_topk_tail_kl_checks import check_inputs, check_row_weights
from lopd_kernels.fused_linear_topk_tail_kl_chunked import (
    LossWeights,
    Needs,
    chunked_loss_fwd,
    shared_head,
)
from lopd_kernels.op_outputs import FusedLinearTopKTailKLLossOpOutput, LinearPairGrads
from lopd_kernels.topk_tail_kl import TopKTailKLOutput, support_size, teacher_topk_mass
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range

__all__ = [
    "FusedLinearTopKTailKL",
    "FusedLinearTopKTailKLLoss",
    "fused_linear_topk_tail_kl_loss",
]

OP = "fused_linear_topk_tail_kl_loss"


class FusedLinearTopKTailKLLoss(NamedTuple):
    """What :func:`fused_linear_topk_tail_kl_loss` returns.

    Attributes:
        loss: ``[]`` the weighted sum (float32; float64 for float64 inputs), differentiable.
        output: the per-row :class:`~lopd_kernels.topk_tail_kl.TopKTailKLOutput`, without
            gradient (its gradient is in ``loss``).
    """

    loss: Tensor
    output: TopKTailKLOutput


# ----------------------------------------------------------------------------------------------
# Custom ops: fused_linear_topk_tail_kl_loss_{cpu,cuda}_{fwd,bwd}
# ----------------------------------------------------------------------------------------------


def _fwd(
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    target_ids: Tensor,
    kl_weight: Tensor,
    student_logprob_weight: Tensor,
    teacher_logprob_weight: Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
    chunk_size: int,
    needs: list[bool],
    shared_weight: bool,
) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor
]:
    """A :class:`~lopd_kernels.op_outputs.FusedLinearTopKTailKLLossOpOutput`: the loss, the
    per-row outputs and the loss's gradients in the six differentiable inputs (``[0]`` where
    ``needs`` is false; the teacher weight's too with ``shared_weight``, summed into the
    student's): :func:`~lopd_kernels.fused_linear_topk_tail_kl_chunked.chunked_loss_fwd`."""
    weights = LossWeights(kl_weight, student_logprob_weight, teacher_logprob_weight)
    return chunked_loss_fwd(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
        teacher_bias, target_ids, weights, top_m, temperature, divergence, beta, support,
        ignore_index, chunk_size, Needs(*needs), shared_weight,
    )  # fmt: skip


#: The backward's arguments: the forward's gradients, scaled in place.
_KEPT = (
    "d_student_hidden",
    "d_student_weight",
    "d_student_bias",
    "d_teacher_hidden",
    "d_teacher_weight",
    "d_teacher_bias",
)


def _bwd(
    grad_loss: Tensor,
    d_student_hidden: Tensor,
    d_student_weight: Tensor,
    d_student_bias: Tensor,
    d_teacher_hidden: Tensor,
    d_teacher_weight: Tensor,
    d_teacher_bias: Tensor,
) -> None:
    """Scales the forward's gradients by the upstream scalar ``grad_loss``, in place.

    In place because a fresh ``[V, d]`` result costs more than the product: on CPU it is new
    pages the OS zeroes on first touch (1.3-2.4 s for two float32 ``[151936, 1024]`` heads on 2
    cores, against 0.04 s for the multiply into warm memory). The kept gradients belong to this
    op's graph alone, and autograd's version counter refuses a second backward through it.
    """
    kept = (d_student_hidden, d_student_weight, d_student_bias, d_teacher_hidden)
    kept += (d_teacher_weight, d_teacher_bias)
    for g in kept:
        if g.numel():
            g.mul_(grad_loss.to(g.dtype))


def _fwd_fake(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
              teacher_bias, target_ids, kl_weight, student_logprob_weight,
              teacher_logprob_weight, top_m, temperature, divergence, beta, support,
              ignore_index, chunk_size, needs, shared_weight):  # fmt: skip
    n = student_hidden.shape[0]
    m = effective_top_m(top_m, student_weight.shape[0])
    k = support_width(m, support)
    f32 = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    kl = student_hidden.new_empty(n, dtype=torch.float32)
    likes = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight)
    grads = fake_grads((*likes, teacher_bias), needs, shared_weight)
    return FusedLinearTopKTailKLLossOpOutput(
        kl.new_empty((), dtype=f32),
        kl,
        torch.empty_like(kl),
        torch.empty_like(kl),
        student_hidden.new_empty(n, k, dtype=torch.long),
        kl.new_empty(n, 2, k + 1),
        *grads,
    )


def _bwd_fake(grad_loss, *kept) -> None:
    return None


class _FwdArgs(NamedTuple):
    """The arguments of ``fused_linear_topk_tail_kl_loss_<impl>_fwd``."""

    student_hidden: Tensor
    student_weight: Tensor
    student_bias: Tensor | None
    teacher_hidden: Tensor
    teacher_weight: Tensor
    teacher_bias: Tensor | None
    target_ids: Tensor
    kl_weight: Tensor
    student_logprob_weight: Tensor
    teacher_logprob_weight: Tensor
    top_m: int
    temperature: float
    divergence: str
    beta: float
    support: str
    ignore_index: int
    chunk_size: int
    needs: list[bool]
    shared_weight: bool


def _setup_context(ctx, inputs, output) -> None:
    args, out = _FwdArgs(*inputs), FusedLinearTopKTailKLLossOpOutput(*output)
    grads = out.grads()
    ctx.save_for_backward(*grads)
    # The gradient slots that hold a gradient (an input that needs none, and the teacher's head
    # when it is the student's, hold an empty placeholder).
    ctx.given = [
        name
        for name, need in zip(LinearPairGrads._fields, args.needs)
        if need and not (name == "teacher_weight" and args.shared_weight)
    ]
    ctx.mark_non_differentiable(*(getattr(out, name) for name in out._fields if name != "loss"))
    # Only the loss carries a gradient: without this autograd would hand the backward a zero
    # tensor for every other output, the [V, d] gradients included (a fresh zero-filled copy of
    # both heads: 0.6 s and 1.2 GB at V = 151,936, d = 1,024).
    ctx.set_materialize_grads(False)


def _make_backward(bwd_op):
    def backward(ctx, g_loss, *_unused):
        if g_loss is None:  # nothing flowed into the loss
            return input_grads(_FwdArgs._fields)
        kept = LinearPairGrads(*ctx.saved_tensors)
        bwd_op(g_loss, *kept)
        return input_grads(_FwdArgs._fields, **{name: getattr(kept, name) for name in ctx.given})

    return backward


CUSTOM_OPS = CustomOps(OP, _fwd_fake, _bwd_fake, _setup_context, _make_backward)
CUSTOM_OPS.define("chunked", _fwd, _bwd, bwd_mutates_args=_KEPT)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _row_weight(w: Tensor | float, n: int, like: Tensor) -> Tensor:
    """A row weight as a contiguous ``[N]`` float32 (float64) tensor on ``like``'s device."""
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.as_tensor(w, dtype=dt, device=like.device).expand(n).contiguous()


def fused_linear_topk_tail_kl_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target_ids: Tensor,
    *,
    kl_weight: Tensor | float | None = None,
    student_logprob_weight: Tensor | float = 0.0,
    teacher_logprob_weight: Tensor | float = 0.0,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> FusedLinearTopKTailKLLoss:
    """``sum_n kl_weight[n] * kl[n] + student_logprob_weight[n] * log pS(a_n) +
    teacher_logprob_weight[n] * log pT(a_n)`` from the LM-head inputs, its gradients computed in
    the forward (module docstring): the loss of :func:`fused_linear_topk_tail_kl` for a loss that
    is a fixed weighting of its rows, at the GEMM count of the materialized path.

    Args:
        student_hidden, student_weight, teacher_hidden, teacher_weight, target_ids: as in
            :func:`fused_linear_topk_tail_kl` (``[N, d_s]``, ``[V, d_s]``, ``[N, d_t]``,
            ``[V, d_t]``, ``[N]``).
        kl_weight: ``[N]`` or a scalar (a float or 0-d tensor); ``None``: the mean over the rows
            whose target is not ``ignore_index`` (0 when there is none).
        student_logprob_weight, teacher_logprob_weight: ``[N]`` or scalars weighting the target
            tokens' log-probs (LOPD's privilege ``log pT - sg log pS`` is a teacher weight).
            Weights are constants: a weight that requires grad is refused.
        student_bias, teacher_bias, top_m, temperature, divergence, beta, support, ignore_index,
            chunk_size: as in :func:`fused_linear_topk_tail_kl`.
        backend: ``"auto"`` (``"chunked"``; float64: the reference), ``"chunked"`` (gradients
            in the forward), ``"torch"`` / ``"triton"`` (the weighted outputs of
            :func:`fused_linear_topk_tail_kl` under autograd).

    Returns:
        :class:`FusedLinearTopKTailKLLoss` ``(loss, output)``.
    """
    hs, ws, ht, wt = student_hidden, student_weight, teacher_hidden, teacher_weight
    m = check_inputs(hs, ws, ht, wt, target_ids, student_bias, teacher_bias, top_m, temperature,
                     divergence, ignore_index, chunk_size, beta, support)  # fmt: skip
    n = hs.shape[0]
    weights = {"kl_weight": kl_weight, "student_logprob_weight": student_logprob_weight}
    weights["teacher_logprob_weight"] = teacher_logprob_weight
    check_row_weights(weights, n, hs.device)
    check_targets_in_range(target_ids, ws.shape[0], ignore_index)
    target = target_ids.long()
    if kl_weight is None:
        kl_weight = 1.0 / (target != ignore_index).sum().clamp(min=1)
    w_kl, w_slp, w_tlp = (_row_weight(w, n, hs) for w in (kl_weight, *list(weights.values())[1:]))
    fp64 = torch.float64 in (hs.dtype, ht.dtype)
    impl = BACKENDS.resolve(backend, hs.device, fp64=fp64)
    if impl in ("torch", "triton"):
        out = fused_linear_topk_tail_kl(
            hs, ws, ht, wt, target, student_bias=student_bias, teacher_bias=teacher_bias,
            top_m=top_m, temperature=temperature, divergence=divergence, beta=beta,
            support=support, ignore_index=ignore_index, backend=impl, chunk_size=chunk_size,
        )  # fmt: skip
        dt = w_kl.dtype
        loss = (w_kl * out.kl.to(dt)).sum() + (w_slp * out.student_logprob.to(dt)).sum()
        loss = loss + (w_tlp * out.teacher_logprob.to(dt)).sum()
        detached = TopKTailKLOutput(*(x.detach() for x in out))
        return FusedLinearTopKTailKLLoss(loss, detached)
    div, div_beta = op_divergence(divergence, beta)
    m = effective_top_m(m, ws.shape[0])
    grad = torch.is_grad_enabled()
    inputs = (hs, ws, student_bias, ht, wt, teacher_bias)
    needs = Needs(*(bool(grad and x is not None and x.requires_grad) for x in inputs))
    shared = shared_head(ws, wt, needs)
    out = FusedLinearTopKTailKLLossOpOutput(*CUSTOM_OPS.fwd_op(impl)(
        hs, ws, student_bias, ht, wt, teacher_bias, target, w_kl, w_slp, w_tlp, m,
        float(temperature), div, div_beta, support, ignore_index, chunk_size or 0, list(needs),
        shared,
    ))  # fmt: skip
    lp_s, lp_t, ids = out.student_logprob, out.teacher_logprob, out.topk_ids
    output = TopKTailKLOutput(
        kl=out.kl,
        privilege=lp_t - lp_s,
        student_logprob=lp_s,
        teacher_logprob=lp_t,
        topk_ids=ids,
        teacher_topk_mass=teacher_topk_mass(out.bucket_logp, target, ignore_index),
        support_size=support_size(ids, target, ignore_index, ws.shape[0]),
    )
    return FusedLinearTopKTailKLLoss(out.loss, output)


class FusedLinearTopKTailKL(nn.Module):
    """Module form of :func:`fused_linear_topk_tail_kl` returning the (reduced) divergence.

    Args:
        top_m, temperature, divergence, beta, support, ignore_index, backend, chunk_size: as in
            :func:`fused_linear_topk_tail_kl`.
        reduction: ``"none"`` (``[N]`` per-token KL, 0 at ignored tokens), ``"mean"`` (over
            non-ignored tokens; 0, never NaN, when every token is ignored) or ``"sum"``; the
            reduced ones are :func:`fused_linear_topk_tail_kl_loss` (gradients formed in the
            forward).

    Shapes:
        student_hidden ``[N, d_s]``, student_weight ``[V, d_s]``, teacher_hidden ``[N, d_t]``,
        teacher_weight ``[V, d_t]``, target_ids ``[N]``, optional biases ``[V]``; output ``[N]``
        for ``"none"``, else a scalar.
    """

    def __init__(
        self,
        top_m: int | None = 20,
        temperature: float = 1.0,
        divergence: str = "reverse",
        ignore_index: int = -100,
        reduction: str = "mean",
        backend: str = "auto",
        chunk_size: int | None = None,
        *,
        beta: float | None = None,
        support: str = "teacher",
    ) -> None:
        super().__init__()
        check_module_options(reduction, divergence, backend, support=support)
        self.top_m = top_m
        self.temperature = temperature
        self.divergence = divergence
        self.beta = beta
        self.support = support
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.backend = backend
        self.chunk_size = chunk_size

    def forward(
        self,
        student_hidden: Tensor,
        student_weight: Tensor,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        target_ids: Tensor,
        student_bias: Tensor | None = None,
        teacher_bias: Tensor | None = None,
    ) -> Tensor:
        args = (student_hidden, student_weight, teacher_hidden, teacher_weight, target_ids)
        kw = dict(student_bias=student_bias, teacher_bias=teacher_bias, top_m=self.top_m,
                  temperature=self.temperature, divergence=self.divergence, beta=self.beta,
                  support=self.support, ignore_index=self.ignore_index, backend=self.backend,
                  chunk_size=self.chunk_size)  # fmt: skip
        if self.reduction == "none":
            return fused_linear_topk_tail_kl(*args, **kw).kl
        # A reduced KL is a fixed weighting of the rows: its gradients are formed in the forward.
        kl_weight = None if self.reduction == "mean" else 1.0
        return fused_linear_topk_tail_kl_loss(*args, kl_weight=kl_weight, **kw).loss

    def extra_repr(self) -> str:
        return (
            f"top_m={self.top_m}, temperature={self.temperature}, divergence={self.divergence!r}, "
            f"beta={self.beta}, support={self.support!r}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}, backend={self.backend!r}, chunk_size={self.chunk_size}"
        )
