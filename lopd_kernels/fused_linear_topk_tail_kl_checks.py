"""Input validation of ``fused_linear_topk_tail_kl``, each message naming the bad argument.

The scheme of :mod:`lopd_kernels.topk_tail_kl_checks`: :func:`check_inputs` reads only metadata
(shapes, dtypes, devices, Python scalars; the scalar options the top-M + tail family shares are
:func:`lopd_kernels.topk_tail_kl_checks.check_loss_options`). The targets are read by the
family's one target check, :func:`lopd_kernels.topk_tail_kl_checks.check_targets_in_range`
(a device-side assert on CUDA, no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_kernels._constants import REFERENCE_DTYPES
from lopd_kernels.topk_tail_kl_checks import check_loss_options, check_support

__all__ = ["check_inputs", "check_row_weights"]


def check_inputs(
    hs: Tensor,
    ws: Tensor,
    ht: Tensor,
    wt: Tensor,
    target: Tensor,
    bs: Tensor | None,
    bt: Tensor | None,
    top_m: int | None,
    temperature: float,
    divergence: str,
    ignore_index: int,
    chunk_size: int | None,
    beta: float | None = None,
    support: str = "teacher",
) -> int:
    """Validates everything knowable without reading tensor data; returns ``top_m`` as an int
    (0: the full vocabulary).

    Args:
        hs, ws, ht, wt: student / teacher hidden states ``[N, d]`` and LM heads ``[V, d]``.
        target: ``[N]`` target ids; bs, bt: optional ``[V]`` biases.
        top_m, temperature, divergence, ignore_index, chunk_size, beta, support: as
            :func:`lopd_kernels.fused_linear_topk_tail_kl` takes them.
    """
    if top_m is None:
        top_m = 0
    elif isinstance(top_m, bool) or not isinstance(top_m, int) or top_m < 1:
        raise ValueError(f"top_m must be a positive int or None (full vocabulary), got {top_m!r}")
    check_loss_options(temperature, divergence, ignore_index, beta=beta)
    check_support(support)
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None (auto), got {chunk_size!r}")
    named = {"student_hidden": hs, "student_weight": ws, "teacher_hidden": ht}
    named |= {"teacher_weight": wt, "target_ids": target}
    named |= {k: v for k, v in (("student_bias", bs), ("teacher_bias", bt)) if v is not None}
    for name, x in named.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != hs.device:
            raise ValueError(f"{name} is on {x.device} but student_hidden is on {hs.device}")
        if name != "target_ids" and x.dtype not in REFERENCE_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    for name, x in (("student_hidden", hs), ("student_weight", ws)):
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    for name, x in (("teacher_hidden", ht), ("teacher_weight", wt)):
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    vocab = ws.shape[0]
    if hs.shape[1] != ws.shape[1]:
        raise ValueError(
            f"student_hidden [N, d] = {tuple(hs.shape)} and student_weight [V, d] = "
            f"{tuple(ws.shape)} disagree on d"
        )
    if ht.shape[1] != wt.shape[1]:
        raise ValueError(
            f"teacher_hidden [N, d] = {tuple(ht.shape)} and teacher_weight [V, d] = "
            f"{tuple(wt.shape)} disagree on d"
        )
    if wt.shape[0] != vocab:
        raise ValueError(f"teacher_weight has {wt.shape[0]} vocabulary rows, student {vocab}")
    if vocab == 0:
        raise ValueError("student_weight has an empty vocabulary (V = 0)")
    if ht.shape[0] != hs.shape[0]:
        raise ValueError(f"teacher_hidden has {ht.shape[0]} rows, student_hidden {hs.shape[0]}")
    if hs.dtype != ws.dtype or ht.dtype != wt.dtype:
        raise TypeError(
            "each hidden state must share its weight's dtype, got "
            f"student {hs.dtype}/{ws.dtype}, teacher {ht.dtype}/{wt.dtype}"
        )
    if target.dtype not in (torch.int64, torch.int32):  # a dtype: TypeError, as every op
        raise TypeError(f"target_ids must be int64 (or int32), got {target.dtype}")
    if target.shape != (hs.shape[0],):
        raise ValueError(
            f"target_ids must have shape [N] = [{hs.shape[0]}], got {tuple(target.shape)}"
        )
    for name, b, w in (("student_bias", bs, ws), ("teacher_bias", bt, wt)):
        if b is not None and b.shape != (vocab,):
            raise ValueError(f"{name} must have shape [V] = [{vocab}], got {tuple(b.shape)}")
        if b is not None and b.dtype != w.dtype:
            raise TypeError(f"{name} must have its weight's dtype {w.dtype}, got {b.dtype}")
    return top_m


def check_row_weights(weights: dict[str, Tensor | float | None], n: int, device) -> None:
    """The row weights of ``fused_linear_topk_tail_kl_loss``: each ``None`` (where allowed), a
    real number, or a real tensor of shape ``[]`` or ``[N]`` on the inputs' device that needs no
    gradient (the loss's gradients are formed in its forward, with the weights as constants)."""
    for name, w in weights.items():
        if w is None:
            if name != "kl_weight":
                raise TypeError(f"{name} must be a number or a tensor, got None")
            continue
        if isinstance(w, bool) or not isinstance(w, (int, float, Tensor)):
            raise TypeError(f"{name} must be a number or a tensor, got {type(w).__name__}")
        if not isinstance(w, Tensor):
            continue
        if w.is_complex() or w.dtype == torch.bool:
            raise TypeError(f"{name} must be a real tensor, got {w.dtype}")
        if w.shape not in ((), (n,)):
            raise ValueError(f"{name} must have shape [] or [N] = [{n}], got {tuple(w.shape)}")
        if w.device != device:
            raise ValueError(f"{name} is on {w.device} but student_hidden is on {device}")
        if w.requires_grad:
            raise ValueError(
                f"{name} requires grad, but the loss's gradients are formed in its forward with "
                "the weights as constants: pass weight.detach()"
            )
