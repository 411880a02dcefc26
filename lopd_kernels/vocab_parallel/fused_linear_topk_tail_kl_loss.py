"""``vocab_parallel.fused_linear_topk_tail_kl_loss``: the fused top-M + tail loss over LM heads
sharded over the vocabulary (Megatron-core's column-parallel output layer).

Every rank passes the same hidden states and targets and its ``[V_local, d]`` shards of both
heads. The op walks token chunks with the shared chunk loop
(:func:`lopd_kernels.chunked_linear.run_chunks`): per chunk, both ``[C, V_local]`` logit blocks
(one GEMM each), the shard's partial statistics from the single-process per-row kernel, one
all-gather of the chunk's O(K) candidates per row, the global buckets, then, while the blocks are
still in memory, the shard's logit gradients with the row weights as upstream gradients and the
gradient GEMMs: the six GEMMs of the single-process loss op on ``V / world`` columns each, and no
``[N, V_local]`` tensor. Every rank runs the same chunks (their height is agreed: the group's
smallest) and so the same collectives.

Gradients: each rank's head (and bias) shards get their own gradients. The hidden states'
gradient of a rank is the part its shard contributes, ``sum_{j in shard} ds_j W_j``; with
``reduce_hidden_grad=True`` (the default) the backward sums it over the group (one all-reduce per
hidden-states tensor), the full gradient Megatron-core's column-parallel output layer gives its
input. With ``False`` it stays partial, for callers that reduce it themselves (e.g. after
``copy_to_tensor_model_parallel_region``, whose backward is that all-reduce). Every rank must
then run the backward (the all-reduce is a collective), as with Megatron's own layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lopd_kernels._backend import BackendUnavailableError, check_backend
from lopd_kernels.bucket_math import effective_top_m, op_divergence, support_size, support_width
from lopd_kernels.chunked_linear import Chunk, Head, HeadGrads, Rows, auto_chunk_rows, run_chunks
from lopd_kernels.fused_linear_topk_tail_kl import BACKENDS as FUSED_BACKENDS
from lopd_kernels.fused_linear_topk_tail_kl_checks import check_inputs, check_row_weights
from lopd_kernels.fused_linear_topk_tail_kl_chunked import Needs, shared_head
from lopd_kernels.fused_linear_topk_tail_kl_loss import FusedLinearTopKTailKLLoss
from lopd_kernels.op_outputs import LinearPairGrads
from lopd_kernels.topk_tail_kl import BACKENDS as ROW_BACKENDS
from lopd_kernels.topk_tail_kl import TopKTailKLOutput, implementation_limits
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range
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
from lopd_kernels.vocab_parallel.topk_tail_kl import support_mass

__all__ = ["fused_linear_topk_tail_kl_loss"]


class _Plan(NamedTuple):
    layout: ShardLayout
    target: Tensor  # [N] int64 global
    weights: tuple[Tensor, Tensor, Tensor]  # [N] kl, student log-prob, teacher log-prob
    ignore_index: int
    opts: BlockOptions
    chunk_rows: int
    needs: Needs
    shared: bool  # one head for both models, both needing its gradient
    reduce_hidden_grad: bool


def _forward(plan: _Plan, heads: tuple[Head, Head]):
    """The chunk loop: per-row outputs (float32; float64 for float64 inputs) and the loss's
    gradients of this rank's shards (float32 / float64 accumulators)."""
    layout, opts, needs = plan.layout, plan.opts, plan.needs
    target = plan.target
    n, dev = target.shape[0], target.device
    dt = compute_dtype(heads[0].hidden, heads[1].hidden)
    k = support_width(opts.m, opts.support)
    out = {
        "kl": torch.zeros(n, dtype=dt, device=dev),
        "slp": torch.zeros(n, dtype=dt, device=dev),
        "tlp": torch.zeros(n, dtype=dt, device=dev),
        "ids": torch.zeros(n, k, dtype=torch.int64, device=dev),
        "bucket": torch.zeros(n, 2, k + 1, dtype=dt, device=dev),
    }
    d_s = HeadGrads.alloc(heads[0], needs.student_hidden, needs.student_weight, needs.student_bias)
    d_t = HeadGrads.alloc(
        heads[1], needs.teacher_hidden, needs.teacher_weight, needs.teacher_bias,
        shared_weight=d_s.weight if plan.shared else None,
    )  # fmt: skip
    sides = tuple(x for x, need in ((0, needs.student), (1, needs.teacher)) if need)
    rows = Rows(target, plan.ignore_index)

    def math(chunk: Chunk) -> None:
        s, t = chunk.logits(0), chunk.logits(1)
        tgt = chunk.take(target)
        local, owned, ignore = layout.local_targets(tgt, plan.ignore_index)
        every = torch.arange(chunk.n_rows, device=dev)
        got = merge_block(opts, layout, s, t, tgt, local, ignore, every)
        for key, value in zip(("ids", "bucket", "kl"), (got.ids, got.bucket_logp, got.kl)):
            chunk.put(out[key], value.to(out[key].dtype))
        chunk.put(out["slp"], got.logprob[:, 0].to(dt))
        chunk.put(out["tlp"], got.logprob[:, 1].to(dt))
        if not sides:
            return
        up = Upstream(*(chunk.take(w) for w in plan.weights))
        targets = (local, owned, torch.ones_like(owned), ignore)
        stats = (got.ids, got.kl, got.lse, got.bucket_logp, got.jsd_kls)
        # With M > 0 a side's gradient reads its own logits only: one gradient block at a time;
        # the full-vocabulary divergence couples both (one kernel call, both blocks).
        turns = [sides] if opts.m == 0 else [(x,) for x in sides]
        for turn in turns:
            grads = block_grads(opts, layout, s, t, targets, stats, up, Sides(0 in turn, 1 in turn))
            for x in turn:
                chunk.backprop(x, grads.student_logits if x == 0 else grads.teacher_logits)
            del grads

    run_chunks(heads, rows, math, chunk_rows=plan.chunk_rows,
               grads=(d_s if 0 in sides else None, d_t if 1 in sides else None))  # fmt: skip
    return out, d_s, d_t


