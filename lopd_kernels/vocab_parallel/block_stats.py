"""A block of rows of the top-M + tail family on one vocabulary shard: its global statistics
(one collective) and the shard's logit gradients from them (no collective).

What ``vocab_parallel.topk_tail_kl`` does with the whole logits and
``vocab_parallel.fused_linear_topk_tail_kl_loss`` with each chunk's logit blocks: every rank runs
:func:`merge_block` on its shard of the same rows (the same collectives in the same order), gets
the same global buckets, log-sum-exps, target log-probs and divergence, and then
:func:`block_grads` gives its shard's slice of the logit gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels.vocab_parallel.candidates import (
    bucket_kl,
    merge_full_kl,
    merge_topk,
    owner_logprob,
    pack,
    unpack,
)
from lopd_kernels.vocab_parallel.shard_grads import (
    LogitGrads,
    Sides,
    Upstream,
    topk_shard_grads,
    topk_shard_grads_torch,
)
from lopd_kernels.vocab_parallel.shard_stats import (
    compute_dtype,
    full_shard_stats,
    jsd_partial_kls,
    topk_shard_stats,
)
from lopd_kernels.vocab_parallel.shards import ShardLayout, all_gather_rows

__all__ = [
    "BlockOptions",
    "GlobalRows",
    "LogitGrads",
    "Sides",
    "Upstream",
    "block_grads",
    "merge_block",
    "uses_twin",
]


class BlockOptions(NamedTuple):
    """The op's options, the same on every rank, and this shard's implementation."""

    m: int  # M, 0: the full vocabulary
    support: str
    temperature: float
    divergence: str  # as the kernels take it (lopd_kernels.bucket_math.op_divergence)
    beta: float
    impl: str  # the single-process implementation: "cpu", "cuda", "triton", "torch"


class GlobalRows(NamedTuple):
    """Global statistics of a block's rows (float64; identical on every rank).

    Attributes:
        ids: ``[R, K]`` int64 global support ids (``[R, 0]`` for the full vocabulary).
        bucket_logp: ``[R, 2, K + 1]`` bucket log-masses (``[R, 2, 1]`` zeros: full vocabulary).
        lse: ``[R, 2]`` log-sum-exps of ``logits / T`` over the whole vocabulary.
        logprob: ``[R, 2]`` target log-probs (student, teacher).
        kl: ``[R]`` the divergence.
        jsd_kls: ``[R, 2]`` ``KL(P || M)``, ``KL(Q || M)`` of the full-vocabulary JSD, else None.
    """

    ids: Tensor
    bucket_logp: Tensor
    lse: Tensor
    logprob: Tensor
    kl: Tensor
    jsd_kls: Tensor | None


def uses_twin(opts: BlockOptions, v_local: int) -> bool:
    """Whether a shard runs the PyTorch twins: the reference's formulas (``"torch"``), a shard
    the kernels cannot take (``M >= V_local``), or the full-vocabulary JSD."""
    if opts.impl == "torch":
        return True
    if opts.m == 0:
        return opts.divergence == "jsd"
    return opts.m >= v_local


def merge_block(
    opts: BlockOptions,
    layout: ShardLayout,
    s: Tensor,
    t: Tensor,
    target: Tensor,
    local: Tensor,
    ignore: int,
    rows: Tensor,
) -> GlobalRows:
    """The global statistics of rows ``rows`` of a shard's logit block: one all-gather (two for
    the full-vocabulary JSD).

    Args:
        s, t: ``[B, V_local]`` (or ``[B1, B2, V_local]``) this shard's logits of the block.
        target: ``[B]`` global targets; local, ignore: as
            :meth:`~lopd_kernels.vocab_parallel.shards.ShardLayout.local_targets` gives them.
        rows: ``[R]`` the rows with a target (the same on every rank).
    """
    impl = "torch" if uses_twin(opts, s.shape[-1]) else opts.impl
    dt = compute_dtype(s, t)
    owner = layout.owner(target.index_select(0, rows))
    if opts.m:
        stats = topk_shard_stats(
            impl, s, t, local, ignore, opts.m, opts.support, opts.temperature,
            opts.divergence, opts.beta, layout.start,
        )  # fmt: skip
        kept = type(stats)(*(x.index_select(0, rows) for x in stats))
        gathered = unpack(all_gather_rows(pack(kept, dt), layout), kept.ids.shape[1])
        merged = merge_topk(gathered, opts.m, opts.support, opts.temperature, owner)
        return GlobalRows(
            ids=merged.ids,
            bucket_logp=merged.bucket_logp,
            lse=merged.lse,
            logprob=merged.logprob,
            kl=bucket_kl(merged.bucket_logp, opts.divergence, opts.beta),
            jsd_kls=None,
        )
    full = full_shard_stats(impl, s, t, local, ignore, opts.temperature, opts.divergence)
    cols = torch.cat([full.kl.unsqueeze(1), full.lse, full.logprob], 1).index_select(0, rows)
    got = all_gather_rows(cols.to(dt), layout).double()  # [W, R, 5]
    full_kl = merge_full_kl(got[..., 0], got[..., 1:3], opts.divergence == "reverse")
    kl, lse = full_kl.kl, full_kl.lse
    logprob = torch.stack(
        [owner_logprob(got[..., 3 + x], got[..., 1 + x], owner) for x in (0, 1)], 1
    )
    jsd_kls = None
    if opts.divergence == "jsd":
        keep = torch.zeros(target.shape[0], dtype=torch.bool, device=s.device)
        keep[rows] = True
        lse_all = lse.new_zeros(keep.shape[0], 2).index_copy_(0, rows, lse)
        part = jsd_partial_kls(s, t, lse_all, opts.beta, opts.temperature, keep)
        jsd_kls = all_gather_rows(part.index_select(0, rows).to(dt), layout).double().sum(0)
        kl = opts.beta * jsd_kls[:, 1] + (1.0 - opts.beta) * jsd_kls[:, 0]
    n = rows.numel()
    ids = torch.zeros(n, 0, dtype=torch.int64, device=s.device)
    return GlobalRows(ids, lse.new_zeros(n, 2, 1), lse, logprob, kl, jsd_kls)


def block_grads(
    opts: BlockOptions,
    layout: ShardLayout,
    s: Tensor,
    t: Tensor,
    targets: tuple[Tensor, Tensor, Tensor, int],
    stats: tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None],
    upstream: Upstream,
    needs: Sides,
) -> LogitGrads:
    """This shard's logit gradients of a block.

    Args:
        s, t: the shard's logits of the block.
        targets: ``(local, owned, valid, ignore)`` of the block's rows (local targets, rows
            whose target is in this shard, rows with a target, the local ignore marker).
        stats: the global ``(ids [B, K], kl [B], lse [B, 2], bucket_logp [B, 2, K + 1],
            jsd_kls [B, 2] or None)`` of every row of the block (0 at ignored rows).
        upstream: ``[B]`` each.
    """
    local, owned, valid, ignore = targets
    ids, kl, lse, bucket, jsd_kls = stats
    local_ids = torch.where(layout.owned(ids) & (ids >= 0), ids - layout.start, -1)
    if uses_twin(opts, s.shape[-1]):
        up = Upstream(*(u.to(kl.dtype) for u in upstream))
        return topk_shard_grads_torch(
            up, s, t, local, owned, valid, local_ids, (kl, lse, bucket), opts.temperature,
            opts.divergence, opts.beta, needs, jsd_kls,
        )  # fmt: skip
    up = Upstream(*(u.float().contiguous() for u in upstream))
    f32 = (kl.float(), lse.float().contiguous(), bucket.float().contiguous())
    return topk_shard_grads(
        opts.impl, up, s, t, local, ignore, valid & ~owned, local_ids, f32, opts.temperature,
        opts.divergence, opts.beta, needs,
    )  # fmt: skip
