"""``vocab_parallel.topk_tail_kl``: :func:`lopd_kernels.topk_tail_kl` over vocabulary shards.

Every rank of the tensor-parallel group passes its ``[..., V_local]`` shard of both logits and
the same targets; every rank gets the full per-row outputs of the single-process op (global
``topk_ids``), and gradients reach this rank's shards. Per row the ranks exchange their O(K)
candidates and six scalars, once (:mod:`lopd_kernels.vocab_parallel.candidates`); the backward
needs no communication (every rank holds the global statistics). Maths: docs/math.md, section 7.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lopd_kernels._backend import check_backend
from lopd_kernels.bucket_math import op_divergence, support_size, support_width
from lopd_kernels.row_layout import rows_in_place
from lopd_kernels.topk_tail_kl import BACKENDS, TopKTailKLOutput, implementation_limits
from lopd_kernels.topk_tail_kl_checks import (
    check_inputs,
    check_rows_have_mass,
    check_targets_in_range,
)
from lopd_kernels.vocab_parallel.block_stats import (
    BlockOptions,
    Sides,
    Upstream,
    block_grads,
    merge_block,
)
from lopd_kernels.vocab_parallel.shard_stats import compute_dtype
from lopd_kernels.vocab_parallel.shards import (
    LocalShard,
    ShardLayout,
    agree,
    checksum,
    fingerprint,
)

__all__ = ["support_mass", "topk_tail_kl"]

_SIDES = ("student_logits", "teacher_logits")


class _Plan(NamedTuple):
    """What the autograd function needs besides the logits."""

    layout: ShardLayout
    target: Tensor  # [N] int64 global targets
    ignore_index: int
    opts: BlockOptions


def support_mass(bucket: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """``[N]`` the teacher's mass on the support, ``sum_i exp(log Q_i)`` in the buckets' dtype
    (1 for the full vocabulary, 0 at ignored rows): the single-process op's
    ``teacher_topk_mass``, kept in float64 for float64 inputs."""
    k = bucket.shape[-1] - 1
    mass = bucket[:, 1, :k].exp().sum(-1) if k else torch.ones_like(bucket[:, 0, 0])
    return torch.where(target == ignore_index, torch.zeros_like(mass), mass)


class _TopKTailKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, plan: _Plan):
        layout, opts = plan.layout, plan.opts
        s, t = rows_in_place(student), rows_in_place(teacher)
        tgt = plan.target
        n, dev = tgt.numel(), tgt.device
        local, owned, ignore = layout.local_targets(tgt, plan.ignore_index)
        valid = tgt != plan.ignore_index
        rows = valid.nonzero().squeeze(1)
        k = support_width(opts.m, opts.support)
        dt = compute_dtype(student, teacher)
        ids = torch.zeros(n, k, dtype=torch.int64, device=dev)
        bucket = torch.zeros(n, 2, k + 1, dtype=dt, device=dev)
        lse = torch.zeros(n, 2, dtype=dt, device=dev)
        logprob = torch.zeros(n, 2, dtype=dt, device=dev)
        kl = torch.zeros(n, dtype=dt, device=dev)
        jsd_kls = None
        if rows.numel():
            got = merge_block(opts, layout, s, t, tgt, local, ignore, rows)
            pairs = ((ids, got.ids), (bucket, got.bucket_logp), (lse, got.lse))
            pairs += ((logprob, got.logprob), (kl, got.kl))
            for dst, src in pairs:
                dst.index_copy_(0, rows, src.to(dst.dtype))
            check_rows_have_mass(lse, tgt, plan.ignore_index, _SIDES)
            if got.jsd_kls is not None:
                jsd_kls = torch.zeros(n, 2, dtype=dt, device=dev)
                jsd_kls.index_copy_(0, rows, got.jsd_kls.to(dt))
        ctx.save_for_backward(student, teacher, local, owned, valid, ids, kl, lse, bucket)
        ctx.jsd_kls, ctx.plan, ctx.ignore = jsd_kls, plan, ignore
        ctx.mark_non_differentiable(ids, bucket)
        return kl, logprob[:, 0].clone(), logprob[:, 1].clone(), ids, bucket

    @staticmethod
    def backward(ctx, g_kl, g_slp, g_tlp, _g_ids, _g_bucket):
        student, teacher, local, owned, valid, ids, kl, lse, bucket = ctx.saved_tensors
        plan = ctx.plan
        needs = Sides(*ctx.needs_input_grad[:2])
        up = Upstream(*(kl.new_zeros(kl.shape) if g is None else g for g in (g_kl, g_slp, g_tlp)))
        grads = block_grads(
            plan.opts, plan.layout, rows_in_place(student), rows_in_place(teacher),
            (local, owned, valid, ctx.ignore), (ids, kl, lse, bucket, ctx.jsd_kls), up, needs,
        )  # fmt: skip
        gs, gt = grads.student_logits, grads.teacher_logits
        gs = None if gs is None else gs.reshape(student.shape)
        gt = None if gt is None else gt.reshape(teacher.shape)
        return gs, gt, None


def topk_tail_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
    backend: str = "auto",
) -> TopKTailKLOutput:
    """:func:`lopd_kernels.topk_tail_kl` of logits sharded over the vocabulary.

    Call it on every rank of ``group`` with that rank's shard; the result equals the
    single-process op on the whole logits (the same global top-M, ties to the lower global id
    across shard boundaries too; the tail a log-sum-exp of the complement).

    Args:
        student_logits, teacher_logits: ``[..., V_local]`` this rank's shard (the same
            ``V_local`` for both; shards may differ in size across ranks; ``-inf`` entries, a
            padded vocabulary, allowed).
        target_ids: ``[...]`` global target ids in ``[0, V)`` or ``ignore_index``, the same on
            every rank.
        group: the tensor-parallel process group (``None``: the default group).
        vocab_start: this rank's first global id; ``None``: ``rank * V_local`` (Megatron-core's
            contiguous equal partition, ``VocabUtility``). Given on every rank or on none.
        top_m: M; ``None`` (or ``>= V``, the whole vocabulary) the full-vocabulary divergence.
        temperature, divergence, beta, support, ignore_index: as :func:`lopd_kernels.topk_tail_kl`,
            the same on every rank.
        backend: the single-process implementation each rank runs on its shard (``"auto"``: C++
            on CPU, Triton / CUDA on a GPU; ``"torch"``: the reference's formulas).

    Returns:
        :class:`~lopd_kernels.topk_tail_kl.TopKTailKLOutput`, the full per-row outputs on every
        rank (``topk_ids`` global). Gradients flow to this rank's shards only.

    Raises:
        TypeError / ValueError: on every rank, before any data collective: a bad argument on any
            rank, ``N`` or an option or the targets differing across ranks, shards that do not
            tile ``[0, V)``; a target outside ``[0, V)``; a row whose logits are all ``-inf``.
    """
    s, t = student_logits, teacher_logits

    def check():
        check_inputs(s, t, target_ids, top_m, temperature, divergence, ignore_index, beta, support)
        check_backend(backend)
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"vocab_start must be None or an int >= 0, got {vocab_start!r}")
        prints = fingerprint(
            options=(top_m, float(temperature), divergence, beta, support, ignore_index),
            target_ids=checksum(target_ids),
            precision=str(compute_dtype(s, t)),
        )
        return LocalShard(target_ids.numel(), s.shape[-1], vocab_start, prints)

    device = s if isinstance(s, Tensor) else None
    layout = agree("topk_tail_kl", group, check=check, device_of=device)
    target = target_ids.reshape(-1).long()
    check_targets_in_range(target, layout.vocab, ignore_index)
    m = 0 if top_m is None or top_m >= layout.vocab else top_m
    div, div_beta = op_divergence(divergence, beta)
    fp64 = torch.float64 in (s.dtype, t.dtype)
    limits = implementation_limits(m)
    impl = BACKENDS.resolve(backend, s.device, fp64=fp64, unsupported=limits)
    opts = BlockOptions(m, support, float(temperature), div, div_beta, impl)
    kl, slp, tlp, ids, bucket = _TopKTailKL.apply(s, t, _Plan(layout, target, ignore_index, opts))
    lead = s.shape[:-1]
    return TopKTailKLOutput(
        kl=kl.reshape(lead),
        privilege=(tlp - slp.detach()).reshape(lead),
        student_logprob=slp.reshape(lead),
        teacher_logprob=tlp.reshape(lead),
        topk_ids=ids.reshape(*lead, ids.shape[-1]),
        teacher_topk_mass=support_mass(bucket, target, ignore_index).reshape(lead),
        support_size=support_size(ids, target, ignore_index, layout.vocab).reshape(lead),
    )
