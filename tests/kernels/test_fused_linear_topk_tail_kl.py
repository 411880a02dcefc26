"""fused_linear_topk_tail_kl: every backend against the float64 materialized reference.

Outputs and all gradients (hidden states, weights, biases) are compared at the tolerance of the
input dtype (tests/utils.py). Shapes keep V off every tile/chunk multiple; logits are scaled so
that the top-M boundary has no near-ties (the selection is then the same in every precision).
"""

from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.fused_linear_topk_tail_kl import (
    auto_chunk_rows,
    fused_linear_topk_tail_kl,
    fused_linear_topk_tail_kl_reference,
)
from lopd_kernels.hf import causal_lm_topk_tail_kl, lm_head_topk_tail_kl
from tests.kernels.fused_linear_utils import (
    CASES,
    NAMES,
    OUTS,
    check,
    check_case,
    make_inputs,
    run,
    to_device,
)
from tests.kernels.triton_compile import assert_script_compiles
from tests.utils import TRITON_DEVICE, assert_close, requires_cuda, triton_interpret

# ---------------------------------------------------------------------------------------------
# Chunked CPU path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_matches_reference_fp32(case):
    check_case(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_precision(dtype):
    inputs, target = make_inputs(11, 64, 203, dtype, bias=True, seed=3)
    check(inputs, target, "chunked", dtype, top_m=8, temperature=0.9, chunk_size=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_frozen_heads_tail_projection(dtype, divergence):
    """Frozen heads, hidden states with grad (LoRA student, frozen teacher): dh comes from the
    forward's tail projections, with no logit recompute in the backward."""
    inputs, target = make_inputs(11, 64, 203, dtype, bias=True, seed=16)
    requires = {"student_hidden", "teacher_hidden"}
    check(
        inputs, target, "chunked", dtype, requires=requires, top_m=8, temperature=0.9,
        divergence=divergence, chunk_size=4,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The chunked path with the CUDA per-row kernels as its epilogue (what backend="cuda" runs on a
# GPU: cuBLAS logit blocks + csrc/cuda/topk_tail_kl_kernels.cuh), here on CPU tensors with those
# kernels run by the SIMT emulator (tests/kernels/simt_emu.py).
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def emulated_cuda_epilogue(monkeypatch):
    from tests.kernels import simt_emu

    chunked = importlib.import_module("lopd_kernels.fused_linear_topk_tail_kl_chunked")

    reason = simt_emu.unavailable_reason()
    if reason:
        pytest.skip(reason)
    simt_emu.load()
    ops = torch.ops.lopd_simt_emu
    monkeypatch.setattr(
        chunked,
        "epilogue_kernels",
        lambda device, top_m=0: chunked.EpilogueKernels(
            ops.topk_tail_kl_cuda_fwd, ops.topk_tail_kl_cuda_bwd
        ),
    )


@pytest.mark.parametrize(
    "case", [CASES[0], CASES[2], CASES[3], CASES[5]], ids=lambda c: "-".join(map(str, c))
)
def test_chunked_with_emulated_cuda_epilogue(case, emulated_cuda_epilogue):
    check_case(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_heads_with_emulated_cuda_epilogue(dtype, emulated_cuda_epilogue):
    inputs, target = make_inputs(11, 64, 2203, dtype, bias=True, seed=16)
    requires = {"student_hidden", "teacher_hidden"}
    check(inputs, target, "chunked", dtype, requires=requires, top_m=8, temperature=0.9,
          chunk_size=4)  # fmt: skip


# The same on a GPU: the real CUDA kernels as the epilogue of cuBLAS logit blocks.
@requires_cuda
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[2], CASES[3], CASES[5]], ids=lambda c: "-".join(map(str, c))
)
def test_chunked_cuda_on_gpu(case):
    n, d, vocab, top_m, temp, div, bias, chunk = case
    inputs, target = to_device(*make_inputs(n, d, vocab, bias=bias), "cuda")
    check(
        inputs, target, "chunked", torch.float32,
        top_m=top_m, temperature=temp, divergence=div, chunk_size=chunk,
    )  # fmt: skip


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_heads_chunked_cuda_on_gpu(dtype):
    inputs, target = to_device(*make_inputs(11, 64, 2203, dtype, bias=True, seed=16), "cuda")
    requires = {"student_hidden", "teacher_hidden"}
    check(inputs, target, "chunked", dtype, requires=requires, top_m=8, temperature=0.9,
          chunk_size=4)  # fmt: skip


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_tied_head(divergence):
    """One weight tensor for both models: its gradient is the sum of both sides'."""
    inputs, target = make_inputs(10, 16, 67, bias=True, tied=True, seed=4)
    _, grads = check(inputs, target, "chunked", torch.float32, top_m=6, divergence=divergence)
    assert "teacher_weight" not in grads and "student_weight" in grads


@pytest.mark.parametrize(
    "requires",
    [
        set(c)
        for r in range(len(NAMES) + 1)
        for c in itertools.combinations((*NAMES, "student_bias", "teacher_bias"), r)
        if r <= 1 or set(c) <= set(NAMES)
    ],
    ids=lambda s: "+".join(sorted(s)) or "none",
)
@pytest.mark.parametrize("top_m", [4, None])
def test_requires_grad_combinations(requires, top_m):
    """Each subset of {hidden, weight} x {student, teacher} (and each bias alone), top-M and
    full-vocabulary KL."""
    inputs, target = make_inputs(8, 8, 29, bias=True, seed=5)
    _, grads = check(inputs, target, "chunked", torch.float32, requires=requires, top_m=top_m)
    assert set(grads) == requires


def test_tied_head_one_side_requires_grad():
    """A shared head that requires grad while only the teacher's hidden states flow."""
    inputs, target = make_inputs(8, 8, 29, tied=True, seed=6)
    _, grads = check(
        inputs, target, "chunked", torch.float32, requires={"student_weight", "teacher_hidden"}
    )
    assert set(grads) == {"student_weight", "teacher_hidden"}


def test_different_hidden_sizes():
    """A wider teacher (d_t != d_s) over the same vocabulary."""
    inputs, target = make_inputs(7, 8, 41, bias=True, d_t=24, seed=7)
    check(inputs, target, "chunked", torch.float32, top_m=5, chunk_size=3)


def test_all_rows_ignored():
    inputs, target = make_inputs(5, 8, 19)
    target[:] = -100
    out, grads = run(inputs, target, "chunked", top_m=3)
    assert not out.kl.any() and not out.student_logprob.any() and not out.topk_ids.any()
    assert all(not g.any() for g in grads.values())


def test_custom_ignore_index_and_int32_targets():
    inputs, target = make_inputs(9, 8, 31, seed=8)
    target = torch.where(target == -100, torch.full_like(target, 7), target).int()
    target[::3] = 7  # ignore_index=7 drops these rows although 7 is a valid id
    ref, _ = run(inputs, target.long(), "torch", upcast=True, ignore_index=7, top_m=4)
    out, _ = run(inputs, target, "chunked", ignore_index=7, top_m=4)
    assert_close(out.kl, ref.kl, torch.float32, "kl")
    assert not out.kl[::3].any()


def test_masked_vocabulary_is_finite():
    """-inf logits (padded vocabulary through a -inf bias) give finite outputs and gradients."""
    inputs, target = make_inputs(8, 8, 40, bias=True, seed=9)
    for key in ("student_bias", "teacher_bias"):
        inputs[key][-6:] = -math.inf
    target = torch.where(target >= 34, target - 10, target)
    out, grads = check(inputs, target, "chunked", torch.float32, top_m=5, chunk_size=3)
    assert torch.isfinite(out.kl).all()
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_sharp_teacher_exact_tail():
    """A teacher whose top-M holds all but ~1e-9 of the mass: the tail must be a direct
    log-sum-exp over the complement (1 - sum(top-M) is 0 or noise in float32, and a clamp floors
    it at 1e-7), so the KL and its gradients match the float64 reference."""
    inputs, target = make_inputs(6, 8, 50, seed=10)
    inputs["teacher_weight"] = inputs["teacher_weight"] * 4
    # A student close to the teacher (self-distillation), so the KL stays O(1): a KL of ~30
    # would amplify float32 logit rounding past the fp32 gradient tolerance by itself.
    g = torch.Generator().manual_seed(3)
    inputs["student_weight"] = inputs["teacher_weight"] + 0.3 * torch.randn(50, 8, generator=g)
    inputs["student_hidden"] = inputs["teacher_hidden"] + 0.3 * torch.randn(6, 8, generator=g)
    t = inputs["teacher_hidden"].double() @ inputs["teacher_weight"].double().T / 0.5
    tail_mass = -torch.expm1(t.topk(10).values.logsumexp(-1) - t.logsumexp(-1))
    assert (tail_mass < 1e-8).sum() >= 3  # the regime this test is about
    check(inputs, target, "chunked", torch.float32, top_m=10, temperature=0.5)


def test_auto_chunk_rows(monkeypatch):
    chunked = importlib.import_module("lopd_kernels.chunked_linear")
    monkeypatch.setattr(chunked, "_free_memory_bytes", lambda device: 64 << 30)
    # 384 MiB cap / (4 blocks x 4 B x V) = 165 rows, 8-aligned: 160; 26 chunks of 158 -> 160.
    assert auto_chunk_rows(151_936, 4096) == 160
    # 328 rows per chunk at most: 13 balanced chunks of 316 rows, 8-aligned: 320.
    assert auto_chunk_rows(151_936, 4096, live_blocks=2) == 320
    assert auto_chunk_rows(151_936, 2048, live_blocks=2) == 296  # 7 x 293
    assert auto_chunk_rows(151_936, 400, live_blocks=2) == 200  # 2 x 200, not 328 + 72
    assert auto_chunk_rows(151_936, 329, live_blocks=2) == 168  # 2 x 165, 8-aligned
    assert auto_chunk_rows(151_936, 328, live_blocks=2) == 328
    # A quarter of the free memory when that is below the cap.
    monkeypatch.setattr(chunked, "_free_memory_bytes", lambda device: 1 << 30)
    assert auto_chunk_rows(151_936, 4096, live_blocks=2) == 216
    assert auto_chunk_rows(151_936, 5) == 5
    assert auto_chunk_rows(10**12, 100) == 1
    assert auto_chunk_rows(1000, 0) == 1


def test_reference_backend_is_reference():
    inputs, target = make_inputs(6, 8, 23, bias=True)
    args = [inputs[k] for k in NAMES] + [target]
    kw = {"student_bias": inputs["student_bias"], "teacher_bias": inputs["teacher_bias"]}
    a = fused_linear_topk_tail_kl(*args, backend="torch", top_m=3, **kw)
    b = fused_linear_topk_tail_kl_reference(*args, top_m=3, **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_exported():
    assert lk.fused_linear_topk_tail_kl is fused_linear_topk_tail_kl
    assert lk.lm_head_topk_tail_kl is lm_head_topk_tail_kl


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_is_the_reduced_functional(reduction):
    """FusedLinearTopKTailKL: the op's KL reduced (mean over the kept tokens), gradients to the
    hidden states, head and bias included, equal to the functional's on the chunked path (to
    float32 rounding for the reduced ones, whose gradients are formed in the forward)."""
    inputs, target = make_inputs(9, 16, 53, bias=True, seed=3)
    kw = {"top_m": 6, "temperature": 0.7, "chunk_size": 4}

    def grads(fn):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        loss = fn(leaves)
        loss.sum().backward()
        return loss.detach(), {k: v.grad for k, v in leaves.items()}

    def functional(x):
        kl = lk.fused_linear_topk_tail_kl(*(x[n] for n in NAMES), target, backend="chunked",
                                          student_bias=x["student_bias"],
                                          teacher_bias=x["teacher_bias"], **kw).kl  # fmt: skip
        kept = (target != -100).sum()
        return {"none": kl, "sum": kl.sum(), "mean": kl.sum() / kept}[reduction]

    module = lk.FusedLinearTopKTailKL(reduction=reduction, backend="chunked", **kw)
    got, got_grads = grads(lambda x: module(*(x[n] for n in NAMES), target, x["student_bias"],
                                            x["teacher_bias"]))  # fmt: skip
    want, want_grads = grads(functional)
    # "none" is the functional itself; a reduced KL is fused_linear_topk_tail_kl_loss (gradients
    # formed in the forward: the same sums in another order).
    exact = {"rtol": 0, "atol": 0} if reduction == "none" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, want, **exact)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **exact)
    all_ignored = torch.full_like(target, -100)
    if reduction == "mean":  # every token ignored: 0, not NaN
        assert module(*(inputs[n] for n in NAMES), all_ignored).item() == 0.0
    with pytest.raises(ValueError, match="divergence must be one of"):
        lk.FusedLinearTopKTailKL(divergence="js")


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


def _args():
    inputs, target = make_inputs(4, 8, 13)
    return [inputs[k] for k in NAMES] + [target]


@pytest.mark.parametrize(
    ("mutate", "kw", "match"),
    [
        (lambda a: a.__setitem__(0, a[0][:, :4]), {}, "student_hidden .* disagree on d"),
        (lambda a: a.__setitem__(3, a[3][:5]), {}, "teacher_weight has 5 vocabulary rows"),
        (lambda a: a.__setitem__(2, a[2][:3]), {}, "teacher_hidden has 3 rows"),
        (lambda a: a.__setitem__(0, a[0][None]), {}, "student_hidden must be 2-D"),
        (lambda a: a.__setitem__(4, a[4].float()), {}, r"target_ids must be int64 \(or int32\)"),
        (lambda a: a[4].__setitem__(0, 13), {}, r"target_ids\[0\] = 13 is outside \[0, V=13\)"),
        (lambda a: a.__setitem__(1, a[1].double()), {}, "share its weight's dtype"),
        (lambda a: None, {"top_m": 0}, "top_m must be a positive int"),
        (lambda a: None, {"temperature": 0.0}, "temperature must be a finite number"),
        (lambda a: None, {"divergence": "js"}, "divergence must be one of"),
        (lambda a: None, {"backend": "tpu"}, "backend must be one of"),
        (lambda a: None, {"chunk_size": 0}, "chunk_size must be a positive int"),
        (lambda a: None, {"student_bias": torch.zeros(12)}, r"student_bias must have shape"),
        (lambda a: None, {"backend": "cuda"}, "backend='cuda' is not an implementation of"),
        (lambda a: None, {"backend": "cpu"}, "backend='cpu' is not an implementation of"),
        (lambda a: a.__setitem__(0, a[0].double()), {"backend": "chunked"}, "share its weight"),
        (
            lambda a: a.__setitem__(slice(0, 2), [a[0].double(), a[1].double()]),
            {"backend": "chunked"},
            "does not accept float64",
        ),
    ],
)
def test_validation(mutate, kw, match):
    args = _args()
    mutate(args)
    with pytest.raises((ValueError, TypeError, lk.BackendUnavailableError), match=match):
        fused_linear_topk_tail_kl(*args, **kw)


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("impl", "tail_proj", "options"),
    [("chunked", False, None), ("chunked", True, None), ("triton", False, None),
     ("triton", False, ("union", "jsd", 0.5)), ("triton", False, ("student", "forward", 0.0))],
)  # fmt: skip
def test_opcheck(impl, tail_proj, options):
    if impl == "triton" and not lk._backend.triton_available():
        pytest.skip("Triton cannot run here (no CUDA device and TRITON_INTERPRET unset)")
    support, divergence, beta = options or ("teacher", "reverse", 1.0)
    inputs, target = make_inputs(6, 16, 37, bias=True, seed=11)
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    inputs, target = to_device(inputs, target, device)
    leaves = {k: v.requires_grad_() for k, v in inputs.items()}
    args = (
        leaves["student_hidden"], leaves["student_weight"], leaves["student_bias"],
        leaves["teacher_hidden"], leaves["teacher_weight"], leaves["teacher_bias"],
        target, 4, 0.9, divergence, beta, support, -100, 2, [tail_proj, tail_proj],
    )  # fmt: skip
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    fwd_op = getattr(torch.ops.lopd, f"fused_linear_topk_tail_kl_{impl}_fwd").default
    torch.library.opcheck(fwd_op, args, test_utils=tests)
    kl, _, _, ids, lse, bucket, proj_s, proj_t = fwd_op(*args)
    assert proj_s.shape == ((6, 16) if tail_proj else (0,))
    grads = [torch.randn(6).to(device) for _ in range(3)]
    bwd_args = (
        *grads, *(x.detach() for x in args[:7]), ids, kl.detach(), lse, bucket, proj_s, proj_t,
        0.9, divergence, beta, support, -100, 2, [True, True, False, True, False, True], False,
    )  # fmt: skip
    torch.library.opcheck(
        getattr(torch.ops.lopd, f"fused_linear_topk_tail_kl_{impl}_bwd").default,
        bwd_args,
        test_utils=("test_schema", "test_faketensor"),
    )


# ---------------------------------------------------------------------------------------------
# Triton (interpreter on CPU: tiny shapes)
# ---------------------------------------------------------------------------------------------

TRITON_CASES = [
    # (n, d, V, top_m, temperature, divergence, bias, tied, dtype)
    (19, 16, 45, 5, 0.7, "reverse", True, False, torch.float32),
    (10, 24, 37, 3, 1.0, "forward", False, True, torch.float32),
    (9, 16, 23, None, 1.2, "reverse", True, False, torch.float32),
    (9, 16, 23, None, 1.0, "forward", False, False, torch.float32),
    (7, 8, 9, 12, 1.0, "reverse", True, False, torch.float32),  # M >= V
    (12, 16, 40, 4, 0.8, "reverse", True, False, torch.bfloat16),
]

# support x divergence on the fused Triton kernel: (support, divergence, beta, top_m, dtype).
TRITON_OPTIONS = [
    ("student", "reverse", None, 5, torch.float32),
    ("student", "forward", None, 4, torch.float32),
    ("union", "reverse", None, 4, torch.bfloat16),
    ("student", "jsd", 0.25, 4, torch.bfloat16),
    ("union", "forward", None, 5, torch.float32),
    ("union", "jsd", 0.5, 6, torch.float32),
    ("union", "jsd", 0.9, 3, torch.bfloat16),
    ("teacher", "jsd", 0.5, 5, torch.float32),
    ("teacher", "jsd", 0.5, None, torch.float32),
    ("teacher", "jsd", 0.25, None, torch.bfloat16),
]


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret()),
    reason="Triton needs a CUDA device or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_matches_reference(case):
    n, d, vocab, top_m, temp, div, bias, tied, dtype = case
    inputs, target = make_inputs(n, d, vocab, dtype, bias=bias, tied=tied, seed=12)
    inputs, target = to_device(inputs, target, TRITON_DEVICE)
    check(inputs, target, "triton", dtype, top_m=top_m, temperature=temp, divergence=div)


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret()),
    reason="Triton needs a CUDA device or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", TRITON_OPTIONS, ids=lambda c: "-".join(map(str, c)))
