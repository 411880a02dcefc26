"""Triton kernels of ``topk_tail_kl`` (top-M + tail-bucket KL + privilege): the device code.

The maths is ``docs/math.md``; the launchers (argument checks, grids, launch defaults) are
``lopd_kernels/triton/topk_tail_kl.py``, which ``lopd_kernels/topk_tail_kl.py`` registers as
``torch.ops.lopd.topk_tail_kl_triton_fwd`` / ``..._bwd``.

Design (one program per row, int64 row offsets, float32 math whatever the input dtype):

* **Rows in place**: the logits are ``[N, V]`` with any row stride or ``[B, L, V]`` with any
  item and position strides (``logits[:, :-1]`` of a causal LM, which no 2-D view covers);
  row ``r`` starts at ``(r // L) * stride_b + (r % L) * stride_row``. Only the vocabulary axis
  must be dense: nothing is copied.

* **Forward, top-M** (``top_m >= 1``): a single streaming pass over the vocabulary in blocks of
  ``BLOCK_V`` reads each logit once. It keeps

  - the running top-M of the teacher as packed int64 *keys* (below), an unsorted set whose
    minimum ``thr`` is the current M-th largest key;
  - two running base-2 log-sum-exps, student and teacher, over the **complement** of the running
    top-M (the tail), each with its own maximum, so the tail is exact to float32 rounding however
    little mass it holds (``docs/math.md``: never ``1 - sum`` nor ``log1mexp``).

  Per block (the next block's loads already in flight): if the block's teacher maximum is below
  the M-th value, no entry can enter the top-M and the whole block is folded into the tail (the
  common case once the threshold has settled; this path does no integer work at all). Otherwise
  the block's keys are built and the top-M is updated in one of two ways:

  - *sequential inserts* (few candidates): the largest remaining candidate replaces the set's
    minimum, until none beats it. The evicted entry is folded into the tail (teacher value
    decoded from its key, student logit re-read by index: one scalar load). Candidates go in
    descending order, so the inserted ones are exactly the block keys ``>= lowest inserted``;
  - *bitonic merge* (many candidates, compiled in for M > 64 only, see ``_FWD_BULK_TOP_M``): the
    running top-M and the block's own top-MP are merged with ``tl.topk``; old members below the
    new M-th key are folded into the tail (M masked gathers), block keys below it too.

  Every other block entry joins the tail. The full log-sum-exps are ``logaddexp(tail, top-M)``
  at the end, so the streaming loop costs two ``exp2`` per vocabulary entry, not four.

* **Forward, full vocabulary** (``top_m == 0``): online log-sum-exp of both sides plus an online
  ``sum_j 2^(y_j - r) * d_j`` accumulator for the KL, with ``d_j`` measured from the running
  maxima so that ``KL = E[d] - log l_s + log l_t`` never subtracts two large numbers.

* **Backward**: one streaming pass that writes, for every j, the *tail* formula
  ``ds_j = (S_j / P_tail) * A_tail + [j = target] * u_ls / T`` (same for the teacher; the
  bucket-normalized form never overflows, see ``_bucket_grads``), then a fix-up that overwrites
  the M top-M entries with their own single-entry bucket gradients (M scatters, after a block
  barrier so they land last; no logit is re-read). Full-vocabulary rows use the per-entry
  formulas of ``docs/math.md`` directly.

Packed keys: ``key = (mono(t) << 32) | (0x7FFFFFFF - j)`` where ``mono`` maps the float32 bits
of the teacher logit to an int32 with the same order (flip the magnitude bits of negatives).
Keys are unique; a larger key means a larger value or, on a tie, a lower index (the reference's
rule), and one int64 max/min carries the index along with the value. Value and index are
recovered from a key exactly. ``topk_ids`` come out sorted by descending teacher logit.

Cost: on top of the stream, about ``M * (1 + ln(V / BLOCK_V))`` sequential block reductions per
row when the vocabulary order is random w.r.t. the teacher, M + 1 of them in the first block
(simulated for M = 20, V = 151,936, BLOCK_V = 2048: ~130 on i.i.d. logits, ~22 when high
logits cluster at low ids as in frequency-ordered BPE vocabularies).

Limits: ``1 <= top_m <= min(V, 256)`` or ``top_m == 0``; ``V < 2**30``.
Out-of-range targets (neither in ``[0, V)`` nor ``ignore_index``) are not validated here (that
would sync the device; the public API validates): their log-probs come out NaN, loudly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import LN2_C, LOG2E_C

# Triton reads globals only as constexpr.
_LOG2E = LOG2E_C
_LN2 = LN2_C
# Empty slot of the running top-M: below every real key (a real key's high word is at least
# mono(-inf) = -0x7F800001 > INT32_MIN), so any real entry replaces it.
_KEY_EMPTY = tl.constexpr(-(2**63))
# Padding slots (index >= M of the power-of-two register vector): above every real key, so
# they are never the minimum and never evicted.
_KEY_PAD = tl.constexpr(2**63 - 1)


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _sortable_key(t, idx):
    """Pack float32 teacher logits ``t`` and their int32 vocabulary indices into int64 keys.

    Args:
        t: float32 values (any shape).
        idx: int32 indices in ``[0, 2^31)``, same shape.

    Returns:
        int64 keys ordered like ``(t, -idx)``: the larger value wins, on a tie the lower index.
    """
    u = t.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flipping their 31 magnitude bits fixes that
    # (the map is its own inverse, see _key_value).
    mono = u ^ ((u >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 teacher logit packed in ``key`` (exact inverse of ``_sortable_key``)."""
    mono = (key >> 32).to(tl.int32)
    u = mono ^ ((mono >> 31) & 0x7FFFFFFF)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key):
    """The int32 vocabulary index packed in ``key``."""
    return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _safe_ref(m):
    """Reference point for exponentials: the running max, or 0 while it is still ``-inf``.

    Using 0 keeps ``exp2(-inf - ref)`` at 0 instead of ``exp2(-inf + inf) = NaN`` for rows (or
    tails) that hold only ``-inf`` so far.
    """
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _lse_fold(m, total, y):
    """Fold a block ``y`` (float32 [B], base-2 units, ``-inf`` = absent) into ``(m, total)``.

    ``(m, total)`` is an online base-2 log-sum-exp: ``lse2 = _safe_ref(m) + log2(total)``.
    """
    m_new = tl.maximum(m, tl.max(y, 0))
    ref = _safe_ref(m_new)
    total = total * tl.exp2(m - ref) + tl.sum(tl.exp2(y - ref), 0)
    return m_new, total


