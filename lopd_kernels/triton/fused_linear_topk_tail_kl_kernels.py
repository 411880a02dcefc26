"""Triton kernels of the fused LM head + top-M/tail divergence: the forward device code (the
backward: ``lopd_kernels/triton/fused_linear_topk_tail_kl_kernels_bwd.py``; launchers:
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

Supports (``SUPPORT``): the student's top-M is the same merge keyed on the student tile (the
roles swapped; the candidates keep their teacher / student value slots). The union keeps both
running sets in the same pass over the tiles (the teacher's merged first, then the student's):
an entry joins the tails only once it is in neither. An evicted entry's membership in the other
set needs no search: a set is exactly the top-M (by value, ties to the lower id) of the split's
entries seen so far, so the test is a comparison with that set's M-th entry
(:func:`_set_floor`, :func:`_in_set`). Each split then writes both candidate lists;
``_merge_splits`` selects both global top-Ms and folds every other candidate into the tail once.
Cost over the teacher's support: the second set's registers and merges (at most twice the merge
work, tile GEMMs unchanged). The JSD (``DIV == 2``) is finalized from the K + 1 bucket masses;
over the full vocabulary it needs both normalizers inside every term, so a second pass
(:func:`_jsd_full_kernel`, the logit tiles recomputed) sums ``KL(P || M)`` and ``KL(Q || M)``
once the log-sum-exps are known.

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
from lopd_kernels.triton.topk_tail_kl_device import _jsd_log_mixture, _kl_to_mixture


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
def _set_floor(run_v, run_i, slots, M: tl.constexpr):
    """The M-th entry of running sets ``[BLOCK_N, M_PAD]`` (value ``run_v``, id ``run_i``; -1:
    empty): ``(value, id, full)`` per row, ``value`` clamped at NEG_BIG as the merge ranks
    (ties: the highest id among the lowest values)."""
    real = (slots[None, :] < M) & (run_i >= 0)
    key = tl.where(real, tl.maximum(run_v, NEG_BIG_C), float("inf"))
    kv = tl.min(key, axis=1)
    kid = tl.max(tl.where(real & (key == kv[:, None]), run_i, -1), axis=1)
    full = tl.sum(real.to(tl.int32), axis=1) == M
    return kv, kid, full


@triton.jit
def _in_set(val, idx, kv, kid, full):
    """Whether entries ``(val, idx)`` ``[BLOCK_N, X]`` are in the running set whose floor is
    ``_set_floor``'s ``(kv, kid, full)``: the set holds the top-M of the entries seen so far
    (every one while not full)."""
    c = tl.maximum(val, NEG_BIG_C)
    above = (c > kv[:, None]) | ((c == kv[:, None]) & (idx <= kid[:, None]))
    return (~full)[:, None] | above


@triton.jit
def _merge_tile(
    run_k,
    run_o,
    run_i,
    k_tile,
    o_tile,
    cols,
    v0,
    valid,
    slots,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Merge a tile into a running top-M by M arg-max extractions over (running set u tile).

    ``run_k``/``run_o``/``run_i`` ``[BLOCK_N, M_PAD]``: the set's ranking-side values, its other
    side's values and its ids; ``k_tile``/``o_tile`` ``[BLOCK_N, BLOCK_V]``: the tile's (``-inf``
    where not ``valid``). Returns the new set and ``(evicted, left)``: old members that left the
    set, tile entries not taken into it.
    """
    avail_run = run_i >= 0
    avail_tile = valid
    new_k = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
    new_o = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
    new_i = tl.full((BLOCK_N, M_PAD), -1, tl.int32)
    for k in range(M):
        key_r = tl.where(avail_run, tl.maximum(run_k, NEG_BIG_C), float("-inf"))
        key_c = tl.where(avail_tile, tl.maximum(k_tile, NEG_BIG_C), float("-inf"))
        best_r = tl.max(key_r, axis=1)
        best_c = tl.max(key_c, axis=1)
        arg_r = tl.argmax(key_r, axis=1)
        arg_c = tl.argmax(key_c, axis=1)
        # Ties go to the running set: it holds the smaller vocabulary ids.
        from_c = best_c > best_r
        found = tl.maximum(best_r, best_c) > float("-inf")
        hit_r = (slots[None, :] == arg_r[:, None]) & (~from_c & found)[:, None]
        hit_c = (cols[None, :] - v0 == arg_c[:, None]) & (from_c & found)[:, None]
        val_k = tl.where(
            from_c,
            tl.max(tl.where(hit_c, k_tile, float("-inf")), axis=1),
            tl.max(tl.where(hit_r, run_k, float("-inf")), axis=1),
        )
        val_o = tl.where(
            from_c,
            tl.max(tl.where(hit_c, o_tile, float("-inf")), axis=1),
            tl.max(tl.where(hit_r, run_o, float("-inf")), axis=1),
        )
        val_i = tl.where(
            from_c,
            tl.max(tl.where(hit_c, cols[None, :], -1), axis=1),
            tl.max(tl.where(hit_r, run_i, -1), axis=1),
        )
        put = (slots[None, :] == k) & found[:, None]
        new_k = tl.where(put, val_k[:, None], new_k)
        new_o = tl.where(put, val_o[:, None], new_o)
        new_i = tl.where(put, val_i[:, None], new_i)
        avail_run = avail_run & ~hit_r
        avail_tile = avail_tile & ~hit_c
    return new_k, new_o, new_i, avail_run, avail_tile


