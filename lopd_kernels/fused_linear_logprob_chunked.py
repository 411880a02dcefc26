"""The blocked PyTorch path of ``fused_linear_logprob`` (backend ``"cuda"``) and the block plan
every implementation shares.

**Blocks.** The valid rows (target not ``ignore_index``) are taken ``C`` at a time (a token
chunk) and the vocabulary ``Vb`` entries at a time (a vocabulary block); one ``[C, Vb]`` float32
logit block exists at a time (:func:`block_plan`: ``C`` up to a row cap, ``Vb`` from a byte
budget and at most 16,384 entries, so no block is ever ``[N, V]`` of a larger vocabulary, a short
sequence included). The
forward keeps per row a running maximum ``m``, ``S_ex = sum_{j != a} e^{z_j - m}`` (the target
``a`` left out, so that ``1 - p_a`` is a sum, never a difference) and, for the entropy,
``sum_{j != a} e^{z_j - m} (z_j - m)``: a block rescales them by ``e^{m_old - m_new}`` (the online
log-sum-exp). At the end ``lse = m + log S``, ``S = S_ex + e^{z_a - m}``, the log-prob is
``-log1p(S_ex e^{m - z_a})`` (exact for a target holding nearly all the mass) and the entropy
``log S - sum p (z - m)``. The backward recomputes each block and forms the logit gradient
(docs/math.md, section 6) in place, then ``dh += G W_b`` and ``dW_b += G^T h`` (float32
accumulators).

**Frozen head: the gradient projection.** When the head (and bias) need no gradient but the
hidden states do (a LoRA model, the cold start's frozen backbone) and no entropy is asked for,
``dh = u P`` with ``P = sum_j (1[j = a] - p_j) W_j / T``, the hidden-state gradient of a unit
upstream gradient. The forward accumulates it flash-attention style, ``A += e^{z - m} W_b`` with
the target entry left out and ``A`` rescaled when ``m`` grows, and
``P = (S_ex W_a - A) / (S T)``; the backward is then one multiply, no logit recompute and no GEMM
(two GEMMs in the forward instead of one forward and two backward). ``P`` is saved in the hidden
states' dtype in their place (the op saves no hidden states in this mode).

On a GPU the GEMMs are cuBLAS's (half-precision operands write float32 logits where
:func:`lopd_kernels.gemm_f32.half_gemm`), the per-row work a few ATen elementwise passes per
block; on CPU the same code runs with upcast slabs (the ``"cpu"`` backend is the C++ op instead,
csrc/cpu/fused_linear_logprob.cpp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_kernels import gemm_f32 as gemm
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range

__all__ = [
    "BLOCK_BUDGET",
    "MAX_BLOCK_VOCAB",
    "MAX_CHUNK_ROWS",
    "block_plan",
    "blocked_bwd",
    "blocked_fwd",
    "finalize_rows",
    "workspace_bytes",
]

#: Bytes of the one float32 ``[C, Vb]`` logit block per device type (the op's working set beyond
#: its outputs and gradients). CPU: 128 MiB (2,048 rows x 16,384 entries). Measured at N = 2,048,
#: V = 151,936, fp32, 2 loaded cores (forward + backward against the materialized path):
#: d = 1,024: 64 / 128 / 256 MiB blocks 0.94x / 0.86x / 0.86x; d = 256: 64 / 256 MiB 0.99x /
#: 0.86x, whole-vocabulary rows (chunks of 110 / 440 rows) 1.25x / 0.97x. GPU: 1 GiB is ~1,700
#: rows of a 152k vocabulary,
#: GEMMs large enough for cuBLAS's peak.
BLOCK_BUDGET = {"cpu": 128 << 20, "cuda": 1 << 30}
#: Most token rows per chunk: the weight gradient is read and written once per chunk.
MAX_CHUNK_ROWS = {"cpu": 4096, "cuda": 16384}
#: Most vocabulary entries per block, whatever the rows: a short batch's block would otherwise
#: span the whole vocabulary, an ``[N, V]`` tensor after all. 16,384 is what the budgets give a
#: full chunk (2,048 CPU / 16,384 GPU rows), so long batches are unaffected.
MAX_BLOCK_VOCAB = 16_384
# Vocabulary blocks are multiples of this many entries (vector and GEMM tile friendly).
_VOCAB_ALIGN = 64
# Exponents below this contribute exactly 0 (e^-150 underflows float32); clamping there keeps
# 0 * (-inf) out of the entropy terms of -inf logits.
_NEG_CLAMP = -150.0


def block_plan(
    n_rows: int, vocab: int, device_type: str = "cpu", chunk_size: int | None = None
) -> tuple[int, int]:
    """``(C, Vb)``: token rows per chunk and vocabulary entries per block.

    ``C = min(n_rows, chunk_size or MAX_CHUNK_ROWS)``; ``Vb`` the largest multiple of 64 with
    ``C * Vb * 4 <= BLOCK_BUDGET`` (at least 64, at most ``MAX_BLOCK_VOCAB`` and ``V``). Pure
    arithmetic on Python ints: ``torch.compile`` traces it.
    """
    key = "cuda" if device_type == "cuda" else "cpu"
    rows = max(1, min(max(n_rows, 1), chunk_size or MAX_CHUNK_ROWS[key]))
    vb = BLOCK_BUDGET[key] // (4 * rows)
    vb = max(_VOCAB_ALIGN, vb - vb % _VOCAB_ALIGN)
    return rows, min(vocab, vb, MAX_BLOCK_VOCAB)


def workspace_bytes(
    n_rows: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype = torch.float32,
    device_type: str = "cpu",
    *,
    head_grad: bool = True,
    projection: bool = False,
    chunk_size: int | None = None,
) -> int:
    """Upper bound of the bytes one call allocates beyond its inputs, its ``[N]`` outputs and the
    gradients it returns, for the block plan of these shapes (:func:`block_plan`).

    The float32 ``[C, Vb]`` logit block, the chunk's hidden rows in float32, for half-precision
    operands the head block in float32 and (several chunks, head trained) the float32
    weight-gradient accumulator, with ``projection`` the ``[C, d]`` accumulator and the saved
    ``[N, d]`` projection. A memory account adds this to what the step holds anyway.
    """
    rows, vb = block_plan(n_rows, vocab, device_type, chunk_size)
    half = dtype in (torch.bfloat16, torch.float16)
    total = 4 * rows * vb + 4 * rows * hidden
    if half:
        total += 4 * vb * hidden
        if head_grad and n_rows > rows:
            total += 4 * vocab * hidden
    if projection:
        total += 4 * rows * hidden + n_rows * hidden * torch.empty(0, dtype=dtype).element_size()
    return total


def _spans(n: int, step: int):
    for start in range(0, n, step):
        yield start, min(n, start + step)


def _block_logits(h: Tensor, w: Tensor, b: Tensor | None, inv_temp: float) -> Tensor:
    """``(h @ w^T + b) / T`` as a float32 ``[C, Vb]`` block."""
    out = gemm.matmul_f32(h, w.T)
    if b is not None:
        out += b.to(out.dtype)
    return out.mul_(inv_temp)


def _in_block(tgt: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """Rows of the chunk whose target lies in ``[v0, v1)`` and the target's column there."""
    hit = ((tgt >= v0) & (tgt < v1)).nonzero().squeeze(-1)
    return hit, tgt.index_select(0, hit) - v0


