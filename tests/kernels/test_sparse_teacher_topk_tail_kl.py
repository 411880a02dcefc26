"""sparse_teacher_topk_tail_kl: the reference against the dense op's reference, every backend
against the float64 reference (loss, student log-prob, student gradient), equality with the
dense op given the dense teacher's top-M, the tail/padding conventions, custom-op checks and
input validation."""

from __future__ import annotations

import math

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.sparse_teacher_topk_tail_kl import sparse_teacher_topk_tail_kl_reference
from lopd_kernels.topk_tail_kl import topk_tail_kl_reference
from tests.kernels.utils import assert_grad_close
from tests.utils import HAS_CPP, TRITON_DEVICE, assert_close, requires_cpp, requires_triton

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKEND_MARKS = {"cpu": requires_cpp, "triton": requires_triton}
BACKENDS = [pytest.param(b, marks=m) for b, m in BACKEND_MARKS.items()]


def device_of(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def make_inputs(
    n,
    v,
    m,
    *,
    s_dtype=torch.float32,
    seed=0,
    temperature=1.0,
    ignore_rows=(),
    pad_rows=(),
    student_neg_inf=0,
    shuffle=True,
):
    """Student logits [n, v] (the last ``student_neg_inf`` entries -inf), a dense teacher [n, v]
    and its top-m ids / tempered log-probs (slots shuffled); rows in ``pad_rows`` have their
    last m // 2 slots padded (-inf log-prob, placeholder id 0)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    s = t + torch.randn(n, v, generator=g, dtype=torch.float64)
    if student_neg_inf:
        s[:, v - student_neg_inf :] = -math.inf
    s = s.to(s_dtype)
    ids = torch.sort(t, dim=-1, descending=True, stable=True).indices[:, :m]
    if shuffle:
        ids = ids.gather(1, torch.rand(n, m, generator=g).argsort(-1))
    lp = torch.log_softmax(t / temperature, -1).gather(1, ids)
    lp = lp.to(torch.float64 if s_dtype == torch.float64 else torch.float32)  # a server's fp32
    target = torch.randint(0, v - student_neg_inf, (n,), generator=g)
    for r in ignore_rows:
        target[r] = -100
    for r in pad_rows:
        lp[r, m - m // 2 :] = -math.inf
        ids[r, m - m // 2 :] = 0
    return s, t, lp, ids, target


def run_sparse(fn, s, lp, ids, target, upstream, **kw):
    """Calls ``fn`` on a leaf copy of ``s``; returns (outputs, grad_student)."""
    s = s.detach().clone().requires_grad_(True)
    out = fn(s, lp, ids, target, **kw)
    loss = (out.kl.double() * upstream[0]).sum() + (
        out.student_logprob.double() * upstream[1]
    ).sum()
    loss.backward()
    return out, s.grad


def upstream(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2)]


def check_backend(backend, s, lp, ids, target, **kw):
    dev = device_of(backend)
    s, lp, ids, target = (x.to(dev) for x in (s, lp, ids, target))
    up = [u.to(dev) for u in upstream(target.numel())]
    out, gs = run_sparse(
        lk.sparse_teacher_topk_tail_kl, s, lp, ids, target, up, backend=backend, **kw
    )
    ref, rgs = run_sparse(
        sparse_teacher_topk_tail_kl_reference, s.double(), lp.double(), ids, target, up, **kw
    )
    # Outputs: float32 math on exactly widened inputs (teacher log-probs rounded to float32).
    for name in ("kl", "student_logprob", "student_topk_mass", "teacher_topk_mass"):
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, f"{backend}: {name}")
        assert getattr(out, name).dtype == torch.float32
    assert gs.dtype == s.dtype
    assert_grad_close(gs, rgs, s.dtype, f"{backend}: grad_student")
    keep = target != -100
    assert (gs[~keep] == 0).all() and (out.kl[~keep] == 0).all()


# --------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
@pytest.mark.parametrize(("v", "m", "temperature"), [(37, 5, 1.0), (23, 1, 0.7), (40, 33, 1.6)])
def test_reference_equals_dense_reference(divergence, v, m, temperature):
    """float64: the sparse reference on the dense teacher's top-M equals the dense reference
    (loss, student log-prob, student gradient), whatever the slot order."""
    s, t, lp, ids, target = make_inputs(6, v, m, s_dtype=torch.float64, temperature=temperature)
    target[2] = -100
    up = upstream(6)
    kw = {"temperature": temperature, "divergence": divergence}
    out, gs = run_sparse(sparse_teacher_topk_tail_kl_reference, s, lp, ids, target, up, **kw)
    sd = s.detach().clone().requires_grad_(True)
    dense = topk_tail_kl_reference(sd, t, target, top_m=m, **kw)
    ((dense.kl * up[0]).sum() + (dense.student_logprob * up[1]).sum()).backward()
    torch.testing.assert_close(out.kl, dense.kl, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(out.student_logprob, dense.student_logprob)
    torch.testing.assert_close(out.teacher_topk_mass, dense.teacher_topk_mass)
    torch.testing.assert_close(gs, sd.grad, rtol=1e-9, atol=1e-11)
    assert (out.kl[target != -100] > 0).all()


def test_reference_gradcheck():
    s, _t, lp, ids, target = make_inputs(3, 11, 3, s_dtype=torch.float64, pad_rows=(1,))
    s.requires_grad_(True)
    for div in ("reverse", "forward"):

        def f(x, div=div):
            out = sparse_teacher_topk_tail_kl_reference(x, lp, ids, target, divergence=div)
            return out.kl, out.student_logprob

        torch.autograd.gradcheck(f, (s,))


# --------------------------------------------------------------------------------- backends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_backend_matches_reference(backend, dtype, divergence):
    s, _t, lp, ids, target = make_inputs(
        5, 37, 4, s_dtype=dtype, seed=3, ignore_rows=(1,), pad_rows=(3,), student_neg_inf=3
    )
    check_backend(backend, s, lp, ids, target, temperature=1.3, divergence=divergence)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n", "v", "m"), [(3, 1, 1), (4, 29, 1), (3, 50, 50), (2, 300, 64)])
def test_backend_odd_shapes(backend, n, v, m):
    """V = 1, M = 1, M = V (no student tail), V not a power of two, M large."""
    s, _t, lp, ids, target = make_inputs(n, v, m, seed=n + v + m, pad_rows=(0,) if m > 1 else ())
    for divergence in ("reverse", "forward"):
        check_backend(backend, s, lp, ids, target, divergence=divergence)


@requires_triton
def test_triton_launcher_many_blocks():
    """Several vocabulary blocks per row (the interpreter-sized block of 16)."""
    from lopd_kernels.triton.sparse_teacher_topk_tail_kl import (
        sparse_teacher_bwd_triton,
        sparse_teacher_fwd_triton,
    )

    s, _t, lp, ids, target = make_inputs(4, 75, 6, seed=5, ignore_rows=(2,), pad_rows=(1,))
    s, lp, ids, target = (x.to(TRITON_DEVICE) for x in (s, lp, ids, target))
    for reverse in (True, False):
        fwd = sparse_teacher_fwd_triton(s, lp, ids, target, 0.8, reverse, -100, 1e-6, block_v=16)
        ref = torch.ops.lopd.sparse_teacher_topk_tail_kl_triton_fwd(
            s, lp, ids, target, 0.8, reverse, -100, 1e-6
        )
        for a, b in zip(fwd, ref):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, equal_nan=False)
        up = [u.float().to(TRITON_DEVICE) for u in upstream(4)]
        g = sparse_teacher_bwd_triton(
            *up, s, ids, target, fwd[0], fwd[2], fwd[3], 0.8, reverse, -100, block_v=16
        )
        g_ref = torch.ops.lopd.sparse_teacher_topk_tail_kl_triton_bwd(
            *up, s, ids, target, fwd[0], fwd[2], fwd[3], 0.8, reverse, -100
        )
        torch.testing.assert_close(g, g_ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_equals_dense_op(backend, divergence):
    """The same backend's dense op on the dense teacher == the sparse op on that teacher's
    top-M ids (from the dense op's own topk_ids) and tempered log-probs."""
    dev = device_of(backend)
    s, t, _lp, _ids, target = make_inputs(6, 45, 7, seed=11, ignore_rows=(4,))
    s, t, target = s.to(dev), t.float().to(dev), target.to(dev)
    temperature = 1.4
    kw = {"temperature": temperature, "divergence": divergence, "backend": backend}
    sd = s.clone().requires_grad_(True)
    dense = lk.topk_tail_kl(sd, t, target, top_m=7, **kw)
    (dense.kl.sum() + dense.student_logprob.sum()).backward()
    ids = dense.topk_ids.flip(-1)  # any slot order
    lp = torch.log_softmax(t / temperature, -1).gather(1, ids)
    ss = s.clone().requires_grad_(True)
    sparse = lk.sparse_teacher_topk_tail_kl(ss, lp, ids, target, **kw)
    (sparse.kl.sum() + sparse.student_logprob.sum()).backward()
    keep = target != -100
    for a, b in ((sparse.kl, dense.kl), (sparse.student_logprob, dense.student_logprob)):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(sparse.teacher_topk_mass[keep], dense.teacher_topk_mass[keep])
    assert_grad_close(ss.grad, sd.grad, torch.float32, f"{backend}: sparse vs dense grad")


def test_float64_auto_is_reference():
    s, _t, lp, ids, target = make_inputs(3, 20, 4, s_dtype=torch.float64)
    out = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target)
    ref = sparse_teacher_topk_tail_kl_reference(s, lp, ids, target)
    assert out.kl.dtype == torch.float64
    torch.testing.assert_close(out.kl, ref.kl, rtol=0, atol=0)
    with pytest.raises(TypeError, match="float64"):
        lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend="cpu")


