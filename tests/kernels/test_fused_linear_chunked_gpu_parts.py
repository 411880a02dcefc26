"""The chunked path of ``fused_linear_topk_tail_kl`` as it runs on a GPU, against the float64
reference, on CPU tensors:

* its per-row epilogue: what ``topk_tail_kl``'s ``backend="auto"`` picks on a GPU;
* the Triton epilogue and the Triton tail-probability pass, under ``TRITON_INTERPRET=1``
  (conftest.py);
* the half-precision GEMM plan of a GPU (one cast of the logit gradient, fp32-output ``addmm``
  into the weight gradient), with cuBLAS's ``mm(out_dtype=float32)`` / ``addmm(out_dtype=
  float32)`` stood in for by float32 GEMMs of the same half-precision operands (the same product
  up to summation order; what is tested is which operands reach which GEMM).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.kernels.fused_linear_utils import CASES, check, check_case, make_inputs
from tests.kernels.triton_compile import assert_script_compiles
from tests.utils import assert_close, requires_triton_interpret, triton_interpret

chunked = importlib.import_module("lopd_kernels.fused_linear_topk_tail_kl_chunked")
gemm = importlib.import_module("lopd_kernels.gemm_f32")
FROZEN = {"student_hidden", "teacher_hidden"}
ALL = {"student_hidden", "student_weight", "teacher_hidden", "teacher_weight"}


def test_epilogue_follows_topk_tail_kl_auto(monkeypatch):
    """On a GPU the epilogue is what topk_tail_kl's "auto" picks: Triton first, then the CUDA
    kernels, each within its top_m limit, else the PyTorch twins; the C++ kernels on CPU."""
    from lopd_kernels import _backend
    from lopd_kernels.topk_tail_kl import BACKENDS

    monkeypatch.setattr(_backend, "triton_available", lambda: True)
    built = _backend.OpBackends(BACKENDS.op, BACKENDS.impls, unavailable={}, auto=BACKENDS.auto)
    monkeypatch.setattr(chunked, "TOPK_TAIL_KL_BACKENDS", built)
    gpu = torch.device("cuda")
    assert chunked.epilogue_impl(gpu, 20) == "triton"
    assert chunked.epilogue_impl(gpu, 300) == "cuda"  # Triton's top-M limit is 256
    assert chunked.epilogue_impl(gpu, 2000) == "torch"  # CUDA's is 1024
    assert chunked.epilogue_impl(torch.device("cpu"), 20) == "cpu"
    monkeypatch.setattr(_backend, "triton_available", lambda: False)
    assert chunked.epilogue_impl(gpu, 20) == "cuda"
    no_cuda = _backend.OpBackends(BACKENDS.op, BACKENDS.impls, unavailable={"cuda": "not built"},
                                  auto=BACKENDS.auto)  # fmt: skip
    monkeypatch.setattr(chunked, "TOPK_TAIL_KL_BACKENDS", no_cuda)
    assert chunked.epilogue_impl(gpu, 20) == "torch"


# ---------------------------------------------------------------------------------------------
# Triton tail-probability pass
# ---------------------------------------------------------------------------------------------


@requires_triton_interpret
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [0, 7])
def test_tail_probs_triton_matches_float64(out_dtype, m):
    from lopd_kernels.triton.fused_linear_topk_tail_kl_chunked import tail_probs_triton

    g = torch.Generator().manual_seed(3)
    c, v, temp = 5, 173, 0.7
    x = torch.randn(c, v + 3, generator=g) * 3
    x[1, 10:40] = -math.inf  # masked vocabulary entries: probability 0
    x = x[:, :v]  # a row stride that is not V
    lse = torch.logsumexp(x.double() / temp, dim=1)
    ids = torch.stack([torch.randperm(v, generator=g)[:m] for _ in range(c)])
    want = (x.double() / temp - lse[:, None]).exp()
    want.scatter_(1, ids, 0.0)
    lse_col = torch.stack([lse.float(), lse.float()], dim=1)[:, 0]  # strided, as the op's lse
    got = tail_probs_triton(x.clone(), lse_col, ids, temp, out_dtype)
    assert got.dtype == out_dtype and got.shape == (c, v)
    assert_close(got.double(), want, out_dtype, "tail probs")
    assert not got.gather(1, ids).any()
    torch_path = chunked.tail_probs(x.clone(), lse_col, ids, temp, out_dtype)
    assert_close(torch_path.double(), want, out_dtype, "tail probs, PyTorch passes")


_COMPILE_SCRIPT = """
import functools

