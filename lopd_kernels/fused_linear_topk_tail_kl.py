"""Fused LM head + top-M/tail KL: distillation that never materializes [tokens x vocab] logits.

``fused_linear_topk_tail_kl`` computes exactly what ``topk_tail_kl`` computes on the logits
``s = h_s W_s^T (+ b_s)`` and ``t = h_t W_t^T (+ b_t)`` (same five outputs, same gradients; see
``/work/shared/design/math.md``), but takes the final hidden states and the LM heads instead of the
logits, so the ``[N, V]`` logits of both models and their gradients never exist in memory at once:

- **chunked** (``"cpu"``, ``"cuda"``, and ``"auto"``): the forward walks token chunks, computes
  the two ``[C, V]`` logit blocks with one vendor GEMM each (MKL / cuBLAS), runs the per-row
  ``topk_tail_kl_fwd`` kernel on them and keeps only O(M) per row (top-M ids, both
  log-sum-exps, the M+1 bucket log-masses). The backward recomputes a side's chunk logits, runs
  ``topk_tail_kl_bwd`` on the chunk and accumulates ``dh = ds @ W`` and ``dW += ds^T h`` (fp32).
  Peak memory is a few ``[C, V]`` blocks; ``C`` comes from the free memory (``chunk_size=``
  overrides it).
- **frozen heads**: when a side's head (and bias) needs no gradient but its hidden states do (a
  LoRA student, a frozen teacher whose activations carry the composer's gradient), the forward
  also keeps that side's *tail projection* ``sum_{j not in top-M} softmax_j W[j]`` ([N, d]).
  The logit gradient is ``S_j * c[b(j)]`` with one coefficient per bucket, so ``dh`` is the tail
  projection times the tail coefficient plus M + 1 rows of ``W``: the backward skips that side's
  logit recompute and its dh GEMM (one extra GEMM in the forward instead of two in the backward).
- **triton** (``backend="triton"``; GPU, or ``TRITON_INTERPRET=1``): one kernel that tiles
  tokens x vocabulary, keeps the logit tile in registers and streams the tail log-sum-exps and
  the running teacher top-M; see ``lopd_kernels/triton/fused_linear_topk_tail_kl.py``.

Rows whose target is ``ignore_index`` are dropped before any matmul: only real targets cost
anything. Logits are always formed in float32 (the GEMMs accumulate in fp32 whatever the input
dtype) and weight gradients accumulate in float32 across token chunks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from lopd_kernels._backend import check_backend, has_cpp_op, triton_available
from lopd_kernels.topk_tail_kl import (
    TopKTailKLOutput,
    teacher_topk_mass,
    topk_tail_kl_reference,
)

__all__ = [
    "auto_chunk_rows",
    "causal_lm_topk_tail_kl",
    "fused_linear_topk_tail_kl",
    "fused_linear_topk_tail_kl_reference",
    "lm_head_topk_tail_kl",
]

_DIVERGENCES = ("reverse", "forward")

# Working-set cap for the chunked path's [C, V] blocks. 256 MiB is C ~ 220 rows of a 152k
# vocabulary per live block pair: CPU GEMMs of that height run within ~20% of their large-M
# throughput (~100 rows are ~35% slower, measured on 2 cores), and it keeps the op ~1/20 of the
# materialized logits at N = 2048. On a GPU 512 MiB is ~440 rows of fp32 logits per block pair,
# a ~0.5 TFLOP GEMM at d = 4096: large enough for cuBLAS to run near peak.
_CHUNK_BUDGET_CAP = {"cpu": 256 << 20, "cuda": 512 << 20}
# fp32 bytes of one weight slab upcast at a time when the head is bf16/fp16 (see _matmul_f32).
_SLAB_BYTES = 64 << 20


# ----------------------------------------------------------------------------------------------
# PyTorch twins of the per-row topk_tail_kl kernels (same outputs from the same inputs): the
# chunked path's fallback where the compiled kernels are missing (a pure-Python install).
# ----------------------------------------------------------------------------------------------


def _effective_m(top_m: int, vocab: int) -> int:
    """Number of top buckets M; 0 (the full-vocabulary KL) for ``top_m`` 0 or ``>= V``, as in
    ``topk_tail_kl``."""
    return 0 if top_m == 0 or top_m >= vocab else top_m


def _xlogx_ratio(logp: Tensor, logq: Tensor) -> Tensor:
    """``exp(logp) * (logp - logq)`` with the convention ``0 * anything = 0`` (never NaN)."""
    p = logp.exp()
    return p * torch.where(p > 0, logp - logq, torch.zeros_like(p))


def _rows_math(
    s: Tensor, t: Tensor, target: Tensor, top_m: int, temperature: float, reverse: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Top-M + tail KL of every row of a logit block (no autograd: ``_rows_bwd_torch`` is the
    closed-form backward; the differentiable oracle is ``topk_tail_kl_reference``).

    Args:
        s, t: ``[R, V]`` logits (float32 or float64; all rows have a real target).
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
    m = _effective_m(top_m, s.shape[-1])
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


def _rows_fwd_torch(
    s: Tensor,
    t: Tensor,
    target: Tensor,
    top_m: int,
    temperature: float,
    reverse: bool,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch twin of ``torch.ops.lopd.topk_tail_kl_fwd`` (same outputs, ignored rows zero)."""
    n, vocab = s.shape
    m = _effective_m(top_m, vocab)
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


