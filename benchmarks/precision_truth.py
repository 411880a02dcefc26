"""Float64 truths and error measures of ``benchmarks/precision.py``.

The truths are the textbook formulas differentiated by autograd in float64, written here apart
from the library (``lopd_kernels``'s own reference is one of the things measured):

* full vocabulary: ``log_softmax`` of each side, then the divergence;
* top-M: the teacher's M largest logits (stable descending sort: ties to the lower id, as every
  kernel) each a bucket, plus one tail bucket whose log-mass is the log-sum-exp over the
  complement of the top-M (exact: no ``1 - sum``).

Divergences (TRL's ``beta`` convention): ``reverse`` ``sum P (log P - log Q)`` (P student,
Q teacher), ``forward`` ``sum Q (log Q - log P)``, ``jsd`` ``beta KL(Q || M) + (1 - beta)
KL(P || M)`` with ``M = (1 - beta) P + beta Q``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DIVERGENCES = ("reverse", "forward", "jsd")


def divergence64(lp: Tensor, lq: Tensor, div: str, beta: float | None) -> Tensor:
    """Per-row divergence of log-probability rows ``lp`` (student), ``lq`` (teacher) ``[R, K]``."""
    p, q = lp.exp(), lq.exp()
    if div == "reverse":
        return (p * (lp - lq)).sum(-1)
    if div == "forward":
        return (q * (lq - lp)).sum(-1)
    lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
    return beta * (q * (lq - lm)).sum(-1) + (1 - beta) * (p * (lp - lm)).sum(-1)


def bucket_logp(x: Tensor, ids: Tensor) -> Tensor:
    """``[R, M + 1]`` log-masses of the buckets ``ids`` (``[R, M]``) and the exact tail."""
    lse = torch.logsumexp(x, -1, keepdim=True)
    in_top = torch.zeros_like(x, dtype=torch.bool).scatter(1, ids, True)
    tail = torch.logsumexp(x.masked_fill(in_top, -math.inf), -1, keepdim=True)
    return torch.cat([x.gather(1, ids), tail], 1) - lse


def teacher_top(t: Tensor, m: int) -> Tensor:
    """The teacher's top-``m`` ids by a stable descending sort (ties: the lower id first)."""
    return torch.sort(t, dim=-1, descending=True, stable=True).indices[:, :m]


def truth_dense(
    s: Tensor, t: Tensor, div: str, beta: float | None, top_m: int | None, rows: int = 32
) -> tuple[Tensor, Tensor, Tensor]:
    """Float64 per-row divergence ``[N]`` and gradients of its sum w.r.t. ``s``, ``t``
    (``[N, V]`` float64), from the values of ``s``, ``t`` (any dtype), ``rows`` rows at a time."""
    n = s.shape[0]
    out = torch.empty(n, dtype=torch.float64)
    gs = torch.empty(s.shape, dtype=torch.float64)
    gt = torch.empty(t.shape, dtype=torch.float64)
    with torch.enable_grad():
        for r in range(0, n, rows):
            sc = s[r : r + rows].detach().double().requires_grad_(True)
            tc = t[r : r + rows].detach().double().requires_grad_(True)
            if top_m:
                ids = teacher_top(tc.detach(), top_m)
                lp, lq = bucket_logp(sc, ids), bucket_logp(tc, ids)
            else:
                lp, lq = torch.log_softmax(sc, -1), torch.log_softmax(tc, -1)
            loss = divergence64(lp, lq, div, beta)
            loss.sum().backward()
            out[r : r + rows] = loss.detach()
            gs[r : r + rows] = sc.grad
            gt[r : r + rows] = tc.grad
    return out, gs, gt


def sq_err(got: Tensor, ref: Tensor, rows: int = 64) -> tuple[float, float]:
    """``(||got - ref||^2, ||ref||^2)`` in float64, ``rows`` rows at a time."""
    num = den = 0.0
    for r in range(0, ref.shape[0], rows):
        g, f = got[r : r + rows].double(), ref[r : r + rows]
        num += float((g - f).square().sum())
        den += float(f.square().sum())
    return num, den


def rel_err(got: Tensor, ref: Tensor) -> float:
    """``||got - ref||_F / ||ref||_F`` over the whole tensor, in float64."""
    num, den = sq_err(got, ref)
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def worst_row_err(got: Tensor, ref: Tensor, rows: int = 64) -> float:
    """``max_r ||got_r - ref_r|| / ||ref_r||`` over rows (rows of zero truth skipped)."""
    worst = 0.0
    for r in range(0, ref.shape[0], rows):
        g, f = got[r : r + rows].double(), ref[r : r + rows]
        den = f.norm(dim=-1)
        ok = den > 0
        if ok.any():
            worst = max(worst, float(((g - f).norm(dim=-1)[ok] / den[ok]).max()))
    return worst


def loss_errors(loss: Tensor, rows64: Tensor) -> dict[str, float | None]:
    """``loss_rel_err`` of the summed loss and, for per-row ``loss`` (``[N]``), the largest
    per-row relative error ``loss_worst_row_rel_err`` (None for a 0-d summed loss)."""
    total = float(rows64.sum())
    if loss.dim() == 0:
        return {
            "loss_rel_err": abs(float(loss.double()) - total) / abs(total),
            "loss_worst_row_rel_err": None,
        }
    got = loss.double()
    worst = float(((got - rows64).abs() / rows64.abs().clamp_min(1e-300)).max())
    return {
        "loss_rel_err": abs(float(got.sum()) - total) / abs(total),
        "loss_worst_row_rel_err": worst,
    }


def logits64(h: torch.Tensor, w: torch.Tensor, slab: int = 16384) -> torch.Tensor:
    """``h @ w^T`` in float64, one vocabulary slab of ``w`` upcast at a time."""
    h64 = h.double()
    return torch.cat([h64 @ w[i : i + slab].double().T for i in range(0, w.shape[0], slab)], 1)


def matmul64(g: torch.Tensor, w: torch.Tensor, slab: int = 16384) -> torch.Tensor:
    """``g @ w`` for float64 ``g [N, V]`` and ``w [V, d]``, one slab of ``w`` upcast at a time."""
    out = torch.zeros(g.shape[0], w.shape[1], dtype=torch.float64)
    for i in range(0, w.shape[0], slab):
        out += g[:, i : i + slab] @ w[i : i + slab].double()
    return out


def dw_err(dw, gs64, h64, floor=False, slab=16384) -> float | None:
    """``||dW - dW64|| / ||dW64||`` with ``dW64 = gs64^T h64`` formed one vocabulary slab at a
    time (``[V, d]`` float64 never whole); ``floor``: dW64 rounded to bf16 instead of ``dw``."""
    if dw is None and not floor:
        return None
    num = den = 0.0
    for i in range(0, gs64.shape[1], slab):
        ref = gs64[:, i : i + slab].T @ h64
        got = ref.bfloat16() if floor else dw[i : i + slab]
        e, r = sq_err(got, ref)
        num, den = num + e, den + r
    return math.sqrt(num / den)
