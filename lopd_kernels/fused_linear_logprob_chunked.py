"""The chunk math of ``fused_linear_logprob`` (backend ``"cuda"``, run by
:func:`lopd_kernels.chunked_linear.run_chunks`) and the chunk plan every implementation shares.

**Chunks.** The rows that count (target not ``ignore_index``) are taken ``C`` at a time and the
vocabulary ``Vc`` entries at a time; one ``[C, Vc]`` float32 logit block exists at a time
(:func:`chunk_plan`: ``C`` up to a row cap, ``Vc`` from a byte budget and at most 16,384 entries,
so no block is ever ``[N, V]`` of a larger vocabulary, a short sequence included). The forward
keeps per row a running maximum ``m``, ``S_ex = sum_{j != a} e^{z_j - m}`` (the target ``a``
left out, so that ``1 - p_a`` is a sum, never a difference) and, for the entropy,
``sum_{j != a} e^{z_j - m} (z_j - m)``: each vocabulary chunk rescales them by
``e^{m_old - m_new}`` (the online log-sum-exp). At the end ``lse = m + log S``,
``S = S_ex + e^{z_a - m}``, the log-prob is ``-log1p(S_ex e^{m - z_a})`` (exact for a target
holding nearly all the mass) and the entropy ``log S - sum p (z - m)``. The backward recomputes
each chunk and forms the logit gradient (docs/math.md, section 6) in place; the chunk loop adds
``dh += G W_c`` and ``dW_c += G^T h`` (float32 accumulators).

**Frozen head: the gradient projection.** When the head (and bias) need no gradient but the
hidden states do (a LoRA model, the cold start's frozen backbone) and no entropy is asked for,
``dh = u P`` with ``P = sum_j (1[j = a] - p_j) W_j / T``, the hidden-state gradient of a unit
upstream gradient. The forward accumulates it flash-attention style, ``A += e^{z - m} W_c`` with
the target entry left out and ``A`` rescaled when ``m`` grows, and
``P = (S_ex W_a - A) / (S T)``; the backward is then one multiply, no logit recompute and no GEMM
(two GEMMs in the forward instead of one forward and two backward). ``P`` is saved in the hidden
states' dtype in their place (the op saves no hidden states in this mode).

On a GPU the GEMMs are cuBLAS's (half-precision operands write float32 logits where
:func:`lopd_kernels.gemm_f32.half_gemm`), the per-row work a few ATen elementwise passes per
chunk; on CPU the same code runs with upcast slabs (the ``"cpu"`` backend is the C++ op instead,
csrc/cpu/fused_linear_logprob.cpp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_kernels import gemm_f32 as gemm
from lopd_kernels.chunked_linear import Chunk, Head, HeadGrads, Rows, run_chunks
from lopd_kernels.op_outputs import FusedLinearLogprobOpGrads, FusedLinearLogprobOpOutput
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range

__all__ = [
    "CHUNK_BUDGET",
    "MAX_CHUNK_ROWS",
    "MAX_CHUNK_VOCAB",
    "chunk_plan",
    "chunked_bwd",
    "chunked_fwd",
    "finalize_rows",
    "workspace_bytes",
]

#: Bytes of the one float32 ``[C, Vc]`` logit block per device type (the op's working set beyond
#: its outputs and gradients). CPU: 128 MiB (2,048 rows x 16,384 entries). Measured at N = 2,048,
#: V = 151,936, fp32, 2 loaded cores (forward + backward against the materialized path):
#: d = 1,024: 64 / 128 / 256 MiB budgets 0.94x / 0.86x / 0.86x; d = 256: 64 / 256 MiB 0.99x /
#: 0.86x, whole-vocabulary rows (chunks of 110 / 440 rows) 1.25x / 0.97x. GPU: 1 GiB is ~1,700
#: rows of a 152k vocabulary, GEMMs large enough for cuBLAS's peak.
CHUNK_BUDGET = {"cpu": 128 << 20, "cuda": 1 << 30}
#: Most token rows per chunk: the weight gradient is read and written once per chunk.
MAX_CHUNK_ROWS = {"cpu": 4096, "cuda": 16384}
#: Most vocabulary entries per chunk, whatever the rows: a short batch's chunk would otherwise
#: span the whole vocabulary, an ``[N, V]`` tensor after all. 16,384 is what the budgets give a
#: full chunk (2,048 CPU / 16,384 GPU rows), so long batches are unaffected.
MAX_CHUNK_VOCAB = 16_384
# Vocabulary chunks are multiples of this many entries (vector and GEMM tile friendly).
_VOCAB_ALIGN = 64
# Exponents below this contribute exactly 0 (e^-150 underflows float32); clamping there keeps
# 0 * (-inf) out of the entropy terms of -inf logits.
_NEG_CLAMP = -150.0


def chunk_plan(
    n_rows: int, vocab: int, device_type: str = "cpu", chunk_size: int | None = None
) -> tuple[int, int]:
    """``(C, Vc)``: token rows and vocabulary entries per chunk.

    ``C = min(n_rows, chunk_size or MAX_CHUNK_ROWS)``; ``Vc`` the largest multiple of 64 with
    ``C * Vc * 4 <= CHUNK_BUDGET`` (at least 64, at most ``MAX_CHUNK_VOCAB`` and ``V``). Pure
    arithmetic on Python ints: ``torch.compile`` traces it.
    """
    key = "cuda" if device_type == "cuda" else "cpu"
    rows = max(1, min(max(n_rows, 1), chunk_size or MAX_CHUNK_ROWS[key]))
    vb = CHUNK_BUDGET[key] // (4 * rows)
    vb = max(_VOCAB_ALIGN, vb - vb % _VOCAB_ALIGN)
    return rows, min(vocab, vb, MAX_CHUNK_VOCAB)


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
    gradients it returns, for the chunk plan of these shapes (:func:`chunk_plan`).

    The float32 ``[C, Vc]`` logit block, the chunk's hidden rows in float32, for half-precision
    operands the head chunk in float32 and (several chunks, head trained) the float32
    weight-gradient accumulator, with ``projection`` the ``[C, d]`` accumulator and the saved
    ``[N, d]`` projection. A memory account adds this to what the step holds anyway.
    """
    rows, vb = chunk_plan(n_rows, vocab, device_type, chunk_size)
    half = dtype in (torch.bfloat16, torch.float16)
    total = 4 * rows * vb + 4 * rows * hidden
    if half:
        total += 4 * vb * hidden
        if head_grad and n_rows > rows:
            total += 4 * vocab * hidden
    if projection:
        total += 4 * rows * hidden + n_rows * hidden * torch.empty(0, dtype=dtype).element_size()
    return total