def test_triton_every_support_and_divergence(case):
    """The fused kernel with the student's / the union's support (two running sets per
    vocabulary split; the splits' candidate lists merged in PyTorch) and the JSD (the full
    vocabulary's second pass over the tiles, forward and backward), all gradients."""
    support, div, beta, top_m, dtype = case
    inputs, target = make_inputs(11, 16, 45, dtype, bias=True, seed=23)
    inputs, target = to_device(inputs, target, TRITON_DEVICE)
    out, _ = check(inputs, target, "triton", dtype, top_m=top_m, temperature=0.8,
                   divergence=div, beta=beta, support=support)  # fmt: skip
    if top_m is not None:
        assert out.topk_ids.shape[-1] == (2 * top_m if support == "union" else top_m)


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret()),
    reason="Triton needs a CUDA device or TRITON_INTERPRET=1",
)
def test_triton_union_frozen_heads_and_masked_vocab():
    """The union with frozen heads (hidden-state gradients only) and -inf logits in some
    tiles: padding slots, and candidates the two sets share across splits."""
    inputs, target = make_inputs(9, 16, 41, bias=True, seed=14)
    inputs["student_bias"][:5] = -math.inf
    inputs["teacher_bias"][30:33] = -math.inf
    target = torch.where((target >= 0) & (target < 5), target + 5, target)
    target = torch.where((target >= 30) & (target < 33), target - 10, target)
    inputs, target = to_device(inputs, target, TRITON_DEVICE)
    requires = {"student_hidden", "teacher_hidden"}
    check(inputs, target, "triton", torch.float32, requires=requires, top_m=4, support="union",
          divergence="jsd", beta=0.4)  # fmt: skip


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret()),
    reason="Triton needs a CUDA device or TRITON_INTERPRET=1",
)
def test_triton_partial_requires_grad_and_masked_vocab():
    """Frozen heads (the LoRA + frozen-teacher setting) and -inf logits in some tiles."""
    inputs, target = make_inputs(9, 16, 41, bias=True, seed=13)
    for key in ("student_bias", "teacher_bias"):
        inputs[key][:5] = -math.inf
    target = torch.where((target >= 0) & (target < 5), target + 5, target)
    inputs, target = to_device(inputs, target, TRITON_DEVICE)
    requires = {"student_hidden", "teacher_hidden"}
    _, grads = check(inputs, target, "triton", torch.float32, requires=requires, top_m=4)
    assert set(grads) == requires


