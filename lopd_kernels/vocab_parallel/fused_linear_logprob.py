"""``vocab_parallel.fused_linear_logprob``: token log-probs (and entropies) from an LM head
sharded over the vocabulary (GRPO's ratio and an NLL under tensor parallelism), never forming
``[N, V_local]`` logits.

Each rank runs the single-process op (C++ on CPU, the cuBLAS chunks or Triton on a GPU) on its
head shard, with its shard's local targets (another shard's target: local id 0). Its outputs are
exactly the shard's partial statistics: the log-sum-exp of the shard ``lse_r``, the entropy of the
distribution renormalized within the shard ``H_r`` (both over every entry, whatever the target),
and, on the rank holding the target, ``log p_a`` within the shard. One all-gather of those three
numbers per row, and (docs/math.md, section 7)

    lse = LSE_r lse_r,   log p_a = lp_o - log1p(sum_{r != o} e^{lse_r - lse_o}),
    H = sum_r P_r H_r - sum_r P_r log P_r,   P_r = e^{lse_r - lse}

(the entropy's grouping rule). The backward runs the single-process backward with the global
``lse``, ``H`` and ``log p_a``, which give each entry its global gradient
``G_j = (u (1[j = a] - p_j) - v p_j (log p_j + H)) / T``; only a row whose target another shard
holds needs care, since every backend writes its target entry (here local id 0) from the
log-prob it is given: that row gets the log-prob that makes the target formula equal the
entry's true one (``log1p(p_0)``: ``-u expm1(log1p(p_0)) = -u p_0``; with an entropy gradient
``u' = 0``, ``H' = H + u / v``, ``log p_0``), so no entry needs correcting afterwards.

The hidden states' gradient is this shard's part; ``reduce_hidden_grad=True`` (the default) sums
it over the group in the backward, as Megatron-core's column-parallel output layer does. No
frozen-head projection here (it needs the global softmax in the forward).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lopd_kernels._backend import check_backend
from lopd_kernels.fused_linear_logprob import BACKENDS, CUSTOM_OPS, FusedLinearLogprobOutput
from lopd_kernels.fused_linear_logprob_checks import check_inputs
from lopd_kernels.fused_linear_logprob_chunked import chunk_plan
from lopd_kernels.op_outputs import FusedLinearLogprobOpGrads, FusedLinearLogprobOpOutput
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range
from lopd_kernels.vocab_parallel.candidates import owner_logprob
from lopd_kernels.vocab_parallel.shard_stats import compute_dtype
from lopd_kernels.vocab_parallel.shards import (
    LocalShard,
    ShardLayout,
    agree,
    all_gather_rows,
    checksum,
    fingerprint,
)

__all__ = ["fused_linear_logprob"]

# |u / v| above which a foreign-target row takes the log1p form with the entropy term left at
# O(v) (u / v would overflow float32 near 3e38).
_MAX_RATIO = 1e30


class _ShardStats(NamedTuple):
    """``[N]`` each: the shard's log-sum-exp, entropy within the shard, target log-prob within
    the shard (meaningful at rows whose target it holds)."""

    lse: Tensor
    entropy: Tensor
    logprob: Tensor


class _Upstream(NamedTuple):
    logprob: Tensor  # [N]
    entropy: Tensor | None  # [N], None: the entropy has no gradient


class _Grads(NamedTuple):
    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


class _Plan(NamedTuple):
    layout: ShardLayout
    target: Tensor  # [N] int64 global
    ignore_index: int
    temperature: float
    with_entropy: bool
    impl: str
    chunk: tuple[int, int]  # (rows, vocabulary entries) per chunk
    reduce_hidden_grad: bool


def _logits_torch(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    dt = compute_dtype(h)
    z = h.to(dt) @ w.to(dt).T
    return (z if b is None else z + b.to(dt)) / temperature


def _shard_stats(
    plan: _Plan, h: Tensor, w: Tensor, b: Tensor | None, local: Tensor, ignore: int
) -> _ShardStats:
    """This shard's statistics (the single-process op, or the twin)."""
    if plan.impl != "torch":
        out = FusedLinearLogprobOpOutput(*CUSTOM_OPS.fwd_op(plan.impl)(
            h, w, b, local, plan.temperature, ignore, plan.with_entropy, False, *plan.chunk
        ))  # fmt: skip
        ent = out.entropy if plan.with_entropy else torch.zeros_like(out.lse)
        return _ShardStats(out.lse, ent, out.logprob)
    z = _logits_torch(h, w, b, plan.temperature)
    lse = torch.logsumexp(z, 1)
    logp = z - lse[:, None]
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(1)
    inside = (local >= 0) & (local < w.shape[0])
    lp = logp.gather(1, torch.where(inside, local, 0)[:, None]).squeeze(1)
    return _ShardStats(lse, ent, torch.where(inside, lp, 0.0))


