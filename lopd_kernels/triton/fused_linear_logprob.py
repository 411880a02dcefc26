"""Launchers of the Triton fused LM head + token log-probability kernels, and the PyTorch merge of
the forward's vocabulary splits.

The kernels: ``lopd_kernels/triton/fused_linear_logprob_kernels.py``;
:mod:`lopd_kernels.fused_linear_logprob` registers these launchers as
``torch.ops.lopd.fused_linear_logprob_triton_fwd`` / ``..._bwd``. The Triton implementation keeps
no gradient projection (its backward recomputes the logit tiles): ``projection`` is ignored.
"""

from __future__ import annotations

import torch
import triton

from lopd_kernels.fused_linear_logprob_chunked import finalize_rows
from lopd_kernels.topk_tail_kl_checks import check_targets_in_range
from lopd_kernels.triton._common import interpreting, upcast_for_interpreter
from lopd_kernels.triton.fused_linear_logprob_kernels import _bwd_kernel, _fwd_kernel


def _config(dtype: torch.dtype) -> dict:
    """Tile sizes: GPU-sized on a device, the smallest legal ``tl.dot`` tiles in the interpreter."""
    if interpreting():
        return {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_D": 16, "num_warps": 1}
    block_d = 64 if dtype == torch.float32 else 128
    return {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": block_d, "num_warps": 8}


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    return ("ieee" if dtype == torch.float32 else "tf32"), upcast_for_interpreter(dtype)


def _packed(hidden, weight, bias, targets, rows):
    h = hidden.index_select(0, rows).contiguous()
    tgt = targets.index_select(0, rows).to(torch.int32).contiguous()
    return h, weight.contiguous(), None if bias is None else bias.contiguous(), tgt


def fused_linear_logprob_fwd_triton(
    hidden, weight, bias, targets, temperature, ignore_index, with_entropy, projection,
    chunk_size, vocab_block,
):  # fmt: skip
    """Launch the forward; same outputs as ``torch.ops.lopd.fused_linear_logprob_cpu_fwd``
    (the projection always ``[0]``)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    check_targets_in_range(targets, vocab, ignore_index, "targets")
    dev = hidden.device
    logprob = torch.zeros(n, dtype=torch.float32, device=dev)
    entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=dev)
    lse = torch.zeros_like(logprob)
    empty = hidden.new_empty(0)
    rows = (targets != ignore_index).nonzero().squeeze(-1)
    nv = rows.numel()
    if nv == 0:
        return logprob, entropy, lse, empty
    h, w, b, tgt = _packed(hidden, weight, bias, targets, rows)
    cfg = _config(hidden.dtype)
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    n_blocks, n_tiles = triton.cdiv(nv, bn), triton.cdiv(vocab, bv)
    if interpreting():
        splits = min(2, n_tiles)
    else:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = max(1, min(n_tiles, triton.cdiv(2 * sms, n_blocks)))
    split_len = triton.cdiv(n_tiles, splits) * bv
    splits = triton.cdiv(vocab, split_len)
    stats = torch.empty(nv, splits, 4, dtype=torch.float32, device=dev)
    precision, upcast = _precision(hidden.dtype)
    _fwd_kernel[(n_blocks, splits)](
        h, w, b if b is not None else w, tgt, stats, nv, vocab, h.shape[1], h.stride(0),
        w.stride(0), split_len, 1.0 / temperature, HAS_B=b is not None, ENTROPY=with_entropy,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=cfg["BLOCK_D"], PRECISION=precision, UPCAST=upcast,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    # Merge the splits in float64: the common maximum, every split's sums rescaled to it.
    st = stats.double()
    m_s, s_s, s2_s, za_s = st.unbind(-1)
    m = m_s.amax(-1)
    seen = m_s > -torch.inf
    m_safe = torch.where(m > -torch.inf, m, torch.zeros_like(m))[:, None]
    scale = torch.where(seen, (m_s - m_safe).exp(), torch.zeros_like(m_s))
    shift = torch.where(seen, m_s - m_safe, torch.zeros_like(m_s))
    s_ex = (scale * s_s).sum(-1)
    s2_ex = (scale * (s2_s + shift * s_s)).sum(-1)
    lp, lse_r, ent, _ = finalize_rows(m, s_ex, s2_ex, za_s.amax(-1))
    logprob.index_copy_(0, rows, lp.float())
    lse.index_copy_(0, rows, lse_r.float())
    if with_entropy:
        entropy.index_copy_(0, rows, ent.float())
    return logprob, entropy, lse, empty


def fused_linear_logprob_bwd_triton(
    grad_logprob, grad_entropy, hidden, weight, bias, targets, logprob, entropy, lse, proj,
    temperature, ignore_index, chunk_size, vocab_block, needs,
):  # fmt: skip
    """Launch the backward; returns ``[d_hidden, d_weight, d_bias]`` (None if unneeded).

    Gradients accumulate in fp32 buffers (atomics) and are cast to the input dtypes at the end.
    """
    n_h, n_w, n_b = needs
    dev, vocab, d = hidden.device, weight.shape[0], hidden.shape[1]
    rows = (targets != ignore_index).nonzero().squeeze(-1)
    nv = rows.numel()
    f32 = torch.float32
    d_w = torch.zeros(weight.shape, dtype=f32, device=dev) if n_w else None
    d_b = torch.zeros(vocab, dtype=f32, device=dev) if n_b else None
    dh = torch.zeros(nv, d, dtype=f32, device=dev) if n_h else None
    with_v = grad_entropy.numel() > 0
    if nv and (n_h or n_w or n_b):
        h, w, b, tgt = _packed(hidden, weight, bias, targets, rows)
        u = grad_logprob.index_select(0, rows).float()
        lp = logprob.index_select(0, rows)
        rowp = torch.zeros(nv, 8, dtype=f32, device=dev)
        rowp[:, 0], rowp[:, 1] = lse.index_select(0, rows), u
        g_a = -u * torch.expm1(lp)  # u (1 - p_a), exact for a sure target
        if with_v:
            v = grad_entropy.index_select(0, rows).float()
            ent = entropy.index_select(0, rows)
            rowp[:, 2], rowp[:, 3] = v, ent
            g_a = g_a - torch.where(lp > -torch.inf, v * lp.exp() * (lp + ent), 0.0)
        rowp[:, 4] = g_a
        cfg = _config(hidden.dtype)
        bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
        precision, upcast = _precision(hidden.dtype)
        _bwd_kernel[(triton.cdiv(nv, bn), triton.cdiv(vocab, bv))](
            h, w, b if b is not None else w, tgt, rowp, dh if dh is not None else rowp,
            d_w if d_w is not None else rowp, d_b if d_b is not None else rowp, nv, vocab, d,
            h.stride(0), w.stride(0), 1.0 / temperature, HAS_B=b is not None, ENTROPY=with_v,
            NEED_DH=bool(n_h), NEED_DW=bool(n_w), NEED_DB=bool(n_b), BLOCK_N=bn, BLOCK_V=bv,
            BLOCK_D=cfg["BLOCK_D"], PRECISION=precision, UPCAST=upcast,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    d_h = None
    if dh is not None:
        d_h = dh.new_zeros(hidden.shape).index_copy_(0, rows, dh).to(hidden.dtype)
    return [
        d_h,
        None if d_w is None else d_w.to(weight.dtype),
        None if d_b is None else d_b.to(weight.dtype),
    ]
