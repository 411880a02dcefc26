"""Top-M + tail-bucket KL against a *sparse* teacher: its top-M ids and log-probs only.

Server-side teachers (vLLM / SGLang teacher workers, e.g. verl's) return per token the ids of the
teacher's top-M entries and their log-probs under the teacher's **full** softmax, never logits.
That determines the teacher's M + 1 buckets of :func:`lopd_kernels.topk_tail_kl` (the top-M ids
and one tail bucket): ``Q_i = exp(logprob_i)`` and ``Q_tail = 1 - sum_i Q_i``. The student side
comes from its full logits: ``P_i = softmax(s / T)[id_i]`` and ``P_tail`` its mass outside the
teacher's ids (a log-sum-exp over the complement, never ``1 - sum``). The divergence is
``sum_b P_b (log P_b - log Q_b)`` (reverse, the paper's) or ``sum_b Q_b (log Q_b - log P_b)``
(forward), so with the teacher's true top-M this op **equals** ``topk_tail_kl`` run on the dense
teacher (same ``top_m``, temperature, divergence), loss and student gradient.

Conventions (documented choices; the maths: ``docs/math.md``, section 3b):

* **Temperature** divides the student logits only: the server's log-probs must already be the
  tempered teacher's (``log_softmax(t / T)``), which is what ``topk_tail_kl(s, t, T)`` uses.
* **Teacher tail**: ``log Q_tail = log(max(-expm1(min(L, 0)), tail_floor))`` with
  ``L = logsumexp(logprob)`` computed as ``max + log1p(sum of the others)`` (no cancellation
  near 1). Rows with ``L > log1p(mass_tolerance)`` are inconsistent (ValueError); ``L`` in
  ``(0, log1p(mass_tolerance)]`` is server rounding and gives a zero raw tail. The floor
  (default 1e-6, above float32 rounding of ``1 - sum`` for M in the hundreds) keeps a teacher
  whose top-M holds all its mass up to rounding from making the reverse KL infinite; pass
  ``tail_floor=0`` for the exact (possibly infinite) value. A tail below the floor is not
  resolvable from float32 log-probs anyway; for the forward KL such a tail is set to 0
  instead (its term ``Q log(Q / P)`` vanishes with ``Q``, while a noise-level ``Q > 0`` would
  make it infinite where the student has no tail, e.g. ``M = V``).
* **Padding**: a ``-inf`` log-prob marks a padding slot (the server returned fewer than M
  entries). Its id is ignored (any value, duplicates allowed); the student's mass on that id
  stays in the student's tail.
* **Ignored rows** (``target_ids == ignore_index``) give zeros and zero gradient, and their
  teacher entries are not validated (servers pad them with placeholders).
* **Gradients** flow to ``student_logits`` only. The teacher's log-probs are a server's
  constants; the op refuses a ``teacher_topk_logprobs`` that requires grad rather than silently
  returning none (its gradient is O(M) per row and could be added if a use appears).
* No privilege output: the teacher's log-prob of the sampled token is known only when the
  token is among the top-M.

Layering as in :mod:`lopd_kernels.topk_tail_kl`: kernels (C++
``csrc/cpu/sparse_teacher_topk_tail_kl.cpp``, Triton
``lopd_kernels/triton/sparse_teacher_topk_tail_kl.py``) -> custom ops
``torch.ops.lopd.sparse_teacher_topk_tail_kl_<impl>_fwd`` / ``_bwd`` (``cpu``: C++, schema in
``csrc/common/schemas.h``; ``triton``: defined here), each with a fake impl and autograd
registered by :data:`CUSTOM_OPS` -> :func:`sparse_teacher_topk_tail_kl` ->
:class:`SparseTeacherTopKTailKL`. There is no CUDA C++ kernel: on GPUs the Triton kernel runs.
:func:`sparse_teacher_topk_tail_kl_reference` is the float64-capable oracle; input checks are
:mod:`lopd_kernels.sparse_teacher_topk_tail_kl_checks`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lopd_kernels._backend import OpBackends, compiled_unavailable, triton_import_error
from lopd_kernels._constants import KL_DIVERGENCES, TRITON_SPARSE_TEACHER_MAX_TOP_M
from lopd_kernels._custom_ops import CustomOps, input_grads
from lopd_kernels._reduction import check_module_options, reduce_kl
from lopd_kernels.bucket_math import bucket_divergence, masked_logsumexp
from lopd_kernels.op_outputs import SparseTeacherTopKTailKLOpOutput
from lopd_kernels.sparse_teacher_topk_tail_kl_checks import (
    check_inputs,
    check_rows_have_mass,
    check_values,
)

__all__ = [
    "SparseTeacherTopKTailKL",
    "SparseTeacherTopKTailKLOutput",
    "sparse_teacher_topk_tail_kl",
    "sparse_teacher_topk_tail_kl_reference",
]

OP = "sparse_teacher_topk_tail_kl"
# No CUDA C++ kernel: on GPUs the Triton kernel runs.
BACKENDS = OpBackends(
    OP,
    impls=("cpu", "triton"),
    unavailable=compiled_unavailable(OP),
    auto={"cpu": ("cpu",), "cuda": ("triton",)},
)


class SparseTeacherTopKTailKLOutput(NamedTuple):
    """Outputs of :func:`sparse_teacher_topk_tail_kl`; leading shape ``[...]`` is
    ``target_ids``'s. Every output is 0 at ignored rows.

    Attributes:
        kl: ``[...]`` float32 divergence over the teacher's top-M buckets plus the tail.
        student_logprob: ``[...]`` ``log_softmax(student_logits / T)[target]``.
        student_topk_mass: ``[...]`` float32, no gradient: the student's mass on the teacher's
            (real) top-M ids.
        teacher_topk_mass: ``[...]`` float32, no gradient: ``sum_i exp(teacher_topk_logprobs_i)``.
    """

    kl: Tensor
    student_logprob: Tensor
    student_topk_mass: Tensor
    teacher_topk_mass: Tensor


def teacher_log_tail(lp: Tensor, tail_floor: float, reverse: bool) -> Tensor:
    """``[N]`` log of the teacher's tail mass ``1 - sum_i exp(lp_i)`` from ``[N, M]`` log-probs
    (``-inf``: padding), with the log-sum-exp as ``max + log1p(rest)`` so that a top-M mass near
    1 keeps its last digits. A tail below ``tail_floor`` is raised to it (``reverse``) or set to
    0 (forward). No gradient (the teacher is constant)."""
    lp = lp.detach()
    top = lp.max(-1).values
    first = lp.argmax(-1, keepdim=True)
    rest = (lp - top.unsqueeze(-1)).exp().scatter(-1, first, 0.0).sum(-1)
    lse = torch.where(top == -math.inf, -math.inf, top + torch.log1p(rest))
    tail = -torch.expm1(lse.clamp(max=0.0))
    if reverse:
        tail = tail.clamp(min=tail_floor)
    else:
        tail = torch.where(tail < tail_floor, 0.0, tail)
    return tail.log()


# ------------------------------------------------------------------------------------ reference


def sparse_teacher_topk_tail_kl_reference(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    divergence: str = "reverse",
    ignore_index: int = -100,
    tail_floor: float = 1e-6,
    mass_tolerance: float = 1e-3,
) -> SparseTeacherTopKTailKLOutput:
    """PyTorch reference of :func:`sparse_teacher_topk_tail_kl` (plain autograd; the oracle).

    Computes in float64 when either floating input is float64, else float32. Same arguments,
    validation and outputs as :func:`sparse_teacher_topk_tail_kl` (without ``backend``).
    """
    check_inputs(
        student_logits,
        teacher_topk_logprobs,
        teacher_topk_ids,
        target_ids,
        temperature,
        divergence,
        ignore_index,
        tail_floor,
        mass_tolerance,
    )
    vocab, m = student_logits.shape[-1], teacher_topk_ids.shape[-1]
    lead = student_logits.shape[:-1]
    f64 = torch.float64 in (student_logits.dtype, teacher_topk_logprobs.dtype)
    dtype = torch.float64 if f64 else torch.float32
    tgt = target_ids.reshape(-1).long()
    lp_all = teacher_topk_logprobs.reshape(-1, m).to(dtype)
    ids_all = teacher_topk_ids.reshape(-1, m).long()
    check_values(lp_all, ids_all, tgt, vocab, ignore_index, mass_tolerance)

    rows = (tgt != ignore_index).nonzero().squeeze(1)
    s = student_logits.reshape(-1, vocab).to(dtype)[rows] / temperature
    lp, ids, a = lp_all[rows], ids_all[rows], tgt[rows].unsqueeze(1)
    pad = lp == -math.inf
    safe_ids = ids.masked_fill(pad, 0)
    # scatter_add, not scatter: a padding slot's placeholder id must not clear a real one.
    in_top = torch.zeros_like(s, dtype=torch.int32).scatter_add(1, safe_ids, (~pad).int()) > 0
    lse_s = torch.logsumexp(s, dim=-1, keepdim=True)
    full_lse = torch.zeros(tgt.numel(), dtype=dtype, device=s.device)
    full_lse[rows] = lse_s.squeeze(1).detach()
    check_rows_have_mass(full_lse, tgt, ignore_index, ("student_logits",))
    slp = (s.gather(1, a) - lse_s).squeeze(1)
    logp_top = (s.gather(1, safe_ids) - lse_s).masked_fill(pad, -math.inf)
    logp_tail = masked_logsumexp(s, ~in_top).unsqueeze(1) - lse_s
    logq_tail = teacher_log_tail(lp, tail_floor, divergence == "reverse").unsqueeze(1)
    logp = torch.cat([logp_top, logp_tail], 1)
    logq = torch.cat([lp, logq_tail], 1)
    kl = bucket_divergence(logp, logq, divergence)
    with torch.no_grad():
        s_mass = logp_top.exp().sum(-1)
        t_mass = lp.exp().sum(-1)

    n = tgt.numel()

    def scatter_rows(x: Tensor) -> Tensor:
        return torch.zeros(n, dtype=x.dtype, device=x.device).index_put((rows,), x)

    return SparseTeacherTopKTailKLOutput(
        kl=scatter_rows(kl).reshape(lead),
        student_logprob=scatter_rows(slp).reshape(lead),
        student_topk_mass=scatter_rows(s_mass).reshape(lead),
        teacher_topk_mass=scatter_rows(t_mass).reshape(lead),
    )


# ------------------------------------------------------------------------------------ custom ops
# Contract of every implementation (schema: csrc/common/schemas.h). Forward:
#   (student_logits [N, V] fp32/bf16/fp16, teacher_topk_logprobs [N, M] fp32,
#    teacher_topk_ids [N, M] int64, target_ids [N] int64, temperature, reverse, ignore_index,
#    tail_floor) -> kl [N], student_logprob [N], lse [N] (student logsumexp(s / T)),
#    bucket_logp [N, 2, M + 1] (log P_b, log Q_b in slot order, -inf at padding slots; M: tail).
# Backward: (grad_kl, grad_student_logprob, student_logits, teacher_topk_ids, target_ids, kl,
#    lse, bucket_logp, temperature, reverse, ignore_index) -> grad_student [N, V] (its dtype).


def _fwd_fake(student_logits, teacher_topk_logprobs, teacher_topk_ids, target_ids, *_args):
    n, m = teacher_topk_ids.shape
    f32 = {"dtype": torch.float32, "device": student_logits.device}
    return (
        torch.empty(n, **f32),
        torch.empty(n, **f32),
        torch.empty(n, **f32),
        torch.empty(n, 2, m + 1, **f32),
    )


def _bwd_fake(grad_kl, grad_student_logprob, student_logits, *_args):
    return torch.empty_like(student_logits)


class _FwdArgs(NamedTuple):
    """The arguments of ``sparse_teacher_topk_tail_kl_<impl>_fwd`` (csrc/common/schemas.h)."""

    student_logits: Tensor
    teacher_topk_logprobs: Tensor
    teacher_topk_ids: Tensor
    target_ids: Tensor
    temperature: float
    reverse: bool
    ignore_index: int
    tail_floor: float


def _setup_context(ctx, inputs, output) -> None:
    args, out = _FwdArgs(*inputs), SparseTeacherTopKTailKLOpOutput(*output)
    ctx.save_for_backward(args.student_logits, args.teacher_topk_ids, args.target_ids, out.kl,
                          out.lse, out.bucket_logp)  # fmt: skip
    ctx.temperature = args.temperature
    ctx.reverse = args.reverse
    ctx.ignore_index = args.ignore_index


def _make_backward(bwd_op):
    """The autograd backward of a forward op, differentiating through ``bwd_op``."""

    def backward(ctx, g_kl, g_slp, _g_lse, _g_bucket):
        student, ids, target, kl, lse, bucket_logp = ctx.saved_tensors
        grad = None
        if _FwdArgs(*ctx.needs_input_grad).student_logits:

            def upstream(g):
                return kl.new_zeros(kl.shape) if g is None else g.float().contiguous()

            grad = bwd_op(
                upstream(g_kl),
                upstream(g_slp),
                student,
                ids,
                target,
                kl,
                lse,
                bucket_logp,
                ctx.temperature,
                ctx.reverse,
                ctx.ignore_index,
            )
        return input_grads(_FwdArgs._fields, student_logits=grad)

    return backward


CUSTOM_OPS = CustomOps(OP, _fwd_fake, _bwd_fake, _setup_context, _make_backward)


def _triton_launchers():
    """The Triton launchers, imported on first use."""
    try:
        # triton is optional (machines without it use the other backends): imported lazily.
        from lopd_kernels.triton.sparse_teacher_topk_tail_kl import (
            sparse_teacher_bwd_triton,
            sparse_teacher_fwd_triton,
        )
    except ImportError as err:
        raise triton_import_error(OP, err) from err
    return sparse_teacher_fwd_triton, sparse_teacher_bwd_triton


def _triton_fwd(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    tail_floor: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton forward as an opaque op (same contract as the C++ ``..._cpu_fwd``)."""
    fwd, _ = _triton_launchers()
    return fwd(
        student_logits,
        teacher_topk_logprobs,
        teacher_topk_ids,
        target_ids,
        temperature,
        reverse,
        ignore_index,
        tail_floor,
    )