def finalize_rows(
    m: Tensor, s_ex: Tensor, s2_ex: Tensor, z_a: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(log p_a, lse, entropy, S)`` of rows from their running state (float64 ``[R]`` each):
    maximum ``m``, ``S_ex`` and ``sum e^{z - m} (z - m)`` over the non-target entries, the
    target's tempered logit ``z_a``. ``log p_a = -log1p(S_ex e^{m - z_a})`` while ``e^{z_a - m}``
    resolves it (a target holding nearly all the mass stays exact), else ``z_a - lse``."""
    d_a = z_a - m
    e_a = torch.where(z_a > -torch.inf, d_a.exp(), torch.zeros_like(d_a))
    total = s_ex + e_a
    log_total = total.log()
    near = d_a > -30.0
    lp = torch.where(near, -torch.log1p(s_ex * (-d_a).clamp(max=60.0).exp()), d_a - log_total)
    shift = (s2_ex + torch.where(e_a > 0, e_a * d_a, torch.zeros_like(e_a))) / total
    return lp, m + log_total, log_total - shift, total


def blocked_fwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    projection: bool,
    chunk_size: int,
    vocab_block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward: ``(logprob [N], entropy [N] or [0], lse [N], projection [N, d] or [0])``.

    ``projection`` (frozen head, see the module docstring) also returns ``P`` in the hidden
    states' dtype. Rows whose target is ``ignore_index`` output 0 everywhere.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    check_targets_in_range(targets, vocab, ignore_index, "targets")
    dev = hidden.device
    logprob = torch.zeros(n, dtype=torch.float32, device=dev)
    entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=dev)
    lse = torch.zeros(n, dtype=torch.float32, device=dev)
    proj = hidden.new_zeros(hidden.shape if projection else (0,))
    rows = (targets != ignore_index).nonzero().squeeze(-1)
    inv_temp = 1.0 / temperature
    chunk, vb = max(1, chunk_size or rows.numel()), max(1, vocab_block or vocab)
    for c0, c1 in _spans(rows.numel(), chunk):
        r = rows[c0:c1]
        h = hidden.index_select(0, r)
        tgt = targets.index_select(0, r).long()
        f64 = dict(dtype=torch.float64, device=dev)
        m = torch.full((r.numel(),), -torch.inf, **f64)
        s_ex, s2_ex, z_a = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        acc = torch.zeros(r.numel(), hidden.shape[1], dtype=torch.float32, device=dev)
        for v0, v1 in _spans(vocab, vb):
            z = _block_logits(h, weight[v0:v1], None if bias is None else bias[v0:v1], inv_temp)
            hit, col = _in_block(tgt, v0, v1)
            z_a[hit] = z[hit, col].double()
            m_new = torch.maximum(m, z.amax(1).double())
            z[hit, col] = -torch.inf  # the target stays out of the sums
            seen = m > -torch.inf
            scale = torch.where(seen, (m - m_new).exp(), torch.zeros_like(m))
            # sum e (z - m_new) over the old terms: scale * (s2 + (m - m_new) s_ex)
            shift = torch.where(seen, m - m_new, torch.zeros_like(m))
            s2_ex = scale * (s2_ex + shift * s_ex)
            s_ex = scale * s_ex
            m_safe = torch.where(m_new > -torch.inf, m_new, torch.zeros_like(m_new)).float()
            d = z.sub_(m_safe[:, None])
            e = d.exp()
            s_ex += e.sum(1, dtype=torch.float64)
            if with_entropy:
                s2_ex += (e * d.clamp_(min=_NEG_CLAMP)).sum(1, dtype=torch.float64)
            if projection:
                acc.mul_(scale.float()[:, None])
                gemm.matmul_f32(e, weight[v0:v1], out=acc, accumulate=True)
            m = m_new
            del z, d, e
        lp, lse_r, ent, total = finalize_rows(m, s_ex, s2_ex, z_a)
        logprob.index_copy_(0, r, lp.float())
        lse.index_copy_(0, r, lse_r.float())
        if with_entropy:
            entropy.index_copy_(0, r, ent.float())
        if projection:
            w_a = weight.index_select(0, tgt).to(torch.float32)
            p = ((s_ex / total)[:, None].float() * w_a - acc / total.float()[:, None]) * inv_temp
            proj.index_copy_(0, r, p.to(proj.dtype))
    return logprob, entropy, lse, proj


def blocked_bwd(
    grad_logprob: Tensor,
    grad_entropy: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    logprob: Tensor,
    entropy: Tensor,
    lse: Tensor,
    proj: Tensor,
    temperature: float,
    ignore_index: int,
    chunk_size: int,
    vocab_block: int,
    needs: tuple[bool, bool, bool],
) -> list[Tensor | None]:
    """Gradients ``[d_hidden, d_weight, d_bias]`` (None where not needed).

    With a projection (``proj`` non-empty) ``d_hidden = grad_logprob * P``. Otherwise every
    block is recomputed and (docs/math.md, section 6)
    ``G = (u (1[j = a] - p_j) - v p_j (log p_j + H)) / T``, the target entry with
    ``1 - p_a = -expm1(log p_a)``; ``grad_entropy`` (``v``) may be empty (no entropy gradient).
    """
    n_h, n_w, n_b = needs
    f32 = torch.float32
    like_h = proj if proj.numel() else hidden
    d_h = torch.zeros(like_h.shape, dtype=f32, device=like_h.device) if n_h else None
    rows = (targets != ignore_index).nonzero().squeeze(-1)
    if proj.numel():
        if d_h is not None:
            u = grad_logprob.index_select(0, rows).float()[:, None]
            d_h.index_copy_(0, rows, u * proj.index_select(0, rows).float())
        return [None if d_h is None else d_h.to(proj.dtype), None, None]
    vocab, dev = weight.shape[0], hidden.device
    d_w = torch.zeros(weight.shape, dtype=f32, device=dev) if n_w else None
    d_b = torch.zeros(vocab, dtype=f32, device=dev) if n_b else None
    inv_temp = 1.0 / temperature
    use_h = grad_entropy.numel() > 0
    chunk, vb = max(1, chunk_size or rows.numel()), max(1, vocab_block or vocab)
    for c0, c1 in _spans(rows.numel() if (n_h or n_w or n_b) else 0, chunk):
        r = rows[c0:c1]
        h = hidden.index_select(0, r)
        tgt = targets.index_select(0, r).long()
        u = grad_logprob.index_select(0, r).float()
        lse_r, lp_r = lse.index_select(0, r), logprob.index_select(0, r)
        if use_h:
            v = grad_entropy.index_select(0, r).float()
            ent = entropy.index_select(0, r)
        dh_c = torch.zeros(r.numel(), hidden.shape[1], dtype=f32, device=dev) if n_h else None
        for v0, v1 in _spans(vocab, vb):
            w = weight[v0:v1]
            g = _block_logits(h, w, None if bias is None else bias[v0:v1], inv_temp)
            d = g.sub_(lse_r[:, None])
            p = d.exp()
            if use_h:
                # -p (u + v (log p + H)); the clamp keeps 0 * (-inf) out at -inf logits
                coef = d.clamp_(min=_NEG_CLAMP).add_(ent[:, None]).mul_(v[:, None])
                g = p.mul_(coef.add_(u[:, None]))
            else:
                g = p.mul_(u[:, None])
            g.neg_()
            hit, col = _in_block(tgt, v0, v1)
            if hit.numel():
                lp_a, u_a = lp_r[hit], u[hit]
                g_a = -u_a * torch.expm1(lp_a)
                if use_h:
                    g_a = g_a - v[hit] * lp_a.exp() * (lp_a + ent[hit])
                g[hit, col] = g_a
            g.mul_(inv_temp)
            gg = g.to(w.dtype) if gemm.half_gemm(w) else g
            if dh_c is not None:
                gemm.matmul_f32(gg, w, out=dh_c, accumulate=True)
            if d_w is not None:
                gemm.accumulate_f32_(d_w[v0:v1], gg.T, h)
            if d_b is not None:
                d_b[v0:v1] += g.sum(0)
            del g, gg, d, p
        if d_h is not None:
            d_h.index_copy_(0, r, dh_c)
    return [
        None if d_h is None else d_h.to(hidden.dtype),
        None if d_w is None else d_w.to(weight.dtype),
        None if d_b is None else d_b.to(weight.dtype),
    ]
