"""What the loss modules share (``TopKTailKL``, ``SparseTeacherTopKTailKL``,
``FusedLinearTopKTailKL``): the checks of their options and the reduction of the per-token KL."""

from __future__ import annotations

from torch import Tensor

from lopd_kernels._backend import check_backend
from lopd_kernels._constants import DIVERGENCES, REDUCTIONS, SUPPORTS

__all__ = ["check_module_options", "reduce_kl"]


def check_module_options(
    reduction: str,
    divergence: str,
    backend: str,
    *,
    divergences: tuple[str, ...] = DIVERGENCES,
    support: str = "teacher",
) -> None:
    """Raises ValueError for an unknown ``reduction``, ``divergence`` (of the op's
    ``divergences``), ``support`` or ``backend`` (at construction, before any input is seen)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if divergence not in divergences:
        raise ValueError(f"divergence must be one of {divergences}, got {divergence!r}")
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")
    check_backend(backend)


def reduce_kl(kl: Tensor, target_ids: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """``kl`` (``[...]``, 0 at ignored tokens) as is (``"none"``), summed, or averaged over the
    tokens whose target is not ``ignore_index`` (``"mean"``; 0, never NaN, when all are)."""
    if reduction == "none":
        return kl
    if reduction == "sum":
        return kl.sum()
    return kl.sum() / (target_ids != ignore_index).sum().clamp(min=1)
