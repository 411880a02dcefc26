"""Device functions shared by the Triton ``topk_tail_kl`` kernels (the per-row forwards, the
backward) and the fused-linear kernels' divergence terms: packed sort keys, online
log-sum-exps, the per-bucket divergence terms (reverse / forward KL, TRL's generalized JSD) and
the per-bucket gradient factors. The maths is ``docs/math.md`` (sections 1, 1b, 2).

Divergence codes (the kernels' ``DIV`` constexpr; the launchers map the op's ``divergence`` /
``beta`` to them, ``"jsd"`` at ``beta`` 0 / 1 to the forward / reverse KL):
:data:`DIV_REVERSE` KL(P || Q), :data:`DIV_FORWARD` KL(Q || P), :data:`DIV_JSD`
``beta KL(Q || M) + (1 - beta) KL(P || M)`` with ``M = (1 - beta) P + beta Q``. The JSD
functions take ``log(1 - beta)`` and ``log(beta)`` from the host (float64 there: no ``log1p``
needed in the kernel).

Packed keys: ``key = (mono(x) << 32) | (0x7FFFFFFF - j)`` where ``mono`` maps the float32 bits
of a logit to an int32 with the same order (flip the magnitude bits of negatives). Keys are
unique; a larger key means a larger value or, on a tie, a lower index (the reference's rule),
and one int64 max/min carries the index along with the value. Value and index are recovered
from a key exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lopd_kernels.triton._common import LN2_C

#: The ``DIV`` codes of the kernels.
DIV_REVERSE, DIV_FORWARD, DIV_JSD = 0, 1, 2
#: The ``SUPPORT`` codes of the per-row forwards: whose top-M ids are buckets.
SUPPORT_TEACHER, SUPPORT_STUDENT, SUPPORT_UNION = 0, 1, 2

# Empty slot of a running top-M: below every real key (a real key's high word is at least
# mono(-inf) = -0x7F800001 > INT32_MIN), so any real entry replaces it.
_KEY_EMPTY = tl.constexpr(-(2**63))
# Padding slots (index >= M of the power-of-two register vector): above every real key, so
# they are never the minimum and never evicted.
_KEY_PAD = tl.constexpr(2**63 - 1)


@triton.jit
def _sortable_key(x, idx):
    """Pack float32 logits ``x`` and their int32 vocabulary indices into int64 keys.

    Args:
        x: float32 values (any shape).
        idx: int32 indices in ``[0, 2^31)``, same shape.

    Returns:
        int64 keys ordered like ``(x, -idx)``: the larger value wins, on a tie the lower index.
    """
    u = x.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flipping their 31 magnitude bits fixes that
    # (the map is its own inverse, see _key_value).
    mono = u ^ ((u >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 logit packed in ``key`` (exact inverse of ``_sortable_key``)."""
    mono = (key >> 32).to(tl.int32)
    u = mono ^ ((mono >> 31) & 0x7FFFFFFF)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key):
    """The int32 vocabulary index packed in ``key``."""
    return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _safe_ref(m):
    """Reference point for exponentials: the running max, or 0 while it is still ``-inf``.

    Using 0 keeps ``exp2(-inf - ref)`` at 0 instead of ``exp2(-inf + inf) = NaN`` for rows (or
    tails) that hold only ``-inf`` so far.
    """
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _lse_fold(m, total, y):
    """Fold a block ``y`` (float32 [B], base-2 units, ``-inf`` = absent) into ``(m, total)``.

    ``(m, total)`` is an online base-2 log-sum-exp: ``lse2 = _safe_ref(m) + log2(total)``.
    """
    m_new = tl.maximum(m, tl.max(y, 0))
    ref = _safe_ref(m_new)
    total = total * tl.exp2(m - ref) + tl.sum(tl.exp2(y - ref), 0)
    return m_new, total


@triton.jit
def _lse_fold_scalar(m, total, y):
    """``_lse_fold`` for a single scalar ``y``."""
    m_new = tl.maximum(m, y)
    ref = _safe_ref(m_new)
    total = total * tl.exp2(m - ref) + tl.exp2(y - ref)
    return m_new, total


@triton.jit
def _kl_terms(a, b):
    """Bucketwise ``exp(a) * (a - b)`` for natural log-masses ``a``, ``b``.

    A zero-mass bucket (``a = -inf``) contributes 0 (never ``0 * inf``); positive mass against
    ``b = -inf`` is a genuinely infinite KL and gives ``+inf``, also when ``exp(a)`` underflows.
    """
    return tl.where(
        a == float("-inf"), 0.0, tl.where(b == float("-inf"), float("inf"), tl.exp(a) * (a - b))
    )


