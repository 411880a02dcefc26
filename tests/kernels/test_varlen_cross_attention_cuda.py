"""varlen_cross_attention's CUDA kernels (csrc/cuda/varlen_cross_attention_kernels.cuh and
csrc/cuda/varlen_cross_attention_kernels_wmma.cuh) against the float64 reference: out and
lse, and dq, dk, dv under a random output gradient *and* a nonzero lse gradient, on two targets
(as tests/kernels/test_topk_tail_kl_cuda.py):

- ``cuda``: the real kernels on a GPU (where the extension was built with CUDA; elsewhere these
  skip with the reason);
- ``emulated``: the same kernel source compiled by g++ and run on CPU tensors by the SIMT
  emulator (csrc/emu/, tests/kernels/simt_emu.py). It checks the kernels' indexing, arithmetic, and
  barrier / warp-collective structure, not their speed or memory model.

Shapes cover the kernels' edges: D in {16, 64, 80, 128} (1, 2, 3, 4 dims per lane; 80 leaves
lanes idle in the last slot), key tiles of 32 (items of 0, 1, 7, 33, 97 and ~2000 keys), query
rows per kv head (G * Lq) that fill 1 to 8 warps and several dK/dV row chunks of 32.

Which kernels a shape runs (the host launcher picks; nothing in Python changes): bf16 / fp16
inputs with D % 16 == 0 and D <= 128 take the tensor-core (WMMA) kernels, everything else the
CUDA-core fp32 kernels. So the fp32 tests (test_matches_reference, test_single_query,
test_long_item[fp32], ...) run the CUDA-core kernels; test_half_precision (D = 80),
test_long_item[bf16] (D = 128), test_wmma_* and the half-precision cases of
test_nonzero_lse_gradient_on_empty_items run the WMMA kernels (tiles of 64 query rows / 64 or 32
keys, 16 per warp); test_half_precision_cuda_core_fallback (D = 40, D = 144) and the misaligned
run of test_misaligned_half_precision_inputs_fall_back run the CUDA-core kernels on
half-precision inputs.
"""

from __future__ import annotations

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.varlen_cross_attention import varlen_cross_attention_reference
from tests.kernels import simt_emu
from tests.kernels.utils import cu_seqlens, varlen_inputs
from tests.utils import TOLERANCES, assert_close

EMU_UNAVAILABLE = simt_emu.unavailable_reason()
# Odd lengths: a 1-key item, an empty item in the middle, partial and multiple key tiles.
LENGTHS = [1, 7, 0, 97, 33]


def cuda_op(q, k, v, cu, *, scale=None, return_lse=False):
    """The CUDA backend on copies of CPU leaves; outputs back on the CPU (autograd crosses)."""
    res = lk.varlen_cross_attention(
        q.cuda(), k.cuda(), v.cuda(), cu.cuda(), scale=scale, backend="cuda", return_lse=True
    )
    out, lse = (t.cpu() for t in res)
    return (out, lse) if return_lse else out


@pytest.fixture(params=simt_emu.cuda_targets("varlen_cross_attention_cuda_fwd"))
def target(request):
    """Where the CUDA kernels run: ``"cuda"`` (a GPU) or ``"emulated"`` (SIMT emulator, CPU)."""
    return simt_emu.prepare_target(request.param)


def op_for(where: str):
    return cuda_op if where == "cuda" else simt_emu.varlen_cross_attention_emulated


def raw_ops(where: str):
    """(fwd, bwd) custom ops of the target, called without autograd."""
    ns = torch.ops.lopd if where == "cuda" else torch.ops.lopd_simt_emu
    return ns.varlen_cross_attention_cuda_fwd, ns.varlen_cross_attention_cuda_bwd


def _reference_lse(q64, k64, cu, scale):
    """float64 [B, Hq, Lq] log-sum-exp of the scaled scores (-inf for an empty item)."""
    batch, lq, hq, _ = q64.shape
    group = hq // k64.shape[1]
    bounds = cu.tolist()
    rows = []
    for b in range(batch):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            rows.append(torch.full((hq, lq), float("-inf"), dtype=torch.float64))
            continue
        kb = k64[s:e].repeat_interleave(group, 1)
        rows.append(torch.logsumexp(torch.einsum("ihd,thd->hit", q64[b], kb) * scale, -1))
    return torch.stack(rows)