def _rows_bwd_torch(
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
    """PyTorch twin of ``torch.ops.lopd.topk_tail_kl_bwd``: the closed-form logit gradients.

    With ``g_b = log P_b - log Q_b`` and ``b(j)`` the bucket of entry ``j`` (reverse KL)::

        ds_j = (S_j * (u_kl (g_b(j) - KL) - u_ls) + u_ls 1[j = a]) / T
        dt_j = (T_j * (u_kl (1 - P_b(j) / Q_b(j)) - u_lt) + u_lt 1[j = a]) / T

    so each row needs one coefficient per bucket (M + 1 numbers) and one pass over the logits.
    """
    valid = (target != ignore_index).unsqueeze(-1)
    tgt = target.clamp(0, s.shape[-1] - 1).unsqueeze(-1)
    u_kl = torch.where(valid, grad_kl.float().unsqueeze(-1), 0.0)
    m = topk_ids.shape[-1]
    logp, logq = bucket_logp[:, 0], bucket_logp[:, 1]
    g = logp - logq

    def bucket_coef(coef: Tensor, block: Tensor) -> Tensor:
        # Spread [R, M+1] bucket coefficients over [R, V]: tail everywhere, then the top-M ids.
        if m == 0:
            return coef.expand_as(block).clone()
        out = coef[:, m:].expand_as(block).clone()
        return out.scatter_(-1, topk_ids, coef[:, :m])

    def side(x: Tensor, lse_x: Tensor, u: Tensor, coef_kl: Tensor) -> Tensor:
        logprob = x.float() / temperature - lse_x.unsqueeze(-1)
        prob = torch.where(valid, logprob.exp(), 0.0)
        grad = prob * (u_kl * coef_kl - u)
        grad.scatter_add_(-1, tgt, u.expand_as(tgt).clone())
        return torch.where(valid, grad / temperature, 0.0).to(x.dtype)

    empty = s.new_empty(0)
    grad_s = grad_t = empty
    if m == 0:
        # Full vocabulary: every entry is its own bucket, so P_b / Q_b = S_j / T_j etc.
        log_s = s.float() / temperature - lse[:, :1]
        log_t = t.float() / temperature - lse[:, 1:]
        g_full = log_s - log_t
        fin = torch.isfinite(g_full)
        if reverse:
            coef_s = torch.where(fin, g_full - kl.unsqueeze(-1), 0.0)
            coef_t = torch.where(fin, 1 - (log_s - log_t).exp(), 0.0)
        else:
            coef_s = torch.where(fin, 1 - (log_t - log_s).exp(), 0.0)
            coef_t = torch.where(fin, -g_full - kl.unsqueeze(-1), 0.0)
    else:
        fin = torch.isfinite(g)
        if reverse:
            coef_s = bucket_coef(torch.where(fin, g - kl.unsqueeze(-1), 0.0), s)
            coef_t = bucket_coef(torch.where(fin, 1 - g.exp(), 0.0), t)
        else:
            coef_s = bucket_coef(torch.where(fin, 1 - (-g).exp(), 0.0), s)
            coef_t = bucket_coef(torch.where(fin, -g - kl.unsqueeze(-1), 0.0), t)
    if student_requires_grad:
        grad_s = side(s, lse[:, 0], torch.where(valid, grad_slp.float().unsqueeze(-1), 0.0), coef_s)
    if teacher_requires_grad:
        grad_t = side(t, lse[:, 1], torch.where(valid, grad_tlp.float().unsqueeze(-1), 0.0), coef_t)
    return grad_s, grad_t


def _kernels_for(device: torch.device) -> tuple[Callable, Callable]:
    """Per-row fwd/bwd on a logit block: the compiled ``topk_tail_kl`` kernels when this device
    has them, on a GPU without them ``topk_tail_kl``'s Triton kernels, else the PyTorch twins
    (a pure-Python install: still memory-bounded, only slower)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    if key and all(
        has_cpp_op(op) and torch._C._dispatch_has_kernel_for_dispatch_key(f"lopd::{op}", key)
        for op in ("topk_tail_kl_fwd", "topk_tail_kl_bwd")
    ):
        return torch.ops.lopd.topk_tail_kl_fwd, torch.ops.lopd.topk_tail_kl_bwd
    if device.type == "cuda" and triton_available():
        return torch.ops.lopd.topk_tail_kl_triton_fwd, torch.ops.lopd.topk_tail_kl_triton_bwd
    return _rows_fwd_torch, _rows_bwd_torch


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def _linear_f32(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``h @ w^T + b`` formed in float32 (float64 stays float64), like the fused kernels."""
    dt = torch.float64 if h.dtype == torch.float64 else torch.float32
    out = h.to(dt) @ w.to(dt).T
    return out if b is None else out + b.to(dt)


def fused_linear_topk_tail_kl_reference(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target_ids: Tensor,
    *,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    ignore_index: int = -100,
) -> TopKTailKLOutput:
    """Materialized reference: the LM-head matmuls, then ``topk_tail_kl_reference`` (autograd).

    Holds both ``[N, V]`` logit tensors (and autograd their gradients): the ground truth every
    backend is tested against, not something to run at scale. Logits are formed in float32
    (float64 inputs stay float64). Arguments as :func:`fused_linear_topk_tail_kl`.
    """
    _check_scalars(top_m, temperature, divergence, ignore_index, "torch", None)
    _check_tensors(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target_ids,
        student_bias, teacher_bias, ignore_index,
    )  # fmt: skip
    return topk_tail_kl_reference(
        _linear_f32(student_hidden, student_weight, student_bias),
        _linear_f32(teacher_hidden, teacher_weight, teacher_bias),
        target_ids.long(),
        top_m=top_m,
        temperature=temperature,
        divergence=divergence,
        ignore_index=ignore_index,
    )


# ----------------------------------------------------------------------------------------------
# Chunked path: token chunks x full vocabulary, ATen GEMMs + per-row kernels
# ----------------------------------------------------------------------------------------------


def _free_memory_bytes(device: torch.device) -> int:
    """Memory the op may use on ``device``: free GPU memory, or MemAvailable on the host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # No way to ask (not Linux, no psutil): assume a modest 4 GiB.
    return 4 << 30


def auto_chunk_rows(
    vocab: int, n_rows: int, device: torch.device | str = "cpu", live_blocks: int = 4
) -> int:
    """Token-chunk size of the chunked path, from the free memory of ``device``.

    The chunk's working set is ``live_blocks`` float32 ``[C, V]`` blocks (forward: the two logit
    blocks; backward: logits and gradient of each side it recomputes), budgeted at a quarter of
    the free memory and at most 256 MiB on CPU / 512 MiB on GPU (``_CHUNK_BUDGET_CAP``).

    Args:
        vocab: ``V``, the LM-head rows.
        n_rows: rows with a real target (the chunk never exceeds it).
        device: where the op runs.
        live_blocks: ``[C, V]`` float32 blocks alive at once.

    Returns:
        ``C >= 1`` (a multiple of 8 when the budget allows one).
    """
    device = torch.device(device)
    cap = _CHUNK_BUDGET_CAP["cuda" if device.type == "cuda" else "cpu"]
    budget = min(_free_memory_bytes(device) // 4, cap)
    rows = budget // (max(live_blocks, 1) * max(vocab, 1) * 4)
    if rows >= 8:
        rows -= rows % 8
    return int(max(1, min(rows, max(n_rows, 1))))


_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _cuda_half_gemm_f32_out() -> bool:
    """Whether cuBLAS half-precision GEMMs can write float32 here (``mm(..., out_dtype=)``)."""
    try:
        x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _matmul_f32(
    a: Tensor, b: Tensor, out: Tensor | None = None, accumulate: bool = False
) -> Tensor:
    """``a @ b`` (or ``out += a @ b``) into float32, for ``a [R, K]``, ``b [K, C]``.

    float32 operands go straight to one GEMM. With a half-precision ``b`` on a GPU, ``a`` is
    cast to ``b``'s dtype (as autograd's bf16 matmuls do) and tensor-core GEMMs write float32
    (``out_dtype``), accumulating in slabs of ``out``'s rows. Otherwise (CPU) half operands are
    upcast one slab of ``b``'s columns at a time, so a bf16 LM head is never copied to float32
    whole.
    """
    rows, cols = a.shape[0], b.shape[1]
    f32 = torch.float64 if a.dtype == torch.float64 else torch.float32
    if a.is_cuda and b.dtype in _HALF and _cuda_half_gemm_f32_out():
        a_h = a.to(b.dtype)
        if out is None:
            return torch.mm(a_h, b, out_dtype=torch.float32)
        slab = max(1, _SLAB_BYTES // (4 * max(cols, 1)))
        for r0 in range(0, rows, slab):
            r1 = min(rows, r0 + slab)
            part = torch.mm(a_h[r0:r1], b, out_dtype=torch.float32)
            if accumulate:
                out[r0:r1] += part
            else:
                out[r0:r1] = part
        return out
    if out is None:
        out = torch.empty(rows, cols, dtype=f32, device=a.device)
        accumulate = False
    if a.dtype == f32 and b.dtype == f32:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    a32 = a.to(f32)
    slab = max(1, _SLAB_BYTES // (4 * max(b.shape[0], 1)))
    for c0 in range(0, cols, slab):
        c1 = min(cols, c0 + slab)
        dst = out[:, c0:c1]
        if accumulate:
            dst.addmm_(a32, b[:, c0:c1].to(f32))
        else:
            torch.mm(a32, b[:, c0:c1].to(f32), out=dst)
    return out


def _logits_block(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``[C, V]`` float32 logits of one token chunk."""
    out = _matmul_f32(h, w.T)
    if b is not None:
        out += b.to(out.dtype)
    return out


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield start, min(n, start + chunk)


