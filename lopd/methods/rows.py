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

from lopd.loss import segment_mean
from lopd.methods.base import DistillSpec
from lopd.parallel.distributed import is_sharded
from lopd.parallel.fsdp import full_weight
from lopd.parallel.precision import autocast_cast
from lopd.rollout.batch import ActionRows, lm_head, pad_batch
from lopd.run.context import Models
from lopd.types import Trajectory
from lopd_kernels.hf import lm_head_topk_tail_kl

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
) -> Any:
    """Top-M + tail KL of the action rows (fused with the LM heads when ``spec.fused_linear``).

    Args:
        h_s, h_t: ``[N, d]`` final hidden states of student / teacher at the action rows.
        head_s, head_t: their LM heads.
        targets: ``[N]`` sampled action tokens.
        spec: the kernel settings.

    Returns:
        The kernel's :class:`~lopd_kernels.topk_tail_kl.TopKTailKLOutput` (``kl, privilege,
        student_logprob, teacher_logprob, topk_ids, teacher_topk_mass``).
    """
    # The HF-facing helper users get (one way from hidden states and heads to the kernels): fused
    # with the heads, or on their materialized [N, V] logits (action rows only). A sharded frozen
    # head goes in as its gathered (weight, bias) pair.

    if spec.fused_linear:
        # Under mixed precision the fused kernel reads 16-bit operands, as an autocast lm_head
        # would (the student's are float32 master weights and hidden states); autocast does not
        # cast custom ops' inputs itself.
        h_s, w_s, h_t, w_t = autocast_cast(h_s, full_weight(head_s), h_t, full_weight(head_t))
        kernel_head_s = (w_s, getattr(head_s, "bias", None))
        kernel_head_t = (w_t, getattr(head_t, "bias", None))
    else:  # the heads' logits under the caller's autocast, action rows only
        kernel_head_s, kernel_head_t = _kernel_head(head_s), _kernel_head(head_t)
    return lm_head_topk_tail_kl(
        h_s,
        kernel_head_s,
        h_t,
        kernel_head_t,
        targets,
        fused=spec.fused_linear,
        top_m=spec.top_m,
        temperature=spec.temperature,
        divergence=spec.divergence,
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
    out = distill_rows(h_s, lm_head(models.student), h_t, head_t, where.targets, spec)
    b = len(trajectories)
    kl = segment_mean(out.kl, where.batch, b)
    if weights is not None:
        kl = kl * weights
    sums = {"kl": float(kl.detach().sum())}
    sums.update(distill_metric_sums(out, where, b))
    return kl.sum() / num_total, sums


def zero_loss(device: torch.device) -> torch.Tensor:
    """A micro-batch with nothing to learn from: a graph-free zero whose backward is a no-op."""
    return torch.zeros((), device=device, requires_grad=True)
