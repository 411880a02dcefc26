"""fused_linear_logprob: every backend against the float64 materialized reference.

Backends: ``cpu`` (the C++ op), ``chunked`` (the chunk loop in PyTorch, what ``"auto"`` runs on
a GPU; here on CPU tensors), ``triton`` (the interpreter on CPU: tiny shapes). Outputs and every
gradient (hidden states, head, bias) are compared at the tolerance of the input dtype
(tests/utils.py); shapes keep N, d and V off every block multiple.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import lopd_kernels as lk
from lopd_kernels import fused_linear_logprob_chunked as chunked
from lopd_kernels.fused_linear_logprob import fused_linear_logprob, fused_linear_logprob_reference
from tests.kernels.triton_compile import assert_script_compiles
from tests.utils import TRITON_DEVICE, assert_close, requires_cpp, requires_triton

NAMES = ("hidden", "weight", "bias")
# The module (lopd_kernels.fused_linear_logprob is also the function's name in the package).
flp = importlib.import_module("lopd_kernels.fused_linear_logprob")


def make_inputs(n, d, vocab, dtype=torch.float32, *, bias=False, seed=0, scale=2.0):
    """Hidden states and a head whose logits have std ~``scale``; a quarter of the rows ignored."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "hidden": torch.randn(n, d, generator=g),
        "weight": torch.randn(vocab, d, generator=g) * (scale / math.sqrt(d)),
    }
    if bias:
        x["bias"] = torch.randn(vocab, generator=g) * 0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[1::4] = -100
    return {k: v.to(dtype) for k, v in x.items()}, targets


def run(inputs, targets, backend, *, requires=None, upcast=False, seed=1, device="cpu", **kw):
    """Forward + backward with random upstream gradients on the log-probs (and the entropy).

    Returns ``(output, {name: grad})`` for the inputs that require grad (``requires``: names;
    default all).
    """
    leaves = {}
    for k, v in inputs.items():
        leaf = (v.double() if upcast else v).clone().to(device)
        leaves[k] = leaf.requires_grad_(requires is None or k in requires)
    if "embedding" in kw:  # a tied head: the weight also embeds the inputs
        ids = kw.pop("embedding")
        hidden = torch.tanh(F.embedding(ids.to(device), leaves["weight"]) + leaves["hidden"])
    else:
        hidden = leaves["hidden"]
    be = "torch" if upcast else backend
    out = fused_linear_logprob(
        hidden, leaves["weight"], targets.to(device), bias=leaves.get("bias"), backend=be, **kw
    )
    g = torch.Generator().manual_seed(seed)
    u, v = (torch.randn(targets.shape[0], generator=g, dtype=torch.float64) for _ in range(2))
    loss = (out.logprob.double() * u.to(device)).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy.double() * v.to(device)).sum()
    if loss.requires_grad:
        loss.backward()
    return out, {k: x.grad for k, x in leaves.items() if x.requires_grad}


def check(inputs, targets, backend, dtype, requires=None, device="cpu", **kw):
    ref_out, ref_grads = run(inputs, targets, backend, requires=requires, upcast=True, **kw)
    out, grads = run(inputs, targets, backend, requires=requires, device=device, **kw)
    assert out.logprob.dtype == torch.float32
    assert_close(out.logprob.cpu(), ref_out.logprob, dtype, f"{backend} logprob")
    if kw.get("with_entropy"):
        assert_close(out.entropy.cpu(), ref_out.entropy, dtype, f"{backend} entropy")
    else:
        assert out.entropy is None
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_close(grad.cpu(), ref_grads[name], dtype, f"{backend} d{name}")
    ignored = (targets == -100).to(out.logprob.device)
    assert not out.logprob[ignored].any()
    if "hidden" in grads and "embedding" not in kw:
        assert not grads["hidden"][ignored].any()
    return out, grads


# ---------------------------------------------------------------------------------------------
# The C++ CPU op and the chunked path, against the float64 reference
# ---------------------------------------------------------------------------------------------