@triton.jit
def _jsd_log_mixture(lp, lq, log_1mb, log_b):
    """``log M_b = log((1 - beta) P_b + beta Q_b)`` from natural log-masses; ``-inf`` when both
    are ``-inf`` (then every term using it is dropped)."""
    a = lp + log_1mb
    b = lq + log_b
    hi = tl.maximum(a, b)
    # log(1 + e) with e in [0, 1]: absolute error ~1e-7, as log1p's would be at this size.
    return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - _safe_ref(hi)))


@triton.jit
def _kl_to_mixture(lx, lm):
    """``X_b (log X_b - log M_b)``: one bucket's share of ``KL(X || M)``; 0 where ``X_b = 0``."""
    return tl.where(lx == float("-inf"), 0.0, tl.exp(lx) * (lx - lm))


@triton.jit
def _div_terms(lp, lq, beta, log_1mb, log_b, DIV: tl.constexpr):
    """Per-bucket divergence terms (any shape) of the divergence ``DIV``; their sum over the
    buckets is the row's divergence. The KLs' are :func:`_kl_terms`; the JSD's
    ``beta Q_b log(Q_b / M_b) + (1 - beta) P_b log(P_b / M_b)``, finite for any buckets."""
    if DIV == 0:
        return _kl_terms(lp, lq)
    elif DIV == 1:
        return _kl_terms(lq, lp)
    else:
        lm = _jsd_log_mixture(lp, lq, log_1mb, log_b)
        return beta * _kl_to_mixture(lq, lm) + (1.0 - beta) * _kl_to_mixture(lp, lm)


@triton.jit
def _jsd_kls(lp, lq, lp_tail, lq_tail, log_1mb, log_b):
    """``(K_P, K_Q) = (KL(P || M), KL(Q || M))`` over the buckets ``lp``, ``lq`` (a vector; -inf
    padding adds 0) plus the tail bucket: what the JSD's gradient needs besides the masses."""
    lm = _jsd_log_mixture(lp, lq, log_1mb, log_b)
    lm_tail = _jsd_log_mixture(lp_tail, lq_tail, log_1mb, log_b)
    k_p = tl.sum(_kl_to_mixture(lp, lm), 0) + _kl_to_mixture(lp_tail, lm_tail)
    k_q = tl.sum(_kl_to_mixture(lq, lm), 0) + _kl_to_mixture(lq_tail, lm_tail)
    return k_p, k_q


@triton.jit
def _bucket_grads(lp, lq, kl, u_kl, u_ls, u_lt, inv_t, REVERSE: tl.constexpr):
    """Per-bucket gradients ``A_b``, ``B_b`` of the KLs (``docs/math.md``; divided by T),
    bucket-normalized.

    For an entry j of bucket b: ``ds_j = (S_j / P_b) * A_b + [j = a] u_ls / T`` and
    ``dt_j = (T_j / Q_b) * B_b + [j = a] u_lt / T``. A support bucket holds one entry
    (``S_j / P_b = 1``): ``A_b``, ``B_b`` are its gradients. Normalizing by the bucket mass keeps
    every factor finite: ``S_j * Q_b / P_b`` (forward KL) becomes ``(S_j / P_b) * Q_b``, where
    the ratio ``Q_b / P_b`` alone overflows float32 once the student gives the bucket e^-88 of
    the teacher's mass.

    Args:
        lp, lq: natural log-masses ``log P_b``, ``log Q_b`` (same shape, any).
        kl: the row's KL (reverse or forward, matching ``REVERSE``).
        u_kl, u_ls, u_lt: upstream gradients of kl, student and teacher log-probs.
        inv_t: 1 / temperature.
    """
    p = tl.exp(lp)
    q = tl.exp(lq)
    if REVERSE:
        # d/ds_j = S_j (g_b - KL); d/dt_j = T_j (1 - P_b / Q_b) = (T_j / Q_b) (Q_b - P_b).
        g = tl.where(p > 0.0, lp - lq, 0.0)  # a zero-mass bucket contributes 0, not 0 * inf
        a = p * (u_kl * (g - kl) - u_ls)
        b = u_kl * (q - p) - u_lt * q
    else:
        # d/ds_j = S_j (1 - Q_b / P_b) = (S_j / P_b) (P_b - Q_b); d/dt_j = T_j (h_b - F).
        h = tl.where(q > 0.0, lq - lp, 0.0)
        a = u_kl * (p - q) - u_ls * p
        b = q * (u_kl * (h - kl) - u_lt)
    return a * inv_t, b * inv_t


