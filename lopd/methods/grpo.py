"""GRPO (paper B.1): group-normalized advantages weight a PPO-clip objective. No teacher."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lopd.config import Config
from lopd.loss import segment_mean
from lopd.methods.base import MethodBase, MethodContext
from lopd.methods.groups import group_advantages, group_rollouts, ppo_clip_loss
from lopd.methods.rows import student_action_hidden
from lopd.rollout.batch import ActionRows, lm_head, lm_head_logprobs
from lopd.types import Trajectory

__all__ = ["GRPOMethod"]


class GRPOMethod(MethodBase):
    """GRPO: G rollouts per task, group-normalized advantages, PPO-clip, token-level loss.

    The loss of a trajectory is the mean over its action tokens of :func:`ppo_clip_loss`; the
    step's loss is the mean over trajectories (DeepSeekMath's normalisation). Log-probabilities
    use the sampling temperature (``gen.temperature``), the distribution the tokens were drawn
    from. No KL to a reference model (beta = 0, as in DAPO / Dr. GRPO and TRL's default).

    Args:
        ctx: the models, engine and sampler.
        group_size: G (``grpo.group_size``).
        clip_eps: PPO epsilon (``grpo.clip_eps``).
        tasks_per_step: rollouts per step across ranks.
        sampling_temperature: ``gen.temperature`` (0, greedy, scores at temperature 1).
    """

    def __init__(
        self,
        ctx: MethodContext,
        group_size: int,
        clip_eps: float,
        tasks_per_step: int,
        sampling_temperature: float,
    ) -> None:
        super().__init__(ctx, tasks_per_step)
        self.group_size = group_size
        self.clip_eps = clip_eps
        self.tau = sampling_temperature or 1.0

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config) -> GRPOMethod:
        return cls(
            ctx, cfg.grpo.group_size, cfg.grpo.clip_eps, cfg.train.tasks_per_step,
            cfg.gen.temperature,
        )  # fmt: skip

    def rollouts(self, step: int) -> list[Trajectory]:
        """G rollouts of each drawn task; ``info["advantage"]`` is the group-normalized one."""
        trajs = group_rollouts(self.ctx, step, self.group_size, self.tasks_per_step)
        if trajs:
            adv = group_advantages(
                torch.tensor([t.reward for t in trajs], dtype=torch.float64),
                torch.tensor([t.info["group"] for t in trajs]),
            )
            for t, a in zip(trajs, adv.tolist()):
                t.info["advantage"] = a
        return trajs

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        models = self.models
        where = ActionRows.of(trajectories, models.device)
        h = student_action_hidden(models, trajectories, where)
        logp = lm_head_logprobs(lm_head(models.student), h, where.targets, self.tau)
        adv = torch.tensor([t.info["advantage"] for t in trajectories], device=models.device)
        per_token = ppo_clip_loss(logp, logp.detach(), adv[where.batch], self.clip_eps)
        b = len(trajectories)
        per_traj = segment_mean(per_token, where.batch, b)
        with torch.no_grad():
            ratio = torch.exp(logp - logp.detach())
            clipped = ((ratio - 1.0).abs() > self.clip_eps).float()
            sums: dict[str, Any] = {
                "advantage_abs": float(adv.abs().sum()),
                "clip_fraction": float(segment_mean(clipped, where.batch, b).sum()),
                "student_logprob": float(segment_mean(logp.detach(), where.batch, b).sum()),
                "action_tokens": float(where.rows.numel()),
            }
        return per_traj.sum() / num_total, sums
