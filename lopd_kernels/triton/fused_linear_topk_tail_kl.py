"""Triton kernels for the fused LM head + top-M/tail KL (see
:mod:`lopd_kernels.fused_linear_topk_tail_kl` and ``/work/shared/design/math.md``).

Shapes: hidden states ``[N, D]`` (only rows with a real target; the launchers pack them), LM heads
``[V, D]``, optional biases ``[V]``. Logits are divided by the temperature right after the tile
GEMM; everything after the GEMM is float32.

Forward (:func:`_fwd_kernel`), grid ``(token blocks, vocabulary splits)``. A program walks the
vocabulary tiles of its split; per tile it forms the ``[BLOCK_N, BLOCK_V]`` student and teacher
logits in registers (``tl.dot`` over ``D`` in ``BLOCK_D`` steps) and

* merges the tile into a running top-M of the teacher (values, student values and ids kept in
  ``[BLOCK_N, M_PAD]`` registers) by M arg-max extractions over (running set u tile). Once the
  running set is full, a tile whose best teacher logit cannot beat any row's current M-th value is
  not merged at all (after the first tiles almost none is);
* folds every entry that is *not* in the running top-M -- tile entries never selected and entries
  evicted from the running set -- into two online log-sum-exps, the student's and the teacher's
  **tail**. The complement of the top-M is thus accumulated directly, exact to fp32 rounding,
  never as ``1 - sum(top-M)``;
* picks up the target logits.

Each split writes its local top-M candidates and tail (max, sum) pairs; :func:`_merge_splits`
(PyTorch, O(N * splits * M)) keeps the global top-M of the candidates and folds the rest into the
tail, which is again exact. Splitting the vocabulary keeps the GPU busy when ``N`` is small. With
``top_m`` = full vocabulary (``FULL``) the kernel instead accumulates the log-sum-exps and the
softmax-weighted mean of ``s - t`` (reverse) or ``t - s`` (forward), which is the full KL.

Backward (:func:`_bwd_kernel`), grid ``(token blocks, vocabulary tiles)``: each program recomputes
its logit tile, forms ``ds = (S * c_s[b(j)] + u_ls 1[j = a]) / T`` and the teacher's twin from
per-row bucket coefficients (PyTorch, O(N * M), ``bucket_coefs``), and accumulates
``dh += ds @ W`` and ``dW += ds^T h`` (and the bias gradient) with fp32 atomics, like Cut
Cross-Entropy does for plain cross-entropy.

Cost model, and why ``backend="auto"`` uses the chunked path (cuBLAS GEMMs + per-row kernels)
instead: the logit tiles are plain ``tl.dot`` loops (no autotuning, no warp specialization), and
unlike cross-entropy's gradient this KL's ``ds`` is dense, so there is no block sparsity to skip:
the backward's atomics move ``N * d * V / BLOCK_V`` fp32 partial sums of ``dh`` (and the same
for ``dW``). That is fine up to mid-size problems and the kernel is exact, but at LLM scale
(N = 16k, d = 4096, V = 152k) the vendor-GEMM path is expected to be faster;
``benchmarks/gpu_fused_linear.py`` measures both.

Pointer offsets are int64 (``V * D`` overflows int32 for 152k x 8k heads). fp32 inputs use IEEE
(not TF32) products so fp32 results match the float64 reference at fp32 tolerances.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from lopd_kernels.fused_linear_topk_tail_kl import bucket_coefs

# Smallest float32 > -inf: the ranking key of a real entry whose logit is -inf, so that it still
# outranks an empty / already-taken slot (key -inf).
_NEG_BIG = -3.4028234663852886e38
# The same inside kernels (compiled kernels may only read constexpr globals).
NEG_BIG = tl.constexpr(_NEG_BIG)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; ``UPCAST`` feeds it fp32 operands.

    Triton's interpreter multiplies 16-bit float tiles as raw integers, so under
    ``TRITON_INTERPRET=1`` half-precision operands are upcast first; compiled kernels never are.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _logit_tile(
    H,
    W,
    B,
    rows,
    row_mask,
    cols,
    col_mask,
    D,
    stride_h,
    stride_w,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``(H[rows] @ W[cols]^T + B[cols]) / T`` as a ``[BLOCK_N, BLOCK_V]`` fp32 tile."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dm = (d0 + offs_d) < D
        h = tl.load(
            H + rows.to(tl.int64)[:, None] * stride_h + (d0 + offs_d)[None, :],
            mask=row_mask[:, None] & dm[None, :],
            other=0.0,
        )
        w = tl.load(
            W + cols.to(tl.int64)[:, None] * stride_w + (d0 + offs_d)[None, :],
            mask=col_mask[:, None] & dm[None, :],
            other=0.0,
        )
        acc += _dot(h, tl.trans(w), PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def _lse_update(m, acc, x):
    """Online log-sum-exp: fold the rows of ``x [BLOCK_N, K]`` into running ``(max m, sum acc)``.

    ``-inf`` entries (masked, or logits that are really -inf) add nothing; a row that has seen only
    ``-inf`` keeps ``m = -inf, l = 0`` (no ``-inf - -inf`` NaN).
    """
    m_new = tl.maximum(m, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
    return m_new, acc


@triton.jit
def _fwd_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    TGT,
    TOP_T,
    TOP_S,
    TOP_I,
    STATS,
    N,
    V,
    DS,
    DT,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    split_len,
    inv_temp,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    FULL: tl.constexpr,
    REVERSE: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (token block, vocabulary split): local top-M candidates and tail statistics.

    Writes ``TOP_T/TOP_S/TOP_I [N, splits, M_PAD]`` (teacher value, student value, id; id -1 for
    an empty slot) and ``STATS [N, splits, 8]``: (max, sum) of the student's and the teacher's
    tail, the target's student and teacher logits (0 when outside this split) and, with
    ``FULL``, the weighted sum of ``s - t`` (reverse) or ``t - s`` (forward) at the tail max.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(TGT + rows, mask=row_mask, other=-1)
    v_begin = pid_s * split_len
    v_end = tl.minimum(v_begin + split_len, V)

    slots = tl.arange(0, M_PAD)
    run_t = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
    run_s = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
    run_i = tl.full((BLOCK_N, M_PAD), -1, tl.int32)
    m_s = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_s = tl.zeros((BLOCK_N,), tl.float32)
    m_t = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_t = tl.zeros((BLOCK_N,), tl.float32)
    w_acc = tl.zeros((BLOCK_N,), tl.float32)
    tgt_s = tl.zeros((BLOCK_N,), tl.float32)
    tgt_t = tl.zeros((BLOCK_N,), tl.float32)

    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        s = _logit_tile(
            HS, WS, BS, rows, row_mask, cols, col_mask, DS, stride_hs, stride_ws, inv_temp,
            HAS_BS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
        )  # fmt: skip
        t = _logit_tile(
            HT, WT, BT, rows, row_mask, cols, col_mask, DT, stride_ht, stride_wt, inv_temp,
            HAS_BT, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST,
        )  # fmt: skip
        valid = row_mask[:, None] & col_mask[None, :]
        s = tl.where(valid, s, float("-inf"))
        t = tl.where(valid, t, float("-inf"))
        is_tgt = cols[None, :] == tgt[:, None]
        tgt_s += tl.sum(tl.where(is_tgt, s, 0.0), axis=1)
        tgt_t += tl.sum(tl.where(is_tgt, t, 0.0), axis=1)
        if FULL:
            # Full vocabulary: the "tail" is everything; w_acc carries sum exp(x - m) * diff.
            if REVERSE:
                m_new = tl.maximum(m_s, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                diff = tl.where(p > 0, p * (s - t), 0.0)
                w_acc = w_acc * tl.exp(m_s - m_safe) + tl.sum(diff, axis=1)
                m_t, l_t = _lse_update(m_t, l_t, t)
                m_s, l_s = _lse_update(m_s, l_s, s)
            else:
                m_new = tl.maximum(m_t, tl.max(t, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                q = tl.exp(t - m_safe[:, None])
                diff = tl.where(q > 0, q * (t - s), 0.0)
                w_acc = w_acc * tl.exp(m_t - m_safe) + tl.sum(diff, axis=1)
                m_s, l_s = _lse_update(m_s, l_s, s)
                m_t, l_t = _lse_update(m_t, l_t, t)
        else:
            avail_tile = valid
            # The running set is full once its last real slot holds an id; then only tiles with
            # an entry above some row's current M-th teacher value need a merge.
            kth = tl.min(tl.where(slots[None, :] < M, run_t, float("inf")), axis=1)
            full = tl.min(tl.where(slots[None, :] < M, run_i, 0), axis=1) >= 0
            need = tl.where(full, tl.max(t, axis=1) > kth, row_mask)
            if tl.max(need.to(tl.int32), axis=0) > 0:
                avail_run = run_i >= 0
                new_t = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
                new_s = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
                new_i = tl.full((BLOCK_N, M_PAD), -1, tl.int32)
                for k in range(M):
                    key_r = tl.where(avail_run, tl.maximum(run_t, NEG_BIG), float("-inf"))
                    key_c = tl.where(avail_tile, tl.maximum(t, NEG_BIG), float("-inf"))
                    best_r = tl.max(key_r, axis=1)
                    best_c = tl.max(key_c, axis=1)
                    arg_r = tl.argmax(key_r, axis=1)
                    arg_c = tl.argmax(key_c, axis=1)
                    # Ties go to the running set: it holds the smaller vocabulary ids.
                    from_c = best_c > best_r
                    found = tl.maximum(best_r, best_c) > float("-inf")
                    hit_r = (slots[None, :] == arg_r[:, None]) & (~from_c & found)[:, None]
                    hit_c = (cols[None, :] - v0 == arg_c[:, None]) & (from_c & found)[:, None]
                    val_t = tl.where(
                        from_c,
                        tl.max(tl.where(hit_c, t, float("-inf")), axis=1),
                        tl.max(tl.where(hit_r, run_t, float("-inf")), axis=1),
                    )
                    val_s = tl.where(
                        from_c,
                        tl.max(tl.where(hit_c, s, float("-inf")), axis=1),
                        tl.max(tl.where(hit_r, run_s, float("-inf")), axis=1),
                    )
                    val_i = tl.where(
                        from_c,
                        tl.max(tl.where(hit_c, cols[None, :], -1), axis=1),
                        tl.max(tl.where(hit_r, run_i, -1), axis=1),
                    )
                    put = (slots[None, :] == k) & found[:, None]
                    new_t = tl.where(put, val_t[:, None], new_t)
                    new_s = tl.where(put, val_s[:, None], new_s)
                    new_i = tl.where(put, val_i[:, None], new_i)
                    avail_run = avail_run & ~hit_r
                    avail_tile = avail_tile & ~hit_c
                # Evicted running entries join the tail.
                m_s, l_s = _lse_update(m_s, l_s, tl.where(avail_run, run_s, float("-inf")))
                m_t, l_t = _lse_update(m_t, l_t, tl.where(avail_run, run_t, float("-inf")))
                run_t = new_t
                run_s = new_s
                run_i = new_i
            # Tile entries not taken into the running set join the tail.
            m_s, l_s = _lse_update(m_s, l_s, tl.where(avail_tile, s, float("-inf")))
            m_t, l_t = _lse_update(m_t, l_t, tl.where(avail_tile, t, float("-inf")))

    rows64 = rows.to(tl.int64)
    base = (rows64 * n_splits + pid_s)[:, None] * M_PAD + slots[None, :]
    smask = row_mask[:, None] & (slots[None, :] < M_PAD)
    if not FULL:
        tl.store(TOP_T + base, run_t, mask=smask)
        tl.store(TOP_S + base, run_s, mask=smask)
        tl.store(TOP_I + base, run_i, mask=smask)
    st = STATS + (rows64 * n_splits + pid_s) * 8
    tl.store(st + 0, m_s, mask=row_mask)
    tl.store(st + 1, l_s, mask=row_mask)
    tl.store(st + 2, m_t, mask=row_mask)
    tl.store(st + 3, l_t, mask=row_mask)
    tl.store(st + 4, tgt_s, mask=row_mask)
    tl.store(st + 5, tgt_t, mask=row_mask)
    tl.store(st + 6, w_acc, mask=row_mask)


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
            part = _dot(x_lp, w, PRECISION, UPCAST)
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
            part = _dot(tl.trans(x_lp), h, PRECISION, UPCAST)
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
    M: tl.constexpr,
    FULL: tl.constexpr,
    REVERSE: tl.constexpr,
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

    ``ROWP [N, 8]`` per row: lse_s, lse_t, u_ls, u_t (= u_priv + u_lt), and with ``FULL`` u_kl and
    KL. ``COEF_S/COEF_T [N, M+1]``: the bucket coefficients (index M: the tail) such that
    ``ds_j = (S_j * COEF_S[b(j)] + u_ls 1[j = a]) / T`` and the same for ``dt``.
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
        kl = tl.load(rp + 5, mask=row_mask, other=0.0)
        g = log_s - log_t
        fin = (p_s > 0) & (p_t > 0)
        if REVERSE:
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


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _config(dtype: torch.dtype) -> dict:
    """Tile sizes: GPU-sized on a device, the smallest legal ``tl.dot`` tiles in the interpreter."""
    if _interpret():
        return {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_D": 16, "num_warps": 1}
    block_d = 64 if dtype == torch.float32 else 128
    return {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": block_d, "num_warps": 8}


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    return ("ieee" if dtype == torch.float32 else "tf32"), (
        _interpret() and dtype in (torch.float16, torch.bfloat16)
    )


def _lse_of(m: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``m + log(acc)``; ``-inf`` for an empty accumulator (``acc == 0``)."""
    return torch.where(acc > 0, m + acc.log(), torch.full_like(m, -math.inf))


