"""Group rollouts and policy-gradient pieces shared by group methods (GRPO, SDPO, Skill-SD).

A group method rolls each drawn task out G times; ``max(1, tasks_per_step // G)`` distinct tasks
are drawn, so at ``tasks_per_step`` divisible by G a step generates exactly as many rollouts as
LOPD's one-per-task (equal budgets).
"""

from __future__ import annotations

import torch

from lopd.methods.base import MethodContext
from lopd.types import Trajectory

__all__ = ["group_advantages", "group_rollouts", "ppo_clip_loss"]


def group_rollouts(
    ctx: MethodContext, step: int, group_size: int, tasks_per_step: int
) -> list[Trajectory]:
    """This rank's rollouts of step ``step`` for a group method: G rollouts of each task.

    ``max(1, tasks_per_step // G)`` distinct training tasks are drawn (the same seeded draw as
    one-rollout-per-task methods, :meth:`~lopd.methods.base.MethodContext.step_tasks`), whole
    groups are dealt to ranks, and each task is rolled out G times by the student in one batch.
    ``info["group"]`` holds the group index within this rank's list.
    """
    num_groups = max(1, tasks_per_step // group_size)
    tasks = ctx.step_tasks(step, num_groups)
    reps = [task for task in tasks for _ in range(group_size)]
    trajs = ctx.engine.generate(ctx.models.student, reps, seed=ctx.rollout_seed(step))
    for k, t in enumerate(trajs):
        t.info["group"] = k // group_size
    return trajs


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's group-normalized advantages ``(r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased sample standard deviation of the group (as in DeepSeekMath's GRPO
    and TRL). A group whose rewards are all equal, or that has a single member, gets advantage 0:
    it carries no preference between its members.

    Args:
        rewards: ``[B]`` float rewards.
        groups: ``[B]`` int64 group id of each rollout (ids need not be contiguous).
        eps: added to the standard deviation.

    Returns:
        ``[B]`` advantages, dtype of ``rewards`` (at least float32).
    """
    if rewards.dim() != 1 or rewards.shape != groups.shape:
        raise ValueError(
            f"rewards and groups must be [B] of the same shape, got {tuple(rewards.shape)} and "
            f"{tuple(groups.shape)}"
        )
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    _, inverse = torch.unique(groups, return_inverse=True)
    g = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(g, dtype=r.dtype, device=r.device).index_add(0, inverse, torch.ones_like(r))
    mean = torch.zeros(g, dtype=r.dtype, device=r.device).index_add(0, inverse, r) / count
    centered = r - mean[inverse]
    sq = torch.zeros(g, dtype=r.dtype, device=r.device).index_add(0, inverse, centered**2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    adv = centered / (std[inverse] + eps)
    # A singleton group has centered == 0 already; equal rewards give 0 / eps == 0 as well.
    return adv


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> torch.Tensor:
    """Per-token PPO-clip loss ``-min(rho A, clip(rho, 1 - eps_lo, 1 + eps_hi) A)``, ``rho =
    exp(logp - logp_old)``.

    With one optimizer update per batch of rollouts ``logp_old`` equals ``logp`` (detached), so
    ``rho = 1`` and the gradient is the policy gradient ``-A grad logp``; the clip only binds
    when several updates reuse the same rollouts.

    Args:
        logp: ``[N]`` log-probabilities of the sampled tokens under the current policy.
        logp_old: ``[N]`` the same under the sampling policy (no gradient is taken).
        advantages: ``[N]`` advantage of each token (its trajectory's).
        clip_eps: eps_lo, and eps_hi unless ``clip_eps_high`` is given.
        clip_eps_high: eps_hi of an asymmetric ("clip-higher", DAPO) range, e.g. Skill-SD's
            0.28 with eps_lo 0.2; ``None``: symmetric.

    Returns:
        ``[N]`` losses to average.
    """
    if not (logp.shape == logp_old.shape == advantages.shape):
        raise ValueError(
            "logp, logp_old and advantages must have the same shape, got "
            f"{tuple(logp.shape)}, {tuple(logp_old.shape)} and {tuple(advantages.shape)}"
        )
    eps_hi = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    if eps_hi <= 0:
        raise ValueError(f"clip_eps_high must be > 0, got {eps_hi}")
    ratio = torch.exp(logp - logp_old.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_hi) * advantages
    return -torch.minimum(unclipped, clipped)