# ---------------------------------------------------------------------------------------------
# Hugging Face helpers
# ---------------------------------------------------------------------------------------------


def _tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


def test_causal_lm_helper_matches_materialized_logits():
    """Two real HF causal LMs: the helper equals reference-on-full-logits, gradients included."""
    student, teacher = _tiny_llama(0), _tiny_llama(1)
    teacher.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    action = torch.zeros(2, 12, dtype=torch.bool)
    action[0, 5:10] = True
    action[1, 3:12] = True
    out = causal_lm_topk_tail_kl(student, teacher, ids, action, top_m=5, backend="chunked")
    assert out.kl.shape == (2, 12) and out.topk_ids.shape == (2, 12, 5)
    assert not out.kl[~action].any()
    out.kl.sum().backward()
    fused_grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()

    s_logits = student(ids).logits[:, :-1]
    t_logits = teacher(ids).logits[:, :-1]
    rows = action[:, 1:]
    # The logits of the rows, as [R, V]; an identity "head" turns them into the reference's input.
    eye = torch.eye(97)
    ref = fused_linear_topk_tail_kl_reference(
        s_logits[rows], eye, t_logits[rows], eye, ids[:, 1:][rows], top_m=5
    )
    ref.kl.sum().backward()
    assert_close(out.kl[action], ref.kl, torch.float32, "kl")
    assert_close(out.privilege[action], ref.privilege, torch.float32, "privilege")
    assert torch.equal(out.topk_ids[action], ref.topk_ids)
    for p, fused in zip(student.parameters(), fused_grads):
        torch.testing.assert_close(fused, p.grad, rtol=1e-4, atol=1e-6)