class _FusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, plan: _Plan):
        heads = (Head(hs, ws, bs), Head(ht, wt, bt))
        out, d_s, d_t = _forward(plan, heads)
        dt = out["kl"].dtype
        loss = sum(
            (w.to(dt) * out[key]).sum() for w, key in zip(plan.weights, ("kl", "slp", "tlp"))
        )

        def cast(g: Tensor | None, like: Tensor | None) -> Tensor | None:
            return None if g is None or like is None else g.to(like.dtype)

        grads = LinearPairGrads(
            student_hidden=cast(d_s.hidden, hs),
            student_weight=cast(d_s.weight, ws),
            student_bias=cast(d_s.bias, bs),
            teacher_hidden=cast(d_t.hidden, ht),
            # One head for both models: its gradient is in the student's slot.
            teacher_weight=None if plan.shared else cast(d_t.weight, wt),
            teacher_bias=cast(d_t.bias, bt),
        )
        ctx.present = [g is not None for g in grads]
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.plan = plan
        # Only the loss carries a gradient (its gradients were formed above): no zero-filled
        # gradients for the other outputs.
        ctx.set_materialize_grads(False)
        rows = (out["kl"], out["slp"], out["tlp"], out["ids"], out["bucket"])
        ctx.mark_non_differentiable(*rows)
        return (loss, *rows)

    @staticmethod
    def backward(ctx, g_loss, *_unused):
        saved = iter(ctx.saved_tensors)
        grads = LinearPairGrads(*(next(saved) if present else None for present in ctx.present))
        if g_loss is None:
            return (*([None] * 6), None)
        plan = ctx.plan
        # In place: the kept gradients belong to this graph alone (a second backward through it
        # is refused by autograd's version counter), and a fresh [V, d] result would be new pages.
        for g in grads:
            if g is not None:
                g.mul_(g_loss.to(g.dtype))
        if plan.reduce_hidden_grad and plan.layout.world > 1:
            for g in (grads.student_hidden, grads.teacher_hidden):
                if g is not None:
                    dist.all_reduce(g, group=plan.layout.group)
        return (*grads, None)


def _row_kernels(backend: str, device: torch.device, fp64: bool, m: int) -> str:
    """The per-row implementation the chunks run for ``backend`` (the fused op's words)."""
    word = FUSED_BACKENDS.resolve(backend, device, fp64=fp64)
    if word == "triton":
        raise BackendUnavailableError(
            "vocab_parallel.fused_linear_topk_tail_kl_loss: backend='triton' has no "
            "vocabulary-parallel form (the fused kernel keeps its statistics inside one launch); "
            "backend='chunked' runs Triton's per-row kernels on a GPU"
        )
    if word == "torch":
        return "torch"
    return ROW_BACKENDS.resolve("auto", device, unsupported=implementation_limits(m))


def _row_weight(w, n: int, like: Tensor) -> Tensor:
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.as_tensor(w, dtype=dt, device=like.device).expand(n).contiguous()


