"""Triton kernels of the fused LM head + token log-probabilities: the device code (launchers:
``lopd_kernels/triton/fused_linear_logprob.py``; the op: :mod:`lopd_kernels.fused_linear_logprob`;
the maths: ``docs/math.md``, section 6).

Shapes: hidden states ``[N, D]`` (only rows with a real target; the launchers pack them), the head
``[V, D]``, an optional bias ``[V]``. The logit tiles come from the fused top-M op's helper
(``_logit_tile``: ``tl.dot`` over ``D``, bias added, divided by the temperature) and the backward
accumulates through its ``_bwd_side`` (fp32 atomics), so the two fused ops form and differentiate
logits identically.

Forward (:func:`_fwd_kernel`), grid ``(token blocks, vocabulary splits)``: a program walks the
tiles of its split keeping per row the running maximum ``m``, ``S_ex = sum e^{z - m}`` and
``sum e^{z - m} (z - m)`` over every entry but the target (whose logit it picks up): the target
stays out of the sums so that ``1 - p_a`` is a sum, as in the other backends. Each split writes
these four numbers; the launcher merges the splits (PyTorch, float64) and finalizes the rows
exactly as the blocked path does.

Backward (:func:`_bwd_kernel`), grid ``(token blocks, vocabulary tiles)``: each program recomputes
its tile, forms ``G = -p (u + v (log p + H)) / T`` with the target entry replaced by its
per-row value (computed by the launcher with ``expm1``), and accumulates ``dh``, ``dW`` and the
bias gradient with fp32 atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton.fused_linear_topk_tail_kl_kernels import _logit_tile
from lopd_kernels.triton.fused_linear_topk_tail_kl_kernels_bwd import _bwd_side


@triton.jit
def _fwd_kernel(
    H,
    W,
    B,
    TGT,
    STATS,
    N,
    V,
    D,
    stride_h,
    stride_w,
    split_len,
    inv_temp,
    HAS_B: tl.constexpr,
    ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (token block, vocabulary split): ``STATS [N, splits, 4]`` = (m, S_ex, sum e (z - m),
    z_a), the target's tempered logit ``-inf`` outside this split."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(TGT + rows, mask=row_mask, other=-1)
    v_begin = pid_s * split_len
    v_end = tl.minimum(v_begin + split_len, V)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_ex = tl.zeros((BLOCK_N,), tl.float32)
    s2_ex = tl.zeros((BLOCK_N,), tl.float32)
    z_a = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        z = _logit_tile(
            H, W, B, rows, row_mask, cols, col_mask, D, stride_h, stride_w, inv_temp,
            HAS_B, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
        )  # fmt: skip
        z = tl.where(row_mask[:, None] & col_mask[None, :], z, float("-inf"))
        is_tgt = cols[None, :] == tgt[:, None]
        z_a = tl.maximum(z_a, tl.max(tl.where(is_tgt, z, float("-inf")), axis=1))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        z = tl.where(is_tgt, float("-inf"), z)
        seen = m > float("-inf")
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        scale = tl.where(seen, tl.exp(m - m_safe), 0.0)
        shift = tl.where(seen, m - m_safe, 0.0)
        d = z - m_safe[:, None]
        e = tl.exp(d)
        if ENTROPY:
            s2_ex = scale * (s2_ex + shift * s_ex) + tl.sum(e * tl.maximum(d, -150.0), axis=1)
        s_ex = scale * s_ex + tl.sum(e, axis=1)
        m = m_new
    st = STATS + (rows.to(tl.int64) * n_splits + pid_s) * 4
    tl.store(st + 0, m, mask=row_mask)
    tl.store(st + 1, s_ex, mask=row_mask)
    tl.store(st + 2, s2_ex, mask=row_mask)
    tl.store(st + 3, z_a, mask=row_mask)


@triton.jit
def _bwd_kernel(
    H,
    W,
    B,
    TGT,
    ROWP,
    DH,
    DW,
    DB,
    N,
    V,
    D,
    stride_h,
    stride_w,
    inv_temp,
    HAS_B: tl.constexpr,
    ENTROPY: tl.constexpr,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (token block, vocabulary tile) of the backward. ``ROWP [N, 8]`` per row: lse, u
    (grad of the log-prob), v (grad of the entropy), H (the entropy), the target entry's
    ``u (1 - p_a) - v p_a (log p_a + H)``."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    valid = row_mask[:, None] & col_mask[None, :]
    rp = ROWP + rows.to(tl.int64) * 8
    lse = tl.load(rp + 0, mask=row_mask, other=0.0)
    u = tl.load(rp + 1, mask=row_mask, other=0.0)
    g_a = tl.load(rp + 4, mask=row_mask, other=0.0)
    tgt = tl.load(TGT + rows, mask=row_mask, other=-1)
    z = _logit_tile(
        H, W, B, rows, row_mask, cols, col_mask, D, stride_h, stride_w, inv_temp,
        HAS_B, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
    )  # fmt: skip
    d = z - lse[:, None]
    p = tl.where(valid, tl.exp(d), 0.0)
    if ENTROPY:
        v = tl.load(rp + 2, mask=row_mask, other=0.0)
        ent = tl.load(rp + 3, mask=row_mask, other=0.0)
        coef = u[:, None] + v[:, None] * (tl.maximum(d, -150.0) + ent[:, None])
    else:
        coef = u[:, None] + tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    g = -p * coef
    g = tl.where(cols[None, :] == tgt[:, None], g_a[:, None], g)
    g = tl.where(valid, g * inv_temp, 0.0)
    _bwd_side(
        g, H, W, DH, DW, DB, rows, row_mask, cols, col_mask, D, stride_h, stride_w,
        NEED_DH, NEED_DW, NEED_DB, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
    )  # fmt: skip
