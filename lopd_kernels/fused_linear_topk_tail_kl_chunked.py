"""The chunked path of ``fused_linear_topk_tail_kl`` (backends ``"cpu"`` and ``"cuda"``).

Token chunks x the full vocabulary: the forward computes each chunk's two ``[C, V]`` logit
blocks with one vendor GEMM each (MKL / cuBLAS), runs a per-row ``topk_tail_kl`` kernel on them
(:func:`epilogue_kernels`: the C++ one on CPU, Triton's or CUDA's on a GPU) and keeps only O(M)
per row (top-M ids, both log-sum-exps, the M+1 bucket log-masses). The backward recomputes a
side's chunk logits, runs the per-row backward on the chunk and accumulates ``dh = ds @ W`` and
``dW += ds^T h`` (fp32). Peak memory is a few ``[C, V]`` blocks; ``C`` comes from the free memory
(:func:`auto_chunk_rows`, ``chunk_size=`` overrides it).

**Frozen heads.** When a side's head (and bias) needs no gradient but its hidden states do (a
LoRA student, a frozen teacher whose activations carry the composer's gradient), the forward also
keeps that side's *tail projection* ``sum_{j not in top-M} softmax_j W[j]`` ([N, d]). The logit
gradient is ``S_j * c[b(j)]`` with one coefficient per bucket, so ``dh`` is the tail projection
times the tail coefficient plus M + 1 rows of ``W``: the backward skips that side's logit
recompute and its dh GEMM (one extra GEMM in the forward instead of two in the backward).

**Variants** (switch ``fused_linear_topk_tail_kl.chunked``, :mod:`lopd_kernels.kernel_variants`;
``v1`` is the previous path, kept until a GPU has timed both). ``v2``: on a GPU the Triton
per-row kernels first (:func:`epilogue_impl`); the tail probabilities in one pass
(:func:`tail_probs`); with a half-precision head on a GPU the logit gradient cast once per chunk
for both GEMMs, and the weight gradient accumulated by one fp32-output ``addmm``
(:func:`lopd_kernels.gemm_f32.accumulate_f32_`). The float32-output GEMMs of half-precision
operands are :mod:`lopd_kernels.gemm_f32`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lopd_kernels import gemm_f32 as gemm
from lopd_kernels._backend import has_kernel, triton_available
from lopd_kernels._constants import CUDA_TOPK_MAX_TOP_M, TRITON_TOPK_MAX_TOP_M
from lopd_kernels._custom_ops import PHASES
from lopd_kernels.bucket_math import (
    bucket_coefs,
    effective_top_m,
    rows_bwd_torch,
    rows_fwd_torch,
    support_width,
)
from lopd_kernels.kernel_variants import variant as selected_variant
from lopd_kernels.topk_tail_kl import CUSTOM_OPS as TOPK_TAIL_KL_OPS
from lopd_kernels.topk_tail_kl import kernel_option_refusal

__all__ = ["auto_chunk_rows", "chunked_bwd", "chunked_fwd", "epilogue_kernels", "tail_probs"]

#: The switch choosing between the previous chunked path (v1) and the current one (v2):
#: lopd_kernels/kernel_variants.py.
CHUNKED_SWITCH = "fused_linear_topk_tail_kl.chunked"

# Working-set cap for the chunked path's [C, V] blocks. 256 MiB is C ~ 220 rows of a 152k
# vocabulary per live block pair: CPU GEMMs of that height run within ~20% of their large-M
# throughput (~100 rows are ~35% slower, measured on 2 cores), and it keeps the op ~1/20 of the
# materialized logits at N = 2048. On a GPU 512 MiB is ~440 rows of fp32 logits per block pair,
# a ~0.5 TFLOP GEMM at d = 4096: large enough for cuBLAS to run near peak.
_CHUNK_BUDGET_CAP = {"cpu": 256 << 20, "cuda": 512 << 20}


# GPU epilogue order per variant: v1 took the CUDA per-row kernels whenever the build had them;
# v2 follows topk_tail_kl's own "auto" on a GPU (Triton first, lopd_kernels/topk_tail_kl.py).
_GPU_EPILOGUE_ORDER = {"v1": ("cuda", "triton"), "v2": ("triton", "cuda")}
_EPILOGUE_MAX_TOP_M = {"cuda": CUDA_TOPK_MAX_TOP_M, "triton": TRITON_TOPK_MAX_TOP_M}


def epilogue_impl(
    device: torch.device,
    top_m: int = 0,
    variant: str | None = None,
    divergence: str = "reverse",
    support: str = "teacher",
) -> str:
    """The implementation word of the per-row epilogue :func:`epilogue_kernels` returns.

    CPU: ``"cpu"`` (the C++ kernels) when built, else ``"torch"``. GPU: the first of
    ``_GPU_EPILOGUE_ORDER[variant]`` that this install has and whose ``top_m`` limit admits
    ``top_m``, else ``"torch"``. An implementation without a kernel for ``support`` /
    ``divergence`` (as the ops take it) is passed over.
    """
    variant = variant or selected_variant(CHUNKED_SWITCH)
    if device.type == "cpu":
        order: tuple[str, ...] = ("cpu",)
    elif device.type == "cuda":
        order = _GPU_EPILOGUE_ORDER[variant]
    else:
        order = ()
    for impl in order:
        if top_m > _EPILOGUE_MAX_TOP_M.get(impl, top_m):
            continue
        if kernel_option_refusal(impl, divergence, support if top_m else "teacher") is not None:
            continue
        if impl == "triton":
            if triton_available():
                return impl
        elif all(has_kernel(TOPK_TAIL_KL_OPS.name(impl, p), impl.upper()) for p in PHASES):
            return impl
    return "torch"


def epilogue_kernels(
    device: torch.device, top_m: int = 0, divergence: str = "reverse", support: str = "teacher"
) -> tuple[Callable, Callable]:
    """Per-row fwd/bwd on a logit block: ``topk_tail_kl``'s kernels of :func:`epilogue_impl`
    (``topk_tail_kl_cpu_*`` on CPU; on a GPU its Triton or CUDA kernels, in the order the
    switch :data:`CHUNKED_SWITCH` selects), else the PyTorch twins (a pure-Python install: still
    memory-bounded, only slower)."""
    impl = epilogue_impl(device, top_m, divergence=divergence, support=support)
    if impl == "torch":
        return rows_fwd_torch, rows_bwd_torch
    return TOPK_TAIL_KL_OPS.ops(impl)


def _free_memory_bytes(device: torch.device) -> int:
    """Memory the op may use on ``device``: free GPU memory, or MemAvailable on the host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        # psutil is optional (/proc/meminfo below serves Linux without it).
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


