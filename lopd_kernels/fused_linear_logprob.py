"""Fused LM head + token log-probabilities: ``log softmax(h W^T / T)[target]`` without ``[N, V]``.

``fused_linear_logprob`` returns, per row, the log-probability of its target token (and, when
asked, the entropy of the row's distribution) from the final hidden states and the LM head,
what GRPO's ratio, a cold start's NLL or an SFT loss need, with gradients to the hidden states,
the head and its bias, and never holds the ``[N, V]`` logits or their gradient (maths:
``docs/math.md``, section 6). Implementations (``torch.ops.lopd.fused_linear_logprob_<impl>_fwd
/_bwd``, one schema):

- ``"cpu"`` (and ``"auto"`` on CPU): C++ (csrc/cpu/fused_linear_logprob.cpp): token chunks x
  vocabulary blocks, one MKL GEMM per block through ATen, the per-row online log-sum-exp and the
  logit gradient in AVX-512 / AVX2 kernels (csrc/cpu/isa/fused_linear_logprob_kernel.cpp);
- ``"chunked"`` (and ``"auto"`` on a GPU), any device: the same chunks in PyTorch
  (:mod:`lopd_kernels.fused_linear_logprob_chunked`): vendor GEMMs (cuBLAS on a GPU), ATen's
  elementwise kernels per chunk; no hand-written CUDA kernel (``docs/kernels.md`` says why);
- ``"triton"`` (GPU, or ``TRITON_INTERPRET=1``): one kernel over token x vocabulary tiles with
  the logit tile in registers (:mod:`lopd_kernels.triton.fused_linear_logprob`);
- ``"torch"``: :func:`fused_linear_logprob_reference`, the materialized float64-capable oracle.

Rows whose target is ``ignore_index`` output 0 and get no gradient (and cost nothing). Logits are
formed in float32 whatever the input dtype; weight gradients accumulate in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from lopd_kernels._backend import (
    OpBackends,
    check_backend,
    compiled_unavailable,
    triton_import_error,
)
from lopd_kernels._constants import REDUCTIONS
from lopd_kernels._custom_ops import CustomOps, input_grads
from lopd_kernels._reduction import reduce_kl
from lopd_kernels.fused_linear_logprob_checks import check_inputs
from lopd_kernels.fused_linear_logprob_chunked import chunk_plan, chunked_bwd, chunked_fwd
from lopd_kernels.op_outputs import FusedLinearLogprobOpGrads, FusedLinearLogprobOpOutput
from lopd_kernels.topk_tail_kl_checks import check_values

__all__ = [
    "FusedLinearCrossEntropy",
    "FusedLinearLogprobOutput",
    "fused_linear_logprob",
    "fused_linear_logprob_reference",
]

OP = "fused_linear_logprob"
#: "cpu" is the C++ op (compiled); "chunked" and "triton" are Python custom ops, always defined.
#: "auto" on a GPU takes the cuBLAS chunks: the Triton kernel's tiles are untuned tl.dot loops.
BACKENDS = OpBackends(
    OP,
    impls=("cpu", "chunked", "triton"),
    unavailable=compiled_unavailable(OP),
    auto={"cpu": ("cpu",), "cuda": ("chunked",)},
)


class FusedLinearLogprobOutput(NamedTuple):
    """What :func:`fused_linear_logprob` returns (``[N]`` float32 each, 0 at ignored rows).

    Attributes:
        logprob: ``log softmax(h W^T / T + b / T)[target]``.
        entropy: the entropy of that softmax (nats), or ``None`` unless ``with_entropy``.
    """

    logprob: Tensor
    entropy: Tensor | None


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def fused_linear_logprob_reference(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
) -> FusedLinearLogprobOutput:
    """Materialized reference: the ``[N, V]`` logits (float32, float64 for float64 inputs), a log
    softmax, a gather; autograd differentiates it. The oracle every backend is tested against.
    Arguments as :func:`fused_linear_logprob`."""
    check_inputs(hidden, weight, targets, bias, temperature, ignore_index)
    check_values(targets, weight.shape[0], ignore_index, "targets")
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(dt) @ weight.to(dt).T
    if bias is not None:
        logits = logits + bias.to(dt)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets.long(), torch.zeros_like(targets.long()))
    lp = torch.where(valid, logp.gather(1, safe[:, None]).squeeze(1), torch.zeros_like(logp[:, 0]))
    entropy = None
    if with_entropy:
        p = logp.exp()
        # 0 * log 0 = 0, also for the gradient (a -inf logit has p = 0 and no NaN).
        plogp = p * torch.where(p > 0, logp, torch.zeros_like(logp))
        entropy = torch.where(valid, -plogp.sum(-1), torch.zeros_like(lp))
    return FusedLinearLogprobOutput(lp, entropy)


# ----------------------------------------------------------------------------------------------
# Custom ops: fused_linear_logprob_{cpu,chunked,triton}_{fwd,bwd} (one schema; "cpu" is C++)
# ----------------------------------------------------------------------------------------------


def _forward(impl: str, args: tuple) -> tuple:
    if impl == "triton":
        try:
            # triton is optional (machines without it run the other backends): imported lazily.
            from lopd_kernels.triton.fused_linear_logprob import fused_linear_logprob_fwd_triton
        except ImportError as err:
            raise triton_import_error(OP, err) from err
        return fused_linear_logprob_fwd_triton(*args)
    return chunked_fwd(*args)


def _backward(impl: str, args: tuple) -> list:
    if impl == "triton":
        # triton is optional (machines without it run the other backends): imported lazily.
        from lopd_kernels.triton.fused_linear_logprob import fused_linear_logprob_bwd_triton

        return fused_linear_logprob_bwd_triton(*args)
    return chunked_bwd(*args)


def _kernels(impl: str):
    """The forward and backward of a Python implementation as functions with the op's schema
    (the C++ ``cpu`` one: csrc/common/schemas.h, the same arguments)."""

    def fwd(
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        ignore_index: int,
        with_entropy: bool,
        projection: bool,
        chunk_size: int,
        vocab_block: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Forward: ``logprob [N]``, ``entropy [N]`` (``[0]`` unless ``with_entropy``), ``lse
        [N]`` (float32, log-sum-exp of the tempered logits, for the backward) and the gradient
        projection ``[N, d]`` in the hidden states' dtype where ``projection`` (frozen head),
        else ``[0]``. ``chunk_size`` / ``vocab_block``: the chunk shape (``chunk_plan``)."""
        args = (hidden, weight, bias, targets, temperature, ignore_index, with_entropy)
        return _forward(impl, (*args, projection, chunk_size, vocab_block))

    def bwd(
        grad_logprob: Tensor,
        grad_entropy: Tensor,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        logprob: Tensor,
        entropy: Tensor,
        lse: Tensor,
        proj: Tensor,
        temperature: float,
        ignore_index: int,
        chunk_size: int,
        vocab_block: int,
        needs: list[bool],
    ) -> list[Tensor]:
        """Backward: ``[d_hidden, d_weight, d_bias]``, an entry not in ``needs`` an empty
        ``[0]`` tensor. ``grad_entropy`` is ``[0]`` when the entropy has no gradient; with a
        projection (``proj`` non-empty) ``hidden`` and ``weight`` may be empty."""
        args = (grad_logprob, grad_entropy, hidden, weight, bias, targets, logprob, entropy)
        args += (lse, proj, temperature, ignore_index, chunk_size, vocab_block, tuple(needs))
        grads = _backward(impl, args)
        # One fresh empty per unused slot: a custom op's outputs must not alias each other.
        return [lse.new_empty(0) if g is None else g for g in grads]

    return fwd, bwd