def _in_chunk(tgt: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
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


class _Running:
    """The online state of one row chunk across its vocabulary chunks (float64 ``[C]`` each,
    ``acc [C, d]`` float32 with a projection)."""

    def __init__(self, tgt: Tensor, d: int, projection: bool) -> None:
        f64 = dict(dtype=torch.float64, device=tgt.device)
        self.tgt = tgt
        self.m = torch.full((tgt.numel(),), -torch.inf, **f64)
        self.s_ex, self.s2_ex, self.z_a = (torch.zeros_like(self.m) for _ in range(3))
        self.acc = (
            torch.zeros(tgt.numel(), d, dtype=torch.float32, device=tgt.device)
            if projection
            else None
        )


def chunked_fwd(
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
) -> FusedLinearLogprobOpOutput:
    """Forward over ``chunk_size`` x ``vocab_block`` chunks (0: all rows / the whole
    vocabulary).

    ``projection`` (frozen head, see the module docstring) also returns ``P`` in the hidden
    states' dtype. Rows whose target is ``ignore_index`` output 0 everywhere.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    check_targets_in_range(targets, vocab, ignore_index, "targets")
    dev = hidden.device
    out = FusedLinearLogprobOpOutput(
        logprob=torch.zeros(n, dtype=torch.float32, device=dev),
        entropy=torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=dev),
        lse=torch.zeros(n, dtype=torch.float32, device=dev),
        projection=hidden.new_zeros(hidden.shape if projection else (0,)),
    )
    rows = Rows(targets, ignore_index)
    inv_temp = 1.0 / temperature
    state: list[_Running] = []

    def math(chunk: Chunk) -> None:
        if chunk.first:
            state[:] = [_Running(chunk.take(targets).long(), hidden.shape[1], projection)]
        st = state[0]
        z = chunk.logits(0).mul_(inv_temp)
        hit, col = _in_chunk(st.tgt, chunk.v0, chunk.v1)
        st.z_a[hit] = z[hit, col].double()
        m_new = torch.maximum(st.m, z.amax(1).double())
        z[hit, col] = -torch.inf  # the target stays out of the sums
        seen = st.m > -torch.inf
        scale = torch.where(seen, (st.m - m_new).exp(), torch.zeros_like(st.m))
        # sum e (z - m_new) over the old terms: scale * (s2 + (m - m_new) s_ex)
        shift = torch.where(seen, st.m - m_new, torch.zeros_like(st.m))
        st.s2_ex = scale * (st.s2_ex + shift * st.s_ex)
        st.s_ex = scale * st.s_ex
        m_safe = torch.where(m_new > -torch.inf, m_new, torch.zeros_like(m_new)).float()
        d = z.sub_(m_safe[:, None])
        e = d.exp()
        st.s_ex += e.sum(1, dtype=torch.float64)
        if with_entropy:
            st.s2_ex += (e * d.clamp_(min=_NEG_CLAMP)).sum(1, dtype=torch.float64)
        if st.acc is not None:
            st.acc.mul_(scale.float()[:, None])
            gemm.matmul_f32(e, chunk.weight(0), out=st.acc, accumulate=True)
        st.m = m_new
        del z, d, e
        if not chunk.last:
            return
        lp, lse_r, ent, total = finalize_rows(st.m, st.s_ex, st.s2_ex, st.z_a)
        chunk.put(out.logprob, lp.float())
        chunk.put(out.lse, lse_r.float())
        if with_entropy:
            chunk.put(out.entropy, ent.float())
        if st.acc is not None:
            w_a = weight.index_select(0, st.tgt).to(torch.float32)
            s_ex, tot = (st.s_ex / total)[:, None].float(), total.float()[:, None]
            chunk.put(out.projection, ((s_ex * w_a - st.acc / tot) * inv_temp).to(hidden.dtype))

    run_chunks([Head(hidden, weight, bias)], rows, math, chunk_rows=chunk_size or rows.n,
               chunk_vocab=vocab_block)  # fmt: skip
    return out


def chunked_bwd(
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
) -> FusedLinearLogprobOpGrads:
    """Gradients in ``hidden``, ``weight``, ``bias`` (an empty ``[0]`` where not needed).

    With a projection (``proj`` non-empty) ``d_hidden = grad_logprob * P``. Otherwise every
    chunk is recomputed and (docs/math.md, section 6)
    ``G = (u (1[j = a] - p_j) - v p_j (log p_j + H)) / T``, the target entry with
    ``1 - p_a = -expm1(log p_a)``; ``grad_entropy`` (``v``) may be empty (no entropy gradient).
    """
    n_h, n_w, n_b = needs
    rows = Rows(targets, ignore_index)
    if proj.numel():
        d_h = torch.zeros(proj.shape, dtype=torch.float32, device=proj.device)
        if n_h and rows.n:
            u = grad_logprob.index_select(0, rows.index).float()[:, None]
            d_h.index_copy_(0, rows.index, u * proj.index_select(0, rows.index).float())
        empty = proj.new_empty(0)
        hidden_grad = d_h.to(proj.dtype) if n_h else empty
        return FusedLinearLogprobOpGrads(hidden_grad, empty.new_empty(0), empty.new_empty(0))
    head = Head(hidden, weight, bias)
    grads = HeadGrads.alloc(head, n_h, n_w, n_b)
    inv_temp = 1.0 / temperature
    use_h = grad_entropy.numel() > 0
    state: list[dict[str, Tensor]] = []

    def math(chunk: Chunk) -> None:
        if chunk.first:
            names = {"tgt": targets, "u": grad_logprob, "lse": lse, "lp": logprob}
            if use_h:
                names |= {"v": grad_entropy, "ent": entropy}
            st = {k: chunk.take(x) for k, x in names.items()}
            st["tgt"], st["u"] = st["tgt"].long(), st["u"].float()
            if use_h:
                st["v"] = st["v"].float()
            state[:] = [st]
        st = state[0]
        u = st["u"]
        g = chunk.logits(0).mul_(inv_temp)
        d = g.sub_(st["lse"][:, None])
        p = d.exp()
        if use_h:
            # -p (u + v (log p + H)); the clamp keeps 0 * (-inf) out at -inf logits
            coef = d.clamp_(min=_NEG_CLAMP).add_(st["ent"][:, None]).mul_(st["v"][:, None])
            g = p.mul_(coef.add_(u[:, None]))
        else:
            g = p.mul_(u[:, None])
        g.neg_()
        hit, col = _in_chunk(st["tgt"], chunk.v0, chunk.v1)
        if hit.numel():
            lp_a, u_a = st["lp"][hit], u[hit]
            g_a = -u_a * torch.expm1(lp_a)
            if use_h:
                g_a = g_a - st["v"][hit] * lp_a.exp() * (lp_a + st["ent"][hit])
            g[hit, col] = g_a
        chunk.backprop(0, g.mul_(inv_temp))

    if n_h or n_w or n_b:
        run_chunks([head], rows, math, chunk_rows=chunk_size or rows.n, chunk_vocab=vocab_block,
                   grads=[grads])  # fmt: skip

    def cast(g: Tensor | None, like: Tensor) -> Tensor:
        return lse.new_empty(0) if g is None else g.to(like.dtype)

    return FusedLinearLogprobOpGrads(
        cast(grads.hidden, hidden), cast(grads.weight, weight), cast(grads.bias, weight)
    )
