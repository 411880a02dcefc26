"""The per-rank partial statistics of the top-M + tail family and their exact merge.

Each rank reduces its ``[N, V_local]`` shard to O(K) numbers per row (``K = M``, or ``2M`` for
the union support): its local support (the shard's own top-M by the same rule, ties to the lower
id), the raw logits of those ids on both sides, the log-sum-exp of the whole shard and of the
shard's *tail* (every local id outside its local support), and the target log-probs within the
shard. :func:`pack` writes them in one row of floats (ids as their integer bits) for one
all-gather; :func:`merge_topk` turns the gathered rows into the global buckets.

Why this is exact (docs/math.md, section 7): the global top-M of a side is, id by id, among the
ranks' local top-Ms of that side (a shard's M best entries contain every one of its entries that
is among the M best of all), so the selection over the gathered candidates, by descending logit
and then ascending global id, is the single-process one, ties across shard boundaries included.
Every entry outside the global support is either in some rank's local tail or a gathered
candidate that was not selected, so the global tail's log-sum-exp is that of the ranks' local
tail log-sum-exps and the unselected candidates: the log-sum-exp of the complement, never
``1 - sum``, and no second pass over the logits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels.bucket_math import bucket_divergence, select_support

__all__ = [
    "FullKL",
    "GlobalBuckets",
    "ShardStats",
    "merge_full_kl",
    "merge_topk",
    "owner_logprob",
    "pack",
    "packed_width",
    "unpack",
]


class ShardStats(NamedTuple):
    """One rank's partial statistics of its vocabulary shard (leading dims ``[..., N]``: one
    rank's rows, or ``[R, N]`` once gathered).

    Attributes:
        ids: ``[..., N, K]`` int64 global ids of the shard's local support (-1: none).
        s, t: ``[..., N, K]`` their raw student / teacher logits (-inf at -1 slots).
        lse: ``[..., N, 2]`` log-sum-exp of ``logits / T`` over the shard (student, teacher).
        tail: ``[..., N, 2]`` the same over the shard's ids outside its local support.
        logprob: ``[..., N, 2]`` ``x_a / T - lse`` of the row's target within the shard (only
            the shard holding the target means anything).
    """

    ids: Tensor
    s: Tensor
    t: Tensor
    lse: Tensor
    tail: Tensor
    logprob: Tensor


class GlobalBuckets(NamedTuple):
    """The merged, global statistics of the rows (identical on every rank).

    Attributes:
        ids: ``[N, K]`` int64 global support ids, as the single-process op's ``topk_ids``.
        bucket_logp: ``[N, 2, K + 1]`` float64 ``log P_b``, ``log Q_b`` (K: the tail).
        lse: ``[N, 2]`` float64 log-sum-exp of ``logits / T`` over the whole vocabulary.
        logprob: ``[N, 2]`` float64 target log-probs (student, teacher).
    """

    ids: Tensor
    bucket_logp: Tensor
    lse: Tensor
    logprob: Tensor


def packed_width(k: int) -> int:
    """Floats per row of :func:`pack`: ``3K + 6``."""
    return 3 * k + 6


def pack(stats: ShardStats, dtype: torch.dtype) -> Tensor:
    """``[N, 3K + 6]`` one row of ``dtype`` (float32, or float64 for float64 inputs) per token:
    the ids' integer bits, both sides' raw candidate logits, then ``lse``, ``tail``,
    ``logprob``. Raw float32 / bfloat16 / float16 logits are exact in float32."""
    n, k = stats.ids.shape
    out = torch.empty(n, packed_width(k), dtype=dtype, device=stats.ids.device)
    int_view = out.view(torch.int32 if dtype == torch.float32 else torch.int64)
    int_view[:, :k] = stats.ids.to(int_view.dtype)
    out[:, k : 2 * k] = stats.s
    out[:, 2 * k : 3 * k] = stats.t
    out[:, 3 * k :] = torch.cat([stats.lse, stats.tail, stats.logprob], 1)
    return out


def unpack(rows: Tensor, k: int) -> ShardStats:
    """The gathered ``[R, N, 3K + 6]`` rows of :func:`pack` as float64 :class:`ShardStats`."""
    int_view = rows.view(torch.int32 if rows.dtype == torch.float32 else torch.int64)
    ids = int_view[..., :k].to(torch.int64)
    f64 = rows.double()
    return ShardStats(
        ids=ids,
        s=f64[..., k : 2 * k],
        t=f64[..., 2 * k : 3 * k],
        lse=f64[..., 3 * k : 3 * k + 2],
        tail=f64[..., 3 * k + 2 : 3 * k + 4],
        logprob=f64[..., 3 * k + 4 : 3 * k + 6],
    )


def owner_logprob(logprob: Tensor, lse: Tensor, owner: Tensor) -> Tensor:
    """``[N]`` the global ``x_a / T - LSE(x / T)`` from the shard holding the target.

    ``logprob``, ``lse``: ``[R, N]`` per rank (within-shard log-prob, shard log-sum-exp);
    ``owner``: ``[N]`` the rank holding each target. Computed as
    ``logprob_o - log1p(sum_{r != o} exp(lse_r - lse_o))``: both terms keep their digits, so a
    target holding nearly all the mass stays exact (the single-process ops' ``log1p`` form,
    docs/math.md section 6). A shard without mass gives ``-inf``.
    """
    o = owner.unsqueeze(0)
    lse_o = lse.gather(0, o).squeeze(0)
    lp_o = logprob.gather(0, o).squeeze(0)
    others = (lse - lse_o.unsqueeze(0)).exp()
    others = others.scatter(0, o, 0.0).sum(0)
    out = lp_o - torch.log1p(others)
    return torch.where(lse_o == -math.inf, -math.inf, out)


def _logsumexp(x: Tensor, dim: int) -> Tensor:
    """``torch.logsumexp``, ``-inf`` (not NaN) over all ``-inf`` (no gradient needed here)."""
    m = x.amax(dim, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    return ((x - m).exp().sum(dim, keepdim=True).log() + m).squeeze(dim)


def merge_topk(
    stats: ShardStats, m: int, support: str, temperature: float, owner: Tensor
) -> GlobalBuckets:
    """The global buckets of the rows from every rank's gathered :class:`ShardStats`.

    Args:
        stats: ``[R, N, ...]`` float64 statistics of the R ranks (:func:`unpack`).
        m: M >= 1; support: ``"teacher"`` / ``"student"`` / ``"union"``.
        temperature: T (the candidates are raw logits; ``lse``, ``tail`` are of ``x / T``).
        owner: ``[N]`` the rank holding each row's target (any rank at ignored rows).

    Returns:
        :class:`GlobalBuckets`; ignored rows are garbage (the caller zeroes them).
    """
    r, n, k = stats.ids.shape
    ids = stats.ids.permute(1, 0, 2).reshape(n, r * k)
    pad = ids < 0
    neg = torch.tensor(-math.inf, dtype=torch.float64, device=ids.device)
    cand = [torch.where(pad, neg, x.permute(1, 0, 2).reshape(n, r * k)) for x in (stats.s, stats.t)]
    # Columns in ascending global id, the -1 slots last: the stable descending sorts of
    # select_support then break ties to the lower global id, as every single-process kernel,
    # and a -1 slot never wins a tie against a real -inf entry.
    key = torch.where(pad, torch.full_like(ids, torch.iinfo(torch.int64).max), ids)
    order = torch.sort(key, dim=1, stable=True).indices
    ids, pad = ids.gather(1, order), pad.gather(1, order)
    cs, ct = (x.gather(1, order) for x in cand)
    cols = select_support(cs, ct, m, support)  # [N, K_out], -1: a union's padding
    chosen = cols >= 0
    safe = cols.clamp(min=0)
    out_ids = torch.where(chosen, ids.gather(1, safe), -1)
    # A -1 column writes into a spare last column, dropped.
    selected = torch.zeros(n, r * k + 1, dtype=torch.bool, device=ids.device)
    selected = selected.scatter_(1, torch.where(chosen, cols, r * k), True)[:, : r * k]
    lse = _logsumexp(stats.lse, 0)  # [N, 2]
    logs = []
    for side, c in enumerate((cs, ct)):
        scaled = c / temperature
        top = torch.where(chosen, scaled.gather(1, safe), neg)
        rest = torch.where(selected | pad, neg, scaled)
        tail = _logsumexp(torch.cat([stats.tail[..., side].T, rest], 1), 1)
        logs.append(torch.cat([top, tail.unsqueeze(1)], 1) - lse[:, side : side + 1])
    logprob = torch.stack(
        [owner_logprob(stats.logprob[..., x], stats.lse[..., x], owner) for x in (0, 1)], 1
    )
    return GlobalBuckets(out_ids, torch.stack(logs, 1), lse, logprob)


class FullKL(NamedTuple):
    """The merged full-vocabulary KL of the rows and their log-sum-exps (float64)."""

    kl: Tensor  # [N]
    lse: Tensor  # [N, 2]


def merge_full_kl(kl: Tensor, lse: Tensor, reverse: bool) -> FullKL:
    """The full-vocabulary KL from each shard's own KL, by the chain rule of the KL over the
    grouping of the vocabulary into shards.

    With ``P_r``, ``Q_r`` the shards' masses and ``KL_r`` the KL of the distributions
    renormalized within shard r, ``KL(P || Q) = sum_r P_r (KL_r + log P_r - log Q_r)`` (the
    forward KL with the roles swapped).

    Args:
        kl: ``[R, N]`` each shard's KL of its renormalized rows; lse: ``[R, N, 2]``.

    Returns:
        :class:`FullKL`.
    """
    total = _logsumexp(lse, 0)
    log_mass = lse - total.unsqueeze(0)  # [R, N, 2]: log P_r, log Q_r
    w, o = (log_mass[..., 0], log_mass[..., 1]) if reverse else (log_mass[..., 1], log_mass[..., 0])
    term = w.exp() * (kl + w - o)
    term = torch.where(o == -math.inf, math.inf, term)
    term = torch.where(w == -math.inf, 0.0, term)
    return FullKL(term.sum(0), total)


def bucket_kl(bucket_logp: Tensor, divergence: str, beta: float) -> Tensor:
    """``[N]`` the divergence of ``[N, 2, B]`` bucket log-masses (float64, no gradient)."""
    return bucket_divergence(bucket_logp[:, 0], bucket_logp[:, 1], divergence, beta)
