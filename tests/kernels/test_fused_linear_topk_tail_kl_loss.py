"""fused_linear_topk_tail_kl_loss: the weighted loss with its gradients formed in the forward,
against the float64 materialized reference (``fused_linear_topk_tail_kl_reference`` weighted the
same way, under autograd), on every option the chunked path has."""

from __future__ import annotations

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels import fused_linear_topk_tail_kl_chunked as chunked
from lopd_kernels.chunked_linear import Chunk
from lopd_kernels.fused_linear_topk_tail_kl import fused_linear_topk_tail_kl_reference
from lopd_kernels.fused_linear_topk_tail_kl_loss import (
    CUSTOM_OPS,
    fused_linear_topk_tail_kl_loss,
)
from tests.kernels.fused_linear_utils import NAMES, make_inputs
from tests.utils import assert_close

# The module (the package's attribute of that name is the function).
WEIGHTS = ("kl_weight", "student_logprob_weight", "teacher_logprob_weight")
#: The defaults: the token-mean KL, no log-prob term.
NO_LOGPROB = {"student_logprob_weight": 0.0, "teacher_logprob_weight": 0.0}


def row_weights(n, seed, scalar=False):
    """Random per-row weights (or scalars) for the three weighted outputs."""
    g = torch.Generator().manual_seed(seed)
    if scalar:
        return {k: float(torch.randn((), generator=g)) for k in WEIGHTS}
    return {k: torch.randn(n, generator=g) for k in WEIGHTS}


def leaves_of(inputs, requires, upcast=False):
    """Fresh leaves of ``inputs`` (a tied head stays one tensor); ``requires``: names with grad."""
    tied = inputs["teacher_weight"] is inputs["student_weight"]
    leaves = {}
    for k, v in inputs.items():
        if tied and k == "teacher_weight":
            continue
        x = v.double() if upcast else v.clone()
        leaves[k] = x.requires_grad_(requires is None or k in requires)
    args = dict(leaves)
    if tied:
        args["teacher_weight"] = args["student_weight"]
    return leaves, args


def reference_loss(inputs, target, weights, requires=None, upstream=1.0, **kw):
    """The weighted sum of the float64 reference's outputs and its gradients."""
    leaves, args = leaves_of(inputs, requires, upcast=True)
    kw = {k: v for k, v in kw.items() if k not in ("chunk_size", "backend")}
    out = fused_linear_topk_tail_kl_reference(*(args.pop(n) for n in NAMES), target, **args, **kw)
    w = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in weights.items()}
    if "kl_weight" not in w:  # the default: the mean over kept rows
        w["kl_weight"] = torch.tensor(1.0 / max(int((target != -100).sum()), 1))
    loss = (w["kl_weight"] * out.kl).sum() + (
        w["student_logprob_weight"] * out.student_logprob
    ).sum()
    loss = loss + (w["teacher_logprob_weight"] * out.teacher_logprob).sum()
    (loss * upstream).backward()
    return loss.detach(), out, {k: v.grad for k, v in leaves.items() if v.requires_grad}


def eager_loss(inputs, target, weights, requires=None, upstream=1.0, backend="chunked", **kw):
    leaves, args = leaves_of(inputs, requires)
    res = fused_linear_topk_tail_kl_loss(
        *(args.pop(n) for n in NAMES), target, **weights, **args, backend=backend, **kw
    )
    if res.loss.requires_grad:
        (res.loss * upstream).backward()
    return res, {k: v.grad for k, v in leaves.items() if v.requires_grad}


def check(inputs, target, weights, dtype, requires=None, **kw):
    upstream = 1.7
    want, ref, want_grads = reference_loss(inputs, target, weights, requires, upstream, **kw)
    res, grads = eager_loss(inputs, target, weights, requires, upstream, **kw)
    assert_close(res.loss, want, dtype, "loss")
    for name in ("kl", "student_logprob", "teacher_logprob", "teacher_topk_mass"):
        got = getattr(res.output, name)
        assert not got.requires_grad, name
        assert_close(got, getattr(ref, name), dtype, name)
    assert torch.equal(res.output.topk_ids, ref.topk_ids)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_close(grad, want_grads[name], dtype, f"d{name}")
    return res, grads


