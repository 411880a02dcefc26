"""The weights LOPD's latent teacher runs on (``lopd.teacher_backbone``; ``lopd`` and ``lopd-ppo``).

* ``base``: the frozen base model, the paper's teacher. It is the composer's encoder backbone
  with the encoder's LoRA switched off (``composer.teacher_mode()``); no copy is kept.
* ``sync``: a copy of the student, refreshed every ``lopd.teacher_sync_every`` optimizer steps
  (Skill-SD's "dynamically synchronized" teacher). With 1 it is the student as it was before the
  step; a copy rather than the student itself, since the teacher's forward is differentiable in
  phi and must not send gradients into theta.
* ``ema``: an exponential moving average of the student, ``theta_T <- (1 - rate) theta_T + rate
  theta_S`` after every optimizer step (``lopd.teacher_ema_rate``; SDPO's teacher).

Both copies start as the initial student (the base model's weights), so the three settings share
their first step. The composer's encoder stays the frozen base with its LoRA whatever the teacher
is, and a copy carries no LoRA at all. The copy and the step count are the method's state, saved
in every checkpoint.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lopd.methods.ema import EMATeacher
from lopd.parallel.fsdp import Sharding

__all__ = ["TeacherBackbone"]


class TeacherBackbone:
    """Whose weights the latent teacher reads the student's trajectories with.

    Args:
        student: the trained model.
        kind: ``base``, ``sync`` or ``ema``.
        sync_every: ``sync``: optimizer steps between copies.
        ema_rate: ``ema``: the update rate per optimizer step.
        sharding: the run's sharding: under FSDP2 a copy is sharded like the student
            (:class:`~lopd.methods.ema.EMATeacher`).

    Attributes:
        steps: optimizer steps seen (:meth:`after_step` calls).
    """

    def __init__(
        self,
        student: nn.Module,
        kind: str,
        sync_every: int,
        ema_rate: float,
        sharding: Sharding | None = None,
    ) -> None:
        if kind not in ("base", "sync", "ema"):
            raise ValueError(f"teacher backbone must be base, sync or ema, got {kind!r}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.kind = kind
        self.sync_every = sync_every
        self.steps = 0
        rate = 1.0 if kind == "sync" else ema_rate
        self.copy = None if kind == "base" else EMATeacher(student, rate, sharding)
        if self.copy is not None:
            self.copy.get()  # the initial student, before any optimizer step

    @property
    def moved(self) -> bool:
        """Whether the teacher's weights follow the student (``sync`` or ``ema``)."""
        return self.copy is not None

    def model(self) -> nn.Module | None:
        """The teacher's ``*ForCausalLM``: the copy, or ``None`` for the frozen base (run it
        through ``composer.teacher_mode()``)."""
        return None if self.copy is None else self.copy.get()

    def after_step(self) -> None:
        """After an optimizer step: the EMA moves, a sync copies every ``sync_every`` steps."""
        self.steps += 1
        if self.copy is None:
            return
        if self.kind == "ema" or self.steps % self.sync_every == 0:
            self.copy.update()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"teacher_steps": self.steps}
        if self.copy is not None:
            state.update(self.copy.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("teacher_steps", 0))
        if self.copy is not None:
            self.copy.load_state_dict(state)