def assert_grad_close(actual, expected, dtype, msg):
    """The per-dtype tolerance of tests/utils.py, with the fp32 atol taken relative to the
    gradient's largest entry (when above 1).

    The table's fp32 atol (2e-6) is absolute; these gradients reach ~30 at Lq = 32 and
    ``ds = p (<do, v> - delta)`` subtracts two fp32 dot products of that size (exactly equal in
    float64 for a 1-key item), so every fp32 implementation is off by ~1e-6 of the largest
    entry. Measured at GQA 8/2, D = 128, Lq = 32: the CPU backend (ATen's GEMMs) misses the
    absolute atol by 1.1x (dk) and 1.5x (dv), these kernels by 2.6x (dk). Half-precision bounds
    are dominated by rounding the result, which rtol covers: unchanged.
    """
    if dtype != torch.float32:
        assert_close(actual, expected, dtype, msg)
        return
    rtol, atol = TOLERANCES[dtype]
    assert not torch.isnan(actual).any(), f"{msg}: NaN in result"
    expected = expected.detach().double()
    atol *= max(1.0, float(expected.abs().max()) if expected.numel() else 1.0)
    torch.testing.assert_close(actual.detach().double(), expected, rtol=rtol, atol=atol, msg=msg)


def check(where, lengths, n_q_heads, n_kv_heads, head_dim, seq_q, dtype, seed=0, scale=None):
    """out, lse, dq, dk, dv of the target vs float64, with random do and random (finite) dlse."""
    cu = cu_seqlens(lengths)
    q, k, v, grad = varlen_inputs(
        lengths, n_q_heads, n_kv_heads, head_dim, seq_q, dtype, "cpu", seed
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w = torch.randn(len(lengths), n_q_heads, seq_q, generator=torch.Generator().manual_seed(seed))
    eff_scale = head_dim**-0.5 if scale is None else scale

    out, lse = op_for(where)(q, k, v, cu, scale=scale, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (len(lengths), n_q_heads, seq_q)
    # An empty item's lse is -inf: weight the finite entries only (the gradient of the masked
    # entries is 0, which the backward must survive without NaN).
    loss = (out.float() * grad.float()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * w).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = varlen_cross_attention_reference(q64, k64, v64, cu, scale=eff_scale)
    ref_lse = _reference_lse(q64, k64, cu, eff_scale)
    finite = torch.isfinite(ref_lse)
    ref_loss = (ref * grad.double()).sum() + (ref_lse.masked_fill(~finite, 0) * w.double()).sum()
    rdq, rdk, rdv = torch.autograd.grad(ref_loss, (q64, k64, v64))

    assert_close(out, ref, dtype, f"{where} out")
    assert torch.equal(torch.isneginf(lse), ~finite), f"{where} lse: -inf exactly at empty items"
    assert_close(lse[finite], ref_lse[finite], torch.float32, f"{where} lse")
    assert_grad_close(dq, rdq, dtype, f"{where} dq")
    assert_grad_close(dk, rdk, dtype, f"{where} dk")
    assert_grad_close(dv, rdv, dtype, f"{where} dv")
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"{where} out of empty item"
            assert torch.equal(dq[b], torch.zeros_like(dq[b])), f"{where} dq of empty item"


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_matches_reference(target, heads, head_dim):
    # Lq = 32: 128 (MHA) or 128 (GQA: 4 heads x 32) query rows per kv head -> 4 forward blocks of
    # 32 rows, 4 dK/dV row chunks.
    check(target, LENGTHS, *heads, head_dim, 32, torch.float32, seed=head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_half_precision(target, heads, dtype):
    check(target, LENGTHS, *heads, 80, 32, dtype, seed=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("heads", "head_dim"), [((8, 2), 16), ((6, 2), 64), ((8, 2), 80), ((6, 2), 128)]
)
def test_wmma_gqa(target, heads, head_dim, dtype):
    # The WMMA kernels at D = 1, 4, 5, 8 tiles of 16, Lq = 32: 128 query rows per kv head (two full
    # row tiles of 64, four dK/dV chunks of 32) or 96 (G = 3: the second row tile half padding);
    # a 1-key item, an empty one, and items ending inside a 16-key sub-tile of the 64 / 32 tiles.
    check(target, LENGTHS, *heads, head_dim, 32, dtype, seed=20 + head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("heads", "head_dim"), [((2, 2), 16), ((8, 2), 64), ((3, 1), 128)], ids=["mha", "gqa", "mqa"]
)
def test_wmma_single_query(target, heads, head_dim, dtype):
    # Lq = 1: 1 to 4 query rows in a 64-row tile (the other rows are zero padding).
    check(target, [0, 1, 50, 3], *heads, head_dim, 1, dtype, seed=21)


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 40), (torch.float16, 144)], ids=["bf16-40", "fp16-144"]
)
def test_half_precision_cuda_core_fallback(target, dtype, head_dim):
    # D % 16 != 0 or D > 128: the CUDA-core kernels, on half-precision inputs.
    check(target, [3, 0, 40], 4, 2, head_dim, 5, dtype, seed=22)


