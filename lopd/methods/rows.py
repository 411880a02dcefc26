"""The distillation building blocks every method shares: action rows, hidden states, kernels.

A trajectory's supervised tokens are its *action* tokens (``action_mask``). Only their rows are
ever scored: the models return final hidden states (no ``[L, V]`` logits), the rows are gathered
(:class:`ActionRows`), and the LM heads and the top-M + tail KL kernel run on those ``N`` rows
alone (:func:`distill_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lopd.loss import segment_mean, segment_mean_weights
from lopd.methods.base import DistillSpec
from lopd.parallel.distributed import is_sharded
from lopd.parallel.fsdp import full_weight
from lopd.parallel.precision import autocast_cast
from lopd.rollout.batch import ActionRows, lm_head, pad_batch
from lopd.run.context import Models
from lopd.types import Trajectory
from lopd_kernels.fused_linear_topk_tail_kl_loss import (
    FusedLinearTopKTailKLLoss,
    fused_linear_topk_tail_kl_loss,
)
from lopd_kernels.hf import lm_head_topk_tail_kl
from lopd_kernels.topk_tail_kl import TopKTailKLOutput

__all__ = [
    "DISTILL_METRICS",
    "distill_loss",
    "distill_metric_sums",
    "distill_rows",
    "student_action_hidden",
    "zero_loss",
]

DISTILL_METRICS = (
    "kl",
    "teacher_top_m_mass",
    "privilege",
    "student_logprob",
    "teacher_logprob",
    "action_tokens",
)
"""The metric keys of :func:`distill_loss` (a micro-batch with nothing to distill returns them
as zeros: ranks reduce metrics by key)."""


def student_action_hidden(
    models: Models, trajectories: Sequence[Trajectory], where: ActionRows
) -> torch.Tensor:
    """Final hidden states of the student at the action rows, ``[N, d]``.

    Args:
        models: the run's models (the student runs through its FSDP root when sharded).
        trajectories: B trajectories (right-padded into one batch).
        where: their :class:`ActionRows`.
    """
    device = where.rows.device
    ids, mask = pad_batch([t.input_ids for t in trajectories], models.pad_id, device)
    hidden = models.hidden_states(models.student, input_ids=ids, attention_mask=mask)
    return hidden[where.batch, where.rows]


def distill_rows(
    h_s: torch.Tensor,
    head_s: nn.Module,
    h_t: torch.Tensor,
    head_t: nn.Module,
    targets: torch.Tensor,
    spec: DistillSpec,
    kl_weight: torch.Tensor,
    teacher_logprob_weight: torch.Tensor | float = 0.0,
) -> FusedLinearTopKTailKLLoss:
    """``sum_n kl_weight[n] KL_n + teacher_logprob_weight[n] log pT(a_n)`` of the action rows
    (top-M + tail KL, fused with the LM heads when ``spec.fused_linear``), and the per-row
    outputs without gradient.

    Fused, this is :func:`~lopd_kernels.fused_linear_topk_tail_kl_loss`: the weights are known
    before the kernel runs, so it forms the gradients while each chunk's logits are in memory
    (the GEMM count of the materialized path, none of its ``[N, V]`` tensors). Otherwise the
    heads' logits of the action rows under the caller's autocast, then ``topk_tail_kl``, the
    outputs weighted under autograd.

    Args:
        h_s, h_t: ``[N, d]`` final hidden states of student / teacher at the action rows.
        head_s, head_t: their LM heads (a sharded one is gathered).
        targets: ``[N]`` sampled action tokens.
        spec: the kernel settings.
        kl_weight, teacher_logprob_weight: ``[N]`` row weights (constants), e.g. from
            :func:`lopd.loss.segment_mean_weights`.

    Returns:
        ``(loss, output)``: the weighted sum and the kernel's
        :class:`~lopd_kernels.topk_tail_kl.TopKTailKLOutput` (``kl, privilege, student_logprob,
        teacher_logprob, topk_ids, teacher_topk_mass``) without gradient.
    """
    kernel = {"top_m": spec.top_m, "temperature": spec.temperature}
    kernel["divergence"] = spec.divergence
    if not spec.fused_linear:
        out = lm_head_topk_tail_kl(
            h_s, _kernel_head(head_s), h_t, _kernel_head(head_t), targets, fused=False, **kernel
        )
        loss = (kl_weight * out.kl).sum() + (teacher_logprob_weight * out.teacher_logprob).sum()
        return FusedLinearTopKTailKLLoss(loss, TopKTailKLOutput(*(x.detach() for x in out)))
    # Under mixed precision the fused kernel reads 16-bit operands, as an autocast lm_head would
    # (the student's are float32 master weights and hidden states); autocast does not cast
    # custom ops' inputs itself.
    h_s, w_s, h_t, w_t = autocast_cast(h_s, full_weight(head_s), h_t, full_weight(head_t))
    return fused_linear_topk_tail_kl_loss(
        h_s,
        w_s,
        h_t,
        w_t,
        targets,
        kl_weight=kl_weight,
        teacher_logprob_weight=teacher_logprob_weight,
        student_bias=getattr(head_s, "bias", None),
        teacher_bias=getattr(head_t, "bias", None),
        **kernel,
    )


def _kernel_head(head: nn.Module) -> nn.Module | tuple[torch.Tensor, torch.Tensor | None]:
    """The head, or ``(full weight, bias)`` when its weight is sharded (:func:`full_weight`)."""
    if is_sharded(head.weight):
        return full_weight(head), getattr(head, "bias", None)
    return head


def distill_metric_sums(out: Any, where: ActionRows, num_traj: int) -> dict[str, float]:
    """Per-trajectory token means of the distillation outputs, summed over the ``num_traj``
    trajectories (the trainer averages these sums globally), and the action-token count.

    All of them leave the device in one transfer. ``teacher_top_m_mass`` comes from the kernel's
    own bucket masses (``out.teacher_topk_mass``): no second pass over the teacher logits.
    """
    names = ("privilege", "student_logprob", "teacher_logprob", "teacher_topk_mass")
    with torch.no_grad():
        means = torch.stack(
            [segment_mean(getattr(out, n).detach().float(), where.batch, num_traj) for n in names]
        )
        privilege, student_lp, teacher_lp, mass = means.sum(1).tolist()
    return {
        "teacher_top_m_mass": mass,
        "privilege": privilege,
        "student_logprob": student_lp,
        "teacher_logprob": teacher_lp,
        "action_tokens": float(where.rows.numel()),
    }


def distill_loss(
    models: Models,
    trajectories: Sequence[Trajectory],
    where: ActionRows,
    h_t: torch.Tensor,
    head_t: nn.Module,
    spec: DistillSpec,
    num_total: int,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Distillation of the student toward a teacher's hidden states at the action rows.

    Token-mean KL per trajectory (:func:`distill_rows`), optionally weighted, summed and divided
    by ``num_total``.

    Args:
        models: the run's models (the student's forward runs here).
        trajectories: B student trajectories.
        where: their :class:`ActionRows`.
        h_t: ``[N, d]`` teacher hidden states at the same rows.
        head_t: the teacher's LM head.
        spec: kernel settings.
        num_total: the step's trajectories on this rank.
        weights: ``[B]`` per-trajectory weights.

    Returns:
        ``(loss, metric sums)`` with the keys :data:`DISTILL_METRICS`.
    """
    h_s = student_action_hidden(models, trajectories, where)
    b = len(trajectories)
    per_traj = (1.0 if weights is None else weights.detach()) / num_total
    row_weights = segment_mean_weights(where.batch, per_traj, b)
    head_s = lm_head(models.student)
    distilled = distill_rows(h_s, head_s, h_t, head_t, where.targets, spec, row_weights)
    with torch.no_grad():
        kl = segment_mean(distilled.output.kl, where.batch, b)
        if weights is not None:
            kl = kl * weights
    sums = {"kl": float(kl.sum())}
    sums.update(distill_metric_sums(distilled.output, where, b))
    return distilled.loss, sums


def zero_loss(device: torch.device) -> torch.Tensor:
    """A micro-batch with nothing to learn from: a graph-free zero whose backward is a no-op."""
    return torch.zeros((), device=device, requires_grad=True)