def test_no_cuda_backend():
    s, _t, lp, ids, target = make_inputs(2, 20, 4)
    with pytest.raises(lk.BackendUnavailableError, match="backend='cuda' is not an implementation"):
        lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend="cuda")


# --------------------------------------------------------------------------------- conventions


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_tail_floor_and_full_mass(backend):
    """A teacher whose top-M holds all its mass (here: up to 1e-4 above 1, within tolerance)
    gets the floored tail: finite KL, equal to the formula; tail_floor=0 gives +inf."""
    dev = device_of(backend)
    s = torch.randn(2, 30, generator=torch.Generator().manual_seed(0)).to(dev)
    ids = torch.tensor([[3, 7], [0, 29]], device=dev)
    lp = torch.tensor([[math.log(0.6), math.log(0.4001)], [0.0, -math.inf]], device=dev)
    target = torch.tensor([1, 2], device=dev)
    out = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, tail_floor=1e-6, backend=backend)
    logp = torch.log_softmax(s.double(), -1)
    for r in range(2):
        real = lp[r] > -math.inf
        p = logp[r, ids[r][real]].exp()
        q = lp[r][real].double().exp()
        p_tail = 1 - p.sum()
        expected = (p * (p.log() - q.log())).sum() + p_tail * (p_tail.log() - math.log(1e-6))
        assert math.isclose(float(out.kl[r]), float(expected), rel_tol=1e-4)
    zero = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, tail_floor=0.0, backend=backend)
    assert torch.isinf(zero.kl).all() and (zero.kl > 0).all()
    # Forward KL: the noise-level tail is dropped (its term Q log(Q / P) -> 0), not floored.
    fwd = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, divergence="forward", backend=backend)
    for r in range(2):
        real = lp[r] > -math.inf
        p = logp[r, ids[r][real]].exp()
        q = lp[r][real].double().exp()
        assert math.isclose(float(fwd.kl[r]), float((q * (q.log() - p.log())).sum()), rel_tol=1e-4)


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_padding_slots(backend):
    """A padding slot (-inf log-prob) is no bucket whatever its id: the result equals the
    same row without it; an all-padding row is a one-bucket teacher (KL 0)."""
    dev = device_of(backend)
    s = torch.randn(1, 16, generator=torch.Generator().manual_seed(1)).expand(3, 16).to(dev)
    lp_real = torch.tensor([math.log(0.5), math.log(0.2)], device=dev)
    ids = torch.tensor([[4, 9, 4, 0], [4, 9, 0, 0], [5, 5, 5, 5]], device=dev)
    lp = torch.stack([torch.cat([lp_real, torch.full((2,), -math.inf, device=dev)])] * 3)
    lp[2] = -math.inf
    target = torch.tensor([0, 1, 2], device=dev)
    out = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend=backend)
    short = lk.sparse_teacher_topk_tail_kl(
        s[:1], lp_real[None], ids[:1, :2], target[:1], backend=backend
    )
    torch.testing.assert_close(out.kl[:2], short.kl.expand(2), rtol=2e-5, atol=2e-6)
    assert float(out.kl[2].abs()) < 1e-6 and float(out.teacher_topk_mass[2]) == 0