def _pack(ws: torch.Tensor, wt: torch.Tensor, bs, bt):
    def c(x):
        return None if x is None else x.contiguous()

    return c(ws), c(wt), c(bs), c(bt)


def fused_linear_fwd_triton(hs, ws, bs, ht, wt, bt, target, top_m, temperature, reverse, ignore):
    """Launch the forward; same outputs as ``torch.ops.lopd.fused_linear_topk_tail_kl_fwd``."""
    n, vocab = hs.shape[0], ws.shape[0]
    m = 0 if top_m == 0 or top_m >= vocab else top_m
    dev = hs.device
    kl = torch.zeros(n, dtype=torch.float32, device=dev)
    lp_s, lp_t = torch.zeros_like(kl), torch.zeros_like(kl)
    ids = torch.zeros(n, m, dtype=torch.long, device=dev)
    lse = kl.new_zeros(n, 2)
    bucket = kl.new_zeros(n, 2, m + 1)
    rows = (target != ignore).nonzero().squeeze(-1)
    nv = rows.numel()
    if nv == 0:
        return kl, lp_s, lp_t, ids, lse, bucket
    h_s = hs.index_select(0, rows).contiguous()
    h_t = ht.index_select(0, rows).contiguous()
    tgt = target.index_select(0, rows).to(torch.int32).contiguous()
    ws, wt, bs, bt = _pack(ws, wt, bs, bt)
    cfg = _config(hs.dtype)
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    n_blocks, n_tiles = triton.cdiv(nv, bn), triton.cdiv(vocab, bv)
    if _interpret():
        splits = min(2, n_tiles)
    else:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = max(1, min(n_tiles, triton.cdiv(2 * sms, n_blocks)))
    split_len = triton.cdiv(n_tiles, splits) * bv
    splits = triton.cdiv(vocab, split_len)
    m_pad = max(1, triton.next_power_of_2(max(m, 1)))
    full = m == 0
    top_shape = (nv, splits, m_pad) if not full else (1,)
    top_t = torch.empty(top_shape, dtype=torch.float32, device=dev)
    top_s = torch.empty_like(top_t)
    top_i = torch.empty(top_shape, dtype=torch.int32, device=dev)
    stats = torch.zeros(nv, splits, 8, dtype=torch.float32, device=dev)
    precision, upcast = _precision(hs.dtype)
    _fwd_kernel[(n_blocks, splits)](
        h_s, ws, bs if bs is not None else ws, h_t, wt, bt if bt is not None else wt, tgt,
        top_t, top_s, top_i, stats, nv, vocab, h_s.shape[1], h_t.shape[1],
        h_s.stride(0), ws.stride(0), h_t.stride(0), wt.stride(0), split_len, 1.0 / temperature,
        M=max(m, 1), M_PAD=m_pad, FULL=full, REVERSE=reverse, HAS_BS=bs is not None,
        HAS_BT=bt is not None, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=cfg["BLOCK_D"],
        PRECISION=precision, UPCAST=upcast, num_warps=cfg["num_warps"],
    )  # fmt: skip
    out = _merge_splits(top_t, top_s, top_i, stats, m, reverse)
    for dst, src in zip((kl, lp_s, lp_t, ids, lse, bucket), out):
        dst.index_copy_(0, rows, src.to(dst.dtype))
    return kl, lp_s, lp_t, ids, lse, bucket


