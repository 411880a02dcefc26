"""An EMA shadow of the student as a teacher (SDPO; reusable by any self-distillation method).

The shadow is created from the student on first use (before the first optimizer step that is
the initial student), frozen, and moved toward the student after every optimizer step by
:func:`ema_update_`. It is part of the method's state: saved in every checkpoint.

Under ``model.parallel=fsdp2`` the shadow is sharded like the student
(:meth:`lopd.parallel.fsdp.Sharding.frozen_copy`, built when the method is, on every rank): each
rank moves its own shards toward the student's, and a checkpoint holds it whole (gathered on
rank 0, like the deployable student).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lopd.parallel.fsdp import Sharding

__all__ = ["EMATeacher", "ema_update_", "lerp_"]


@torch.no_grad()
def lerp_(targets: list[torch.Tensor], sources: list[torch.Tensor], rate: float) -> None:
    """In place ``t <- (1 - rate) t + rate s`` for matching tensors (``rate`` in ``[0, 1]``)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    if len(targets) != len(sources):
        raise ValueError(
            f"teacher has {len(targets)} parameter tensors but student has {len(sources)}"
        )
    for t, s in zip(targets, sources):
        t.lerp_(s.detach().to(t.dtype), rate)


@torch.no_grad()
def ema_update_(teacher: nn.Module, student: nn.Module, rate: float) -> None:
    """In place ``theta_T <- (1 - rate) theta_T + rate theta_S`` over matching parameters.

    Args:
        teacher: the EMA shadow (same architecture as ``student``).
        student: the trained model.
        rate: update rate in ``[0, 1]`` (SDPO: 0.05).
    """
    lerp_(list(teacher.parameters()), list(student.parameters()), rate)


class EMATeacher:
    """A frozen exponential-moving-average copy of a student.

    Args:
        student: the trained model.
        rate: update rate per :meth:`update` in ``[0, 1]``.
        sharding: the run's sharding; when it shards the student, the shadow is a sharded copy,
            built here (a collective: every rank builds its method at the same point).
    """

    def __init__(self, student: nn.Module, rate: float, sharding: Sharding | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.student = student
        self.rate = rate
        self.model: nn.Module | None = None
        self.sharding = sharding if sharding is not None and sharding.is_sharded(student) else None
        if self.sharding is not None:
            self.get()

    def get(self) -> nn.Module:
        """The shadow model, created from the student on first use."""
        if self.model is None:
            if self.sharding is not None:
                self.model = self.sharding.frozen_copy(self.student)
            else:
                self.model = copy.deepcopy(self.student)
                self.model.requires_grad_(False)
                self.model.eval()
        return self.model

    def update(self) -> None:
        """``theta_T <- (1 - rate) theta_T + rate theta_S`` (under FSDP2 on each rank's shards,
        every rank together)."""
        if self.sharding is None:
            ema_update_(self.get(), self.student, self.rate)
            return
        with (
            self.sharding.local_shards(self.get()) as teacher,
            self.sharding.local_shards(self.student) as student,
        ):
            lerp_(teacher, student, self.rate)

    def state_dict(self) -> dict[str, Any]:
        """``{"ema_teacher": the shadow's state dict}`` (whole: under FSDP2 gathered on rank 0,
        a collective, and ``{}`` there on the other ranks, which do not write checkpoints)."""
        if self.model is None:
            return {}
        if self.sharding is not None:
            return {"ema_teacher": self.sharding.full_state_dict(self.model)}
        return {"ema_teacher": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ema_teacher" in state:
            if self.sharding is not None:
                self.sharding.load_full_state_dict(self.get(), state["ema_teacher"])
            else:
                self.get().load_state_dict(state["ema_teacher"])