def test_misaligned_half_precision_inputs_fall_back(target):
    """The WMMA kernels stage rows in 16-byte vectors: a contiguous view 2 bytes off 16-byte
    alignment takes the CUDA-core kernels instead, with results within the bf16 tolerance of the
    aligned (WMMA) run."""
    fwd, bwd = raw_ops(target)
    dev = "cuda" if target == "cuda" else "cpu"
    lengths = [5, 0, 40]
    cu = cu_seqlens(lengths, dev)
    q, k, v, grad = varlen_inputs(lengths, 4, 2, 64, 6, torch.bfloat16, dev, seed=23)
    q_off = torch.empty(q.numel() + 1, dtype=q.dtype, device=dev)[1:].view(q.shape).copy_(q)
    assert q_off.is_contiguous() and q_off.data_ptr() % 16 != 0
    out, lse = fwd(q, k, v, cu, 0.125, 40)
    out2, lse2 = fwd(q_off, k, v, cu, 0.125, 40)
    assert_close(out2, out, torch.bfloat16, "misaligned out")
    assert_close(lse2, lse, torch.float32, "misaligned lse")
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(24)).to(dev)
    grads = bwd(grad, dlse, q, k, v, out, lse, cu, 0.125, 40)
    grads2 = bwd(grad, dlse, q_off, k, v, out, lse, cu, 0.125, 40)
    for name, a, b_ in zip(("dq", "dk", "dv"), grads2, grads, strict=True):
        assert_close(a, b_.double(), torch.bfloat16, f"misaligned {name}")


@pytest.mark.parametrize(
    ("heads", "head_dim"), [((2, 2), 16), ((8, 2), 64), ((3, 1), 128)], ids=["mha", "gqa", "mqa"]
)
def test_single_query(target, heads, head_dim):
    # Lq = 1: G rows per kv head (1 to 4): one partly filled warp per block.
    check(target, [0, 1, 50, 3], *heads, head_dim, 1, torch.float32, seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_item(target, dtype):
    # T ~ 2000: 63 key tiles streamed by the forward and dQ kernels, 63 dK/dV blocks; a short item
    # next to it (its dK/dV blocks past its end exit at once).
    check(target, [1999, 5], 2, 1, 128, 32, dtype, seed=3)


def test_custom_scale_and_odd_head_dim(target):
    # D = 20 (odd stride path not taken: stride 21) and D = 33 (odd: stride 33, 2 dims per lane).
    check(target, [3, 70], 3, 1, 20, 4, torch.float32, seed=4, scale=0.3)
    check(target, [40, 0, 2], 2, 2, 33, 3, torch.float32, seed=5, scale=0.7)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_nonzero_lse_gradient_on_empty_items(target, dtype):
    """The backward op with a random grad_lse on *every* row, empty items included: finite
    results, dq = 0 for the empty item, and the other items as with the masked gradient (D = 64:
    CUDA-core kernels for fp32, WMMA for bf16 / fp16)."""
    fwd, bwd = raw_ops(target)
    dev = "cuda" if target == "cuda" else "cpu"
    lengths = [5, 0, 40]
    cu = cu_seqlens(lengths, dev)
    q, k, v, grad = varlen_inputs(lengths, 4, 2, 64, 6, dtype, dev, seed=6)
    out, lse = fwd(q, k, v, cu, 0.125, 40)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(7)).to(dev)
    dq, dk, dv = bwd(grad, dlse, q, k, v, out, lse, cu, 0.125, 40)
    masked = dlse.clone()
    masked[1] = 0
    dq2, dk2, dv2 = bwd(grad, masked, q, k, v, out, lse, cu, 0.125, 40)
    for a, b_ in ((dq, dq2), (dk, dk2), (dv, dv2)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b_, rtol=0, atol=0)
    assert torch.equal(dq[1], torch.zeros_like(dq[1]))


