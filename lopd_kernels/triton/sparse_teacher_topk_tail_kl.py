"""Triton launchers of ``sparse_teacher_topk_tail_kl`` (the GPU implementation).

``lopd_kernels/sparse_teacher_topk_tail_kl.py`` registers :func:`sparse_teacher_fwd_triton` /
:func:`sparse_teacher_bwd_triton` as ``torch.ops.lopd.sparse_teacher_topk_tail_kl_triton_fwd``
/ ``..._bwd`` (the contract of the C++ CPU ops; conventions in that module's docstring). The
kernels, one program per row, and their design are
``lopd_kernels/triton/sparse_teacher_topk_tail_kl_kernels.py``.

Limits: ``1 <= M <= 256``; ``V < 2**31``. Ids and targets are not validated here (the public
API does): a real slot's id outside ``[0, V)`` is masked out of every load, never read.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from lopd_kernels._constants import KERNEL_DTYPES, TRITON_SPARSE_TEACHER_MAX_TOP_M
from lopd_kernels.triton.sparse_teacher_topk_tail_kl_kernels import _bwd_kernel, _fwd_kernel

__all__ = ["sparse_teacher_bwd_triton", "sparse_teacher_fwd_triton"]

# Block of the vocabulary per loop step and the cap on the [BLOCK_V, MP] id-equality tile, from
# ptxas register counts for sm_90a at 8 warps, M = 20 (MP = 32), bf16 (register counts, not GPU
# timings: no GPU figure of this op exists yet). Forward, 16K entries (blocks of 512): 38
# registers. The backward also holds the tile's coefficients: 8K entries (blocks of 256) take 80
# registers, 16K took 172. No spills. M = 256: forward (blocks of 64) 48, backward 119 at blocks
# of 64.
_BLOCK_V = 1024
_FWD_TILE = 16384
_BWD_TILE = 8192
_WARPS = 8


def _check(student_logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> None:
    s = student_logits
    if s.dim() != 2 or s.shape[1] < 1:
        raise ValueError(f"student_logits must be 2-D [N, V] with V >= 1, got {tuple(s.shape)}")
    if s.dtype not in KERNEL_DTYPES:
        raise TypeError(f"student_logits must be float32, float16 or bfloat16, got {s.dtype}")
    if s.shape[1] >= 2**31 - 1:
        raise ValueError(f"student_logits: vocabulary size {s.shape[1]} must be below 2**31 - 1")
    if ids.dim() != 2 or ids.shape[0] != s.shape[0] or ids.dtype != torch.int64:
        raise ValueError(
            f"teacher_topk_ids must be int64 [{s.shape[0]}, M], got {ids.dtype} {tuple(ids.shape)}"
        )
    if not 1 <= ids.shape[1] <= TRITON_SPARSE_TEACHER_MAX_TOP_M:
        raise ValueError(
            f"teacher_topk_ids: the triton backend needs 1 <= M <= "
            f"{TRITON_SPARSE_TEACHER_MAX_TOP_M}, got M={ids.shape[1]}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or not (
        temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    dev = s.device
    if not (
        dev.type == "cuda" or (dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    ):
        raise RuntimeError(
            f"sparse_teacher_topk_tail_kl triton backend: tensors are on {dev}; Triton kernels "
            "need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before triton is "
            "imported)"
        )


def _launch_sizes(m: int, v: int, block_v: int | None, tile: int) -> tuple[int, int]:
    mp = max(2, triton.next_power_of_2(m))
    block = block_v or _BLOCK_V
    if block & (block - 1):
        raise ValueError(f"block_v must be a power of two, got {block}")
    block = max(16, min(block, tile // mp, triton.next_power_of_2(v)))
    return mp, block


def sparse_teacher_fwd_triton(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    tail_floor: float,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward (the ``lopd::sparse_teacher_topk_tail_kl_cpu_fwd`` contract).

    Args:
        student_logits: [N, V] float32 / float16 / bfloat16.
        teacher_topk_logprobs: [N, M] (used in float32; ``-inf``: padding slot).
        teacher_topk_ids: [N, M] int64.
        target_ids: [N] int64, or ``ignore_index``.
        temperature, reverse, ignore_index, tail_floor: as in the public op.
        block_v, num_warps: launch tuning (block_v a power of two).

    Returns:
        ``(kl [N], student_logprob [N], lse [N], bucket_logp [N, 2, M + 1])``, float32.
    """
    _check(student_logits, teacher_topk_ids, temperature)
    s = student_logits if student_logits.stride(1) == 1 else student_logits.contiguous()
    n, v = s.shape
    m = teacher_topk_ids.shape[1]
    lp = teacher_topk_logprobs.to(torch.float32).contiguous()
    ids = teacher_topk_ids.contiguous()
    tgt = target_ids.to(torch.int64).contiguous()
    if lp.shape != (n, m) or tgt.shape != (n,):
        raise ValueError(
            f"teacher_topk_logprobs must be [{n}, {m}] and target_ids [{n}], got "
            f"{tuple(lp.shape)} and {tuple(tgt.shape)}"
        )
    dev = s.device
    kl = torch.empty(n, dtype=torch.float32, device=dev)
    slp = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    blp = torch.empty(n, 2, m + 1, dtype=torch.float32, device=dev)
    if n == 0:
        return kl, slp, lse, blp
    mp, block = _launch_sizes(m, v, block_v, _FWD_TILE)
    _fwd_kernel[(n,)](
        s, lp, ids, tgt, kl, slp, lse, blp, v, s.stride(0), 1.0 / float(temperature),
        int(ignore_index), float(tail_floor),
        M=m, MP=mp, BLOCK_V=block, REVERSE=bool(reverse), num_warps=num_warps or _WARPS,
    )  # fmt: skip
    return kl, slp, lse, blp


