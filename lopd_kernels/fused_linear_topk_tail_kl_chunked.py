"""The chunk math of ``fused_linear_topk_tail_kl`` and ``fused_linear_topk_tail_kl_loss``
(backend ``"chunked"``), run by :func:`lopd_kernels.chunked_linear.run_chunks`.

Chunks are whole rows (the per-row top-M kernels need every entry of a row). The forward forms a
chunk's two ``[C, V]`` logit blocks (one vendor GEMM each: MKL / cuBLAS), runs the per-row
``topk_tail_kl`` kernel on them (:func:`epilogue_kernels`: what ``topk_tail_kl``'s
``backend="auto"`` picks on that device) and keeps only O(M) per row (top-M ids, both
log-sum-exps, the M+1 bucket log-masses). The backward recomputes a side's chunk logits, runs the
per-row backward on the chunk and hands the logit gradient to the chunk loop (``dh = ds W``,
``dW += ds^T h``, in float32). The loss op does both per chunk while the logit blocks are in
memory. Peak memory is a few ``[C, V]`` blocks; ``C`` comes from the free memory
(:func:`lopd_kernels.chunked_linear.auto_chunk_rows`, ``chunk_size=`` overrides it).

**Frozen heads.** When a side's head (and bias) needs no gradient but its hidden states do (a
LoRA student, a frozen teacher whose activations carry the composer's gradient), the forward also
keeps that side's *tail projection* ``sum_{j not in top-M} softmax_j W[j]`` ([N, d]). The logit
gradient is ``S_j * c[b(j)]`` with one coefficient per bucket, so ``dh`` is the tail projection
times the tail coefficient plus M + 1 rows of ``W``: the backward skips that side's logit
recompute and its dh GEMM (one extra GEMM in the forward instead of two in the backward). The
tail probabilities are formed in one pass (:func:`tail_probs`: Triton on a GPU, written in the
GEMM dtype; two PyTorch passes elsewhere).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels import gemm_f32 as gemm
from lopd_kernels._backend import triton_available
from lopd_kernels.bucket_math import (
    bucket_coefs,
    effective_top_m,
    rows_bwd_torch,
    rows_fwd_torch,
    support_width,
)
from lopd_kernels.chunked_linear import (
    Chunk,
    Head,
    HeadGrads,
    Rows,
    auto_chunk_rows,
    run_chunks,
    spans,
)
from lopd_kernels.op_outputs import (
    FusedLinearTopKTailKLLossOpOutput,
    FusedLinearTopKTailKLOpOutput,
    LinearPairGrads,
    TopKTailKLOpGrads,
    TopKTailKLOpOutput,
)
from lopd_kernels.topk_tail_kl import BACKENDS as TOPK_TAIL_KL_BACKENDS
from lopd_kernels.topk_tail_kl import CUSTOM_OPS as TOPK_TAIL_KL_OPS
from lopd_kernels.topk_tail_kl import implementation_limits

__all__ = [
    "EpilogueKernels",
    "LossWeights",
    "Needs",
    "chunked_bwd",
    "chunked_fwd",
    "chunked_loss_fwd",
    "epilogue_impl",
    "epilogue_kernels",
    "shared_head",
    "tail_probs",
]


class Needs(NamedTuple):
    """Which of the six LM-head inputs need a gradient."""

    student_hidden: bool
    student_weight: bool
    student_bias: bool
    teacher_hidden: bool
    teacher_weight: bool
    teacher_bias: bool

    @property
    def student(self) -> bool:
        return self.student_hidden or self.student_weight or self.student_bias

    @property
    def teacher(self) -> bool:
        return self.teacher_hidden or self.teacher_weight or self.teacher_bias


class EpilogueKernels(NamedTuple):
    """The per-row forward and backward a chunk runs (``topk_tail_kl_<impl>_fwd/_bwd``'s
    schema)."""

    fwd: object
    bwd: object


class LossWeights(NamedTuple):
    """The loss op's ``[N]`` row weights: its upstream gradients of ``kl``,
    ``student_logprob`` and ``teacher_logprob``."""

    kl: Tensor
    student_logprob: Tensor
    teacher_logprob: Tensor


def epilogue_impl(device: torch.device, top_m: int = 0) -> str:
    """The implementation of ``topk_tail_kl`` a chunk on ``device`` runs: the one its
    ``backend="auto"`` picks there (the C++ kernels on CPU; on a GPU Triton's, else CUDA's,
    within their ``top_m`` limits; ``"torch"``: the PyTorch twins, e.g. a pure-Python
    install). One order for both ops, decided where ``topk_tail_kl`` is."""
    limits = implementation_limits(top_m)
    return TOPK_TAIL_KL_BACKENDS.resolve("auto", device, unsupported=limits)


def epilogue_kernels(device: torch.device, top_m: int = 0) -> EpilogueKernels:
    """Per-row fwd/bwd of :func:`epilogue_impl` (its custom ops, or the PyTorch twins
    ``rows_fwd_torch`` / ``rows_bwd_torch``: still memory-bounded, only slower)."""
    impl = epilogue_impl(device, top_m)
    if impl == "torch":
        return EpilogueKernels(rows_fwd_torch, rows_bwd_torch)
    return EpilogueKernels(*TOPK_TAIL_KL_OPS.ops(impl))


def tail_probs_on_triton(logits: Tensor) -> bool:
    """Whether :func:`tail_probs` takes the Triton pass (a GPU with Triton)."""
    return logits.is_cuda and triton_available()


def tail_probs(
    logits: Tensor, lse: Tensor, topk_ids: Tensor, temperature: float, out_dtype: torch.dtype
) -> Tensor:
    """``exp(logits / T - lse)`` with each row's top-M entries zeroed, in ``out_dtype``.

    On a GPU with Triton one pass (:mod:`lopd_kernels.triton.fused_linear_topk_tail_kl_chunked`:
    a float32 read, a write in the GEMM dtype, M zeros per row). Otherwise two PyTorch passes in
    place (``lse`` subtracted with the ``1/T`` scale in one ``add``, then ``exp``), a scatter and,
    when ``out_dtype`` is not float32, a cast. ``logits`` (``[C, V]`` float32) is overwritten.

    Args:
        logits: ``[C, V]`` float32 logit block; lse: ``[C]`` this side's log-sum-exp of
            ``logits / T``; topk_ids: ``[C, M]`` int64.
    """
    if tail_probs_on_triton(logits):
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


def _put_rows(chunk: Chunk, dst: NamedTuple, src: TopKTailKLOpOutput, fields) -> None:
    for name in fields:
        chunk.put(getattr(dst, name), getattr(src, name))


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
) -> FusedLinearTopKTailKLOpOutput:
    """The forward; ``tail_proj[x]``: also side x's tail projection (student 0, teacher 1)."""
    n, vocab = hs.shape[0], ws.shape[0]
    m = effective_top_m(top_m, vocab)
    k = support_width(m, support)
    dev = hs.device
    kl = torch.zeros(n, dtype=torch.float32, device=dev)
    out = FusedLinearTopKTailKLOpOutput(
        kl=kl,
        student_logprob=torch.zeros_like(kl),
        teacher_logprob=torch.zeros_like(kl),
        topk_ids=torch.zeros(n, k, dtype=torch.long, device=dev),
        lse=kl.new_zeros(n, 2),
        bucket_logp=kl.new_zeros(n, 2, k + 1),
        student_tail_proj=kl.new_zeros(n, hs.shape[1]) if tail_proj[0] and m else kl.new_empty(0),
        teacher_tail_proj=kl.new_zeros(n, ht.shape[1]) if tail_proj[1] and m else kl.new_empty(0),
    )
    rows = Rows(target, ignore_index)
    if rows.n == 0:
        return out
    kernels = epilogue_kernels(dev, m)
    projs = (out.student_tail_proj, out.teacher_tail_proj)

    def math(chunk: Chunk) -> None:
        s, t = chunk.logits(0), chunk.logits(1)
        res = TopKTailKLOpOutput(*kernels.fwd(
            s, t, chunk.take(target), m, temperature, divergence, beta, support, ignore_index,
        ))  # fmt: skip
        _put_rows(chunk, out, res, TopKTailKLOpOutput._fields)
        # Tail projection sum_{j not in top-M} softmax_j W[j] ([C, d]): with it the backward
        # gets this side's dh from O(M) rows of W, without recomputing its logits
        # (_hidden_grad_from_tail). In place: the logits are not needed any more.
        for x, logits in ((0, s), (1, t)):
            if projs[x].numel():
                w = chunk.weight(x)
                gemm_dtype = w.dtype if gemm.half_gemm(w) else logits.dtype
                ids = without_padding(res.topk_ids)
                probs = tail_probs(logits, res.lse[:, x], ids, temperature, gemm_dtype)
                chunk.put(projs[x], gemm.matmul_f32(probs, w))
                del probs

    chunk_rows = chunk_size or auto_chunk_rows(vocab, rows.n, dev, live_blocks=2)
    run_chunks((Head(hs, ws, bs), Head(ht, wt, bt)), rows, math, chunk_rows=chunk_rows)
    return out


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
    step = max(1, (64 << 20) // max(1, 4 * (m + 1) * d))
    for c0, c1 in spans(rows.numel(), step):
        w_top = w[ids[c0:c1]].to(out.dtype)  # [C, M, d]
        top = torch.bmm((coef[c0:c1, :m] * log_mass[c0:c1, :m].exp()).unsqueeze(1), w_top)
        dh = coef[c0:c1, m:] * proj[c0:c1] + top.squeeze(1)
        dh += u[c0:c1, None] * w[target[c0:c1]].to(out.dtype)
        out.index_copy_(0, rows[c0:c1], dh / temperature)


def shared_head(ws: Tensor, wt: Tensor, needs: Needs) -> bool:
    """Whether both models use one head and both need its gradient: then one float32
    accumulator takes both sides' weight gradients, returned in the student's slot.

    Decided on the real tensors, before a custom op runs (a fake tensor has no storage). Under
    ``torch.compile`` only identity is traceable: two views of one head then take two
    accumulators, which autograd sums (the same gradient, one more ``[V, d]`` buffer)."""
    same = ws is wt
    if not same and not torch.compiler.is_compiling():
        same = ws.data_ptr() == wt.data_ptr() and ws.shape == wt.shape
    both = needs.student_weight and needs.teacher_weight
    return bool(same and both and ws.stride() == wt.stride())


def _grads(heads: tuple[Head, Head], needs: Needs, shared: bool, tail: tuple[bool, bool]):
    """The two heads' accumulators (``tail[x]``: side x's dh comes from its tail projection)."""
    s_hidden, t_hidden = needs.student_hidden and not tail[0], needs.teacher_hidden and not tail[1]
    d_s = HeadGrads.alloc(heads[0], s_hidden, needs.student_weight, needs.student_bias)
    shared_weight = d_s.weight if shared else None
    d_t = HeadGrads.alloc(heads[1], t_hidden, needs.teacher_weight, needs.teacher_bias,
                          shared_weight=shared_weight)  # fmt: skip
    return d_s, d_t


def _pair_grads(
    heads: tuple[Head, Head], d_s: HeadGrads, d_t: HeadGrads, shared: bool
) -> LinearPairGrads:
    """The accumulators in the inputs' dtypes (an empty ``[0]`` where none; the teacher weight's
    with ``shared``: it is in the student's)."""
    empty = heads[0].hidden.new_empty(0)

    def cast(g: Tensor | None, like: Tensor) -> Tensor:
        return empty.new_empty(0) if g is None else g.to(like.dtype)

    (hs, ws, _), (ht, wt, _) = heads
    return LinearPairGrads(
        student_hidden=cast(d_s.hidden, hs),
        student_weight=cast(d_s.weight, ws),
        student_bias=cast(d_s.bias, ws),
        teacher_hidden=cast(d_t.hidden, ht),
        teacher_weight=cast(None if shared else d_t.weight, wt),
        teacher_bias=cast(d_t.bias, wt),
    )


def _backprop_rows(
    chunk: Chunk,
    kernels: EpilogueKernels,
    upstream: tuple[Tensor, Tensor, Tensor],
    saved: tuple[Tensor, ...],
    opts: tuple,
    sides: tuple[int, ...],
    logits: tuple[Tensor, Tensor] | None,
    full_vocab: bool,
) -> None:
    """The per-row backward of one chunk and its logit gradients into the chunk loop.

    ``logits``: both sides' logit blocks when the chunk holds them (the loss op), else each side
    recomputes its own in turn through logit block 0. With M > 0 a side's logit gradient reads
    only its own logits (the coupling through the KL is in the saved bucket log-masses), so the
    kernel gets that side's block in the other's place too and never reads it. The
    full-vocabulary KL couples every entry: both logit blocks, both gradients at once.
    """
    if full_vocab:
        s, t = logits if logits is not None else (chunk.logits(0), chunk.logits(1))
        g = TopKTailKLOpGrads(*kernels.bwd(*upstream, s, t, *saved, *opts, 0 in sides,
                                            1 in sides))  # fmt: skip
        for x in sides:
            chunk.backprop(x, g.student_logits if x == 0 else g.teacher_logits)
        return
    for x in sides:
        if logits is None:
            s = t = chunk.logits(x, slot=0)
        else:
            s, t = logits
        g = TopKTailKLOpGrads(*kernels.bwd(*upstream, s, t, *saved, *opts, x == 0, x == 1))
        chunk.backprop(x, g.student_logits if x == 0 else g.teacher_logits)
        del g


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
    ignore_index: int,
    chunk_size: int,
    needs: Needs,
    shared_weight: bool,
) -> LinearPairGrads:
    """The backward: gradients in the six LM-head inputs.

    A side with a tail projection (``proj_*`` non-empty) gets ``dh`` from it; the other sides
    recompute their chunk logits and run ``topk_tail_kl_bwd``. Weight and bias gradients
    accumulate in float32 over the chunks. With ``shared_weight`` (one head for both models)
    both sides accumulate into one buffer, returned in the student's slot.
    """
    vocab, dev = ws.shape[0], hs.device
    rows = Rows(target, ignore_index)
    heads = (Head(hs, ws, bs), Head(ht, wt, bt))
    tail = (bool(needs.student_hidden and proj_s.numel()),
            bool(needs.teacher_hidden and proj_t.numel()))  # fmt: skip
    d_s, d_t = _grads(heads, needs, shared_weight, tail)
    need = (
        bool((needs.student_hidden and not tail[0]) or needs.student_weight or needs.student_bias),
        bool((needs.teacher_hidden and not tail[1]) or needs.teacher_weight or needs.teacher_bias),
    )
    if any(need):  # run also without rows: the loop zeroes weight gradients none wrote
        kernels = epilogue_kernels(dev, topk_ids.shape[1])
        sides = tuple(x for x in (0, 1) if need[x])
        full_vocab = topk_ids.shape[1] == 0
        opts = (temperature, divergence, beta, ignore_index)

        def math(chunk: Chunk) -> None:
            up = tuple(chunk.take(x).float() for x in (grad_kl, grad_slp, grad_tlp))
            saved = tuple(chunk.take(x) for x in (target, topk_ids, kl, lse, bucket))
            _backprop_rows(chunk, kernels, up, saved, opts, sides, None, full_vocab)

        # Live [C, V] blocks: with M > 0 one logit block and its gradient; the full-vocabulary
        # KL both logit blocks, then both gradients.
        live = 4 if full_vocab else 2
        chunk_rows = chunk_size or auto_chunk_rows(vocab, rows.n, dev, live_blocks=live)
        run_chunks(heads, rows, math, chunk_rows=chunk_rows,
                   grads=(d_s if need[0] else None, d_t if need[1] else None))  # fmt: skip
    # dh of the sides with a tail projection (the chunks above did not touch it).
    acc_dtype = torch.float64 if hs.dtype == torch.float64 else torch.float32
    for x, grads in ((0, d_s), (1, d_t)):
        if tail[x]:
            grads.hidden = torch.zeros(heads[x].hidden.shape, dtype=acc_dtype, device=dev)
    if rows.n and any(tail):
        r = rows.index
        tgt = target.index_select(0, r)
        b = bucket.index_select(0, r)
        u_ls = grad_slp.index_select(0, r).float()
        u_t = grad_tlp.index_select(0, r).float()
        u_kl = grad_kl.index_select(0, r).float()
        c_s, c_t = bucket_coefs(u_kl, kl.index_select(0, r), b, divergence, beta, u_ls, u_t)
        ids = topk_ids.index_select(0, r)
        for x, (proj, w, coef, u, grads) in enumerate(
            ((proj_s, ws, c_s, u_ls, d_s), (proj_t, wt, c_t, u_t, d_t))
        ):
            if tail[x]:
                p = proj.index_select(0, r)
                _hidden_grad_from_tail(p, w, r, tgt, ids, b[:, x], coef, u, temperature,
                                       grads.hidden)  # fmt: skip
    return _pair_grads(heads, d_s, d_t, shared_weight)


