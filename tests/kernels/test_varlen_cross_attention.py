"""varlen_cross_attention: every backend vs the float64 reference, forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch

from lopd_kernels._backend import triton_available
from lopd_kernels.varlen_cross_attention import (
    varlen_cross_attention,
    varlen_cross_attention_reference,
)
from tests.kernels.triton_compile import assert_script_compiles
from tests.kernels.utils import cu_seqlens, varlen_inputs
from tests.utils import assert_close

# The four lengths of the spec plus an empty item in the middle of the pack.
LENGTHS = [1, 7, 0, 97, 1025]
KERNEL_BACKENDS = ["cpu"] + (["triton"] if triton_available() else [])
DEVICE = {"cpu": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}


def _reference_grads(q, k, v, cu, grad, scale=None):
    """Float64 reference output and (dq, dk, dv) on the same (already rounded) inputs."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out = varlen_cross_attention_reference(q64, k64, v64, cu.cpu(), scale=scale)
    grads = torch.autograd.grad(out, (q64, k64, v64), grad.double().cpu())
    return out.detach(), grads


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_backend_matches_reference(backend, dtype, heads):
    device = DEVICE[backend]
    n_q_heads, n_kv_heads = heads
    cu = cu_seqlens(LENGTHS, device)
    q, k, v, grad = varlen_inputs(LENGTHS, n_q_heads, n_kv_heads, 16, 5, dtype, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = varlen_cross_attention(q, k, v, cu, max_seqlen_k=max(LENGTHS), backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref, (rdq, rdk, rdv) = _reference_grads(q, k, v, cu, grad)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out.cpu(), ref, dtype, f"{backend} out")
    assert_close(dq.cpu(), rdq, dtype, f"{backend} dq")
    assert_close(dk.cpu(), rdk, dtype, f"{backend} dk")
    assert_close(dv.cpu(), rdv, dtype, f"{backend} dv")
    # The empty item (index 2): exact zeros out, zero dq; it owns no key rows.
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.equal(dq[2], torch.zeros_like(dq[2]))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_non_power_of_two_head_dim_and_custom_scale(backend):
    """Head dim 20 exercises the masked D tile (Qwen3-4B's QFormer has D = 2560 / 32 = 80)."""
    device = DEVICE[backend]
    lengths = [3, 70]
    cu = cu_seqlens(lengths, device)
    q, k, v, grad = varlen_inputs(lengths, 3, 1, 20, 4, torch.float32, device, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = varlen_cross_attention(q, k, v, cu, scale=0.3, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref, rgrads = _reference_grads(q, k, v, cu, grad, scale=0.3)
    assert_close(out.cpu(), ref, torch.float32, "out")
    for name, g, r in zip("qkv", grads, rgrads):
        assert_close(g.cpu(), r, torch.float32, f"d{name}")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_lse_output_and_its_gradient(backend):
    """lse is differentiable (the Perceiver option merges two attentions through it)."""
    device = DEVICE[backend]
    lengths = [5, 0, 40]
    cu = cu_seqlens(lengths, device)
    q, k, v, grad = varlen_inputs(lengths, 2, 1, 16, 3, torch.float32, device, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = varlen_cross_attention(q, k, v, cu, backend=backend, return_lse=True)
    assert torch.isneginf(lse[1]).all()
    w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3)).to(device)
    loss = (out * grad).sum() + (lse.masked_fill(torch.isinf(lse), 0) * w).sum()
    grads = torch.autograd.grad(loss, (q, k, v))

    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref_loss = (varlen_cross_attention_reference(q64, k64, v64, cu.cpu()) * grad.cpu()).sum()
    for b, (s, e) in enumerate([(0, 5), (5, 5), (5, 45)]):
        if e == s:
            continue
        scores = torch.einsum("ihd,thd->hit", q64[b], k64[s:e].repeat_interleave(2, 1)) * 0.25
        ref_lse = torch.logsumexp(scores, -1)
        assert_close(lse[b].cpu(), ref_lse, torch.float32, "lse")
        ref_loss = ref_loss + (ref_lse * w[b].cpu()).sum()
    rgrads = torch.autograd.grad(ref_loss, (q64, k64, v64))
    for name, g, r in zip("qkv", grads, rgrads):
        assert_close(g.cpu(), r, torch.float32, f"d{name}")


def test_reference_matches_dense_masked_softmax():
    """The SDPA-loop reference vs an explicit padded softmax(QK^T)V, in float64."""
    lengths = [4, 0, 9]
    cu = cu_seqlens(lengths)
    q, k, v, _ = varlen_inputs(lengths, 4, 2, 8, 3, torch.float64, "cpu", seed=4)
    out = varlen_cross_attention_reference(q, k, v, cu)
    for b, (s, e) in enumerate([(0, 4), (4, 4), (4, 13)]):
        if e == s:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        kb, vb = k[s:e].repeat_interleave(2, 1), v[s:e].repeat_interleave(2, 1)
        p = torch.softmax(torch.einsum("ihd,thd->hit", q[b], kb) / 8**0.5, -1)
        torch.testing.assert_close(out[b], torch.einsum("hit,thd->ihd", p, vb))


@pytest.mark.skipif(not triton_available(), reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("num_splits", [2, 5])
def test_triton_split_kv_forward(num_splits):
    """Split-KV chunks (some empty for the short items) merge to the unsplit result."""
    from lopd_kernels.triton.varlen_cross_attention import varlen_xattn_fwd

    device = DEVICE["triton"]
    lengths = [1, 0, 300, 64]
    cu = cu_seqlens(lengths, device)
    q, k, v, _ = varlen_inputs(lengths, 4, 2, 16, 5, torch.float32, device, seed=5)
    out, lse = varlen_xattn_fwd(q, k, v, cu, 0.25, max(lengths), num_splits=num_splits)
    ref = varlen_cross_attention_reference(q.double().cpu(), k.double().cpu(), v.double().cpu(), cu)
    assert_close(out.cpu(), ref, torch.float32, "split out")
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[[0, 2, 3]]).all()


def _opcheck_args(device, dtype=torch.float32):
    lengths = [3, 0, 20]
    cu = cu_seqlens(lengths, device)
    q, k, v, grad = varlen_inputs(lengths, 4, 2, 16, 2, dtype, device, seed=6)
    return lengths, cu, q, k, v, grad


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_opcheck(backend):
    device = DEVICE[backend]
    lengths, cu, q, k, v, grad = _opcheck_args(device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fwd = getattr(torch.ops.lopd, f"varlen_cross_attention_{backend}_fwd")
    bwd = getattr(torch.ops.lopd, f"varlen_cross_attention_{backend}_bwd")
    extra = (max(lengths),)
    torch.library.opcheck(fwd, (q, k, v, cu, 0.25, *extra))
    out, lse = fwd(q.detach(), k.detach(), v.detach(), cu, 0.25, *extra)
    bwd_args = (grad, torch.zeros_like(lse), q.detach(), k.detach(), v.detach(), out, lse, cu)
    torch.library.opcheck(bwd, (*bwd_args, 0.25, *extra))


def test_auto_backend_and_dtype_support():
    _, cu, q, k, v, _ = _opcheck_args("cpu")
    auto = varlen_cross_attention(q, k, v, cu)
    torch.testing.assert_close(auto, varlen_cross_attention(q, k, v, cu, backend="cpu"))
    with pytest.raises(RuntimeError, match="backend='cuda'"):
        varlen_cross_attention(q, k, v, cu, backend="cuda")
    with pytest.raises(TypeError, match="fp32/bf16/fp16"):
        varlen_cross_attention(q.double(), k.double(), v.double(), cu, backend="cpu")
    # The reference returns the log-sum-exp too (it is what "auto" falls back to).
    out, lse = varlen_cross_attention(q, k, v, cu, backend="torch", return_lse=True)
    cpu_out, cpu_lse = varlen_cross_attention(q, k, v, cu, backend="cpu", return_lse=True)
    torch.testing.assert_close(out, cpu_out)
    torch.testing.assert_close(lse, cpu_lse)


@pytest.mark.parametrize(
    ("triton", "cuda_kernel", "expected"),
    [
        (True, True, "triton"),
        (True, False, "triton"),
        (False, True, "cuda"),
        (False, False, "torch"),
    ],
)
def test_auto_backend_on_cuda_tensors(monkeypatch, triton, cuda_kernel, expected):
    """On a GPU "auto" is Triton; a deployment without Triton gets the compiled CUDA kernels,
    one without either the reference."""
    import dataclasses

    from lopd_kernels import _backend

    # The module (lopd_kernels exports a function of the same name).
    xattn = importlib.import_module("lopd_kernels.varlen_cross_attention")
    monkeypatch.setattr(_backend, "triton_available", lambda: triton)
    missing = {} if cuda_kernel else {"cuda": _backend.CUDA_MISSING}
    backends = dataclasses.replace(xattn.BACKENDS, unavailable=missing)
    assert backends.resolve("auto", torch.device("cuda")) == expected
    assert backends.resolve("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "q must be"),
        (lambda a: {**a, "k": a["k"][None]}, ValueError, "k must be"),
        (lambda a: {**a, "v": a["v"][:, :1]}, ValueError, "v must have"),
        (lambda a: {**a, "k": a["k"][:, :, :8], "v": a["v"][:, :, :8]}, ValueError, "head dim"),
        (lambda a: {**a, "q": a["q"][:, :, :3]}, ValueError, "multiple of k/v heads"),
        (lambda a: {**a, "k": a["k"].half()}, TypeError, "share a dtype"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"].long()}, TypeError, "cu_seqlens_k"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:-1]}, ValueError, "cu_seqlens_k"),
        (
            lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"].flip(0).contiguous()},
            ValueError,
            "cu_seqlens_k must start at 0",
        ),
        (lambda a: {**a, "max_seqlen_k": 5}, ValueError, "max_seqlen_k"),
        (lambda a: {**a, "scale": -1.0}, ValueError, "scale"),
        (lambda a: {**a, "backend": "gpu"}, ValueError, "backend"),
    ],
)
def test_validation_names_the_argument(mutate, error, match):
    _, cu, q, k, v, _ = _opcheck_args("cpu")
    args = {"q": q, "k": k, "v": v, "cu_seqlens_k": cu}
    args = mutate(args)
    with pytest.raises(error, match=match):
        varlen_cross_attention(**args)


# Runs in a subprocess: under TRITON_INTERPRET=1 (conftest.py) triton.jit yields interpreter
# functions, which cannot be compiled.
_COMPILE_SCRIPT = """
from tests.kernels.triton_compile import compile_kernel
import lopd_kernels.triton.varlen_cross_attention as k

def arg_type(name):
    if name in ("Q", "K", "V", "DO", "DQ", "DK", "DV", "Out"):
        return "*bf16"
    if name == "CU":
        return "*i32"
    if name in ("LSE", "DELTA"):
        return "*fp32"
    return "fp32" if name in ("sm_scale", "qk_scale_log2") else "i32"

def compile_for(fn, arch, **constexprs):
    compile_kernel(
        fn, arch, arg_type, lambda n: n.isupper() or n.startswith("stride"), num_warps=4,
        **constexprs,
    )

for arch in (80, 90):
    c = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, PRECISION="tf32", UPCAST=False)
    compile_for(k._fwd_kernel, arch, **c)
    compile_for(k._bwd_dq_kernel, arch, **c)
    compile_for(k._bwd_dkdv_kernel, arch, **{**c, "BLOCK_M": 32})
print("compiled")
"""


def test_triton_kernels_compile_for_sm80_sm90():
    """The three kernels lower to cubins for sm_80 and sm_90 in bf16 (Triton's ptxas, no GPU).

    The interpreter accepts code the compiler rejects (early returns, int64 loop bounds, dtype
    changes across loop iterations): this checks that the GPU path builds.
    """
    assert_script_compiles(_COMPILE_SCRIPT)
