"""What one rank of a vocabulary-parallel benchmark runs: each op's inputs on this rank and one
forward + backward of each variant (benchmarks/vocab_parallel.py drives them).

Variants (``world`` processes, this one holding vocabulary shard ``rank``):

* ``vocab_parallel``: the ``lopd_kernels.vocab_parallel`` op on the shard;
* ``allgather``: the obvious implementation: the logits all-gathered (an autograd all-gather
  whose backward takes this rank's slice, as Megatron-core's
  ``gather_from_tensor_model_parallel_region``), then the single-process op on the whole
  vocabulary. The fused ops form their shard's logits with one GEMM and gather them in bf16, as a
  bf16 model's output layer hands them (float32 would double the gather and its memory);
* ``single_process``: ``world`` 1, the single-process op on the whole vocabulary;
* ``megatron_cross_entropy`` (the log-prob op): the shard's logits, then Megatron-core's
  ``tensor_parallel.vocab_parallel_cross_entropy``.

Inputs: ``topk_tail_kl`` and ``sparse_teacher_topk_tail_kl`` take bf16 logits (what a bf16
model produces; float32 ``[N, V]`` logits of both models would not fit this benchmark's
machine twice over in the all-gather variant), the fused ops float32 hidden states and heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

import lopd_kernels as lk
from lopd_kernels import vocab_parallel as vp

OPS = ("topk_tail_kl", "sparse_teacher_topk_tail_kl", "fused_linear_topk_tail_kl_loss",
       "fused_linear_logprob")  # fmt: skip
VARIANTS = ("vocab_parallel", "allgather", "single_process", "megatron_cross_entropy")


class Shapes(NamedTuple):
    n: int  # tokens
    vocab: int  # V (the whole, padded vocabulary)
    hidden: int  # d
    top_m: int  # M


class _ReduceGrad(torch.autograd.Function):
    """The identity whose backward sums the gradient over the group: the hidden states' entry
    into a column-parallel layer (Megatron-core's ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _GatherVocab(torch.autograd.Function):
    """All-gather along the last dim; the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.width = rank, x.shape[-1]
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaf(x: Tensor, device: torch.device) -> Tensor:
    return x.to(device).requires_grad_(True)


def build(op: str, variant: str, shapes: Shapes, device: torch.device) -> Callable[[], Any]:
    """This rank's inputs for ``op`` and a callable running one forward + backward of
    ``variant`` on them (gradients cleared by the call) and returning the loss it
    backpropagated (the same inputs for every variant: a sanity check between them)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    whole = variant == "single_process"
    width = shapes.vocab if whole else shapes.vocab // world
    n, d, m = shapes.n, shapes.hidden, shapes.top_m
    g = _generator(100 + (0 if whole else rank))
    shared = _generator(7)  # what every rank holds alike: targets, hidden states, the teacher
    target = torch.randint(0, shapes.vocab, (n,), generator=shared).to(device)
    if op in ("topk_tail_kl", "sparse_teacher_topk_tail_kl"):
        s = _leaf((torch.randn(n, width, generator=g) * 2).bfloat16(), device)
        t = (torch.randn(n, width, generator=g) * 3).bfloat16().to(device)
        if op == "topk_tail_kl":
            t.requires_grad_(True)
            return _dense(variant, s, t, target, m)
        ids = torch.arange(m) * (shapes.vocab // m) + torch.randint(
            0, shapes.vocab // m, (n, m), generator=shared
        )
        lp = torch.log_softmax(torch.randn(n, m, generator=shared), -1) + math.log(0.9)
        return _sparse(variant, s, lp.to(device), ids.to(device), target)
    hs = _leaf(torch.randn(n, d, generator=shared), device)
    ws = _leaf(torch.randn(width, d, generator=g) * d**-0.5, device)
    if op == "fused_linear_logprob":
        return _logprob(variant, hs, ws, target)
    ht = _leaf(torch.randn(n, d, generator=shared), device)
    wt = _leaf(torch.randn(width, d, generator=g) * d**-0.5 * 1.5, device)
    return _loss(variant, hs, ws, ht, wt, target, m)


def _clear(*xs: Tensor) -> None:
    for x in xs:
        x.grad = None


def _dense(variant: str, s: Tensor, t: Tensor, target: Tensor, m: int):
    def run() -> None:
        _clear(s, t)
        if variant == "vocab_parallel":
            out = vp.topk_tail_kl(s, t, target, top_m=m)
        else:
            full = (
                (_GatherVocab.apply(s), _GatherVocab.apply(t)) if variant == "allgather" else (s, t)
            )
            out = lk.topk_tail_kl(*full, target, top_m=m)
        loss = out.kl.sum() + out.privilege.sum()
        loss.backward()
        return float(loss.detach())

    return run


def _sparse(variant: str, s: Tensor, lp: Tensor, ids: Tensor, target: Tensor):
    def run() -> None:
        _clear(s)
        if variant == "vocab_parallel":
            out = vp.sparse_teacher_topk_tail_kl(s, lp, ids, target)
        else:
            full = _GatherVocab.apply(s) if variant == "allgather" else s
            out = lk.sparse_teacher_topk_tail_kl(full, lp, ids, target)
        loss = out.kl.sum() + out.student_logprob.sum()
        loss.backward()
        return float(loss.detach())

    return run


def _gathered_logits(h: Tensor, w: Tensor) -> Tensor:
    """The whole vocabulary's logits, gathered in bf16; ``h``'s gradient summed over the group."""
    return _GatherVocab.apply((_ReduceGrad.apply(h) @ w.T).bfloat16())


def _loss(variant: str, hs: Tensor, ws: Tensor, ht: Tensor, wt: Tensor, target: Tensor, m: int):
    weights = {"kl_weight": 1.0 / target.numel(), "teacher_logprob_weight": -0.1}

    def run() -> None:
        _clear(hs, ws, ht, wt)
        if variant == "vocab_parallel":
            loss = vp.fused_linear_topk_tail_kl_loss(hs, ws, ht, wt, target, top_m=m, **weights)
            loss = loss.loss
        elif variant == "single_process":
            loss = lk.fused_linear_topk_tail_kl_loss(hs, ws, ht, wt, target, top_m=m, **weights)
            loss = loss.loss
        else:
            out = lk.topk_tail_kl(_gathered_logits(hs, ws), _gathered_logits(ht, wt), target,
                                  top_m=m)  # fmt: skip
            loss = out.kl.mean() - 0.1 * out.teacher_logprob.sum()
        loss.backward()
        return float(loss.detach())

    return run


def _logprob(variant: str, h: Tensor, w: Tensor, target: Tensor):
    def run() -> None:
        _clear(h, w)
        if variant == "vocab_parallel":
            lp = vp.fused_linear_logprob(h, w, target).logprob
        elif variant == "single_process":
            lp = lk.fused_linear_logprob(h, w, target).logprob
        elif variant == "megatron_cross_entropy":
            # Optional peer of this comparison (megatron-core, the [test] extra).
            from megatron.core import tensor_parallel

            h_in = tensor_parallel.copy_to_tensor_model_parallel_region(h)
            logits = (h_in @ w.T)[None]  # Megatron's [s, b, v_local]
            lp = -tensor_parallel.vocab_parallel_cross_entropy(logits, target[None])[0]
        else:
            full = _gathered_logits(h, w)
            lp = -torch.nn.functional.cross_entropy(full, target, reduction="none")
        loss = lp.float().sum()
        loss.backward()
        return float(loss.detach())

    return run


class ByteCounter:
    """Bytes this rank hands to each kind of collective (what it sends into an all-gather or an
    all-reduce), by wrapping ``torch.distributed``'s collectives while active."""

    NAMES = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce")

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> ByteCounter:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name: str, fn):
        kind = "all_reduce" if name == "all_reduce" else "all_gather"

        def counted(*args, **kwargs):
            sent = args[0] if kind == "all_reduce" else args[1]
            self.bytes[kind] = self.bytes.get(kind, 0) + sent.numel() * sent.element_size()
            self.calls += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
