"""The top-M + tail bucket maths in PyTorch: one definition for every op of the family.

A leaf module (it imports only torch). The references of ``topk_tail_kl`` and
``sparse_teacher_topk_tail_kl`` take their bucket divergence from here (:func:`bucket_divergence`,
:func:`masked_logsumexp`: differentiable, NaN-free at empty and zero-mass buckets); the chunked
fused-linear path, the Triton fused-linear launcher and the PyTorch twins of the per-row kernels
take their closed-form bucket coefficients (no autograd). The derivation is ``docs/math.md``
("Gradients"); per row, with ``g_b = log P_b - log Q_b`` and ``b(j)`` the bucket of vocabulary
entry ``j`` (itself if in the top-M, else the tail)::

    reverse KL:  dKL/ds_j = S_j (g_b(j) - KL)          dKL/dt_j = T_j (1 - P_b(j) / Q_b(j))
    forward KL:  dF/ds_j  = S_j (1 - Q_b(j) / P_b(j))   dF/dt_j  = T_j (-g_b(j) - F)

so a row's logit gradients need one coefficient per bucket (M + 1 numbers) and one pass over the
logits: :func:`bucket_coefs`.

:func:`rows_fwd_torch` / :func:`rows_bwd_torch` compute exactly what the compiled
``topk_tail_kl_<impl>_fwd/_bwd`` ops compute, from the same inputs: the chunked path's epilogue
where no compiled kernel exists (a pure-Python install). The differentiable oracle is
:func:`lopd_kernels.topk_tail_kl_reference`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "bucket_coefs",
    "bucket_divergence",
    "effective_top_m",
    "masked_logsumexp",
    "rows_bwd_torch",
    "rows_fwd_torch",
]


def effective_top_m(top_m: int, vocab: int) -> int:
    """Number of top buckets M; 0 (the full-vocabulary KL) for ``top_m`` 0 or ``>= V``."""
    return 0 if top_m == 0 or top_m >= vocab else top_m


def masked_logsumexp(x: Tensor, keep: Tensor) -> Tensor:
    """Row log-sum-exp over ``x[keep]``; ``-inf`` (with zero, not NaN, gradient) if empty."""
    x = x.masked_fill(~keep, -math.inf)
    empty = (x == -math.inf).all(dim=-1, keepdim=True)
    # logsumexp over an all -inf row has gradient exp(-inf - (-inf)) = NaN: feed it zeros there.
    out = torch.logsumexp(x.masked_fill(empty, 0.0), dim=-1)
    return out.masked_fill(empty.squeeze(-1), -math.inf)


def bucket_divergence(logp: Tensor, logq: Tensor, reverse: bool) -> Tensor:
    """``sum_b W_b (log W_b - log O_b)`` over the last dim; zero-mass buckets add exactly 0, and
    a bucket with mass against a zero-mass one adds +inf (also when ``exp`` of its log-mass
    underflows, where ``0 * inf`` would be NaN)."""
    w, o = (logp, logq) if reverse else (logq, logp)
    zero = w == -math.inf
    # Mass too small for exp against none: +inf (the expression below would give 0 * inf).
    # Elsewhere mass against none gives exp(w) * inf = inf by the expression itself, whose
    # gradient to o (-exp(w)) stays finite and is kept.
    underflow = ~zero & (o == -math.inf) & (w.exp() == 0)
    # Double masking: the unused branch of a where still backpropagates 0 * its local gradient,
    # so the masked entries must be finite inside the expression too.
    w_safe = w.masked_fill(zero, 0.0)
    o_safe = o.masked_fill(zero | underflow, 0.0)
    terms = torch.where(zero, 0.0, w_safe.exp() * (w_safe - o_safe))
    return terms.masked_fill(underflow, math.inf).sum(dim=-1)


def bucket_coefs(
    u_kl: Tensor, kl: Tensor, bucket_logp: Tensor, reverse: bool, u_ls: Tensor, u_t: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-bucket backward coefficients of the top-M + tail KL.

    Args:
        u_kl, u_ls, u_t: ``[R]`` upstream gradients of the KL, the student log-prob and the
            teacher log-prob (privilege included).
        kl: ``[R]`` the forward KL.
        bucket_logp: ``[R, 2, B]`` (log P_b, log Q_b): the M + 1 buckets (index M: the tail),
            or every vocabulary entry (``B = V``) for the full-vocabulary KL.

    Returns:
        ``c_s, c_t [R, B]`` such that ``d/ds_j = (S_j c_s[b(j)] + u_ls 1[j = a]) / T`` and
        ``d/dt_j = (T_j c_t[b(j)] + u_t 1[j = a]) / T``. A bucket with zero (or infinite-ratio)
        mass gets 0 from the KL term.
    """
    logp, logq = bucket_logp[:, 0], bucket_logp[:, 1]
    g = logp - logq
    fin = torch.isfinite(g)
    zero = torch.zeros_like(g)
    u, klc = u_kl.unsqueeze(-1), kl.unsqueeze(-1)
    if reverse:
        c_s = u * torch.where(fin, g - klc, zero) - u_ls.unsqueeze(-1)
        c_t = u * torch.where(fin, 1 - g.exp(), zero) - u_t.unsqueeze(-1)
    else:
        c_s = u * torch.where(fin, 1 - (-g).exp(), zero) - u_ls.unsqueeze(-1)
        c_t = u * torch.where(fin, -g - klc, zero) - u_t.unsqueeze(-1)
    return c_s.contiguous(), c_t.contiguous()


