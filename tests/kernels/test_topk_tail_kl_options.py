"""``support`` x ``divergence`` on every backend of ``topk_tail_kl``, against the float64
reference; and ``support="teacher"`` with the KLs bit for bit as before the options existed
(golden digests of the previous build: tests/kernels/topk_teacher_golden.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels import _backend
from lopd_kernels.topk_tail_kl import (
    TopKTailKLOutput,
    topk_tail_kl_reference,
)
from tests.kernels import simt_emu
from tests.kernels import topk_teacher_golden as golden
from tests.kernels.utils import assert_grad_close, make_inputs, opcheck_samples, random_upstream
from tests.utils import HAS_CPP, TRITON_DEVICE, assert_close, requires_cpp

# --------------------------------------------------------------------------------- teacher: bits


def _recorded() -> dict:
    return json.loads(golden.GOLDEN.read_text())


@requires_cpp
@pytest.mark.parametrize("isa", golden.ISAS)
def test_teacher_support_kernels_bitwise_as_before(isa, monkeypatch):
    """Every output and both gradients of the C++ kernels with support="teacher" (reverse and
    forward KL, top-M and full vocabulary, three dtype pairs, strided rows, ties, -inf) hash to
    what the build before ``support`` / ``"jsd"`` produced, per ISA copy of the kernel."""
    data = _recorded()
    if golden.build_key() != data["compiler"]:
        pytest.skip(f"digests recorded with {data['compiler']}, this build: {golden.build_key()}")
    from lopd_kernels import _C

    monkeypatch.delenv("LOPD_CPU_ISA", raising=False)
    best = _C.cpu_isa()
    if golden.ISAS.index(isa) > golden.ISAS.index(best):
        # A capped request above the CPU falls back to another copy, whose bits differ.
        pytest.skip(f"this CPU runs at most the {best} copy")
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    got = golden.case_digests(lk.topk_tail_kl)
    assert got == data["digests"][isa]


# --------------------------------------------------------------------------------- the matrix

# (divergence, beta) as a user passes them; "jsd" at 0 / 1 is TRL's forward / reverse end.
DIVERGENCES = [
    ("reverse", None),
    ("forward", None),
    ("jsd", 0.25),
    ("jsd", 0.5),
    ("jsd", 0.9),
    ("jsd", 0.0),
    ("jsd", 1.0),
]
DIV_IDS = [d if b is None else f"{d}{b}" for d, b in DIVERGENCES]
SUPPORTS = lk.SUPPORTS
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _triton_call(s, t, target, **kw):
    out = lk.topk_tail_kl(
        s.to(TRITON_DEVICE), t.to(TRITON_DEVICE), target.to(TRITON_DEVICE), backend="triton", **kw
    )
    return TopKTailKLOutput(*(o.cpu() for o in out))


def _emulated_call(s, t, target, **kw):
    return simt_emu.topk_tail_kl_emulated(s, t, target, **kw)


def _backend_call(name):
    return lambda s, t, target, **kw: lk.topk_tail_kl(s, t, target, backend=name, **kw)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation under test: how to call it and what it needs. Adding a backend to the
    matrix is one entry of BACKENDS."""

    name: str
    call: Callable
    unavailable: str | None


def _triton_unavailable() -> str | None:
    if not _backend.triton_available():
        return "triton cannot run here (no GPU, TRITON_INTERPRET unset)"
    return None


BACKENDS = [
    Backend("torch", _backend_call("torch"), None),
    Backend("cpu", _backend_call("cpu"), None if HAS_CPP else "no lopd_kernels._C"),
    Backend("triton", _triton_call, _triton_unavailable()),
    Backend("cuda-emulated", _emulated_call, simt_emu.unavailable_reason()),
]


def _skip_unless_runs(backend: Backend, support: str, divergence: str, beta) -> None:
    if backend.unavailable:
        pytest.skip(backend.unavailable)


def _skip_interpreted_repeats(backend: Backend, divergence: str, beta, dtype=None) -> None:
    """Triton under its interpreter costs ~1 s of CPU per case: it skips the cases that run no
    code the others do not. The JSD's ends are mapped to the KLs before the op (the same
    kernels, bit for bit: tests/kernels/test_topk_tail_kl_triton_options.py checks the launchers'
    own mapping); float16 loads like bfloat16, so it runs with the JSD at 0.5 only."""
    if backend.name != "triton" or torch.cuda.is_available():
        return
    if divergence == "jsd" and beta in (0.0, 1.0):
        pytest.skip("the JSD's ends run the KLs' kernels (lopd_kernels.bucket_math.op_divergence)")
    if dtype == torch.float16 and (divergence, beta) != ("jsd", 0.5):
        pytest.skip("float16 loads like bfloat16: the interpreter runs it with the JSD only")