@triton.jit
def _bucket_grads_div(
    lp, lq, kl, k_p, k_q, u_kl, u_ls, u_lt, inv_t, beta, log_1mb, log_b, DIV: tl.constexpr
):
    """:func:`_bucket_grads` for any divergence. The JSD's (``docs/math.md``, 1b)::

        A_b = P_b (u_kl (1 - beta) (log P_b - log M_b - K_P) - u_ls)
        B_b = Q_b (u_kl beta (log Q_b - log M_b - K_Q) - u_lt)

    a mass in [0, 1] times a bounded log-ratio (``log P_b - log M_b <= -log(1 - beta)``); a side
    without mass in the bucket gets 0. ``k_p``, ``k_q``: :func:`_jsd_kls` of the row (read by the
    JSD only; ``kl`` by the KLs only).
    """
    if DIV == 2:
        lm = _jsd_log_mixture(lp, lq, log_1mb, log_b)
        a = tl.exp(lp) * (u_kl * (1.0 - beta) * ((lp - lm) - k_p) - u_ls)
        b = tl.exp(lq) * (u_kl * beta * ((lq - lm) - k_q) - u_lt)
        a = tl.where(lp == float("-inf"), 0.0, a)
        b = tl.where(lq == float("-inf"), 0.0, b)
        return a * inv_t, b * inv_t
    else:
        return _bucket_grads(lp, lq, kl, u_kl, u_ls, u_lt, inv_t, DIV == 0)


@triton.jit
def _full_row_lse(s_row, t_row, V, scale2, BLOCK_V: tl.constexpr):
    """Online base-2 log-sum-exps ``(ms, ls, mt, lt)`` of a whole row pair (``lse2 =
    _safe_ref(m) + log2(l)``): the JSD's first pass over the full vocabulary."""
    ms = tl.full([], float("-inf"), tl.float32)
    ls = tl.zeros([], tl.float32)
    mt = tl.full([], float("-inf"), tl.float32)
    lt = tl.zeros([], tl.float32)
    lanes = tl.arange(0, BLOCK_V)
    s_next = tl.load(s_row + lanes, mask=lanes < V, other=float("-inf"))
    t_next = tl.load(t_row + lanes, mask=lanes < V, other=float("-inf"))
    for start in range(0, V, BLOCK_V):
        nxt = start + BLOCK_V + lanes
        ys = s_next.to(tl.float32) * scale2
        yt = t_next.to(tl.float32) * scale2
        s_next = tl.load(s_row + nxt, mask=nxt < V, other=float("-inf"))
        t_next = tl.load(t_row + nxt, mask=nxt < V, other=float("-inf"))
        ms, ls = _lse_fold(ms, ls, ys)
        mt, lt = _lse_fold(mt, lt, yt)
    return ms, ls, mt, lt


@triton.jit
def _full_row_jsd_kls(
    s_row, t_row, V, scale2, ref_s, log_ls, ref_t, log_lt, log_1mb, log_b, BLOCK_V: tl.constexpr
):
    """``(K_P, K_Q)`` of the JSD over every vocabulary entry of a row pair, given its base-2
    log-sum-exps as ``ref + log_l`` (``log P_j = ((y_j - ref) - log_l) ln 2``: rounding at the
    size of the result). One pass over both rows."""
    k_p = tl.zeros([], tl.float32)
    k_q = tl.zeros([], tl.float32)
    lanes = tl.arange(0, BLOCK_V)
    s_next = tl.load(s_row + lanes, mask=lanes < V, other=float("-inf"))
    t_next = tl.load(t_row + lanes, mask=lanes < V, other=float("-inf"))
    for start in range(0, V, BLOCK_V):
        nxt = start + BLOCK_V + lanes
        lp = ((s_next.to(tl.float32) * scale2 - ref_s) - log_ls) * LN2_C
        lq = ((t_next.to(tl.float32) * scale2 - ref_t) - log_lt) * LN2_C
        s_next = tl.load(s_row + nxt, mask=nxt < V, other=float("-inf"))
        t_next = tl.load(t_row + nxt, mask=nxt < V, other=float("-inf"))
        lm = _jsd_log_mixture(lp, lq, log_1mb, log_b)
        k_p += tl.sum(_kl_to_mixture(lp, lm), 0)
        k_q += tl.sum(_kl_to_mixture(lq, lm), 0)
    return k_p, k_q