def test_module_reductions():
    s, _t, lp, ids, target = make_inputs(4, 20, 3, ignore_rows=(0,))
    per_token = lk.SparseTeacherTopKTailKL(reduction="none")(s, lp, ids, target)
    assert per_token.shape == (4,) and per_token[0] == 0
    mean = lk.SparseTeacherTopKTailKL()(s, lp, ids, target)
    torch.testing.assert_close(mean, per_token.sum() / 3)
    with pytest.raises(ValueError, match="reduction"):
        lk.SparseTeacherTopKTailKL(reduction="max")


def test_leading_dims():
    s, _t, lp, ids, target = make_inputs(6, 20, 3, seed=2)
    flat = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target)
    nested = lk.sparse_teacher_topk_tail_kl(
        s.view(2, 3, 20), lp.view(2, 3, 3), ids.view(2, 3, 3), target.view(2, 3)
    )
    assert nested.kl.shape == (2, 3)
    torch.testing.assert_close(nested.kl.reshape(-1), flat.kl)


# --------------------------------------------------------------------------------- custom ops


def _op_samples(device):
    s, _t, lp, ids, target = make_inputs(4, 23, 3, seed=9, ignore_rows=(1,), pad_rows=(2,))
    s, lp, ids, target = (x.to(device) for x in (s, lp, ids, target))
    fwd_args = (s.requires_grad_(True), lp.float(), ids, target, 0.9, True, -100, 1e-6)
    return fwd_args


