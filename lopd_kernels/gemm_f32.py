"""GEMMs into float32 from half-precision or float32 operands, without a float32 copy of a weight.

The chunked fused-linear path (:mod:`lopd_kernels.fused_linear_topk_tail_kl_chunked`) forms its
logit blocks ``h @ W^T`` and its gradients ``ds @ W``, ``dW += ds^T h`` in float32 whatever the
head's dtype. On a GPU whose cuBLAS writes float32 from bf16 / fp16 operands
(``mm(..., out_dtype=float32)``, :func:`half_gemm`) the operands stay in their half dtype (tensor
cores); elsewhere a half-precision operand is upcast one slab at a time (``_SLAB_BYTES``), so an
LM head is never copied to float32 whole.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "accumulate_f32_",
    "addmm_f32_out_",
    "half_addmm",
    "half_gemm",
    "matmul_f32",
    "mm_f32_out",
]

# fp32 bytes of one weight slab upcast at a time when the head is bf16/fp16 (see matmul_f32).
_SLAB_BYTES = 64 << 20

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _cuda_half_gemm_f32_out() -> bool:
    """Whether cuBLAS half-precision GEMMs can write float32 here (``mm(..., out_dtype=)``)."""
    try:
        x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


@functools.cache
def _cuda_half_addmm_f32_out() -> bool:
    """Whether cuBLAS accumulates a half-precision product into a float32 tensor in place
    (``addmm(c, a, b, out_dtype=float32, out=c)``; older torch wants ``c`` in ``a``'s dtype)."""
    try:
        # A transposed left operand, as the weight-gradient GEMM passes it (ds^T).
        x = torch.ones(8, 16, device="cuda", dtype=torch.bfloat16)
        c = torch.ones(16, 16, device="cuda", dtype=torch.float32)
        torch.addmm(c, x.T, x, out_dtype=torch.float32, out=c)
        return bool((c == 9).all())
    except (RuntimeError, TypeError):
        return False


def half_gemm(b: Tensor) -> bool:
    """Whether GEMMs with operand ``b`` run in its half dtype with float32 output (a GPU with
    tensor-core ``mm(out_dtype=float32)``); otherwise :func:`matmul_f32` upcasts ``b``."""
    return b.is_cuda and b.dtype in _HALF and _cuda_half_gemm_f32_out()


def half_addmm(b: Tensor) -> bool:
    """Whether ``out += a @ b`` with half ``a``, ``b`` and a float32 ``out`` is one GEMM here."""
    return half_gemm(b) and _cuda_half_addmm_f32_out()


def mm_f32_out(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of two half-precision matrices, written in float32 (where :func:`half_gemm`)."""
    return torch.mm(a, b, out_dtype=torch.float32)


def addmm_f32_out_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out += a @ b`` in one GEMM: half ``a``, ``b``, float32 ``out`` (where
    :func:`half_addmm`): ``out`` is read and written once."""
    return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)


def matmul_f32(a: Tensor, b: Tensor, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """``a @ b`` (or ``out += a @ b``) into float32, for ``a [R, K]``, ``b [K, C]``.

    float32 operands go straight to one GEMM. With a half-precision ``b`` on a GPU
    (:func:`half_gemm`), ``a`` is cast to ``b``'s dtype (as autograd's bf16 matmuls do; a no-op
    when it has it already) and tensor-core GEMMs write float32 (``out_dtype``), accumulating in
    slabs of ``out``'s rows. Otherwise (CPU) half operands are upcast one slab of ``b``'s columns
    at a time, so a bf16 LM head is never copied to float32 whole.
    """
    rows, cols = a.shape[0], b.shape[1]
    f32 = torch.float64 if a.dtype == torch.float64 else torch.float32
    if half_gemm(b):
        a_h = a.to(b.dtype)
        if out is None:
            return mm_f32_out(a_h, b)
        slab = max(1, _SLAB_BYTES // (4 * max(cols, 1)))
        for r0 in range(0, rows, slab):
            r1 = min(rows, r0 + slab)
            part = mm_f32_out(a_h[r0:r1], b)
            if accumulate:
                out[r0:r1] += part
            else:
                out[r0:r1] = part
        return out
    if out is None:
        out = torch.empty(rows, cols, dtype=f32, device=a.device)
        accumulate = False
    if a.dtype == f32 and b.dtype == f32:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    a32 = a.to(f32)
    slab = max(1, _SLAB_BYTES // (4 * max(b.shape[0], 1)))
    for c0 in range(0, cols, slab):
        c1 = min(cols, c0 + slab)
        dst = out[:, c0:c1]
        if accumulate:
            dst.addmm_(a32, b[:, c0:c1].to(f32))
        else:
            torch.mm(a32, b[:, c0:c1].to(f32), out=dst)
    return out


def accumulate_f32_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` into the float32 ``out``: one fp32-output ``addmm`` where
    :func:`half_addmm` (``out`` read and written once per call; a float32 part per slab written,
    re-read and added would double the traffic on ``out``), else :func:`matmul_f32`'s
    accumulation (on CPU already one ``addmm_`` per upcast slab)."""
    if half_addmm(b) and a.dtype == b.dtype:
        addmm_f32_out_(out, a, b)
    else:
        matmul_f32(a, b, out=out, accumulate=True)
