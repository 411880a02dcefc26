"""Input validation of ``fused_linear_logprob``, each message naming the bad argument.

The scheme of :mod:`lopd_kernels.topk_tail_kl_checks`: :func:`check_inputs` reads only metadata
(shapes, dtypes, devices, Python scalars), so it runs under ``torch.compile`` without graph
breaks. The targets are read by the family's one target check,
:func:`lopd_kernels.topk_tail_kl_checks.check_values` (the reference) and
:func:`~lopd_kernels.topk_tail_kl_checks.check_targets_in_range` (the Python implementations,
inside their custom ops: a device-side assert on CUDA); the C++ one checks in C++.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lopd_kernels._constants import REFERENCE_DTYPES

__all__ = ["check_inputs"]


def _check_positive_int_or_none(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None (auto), got {value!r}")


def check_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    ignore_index: int,
    chunk_size: int | None = None,
) -> None:
    """Validates everything knowable without reading tensor data.

    Args:
        hidden: ``[N, d]`` hidden states; weight: ``[V, d]`` LM head; targets: ``[N]`` int64 /
            int32; bias: optional ``[V]``.
        temperature, ignore_index, chunk_size: as :func:`lopd_kernels.fused_linear_logprob`
            takes them.
    """
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    _check_positive_int_or_none("chunk_size", chunk_size)
    named = {"hidden": hidden, "weight": weight, "targets": targets}
    if bias is not None:
        named["bias"] = bias
    for name, x in named.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}")
        if name != "targets" and x.dtype not in REFERENCE_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, d] = {tuple(hidden.shape)} and weight [V, d] = {tuple(weight.shape)} "
            "disagree on d"
        )
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden and weight must share one dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if targets.dtype not in (torch.int64, torch.int32) or targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"targets must be int64/int32 of shape [N] = [{hidden.shape[0]}], "
            f"got {targets.dtype} {tuple(targets.shape)}"
        )
    if bias is not None:
        if bias.shape != (vocab,):
            raise ValueError(f"bias must have shape [V] = [{vocab}], got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias must have the weight's dtype {weight.dtype}, got {bias.dtype}")