def _merge(got: _ShardStats, owner: Tensor) -> _ShardStats:
    """The rows' global statistics (float64) from every rank's (``[W, R]`` each)."""
    lse_r, ent_r, lp_r = got
    top = lse_r.amax(0)
    safe = torch.where(top == -math.inf, 0.0, top)
    lse = (lse_r - safe).exp().sum(0).log() + safe
    log_mass = lse_r - lse
    mass = log_mass.exp()
    zero = mass == 0
    ent = (mass * ent_r.masked_fill(zero, 0.0) - mass * log_mass.masked_fill(zero, 0.0)).sum(0)
    return _ShardStats(lse, ent, owner_logprob(lp_r, lse_r, owner))


class _Logprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, plan: _Plan):
        layout, target = plan.layout, plan.target
        n, dev = target.shape[0], target.device
        dt = compute_dtype(hidden)
        local, owned, ignore = layout.local_targets(target, plan.ignore_index)
        valid = target != plan.ignore_index
        rows = valid.nonzero().squeeze(1)
        lse, ent, lp = (torch.zeros(n, dtype=dt, device=dev) for _ in range(3))
        if rows.numel():
            stats = torch.stack(_shard_stats(plan, hidden, weight, bias, local, ignore), 1)
            got = all_gather_rows(stats.index_select(0, rows).to(dt), layout).double()
            merged = _merge(
                _ShardStats(*got.unbind(-1)), layout.owner(target.index_select(0, rows))
            )
            for dst, src in ((lse, merged.lse), (ent, merged.entropy), (lp, merged.logprob)):
                dst.index_copy_(0, rows, src.to(dt))
        ctx.save_for_backward(hidden, weight, bias, local, owned, valid, lse, ent, lp)
        ctx.plan, ctx.ignore = plan, ignore
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        hidden, weight, bias, local, owned, valid, lse, ent, lp = ctx.saved_tensors
        plan = ctx.plan
        needs = _Grads(*ctx.needs_input_grad[:3])
        if not any(needs):
            return None, None, None, None
        u = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        v = None if g_ent is None or not plan.with_entropy else g_ent.to(lse.dtype)
        up = _Upstream(
            torch.where(valid, u, 0.0), None if v is None else torch.where(valid, v, 0.0)
        )
        if plan.impl == "torch":
            grads = _grads_torch(plan, hidden, weight, bias, local, owned, up, lse, ent, needs)
        else:
            stats = _ShardStats(lse, ent, lp)
            grads = _grads_kernel(plan, hidden, weight, bias, local, owned & valid, valid, up,
                                  stats, needs, ctx.ignore)  # fmt: skip
        d_h = grads.hidden
        if needs.hidden and plan.reduce_hidden_grad and plan.layout.world > 1:
            # Every rank has a hidden-state gradient here (zeros without rows): one collective.
            d_h = torch.zeros_like(hidden) if d_h is None else d_h
            dist.all_reduce(d_h, group=plan.layout.group)
        return d_h, grads.weight, grads.bias, None


def _grads_kernel(plan, hidden, weight, bias, local, owned, valid, up, stats, needs, ignore):
    """The single-process backward fed the global statistics (module docstring)."""
    u, v = up
    lse, ent, lp = stats.lse, stats.entropy, stats.logprob
    foreign = valid & ~owned
    lp_in, u_in, ent_in = lp.clone(), u.clone(), ent.clone()
    rows = foreign.nonzero().squeeze(1)
    if rows.numel():
        # The global log-prob of local id 0 at these rows (O(N d): one row of the head).
        z0 = hidden.index_select(0, rows).double() @ weight[0].double()
        if bias is not None:
            z0 = z0 + bias[0].double()
        logp0 = z0 / plan.temperature - lse.index_select(0, rows).double()
        u_r = u.index_select(0, rows).double()
        v_r = torch.zeros_like(u_r) if v is None else v.index_select(0, rows).double()
        by_entropy = (v_r != 0) & (u_r.abs() < _MAX_RATIO * v_r.abs())
        # -u' expm1(lp') - v e^lp' (lp' + H') = -p_0 (u + v (log p_0 + H)) at entry 0.
        safe_v = torch.where(by_entropy, v_r, 1.0)
        lp_in[rows] = torch.where(by_entropy, logp0, torch.log1p(logp0.exp())).to(lp.dtype)
        u_in[rows] = torch.where(by_entropy, 0.0, u_r).to(u.dtype)
        ent_r = ent.index_select(0, rows).double()
        ent_in[rows] = torch.where(by_entropy, ent_r + u_r / safe_v, ent_r).to(ent.dtype)
    f32 = torch.float32
    grad_ent = v.to(f32).contiguous() if v is not None else lse.new_empty(0, dtype=f32)
    _, bwd = CUSTOM_OPS.ops(plan.impl)
    grads = FusedLinearLogprobOpGrads(*bwd(
        u_in.to(f32).contiguous(), grad_ent, hidden, weight, bias, local, lp_in.to(f32),
        ent_in.to(f32) if v is not None else ent.new_empty(0, dtype=f32), lse.to(f32),
        hidden.new_empty(0), plan.temperature, ignore, *plan.chunk, list(needs),
    ))  # fmt: skip
    return _Grads(*(g if need and g.numel() else None for g, need in zip(grads, needs)))


