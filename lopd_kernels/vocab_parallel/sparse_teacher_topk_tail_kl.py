"""``vocab_parallel.sparse_teacher_topk_tail_kl``: the sparse-teacher op over vocabulary-sharded
student logits (verl's Megatron distillation case: a served teacher's top-M, a tensor-parallel
student).

Every rank passes its ``[..., V_local]`` shard of the student logits and the same teacher top-M
(global ids) and targets. A teacher id belongs to one shard; each rank runs the single-process
kernel on its shard with the other shards' ids as padding, which gives its shard's log-sum-exp,
the log-sum-exp of its ids that are not teacher ids (its share of the student's tail) and its
student logits at the teacher ids it holds. One all-gather of those ``M + 3`` numbers per row and
rank, and every rank has the single-process op's outputs. The backward needs no communication.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lopd_kernels._backend import check_backend
from lopd_kernels.bucket_math import bucket_divergence
from lopd_kernels.sparse_teacher_topk_tail_kl import (
    BACKENDS,
    SparseTeacherTopKTailKLOutput,
    teacher_log_tail,
)
from lopd_kernels.sparse_teacher_topk_tail_kl import _limits as kernel_limits
from lopd_kernels.sparse_teacher_topk_tail_kl_checks import (
    check_inputs,
    check_rows_have_mass,
    check_values,
)
from lopd_kernels.vocab_parallel.candidates import owner_logprob
from lopd_kernels.vocab_parallel.shard_grads import (
    Upstream,
    sparse_shard_grads,
    sparse_shard_grads_torch,
)
from lopd_kernels.vocab_parallel.shard_stats import compute_dtype, sparse_shard_stats
from lopd_kernels.vocab_parallel.shards import (
    LocalShard,
    ShardLayout,
    agree,
    all_gather_rows,
    checksum,
    fingerprint,
)

__all__ = ["sparse_teacher_topk_tail_kl"]


class _Plan(NamedTuple):
    layout: ShardLayout
    logprobs: Tensor  # [N, M] the teacher's (float32; float64 for float64 inputs)
    ids: Tensor  # [N, M] int64 global
    target: Tensor  # [N] int64 global
    temperature: float
    reverse: bool
    ignore_index: int
    tail_floor: float
    impl: str


def _logsumexp0(x: Tensor) -> Tensor:
    """Log-sum-exp over dim 0, ``-inf`` over all ``-inf``."""
    m = x.amax(0)
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    return (x - m_safe).exp().sum(0).log() + m_safe


class _SparseTeacher(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: Tensor, plan: _Plan):
        layout = plan.layout
        s = student.reshape(-1, student.shape[-1]).contiguous()
        n, m = plan.ids.shape
        dt = compute_dtype(student, plan.logprobs)
        local, owned_t, ignore = layout.local_targets(plan.target, plan.ignore_index)
        valid = plan.target != plan.ignore_index
        real = plan.logprobs > -math.inf
        owned = layout.owned(plan.ids) & real & valid.unsqueeze(1)
        stats = sparse_shard_stats(
            plan.impl, s, plan.logprobs, plan.ids, owned, local, ignore, plan.temperature,
            plan.reverse, plan.tail_floor, layout.start,
        )  # fmt: skip
        rows = valid.nonzero().squeeze(1)
        cols = torch.cat(
            [stats.top.to(dt), torch.stack([stats.lse, stats.tail, stats.logprob], 1).to(dt)], 1
        )
        got = all_gather_rows(cols.index_select(0, rows), layout).double()  # [W, R, M + 3]
        top = got[..., :m].amax(0)  # each real slot is held by one rank; -inf elsewhere
        lse = _logsumexp0(got[..., m])
        tail = _logsumexp0(got[..., m + 1])
        owner = layout.owner(plan.target.index_select(0, rows))
        slp = owner_logprob(got[..., m + 2], got[..., m], owner)
        lp = plan.logprobs.index_select(0, rows).double()
        logp = torch.where(lp > -math.inf, top / plan.temperature - lse.unsqueeze(1), -math.inf)
        logp = torch.cat([logp, (tail - lse).unsqueeze(1)], 1)
        logq = torch.cat([lp, teacher_log_tail(lp, plan.tail_floor, plan.reverse)[:, None]], 1)
        kl_rows = bucket_divergence(logp, logq, "reverse" if plan.reverse else "forward")

        def full(x: Tensor, *shape: int) -> Tensor:
            out = torch.zeros(n, *shape, dtype=dt, device=s.device)
            return out.index_copy_(0, rows, x.to(dt))

        kl, lse_n, slp_n = full(kl_rows), full(lse), full(slp)
        bucket = full(torch.stack([logp, logq], 1), 2, m + 1)
        check_rows_have_mass(lse_n, plan.target, plan.ignore_index, ("student_logits",))
        with torch.no_grad():
            s_mass = full(logp[:, :m].exp().sum(1))
            t_mass = full(lp.exp().sum(1))
        local_ids = torch.where(owned, plan.ids - layout.start, torch.zeros_like(plan.ids))
        ctx.save_for_backward(student, local, owned_t, valid, local_ids, owned, kl, lse_n, bucket)
        ctx.plan, ctx.ignore = plan, ignore
        ctx.mark_non_differentiable(s_mass, t_mass)
        return kl, slp_n, s_mass, t_mass

    @staticmethod
    def backward(ctx, g_kl, g_slp, _g_smass, _g_tmass):
        student, local, owned_t, valid, local_ids, owned, kl, lse, bucket = ctx.saved_tensors
        plan = ctx.plan
        if not ctx.needs_input_grad[0]:
            return None, None
        s = student.reshape(-1, student.shape[-1]).contiguous()
        twin = plan.impl == "torch"
        dt = kl.dtype if twin else torch.float32
        zero = kl.new_zeros(kl.shape, dtype=dt)
        up = Upstream(*(zero if g is None else g.to(dt).contiguous() for g in (g_kl, g_slp)), zero)
        if twin:
            grad = sparse_shard_grads_torch(
                up, s, local, owned_t, valid, local_ids, owned, (kl, lse, bucket),
                plan.temperature, plan.reverse,
            )  # fmt: skip
        else:
            stats = (kl.float(), lse.float(), bucket.float().contiguous())
            grad = sparse_shard_grads(
                plan.impl, up, s, local, ctx.ignore, valid & ~owned_t, local_ids, owned, stats,
                plan.temperature, plan.reverse,
            )  # fmt: skip
        return grad.reshape(student.shape), None


def sparse_teacher_topk_tail_kl(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    divergence: str = "reverse",
    ignore_index: int = -100,
    tail_floor: float = 1e-6,
    mass_tolerance: float = 1e-3,
    backend: str = "auto",
) -> SparseTeacherTopKTailKLOutput:
    """:func:`lopd_kernels.sparse_teacher_topk_tail_kl` of student logits sharded over the
    vocabulary.

    Args:
        student_logits: ``[..., V_local]`` this rank's shard of the student logits.
        teacher_topk_logprobs, teacher_topk_ids: ``[..., M]`` the teacher's top-M log-probs and
            their *global* ids, the same on every rank.
        target_ids: ``[...]`` global target ids (or ``ignore_index``), the same on every rank.
        group, vocab_start: the tensor-parallel group and this rank's first global id, as in
            :func:`lopd_kernels.vocab_parallel.topk_tail_kl`.
        temperature, divergence, ignore_index, tail_floor, mass_tolerance, backend: as the
            single-process op (``backend``: what each rank runs on its shard).

    Returns:
        :class:`~lopd_kernels.sparse_teacher_topk_tail_kl.SparseTeacherTopKTailKLOutput`, the
        full per-row outputs on every rank; the gradient flows to this rank's student shard.

    Raises:
        TypeError / ValueError: on every rank, before any data collective (see
            :func:`lopd_kernels.vocab_parallel.topk_tail_kl`); the single-process op's checks of
            the teacher's values, against the whole vocabulary.
    """
    s, lp, ids = student_logits, teacher_topk_logprobs, teacher_topk_ids
    args = (temperature, divergence, ignore_index, tail_floor, mass_tolerance)

    def check():
        check_inputs(s, lp, ids, target_ids, *args)
        check_backend(backend)
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"vocab_start must be None or an int >= 0, got {vocab_start!r}")
        prints = fingerprint(
            options=(float(temperature), divergence, ignore_index, tail_floor, mass_tolerance),
            target_ids=checksum(target_ids),
            teacher_topk_ids=checksum(ids),
            teacher_topk_logprobs=checksum(lp),
            precision=str(compute_dtype(s, lp)),
        )
        return LocalShard(target_ids.numel(), s.shape[-1], vocab_start, prints)

    device = s if isinstance(s, Tensor) else None
    layout = agree("sparse_teacher_topk_tail_kl", group, check=check, device_of=device)
    m = ids.shape[-1]
    dt = compute_dtype(s, lp)
    flat_lp = lp.reshape(-1, m).to(dt)
    flat_ids = ids.reshape(-1, m).long()
    target = target_ids.reshape(-1).long()
    check_values(flat_lp, flat_ids, target, layout.vocab, ignore_index, mass_tolerance)
    fp64 = dt == torch.float64
    impl = BACKENDS.resolve(backend, s.device, fp64=fp64, unsupported=kernel_limits(m))
    plan = _Plan(
        layout, flat_lp.contiguous(), flat_ids, target, float(temperature),
        divergence == "reverse", ignore_index, float(tail_floor), impl,
    )  # fmt: skip
    kl, slp, s_mass, t_mass = _SparseTeacher.apply(s, plan)
    lead = s.shape[:-1]
    return SparseTeacherTopKTailKLOutput(
        kl=kl.reshape(lead),
        student_logprob=slp.reshape(lead),
        student_topk_mass=s_mass.reshape(lead),
        teacher_topk_mass=t_mass.reshape(lead),
    )
