"""Triton pass of the chunked fused-linear path's tail projection: ``[C, V]`` logits to the
tail-masked tempered softmax, in the dtype of the GEMM that reads it.

The frozen-head tail projection (``lopd_kernels/fused_linear_chunked.py``) needs
``P_j = exp(x_j / T - lse)`` with the M top-M entries set to 0, as the left operand of
``P @ W``. Done with PyTorch ops that is three elementwise passes over the float32 block (scale,
shift, exp), a scatter and, for a bf16 head, a fourth pass that casts it for the tensor-core GEMM:
about ``(4 + 4 + 4 + 4 + 2) * 2`` bytes per entry. This kernel reads each float32 logit once and
writes ``P`` once in the GEMM dtype (``4 + 2`` bytes per entry for bf16, ``4 + 4`` for fp32), then
zeroes the top-M entries of the row: ``M`` stores per row, read from the forward's ``topk_ids``
(the same zeroing as the scatter, without a pass over the row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopd_kernels.triton._common import LOG2E_C, interpreting

_BLOCK_V = 2048


@triton.jit
def _tail_probs_kernel(
    X,  # [C, V] float32 logits, row stride stride_x
    LSE,  # [C] float32 log-sum-exp of x / T, stride stride_lse
    IDS,  # [C, M] int64 top-M ids, row stride stride_ids
    OUT,  # [C, V] probabilities in OUT's dtype, row stride stride_o (may be X itself)
    V,
    stride_x,
    stride_lse,
    stride_ids,
    stride_o,
    inv_temp,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x
    o_row = OUT + row.to(tl.int64) * stride_o
    # exp(x / T - lse) = 2^(x * (log2 e / T) - lse * log2 e): one FMA and one exp2 per entry.
    scale = inv_temp * LOG2E_C
    shift = tl.load(LSE + row * stride_lse) * LOG2E_C
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        p = tl.exp2(x * scale - shift)
        tl.store(o_row + offs, p.to(OUT.dtype.element_ty), mask=mask)
    if M > 0:
        # The same program wrote this row: its stores are visible to its own later stores, so
        # the zeros land after the probabilities (no second launch, no race).
        tl.debug_barrier()
        k = tl.arange(0, M_PAD)
        ids = tl.load(IDS + row.to(tl.int64) * stride_ids + k, mask=k < M, other=0)
        zero = tl.zeros([M_PAD], dtype=OUT.dtype.element_ty)
        tl.store(o_row + ids, zero, mask=k < M)


def tail_probs_triton(
    logits: torch.Tensor,
    lse: torch.Tensor,
    topk_ids: torch.Tensor,
    temperature: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``exp(logits / T - lse[:, None])`` with the top-M entries of each row zeroed.

    Args:
        logits: ``[C, V]`` float32, last dim contiguous; overwritten (and returned) when
            ``out_dtype`` is float32.
        lse: ``[C]`` float32, this side's log-sum-exp of ``logits / T``.
        topk_ids: ``[C, M]`` int64 ids to zero (``M`` may be 0).
        temperature: ``T > 0``.
        out_dtype: dtype of the result (the GEMM operand dtype: float32, bfloat16 or float16).

    Returns:
        ``[C, V]`` tensor of ``out_dtype``.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be a [C, V] float32 tensor with a contiguous last dim, got "
            f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}"
        )
    c, v = logits.shape
    m = topk_ids.shape[1]
    out = logits if out_dtype == torch.float32 else logits.new_empty(c, v, dtype=out_dtype)
    if c == 0:
        return out
    ids = topk_ids if topk_ids.stride(-1) == 1 or m == 0 else topk_ids.contiguous()
    block_v = 64 if interpreting() else _BLOCK_V
    _tail_probs_kernel[(c,)](
        logits, lse, ids, out, v,
        logits.stride(0), lse.stride(0), max(ids.stride(0), 1), out.stride(0),
        1.0 / temperature,
        M=m, M_PAD=max(1, triton.next_power_of_2(m)),
        BLOCK_V=min(block_v, triton.next_power_of_2(v)),
        num_warps=1 if interpreting() else 8,
    )  # fmt: skip
    return out