def _merge_splits(top_t, top_s, top_i, stats, m: int, reverse: bool):
    """Combine the per-split candidates and tails into the final per-row outputs (PyTorch)."""
    nv = stats.shape[0]
    tail_s_split = _lse_of(stats[..., 0], stats[..., 1])  # [n, splits]
    tail_t_split = _lse_of(stats[..., 2], stats[..., 3])
    tgt_s, tgt_t = stats[..., 4].sum(-1), stats[..., 5].sum(-1)
    if m == 0:
        lse_s = torch.logsumexp(tail_s_split, -1)
        lse_t = torch.logsumexp(tail_t_split, -1)
        # Each split's w is sum exp(x - m_split) * diff; rescale to the global lse and add.
        side = tail_s_split if reverse else tail_t_split
        m_split = stats[..., 0] if reverse else stats[..., 2]
        lse_side = lse_s if reverse else lse_t
        scale = torch.where(
            side > -math.inf, (m_split - lse_side.unsqueeze(-1)).exp(), torch.zeros_like(side)
        )
        mean_diff = (stats[..., 6] * scale).sum(-1)
        kl = mean_diff - (lse_s - lse_t) if reverse else mean_diff - (lse_t - lse_s)
        kl = kl.clamp_min(0.0)
        bucket = torch.zeros(nv, 2, 1, dtype=torch.float32, device=stats.device)
        ids = torch.empty(nv, 0, dtype=torch.long, device=stats.device)
    else:
        cand_t = top_t.flatten(1)
        cand_s = top_s.flatten(1)
        cand_i = top_i.flatten(1)
        real = cand_i >= 0
        key = torch.where(real, cand_t.clamp_min(_NEG_BIG), torch.full_like(cand_t, -math.inf))
        # Candidates are laid out by split (ascending ids) and, within a split, in extraction
        # order (ties already by ascending id): a stable sort gives ties to the lower id.
        sel = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :m]
        ids = cand_i.gather(-1, sel).long()
        top_tv, top_sv = cand_t.gather(-1, sel), cand_s.gather(-1, sel)
        left = real.clone()
        left.scatter_(-1, sel, False)
        ninf = torch.full_like(cand_t, -math.inf)
        tail_s = torch.logsumexp(
            torch.cat([tail_s_split, torch.where(left, cand_s, ninf)], -1), -1, keepdim=True
        )
        tail_t = torch.logsumexp(
            torch.cat([tail_t_split, torch.where(left, cand_t, ninf)], -1), -1, keepdim=True
        )
        all_s = torch.cat([top_sv, tail_s], -1)
        all_t = torch.cat([top_tv, tail_t], -1)
        lse_s = torch.logsumexp(all_s, -1)
        lse_t = torch.logsumexp(all_t, -1)
        logp = all_s - lse_s.unsqueeze(-1)
        logq = all_t - lse_t.unsqueeze(-1)
        a, b = (logp, logq) if reverse else (logq, logp)
        pa = a.exp()
        kl = (pa * torch.where(pa > 0, a - b, torch.zeros_like(a))).sum(-1)
        bucket = torch.stack([logp, logq], 1)
    lp_s, lp_t = tgt_s - lse_s, tgt_t - lse_t
    return kl, lp_s, lp_t, ids, torch.stack([lse_s, lse_t], -1), bucket


