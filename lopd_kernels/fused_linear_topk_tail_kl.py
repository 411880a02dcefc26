"""Fused LM head + top-M/tail KL: distillation that never materializes [tokens x vocab] logits.

``fused_linear_topk_tail_kl`` computes exactly what ``topk_tail_kl`` computes on the logits
``s = h_s W_s^T (+ b_s)`` and ``t = h_t W_t^T (+ b_t)`` (same six outputs, same gradients; the
maths is ``docs/math.md``), but takes the final hidden states and the LM heads instead of the
logits, so the ``[N, V]`` logits of both models and their gradients never exist in memory at once.
Implementations (``torch.ops.lopd.fused_linear_topk_tail_kl_<impl>_fwd/_bwd``, one schema):

- ``"chunked"`` (and ``"auto"``), any device: the chunk loop
  (:mod:`lopd_kernels.fused_linear_topk_tail_kl_chunked`): token chunks, one vendor GEMM (MKL /
  cuBLAS) per logit block, the per-row ``topk_tail_kl`` kernels ``"auto"`` picks on that device
  (C++ on CPU; on a GPU Triton's, else CUDA's), O(M) state per row; frozen heads skip their
  logit recompute (tail projections).
- ``"triton"`` (GPU, or ``TRITON_INTERPRET=1``): one kernel that tiles tokens x vocabulary, keeps
  the logit tile in registers and streams the tail log-sum-exps and the running teacher top-M;
  see :mod:`lopd_kernels.triton.fused_linear_topk_tail_kl`.
- ``"torch"``: :func:`fused_linear_topk_tail_kl_reference`, the materialized float64-capable
  oracle.

Rows whose target is ``ignore_index`` are dropped before any matmul: only real targets cost
anything. Logits are always formed in float32 (the GEMMs accumulate in fp32 whatever the input
dtype) and weight gradients accumulate in float32 across token chunks. Hugging Face models:
:mod:`lopd_kernels.hf`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels._backend import OpBackends
from lopd_kernels._custom_ops import CustomOps, input_grads
from lopd_kernels.bucket_math import effective_top_m, op_divergence, support_width
from lopd_kernels.chunked_linear import auto_chunk_rows
from lopd_kernels.fused_linear_topk_tail_kl_checks import check_inputs
from lopd_kernels.fused_linear_topk_tail_kl_chunked import (
    Needs,
    chunked_bwd,
    chunked_fwd,
    shared_head,
)
from lopd_kernels.op_outputs import (
    FusedLinearTopKTailKLOpOutput,
    LinearPairGrads,
    TopKTailKLOpOutput,
)
from lopd_kernels.topk_tail_kl import (
    TopKTailKLOutput,
    support_size,
    teacher_topk_mass,
    topk_tail_kl_reference,
)
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range, check_values

__all__ = [
    "auto_chunk_rows",
    "fused_linear_topk_tail_kl",
    "fused_linear_topk_tail_kl_reference",
]

OP = "fused_linear_topk_tail_kl"
#: "chunked" needs no compiled code (its per-row work falls back to PyTorch twins); "auto" keeps
#: it on GPUs too: the Triton kernel's logit tiles are plain tl.dot loops, not yet tuned against
#: cuBLAS (benchmarks/gpu_fused_linear.py measures both).
BACKENDS = OpBackends(
    OP,
    impls=("chunked", "triton"),
    unavailable={},
    auto={"cpu": ("chunked",), "cuda": ("chunked",)},
)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def _linear_f32(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``h @ w^T + b`` formed in float32 (float64 stays float64), like the fused kernels."""
    dt = torch.float64 if h.dtype == torch.float64 else torch.float32
    out = h.to(dt) @ w.to(dt).T
    return out if b is None else out + b.to(dt)


