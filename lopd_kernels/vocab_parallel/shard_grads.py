"""One rank's logit gradients from the global statistics, through the single-process kernels.

Every logit gradient of the top-M + tail family is ``(S_j c[b(j)] + u 1[j = a]) / T`` with one
coefficient per bucket (docs/math.md, section 2), and the backward kernels take what they
normalize with as inputs: the row's ``lse``, ``kl`` and ``bucket_logp``. Fed the *global* ones,
with ``topk_ids`` mapped to this shard's local ids (-1 for the support ids other shards hold,
which the kernels skip; their bucket log-masses stay in ``bucket_logp``, where the JSD's
``KL(P || M)`` and ``KL(Q || M)`` sum over every bucket), they write exactly this shard's slice of
the global gradient, in one streaming pass, for every divergence and support.

One entry needs care: the kernels add the target's ``u / T`` at their target id, and a row whose
target another shard holds has none here. Such rows run with local target 0 and that one entry is
then overwritten with its true value, ``S_0 c[b(0)] / T`` (:func:`_correct_foreign_targets`):
``[N]`` values, an overwrite, not a subtraction (which would cancel).

The PyTorch twins (:func:`topk_shard_grads_torch`, :func:`sparse_shard_grads_torch`) compute the
same from the formulas, in the inputs' precision: for float64 and ``backend="torch"``, for shards
the kernels cannot take (``M >= V_local``) and for the full-vocabulary JSD, whose per-entry
coefficient needs the global ``KL(P || M)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels.bucket_math import bucket_coefs, mixture_logmass
from lopd_kernels.op_outputs import TopKTailKLOpGrads
from lopd_kernels.sparse_teacher_topk_tail_kl import CUSTOM_OPS as SPARSE_OPS
from lopd_kernels.topk_tail_kl import CUSTOM_OPS as TOPK_OPS
from lopd_kernels.vocab_parallel.shard_stats import compute_dtype

__all__ = [
    "LogitGrads",
    "Sides",
    "Upstream",
    "sparse_shard_grads",
    "sparse_shard_grads_torch",
    "topk_shard_grads",
    "topk_shard_grads_torch",
]


class Upstream(NamedTuple):
    """``[N]`` upstream gradients of a row's outputs."""

    kl: Tensor
    student_logprob: Tensor
    teacher_logprob: Tensor  # the privilege's included (a sparse teacher's: zeros)


class Sides(NamedTuple):
    """Which logits need a gradient."""

    student: bool
    teacher: bool


class LogitGrads(NamedTuple):
    """A shard's logit gradients, in the logits' dtypes and shapes; None where not needed."""

    student_logits: Tensor | None
    teacher_logits: Tensor | None


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _entry_bucket(local_ids: Tensor, width: int) -> Tensor:
    """``[R]`` the bucket of local id 0 in each row: its slot in ``local_ids [R, K]`` (-1
    slots are other shards' ids), else the tail (``K``)."""
    hit = local_ids == 0
    return torch.where(hit.any(1), hit.to(torch.uint8).argmax(1), width)


def _correct_foreign_targets(
    grads: list[Tensor | None],
    logits: list[Tensor],
    lse_rows: list[Tensor],
    coefs: list[Tensor],
    rows: Tensor,
    slot: Tensor,
    temperature: float,
) -> None:
    """Overwrites entry 0 of ``rows`` (whose target another shard holds) of each side's
    gradient with ``exp(x_0 / T - lse) * c[slot] / T``; per side ``lse_rows [R]`` and
    ``coefs [R, B]`` are the rows' log-sum-exp and bucket coefficients."""
    for grad, x, lse, coef in zip(grads, logits, lse_rows, coefs):
        if grad is None or not grad.numel():
            continue
        g = _flat(grad)
        x0 = _flat(x)[rows, 0].double() / temperature
        value = (x0 - lse.double()).exp() * coef.gather(1, slot[:, None])[:, 0]
        g[rows, 0] = (value / temperature).to(g.dtype)


