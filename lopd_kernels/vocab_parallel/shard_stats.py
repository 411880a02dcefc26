"""One rank's partial statistics of its vocabulary shard, from the single-process kernels.

The one-pass forward kernels of ``topk_tail_kl`` and ``sparse_teacher_topk_tail_kl`` already
compute, for a block of logits, everything a shard must contribute: run on the shard with the
shard's own targets, their ``topk_ids`` are the shard's local support (the same selection rule),
their ``lse`` the shard's log-sum-exps and their tail bucket ``log P_tail = LSE_tail - lse`` the
shard's tail log-sum-exp relative to it. So each rank runs the kernel its device has (C++ on CPU,
Triton or CUDA on a GPU: the implementation ``backend=`` resolves to, as the single-process op)
and reads the raw logits of its O(K) candidates back from the shard. The kernels' own divergence
of the shard is discarded (O(K) per row).

The PyTorch twins here serve what no kernel takes: float64 inputs and ``backend="torch"`` (the
reference, in the inputs' precision), a shard no wider than M (the kernels need
``M < V_local``: its whole shard is then its candidates, an ``[N, V_local]`` block of at most
``[N, M]``), and the full-vocabulary JSD, whose per-entry terms need the global log-sum-exps
first (:func:`jsd_partial_kls`; docs/math.md, section 7).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels.bucket_math import (
    masked_logsumexp,
    mixture_logmass,
    select_support,
    support_masks,
)
from lopd_kernels.op_outputs import SparseTeacherTopKTailKLOpOutput, TopKTailKLOpOutput
from lopd_kernels.sparse_teacher_topk_tail_kl import CUSTOM_OPS as SPARSE_OPS
from lopd_kernels.topk_tail_kl import CUSTOM_OPS as TOPK_OPS
from lopd_kernels.vocab_parallel.candidates import ShardStats

__all__ = [
    "FullStats",
    "SparseStats",
    "full_shard_stats",
    "gather_rows",
    "jsd_partial_kls",
    "sparse_shard_stats",
    "topk_shard_stats",
]


class FullStats(NamedTuple):
    """A shard's statistics for the full-vocabulary divergence (``top_m=None``).

    Attributes:
        kl: ``[N]`` the KL of the two rows renormalized within the shard (zeros for the JSD).
        lse: ``[N, 2]`` log-sum-exp of ``x / T`` over the shard (student, teacher).
        logprob: ``[N, 2]`` the target log-probs within the shard.
    """

    kl: Tensor
    lse: Tensor
    logprob: Tensor


class SparseStats(NamedTuple):
    """A shard's statistics against a sparse teacher.

    Attributes:
        top: ``[N, M]`` raw student logits at the teacher's real ids in this shard, ``-inf`` at
            the others (another shard's, or padding).
        lse: ``[N]`` log-sum-exp of ``s / T`` over the shard.
        tail: ``[N]`` the same over the shard's ids that are not teacher ids.
        logprob: ``[N]`` the target's log-prob within the shard.
    """

    top: Tensor
    lse: Tensor
    tail: Tensor
    logprob: Tensor


def compute_dtype(*xs: Tensor) -> torch.dtype:
    """float64 if an input is float64 (the reference's precision), else float32."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def gather_rows(x: Tensor, ids: Tensor) -> Tensor:
    """``[N, K]`` entries ``x[n, ids[n, k]]`` of ``[N, V]`` or ``[B, L, V]`` logits (``ids``
    in range), without copying ``x``."""
    k = ids.shape[-1]
    if x.dim() == 3:
        return x.gather(-1, ids.view(x.shape[0], x.shape[1], k)).reshape(-1, k)
    return x.gather(-1, ids)


def _tail_from_bucket(bucket_tail: Tensor, lse: Tensor) -> Tensor:
    """A kernel's tail log-sum-exp from its ``log P_tail`` and ``lse`` (``-inf`` where the
    shard's row has no mass, whose relative tail is undefined)."""
    out = bucket_tail.double() + lse.double()
    return torch.where(lse == -math.inf, -math.inf, out)


def topk_shard_stats(
    impl: str,
    s: Tensor,
    t: Tensor,
    target: Tensor,
    ignore_index: int,
    m: int,
    support: str,
    temperature: float,
    divergence: str,
    beta: float,
    start: int,
) -> ShardStats:
    """The shard's :class:`ShardStats` for the top-M buckets (``1 <= m``).

    Args:
        impl: the single-process implementation (``"cpu"``, ``"cuda"``, ``"triton"``, or
            ``"torch"``: the twin).
        s, t: ``[N, V_local]`` / ``[B, L, V_local]`` the shard's logits (rows in place).
        target: ``[N]`` int64 local targets (:meth:`ShardLayout.local_targets`).
        ignore_index: the local ignore marker.
        start: the shard's first global id.
    """
    v_local = s.shape[-1]
    if impl == "torch" or m >= v_local:
        return _topk_stats_torch(s, t, target, ignore_index, m, support, temperature, start)
    out = TopKTailKLOpOutput(*TOPK_OPS.fwd_op(impl)(
        s, t, target, m, float(temperature), divergence, beta, support, int(ignore_index)
    ))  # fmt: skip
    ids = out.topk_ids
    pad = ids < 0
    safe = ids.clamp(min=0)
    f32 = torch.float32
    raw_s = gather_rows(s, safe).to(f32).masked_fill(pad, -math.inf)
    raw_t = gather_rows(t, safe).to(f32).masked_fill(pad, -math.inf)
    k = ids.shape[1]
    return ShardStats(
        ids=torch.where(pad, ids, ids + start),
        s=raw_s,
        t=raw_t,
        lse=out.lse,
        tail=_tail_from_bucket(out.bucket_logp[:, :, k], out.lse),
        logprob=torch.stack([out.student_logprob, out.teacher_logprob], 1),
    )


def _flat(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


def _local_logprob(x: Tensor, lse: Tensor, target: Tensor, vocab: int) -> Tensor:
    """``x[a] - lse`` at in-range local targets (others: 0, unused)."""
    inside = (target >= 0) & (target < vocab)
    a = torch.where(inside, target, torch.zeros_like(target)).unsqueeze(1)
    return torch.where(inside, x.gather(1, a).squeeze(1) - lse, 0.0)


def _topk_stats_torch(
    s: Tensor,
    t: Tensor,
    target: Tensor,
    ignore_index: int,
    m: int,
    support: str,
    temperature: float,
    start: int,
) -> ShardStats:
    """The twin of :func:`topk_shard_stats` (float64 for float64 inputs)."""
    del ignore_index  # ignored rows' statistics are never read
    dt = compute_dtype(s, t)
    raw_s, raw_t = _flat(s, dt), _flat(t, dt)
    n, v_local = raw_s.shape
    k = 2 * m if support == "union" else m
    if m >= v_local:  # the whole shard is its local support
        ids = torch.arange(v_local, device=raw_s.device).expand(n, v_local)
        ids = torch.nn.functional.pad(ids, (0, k - v_local), value=-1)
    else:
        ids = select_support(raw_s, raw_t, m, support)
    in_support, pad = support_masks(ids, v_local)
    safe = ids.clamp(min=0)
    lse, tail, logprob = [], [], []
    for x in (raw_s / temperature, raw_t / temperature):
        lse.append(torch.logsumexp(x, 1))
        tail.append(masked_logsumexp(x, ~in_support))
        logprob.append(_local_logprob(x, lse[-1], target, v_local))
    return ShardStats(
        ids=torch.where(pad, ids, ids + start),
        s=raw_s.gather(1, safe).masked_fill(pad, -math.inf),
        t=raw_t.gather(1, safe).masked_fill(pad, -math.inf),
        lse=torch.stack(lse, 1),
        tail=torch.stack(tail, 1),
        logprob=torch.stack(logprob, 1),
    )


def full_shard_stats(
    impl: str,
    s: Tensor,
    t: Tensor,
    target: Tensor,
    ignore_index: int,
    temperature: float,
    divergence: str,
) -> FullStats:
    """The shard's :class:`FullStats` (``top_m=None``). The KLs run the kernel's full-vocabulary
    mode on the shard (its own KL, renormalized within the shard); the JSD (and the twin) only
    the log-sum-exps and log-probs here (:func:`jsd_partial_kls` needs the global ones)."""
    if impl != "torch" and divergence != "jsd":
        out = TopKTailKLOpOutput(*TOPK_OPS.fwd_op(impl)(
            s, t, target, 0, float(temperature), divergence, 1.0, "teacher", int(ignore_index)
        ))  # fmt: skip
        return FullStats(
            out.kl, out.lse, torch.stack([out.student_logprob, out.teacher_logprob], 1)
        )
    dt = compute_dtype(s, t)
    x_s, x_t = _flat(s, dt) / temperature, _flat(t, dt) / temperature
    v_local = x_s.shape[1]
    lse = torch.stack([torch.logsumexp(x_s, 1), torch.logsumexp(x_t, 1)], 1)
    logprob = torch.stack(
        [_local_logprob(x, lse[:, i], target, v_local) for i, x in enumerate((x_s, x_t))], 1
    )
    kl = torch.zeros_like(lse[:, 0])
    if divergence != "jsd":
        ls, lt = x_s - lse[:, :1], x_t - lse[:, 1:]
        w, o = (ls, lt) if divergence == "reverse" else (lt, ls)
        zero = w == -math.inf
        terms = torch.where(zero, 0.0, w.exp() * (w - o.masked_fill(zero, 0.0)))
        kl = terms.sum(1)
    return FullStats(kl, lse, logprob)


def jsd_partial_kls(
    s: Tensor, t: Tensor, lse: Tensor, beta: float, temperature: float, rows: Tensor
) -> Tensor:
    """``[N, 2]`` this shard's share of ``KL(P || M)`` and ``KL(Q || M)`` of the full-vocabulary
    JSD, given the global ``lse [N, 2]``: ``sum_{j in shard} S_j (log S_j - log M_j)`` and the
    teacher's. Rows outside ``rows`` (bool ``[N]``) give 0."""
    dt = compute_dtype(s, t)
    ls = _flat(s, dt) / temperature - lse[:, :1].to(dt)
    lt = _flat(t, dt) / temperature - lse[:, 1:].to(dt)
    keep = rows.unsqueeze(1)
    ls = torch.where(keep, ls, -math.inf)
    lt = torch.where(keep, lt, -math.inf)
    lm = mixture_logmass(ls, lt, beta)
    out = []
    for x in (ls, lt):
        zero = x == -math.inf
        out.append(torch.where(zero, 0.0, x.exp() * (x.masked_fill(zero, 0.0) - lm)).sum(1))
    return torch.stack(out, 1)


def sparse_shard_stats(
    impl: str,
    s: Tensor,
    logprobs: Tensor,
    ids: Tensor,
    owned: Tensor,
    target: Tensor,
    ignore_index: int,
    temperature: float,
    reverse: bool,
    tail_floor: float,
    start: int,
) -> SparseStats:
    """The shard's :class:`SparseStats`.

    Args:
        s: ``[N, V_local]`` the shard's student logits.
        logprobs, ids: ``[N, M]`` the teacher's top-M (global ids; ``-inf``: padding).
        owned: ``[N, M]`` bool, the real slots whose id lies in this shard.
        target: ``[N]`` local targets; ignore_index: the local ignore marker.
    """
    local_ids = torch.where(owned, ids - start, torch.zeros_like(ids))
    if impl == "torch":
        dt = compute_dtype(s, logprobs)
        x = s.to(dt) / temperature
        n, v_local = x.shape
        in_top = torch.zeros(n, v_local, dtype=torch.int32, device=x.device)
        in_top = in_top.scatter_add(1, local_ids, owned.int()) > 0
        lse = torch.logsumexp(x, 1)
        tail = masked_logsumexp(x, ~in_top)
        logprob = _local_logprob(x, lse, target, v_local)
    else:
        # The teacher's other slots become padding for the shard's kernel: their ids stay out
        # of its tail only in the shards that hold them.
        lp = torch.where(owned, logprobs.float(), -math.inf).contiguous()
        out = SparseTeacherTopKTailKLOpOutput(*SPARSE_OPS.fwd_op(impl)(
            s, lp, local_ids.contiguous(), target, float(temperature), reverse,
            int(ignore_index), float(tail_floor),
        ))  # fmt: skip
        lse, logprob = out.lse, out.student_logprob
        tail = _tail_from_bucket(out.bucket_logp[:, 0, -1], lse)
    top = gather_rows(s, local_ids).to(compute_dtype(s)).masked_fill(~owned, -math.inf)
    return SparseStats(top, lse, tail, logprob)
