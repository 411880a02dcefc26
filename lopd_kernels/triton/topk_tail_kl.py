"""Launchers of the Triton ``topk_tail_kl`` kernels: argument checks, grids, launch defaults.

The kernels and their design are ``lopd_kernels/triton/topk_tail_kl_kernels.py``; the maths is
``docs/math.md``. ``lopd_kernels/topk_tail_kl.py`` registers :func:`topk_tail_kl_fwd_triton` /
:func:`topk_tail_kl_bwd_triton` as ``torch.ops.lopd.topk_tail_kl_triton_fwd`` / ``..._bwd`` and
wires autograd.

Options: ``divergence`` ``"reverse"`` / ``"forward"`` / ``"jsd"`` with ``beta`` (at 0 / 1 the
forward / reverse KL, as the C++ ops parse it), ``support`` ``"teacher"`` / ``"student"`` /
``"union"`` (``topk_ids`` ``[N, 2M]`` with -1 padding); what each costs is in the kernels'
docstring.

Limits: ``1 <= top_m <= min(V, 256)`` or ``top_m == 0`` (the limit is on M: a union has 2M
slots); ``V < 2**30``.
Out-of-range targets (neither in ``[0, V)`` nor ``ignore_index``) are not validated here (that
would sync the device; the public API validates): their log-probs come out NaN, loudly.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from lopd_kernels._constants import KERNEL_DTYPES, TRITON_TOPK_MAX_TOP_M
from lopd_kernels.kernel_variants import SLOTS, selected
from lopd_kernels.triton._common import LOG2E
from lopd_kernels.triton.topk_tail_kl_device import (
    DIV_FORWARD,
    DIV_JSD,
    DIV_REVERSE,
    SUPPORT_STUDENT,
    SUPPORT_TEACHER,
    SUPPORT_UNION,
)
from lopd_kernels.triton.topk_tail_kl_kernels import _fwd_full_kernel, _fwd_topm_kernel
from lopd_kernels.triton.topk_tail_kl_kernels_bwd import _bwd_kernel
from lopd_kernels.triton.topk_tail_kl_kernels_joined import _fwd_topm_joined_kernel

__all__ = ["topk_tail_kl_bwd_triton", "topk_tail_kl_fwd_triton"]

# Launch defaults for a GPU (H100/H200 class), chosen from ptxas register counts for sm_90 with
# the 16-divisible pointers/strides/V Triton specializes on (128-bit loads); not yet timed on a
# GPU. Top-M forward, 2048 x 8 warps: 74 registers (M <= 64), three programs per SM, each with
# its next block in flight. Full-vocabulary forward, 4096 x 8: 80. Backward, 2048 x 8: 58.
# Tests pass small blocks to the interpreter.
_FWD_BLOCK_V = 2048
_FULL_BLOCK_V = 4096
_FWD_WARPS = 8
# Sequential inserts cost one block reduction each; a bitonic merge of a block costs about a
# dozen, but its network triples the registers (232 vs 73 at M = 64: one program per SM instead
# of three) and takes 20-30 s to compile. The first block takes M + 1 inserts, block k about
# M / k more: the merge pays off for large M only.
_FWD_BULK_TOP_M = 64
_FWD_BULK_MIN = 12
_BWD_BLOCK_V = 2048
_BWD_WARPS = 8
#: The kernel slot of the top-M forward (lopd_kernels/kernel_variants.py).
FWD_SLOT = "topk_tail_kl.triton_forward"
# The joined-reductions top-M forward left alone takes 95 registers (two programs per SM);
# capped at 80 (the separate-reductions kernel's 74 allocate as 80 too: registers go per warp in
# units of 256) it keeps three programs per SM with no spill and one more instruction per block
# (tools/kernel_report.py).
_FWD_JOINED_MAXNREG = 80


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check_runnable(device: torch.device) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise RuntimeError(
        f"topk_tail_kl triton backend: tensors are on {device}; Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1 set before triton is imported)"
    )


def _check_logits(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must be [N, V] or [B, L, V], got shape {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    # Rows may be strided (a slice of a padded buffer, logits[:, :-1]): the kernels take the
    # strides. Only the vocabulary axis must be dense.
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _rows(x: torch.Tensor) -> int:
    """Number of rows N of ``[N, V]`` or ``[B, L, V]`` logits (``B * L``)."""
    return x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1]


def _row_layout(x: torch.Tensor) -> tuple[int, int, int]:
    """``(L, item stride, row stride)``: row ``r`` of ``x`` starts at
    ``(r // L) * item_stride + (r % L) * row_stride`` (``[N, V]``: one item of ``N`` rows)."""
    if x.dim() == 2:
        return max(x.shape[0], 1), 0, x.stride(0)
    return max(x.shape[1], 1), x.stride(0), x.stride(1)


def _check_rows(name: str, x: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """A per-row [N] float32 vector (upstream gradient or saved kl), made contiguous."""
    if x.shape != (n,):
        raise ValueError(f"{name} must be a tensor of shape ({n},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, student_logits on {device}")
    return x.to(torch.float32).contiguous()


def _check_common(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = _check_logits("student_logits", student_logits)
    t = _check_logits("teacher_logits", teacher_logits)
    if s.shape != t.shape:
        raise ValueError(
            f"student_logits {tuple(s.shape)} and teacher_logits {tuple(t.shape)} must have the "
            "same shape [N, V] or [B, L, V]"
        )
    if s.device != t.device:
        raise ValueError(f"student_logits is on {s.device}, teacher_logits on {t.device}")
    if target_ids.shape != (_rows(s),):
        raise ValueError(f"target_ids must have shape ({_rows(s)},), got {tuple(target_ids.shape)}")
    if target_ids.dtype != torch.int64:
        raise TypeError(f"target_ids must be int64, got {target_ids.dtype}")
    if target_ids.device != s.device:
        raise ValueError(f"target_ids is on {target_ids.device}, student_logits on {s.device}")
    if s.shape[-1] < 1:
        raise ValueError("student_logits must have a vocabulary size V >= 1")
    if s.shape[-1] >= 2**30:
        # Keys hold int32 indices, and block offsets (int32) run up to V + 2 * BLOCK_V.
        raise ValueError(f"student_logits: vocabulary size {s.shape[-1]} must be below 2**30")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or not (
        temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    _check_runnable(s.device)
    return s, t, target_ids.contiguous()


_SUPPORTS = {"teacher": SUPPORT_TEACHER, "student": SUPPORT_STUDENT, "union": SUPPORT_UNION}


def divergence_args(divergence: str, beta: float) -> tuple[int, tuple[float, float, float]]:
    """The kernels' ``DIV`` code and runtime ``(beta, log(1 - beta), log(beta))`` of an op's
    ``divergence`` / ``beta``: ``"jsd"`` at ``beta`` 0 / 1 is the forward / reverse KL (as
    ``checks::parse_divergence`` of the C++ ops has it); the KLs ignore ``beta``."""
    if divergence == "reverse":
        return DIV_REVERSE, (1.0, 0.0, 0.0)
    if divergence == "forward":
        return DIV_FORWARD, (0.0, 0.0, 0.0)
    if divergence != "jsd":
        raise ValueError(f"divergence must be 'reverse', 'forward' or 'jsd', got {divergence!r}")
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1] for divergence='jsd', got {beta!r}")
    if beta == 0.0:
        return DIV_FORWARD, (0.0, 0.0, 0.0)
    if beta == 1.0:
        return DIV_REVERSE, (1.0, 0.0, 0.0)
    beta = float(beta)
    return DIV_JSD, (beta, math.log1p(-beta), math.log(beta))


def support_code(support: str) -> int:
    """The kernels' ``SUPPORT`` code of an op's ``support``."""
    if support not in _SUPPORTS:
        raise ValueError(f"support must be 'teacher', 'student' or 'union', got {support!r}")
    return _SUPPORTS[support]


def _register_width(top_m: int) -> int:
    """Power-of-two register width of the running top-M (>= 2: Triton's sort wants >= 2)."""
    return max(2, triton.next_power_of_2(top_m))


def _block_size(block_v: int, v: int, minimum: int) -> int:
    """The vocabulary block: ``block_v`` (a power of two), no larger than needed for ``v``, and
    at least ``minimum`` (the forward's bitonic merge takes the block's top-MP)."""
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    return max(minimum, min(block_v, triton.next_power_of_2(v)))


def topk_tail_kl_fwd_triton(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target_ids: torch.Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    bulk_min: int | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of ``topk_tail_kl`` in Triton (the ``lopd::topk_tail_kl_cpu_fwd`` contract).

    Args:
        student_logits: [N, V] or [B, L, V] float32 / float16 / bfloat16, unit stride along V,
            any other strides (read in place: ``logits[:, :-1]`` is not copied).
        teacher_logits: the same shape and device; its dtype may differ from the student's.
        target_ids: [N] int64 sampled token ids, or ``ignore_index``.
        top_m: M in ``[1, min(V, 256)]``, or 0 for the full-vocabulary KL (no tail bucket).
        temperature: T > 0; logits are divided by T before everything.
        divergence, beta: ``"reverse"`` KL(student || teacher), ``"forward"`` KL(teacher ||
            student), or ``"jsd"``: TRL's generalized JSD with ``0 < beta < 1`` (0 / 1: the
            forward / reverse KL).
        support: ``"teacher"``, ``"student"`` or ``"union"``: whose top-M ids are buckets
            (ignored with ``top_m == 0``).
        ignore_index: rows with this target produce all-zero outputs.
        block_v: vocabulary block per loop step (power of two; raised to at least the
            power of two above ``top_m``; default tuned for GPUs).
        num_warps: warps per program (default tuned for GPUs).
        bulk_min: a block with more top-M candidates than this is merged into the running
            top-M with one bitonic merge, one with fewer by sequential inserts; negative: always
            inserts (the merge is not compiled). Default: 12 when ``top_m > 64``, else -1.
        kernel: the top-M kernel, ``"separate_reductions"`` or ``"joined_reductions"`` (slot
            :data:`FWD_SLOT` of :mod:`lopd_kernels.kernel_variants`; default: the process
            setting). ``joined_reductions`` has no bitonic merge: with ``bulk_min >= 0``
            ``separate_reductions`` runs.

    Returns:
        ``(kl [N], student_logprob [N], teacher_logprob [N], topk_ids [N, K] int64,
        lse [N, 2], bucket_logp [N, 2, K + 1])``, all float32 except ``topk_ids``; ``K = M``,
        or ``2M`` for the union. ``topk_ids`` is ordered by descending teacher (student) logit
        for the teacher's (student's) support, ties: lower id first; the union's are the
        teacher's top-M, then the student's other top-M ids, then -1.
        ``bucket_logp[:, :, :K]`` follows that order (-inf on both sides at a -1 slot);
        ``bucket_logp[:, :, K]`` is the tail.
        With ``top_m == 0``, ``topk_ids`` is [N, 0] and ``bucket_logp`` [N, 2, 1] holds 0, 0:
        the single bucket is the whole vocabulary, of mass 1 on both sides.
    """
    s, t, tgt = _check_common(student_logits, teacher_logits, target_ids, temperature)
    n, v = _rows(s), s.shape[-1]
    if not isinstance(top_m, int) or isinstance(top_m, bool) or top_m < 0:
        raise ValueError(f"top_m must be an int >= 0 (0: full vocabulary), got {top_m!r}")
    if top_m > min(v, TRITON_TOPK_MAX_TOP_M):
        raise ValueError(
            f"top_m={top_m} is not supported by the triton backend: it needs top_m <= V "
            f"(V={v}) and top_m <= {TRITON_TOPK_MAX_TOP_M}; use top_m=0 for the full vocabulary"
        )
    default_block = _FWD_BLOCK_V if top_m else _FULL_BLOCK_V
    block_v = _block_size(block_v or default_block, v, _register_width(top_m))
    if bulk_min is None:
        bulk_min = _FWD_BULK_MIN if top_m > _FWD_BULK_TOP_M else -1
    if kernel is None:
        kernel = selected(FWD_SLOT)
    elif kernel not in SLOTS[FWD_SLOT].choices:
        raise ValueError(f"kernel must be one of {SLOTS[FWD_SLOT].choices}, got {kernel!r}")
    warps = num_warps or _FWD_WARPS
    div, jsd = divergence_args(divergence, beta)
    sup = support_code(support)
    k = 2 * top_m if sup == SUPPORT_UNION else top_m

    dev = s.device
    kl = torch.empty(n, dtype=torch.float32, device=dev)
    slp = torch.empty(n, dtype=torch.float32, device=dev)
    tlp = torch.empty(n, dtype=torch.float32, device=dev)
    ids = torch.empty(n, k, dtype=torch.int64, device=dev)
    lse = torch.empty(n, 2, dtype=torch.float32, device=dev)
    blp = torch.empty(n, 2, k + 1, dtype=torch.float32, device=dev)
    if n == 0:
        return kl, slp, tlp, ids, lse, blp

    scale2 = LOG2E / float(temperature)
    rows_per_item, s_item, s_row = _row_layout(s)
    _, t_item, t_row = _row_layout(t)
    common = (v, rows_per_item, s_item, s_row, t_item, t_row, scale2, int(ignore_index), *jsd)
    if top_m == 0:
        _fwd_full_kernel[(n,)](
            s, t, tgt, kl, slp, tlp, lse, blp, *common,
            BLOCK_V=block_v, DIV=div, num_warps=warps,
        )  # fmt: skip
    elif kernel == "joined_reductions" and bulk_min < 0:
        _fwd_topm_joined_kernel[(n,)](
            s, t, tgt, kl, slp, tlp, ids, lse, blp, *common,
            M=top_m, MP=_register_width(top_m), K=k, BLOCK_V=block_v, DIV=div, SUPPORT=sup,
            num_warps=warps, maxnreg=_FWD_JOINED_MAXNREG,
        )  # fmt: skip
    else:
        _fwd_topm_kernel[(n,)](
            s, t, tgt, kl, slp, tlp, ids, lse, blp, *common,
            M=top_m, MP=_register_width(top_m), K=k, BLOCK_V=block_v, DIV=div, SUPPORT=sup,
            BULK=bulk_min >= 0, BULK_MIN=max(bulk_min, 0), num_warps=warps,
        )  # fmt: skip
    return kl, slp, tlp, ids, lse, blp


def topk_tail_kl_bwd_triton(
    grad_kl: torch.Tensor,
    grad_student_logprob: torch.Tensor,
    grad_teacher_logprob: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    kl: torch.Tensor,
    lse: torch.Tensor,
    bucket_logp: torch.Tensor,
    temperature: float,
    divergence: str,
    beta: float,
    ignore_index: int,
    student_requires_grad: bool,
    teacher_requires_grad: bool,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``topk_tail_kl`` in Triton (the ``lopd::topk_tail_kl_cpu_bwd`` contract).

    Args:
        grad_kl, grad_student_logprob, grad_teacher_logprob: [N] upstream gradients (any float
            dtype, used in float32); the teacher one already includes the privilege's.
        student_logits, teacher_logits, target_ids: the forward inputs.
        topk_ids, kl, lse, bucket_logp: the forward outputs ([N, K], [N], [N, 2], [N, 2, K+1]);
            the support is read from ``topk_ids`` (-1 slots: a union's padding, skipped).
        temperature, divergence, beta, ignore_index: as in the forward.
        student_requires_grad, teacher_requires_grad: which gradients to compute.
        block_v, num_warps: launch tuning, as in the forward.

    Returns:
        ``(grad_student, grad_teacher)``: dense, in each logits' shape ([N, V] or [B, L, V])
        and dtype, or an empty float32 [0] tensor for a side that does not require grad.
    """
    s, t, tgt = _check_common(student_logits, teacher_logits, target_ids, temperature)
    n, v = _rows(s), s.shape[-1]
    dev = s.device
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.dtype != torch.int64:
        raise ValueError(
            f"topk_ids must be int64 [{n}, M], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    k = topk_ids.shape[1]
    if k > 2 * min(v, TRITON_TOPK_MAX_TOP_M):
        raise ValueError(
            f"topk_ids has K={k} columns; the triton backend needs K <= "
            f"2 * min(V, {TRITON_TOPK_MAX_TOP_M}) "
            "(M, or 2M for a union)"
        )
    if bucket_logp.shape != (n, 2, k + 1):
        raise ValueError(
            f"bucket_logp must have shape ({n}, 2, {k + 1}), got {tuple(bucket_logp.shape)}"
        )
    div, jsd = divergence_args(divergence, beta)
    if lse.shape != (n, 2):
        raise ValueError(f"lse must have shape ({n}, 2), got {tuple(lse.shape)}")
    gkl = _check_rows("grad_kl", grad_kl, n, dev)
    gsl = _check_rows("grad_student_logprob", grad_student_logprob, n, dev)
    gtl = _check_rows("grad_teacher_logprob", grad_teacher_logprob, n, dev)
    kl = _check_rows("kl", kl, n, dev)
    lse = lse.to(torch.float32).contiguous()
    blp = bucket_logp.to(torch.float32).contiguous()
    ids = topk_ids.contiguous()

    # A side without gradient gets its own empty float32 [0] tensor (the op's fake does the
    # same; outputs of a custom op must not alias each other).
    f32 = torch.float32
    # Gradients come out dense, in the logits' shape ([N, V] or [B, L, V]): row r at r * V.
    gs = torch.empty(s.shape, dtype=s.dtype, device=dev) if student_requires_grad else None
    gt = torch.empty(t.shape, dtype=t.dtype, device=dev) if teacher_requires_grad else None
    gs = gs if gs is not None else torch.empty(0, dtype=f32, device=dev)
    gt = gt if gt is not None else torch.empty(0, dtype=f32, device=dev)
    if n == 0 or not (student_requires_grad or teacher_requires_grad):
        return gs, gt

    block_v = _block_size(block_v or _BWD_BLOCK_V, v, 16)
    # A side without gradient still needs a pointer of some float dtype: reuse the other.
    gs_arg = gs if student_requires_grad else gt
    gt_arg = gt if teacher_requires_grad else gs
    rows_per_item, s_item, s_row = _row_layout(s)
    _, t_item, t_row = _row_layout(t)
    _bwd_kernel[(n,)](
        gkl, gsl, gtl, s, t, tgt, ids, kl, lse, blp, gs_arg, gt_arg,
        v, rows_per_item, s_item, s_row, t_item, t_row, v, v,
        LOG2E / float(temperature), 1.0 / float(temperature), int(ignore_index), *jsd,
        K=k, KP=_register_width(k), BLOCK_V=block_v, DIV=div,
        FULL=k == 0, GRAD_S=bool(student_requires_grad),
        GRAD_T=bool(teacher_requires_grad), num_warps=num_warps or _BWD_WARPS,
    )  # fmt: skip
    return gs, gt
