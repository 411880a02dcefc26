"""Input validation of ``sparse_teacher_topk_tail_kl``, each message naming the bad argument.

The scheme of :mod:`lopd_kernels.topk_tail_kl_checks`: :func:`check_inputs` reads only metadata
(shapes, dtypes, devices, Python scalars); :func:`check_values` reads the targets and the
teacher's ids and log-probs of the rows that count (rows whose target is ``ignore_index`` may hold
anything: servers pad them with placeholders). The C++ kernel repeats the check it needs for
memory safety (ids in ``[0, V)``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lopd_kernels._constants import KL_DIVERGENCES, REFERENCE_DTYPES
from lopd_kernels.topk_tail_kl_checks import check_loss_options, check_rows_have_mass
from lopd_kernels.topk_tail_kl_checks import check_values as check_target_values

__all__ = ["check_inputs", "check_rows_have_mass", "check_values"]


def check_inputs(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    temperature: float,
    divergence: str,
    ignore_index: int,
    tail_floor: float,
    mass_tolerance: float,
) -> None:
    """Validates everything knowable without reading tensor data."""
    tensors = (
        ("student_logits", student_logits),
        ("teacher_topk_logprobs", teacher_topk_logprobs),
        ("teacher_topk_ids", teacher_topk_ids),
        ("target_ids", target_ids),
    )
    for name, x in tensors:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in tensors[:2]:
        if x.dtype not in REFERENCE_DTYPES:
            raise TypeError(
                f"{name} must be a floating tensor (float32, bfloat16, float16 or float64), "
                f"got {x.dtype}"
            )
    if teacher_topk_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_topk_ids must be int64 (or int32), got {teacher_topk_ids.dtype}")
    if target_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target_ids must be int64 (or int32), got {target_ids.dtype}")
    if student_logits.dim() < 1 or student_logits.shape[-1] < 1:
        raise ValueError(
            "student_logits must have shape [..., V] with V >= 1, got "
            f"{tuple(student_logits.shape)}"
        )
    lead = student_logits.shape[:-1]
    for name, x in tensors[1:3]:
        if x.dim() != len(lead) + 1 or x.shape[:-1] != lead or x.shape[-1] < 1:
            raise ValueError(
                f"{name} must have shape [{', '.join(map(str, lead))}{', ' if lead else ''}M] "
                f"with M >= 1 (student_logits is {tuple(student_logits.shape)}), got "
                f"{tuple(x.shape)}"
            )
    if teacher_topk_ids.shape != teacher_topk_logprobs.shape:
        raise ValueError(
            f"teacher_topk_ids {tuple(teacher_topk_ids.shape)} and teacher_topk_logprobs "
            f"{tuple(teacher_topk_logprobs.shape)} must have the same shape"
        )
    if target_ids.shape != lead:
        raise ValueError(
            f"target_ids must have shape {tuple(lead)} (student_logits' shape without the "
            f"vocabulary dim), got {tuple(target_ids.shape)}"
        )
    for name, x in tensors[1:]:
        if x.device != student_logits.device:
            raise ValueError(
                f"{name} is on {x.device} but student_logits is on {student_logits.device}"
            )
    if teacher_topk_logprobs.requires_grad:
        raise ValueError(
            "teacher_topk_logprobs requires grad, but the op treats the teacher's log-probs as "
            "constants (a server's outputs) and returns no gradient for them: pass "
            "teacher_topk_logprobs.detach()"
        )
    check_loss_options(temperature, divergence, ignore_index, divergences=KL_DIVERGENCES)
    if not isinstance(tail_floor, (int, float)) or not 0.0 <= tail_floor < 1.0:
        raise ValueError(f"tail_floor must be a number in [0, 1), got {tail_floor!r}")
    if not isinstance(mass_tolerance, (int, float)) or not 0.0 <= mass_tolerance < 1.0:
        raise ValueError(f"mass_tolerance must be a number in [0, 1), got {mass_tolerance!r}")


def _first_row(bad: Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def check_values(
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    target_ids: Tensor,
    vocab: int,
    ignore_index: int,
    mass_tolerance: float,
) -> None:
    """Raises ValueError naming the argument and the first bad (flattened) row.

    Checked on the rows whose target is not ``ignore_index``: targets in ``[0, V)``; no NaN
    log-prob; no log-prob above ``log1p(mass_tolerance)``; the top-M mass
    ``sum_i exp(logprob_i)`` at most ``1 + mass_tolerance`` (above: the log-probs cannot be the
    teacher's, "inconsistent"); the ids of the real (finite log-prob) slots in ``[0, V)`` and
    distinct. Padding slots (log-prob ``-inf``) may hold any id. One host sync on CUDA.

    Args:
        teacher_topk_logprobs: ``[N, M]`` floating.
        teacher_topk_ids: ``[N, M]`` integer.
        target_ids: ``[N]`` integer.
    """
    check_target_values(target_ids, vocab, ignore_index)
    keep = target_ids != ignore_index
    f64 = teacher_topk_logprobs.dtype == torch.float64
    lp = teacher_topk_logprobs if f64 else teacher_topk_logprobs.float()
    ids = teacher_topk_ids.long()
    real = lp != -math.inf
    log_tol = math.log1p(mass_tolerance)
    nan = torch.isnan(lp).any(-1) & keep
    positive = (lp > log_tol).any(-1) & keep
    total = torch.logsumexp(lp.masked_fill(~real, -math.inf), -1)
    inconsistent = (total > log_tol) & keep
    out_of_range = (real & ((ids < 0) | (ids >= vocab))).any(-1) & keep
    # Duplicates among the real slots: sort with padding slots mapped to distinct negatives.
    m = ids.shape[-1]
    pad_codes = -1 - torch.arange(m, device=ids.device).expand_as(ids)
    sorted_ids = torch.where(real, ids, pad_codes).sort(-1).values
    duplicate = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(-1) & keep
    flags = torch.stack([nan, positive, inconsistent, out_of_range, duplicate])
    if not bool(flags.any()):
        return
    nan, positive, inconsistent, out_of_range, duplicate = flags.cpu()
    if nan.any():
        raise ValueError(f"teacher_topk_logprobs has NaN in row {_first_row(nan)} (flattened)")
    if positive.any():
        r = _first_row(positive)
        raise ValueError(
            f"teacher_topk_logprobs row {r} (flattened) has a log-prob above 0 (+ mass_tolerance "
            f"{mass_tolerance}): max {float(lp[r].max()):.6g}; log-probs must be <= 0"
        )
    if inconsistent.any():
        r = _first_row(inconsistent)
        raise ValueError(
            f"teacher_topk_logprobs row {r} (flattened) is inconsistent: its top-M mass "
            f"sum(exp(logprob)) = {math.exp(float(total[r])):.6g} exceeds 1 + mass_tolerance "
            f"({mass_tolerance}); they must be log-probs under the teacher's full softmax"
        )
    if out_of_range.any():
        r = _first_row(out_of_range)
        bad = ids[r][real[r] & ((ids[r] < 0) | (ids[r] >= vocab))]
        raise ValueError(
            f"teacher_topk_ids row {r} (flattened) holds id {int(bad[0])} outside [0, V={vocab})"
        )
    r = _first_row(duplicate)
    raise ValueError(
        f"teacher_topk_ids row {r} (flattened) has a duplicate id among its real (finite "
        "log-prob) slots"
    )