def topk_shard_grads(
    impl: str,
    upstream: Upstream,
    s: Tensor,
    t: Tensor,
    target: Tensor,
    ignore_index: int,
    foreign: Tensor,
    local_ids: Tensor,
    stats: tuple[Tensor, Tensor, Tensor],
    temperature: float,
    divergence: str,
    beta: float,
    needs: Sides,
) -> LogitGrads:
    """This shard's logit gradients.

    Args:
        impl: the implementation whose backward kernel runs (not ``"torch"``).
        upstream: float32.
        s, t: the shard's logits as the forward kernel read them; target: ``[N]`` local targets
            (0 at ``foreign`` rows); ignore_index: the local ignore marker.
        foreign: ``[N]`` bool, the rows whose target another shard holds.
        local_ids: ``[N, K]`` int64 the global support as local ids, -1 outside the shard.
        stats: the global ``(kl [N], lse [N, 2], bucket_logp [N, 2, K + 1])``, float32.
    """
    kl, lse, bucket = stats
    _, bwd = TOPK_OPS.ops(impl)
    out = TopKTailKLOpGrads(*bwd(
        *upstream, s, t, target, local_ids, kl, lse, bucket, float(temperature), divergence,
        beta, int(ignore_index), needs.student, needs.teacher,
    ))  # fmt: skip
    grads = [
        out.student_logits if needs.student else None,
        out.teacher_logits if needs.teacher else None,
    ]
    rows = foreign.nonzero().squeeze(1)
    if rows.numel():
        k = local_ids.shape[1]
        u_kl_r, u_ls_r, u_lt_r = Upstream(*(u.index_select(0, rows).double() for u in upstream))
        if k == 0:  # the full vocabulary: entry 0 is its own bucket
            x0 = torch.stack([_flat(x)[rows, 0].double() for x in (s, t)], 1) / temperature
            buckets = (x0 - lse[rows].double()).unsqueeze(2)
            slot = torch.zeros_like(rows)
        else:
            buckets = bucket[rows].double()
            slot = _entry_bucket(local_ids[rows], k)
        coefs = bucket_coefs(u_kl_r, kl[rows].double(), buckets, divergence, beta, u_ls_r, u_lt_r)
        lse_rows = [lse[rows, 0], lse[rows, 1]]
        _correct_foreign_targets(grads, [s, t], lse_rows, list(coefs), rows, slot, temperature)
    return LogitGrads(*grads)


def _spread(coef: Tensor, local_ids: Tensor, vocab: int) -> Tensor:
    """``[N, V_local]`` per-entry coefficients: the tail's everywhere, then each local support
    id's own (``coef [N, K + 1]``; -1 slots are skipped)."""
    k = local_ids.shape[1]
    slots = local_ids.masked_fill(local_ids < 0, vocab)
    wide = coef[:, k:].expand(-1, vocab + 1).clone()
    return wide.scatter_(1, slots, coef[:, :k])[:, :vocab]


def _finish(
    x: Tensor, log_x: Tensor, coef: Tensor, u: Tensor, target: Tensor, owned: Tensor, t: float
) -> Tensor:
    """``(S_j coef_j + u 1[j = a]) / T`` in ``x``'s dtype and shape, 0 at rows with no target."""
    grad = log_x.exp() * coef
    a = target.clamp(0, grad.shape[1] - 1).unsqueeze(1)
    grad.scatter_add_(1, a, torch.where(owned, u, 0.0).unsqueeze(1).to(grad.dtype))
    return (grad / t).to(x.dtype).reshape(x.shape)


def topk_shard_grads_torch(
    upstream: Upstream,
    s: Tensor,
    t: Tensor,
    target: Tensor,
    owned: Tensor,
    valid: Tensor,
    local_ids: Tensor,
    stats: tuple[Tensor, Tensor, Tensor],
    temperature: float,
    divergence: str,
    beta: float,
    needs: Sides,
    jsd_kls: Tensor | None = None,
) -> LogitGrads:
    """The twin of :func:`topk_shard_grads`, from the formulas (float64 for float64 inputs).

    ``owned``: rows whose target is in this shard (``target`` its local id); ``valid``: rows
    with a target. ``jsd_kls``: ``[N, 2]`` the global ``KL(P || M)``, ``KL(Q || M)`` of the
    full-vocabulary JSD (``K = 0``).
    """
    kl, lse, bucket = stats
    dt = compute_dtype(s, t)
    keep = valid.unsqueeze(1)
    up = Upstream(*(torch.where(valid, u.to(dt), 0.0) for u in upstream))
    log_s = _flat(s).to(dt) / temperature - lse[:, :1].to(dt)
    log_t = _flat(t).to(dt) / temperature - lse[:, 1:].to(dt)
    log_s, log_t = (torch.where(keep, x, -math.inf) for x in (log_s, log_t))
    vocab = log_s.shape[1]
    if local_ids.shape[1] == 0 and divergence == "jsd":
        lm = mixture_logmass(log_s, log_t, beta)
        kp, kq = (jsd_kls[:, i : i + 1].to(dt) for i in (0, 1))
        u_kl = up.kl.unsqueeze(1)
        c_s = u_kl * (1 - beta) * (log_s - lm - kp) - up.student_logprob.unsqueeze(1)
        c_t = u_kl * beta * (log_t - lm - kq) - up.teacher_logprob.unsqueeze(1)
        c_s = torch.where(log_s == -math.inf, 0.0, c_s)
        c_t = torch.where(log_t == -math.inf, 0.0, c_t)
    else:
        full = local_ids.shape[1] == 0  # every entry its own bucket (the KLs need no sum)
        buckets = torch.stack([log_s, log_t], 1) if full else bucket.to(dt)
        c_s, c_t = bucket_coefs(up.kl, kl.to(dt), buckets, divergence, beta,
                                up.student_logprob, up.teacher_logprob)  # fmt: skip
        if not full:
            c_s, c_t = _spread(c_s, local_ids, vocab), _spread(c_t, local_ids, vocab)
    u_s, u_t = up.student_logprob, up.teacher_logprob
    return LogitGrads(
        _finish(s, log_s, c_s, u_s, target, owned, temperature) if needs.student else None,
        _finish(t, log_t, c_t, u_t, target, owned, temperature) if needs.teacher else None,
    )


