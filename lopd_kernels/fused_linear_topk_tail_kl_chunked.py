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
from typing import NamedTuple

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

__all__ = [
    "CHUNKED_SWITCH",
    "Rows",
    "Side",
    "accumulate_logit_grad",
    "auto_chunk_rows",
    "block_buffers",
    "chunked_bwd",
    "chunked_fwd",
    "chunks",
    "epilogue_kernels",
    "grad_buffers",
    "logits_block",
    "shared_head",
    "tail_probs",
]

#: The switch choosing between the previous chunked path (v1) and the current one (v2):
#: lopd_kernels/kernel_variants.py.
CHUNKED_SWITCH = "fused_linear_topk_tail_kl.chunked"

# Working-set cap for the chunked path's [C, V] blocks. On CPU 384 MiB is C ~ 330 rows of a 152k
# vocabulary per live block pair (balanced chunks: 296 rows at N = 2048). The chunk height is the
# logit GEMM's M and the backward GEMMs' K, and each chunk re-reads W (and re-reads and rewrites
# the [V, d] weight-gradient accumulator): at 216 rows (the former 256 MiB cap) the forward and
# backward GEMMs ran ~25% slower than at 256-512 rows on 2 cores. 384 MiB keeps the op's extra
# memory under 1/10 of the materialized path's at N = 2048 (351 MiB against 4457 MiB beyond
# inputs and gradients, d = 256, both heads trained). On a GPU 512 MiB is ~440 rows of
# fp32 logits per block pair, a ~0.5 TFLOP GEMM at d = 4096: large enough for cuBLAS.
_CHUNK_BUDGET_CAP = {"cpu": 384 << 20, "cuda": 512 << 20}


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
    the free memory and at most 384 MiB on CPU / 512 MiB on GPU (``_CHUNK_BUDGET_CAP``).

    Args:
        vocab: ``V``, the LM-head rows.
        n_rows: rows with a real target (the chunk never exceeds it).
        device: where the op runs.
        live_blocks: ``[C, V]`` float32 blocks alive at once.

    Returns:
        ``C >= 1`` (a multiple of 8 when the budget allows one). When ``n_rows`` takes several
        chunks they are balanced: ``ceil(n_rows / chunks)`` rows each (8-aligned within the
        budget), so that no last chunk is a short GEMM at a fraction of the others' throughput.
    """
    device = torch.device(device)
    cap = _CHUNK_BUDGET_CAP["cuda" if device.type == "cuda" else "cpu"]
    budget = min(_free_memory_bytes(device) // 4, cap)
    rows = budget // (max(live_blocks, 1) * max(vocab, 1) * 4)
    if rows >= 8:
        rows -= rows % 8
    rows, n_rows = max(1, rows), max(n_rows, 1)
    if n_rows <= rows:
        return int(n_rows)
    balanced = -(-n_rows // -(-n_rows // rows))
    aligned = -(-balanced // 8) * 8
    return int(aligned if aligned <= rows else balanced)


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


def logits_block(h: Tensor, w: Tensor, b: Tensor | None, out: Tensor | None = None) -> Tensor:
    """``[C, V]`` float32 logits of one token chunk, written into ``out`` (a reused block, see
    :func:`block_buffers`) when given. A GPU's half-precision GEMM writes a fresh block: its
    caching allocator makes that free, and its float32-output GEMM has no ``out=``."""
    if gemm.half_gemm(w):
        out = None
    logits = gemm.matmul_f32(h, w.T, out=out)
    if b is not None:
        logits += b.to(logits.dtype)
    return logits


def block_buffers(count: int, rows: int, vocab: int, like: Tensor) -> list[Tensor]:
    """``count`` uninitialized float32 ``[rows, V]`` blocks, allocated once per call and reused
    by every chunk (a shorter last chunk takes the first rows: still a contiguous view).

    Why not a fresh block per chunk: on CPU a ``[C, V]`` block is far above glibc's mmap
    threshold, so every new one is fresh pages the OS zeroes on first touch (page faults inside
    the GEMM's stores); at C = 216, V = 152k that made the logit GEMM ~25% slower on 2 cores.
    """
    f32 = torch.float64 if like.dtype == torch.float64 else torch.float32
    return [torch.empty(rows, vocab, dtype=f32, device=like.device) for _ in range(count)]


def chunks(n: int, chunk: int):
    """``(start, stop)`` of consecutive ``chunk``-row slices of ``n`` rows."""
    for start in range(0, n, chunk):
        yield start, min(n, start + chunk)


class Rows:
    """The rows with a real target, and per-chunk access to them.

    When every row has a target (the common case) a chunk is a slice: inputs are views and
    results are written in place, nothing is gathered or scattered.
    """

    def __init__(self, target: Tensor, ignore_index: int) -> None:
        self.index = (target != ignore_index).nonzero().squeeze(-1)
        self.n = self.index.numel()
        self.dense = self.n == target.shape[0]

    def take(self, x: Tensor, c0: int, c1: int) -> Tensor:
        """Rows ``c0:c1`` (of the rows with a target) of ``x``."""
        return x[c0:c1] if self.dense else x.index_select(0, self.index[c0:c1])

    def put(self, dst: Tensor, c0: int, c1: int, src: Tensor) -> None:
        """Writes ``src`` at rows ``c0:c1`` (of the rows with a target) of ``dst``."""
        if self.dense:
            dst[c0:c1].copy_(src)
        else:
            dst.index_copy_(0, self.index[c0:c1], src.to(dst.dtype))


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
    rows = Rows(target, ignore_index)
    if rows.n == 0:
        return kl, lp_s, lp_t, ids, lse, bucket, *projs
    v2 = selected_variant(CHUNKED_SWITCH) == "v2"
    fwd, _ = epilogue_kernels(dev, m, divergence, support)
    chunk = min(chunk_size or auto_chunk_rows(vocab, rows.n, dev, live_blocks=2), rows.n)
    buf_s, buf_t = block_buffers(2, chunk, vocab, hs)
    for c0, c1 in chunks(rows.n, chunk):
        s = logits_block(rows.take(hs, c0, c1), ws, bs, buf_s[: c1 - c0])
        t = logits_block(rows.take(ht, c0, c1), wt, bt, buf_t[: c1 - c0])
        out = fwd(s, t, rows.take(target, c0, c1), m, temperature, divergence, beta, support,
                  ignore_index)  # fmt: skip
        for dst, src in zip((kl, lp_s, lp_t, ids, lse, bucket), out):
            rows.put(dst, c0, c1, src)
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
            rows.put(proj, c0, c1, gemm.matmul_f32(probs, w))
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
    for c0, c1 in chunks(rows.numel(), chunk):
        w_top = w[ids[c0:c1]].to(out.dtype)  # [C, M, d]
        top = torch.bmm((coef[c0:c1, :m] * log_mass[c0:c1, :m].exp()).unsqueeze(1), w_top)
        dh = coef[c0:c1, m:] * proj[c0:c1] + top.squeeze(1)
        dh += u[c0:c1, None] * w[target[c0:c1]].to(out.dtype)
        out.index_copy_(0, rows[c0:c1], dh / temperature)


class Side(NamedTuple):
    """One side whose logits the backward recomputes, and where its gradients go."""

    x: int  # 0: student, 1: teacher (its slot in the per-row kernel's outputs)
    h: Tensor  # [N, d] hidden states
    w: Tensor  # [V, d] head
    b: Tensor | None  # [V] bias
    d_h: Tensor | None  # [N, d] float32 hidden-state gradient (None: not needed, or from the tail)
    d_w: Tensor | None  # [V, d] float32 weight gradient, accumulated over chunks
    d_b: Tensor | None  # [V] float32 bias gradient, accumulated over chunks


def accumulate_logit_grad(
    grad: Tensor, h: Tensor, side: Side, rows: Rows, c0: int, c1: int, v2: bool, written: set
) -> None:
    """One chunk's logit gradient ``grad [C, V]`` into ``dh = grad @ W`` (rows ``c0:c1``),
    ``dW += grad^T h`` and ``db += sum(grad)``; ``h`` is the chunk's ``[C, d]`` hidden states.
    ``written``: ids of the ``dW`` buffers a product was written into already; the first product
    into one (uninitialized until then, shared by both sides with one head) overwrites it."""
    w = side.w
    if side.d_b is not None:
        side.d_b.add_(grad.sum(0))
    # v2: the logit gradient cast once to the GEMM dtype, for both GEMMs (v1 cast it inside each
    # matmul_f32 call: twice with a bf16 head on a GPU).
    g = grad.to(w.dtype) if v2 and gemm.half_gemm(w) else grad
    if side.d_h is not None:
        if rows.dense:
            gemm.matmul_f32(g, w, out=side.d_h[c0:c1])
        else:
            rows.put(side.d_h, c0, c1, gemm.matmul_f32(g, w))
    if side.d_w is not None:
        # dW[V, d] += ds^T [V, C] @ h [C, d]: one GEMM per chunk, fp32 accumulator; the first
        # writes it (no zero fill of a [V, d] accumulator, nor its read in the first GEMM).
        if id(side.d_w) not in written:
            written.add(id(side.d_w))
            gemm.matmul_f32(g.T, h, out=side.d_w)
        elif v2:
            gemm.accumulate_f32_(side.d_w, g.T, h)
        else:
            gemm.matmul_f32(g.T, h, out=side.d_w, accumulate=True)


def shared_head(ws: Tensor, wt: Tensor, needs) -> bool:
    """Whether both models use one head and both need its gradient: then one float32
    accumulator takes both sides' weight gradients, returned in the student's slot.

    Decided on the real tensors, before a custom op runs (a fake tensor has no storage). Under
    ``torch.compile`` only identity is traceable: two views of one head then take two
    accumulators, which autograd sums (the same gradient, one more ``[V, d]`` buffer)."""
    same = ws is wt
    if not same and not torch.compiler.is_compiling():
        same = ws.data_ptr() == wt.data_ptr() and ws.shape == wt.shape
    return bool(same and needs[1] and needs[4] and ws.stride() == wt.stride())


def grad_buffers(
    hs: Tensor, ws: Tensor, ht: Tensor, wt: Tensor, needs, shared_weight: bool, rows: Rows
) -> list[Tensor | None]:
    """Float32 (float64 for float64 inputs) gradient buffers ``[d_hs, d_ws, d_bs, d_ht, d_wt,
    d_bt]``, None where ``needs`` is false. Hidden-state and bias gradients start at zero; the
    weight gradients are written by the first chunk's GEMM (zeros when no row has a target);
    with ``shared_weight`` ``d_wt`` is ``d_ws``."""
    f32 = torch.float64 if hs.dtype == torch.float64 else torch.float32
    dev, vocab = hs.device, ws.shape[0]
    new_w = torch.empty if rows.n else torch.zeros
    d_hs = torch.zeros(hs.shape, dtype=f32, device=dev) if needs[0] else None
    d_ws = new_w(ws.shape, dtype=f32, device=dev) if needs[1] else None
    d_bs = torch.zeros(vocab, dtype=f32, device=dev) if needs[2] else None
    d_ht = torch.zeros(ht.shape, dtype=f32, device=dev) if needs[3] else None
    d_wt = d_ws if shared_weight else (new_w(wt.shape, dtype=f32, device=dev) if needs[4] else None)
    d_bt = torch.zeros(vocab, dtype=f32, device=dev) if needs[5] else None
    return [d_hs, d_ws, d_bs, d_ht, d_wt, d_bt]


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
    rows = Rows(target, ignore_index)
    d_hs, d_ws, d_bs, d_ht, d_wt, d_bt = grad_buffers(hs, ws, ht, wt, needs, shared_weight, rows)
    from_tail_s = bool(n_hs and proj_s.numel())
    from_tail_t = bool(n_ht and proj_t.numel())
    if rows.n and (from_tail_s or from_tail_t):
        r = rows.index
        tgt = target.index_select(0, r)
        b = bucket.index_select(0, r)
        u_ls = grad_slp.index_select(0, r).float()
        u_t = grad_tlp.index_select(0, r).float()
        u_kl = grad_kl.index_select(0, r).float()
        c_s, c_t = bucket_coefs(u_kl, kl.index_select(0, r), b, divergence, beta, u_ls, u_t)
        ids = topk_ids.index_select(0, r)
        for flag, proj, w, x, coef, u, out in (
            (from_tail_s, proj_s, ws, 0, c_s, u_ls, d_hs),
            (from_tail_t, proj_t, wt, 1, c_t, u_t, d_ht),
        ):
            if flag:
                p = proj.index_select(0, r)
                _hidden_grad_from_tail(p, w, r, tgt, ids, b[:, x], coef, u, temperature, out)
    need_s = (n_hs and not from_tail_s) or n_ws or n_bs
    need_t = (n_ht and not from_tail_t) or n_wt or n_bt
    if rows.n and (need_s or need_t):
        v2 = selected_variant(CHUNKED_SWITCH) == "v2"
        _, bwd = epilogue_kernels(dev, topk_ids.shape[1], divergence, support)
        student = Side(0, hs, ws, bs, None if from_tail_s else d_hs, d_ws, d_bs)
        teacher = Side(1, ht, wt, bt, None if from_tail_t else d_ht, d_wt, d_bt)
        sides = [side for side, need in ((student, need_s), (teacher, need_t)) if need]
        # With M > 0 a side's logit gradient reads only its own logits (the coupling through
        # the KL is in the saved bucket log-masses): the sides take turns through one logit
        # block (live: it and the kernel's gradient block), the kernel getting that side's
        # block in the other's place too and never reading it. The full-vocabulary KL couples
        # every entry: both logit blocks, then both gradients (4 live blocks).
        full_vocab = topk_ids.shape[1] == 0
        live = 4 if full_vocab else 2
        chunk = min(chunk_size or auto_chunk_rows(vocab, rows.n, dev, live_blocks=live), rows.n)
        bufs = block_buffers(2 if full_vocab else 1, chunk, vocab, hs)
        written: set[int] = set()
        for c0, c1 in chunks(rows.n, chunk):
            c = c1 - c0
            up = [rows.take(x, c0, c1).float() for x in (grad_kl, grad_slp, grad_tlp)]
            saved = [rows.take(x, c0, c1) for x in (target, topk_ids, kl, lse, bucket)]
            opts = (temperature, divergence, beta, ignore_index)
            h = {side.x: rows.take(side.h, c0, c1) for side in sides}
            if full_vocab:
                s = logits_block(rows.take(hs, c0, c1), ws, bs, bufs[0][:c])
                t = logits_block(rows.take(ht, c0, c1), wt, bt, bufs[1][:c])
                grads = bwd(*up, s, t, *saved, *opts, bool(need_s), bool(need_t))
                for side in sides:
                    accumulate_logit_grad(grads[side.x], h[side.x], side, rows, c0, c1, v2, written)
                del grads
                continue
            for side in sides:
                logits = logits_block(h[side.x], side.w, side.b, bufs[0][:c])
                grad = bwd(*up, logits, logits, *saved, *opts, side.x == 0, side.x == 1)[side.x]
                accumulate_logit_grad(grad, h[side.x], side, rows, c0, c1, v2, written)
                del grad
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
