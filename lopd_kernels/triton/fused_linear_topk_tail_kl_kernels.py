"""Triton kernels of the fused LM head + top-M/tail KL: the device code (launchers:
``lopd_kernels/triton/fused_linear_topk_tail_kl.py``; the op:
:mod:`lopd_kernels.fused_linear_topk_tail_kl`; the maths: ``docs/math.md``).

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

import triton
import triton.language as tl

from lopd_kernels.triton._common import NEG_BIG_C, dot


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
        acc += dot(h, tl.trans(w), PRECISION, UPCAST)
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
                    key_r = tl.where(avail_run, tl.maximum(run_t, NEG_BIG_C), float("-inf"))
                    key_c = tl.where(avail_tile, tl.maximum(t, NEG_BIG_C), float("-inf"))
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
