"""Triton top-M forward of ``topk_tail_kl``, variant ``v2``: fused reductions, top-M student
logits in registers (switch ``topk_tail_kl.triton_fwd``, :mod:`lopd_kernels.kernel_variants`).

Same contract, keys, tail accounting and finalization as ``_fwd_topm_kernel`` (variant ``v1``,
``lopd_kernels/triton/topk_tail_kl_kernels.py``, whose docstring explains the algorithm); what
changes is the work per block:

* **Common path** (no entry of the block can beat the running M-th key): v1 runs five block
  reductions (the teacher maximum for the test, then maximum and sum of each side's tail fold),
  each a shuffle tree plus a shared-memory exchange between two barriers. v2 runs two
  reductions of both sides joined (``tl.join``: ``[BLOCK_V, 2]``): ``(max s, max t)`` of the
  block, which is both the test and the tails' new maxima (``max(c * x) = c * max(x)`` for
  ``c > 0``: exact), then ``(sum 2^(ys - ref_s), sum 2^(yt - ref_t))``. Same two ``exp2`` per
  entry; four barriers per block instead of ten (``tools/kernel_report.py``).
* **Insertions** (a few candidates): v1 re-reads the evicted entry's student logit from global
  memory by index (a dependent load per insertion, serial). v2 keeps the student logits of the
  running top-M in a register vector next to the keys: the next candidate comes with its
  student logit from one tuple arg-max reduction ``(key, s)``, the evicted one's is read from
  the register vector.

Only the sequential-insert path exists here (no bitonic merge); the launcher runs ``v1`` where
the merge is enabled (``top_m > 64`` by default).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton.topk_tail_kl_kernels import (
    _KEY_EMPTY,
    _KEY_PAD,
    _LN2,
    _key_index,
    _key_value,
    _kl_terms,
    _lse_fold,
    _lse_fold_scalar,
    _safe_ref,
    _sortable_key,
)


@triton.jit
def _argmax_key(ka, sa, kb, sb):
    """The (key, student logit) pair with the larger key (keys are unique but for EMPTY)."""
    take_a = ka > kb
    return tl.where(take_a, ka, kb), tl.where(take_a, sa, sb)


@triton.jit
def _fwd_topm_fused_kernel(
    s_ptr,  # [N, V] student logits (row stride stride_s, unit column stride)
    t_ptr,  # [N, V] teacher logits
    tgt_ptr,  # [N] int64 targets
    kl_ptr,  # [N] fp32 out
    slp_ptr,  # [N] fp32 out
    tlp_ptr,  # [N] fp32 out
    ids_ptr,  # [N, M] int64 out: teacher top-M ids, by descending teacher logit
    lse_ptr,  # [N, 2] fp32 out
    blp_ptr,  # [N, 2, M + 1] fp32 out: log P_b, log Q_b; b = M is the tail
    V,
    L,  # rows per batch item ([B, L, V] inputs; else N), as in v1
    stride_sb,
    stride_s,
    stride_tb,
    stride_t,
    scale2,  # log2(e) / T
    ignore_index,
    M: tl.constexpr,
    MP: tl.constexpr,  # power of two >= max(M, 2)
    BLOCK_V: tl.constexpr,  # >= MP
    REVERSE: tl.constexpr,
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
        # Student logits (float32, unscaled) of the running top-M, slot by slot.
        top_s = tl.full([MP], float("-inf"), tl.float32)
        thr = tl.min(top, 0)
        thr_val = tl.full([], float("-inf"), tl.float32)
        ms = tl.full([], float("-inf"), tl.float32)
        ls = tl.zeros([], tl.float32)
        mt = tl.full([], float("-inf"), tl.float32)
        lt = tl.zeros([], tl.float32)
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
            # Reduction 1 of the common path: both block maxima at once. Joined into one
            # [BLOCK_V, 2] tensor (both values in the same thread), the two maxima cross the
            # block in one shared-memory exchange (two barriers), where a tuple tl.reduce
            # exchanges each operand separately (three).
            s_max, t_max = tl.split(tl.max(tl.join(s, t), 0))
            if t_max >= thr_val:
                key = tl.where(inb, _sortable_key(t, offs), _KEY_EMPTY)
                kmax, s_kmax = tl.reduce((key, s), 0, _argmax_key)
                lowest = tl.full([], _KEY_PAD, tl.int64)
                while kmax > thr:
                    hit = slot == tl.argmin(top, 0)
                    # The evicted entry (the old minimum) leaves for good; its student logit
                    # is in registers. Nothing is evicted while slots are EMPTY.
                    evicted = thr != _KEY_EMPTY
                    e_s = tl.max(tl.where(hit, top_s, float("-inf")), 0)
                    e_s = tl.where(evicted, e_s, float("-inf"))
                    e_t = tl.where(evicted, _key_value(thr), float("-inf"))
                    ms, ls = _lse_fold_scalar(ms, ls, e_s * scale2)
                    mt, lt = _lse_fold_scalar(mt, lt, e_t * scale2)
                    top = tl.where(hit, kmax, top)
                    top_s = tl.where(hit, s_kmax, top_s)
                    thr = tl.min(top, 0)
                    lowest = kmax
                    kmax, s_kmax = tl.reduce(
                        (tl.where(key < kmax, key, _KEY_EMPTY), s), 0, _argmax_key
                    )
                thr_val = tl.where(thr == _KEY_EMPTY, float("-inf"), _key_value(thr))
                in_tail = key < lowest
                ys = tl.where(in_tail, s * scale2, float("-inf"))
                yt = tl.where(in_tail, t * scale2, float("-inf"))
                ys_max, yt_max = tl.split(tl.max(tl.join(ys, yt), 0))
            else:
                ys = s * scale2
                yt = t * scale2
                ys_max = s_max * scale2
                yt_max = t_max * scale2
            # Reduction 2: both sums of exponentials at once.
            ms_new = tl.maximum(ms, ys_max)
            mt_new = tl.maximum(mt, yt_max)
            ref_s = _safe_ref(ms_new)
            ref_t = _safe_ref(mt_new)
            e = tl.join(tl.exp2(ys - ref_s), tl.exp2(yt - ref_t))
            sum_s, sum_t = tl.split(tl.sum(e, 0))
            ls = ls * tl.exp2(ms - ref_s) + sum_s
            lt = lt * tl.exp2(mt - ref_t) + sum_t
            ms = ms_new
            mt = mt_new

        # Finalization as in v1: sort the top-M, gather its M student logits once per row.
        top = tl.sort(tl.where(valid, top, _KEY_EMPTY), descending=True)
        ids = tl.where(valid, _key_index(top), 0)
        yt_top = tl.where(valid, _key_value(top), float("-inf")) * scale2
        ys_top = tl.load(s_row + ids, mask=valid, other=float("-inf")).to(tl.float32) * scale2
        tail_ref_s = _safe_ref(ms)
        tail_ref_t = _safe_ref(mt)
        tail_log_s = tl.log2(ls)
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