def fused_linear_topk_tail_kl_reference(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target_ids: Tensor,
    *,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
) -> TopKTailKLOutput:
    """Materialized reference: the LM-head matmuls, then ``topk_tail_kl_reference`` (autograd).

    Holds both ``[N, V]`` logit tensors (and autograd their gradients): the ground truth every
    backend is tested against, not something to run at scale. Logits are formed in float32
    (float64 inputs stay float64). Arguments as :func:`fused_linear_topk_tail_kl`.
    """
    check_inputs(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target_ids,
        student_bias, teacher_bias, top_m, temperature, divergence, ignore_index, None,
        beta, support,
    )  # fmt: skip
    check_values(target_ids, student_weight.shape[0], ignore_index)
    return topk_tail_kl_reference(
        _linear_f32(student_hidden, student_weight, student_bias),
        _linear_f32(teacher_hidden, teacher_weight, teacher_bias),
        target_ids.long(),
        top_m=top_m,
        temperature=temperature,
        divergence=divergence,
        beta=beta,
        support=support,
        ignore_index=ignore_index,
    )


# ----------------------------------------------------------------------------------------------
# Custom ops: fused_linear_topk_tail_kl_{cpu,cuda,triton}_{fwd,bwd}, all defined here (one schema);
# fakes and autograd registered by CUSTOM_OPS
# ----------------------------------------------------------------------------------------------


