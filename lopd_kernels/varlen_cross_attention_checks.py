"""Input validation of ``varlen_cross_attention``, each message naming the bad argument.

The scheme of :mod:`lopd_kernels.topk_tail_kl_checks`: :func:`check_inputs` reads only metadata
(shapes, dtypes, devices, Python scalars); :func:`check_values` reads the item boundaries
``cu_seqlens_k``, on CPU tensors only: on a GPU that would be a device sync per call, so the
boundaries of CUDA tensors are taken as given (as flash-attn's varlen API takes them; the CUDA
launcher, ``csrc/cuda/varlen_cross_attention_launch.cuh``, checks the shapes and grid limits).
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_inputs", "check_values"]


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int | None,
    scale: float | None,
) -> None:
    """Validates everything knowable without reading tensor data."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Lq, Hq, D], got shape {tuple(q.shape)}")
    if k.dim() != 3:
        raise ValueError(f"k must be packed [total_k, Hkv, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[2] != q.shape[3]:
        raise ValueError(f"k head dim {k.shape[2]} must equal q head dim {q.shape[3]}")
    if k.shape[1] == 0 or q.shape[2] % k.shape[1] != 0:
        raise ValueError(
            f"q heads ({q.shape[2]}) must be a positive multiple of k/v heads ({k.shape[1]})"
        )
    if not q.is_floating_point():
        raise TypeError(f"q must be floating point, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_k.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_k must be int32, got {cu_seqlens_k.dtype}")
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() != q.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_k must be [B+1] = [{q.shape[0] + 1}], got {tuple(cu_seqlens_k.shape)}"
        )
    for name, t in (("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    if max_seqlen_k is not None and max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be >= 0, got {max_seqlen_k}")


def check_values(
    k: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int | None, batch: int
) -> None:
    """Raises ValueError unless ``cu_seqlens_k`` starts at 0, does not decrease and ends at
    ``total_k``, and ``max_seqlen_k`` (if given) covers the longest item. Reads the boundaries
    of CPU tensors only: free there, a device sync on a GPU (skipped)."""
    if cu_seqlens_k.device.type == "cpu":
        cu = cu_seqlens_k.long()
        if cu[0] != 0 or cu[-1] != k.shape[0] or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                "cu_seqlens_k must start at 0, be non-decreasing and end at total_k = "
                f"{k.shape[0]}; got {cu_seqlens_k.tolist()}"
            )
        if max_seqlen_k is not None and batch > 0:
            longest = int((cu[1:] - cu[:-1]).max())
            if max_seqlen_k < longest:
                raise ValueError(f"max_seqlen_k={max_seqlen_k} is below the longest item {longest}")
