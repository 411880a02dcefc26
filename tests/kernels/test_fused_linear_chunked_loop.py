"""The chunked path's loop (lopd_kernels/fused_linear_topk_tail_kl_chunked.py) against the float64
reference where its CPU fast paths differ from the general one:

* every row has a target ("dense" rows): chunks are slices of the inputs, results are written in
  place (``Rows``), the hidden-state gradient straight into its rows by the GEMM;
* the logit blocks are allocated once per call and reused by every chunk (a shorter last chunk
  takes the first rows of a block);
* with M > 0 the backward recomputes one side at a time through one logit block (2 live blocks
  per chunk, so the automatic chunk is twice as tall as with both sides at once).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.chunked_linear import Chunk
from tests.kernels.fused_linear_utils import check, make_inputs
from tests.utils import assert_close

chunked = importlib.import_module("lopd_kernels.fused_linear_topk_tail_kl_chunked")
ALL = {"student_hidden", "student_weight", "teacher_hidden", "teacher_weight"}
FROZEN = {"student_hidden", "teacher_hidden"}


def dense_inputs(n, d, vocab, dtype=torch.float32, **kw):
    """``make_inputs`` with a real target on every row."""
    inputs, _ = make_inputs(n, d, vocab, dtype, **kw)
    g = torch.Generator().manual_seed(n * 31 + vocab)
    return inputs, torch.randint(0, vocab, (n,), generator=g)


CASES = [
    # (n, d, V, top_m, chunk_size, bias, requires, dtype)
    (13, 24, 307, 7, 4, True, ALL, torch.float32),  # last chunk shorter than the others
    (13, 24, 307, 7, None, False, ALL, torch.float32),  # automatic chunk: one chunk
    (11, 16, 97, None, 3, True, ALL, torch.float32),  # full vocabulary: both blocks at once
    (9, 32, 151, 5, 2, True, {"teacher_hidden", "teacher_weight"}, torch.float32),
    (9, 32, 151, 5, 2, False, {"student_weight"}, torch.float32),
    (10, 16, 203, 8, 3, True, FROZEN, torch.float32),  # tail projections, no recompute
    (10, 16, 203, 8, 3, True, ALL, torch.bfloat16),
    (10, 16, 203, None, 4, False, ALL, torch.float16),
]


def _case_id(case) -> str:
    """The case's fields joined by ``-``, a set of names sorted: ids must not depend on the hash
    seed (``pytest --lf``, pytest-xdist's workers compare them across processes)."""
    return "-".join("+".join(sorted(x)) if isinstance(x, set) else str(x) for x in case)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dense_rows_match_reference(case):
    n, d, vocab, top_m, chunk, bias, requires, dtype = case
    inputs, target = dense_inputs(n, d, vocab, dtype, bias=bias, seed=n + d)
    check(inputs, target, "chunked", dtype, requires=requires, top_m=top_m, temperature=0.8,
          chunk_size=chunk)  # fmt: skip


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "ignored-rows"])
@pytest.mark.parametrize("top_m", [6, None])
def test_strided_hidden_rows(dense, top_m):
    """Hidden states that are strided views (every other row of wider activations): the chunk
    views and gathers feed the GEMMs as they are; gradients reach the wide tensor."""
    n, d, vocab = 9, 16, 131
    inputs, target = (dense_inputs if dense else make_inputs)(n, d, vocab, bias=True, seed=4)
    wide = torch.randn(2 * n, 3 * d, generator=torch.Generator().manual_seed(5))
    ups = torch.randn(2, n, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    results = []
    for backend, dtype in (("chunked", torch.float32), ("torch", torch.float64)):
        leaf = wide.to(dtype, copy=True).requires_grad_(True)
        w_s, w_t = (inputs[k].to(dtype) for k in ("student_weight", "teacher_weight"))
        out = lk.fused_linear_topk_tail_kl(
            leaf[::2, :d], w_s, leaf[::2, d : 2 * d], w_t, target, top_m=top_m, chunk_size=4,
            student_bias=inputs["student_bias"].to(dtype), backend=backend,
        )  # fmt: skip
        ((out.kl.double() * ups[0]).sum() + (out.privilege.double() * ups[1]).sum()).backward()
        results.append((out.kl, leaf.grad))
    (kl, grad), (kl_ref, grad_ref) = results
    assert_close(kl, kl_ref, torch.float32, "kl")
    assert_close(grad, grad_ref, torch.float32, "d wide")
    assert not grad[1::2].any() and not grad[:, 2 * d :].any()


@pytest.fixture
def logit_blocks(monkeypatch):
    """Records, per call of ``Chunk.logits``, the storage it wrote the logits into."""
    seen: list[int] = []
    inner = Chunk.logits

    def recording(self, k, slot=None):
        logits = inner(self, k, slot)
        seen.append(logits.untyped_storage().data_ptr())
        return logits

    monkeypatch.setattr(Chunk, "logits", recording)
    return seen


@pytest.mark.parametrize("top_m, bwd_blocks", [(5, 1), (None, 2)])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "ignored-rows"])
def test_logit_blocks_reused_across_chunks(logit_blocks, top_m, bwd_blocks, dense):
    """Forward: two blocks (student, teacher) for every chunk; backward: one block the sides
    take turns in with M > 0, two with the full vocabulary. A fresh [C, V] tensor per chunk
    would be fresh pages the OS zeroes on first touch, inside the GEMM."""
    n, d, vocab, chunk = 13, 8, 67, 4
    inputs, target = (dense_inputs if dense else make_inputs)(n, d, vocab, seed=1)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    out = lk.fused_linear_topk_tail_kl(
        leaves["student_hidden"], leaves["student_weight"], leaves["teacher_hidden"],
        leaves["teacher_weight"], target, top_m=top_m, chunk_size=chunk, backend="chunked",
    )  # fmt: skip
    chunks = -(-int((target != -100).sum()) // chunk)
    assert len(logit_blocks) == 2 * chunks and len(set(logit_blocks)) == 2
    logit_blocks.clear()
    (out.kl.sum() + out.student_logprob.sum() + out.teacher_logprob.sum()).backward()
    assert len(logit_blocks) == 2 * chunks
    assert len(set(logit_blocks)) == bwd_blocks


def test_backward_chunk_budget(monkeypatch):
    """The automatic chunk counts the blocks really alive: 2 in the forward, 2 in a top-M
    backward (one side's logits and gradient), 4 in a full-vocabulary backward."""
    asked: list[int] = []
    inner = chunked.auto_chunk_rows

    def recording(vocab, n_rows, device="cpu", live_blocks=4):
        asked.append(live_blocks)
        return inner(vocab, n_rows, device, live_blocks)

    monkeypatch.setattr(chunked, "auto_chunk_rows", recording)
    inputs, target = make_inputs(7, 8, 53, seed=2)
    for top_m, want in ((5, [2, 2]), (None, [2, 4])):
        asked.clear()
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        out = lk.fused_linear_topk_tail_kl(
            leaves["student_hidden"], leaves["student_weight"], leaves["teacher_hidden"],
            leaves["teacher_weight"], target, top_m=top_m, backend="chunked",
        )  # fmt: skip
        out.kl.sum().backward()
        assert asked == want, (top_m, asked)