def _grads_torch(plan, hidden, weight, bias, local, owned, up, lse, ent, needs):
    """The twin: the gradient formula on the shard's materialized logits (``[N, V_local]``;
    the float64 oracle's precision)."""
    u, v = up
    z = _logits_torch(hidden, weight, bias, plan.temperature)
    logp = z - lse[:, None]
    p = logp.exp()
    coef = u[:, None]
    if v is not None:  # the clamp keeps 0 * (-inf) out at -inf logits
        coef = coef + v[:, None] * (logp.clamp(min=-150) + ent[:, None])
    g = -p * coef
    a = torch.where(owned, local, 0)[:, None]
    g.scatter_add_(1, a, torch.where(owned, u, 0.0)[:, None])
    g = g / plan.temperature
    return _Grads(
        (g @ weight.to(g.dtype)).to(hidden.dtype) if needs.hidden else None,
        (g.T @ hidden.to(g.dtype)).to(weight.dtype) if needs.weight else None,
        g.sum(0).to(bias.dtype) if needs.bias else None,
    )


def fused_linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    reduce_hidden_grad: bool = True,
) -> FusedLinearLogprobOutput:
    """:func:`lopd_kernels.fused_linear_logprob` over a vocabulary-sharded LM head.

    Args:
        hidden: ``[N, d]`` the same on every rank.
        weight: ``[V_local, d]`` this rank's head shard; bias: its ``[V_local]`` shard or None.
        targets: ``[N]`` global ids or ``ignore_index``, the same on every rank.
        group, vocab_start: as :func:`lopd_kernels.vocab_parallel.topk_tail_kl`.
        temperature, ignore_index, with_entropy, chunk_size: as the single-process op.
        backend: the single-process implementation each rank runs on its shard (``"auto"``:
            C++ on CPU, the cuBLAS chunks on a GPU; ``"torch"``: the formulas on the shard's
            materialized logits, the float64 oracle).
        reduce_hidden_grad: sum the hidden states' gradient over the group in the backward;
            ``False``: this shard's part (the caller reduces it).

    Returns:
        :class:`~lopd_kernels.fused_linear_logprob.FusedLinearLogprobOutput` ``(logprob,
        entropy)``, the same on every rank.

    Raises:
        TypeError / ValueError: on every rank, before any data collective.
    """

    def check() -> LocalShard:
        check_inputs(hidden, weight, targets, bias, temperature, ignore_index, chunk_size)
        check_backend(backend)
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"vocab_start must be None or an int >= 0, got {vocab_start!r}")
        if not isinstance(reduce_hidden_grad, bool):
            raise TypeError(f"reduce_hidden_grad must be a bool, got {reduce_hidden_grad!r}")
        grad = torch.is_grad_enabled()
        # Which inputs need a gradient: the backward's all-reduce must run on every rank or none.
        needs = tuple(
            bool(grad and x is not None and x.requires_grad) for x in (hidden, weight, bias)
        )
        prints = fingerprint(
            options=(float(temperature), ignore_index, bool(with_entropy), reduce_hidden_grad),
            requires_grad=needs,
            targets=checksum(targets),
            hidden_size=hidden.shape[1],
            precision=str(compute_dtype(hidden)),
        )
        return LocalShard(hidden.shape[0], weight.shape[0], vocab_start, prints)

    device = hidden if isinstance(hidden, Tensor) else None
    layout = agree("fused_linear_logprob", group, check=check, device_of=device)
    target = targets.long()
    check_targets_in_range(target, layout.vocab, ignore_index, "targets")
    impl = BACKENDS.resolve(backend, hidden.device, fp64=hidden.dtype == torch.float64)
    chunk = chunk_plan(hidden.shape[0], weight.shape[0], hidden.device.type, chunk_size)
    plan = _Plan(layout, target, ignore_index, float(temperature), bool(with_entropy), impl,
                 chunk, reduce_hidden_grad)  # fmt: skip
    lp, ent, _ = _Logprob.apply(hidden, weight, bias, plan)
    return FusedLinearLogprobOutput(lp, ent if with_entropy else None)