def _kernels(impl: str):
    """The forward and backward of implementation ``impl`` as functions with the op's schema
    (the chunked path for ``cpu`` / ``cuda``, the fused kernel for ``triton``)."""

    def fwd(
        student_hidden: Tensor,
        student_weight: Tensor,
        student_bias: Tensor | None,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        teacher_bias: Tensor | None,
        target_ids: Tensor,
        top_m: int,
        temperature: float,
        divergence: str,
        beta: float,
        support: str,
        ignore_index: int,
        chunk_size: int,
        tail_proj: list[bool],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Forward on hidden states: a ``FusedLinearTopKTailKLOpOutput`` (op_outputs.py).

        The first six outputs are ``topk_tail_kl``'s ops' (whose schema the options ``top_m,
        temperature, divergence, beta, support, ignore_index`` follow); then the student's /
        teacher's tail projections ``[N, d]`` float32 where ``tail_proj`` asks for them
        (chunked, M > 0), else ``[0]``: ``sum_{j not in support} softmax(x / T)_j W[j]``, which
        gives that side's hidden-state gradient in the backward without recomputing its logits.
        ``chunk_size`` (0: automatic) and ``tail_proj`` are ignored by the Triton
        implementation.
        """
        head = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight)
        head += (teacher_bias, target_ids)
        options = (top_m, temperature, divergence, beta, support, ignore_index)
        if impl == "triton":
            # triton is optional (machines without it run the chunked path): imported lazily.
            from lopd_kernels.triton.fused_linear_topk_tail_kl import fused_linear_fwd_triton

            rows = TopKTailKLOpOutput(*fused_linear_fwd_triton(*head, *options))
            empty = student_hidden.new_empty(0, dtype=torch.float32)
            return FusedLinearTopKTailKLOpOutput(*rows, empty, empty.clone())
        return chunked_fwd(*head, *options, chunk_size, (tail_proj[0], tail_proj[1]))

    def bwd(
        grad_kl: Tensor,
        grad_student_logprob: Tensor,
        grad_teacher_logprob: Tensor,
        student_hidden: Tensor,
        student_weight: Tensor,
        student_bias: Tensor | None,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        teacher_bias: Tensor | None,
        target_ids: Tensor,
        topk_ids: Tensor,
        kl: Tensor,
        lse: Tensor,
        bucket_logp: Tensor,
        student_tail_proj: Tensor,
        teacher_tail_proj: Tensor,
        temperature: float,
        divergence: str,
        beta: float,
        support: str,
        ignore_index: int,
        chunk_size: int,
        needs: list[bool],
        shared_weight: bool,
    ) -> list[Tensor]:
        """Backward: :class:`~lopd_kernels.op_outputs.LinearPairGrads`' six gradients; an entry
        not in ``needs`` (or the teacher weight when ``shared_weight``, whose gradient is summed
        into the student's) is an empty ``[0]`` tensor. The support is read from ``topk_ids``."""
        up = (grad_kl, grad_student_logprob, grad_teacher_logprob)
        head = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight)
        head += (teacher_bias, target_ids)
        saved = (topk_ids, kl, lse, bucket_logp)
        options = (temperature, divergence, beta, ignore_index)
        if impl == "triton":
            # triton is optional (machines without it run the chunked path): imported lazily.
            from lopd_kernels.triton.fused_linear_topk_tail_kl import fused_linear_bwd_triton

            grads = fused_linear_bwd_triton(*up, *head, *saved, *options, tuple(needs),
                                            shared_weight)  # fmt: skip
            # One fresh empty per unused slot: a custom op's outputs must not alias each other.
            return [student_hidden.new_empty(0) if g is None else g for g in grads]
        projs = (student_tail_proj, teacher_tail_proj)
        return list(chunked_bwd(*up, *head, *saved, *projs, *options, chunk_size, Needs(*needs),
                                shared_weight))  # fmt: skip

    return fwd, bwd


def _make_fwd_fake(tail_projections: bool):
    """The forward's fake; ``tail_projections``: whether the implementation returns the tail
    projections it is asked for (the chunked ones; the Triton one returns ``[0]`` tensors)."""

    def fwd_fake(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                 teacher_bias, target_ids, top_m, temperature, divergence, beta, support,
                 ignore_index, chunk_size, tail_proj):  # fmt: skip
        n = student_hidden.shape[0]
        m = effective_top_m(top_m, student_weight.shape[0])
        k = support_width(m, support)
        kl = student_hidden.new_empty(n, dtype=torch.float32)
        ids = student_hidden.new_empty(n, k, dtype=torch.long)
        projs = [
            kl.new_empty(n, h.shape[1]) if flag and m > 0 and tail_projections else kl.new_empty(0)
            for flag, h in zip(tail_proj, (student_hidden, teacher_hidden))
        ]
        return FusedLinearTopKTailKLOpOutput(
            kl=kl,
            student_logprob=torch.empty_like(kl),
            teacher_logprob=torch.empty_like(kl),
            topk_ids=ids,
            lse=kl.new_empty(n, 2),
            bucket_logp=kl.new_empty(n, 2, k + 1),
            student_tail_proj=projs[0],
            teacher_tail_proj=projs[1],
        )

    return fwd_fake


def _bwd_fake(grad_kl, grad_student_logprob, grad_teacher_logprob, student_hidden, student_weight,
              student_bias, teacher_hidden, teacher_weight, teacher_bias, target_ids, topk_ids,
              kl, lse, bucket_logp, student_tail_proj, teacher_tail_proj, temperature, divergence,
              beta, support, ignore_index, chunk_size, needs, shared_weight):  # fmt: skip
    likes = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight)
    return fake_grads((*likes, teacher_bias), needs, shared_weight)


def fake_grads(likes: tuple, needs, shared_weight: bool) -> LinearPairGrads:
    """The fakes of the six gradient slots (:class:`LinearPairGrads`) of the inputs ``likes``
    (in that order): each input's shape where needed, else ``[0]`` (the teacher weight's too
    with ``shared_weight``: its gradient is in the student's slot)."""
    slots = {}
    for name, need, like in zip(LinearPairGrads._fields, needs, likes):
        skip = not need or like is None or (name == "teacher_weight" and shared_weight)
        slots[name] = likes[0].new_empty(0) if skip else torch.empty_like(like)
    return LinearPairGrads(**slots)


class _FwdArgs(NamedTuple):
    """The arguments of ``fused_linear_topk_tail_kl_<impl>_fwd``."""

    student_hidden: Tensor
    student_weight: Tensor
    student_bias: Tensor | None
    teacher_hidden: Tensor
    teacher_weight: Tensor
    teacher_bias: Tensor | None
    target_ids: Tensor
    top_m: int
    temperature: float
    divergence: str
    beta: float
    support: str
    ignore_index: int
    chunk_size: int
    tail_proj: list[bool]