def fused_linear_bwd_triton(
    grad_kl, grad_slp, grad_tlp, hs, ws, bs, ht, wt, bt, target, topk_ids, kl, lse, bucket,
    temperature, reverse, ignore, needs, shared_weight,
):  # fmt: skip
    """Launch the backward; returns ``[d_hs, d_ws, d_bs, d_ht, d_wt, d_bt]`` (None if unneeded).

    Gradients accumulate in fp32 buffers (atomics) and are cast to the input dtypes at the end;
    with ``shared_weight`` both sides add into one weight buffer, returned in the student slot.
    """
    n_hs, n_ws, n_bs, n_ht, n_wt, n_bt = needs
    dev, vocab = hs.device, ws.shape[0]
    rows = (target != ignore).nonzero().squeeze(-1)
    nv = rows.numel()
    f32 = torch.float32
    d_ws = torch.zeros(ws.shape, dtype=f32, device=dev) if n_ws else None
    d_wt = (
        d_ws if shared_weight else (torch.zeros(wt.shape, dtype=f32, device=dev) if n_wt else None)
    )
    d_bs = torch.zeros(vocab, dtype=f32, device=dev) if n_bs else None
    d_bt = torch.zeros(vocab, dtype=f32, device=dev) if n_bt else None
    dh_s = torch.zeros(nv, hs.shape[1], dtype=f32, device=dev) if n_hs else None
    dh_t = torch.zeros(nv, ht.shape[1], dtype=f32, device=dev) if n_ht else None
    need_s, need_t = n_hs or n_ws or n_bs, n_ht or n_wt or n_bt
    if nv and (need_s or need_t):
        h_s = hs.index_select(0, rows).contiguous()
        h_t = ht.index_select(0, rows).contiguous()
        tgt = target.index_select(0, rows).to(torch.int32).contiguous()
        ws_c, wt_c, bs_c, bt_c = _pack(ws, wt, bs, bt)
        u_kl = grad_kl.index_select(0, rows).float()
        u_ls = grad_slp.index_select(0, rows).float()
        u_t = grad_tlp.index_select(0, rows).float()
        kl_v, lse_v = kl.index_select(0, rows), lse.index_select(0, rows)
        m = topk_ids.shape[1]
        rowp = torch.zeros(nv, 8, dtype=f32, device=dev)
        rowp[:, 0], rowp[:, 1], rowp[:, 2], rowp[:, 3] = lse_v[:, 0], lse_v[:, 1], u_ls, u_t
        if m == 0:
            rowp[:, 4], rowp[:, 5] = u_kl, kl_v
            c_s = c_t = rowp  # unused by the FULL kernel
            ids = tgt
        else:
            c_s, c_t = bucket_coefs(u_kl, kl_v, bucket.index_select(0, rows), reverse, u_ls, u_t)
            ids = topk_ids.index_select(0, rows).contiguous()
        cfg = _config(hs.dtype)
        bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
        precision, upcast = _precision(hs.dtype)
        dummy = rowp
        _bwd_kernel[(triton.cdiv(nv, bn), triton.cdiv(vocab, bv))](
            h_s, ws_c, bs_c if bs_c is not None else ws_c, h_t, wt_c,
            bt_c if bt_c is not None else wt_c, tgt, ids, rowp, c_s, c_t,
            dh_s if dh_s is not None else dummy, d_ws if d_ws is not None else dummy,
            d_bs if d_bs is not None else dummy, dh_t if dh_t is not None else dummy,
            d_wt if d_wt is not None else dummy, d_bt if d_bt is not None else dummy,
            nv, vocab, h_s.shape[1], h_t.shape[1], h_s.stride(0), ws_c.stride(0),
            h_t.stride(0), wt_c.stride(0), 1.0 / temperature,
            M=max(m, 1), FULL=m == 0, REVERSE=reverse, HAS_BS=bs is not None,
            HAS_BT=bt is not None, NEED_S=bool(need_s), NEED_T=bool(need_t),
            NEED_DHS=bool(n_hs), NEED_DWS=bool(n_ws), NEED_DBS=bool(n_bs), NEED_DHT=bool(n_ht),
            NEED_DWT=bool(n_wt), NEED_DBT=bool(n_bt), BLOCK_N=bn, BLOCK_V=bv,
            BLOCK_D=cfg["BLOCK_D"], PRECISION=precision, UPCAST=upcast,
            num_warps=cfg["num_warps"],
        )  # fmt: skip

    def scatter_rows(dh, like):
        if dh is None:
            return None
        return dh.new_zeros(like.shape).index_copy_(0, rows, dh).to(like.dtype)

    def cast(g, like):
        return None if g is None else g.to(like.dtype)

    return [
        scatter_rows(dh_s, hs),
        cast(d_ws, ws),
        cast(d_bs, ws),
        scatter_rows(dh_t, ht),
        None if shared_weight else cast(d_wt, wt),
        cast(d_bt, wt),
    ]