IMPLS = [pytest.param("cpu", marks=requires_cpp), "chunked"]
CASES = [
    # (n, d, V, temperature, bias, chunk_size, with_entropy)
    (13, 8, 37, 1.0, False, None, False),
    (13, 8, 37, 0.7, True, 4, True),
    (9, 64, 301, 1.3, True, 3, False),
    (6, 100, 129, 0.8, False, 1, True),
    (7, 33, 1000, 1.0, True, None, True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference_fp32(impl, case):
    n, d, vocab, temp, bias, chunk, ent = case
    inputs, targets = make_inputs(n, d, vocab, bias=bias)
    check(inputs, targets, impl, torch.float32, temperature=temp, chunk_size=chunk,
          with_entropy=ent)  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_many_vocabulary_blocks(impl, monkeypatch):
    """A block budget of a few entries per row: dozens of vocabulary blocks and token chunks, the
    online log-sum-exp (and the projection's rescaled accumulator) across all of them."""
    monkeypatch.setitem(chunked.CHUNK_BUDGET, "cpu", 3 * 64 * 4)
    inputs, targets = make_inputs(11, 16, 1001, bias=True, seed=2)
    check(inputs, targets, impl, torch.float32, chunk_size=3, with_entropy=True)
    check(inputs, targets, impl, torch.float32, requires={"hidden"}, chunk_size=3)  # projection


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(impl, dtype):
    inputs, targets = make_inputs(11, 64, 203, dtype, bias=True, seed=3)
    check(inputs, targets, impl, dtype, temperature=0.9, chunk_size=4, with_entropy=True)
    check(inputs, targets, impl, dtype, requires={"hidden"}, chunk_size=4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "requires",
    [{"hidden"}, {"weight"}, {"bias"}, {"hidden", "weight"}, {"hidden", "bias"}, set()],
    ids=lambda s: "+".join(sorted(s)) or "none",
)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_requires_grad_combinations(impl, requires, with_entropy):
    """Each subset of {hidden, head, bias}; hidden alone (a frozen head) takes the projection."""
    inputs, targets = make_inputs(8, 8, 29, bias=True, seed=5)
    _, grads = check(inputs, targets, impl, torch.float32, requires=requires,
                     with_entropy=with_entropy, temperature=1.2)  # fmt: skip
    assert set(grads) == requires


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_head(impl):
    """The head is the input embedding: its gradient sums the embedding's and the head's."""
    inputs, targets = make_inputs(10, 16, 67, seed=4)
    ids = torch.randint(0, 67, (10,), generator=torch.Generator().manual_seed(9))
    _, grads = check(inputs, targets, impl, torch.float32, embedding=ids, with_entropy=True)
    assert set(grads) == {"hidden", "weight"}


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_hidden_rows(impl):
    """Rows of a wider buffer (``h[:, :d]``) and every other row (``h[::2]``), read in place."""
    inputs, targets = make_inputs(9, 24, 53, bias=True, seed=6)
    base = torch.randn(18, 40)
    for view in (base[:9, 3:27], base[::2, :24]):
        x = dict(inputs, hidden=view)
        assert not x["hidden"].is_contiguous()
        leaf = view.clone().requires_grad_()
        lp = fused_linear_logprob(leaf[:, :], inputs["weight"], targets, bias=inputs["bias"],
                                  backend=impl).logprob  # fmt: skip
        strided = base.clone().requires_grad_()
        rows = strided[:9, 3:27] if view.stride(0) == 40 else strided[::2, :24]
        lp2 = fused_linear_logprob(rows, inputs["weight"], targets, bias=inputs["bias"],
                                   backend=impl).logprob  # fmt: skip
        torch.testing.assert_close(lp, lp2, rtol=0, atol=0)
        check(x, targets, impl, torch.float32, requires={"hidden", "weight"})


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_vocabulary(impl):
    """Padded vocabulary rows: a -inf bias (logits -inf, p = 0, no NaN anywhere) and zeroed head
    rows (logit 0)."""
    inputs, targets = make_inputs(8, 8, 40, bias=True, seed=9)
    inputs["bias"][-6:] = -math.inf
    inputs["weight"][:3] = 0.0
    targets = torch.where(targets >= 34, targets - 10, targets)
    for ent in (False, True):
        out, grads = check(inputs, targets, impl, torch.float32, with_entropy=ent, chunk_size=3)
        assert all(torch.isfinite(g).all() for g in grads.values())
        assert not grads["bias"][-6:].any() and torch.isfinite(out.logprob).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_sure_target_is_exact(impl):
    """Targets holding all but ~1e-7 .. 1e-10 of the mass: the log-prob and the gradient
    ``1 - p_a`` come from the sum over the other entries, not from a rounded ``lse`` or ``p_a``
    (``z_a - lse`` in float32 would be off by ~1e-6, a thousand times the answer)."""
    inputs, targets = make_inputs(6, 64, 50, seed=10, scale=1.0)
    targets[:] = torch.arange(6)
    h, w = inputs["hidden"], inputs["weight"]
    margin = torch.tensor([16.0, 18.0, 20.0, 22.0, 24.0, 14.0])  # z_a - max_{j != a} z_j
    top = (h @ w.T)[:, 6:].amax(1)
    w[:6] = h * ((top + margin) / (h * h).sum(1))[:, None]
    ref, _ = run(inputs, targets, "torch", upcast=True, requires=set())
    assert ((ref.logprob > -1e-6) & (ref.logprob < -1e-11)).sum() >= 4  # the regime tested
    out, _ = check(inputs, targets, impl, torch.float32, requires={"hidden", "weight"})
    rel = (out.logprob.double() - ref.logprob).abs() / ref.logprob.abs()
    assert (rel < 1e-3).all(), rel


@pytest.mark.parametrize("impl", IMPLS)
def test_all_rows_ignored_and_int32_targets(impl):
    inputs, targets = make_inputs(5, 8, 19)
    out, grads = run(inputs, torch.full_like(targets, -100), impl, with_entropy=True)
    assert not out.logprob.any() and not out.entropy.any()
    assert all(not g.any() for g in grads.values())
    targets = torch.where(targets == -100, torch.full_like(targets, 7), targets).int()
    targets[::3] = 7
    ref, _ = run(inputs, targets.long(), impl, upcast=True, ignore_index=7)
    out, _ = run(inputs, targets, impl, ignore_index=7)
    assert_close(out.logprob, ref.logprob, torch.float32, "logprob")
    assert not out.logprob[::3].any()


@requires_cpp
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_cpu_bf16_gemms(isa, monkeypatch):
    """A bf16 head on CPU: float32 GEMMs of upcast blocks (below AVX-512, or without
    AVX512-BF16), or bf16 GEMMs (oneDNN, where the CPU has AVX512-BF16), both within bf16
    tolerance of the float64 reference, several chunks."""
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    monkeypatch.setitem(chunked.CHUNK_BUDGET, "cpu", 4 * 64 * 4)
    inputs, targets = make_inputs(13, 48, 301, torch.bfloat16, bias=True, seed=15)
    check(inputs, targets, "cpu", torch.bfloat16, chunk_size=4, with_entropy=True)
    check(inputs, targets, "cpu", torch.bfloat16, requires={"hidden"}, chunk_size=4)
    check(inputs, targets, "cpu", torch.bfloat16, chunk_size=20)  # one chunk


@requires_cpp
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_every_cpu_isa(isa, monkeypatch):
    """Each compiled ISA copy of the row kernels (LOPD_CPU_ISA caps it), V off the vector width."""
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    inputs, targets = make_inputs(7, 16, 301, bias=True, seed=11)
    check(inputs, targets, "cpu", torch.float32, with_entropy=True, temperature=0.6)
    check(inputs, targets, "cpu", torch.float32, requires={"hidden"})


# ---------------------------------------------------------------------------------------------
# Triton (interpreter on CPU: tiny shapes)
# ---------------------------------------------------------------------------------------------

TRITON_CASES = [
    # (n, d, V, temperature, bias, with_entropy, dtype)
    (19, 16, 45, 0.7, True, True, torch.float32),
    (10, 24, 37, 1.0, False, False, torch.float32),
    (12, 16, 40, 0.8, True, True, torch.bfloat16),
]


@requires_triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_matches_reference(case):
    n, d, vocab, temp, bias, ent, dtype = case
    inputs, targets = make_inputs(n, d, vocab, dtype, bias=bias, seed=12)
    check(inputs, targets, "triton", dtype, device=TRITON_DEVICE, temperature=temp,
          with_entropy=ent)  # fmt: skip


@requires_triton
def test_triton_frozen_head_and_masked_vocabulary():
    inputs, targets = make_inputs(9, 16, 41, bias=True, seed=13)
    inputs["bias"][:5] = -math.inf
    targets = torch.where((targets >= 0) & (targets < 5), targets + 5, targets)
    _, grads = check(inputs, targets, "triton", torch.float32, device=TRITON_DEVICE,
                     requires={"hidden"})  # fmt: skip
    assert set(grads) == {"hidden"}


# ---------------------------------------------------------------------------------------------
# API, module, custom ops, torch.compile, bad input
# ---------------------------------------------------------------------------------------------


def test_reference_backend_is_the_reference_and_exported():
    inputs, targets = make_inputs(6, 8, 23, bias=True)
    a = fused_linear_logprob(inputs["hidden"], inputs["weight"], targets, bias=inputs["bias"],
                             backend="torch", with_entropy=True)  # fmt: skip
    b = fused_linear_logprob_reference(inputs["hidden"], inputs["weight"], targets,
                                       bias=inputs["bias"], with_entropy=True)  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert lk.fused_linear_logprob is fused_linear_logprob
    want = -F.cross_entropy(inputs["hidden"] @ inputs["weight"].T + inputs["bias"], targets,
                            reduction="none")  # fmt: skip
    torch.testing.assert_close(a.logprob, want)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_module_is_f_cross_entropy(reduction):
    inputs, targets = make_inputs(9, 16, 53, bias=True, seed=3)
    h = inputs["hidden"].requires_grad_()
    module = lk.FusedLinearCrossEntropy(temperature=0.7, reduction=reduction)
    got = module(h, inputs["weight"], targets, inputs["bias"])
    (g_got,) = torch.autograd.grad(got.sum(), h)
    want = F.cross_entropy((h @ inputs["weight"].T + inputs["bias"]) / 0.7, targets,
                           reduction=reduction)  # fmt: skip
    (g_want,) = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(g_got, g_want, rtol=2e-5, atol=2e-6)
    if reduction == "mean":  # every row ignored: 0, not NaN
        assert module(h, inputs["weight"], torch.full_like(targets, -100)).item() == 0.0
    assert f"reduction={reduction!r}" in repr(module)
    with pytest.raises(ValueError, match="reduction must be one of"):
        lk.FusedLinearCrossEntropy(reduction="max")


def _op_args(device, projection):
    inputs, targets = make_inputs(6, 16, 37, bias=True, seed=11)
    leaves = {k: v.to(device).requires_grad_(k == "hidden" or not projection)
              for k, v in inputs.items()}  # fmt: skip
    args = (leaves["hidden"], leaves["weight"], leaves["bias"], targets.to(device), 0.9, -100,
            not projection, projection, 4, 16)  # fmt: skip
    return args


@pytest.mark.parametrize(
    ("impl", "projection"),
    [
        pytest.param("cpu", False, marks=requires_cpp),
        pytest.param("cpu", True, marks=requires_cpp),
        ("chunked", False),
        ("chunked", True),
        pytest.param("triton", False, marks=requires_triton),
    ],
)
def test_opcheck(impl, projection):
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    args = _op_args(device, projection)
    fwd_op, bwd_op = flp.CUSTOM_OPS.ops(impl)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(fwd_op.default, args, test_utils=tests)
    lp, ent, lse, proj = fwd_op(*args)
    assert proj.shape == ((6, 16) if projection else (0,))
    detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in args[:4]]
    grads = [torch.randn(6).to(device), ent.new_empty(0) if projection else torch.randn(6)]
    bwd_args = (
        *grads, *detached, lp.detach(), ent.detach(), lse, proj, 0.9, -100, 4, 16,
        [True, not projection, not projection],
    )  # fmt: skip
    torch.library.opcheck(bwd_op.default, bwd_args, test_utils=("test_schema", "test_faketensor"))


@requires_cpp
def test_torch_compile_fullgraph():
    inputs, targets = make_inputs(7, 16, 61, bias=True, seed=14)

    def loss_fn(h, w, b):
        out = lk.fused_linear_logprob(h, w, targets, bias=b, with_entropy=True, temperature=0.8)
        return out.logprob.sum() - 0.1 * out.entropy.mean()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (loss_fn, compiled):
        leaves = [inputs[k].clone().requires_grad_() for k in NAMES]
        loss = fn(*leaves)
        loss.backward()
        results.append((loss.detach(), *(x.grad for x in leaves)))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"hidden": torch.zeros(4, 5)}, "disagree on d"),
        ({"hidden": torch.zeros(4, 8, 1)}, "hidden must be 2-D"),
        ({"targets": torch.zeros(4)}, "targets must be int64/int32"),
        ({"targets": torch.tensor([0, 13, 1, 2])}, r"targets\[1\] = 13 is outside \[0, V=13\)"),
        ({"weight": torch.zeros(13, 8, dtype=torch.float64)}, "share one dtype"),
        ({"weight": torch.zeros(0, 8)}, "empty vocabulary"),
        ({"bias": torch.zeros(12)}, r"bias must have shape \[V\] = \[13\]"),
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number > 0"),
        ({"ignore_index": 1.5}, "ignore_index must be an int"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"backend": "tpu"}, "backend must be one of"),
        ({"backend": "cuda"}, "backend='cuda' is not an implementation of"),
    ],
)
def test_bad_input_names_the_argument(kw, match):
    g = torch.Generator().manual_seed(0)
    args = {"hidden": torch.randn(4, 8, generator=g), "weight": torch.randn(13, 8, generator=g),
            "targets": torch.tensor([0, 3, -100, 12])}  # fmt: skip
    args.update(kw)
    with pytest.raises((ValueError, TypeError, lk.BackendUnavailableError), match=match):
        fused_linear_logprob(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


def test_float64_only_on_the_reference():
    inputs, targets = make_inputs(4, 8, 13)
    h, w = inputs["hidden"].double(), inputs["weight"].double()
    assert fused_linear_logprob(h, w, targets).logprob.dtype == torch.float64
    with pytest.raises(TypeError, match="does not accept float64"):
        fused_linear_logprob(h, w, targets, backend="cpu")


def test_chunk_plan_and_working_set():
    """Vocabulary blocks of at most 16,384 entries whatever the rows (a short batch too: no
    [N, V] block), all within the block budget; the working-set bound counts what the op
    allocates."""
    budget = chunked.CHUNK_BUDGET["cpu"]
    assert chunked.chunk_plan(100, 151_936) == (100, chunked.MAX_CHUNK_VOCAB)
    assert chunked.chunk_plan(100, 151_936, "cuda") == (100, chunked.MAX_CHUNK_VOCAB)
    assert chunked.chunk_plan(3, 1000) == (3, 1000)
    rows, vb = chunked.chunk_plan(40_960, 151_936)
    assert rows == chunked.MAX_CHUNK_ROWS["cpu"] and vb % 64 == 0 and rows * vb * 4 <= budget
    assert chunked.chunk_plan(2048, 151_936, chunk_size=7)[0] == 7
    assert chunked.chunk_plan(10**6, 10, "cuda")[1] == 10
    work = chunked.workspace_bytes(40_960, 151_936, 4096, torch.bfloat16, head_grad=True)
    assert budget < work < budget + 4 * 151_936 * 4096 + 5 * 4 * 4096 * 4096
    frozen = chunked.workspace_bytes(2048, 151_936, 1024, projection=True, head_grad=False)
    assert frozen >= 2048 * 1024 * 4  # the saved projection


class _OpBlocks(TorchDispatchMode):
    """Bytes of the float32 ``[chunk_size, vocab_block]`` block each ``fused_linear_logprob``
    custom op is handed: the C++ op's one logit buffer, which comes from its recycled-buffer cache
    (memory it maps itself, so the profiler's allocator events do not show it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "fused_linear_logprob" in name:
            chunk, vb = args[-2:] if name.endswith("_fwd.default") else args[-3:-1]
            self.blocks.append(4 * chunk * vb)
        return func(*args, **(kwargs or {}))


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation made while ``fn`` runs: the profiler's allocator
    events (inside ops too, which a dispatch hook does not see) and the C++ op's block."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _OpBlocks() as op:
        fn()
    events = prof.profiler.kineto_results.events()
    return max([e.nbytes() for e in events if e.name() == "[memory]"] + op.blocks)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_grad", [True, False])
def test_no_allocation_of_n_x_v_elements(impl, dtype, head_grad):
    """36 scored rows over a 131,072-entry vocabulary: fewer rows than one block holds, yet no
    allocation of the forward and backward (with entropy) is as large as [36, V] in half
    precision (the largest: a [36, 16,384] block, in float64 where the chunked path sums it on
    CPU, or the [V, 8] float32 weight gradient); the materialized path is caught."""
    vocab = 131_072
    inputs, targets = make_inputs(48, 8, vocab, dtype)
    h = inputs["hidden"].requires_grad_()
    w = inputs["weight"].requires_grad_(head_grad)
    limit = 36 * vocab * 2

    def fused():
        out = lk.fused_linear_logprob(h, w, targets, with_entropy=head_grad, backend=impl)
        (out.logprob.sum() + (out.entropy.sum() if head_grad else 0)).backward()

    assert _largest_allocation(fused) < limit
    materialized = F.cross_entropy((h @ w.T).float(), targets, reduction="none").sum().backward
    assert _largest_allocation(materialized) >= limit


# Runs in a subprocess: with TRITON_INTERPRET=1 (set for this process by conftest.py) triton.jit
# yields interpreter functions, which cannot be compiled.
_COMPILE_SCRIPT = """
import functools

from tests.kernels.triton_compile import compile_kernel
import lopd_kernels.triton.fused_linear_logprob_kernels as k

def arg_type(name):
    if name in ("H", "W", "B"):
        return "*bf16"
    if name == "TGT":
        return "*i32"
    if name in ("N", "V", "D", "split_len") or name.startswith("stride"):
        return "i32"
    return "fp32" if name == "inv_temp" else "*fp32"

compile_for = functools.partial(
    compile_kernel,
    arch=90,
    arg_type=arg_type,
    aligned=lambda n: arg_type(n).startswith("*") or n.startswith("stride"),
)
tiles = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_D=128, PRECISION="tf32", UPCAST=False)
compile_for(k._fwd_kernel, HAS_B=True, ENTROPY=True, **tiles)
compile_for(k._bwd_kernel, HAS_B=False, ENTROPY=True, NEED_DH=True, NEED_DW=True, NEED_DB=False,
            **tiles)
print("compiled")
"""


def test_triton_kernels_compile_for_sm90():
    """The forward and backward kernels lower to a cubin for sm_90 (Triton's own ptxas, no GPU):
    the interpreter accepts code the compiler rejects."""
    assert_script_compiles(_COMPILE_SCRIPT)
