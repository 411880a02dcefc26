"""Launchers of the Triton varlen cross-attention kernels (grids, tile sizes, the split-KV merge).

The kernels and their design are ``lopd_kernels/triton/varlen_cross_attention_kernels.py``;
:mod:`lopd_kernels.varlen_cross_attention` registers :func:`varlen_xattn_fwd` /
:func:`varlen_xattn_bwd` as ``torch.ops.lopd.varlen_cross_attention_triton_fwd`` / ``..._bwd``.
"""

from __future__ import annotations

import torch
import triton

from lopd_kernels.triton._common import LOG2E, upcast_for_interpreter
from lopd_kernels.triton.varlen_cross_attention_kernels import (
    _bwd_dkdv_kernel,
    _bwd_dq_kernel,
    _fwd_kernel,
)


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; a non-power-of-two head dim (e.g. 80) is masked.
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    # fp32: 3xTF32 split products (~fp32 accuracy on tensor cores; "ieee" takes minutes to
    # compile). 16-bit inputs ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: splitting only adds work


def _fwd_blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): halve the key tile above D = 128 to bound registers."""
    if head_dim <= 128:
        return 64, 64, 4
    return 64, 32, 8


def varlen_xattn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_k: int,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. Inputs contiguous; returns ``out [B, Lq, Hq, D]``, ``lse [B, Hq, Lq]``.

    Args:
        q, k, v, cu_seqlens_k, scale: As in :func:`lopd_kernels.varlen_cross_attention`.
        max_seqlen_k: Longest item (sizes the split-KV grid).
        num_splits: Key chunks per item; chosen to fill the GPU (~2 programs per SM) when ``None``.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, seq_q, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    group = n_q_heads // n_kv_heads
    block_m, block_n, num_warps = _fwd_blocks(head_dim)
    block_m = min(block_m, max(16, triton.next_power_of_2(group * seq_q)))
    m_blocks = triton.cdiv(group * seq_q, block_m)
    n_blocks = triton.cdiv(max(max_seqlen_k, 1), block_n)
    if num_splits is None:
        programs = batch * n_kv_heads * m_blocks
        num_splits = triton.cdiv(2 * _num_sms(q.device), max(programs, 1))
    num_splits = max(1, min(num_splits, n_blocks))
    # Chunks are whole key tiles; recompute the split count so no chunk is empty by construction.
    chunk = triton.cdiv(n_blocks, num_splits) * block_n
    num_splits = triton.cdiv(max(max_seqlen_k, 1), chunk)

    if num_splits == 1:
        out = torch.empty_like(q)
        lse = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
        o_buf, l_buf = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_buf = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        l_buf = torch.empty(
            (num_splits, batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device
        )
    if batch * seq_q * n_q_heads == 0:
        return torch.zeros_like(q), torch.full_like(l_buf[0], float("-inf"))

    grid = (batch * n_kv_heads, m_blocks, num_splits)
    _fwd_kernel[grid](
        q,
        k,
        v,
        cu_seqlens_k,
        o_buf,
        l_buf,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o_buf.stride(0),
        o_buf.stride(1),
        o_buf.stride(2),
        o_buf.stride(3),
        l_buf.stride(0),
        l_buf.stride(1),
        l_buf.stride(2),
        n_kv_heads,
        group,
        seq_q,
        head_dim,
        chunk,
        scale * LOG2E,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_block_d(head_dim),
        PRECISION=_precision(q.dtype),
        UPCAST=upcast_for_interpreter(q.dtype),
        num_warps=num_warps,
    )
    if num_splits == 1:
        return out, lse
    # Merge the chunks: lse = logsumexp_s lse_s; out = sum_s exp(lse_s - lse) out_s. Empty chunks
    # carry lse_s = -inf (weight 0); an empty item has lse = -inf everywhere (shifted to 0 first).
    lse = torch.logsumexp(l_buf, 0)
    weights = torch.exp(l_buf - lse.masked_fill(torch.isinf(lse), 0.0))  # [S, B, Hq, Lq]
    out = (o_buf * weights.transpose(2, 3).unsqueeze(-1)).sum(0).to(q.dtype)
    return out, lse


def varlen_xattn_bwd(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the dQ pass and the dK/dV pass; returns ``dq, dk, dv`` in the input dtypes."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    grad_out, lse = grad_out.contiguous(), lse.contiguous()
    batch, seq_q, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    group = n_q_heads // n_kv_heads
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if q.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if k.numel() == 0:
        return dq.zero_(), dk, dv
    # delta_i = <do_i, out_i> - dlse_i, [B, Hq, Lq] fp32 (tiny: Lq rows per head and item).
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2) - grad_lse.float()
    delta = delta.contiguous()
    block_d = _block_d(head_dim)
    precision = _precision(q.dtype)
    common = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        lse.stride(0),
        lse.stride(1),
        n_kv_heads,
        group,
        seq_q,
        head_dim,
        scale,
        scale * LOG2E,
    )
    block_m = min(64, max(16, triton.next_power_of_2(group * seq_q)))
    grid_dq = (batch * n_kv_heads, triton.cdiv(group * seq_q, block_m))
    _bwd_dq_kernel[grid_dq](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        cu_seqlens_k,
        dq,
        *common,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=block_d,
        PRECISION=precision,
        UPCAST=upcast_for_interpreter(q.dtype),
        num_warps=4,
    )
    # Rows of dk/dv past every item's end do not exist (cu_seqlens_k ends at total_k), so every
    # row is written by exactly one program of the dK/dV grid.
    block_n = 64
    grid_kv = (batch * n_kv_heads, triton.cdiv(max(max_seqlen_k, 1), block_n))
    _bwd_dkdv_kernel[grid_kv](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        cu_seqlens_k,
        dk,
        dv,
        *common,
        BLOCK_M=min(32, block_m),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION=precision,
        UPCAST=upcast_for_interpreter(q.dtype),
        num_warps=4,
    )
    return dq, dk, dv
