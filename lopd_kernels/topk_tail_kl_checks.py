"""Input validation of ``topk_tail_kl`` (every backend), each message naming the bad argument.

The scheme of every op's ``<op>_checks.py``: :func:`check_inputs` reads only metadata (shapes,
dtypes, devices, Python scalars), so it runs under ``torch.compile`` without graph breaks;
:func:`check_values` reads tensor data (here the targets; a host sync on a GPU, so each backend
calls it where it can afford one). The compiled kernels repeat the checks they need in C++
(``csrc/common/topk_tail_kl_checks.h``). :func:`check_loss_options` holds the scalar options the
whole top-M + tail family shares; :func:`check_support` the ``support`` option of the two ops that
select their buckets (``topk_tail_kl``, ``fused_linear_topk_tail_kl``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lopd_kernels._constants import DIVERGENCES, REFERENCE_DTYPES, SUPPORTS

__all__ = [
    "check_inputs",
    "check_loss_options",
    "check_rows_have_mass",
    "check_support",
    "check_targets_in_range",
    "check_values",
]


def check_inputs(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    top_m: int | None,
    temperature: float,
    divergence: str,
    ignore_index: int,
    beta: float | None = None,
    support: str = "teacher",
) -> int:
    """Validates everything knowable without reading tensor data; returns the op's ``top_m``.

    Only metadata is inspected (shapes, dtypes, devices, Python scalars), so this runs under
    ``torch.compile`` without graph breaks. Target *values* are checked by each backend.
    """
    for name, x in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in REFERENCE_DTYPES:
            raise TypeError(
                f"{name} must be a floating tensor (float32, bfloat16, float16 or float64), "
                f"got {x.dtype}"
            )
        if x.dim() < 1 or x.shape[-1] < 1:
            raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {tuple(x.shape)}")
    if teacher_logits.shape[-1] != student_logits.shape[-1]:
        raise ValueError(
            f"vocabulary size mismatch: student_logits has V={student_logits.shape[-1]}, "
            f"teacher_logits has V={teacher_logits.shape[-1]}"
        )
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits shape {tuple(teacher_logits.shape)} must equal student_logits shape "
            f"{tuple(student_logits.shape)}"
        )
    if not isinstance(target_ids, Tensor):
        raise TypeError(f"target_ids must be a torch.Tensor, got {type(target_ids).__name__}")
    if target_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target_ids must be int64 (or int32), got {target_ids.dtype}")
    if target_ids.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"target_ids must have shape {tuple(student_logits.shape[:-1])} (the logits' shape "
            f"without the vocabulary dim), got {tuple(target_ids.shape)}"
        )
    if teacher_logits.device != student_logits.device:
        raise ValueError(
            f"teacher_logits is on {teacher_logits.device} but student_logits is on "
            f"{student_logits.device}"
        )
    if target_ids.device != student_logits.device:
        raise ValueError(
            f"target_ids is on {target_ids.device} but student_logits is on {student_logits.device}"
        )
    if top_m is not None and (not isinstance(top_m, int) or isinstance(top_m, bool) or top_m < 1):
        raise ValueError(f"top_m must be None (full vocabulary) or an int >= 1, got {top_m!r}")
    check_loss_options(temperature, divergence, ignore_index, beta=beta)
    check_support(support)
    vocab = student_logits.shape[-1]
    return 0 if top_m is None or top_m >= vocab else top_m


def check_values(
    target_ids: Tensor, vocab: int, ignore_index: int, name: str = "target_ids"
) -> None:
    """Raises if a target is neither ``ignore_index`` nor in ``[0, V)`` (reads the data): the
    one target check of every op of the family, ``name`` being the argument's name."""
    bad = (target_ids != ignore_index) & ((target_ids < 0) | (target_ids >= vocab))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0, 0])
        value = int(target_ids.flatten()[i])
        where = f"{name}[{i}]" + (" (flattened)" if target_ids.dim() > 1 else "")
        raise ValueError(
            f"{where} = {value} is outside [0, V={vocab}) and is not ignore_index ({ignore_index})"
        )


def check_loss_options(
    temperature: float,
    divergence: str,
    ignore_index: int,
    *,
    beta: float | None = None,
    divergences: tuple[str, ...] = DIVERGENCES,
) -> None:
    """The scalar options every top-M + tail op shares: a finite temperature > 0, a divergence
    of ``divergences`` (the op's), ``beta`` only with ``divergence="jsd"`` and then None (0.5)
    or a number in [0, 1], an integer ``ignore_index``."""
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if divergence not in divergences:
        raise ValueError(f"divergence must be one of {divergences}, got {divergence!r}")
    if beta is not None:
        if divergence != "jsd":
            raise ValueError(
                f"beta is the option of divergence='jsd' (TRL's generalized JSD); with "
                f"divergence={divergence!r} leave it None, got beta={beta!r}"
            )
        if (
            not isinstance(beta, (int, float))
            or isinstance(beta, bool)
            or not math.isfinite(beta)
            or not 0.0 <= beta <= 1.0
        ):
            raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")


def check_rows_have_mass(
    lse: Tensor, target_ids: Tensor, ignore_index: int, sides: tuple[str, ...]
) -> None:
    """Raises ``ValueError`` naming the first row (not ``ignore_index``) whose logits are all
    ``-inf`` on one side: a distribution with no mass, whose KL and log-probs are undefined (the
    kernels would give ``inf``, ``0`` or NaN depending on the backend).

    Read from the forward's per-row log-sum-exp (``-inf`` exactly for such a row), not from the
    logits: ``[N]`` values, no second pass over ``[N, V]``. On CUDA tensors, and under
    ``torch.compile``, the check is a device-side assert instead (no host synchronization per
    step, no graph break), like the targets' check there: a ``RuntimeError`` without the row.

    Args:
        lse: ``[N, len(sides)]`` (or ``[N]`` for one side) log-sum-exp of ``logits / T``.
        target_ids: ``[N]`` flattened targets.
        ignore_index: rows with this target are not checked (their outputs are 0).
        sides: the argument each column of ``lse`` belongs to, e.g. ``("student_logits",
            "teacher_logits")``.
    """
    lse = lse if lse.dim() == 2 else lse.unsqueeze(1)
    bad = (lse == -math.inf) & (target_ids != ignore_index).unsqueeze(1)
    if lse.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(
            ~bad.any(), "a row whose logits are all -inf (no probability mass) is not ignored"
        )
        return
    if bad.any():
        row, side = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"row {row} (flattened) of {sides[side]} is all -inf (no probability mass): its KL "
            "and log-probs are undefined; give the row target ignore_index, or finite logits"
        )


def check_targets_in_range(
    target_ids: Tensor, vocab: int, ignore_index: int, name: str = "target_ids"
) -> None:
    """:func:`check_values` where a host read is free (CPU tensors, eager: ``ValueError``), else a
    device-side assert (CUDA tensors: no host synchronization per step). Called before every
    compiled kernel: the CUDA kernels index the logits with the targets unchecked. Under
    ``torch.compile`` on CPU tensors nothing is added to the graph: the C++ and Triton ops check
    their targets inside (``ValueError``)."""
    if target_ids.is_cuda:
        bad = (target_ids != ignore_index) & ((target_ids < 0) | (target_ids >= vocab))
        torch._assert_async(~bad.any(), f"{name} outside [0, V) that are not ignore_index")
    elif not torch.compiler.is_compiling():
        check_values(target_ids, vocab, ignore_index, name)


def check_support(support: str) -> None:
    """``support`` is one of :data:`lopd_kernels.SUPPORTS` (whose top-M gets the buckets)."""
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")