@triton.jit
def _lse_fold_scalar(m, total, y):
    """``_lse_fold`` for a single scalar ``y``."""
    m_new = tl.maximum(m, y)
    ref = _safe_ref(m_new)
    total = total * tl.exp2(m - ref) + tl.exp2(y - ref)
    return m_new, total


@triton.jit
def _kl_terms(a, b):
    """Bucketwise ``exp(a) * (a - b)`` for natural log-masses ``a``, ``b``.

    A zero-mass bucket (``a = -inf``) contributes 0 (never ``0 * inf``); positive mass against
    ``b = -inf`` is a genuinely infinite KL and gives ``+inf``, also when ``exp(a)`` underflows.
    """
    return tl.where(
        a == float("-inf"), 0.0, tl.where(b == float("-inf"), float("inf"), tl.exp(a) * (a - b))
    )


@triton.jit
def _bucket_grads(lp, lq, kl, u_kl, u_ls, u_lt, inv_t, REVERSE: tl.constexpr):
    """Per-bucket gradients ``A_b``, ``B_b`` (``docs/math.md``; divided by T), bucket-normalized.

    For an entry j of bucket b: ``ds_j = (S_j / P_b) * A_b + [j = a] u_ls / T`` and
    ``dt_j = (T_j / Q_b) * B_b + [j = a] u_lt / T``. A top-M bucket holds one entry
    (``S_j / P_b = 1``): ``A_b``, ``B_b`` are its gradients. Normalizing by the bucket mass keeps
    every factor finite: ``S_j * Q_b / P_b`` (forward KL) becomes ``(S_j / P_b) * Q_b``, where
    the ratio ``Q_b / P_b`` alone overflows float32 once the student gives the bucket e^-88 of
    the teacher's mass.

    Args:
        lp, lq: natural log-masses ``log P_b``, ``log Q_b`` (same shape, any).
        kl: the row's KL (reverse or forward, matching ``REVERSE``).
        u_kl, u_ls, u_lt: upstream gradients of kl, student and teacher log-probs.
        inv_t: 1 / temperature.
    """
    p = tl.exp(lp)
    q = tl.exp(lq)
    if REVERSE:
        # d/ds_j = S_j (g_b - KL); d/dt_j = T_j (1 - P_b / Q_b) = (T_j / Q_b) (Q_b - P_b).
        g = tl.where(p > 0.0, lp - lq, 0.0)  # a zero-mass bucket contributes 0, not 0 * inf
        a = p * (u_kl * (g - kl) - u_ls)
        b = u_kl * (q - p) - u_lt * q
    else:
        # d/ds_j = S_j (1 - Q_b / P_b) = (S_j / P_b) (P_b - Q_b); d/dt_j = T_j (h_b - F).
        h = tl.where(q > 0.0, lq - lp, 0.0)
        a = u_kl * (p - q) - u_ls * p
        b = q * (u_kl * (h - kl) - u_lt)
    return a * inv_t, b * inv_t