def _bwd_args(fwd, fwd_args):
    s, _lp, ids, target = fwd_args[:4]
    kl, _slp, lse, bucket = fwd(*(x.detach() if torch.is_tensor(x) else x for x in fwd_args))
    up = [u.float().to(s.device) for u in upstream(4)]
    return (*up, s.detach(), ids, target, kl, lse, bucket, 0.9, True, -100)


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        pytest.param("cpu", "cpu", marks=requires_cpp),
        pytest.param("triton", TRITON_DEVICE, marks=requires_triton),
    ],
)
def test_opcheck(backend, device):
    fwd_args = _op_samples(device)
    fwd = getattr(torch.ops.lopd, f"sparse_teacher_topk_tail_kl_{backend}_fwd")
    bwd = getattr(torch.ops.lopd, f"sparse_teacher_topk_tail_kl_{backend}_bwd")
    torch.library.opcheck(fwd, fwd_args)
    torch.library.opcheck(bwd, _bwd_args(fwd, fwd_args))


@requires_cpp
def test_cpp_rejects_out_of_range_ids():
    """The C++ op itself (bypassing the Python checks) never reads outside the row."""
    s, lp, ids, target = _op_samples("cpu")[:4]
    bad = ids.clone()
    bad[0, 1] = 23
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        torch.ops.lopd.sparse_teacher_topk_tail_kl_cpu_fwd(
            s.detach(), lp, bad, target, 1.0, True, -100, 1e-6
        )


