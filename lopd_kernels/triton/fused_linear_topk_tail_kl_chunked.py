"""Triton pass of the chunked fused-linear path's tail projection: ``[C, V]`` logits to the
tail-masked tempered softmax, in the dtype of the GEMM that reads it.

The frozen-head tail projection (``lopd_kernels/fused_linear_topk_tail_kl_chunked.py``) needs
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

from lopd_kernels.triton._common import interpreting
from lopd_kernels.triton.fused_linear_topk_tail_kl_chunked_kernels import _tail_probs_kernel

_BLOCK_V = 2048


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
