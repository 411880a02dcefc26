"""The chunk loop of every fused-linear op: ``h @ W^T`` one chunk at a time, the math passed in.

A *chunk* is a tile of the logits of the rows that count (those with a target): ``C``
consecutive rows x ``Vc`` consecutive vocabulary entries (``Vc = V``: whole rows, what the
per-row top-M kernels need). :func:`run_chunks` walks the chunks, vocabulary chunks inside row
chunks, and gives each to the op's *chunk math* (a callable taking a :class:`Chunk`). The chunk
forms a head's float32 logits when the math asks for them (one GEMM into a block reused by every
chunk) and takes back the logit gradient the math forms: ``dh += G W_c`` (rows of the chunk),
``dW_c += G^T h``, ``db_c += sum_rows G``, into float32 accumulators (:class:`HeadGrads`). The
loop, the row bookkeeping, the buffers and the gradient GEMMs exist here once; an op supplies
what it does with a chunk's logits.

Its users: ``fused_linear_topk_tail_kl`` (forward, backward) and ``fused_linear_topk_tail_kl_loss``
(:mod:`lopd_kernels.fused_linear_topk_tail_kl_chunked`: whole rows, one or two heads),
``fused_linear_logprob``'s ``"cuda"`` implementation
(:mod:`lopd_kernels.fused_linear_logprob_chunked`: vocabulary chunks and an online log-sum-exp),
and any op over a vocabulary shard: a rank holding a ``[V_local, d]`` head passes its shard as
the :class:`Head`; its math reads per-row statistics of the shard's logits in the forward and,
in the backward, turns per-row global coefficients into the shard's logit gradient for
:meth:`Chunk.backprop` (the hidden-state gradient is then this shard's part, summed by the
caller).

The GEMMs are :mod:`lopd_kernels.gemm_f32`'s: float32 output from half-precision operands,
tensor cores on a GPU, slab-wise upcasts on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lopd_kernels import gemm_f32 as gemm

__all__ = [
    "Chunk",
    "Head",
    "HeadGrads",
    "Rows",
    "auto_chunk_rows",
    "run_chunks",
    "spans",
]

# Working-set cap of the [C, V] blocks of a whole-row chunk loop. On CPU 384 MiB is C ~ 330 rows
# of a 152k vocabulary per live block pair (balanced chunks: 296 rows at N = 2048). The chunk
# height is the logit GEMM's M and the backward GEMMs' K, and each chunk re-reads W (and re-reads
# and rewrites the [V, d] weight-gradient accumulator): at 216 rows (a 256 MiB cap) the forward
# and backward GEMMs ran ~25% slower than at 256-512 rows on 2 cores. 384 MiB keeps the extra
# memory of fused_linear_topk_tail_kl under 1/10 of the materialized path's at N = 2048 (351 MiB
# against 4457 MiB beyond inputs and gradients, d = 256, both heads trained). On a GPU 512 MiB is
# ~440 rows of fp32 logits per block pair, a ~0.5 TFLOP GEMM at d = 4096: large enough for cuBLAS.
CHUNK_BUDGET_CAP = {"cpu": 384 << 20, "cuda": 512 << 20}


class Head(NamedTuple):
    """One model's LM head (or this rank's shard of it) and the hidden states that feed it."""

    hidden: Tensor  # [N, d]
    weight: Tensor  # [V, d]
    bias: Tensor | None  # [V]


@dataclasses.dataclass
class HeadGrads:
    """Accumulators of one head's gradients: float32 (float64 for float64 inputs), None where
    not wanted. Two heads that share a weight share its accumulator (pass the same tensor)."""

    hidden: Tensor | None = None  # [N, d], zero at rows without a target
    weight: Tensor | None = None  # [V, d], written by the first chunk (zeros if none ran)
    bias: Tensor | None = None  # [V]

    @classmethod
    def alloc(
        cls, head: Head, hidden: bool, weight: bool, bias: bool, shared_weight: Tensor | None = None
    ) -> HeadGrads:
        """The accumulators ``head`` needs; ``shared_weight``: another head's weight accumulator
        to use for this head's weight gradient too."""
        dt = torch.float64 if head.hidden.dtype == torch.float64 else torch.float32
        dev = head.hidden.device
        d_w = shared_weight
        if d_w is None and weight:
            # Not zeroed: the first chunk's GEMM writes it (run_chunks zeroes what none wrote).
            d_w = torch.empty(head.weight.shape, dtype=dt, device=dev)
        return cls(
            hidden=torch.zeros(head.hidden.shape, dtype=dt, device=dev) if hidden else None,
            weight=d_w,
            bias=torch.zeros(head.weight.shape[0], dtype=dt, device=dev) if bias else None,
        )