def test_lm_head_helper_teacher_with_prefix():
    """The teacher sees extra (privileged) positions: its action rows are shifted."""
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(2, 6, 8, generator=g)
    ht = torch.randn(2, 9, 8, generator=g)
    target = torch.randint(0, 31, (2, 6), generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    t_mask = torch.zeros(2, 9, dtype=torch.bool)
    t_mask[:, 3:] = mask
    head_s = torch.nn.Linear(8, 31)
    head_t = torch.nn.Linear(8, 31, bias=False)
    out = lm_head_topk_tail_kl(
        hs, head_s, ht, head_t, target, mask, teacher_action_mask=t_mask, top_m=4
    )
    ref = fused_linear_topk_tail_kl_reference(
        hs[mask], head_s.weight, ht[t_mask], head_t.weight, target[mask],
        student_bias=head_s.bias, top_m=4,
    )  # fmt: skip
    assert_close(out.kl[mask], ref.kl, torch.float32, "kl")
    assert_close(out.teacher_logprob[mask], ref.teacher_logprob, torch.float32, "lp_t")
    assert not out.kl[~mask].any()
    t_mask[0, 0] = True  # one teacher row too many in sequence 0
    with pytest.raises(ValueError, match="as many rows per sequence"):
        lm_head_topk_tail_kl(hs, head_s, ht, head_t, target, mask, teacher_action_mask=t_mask)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialized"])
def test_lm_head_helper_on_packed_rows(fused):
    """Packed action rows (the trainer's layout): the same outputs from a module head, a weight /
    (weight, bias) pair, and, with fused=False, from the heads' own logits."""
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(7, 8, generator=g, requires_grad=True)
    ht = torch.randn(7, 8, generator=g, requires_grad=True)
    target = torch.randint(0, 31, (7,), generator=g)
    target[3] = -100
    head_s, head_t = torch.nn.Linear(8, 31), torch.nn.Linear(8, 31, bias=False)
    out = lm_head_topk_tail_kl(hs, head_s, ht, head_t, target, fused=fused, top_m=4)
    pair = lm_head_topk_tail_kl(
        hs, (head_s.weight, head_s.bias), ht, head_t.weight, target, fused=fused, top_m=4
    )
    ref = fused_linear_topk_tail_kl_reference(
        hs, head_s.weight, ht, head_t.weight, target, student_bias=head_s.bias, top_m=4
    )
    for name in OUTS:
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, name)
        assert torch.equal(getattr(out, name), getattr(pair, name)), name
    assert torch.equal(out.topk_ids, ref.topk_ids)
    (g_hs,) = torch.autograd.grad(out.kl.sum(), hs)
    (r_hs,) = torch.autograd.grad(ref.kl.sum(), hs)
    assert_close(g_hs, r_hs, torch.float32, "d student_hidden")
    if not fused:
        with pytest.raises(ValueError, match="chunk_size"):
            lm_head_topk_tail_kl(hs, head_s, ht, head_t, target, fused=False, chunk_size=2)
    with pytest.raises(ValueError, match="packed"):
        lm_head_topk_tail_kl(hs[None], head_s, ht, head_t, target)


