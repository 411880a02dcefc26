"""OPSD (paper B.1): the frozen base model as teacher, a retrieved successful trajectory as text.

The privileged text is the first of the task's ``composer.num_retrieved`` retrievals from the
experience bank (successful base-model rollouts of *other* training tasks, rendered by
:func:`~lopd.memory.format_experience`), the same bank and retriever LOPD's composer reads,
appended to the teacher's system message in the paper's wording (:data:`OPSD_SYSTEM_TEMPLATE`).
Loss: forward KL(teacher || student) over the full vocabulary (``opsd`` section), token mean per
trajectory, mean over trajectories.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lopd.config import Config
from lopd.methods.base import DistillSpec, MethodBase, MethodContext
from lopd.methods.rows import distill_loss
from lopd.methods.text_teacher import (
    TextTeacherSequence,
    framed_teacher_sequence,
    text_teacher_hidden,
)
from lopd.rollout.batch import ActionRows, lm_head
from lopd.types import Trajectory

__all__ = ["OPSD_SYSTEM_TEMPLATE", "OPSDMethod"]

# Paper B.1, verbatim: appended to the teacher's system message for OPSD.
OPSD_SYSTEM_TEMPLATE = (
    "\n\nThe following is a reference plan for the upcoming task. Use it only as guidance for "
    "your own reasoning; you must still interact with the environment to complete the task."
    "\n\n{gt_text}\n\n"
    "After reading the reference solution above, make sure you truly understand the reasoning "
    "behind each step. Now, using your own words and independent reasoning, derive the same "
    "final answer."
)


class OPSDMethod(MethodBase):
    """OPSD: frozen base teacher with a retrieved successful trajectory in its system message.

    Args:
        ctx: needs ``experience`` (the retrievals).
        spec: the kernel settings (``opsd.top_m``, ``opsd.divergence``).
        tasks_per_step: rollouts per step across ranks.
    """

    def __init__(self, ctx: MethodContext, spec: DistillSpec, tasks_per_step: int) -> None:
        super().__init__(ctx, tasks_per_step)
        if ctx.experience is None:
            raise ValueError("OPSD needs the experience bank's retrievals")
        self.retrieved = ctx.experience.retrieved
        self.spec = spec

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config) -> OPSDMethod:
        spec = DistillSpec.of(cfg.lopd, top_m=cfg.opsd.top_m, divergence=cfg.opsd.divergence)
        return cls(ctx, spec, cfg.train.tasks_per_step)

    def teacher_sequence(self, traj: Trajectory) -> TextTeacherSequence:
        """The teacher's input: the first retrieved experience of the task as system text."""
        gt_text = self.privileged(self.retrieved[traj.task.task_id][0])
        return framed_teacher_sequence(
            self.models.tokenizer,
            traj,
            gt_text,
            self.ctx.context_format,
            system_suffix=OPSD_SYSTEM_TEMPLATE.format(gt_text=gt_text),
        )

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        models = self.models
        where = ActionRows.of(trajectories, models.device)
        seqs = [self.teacher_sequence(t) for t in trajectories]
        with torch.no_grad():
            h_t = text_teacher_hidden(models, models.backbone, seqs, where)
        return distill_loss(
            models, trajectories, where, h_t, lm_head(models.backbone), self.spec, num_total
        )
