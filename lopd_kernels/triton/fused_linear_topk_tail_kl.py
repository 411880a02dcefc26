"""Launchers of the Triton fused LM head + top-M/tail divergence kernels, and the PyTorch merge
of the forward's vocabulary splits.

The kernels, their design and cost model are in
``lopd_kernels/triton/fused_linear_topk_tail_kl_kernels.py`` (backward:
``lopd_kernels/triton/fused_linear_topk_tail_kl_kernels_bwd.py``);
:mod:`lopd_kernels.fused_linear_topk_tail_kl` registers these launchers as
``torch.ops.lopd.fused_linear_topk_tail_kl_triton_fwd`` / ``..._bwd``.
"""

from __future__ import annotations

import math

import torch
import triton

from lopd_kernels.bucket_math import bucket_coefs, bucket_divergence, support_width
from lopd_kernels.triton._common import NEG_BIG, interpreting, upcast_for_interpreter
from lopd_kernels.triton.fused_linear_topk_tail_kl_kernels import _fwd_kernel, _jsd_full_kernel
from lopd_kernels.triton.fused_linear_topk_tail_kl_kernels_bwd import _bwd_kernel
from lopd_kernels.triton.topk_tail_kl import divergence_args, support_code
from lopd_kernels.triton.topk_tail_kl_device import DIV_JSD, DIV_REVERSE, SUPPORT_UNION

# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _config(dtype: torch.dtype) -> dict:
    """Tile sizes: GPU-sized on a device, the smallest legal ``tl.dot`` tiles in the interpreter."""
    if interpreting():
        return {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_D": 16, "num_warps": 1}
    block_d = 64 if dtype == torch.float32 else 128
    return {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": block_d, "num_warps": 8}


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    return ("ieee" if dtype == torch.float32 else "tf32"), upcast_for_interpreter(dtype)


def _lse_of(m: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``m + log(acc)``; ``-inf`` for an empty accumulator (``acc == 0``)."""
    return torch.where(acc > 0, m + acc.log(), torch.full_like(m, -math.inf))


def _pack(ws: torch.Tensor, wt: torch.Tensor, bs, bt):
    def c(x):
        return None if x is None else x.contiguous()

    return c(ws), c(wt), c(bs), c(bt)


def _splits(dev: torch.device, n_blocks: int, n_tiles: int, bv: int, vocab: int) -> tuple[int, int]:
    """``(split_len, splits)``: vocabulary splits that keep every SM busy when ``N`` is small."""
    if interpreting():
        splits = min(2, n_tiles)
    else:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = max(1, min(n_tiles, triton.cdiv(2 * sms, n_blocks)))
    split_len = triton.cdiv(n_tiles, splits) * bv
    return split_len, triton.cdiv(vocab, split_len)


def _jsd_mixture_kls(h_s, ws, bs, h_t, wt, bt, lse, temperature, jsd, cfg):
    """``(K_P, K_Q) [n]`` of the full-vocabulary JSD of the packed rows (``lse [n, 2]`` known):
    one more pass over the logit tiles (:func:`_jsd_full_kernel`)."""
    nv, vocab = h_s.shape[0], ws.shape[0]
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    n_blocks, n_tiles = triton.cdiv(nv, bn), triton.cdiv(vocab, bv)
    split_len, splits = _splits(h_s.device, n_blocks, n_tiles, bv, vocab)
    out = torch.zeros(nv, splits, 2, dtype=torch.float32, device=h_s.device)
    precision, upcast = _precision(h_s.dtype)
    _jsd_full_kernel[(n_blocks, splits)](
        h_s, ws, bs if bs is not None else ws, h_t, wt, bt if bt is not None else wt,
        lse.contiguous(), out, nv, vocab, h_s.shape[1], h_t.shape[1], h_s.stride(0),
        ws.stride(0), h_t.stride(0), wt.stride(0), split_len, 1.0 / temperature, jsd[1], jsd[2],
        HAS_BS=bs is not None, HAS_BT=bt is not None, BLOCK_N=bn, BLOCK_V=bv,
        BLOCK_D=cfg["BLOCK_D"], PRECISION=precision, UPCAST=upcast, num_warps=cfg["num_warps"],
    )  # fmt: skip
    k = out.sum(1)
    return k[:, 0], k[:, 1]


def fused_linear_fwd_triton(
    hs, ws, bs, ht, wt, bt, target, top_m, temperature, divergence, beta, support, ignore
):  # fmt: skip
    """Launch the forward; same outputs as ``torch.ops.lopd.fused_linear_topk_tail_kl_cpu_fwd``
    (``divergence``, ``beta``, ``support`` as the op takes them)."""
    n, vocab = hs.shape[0], ws.shape[0]
    m = 0 if top_m == 0 or top_m >= vocab else top_m
    div, jsd = divergence_args(divergence, beta)
    sup = support_code(support)
    k = support_width(m, support)
    dev = hs.device
    kl = torch.zeros(n, dtype=torch.float32, device=dev)
    lp_s, lp_t = torch.zeros_like(kl), torch.zeros_like(kl)
    ids = torch.zeros(n, k, dtype=torch.long, device=dev)
    lse = kl.new_zeros(n, 2)
    bucket = kl.new_zeros(n, 2, k + 1)
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
    split_len, splits = _splits(dev, n_blocks, n_tiles, bv, vocab)
    m_pad = max(1, triton.next_power_of_2(max(m, 1)))
    full = m == 0
    sets = 2 if sup == SUPPORT_UNION else 1
    top_shape = (nv, splits, sets * m_pad) if not full else (1,)
    top_t = torch.empty(top_shape, dtype=torch.float32, device=dev)
    top_s = torch.empty_like(top_t)
    top_i = torch.empty(top_shape, dtype=torch.int32, device=dev)
    stats = torch.zeros(nv, splits, 8, dtype=torch.float32, device=dev)
    precision, upcast = _precision(hs.dtype)
    _fwd_kernel[(n_blocks, splits)](
        h_s, ws, bs if bs is not None else ws, h_t, wt, bt if bt is not None else wt, tgt,
        top_t, top_s, top_i, stats, nv, vocab, h_s.shape[1], h_t.shape[1],
        h_s.stride(0), ws.stride(0), h_t.stride(0), wt.stride(0), split_len, 1.0 / temperature,
        M=max(m, 1), M_PAD=m_pad, FULL=full, DIV=div, SUPPORT=sup, SETS=sets,
        HAS_BS=bs is not None, HAS_BT=bt is not None, BLOCK_N=bn, BLOCK_V=bv,
        BLOCK_D=cfg["BLOCK_D"], PRECISION=precision, UPCAST=upcast, num_warps=cfg["num_warps"],
    )  # fmt: skip
    got_kl, got_lp_s, got_lp_t, got_ids, got_lse, got_bucket = _merge_splits(
        top_t, top_s, top_i, stats, m, div, jsd[0], sup
    )
    if full and div == DIV_JSD:
        k_p, k_q = _jsd_mixture_kls(h_s, ws, bs, h_t, wt, bt, got_lse, temperature, jsd, cfg)
        got_kl = jsd[0] * k_q + (1.0 - jsd[0]) * k_p
    got = (got_kl, got_lp_s, got_lp_t, got_ids, got_lse, got_bucket)
    for dst, src in zip((kl, lp_s, lp_t, ids, lse, bucket), got, strict=True):
        dst.index_copy_(0, rows, src.to(dst.dtype))
    return kl, lp_s, lp_t, ids, lse, bucket


def _select(key, cand_t, cand_s, cand_i, m):
    """The top-``m`` candidates by ``key`` (``[n, C]``; -inf: no candidate): positions, ids,
    teacher and student values. Candidates are laid out by split (ascending ids) and, within a
    split, in extraction order (ties already by ascending id): a stable sort gives ties to the
    lower id."""
    sel = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :m]
    return sel, cand_i.gather(-1, sel).long(), cand_t.gather(-1, sel), cand_s.gather(-1, sel)


def _floor_holds(val, idx, sel_val, sel_ids):
    """Whether entries ``(val, idx)`` ``[n, X]`` are among a selection made by ``_select`` (its
    values ``sel_val``, ids ``sel_ids`` ``[n, m]``, by descending value, ties to the lower id):
    at or above its m-th entry, compared as the kernel ranks (values clamped at NEG_BIG)."""
    kv = sel_val[:, -1:].clamp_min(NEG_BIG)
    c = val.clamp_min(NEG_BIG)
    return (c > kv) | ((c == kv) & (idx <= sel_ids[:, -1:]))


def _union_merge(top_t, top_s, top_i, tail_s_split, tail_t_split, m: int):
    """The union's ids ``[n, 2M]`` (-1 padding), their teacher and student values (-inf at
    padding) and the tail log-sum-exps ``[n, 1]`` from both candidate lists of every split
    (``[n, splits, 2 M_PAD]``: the split's teacher set, then its student set)."""
    n, splits, width = top_t.shape
    halves = [x.view(n, splits, 2, width // 2) for x in (top_t, top_s, top_i)]
    ninf = torch.full((), -math.inf, device=top_t.device)
    lists = []
    for side in (0, 1):  # 0: the teachers' sets (ranked by t), 1: the students' (by s)
        c_t, c_s, c_i = (x[:, :, side].flatten(1) for x in halves)
        real = c_i >= 0
        key = torch.where(real, (c_t if side == 0 else c_s).clamp_min(NEG_BIG), ninf)
        lists.append((c_t, c_s, c_i, real, *_select(key, c_t, c_s, c_i, m)))
    (t_t, t_s, t_i, t_real, t_sel, t_ids, t_tv, t_sv) = lists[0]
    (s_t, s_s, _, s_real, s_sel, s_ids, s_tv, s_sv) = lists[1]
    # A student candidate its own split's teacher set also holds is counted there: the split's
    # teacher set is the split's top-M, so the test is one comparison with its M-th entry.
    tt, ti = halves[0][:, :, 0], halves[2][:, :, 0]
    t_real_split = ti >= 0
    t_full = t_real_split.sum(-1, keepdim=True) == m
    kv = torch.where(t_real_split, tt.clamp_min(NEG_BIG), math.inf).min(-1, keepdim=True).values
    tie = t_real_split & (tt.clamp_min(NEG_BIG) == kv)
    kid = torch.where(tie, ti, -1).max(-1, keepdim=True).values
    st, si = halves[0][:, :, 1], halves[2][:, :, 1]
    cs = st.clamp_min(NEG_BIG)
    in_split_t = ~t_full | (cs > kv) | ((cs == kv) & (si <= kid))
    s_own = s_real & ~in_split_t.flatten(1)
    # Every candidate outside the union joins the tail once: a teacher-list entry selected by
    # neither side (the students' selection tested by its floor), a student-only entry not
    # selected by the students' (it cannot be in the teachers' selection: not in its split's).
    t_left = t_real.clone()
    t_left.scatter_(-1, t_sel, False)
    t_left &= ~_floor_holds(t_s, t_i, s_sv, s_ids)
    s_left = s_own.clone()
    s_left.scatter_(-1, s_sel, False)
    tails = []
    for split_tail, t_val, s_val in ((tail_s_split, t_s, s_s), (tail_t_split, t_t, s_t)):
        parts = [split_tail, torch.where(t_left, t_val, ninf), torch.where(s_left, s_val, ninf)]
        tails.append(torch.logsumexp(torch.cat(parts, -1), -1, keepdim=True))
    # The union's order: the teacher's top-M, then the student's other ids in student order.
    dup = (s_ids.unsqueeze(-1) == t_ids.unsqueeze(-2)).any(-1)
    order = torch.sort(dup.to(torch.uint8), dim=-1, stable=True).indices
    pad = dup.gather(-1, order)
    extra = [x.gather(-1, order) for x in (s_ids, s_tv, s_sv)]
    ids = torch.cat([t_ids, extra[0].masked_fill(pad, -1)], -1)
    top_tv = torch.cat([t_tv, extra[1].masked_fill(pad, -math.inf)], -1)
    top_sv = torch.cat([t_sv, extra[2].masked_fill(pad, -math.inf)], -1)
    return ids, top_tv, top_sv, tails[0], tails[1]


def _merge_splits(top_t, top_s, top_i, stats, m: int, div: int, beta: float, sup: int):
    """Combine the per-split candidates and tails into the final per-row outputs (PyTorch).

    ``div``, ``beta``: the kernels' divergence code and the JSD's beta; ``sup``: the support
    code. The full-vocabulary JSD's value is the caller's (it needs another pass)."""
    nv = stats.shape[0]
    reverse = div == DIV_REVERSE
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
        if sup == SUPPORT_UNION:
            ids, top_tv, top_sv, tail_s, tail_t = _union_merge(
                top_t, top_s, top_i, tail_s_split, tail_t_split, m
            )
        else:
            cand_t = top_t.flatten(1)
            cand_s = top_s.flatten(1)
            cand_i = top_i.flatten(1)
            real = cand_i >= 0
            ranked = cand_t if sup == 0 else cand_s  # the selecting side's values
            key = torch.where(real, ranked.clamp_min(NEG_BIG), torch.full_like(ranked, -math.inf))
            sel, ids, top_tv, top_sv = _select(key, cand_t, cand_s, cand_i, m)
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
        if div == DIV_JSD:
            kl = bucket_divergence(logp, logq, "jsd", beta)
        else:
            a, b = (logp, logq) if reverse else (logq, logp)
            pa = a.exp()
            kl = (pa * torch.where(pa > 0, a - b, torch.zeros_like(a))).sum(-1)
        bucket = torch.stack([logp, logq], 1)
    lp_s, lp_t = tgt_s - lse_s, tgt_t - lse_t
    return kl, lp_s, lp_t, ids, torch.stack([lse_s, lse_t], -1), bucket


def fused_linear_bwd_triton(
    grad_kl, grad_slp, grad_tlp, hs, ws, bs, ht, wt, bt, target, topk_ids, kl, lse, bucket,
    temperature, divergence, beta, ignore, needs, shared_weight,
):  # fmt: skip
    """Launch the backward; returns ``[d_hs, d_ws, d_bs, d_ht, d_wt, d_bt]`` (None if unneeded).

    Gradients accumulate in fp32 buffers (atomics) and are cast to the input dtypes at the end;
    with ``shared_weight`` both sides add into one weight buffer, returned in the student slot.
    """
    n_hs, n_ws, n_bs, n_ht, n_wt, n_bt = needs
    div, jsd = divergence_args(divergence, beta)
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
        m = topk_ids.shape[1]  # K: M, or 2M for a union (its -1 slots match no column)
        cfg = _config(hs.dtype)
        rowp = torch.zeros(nv, 8, dtype=f32, device=dev)
        rowp[:, 0], rowp[:, 1], rowp[:, 2], rowp[:, 3] = lse_v[:, 0], lse_v[:, 1], u_ls, u_t
        if m == 0:
            rowp[:, 4], rowp[:, 5] = u_kl, kl_v
            if div == DIV_JSD:
                # K_P, K_Q of every row: one more pass over the logit tiles.
                lse_f = lse_v.float()
                rowp[:, 6], rowp[:, 7] = _jsd_mixture_kls(
                    h_s, ws_c, bs_c, h_t, wt_c, bt_c, lse_f, temperature, jsd, cfg
                )
            c_s = c_t = rowp  # unused by the FULL kernel
            ids = tgt
        else:
            b_rows = bucket.index_select(0, rows)
            name = ("reverse", "forward", "jsd")[div]  # "jsd" at beta 0 / 1: a KL
            c_s, c_t = bucket_coefs(u_kl, kl_v, b_rows, name, jsd[0], u_ls, u_t)
            ids = topk_ids.index_select(0, rows).contiguous()
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
            h_t.stride(0), wt_c.stride(0), 1.0 / temperature, *jsd,
            M=max(m, 1), FULL=m == 0, DIV=div, HAS_BS=bs is not None,
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
