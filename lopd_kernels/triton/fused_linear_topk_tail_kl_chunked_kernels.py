"""Triton kernel of the chunked fused-linear path: ``[C, V]`` logits to the tail-masked tempered
softmax in the GEMM's dtype. Launcher and rationale:
:mod:`lopd_kernels.triton.fused_linear_topk_tail_kl_chunked`."""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import LOG2E_C


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