def _xlogx_ratio(logp: Tensor, logq: Tensor) -> Tensor:
    """``exp(logp) * (logp - logq)`` with the convention ``0 * anything = 0`` (never NaN); mass
    against ``logq = -inf`` is ``+inf``, also when ``exp(logp)`` underflows."""
    p = logp.exp()
    terms = p * torch.where(p > 0, logp - logq, torch.zeros_like(p))
    return terms.masked_fill((logp != -math.inf) & (logq == -math.inf), math.inf)


def _rows_math(
    s: Tensor, t: Tensor, target: Tensor, top_m: int, temperature: float, reverse: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Top-M + tail KL of every row of a logit block whose rows all have a real target.

    Args:
        s, t: ``[R, V]`` logits (float32 or float64).
        target: ``[R]`` int64 target ids in ``[0, V)``.

    Returns:
        ``kl [R]``, ``student_logprob [R]``, ``teacher_logprob [R]``, ``topk_ids [R, M]``,
        ``lse [R, 2]`` and ``bucket_logp [R, 2, M+1]`` (log P_b, log Q_b; index M is the tail).
    """
    s = s / temperature
    t = t / temperature
    lse_s = torch.logsumexp(s, dim=-1)
    lse_t = torch.logsumexp(t, dim=-1)
    tgt = target.unsqueeze(-1)
    lp_s = s.gather(-1, tgt).squeeze(-1) - lse_s
    lp_t = t.gather(-1, tgt).squeeze(-1) - lse_t
    m = effective_top_m(top_m, s.shape[-1])
    if m == 0:
        logp = s - lse_s.unsqueeze(-1)
        logq = t - lse_t.unsqueeze(-1)
        ids = torch.empty(s.shape[0], 0, dtype=torch.long, device=s.device)
        bucket = torch.zeros(s.shape[0], 2, 1, dtype=s.dtype, device=s.device)
        kl_terms = _xlogx_ratio(logp, logq) if reverse else _xlogx_ratio(logq, logp)
        return kl_terms.sum(-1), lp_s, lp_t, ids, torch.stack([lse_s, lse_t], -1), bucket
    # Stable descending sort: ties go to the lower vocabulary id, the rule of every kernel.
    ids = torch.sort(t, dim=-1, descending=True, stable=True).indices[:, :m]
    in_top = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, ids, True)
    # The tail is the log-sum-exp over the complement of the top-M, accumulated directly (never
    # 1 - sum of the top-M masses, which cancels to garbage when the top-M holds nearly all).
    tail_s = torch.logsumexp(s.masked_fill(in_top, -math.inf), dim=-1, keepdim=True)
    tail_t = torch.logsumexp(t.masked_fill(in_top, -math.inf), dim=-1, keepdim=True)
    logp = torch.cat([s.gather(-1, ids), tail_s], -1) - lse_s.unsqueeze(-1)
    logq = torch.cat([t.gather(-1, ids), tail_t], -1) - lse_t.unsqueeze(-1)
    kl_terms = _xlogx_ratio(logp, logq) if reverse else _xlogx_ratio(logq, logp)
    bucket = torch.stack([logp, logq], dim=1)
    return kl_terms.sum(-1), lp_s, lp_t, ids, torch.stack([lse_s, lse_t], -1), bucket


def rows_fwd_torch(
    s: Tensor,
    t: Tensor,
    target: Tensor,
    top_m: int,
    temperature: float,
    reverse: bool,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch twin of ``torch.ops.lopd.topk_tail_kl_cpu_fwd`` (same outputs; ignored rows 0)."""
    n, vocab = s.shape
    m = effective_top_m(top_m, vocab)
    kl = s.new_zeros(n, dtype=torch.float32)
    lp_s, lp_t = torch.zeros_like(kl), torch.zeros_like(kl)
    ids = torch.zeros(n, m, dtype=torch.long, device=s.device)
    lse = kl.new_zeros(n, 2)
    bucket = kl.new_zeros(n, 2, m + 1)
    rows = (target != ignore_index).nonzero().squeeze(-1)
    if rows.numel():
        out = _rows_math(
            s.index_select(0, rows).float(),
            t.index_select(0, rows).float(),
            target.index_select(0, rows),
            top_m,
            temperature,
            reverse,
        )
        for dst, src in zip((kl, lp_s, lp_t, ids, lse, bucket), out):
            dst.index_copy_(0, rows, src)
    return kl, lp_s, lp_t, ids, lse, bucket


def rows_bwd_torch(
    grad_kl: Tensor,
    grad_slp: Tensor,
    grad_tlp: Tensor,
    s: Tensor,
    t: Tensor,
    target: Tensor,
    topk_ids: Tensor,
    kl: Tensor,
    lse: Tensor,
    bucket_logp: Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    student_requires_grad: bool,
    teacher_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of ``torch.ops.lopd.topk_tail_kl_cpu_bwd``: the closed-form logit gradients
    of :func:`bucket_coefs`, spread over the vocabulary (tail coefficient everywhere, then the
    top-M ids'); with the full vocabulary every entry is its own bucket."""
    valid = (target != ignore_index).unsqueeze(-1)
    tgt = target.clamp(0, s.shape[-1] - 1).unsqueeze(-1)

    def upstream(g: Tensor) -> Tensor:
        return torch.where(valid.squeeze(-1), g.float(), 0.0)

    u_kl, u_ls, u_lt = upstream(grad_kl), upstream(grad_slp), upstream(grad_tlp)
    log_s = s.float() / temperature - lse[:, :1]
    log_t = t.float() / temperature - lse[:, 1:]
    m = topk_ids.shape[-1]
    if m == 0:
        c_s, c_t = bucket_coefs(u_kl, kl, torch.stack([log_s, log_t], 1), reverse, u_ls, u_lt)
    else:
        c_s, c_t = bucket_coefs(u_kl, kl, bucket_logp, reverse, u_ls, u_lt)

        def spread(coef: Tensor) -> Tensor:
            return coef[:, m:].expand_as(log_s).clone().scatter_(-1, topk_ids, coef[:, :m])

        c_s, c_t = spread(c_s), spread(c_t)

    def side(x: Tensor, logprob: Tensor, coef: Tensor, u: Tensor) -> Tensor:
        grad = torch.where(valid, logprob.exp(), 0.0) * coef
        grad.scatter_add_(-1, tgt, u.unsqueeze(-1))
        return torch.where(valid, grad / temperature, 0.0).to(x.dtype)

    empty = s.new_empty(0)
    grad_s = side(s, log_s, c_s, u_ls) if student_requires_grad else empty
    grad_t = side(t, log_t, c_t, u_lt) if teacher_requires_grad else empty
    return grad_s, grad_t