from tests.kernels.triton_compile import compile_kernel
from lopd_kernels.triton.fused_linear_topk_tail_kl_chunked_kernels import _tail_probs_kernel

for out in ("*bf16", "*fp32"):
    def arg_type(name, out=out):
        return {"X": "*fp32", "LSE": "*fp32", "IDS": "*i64", "OUT": out}.get(
            name, "fp32" if name == "inv_temp" else "i32")
    compile_kernel(_tail_probs_kernel, arch=90, arg_type=arg_type,
                   aligned=lambda n: n in ("X", "IDS", "OUT", "stride_x", "stride_o"),
                   M=20, M_PAD=32, BLOCK_V=2048)
print("compiled")
"""


def test_tail_probs_kernel_compiles_for_sm90():
    assert_script_compiles(_COMPILE_SCRIPT)


# ---------------------------------------------------------------------------------------------
# The chunked path with the GPU parts on CPU tensors
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def triton_gpu_parts(monkeypatch):
    """The chunked path as it runs on a GPU with Triton: Triton epilogue, Triton tail pass."""
    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1 (Triton on CPU tensors)")
    import lopd_kernels.topk_tail_kl  # noqa: F401  (registers the Triton ops)

    ops = torch.ops.lopd
    monkeypatch.setattr(
        chunked,
        "epilogue_kernels",
        lambda device, top_m=0: chunked.EpilogueKernels(
            ops.topk_tail_kl_triton_fwd, ops.topk_tail_kl_triton_bwd
        ),
    )
    monkeypatch.setattr(chunked, "tail_probs_on_triton", lambda logits: True)


# The interpreter is slow: few, small cases (the per-row Triton kernels themselves are tested at
# length in tests/kernels/test_topk_tail_kl_triton.py). With every input requiring grad no tail
# projection runs: the epilogue is what differs from the CPU path.
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: "-".join(map(str, c)))
def test_triton_epilogue_matches_reference(case, triton_gpu_parts):
    check_case(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_tail_pass_frozen_heads(dtype, triton_gpu_parts):
    """The Triton tail pass in the forward, frozen heads, masked rows."""
    inputs, target = make_inputs(11, 16, 67, dtype, bias=True, seed=16)
    check(inputs, target, "chunked", dtype, requires=FROZEN, top_m=8, temperature=0.9, chunk_size=4)


@pytest.fixture
def gemm_calls(monkeypatch):
    """The GPU half-precision GEMM plan on CPU tensors; records the operand dtypes of each GEMM."""
    calls: list[tuple[str, torch.dtype, torch.dtype]] = []
    half = (torch.bfloat16, torch.float16)

    def mm_f32_out(a, b):
        calls.append(("mm", a.dtype, b.dtype))
        assert a.dtype == b.dtype and a.dtype in half
        return a.float() @ b.float()

    def addmm_f32_out_(out, a, b):
        calls.append(("addmm", a.dtype, b.dtype))
        assert a.dtype == b.dtype and a.dtype in half and out.dtype == torch.float32
        return out.addmm_(a.float(), b.float())

    monkeypatch.setattr(gemm, "half_gemm", lambda b: b.dtype in half)
    monkeypatch.setattr(gemm, "half_addmm", lambda b: b.dtype in half)
    monkeypatch.setattr(gemm, "mm_f32_out", mm_f32_out)
    monkeypatch.setattr(gemm, "addmm_f32_out_", addmm_f32_out_)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("requires", [ALL, FROZEN, {"student_hidden", "student_weight"}],
                         ids=["all", "frozen-heads", "student-only"])  # fmt: skip
def test_half_gemm_plan_matches_reference(dtype, requires, gemm_calls):
    inputs, target = make_inputs(13, 32, 301, dtype, bias=True, seed=5)
    check(inputs, target, "chunked", dtype, requires=requires, top_m=6, temperature=1.3,
          divergence="forward", chunk_size=4)  # fmt: skip
    kinds = {k for k, *_ in gemm_calls}
    trains_head = bool(requires & {"student_weight", "teacher_weight"})
    # The weight gradient accumulates by the fp32-output addmm.
    assert ("addmm" in kinds) == trains_head


def test_half_gemm_plan_tied_head_full_vocab(gemm_calls):
    inputs, target = make_inputs(9, 16, 97, torch.bfloat16, tied=True, seed=8)
    check(inputs, target, "chunked", torch.bfloat16, top_m=None, chunk_size=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_frozen_heads(dtype):
    inputs, target = make_inputs(11, 32, 203, dtype, bias=True, seed=16)
    check(inputs, target, "chunked", dtype, requires=FROZEN, top_m=8, temperature=0.9, chunk_size=4)
