"""Triton top-M forward of ``topk_tail_kl`` with joined reductions: ``"joined_reductions"`` of
the kernel slot ``topk_tail_kl.triton_forward`` (:mod:`lopd_kernels.kernel_variants`).

Same contract, keys, tail accounting and finalization as ``_fwd_topm_kernel``
(``"separate_reductions"``, ``lopd_kernels/triton/topk_tail_kl_kernels.py``, whose docstring
explains the algorithm); the work per block differs:

* **Common path** (no entry of the block can beat the running M-th key): separate_reductions
  runs five block reductions (the selecting side's maximum for the test, then maximum and sum of
  each side's tail fold), each a shuffle tree plus a shared-memory exchange between two
  barriers. This kernel runs two reductions of both sides joined (``tl.join``:
  ``[BLOCK_V, 2]``): ``(max s, max t)`` of the block, which is both the test and the tails' new
  maxima (``max(c * x) = c * max(x)`` for ``c > 0``: exact), then
  ``(sum 2^(ys - ref_s), sum 2^(yt - ref_t))``. Same two ``exp2`` per entry; four barriers per
  block instead of ten (``tools/kernel_report.py``).
* **Insertions** (a few candidates): separate_reductions re-reads the evicted entry's other-side
  logit from global memory by index (a dependent load per insertion, serial). This kernel keeps
  the other-side logits of the running top-M in a register vector next to the keys: the next
  candidate comes with its other-side logit from one tuple arg-max reduction ``(key, s)``, the
  evicted one's is read from the register vector.

The supports are separate_reductions' (student: the roles of the rows swapped; union: two
running sets, each with its other side's logits in registers, an entry folded into the tails
once it is in neither), and so is the finalization (``_finish_topm``). Only the
sequential-insert path exists here (no bitonic merge); the launcher runs separate_reductions
where the merge is enabled (``top_m > 64`` by default).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton.topk_tail_kl_device import (
    _KEY_EMPTY,
    _KEY_PAD,
    _key_index,
    _key_value,
    _lse_fold_scalar,
    _safe_ref,
    _sortable_key,
)
from lopd_kernels.triton.topk_tail_kl_kernels import _finish_topm, _zero_row


@triton.jit
def _argmax_key(ka, sa, kb, sb):
    """The (key, other-side logit) pair with the larger key (keys are unique but for EMPTY)."""
    take_a = ka > kb
    return tl.where(take_a, ka, kb), tl.where(take_a, sa, sb)


@triton.jit
def _insert_set(top, top_o, thr, key, o, slot, scale2, ma, la, mo, lo, thr_o, UNION: tl.constexpr):
    """Sequential inserts of a block's candidates into a running top-M (``_update_set``
    without the merge): ``top_o`` holds the other side's logits (float32, unscaled) of the set's
    entries slot by slot, ``o`` the block's. Returns ``(top, top_o, thr, lowest, ma, la, mo,
    lo)``."""
    kmax, o_kmax = tl.reduce((key, o), 0, _argmax_key)
    lowest = tl.full([], _KEY_PAD, tl.int64)
    while kmax > thr:
        hit = slot == tl.argmin(top, 0)
        # The evicted entry (the old minimum) leaves for good; its other-side logit is in
        # registers. Nothing is evicted while slots are EMPTY.
        evicted = thr != _KEY_EMPTY
        e_o = tl.max(tl.where(hit, top_o, float("-inf")), 0)
        if UNION:
            # Held by the other set: not in the tails yet (as in _update_set).
            evicted = evicted & (_sortable_key(e_o, _key_index(thr)) < thr_o)
        e_o = tl.where(evicted, e_o, float("-inf"))
        e_a = tl.where(evicted, _key_value(thr), float("-inf"))
        mo, lo = _lse_fold_scalar(mo, lo, e_o * scale2)
        ma, la = _lse_fold_scalar(ma, la, e_a * scale2)
        top = tl.where(hit, kmax, top)
        top_o = tl.where(hit, o_kmax, top_o)
        thr = tl.min(top, 0)
        lowest = kmax
        kmax, o_kmax = tl.reduce((tl.where(key < kmax, key, _KEY_EMPTY), o), 0, _argmax_key)
    return top, top_o, thr, lowest, ma, la, mo, lo


@triton.jit
def _fwd_topm_joined_kernel(
    s_ptr,  # [N, V] student logits (row stride stride_s, unit column stride)
    t_ptr,  # [N, V] teacher logits
    tgt_ptr,  # [N] int64 targets
    kl_ptr,  # [N] fp32 out
    slp_ptr,  # [N] fp32 out
    tlp_ptr,  # [N] fp32 out
    ids_ptr,  # [N, K] int64 out: the support's ids (order: docs/math.md), -1 padding
    lse_ptr,  # [N, 2] fp32 out
    blp_ptr,  # [N, 2, K + 1] fp32 out: log P_b, log Q_b; b = K is the tail
    V,
    L,  # rows per batch item ([B, L, V] inputs; else N), as in _fwd_topm_kernel
    stride_sb,
    stride_s,
    stride_tb,
    stride_t,
    scale2,  # log2(e) / T
    ignore_index,
    beta,  # the JSD's beta, log(1 - beta), log(beta) (read with DIV == 2 only)
    log_1mb,
    log_b,
    M: tl.constexpr,
    MP: tl.constexpr,  # power of two >= max(M, 2)
    K: tl.constexpr,  # M, or 2M for the union
    BLOCK_V: tl.constexpr,  # >= MP
    DIV: tl.constexpr,  # 0 reverse KL, 1 forward KL, 2 JSD
    SUPPORT: tl.constexpr,  # 0 teacher, 1 student, 2 union
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
        _zero_row(kl_ptr, slp_ptr, tlp_ptr, lse_ptr, ids_row, blp_row, row, slot, valid, M, MP, K)
    else:
        top = tl.where(valid, tl.full([MP], _KEY_EMPTY, tl.int64), _KEY_PAD)
        # The other side's logits (float32, unscaled) of the running top-M, slot by slot.
        top_o = tl.full([MP], float("-inf"), tl.float32)
        thr = tl.min(top, 0)
        thr_val = tl.full([], float("-inf"), tl.float32)
        top2 = top  # the union's second set: the student's keys, its teacher logits
        if SUPPORT == 2:
            top2_o = top_o
            thr2 = thr
            thr2_val = thr_val
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
            if SUPPORT == 1:
                go = s_max >= thr_val
            elif SUPPORT == 2:
                go = (t_max >= thr_val) | (s_max >= thr2_val)
            else:
                go = t_max >= thr_val
            if go:
                if SUPPORT == 1:
                    key = tl.where(inb, _sortable_key(s, offs), _KEY_EMPTY)
                    top, top_o, thr, lowest, ms, ls, mt, lt = _insert_set(
                        top, top_o, thr, key, t, slot, scale2, ms, ls, mt, lt, thr, False
                    )
                    in_tail = key < lowest
                elif SUPPORT == 2:
                    # The teacher's set first, then the student's (as in _fwd_topm_kernel).
                    key = tl.where(inb, _sortable_key(t, offs), _KEY_EMPTY)
                    key2 = tl.where(inb, _sortable_key(s, offs), _KEY_EMPTY)
                    top, top_o, thr, lowest, mt, lt, ms, ls = _insert_set(
                        top, top_o, thr, key, s, slot, scale2, mt, lt, ms, ls, thr2, True
                    )
                    top2, top2_o, thr2, lowest2, ms, ls, mt, lt = _insert_set(
                        top2, top2_o, thr2, key2, t, slot, scale2, ms, ls, mt, lt, thr, True
                    )
                    thr2_val = tl.where(thr2 == _KEY_EMPTY, float("-inf"), _key_value(thr2))
                    in_tail = (key < lowest) & (key2 < lowest2)
                else:
                    key = tl.where(inb, _sortable_key(t, offs), _KEY_EMPTY)
                    top, top_o, thr, lowest, mt, lt, ms, ls = _insert_set(
                        top, top_o, thr, key, s, slot, scale2, mt, lt, ms, ls, thr, False
                    )
                    in_tail = key < lowest
                thr_val = tl.where(thr == _KEY_EMPTY, float("-inf"), _key_value(thr))
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

        # Finalization as in _fwd_topm_kernel: sort the set(s), gather the other side's M logits
        # once per row.
        _finish_topm(
            s_row, t_row, tgt, V, scale2, ms, ls, mt, lt, top, top2, thr, row, kl_ptr, slp_ptr,
            tlp_ptr, ids_row, lse_ptr, blp_row, slot, valid, beta, log_1mb, log_b, M, K, DIV,
            SUPPORT,
        )  # fmt: skip
