"""topk_tail_kl's CUDA kernel (csrc/cuda/topk_tail_kl.cu) against the float64 reference: the same
checks as the other backends (all outputs, both gradients under random upstream gradients).

Runs only where the extension was built with CUDA and a GPU is present (benchmarks/gpu_all.sh
runs it, also under compute-sanitizer memcheck with LOPD_TEST_SMALL=1). Elsewhere every test
skips with the reason; the kernel's per-row arithmetic is shared with the C++ CPU kernel
(csrc/common/topk_tail_kl_math.h), which tests/test_topk_tail_kl.py covers on every machine.
"""

from __future__ import annotations

import os

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels import _backend
from lopd_kernels.topk_tail_kl import TopKTailKLOutput, topk_tail_kl_reference
from tests.test_topk_tail_kl import assert_grad_close, make_inputs, random_upstream, run
from tests.utils import assert_close

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _backend.has_cuda_kernel("topk_tail_kl_fwd")),
    reason="needs a CUDA device and lopd_kernels._C built with the CUDA kernels",
)
SMALL = os.environ.get("LOPD_TEST_SMALL") == "1"


def cuda_op(s, t, target, **kw):
    """The CUDA backend on copies of CPU leaves; outputs back on the CPU (autograd crosses)."""
    out = lk.topk_tail_kl(s.cuda(), t.cuda(), target.cuda(), backend="cuda", **kw)
    return TopKTailKLOutput(*(o.cpu() for o in out))


def check(s, t, target, **kw):
    up = random_upstream(target.numel())
    out, gs, gt = run(cuda_op, s, t, target, up, **kw)
    ref, rgs, rgt = run(topk_tail_kl_reference, s.double(), t.double(), target, up, **kw)
    for name in ("kl", "privilege", "student_logprob", "teacher_logprob"):
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, f"cuda {name}")
    assert torch.equal(out.topk_ids, ref.topk_ids), "cuda topk_ids"
    assert_grad_close(gs, rgs, s.dtype, "cuda grad student")
    assert_grad_close(gt, rgt, t.dtype, "cuda grad teacher")


SHAPES = [(1, 1, 1), (3, 7, 1), (3, 97, 20), (17, 1000, 64), (5, 5003, 20), (4, 32000, 1000)]
if not SMALL:
    SHAPES += [(257, 1000, 20), (2, 151936, 20)]


@pytest.mark.parametrize(("n", "v", "m"), SHAPES)
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_cuda_matches_reference(n, v, m, divergence):
    s, t, target = make_inputs(n, v, seed=n + v)
    check(s, t, target, top_m=m if m < v else None, divergence=divergence, temperature=0.7)


@pytest.mark.parametrize("v", [7, 1000] + ([] if SMALL else [151936]))
def test_cuda_full_vocabulary(v):
    s, t, target = make_inputs(3, v, seed=v)
    check(s, t, target, top_m=None, divergence="forward")


@pytest.mark.parametrize(
    ("s_dtype", "t_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_cuda_dtypes(s_dtype, t_dtype):
    s, t, target = make_inputs(5, 4096, s_dtype=s_dtype, t_dtype=t_dtype, seed=3)
    check(s, t, target, top_m=20)


def test_cuda_ignored_and_padded_rows():
    s, t, target = make_inputs(6, 1003, seed=5, pad=40, ignore_rows=(0, 3))
    check(s, t, target, top_m=20)
    s, t, target = make_inputs(4, 64, seed=6, ignore_rows=(0, 1, 2, 3))
    out = cuda_op(s, t, target, top_m=8)
    assert not torch.isnan(out.kl).any() and (out.kl == 0).all()


def test_cuda_sorted_adversarial_row():
    # Ascending teacher logits: every tile beats the running threshold (the slow, rare path).
    v = 20000
    t = torch.linspace(-5, 5, v).repeat(2, 1)
    s = t.flip(-1) * 0.5
    target = torch.tensor([3, v - 2])
    check(s, t, target, top_m=64)
