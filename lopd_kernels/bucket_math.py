"""The top-M + tail bucket maths in PyTorch: one definition for every op of the family.

A leaf module (it imports only torch). The references of ``topk_tail_kl`` and
``sparse_teacher_topk_tail_kl`` take their bucket divergence from here (:func:`bucket_divergence`,
:func:`masked_logsumexp`: differentiable, NaN-free at empty and zero-mass buckets) and the
reference's choice of bucket ids (:func:`select_support`); the chunked fused-linear path, the
Triton fused-linear launcher and the PyTorch twins of the per-row kernels take their closed-form
bucket coefficients (no autograd). The derivation is ``docs/math.md`` (sections 1, 1b, 2); per
row, with ``g_b = log P_b - log Q_b``, ``b(j)`` the bucket of vocabulary entry ``j`` (itself if it
is in the support, else the tail), and for the JSD the mixture ``M_b = (1 - beta) P_b + beta Q_b``
with ``K_P = KL(P || M)``, ``K_Q = KL(Q || M)``::

    reverse KL:  dKL/ds_j = S_j (g_b(j) - KL)          dKL/dt_j = T_j (1 - P_b(j) / Q_b(j))
    forward KL:  dF/ds_j  = S_j (1 - Q_b(j) / P_b(j))   dF/dt_j  = T_j (-g_b(j) - F)
    JSD_beta:    dJ/ds_j  = (1 - beta) S_j (log P_b(j) - log M_b(j) - K_P)
                 dJ/dt_j  = beta T_j (log Q_b(j) - log M_b(j) - K_Q)

so a row's logit gradients need one coefficient per bucket and one pass over the logits:
:func:`bucket_coefs`.

:func:`rows_fwd_torch` / :func:`rows_bwd_torch` compute exactly what the compiled
``topk_tail_kl_<impl>_fwd/_bwd`` ops compute, from the same inputs: the chunked path's epilogue
where no compiled kernel has the options (a pure-Python install, a ``support`` or ``"jsd"`` a
GPU kernel lacks). The differentiable oracle is :func:`lopd_kernels.topk_tail_kl_reference`.
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
    "op_divergence",
    "rows_bwd_torch",
    "rows_fwd_torch",
    "select_support",
    "support_masks",
    "support_width",
]


def effective_top_m(top_m: int, vocab: int) -> int:
    """Number of top buckets M; 0 (the full-vocabulary KL) for ``top_m`` 0 or ``>= V``."""
    return 0 if top_m == 0 or top_m >= vocab else top_m


def support_width(m: int, support: str) -> int:
    """``K``, the width of ``topk_ids`` (and ``K + 1`` buckets): ``M`` for the teacher's or the
    student's top-M, ``2M`` for their union (padded with -1 past the union's size), 0 for the
    full vocabulary (``m == 0``, whatever the support)."""
    if m == 0:
        return 0
    return 2 * m if support == "union" else m


def op_divergence(divergence: str, beta: float | None) -> tuple[str, float]:
    """``(divergence, beta)`` as the ops take them, in TRL's convention (``docs/math.md``, 1b):
    ``"reverse"`` is ``beta = 1``, ``"forward"`` is ``beta = 0``; ``"jsd"`` at ``beta`` 0 or 1 *is*
    the forward / reverse KL (TRL special-cases its ends the same way; the mixture formula would
    give 0 there), so it is mapped to them and runs their code, bit for bit. ``beta=None`` means
    0.5 for the JSD (TRL's GKD default). Options are validated by the callers' checks."""
    if divergence == "reverse":
        return "reverse", 1.0
    if divergence == "forward":
        return "forward", 0.0
    beta = 0.5 if beta is None else float(beta)
    if beta == 0.0:
        return "forward", 0.0
    if beta == 1.0:
        return "reverse", 1.0
    return "jsd", beta


def masked_logsumexp(x: Tensor, keep: Tensor) -> Tensor:
    """Row log-sum-exp over ``x[keep]``; ``-inf`` (with zero, not NaN, gradient) if empty."""
    x = x.masked_fill(~keep, -math.inf)
    empty = (x == -math.inf).all(dim=-1, keepdim=True)
    # logsumexp over an all -inf row has gradient exp(-inf - (-inf)) = NaN: feed it zeros there.
    out = torch.logsumexp(x.masked_fill(empty, 0.0), dim=-1)
    return out.masked_fill(empty.squeeze(-1), -math.inf)


def select_support(s: Tensor, t: Tensor, m: int, support: str) -> Tensor:
    """``[R, K]`` int64 bucket ids of each row (``K = support_width(m, support)``, ``m >= 1``).

    ``"teacher"`` / ``"student"``: that side's top-M ids by descending logit, ties to the lower
    id (a stable descending sort: the rule of every kernel). ``"union"``: the teacher's top-M in
    that order, then the student's top-M ids that are not among them, in the student's order,
    then -1 (padding) up to ``2M``. No gradient (the selection is piecewise constant).
    """
    if support == "teacher":
        return torch.sort(t.detach(), dim=-1, descending=True, stable=True).indices[:, :m]
    s_ids = torch.sort(s.detach(), dim=-1, descending=True, stable=True).indices[:, :m]
    if support == "student":
        return s_ids
    t_ids = torch.sort(t.detach(), dim=-1, descending=True, stable=True).indices[:, :m]
    dup = (s_ids.unsqueeze(-1) == t_ids.unsqueeze(-2)).any(-1)  # [R, M]: already a teacher id
    # Student-only ids first, each group in its own (student) order: a stable sort on the flag.
    order = torch.sort(dup.to(torch.uint8), dim=-1, stable=True).indices
    extra = s_ids.gather(-1, order).masked_fill(dup.gather(-1, order), -1)
    return torch.cat([t_ids, extra], -1)


def support_masks(ids: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """``(in_support [R, V] bool, pad [R, K] bool)`` of bucket ids ``[R, K]`` (-1: padding)."""
    pad = ids < 0
    in_support = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    in_support.scatter_(-1, ids.masked_fill(pad, vocab), True)
    return in_support[:, :vocab], pad


def bucket_divergence(logp: Tensor, logq: Tensor, divergence: str, beta: float = 0.5) -> Tensor:
    """The divergence over the last dim of bucket log-masses ``logp`` (student), ``logq``
    (teacher): differentiable, NaN-free at zero-mass buckets.

    ``"reverse"`` / ``"forward"``: ``sum_b W_b (log W_b - log O_b)``; zero-mass buckets add
    exactly 0, and a bucket with mass against a zero-mass one adds +inf (also when ``exp`` of its
    log-mass underflows, where ``0 * inf`` would be NaN). ``"jsd"``: TRL's generalized JSD at
    ``0 < beta < 1`` (:func:`bucket_jsd`), always finite.
    """
    if divergence == "jsd":
        return bucket_jsd(logp, logq, beta)
    w, o = (logp, logq) if divergence == "reverse" else (logq, logp)
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


def mixture_logmass(logp: Tensor, logq: Tensor, beta: float) -> Tensor:
    """``log M_b = log((1 - beta) P_b + beta Q_b)`` (``0 < beta < 1``); where both masses are 0
    it is 0 instead of ``-inf`` (every term using it is masked there), so gradients stay finite."""
    both = (logp == -math.inf) & (logq == -math.inf)
    return torch.logaddexp(
        logp.masked_fill(both, 0.0) + math.log1p(-beta),
        logq.masked_fill(both, 0.0) + math.log(beta),
    )


def _kl_to_mixture(logx: Tensor, logm: Tensor) -> Tensor:
    """Per-bucket ``X_b (log X_b - log M_b)``, 0 (gradient 0) where ``X_b = 0``."""
    zero = logx == -math.inf
    x_safe = logx.masked_fill(zero, 0.0)
    return torch.where(zero, 0.0, x_safe.exp() * (x_safe - logm))


def bucket_jsd(logp: Tensor, logq: Tensor, beta: float) -> Tensor:
    """TRL's generalized JSD over the last dim: ``beta KL(Q || M) + (1 - beta) KL(P || M)``,
    ``M = (1 - beta) P + beta Q`` (``0 < beta < 1``). Bounded, never NaN."""
    logm = mixture_logmass(logp, logq, beta)
    k_p = _kl_to_mixture(logp, logm).sum(dim=-1)
    k_q = _kl_to_mixture(logq, logm).sum(dim=-1)
    return beta * k_q + (1.0 - beta) * k_p


def bucket_coefs(
    u_kl: Tensor,
    kl: Tensor,
    bucket_logp: Tensor,
    divergence: str,
    beta: float,
    u_ls: Tensor,
    u_t: Tensor,
) -> tuple[Tensor, Tensor]:
    """Per-bucket backward coefficients of the top-M + tail divergence.

    Args:
        u_kl, u_ls, u_t: ``[R]`` upstream gradients of the divergence, the student log-prob and
            the teacher log-prob (privilege included).
        kl: ``[R]`` the forward divergence (read by the KL coefficients; the JSD's need
            ``KL(P || M)`` and ``KL(Q || M)``, recomputed here from the buckets).
        bucket_logp: ``[R, 2, B]`` (log P_b, log Q_b): the K + 1 buckets (index K: the tail;
            padding buckets ``-inf`` on both sides), or every vocabulary entry (``B = V``) for the
            full-vocabulary divergence.
        divergence, beta: as the ops take them (:func:`op_divergence`).

    Returns:
        ``c_s, c_t [R, B]`` such that ``d/ds_j = (S_j c_s[b(j)] + u_ls 1[j = a]) / T`` and
        ``d/dt_j = (T_j c_t[b(j)] + u_t 1[j = a]) / T``. A bucket with zero (or infinite-ratio)
        mass gets 0 from the divergence term.
    """
    logp, logq = bucket_logp[:, 0], bucket_logp[:, 1]
    u = u_kl.unsqueeze(-1)
    if divergence == "jsd":
        logm = mixture_logmass(logp, logq, beta)
        k_p = _kl_to_mixture(logp, logm).sum(-1, keepdim=True)
        k_q = _kl_to_mixture(logq, logm).sum(-1, keepdim=True)
        zero = torch.zeros_like(logp)
        c_s = torch.where(logp > -math.inf, (1.0 - beta) * (logp - logm - k_p), zero)
        c_t = torch.where(logq > -math.inf, beta * (logq - logm - k_q), zero)
        c_s = u * c_s - u_ls.unsqueeze(-1)
        c_t = u * c_t - u_t.unsqueeze(-1)
        return c_s.contiguous(), c_t.contiguous()
    g = logp - logq
    fin = torch.isfinite(g)
    zero = torch.zeros_like(g)
    klc = kl.unsqueeze(-1)
    if divergence == "reverse":
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


def _row_divergence(logp: Tensor, logq: Tensor, divergence: str, beta: float) -> Tensor:
    """Per-row divergence of bucket log-masses (no autograd needed: the twins' forward)."""
    if divergence == "jsd":
        return bucket_jsd(logp, logq, beta)
    kl_terms = _xlogx_ratio(logp, logq) if divergence == "reverse" else _xlogx_ratio(logq, logp)
    return kl_terms.sum(-1)


def _rows_math(
    s: Tensor,
    t: Tensor,
    target: Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Top-M + tail divergence of every row of a logit block whose rows all have a real target.

    Args:
        s, t: ``[R, V]`` logits (float32 or float64).
        target: ``[R]`` int64 target ids in ``[0, V)``.

    Returns:
        ``kl [R]``, ``student_logprob [R]``, ``teacher_logprob [R]``, ``topk_ids [R, K]``,
        ``lse [R, 2]`` and ``bucket_logp [R, 2, K+1]`` (log P_b, log Q_b; index K is the tail).
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
        kl = _row_divergence(logp, logq, divergence, beta)
        return kl, lp_s, lp_t, ids, torch.stack([lse_s, lse_t], -1), bucket
    if support == "union":
        ids = select_support(s, t, m, support)
        in_top, pad = support_masks(ids, s.shape[-1])
        safe = ids.clamp(min=0)
        top_s = s.gather(-1, safe).masked_fill(pad, -math.inf)
        top_t = t.gather(-1, safe).masked_fill(pad, -math.inf)
    else:
        # Stable descending sort: ties go to the lower vocabulary id, the rule of every kernel.
        ids = torch.sort(t if support == "teacher" else s, dim=-1, descending=True, stable=True)
        ids = ids.indices[:, :m]
        in_top = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, ids, True)
        top_s, top_t = s.gather(-1, ids), t.gather(-1, ids)
    # The tail is the log-sum-exp over the complement of the support, accumulated directly (never
    # 1 - sum of the support's masses, which cancels to garbage when it holds nearly all).
    tail_s = torch.logsumexp(s.masked_fill(in_top, -math.inf), dim=-1, keepdim=True)
    tail_t = torch.logsumexp(t.masked_fill(in_top, -math.inf), dim=-1, keepdim=True)
    logp = torch.cat([top_s, tail_s], -1) - lse_s.unsqueeze(-1)
    logq = torch.cat([top_t, tail_t], -1) - lse_t.unsqueeze(-1)
    kl = _row_divergence(logp, logq, divergence, beta)
    bucket = torch.stack([logp, logq], dim=1)
    return kl, lp_s, lp_t, ids, torch.stack([lse_s, lse_t], -1), bucket


def rows_fwd_torch(
    s: Tensor,
    t: Tensor,
    target: Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch twin of ``torch.ops.lopd.topk_tail_kl_cpu_fwd`` (same outputs; ignored rows 0)."""
    n, vocab = s.shape
    k = support_width(effective_top_m(top_m, vocab), support)
    kl = s.new_zeros(n, dtype=torch.float32)
    lp_s, lp_t = torch.zeros_like(kl), torch.zeros_like(kl)
    ids = torch.zeros(n, k, dtype=torch.long, device=s.device)
    lse = kl.new_zeros(n, 2)
    bucket = kl.new_zeros(n, 2, k + 1)
    rows = (target != ignore_index).nonzero().squeeze(-1)
    if rows.numel():
        out = _rows_math(
            s.index_select(0, rows).float(),
            t.index_select(0, rows).float(),
            target.index_select(0, rows),
            top_m,
            temperature,
            divergence,
            beta,
            support,
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
    divergence: str,
    beta: float,
    ignore_index: int,
    student_requires_grad: bool,
    teacher_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of ``torch.ops.lopd.topk_tail_kl_cpu_bwd``: the closed-form logit gradients
    of :func:`bucket_coefs`, spread over the vocabulary (tail coefficient everywhere, then the
    support's ids', padding ids -1 skipped); with the full vocabulary every entry is its own
    bucket."""
    valid = (target != ignore_index).unsqueeze(-1)
    vocab = s.shape[-1]
    tgt = target.clamp(0, vocab - 1).unsqueeze(-1)

    def upstream(g: Tensor) -> Tensor:
        return torch.where(valid.squeeze(-1), g.float(), 0.0)

    u_kl, u_ls, u_lt = upstream(grad_kl), upstream(grad_slp), upstream(grad_tlp)
    log_s = s.float() / temperature - lse[:, :1]
    log_t = t.float() / temperature - lse[:, 1:]
    k = topk_ids.shape[-1]
    if k == 0:
        buckets = torch.stack([log_s, log_t], 1)
        c_s, c_t = bucket_coefs(u_kl, kl, buckets, divergence, beta, u_ls, u_lt)
    else:
        c_s, c_t = bucket_coefs(u_kl, kl, bucket_logp, divergence, beta, u_ls, u_lt)
        # Padding ids (-1) write into a spare column that is dropped.
        slots = topk_ids.masked_fill(topk_ids < 0, vocab)

        def spread(coef: Tensor) -> Tensor:
            wide = coef[:, k:].expand(-1, vocab + 1).clone()
            return wide.scatter_(-1, slots, coef[:, :k])[:, :vocab]

        c_s, c_t = spread(c_s), spread(c_t)

    def side(x: Tensor, logprob: Tensor, coef: Tensor, u: Tensor) -> Tensor:
        grad = torch.where(valid, logprob.exp(), 0.0) * coef
        grad.scatter_add_(-1, tgt, u.unsqueeze(-1))
        return torch.where(valid, grad / temperature, 0.0).to(x.dtype)

    empty = s.new_empty(0)
    grad_s = side(s, log_s, c_s, u_ls) if student_requires_grad else empty
    grad_t = side(t, log_t, c_t, u_lt) if teacher_requires_grad else empty
    return grad_s, grad_t


def teacher_topk_mass(bucket_logp: Tensor, target_ids: Tensor, ignore_index: int) -> Tensor:
    """``[N]`` teacher mass on the support from the ops' ``bucket_logp [N, 2, K+1]`` (no grad).

    A sum of K non-negative terms (never ``1 - tail``; padding buckets are ``-inf``: 0); 1 for
    the full vocabulary (``K = 0``), 0 at rows whose target is ``ignore_index``.
    """
    k = bucket_logp.shape[-1] - 1
    if k == 0:
        mass = torch.ones(bucket_logp.shape[0], dtype=torch.float32, device=bucket_logp.device)
    else:
        mass = bucket_logp.detach()[:, 1, :k].float().exp().sum(-1)
    return torch.where(target_ids == ignore_index, torch.zeros_like(mass), mass)


def support_size(topk_ids: Tensor, target_ids: Tensor, ignore_index: int, vocab: int) -> Tensor:
    """``[N]`` int64 ids per row in ``topk_ids [N, K]`` (its non-negative entries; V when
    ``K = 0``, the full vocabulary), 0 at rows whose target is ``ignore_index``."""
    if topk_ids.shape[-1] == 0:
        size = torch.full(target_ids.shape, vocab, dtype=torch.int64, device=target_ids.device)
    else:
        size = (topk_ids.detach() >= 0).sum(-1)
    return torch.where(target_ids == ignore_index, torch.zeros_like(size), size)
