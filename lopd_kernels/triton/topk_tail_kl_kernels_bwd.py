"""Triton backward kernel of ``topk_tail_kl`` (the forwards and the design:
``lopd_kernels/triton/topk_tail_kl_kernels.py``; the maths: ``docs/math.md``, section 2).

One program per row, one streaming pass that writes, for every j, the *tail* formula
``ds_j = (S_j / P_tail) * A_tail + [j = target] * u_ls / T`` (same for the teacher; the
bucket-normalized form never overflows, see ``_bucket_grads``), then a fix-up that overwrites
the K support entries with their own single-entry bucket gradients (K scatters, after a block
barrier so they land last; no logit is re-read; a union's ``-1`` padding slots are skipped).
The support is read from ``topk_ids``: the backward takes no ``support``.

The JSD's factors need ``K_P = KL(P || M)`` and ``K_Q = KL(Q || M)`` besides the bucket masses:
for a top-M row they are recomputed from the K + 1 saved bucket log-masses (O(K)); for the full
vocabulary every entry is a bucket, so one extra pass over the row pair comes before the
gradient pass. Full-vocabulary rows use the per-entry formulas of ``docs/math.md`` directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import LN2_C, LOG2E_C
from lopd_kernels.triton.topk_tail_kl_device import (
    _bucket_grads_div,
    _full_row_jsd_kls,
    _jsd_kls,
    _jsd_log_mixture,
)


@triton.jit
def _bwd_kernel(
    gkl_ptr,  # [N] fp32 upstream gradient of kl
    gsl_ptr,  # [N] fp32 upstream gradient of student_logprob
    gtl_ptr,  # [N] fp32 upstream gradient of teacher_logprob (privilege's included)
    s_ptr,  # [N, V] student logits
    t_ptr,  # [N, V] teacher logits
    tgt_ptr,  # [N] int64
    ids_ptr,  # [N, K] int64 (unused when FULL); -1: a union's padding
    kl_ptr,  # [N] fp32 forward divergence
    lse_ptr,  # [N, 2] fp32 forward log-sum-exps
    blp_ptr,  # [N, 2, K + 1] fp32 forward bucket log-masses (unused when FULL)
    gs_ptr,  # [N, V] out, student dtype (unused unless GRAD_S)
    gt_ptr,  # [N, V] out, teacher dtype (unused unless GRAD_T)
    V,
    L,
    stride_sb,
    stride_s,
    stride_tb,
    stride_t,
    stride_gs,
    stride_gt,
    scale2,  # log2(e) / T
    inv_t,  # 1 / T
    ignore_index,
    beta,  # the JSD's beta, log(1 - beta), log(beta) (read with DIV == 2 only)
    log_1mb,
    log_b,
    K: tl.constexpr,  # support slots per row (0 when FULL)
    KP: tl.constexpr,  # power of two >= max(K, 2)
    BLOCK_V: tl.constexpr,
    DIV: tl.constexpr,  # 0 reverse KL, 1 forward KL, 2 JSD
    FULL: tl.constexpr,
    GRAD_S: tl.constexpr,
    GRAD_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + (row // L) * stride_sb + (row % L) * stride_s
    t_row = t_ptr + (row // L) * stride_tb + (row % L) * stride_t
    gs_row = gs_ptr + row * stride_gs
    gt_row = gt_ptr + row * stride_gt
    tgt = tl.load(tgt_ptr + row)

    if tgt == ignore_index:
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inb = offs < V
            if GRAD_S:
                zero_s = tl.zeros([BLOCK_V], tl.float32).to(gs_ptr.dtype.element_ty)
                tl.store(gs_row + offs, zero_s, mask=inb)
            if GRAD_T:
                zero_t = tl.zeros([BLOCK_V], tl.float32).to(gt_ptr.dtype.element_ty)
                tl.store(gt_row + offs, zero_t, mask=inb)
    else:
        u_kl = tl.load(gkl_ptr + row)
        u_ls = tl.load(gsl_ptr + row)
        u_lt = tl.load(gtl_ptr + row)
        kl = tl.load(kl_ptr + row)
        lse_s2 = tl.load(lse_ptr + row * 2) * LOG2E_C
        lse_t2 = tl.load(lse_ptr + row * 2 + 1) * LOG2E_C
        blp_row = blp_ptr + row * (2 * (K + 1))
        # The target's own term [j = a] * u / T, added where offs == target.
        tgt_s = u_ls * inv_t
        tgt_t = u_lt * inv_t
        # The JSD's KL(P || M), KL(Q || M) (dead code for the KLs).
        k_p = tl.zeros([], tl.float32)
        k_q = tl.zeros([], tl.float32)
        if FULL:
            if DIV == 2:
                k_p, k_q = _full_row_jsd_kls(
                    s_row, t_row, V, scale2, lse_s2, 0.0, lse_t2, 0.0, log_1mb, log_b, BLOCK_V
                )
        else:
            lp_tail = tl.load(blp_row + K)
            lq_tail = tl.load(blp_row + (2 * K + 1))
            if DIV == 2:
                slot = tl.arange(0, KP)
                lp_all = tl.load(blp_row + slot, mask=slot < K, other=float("-inf"))
                lq_all = tl.load(blp_row + (K + 1) + slot, mask=slot < K, other=float("-inf"))
                k_p, k_q = _jsd_kls(lp_all, lq_all, lp_tail, lq_tail, log_1mb, log_b)
            a_tail, b_tail = _bucket_grads_div(
                lp_tail, lq_tail, kl, k_p, k_q, u_kl, u_ls, u_lt, inv_t, beta, log_1mb, log_b, DIV
            )
            # S_j / P_tail = 2^(y_j - tail lse2). A tail without mass (empty, or all -inf) has
            # only S_j = 0 entries: any finite reference works, the row's lse keeps 2^(.) <= 1.
            ref_s_tail = tl.where(lp_tail == float("-inf"), lse_s2, lse_s2 + lp_tail * LOG2E_C)
            ref_t_tail = tl.where(lq_tail == float("-inf"), lse_t2, lse_t2 + lq_tail * LOG2E_C)
        # Next block's loads in flight while this one is processed (manual pipelining); each
        # side is read only if needed (top-M rows: only for its own gradient).
        lanes = tl.arange(0, BLOCK_V)
        if GRAD_S or FULL:
            s_next = tl.load(s_row + lanes, mask=lanes < V, other=float("-inf"))
        if GRAD_T or FULL:
            t_next = tl.load(t_row + lanes, mask=lanes < V, other=float("-inf"))
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            inb = offs < V
            nxt = offs + BLOCK_V
            is_tgt = offs == tgt
            if GRAD_S or FULL:
                ys = s_next.to(tl.float32) * scale2
                s_next = tl.load(s_row + nxt, mask=nxt < V, other=float("-inf"))
            if GRAD_T or FULL:
                yt = t_next.to(tl.float32) * scale2
                t_next = tl.load(t_row + nxt, mask=nxt < V, other=float("-inf"))
            if FULL:
                # Per-entry buckets: both sides are needed for either gradient.
                p = tl.exp2(ys - lse_s2)
                q = tl.exp2(yt - lse_t2)
                if DIV == 2:
                    lp = (ys - lse_s2) * LN2_C
                    lq = (yt - lse_t2) * LN2_C
                    lm = _jsd_log_mixture(lp, lq, log_1mb, log_b)
                    ds = u_kl * tl.where(p > 0.0, p * ((1.0 - beta) * ((lp - lm) - k_p)), 0.0)
                    dt = u_kl * tl.where(q > 0.0, q * (beta * ((lq - lm) - k_q)), 0.0)
                    ds = ds - u_ls * p
                    dt = dt - u_lt * q
                else:
                    g = ((ys - lse_s2) - (yt - lse_t2)) * LN2_C  # log S_j - log T_j
                    if DIV == 0:
                        ds = u_kl * tl.where(p > 0.0, p * (g - kl), 0.0) - u_ls * p
                        dt = u_kl * (q - p) - u_lt * q
                    else:
                        ds = u_kl * (p - q) - u_ls * p
                        dt = u_kl * tl.where(q > 0.0, q * (-g - kl), 0.0) - u_lt * q
                if GRAD_S:
                    ds = ds * inv_t + tl.where(is_tgt, tgt_s, 0.0)
                    tl.store(gs_row + offs, ds.to(gs_ptr.dtype.element_ty), mask=inb)
                if GRAD_T:
                    dt = dt * inv_t + tl.where(is_tgt, tgt_t, 0.0)
                    tl.store(gt_row + offs, dt.to(gt_ptr.dtype.element_ty), mask=inb)
            else:
                # Every entry as if in the tail; the support's entries are rewritten below.
                if GRAD_S:
                    ds = tl.exp2(ys - ref_s_tail) * a_tail + tl.where(is_tgt, tgt_s, 0.0)
                    tl.store(gs_row + offs, ds.to(gs_ptr.dtype.element_ty), mask=inb)
                if GRAD_T:
                    dt = tl.exp2(yt - ref_t_tail) * b_tail + tl.where(is_tgt, tgt_t, 0.0)
                    tl.store(gt_row + offs, dt.to(gt_ptr.dtype.element_ty), mask=inb)
        if not FULL:
            # The K support entries overwrite what the streaming pass wrote there; the barrier
            # orders the two writes to the same address from different threads.
            tl.debug_barrier()
            slot = tl.arange(0, KP)
            valid = slot < K
            ids = tl.load(ids_ptr + row * K + slot, mask=valid, other=0)
            live = valid & (ids >= 0)  # a union's padding slots (-1) hold no entry
            # One entry per support bucket: its gradient is the bucket's (no logit re-read).
            a, b = _bucket_grads_div(
                tl.load(blp_row + slot, mask=valid, other=float("-inf")),
                tl.load(blp_row + (K + 1) + slot, mask=valid, other=float("-inf")),
                kl, k_p, k_q, u_kl, u_ls, u_lt, inv_t, beta, log_1mb, log_b, DIV,
            )  # fmt: skip
            is_tgt = ids == tgt
            if GRAD_S:
                ds = a + tl.where(is_tgt, tgt_s, 0.0)
                tl.store(gs_row + ids, ds.to(gs_ptr.dtype.element_ty), mask=live)
            if GRAD_T:
                dt = b + tl.where(is_tgt, tgt_t, 0.0)
                tl.store(gt_row + ids, dt.to(gt_ptr.dtype.element_ty), mask=live)