# --------------------------------------------------------------------------------- validation


def _valid():
    s, _t, lp, ids, target = make_inputs(3, 20, 4, seed=4)
    return s, lp.float(), ids, target


def _with(**changes):
    s, lp, ids, target = _valid()
    args = {"student_logits": s, "teacher_topk_logprobs": lp, "teacher_topk_ids": ids}
    args["target_ids"] = target
    for k, fn in changes.items():
        args[k] = fn(args[k])
    return args


def _set(i, j, value):
    def fn(x):
        x = x.clone()
        x[i, j] = value
        return x

    return fn


BAD_INPUTS = {
    "id out of range": (
        _with(teacher_topk_ids=_set(1, 2, 20)),
        ValueError,
        r"teacher_topk_ids row 1.*outside \[0, V=20\)",
    ),
    "negative id": (_with(teacher_topk_ids=_set(0, 0, -1)), ValueError, "teacher_topk_ids row 0"),
    "duplicate id": (
        _with(teacher_topk_ids=lambda x: torch.cat([x[:, :1], x[:, :3]], 1)),
        ValueError,
        "teacher_topk_ids row 0.*duplicate",
    ),
    "positive logprob": (
        _with(teacher_topk_logprobs=_set(2, 1, 0.01)),
        ValueError,
        "teacher_topk_logprobs row 2.*above 0",
    ),
    "inconsistent mass": (
        _with(teacher_topk_logprobs=lambda x: torch.full_like(x, math.log(0.3))),
        ValueError,
        "teacher_topk_logprobs row 0.*inconsistent.*1.2",
    ),
    "nan logprob": (
        _with(teacher_topk_logprobs=_set(1, 0, math.nan)),
        ValueError,
        "teacher_topk_logprobs has NaN in row 1",
    ),
    "target out of range": (
        _with(target_ids=lambda x: torch.tensor([0, 20, 1])),
        ValueError,
        "target_ids",
    ),
    "ids shape": (
        _with(teacher_topk_ids=lambda x: x[:, :3]),
        ValueError,
        "teacher_topk_ids .* must have the same shape",
    ),
    "rows mismatch": (
        _with(teacher_topk_logprobs=lambda x: x[:2]),
        ValueError,
        "teacher_topk_logprobs must have shape",
    ),
    "target shape": (_with(target_ids=lambda x: x[:2]), ValueError, "target_ids must have shape"),
    "float ids": (_with(teacher_topk_ids=lambda x: x.float()), TypeError, "teacher_topk_ids"),
    "int logprobs": (
        _with(teacher_topk_logprobs=lambda x: x.long()),
        TypeError,
        "teacher_topk_logprobs",
    ),
    "int student": (_with(student_logits=lambda x: x.long()), TypeError, "student_logits"),
    "device": (
        _with(teacher_topk_ids=lambda x: x.to("meta")),
        ValueError,
        "teacher_topk_ids is on meta",
    ),
    "teacher requires grad": (
        _with(teacher_topk_logprobs=lambda x: x.requires_grad_(True)),
        ValueError,
        r"teacher_topk_logprobs requires grad.*detach",
    ),
}


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, backend):
    args, err, match = BAD_INPUTS[case]
    if backend == "triton" and TRITON_DEVICE != "cpu":
        args = {k: v.to(TRITON_DEVICE) if v.device.type == "cpu" else v for k, v in args.items()}
    with pytest.raises(err, match=match):
        lk.sparse_teacher_topk_tail_kl(**args, backend=backend)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"divergence": "js"}, "divergence"),
        ({"tail_floor": 1.0}, "tail_floor"),
        ({"mass_tolerance": -1.0}, "mass_tolerance"),
        ({"backend": "gpu"}, "backend"),
    ],
)
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        lk.sparse_teacher_topk_tail_kl(*_valid(), **kw)


