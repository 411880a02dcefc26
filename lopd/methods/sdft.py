"""SDFT (paper B.1): an EMA teacher conditioned on a demonstration from the shared pool.

The teacher is an EMA shadow of the student (:class:`~lopd.methods.ema.EMATeacher`, alpha =
``sdft.ema_rate`` = 0.01, updated after every optimizer step, saved in every checkpoint). Its
privileged context is a verified-successful trajectory from the shared pool, the experience
bank's successful base-model rollouts (reward >= ``bank.min_reward``, the pool OPSD reads too),
appended to its first user message in the paper's wording (:data:`SDFT_USER_TEMPLATE`):

* the task's own successful trajectory when the pool has one (the best, first on ties),
  rendered as its observation-lite trace: a demonstration of a response to this very task;
* otherwise the task's first retrieved experience (a successful trajectory of the most similar
  other task, :func:`~lopd.memory.format_experience`). The paper fills such gaps with
  trajectories synthesized by stronger models; there are none offline, so the nearest
  verified one stands in.

With a growing bank (``bank.grow``) the pool grows with the student's verified successes: a task
without a demonstration of its own gets the first of its grown entries.

Loss: forward KL(teacher || student) over the full vocabulary (``sdft.top_m`` = ``None``), token
mean per trajectory, mean over trajectories. One student rollout per task, as LOPD; the bank's
rollouts count toward the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lopd.config import Config
from lopd.memory import BankEntry, format_experience
from lopd.methods.base import DistillSpec, MethodBase, MethodContext
from lopd.methods.ema import EMATeacher
from lopd.methods.rows import distill_loss
from lopd.methods.text_teacher import (
    TextTeacherSequence,
    framed_teacher_sequence,
    reference_text,
    text_teacher_hidden,
)
from lopd.rollout.batch import ActionRows, lm_head
from lopd.types import Trajectory

__all__ = ["SDFT_USER_TEMPLATE", "SDFTMethod"]

# Paper B.1, verbatim: appended to the teacher's first user message for SDFT.
SDFT_USER_TEMPLATE = (
    "\n\nThis is an example for a response to the question:\n\n{demo_text}\n\n"
    "Now answer with a response of your own, including the thinking process."
)


class SDFTMethod(MethodBase):
    """SDFT: EMA teacher with a demonstration in its first user message, forward KL.

    Args:
        ctx: needs ``experience`` (the pool's trajectories and every task's retrievals).
        ema_rate: alpha of the EMA teacher.
        spec: the kernel settings (``sdft.top_m``, ``sdft.divergence``).
        tasks_per_step: rollouts per step across ranks.

    Attributes:
        teacher: the :class:`~lopd.methods.ema.EMATeacher`.
        own_demos: ``task_id -> `` trace text of the task's best successful pool trajectory.
    """

    def __init__(
        self, ctx: MethodContext, ema_rate: float, spec: DistillSpec, tasks_per_step: int
    ) -> None:
        super().__init__(ctx, tasks_per_step)
        if ctx.experience is None:
            raise ValueError("SDFT needs the shared pool (the experience bank)")
        self.retrieved = ctx.experience.retrieved
        best: dict[str, Trajectory] = {}
        for t in ctx.experience.trajectories:
            held = best.get(t.task.task_id)
            if held is None or t.reward > held.reward:
                best[t.task.task_id] = t
        self.own_demos = {k: reference_text(t, ctx.context_format) for k, t in best.items()}
        self.spec = spec
        self.teacher = EMATeacher(ctx.models.student, ema_rate, ctx.models.sharding)
        if self.bank_growth is not None:
            self.bank_growth.subscribe(self.add_demonstrations)

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config) -> SDFTMethod:
        spec = DistillSpec.of(cfg.lopd, top_m=cfg.sdft.top_m, divergence=cfg.sdft.divergence)
        return cls(ctx, cfg.sdft.ema_rate, spec, cfg.train.tasks_per_step)

    def add_demonstrations(self, entries: list[BankEntry]) -> None:
        """The grown pool's entries as the demonstrations of the tasks that had none (the
        earlier one stays: the best, first on ties)."""
        for e in entries:
            if e.task_id not in self.own_demos:
                a5 = self.ctx.context_format == "a5"
                text = format_experience(e) if a5 else (e.trace_text or "(no tool calls)")
                self.own_demos[e.task_id] = text

    def demonstration(self, task_id: str) -> tuple[str, bool]:
        """The demonstration text of a task and whether it is the task's own trajectory."""
        own = self.own_demos.get(task_id)
        if own is not None:
            return own, True
        return self.retrieved[task_id][0], False

    def teacher_sequence(self, traj: Trajectory) -> TextTeacherSequence:
        """The teacher's input: the demonstration after the first user message."""
        demo = self.privileged(self.demonstration(traj.task.task_id)[0])
        return framed_teacher_sequence(
            self.models.tokenizer,
            traj,
            demo,
            self.ctx.context_format,
            user_suffix=SDFT_USER_TEMPLATE.format(demo_text=demo),
        )

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        models = self.models
        teacher = self.teacher.get()
        where = ActionRows.of(trajectories, models.device)
        seqs = [self.teacher_sequence(t) for t in trajectories]
        with torch.no_grad():
            h_t = text_teacher_hidden(models, teacher, seqs, where)
        loss, sums = distill_loss(
            models, trajectories, where, h_t, lm_head(teacher), self.spec, num_total
        )
        own = sum(self.demonstration(t.task.task_id)[1] for t in trajectories)
        return loss, {**sums, "demo_own_task": float(own)}

    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        self.teacher.update()
        return super().after_step(means)

    def state_dict(self) -> dict[str, Any]:
        return {**self.teacher.state_dict(), **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teacher.load_state_dict(state)
        super().load_state_dict(state)