def chunked_loss_fwd(
    hs: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    ht: Tensor,
    wt: Tensor,
    bt: Tensor | None,
    target: Tensor,
    weights: LossWeights,
    top_m: int,
    temperature: float,
    divergence: str,
    beta: float,
    support: str,
    ignore_index: int,
    chunk_size: int,
    needs: Needs,
    shared_weight: bool,
) -> FusedLinearTopKTailKLLossOpOutput:
    """The loss op's forward: per chunk both logit blocks, the per-row forward, then (where
    ``needs``) the per-row backward with the row weights as upstream gradients, into the
    gradient GEMMs. The gradients are in the inputs' dtypes (an empty ``[0]`` where not needed,
    and the teacher weight's when it is the student's: summed there)."""
    n, vocab, dev = hs.shape[0], ws.shape[0], hs.device
    m = effective_top_m(top_m, vocab)
    k = support_width(m, support)
    f32 = torch.float64 if hs.dtype == torch.float64 else torch.float32
    rows_out = TopKTailKLOpOutput(
        kl=torch.zeros(n, dtype=torch.float32, device=dev),
        student_logprob=torch.zeros(n, dtype=torch.float32, device=dev),
        teacher_logprob=torch.zeros(n, dtype=torch.float32, device=dev),
        topk_ids=torch.zeros(n, k, dtype=torch.long, device=dev),
        lse=torch.empty(0, device=dev),
        bucket_logp=torch.zeros(n, 2, k + 1, dtype=torch.float32, device=dev),
    )
    rows = Rows(target, ignore_index)
    heads = (Head(hs, ws, bs), Head(ht, wt, bt))
    d_s, d_t = _grads(heads, needs, shared_weight, (False, False))
    if rows.n or needs.student or needs.teacher:
        kernels = epilogue_kernels(dev, m)
        sides = tuple(x for x, need in ((0, needs.student), (1, needs.teacher)) if need)
        opts = (temperature, divergence, beta, ignore_index)
        kept = ("kl", "student_logprob", "teacher_logprob", "topk_ids", "bucket_logp")

        def math(chunk: Chunk) -> None:
            s, t = chunk.logits(0), chunk.logits(1)
            tgt = chunk.take(target)
            res = TopKTailKLOpOutput(*kernels.fwd(
                s, t, tgt, m, temperature, divergence, beta, support, ignore_index,
            ))  # fmt: skip
            _put_rows(chunk, rows_out, res, kept)
            if sides:
                up = tuple(chunk.take(w) for w in weights)
                saved = (tgt, res.topk_ids, res.kl, res.lse, res.bucket_logp)
                _backprop_rows(chunk, kernels, up, saved, opts, sides, (s, t), m == 0)

        # Live [C, V] blocks: both logit blocks, and one gradient block per side in turn (with
        # M > 0 a side's logit gradient reads only its own logits); the full-vocabulary KL
        # couples every entry: both gradient blocks at once.
        live = 2 + (0 if not sides else (2 if m == 0 else 1))
        chunk_rows = chunk_size or auto_chunk_rows(vocab, rows.n, dev, live_blocks=live)
        run_chunks(heads, rows, math, chunk_rows=chunk_rows, grads=(d_s, d_t))
    loss = sum(
        (w.to(f32) * x).sum()
        for w, x in zip(weights, (rows_out.kl, rows_out.student_logprob, rows_out.teacher_logprob))
    )
    g = _pair_grads(heads, d_s, d_t, shared_weight)
    return FusedLinearTopKTailKLLossOpOutput(
        loss, rows_out.kl, rows_out.student_logprob, rows_out.teacher_logprob,
        rows_out.topk_ids, rows_out.bucket_logp, *g,
    )  # fmt: skip