CASES = [
    # (n, d, V, top_m, temperature, divergence, beta, support, bias, chunk_size)
    (13, 8, 37, 5, 1.0, "reverse", None, "teacher", False, 4),
    (13, 8, 37, 5, 0.7, "forward", None, "union", True, None),
    (9, 64, 301, 20, 1.3, "jsd", 0.5, "student", True, 3),
    (9, 64, 301, None, 1.0, "forward", None, "teacher", False, 2),
    (7, 64, 53, None, 0.5, "jsd", 0.25, "teacher", True, 7),
    (6, 8, 11, 16, 1.0, "reverse", None, "union", False, 5),  # M >= V: no tail bucket
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(case):
    n, d, vocab, top_m, temp, div, beta, support, bias, chunk = case
    inputs, target = make_inputs(n, d, vocab, bias=bias, seed=n + d)
    kw = dict(top_m=top_m, temperature=temp, divergence=div, beta=beta, support=support)
    check(inputs, target, row_weights(n, seed=d), torch.float32, chunk_size=chunk, **kw)


@pytest.fixture
def emulated_cuda_epilogue(monkeypatch):
    """The CUDA per-row kernels (what backend="cuda" runs on a GPU after its cuBLAS logit
    blocks) as the epilogue, on CPU tensors under the SIMT emulator (tests/kernels/simt_emu.py)."""
    from tests.kernels import simt_emu

    reason = simt_emu.unavailable_reason()
    if reason:
        pytest.skip(reason)
    simt_emu.load()
    ops = torch.ops.lopd_simt_emu
    kernels = chunked.EpilogueKernels(ops.topk_tail_kl_cuda_fwd, ops.topk_tail_kl_cuda_bwd)
    monkeypatch.setattr(chunked, "epilogue_kernels", lambda *_a, **_k: kernels)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: "-".join(map(str, c)))
def test_with_emulated_cuda_epilogue(case, emulated_cuda_epilogue):
    test_matches_reference(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    inputs, target = make_inputs(11, 64, 203, dtype, bias=True, seed=3)
    check(inputs, target, row_weights(11, seed=4), dtype, top_m=8, temperature=0.9, chunk_size=4)


@pytest.mark.parametrize(
    "requires",
    [{"student_hidden"}, {"student_hidden", "teacher_hidden"}, {"student_weight"},
     {"teacher_hidden", "teacher_weight"}, {"student_bias"}, {"teacher_bias"},
     {"student_hidden", "student_weight", "student_bias"}],
    ids=lambda s: "+".join(sorted(s)),
)  # fmt: skip
@pytest.mark.parametrize("top_m", [4, None])
def test_requires_grad_subsets(requires, top_m):
    """Frozen heads (LoRA, a frozen teacher), a frozen student, biases alone."""
    inputs, target = make_inputs(8, 8, 29, bias=True, seed=5)
    _, grads = check(inputs, target, row_weights(8, 6), torch.float32, requires, top_m=top_m)
    assert set(grads) == requires


@pytest.mark.parametrize("requires", [None, {"student_weight", "teacher_hidden"}])
def test_tied_head(requires):
    """One head for both models: its gradient is the sum of both sides', in one tensor."""
    inputs, target = make_inputs(10, 16, 67, bias=True, tied=True, seed=4)
    _, grads = check(inputs, target, row_weights(10, 7), torch.float32, requires, top_m=6)
    assert "teacher_weight" not in grads and "student_weight" in grads


def test_strided_rows_and_scalar_weights():
    """Hidden states that are a strided view (every other row of a packed batch), scalar
    weights."""
    inputs, target = make_inputs(18, 16, 41, seed=8)
    inputs = {k: (v[::2] if "hidden" in k else v) for k, v in inputs.items()}
    target = target[::2]
    assert not inputs["student_hidden"].is_contiguous()
    check(inputs, target, row_weights(9, 9, scalar=True), torch.float32, top_m=5, chunk_size=4)


def test_default_is_the_token_mean_and_upstream_scales():
    """No weights: the mean KL over kept rows (as ``FusedLinearTopKTailKL(reduction="mean")``);
    every row ignored gives 0 and zero gradients, never NaN."""
    inputs, target = make_inputs(12, 16, 45, seed=10)
    check(inputs, target, NO_LOGPROB, torch.float32, top_m=5)
    res, grads = eager_loss(inputs, torch.full_like(target, -100), {}, top_m=5)
    assert res.loss.item() == 0.0 and all(not g.any() for g in grads.values())


def test_no_grad_forms_no_gradient(monkeypatch):
    """Under no_grad the forward is the plain forward: no per-row backward is run."""
    inputs, target = make_inputs(9, 8, 31, seed=12)
    calls = []
    fwd, bwd = chunked.epilogue_kernels(torch.device("cpu"), 4)

    def recording(*_a, **_k):
        return chunked.EpilogueKernels(fwd, lambda *a: calls.append(1) or bwd(*a))

    monkeypatch.setattr(chunked, "epilogue_kernels", recording)
    _, args = leaves_of(inputs, None)
    with torch.no_grad():
        res = fused_linear_topk_tail_kl_loss(*(args.pop(n) for n in NAMES), target, top_m=4)
    assert not calls and not res.loss.requires_grad
    want, _, _ = reference_loss(inputs, target, NO_LOGPROB, top_m=4)
    assert_close(res.loss, want, torch.float32, "loss")


def test_backward_recomputes_no_logits(monkeypatch):
    """Two logit GEMMs per chunk, all in the forward; the backward only scales."""
    inputs, target = make_inputs(16, 8, 31, seed=13)
    target[:] = target.clamp(min=0)
    calls = {"n": 0}
    inner = Chunk.logits

    def counting(*a, **k):
        calls["n"] += 1
        return inner(*a, **k)

    monkeypatch.setattr(Chunk, "logits", counting)
    _, args = leaves_of(inputs, None)
    res = fused_linear_topk_tail_kl_loss(*(args.pop(n) for n in NAMES), target, top_m=4,
                                         chunk_size=5)  # fmt: skip
    assert calls["n"] == 2 * 4  # 16 rows in chunks of 5: 4 chunks, 2 sides
    res.loss.backward()
    assert calls["n"] == 8


@pytest.mark.parametrize("backend", ["torch", "chunked"])
def test_backends_agree(backend):
    inputs, target = make_inputs(9, 16, 37, bias=True, seed=14)
    check(inputs, target, row_weights(9, 15), torch.float32, top_m=5, backend=backend)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"kl_weight": torch.ones(3)}, r"kl_weight must have shape \[\] or \[N\] = \[6\]"),
        ({"kl_weight": torch.ones(6, requires_grad=True)}, "kl_weight requires grad"),
        ({"teacher_logprob_weight": None}, "teacher_logprob_weight must be a number"),
        ({"student_logprob_weight": "1"}, "student_logprob_weight must be a number"),
        ({"kl_weight": torch.ones(6, dtype=torch.bool)}, "kl_weight must be a real tensor"),
    ],
)
def test_validation(weights, match):
    inputs, target = make_inputs(6, 8, 13)
    with pytest.raises((ValueError, TypeError), match=match):
        fused_linear_topk_tail_kl_loss(*(inputs[n] for n in NAMES), target, **weights)