def strided_buffer(x: torch.Tensor, rows_per_item: int) -> torch.Tensor:
    """``[N, V]`` rows as a ``[B, L + 1, V]`` buffer whose view ``[:, :-1]`` holds them
    (``logits[:, :-1]`` of a causal LM: rows read in place, no 2-D view covers them)."""
    n, v = x.shape
    return torch.cat([x.reshape(-1, rows_per_item, v), x[: n // rows_per_item].unsqueeze(1)], 1)


def drop_last(x: torch.Tensor) -> torch.Tensor:
    return x[:, :-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_support_and_divergence_against_the_reference(
    backend, support, divergence, beta, dtype
):
    """Forward (every output) and both gradients under random upstream gradients vs the float64
    reference: odd V, masked rows, -inf entries, strided rows read in place."""
    _skip_unless_runs(backend, support, divergence, beta)
    _skip_interpreted_repeats(backend, divergence, beta, dtype)
    s, t, target = make_inputs(8, 1031, s_dtype=dtype, ignore_rows=(2, 5), pad=7, seed=13)
    s[1, :40] = -math.inf  # the student gives some of the teacher's top ids no mass
    kw = {"top_m": 6, "temperature": 0.8, "divergence": divergence, "beta": beta}
    s, t = strided_buffer(s, 2), strided_buffer(t, 2)
    check_against(backend.call, s, t, target.reshape(4, 2), support, kw, view=drop_last)


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_full_vocabulary_every_divergence(backend, divergence, beta):
    """top_m=None (the support is irrelevant): every divergence over every entry."""
    _skip_unless_runs(backend, "teacher", divergence, beta)
    _skip_interpreted_repeats(backend, divergence, beta)
    s, t, target = make_inputs(6, 517, s_dtype=torch.bfloat16, ignore_rows=(1,), pad=3, seed=4)
    kw = {"top_m": None, "temperature": 1.2, "divergence": divergence, "beta": beta}
    check_against(backend.call, s, t, target, "union", kw)


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_mixed_dtypes_ties_and_a_large_vocabulary(backend, support):
    """bf16 student with fp32 teacher at V = 151,936 (vector blocks, the stabilizers' jumps),
    M = 20, exact ties in both rows (bf16: many), the JSD at beta 0.5."""
    _skip_unless_runs(backend, support, "jsd", 0.5)
    if backend.name in ("triton", "cuda-emulated"):
        pytest.skip("the interpreter / emulator at V = 151,936 is too slow for CI")
    s, t, target = make_inputs(2, 151_936, s_dtype=torch.bfloat16, t_dtype=torch.float32, seed=6)
    t[:, 100:110] = t[:, 99:100]  # a block of exactly tied teacher logits
    kw = {"top_m": 20, "divergence": "jsd", "beta": 0.5}
    check_against(backend.call, s, t, target, support, kw)


def _run(call, s_buf, t_buf, target, up, view, **kw):
    """Outputs and the two logit gradients of ``call`` on ``view`` of leaf buffers (the view is
    what the op reads: strided rows stay strided)."""
    s_buf = s_buf.detach().clone().requires_grad_(True)
    t_buf = t_buf.detach().clone().requires_grad_(True)
    out = call(view(s_buf), view(t_buf), target, **kw)
    loss = sum((o.double() * u).sum() for o, u in zip(out[:4], up))
    loss.backward()
    return out, view(s_buf.grad), view(t_buf.grad)


def check_against(call, s, t, target, support, kw, view=lambda x: x):
    """Every output of ``call`` (``topk_tail_kl``-like) and both logit gradients against the
    float64 reference on the same (rounded) inputs; ``view`` of ``s``, ``t`` is what the ops
    read."""
    up = [u.reshape(target.shape) for u in random_upstream(target.numel())]
    out, gs, gt = _run(call, s, t, target, up, view, support=support, **kw)
    ref, rgs, rgt = _run(topk_tail_kl_reference, s.double(), t.double(), target, up, view,
                         support=support, **kw)  # fmt: skip
    for name in ("kl", "privilege", "student_logprob", "teacher_logprob"):
        assert getattr(out, name).dtype == torch.float32, name
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, name)
    assert torch.equal(out.topk_ids, ref.topk_ids), "topk_ids"
    assert torch.equal(out.support_size, ref.support_size), "support_size"
    assert_close(out.teacher_topk_mass, ref.teacher_topk_mass, torch.float32, "mass")
    assert gs.dtype == s.dtype and gt.dtype == t.dtype
    v = s.shape[-1]
    assert_grad_close(gs.reshape(-1, v), rgs.reshape(-1, v), s.dtype, "d student_logits")
    assert_grad_close(gt.reshape(-1, v), rgt.reshape(-1, v), t.dtype, "d teacher_logits")
    ignored = target == -100
    assert not out.kl[ignored].any() and not out.topk_ids[ignored].any()
    assert not out.support_size[ignored].any()
    assert not gs[ignored].any() and not gt[ignored].any()


# --------------------------------------------------------------------------------- ends, ops


@requires_cpp
@pytest.mark.parametrize("support", SUPPORTS)
def test_jsd_ends_are_the_kls_bit_for_bit_on_cpu(support):
    s, t, target = make_inputs(5, 777, s_dtype=torch.bfloat16, ignore_rows=(1,), seed=2)
    for beta, div in ((0.0, "forward"), (1.0, "reverse")):
        for top_m in (7, None):
            kw = {"top_m": top_m, "support": support, "backend": "cpu"}
            a = lk.topk_tail_kl(s, t, target, divergence=div, **kw)
            b = lk.topk_tail_kl(s, t, target, divergence="jsd", beta=beta, **kw)
            for x, y in zip(a, b):
                assert torch.equal(x, y)


@requires_cpp
def test_cpu_op_rejects_bad_options_in_one_line():
    fwd_args, _ = opcheck_samples(
        torch.ops.lopd.topk_tail_kl_cpu_fwd, 5, "cpu", "union", "jsd", 0.5
    )
    args = [x.detach() if torch.is_tensor(x) else x for x in fwd_args]
    for i, value, fragment in ((5, "js", "divergence must be"), (6, 1.5, "beta must be in"),
                               (7, "both", "support must be")):  # fmt: skip
        bad = list(args)
        bad[i] = value
        with pytest.raises(RuntimeError, match=fragment):
            torch.ops.lopd.topk_tail_kl_cpu_fwd(*bad)


def test_modules_take_the_options():
    s, t, target = make_inputs(4, 60, ignore_rows=(2,))
    kw = {"top_m": 5, "divergence": "jsd", "beta": 0.3, "support": "union"}
    mod = lk.TopKTailKL(**kw, reduction="sum")
    assert "support='union'" in repr(mod) and "beta=0.3" in repr(mod)
    torch.testing.assert_close(mod(s, t, target), lk.topk_tail_kl(s, t, target, **kw).kl.sum())
    g = torch.Generator().manual_seed(0)
    h_s, h_t, w = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(60, 8)
    tgt = torch.randint(0, 60, (6,), generator=g)
    fused = lk.FusedLinearTopKTailKL(**kw, reduction="none")(h_s, w, h_t, w, tgt)
    ref = lk.fused_linear_topk_tail_kl_reference(h_s, w, h_t, w, tgt, **kw).kl
    torch.testing.assert_close(fused, ref)


@requires_cpp
@pytest.mark.parametrize("isa", golden.ISAS)
def test_every_isa_copy_with_the_options(isa, monkeypatch):
    """Each per-ISA build of the C++ kernels (V off every vector width, so the scalar remainders
    run): the union's two heaps, the student's selection, and the full-vocabulary JSD."""
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    s, t, target = make_inputs(5, 4099, s_dtype=torch.bfloat16, ignore_rows=(3,), pad=5, seed=3)
    call = _backend_call("cpu")
    for support, top_m, div, beta in (("union", 20, "jsd", 0.3), ("student", 7, "reverse", None),
                                      ("union", None, "jsd", 0.6)):  # fmt: skip
        kw = {"top_m": top_m, "temperature": 0.9, "divergence": div, "beta": beta}
        check_against(call, s, t, target, support, kw)