def fused_linear_topk_tail_kl_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target_ids: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    kl_weight: Tensor | float | None = None,
    student_logprob_weight: Tensor | float = 0.0,
    teacher_logprob_weight: Tensor | float = 0.0,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
    backend: str = "auto",
    chunk_size: int | None = None,
    reduce_hidden_grad: bool = True,
) -> FusedLinearTopKTailKLLoss:
    """:func:`lopd_kernels.fused_linear_topk_tail_kl_loss` over vocabulary-sharded LM heads.

    Args:
        student_hidden, teacher_hidden: ``[N, d_s]``, ``[N, d_t]`` the same on every rank.
        student_weight, teacher_weight: ``[V_local, d_s]``, ``[V_local, d_t]`` this rank's
            shards of the two heads (the same ids: one partition of the vocabulary).
        target_ids: ``[N]`` global ids or ``ignore_index``, the same on every rank.
        group, vocab_start: as :func:`lopd_kernels.vocab_parallel.topk_tail_kl`.
        kl_weight, student_logprob_weight, teacher_logprob_weight, student_bias, teacher_bias
            (this rank's ``[V_local]`` shards), top_m, temperature, divergence, beta, support,
            ignore_index: as the single-process op; the weights the same on every rank.
        backend: ``"auto"`` / ``"chunked"``: the chunk loop, with the per-row kernels
            ``topk_tail_kl``'s ``"auto"`` picks on the device (C++ on CPU, Triton / CUDA on a
            GPU), as the single-process op's chunk loop; ``"torch"``: the chunk loop with the
            PyTorch twins (what float64 inputs take). No ``"triton"``: the fused Triton kernel
            keeps its statistics inside one launch, so it has no vocabulary-parallel form.
        chunk_size: rows per chunk (``None``: from each rank's free memory, then the group's
            smallest).
        reduce_hidden_grad: sum the hidden states' gradient over the group in the backward
            (module docstring); ``False``: leave this rank's part.

    Returns:
        :class:`~lopd_kernels.fused_linear_topk_tail_kl_loss.FusedLinearTopKTailKLLoss`
        ``(loss, output)``: the same loss and per-row outputs (global ``topk_ids``) on every
        rank.

    Raises:
        TypeError / ValueError: on every rank, before any data collective, as
            :func:`lopd_kernels.vocab_parallel.topk_tail_kl`.
    """
    hs, ws, ht, wt = student_hidden, student_weight, teacher_hidden, teacher_weight
    weights = {"kl_weight": kl_weight, "student_logprob_weight": student_logprob_weight}
    weights["teacher_logprob_weight"] = teacher_logprob_weight

    def check() -> LocalShard:
        m = check_inputs(
            hs, ws, ht, wt, target_ids, student_bias, teacher_bias, top_m, temperature,
            divergence, ignore_index, chunk_size, beta, support,
        )  # fmt: skip
        check_row_weights(weights, hs.shape[0], hs.device)
        check_backend(backend)
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"vocab_start must be None or an int >= 0, got {vocab_start!r}")
        if not isinstance(reduce_hidden_grad, bool):
            raise TypeError(f"reduce_hidden_grad must be a bool, got {reduce_hidden_grad!r}")
        kept = int((target_ids != ignore_index).sum())
        # Live [C, V_local] blocks: both logit blocks and a gradient block (two: full vocabulary).
        live = 3 if m else 4
        rows = chunk_size or auto_chunk_rows(ws.shape[0], kept, hs.device, live_blocks=live)
        grad = torch.is_grad_enabled()
        inputs = (hs, ws, student_bias, ht, wt, teacher_bias)
        # Which inputs need a gradient: the backward's all-reduces run on every rank or none.
        needs = tuple(bool(grad and x is not None and x.requires_grad) for x in inputs)
        prints = fingerprint(
            options=(top_m, float(temperature), divergence, beta, support, ignore_index,
                     reduce_hidden_grad),
            requires_grad=needs,
            target_ids=checksum(target_ids),
            weights=tuple(checksum(w) if isinstance(w, Tensor) else w for w in weights.values()),
            hidden_sizes=(hs.shape[1], ht.shape[1]),
            precision=str(compute_dtype(hs, ht)),
        )  # fmt: skip
        return LocalShard(hs.shape[0], ws.shape[0], vocab_start, prints, (("chunk_rows", rows),))

    device = hs if isinstance(hs, Tensor) else None
    layout = agree("fused_linear_topk_tail_kl_loss", group, check=check, device_of=device)
    target = target_ids.long()
    check_targets_in_range(target, layout.vocab, ignore_index)
    n = hs.shape[0]
    if kl_weight is None:
        kl_weight = 1.0 / (target != ignore_index).sum().clamp(min=1)
    row_weights = tuple(
        _row_weight(w, n, hs) for w in (kl_weight, student_logprob_weight, teacher_logprob_weight)
    )
    m = effective_top_m(0 if top_m is None else top_m, layout.vocab)
    div, div_beta = op_divergence(divergence, beta)
    fp64 = torch.float64 in (hs.dtype, ht.dtype)
    impl = _row_kernels(backend, hs.device, fp64, m)
    grad = torch.is_grad_enabled()
    inputs = (hs, ws, student_bias, ht, wt, teacher_bias)
    needs = Needs(*(bool(grad and x is not None and x.requires_grad) for x in inputs))
    plan = _Plan(
        layout, target, row_weights, ignore_index,
        BlockOptions(m, support, float(temperature), div, div_beta, impl),
        layout.minimums["chunk_rows"], needs, shared_head(ws, wt, needs), reduce_hidden_grad,
    )  # fmt: skip
    loss, kl, slp, tlp, ids, bucket = _FusedLoss.apply(
        hs, ws, student_bias, ht, wt, teacher_bias, plan
    )
    output = TopKTailKLOutput(
        kl=kl,
        privilege=tlp - slp,
        student_logprob=slp,
        teacher_logprob=tlp,
        topk_ids=ids,
        teacher_topk_mass=support_mass(bucket, target, ignore_index),
        support_size=support_size(ids, target, ignore_index, layout.vocab),
    )
    return FusedLinearTopKTailKLLoss(loss, output)