def spans(n: int, step: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive ``step``-long slices of ``range(n)``."""
    for start in range(0, n, step):
        yield start, min(n, start + step)


class Rows:
    """The rows that count (their target is not ``ignore_index``), and access to them by their
    position among those rows.

    When every row counts (the common case) a chunk of rows is a slice: inputs are views and
    results are written in place, nothing is gathered or scattered.
    """

    def __init__(self, target: Tensor, ignore_index: int) -> None:
        self.index = (target != ignore_index).nonzero().squeeze(-1)
        self.n = self.index.numel()
        self.dense = self.n == target.shape[0]

    def take(self, x: Tensor, r0: int, r1: int) -> Tensor:
        """Rows ``r0:r1`` (of the rows that count) of ``x [N, ...]``."""
        return x[r0:r1] if self.dense else x.index_select(0, self.index[r0:r1])

    def put(self, dst: Tensor, r0: int, r1: int, src: Tensor) -> None:
        """Writes ``src`` at rows ``r0:r1`` (of the rows that count) of ``dst [N, ...]``."""
        if self.dense:
            dst[r0:r1].copy_(src)
        else:
            dst.index_copy_(0, self.index[r0:r1], src.to(dst.dtype))


class _Loop:
    """What every chunk of one :func:`run_chunks` call shares: heads, accumulators, buffers and
    which gradient slices were written already."""

    def __init__(self, heads, grads, rows, chunk_rows, chunk_vocab) -> None:
        self.heads: Sequence[Head] = heads
        self.grads: Sequence[HeadGrads | None] = grads
        self.rows: Rows = rows
        self.chunk_rows = chunk_rows
        self.chunk_vocab = chunk_vocab
        like = heads[0].hidden
        self.dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        self.device = like.device
        self.blocks: dict[int, Tensor] = {}
        self.written: set[tuple[int, int]] = set()  # (id of a weight accumulator, v0)

    def block(self, slot: int, rows: int, cols: int) -> Tensor:
        """A contiguous ``[rows, cols]`` view of logit block ``slot``, allocated once per call
        and reused by every chunk.

        Why not a fresh block per chunk: on CPU a ``[C, V]`` block is far above glibc's mmap
        threshold, so every new one is fresh pages the OS zeroes on first touch (page faults
        inside the GEMM's stores); at C = 216, V = 152k that made the logit GEMM ~25% slower on
        2 cores.
        """
        buf = self.blocks.get(slot)
        if buf is None:
            size = self.chunk_rows * self.chunk_vocab
            buf = self.blocks[slot] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buf[: rows * cols].view(rows, cols)


class Chunk:
    """Rows ``r0:r1`` (of the rows that count) x vocabulary entries ``v0:v1``.

    ``k`` below indexes the heads given to :func:`run_chunks`. ``first`` / ``last``: whether
    this is the first / last vocabulary chunk of its rows.
    """

    def __init__(self, loop: _Loop, r0: int, r1: int, v0: int, v1: int, cache: dict) -> None:
        self._loop = loop
        self._cache = cache  # per row chunk: the rows' hidden states, dh accumulators
        self.r0, self.r1, self.v0, self.v1 = r0, r1, v0, v1
        self.first = v0 == 0
        self.last = v1 == loop.heads[0].weight.shape[0]

    @property
    def n_rows(self) -> int:
        return self.r1 - self.r0

    def take(self, x: Tensor) -> Tensor:
        """This chunk's rows of ``x [N, ...]``."""
        return self._loop.rows.take(x, self.r0, self.r1)

    def put(self, dst: Tensor, src: Tensor) -> None:
        """Writes ``src [C, ...]`` at this chunk's rows of ``dst [N, ...]``."""
        self._loop.rows.put(dst, self.r0, self.r1, src)

    def hidden(self, k: int) -> Tensor:
        """``[C, d]`` hidden states of head ``k`` at this chunk's rows."""
        key = ("h", k)
        if key not in self._cache:
            self._cache[key] = self.take(self._loop.heads[k].hidden)
        return self._cache[key]

    def weight(self, k: int) -> Tensor:
        """``[Vc, d]`` rows ``v0:v1`` of head ``k``'s weight."""
        w = self._loop.heads[k].weight
        return w if self.first and self.last else w[self.v0 : self.v1]

    def logits(self, k: int, slot: int | None = None) -> Tensor:
        """``[C, Vc]`` float32 logits ``h W_c^T + b_c`` of head ``k``, written into logit block
        ``slot`` (default ``k``): a block is overwritten by the next ``logits`` call into it.
        A GPU's half-precision GEMM writes a fresh block instead (its caching allocator makes
        that free, and its float32-output GEMM has no ``out=``)."""
        head = self._loop.heads[k]
        w = self.weight(k)
        out = None
        if not gemm.half_gemm(w):
            out = self._loop.block(k if slot is None else slot, self.n_rows, self.v1 - self.v0)
        z = gemm.matmul_f32(self.hidden(k), w.T, out=out)
        if head.bias is not None:
            z += head.bias[self.v0 : self.v1].to(z.dtype)
        return z

    def backprop(self, k: int, grad: Tensor) -> None:
        """Takes ``grad [C, Vc]``, the gradient of head ``k``'s logits on this chunk, into its
        accumulators: ``dh += grad W_c`` at the chunk's rows, ``dW_c += grad^T h``,
        ``db_c += sum_rows grad``. ``grad`` may be overwritten."""
        g = self._loop.grads[k]
        if g is None:
            return
        w = self.weight(k)
        if g.bias is not None:
            g.bias[self.v0 : self.v1].add_(grad.sum(0))
        # Cast once to the GEMM dtype for both GEMMs (a no-op but on a GPU with a half head).
        gg = grad.to(w.dtype) if gemm.half_gemm(w) else grad
        if g.hidden is not None:
            self._backprop_hidden(k, g.hidden, gg, w)
        if g.weight is not None:
            dst = g.weight if self.first and self.last else g.weight[self.v0 : self.v1]
            key = (id(g.weight), self.v0)
            if key in self._loop.written:
                gemm.accumulate_f32_(dst, gg.T, self.hidden(k))
            else:
                # The first product into a slice writes it: no zero fill of a [V, d]
                # accumulator, nor its read in the first GEMM.
                self._loop.written.add(key)
                gemm.matmul_f32(gg.T, self.hidden(k), out=dst)

    def _backprop_hidden(self, k: int, d_h: Tensor, grad: Tensor, w: Tensor) -> None:
        key = ("dh", k)
        started = key in self._cache
        if self._loop.rows.dense:
            # Straight into the accumulator's rows (a view).
            gemm.matmul_f32(grad, w, out=d_h[self.r0 : self.r1], accumulate=started)
            self._cache[key] = None
            return
        if not started:
            self._cache[key] = torch.zeros(self.n_rows, d_h.shape[1], dtype=d_h.dtype,
                                           device=d_h.device)  # fmt: skip
        gemm.matmul_f32(grad, w, out=self._cache[key], accumulate=True)

    def finish_rows(self) -> None:
        """Scatters the dh of rows gathered by index into the accumulators (called by the loop
        after the last vocabulary chunk of these rows)."""
        for k, g in enumerate(self._loop.grads):
            part = self._cache.get(("dh", k))
            if part is not None and g is not None and g.hidden is not None:
                self.put(g.hidden, part)


def auto_chunk_rows(
    vocab: int, n_rows: int, device: torch.device | str = "cpu", live_blocks: int = 4
) -> int:
    """Rows per chunk of a whole-row chunk loop, from the free memory of ``device``.

    The chunk's working set is ``live_blocks`` float32 ``[C, V]`` blocks, budgeted at a quarter
    of the free memory and at most 384 MiB on CPU / 512 MiB on GPU (``CHUNK_BUDGET_CAP``).

    Args:
        vocab: ``V``, the LM-head rows.
        n_rows: rows that count (the chunk never exceeds it).
        device: where the op runs.
        live_blocks: ``[C, V]`` float32 blocks alive at once.

    Returns:
        ``C >= 1`` (a multiple of 8 when the budget allows one). When ``n_rows`` takes several
        chunks they are balanced: ``ceil(n_rows / chunks)`` rows each (8-aligned within the
        budget), so that no last chunk is a short GEMM at a fraction of the others' throughput.
    """
    device = torch.device(device)
    cap = CHUNK_BUDGET_CAP["cuda" if device.type == "cuda" else "cpu"]
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


def run_chunks(
    heads: Sequence[Head],
    rows: Rows,
    math: Callable[[Chunk], None],
    *,
    chunk_rows: int,
    chunk_vocab: int = 0,
    grads: Sequence[HeadGrads | None] = (),
) -> None:
    """Calls ``math(chunk)`` for every chunk of ``rows`` x the vocabulary, in order: row chunks
    of ``chunk_rows`` rows, and inside each the vocabulary in chunks of ``chunk_vocab`` entries
    (0: whole rows).

    Args:
        heads: the heads whose logits the math may ask for (same ``N`` and ``V``; ``d`` may
            differ).
        rows: the rows that count.
        math: the op's per-chunk work; it asks the chunk for logits, writes its per-row
            results through :meth:`Chunk.put` and hands logit gradients to
            :meth:`Chunk.backprop`.
        chunk_rows: rows per chunk (``>= 1``).
        chunk_vocab: vocabulary entries per chunk (0 or ``>= V``: whole rows).
        grads: per head, its gradient accumulators (missing or None: none). A weight
            accumulator that no chunk wrote (no rows, or a math that never backpropagated into
            it) is zero when this returns.
    """
    vocab = heads[0].weight.shape[0]
    chunk_vocab = vocab if chunk_vocab <= 0 else min(chunk_vocab, vocab)
    chunk_rows = max(1, min(chunk_rows, rows.n)) if rows.n else 1
    grads = list(grads) + [None] * (len(heads) - len(grads))
    loop = _Loop(heads, grads, rows, chunk_rows, chunk_vocab)
    for r0, r1 in spans(rows.n, chunk_rows):
        cache: dict = {}
        for v0, v1 in spans(vocab, chunk_vocab):
            chunk = Chunk(loop, r0, r1, v0, v1, cache)
            math(chunk)
        chunk.finish_rows()
    weights = {id(g.weight): g.weight for g in grads if g is not None and g.weight is not None}
    for d_w in weights.values():
        for v0, v1 in spans(vocab, chunk_vocab):
            if (id(d_w), v0) not in loop.written:
                d_w[v0:v1].zero_()
