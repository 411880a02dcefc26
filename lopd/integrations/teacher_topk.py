"""Top-M + tail KL when the teacher is known only through its top-M ids and log-probs.

Server-side teachers (verl's vLLM/SGLang teacher workers) return, per token, the teacher's top-M
token ids and their log-probs under the *full* teacher softmax, never the logits. That is enough
for the top-M + tail divergence (paper eq. 9-11): the teacher's bucket masses are the M given
probabilities plus the tail ``1 - sum_i exp(logprob_i)``, computed as ``-expm1(logsumexp)``
(stable when the top-M mass is close to 1).

:func:`topk_tail_kl_from_teacher_topk` runs the dense kernel :func:`lopd_kernels.topk_tail_kl`
on a teacher rebuilt from those numbers: the M given log-probs at their ids, the tail mass spread
evenly over the other ``V - M`` ids. Every bucket mass is then exactly the server's, so the KL,
its gradient to the student and the tail are exact; the kernel's own top-M selection recovers
the given ids because each spread tail entry is below the smallest given probability (true of any
genuine top-M; rows where it is not are inconsistent). The cost is one ``[N, V]`` float32 teacher
buffer next to the student logits the caller already holds (a dedicated sparse-teacher op, which
avoids it, is issue 19 item 2).

Rows are checked, never silently wrong: a top-M mass above ``1 + mass_tolerance``, a duplicate
or out-of-range id, or a tail too heavy for the given ids to be the teacher's top-M makes a row
inconsistent. ``on_invalid="raise"`` raises a ValueError naming the argument; ``"ignore"``
(what the verl plugin uses, since padded positions carry placeholder ids and zero log-probs) gives
such rows zero loss and zero gradient and reports them in ``invalid``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

import lopd_kernels as lk

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
) -> TeacherTopKKL:
    """Top-M + tail KL between full student logits and a teacher given by its top-M only.

    Args:
        student_logits: ``[..., V]`` float logits (already divided by any temperature).
        teacher_topk_logprobs: ``[..., M]`` log-probs of the teacher's top-M ids under its full
            softmax, 1 <= M < V.
        teacher_topk_ids: ``[..., M]`` integer ids of those entries.
        divergence: ``"reverse"`` (KL(student || teacher), the paper's) or ``"forward"``.
        tail_floor: smallest teacher tail mass used (a top-M mass of 1 up to rounding leaves a
            zero tail, which makes the reverse KL infinite); lowered per row to at most half
            the smallest given probability per tail entry, so the given ids stay the top-M.
        mass_tolerance: how far above 1 the top-M mass may be (server rounding) before the row
            counts as inconsistent.
        on_invalid: ``"raise"`` or ``"ignore"`` (see the module docstring).
        backend: passed to :func:`lopd_kernels.topk_tail_kl`.

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
    s = student_logits.reshape(-1, vocab)

    top_log_mass = torch.logsumexp(lp, -1)  # [N]
    # Tail mass 1 - exp(top_log_mass), stable near 1 (-inf when the top-M holds all the mass).
    tail_log_mass = torch.log(-torch.expm1(top_log_mass.clamp(max=0.0)))
    log_spread = math.log(vocab - m)
    raw_entry = tail_log_mass - log_spread  # [N] each of the V - M spread entries
    reasons = _invalid_rows(lp, ids, vocab, raw_entry, mass_tolerance)
    # Floor the tail so the bucket stays > 0 (a finite reverse KL), but never so high that a
    # spread entry reaches the smallest given probability (the kernel's top-M must stay the
    # given ids): a sharp teacher's top-M may hold entries far below the floor.
    floor_entry = torch.minimum(
        torch.full_like(raw_entry, math.log(tail_floor) - log_spread),
        lp.min(-1).values - math.log(2.0),
    )
    tail_entry = torch.maximum(raw_entry, floor_entry)
    invalid = torch.stack(list(reasons.values())).any(0)
    if on_invalid == "raise" and bool(invalid.any()):
        found = [name for name, rows in reasons.items() if bool(rows.any())]
        raise ValueError(f"inconsistent teacher top-M at {int(invalid.sum())} row(s): {found}")

    safe_ids = torch.where(invalid.unsqueeze(1), torch.arange(m, device=ids.device), ids)
    safe_lp = torch.where(invalid.unsqueeze(1), torch.zeros_like(lp), lp)
    safe_entry = torch.where(invalid, torch.full_like(tail_entry, -30.0), tail_entry)
    with torch.no_grad():
        teacher = safe_entry.unsqueeze(1).expand(-1, vocab).clone()
        teacher.scatter_(1, safe_ids, safe_lp)
    # The target feeds only the sampled-token log-probs, unused here; invalid rows are ignored.
    target = torch.where(invalid, torch.full_like(ids[:, 0], _IGNORE), safe_ids[:, 0])
    out = lk.topk_tail_kl(
        s, teacher, target, top_m=m, divergence=divergence, ignore_index=_IGNORE, backend=backend
    )
    with torch.no_grad():
        s32 = s.detach().float()
        student_mass = (s32.gather(1, safe_ids).logsumexp(-1) - s32.logsumexp(-1)).exp()
    return TeacherTopKKL(
        kl=out.kl.reshape(lead),
        student_mass=student_mass.masked_fill(invalid, 0.0).reshape(lead),
        teacher_mass=top_log_mass.exp().reshape(lead),
        invalid=invalid.reshape(lead),
    )
