"""Top-M + tail-bucket KL with the per-token privilege (paper eq. 9-11): the LOPD loss kernel.

For every token row (student logits ``s``, teacher logits ``t``, sampled token ``a``, all divided
by the temperature first) the op returns

* ``kl``: the divergence between student and teacher over the buckets of a *support*: its ids
  (``support="teacher"``: the teacher's top-M, the paper's; ``"student"``: the student's top-M;
  ``"union"``: both, up to 2M ids) each a bucket, and one tail bucket holding the rest of the
  vocabulary. Reverse KL ``sum_b P_b (log P_b - log Q_b)`` (the paper's), forward KL
  ``sum_b Q_b (log Q_b - log P_b)``, or TRL's generalized JSD with ``beta``. The tail's log-mass
  is the log-sum-exp over the complement of the support, never ``log(1 - sum(top))``
  (definitions and derivations: ``docs/math.md``).
* ``student_logprob`` / ``teacher_logprob``: ``log_softmax(.)[a]`` of each side.
* ``privilege = teacher_logprob - stopgrad(student_logprob)``.
* ``topk_ids``: the support's ids (``-1``: padding of a union smaller than 2M), and
  ``support_size``: how many there are.

Gradients flow to both logits: ``kl`` to both, ``student_logprob`` to the student,
``privilege`` and ``teacher_logprob`` to the teacher.

Layering: kernels (C++ ``csrc/cpu/``, CUDA ``csrc/cuda/``, Triton
``lopd_kernels/triton/topk_tail_kl.py``) -> custom ops ``torch.ops.lopd.topk_tail_kl_<impl>_fwd``
/ ``_bwd`` for ``<impl>`` in ``cpu``, ``cuda`` (C++, schemas in ``csrc/common/schemas.h``) and
``triton`` (defined here), each with a fake impl and autograd registered by :data:`CUSTOM_OPS`
(:class:`lopd_kernels._custom_ops.CustomOps`) -> :func:`topk_tail_kl` -> :class:`TopKTailKL`.
:func:`topk_tail_kl_reference` is the plain-autograd PyTorch oracle (float64-capable) every
backend is tested against; backend choice is :class:`lopd_kernels._backend.OpBackends`; input
checks are :mod:`lopd_kernels.topk_tail_kl_checks`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lopd_kernels._backend import OpBackends, compiled_unavailable, triton_import_error
from lopd_kernels._constants import CUDA_TOPK_MAX_TOP_M, TRITON_TOPK_MAX_TOP_M
from lopd_kernels._custom_ops import CustomOps, input_grads
from lopd_kernels._reduction import check_module_options, reduce_kl
from lopd_kernels.bucket_math import (
    bucket_divergence,
    masked_logsumexp,
    op_divergence,
    select_support,
    support_masks,
    support_size,
    support_width,
    teacher_topk_mass,
)
from lopd_kernels.op_outputs import TopKTailKLOpGrads, TopKTailKLOpOutput
from lopd_kernels.row_layout import rows_in_place
from lopd_kernels.topk_tail_kl_checks import (
    check_inputs,
    check_rows_have_mass,
    check_targets_in_range,
    check_values,
)

__all__ = ["TopKTailKL", "TopKTailKLOutput", "topk_tail_kl", "topk_tail_kl_reference"]

_SIDES = ("student_logits", "teacher_logits")

OP = "topk_tail_kl"
# Resolved once at import (the extension is loaded here if it exists), so that backend choice
# is plain Python on constants and torch.compile traces it without graph breaks. On GPUs Triton
# is the measured default; the CUDA kernels take over where Triton cannot run (no triton, top_m
# above its limit) until a GPU benchmark shows them faster.
BACKENDS = OpBackends(
    OP,
    impls=("cpu", "cuda", "triton"),
    unavailable=compiled_unavailable(OP),
    auto={"cpu": ("cpu",), "cuda": ("triton", "cuda")},
)


class TopKTailKLOutput(NamedTuple):
    """Outputs of :func:`topk_tail_kl`; leading shape ``[...]`` is that of ``target_ids``.

    Attributes:
        kl: ``[...]`` float32 divergence over the support's buckets plus the tail bucket.
        privilege: ``[...]`` ``teacher_logprob - stopgrad(student_logprob)`` (gradient to the
            teacher only).
        student_logprob: ``[...]`` ``log_softmax(student_logits / T)[target]``.
        teacher_logprob: ``[...]`` ``log_softmax(teacher_logits / T)[target]``.
        topk_ids: ``[..., K]`` int64, no gradient: the support's ids, its bucket order
            (``docs/math.md``): ``K = M`` for ``support="teacher"`` (the teacher's top-M, by
            descending teacher logit, ties to the lower id) and ``"student"`` (the same on the
            student); ``K = 2M`` for ``"union"`` (the teacher's top-M, then the student's other
            top-M ids in student order, then -1); ``K = 0`` for the full vocabulary.
        teacher_topk_mass: ``[...]`` float32, no gradient: the teacher's probability mass on the
            support's ids, ``sum_i exp(log Q_i)`` over the kernel's bucket log-masses (exact also
            for a sharp teacher; no extra pass over the logits). 1 in full-vocabulary mode; 0 at
            ignored rows. How much of the teacher the buckets resolve (paper, A.2).
        support_size: ``[...]`` int64, no gradient: the number of ids in ``topk_ids`` (M, the
            union's size in ``[M, 2M]``, V for the full vocabulary); 0 at ignored rows.
    """

    kl: Tensor
    privilege: Tensor
    student_logprob: Tensor
    teacher_logprob: Tensor
    topk_ids: Tensor
    teacher_topk_mass: Tensor
    support_size: Tensor


# ------------------------------------------------------------------------------------ reference


def topk_tail_kl_reference(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    *,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
) -> TopKTailKLOutput:
    """PyTorch reference of :func:`topk_tail_kl` (plain autograd; the test oracle).

    Computes in float64 when either input is float64, else in float32. The support's ids come
    from stable descending sorts (:func:`lopd_kernels.bucket_math.select_support`), so ties go to
    the lower vocabulary id (the rule every kernel implements). The tail log-mass is a
    log-sum-exp over the complement of the support. Ignored rows are dropped before any work and
    come back as zeros.

    Args:
        student_logits: ``[..., V]`` floating logits.
        teacher_logits: ``[..., V]`` floating logits (dtype may differ from the student's).
        target_ids: ``[...]`` int64 sampled token ids, or ``ignore_index``.
        top_m: M >= 1, or None (or >= V) for the full-vocabulary divergence without a tail.
        temperature: T > 0; logits are divided by T first.
        divergence, beta, support: as :func:`topk_tail_kl`.
        ignore_index: target value marking rows that produce zeros.

    Returns:
        :class:`TopKTailKLOutput`; float outputs in the compute dtype (float32 or float64).
    """
    m = check_inputs(
        student_logits, teacher_logits, target_ids, top_m, temperature, divergence, ignore_index,
        beta, support,
    )  # fmt: skip
    divergence, beta = op_divergence(divergence, beta)
    vocab = student_logits.shape[-1]
    lead = student_logits.shape[:-1]
    dtype = (
        torch.float64
        if torch.float64 in (student_logits.dtype, teacher_logits.dtype)
        else torch.float32
    )
    tgt = target_ids.reshape(-1).long()
    check_values(tgt, vocab, ignore_index)
    keep = target_ids != ignore_index
    rows = keep.reshape(-1).nonzero().squeeze(1)
    # Gather the kept rows straight from [..., V] (a strided view such as logits[:, :-1] is not
    # first copied whole by a reshape), in the order of ``rows``.
    s = student_logits[keep].to(dtype) / temperature
    t = teacher_logits[keep].to(dtype) / temperature
    a = tgt[rows].unsqueeze(1)

    lse_s = torch.logsumexp(s, dim=-1, keepdim=True)
    lse_t = torch.logsumexp(t, dim=-1, keepdim=True)
    full_lse = torch.zeros(tgt.numel(), 2, dtype=dtype, device=s.device)
    full_lse[rows] = torch.cat([lse_s, lse_t], 1).detach()
    check_rows_have_mass(full_lse, tgt, ignore_index, _SIDES)
    slp = (s.gather(1, a) - lse_s).squeeze(1)
    tlp = (t.gather(1, a) - lse_t).squeeze(1)
    if m == 0:
        ids = torch.zeros(rows.numel(), 0, dtype=torch.int64, device=s.device)
        logp, logq = s - lse_s, t - lse_t
    else:
        ids = select_support(s, t, m, support)
        in_support, pad = support_masks(ids, vocab)
        safe = ids.clamp(min=0)
        # Padding slots (-1, union only) are buckets of mass 0 on both sides: they add 0.
        top_s = s.gather(1, safe).masked_fill(pad, -math.inf)
        top_t = t.gather(1, safe).masked_fill(pad, -math.inf)
        tail = ~in_support
        logp = torch.cat([top_s, masked_logsumexp(s, tail).unsqueeze(1)], 1) - lse_s
        logq = torch.cat([top_t, masked_logsumexp(t, tail).unsqueeze(1)], 1) - lse_t
    kl = bucket_divergence(logp, logq, divergence, beta)
    with torch.no_grad():
        if m == 0:
            mass = torch.ones(rows.numel(), dtype=dtype, device=s.device)
        else:
            mass = logq[:, :-1].exp().sum(-1)

    n = tgt.numel()

    def scatter_rows(x: Tensor) -> Tensor:
        full = torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return full.index_put((rows,), x)

    kl, slp, tlp, ids, mass = (scatter_rows(x) for x in (kl, slp, tlp, ids, mass))
    return TopKTailKLOutput(
        kl=kl.reshape(lead),
        privilege=(tlp - slp.detach()).reshape(lead),
        student_logprob=slp.reshape(lead),
        teacher_logprob=tlp.reshape(lead),
        topk_ids=ids.reshape(*lead, ids.shape[-1]),
        teacher_topk_mass=mass.reshape(lead),
        support_size=support_size(ids, tgt, ignore_index, vocab).reshape(lead),
    )


# ------------------------------------------------------------------------------------ custom ops
# One schema for every implementation (csrc/common/schemas.h): cpu and cuda are C++ ops, triton
# the Python ops defined below; fakes and autograd are registered for all of them by CUSTOM_OPS.


def _fwd_fake(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    n = math.prod(student_logits.shape[:-1])  # [N, V] or [B, L, V] logits
    k = support_width(top_m, support)
    f32 = {"dtype": torch.float32, "device": student_logits.device}
    return (
        torch.empty(n, **f32),
        torch.empty(n, **f32),
        torch.empty(n, **f32),
        torch.empty(n, k, dtype=torch.int64, device=student_logits.device),
        torch.empty(n, 2, **f32),
        torch.empty(n, 2, k + 1, **f32),
    )


def _bwd_fake(
    grad_kl: Tensor,
    grad_student_logprob: Tensor,
    grad_teacher_logprob: Tensor,
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    topk_ids: Tensor,
    kl: Tensor,
    lse: Tensor,
    bucket_logp: Tensor,
    temperature: float,
    divergence: str,
    beta: float,
    ignore_index: int,
    student_requires_grad: bool,
    teacher_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    dev = student_logits.device
    none = torch.empty(0, dtype=torch.float32, device=dev)
    gs = student_logits.new_empty(student_logits.shape) if student_requires_grad else none
    gt = teacher_logits.new_empty(teacher_logits.shape) if teacher_requires_grad else none
    return gs, gt


class _FwdArgs(NamedTuple):
    """The arguments of ``topk_tail_kl_<impl>_fwd`` (csrc/common/schemas.h)."""

    student_logits: Tensor
    teacher_logits: Tensor
    target_ids: Tensor
    top_m: int
    temperature: float
    divergence: str
    beta: float
    support: str
    ignore_index: int


def _setup_context(ctx, inputs, output) -> None:
    args, out = _FwdArgs(*inputs), TopKTailKLOpOutput(*output)
    # O(K) per row beyond the inputs themselves: lse [N, 2], bucket_logp [N, 2, K + 1].
    ctx.save_for_backward(args.student_logits, args.teacher_logits, args.target_ids,
                          out.topk_ids, out.kl, out.lse, out.bucket_logp)  # fmt: skip
    ctx.scalars = (args.temperature, args.divergence, args.beta, args.ignore_index)


def _make_backward(bwd_op):
    """The autograd backward of a forward op, differentiating through ``bwd_op``."""

    def backward(ctx, g_kl, g_slp, g_tlp, _g_ids, _g_lse, _g_bucket):
        student, teacher, target, topk_ids, kl, lse, bucket_logp = ctx.saved_tensors
        needs = _FwdArgs(*ctx.needs_input_grad)
        need_s, need_t = needs.student_logits, needs.teacher_logits
        rows = (kl.shape[0],)

        def upstream(g):
            if g is None:
                return kl.new_zeros(rows)
            return g.to(torch.float32).contiguous()

        grads = TopKTailKLOpGrads(*bwd_op(
            upstream(g_kl), upstream(g_slp), upstream(g_tlp), student, teacher, target,
            topk_ids, kl, lse, bucket_logp, *ctx.scalars, need_s, need_t,
        ))  # fmt: skip
        return input_grads(
            _FwdArgs._fields,
            student_logits=grads.student_logits if need_s else None,
            teacher_logits=grads.teacher_logits if need_t else None,
        )

    return backward


CUSTOM_OPS = CustomOps(OP, _fwd_fake, _bwd_fake, _setup_context, _make_backward)


def _triton_launchers():
    """The Triton launchers, imported on first use."""
    try:
        # triton is optional (machines without it use the other backends): imported lazily.
        from lopd_kernels.triton.topk_tail_kl import (
            topk_tail_kl_bwd_triton,
            topk_tail_kl_fwd_triton,
        )
    except ImportError as err:
        raise triton_import_error(OP, err) from err
    return topk_tail_kl_fwd_triton, topk_tail_kl_bwd_triton


def _triton_fwd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Triton forward as an opaque op (same contract as ``lopd::topk_tail_kl_cpu_fwd``)."""
    fwd, _ = _triton_launchers()
    vocab = student_logits.shape[-1]
    if target_ids.is_cuda:
        # Device-side assert: validating on the host would synchronize every step.
        bad = (target_ids != ignore_index) & ((target_ids < 0) | (target_ids >= vocab))
        torch._assert_async(
            ~bad.any(), "topk_tail_kl: target_ids outside [0, V) that are not ignore_index"
        )
    else:
        check_values(target_ids, vocab, ignore_index)
    # The launcher reads strided rows in place (it copies only a non-dense vocabulary axis).
    return fwd(
        student_logits, teacher_logits, target_ids.contiguous(), top_m, temperature,
        divergence, beta, support, ignore_index,
    )  # fmt: skip


def _triton_bwd(
    grad_kl: Tensor,
    grad_student_logprob: Tensor,
    grad_teacher_logprob: Tensor,
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    topk_ids: Tensor,
    kl: Tensor,
    lse: Tensor,
    bucket_logp: Tensor,
    temperature: float,
    divergence: str,
    beta: float,
    ignore_index: int,
    student_requires_grad: bool,
    teacher_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    """Triton backward as an opaque op (same contract as ``lopd::topk_tail_kl_cpu_bwd``)."""
    _, bwd = _triton_launchers()
    return bwd(
        grad_kl.contiguous(), grad_student_logprob.contiguous(),
        grad_teacher_logprob.contiguous(), student_logits, teacher_logits,
        target_ids.contiguous(), topk_ids.contiguous(), kl.contiguous(), lse.contiguous(),
        bucket_logp.contiguous(), temperature, divergence, beta, ignore_index,
        student_requires_grad, teacher_requires_grad,
    )  # fmt: skip


CUSTOM_OPS.define("triton", _triton_fwd, _triton_bwd)
CUSTOM_OPS.register_compiled()


def implementation_limits(top_m: int) -> dict[str, str]:
    """Per-call reasons an implementation cannot take ``top_m`` (0: the full vocabulary): the
    ``unsupported`` argument of :meth:`OpBackends.resolve`."""
    out = {}
    if top_m > TRITON_TOPK_MAX_TOP_M:
        out["triton"] = f"supports top_m <= {TRITON_TOPK_MAX_TOP_M} (or None), got {top_m}"
    if top_m > CUDA_TOPK_MAX_TOP_M:
        out["cuda"] = f"supports top_m <= {CUDA_TOPK_MAX_TOP_M} (or None), got {top_m}"
    return out


def topk_tail_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    *,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
    backend: str = "auto",
) -> TopKTailKLOutput:
    """Top-M + tail-bucket divergence, sampled-token log-probs and privilege, fused (paper
    eq. 9-11).

    Args:
        student_logits: ``[..., V]`` float32 / bfloat16 / float16 (float64: ``backend="torch"``
            only, which ``"auto"`` picks for it).
        teacher_logits: ``[..., V]``, same shape and device; the dtype may differ.
        target_ids: ``[...]`` int64 (or int32) sampled token ids in ``[0, V)``, or
            ``ignore_index`` for rows that produce 0 everywhere (outputs and gradients).
        top_m: M, the number of top ids each kept as a bucket; ``None`` (or ``>= V``) computes
            the full-vocabulary divergence with no tail bucket.
        temperature: T > 0; both logits are divided by T first.
        divergence: ``"reverse"`` = KL(student || teacher) (the paper's), ``"forward"`` =
            KL(teacher || student), or ``"jsd"``: TRL's generalized JSD
            ``beta KL(Q || M) + (1 - beta) KL(P || M)``, ``M = (1 - beta) P + beta Q``, with
            ``beta=0`` / ``1`` the forward / reverse KL as in TRL (``docs/math.md``, 1b).
        beta: the JSD's ``beta`` in [0, 1] (None: 0.5, TRL's GKD default); only with
            ``divergence="jsd"``.
        support: whose top-M ids are buckets: ``"teacher"`` (the paper's), ``"student"``, or
            ``"union"`` (both; ``topk_ids`` is ``[..., 2M]`` with -1 padding).
        ignore_index: target value marking ignored rows.
        backend: ``"auto"`` (CPU tensors: the C++ kernel; CUDA tensors: Triton, else the CUDA
            kernel if built; float64, or options no kernel has: the reference), ``"torch"``,
            ``"cpu"``, ``"triton"``, ``"cuda"``.

    Returns:
        :class:`TopKTailKLOutput` ``(kl, privilege, student_logprob, teacher_logprob,
        topk_ids, teacher_topk_mass, support_size)``; float outputs are float32 ``[...]``
        (float64 from the float64 reference), ``topk_ids`` is int64 ``[..., K]``.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, devices, ``top_m``, ``temperature``,
            ``divergence``, ``beta``, ``support`` or ``backend``; the message names the argument.
        ValueError: a target outside ``[0, V)`` that is not ``ignore_index``, or a row (not
            ignored) whose student or teacher logits are all ``-inf``; on CUDA tensors and under
            ``torch.compile`` a device-side assert (``RuntimeError``) instead (docs/kernels.md).
        BackendUnavailableError: an explicit backend that cannot run these inputs or options.
    """
    m = check_inputs(
        student_logits, teacher_logits, target_ids, top_m, temperature, divergence, ignore_index,
        beta, support,
    )  # fmt: skip
    fp64 = torch.float64 in (student_logits.dtype, teacher_logits.dtype)
    limits = implementation_limits(m)
    name = BACKENDS.resolve(backend, student_logits.device, fp64=fp64, unsupported=limits)
    if name == "torch":
        return topk_tail_kl_reference(
            student_logits, teacher_logits, target_ids, top_m=top_m, temperature=temperature,
            divergence=divergence, beta=beta, support=support, ignore_index=ignore_index,
        )  # fmt: skip
    return call_fwd_op(
        CUSTOM_OPS.fwd_op(name), student_logits, teacher_logits, target_ids, m, temperature,
        divergence, ignore_index, beta=beta, support=support,
    )  # fmt: skip


def call_fwd_op(
    op,
    student_logits: Tensor,
    teacher_logits: Tensor,
    target_ids: Tensor,
    m: int,
    temperature: float,
    divergence: str,
    ignore_index: int,
    *,
    beta: float | None = None,
    support: str = "teacher",
) -> TopKTailKLOutput:
    """Runs a ``topk_tail_kl_<impl>_fwd``-schema op (any implementation's, autograd registered)
    on validated ``[..., V]`` inputs with ``m`` top ids and shapes its outputs as
    :func:`topk_tail_kl` (``divergence`` / ``beta`` as the user gives them)."""
    lead = student_logits.shape[:-1]
    flat_target = target_ids.reshape(-1).to(torch.int64).contiguous()
    check_targets_in_range(flat_target, student_logits.shape[-1], ignore_index)
    div, b = op_divergence(divergence, beta)
    out = TopKTailKLOpOutput(*op(
        rows_in_place(student_logits), rows_in_place(teacher_logits), flat_target, m,
        float(temperature), div, b, support, int(ignore_index),
    ))  # fmt: skip
    check_rows_have_mass(out.lse, flat_target, ignore_index, _SIDES)
    vocab = student_logits.shape[-1]
    slp, tlp, ids = out.student_logprob, out.teacher_logprob, out.topk_ids
    return TopKTailKLOutput(
        kl=out.kl.reshape(lead),
        privilege=(tlp - slp.detach()).reshape(lead),
        student_logprob=slp.reshape(lead),
        teacher_logprob=tlp.reshape(lead),
        topk_ids=ids.reshape(*lead, ids.shape[-1]),
        teacher_topk_mass=teacher_topk_mass(out.bucket_logp, flat_target, ignore_index).reshape(
            lead
        ),
        support_size=support_size(ids, flat_target, ignore_index, vocab).reshape(lead),
    )


class TopKTailKL(nn.Module):
    """Module form of :func:`topk_tail_kl` returning the (reduced) divergence.

    Args:
        top_m, temperature, divergence, beta, support, ignore_index, backend: as in
            :func:`topk_tail_kl`.
        reduction: ``"none"`` (``[...]`` per-token divergence, 0 at ignored tokens), ``"mean"``
            (over non-ignored tokens; 0, never NaN, when every token is ignored) or ``"sum"``.

    Shapes:
        student_logits, teacher_logits: ``[..., V]``; target_ids: ``[...]``; output: ``[...]``
        for ``"none"``, else a scalar.
    """

    def __init__(
        self,
        top_m: int | None = 20,
        temperature: float = 1.0,
        divergence: str = "reverse",
        ignore_index: int = -100,
        reduction: str = "mean",
        backend: str = "auto",
        *,
        beta: float | None = None,
        support: str = "teacher",
    ) -> None:
        super().__init__()
        check_module_options(reduction, divergence, backend, support=support)
        self.top_m = top_m
        self.temperature = temperature
        self.divergence = divergence
        self.beta = beta
        self.support = support
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.backend = backend

    def forward(self, student_logits: Tensor, teacher_logits: Tensor, target_ids: Tensor) -> Tensor:
        kl = topk_tail_kl(
            student_logits, teacher_logits, target_ids, top_m=self.top_m,
            temperature=self.temperature, divergence=self.divergence, beta=self.beta,
            support=self.support, ignore_index=self.ignore_index, backend=self.backend,
        ).kl  # fmt: skip
        return reduce_kl(kl, target_ids, self.ignore_index, self.reduction)

    def extra_repr(self) -> str:
        return (
            f"top_m={self.top_m}, temperature={self.temperature}, divergence={self.divergence!r}, "
            f"beta={self.beta}, support={self.support!r}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}, backend={self.backend!r}"
        )