@pytest.mark.skipif(EMU_UNAVAILABLE is not None, reason=str(EMU_UNAVAILABLE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-wmma"])
def test_emulated_random_schedule(dtype):
    """The kernels give the reference's results whatever order the emulated threads resume in at
    each barrier and warp collective (a seeded random schedule instead of round-robin)."""
    simt_emu.load()
    simt_emu.set_schedule_seed(12345)
    try:
        check("emulated", [1, 0, 45], 8, 2, 80, 5, dtype, seed=8)
    finally:
        simt_emu.set_schedule_seed(0)


def test_opcheck(target):
    """Schemas, fake implementations and autograd registration of the ops (lopd_kernels registers
    them for the CUDA ops, tests/kernels/simt_emu.py the same functions for the emulated ones)."""
    fwd, bwd = raw_ops(target)
    dev = "cuda" if target == "cuda" else "cpu"
    lengths = [3, 0, 20]
    cu = cu_seqlens(lengths, dev)
    q, k, v, grad = varlen_inputs(lengths, 4, 2, 16, 2, torch.float32, dev, seed=9)
    torch.library.opcheck(fwd, (q.requires_grad_(), k, v, cu, 0.25, 20))
    out, lse = fwd(q.detach(), k, v, cu, 0.25, 20)
    torch.library.opcheck(
        bwd, (grad, torch.zeros_like(lse), q.detach(), k, v, out, lse, cu, 0.25, 20)
    )


def _bad_input_cases():
    lengths = [3, 0, 20]
    cu = cu_seqlens(lengths)
    q, k, v, _ = varlen_inputs(lengths, 4, 2, 16, 2, torch.float32, "cpu", seed=10)
    ok = {"q": q, "k": k, "v": v, "cu": cu, "scale": 0.25, "max_seqlen_k": 20}
    big_d = torch.zeros(1, 1, 1, 264), torch.zeros(2, 1, 264)
    return [
        ({"q": q.double(), "k": k.double(), "v": v.double()}, "q must be float32"),
        ({"k": k.half()}, "k and v must have q's dtype"),
        ({"q": q[0]}, r"q must be \[B, Lq, Hq, D\]"),
        ({"k": k[None]}, "k must be packed"),
        ({"v": v[:, :1].contiguous()}, "v must have k's shape"),
        ({"k": k[..., :8].contiguous(), "v": v[..., :8].contiguous()}, "k head dim 8"),
        ({"q": q[:, :, :3].contiguous()}, "must be a positive multiple of k/v heads"),
        ({"q": q.transpose(1, 2)}, "q must be contiguous"),
        ({"cu": cu.long()}, "cu_seqlens_k must be int32"),
        ({"cu": cu[:-1]}, r"cu_seqlens_k must be \[B\+1\]"),
        ({"cu": cu.flip(0).contiguous()}, "cu_seqlens_k must start at 0"),
        ({"cu": torch.tensor([0, 10, 3, 23], dtype=torch.int32)}, "non-decreasing"),
        ({"max_seqlen_k": 5}, "max_seqlen_k=5 is below"),
        ({"scale": float("nan")}, "scale must be a positive finite float"),
        (
            {"q": big_d[0], "k": big_d[1], "v": big_d[1], "cu": cu_seqlens([2])},
            r"head dim D must be in \[1, 256\]",
        ),
    ], ok


@pytest.mark.skipif(EMU_UNAVAILABLE is not None, reason=str(EMU_UNAVAILABLE))
def test_emulated_rejects_bad_input_naming_the_argument():
    simt_emu.load()
    fwd = torch.ops.lopd_simt_emu.varlen_cross_attention_cuda_fwd
    bwd = torch.ops.lopd_simt_emu.varlen_cross_attention_cuda_bwd
    cases, ok = _bad_input_cases()
    for change, match in cases:
        a = {**ok, **change}
        with pytest.raises(RuntimeError, match=match):
            fwd(a["q"], a["k"], a["v"], a["cu"], a["scale"], a["max_seqlen_k"])
    q, k, v, cu = ok["q"], ok["k"], ok["v"], ok["cu"]
    out, lse = fwd(q, k, v, cu, 0.25, 20)
    good = {"grad_out": out, "grad_lse": torch.zeros_like(lse), "out": out, "lse": lse}
    for change, match in [
        ({"grad_out": out.half()}, "grad_out must match q"),
        ({"out": out[:, :1].contiguous()}, "out must match q"),
        ({"lse": lse.double()}, r"lse must be float32 \[B, Hq, Lq\]"),
        ({"grad_lse": lse[:, :1].contiguous()}, r"grad_lse must be float32 \[B, Hq, Lq\]"),
    ]:
        a = {**good, **change}
        with pytest.raises(RuntimeError, match=match):
            bwd(a["grad_out"], a["grad_lse"], q, k, v, a["out"], a["lse"], cu, 0.25, 20)


def test_public_backend_cuda_needs_cuda_tensors():
    cu = cu_seqlens([2, 3])
    q, k, v, _ = varlen_inputs([2, 3], 2, 1, 16, 2, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="backend='cuda' needs CUDA tensors"):
        lk.varlen_cross_attention(q, k, v, cu, backend="cuda")
