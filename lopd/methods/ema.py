"""An EMA shadow of the student as a teacher (SDPO; reusable by any self-distillation method).

The shadow is created from the student on first use (before the first optimizer step that is
the initial student), frozen, and moved toward the student after every optimizer step by
:func:`ema_update_`. It is part of the method's state: saved in every checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["EMATeacher", "ema_update_"]


@torch.no_grad()
def ema_update_(teacher: nn.Module, student: nn.Module, rate: float) -> None:
    """In place ``theta_T <- (1 - rate) theta_T + rate theta_S`` over matching parameters.

    Args:
        teacher: the EMA shadow (same architecture as ``student``).
        student: the trained model.
        rate: update rate in ``[0, 1]`` (SDPO: 0.05).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    t_params, s_params = list(teacher.parameters()), list(student.parameters())
    if len(t_params) != len(s_params):
        raise ValueError(
            f"teacher has {len(t_params)} parameter tensors but student has {len(s_params)}"
        )
    for t, s in zip(t_params, s_params):
        t.lerp_(s.detach().to(t.dtype), rate)


class EMATeacher:
    """A frozen exponential-moving-average copy of a student.

    Args:
        student: the trained model.
        rate: update rate per :meth:`update` in ``[0, 1]``.
    """

    def __init__(self, student: nn.Module, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.student = student
        self.rate = rate
        self.model: nn.Module | None = None

    def get(self) -> nn.Module:
        """The shadow model, created from the student on first use."""
        if self.model is None:
            self.model = copy.deepcopy(self.student)
            self.model.requires_grad_(False)
            self.model.eval()
        return self.model

    def update(self) -> None:
        """``theta_T <- (1 - rate) theta_T + rate theta_S``."""
        ema_update_(self.get(), self.student, self.rate)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.model is None else {"ema_teacher": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ema_teacher" in state:
            self.get().load_state_dict(state["ema_teacher"])