def test_targets_out_of_range_are_named():
    inputs, target = make_inputs(6, 8, 13)
    target[2] = 13
    with pytest.raises(ValueError, match=r"target_ids\[2\] = 13 is outside \[0, V=13\)"):
        fused_linear_topk_tail_kl_loss(*(inputs[n] for n in NAMES), target)


def test_opcheck():
    inputs, target = make_inputs(6, 16, 37, bias=True, seed=11)
    leaves = {k: v.requires_grad_() for k, v in inputs.items()}
    w = [torch.randn(6) for _ in WEIGHTS]
    args = (
        leaves["student_hidden"], leaves["student_weight"], leaves["student_bias"],
        leaves["teacher_hidden"], leaves["teacher_weight"], leaves["teacher_bias"],
        target, *w, 4, 0.9, "jsd", 0.5, "union", -100, 2, [True, True, False, True, False, True],
        False,
    )  # fmt: skip
    fwd_op, bwd_op = (op.default for op in CUSTOM_OPS.ops("chunked"))
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(fwd_op, args, test_utils=tests)
    grads = [g.detach() for g in fwd_op(*args)[6:]]
    torch.library.opcheck(bwd_op, (torch.tensor(0.5), *grads), test_utils=tests[::2])


def test_second_backward_is_refused():
    """The backward scales the kept gradients in place: autograd's version check refuses to
    run it twice (retain_graph) instead of scaling them twice."""
    inputs, target = make_inputs(8, 8, 29, seed=17)
    _, args = leaves_of(inputs, None)
    res = fused_linear_topk_tail_kl_loss(*(args.pop(n) for n in NAMES), target, top_m=4)
    res.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        res.loss.backward()


def test_compiles_fullgraph():
    inputs, target = make_inputs(8, 8, 29, seed=16)
    leaves, args = leaves_of(inputs, None)
    hs, ws, ht, wt = (args[n] for n in NAMES)
    fn = torch.compile(
        lambda *x: fused_linear_topk_tail_kl_loss(*x, target, top_m=4).loss, fullgraph=True,
        backend="aot_eager",
    )  # fmt: skip
    loss = fn(hs, ws, ht, wt)
    loss.backward()
    want, _, want_grads = reference_loss(inputs, target, NO_LOGPROB, top_m=4)
    assert_close(loss, want, torch.float32, "loss")
    for name, grad in want_grads.items():
        assert_close(leaves[name].grad, grad, torch.float32, name)


def test_exported():
    assert lk.fused_linear_topk_tail_kl_loss is fused_linear_topk_tail_kl_loss


def test_backward_forms_no_head_sized_tensor():
    """The backward only scales the kept gradients in place: no zero gradient materialized for
    the op's other outputs, no fresh [V, d] result (either would be a copy of both heads)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    inputs, target = make_inputs(8, 16, 53, seed=18)
    head = inputs["student_weight"].numel()

    class HeadSized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() == head:
                    self.ops.add(str(func))
            return out

    _, args = leaves_of(inputs, None)
    res = fused_linear_topk_tail_kl_loss(*(args.pop(n) for n in NAMES), target, top_m=4)
    with HeadSized() as seen:
        res.loss.backward()
    assert seen.ops <= {"aten.mul_.Tensor", "aten.detach.default"}, seen.ops