def tail_probs_triton_ok(logits: Tensor) -> bool:
    """Whether the tail probabilities are computed by the Triton pass (a GPU with Triton)."""
    return logits.is_cuda and triton_available()


def tail_probs(
    logits: Tensor, lse: Tensor, topk_ids: Tensor, temperature: float, out_dtype: torch.dtype
) -> Tensor:
    """``exp(logits / T - lse)`` with each row's top-M entries zeroed, in ``out_dtype`` (v2).

    On a GPU with Triton one pass (:mod:`lopd_kernels.triton.fused_linear_topk_tail_kl_chunked`:
    a float32 read, a write in the GEMM dtype, M zeros per row). Otherwise two PyTorch passes in
    place (``lse`` subtracted with the ``1/T`` scale in one ``add``, then ``exp``), a scatter and,
    when ``out_dtype`` is not float32, a cast. ``logits`` (``[C, V]`` float32) is overwritten.

    Args:
        logits: ``[C, V]`` float32 logit block; lse: ``[C]`` this side's log-sum-exp of
            ``logits / T``; topk_ids: ``[C, M]`` int64.
    """
    if tail_probs_triton_ok(logits):
        # triton is optional (machines without it take the PyTorch passes): imported lazily.
        from lopd_kernels.triton.fused_linear_topk_tail_kl_chunked import tail_probs_triton

        return tail_probs_triton(logits, lse, topk_ids, temperature, out_dtype)
    probs = torch.add(lse.neg()[:, None], logits, alpha=1.0 / temperature, out=logits).exp_()
    probs.scatter_(1, topk_ids, 0.0)
    return probs.to(out_dtype)


def without_padding(ids: Tensor) -> Tensor:
    """``ids [C, K]`` with a union's -1 padding slots replaced by the row's first id (every row
    has one): zeroing or gathering it again changes nothing, and no index is negative."""
    return ids if ids.shape[1] == 0 else torch.where(ids >= 0, ids, ids[:, :1])