def _make_fwd_fake(projections: bool):
    """The forward's fake; ``projections``: whether the implementation returns the projection
    it is asked for (the blocked ones; the Triton one returns ``[0]``)."""

    def fwd_fake(hidden, weight, bias, targets, temperature, ignore_index, with_entropy,
                 projection, chunk_size, vocab_block):  # fmt: skip
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)
        ent = lp.new_empty(n if with_entropy else 0)
        proj = hidden.new_empty(hidden.shape if projection and projections else (0,))
        return lp, ent, torch.empty_like(lp), proj

    return fwd_fake


def _bwd_fake(grad_logprob, grad_entropy, hidden, weight, bias, targets, logprob, entropy, lse,
              proj, temperature, ignore_index, chunk_size, vocab_block, needs):  # fmt: skip
    like_h = proj if proj.numel() else hidden
    out = []
    for need, like in zip(needs, (like_h, weight, bias)):
        skip = not need or like is None or (proj.numel() and like is not like_h)
        out.append(lse.new_empty(0) if skip else torch.empty_like(like))
    return out


class _FwdArgs(NamedTuple):
    """The arguments of ``fused_linear_logprob_<impl>_fwd`` (csrc/common/schemas.h)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    targets: Tensor
    temperature: float
    ignore_index: int
    with_entropy: bool
    projection: bool
    chunk_size: int
    vocab_block: int


def _setup_context(ctx, inputs, output) -> None:
    args, out = _FwdArgs(*inputs), FusedLinearLogprobOpOutput(*output)
    hidden, weight = args.hidden, args.weight
    if out.projection.numel():  # the projection replaces hidden states and head in the backward
        hidden = weight = None
    ctx.save_for_backward(hidden, weight, args.bias, args.targets, out.logprob, out.entropy,
                          out.lse, out.projection)  # fmt: skip
    ctx.args = (args.temperature, args.ignore_index, args.chunk_size, args.vocab_block)
    ctx.mark_non_differentiable(out.lse, out.projection)


def _make_backward(bwd_op):
    """The autograd backward of a forward op, differentiating through ``bwd_op``."""

    def backward(ctx, g_lp, g_ent, *_unused):
        hidden, weight, bias, targets, logprob, entropy, lse, proj = ctx.saved_tensors
        temperature, ignore, chunk, vb = ctx.args
        needs = _FwdArgs(*ctx.needs_input_grad)
        empty = lse.new_empty(0)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp
        g_ent = empty if g_ent is None or not entropy.numel() else g_ent
        hidden = empty if hidden is None else hidden
        weight = empty if weight is None else weight
        grads = FusedLinearLogprobOpGrads(*bwd_op(
            g_lp, g_ent, hidden, weight, bias, targets, logprob, entropy, lse, proj,
            temperature, ignore, chunk, vb, [needs.hidden, needs.weight, needs.bias],
        ))  # fmt: skip
        return input_grads(
            _FwdArgs._fields,
            hidden=grads.hidden if needs.hidden else None,
            weight=grads.weight if needs.weight else None,
            bias=grads.bias if needs.bias else None,
        )

    return backward


CUSTOM_OPS = CustomOps(OP, _make_fwd_fake(True), _bwd_fake, _setup_context, _make_backward)
CUSTOM_OPS.register_compiled()  # the C++ "cpu" op
CUSTOM_OPS.define("chunked", *_kernels("chunked"))
# The Triton kernel keeps no projection (its backward recomputes the logit tiles).
CUSTOM_OPS.define("triton", *_kernels("triton"), fwd_fake=_make_fwd_fake(False))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def fused_linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> FusedLinearLogprobOutput:
    """Log-probabilities of the targets under ``softmax((hidden @ weight.T + bias) / T)``.

    Equal to ``-F.cross_entropy((hidden @ weight.T + bias) / temperature, targets,
    reduction="none", ignore_index=ignore_index)`` without the ``[N, V]`` logits (the module
    docstring says how each backend bounds memory).

    Args:
        hidden: ``[N, d]`` final hidden states (after the final norm); rows may be strided.
        weight: ``[V, d]`` the LM head (may be the input embedding: tied heads).
        targets: ``[N]`` int64 / int32 token ids; rows equal to ``ignore_index`` output 0, get no
            gradient and cost no compute.
        bias: optional ``[V]`` head bias (``-inf`` entries mask vocabulary rows).
        temperature: the logits are divided by it.
        ignore_index: target value marking rows without a target.
        with_entropy: also return the entropy of each row's distribution (differentiable).
        backend: ``"auto"``, ``"torch"`` (the reference), ``"cpu"``, ``"chunked"`` or
            ``"triton"``.
        chunk_size: token rows per chunk (``None``: up to 4,096 on CPU, 16,384 on a GPU); the
            vocabulary chunk then fills the chunk budget (``chunk_plan``).

    Returns:
        :class:`FusedLinearLogprobOutput` ``(logprob, entropy)``: ``[N]`` float32 (float64 for
        float64 inputs); ``entropy`` is ``None`` unless ``with_entropy``. Gradients reach
        ``hidden``, ``weight`` and ``bias`` wherever they require grad, in their dtypes.
    """
    check_inputs(hidden, weight, targets, bias, temperature, ignore_index, chunk_size)
    fp64 = hidden.dtype == torch.float64
    impl = BACKENDS.resolve(backend, hidden.device, fp64=fp64)
    if impl == "torch":
        return fused_linear_logprob_reference(
            hidden, weight, targets, bias=bias, temperature=temperature,
            ignore_index=ignore_index, with_entropy=with_entropy,
        )  # fmt: skip
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    # Worth one GEMM more in the forward when it saves the logit recompute and both GEMMs of
    # the backward: hidden states need grad, the head does not (and no entropy gradient).
    projection = (
        impl != "triton"
        and torch.is_grad_enabled()
        and hidden.requires_grad
        and frozen
        and not with_entropy
    )
    rows, vocab_block = chunk_plan(hidden.shape[0], weight.shape[0], hidden.device.type, chunk_size)
    out = FusedLinearLogprobOpOutput(*CUSTOM_OPS.fwd_op(impl)(
        hidden, weight, bias, targets.long(), float(temperature), ignore_index, with_entropy,
        projection, rows, vocab_block,
    ))  # fmt: skip
    return FusedLinearLogprobOutput(out.logprob, out.entropy if with_entropy else None)


class FusedLinearCrossEntropy(nn.Module):
    """Cross-entropy from hidden states and an LM head, never forming ``[N, V]`` logits:
    ``-fused_linear_logprob(...).logprob`` reduced (a drop-in for ``F.cross_entropy`` on
    ``hidden @ weight.T``).

    Args:
        temperature, ignore_index, backend, chunk_size: as in :func:`fused_linear_logprob`.
        reduction: ``"none"`` (``[N]``, 0 at ignored rows), ``"mean"`` (over the rows whose target
            is not ``ignore_index``; 0, never NaN, when all are) or ``"sum"``.

    Shapes:
        hidden ``[N, d]``, weight ``[V, d]``, targets ``[N]``, optional bias ``[V]``; output
        ``[N]`` for ``"none"``, else a scalar.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        backend: str = "auto",
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        check_backend(backend)
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.backend = backend
        self.chunk_size = chunk_size

    def forward(
        self, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None = None
    ) -> Tensor:
        nll = -fused_linear_logprob(
            hidden, weight, targets, bias=bias, temperature=self.temperature,
            ignore_index=self.ignore_index, backend=self.backend, chunk_size=self.chunk_size,
        ).logprob  # fmt: skip
        return reduce_kl(nll, targets, self.ignore_index, self.reduction)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}, backend={self.backend!r}, "
            f"chunk_size={self.chunk_size}"
        )
