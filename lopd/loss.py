"""The LOPD objective (paper eq. 10-13) and the dual update of beta.

Per supervised token row ``n`` the kernels give ``KL_n`` (top-M + tail, eq. 9-10) and the
privilege ``delta_n = log pT(a_n) - sg log pS(a_n)`` (eq. 11). With ``seg[n]`` the trajectory of
row ``n`` and ``A_i = 2 r_i - 1``::

    L_distill = mean_i  mean_{n in i} KL_n                            (eq. 10)
    Delta     = mean_i  A_i * mean_{n in i} delta_n                   (eq. 12)
    anchor    = mean_i  mean_{k,c} (c_phi[i] - sg c_phi0[i])^2
    loss      = L_distill + beta * (m - Delta) + lambda * anchor      (eq. 13)
    beta     <- max(0, beta + eta_beta * (m - Delta.detach()))

The anchor is the squared L2 distance normalised by the number of latent elements ``J*K*d`` so
that lambda does not scale with the model width (eq. 13 leaves the normalisation implicit).

Every term is a mean over trajectories of a per-trajectory quantity, so a step split into
micro-batches is exact: each micro-batch divides its per-trajectory sums by the number of
trajectories in the whole step (``num_total``), and the gradients add up to the full-batch ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LOPDTerms",
    "advantages_from_rewards",
    "dual_update",
    "lopd_loss",
    "lopd_row_weights",
    "segment_mean",
    "segment_mean_weights",
]


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """Reductions run in float32 for bf16/fp16 inputs, and keep float64 inputs in float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def segment_mean(values: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Mean of ``values`` within each segment.

    Args:
        values: ``[N]`` per-row values.
        seg: ``[N]`` int64 segment (trajectory) index of each row, in ``[0, num_segments)``.
        num_segments: B.

    Returns:
        ``[B]``; an empty segment gives 0 (a trajectory with no action token contributes
        nothing instead of NaN).
    """
    if values.shape != seg.shape or values.dim() != 1:
        raise ValueError(
            f"values and seg must be [N] of the same shape, got {tuple(values.shape)} and "
            f"{tuple(seg.shape)}"
        )
    sums = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, seg, values)
    return sums / _segment_sizes(seg, num_segments, values.dtype)


def _segment_sizes(seg: torch.Tensor, num_segments: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B]`` rows per segment, at least 1 (an empty segment divides 0 by 1)."""
    counts = torch.zeros(num_segments, dtype=dtype, device=seg.device)
    counts = counts.index_add(0, seg, torch.ones(seg.shape, dtype=dtype, device=seg.device))
    return counts.clamp_min(1)


def segment_mean_weights(
    seg: torch.Tensor, per_segment: torch.Tensor | float, num_segments: int
) -> torch.Tensor:
    """Row weights ``w [N]`` with ``(w * values).sum() == (per_segment * segment_mean(values, seg,
    num_segments)).sum()`` for every ``values``: ``per_segment[seg[n]] / |segment seg[n]|``.

    What turns a sum of per-trajectory token means into one weighted sum over rows, the form
    :func:`lopd_kernels.fused_linear_topk_tail_kl_loss` takes (its gradients are formed in its
    forward, so the weights must be known before it runs).

    Args:
        seg: ``[N]`` int64 segment index of each row, in ``[0, num_segments)``.
        per_segment: ``[B]`` (or a scalar) factor of each segment's mean.
        num_segments: B.

    Returns:
        ``[N]`` float32 (float64 for a float64 ``per_segment``), no gradient.
    """
    dtype = torch.float64 if getattr(per_segment, "dtype", None) == torch.float64 else torch.float32
    factor = torch.as_tensor(per_segment, dtype=dtype, device=seg.device).expand(num_segments)
    return (factor.detach() / _segment_sizes(seg, num_segments, dtype)).index_select(0, seg)


def lopd_row_weights(
    seg: torch.Tensor, advantages: torch.Tensor, beta: float, num_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 13's distillation and privilege terms as weights of the rows' ``KL_n`` and
    ``log pT(a_n)``: ``(sum_n w_kl[n] KL_n + w_t[n] log pT(a_n))`` has the gradient of
    ``(sum_i distill_i - beta * delta_i) / num_total`` (:func:`lopd_loss`); its value differs by
    the constant ``beta * sum_i A_i mean_n sg log pS(a_n) / num_total``.

    Args:
        seg: ``[N]`` trajectory of each row; advantages: ``[B]`` ``A_i``; beta: the dual
            variable; num_total: trajectories in the whole step.

    Returns:
        ``(w_kl, w_t)``, both ``[N]`` without gradient, float32 (float64 advantages: float64).
    """
    num_traj = advantages.shape[0]
    adv = _at_least_f32(advantages.detach())
    w_kl = segment_mean_weights(seg, torch.full_like(adv, 1.0 / num_total), num_traj)
    w_t = segment_mean_weights(seg, -beta * adv / num_total, num_traj)
    return w_kl, w_t


def advantages_from_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """``A = 2 r - 1`` in ``[-1, 1]`` (paper 3.3) for rewards ``r`` in ``[0, 1]``."""
    return 2.0 * rewards - 1.0


@dataclass
class LOPDTerms:
    """The loss of one (micro-)batch and its per-trajectory pieces.

    Attributes:
        loss: scalar to backpropagate (already divided by ``num_total``).
        distill: ``[B]`` per-trajectory token-mean KL.
        delta: ``[B]`` per-trajectory ``A_i * mean delta_n`` (gradient to the teacher side only).
        anchor: ``[B]`` per-trajectory latent drift (mean squared element difference).
    """

    loss: torch.Tensor
    distill: torch.Tensor
    delta: torch.Tensor
    anchor: torch.Tensor


def lopd_loss(
    kl: torch.Tensor,
    privilege: torch.Tensor,
    seg: torch.Tensor,
    advantages: torch.Tensor,
    latents: torch.Tensor | None,
    latents0: torch.Tensor | None,
    beta: float,
    margin: float,
    anchor_weight: float,
    num_total: int | None = None,
) -> LOPDTerms:
    """Eq. 13 for a (micro-)batch of B trajectories.

    Args:
        kl: ``[N]`` per action-token KL (top-M + tail) from ``topk_tail_kl``.
        privilege: ``[N]`` per-token privilege (eq. 11), differentiable in the teacher only.
        seg: ``[N]`` int64 trajectory index of each row in ``[0, B)``.
        advantages: ``[B]`` ``A_i = 2 r_i - 1``.
        latents: ``[B, J*K, d]`` c_phi (``None`` or ``anchor_weight == 0`` skips the anchor).
        latents0: ``[B, J*K, d]`` cached c_phi0 (no gradient is taken through it).
        beta: current dual variable (a constant here).
        margin: m.
        anchor_weight: lambda.
        num_total: trajectories in the whole step (micro-batching); defaults to B.

    Returns:
        :class:`LOPDTerms`.
    """
    num_traj = advantages.shape[0]
    num_total = num_traj if num_total is None else num_total
    if num_total < num_traj:
        raise ValueError(f"num_total={num_total} is smaller than the batch ({num_traj})")
    if kl.shape != privilege.shape:
        raise ValueError(
            f"kl and privilege must have the same shape, got {tuple(kl.shape)} and "
            f"{tuple(privilege.shape)}"
        )
    distill = segment_mean(_at_least_f32(kl), seg, num_traj)
    delta = _at_least_f32(advantages) * segment_mean(_at_least_f32(privilege), seg, num_traj)
    if latents is not None and latents0 is not None and anchor_weight > 0:
        if latents.shape != latents0.shape:
            raise ValueError(
                f"latents and latents0 must match, got {tuple(latents.shape)} and "
                f"{tuple(latents0.shape)}"
            )
        diff = _at_least_f32(latents) - _at_least_f32(latents0.detach())
        anchor = diff.pow(2).flatten(1).mean(dim=1)
    else:
        anchor = torch.zeros(num_traj, device=kl.device)
    per_traj = distill - beta * delta + anchor_weight * anchor
    # beta * m is a constant; kept so the logged loss is the Lagrangian of eq. 13.
    loss = (per_traj.sum() + beta * margin * num_traj) / num_total
    return LOPDTerms(loss=loss, distill=distill, delta=delta, anchor=anchor)


def dual_update(beta: float, margin: float, delta: float, dual_lr: float) -> float:
    """Projected dual ascent: ``beta <- max(0, beta + eta_beta * (m - Delta))``.

    Args:
        beta: current value (>= 0).
        margin: m.
        delta: the step's Delta (a float: no gradient flows through the dual update).
        dual_lr: eta_beta.

    Returns:
        The new beta. It grows while ``Delta < m`` and shrinks to 0 once ``Delta > m``.
    """
    if isinstance(delta, torch.Tensor):
        delta = float(delta.detach())
    return max(0.0, beta + dual_lr * (margin - delta))