# --------------------------------------------------------------------------------------------
# Forward kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_topm_kernel(
    s_ptr,  # [N, V] or [B, L, V] student logits (strided rows, unit column stride)
    t_ptr,  # the same for the teacher
    tgt_ptr,  # [N] int64 targets
    kl_ptr,  # [N] fp32 out
    slp_ptr,  # [N] fp32 out: student log-prob of the target
    tlp_ptr,  # [N] fp32 out: teacher log-prob of the target
    ids_ptr,  # [N, M] int64 out: teacher top-M ids, by descending teacher logit
    lse_ptr,  # [N, 2] fp32 out: natural log-sum-exp of student / T and teacher / T
    blp_ptr,  # [N, 2, M + 1] fp32 out: log P_b, log Q_b; b = M is the tail
    V,
    L,  # rows per batch item: row r is item r // L, position r % L ([B, L, V] inputs; else N)
    stride_sb,  # student item stride (0 for [N, V] inputs)
    stride_s,  # student row stride
    stride_tb,
    stride_t,
    scale2,  # log2(e) / T: logits -> base-2 log-space
    ignore_index,
    M: tl.constexpr,
    MP: tl.constexpr,  # power of two >= max(M, 2): register width of the running top-M
    BLOCK_V: tl.constexpr,  # >= MP
    REVERSE: tl.constexpr,
    BULK: tl.constexpr,  # whether blocks with many candidates use the bitonic merge
    BULK_MIN: tl.constexpr,  # "many": more than this; fewer go through sequential inserts
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + (row // L) * stride_sb + (row % L) * stride_s
    t_row = t_ptr + (row // L) * stride_tb + (row % L) * stride_t
    ids_row = ids_ptr + row * M
    blp_row = blp_ptr + row * (2 * (M + 1))
    slot = tl.arange(0, MP)
    valid = slot < M
    tgt = tl.load(tgt_ptr + row)

    if tgt == ignore_index:
        # Ignored rows: every output 0, and no pass over the logits.
        tl.store(kl_ptr + row, 0.0)
        tl.store(slp_ptr + row, 0.0)
        tl.store(tlp_ptr + row, 0.0)
        tl.store(lse_ptr + row * 2 + tl.arange(0, 2), tl.zeros([2], tl.float32))
        tl.store(ids_row + slot, tl.zeros([MP], tl.int64), mask=valid)
        tl.store(blp_row + slot, tl.zeros([MP], tl.float32), mask=slot < M + 1)
        tl.store(blp_row + (M + 1) + slot, tl.zeros([MP], tl.float32), mask=slot < M + 1)
        tl.store(blp_row + M, 0.0)
        tl.store(blp_row + (2 * M + 1), 0.0)
    else:
        top = tl.where(valid, tl.full([MP], _KEY_EMPTY, tl.int64), _KEY_PAD)
        thr = tl.min(top, 0)  # M-th largest key so far (EMPTY until M entries were seen)
        thr_val = tl.full([], float("-inf"), tl.float32)  # its teacher logit (-inf when EMPTY)
        ms = tl.full([], float("-inf"), tl.float32)  # student tail: max, sum of 2^(y - max)
        ls = tl.zeros([], tl.float32)
        mt = tl.full([], float("-inf"), tl.float32)  # teacher tail
        lt = tl.zeros([], tl.float32)
        # Manual software pipelining: the next block's loads are in flight while this block is
        # processed (Triton does not pipeline loads in a loop with data-dependent control flow).
        lanes = tl.arange(0, BLOCK_V)
        s_next = tl.load(s_row + lanes, mask=lanes < V, other=float("-inf"))
        t_next = tl.load(t_row + lanes, mask=lanes < V, other=float("-inf"))
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            inb = offs < V
            s = s_next.to(tl.float32)
            t = t_next.to(tl.float32)
            s_next = tl.load(s_row + BLOCK_V + offs, mask=offs + BLOCK_V < V, other=float("-inf"))
            t_next = tl.load(t_row + BLOCK_V + offs, mask=offs + BLOCK_V < V, other=float("-inf"))
            t_max = tl.max(t, 0)
            if t_max >= thr_val:
                # Some entry may beat the M-th key.
                key = tl.where(inb, _sortable_key(t, offs), _KEY_EMPTY)
                if BULK:
                    bulk = tl.sum((key > thr).to(tl.int32), 0) > BULK_MIN
                else:
                    bulk = False  # compiled out: no bitonic network, fewer registers
                if bulk:
                    # Many candidates (the first block, or a rising stretch): one bitonic merge
                    # of the running top-M with the block's top-MP, in parallel.
                    old = tl.where(valid, top, _KEY_EMPTY)
                    merged = tl.topk(tl.reshape(tl.join(old, tl.topk(key, MP)), [2 * MP]), MP)
                    thr = tl.min(tl.where(valid, merged, _KEY_PAD), 0)
                    # Old members now below the M-th key leave for good: fold them into the
                    # tails (student logits re-read by index, teacher decoded from the key).
                    evicted = valid & (old != _KEY_EMPTY) & (old < thr)
                    e_s = tl.load(s_row + _key_index(old), mask=evicted, other=float("-inf"))
                    e_t = tl.where(evicted, _key_value(old), float("-inf"))
                    ms, ls = _lse_fold(ms, ls, e_s.to(tl.float32) * scale2)
                    mt, lt = _lse_fold(mt, lt, e_t * scale2)
                    top = tl.where(valid, merged, _KEY_PAD)
                    # The new top-M is exactly the keys >= thr of old and block together.
                    lowest = thr
                else:
                    # A few candidates: insert them largest first, each replacing the minimum.
                    kmax = tl.max(key, 0)
                    lowest = tl.full([], _KEY_PAD, tl.int64)  # smallest key inserted here
                    while kmax > thr:
                        top = tl.where(slot == tl.argmin(top, 0), kmax, top)
                        # The evicted key (the old minimum) leaves the top-M for good. Nothing
                        # is evicted while slots are EMPTY.
                        evicted = thr != _KEY_EMPTY
                        e_s = tl.load(s_row + _key_index(thr), mask=evicted, other=float("-inf"))
                        e_t = tl.where(evicted, _key_value(thr), float("-inf"))
                        ms, ls = _lse_fold_scalar(ms, ls, e_s.to(tl.float32) * scale2)
                        mt, lt = _lse_fold_scalar(mt, lt, e_t * scale2)
                        thr = tl.min(top, 0)
                        lowest = kmax
                        kmax = tl.max(tl.where(key < kmax, key, _KEY_EMPTY), 0)
                    # Descending order: the inserted entries are exactly the block keys >=
                    # lowest, and none of them was evicted again within the block.
                thr_val = tl.where(thr == _KEY_EMPTY, float("-inf"), _key_value(thr))
                in_tail = key < lowest
                ys = tl.where(in_tail, s * scale2, float("-inf"))
                yt = tl.where(in_tail, t * scale2, float("-inf"))
            else:
                ys = s * scale2
                yt = t * scale2
            ms, ls = _lse_fold(ms, ls, ys)
            mt, lt = _lse_fold(mt, lt, yt)

        # Sort the final top-M (descending teacher logit, like torch.topk) and gather its M
        # student logits; the teacher logits are decoded from the keys.
        top = tl.sort(tl.where(valid, top, _KEY_EMPTY), descending=True)
        ids = tl.where(valid, _key_index(top), 0)
        yt_top = tl.where(valid, _key_value(top), float("-inf")) * scale2
        ys_top = tl.load(s_row + ids, mask=valid, other=float("-inf")).to(tl.float32) * scale2
        # Log-masses relative to the running maxima: ``(y - ref) - log2(l)`` rounds at the
        # magnitude of the result, where ``y - lse2`` would round at that of the logits (|s/T|
        # ~ 50 costs ~4e-6 absolute in float32 before the subtraction even starts).
        tail_ref_s = _safe_ref(ms)
        tail_ref_t = _safe_ref(mt)
        tail_log_s = tl.log2(ls)  # -inf for an empty tail (M == V): a zero-mass bucket
        tail_log_t = tl.log2(lt)
        ms, ls = _lse_fold(ms, ls, ys_top)
        mt, lt = _lse_fold(mt, lt, yt_top)
        ref_s = _safe_ref(ms)
        ref_t = _safe_ref(mt)
        log_ls = tl.log2(ls)
        log_lt = tl.log2(lt)

        lp = ((ys_top - ref_s) - log_ls) * _LN2
        lq = ((yt_top - ref_t) - log_lt) * _LN2
        lp_tail = ((tail_ref_s - ref_s) + (tail_log_s - log_ls)) * _LN2
        lq_tail = ((tail_ref_t - ref_t) + (tail_log_t - log_lt)) * _LN2
        if REVERSE:
            kl = tl.sum(_kl_terms(lp, lq), 0) + _kl_terms(lp_tail, lq_tail)
        else:
            kl = tl.sum(_kl_terms(lq, lp), 0) + _kl_terms(lq_tail, lp_tail)

        tgt_ok = (tgt >= 0) & (tgt < V)
        s_a = tl.load(s_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
        t_a = tl.load(t_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
        tl.store(kl_ptr + row, kl)
        tl.store(slp_ptr + row, ((s_a * scale2 - ref_s) - log_ls) * _LN2)
        tl.store(tlp_ptr + row, ((t_a * scale2 - ref_t) - log_lt) * _LN2)
        tl.store(lse_ptr + row * 2, (ref_s + log_ls) * _LN2)
        tl.store(lse_ptr + row * 2 + 1, (ref_t + log_lt) * _LN2)
        tl.store(ids_row + slot, ids.to(tl.int64), mask=valid)
        tl.store(blp_row + slot, lp, mask=valid)
        tl.store(blp_row + M, lp_tail)
        tl.store(blp_row + (M + 1) + slot, lq, mask=valid)
        tl.store(blp_row + (2 * M + 1), lq_tail)


@triton.jit
def _fwd_full_kernel(
    s_ptr,  # [N, V] student logits
    t_ptr,  # [N, V] teacher logits
    tgt_ptr,  # [N] int64 targets
    kl_ptr,  # [N] fp32 out
    slp_ptr,  # [N] fp32 out
    tlp_ptr,  # [N] fp32 out
    lse_ptr,  # [N, 2] fp32 out
    blp_ptr,  # [N, 2, 1] fp32 out: 0, 0 (the single bucket, the whole vocabulary, has mass 1)
    V,
    L,
    stride_sb,
    stride_s,
    stride_tb,
    stride_t,
    scale2,
    ignore_index,
    BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + (row // L) * stride_sb + (row % L) * stride_s
    t_row = t_ptr + (row // L) * stride_tb + (row % L) * stride_t
    tgt = tl.load(tgt_ptr + row)
    tl.store(blp_ptr + row * 2 + tl.arange(0, 2), tl.zeros([2], tl.float32))

    if tgt == ignore_index:
        tl.store(kl_ptr + row, 0.0)
        tl.store(slp_ptr + row, 0.0)
        tl.store(tlp_ptr + row, 0.0)
        tl.store(lse_ptr + row * 2 + tl.arange(0, 2), tl.zeros([2], tl.float32))
    else:
        ms = tl.full([], float("-inf"), tl.float32)
        ls = tl.zeros([], tl.float32)
        mt = tl.full([], float("-inf"), tl.float32)
        lt = tl.zeros([], tl.float32)
        # acc = sum_j w_j * d_j with d_j = (ys_j - ref_s) - (yt_j - ref_t) and w_j = 2^(ys_j -
        # ref_s) (reverse) or 2^(yt_j - ref_t) with d negated (forward). Measuring d from the
        # running maxima keeps it O(log V), so the final KL = acc / l - log2 l_s + log2 l_t
        # loses no digits to cancellation.
        acc = tl.zeros([], tl.float32)
        # Next block's loads in flight while this one is processed (manual pipelining).
        lanes = tl.arange(0, BLOCK_V)
        s_next = tl.load(s_row + lanes, mask=lanes < V, other=float("-inf"))
        t_next = tl.load(t_row + lanes, mask=lanes < V, other=float("-inf"))
        for start in range(0, V, BLOCK_V):
            nxt = start + BLOCK_V + lanes
            ys = s_next.to(tl.float32) * scale2
            yt = t_next.to(tl.float32) * scale2
            s_next = tl.load(s_row + nxt, mask=nxt < V, other=float("-inf"))
            t_next = tl.load(t_row + nxt, mask=nxt < V, other=float("-inf"))
            ms_new = tl.maximum(ms, tl.max(ys, 0))
            mt_new = tl.maximum(mt, tl.max(yt, 0))
            rs_old = _safe_ref(ms)
            rt_old = _safe_ref(mt)
            rs = _safe_ref(ms_new)
            rt = _safe_ref(mt_new)
            alpha = tl.exp2(ms - rs)  # 0 while the row had no finite entry yet
            beta = tl.exp2(mt - rt)
            es = tl.exp2(ys - rs)
            et = tl.exp2(yt - rt)
            d = (ys - rs) - (yt - rt)
            shift = (rs_old - rs) - (rt_old - rt)  # how every earlier d_j moves
            if REVERSE:
                acc = alpha * (acc + ls * shift) + tl.sum(tl.where(es > 0.0, es * d, 0.0), 0)
            else:
                acc = beta * (acc - lt * shift) - tl.sum(tl.where(et > 0.0, et * d, 0.0), 0)
            ls = ls * alpha + tl.sum(es, 0)
            lt = lt * beta + tl.sum(et, 0)
            ms = ms_new
            mt = mt_new

        log_ls = tl.log2(ls)
        log_lt = tl.log2(lt)
        if REVERSE:
            kl = (acc / ls - log_ls + log_lt) * _LN2
        else:
            kl = (acc / lt - log_lt + log_ls) * _LN2
        ref_s = _safe_ref(ms)
        ref_t = _safe_ref(mt)
        tgt_ok = (tgt >= 0) & (tgt < V)
        s_a = tl.load(s_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
        t_a = tl.load(t_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
        tl.store(kl_ptr + row, kl)
        # Relative to the maxima first, as in the top-M kernel (rounding at the result's size).
        tl.store(slp_ptr + row, ((s_a * scale2 - ref_s) - log_ls) * _LN2)
        tl.store(tlp_ptr + row, ((t_a * scale2 - ref_t) - log_lt) * _LN2)
        tl.store(lse_ptr + row * 2, (ref_s + log_ls) * _LN2)
        tl.store(lse_ptr + row * 2 + 1, (ref_t + log_lt) * _LN2)


# --------------------------------------------------------------------------------------------
# Backward kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_kernel(
    gkl_ptr,  # [N] fp32 upstream gradient of kl
    gsl_ptr,  # [N] fp32 upstream gradient of student_logprob
    gtl_ptr,  # [N] fp32 upstream gradient of teacher_logprob (privilege's included)
    s_ptr,  # [N, V] student logits
    t_ptr,  # [N, V] teacher logits
    tgt_ptr,  # [N] int64
    ids_ptr,  # [N, M] int64 (unused when FULL)
    kl_ptr,  # [N] fp32 forward kl
    lse_ptr,  # [N, 2] fp32 forward log-sum-exps
    blp_ptr,  # [N, 2, M + 1] fp32 forward bucket log-masses (unused when FULL)
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
    M: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr,
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
        lse_s2 = tl.load(lse_ptr + row * 2) * _LOG2E
        lse_t2 = tl.load(lse_ptr + row * 2 + 1) * _LOG2E
        blp_row = blp_ptr + row * (2 * (M + 1))
        # The target's own term [j = a] * u / T, added where offs == target.
        tgt_s = u_ls * inv_t
        tgt_t = u_lt * inv_t
        if not FULL:
            lp_tail = tl.load(blp_row + M)
            lq_tail = tl.load(blp_row + (2 * M + 1))
            a_tail, b_tail = _bucket_grads(lp_tail, lq_tail, kl, u_kl, u_ls, u_lt, inv_t, REVERSE)
            # S_j / P_tail = 2^(y_j - tail lse2). A tail without mass (empty, or all -inf) has
            # only S_j = 0 entries: any finite reference works, the row's lse keeps 2^(.) <= 1.
            ref_s_tail = tl.where(lp_tail == float("-inf"), lse_s2, lse_s2 + lp_tail * _LOG2E)
            ref_t_tail = tl.where(lq_tail == float("-inf"), lse_t2, lse_t2 + lq_tail * _LOG2E)
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
                g = ((ys - lse_s2) - (yt - lse_t2)) * _LN2  # log S_j - log T_j
                if REVERSE:
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
                # Every entry as if in the tail; the top-M entries are rewritten below.
                if GRAD_S:
                    ds = tl.exp2(ys - ref_s_tail) * a_tail + tl.where(is_tgt, tgt_s, 0.0)
                    tl.store(gs_row + offs, ds.to(gs_ptr.dtype.element_ty), mask=inb)
                if GRAD_T:
                    dt = tl.exp2(yt - ref_t_tail) * b_tail + tl.where(is_tgt, tgt_t, 0.0)
                    tl.store(gt_row + offs, dt.to(gt_ptr.dtype.element_ty), mask=inb)
        if not FULL:
            # The M top-M entries overwrite what the streaming pass wrote there; the barrier
            # orders the two writes to the same address from different threads.
            tl.debug_barrier()
            slot = tl.arange(0, MP)
            valid = slot < M
            ids = tl.load(ids_ptr + row * M + slot, mask=valid, other=0)
            # One entry per top-M bucket: its gradient is the bucket's (no logit re-read).
            a, b = _bucket_grads(
                tl.load(blp_row + slot, mask=valid, other=float("-inf")),
                tl.load(blp_row + (M + 1) + slot, mask=valid, other=float("-inf")),
                kl,
                u_kl,
                u_ls,
                u_lt,
                inv_t,
                REVERSE,
            )
            is_tgt = ids == tgt
            if GRAD_S:
                ds = a + tl.where(is_tgt, tgt_s, 0.0)
                tl.store(gs_row + ids, ds.to(gs_ptr.dtype.element_ty), mask=valid)
            if GRAD_T:
                dt = b + tl.where(is_tgt, tgt_t, 0.0)
                tl.store(gt_row + ids, dt.to(gt_ptr.dtype.element_ty), mask=valid)