@triton.jit
def _merge_needed(run_k, run_i, k_tile, row_mask, slots, M: tl.constexpr):
    """Whether some row needs a merge: its set is not full yet, or the tile holds a value above
    its current M-th (once full, almost no tile does)."""
    kth = tl.min(tl.where(slots[None, :] < M, run_k, float("inf")), axis=1)
    full = tl.min(tl.where(slots[None, :] < M, run_i, 0), axis=1) >= 0
    need = tl.where(full, tl.max(k_tile, axis=1) > kth, row_mask)
    return tl.max(need.to(tl.int32), axis=0) > 0


@triton.jit
def _update_tile(
    run_k,
    run_o,
    run_i,
    k_tile,
    o_tile,
    cols,
    v0,
    valid,
    row_mask,
    slots,
    m_k,
    l_k,
    m_o,
    l_o,
    o_kv,
    o_kid,
    o_full,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNION: tl.constexpr,
):
    """Merge a tile into a running set where some row needs it and fold the set's evicted
    entries into the tails ``(m_k, l_k)`` (ranking side), ``(m_o, l_o)`` (other side); with
    ``UNION`` only those the other set (floor ``o_kv, o_kid, o_full``, :func:`_set_floor`) does
    not hold. Returns ``(run_k, run_o, run_i, left, m_k, l_k, m_o, l_o)``, ``left``: the tile
    entries not taken into the set."""
    left = valid
    need = _merge_needed(run_k, run_i, k_tile, row_mask, slots, M)
    if need:
        new_k, new_o, new_i, evicted, left = _merge_tile(
            run_k, run_o, run_i, k_tile, o_tile, cols, v0, valid, slots, M, M_PAD, BLOCK_N
        )
        if UNION:
            evicted = evicted & ~_in_set(run_o, run_i, o_kv, o_kid, o_full)
        # Evicted running entries join the tail.
        m_o, l_o = _lse_update(m_o, l_o, tl.where(evicted, run_o, float("-inf")))
        m_k, l_k = _lse_update(m_k, l_k, tl.where(evicted, run_k, float("-inf")))
        run_k = new_k
        run_o = new_o
        run_i = new_i
    return run_k, run_o, run_i, left, m_k, l_k, m_o, l_o


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
    DIV: tl.constexpr,  # FULL only: 0 reverse KL, 1 forward KL, 2 JSD (log-sum-exps only)
    SUPPORT: tl.constexpr,  # 0 teacher, 1 student, 2 union
    SETS: tl.constexpr,  # running sets: 2 for the union, else 1
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (token block, vocabulary split): local top-M candidates and tail statistics.

    Writes ``TOP_T/TOP_S/TOP_I [N, splits, W]`` (teacher value, student value, id; id -1 for
    an empty slot; ``W = M_PAD``, or ``2 M_PAD`` for the union: the teacher's set, then the
    student's) and ``STATS [N, splits, 8]``: (max, sum) of the student's and the teacher's
    tail, the target's student and teacher logits (0 when outside this split) and, with
    ``FULL`` and a KL, the weighted sum of ``s - t`` (reverse) or ``t - s`` (forward) at the
    tail max.
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
    if SUPPORT == 2:
        # The union's second set: the student's top-M (student values, teacher values, ids).
        run2_s = run_s
        run2_t = run_t
        run2_i = run_i
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
            if DIV == 0:
                m_new = tl.maximum(m_s, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                diff = tl.where(p > 0, p * (s - t), 0.0)
                w_acc = w_acc * tl.exp(m_s - m_safe) + tl.sum(diff, axis=1)
                m_t, l_t = _lse_update(m_t, l_t, t)
                m_s, l_s = _lse_update(m_s, l_s, s)
            elif DIV == 1:
                m_new = tl.maximum(m_t, tl.max(t, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                q = tl.exp(t - m_safe[:, None])
                diff = tl.where(q > 0, q * (t - s), 0.0)
                w_acc = w_acc * tl.exp(m_t - m_safe) + tl.sum(diff, axis=1)
                m_s, l_s = _lse_update(m_s, l_s, s)
                m_t, l_t = _lse_update(m_t, l_t, t)
            else:
                # The JSD: log-sum-exps here, its terms in _jsd_full_kernel once they are known.
                m_s, l_s = _lse_update(m_s, l_s, s)
                m_t, l_t = _lse_update(m_t, l_t, t)
        else:
            # The running set is full once its last real slot holds an id; then only tiles with
            # an entry above some row's current M-th value need a merge.
            if SUPPORT == 1:
                run_s, run_t, run_i, left, m_s, l_s, m_t, l_t = _update_tile(
                    run_s, run_t, run_i, s, t, cols, v0, valid, row_mask, slots, m_s, l_s, m_t,
                    l_t, m_s, run_i, row_mask, M, M_PAD, BLOCK_N, False,
                )  # fmt: skip
            elif SUPPORT == 2:
                # The teacher's set first (against the student's set before this tile), then
                # the student's (against the teacher's after it).
                kv, kid, full = _set_floor(run2_s, run2_i, slots, M)
                run_t, run_s, run_i, left, m_t, l_t, m_s, l_s = _update_tile(
                    run_t, run_s, run_i, t, s, cols, v0, valid, row_mask, slots, m_t, l_t, m_s,
                    l_s, kv, kid, full, M, M_PAD, BLOCK_N, True,
                )  # fmt: skip
                kv, kid, full = _set_floor(run_t, run_i, slots, M)
                run2_s, run2_t, run2_i, left2, m_s, l_s, m_t, l_t = _update_tile(
                    run2_s, run2_t, run2_i, s, t, cols, v0, valid, row_mask, slots, m_s, l_s,
                    m_t, l_t, kv, kid, full, M, M_PAD, BLOCK_N, True,
                )  # fmt: skip
                left = left & left2
            else:
                run_t, run_s, run_i, left, m_t, l_t, m_s, l_s = _update_tile(
                    run_t, run_s, run_i, t, s, cols, v0, valid, row_mask, slots, m_t, l_t, m_s,
                    l_s, m_t, run_i, row_mask, M, M_PAD, BLOCK_N, False,
                )  # fmt: skip
            # Tile entries not taken into a running set join the tail.
            m_s, l_s = _lse_update(m_s, l_s, tl.where(left, s, float("-inf")))
            m_t, l_t = _lse_update(m_t, l_t, tl.where(left, t, float("-inf")))

    rows64 = rows.to(tl.int64)
    base = (rows64 * n_splits + pid_s)[:, None] * (SETS * M_PAD) + slots[None, :]
    smask = row_mask[:, None] & (slots[None, :] < M_PAD)
    if not FULL:
        tl.store(TOP_T + base, run_t, mask=smask)
        tl.store(TOP_S + base, run_s, mask=smask)
        tl.store(TOP_I + base, run_i, mask=smask)
        if SUPPORT == 2:
            tl.store(TOP_T + M_PAD + base, run2_t, mask=smask)
            tl.store(TOP_S + M_PAD + base, run2_s, mask=smask)
            tl.store(TOP_I + M_PAD + base, run2_i, mask=smask)
    st = STATS + (rows64 * n_splits + pid_s) * 8
    tl.store(st + 0, m_s, mask=row_mask)
    tl.store(st + 1, l_s, mask=row_mask)
    tl.store(st + 2, m_t, mask=row_mask)
    tl.store(st + 3, l_t, mask=row_mask)
    tl.store(st + 4, tgt_s, mask=row_mask)
    tl.store(st + 5, tgt_t, mask=row_mask)
    tl.store(st + 6, w_acc, mask=row_mask)


@triton.jit
def _jsd_full_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    LSE,
    OUT,
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
    log_1mb,
    log_b,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The full-vocabulary JSD's second pass, one (token block, vocabulary split): with the
    rows' log-sum-exps ``LSE [N, 2]`` known, ``OUT [N, splits, 2]`` gets this split's shares of
    ``K_P = sum_j S_j log(S_j / M_j)`` and ``K_Q = sum_j T_j log(T_j / M_j)``,
    ``M_j = (1 - beta) S_j + beta T_j`` (the forward's ``JSD = beta K_Q + (1 - beta) K_P``; the
    backward's per-entry factors need both)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    lse_s = tl.load(LSE + rows64 * 2, mask=row_mask, other=0.0)
    lse_t = tl.load(LSE + rows64 * 2 + 1, mask=row_mask, other=0.0)
    v_begin = pid_s * split_len
    v_end = tl.minimum(v_begin + split_len, V)
    k_p = tl.zeros((BLOCK_N,), tl.float32)
    k_q = tl.zeros((BLOCK_N,), tl.float32)
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
        lp = tl.where(valid, s - lse_s[:, None], float("-inf"))
        lq = tl.where(valid, t - lse_t[:, None], float("-inf"))
        lm = _jsd_log_mixture(lp, lq, log_1mb, log_b)
        k_p += tl.sum(_kl_to_mixture(lp, lm), axis=1)
        k_q += tl.sum(_kl_to_mixture(lq, lm), axis=1)
    out = OUT + (rows64 * tl.num_programs(1) + pid_s) * 2
    tl.store(out, k_p, mask=row_mask)
    tl.store(out + 1, k_q, mask=row_mask)
