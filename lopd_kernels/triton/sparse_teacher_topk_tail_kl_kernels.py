"""Triton kernels of ``sparse_teacher_topk_tail_kl`` (launched by
``lopd_kernels/triton/sparse_teacher_topk_tail_kl.py``).

Design: one program per row, float32 math whatever the student dtype.

* **Forward**: the teacher's side is O(M) registers (its tail ``1 - sum exp(lp)`` as
  ``-expm1(max + log1p(rest))``, with ``log1p`` / ``expm1`` by Kahan's exact-rounding tricks:
  libdevice is not available to the interpreter). One streaming pass over the student logits
  keeps an online log-sum-exp of the *tail*: each block's entries are compared with the row's
  M real ids (a ``[BLOCK_V, MP]`` equality tile, so the launcher caps the block: ``_FWD_TILE``)
  and the matches left out, never ``1 - sum`` of the top masses. The full log-sum-exp is
  ``logaddexp(tail, top)`` at the end.
* **Backward**: one streaming pass writing each entry's gradient once: the same equality tile
  picks the entry's own bucket coefficient (a teacher id) or the tail's, so no write is
  overwritten and no barrier is needed.

Ids and targets are not validated here (the public API does): a real slot's id outside ``[0, V)``
is masked out of every load, never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0, exact to rounding (Goldberg: log(u) * x / (u - 1), u = 1 + x)."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _neg_expm1(y):
    """1 - exp(y) for y <= 0, exact to rounding (Kahan: (u - 1) * y / log(u), u = exp(y))."""
    u = tl.exp(y)
    d = u - 1.0
    lu = tl.log(tl.where(d == 0.0, 2.0, u))
    em1 = tl.where(d == 0.0, y, tl.where(d == -1.0, -1.0, d * (y / tl.where(d == 0.0, 1.0, lu))))
    return -em1


@triton.jit
def _kl_term(logp, logq, REVERSE: tl.constexpr):
    """One bucket's divergence term; a zero-mass weighting bucket adds exactly 0, one with mass
    against a zero-mass bucket +inf (also when its own mass underflows)."""
    if REVERSE:
        w = logp
        o = logq
    else:
        w = logq
        o = logp
    return tl.where(w == _NEG_INF, 0.0, tl.where(o == _NEG_INF, float("inf"), tl.exp(w) * (w - o)))


@triton.jit
def _k_student(logp, logq, kl, u_kl, u_ls, REVERSE: tl.constexpr):
    """Per-bucket student factor k_s (csrc/common/topk_tail_kl_math.h, bucket_grad_factors)."""
    p = tl.exp(logp)
    if REVERSE:
        return tl.where(logp == _NEG_INF, 0.0, p * (u_kl * ((logp - logq) - kl) - u_ls))
    else:
        return p * (u_kl - u_ls) - u_kl * tl.exp(logq)


@triton.jit
def _fwd_kernel(
    s_ptr,  # [N, V] student logits
    lp_ptr,  # [N, M] float32 teacher log-probs (-inf: padding)
    ids_ptr,  # [N, M] int64
    tgt_ptr,  # [N] int64
    kl_ptr,  # [N] out
    slp_ptr,  # [N] out
    lse_ptr,  # [N] out
    blp_ptr,  # [N, 2, M + 1] out
    V,
    stride_s,
    inv_t,
    ignore_index,
    tail_floor,
    M: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    blp_row = blp_ptr + row * (2 * (M + 1))
    slot = tl.arange(0, MP)
    valid = slot < M
    tgt = tl.load(tgt_ptr + row)
    if tgt == ignore_index:
        tl.store(kl_ptr + row, 0.0)
        tl.store(slp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        zeros = tl.zeros([MP], tl.float32)
        tl.store(blp_row + slot, zeros, mask=valid)
        tl.store(blp_row + (M + 1) + slot, zeros, mask=valid)
        tl.store(blp_row + M, 0.0)
        tl.store(blp_row + (2 * M + 1), 0.0)
    else:
        lp = tl.load(lp_ptr + row * M + slot, mask=valid, other=float("-inf"))
        ids = tl.load(ids_ptr + row * M + slot, mask=valid, other=0)
        real = (lp != _NEG_INF) & (ids >= 0) & (ids < V)
        key = tl.where(real, ids, -1).to(tl.int32)  # -1 matches no vocabulary offset

        # Teacher tail: 1 - exp(top + log1p(rest)), floored.
        top = tl.max(lp, 0)
        arg = tl.argmax(lp, 0)
        rest = tl.sum(tl.where(real & (slot != arg), tl.exp(lp - top), 0.0), 0)
        lse_q = tl.minimum(top + _log1p(rest), 0.0)
        tail_q = tl.where(top == _NEG_INF, 1.0, _neg_expm1(lse_q))
        if REVERSE:  # below the floor: rounding noise (raised for reverse, dropped for forward)
            tail_q = tl.maximum(tail_q, tail_floor)
        else:
            tail_q = tl.where(tail_q < tail_floor, 0.0, tail_q)
        logq_tail = tl.where(tail_q > 0.0, tl.log(tl.where(tail_q > 0.0, tail_q, 1.0)), _NEG_INF)

        # Student tail: online log-sum-exp over the entries that are not real ids.
        lanes = tl.arange(0, BLOCK_V)
        ms = tl.full([], float("-inf"), tl.float32)
        ls = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            x = tl.load(s_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
            hit = tl.max((offs[:, None] == key[None, :]).to(tl.int32), 1) > 0
            x = tl.where(hit, _NEG_INF, x)
            new_m = tl.maximum(ms, tl.max(x, 0))
            scale = tl.where(ms == _NEG_INF, 0.0, tl.exp(ms - new_m))
            ls = ls * scale + tl.sum(tl.where(x == _NEG_INF, 0.0, tl.exp(x - new_m)), 0)
            ms = new_m

        s_top = tl.load(s_row + ids, mask=real, other=float("-inf")).to(tl.float32) * inv_t
        m_all = tl.maximum(ms, tl.max(s_top, 0))
        tail_part = tl.where(ms == _NEG_INF, 0.0, ls * tl.exp(ms - m_all))
        top_part = tl.sum(tl.where(s_top == _NEG_INF, 0.0, tl.exp(s_top - m_all)), 0)
        lse_s = tl.where(m_all == _NEG_INF, _NEG_INF, m_all + tl.log(tail_part + top_part))
        empty = lse_s == _NEG_INF
        logp = tl.where(real, tl.where(empty, _NEG_INF, s_top - lse_s), _NEG_INF)
        logq = tl.where(real, lp, _NEG_INF)
        logp_tail = tl.where((ms == _NEG_INF) | empty, _NEG_INF, ms + tl.log(ls) - lse_s)
        kl = tl.sum(tl.where(valid, _kl_term(logp, logq, REVERSE), 0.0), 0)
        kl += _kl_term(logp_tail, logq_tail, REVERSE)
        x_a = tl.load(s_row + tgt).to(tl.float32) * inv_t
        tl.store(kl_ptr + row, kl)
        tl.store(slp_ptr + row, tl.where(empty, _NEG_INF, x_a - lse_s))
        tl.store(lse_ptr + row, lse_s)
        tl.store(blp_row + slot, logp, mask=valid)
        tl.store(blp_row + (M + 1) + slot, logq, mask=valid)
        tl.store(blp_row + M, logp_tail)
        tl.store(blp_row + (2 * M + 1), logq_tail)


@triton.jit
def _bwd_kernel(
    gkl_ptr,  # [N] float32
    gsl_ptr,  # [N] float32
    s_ptr,  # [N, V]
    ids_ptr,  # [N, M] int64
    tgt_ptr,  # [N] int64
    kl_ptr,  # [N]
    lse_ptr,  # [N]
    blp_ptr,  # [N, 2, M + 1]
    gs_ptr,  # [N, V] out, student dtype
    V,
    stride_s,
    stride_g,
    inv_t,
    ignore_index,
    M: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    g_row = gs_ptr + row * stride_g
    blp_row = blp_ptr + row * (2 * (M + 1))
    lanes = tl.arange(0, BLOCK_V)
    tgt = tl.load(tgt_ptr + row)
    if tgt == ignore_index:
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            zero = tl.zeros([BLOCK_V], tl.float32).to(gs_ptr.dtype.element_ty)
            tl.store(g_row + offs, zero, mask=offs < V)
    else:
        slot = tl.arange(0, MP)
        valid = slot < M
        u_kl = tl.load(gkl_ptr + row)
        u_ls = tl.load(gsl_ptr + row)
        kl = tl.load(kl_ptr + row)
        lse_s = tl.load(lse_ptr + row)
        logp = tl.load(blp_row + slot, mask=valid, other=float("-inf"))
        logq = tl.load(blp_row + (M + 1) + slot, mask=valid, other=float("-inf"))
        logp_t = tl.load(blp_row + M)
        logq_t = tl.load(blp_row + (2 * M + 1))
        ids = tl.load(ids_ptr + row * M + slot, mask=valid, other=0)
        real = (logq != _NEG_INF) & (ids >= 0) & (ids < V)
        key = tl.where(real, ids, -1).to(tl.int32)
        k_top = tl.where(real, _k_student(logp, logq, kl, u_kl, u_ls, REVERSE), 0.0)
        k_tail = _k_student(logp_t, logq_t, kl, u_kl, u_ls, REVERSE)
        # A tail without mass gives every share 0 (lse_tail = +inf), never NaN.
        no_tail = (logp_t == _NEG_INF) | (lse_s == _NEG_INF)
        lse_tail = tl.where(no_tail, _POS_INF, lse_s + logp_t)
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            x = tl.load(s_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
            eq = offs[:, None] == key[None, :]
            hit = tl.max(eq.to(tl.int32), 1) > 0
            k_hit = tl.sum(tl.where(eq, k_top[None, :], 0.0), 1)
            share = tl.where(hit, 1.0, tl.exp(x - lse_tail))
            k = tl.where(hit, k_hit, k_tail)
            g = (share * k + tl.where(offs == tgt, u_ls, 0.0)) * inv_t
            tl.store(g_row + offs, g.to(gs_ptr.dtype.element_ty), mask=offs < V)