def _setup_context(ctx, inputs, output) -> None:
    args, out = _FwdArgs(*inputs), FusedLinearTopKTailKLOpOutput(*output)
    heads = (args.student_hidden, args.student_weight, args.student_bias, args.teacher_hidden)
    heads += (args.teacher_weight, args.teacher_bias, args.target_ids)
    ctx.save_for_backward(*heads, out.topk_ids, out.kl, out.lse, out.bucket_logp,
                          out.student_tail_proj, out.teacher_tail_proj)  # fmt: skip
    ctx.args = (args.temperature, args.divergence, args.beta, args.support, args.ignore_index)
    ctx.args += (args.chunk_size,)
    ctx.mark_non_differentiable(out.topk_ids, out.lse, out.bucket_logp, out.student_tail_proj,
                                out.teacher_tail_proj)  # fmt: skip


def _make_backward(bwd_op):
    """The autograd backward of a forward op, differentiating through ``bwd_op``."""

    def backward(ctx, g_kl, g_slp, g_tlp, *_unused):
        hs, ws, bs, ht, wt, bt, target, ids, kl, lse, bucket, proj_s, proj_t = ctx.saved_tensors
        temperature, divergence, beta, support, ignore, chunk = ctx.args
        wanted = _FwdArgs(*ctx.needs_input_grad)
        needs = Needs(*(getattr(wanted, name) for name in Needs._fields))
        zeros = kl.new_zeros(kl.shape)
        g_kl, g_slp, g_tlp = (zeros if g is None else g for g in (g_kl, g_slp, g_tlp))
        shared = shared_head(ws, wt, needs)
        grads = LinearPairGrads(*bwd_op(
            g_kl, g_slp, g_tlp, hs, ws, bs, ht, wt, bt, target, ids, kl, lse, bucket, proj_s,
            proj_t, temperature, divergence, beta, support, ignore, chunk, list(needs), shared,
        ))  # fmt: skip
        # With one head for both models its gradient is in the student's slot; autograd adds
        # nothing for the teacher's (the same tensor).
        given = {name: getattr(grads, name) for name in Needs._fields if getattr(needs, name)}
        if shared:
            given.pop("teacher_weight", None)
        return input_grads(_FwdArgs._fields, **given)

    return backward


