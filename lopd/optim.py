"""The optimizers of joint training: AdamW on the student theta and on the composer phi.

Built in one place (:func:`build_optimizers`) so learning rates, weight decay, parameter groups
and clipping are read from the ``lopd`` section here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lopd.config import LOPDConfig
from lopd.distributed import Dist, is_sharded

__all__ = ["Optimizers", "build_optimizers"]


@dataclass
class Optimizers:
    """AdamW of the student and (when there is a composer) of phi.

    Attributes:
        student_params: the student's trainable parameters.
        composer_params: phi (LoRA + QFormer), empty without a composer.
        student: AdamW over ``student_params``.
        composer: AdamW over ``composer_params``, or ``None``.
        grad_clip: global gradient-norm clip (student and composer separately).
    """

    student_params: list[nn.Parameter]
    composer_params: list[nn.Parameter]
    student: torch.optim.Optimizer
    composer: torch.optim.Optimizer | None
    grad_clip: float

    def zero_grad(self) -> None:
        self.student.zero_grad(set_to_none=True)
        if self.composer is not None:
            self.composer.zero_grad(set_to_none=True)

    def sync_clip_step(self, dist: Dist) -> tuple[float, float]:
        """Average gradients over ranks, clip each model's global norm, step both optimizers.

        Returns:
            The student's and the composer's gradient norms before clipping (0 without one).
        """
        dist.average_gradients(self.student_params)
        dist.average_gradients(self.composer_params)
        gnorm_s = dist.clip_grad_norm_(self.student_params, self.grad_clip)
        gnorm_c = (
            dist.clip_grad_norm_(self.composer_params, self.grad_clip)
            if self.composer_params
            else 0.0
        )
        self.student.step()
        if self.composer is not None:
            self.composer.step()
        return gnorm_s, gnorm_c

    def state_dict(self) -> dict[str, Any]:
        return {
            "opt_student": self.student.state_dict(),
            "opt_composer": self.composer.state_dict() if self.composer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.student.load_state_dict(state["opt_student"])
        if self.composer is not None and state.get("opt_composer") is not None:
            self.composer.load_state_dict(state["opt_composer"])


def _param_groups(params: list[nn.Parameter]) -> list[nn.Parameter] | list[dict[str, Any]]:
    """One group, or (FSDP2 with replicated parameters next to sharded ones, as phi's QFormer
    next to its LoRA) one group of each kind: AdamW's fused per-group update cannot mix
    DTensors and plain tensors."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded or len(sharded) == len(params):
        return params
    return [{"params": sharded}, {"params": [p for p in params if not is_sharded(p)]}]


def build_optimizers(
    student: nn.Module, composer_params: list[nn.Parameter], cfg: LOPDConfig
) -> Optimizers:
    """AdamW on the student (``lopd.lr``) and on phi (``lopd.composer_lr``), both with
    ``lopd.weight_decay``; call after FSDP2 sharding (the optimizers hold the shards)."""
    student_params = [p for p in student.parameters() if p.requires_grad]
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
    return Optimizers(student_params, composer_params, opt_student, opt_composer, cfg.grad_clip)
