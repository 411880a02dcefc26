"""Triton kernels of varlen cross-attention: the device code (launchers:
``lopd_kernels/triton/varlen_cross_attention.py``; the op and its maths:
:mod:`lopd_kernels.varlen_cross_attention`).

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
accuracy), not plain TF32. ``UPCAST`` only serves the interpreter (see
:func:`lopd_kernels.triton._common.dot`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import dot


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
        s = dot(q, kt, PRECISION, UPCAST) * qk_scale_log2
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
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, PRECISION, UPCAST)
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
        s = dot(q, kt, PRECISION, UPCAST) * qk_scale_log2
        p = tl.where(col_mask[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = dot(do, vt, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(kt.dtype), tl.trans(kt), PRECISION, UPCAST)
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

        st = dot(k, tl.trans(q), PRECISION, UPCAST) * qk_scale_log2  # [BLOCK_N, BLOCK_M]
        pt = tl.exp2(st - lse2[None, :])
        pt = tl.where(col_mask[:, None] & row_mask[None, :], pt, 0.0)
        dv += dot(pt.to(do.dtype), do, PRECISION, UPCAST)
        dpt = dot(v, tl.trans(do), PRECISION, UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk += dot(dst.to(q.dtype), q, PRECISION, UPCAST)
    tl.store(DK + k_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + v_off, dv.to(DV.dtype.element_ty), mask=kv_mask)