CUSTOM_OPS = CustomOps(OP, _make_fwd_fake(True), _bwd_fake, _setup_context, _make_backward)
CUSTOM_OPS.define("chunked", *_kernels("chunked"))
# The Triton kernel keeps no tail projections (its backward recomputes the logit tiles).
CUSTOM_OPS.define("triton", *_kernels("triton"), fwd_fake=_make_fwd_fake(False))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def fused_linear_topk_tail_kl(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target_ids: Tensor,
    *,
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
) -> TopKTailKLOutput:
    """Top-M + tail divergence between a student and a teacher, straight from their LM-head
    inputs.

    Equivalent to ``topk_tail_kl(student_hidden @ student_weight.T + student_bias,
    teacher_hidden @ teacher_weight.T + teacher_bias, target_ids, ...)`` without ever holding the
    ``[N, V]`` logits: see the module docstring for how each backend bounds memory.

    Args:
        student_hidden: ``[N, d_s]`` final hidden states of the student (after its final norm).
        student_weight: ``[V, d_s]`` the student's LM head.
        teacher_hidden: ``[N, d_t]`` the teacher's final hidden states, row-aligned with the
            student's.
        teacher_weight: ``[V, d_t]`` the teacher's LM head; may be the same tensor as
            ``student_weight`` (self-distillation with a shared head).
        target_ids: ``[N]`` int64 sampled token ids; rows equal to ``ignore_index`` output zeros
            and get no gradient (and cost no compute).
        student_bias, teacher_bias: optional ``[V]`` LM-head biases.
        top_m: M, the top entries kept as buckets (the rest is one tail bucket); ``None`` for
            the full-vocabulary divergence.
        temperature: logits are divided by it before every softmax.
        divergence, beta: ``"reverse"`` (KL(student || teacher), the paper's), ``"forward"``, or
            ``"jsd"`` with ``beta`` in [0, 1] (TRL's generalized JSD), as in ``topk_tail_kl``.
        support: ``"teacher"``, ``"student"`` or ``"union"``: whose top-M ids are buckets, as in
            ``topk_tail_kl`` (the union's ``topk_ids`` are ``[N, 2M]`` with -1 padding).
        ignore_index: target value marking rows without a target.
        backend: ``"auto"`` (``"chunked"``; float64 inputs: the reference), ``"torch"`` (the
            materialized reference), ``"chunked"`` (vendor GEMMs + the ``topk_tail_kl``
            kernels per token chunk, or their PyTorch twins without the extension) or
            ``"triton"`` (the fully fused kernel).
        chunk_size: token rows per chunk of the chunked path; ``None`` picks it from the free
            memory (:func:`auto_chunk_rows`).

    Returns:
        :class:`TopKTailKLOutput` ``(kl, privilege, student_logprob, teacher_logprob,
        topk_ids, teacher_topk_mass, support_size)``. Gradients reach the hidden states, weights
        and biases wherever they require grad; weight gradients are accumulated in float32 and
        returned in the weight's dtype.
    """
    hs, ws, ht, wt = student_hidden, student_weight, teacher_hidden, teacher_weight
    m = check_inputs(hs, ws, ht, wt, target_ids, student_bias, teacher_bias, top_m, temperature,
                     divergence, ignore_index, chunk_size, beta, support)  # fmt: skip
    check_targets_in_range(target_ids, ws.shape[0], ignore_index)
    target = target_ids.long()
    fp64 = torch.float64 in (hs.dtype, ht.dtype)
    div, div_beta = op_divergence(divergence, beta)
    m = effective_top_m(m, ws.shape[0])
    impl = BACKENDS.resolve(backend, hs.device, fp64=fp64)
    if impl == "torch":
        return fused_linear_topk_tail_kl_reference(
            hs, ws, ht, wt, target,
            student_bias=student_bias, teacher_bias=teacher_bias, top_m=top_m,
            temperature=temperature, divergence=divergence, beta=beta, support=support,
            ignore_index=ignore_index,
        )  # fmt: skip

    def tail_proj(h: Tensor, w: Tensor, b: Tensor | None) -> bool:
        # Worth one extra GEMM in the forward when it saves the logit recompute and the dh GEMM
        # in the backward: hidden states need grad, the head (and bias) do not.
        frozen = not w.requires_grad and (b is None or not b.requires_grad)
        return torch.is_grad_enabled() and h.requires_grad and frozen and m > 0

    flags = [False, False]
    if impl == "chunked":
        flags = [tail_proj(hs, ws, student_bias), tail_proj(ht, wt, teacher_bias)]
    out = FusedLinearTopKTailKLOpOutput(*CUSTOM_OPS.fwd_op(impl)(
        hs, ws, student_bias, ht, wt, teacher_bias, target, m, float(temperature),
        div, div_beta, support, ignore_index, chunk_size or 0, flags,
    ))  # fmt: skip
    lp_s, lp_t, ids = out.student_logprob, out.teacher_logprob, out.topk_ids
    return TopKTailKLOutput(
        kl=out.kl,
        privilege=lp_t - lp_s.detach(),
        student_logprob=lp_s,
        teacher_logprob=lp_t,
        topk_ids=ids,
        teacher_topk_mass=teacher_topk_mass(out.bucket_logp, target, ignore_index),
        support_size=support_size(ids, target, ignore_index, ws.shape[0]),
    )