def test_decoder_of_is_the_one_helper():
    """lopd's composer uses the kernel library's decoder_of (one definition)."""
    import lopd.latent.composer

    assert lopd.latent.composer.decoder_of is lk.decoder_of
    model = _tiny_llama(3)
    assert lk.decoder_of(model) is model.get_decoder()
    with pytest.raises(TypeError, match="exposes no decoder"):
        lk.decoder_of(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# PyTorch twins of the per-row kernels (the chunked path without the compiled extension)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_m", [5, 0])
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_torch_twins_match_reference(top_m, divergence):
    from lopd_kernels.bucket_math import rows_bwd_torch as _rows_bwd_torch
    from lopd_kernels.bucket_math import rows_fwd_torch as _rows_fwd_torch
    from lopd_kernels.topk_tail_kl import topk_tail_kl_reference

    g = torch.Generator().manual_seed(15)
    s = (torch.randn(9, 41, generator=g) * 2).double().requires_grad_()
    t = (torch.randn(9, 41, generator=g) * 2).double().requires_grad_()
    t.data[0, :3] = -math.inf  # masked vocabulary entries
    s.data[0, :3] = -math.inf
    target = torch.randint(3, 41, (9,), generator=g)
    target[2] = -100
    ref = topk_tail_kl_reference(
        s, t, target, top_m=top_m or None, temperature=0.8, divergence=divergence
    )
    ups = [torch.randn(9, generator=g, dtype=torch.float64) for _ in range(3)]
    loss = (ref.kl * ups[0] + ref.student_logprob * ups[1] + ref.teacher_logprob * ups[2]).sum()
    loss.backward()
    beta = 1.0 if divergence == "reverse" else 0.0
    s32, t32 = s.detach().float(), t.detach().float()
    out = _rows_fwd_torch(s32, t32, target, top_m, 0.8, divergence, beta, "teacher", -100)
    kl, lp_s, lp_t, ids, lse, bucket = out
    assert_close(kl, ref.kl, torch.float32, "kl")
    assert_close(lp_s, ref.student_logprob, torch.float32, "student_logprob")
    assert_close(lp_t, ref.teacher_logprob, torch.float32, "teacher_logprob")
    assert torch.equal(ids, ref.topk_ids)
    gs, gt = _rows_bwd_torch(
        *(u.float() for u in ups), s.detach().float(), t.detach().float(), target, ids, kl, lse,
        bucket, 0.8, divergence, beta, -100, True, True,
    )  # fmt: skip
    assert_close(gs, s.grad, torch.float32, "d student_logits")
    assert_close(gt, t.grad, torch.float32, "d teacher_logits")


# Runs in a subprocess: with TRITON_INTERPRET=1 (set for this process by conftest.py) triton.jit
# yields interpreter functions, which cannot be compiled.
_COMPILE_SCRIPT = """
import functools

from tests.kernels.triton_compile import compile_kernel
import lopd_kernels.triton.fused_linear_topk_tail_kl as k

INTS = ("N", "V", "DS", "DT", "split_len")

def arg_type(name):
    if name in ("HS", "WS", "BS", "HT", "WT", "BT"):
        return "*bf16"
    if name in ("TGT", "TOP_I"):
        return "*i32"
    if name == "IDS":
        return "*i64"
    if name in INTS or name.startswith("stride"):
        return "i32"
    return "fp32" if name in ("inv_temp", "beta", "log_1mb", "log_b") else "*fp32"

compile_for = functools.partial(
    compile_kernel,
    arch=90,
    arg_type=arg_type,
    aligned=lambda n: arg_type(n).startswith("*") or n.startswith("stride"),
)

tiles = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_D=128, PRECISION="tf32", UPCAST=False)
for support in (0, 2):  # the teacher's top-M, the union (two running sets)
    compile_for(k._fwd_kernel, M=20, M_PAD=32, FULL=False, DIV=0, SUPPORT=support,
                SETS=1 + (support == 2), HAS_BS=True, HAS_BT=False, **tiles)
needs = dict(NEED_S=True, NEED_T=True, NEED_DHS=True, NEED_DWS=True, NEED_DBS=True,
             NEED_DHT=True, NEED_DWT=False, NEED_DBT=False)
compile_for(k._bwd_kernel, M=20, FULL=False, DIV=0, HAS_BS=True, HAS_BT=False, **needs, **tiles)
# The full-vocabulary JSD: its second pass, and the backward's per-entry factors.
compile_for(k._jsd_full_kernel, HAS_BS=True, HAS_BT=False, **tiles)
compile_for(k._bwd_kernel, M=1, FULL=True, DIV=2, HAS_BS=True, HAS_BT=False, **needs, **tiles)
print("compiled")
"""


def test_triton_kernels_compile_for_sm90():
    """The forward and backward kernels lower to a cubin for sm_90 (Triton's own ptxas, no GPU).

    The interpreter accepts code the compiler rejects (non-constexpr globals, type changes across
    loop iterations): this is the check that the GPU path builds.
    """
    assert_script_compiles(_COMPILE_SCRIPT)


# ---------------------------------------------------------------------------------------------
# support x divergence on the chunked path (and the HF helpers)
# ---------------------------------------------------------------------------------------------

OPTIONS = [
    ("teacher", "jsd", 0.5),
    ("student", "reverse", None),
    ("student", "jsd", 0.25),
    ("union", "forward", None),
    ("union", "jsd", 0.9),
]


@pytest.mark.parametrize(("support", "divergence", "beta"), OPTIONS)
@pytest.mark.parametrize(
    "requires", [None, {"student_hidden", "teacher_hidden"}], ids=["all", "frozen-heads"]
)
def test_chunked_every_support_and_divergence(support, divergence, beta, requires):
    """Every option through the chunked path (C++ per-row kernels, chunks of 4 rows), all
    gradients, or with frozen heads (the tail projections, padding slots of the union included)."""
    inputs, target = make_inputs(13, 16, 301, bias=True, seed=21)
    kw = {"top_m": 6, "temperature": 0.9, "divergence": divergence, "beta": beta}
    out, _ = check(inputs, target, "chunked", torch.float32, requires=requires, chunk_size=4,
                   support=support, **kw)  # fmt: skip
    biases = {k: inputs[k] for k in ("student_bias", "teacher_bias")}
    ref = fused_linear_topk_tail_kl_reference(*(inputs[n] for n in NAMES), target,
                                              support=support, **biases, **kw)  # fmt: skip
    assert torch.equal(out.support_size, ref.support_size)


@pytest.mark.parametrize("support", ["student", "union"])
def test_hf_helpers_take_support_and_jsd(support):
    """lm_head_topk_tail_kl (batched layout, fused and materialized; causal_lm_topk_tail_kl
    calls it) passes support / beta through; support_size comes back in the batch layout."""
    g = torch.Generator().manual_seed(5)
    h_s, h_t = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    head_s, head_t = torch.nn.Linear(8, 41), torch.nn.Linear(8, 41)
    target = torch.randint(0, 41, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    kw = {"top_m": 4, "divergence": "jsd", "beta": 0.4, "support": support}
    fused = lm_head_topk_tail_kl(h_s, head_s, h_t, head_t, target, mask, **kw)
    plain = lm_head_topk_tail_kl(h_s, head_s, h_t, head_t, target, mask, fused=False, **kw)
    ref = lk.topk_tail_kl_reference(head_s(h_s), head_t(h_t), target.masked_fill(~mask, -100),
                                    **kw)  # fmt: skip
    for out in (fused, plain):
        torch.testing.assert_close(out.kl, ref.kl.float(), rtol=2e-5, atol=2e-6)
        assert torch.equal(out.topk_ids, ref.topk_ids)
        assert torch.equal(out.support_size, ref.support_size)
    assert out.support_size.shape == (2, 5) and not out.support_size[~mask].any()