def test_ignored_rows_are_not_validated():
    """Padded positions carry placeholder teacher data (ids 0, log-probs 0): not an error."""
    s, lp, ids, target = _valid()
    lp[1], ids[1], target[1] = 0.0, 0, -100
    out = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target)
    assert out.kl[1] == 0 and out.teacher_topk_mass[1] == 0 and (out.kl[[0, 2]] > 0).all()


def test_op_names_and_info():
    """cpu (when built) and triton custom ops, no cuda op; lopd_kernels.info reports the op."""
    from lopd_kernels import info

    names = [
        f"sparse_teacher_topk_tail_kl_{i}_{p}" for i in ("triton", "cpu") for p in ("fwd", "bwd")
    ]
    for name in names[: 4 if lk.extension_loaded() else 2]:
        assert hasattr(torch.ops.lopd, name), name
    assert not hasattr(torch.ops.lopd, "sparse_teacher_topk_tail_kl_cuda_fwd")
    auto = info.collect()["auto"]["sparse_teacher_topk_tail_kl"]
    assert auto["cpu"] == ("cpu" if HAS_CPP else "torch")
    assert auto["impls"] == ["torch", "cpu", "triton"]


@requires_cpp
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_cpu_every_isa_several_blocks(isa, dtype, monkeypatch):
    """Each compiled ISA copy (capped by LOPD_CPU_ISA; one the CPU lacks falls back), with V over
    two L1 blocks and not a multiple of the vector width, teacher ids inside and across blocks."""
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    s, _t, lp, ids, target = make_inputs(
        3, 4133, 20, s_dtype=dtype, seed=21, ignore_rows=(2,), pad_rows=(1,), student_neg_inf=5
    )
    for divergence in ("reverse", "forward"):
        check_backend("cpu", s, lp, ids, target, temperature=0.9, divergence=divergence)


# Runs in a subprocess: with TRITON_INTERPRET=1 (set for this process by conftest.py) triton.jit
# yields interpreter functions, which cannot be compiled.
_COMPILE_SCRIPT = """
from tests.kernels.triton_compile import compile_kernel
import lopd_kernels.triton.sparse_teacher_topk_tail_kl as k

def arg_type(name):
    if name in ("s_ptr", "gs_ptr"):
        return "*bf16"
    if name in ("tgt_ptr", "ids_ptr"):
        return "*i64"
    if name.endswith("_ptr"):
        return "*fp32"
    return {"V": "i32", "inv_t": "fp32", "tail_floor": "fp32"}.get(name, "i64")

def compile_for(fn, arch, **constexprs):
    aligned = lambda n: n.endswith("_ptr") or n == "V" or n.startswith("stride")
    compile_kernel(fn, arch, arg_type, aligned, **constexprs)

# The launcher's blocks (forward, backward) for M = 20 (sm_80 reverse, sm_90 forward).
cases = ((80, 20, 32, (512, 256), True), (90, 20, 32, (512, 256), False))
for arch, m, mp, blocks, reverse in cases:
    for fn, block in zip((k._fwd_kernel, k._bwd_kernel), blocks):
        compile_for(fn, arch, M=m, MP=mp, BLOCK_V=block, REVERSE=reverse)
print("compiled")
"""


def test_triton_kernels_compile_for_sm80_sm90():
    """The Triton kernels lower to cubins for sm_80 and sm_90 at the launcher's block sizes
    (Triton's own ptxas, no GPU): the interpreter accepts code the compiler rejects."""
    from tests.kernels.triton_compile import assert_script_compiles

    assert_script_compiles(_COMPILE_SCRIPT)
