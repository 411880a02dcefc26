"""SDPO (paper B.1): an EMA teacher conditioned on a successful sibling of the same group.

Each task is rolled out G times. A rollout is *successful* when its reward reaches
``bank.min_reward`` (the success criterion the bank uses). Every rollout with at least one
successful sibling (another rollout of its group) gets one of them, drawn with a seeded
generator, as text (:data:`SDPO_USER_TEMPLATE`, its observation-lite trace) appended to the
teacher's first user message; rollouts without one contribute no loss. The teacher is an EMA
shadow of the student (:class:`~lopd.methods.ema.EMATeacher`), saved in every checkpoint. Loss:
reverse KL over the teacher's top-M (``lopd.top_m``) plus a tail bucket, token mean per
trajectory, mean over all the step's trajectories.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lopd.config import Config
from lopd.methods.base import DistillSpec, MethodBase, MethodContext
from lopd.methods.ema import EMATeacher
from lopd.methods.groups import group_rollouts
from lopd.methods.rows import DISTILL_METRICS, distill_loss, zero_loss
from lopd.methods.text_teacher import (
    TextTeacherSequence,
    framed_teacher_sequence,
    reference_text,
    text_teacher_hidden,
)
from lopd.rollout.batch import ActionRows, lm_head
from lopd.run.seeds import Stream, seed_of
from lopd.types import Trajectory

__all__ = ["SDPO_USER_TEMPLATE", "SDPOMethod"]

# SDPO's re-prompt layout (the paper gives no B.1 text for SDPO): the successful sibling is
# shown as a correct solution after the original task, then the task is asked again.
SDPO_USER_TEMPLATE = (
    "\n\nCorrect solution:\n\n{solution}\n\nCorrectly solve the original task yourself."
)


class SDPOMethod(MethodBase):
    """SDPO: EMA teacher with a successful sibling as text, reverse top-M + tail KL.

    Args:
        ctx: the models, engine and sampler.
        group_size: G (``sdpo.group_size``).
        ema_rate: the teacher's update rate (``sdpo.ema_rate``).
        success_reward: a sibling is successful at this reward (``bank.min_reward``).
        spec: kernel settings.
        tasks_per_step: rollouts per step across ranks.

    Attributes:
        teacher: the :class:`~lopd.methods.ema.EMATeacher`.
    """

    def __init__(
        self,
        ctx: MethodContext,
        group_size: int,
        ema_rate: float,
        success_reward: float,
        spec: DistillSpec,
        tasks_per_step: int,
    ) -> None:
        super().__init__(ctx, tasks_per_step)
        self.group_size = group_size
        self.success_reward = success_reward
        self.spec = spec
        self.teacher = EMATeacher(ctx.models.student, ema_rate, ctx.models.sharding)

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config) -> SDPOMethod:
        return cls(
            ctx,
            cfg.sdpo.group_size,
            cfg.sdpo.ema_rate,
            cfg.bank.min_reward,
            DistillSpec.of(cfg.lopd, divergence=cfg.sdpo.divergence),
            cfg.train.tasks_per_step,
        )

    def rollouts(self, step: int) -> list[Trajectory]:
        """G rollouts per task; ``info["sibling_text"]`` is a successful sibling's trace (or
        ``None``)."""
        trajs = group_rollouts(self.ctx, step, self.group_size, self.tasks_per_step)
        self.pick_siblings(trajs, step)
        return trajs

    def pick_siblings(self, trajs: Sequence[Trajectory], step: int) -> None:
        """Give every rollout one successful sibling of its group, drawn with the step's seed."""
        ctx = self.ctx
        rng = np.random.default_rng(seed_of(ctx.seed, Stream.SDPO_SIBLING, step, ctx.rank))
        for i, t in enumerate(trajs):
            siblings = [
                s
                for j, s in enumerate(trajs)
                if j != i and s.info["group"] == t.info["group"] and s.reward >= self.success_reward
            ]
            pick = siblings[int(rng.integers(len(siblings)))] if siblings else None
            t.info["sibling_text"] = reference_text(pick, ctx.context_format) if pick else None

    def teacher_sequence(self, traj: Trajectory) -> TextTeacherSequence:
        """The teacher's input: the sibling's solution after the first user message."""
        solution = self.privileged(traj.info["sibling_text"])
        return framed_teacher_sequence(
            self.models.tokenizer,
            traj,
            solution,
            self.ctx.context_format,
            user_suffix=SDPO_USER_TEMPLATE.format(solution=solution),
        )

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        models = self.models
        teacher = self.teacher.get()
        chosen = [t for t in trajectories if t.info.get("sibling_text") is not None]
        counts = {"distilled": float(len(chosen))}
        if not chosen:
            # Same metric keys as a distilled micro-batch: ranks reduce metrics by key.
            nothing = {**dict.fromkeys(DISTILL_METRICS, 0.0), **counts}
            if not models.sharding.enabled:
                return zero_loss(models.device), nothing
            # Under FSDP2 the forwards are collectives: run those of a distilled micro-batch
            # on a placeholder (the first trajectory, an empty solution), weighted by zero.
            placeholder = copy.deepcopy(trajectories[0])
            placeholder.info["sibling_text"] = ""
            loss, _ = self.distill([placeholder], teacher, num_total)
            return loss * 0.0, nothing
        loss, sums = self.distill(chosen, teacher, num_total)
        return loss, {**sums, **counts}

    def distill(
        self, chosen: Sequence[Trajectory], teacher: torch.nn.Module, num_total: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The distillation loss and metric sums of ``chosen`` toward ``teacher``."""
        models = self.models
        where = ActionRows.of(chosen, models.device)
        seqs = [self.teacher_sequence(t) for t in chosen]
        with torch.no_grad():
            h_t = text_teacher_hidden(models, teacher, seqs, where)
        return distill_loss(models, chosen, where, h_t, lm_head(teacher), self.spec, num_total)

    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        self.teacher.update()
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self.teacher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teacher.load_state_dict(state)
