"""Triton backward kernel of the fused LM head + top-M/tail divergence (the forward, the design
and the cost model: ``lopd_kernels/triton/fused_linear_topk_tail_kl_kernels.py``; launcher:
``lopd_kernels/triton/fused_linear_topk_tail_kl.py``; the maths: ``docs/math.md``).

Grid ``(token blocks, vocabulary tiles)``: each program recomputes its logit tile, forms
``ds = (S * c_s[b(j)] + u_ls 1[j = a]) / T`` and the teacher's twin from per-row bucket
coefficients (PyTorch, O(N * K), ``bucket_coefs``: every divergence, a union's -1 slots match no
column), and accumulates ``dh += ds @ W`` and ``dW += ds^T h`` (and the bias gradient) with fp32
atomics. Over the full vocabulary every entry is a bucket: the coefficients are formed here, the
JSD's from ``K_P``, ``K_Q`` of an extra pass (``_jsd_full_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import dot
from lopd_kernels.triton.fused_linear_topk_tail_kl_kernels import _logit_tile
from lopd_kernels.triton.topk_tail_kl_device import _jsd_log_mixture


@triton.jit
def _bwd_side(
    X,
    H,
    W,
    DH,
    DW,
    DB,
    rows,
    row_mask,
    cols,
    col_mask,
    D,
    stride_h,
    stride_w,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Accumulate ``DH[rows] += X @ W[cols]``, ``DW[cols] += X^T @ H[rows]``, ``DB += sum X``."""
    offs_d = tl.arange(0, BLOCK_D)
    if NEED_DB:
        tl.atomic_add(DB + cols, tl.sum(X, axis=0), mask=col_mask)
    x_lp = X.to(W.dtype.element_ty)
    for d0 in range(0, D, BLOCK_D):
        dcols = d0 + offs_d
        dm = dcols < D
        if NEED_DH:
            w = tl.load(
                W + cols.to(tl.int64)[:, None] * stride_w + dcols[None, :],
                mask=col_mask[:, None] & dm[None, :],
                other=0.0,
            )
            part = dot(x_lp, w, PRECISION, UPCAST)
            tl.atomic_add(
                DH + rows.to(tl.int64)[:, None] * D + dcols[None, :],
                part,
                mask=row_mask[:, None] & dm[None, :],
            )
        if NEED_DW:
            h = tl.load(
                H + rows.to(tl.int64)[:, None] * stride_h + dcols[None, :],
                mask=row_mask[:, None] & dm[None, :],
                other=0.0,
            )
            part = dot(tl.trans(x_lp), h, PRECISION, UPCAST)
            tl.atomic_add(
                DW + cols.to(tl.int64)[:, None] * D + dcols[None, :],
                part,
                mask=col_mask[:, None] & dm[None, :],
            )


