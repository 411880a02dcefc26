"""The optimizers of joint training: AdamW on the student theta and on the composer phi.

Built in one place (:func:`build_optimizers`) so learning rates, weight decay, parameter groups
and clipping are read from the ``train`` section here and nowhere else. Every parameter an
optimizer steps is a float32 master weight (its AdamW state is float32 too), whatever
``model.dtype`` computes in (:mod:`lopd.parallel.precision`); with ``float16`` the loss is scaled
(:meth:`Optimizers.backward`) and gradients are unscaled before clipping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lopd.config import TrainConfig
from lopd.parallel.distributed import Dist, is_sharded

__all__ = ["Optimizers", "build_optimizers", "check_master_weights"]


@dataclass
class Optimizers:
    """AdamW of the student and (when there is a composer) of phi.

    Attributes:
        student_params: the student's trainable parameters.
        composer_params: phi (LoRA + QFormer), empty without a composer.
        student: AdamW over ``student_params``.
        composer: AdamW over ``composer_params``, or ``None``.
        grad_clip: global gradient-norm clip (student and composer separately).
        scaler: the float16 loss scaler (:meth:`lopd.parallel.precision.Precision.grad_scaler`), or
            ``None`` (bfloat16 and float32 need none).
    """

    student_params: list[nn.Parameter]
    composer_params: list[nn.Parameter]
    student: torch.optim.Optimizer
    composer: torch.optim.Optimizer | None
    grad_clip: float
    scaler: torch.amp.GradScaler | None = None

    def zero_grad(self) -> None:
        self.student.zero_grad(set_to_none=True)
        if self.composer is not None:
            self.composer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the loss scaler under float16."""
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def sync_clip_step(self, dist: Dist) -> tuple[float, float]:
        """Average gradients over ranks, clip each model's global norm, step both optimizers.

        Under float16 the gradients are unscaled before clipping, and a step whose gradients
        overflowed is skipped by both optimizers (the scale then halves).

        Returns:
            The student's and the composer's gradient norms before clipping (0 without one).
        """
        dist.average_gradients(self.student_params)
        dist.average_gradients(self.composer_params)
        optimizers = [self.student] + ([self.composer] if self.composer is not None else [])
        if self.scaler is not None:
            for opt in optimizers:
                self.scaler.unscale_(opt)
        gnorm_s = dist.clip_grad_norm_(self.student_params, self.grad_clip)
        gnorm_c = (
            dist.clip_grad_norm_(self.composer_params, self.grad_clip)
            if self.composer_params
            else 0.0
        )
        if self.scaler is None:
            for opt in optimizers:
                opt.step()
        else:
            for opt in optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        return gnorm_s, gnorm_c

    def state_dict(self) -> dict[str, Any]:
        state = {
            "opt_student": self.student.state_dict(),
            "opt_composer": self.composer.state_dict() if self.composer is not None else None,
        }
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.student.load_state_dict(state["opt_student"])
        if self.composer is not None and state.get("opt_composer") is not None:
            self.composer.load_state_dict(state["opt_composer"])
        if self.scaler is not None and state.get("grad_scaler") is not None:
            self.scaler.load_state_dict(state["grad_scaler"])


def _param_groups(params: list[nn.Parameter]) -> list[nn.Parameter] | list[dict[str, Any]]:
    """One group, or (FSDP2 with replicated parameters next to sharded ones, as phi's QFormer
    next to its LoRA) one group of each kind: AdamW's fused per-group update cannot mix
    DTensors and plain tensors."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded or len(sharded) == len(params):
        return params
    return [{"params": sharded}, {"params": [p for p in params if not is_sharded(p)]}]


def check_master_weights(params: list[nn.Parameter], what: str) -> None:
    """Every trained parameter must be a float32 master weight.

    Raises:
        TypeError: naming the first parameter of another dtype (a 16-bit weight stepped by
            AdamW at lr 1e-5 barely moves: most updates are below its rounding step).
    """
    for i, p in enumerate(params):
        if p.dtype != torch.float32:
            raise TypeError(
                f"{what} parameter {i} {tuple(p.shape)} is {p.dtype}: trained parameters must be "
                "float32 master weights (lopd.parallel.precision; model.dtype only sets the "
                "compute dtype)"
            )


def build_optimizers(
    student: nn.Module,
    composer_params: list[nn.Parameter],
    cfg: TrainConfig,
    scaler: torch.amp.GradScaler | None = None,
) -> Optimizers:
    """AdamW on the student (``train.lr``) and on phi (``train.composer_lr``), both with
    ``train.weight_decay``; call after FSDP2 sharding (the optimizers hold the shards).

    Args:
        student: the student (its trainable parameters must be float32).
        composer_params: phi (float32), empty without a composer.
        cfg: the ``train`` section.
        scaler: the float16 loss scaler; a disabled one (or ``None``) means no scaling.

    Raises:
        TypeError: a trainable parameter is not float32 (:func:`check_master_weights`).
    """
    student_params = [p for p in student.parameters() if p.requires_grad]
    check_master_weights(student_params, "student")
    check_master_weights(composer_params, "composer")
    opt_student = torch.optim.AdamW(
        _param_groups(student_params), lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    opt_composer = (
        torch.optim.AdamW(
            _param_groups(composer_params), lr=cfg.composer_lr, weight_decay=cfg.weight_decay
        )
        if composer_params
        else None
    )
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    return Optimizers(
        student_params, composer_params, opt_student, opt_composer, cfg.grad_clip, scaler
    )