def _logits_block(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``[C, V]`` float32 logits of one token chunk."""
    out = gemm.matmul_f32(h, w.T)
    if b is not None:
        out += b.to(out.dtype)
    return out


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield start, min(n, start + chunk)


def chunked_fwd(
    hs: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    ht: Tensor,
    wt: Tensor,
    bt: Tensor | None,
    target: Tensor,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
    chunk_size: int,
    tail_proj: tuple[bool, bool],
) -> tuple[Tensor, ...]:
    """Token-chunked forward; ``tail_proj[x]`` also returns side x's tail projection (below)."""
    n, vocab = hs.shape[0], ws.shape[0]
    m = effective_top_m(top_m, vocab)
    k = support_width(m, support)
    dev = hs.device
    kl = torch.zeros(n, dtype=torch.float32, device=dev)
    lp_s, lp_t = torch.zeros_like(kl), torch.zeros_like(kl)
    ids = torch.zeros(n, k, dtype=torch.long, device=dev)
    lse = kl.new_zeros(n, 2)
    bucket = kl.new_zeros(n, 2, k + 1)
    projs = [
        kl.new_zeros(n, h.shape[1]) if flag and m > 0 else kl.new_empty(0)
        for flag, h in zip(tail_proj, (hs, ht))
    ]
    rows = (target != ignore_index).nonzero().squeeze(-1)
    n_valid = rows.numel()
    if n_valid == 0:
        return kl, lp_s, lp_t, ids, lse, bucket, *projs
    v2 = selected_variant(CHUNKED_SWITCH) == "v2"
    fwd, _ = epilogue_kernels(dev, m, divergence, support)
    chunk = chunk_size or auto_chunk_rows(vocab, n_valid, dev, live_blocks=2)
    for c0, c1 in _chunks(n_valid, chunk):
        r = rows[c0:c1]
        s = _logits_block(hs.index_select(0, r), ws, bs)
        t = _logits_block(ht.index_select(0, r), wt, bt)
        out = fwd(s, t, target.index_select(0, r), m, temperature, divergence, beta, support,
                  ignore_index)  # fmt: skip
        for dst, src in zip((kl, lp_s, lp_t, ids, lse, bucket), out):
            dst.index_copy_(0, r, src.to(dst.dtype))
        # Tail projection sum_{j not in top-M} softmax_j W[j] ([C, d]): with it the backward
        # gets this side's dh from O(M) rows of W, without recomputing its logits (see
        # _hidden_grad_from_tail). In place: the logits are not needed any more.
        for x, logits, w, proj in ((0, s, ws, projs[0]), (1, t, wt, projs[1])):
            if not proj.numel():
                continue
            support_ids = without_padding(out[3])
            if v2:
                gemm_dtype = w.dtype if gemm.half_gemm(w) else logits.dtype
                probs = tail_probs(logits, out[4][:, x], support_ids, temperature, gemm_dtype)
            else:
                probs = logits.div_(temperature).sub_(out[4][:, x : x + 1]).exp_()
                probs.scatter_(1, support_ids, 0.0)
            proj.index_copy_(0, r, gemm.matmul_f32(probs, w))
            del probs
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
    ids = without_padding(ids)  # a padding bucket has mass 0: its row of W adds 0
    m, d = ids.shape[1], w.shape[1]
    # Bound the [C, M, d] gather of head rows to ~64 MiB.
    chunk = max(1, (64 << 20) // max(1, 4 * (m + 1) * d))
    for c0, c1 in _chunks(rows.numel(), chunk):
        w_top = w[ids[c0:c1]].to(out.dtype)  # [C, M, d]
        top = torch.bmm((coef[c0:c1, :m] * log_mass[c0:c1, :m].exp()).unsqueeze(1), w_top)
        dh = coef[c0:c1, m:] * proj[c0:c1] + top.squeeze(1)
        dh += u[c0:c1, None] * w[target[c0:c1]].to(out.dtype)
        out.index_copy_(0, rows[c0:c1], dh / temperature)


def chunked_bwd(
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
    divergence: str,
    beta: float,
    support: str,
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
        c_s, c_t = bucket_coefs(u_kl, kl.index_select(0, rows), b, divergence, beta, u_ls, u_t)
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
        v2 = selected_variant(CHUNKED_SWITCH) == "v2"
        _, bwd = epilogue_kernels(dev, topk_ids.shape[1], divergence, support)
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
                divergence,
                beta,
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
                if d_b is not None:
                    d_b += grad.sum(0)
                # v2: the logit gradient cast once to the GEMM dtype, for both GEMMs (v1 cast it
                # inside each matmul_f32 call: twice with a bf16 head on a GPU).
                g = grad.to(w.dtype) if v2 and gemm.half_gemm(w) else grad
                if d_h is not None:
                    d_h.index_copy_(0, r, gemm.matmul_f32(g, w))
                if d_w is not None:
                    # dW[V, d] += ds^T [V, C] @ h [C, d]: one GEMM per chunk, fp32 accumulator.
                    if v2:
                        gemm.accumulate_f32_(d_w, g.T, h)
                    else:
                        gemm.matmul_f32(g.T, h, out=d_w, accumulate=True)
                del g
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