def sparse_teacher_bwd_triton(
    grad_kl: torch.Tensor,
    grad_student_logprob: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    target_ids: torch.Tensor,
    kl: torch.Tensor,
    lse: torch.Tensor,
    bucket_logp: torch.Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Backward (the ``lopd::sparse_teacher_topk_tail_kl_cpu_bwd`` contract): ``[N, V]``
    gradient of ``grad_kl . kl + grad_student_logprob . student_logprob`` in the student's
    dtype."""
    _check(student_logits, teacher_topk_ids, temperature)
    s = student_logits if student_logits.stride(1) == 1 else student_logits.contiguous()
    n, v = s.shape
    m = teacher_topk_ids.shape[1]
    shapes = {
        "grad_kl": (grad_kl, (n,)),
        "grad_student_logprob": (grad_student_logprob, (n,)),
        "kl": (kl, (n,)),
        "lse": (lse, (n,)),
        "bucket_logp": (bucket_logp, (n, 2, m + 1)),
        "target_ids": (target_ids, (n,)),
    }
    for name, (x, shape) in shapes.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    f32 = [x.to(torch.float32).contiguous() for x in (grad_kl, grad_student_logprob, kl, lse)]
    blp = bucket_logp.to(torch.float32).contiguous()
    grad = torch.empty((n, v), dtype=s.dtype, device=s.device)
    if n == 0:
        return grad
    mp, block = _launch_sizes(m, v, block_v, _BWD_TILE)
    _bwd_kernel[(n,)](
        f32[0], f32[1], s, teacher_topk_ids.contiguous(), target_ids.to(torch.int64).contiguous(),
        f32[2], f32[3], blp, grad, v, s.stride(0), grad.stride(0), 1.0 / float(temperature),
        int(ignore_index),
        M=m, MP=mp, BLOCK_V=block, REVERSE=bool(reverse), num_warps=num_warps or _WARPS,
    )  # fmt: skip
    return grad