def _triton_bwd(
    grad_kl: Tensor,
    grad_student_logprob: Tensor,
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    kl: Tensor,
    lse: Tensor,
    bucket_logp: Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
) -> Tensor:
    """Triton backward as an opaque op (same contract as the C++ ``..._cpu_bwd``)."""
    _, bwd = _triton_launchers()
    return bwd(
        grad_kl,
        grad_student_logprob,
        student_logits,
        teacher_topk_ids,
        target_ids,
        kl,
        lse,
        bucket_logp,
        temperature,
        reverse,
        ignore_index,
    )


CUSTOM_OPS.define("triton", _triton_fwd, _triton_bwd)
CUSTOM_OPS.register_compiled()


def _limits(m: int) -> dict[str, str]:
    if m > TRITON_SPARSE_TEACHER_MAX_TOP_M:
        return {"triton": f"supports M <= {TRITON_SPARSE_TEACHER_MAX_TOP_M}, got M={m}"}
    return {}


# ------------------------------------------------------------------------------------ public API


def sparse_teacher_topk_tail_kl(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    divergence: str = "reverse",
    ignore_index: int = -100,
    tail_floor: float = 1e-6,
    mass_tolerance: float = 1e-3,
    backend: str = "auto",
) -> SparseTeacherTopKTailKLOutput:
    """Top-M + tail KL of full student logits against a teacher known by its top-M only.

    Equals :func:`lopd_kernels.topk_tail_kl` run on the dense teacher when the ids are that
    teacher's top-M and the log-probs its ``log_softmax(teacher_logits / T)`` there (the module
    docstring lists the conventions: temperature, tail floor, padding, gradients).

    Args:
        student_logits: ``[..., V]`` float32 / bfloat16 / float16 (float64: ``backend="torch"``,
            which ``"auto"`` picks for it); ``-inf`` entries allowed.
        teacher_topk_logprobs: ``[..., M]`` floating, M >= 1: the teacher's log-probs of its
            top-M ids under its full (tempered) softmax; ``-inf`` marks a padding slot. Any
            order. A constant: must not require grad.
        teacher_topk_ids: ``[..., M]`` int64 (or int32) ids in ``[0, V)``, distinct per row
            (padding slots excepted).
        target_ids: ``[...]`` int64 (or int32) sampled token ids (for ``student_logprob``), or
            ``ignore_index`` for rows that produce zeros (outputs and gradient).
        temperature: T > 0 dividing the student logits.
        divergence: ``"reverse"`` = KL(student || teacher) (the paper's) or ``"forward"``.
        ignore_index: target value marking ignored rows.
        tail_floor: in ``[0, 1)``: teacher tail masses below it are rounding noise, raised
            to it for the reverse KL and dropped to 0 for the forward KL (module docstring; 0
            disables it).
        mass_tolerance: how far above 1 the top-M mass may be (server rounding) before a row
            is inconsistent.
        backend: ``"auto"`` (CPU tensors: the C++ kernel; CUDA: Triton; float64: the
            reference), ``"torch"``, ``"cpu"``, ``"triton"`` (M <= 256). No ``"cuda"``.

    Returns:
        :class:`SparseTeacherTopKTailKLOutput` ``(kl, student_logprob, student_topk_mass,
        teacher_topk_mass)``, float32 ``[...]`` (float64 from the float64 reference).

    Raises:
        TypeError / ValueError: bad dtypes, shapes, devices or options; a target outside
            ``[0, V)``; NaN or positive teacher log-probs, a top-M mass above
            ``1 + mass_tolerance``, ids outside ``[0, V)`` or repeated in a row. The message
            names the argument (and the flattened row). Validation reads the teacher's values:
            one host sync per call on CUDA.
    """
    check_inputs(
        student_logits,
        teacher_topk_logprobs,
        teacher_topk_ids,
        target_ids,
        temperature,
        divergence,
        ignore_index,
        tail_floor,
        mass_tolerance,
    )
    vocab, m = student_logits.shape[-1], teacher_topk_ids.shape[-1]
    fp64 = torch.float64 in (student_logits.dtype, teacher_topk_logprobs.dtype)
    name = BACKENDS.resolve(backend, student_logits.device, fp64=fp64, unsupported=_limits(m))
    kw = {
        "temperature": temperature,
        "divergence": divergence,
        "ignore_index": ignore_index,
        "tail_floor": tail_floor,
        "mass_tolerance": mass_tolerance,
    }
    if name == "torch":
        return sparse_teacher_topk_tail_kl_reference(
            student_logits, teacher_topk_logprobs, teacher_topk_ids, target_ids, **kw
        )
    lead = student_logits.shape[:-1]
    s = student_logits.reshape(-1, vocab).contiguous()
    lp = teacher_topk_logprobs.reshape(-1, m).to(torch.float32).contiguous()
    ids = teacher_topk_ids.reshape(-1, m).to(torch.int64).contiguous()
    tgt = target_ids.reshape(-1).to(torch.int64).contiguous()
    check_values(lp, ids, tgt, vocab, ignore_index, mass_tolerance)
    out = SparseTeacherTopKTailKLOpOutput(*CUSTOM_OPS.fwd_op(name)(
        s, lp, ids, tgt, float(temperature), divergence == "reverse", int(ignore_index),
        float(tail_floor),
    ))  # fmt: skip
    check_rows_have_mass(out.lse, tgt, ignore_index, ("student_logits",))
    with torch.no_grad():
        keep = tgt != ignore_index
        s_mass = torch.where(keep, out.bucket_logp[:, 0, :m].exp().sum(-1), 0.0)
        t_mass = torch.where(keep, lp.exp().sum(-1), 0.0)
    return SparseTeacherTopKTailKLOutput(
        kl=out.kl.reshape(lead),
        student_logprob=out.student_logprob.reshape(lead),
        student_topk_mass=s_mass.reshape(lead),
        teacher_topk_mass=t_mass.reshape(lead),
    )


