"""Top-M + tail KL when the teacher is known only through its top-M ids and log-probs.

Server-side teachers (verl's vLLM/SGLang teacher workers) return, per token, the teacher's top-M
token ids and their log-probs under the *full* teacher softmax, never the logits. That is enough
for the top-M + tail divergence (paper eq. 9-11): the teacher's bucket masses are the M given
probabilities plus the tail ``1 - sum_i exp(logprob_i)``, computed as ``-expm1(logsumexp)``
(stable when the top-M mass is close to 1).

:func:`topk_tail_kl_from_teacher_topk` runs :func:`lopd_kernels.sparse_teacher_topk_tail_kl`, the
op made for this input (no ``[N, V]`` teacher buffer; C++ on CPU, Triton on GPU): the student's
tail is its mass outside the given ids, so the KL and its student gradient equal the dense
kernel's on the teacher's full logits. What this function adds is verl's row policy below.

Rows are checked, never silently wrong: a top-M mass above ``1 + mass_tolerance``, a duplicate
or out-of-range id, or a tail too heavy for the given ids to be the teacher's top-M makes a row
inconsistent. ``on_invalid="raise"`` raises a ValueError naming the argument; ``"ignore"``
(what the verl plugin uses, since padded positions carry placeholder ids and zero log-probs) gives
such rows zero loss and zero gradient and reports them in ``invalid``.

With ``tensor_parallel_group`` the student logits are this rank's shard of a vocabulary split
over that group the way Megatron-core splits it (equal contiguous shards, rank r holding
``[r V_local, (r + 1) V_local)``: verl's Megatron actor), the teacher's ids are global, and
:func:`lopd_kernels.vocab_parallel.sparse_teacher_topk_tail_kl` runs instead: the same outputs
on every rank, the gradient to this rank's shard.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

import lopd_kernels as lk
from lopd_kernels import vocab_parallel

__all__ = ["TeacherTopKKL", "topk_tail_kl_from_teacher_topk"]

_IGNORE = -100


class TeacherTopKKL(NamedTuple):
    """Per-token outputs of :func:`topk_tail_kl_from_teacher_topk`; leading shape ``[...]``.

    Attributes:
        kl: ``[...]`` float32 top-M + tail divergence (0 at invalid rows), differentiable in the
            student logits.
        student_mass: ``[...]`` float32, no gradient: the student's probability on the teacher's
            top-M ids.
        teacher_mass: ``[...]`` float32: ``sum_i exp(teacher_topk_logprobs_i)``.
        invalid: ``[...]`` bool, rows found inconsistent (only with ``on_invalid="ignore"``).
    """

    kl: Tensor
    student_mass: Tensor
    teacher_mass: Tensor
    invalid: Tensor


def _invalid_rows(lp: Tensor, ids: Tensor, vocab: int, tail_entry: Tensor, tol: float) -> dict:
    """Boolean ``[N]`` masks, one per reason a row cannot be a teacher's top-M."""
    sorted_ids = ids.sort(dim=-1).values
    return {
        "teacher_topk_ids out of [0, V)": ((ids < 0) | (ids >= vocab)).any(-1),
        "teacher_topk_ids has a duplicate id": (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(-1),
        "teacher_topk_logprobs is not finite": ~torch.isfinite(lp).all(-1),
        f"teacher_topk_logprobs sum to a mass above 1 + {tol}": (
            torch.logsumexp(lp, -1) > math.log1p(tol)
        ),
        "the tail mass is too heavy for teacher_topk_ids to be the teacher's top-M": (
            tail_entry >= lp.min(-1).values
        ),
    }


def topk_tail_kl_from_teacher_topk(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    *,
    divergence: str = "reverse",
    tail_floor: float = 1e-6,
    mass_tolerance: float = 1e-3,
    on_invalid: str = "raise",
    backend: str = "auto",
    tensor_parallel_group: dist.ProcessGroup | None = None,
) -> TeacherTopKKL:
    """Top-M + tail KL between full student logits and a teacher given by its top-M only.

    Args:
        student_logits: ``[..., V]`` float logits (already divided by any temperature).
        teacher_topk_logprobs: ``[..., M]`` log-probs of the teacher's top-M ids under its full
            softmax, 1 <= M < V.
        teacher_topk_ids: ``[..., M]`` integer ids of those entries.
        divergence: ``"reverse"`` (KL(student || teacher), the paper's) or ``"forward"``.
        tail_floor: teacher tail masses below it are rounding noise: raised to it for the
            reverse KL (a top-M mass of 1 up to rounding would make it infinite), dropped to 0
            for the forward KL (see :mod:`lopd_kernels.sparse_teacher_topk_tail_kl`).
        mass_tolerance: how far above 1 the top-M mass may be (server rounding) before the row
            counts as inconsistent.
        on_invalid: ``"raise"`` or ``"ignore"`` (see the module docstring).
        backend: passed to :func:`lopd_kernels.sparse_teacher_topk_tail_kl` (``"auto"``,
            ``"torch"``, ``"cpu"``, ``"triton"``).
        tensor_parallel_group: ``student_logits`` is this rank's ``[..., V / world]`` shard of
            Megatron's vocabulary split over this group (module docstring); None: the whole
            vocabulary.

    Returns:
        :class:`TeacherTopKKL`.

    Raises:
        ValueError: bad shapes or options, or (``on_invalid="raise"``) an inconsistent row; the
            message names the argument.
    """
    if on_invalid not in ("raise", "ignore"):
        raise ValueError(f"on_invalid must be 'raise' or 'ignore', got {on_invalid!r}")
    if not 0 < tail_floor < 1:
        raise ValueError(f"tail_floor must be in (0, 1), got {tail_floor!r}")
    if teacher_topk_logprobs.shape != teacher_topk_ids.shape:
        raise ValueError(
            f"teacher_topk_logprobs {tuple(teacher_topk_logprobs.shape)} and teacher_topk_ids "
            f"{tuple(teacher_topk_ids.shape)} must have the same shape"
        )
    if teacher_topk_ids.dtype.is_floating_point or teacher_topk_ids.dtype == torch.bool:
        raise TypeError(f"teacher_topk_ids must be integer, got {teacher_topk_ids.dtype}")
    vocab, m = student_logits.shape[-1], teacher_topk_ids.shape[-1]
    if tensor_parallel_group is not None:
        vocab *= dist.get_world_size(tensor_parallel_group)  # Megatron's equal shards
    if teacher_topk_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"teacher_topk_ids {tuple(teacher_topk_ids.shape)} must match student_logits "
            f"{tuple(student_logits.shape)} in every dimension but the last"
        )
    if not 1 <= m < vocab:
        raise ValueError(f"teacher_topk_ids must hold 1 <= M < V={vocab} ids per row, got {m}")
    lead = student_logits.shape[:-1]
    lp = teacher_topk_logprobs.reshape(-1, m).float()
    ids = teacher_topk_ids.reshape(-1, m).long()
    s = student_logits.reshape(-1, student_logits.shape[-1])

    top_log_mass = torch.logsumexp(lp, -1)  # [N]
    # Tail mass 1 - exp(top_log_mass), stable near 1 (-inf when the top-M holds all the mass),
    # spread over the V - M other ids: if one of them must exceed the smallest given
    # probability, the given ids cannot be the teacher's top-M.
    tail_log_mass = torch.log(-torch.expm1(top_log_mass.clamp(max=0.0)))
    raw_entry = tail_log_mass - math.log(vocab - m)  # [N] the average other id
    reasons = _invalid_rows(lp, ids, vocab, raw_entry, mass_tolerance)
    invalid = torch.stack(list(reasons.values())).any(0)
    if on_invalid == "raise" and bool(invalid.any()):
        found = [name for name, rows in reasons.items() if bool(rows.any())]
        raise ValueError(f"inconsistent teacher top-M at {int(invalid.sum())} row(s): {found}")

    # The target feeds only the sampled-token log-prob, unused here. Invalid rows are ignored
    # rows of the op: zeros, no gradient, their teacher entries never read.
    target = torch.where(invalid, _IGNORE, 0)
    kw = {"divergence": divergence, "ignore_index": _IGNORE, "tail_floor": tail_floor}
    kw.update(mass_tolerance=mass_tolerance, backend=backend)
    if tensor_parallel_group is None:
        out = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, **kw)
    else:
        out = vocab_parallel.sparse_teacher_topk_tail_kl(
            s, lp, ids, target, group=tensor_parallel_group, **kw
        )
    return TeacherTopKKL(
        kl=out.kl.reshape(lead),
        student_mass=out.student_topk_mass.reshape(lead),
        teacher_mass=top_log_mass.exp().reshape(lead),
        invalid=invalid.reshape(lead),
    )
