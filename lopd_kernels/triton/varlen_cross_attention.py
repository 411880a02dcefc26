"""Triton kernels for varlen cross-attention (see :mod:`lopd_kernels.varlen_cross_attention`).

Shapes: ``q``/``out`` ``[B, Lq, Hq, D]``, ``k``/``v`` packed ``[total_k, Hkv, D]``, ``lse``
``[B, Hq, Lq]`` fp32, ``cu_seqlens_k`` int32 ``[B+1]``. ``G = Hq // Hkv``.

One program owns one (item, kv head) pair and a tile of the ``G * Lq`` query rows of that GQA
group, so each key/value tile is loaded once for all query heads that share it. ``Lq`` is small
(32 learned queries) while ``T`` reaches thousands of keys, so:

* forward (:func:`_fwd_kernel`): **split-KV** -- grid axis 2 cuts each item's keys into chunks;
  each chunk runs an online softmax (exp2 domain, fp32 running max / sum / accumulator) and writes a
  partial output and log-sum-exp, merged afterwards. Without the split a batch of 12 items x 8 kv
  heads would occupy ~100 programs on a 132-SM GPU while each walks 2000 keys.
* backward: a **dQ pass** (:func:`_bwd_dq_kernel`, programs over query tiles, looping over keys)
  and a **dK/dV pass** (:func:`_bwd_dkdv_kernel`, programs over key tiles, looping over the
  ``G * Lq`` query rows). Each output row has exactly one writer: no atomics, deterministic.

Pointer offsets are formed in int64 (``total_k * Hkv * D`` overflows int32 for long packs). All
dot products accumulate in fp32; fp32 inputs use 3xTF32 products (split-precision, ~fp32
accuracy), not plain TF32. ``UPCAST`` only serves the interpreter (see :func:`_dot`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; ``UPCAST`` feeds it fp32 operands.

    Triton's interpreter (3.x) multiplies 16-bit float tiles as raw integers, so under
    ``TRITON_INTERPRET=1`` half-precision operands are upcast first; compiled kernels never are.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    CU,
    Out,
    LSE,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_os,
    stride_ob,
    stride_om,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    n_kv_heads,
    group,
    seq_q,
    head_dim,
    chunk,
    qk_scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hkv = (pid_bh % n_kv_heads).to(tl.int64)
    start = tl.load(CU + b).to(tl.int64)
    end = tl.load(CU + b + 1).to(tl.int64)
    lo = start + pid_s * chunk
    hi = tl.minimum(end, lo + chunk)

    # Row r of the tile is query row i = r % Lq of query head hkv * G + r // Lq.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < group * seq_q
    head = hkv * group + (rows // seq_q)
    qi = rows % seq_q
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    q_ptrs = Q + b * stride_qb + qi[:, None] * stride_qm + head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < hi
        kt = tl.load(
            K + cols[None, :] * stride_kt + hkv * stride_kh + offs_d[:, None],
            mask=d_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = _dot(q, kt, PRECISION, UPCAST) * qk_scale_log2
        s = tl.where(col_mask[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid key (the loop stops at hi), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(
            V + cols[:, None] * stride_vt + hkv * stride_vh + offs_d[None, :],
            mask=col_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, PRECISION, UPCAST)
        m_i = m_new

    # An empty chunk (or item) has l = 0: output 0 and lse = -inf, never 0/0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    # Back from the log2 domain: lse = ln(2) * (m + log2 l).
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)

    o_ptrs = Out + pid_s * stride_os + b * stride_ob + qi[:, None] * stride_om
    o_ptrs += head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    l_ptrs = LSE + pid_s * stride_ls + b * stride_lb + head * stride_lh + qi
    tl.store(l_ptrs, lse, mask=row_mask)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    CU,
    DQ,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_lb,
    stride_lh,
    n_kv_heads,
    group,
    seq_q,
    head_dim,
    sm_scale,
    qk_scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Q, DO and DQ share one [B, Lq, Hq, D] contiguous layout; LSE and DELTA share [B, Hq, Lq].
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hkv = (pid_bh % n_kv_heads).to(tl.int64)
    start = tl.load(CU + b).to(tl.int64)
    end = tl.load(CU + b + 1).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < group * seq_q
    head = hkv * group + (rows // seq_q)
    qi = rows % seq_q
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    qd_mask = row_mask[:, None] & d_mask[None, :]

    q_off = b * stride_qb + qi[:, None] * stride_qm + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=qd_mask, other=0.0)
    do = tl.load(DO + q_off, mask=qd_mask, other=0.0)
    r_off = b * stride_lb + head * stride_lh + qi
    lse2 = tl.load(LSE + r_off, mask=row_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + r_off, mask=row_mask, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < end
        kv_mask = d_mask[:, None] & col_mask[None, :]
        kt = tl.load(
            K + cols[None, :] * stride_kt + hkv * stride_kh + offs_d[:, None], kv_mask, 0.0
        )
        vt = tl.load(
            V + cols[None, :] * stride_vt + hkv * stride_vh + offs_d[:, None], kv_mask, 0.0
        )
        s = _dot(q, kt, PRECISION, UPCAST) * qk_scale_log2
        p = tl.where(col_mask[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = _dot(do, vt, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), PRECISION, UPCAST)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    CU,
    DK,
    DV,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_lb,
    stride_lh,
    n_kv_heads,
    group,
    seq_q,
    head_dim,
    sm_scale,
    qk_scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # DK shares K's layout and DV shares V's ([total_k, Hkv, D], contiguous).
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hkv = (pid_bh % n_kv_heads).to(tl.int64)
    start = tl.load(CU + b).to(tl.int64)
    end = tl.load(CU + b + 1).to(tl.int64)
    n0 = start + pid_n * BLOCK_N
    if n0 >= end:
        return  # the grid is sized for the longest item

    cols = n0 + tl.arange(0, BLOCK_N)
    col_mask = cols < end
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    kv_mask = col_mask[:, None] & d_mask[None, :]
    k_off = cols[:, None] * stride_kt + hkv * stride_kh + offs_d[None, :]
    v_off = cols[:, None] * stride_vt + hkv * stride_vh + offs_d[None, :]
    k = tl.load(K + k_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(V + v_off, mask=kv_mask, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m0 in range(0, group * seq_q, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < group * seq_q
        head = hkv * group + (rows // seq_q)
        qi = rows % seq_q
        qd_mask = row_mask[:, None] & d_mask[None, :]
        q_off = b * stride_qb + qi[:, None] * stride_qm + head[:, None] * stride_qh
        q = tl.load(Q + q_off + offs_d[None, :], mask=qd_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        do = tl.load(DO + q_off + offs_d[None, :], mask=qd_mask, other=0.0)
        r_off = b * stride_lb + head * stride_lh + qi
        lse2 = tl.load(LSE + r_off, mask=row_mask, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + r_off, mask=row_mask, other=0.0)

        st = _dot(k, tl.trans(q), PRECISION, UPCAST) * qk_scale_log2  # [BLOCK_N, BLOCK_M]
        pt = tl.exp2(st - lse2[None, :])
        pt = tl.where(col_mask[:, None] & row_mask[None, :], pt, 0.0)
        dv += _dot(pt.to(do.dtype), do, PRECISION, UPCAST)
        dpt = _dot(v, tl.trans(do), PRECISION, UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(q.dtype), q, PRECISION, UPCAST)
    tl.store(DK + k_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + v_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; a non-power-of-two head dim (e.g. 80) is masked.
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    # fp32: 3xTF32 split products (~fp32 accuracy on tensor cores; "ieee" takes minutes to
    # compile). 16-bit inputs ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and dtype != torch.float32


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
        scale * _LOG2E,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_block_d(head_dim),
        PRECISION=_precision(q.dtype),
        UPCAST=_upcast(q.dtype),
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
        scale * _LOG2E,
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
        UPCAST=_upcast(q.dtype),
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
        UPCAST=_upcast(q.dtype),
        num_warps=4,
    )
    return dq, dk, dv