def bucket_coefs(
    u_kl: Tensor, kl: Tensor, bucket_logp: Tensor, reverse: bool, u_ls: Tensor, u_t: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-bucket backward coefficients of the top-M + tail KL (``math.md``, "Gradients").

    Args:
        u_kl, u_ls, u_t: ``[R]`` upstream gradients of the KL, the student log-prob and the
            teacher log-prob (privilege included).
        kl: ``[R]`` the forward KL; bucket_logp: ``[R, 2, M+1]`` (log P_b, log Q_b).

    Returns:
        ``c_s, c_t [R, M+1]`` (index M: the tail) such that, with ``b(j)`` the bucket of ``j``,
        ``d/ds_j = (S_j c_s[b(j)] + u_ls 1[j = a]) / T`` and ``d/dt_j = (T_j c_t[b(j)] +
        u_t 1[j = a]) / T``. A bucket with zero (or infinite-ratio) mass gets 0.
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


def _chunked_fwd(
    hs: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    ht: Tensor,
    wt: Tensor,
    bt: Tensor | None,
    target: Tensor,
    top_m: int,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    chunk_size: int,
    tail_proj: tuple[bool, bool],
) -> tuple[Tensor, ...]:
    """Token-chunked forward; ``tail_proj[x]`` also returns side x's tail projection (below)."""
    n, vocab = hs.shape[0], ws.shape[0]
    m = _effective_m(top_m, vocab)
    dev = hs.device
    kl = torch.zeros(n, dtype=torch.float32, device=dev)
    lp_s, lp_t = torch.zeros_like(kl), torch.zeros_like(kl)
    ids = torch.zeros(n, m, dtype=torch.long, device=dev)
    lse = kl.new_zeros(n, 2)
    bucket = kl.new_zeros(n, 2, m + 1)
    projs = [
        kl.new_zeros(n, h.shape[1]) if flag and m > 0 else kl.new_empty(0)
        for flag, h in zip(tail_proj, (hs, ht))
    ]
    rows = (target != ignore_index).nonzero().squeeze(-1)
    n_valid = rows.numel()
    if n_valid == 0:
        return kl, lp_s, lp_t, ids, lse, bucket, *projs
    fwd, _ = _kernels_for(dev)
    chunk = chunk_size or auto_chunk_rows(vocab, n_valid, dev, live_blocks=2)
    for c0, c1 in _chunks(n_valid, chunk):
        r = rows[c0:c1]
        s = _logits_block(hs.index_select(0, r), ws, bs)
        t = _logits_block(ht.index_select(0, r), wt, bt)
        out = fwd(s, t, target.index_select(0, r), m, temperature, reverse, ignore_index)
        for dst, src in zip((kl, lp_s, lp_t, ids, lse, bucket), out):
            dst.index_copy_(0, r, src.to(dst.dtype))
        # Tail projection sum_{j not in top-M} softmax_j W[j] ([C, d]): with it the backward
        # gets this side's dh from O(M) rows of W, without recomputing its logits (see
        # _hidden_grad_from_tail). In place: the logits are not needed any more.
        for x, logits, w, proj in ((0, s, ws, projs[0]), (1, t, wt, projs[1])):
            if proj.numel():
                probs = logits.div_(temperature).sub_(out[4][:, x : x + 1]).exp_()
                probs.scatter_(1, out[3], 0.0)
                proj.index_copy_(0, r, _matmul_f32(probs, w))
        del s, t
    return kl, lp_s, lp_t, ids, lse, bucket, *projs


def _hidden_grad_from_tail(
    proj: Tensor,
    w: Tensor,
    rows: Tensor,
    target: Tensor,
    ids: Tensor,
    log_mass: Tensor,
    coef: Tensor,
    u: Tensor,
    temperature: float,
    out: Tensor,
) -> None:
    """``out[rows] = dh`` of one side from its forward tail projection, without its logits.

    The bucket coefficient is constant over the tail, so ``dh = sum_j ds_j W[j]`` is
    ``(c[tail] * proj + sum_{i in top-M} c[i] P_i W[i] + u W[a]) / T``: M + 1 rows of ``W`` per
    token instead of a ``[C, V] x [V, d]`` GEMM. Exact (the tail part is summed directly in the
    forward, not as the full softmax average minus the top-M).

    Args:
        proj: ``[R, d]`` tail projections of the rows; w: ``[V, d]``.
        rows: ``[R]`` positions in ``out``; target: ``[R]``; ids: ``[R, M]``.
        log_mass: ``[R, M+1]`` this side's bucket log-masses; coef: ``[R, M+1]``; u: ``[R]``.
        out: ``[N, d]`` float32 hidden-state gradient, written at ``rows``.
    """
    m, d = ids.shape[1], w.shape[1]
    # Bound the [C, M, d] gather of head rows to ~64 MiB.
    chunk = max(1, (64 << 20) // max(1, 4 * (m + 1) * d))
    for c0, c1 in _chunks(rows.numel(), chunk):
        w_top = w[ids[c0:c1]].to(out.dtype)  # [C, M, d]
        top = torch.bmm((coef[c0:c1, :m] * log_mass[c0:c1, :m].exp()).unsqueeze(1), w_top)
        dh = coef[c0:c1, m:] * proj[c0:c1] + top.squeeze(1)
        dh += u[c0:c1, None] * w[target[c0:c1]].to(out.dtype)
        out.index_copy_(0, rows[c0:c1], dh / temperature)


def _chunked_bwd(
    grad_kl: Tensor,
    grad_slp: Tensor,
    grad_tlp: Tensor,
    hs: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    ht: Tensor,
    wt: Tensor,
    bt: Tensor | None,
    target: Tensor,
    topk_ids: Tensor,
    kl: Tensor,
    lse: Tensor,
    bucket: Tensor,
    proj_s: Tensor,
    proj_t: Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    chunk_size: int,
    needs: tuple[bool, bool, bool, bool, bool, bool],
    shared_weight: bool,
) -> list[Tensor | None]:
    """Gradients ``[d_hs, d_ws, d_bs, d_ht, d_wt, d_bt]`` (None where not needed).

    A side with a tail projection (``proj_*`` non-empty) gets ``dh`` from it; the other sides
    recompute their chunk logits and run ``topk_tail_kl_bwd``. Weight and bias gradients
    accumulate in float32 over the token chunks. With ``shared_weight`` (one head for both
    models) both sides accumulate into one buffer, returned in the student's slot.
    """
    n_hs, n_ws, n_bs, n_ht, n_wt, n_bt = needs
    vocab, dev = ws.shape[0], hs.device
    f32 = torch.float64 if hs.dtype == torch.float64 else torch.float32
    d_hs = torch.zeros(hs.shape, dtype=f32, device=dev) if n_hs else None
    d_ht = torch.zeros(ht.shape, dtype=f32, device=dev) if n_ht else None
    d_ws = torch.zeros(ws.shape, dtype=f32, device=dev) if n_ws else None
    d_wt = d_ws if shared_weight and n_wt else None
    if n_wt and d_wt is None:
        d_wt = torch.zeros(wt.shape, dtype=f32, device=dev)
    d_bs = torch.zeros(vocab, dtype=f32, device=dev) if n_bs else None
    d_bt = torch.zeros(vocab, dtype=f32, device=dev) if n_bt else None
    rows = (target != ignore_index).nonzero().squeeze(-1)
    from_tail_s = bool(n_hs and proj_s.numel())
    from_tail_t = bool(n_ht and proj_t.numel())
    if rows.numel() and (from_tail_s or from_tail_t):
        tgt = target.index_select(0, rows)
        b = bucket.index_select(0, rows)
        u_ls = grad_slp.index_select(0, rows).float()
        u_t = grad_tlp.index_select(0, rows).float()
        u_kl = grad_kl.index_select(0, rows).float()
        c_s, c_t = bucket_coefs(u_kl, kl.index_select(0, rows), b, reverse, u_ls, u_t)
        ids = topk_ids.index_select(0, rows)
        for flag, proj, w, x, coef, u, out in (
            (from_tail_s, proj_s, ws, 0, c_s, u_ls, d_hs),
            (from_tail_t, proj_t, wt, 1, c_t, u_t, d_ht),
        ):
            if flag:
                p = proj.index_select(0, rows)
                _hidden_grad_from_tail(p, w, rows, tgt, ids, b[:, x], coef, u, temperature, out)
    need_s = (n_hs and not from_tail_s) or n_ws or n_bs
    need_t = (n_ht and not from_tail_t) or n_wt or n_bt
    if rows.numel() and (need_s or need_t):
        _, bwd = _kernels_for(dev)
        full_vocab = topk_ids.shape[1] == 0
        sides = 2 if full_vocab else int(bool(need_s)) + int(bool(need_t))
        # Per recomputed side: its logit block and its gradient block.
        chunk = chunk_size or auto_chunk_rows(vocab, rows.numel(), dev, live_blocks=2 * sides)
        for c0, c1 in _chunks(rows.numel(), chunk):
            r = rows[c0:c1]
            h_s, h_t = hs.index_select(0, r), ht.index_select(0, r)
            # With M > 0 a side's logit gradient reads only its own logits (the coupling through
            # the KL is in the saved bucket log-masses), so a side with nothing to compute is
            # not recomputed: the kernel gets the other side's block in its place and never
            # reads it. The full-vocabulary KL couples every entry: both are needed.
            s = _logits_block(h_s, ws, bs) if need_s or full_vocab else None
            t = _logits_block(h_t, wt, bt) if need_t or full_vocab else s
            s = t if s is None else s
            g_s, g_t = bwd(
                grad_kl.index_select(0, r).float(),
                grad_slp.index_select(0, r).float(),
                grad_tlp.index_select(0, r).float(),
                s,
                t,
                target.index_select(0, r),
                topk_ids.index_select(0, r),
                kl.index_select(0, r),
                lse.index_select(0, r),
                bucket.index_select(0, r),
                temperature,
                reverse,
                ignore_index,
                bool(need_s),
                bool(need_t),
            )
            del s, t
            for grad, h, w, d_h, d_w, d_b in (
                (g_s, h_s, ws, None if from_tail_s else d_hs, d_ws, d_bs),
                (g_t, h_t, wt, None if from_tail_t else d_ht, d_wt, d_bt),
            ):
                if grad.numel() == 0:
                    continue
                if d_h is not None:
                    d_h.index_copy_(0, r, _matmul_f32(grad, w))
                if d_w is not None:
                    # dW[V, d] += ds^T [V, C] @ h [C, d]: one GEMM per chunk, fp32 accumulator.
                    _matmul_f32(grad.T, h, out=d_w, accumulate=True)
                if d_b is not None:
                    d_b += grad.sum(0)
            del g_s, g_t
    return [
        None if g is None else g.to(like.dtype)
        for g, like in (
            (d_hs, hs),
            (d_ws, ws),
            (d_bs, ws),
            (d_ht, ht),
            (None if shared_weight else d_wt, wt),
            (d_bt, wt),
        )
    ]


# ----------------------------------------------------------------------------------------------
# Custom ops + autograd
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("lopd::fused_linear_topk_tail_kl_fwd", mutates_args=())
def _fwd_op(
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    target_ids: Tensor,
    top_m: int,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    chunk_size: int,
    impl: str,
    tail_proj: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward on hidden states, ``impl`` ``"chunked"`` or ``"triton"``.

    Returns ``kl, student_logprob, teacher_logprob [N]``, ``topk_ids [N, M]``, ``lse [N, 2]``,
    ``bucket_logp [N, 2, M+1]`` (as ``topk_tail_kl_fwd``) and the student's / teacher's tail
    projections ``[N, d]`` float32 where ``tail_proj`` asks for them (chunked, M > 0), else
    ``[0]``: ``sum_{j not in top-M} softmax(x / T)_j W[j]``, which gives that side's hidden-state
    gradient in the backward without recomputing its logits.
    """
    args = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight)
    args += (teacher_bias, target_ids, top_m, temperature, reverse, ignore_index)
    if impl == "triton":
        from lopd_kernels.triton.fused_linear_topk_tail_kl import fused_linear_fwd_triton

        empty = student_hidden.new_empty(0, dtype=torch.float32)
        return (*fused_linear_fwd_triton(*args), empty, empty.clone())
    return _chunked_fwd(*args, chunk_size, (tail_proj[0], tail_proj[1]))


@_fwd_op.register_fake
def _(
    student_hidden,
    student_weight,
    student_bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    target_ids,
    top_m,
    temperature,
    reverse,
    ignore_index,
    chunk_size,
    impl,
    tail_proj,
):
    n = student_hidden.shape[0]
    m = _effective_m(top_m, student_weight.shape[0])
    kl = student_hidden.new_empty(n, dtype=torch.float32)
    ids = student_hidden.new_empty(n, m, dtype=torch.long)
    lse = kl.new_empty(n, 2)
    projs = [
        kl.new_empty(n, h.shape[1]) if flag and m > 0 and impl == "chunked" else kl.new_empty(0)
        for flag, h in zip(tail_proj, (student_hidden, teacher_hidden))
    ]
    bucket = kl.new_empty(n, 2, m + 1)
    return kl, torch.empty_like(kl), torch.empty_like(kl), ids, lse, bucket, *projs


@torch.library.custom_op("lopd::fused_linear_topk_tail_kl_bwd", mutates_args=())
def _bwd_op(
    grad_kl: Tensor,
    grad_student_logprob: Tensor,
    grad_teacher_logprob: Tensor,
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    target_ids: Tensor,
    topk_ids: Tensor,
    kl: Tensor,
    lse: Tensor,
    bucket_logp: Tensor,
    student_tail_proj: Tensor,
    teacher_tail_proj: Tensor,
    temperature: float,
    reverse: bool,
    ignore_index: int,
    chunk_size: int,
    impl: str,
    needs: list[bool],
    shared_weight: bool,
) -> list[Tensor]:
    """Backward: ``[d_student_hidden, d_student_weight, d_student_bias, d_teacher_hidden,
    d_teacher_weight, d_teacher_bias]``; an entry not in ``needs`` (or the teacher weight when
    ``shared_weight``, whose gradient is summed into the student's) is an empty ``[0]`` tensor."""
    args = (grad_kl, grad_student_logprob, grad_teacher_logprob, student_hidden, student_weight)
    args += (student_bias, teacher_hidden, teacher_weight, teacher_bias, target_ids, topk_ids)
    args += (kl, lse, bucket_logp)
    scalars = (temperature, reverse, ignore_index)
    if impl == "triton":
        from lopd_kernels.triton.fused_linear_topk_tail_kl import fused_linear_bwd_triton

        grads = fused_linear_bwd_triton(*args, *scalars, tuple(needs), shared_weight)
    else:
        projs = (student_tail_proj, teacher_tail_proj)
        grads = _chunked_bwd(*args, *projs, *scalars, chunk_size, tuple(needs), shared_weight)
    # One fresh empty per unused slot: a custom op's outputs must not alias each other.
    return [student_hidden.new_empty(0) if g is None else g for g in grads]


@_bwd_op.register_fake
def _(
    grad_kl,
    grad_student_logprob,
    grad_teacher_logprob,
    student_hidden,
    student_weight,
    student_bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    target_ids,
    topk_ids,
    kl,
    lse,
    bucket_logp,
    student_tail_proj,
    teacher_tail_proj,
    temperature,
    reverse,
    ignore_index,
    chunk_size,
    impl,
    needs,
    shared_weight,
):
    likes = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight)
    likes += (teacher_bias,)
    out = []
    for i, (need, like) in enumerate(zip(needs, likes)):
        skip = not need or like is None or (i == 4 and shared_weight)
        out.append(student_hidden.new_empty(0) if skip else torch.empty_like(like))
    return out


def _setup_context(ctx, inputs, output) -> None:
    hs, ws, bs, ht, wt, bt, target, _top_m, temperature, reverse, ignore, chunk, impl, _ = inputs
    kl, _, _, ids, lse, bucket, proj_s, proj_t = output
    ctx.save_for_backward(hs, ws, bs, ht, wt, bt, target, ids, kl, lse, bucket, proj_s, proj_t)
    ctx.args = (temperature, reverse, ignore, chunk, impl)
    ctx.mark_non_differentiable(ids, lse, bucket, proj_s, proj_t)


def _backward(ctx, g_kl, g_slp, g_tlp, *_unused):
    hs, ws, bs, ht, wt, bt, target, ids, kl, lse, bucket, proj_s, proj_t = ctx.saved_tensors
    temperature, reverse, ignore, chunk, impl = ctx.args
    needs = list(ctx.needs_input_grad[:6])
    zeros = kl.new_zeros(kl.shape)
    g_kl, g_slp, g_tlp = (zeros if g is None else g for g in (g_kl, g_slp, g_tlp))
    shared = ws is wt or (ws.data_ptr() == wt.data_ptr() and ws.shape == wt.shape)
    shared = shared and needs[1] and needs[4] and ws.stride() == wt.stride()
    grads = _bwd_op(
        g_kl, g_slp, g_tlp, hs, ws, bs, ht, wt, bt, target, ids, kl, lse, bucket, proj_s,
        proj_t, temperature, reverse, ignore, chunk, impl, needs, shared,
    )  # fmt: skip
    out = [g if need and g.numel() else None for g, need in zip(grads, needs)]
    if shared and out[1] is None and needs[1]:
        out[1] = torch.zeros_like(ws)
    return (*out, None, None, None, None, None, None, None, None)


torch.library.register_autograd(_fwd_op, _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _check_scalars(
    top_m: int | None,
    temperature: float,
    divergence: str,
    ignore_index: int,
    backend: str,
    chunk_size: int | None,
) -> int:
    """Validate the scalar arguments; return ``top_m`` as an int (0 = full vocabulary)."""
    if top_m is None:
        top_m = 0
    elif isinstance(top_m, bool) or not isinstance(top_m, int) or top_m < 1:
        raise ValueError(f"top_m must be a positive int or None (full vocabulary), got {top_m!r}")
    if not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if divergence not in _DIVERGENCES:
        raise ValueError(f"divergence must be one of {_DIVERGENCES}, got {divergence!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    check_backend(backend)
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None (auto), got {chunk_size!r}")
    return top_m


def _check_tensors(
    hs: Tensor,
    ws: Tensor,
    ht: Tensor,
    wt: Tensor,
    target: Tensor,
    bs: Tensor | None,
    bt: Tensor | None,
    ignore_index: int,
) -> None:
    named = {"student_hidden": hs, "student_weight": ws, "teacher_hidden": ht}
    named |= {"teacher_weight": wt, "target_ids": target}
    named |= {k: v for k, v in (("student_bias", bs), ("teacher_bias", bt)) if v is not None}
    for name, x in named.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != hs.device:
            raise ValueError(f"{name} is on {x.device} but student_hidden is on {hs.device}")
        if name != "target_ids" and not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    for name, x in (("student_hidden", hs), ("student_weight", ws)):
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    for name, x in (("teacher_hidden", ht), ("teacher_weight", wt)):
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    vocab = ws.shape[0]
    if hs.shape[1] != ws.shape[1]:
        raise ValueError(
            f"student_hidden [N, d] = {tuple(hs.shape)} and student_weight [V, d] = "
            f"{tuple(ws.shape)} disagree on d"
        )
    if ht.shape[1] != wt.shape[1]:
        raise ValueError(
            f"teacher_hidden [N, d] = {tuple(ht.shape)} and teacher_weight [V, d] = "
            f"{tuple(wt.shape)} disagree on d"
        )
    if wt.shape[0] != vocab:
        raise ValueError(f"teacher_weight has {wt.shape[0]} vocabulary rows, student {vocab}")
    if vocab == 0:
        raise ValueError("student_weight has an empty vocabulary (V = 0)")
    if ht.shape[0] != hs.shape[0]:
        raise ValueError(f"teacher_hidden has {ht.shape[0]} rows, student_hidden {hs.shape[0]}")
    if hs.dtype != ws.dtype or ht.dtype != wt.dtype:
        raise TypeError(
            "each hidden state must share its weight's dtype, got "
            f"student {hs.dtype}/{ws.dtype}, teacher {ht.dtype}/{wt.dtype}"
        )
    if target.dtype not in (torch.int64, torch.int32) or target.shape != (hs.shape[0],):
        raise ValueError(
            f"target_ids must be int64/int32 of shape [N] = [{hs.shape[0]}], "
            f"got {target.dtype} {tuple(target.shape)}"
        )
    for name, b, w in (("student_bias", bs, ws), ("teacher_bias", bt, wt)):
        if b is not None and b.shape != (vocab,):
            raise ValueError(f"{name} must have shape [V] = [{vocab}], got {tuple(b.shape)}")
        if b is not None and b.dtype != w.dtype:
            raise TypeError(f"{name} must have its weight's dtype {w.dtype}, got {b.dtype}")
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"target_ids must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
            f"got {target[bad][:4].tolist()}"
        )


def _resolve_impl(backend: str, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> str:
    """``"torch"`` (the reference), ``"chunked"`` or ``"triton"`` for this backend and input."""
    triton_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if torch.float64 in dtypes:
        # Only the reference computes in float64 (as for topk_tail_kl).
        if backend in ("auto", "torch"):
            return "torch"
        raise TypeError(
            f"backend={backend!r} computes in float32 and does not accept float64 inputs; use "
            "backend='torch' (the float64 reference) or cast them"
        )
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                "backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1)"
            )
        if any(dt not in triton_dtypes for dt in dtypes):
            raise TypeError(f"backend='triton' supports {triton_dtypes}, got {dtypes}")
        return "triton"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got {device}")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors, got {device}")
    # "cpu", "cuda" and "auto": token chunks with vendor GEMMs (MKL / cuBLAS) + the per-row
    # topk_tail_kl kernels. "auto" does not pick the fully fused Triton kernel on GPUs: its
    # logit tiles are plain tl.dot loops, not yet tuned against cuBLAS (see
    # benchmarks/gpu_fused_linear.py, which measures both).
    return "chunked"


def fused_linear_topk_tail_kl(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target_ids: Tensor,
    *,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    ignore_index: int = -100,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> TopKTailKLOutput:
    """Top-M + tail KL between a student and a teacher, straight from their LM-head inputs.

    Equivalent to ``topk_tail_kl(student_hidden @ student_weight.T + student_bias,
    teacher_hidden @ teacher_weight.T + teacher_bias, target_ids, ...)`` without ever holding the
    ``[N, V]`` logits: see the module docstring for how each backend bounds memory.

    Args:
        student_hidden: ``[N, d_s]`` final hidden states of the student (after its final norm).
        student_weight: ``[V, d_s]`` the student's LM head.
        teacher_hidden: ``[N, d_t]`` the teacher's final hidden states, row-aligned with the
            student's.
        teacher_weight: ``[V, d_t]`` the teacher's LM head; may be the same tensor as
            ``student_weight`` (self-distillation with a shared head).
        target_ids: ``[N]`` int64 sampled token ids; rows equal to ``ignore_index`` output zeros
            and get no gradient (and cost no compute).
        student_bias, teacher_bias: optional ``[V]`` LM-head biases.
        top_m: M, the teacher's top entries kept as buckets (the rest is one tail bucket);
            ``None`` for the full-vocabulary KL.
        temperature: logits are divided by it before every softmax.
        divergence: ``"reverse"`` (KL(student || teacher), the paper's) or ``"forward"``.
        ignore_index: target value marking rows without a target.
        backend: ``"auto"`` (the chunked path; float64 inputs: the reference), ``"torch"``
            (the materialized reference), ``"cpu"``/``"cuda"`` (chunked: vendor GEMMs + the
            ``topk_tail_kl`` kernels per token chunk) or ``"triton"`` (the fully fused kernel).
        chunk_size: token rows per chunk of the chunked path; ``None`` picks it from the free
            memory (:func:`auto_chunk_rows`).

    Returns:
        :class:`TopKTailKLOutput` ``(kl, privilege, student_logprob, teacher_logprob,
        topk_ids, teacher_topk_mass)``. Gradients reach the hidden states, weights and biases
        wherever they require grad; weight gradients are accumulated in float32 and returned in
        the weight's dtype.
    """
    m = _check_scalars(top_m, temperature, divergence, ignore_index, backend, chunk_size)
    hs, ws, ht, wt = student_hidden, student_weight, teacher_hidden, teacher_weight
    _check_tensors(hs, ws, ht, wt, target_ids, student_bias, teacher_bias, ignore_index)
    target = target_ids.long()
    impl = _resolve_impl(backend, hs.device, (hs.dtype, ht.dtype))
    if impl == "torch":
        return fused_linear_topk_tail_kl_reference(
            hs, ws, ht, wt, target,
            student_bias=student_bias, teacher_bias=teacher_bias, top_m=top_m,
            temperature=temperature, divergence=divergence, ignore_index=ignore_index,
        )  # fmt: skip
    m = _effective_m(m, ws.shape[0])

    def tail_proj(h: Tensor, w: Tensor, b: Tensor | None) -> bool:
        # Worth one extra GEMM in the forward when it saves the logit recompute and the dh GEMM
        # in the backward: hidden states need grad, the head (and bias) do not.
        frozen = not w.requires_grad and (b is None or not b.requires_grad)
        return torch.is_grad_enabled() and h.requires_grad and frozen and m > 0

    flags = [tail_proj(hs, ws, student_bias), tail_proj(ht, wt, teacher_bias)]
    if impl != "chunked":
        flags = [False, False]
    kl, lp_s, lp_t, ids, _lse, bucket, *_ = _fwd_op(
        hs, ws, student_bias, ht, wt, teacher_bias, target, m, float(temperature),
        divergence == "reverse", ignore_index, chunk_size or 0, impl, flags,
    )  # fmt: skip
    mass = teacher_topk_mass(bucket, target, ignore_index)
    return TopKTailKLOutput(kl, lp_t - lp_s.detach(), lp_s, lp_t, ids, mass)


# ----------------------------------------------------------------------------------------------
# Hugging Face helpers
# ----------------------------------------------------------------------------------------------


def _head_params(head: torch.nn.Module | Tensor, name: str) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, d], bias [V] | None)`` of an LM head given as a module or a weight tensor."""
    if isinstance(head, Tensor):
        return head, None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor):
        raise TypeError(f"{name} must be an nn.Linear-like module or a [V, d] weight tensor")
    return weight, getattr(head, "bias", None)


def _scatter_rows(values: Tensor, flat_rows: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Put packed per-row values back at their (flattened) positions; zeros elsewhere."""
    full = values.new_zeros((math.prod(shape), *values.shape[1:]))
    return full.index_put((flat_rows,), values).reshape(*shape, *values.shape[1:])


def lm_head_topk_tail_kl(
    student_hidden: Tensor,
    student_head: torch.nn.Module | Tensor,
    teacher_hidden: Tensor,
    teacher_head: torch.nn.Module | Tensor,
    target_ids: Tensor,
    action_mask: Tensor,
    *,
    teacher_action_mask: Tensor | None = None,
    **kwargs,
) -> TopKTailKLOutput:
    """:func:`fused_linear_topk_tail_kl` on the action rows of batched final hidden states.

    Only the ``action_mask`` rows are packed and sent to the op (nothing else is multiplied by the
    LM head). The teacher's sequences may be longer (privileged context, latent slots):
    ``teacher_action_mask`` marks its rows for the same actions, in the same order.

    Args:
        student_hidden: ``[B, L, d_s]`` the student's final hidden states (after the final norm).
        student_head: the student's LM head (``nn.Linear``, e.g. ``get_output_embeddings()``) or
            its ``[V, d_s]`` weight.
        teacher_hidden: ``[B, L_t, d_t]`` the teacher's final hidden states.
        teacher_head: the teacher's LM head or its weight (may be the student's: a shared head).
        target_ids: ``[B, L]`` the token each student position predicts (already shifted).
        action_mask: ``[B, L]`` bool, the student positions to distill.
        teacher_action_mask: ``[B, L_t]`` bool with, per sequence, as many True entries as
            ``action_mask``; defaults to ``action_mask`` (needs ``L_t == L``).
        **kwargs: ``top_m``, ``temperature``, ``divergence``, ``backend``, ``chunk_size``
            (see :func:`fused_linear_topk_tail_kl`).

    Returns:
        The op's outputs laid out like ``action_mask``: ``kl``, ``privilege``, the log-probs as
        ``[B, L]`` (zero off the mask), ``topk_ids`` as ``[B, L, M]``.
    """
    if teacher_action_mask is None:
        teacher_action_mask = action_mask
    masks = {"action_mask": action_mask, "teacher_action_mask": teacher_action_mask}
    for name, mask in masks.items():
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError(f"{name} must be a 2-D [B, L] tensor")
    if student_hidden.dim() != 3 or student_hidden.shape[:2] != action_mask.shape:
        raise ValueError(
            f"student_hidden must be [B, L, d] with [B, L] = action_mask's "
            f"{tuple(action_mask.shape)}, got {tuple(student_hidden.shape)}"
        )
    if teacher_hidden.dim() != 3 or teacher_hidden.shape[:2] != teacher_action_mask.shape:
        raise ValueError(
            f"teacher_hidden must be [B, L_t, d] with [B, L_t] = teacher_action_mask's "
            f"{tuple(teacher_action_mask.shape)}, got {tuple(teacher_hidden.shape)}"
        )
    if target_ids.shape != action_mask.shape:
        raise ValueError(
            f"target_ids must have action_mask's shape {tuple(action_mask.shape)}, "
            f"got {tuple(target_ids.shape)}"
        )
    action_mask, teacher_action_mask = action_mask.bool(), teacher_action_mask.bool()
    if not torch.equal(action_mask.sum(1), teacher_action_mask.sum(1)):
        raise ValueError(
            "teacher_action_mask must mark as many rows per sequence as action_mask, got "
            f"{teacher_action_mask.sum(1).tolist()} vs {action_mask.sum(1).tolist()}"
        )
    ws, bs = _head_params(student_head, "student_head")
    wt, bt = _head_params(teacher_head, "teacher_head")
    rows = action_mask.flatten().nonzero().squeeze(-1)
    t_rows = teacher_action_mask.flatten().nonzero().squeeze(-1)
    out = fused_linear_topk_tail_kl(
        student_hidden.flatten(0, 1).index_select(0, rows),
        ws,
        teacher_hidden.flatten(0, 1).index_select(0, t_rows),
        wt,
        target_ids.flatten().index_select(0, rows),
        student_bias=bs,
        teacher_bias=bt,
        **kwargs,
    )
    shape = tuple(action_mask.shape)
    return TopKTailKLOutput(*(_scatter_rows(x, rows, shape) for x in out))


def _final_hidden(model: torch.nn.Module, inputs: dict) -> Tensor:
    """Final (post-norm) hidden states of a HF causal LM without computing its logits."""
    decoder = model.get_decoder()
    return decoder(**inputs, use_cache=False).last_hidden_state


def causal_lm_topk_tail_kl(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    input_ids: Tensor,
    action_mask: Tensor,
    *,
    attention_mask: Tensor | None = None,
    teacher_inputs: dict | None = None,
    teacher_action_mask: Tensor | None = None,
    **kwargs,
) -> TopKTailKLOutput:
    """Distillation outputs of two HF causal LMs on a batch of trajectories, logits never formed.

    Runs each model's decoder (``model.get_decoder()``) for its final hidden states and feeds
    them with its ``get_output_embeddings()`` head to :func:`lm_head_topk_tail_kl`. Position
    ``j`` of the result belongs to token ``j`` (predicted from position ``j - 1``).

    Args:
        student, teacher: ``transformers`` causal LMs (peft-wrapped ones too); may be the same
            model (self-distillation: pass the privileged context in ``teacher_inputs``).
        input_ids: ``[B, L]`` the student's trajectories.
        action_mask: ``[B, L]`` bool, True on the tokens the student generated (the ones to
            distill).
        attention_mask: ``[B, L]`` the student's attention mask.
        teacher_inputs: keyword arguments of the teacher's decoder (``input_ids`` or
            ``inputs_embeds``, ``attention_mask``, ...); default: the student's inputs.
        teacher_action_mask: ``[B, L_t]`` True on the same action tokens in the teacher's
            sequence; default ``action_mask`` (teacher sequence aligned with the student's).
        **kwargs: as :func:`fused_linear_topk_tail_kl` (``top_m``, ``temperature``, ...).

    Returns:
        :class:`TopKTailKLOutput` with ``[B, L]`` tensors (``[B, L, M]`` ids), zero
        off the action tokens.
    """
    student_inputs = {"input_ids": input_ids}
    if attention_mask is not None:
        student_inputs["attention_mask"] = attention_mask
    if teacher_inputs is None:
        teacher_inputs = student_inputs
    if teacher_action_mask is None:
        teacher_action_mask = action_mask
    hs = _final_hidden(student, student_inputs)
    ht = _final_hidden(teacher, teacher_inputs)
    # Hidden state i predicts token i + 1: drop the last position and the first mask column.
    out = lm_head_topk_tail_kl(
        hs[:, :-1],
        student.get_output_embeddings(),
        ht[:, :-1],
        teacher.get_output_embeddings(),
        input_ids[:, 1:],
        action_mask[:, 1:].bool(),
        teacher_action_mask=teacher_action_mask[:, 1:].bool(),
        **kwargs,
    )
    pad = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (1, 0)) for x in out]
    return TopKTailKLOutput(*pad)