def sparse_shard_grads(
    impl: str,
    upstream: Upstream,
    s: Tensor,
    target: Tensor,
    ignore_index: int,
    foreign: Tensor,
    local_ids: Tensor,
    owned: Tensor,
    stats: tuple[Tensor, Tensor, Tensor],
    temperature: float,
    reverse: bool,
) -> Tensor:
    """This shard's student gradient against a sparse teacher, by its backward kernel.

    ``local_ids``: ``[N, M]`` the teacher ids as local ids (0 where not ``owned``); ``stats``:
    the global ``(kl [N], lse [N], bucket_logp [N, 2, M + 1])`` float32. The slots other shards
    hold become padding here (``-inf`` on both sides: the kernels skip them).
    """
    kl, lse, bucket = stats
    local_bucket = bucket.clone()
    local_bucket[:, :, :-1] = bucket[:, :, :-1].masked_fill(~owned.unsqueeze(1), -math.inf)
    _, bwd = SPARSE_OPS.ops(impl)
    grad = bwd(
        upstream.kl, upstream.student_logprob, s, local_ids, target, kl, lse, local_bucket,
        float(temperature), reverse, int(ignore_index),
    )  # fmt: skip
    rows = foreign.nonzero().squeeze(1)
    if rows.numel():
        div = "reverse" if reverse else "forward"
        up = Upstream(*(u.index_select(0, rows).double() for u in upstream))
        bucket_r = bucket[rows].double()
        c_s, _ = bucket_coefs(up.kl, kl[rows].double(), bucket_r, div, 1.0,
                              up.student_logprob, up.teacher_logprob)  # fmt: skip
        slot = _entry_bucket(local_ids[rows].masked_fill(~owned[rows], -1), local_ids.shape[1])
        _correct_foreign_targets([grad], [s], [lse[rows]], [c_s], rows, slot, temperature)
    return grad


def sparse_shard_grads_torch(
    upstream: Upstream,
    s: Tensor,
    target: Tensor,
    owned_target: Tensor,
    valid: Tensor,
    local_ids: Tensor,
    owned: Tensor,
    stats: tuple[Tensor, Tensor, Tensor],
    temperature: float,
    reverse: bool,
) -> Tensor:
    """The twin of :func:`sparse_shard_grads` (float64 for float64 inputs)."""
    kl, lse, bucket = stats
    dt = compute_dtype(s)
    up = Upstream(*(torch.where(valid, u.to(dt), 0.0) for u in upstream))
    div = "reverse" if reverse else "forward"
    c_s, _ = bucket_coefs(up.kl, kl.to(dt), bucket.to(dt), div, 1.0, up.student_logprob,
                          up.teacher_logprob)  # fmt: skip
    ids = local_ids.masked_fill(~owned, -1)
    log_s = s.to(dt) / temperature - lse.to(dt).unsqueeze(1)
    log_s = torch.where(valid.unsqueeze(1), log_s, -math.inf)
    coef = _spread(c_s, ids, s.shape[1])
    return _finish(s, log_s, coef, up.student_logprob, target, owned_target, temperature)
