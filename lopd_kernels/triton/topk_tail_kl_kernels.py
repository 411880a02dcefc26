"""Triton kernels of ``topk_tail_kl`` (top-M + tail-bucket divergence + privilege): the
forwards (the backward is ``lopd_kernels/triton/topk_tail_kl_kernels_bwd.py``, the shared device
functions ``lopd_kernels/triton/topk_tail_kl_device.py``).

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

  - the running top-M of the *selecting side* (the teacher for ``support="teacher"``, the
    student for ``"student"``) as packed int64 keys (``topk_tail_kl_device.py``), an unsorted
    set whose minimum ``thr`` is the current M-th largest key;
  - two running base-2 log-sum-exps, student and teacher, over the **complement** of the running
    top-M (the tail), each with its own maximum, so the tail is exact to float32 rounding however
    little mass it holds (``docs/math.md``: never ``1 - sum`` nor ``log1mexp``).

  Per block (the next block's loads already in flight): if the block's selecting-side maximum
  is below the M-th value, no entry can enter the top-M and the whole block is folded into the
  tail (the common case once the threshold has settled; this path does no integer work at
  all). Otherwise the block's keys are built and the top-M is updated in one of two ways
  (:func:`_update_set`):

  - *sequential inserts* (few candidates): the largest remaining candidate replaces the set's
    minimum, until none beats it. The evicted entry is folded into the tail (its selecting-side
    value decoded from its key, the other side's logit re-read by index: one scalar load).
    Candidates go in descending order, so the inserted ones are exactly the block keys ``>=
    lowest inserted``;
  - *bitonic merge* (many candidates, compiled in for M > 64 only, see ``_FWD_BULK_TOP_M``): the
    running top-M and the block's own top-MP are merged with ``tl.topk``; old members below the
    new M-th key are folded into the tail (M masked gathers), block keys below it too.

  Every other block entry joins the tail. The full log-sum-exps are ``logaddexp(tail, top-M)``
  at the end, so the streaming loop costs two ``exp2`` per vocabulary entry, not four.

  ``support="student"`` is the same kernel with the roles of the rows swapped (keys from the
  student row; ``bucket_logp``, ``lse`` and the log-probs keep their student / teacher order).
  ``support="union"`` keeps **two** running sets in the same single pass, the teacher's keys and
  the student's keys. An entry joins the tails only once it is in neither: block entries
  inserted into neither set at once; an entry evicted from one set only if the other does not
  hold it. Membership needs no search: a set holds exactly the top-M (by its own keys) of the
  entries seen so far, so an evicted entry is in the other set iff its key on the other side
  (built from the other side's logit, which the tail fold reads anyway) is at least that set's
  M-th key. Per block the teacher's set is updated first, then the student's (against the
  teacher's updated threshold); entries never re-enter, so each is folded exactly once. Cost
  over ``"teacher"``: the block's student maximum (one more block reduction on the common path
  here; ``topk_tail_kl_kernels_joined.py`` has it already), a block enters the update path when
  either side may enter its set, and one key compare per eviction. Finalization orders the union
  as the op does: the teacher's top-M sorted, then the student's sorted minus the teacher's
  (found by the same threshold test), compacted by a prefix sum, then -1 / -inf padding up to
  2M.

  The divergence (reverse / forward KL or the JSD) is finalized from the K + 1 bucket
  log-masses (``_div_terms``): no extra pass for any divergence.

* **Forward, full vocabulary** (``top_m == 0``): the KLs in one pass, an online log-sum-exp of
  both sides plus an online ``sum_j 2^(y_j - r) * d_j`` accumulator, with ``d_j`` measured from
  the running maxima so that ``KL = E[d] - log l_s + log l_t`` never subtracts two large
  numbers. The JSD needs both normalizers inside every term's log-mixture: two passes (both
  log-sum-exps, then ``K_P`` and ``K_Q``).

Cost of the top-M pass: on top of the stream, about ``M * (1 + ln(V / BLOCK_V))`` sequential
block reductions per row when the vocabulary order is random w.r.t. the selecting side, M + 1 of
them in the first block (simulated for M = 20, V = 151,936, BLOCK_V = 2048: ~130 on i.i.d.
logits, ~22 when high logits cluster at low ids as in frequency-ordered BPE vocabularies); the
union pays it for both sets.

Limits: ``1 <= top_m <= min(V, 256)`` or ``top_m == 0``; ``V < 2**30``.
Out-of-range targets (neither in ``[0, V)`` nor ``ignore_index``) are not validated here (that
would sync the device; the public API validates): their log-probs come out NaN, loudly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import LN2_C
from lopd_kernels.triton.topk_tail_kl_device import (
    _KEY_EMPTY,
    _KEY_PAD,
    _div_terms,
    _full_row_jsd_kls,
    _full_row_lse,
    _key_index,
    _key_value,
    _lse_fold,
    _lse_fold_scalar,
    _safe_ref,
    _sortable_key,
)

# --------------------------------------------------------------------------------------------
# Device helpers of the top-M forwards (separate_reductions here, joined_reductions in
# topk_tail_kl_kernels_joined.py)
# --------------------------------------------------------------------------------------------


@triton.jit
def _update_set(
    top,
    thr,
    key,
    o_row,
    slot,
    valid,
    scale2,
    ma,
    la,
    mo,
    lo,
    thr_o,
    MP: tl.constexpr,
    UNION: tl.constexpr,
    BULK: tl.constexpr,
    BULK_MIN: tl.constexpr,
):
    """Update a running top-M (keys ``top [MP]``, M-th key ``thr``) with a block's ``key``.

    Side ``a`` is the set's (its values are in the keys), side ``o`` the other row (``o_row``,
    read by index for evicted entries). ``(ma, la)``, ``(mo, lo)``: the two tails' online
    log-sum-exps, into which evicted entries are folded; with ``UNION`` only those the other
    set does not hold (its key on the other side below the other set's M-th key ``thr_o``).

    Returns:
        ``(top, thr, lowest, ma, la, mo, lo)``; the block entries taken into the set are exactly
        those with ``key >= lowest`` (``_KEY_PAD`` when none).
    """
    if BULK:
        bulk = tl.sum((key > thr).to(tl.int32), 0) > BULK_MIN
    else:
        bulk = False  # compiled out: no bitonic network, fewer registers
    if bulk:
        # Many candidates (the first block, or a rising stretch): one bitonic merge of the
        # running top-M with the block's top-MP, in parallel.
        old = tl.where(valid, top, _KEY_EMPTY)
        merged = tl.topk(tl.reshape(tl.join(old, tl.topk(key, MP)), [2 * MP]), MP)
        thr = tl.min(tl.where(valid, merged, _KEY_PAD), 0)
        # Old members now below the M-th key leave for good: fold them into the tails (the
        # other side's logits re-read by index, this side's decoded from the key).
        evicted = valid & (old != _KEY_EMPTY) & (old < thr)
        e_o = tl.load(o_row + _key_index(old), mask=evicted, other=float("-inf")).to(tl.float32)
        if UNION:
            evicted = evicted & (_sortable_key(e_o, _key_index(old)) < thr_o)
            e_o = tl.where(evicted, e_o, float("-inf"))
        e_a = tl.where(evicted, _key_value(old), float("-inf"))
        mo, lo = _lse_fold(mo, lo, e_o * scale2)
        ma, la = _lse_fold(ma, la, e_a * scale2)
        top = tl.where(valid, merged, _KEY_PAD)
        # The new top-M is exactly the keys >= thr of old and block together.
        lowest = thr
    else:
        # A few candidates: insert them largest first, each replacing the minimum.
        kmax = tl.max(key, 0)
        lowest = tl.full([], _KEY_PAD, tl.int64)  # smallest key inserted here
        while kmax > thr:
            top = tl.where(slot == tl.argmin(top, 0), kmax, top)
            # The evicted key (the old minimum) leaves the top-M for good. Nothing is evicted
            # while slots are EMPTY.
            evicted = thr != _KEY_EMPTY
            e_o = tl.load(o_row + _key_index(thr), mask=evicted, other=float("-inf"))
            e_o = e_o.to(tl.float32)
            if UNION:
                evicted = evicted & (_sortable_key(e_o, _key_index(thr)) < thr_o)
                e_o = tl.where(evicted, e_o, float("-inf"))
            e_a = tl.where(evicted, _key_value(thr), float("-inf"))
            mo, lo = _lse_fold_scalar(mo, lo, e_o * scale2)
            ma, la = _lse_fold_scalar(ma, la, e_a * scale2)
            thr = tl.min(top, 0)
            lowest = kmax
            kmax = tl.max(tl.where(key < kmax, key, _KEY_EMPTY), 0)
        # Descending order: the inserted entries are exactly the block keys >= lowest, and none
        # of them was evicted again within the block.
    return top, thr, lowest, ma, la, mo, lo


@triton.jit
def _zero_row(
    kl_ptr,
    slp_ptr,
    tlp_ptr,
    lse_ptr,
    ids_row,
    blp_row,
    row,
    slot,
    valid,
    M: tl.constexpr,
    MP: tl.constexpr,
    K: tl.constexpr,
):
    """Every output of an ignored row: 0 (``topk_ids`` too, also for a union's 2M slots)."""
    tl.store(kl_ptr + row, 0.0)
    tl.store(slp_ptr + row, 0.0)
    tl.store(tlp_ptr + row, 0.0)
    tl.store(lse_ptr + row * 2 + tl.arange(0, 2), tl.zeros([2], tl.float32))
    for h in tl.static_range(K // M):
        tl.store(ids_row + h * M + slot, tl.zeros([MP], tl.int64), mask=valid)
        tl.store(blp_row + h * M + slot, tl.zeros([MP], tl.float32), mask=valid)
        tl.store(blp_row + (K + 1) + h * M + slot, tl.zeros([MP], tl.float32), mask=valid)
    tl.store(blp_row + K, 0.0)
    tl.store(blp_row + (2 * K + 1), 0.0)


@triton.jit
def _finish_topm(
    s_row,
    t_row,
    tgt,
    V,
    scale2,
    ms,
    ls,
    mt,
    lt,
    top,
    top2,
    thr,
    row,
    kl_ptr,
    slp_ptr,
    tlp_ptr,
    ids_row,
    lse_ptr,
    blp_row,
    slot,
    valid,
    beta,
    log_1mb,
    log_b,
    M: tl.constexpr,
    K: tl.constexpr,
    DIV: tl.constexpr,
    SUPPORT: tl.constexpr,
):
    """Finalize a top-M row from its running set(s) and tails and write every output.

    ``top``: the selecting side's running keys (the teacher's for the union, whose M-th key is
    ``thr``); ``top2``: the student's set of a union (unused otherwise). The sets are sorted
    (descending key, like a stable ``torch.sort``), the other side's M logits gathered once
    per row, the log-masses taken relative to the running maxima and the divergence summed
    over the K + 1 buckets.
    """
    top = tl.sort(tl.where(valid, top, _KEY_EMPTY), descending=True)
    ids = tl.where(valid, _key_index(top), 0)
    x_top = tl.where(valid, _key_value(top), float("-inf")) * scale2
    if SUPPORT == 1:
        ys_top = x_top
        yt_top = tl.load(t_row + ids, mask=valid, other=float("-inf")).to(tl.float32) * scale2
    else:
        yt_top = x_top
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
    if SUPPORT == 2:
        # The student's set: its ids already among the teacher's (teacher key at or above the
        # teacher's final M-th key) are buckets there; the others follow, in student order.
        top2 = tl.sort(tl.where(valid, top2, _KEY_EMPTY), descending=True)
        ids2 = tl.where(valid, _key_index(top2), 0)
        s2 = tl.where(valid, _key_value(top2), float("-inf"))
        t2 = tl.load(t_row + ids2, mask=valid, other=float("-inf")).to(tl.float32)
        new = valid & (_sortable_key(t2, ids2) < thr)
        ys2 = tl.where(new, s2 * scale2, float("-inf"))
        yt2 = tl.where(new, t2 * scale2, float("-inf"))
        ms, ls = _lse_fold(ms, ls, ys2)
        mt, lt = _lse_fold(mt, lt, yt2)
    ref_s = _safe_ref(ms)
    ref_t = _safe_ref(mt)
    log_ls = tl.log2(ls)
    log_lt = tl.log2(lt)

    lp = ((ys_top - ref_s) - log_ls) * LN2_C
    lq = ((yt_top - ref_t) - log_lt) * LN2_C
    lp_tail = ((tail_ref_s - ref_s) + (tail_log_s - log_ls)) * LN2_C
    lq_tail = ((tail_ref_t - ref_t) + (tail_log_t - log_lt)) * LN2_C
    kl = tl.sum(_div_terms(lp, lq, beta, log_1mb, log_b, DIV), 0) + _div_terms(
        lp_tail, lq_tail, beta, log_1mb, log_b, DIV
    )

    tgt_ok = (tgt >= 0) & (tgt < V)
    s_a = tl.load(s_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
    t_a = tl.load(t_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
    tl.store(slp_ptr + row, ((s_a * scale2 - ref_s) - log_ls) * LN2_C)
    tl.store(tlp_ptr + row, ((t_a * scale2 - ref_t) - log_lt) * LN2_C)
    tl.store(lse_ptr + row * 2, (ref_s + log_ls) * LN2_C)
    tl.store(lse_ptr + row * 2 + 1, (ref_t + log_lt) * LN2_C)
    tl.store(ids_row + slot, ids.to(tl.int64), mask=valid)
    tl.store(blp_row + slot, lp, mask=valid)
    tl.store(blp_row + K, lp_tail)
    tl.store(blp_row + (K + 1) + slot, lq, mask=valid)
    tl.store(blp_row + (2 * K + 1), lq_tail)
    if SUPPORT == 2:
        lp2 = ((ys2 - ref_s) - log_ls) * LN2_C
        lq2 = ((yt2 - ref_t) - log_lt) * LN2_C
        kl += tl.sum(_div_terms(lp2, lq2, beta, log_1mb, log_b, DIV), 0)
        # Compaction: the student-only ids to slots M, M + 1, ... (a prefix sum), then -1.
        pos = M + tl.cumsum(new.to(tl.int32), 0) - 1
        pad = valid & (slot >= tl.sum(new.to(tl.int32), 0))
        tl.store(ids_row + pos, ids2.to(tl.int64), mask=new)
        tl.store(ids_row + M + slot, tl.full(slot.shape, -1, tl.int64), mask=pad)
        tl.store(blp_row + pos, lp2, mask=new)
        none = tl.full(slot.shape, float("-inf"), tl.float32)
        tl.store(blp_row + M + slot, none, mask=pad)
        tl.store(blp_row + (K + 1) + pos, lq2, mask=new)
        tl.store(blp_row + (K + 1 + M) + slot, none, mask=pad)
    tl.store(kl_ptr + row, kl)


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
    ids_ptr,  # [N, K] int64 out: the support's ids (order: docs/math.md), -1 padding
    lse_ptr,  # [N, 2] fp32 out: natural log-sum-exp of student / T and teacher / T
    blp_ptr,  # [N, 2, K + 1] fp32 out: log P_b, log Q_b; b = K is the tail
    V,
    L,  # rows per batch item: row r is item r // L, position r % L ([B, L, V] inputs; else N)
    stride_sb,  # student item stride (0 for [N, V] inputs)
    stride_s,  # student row stride
    stride_tb,
    stride_t,
    scale2,  # log2(e) / T: logits -> base-2 log-space
    ignore_index,
    beta,  # the JSD's beta, log(1 - beta), log(beta) (read with DIV == 2 only)
    log_1mb,
    log_b,
    M: tl.constexpr,
    MP: tl.constexpr,  # power of two >= max(M, 2): register width of a running top-M
    K: tl.constexpr,  # bucket ids per row: M, or 2M for the union
    BLOCK_V: tl.constexpr,  # >= MP
    DIV: tl.constexpr,  # 0 reverse KL, 1 forward KL, 2 JSD
    SUPPORT: tl.constexpr,  # 0 teacher, 1 student, 2 union
    BULK: tl.constexpr,  # whether blocks with many candidates use the bitonic merge
    BULK_MIN: tl.constexpr,  # "many": more than this; fewer go through sequential inserts
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + (row // L) * stride_sb + (row % L) * stride_s
    t_row = t_ptr + (row // L) * stride_tb + (row % L) * stride_t
    ids_row = ids_ptr + row * K
    blp_row = blp_ptr + row * (2 * (K + 1))
    slot = tl.arange(0, MP)
    valid = slot < M
    tgt = tl.load(tgt_ptr + row)

    if tgt == ignore_index:
        # Ignored rows: every output 0, and no pass over the logits.
        _zero_row(kl_ptr, slp_ptr, tlp_ptr, lse_ptr, ids_row, blp_row, row, slot, valid, M, MP, K)
    else:
        top = tl.where(valid, tl.full([MP], _KEY_EMPTY, tl.int64), _KEY_PAD)
        thr = tl.min(top, 0)  # M-th largest key so far (EMPTY until M entries were seen)
        thr_val = tl.full([], float("-inf"), tl.float32)  # its value (-inf when EMPTY)
        top2 = top  # the union's second set: the student's keys
        if SUPPORT == 2:
            thr2 = thr
            thr2_val = thr_val
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
            # Whether some entry may beat a set's M-th key.
            if SUPPORT == 1:
                go = tl.max(s, 0) >= thr_val
            elif SUPPORT == 2:
                go = (tl.max(t, 0) >= thr_val) | (tl.max(s, 0) >= thr2_val)
            else:
                t_max = tl.max(t, 0)
                go = t_max >= thr_val
            if go:
                if SUPPORT == 1:
                    key = tl.where(inb, _sortable_key(s, offs), _KEY_EMPTY)
                    top, thr, lowest, ms, ls, mt, lt = _update_set(
                        top, thr, key, t_row, slot, valid, scale2, ms, ls, mt, lt, thr,
                        MP, False, BULK, BULK_MIN,
                    )  # fmt: skip
                    in_tail = key < lowest
                elif SUPPORT == 2:
                    # The teacher's set first (against the student's set before this block),
                    # then the student's (against the teacher's after it).
                    key = tl.where(inb, _sortable_key(t, offs), _KEY_EMPTY)
                    key2 = tl.where(inb, _sortable_key(s, offs), _KEY_EMPTY)
                    top, thr, lowest, mt, lt, ms, ls = _update_set(
                        top, thr, key, s_row, slot, valid, scale2, mt, lt, ms, ls, thr2,
                        MP, True, BULK, BULK_MIN,
                    )  # fmt: skip
                    top2, thr2, lowest2, ms, ls, mt, lt = _update_set(
                        top2, thr2, key2, t_row, slot, valid, scale2, ms, ls, mt, lt, thr,
                        MP, True, BULK, BULK_MIN,
                    )  # fmt: skip
                    thr2_val = tl.where(thr2 == _KEY_EMPTY, float("-inf"), _key_value(thr2))
                    in_tail = (key < lowest) & (key2 < lowest2)
                else:
                    key = tl.where(inb, _sortable_key(t, offs), _KEY_EMPTY)
                    top, thr, lowest, mt, lt, ms, ls = _update_set(
                        top, thr, key, s_row, slot, valid, scale2, mt, lt, ms, ls, thr,
                        MP, False, BULK, BULK_MIN,
                    )  # fmt: skip
                    in_tail = key < lowest
                thr_val = tl.where(thr == _KEY_EMPTY, float("-inf"), _key_value(thr))
                ys = tl.where(in_tail, s * scale2, float("-inf"))
                yt = tl.where(in_tail, t * scale2, float("-inf"))
            else:
                ys = s * scale2
                yt = t * scale2
            ms, ls = _lse_fold(ms, ls, ys)
            mt, lt = _lse_fold(mt, lt, yt)

        _finish_topm(
            s_row, t_row, tgt, V, scale2, ms, ls, mt, lt, top, top2, thr, row, kl_ptr, slp_ptr,
            tlp_ptr, ids_row, lse_ptr, blp_row, slot, valid, beta, log_1mb, log_b, M, K, DIV,
            SUPPORT,
        )  # fmt: skip


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
    beta,
    log_1mb,
    log_b,
    BLOCK_V: tl.constexpr,
    DIV: tl.constexpr,
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
        if DIV == 2:
            # The JSD: both log-sum-exps first, then K_P and K_Q over every entry.
            ms, ls, mt, lt = _full_row_lse(s_row, t_row, V, scale2, BLOCK_V)
            log_ls = tl.log2(ls)
            log_lt = tl.log2(lt)
            k_p, k_q = _full_row_jsd_kls(
                s_row, t_row, V, scale2, _safe_ref(ms), log_ls, _safe_ref(mt), log_lt, log_1mb,
                log_b, BLOCK_V,
            )  # fmt: skip
            kl = beta * k_q + (1.0 - beta) * k_p
        else:
            ms = tl.full([], float("-inf"), tl.float32)
            ls = tl.zeros([], tl.float32)
            mt = tl.full([], float("-inf"), tl.float32)
            lt = tl.zeros([], tl.float32)
            # acc = sum_j w_j * d_j with d_j = (ys_j - ref_s) - (yt_j - ref_t) and w_j =
            # 2^(ys_j - ref_s) (reverse) or 2^(yt_j - ref_t) with d negated (forward).
            # Measuring d from the running maxima keeps it O(log V), so the final KL = acc / l -
            # log2 l_s + log2 l_t loses no digits to cancellation.
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
                gamma = tl.exp2(mt - rt)
                es = tl.exp2(ys - rs)
                et = tl.exp2(yt - rt)
                d = (ys - rs) - (yt - rt)
                shift = (rs_old - rs) - (rt_old - rt)  # how every earlier d_j moves
                if DIV == 0:
                    acc = alpha * (acc + ls * shift) + tl.sum(tl.where(es > 0.0, es * d, 0.0), 0)
                else:
                    acc = gamma * (acc - lt * shift) - tl.sum(tl.where(et > 0.0, et * d, 0.0), 0)
                ls = ls * alpha + tl.sum(es, 0)
                lt = lt * gamma + tl.sum(et, 0)
                ms = ms_new
                mt = mt_new

            log_ls = tl.log2(ls)
            log_lt = tl.log2(lt)
            if DIV == 0:
                kl = (acc / ls - log_ls + log_lt) * LN2_C
            else:
                kl = (acc / lt - log_lt + log_ls) * LN2_C
        ref_s = _safe_ref(ms)
        ref_t = _safe_ref(mt)
        tgt_ok = (tgt >= 0) & (tgt < V)
        s_a = tl.load(s_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
        t_a = tl.load(t_row + tgt, mask=tgt_ok, other=float("nan")).to(tl.float32)
        tl.store(kl_ptr + row, kl)
        # Relative to the maxima first, as in the top-M kernel (rounding at the result's size).
        tl.store(slp_ptr + row, ((s_a * scale2 - ref_s) - log_ls) * LN2_C)
        tl.store(tlp_ptr + row, ((t_a * scale2 - ref_t) - log_lt) * LN2_C)
        tl.store(lse_ptr + row * 2, (ref_s + log_ls) * LN2_C)
        tl.store(lse_ptr + row * 2 + 1, (ref_t + log_lt) * LN2_C)
