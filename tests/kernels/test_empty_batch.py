"""An empty batch through every op, backend and module: correctly shaped empty outputs, zero
gradients (weights included), ``reduction="mean"`` 0, never an error.

A rank or micro-batch with no action tokens is ordinary in distributed training (the lockstep
plan runs a padding pass on it), so ``N = 0`` and a QFormer with no items are regular inputs.
"""

from __future__ import annotations

import pytest
import torch

import lopd_kernels as lk
from tests.utils import TRITON_DEVICE, requires_cpp, requires_triton

V, D, M = 50, 8, 4


def _backends(*names: str) -> list:
    marks = {"cpu": [requires_cpp], "triton": [requires_triton]}
    return [pytest.param(n, marks=marks.get(n, []), id=n) for n in names]


def _device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _leaf(*shape: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()


def _assert_zero_grads(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.grad is not None and t.grad.shape == t.shape, (t.shape, t.grad)
        assert not t.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", _backends("auto", "torch", "cpu", "triton"))
def test_topk_tail_kl(backend, dtype):
    dev = _device(backend)
    s, t = _leaf(0, V, device=dev, dtype=dtype), _leaf(0, V, device=dev, dtype=dtype)
    target = torch.zeros(0, dtype=torch.long, device=dev)
    out = lk.topk_tail_kl(s, t, target, top_m=M, backend=backend)
    assert out.kl.shape == (0,) and out.topk_ids.shape == (0, M)
    assert out.student_logprob.shape == out.teacher_logprob.shape == out.privilege.shape == (0,)
    (out.kl.sum() + out.student_logprob.sum() + out.teacher_logprob.sum()).backward()
    _assert_zero_grads(s, t)


@pytest.mark.parametrize("backend", _backends("auto", "torch", "cpu", "triton"))
def test_sparse_teacher_topk_tail_kl(backend):
    dev = _device(backend)
    s = _leaf(0, V, device=dev)
    lp = torch.zeros(0, M, device=dev)
    ids = torch.zeros(0, M, dtype=torch.long, device=dev)
    target = torch.zeros(0, dtype=torch.long, device=dev)
    out = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend=backend)
    assert out.kl.shape == out.student_logprob.shape == (0,)
    (out.kl.sum() + out.student_logprob.sum()).backward()
    _assert_zero_grads(s)


def _heads(dev: str) -> tuple[torch.Tensor, ...]:
    return (
        _leaf(0, D, device=dev),
        _leaf(V, D, device=dev),
        _leaf(0, D, device=dev),
        _leaf(V, D, device=dev),
    )


@pytest.mark.parametrize("backend", _backends("auto", "torch", "chunked", "triton"))
def test_fused_linear_topk_tail_kl(backend):
    dev = _device(backend)
    hs, ws, ht, wt = _heads(dev)
    target = torch.zeros(0, dtype=torch.long, device=dev)
    out = lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, target, top_m=M, backend=backend)
    assert out.kl.shape == (0,) and out.topk_ids.shape == (0, M)
    (out.kl.sum() + out.student_logprob.sum()).backward()
    _assert_zero_grads(hs, ws, ht, wt)


@pytest.mark.parametrize("backend", _backends("auto", "torch", "chunked", "triton"))
def test_fused_linear_topk_tail_kl_loss(backend):
    dev = _device(backend)
    hs, ws, ht, wt = _heads(dev)
    target = torch.zeros(0, dtype=torch.long, device=dev)
    res = lk.fused_linear_topk_tail_kl_loss(
        hs, ws, ht, wt, target, top_m=M, student_logprob_weight=0.5, backend=backend
    )
    assert res.loss.shape == () and res.loss.item() == 0.0  # the mean over no rows
    assert res.output.kl.shape == (0,)
    res.loss.backward()
    _assert_zero_grads(hs, ws, ht, wt)


@pytest.mark.parametrize("backend", _backends("auto", "torch", "cpu", "chunked", "triton"))
def test_fused_linear_logprob(backend):
    dev = _device(backend)
    h, w = _leaf(0, D, device=dev), _leaf(V, D, device=dev)
    target = torch.zeros(0, dtype=torch.long, device=dev)
    out = lk.fused_linear_logprob(h, w, target, with_entropy=True, backend=backend)
    assert out.logprob.shape == out.entropy.shape == (0,)
    (out.logprob.sum() + out.entropy.sum()).backward()
    _assert_zero_grads(h, w)


@pytest.mark.parametrize("backend", _backends("auto", "torch", "cpu", "triton"))
def test_varlen_cross_attention_with_zero_items(backend):
    dev = _device(backend)
    q, k, v = _leaf(0, 4, 2, 8, device=dev), _leaf(0, 2, 8, device=dev), _leaf(0, 2, 8, device=dev)
    cu = torch.zeros(1, dtype=torch.int32, device=dev)
    out, lse = lk.varlen_cross_attention(q, k, v, cu, backend=backend, return_lse=True)
    assert out.shape == (0, 4, 2, 8) and lse.shape == (0, 2, 4)
    out.sum().backward()
    _assert_zero_grads(q, k, v)


def test_qformer_with_zero_items():
    qf = lk.QFormerCompressor(16, num_heads=2, num_queries=3, num_layers=1)
    hidden = _leaf(0, 16, device="cpu")
    latents = qf(hidden, torch.zeros(1, dtype=torch.int32))
    assert latents.shape == (0, 3, 16)
    latents.sum().backward()
    _assert_zero_grads(hidden)


@pytest.mark.parametrize(
    "module",
    [
        lambda: lk.TopKTailKL(top_m=M),
        lambda: lk.SparseTeacherTopKTailKL(),
        lambda: lk.FusedLinearTopKTailKL(top_m=M),
        lambda: lk.FusedLinearCrossEntropy(),
    ],
    ids=[
        "TopKTailKL",
        "SparseTeacherTopKTailKL",
        "FusedLinearTopKTailKL",
        "FusedLinearCrossEntropy",
    ],
)
def test_mean_over_no_rows_is_zero(module):
    """``reduction="mean"`` (every module's default) over an empty batch is 0, not NaN."""
    mod = module()
    target = torch.zeros(0, dtype=torch.long)
    if isinstance(mod, lk.TopKTailKL):
        inputs = (_leaf(0, V, device="cpu"), _leaf(0, V, device="cpu"))
    elif isinstance(mod, lk.SparseTeacherTopKTailKL):
        ids = torch.zeros(0, M, dtype=torch.long)
        inputs = (_leaf(0, V, device="cpu"), torch.zeros(0, M), ids)
    elif isinstance(mod, lk.FusedLinearTopKTailKL):
        inputs = _heads("cpu")
    else:
        inputs = (_leaf(0, D, device="cpu"), _leaf(V, D, device="cpu"))
    loss = mod(*inputs, target)
    assert loss.shape == () and loss.item() == 0.0
    loss.backward()
    _assert_zero_grads(*(x for x in inputs if x.requires_grad))