@triton.jit
def _bwd_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    TGT,
    IDS,
    ROWP,
    COEF_S,
    COEF_T,
    DHS,
    DWS,
    DBS,
    DHT,
    DWT,
    DBT,
    N,
    V,
    DS,
    DT,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    inv_temp,
    beta,  # the JSD's beta, log(1 - beta), log(beta) (FULL with DIV == 2 only)
    log_1mb,
    log_b,
    M: tl.constexpr,  # K, the support slots per row (1 when FULL)
    FULL: tl.constexpr,
    DIV: tl.constexpr,  # 0 reverse KL, 1 forward KL, 2 JSD
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    NEED_S: tl.constexpr,
    NEED_T: tl.constexpr,
    NEED_DHS: tl.constexpr,
    NEED_DWS: tl.constexpr,
    NEED_DBS: tl.constexpr,
    NEED_DHT: tl.constexpr,
    NEED_DWT: tl.constexpr,
    NEED_DBT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (token block, vocabulary tile) of the backward.

    ``ROWP [N, 8]`` per row: lse_s, lse_t, u_ls, u_t (= u_priv + u_lt), and with ``FULL`` u_kl,
    the divergence and (JSD) K_P, K_Q. ``COEF_S/COEF_T [N, M+1]``: the bucket coefficients
    (index M: the tail) such that ``ds_j = (S_j * COEF_S[b(j)] + u_ls 1[j = a]) / T`` and the
    same for ``dt``; ``IDS [N, M]`` (-1: a union's padding, matching no column).
    """
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    valid = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    tgt = tl.load(TGT + rows, mask=row_mask, other=-1)
    is_tgt = cols[None, :] == tgt[:, None]
    rp = ROWP + rows64 * 8
    lse_s = tl.load(rp + 0, mask=row_mask, other=0.0)
    lse_t = tl.load(rp + 1, mask=row_mask, other=0.0)
    u_ls = tl.load(rp + 2, mask=row_mask, other=0.0)
    u_t = tl.load(rp + 3, mask=row_mask, other=0.0)
    s = _logit_tile(
        HS, WS, BS, rows, row_mask, cols, col_mask, DS, stride_hs, stride_ws, inv_temp,
        HAS_BS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
    )  # fmt: skip
    t = _logit_tile(
        HT, WT, BT, rows, row_mask, cols, col_mask, DT, stride_ht, stride_wt, inv_temp,
        HAS_BT, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
    )  # fmt: skip
    log_s = s - lse_s[:, None]
    log_t = t - lse_t[:, None]
    p_s = tl.where(valid, tl.exp(log_s), 0.0)
    p_t = tl.where(valid, tl.exp(log_t), 0.0)
    if FULL:
        u_kl = tl.load(rp + 4, mask=row_mask, other=0.0)
        if DIV == 2:
            k_p = tl.load(rp + 6, mask=row_mask, other=0.0)
            k_q = tl.load(rp + 7, mask=row_mask, other=0.0)
            lm = _jsd_log_mixture(log_s, log_t, log_1mb, log_b)
            c_s = tl.where(p_s > 0, (1.0 - beta) * ((log_s - lm) - k_p[:, None]), 0.0)
            c_t = tl.where(p_t > 0, beta * ((log_t - lm) - k_q[:, None]), 0.0)
            c_s = u_kl[:, None] * c_s - u_ls[:, None]
            c_t = u_kl[:, None] * c_t - u_t[:, None]
        else:
            kl = tl.load(rp + 5, mask=row_mask, other=0.0)
            g = log_s - log_t
            fin = (p_s > 0) & (p_t > 0)
            if DIV == 0:
                c_s = u_kl[:, None] * tl.where(fin, g - kl[:, None], 0.0) - u_ls[:, None]
                c_t = u_kl[:, None] * tl.where(fin, 1.0 - tl.exp(g), 0.0) - u_t[:, None]
            else:
                c_s = u_kl[:, None] * tl.where(fin, 1.0 - tl.exp(-g), 0.0) - u_ls[:, None]
                c_t = u_kl[:, None] * tl.where(fin, -g - kl[:, None], 0.0) - u_t[:, None]
    else:
        cp_s = COEF_S + rows64 * (M + 1)
        cp_t = COEF_T + rows64 * (M + 1)
        c_s = (
            tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            + tl.load(cp_s + M, mask=row_mask, other=0.0)[:, None]
        )
        c_t = (
            tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            + tl.load(cp_t + M, mask=row_mask, other=0.0)[:, None]
        )
        for k in range(M):
            idk = tl.load(IDS + rows64 * M + k, mask=row_mask, other=-1)
            hit = cols[None, :] == idk[:, None]
            c_s = tl.where(hit, tl.load(cp_s + k, mask=row_mask, other=0.0)[:, None], c_s)
            c_t = tl.where(hit, tl.load(cp_t + k, mask=row_mask, other=0.0)[:, None], c_t)
    if NEED_S:
        ds = p_s * c_s + tl.where(is_tgt, u_ls[:, None], 0.0)
        ds = tl.where(valid, ds * inv_temp, 0.0)
        _bwd_side(
            ds, HS, WS, DHS, DWS, DBS, rows, row_mask, cols, col_mask, DS, stride_hs, stride_ws,
            NEED_DHS, NEED_DWS, NEED_DBS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
        )  # fmt: skip
    if NEED_T:
        dt = p_t * c_t + tl.where(is_tgt, u_t[:, None], 0.0)
        dt = tl.where(valid, dt * inv_temp, 0.0)
        _bwd_side(
            dt, HT, WT, DHT, DWT, DBT, rows, row_mask, cols, col_mask, DT, stride_ht, stride_wt,
            NEED_DHT, NEED_DWT, NEED_DBT, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
        )  # fmt: skip