class SparseTeacherTopKTailKL(nn.Module):
    """Module form of :func:`sparse_teacher_topk_tail_kl` returning the (reduced) KL loss.

    Args:
        temperature, divergence, ignore_index, tail_floor, mass_tolerance, backend: as in
            :func:`sparse_teacher_topk_tail_kl`.
        reduction: ``"none"`` (``[...]``), ``"mean"`` (over non-ignored tokens; 0 when every
            token is ignored) or ``"sum"``.

    Shapes:
        student_logits ``[..., V]``; teacher_topk_logprobs, teacher_topk_ids ``[..., M]``;
        target_ids ``[...]``; output ``[...]`` for ``"none"``, else a scalar.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        divergence: str = "reverse",
        ignore_index: int = -100,
        reduction: str = "mean",
        tail_floor: float = 1e-6,
        mass_tolerance: float = 1e-3,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_module_options(reduction, divergence, backend, divergences=KL_DIVERGENCES)
        self.temperature = temperature
        self.divergence = divergence
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.tail_floor = tail_floor
        self.mass_tolerance = mass_tolerance
        self.backend = backend

    def forward(
        self,
        student_logits: Tensor,
        teacher_topk_logprobs: Tensor,
        teacher_topk_ids: Tensor,
        target_ids: Tensor,
    ) -> Tensor:
        kl = sparse_teacher_topk_tail_kl(
            student_logits,
            teacher_topk_logprobs,
            teacher_topk_ids,
            target_ids,
            temperature=self.temperature,
            divergence=self.divergence,
            ignore_index=self.ignore_index,
            tail_floor=self.tail_floor,
            mass_tolerance=self.mass_tolerance,
            backend=self.backend,
        ).kl
        return reduce_kl(kl, target_ids, self.ignore_index, self.reduction)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, divergence={self.divergence!r}, "
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"tail_floor={self.tail_floor}, backend={self.backend!r}"
        )
