"""topk_tail_kl: the reference against brute force and gradcheck, every backend present against
the float64 reference (outputs and both gradients), TRL as an outside oracle, custom-op checks,
torch.compile, and input validation."""

from __future__ import annotations

import math

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.topk_tail_kl import topk_tail_kl_reference
from tests.kernels.utils import (
    assert_grad_close,
    make_inputs,
    opcheck_samples,
    random_upstream,
    run,
)
from tests.utils import (
    HAS_CPP,
    TRITON_DEVICE,
    assert_close,
    requires_cpp,
    requires_triton,
)

# --------------------------------------------------------------------------------- helpers


def check_against_reference(s, t, target, backend, **kw):
    """All five outputs and both gradients of ``backend`` vs the float64 reference."""
    n = target.numel()
    up = [u.to(target.device) for u in random_upstream(n)]
    out, gs, gt = run(lk.topk_tail_kl, s, t, target, up, backend=backend, **kw)
    ref, rgs, rgt = run(topk_tail_kl_reference, s.double(), t.double(), target, up, **kw)
    # The kernels compute in float32 on the (exactly widened) inputs: float32 tolerance for the
    # outputs whatever the input dtype; gradients are rounded to each input's dtype.
    for name in ("kl", "privilege", "student_logprob", "teacher_logprob"):
        assert getattr(out, name).dtype == torch.float32
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, f"{backend} {name}")
    assert torch.equal(out.topk_ids, ref.topk_ids), f"{backend} topk_ids"
    assert_close(out.teacher_topk_mass, ref.teacher_topk_mass, torch.float32, f"{backend} mass")
    assert not out.teacher_topk_mass.requires_grad
    assert gs.dtype == s.dtype and gt.dtype == t.dtype
    assert_grad_close(gs, rgs, s.dtype, f"{backend} grad student")
    assert_grad_close(gt, rgt, t.dtype, f"{backend} grad teacher")


def brute_force(s, t, target, top_m, temperature, reverse, ignore_index=-100):
    """Float64, written differently from the reference: explicit bucket masses (sum of
    probabilities) after a Python sort of (-t_j, j) per row."""
    s = s.double() / temperature
    t = t.double() / temperature
    n, v = s.shape
    kl = torch.zeros(n, dtype=torch.float64)
    slp = torch.zeros(n, dtype=torch.float64)
    tlp = torch.zeros(n, dtype=torch.float64)
    m = 0 if top_m is None or top_m >= v else top_m
    ids = torch.zeros(n, m, dtype=torch.int64)
    mass = torch.zeros(n, dtype=torch.float64)
    for r in range(n):
        a = int(target[r])
        if a == ignore_index:
            continue
        p = torch.softmax(s[r], 0)
        q = torch.softmax(t[r], 0)
        slp[r] = math.log(p[a])
        tlp[r] = math.log(q[a])
        if m == 0:
            pb, qb = p.tolist(), q.tolist()
        else:
            order = sorted(range(v), key=lambda j: (-t[r, j].item(), j))
            top, rest = order[:m], order[m:]
            ids[r] = torch.tensor(top)
            pb = [p[j].item() for j in top] + [p[rest].sum().item()]
            qb = [q[j].item() for j in top] + [q[rest].sum().item()]
        mass[r] = 1.0 if m == 0 else sum(qb[:m])
        if not reverse:
            pb, qb = qb, pb
        kl[r] = sum(x * (math.log(x) - math.log(y)) for x, y in zip(pb, qb) if x > 0)
    return kl, slp, tlp, ids, mass


# --------------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    ("v", "top_m", "temperature", "divergence"),
    [
        (7, 1, 1.0, "reverse"),
        (7, 3, 0.7, "forward"),
        (97, 20, 1.5, "reverse"),
        (7, None, 1.0, "forward"),
        (7, 9, 0.5, "reverse"),
    ],
)
def test_reference_matches_bruteforce(v, top_m, temperature, divergence):
    s, t, target = make_inputs(5, v, s_dtype=torch.float64, ignore_rows=(2,))
    ref = topk_tail_kl_reference(
        s, t, target, top_m=top_m, temperature=temperature, divergence=divergence
    )
    kl, slp, tlp, ids, mass = brute_force(s, t, target, top_m, temperature, divergence == "reverse")
    torch.testing.assert_close(ref.kl, kl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ref.student_logprob, slp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ref.teacher_logprob, tlp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ref.privilege, tlp - slp, rtol=1e-10, atol=1e-12)
    assert torch.equal(ref.topk_ids, ids)
    torch.testing.assert_close(ref.teacher_topk_mass, mass, rtol=1e-10, atol=1e-12)
    assert ref.kl[2] == 0 and (ref.topk_ids[2] == 0).all() and ref.teacher_topk_mass[2] == 0


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
@pytest.mark.parametrize("top_m", [2, None])
def test_reference_gradcheck(divergence, top_m):
    s, t, target = make_inputs(3, 6, s_dtype=torch.float64, ignore_rows=(1,))
    s.requires_grad_(True)
    t.requires_grad_(True)

    def f(s_, t_):
        out = topk_tail_kl_reference(
            s_, t_, target, top_m=top_m, temperature=0.8, divergence=divergence
        )
        # privilege is left out: its stop-gradient is invisible to finite differences (its
        # routing is tested below).
        return out.kl, out.student_logprob, out.teacher_logprob

    assert torch.autograd.gradcheck(f, (s, t))


def test_reference_gradient_routing():
    """privilege and teacher_logprob reach only the teacher; student_logprob only the student."""
    s, t, target = make_inputs(4, 11, s_dtype=torch.float64)
    s.requires_grad_(True)
    t.requires_grad_(True)
    out = topk_tail_kl_reference(s, t, target, top_m=3)
    gs, gt = torch.autograd.grad(out.privilege.sum(), (s, t), allow_unused=True)
    assert gs is None or torch.all(gs == 0)
    assert gt.abs().sum() > 0
    gs, gt = torch.autograd.grad(out.student_logprob.sum(), (s, t), allow_unused=True)
    assert gt is None or torch.all(gt == 0)
    assert gs.abs().sum() > 0


# --------------------------------------------------------------------------------- C++ backend

CPU_CASES = [
    # (n, v, top_m, temperature, divergence, s_dtype, t_dtype, pad)
    (1, 1, None, 1.0, "reverse", torch.float32, torch.float32, 0),
    (3, 7, 1, 0.7, "reverse", torch.float32, torch.float32, 0),
    (3, 7, 20, 1.3, "forward", torch.float32, torch.float32, 0),
    (3, 97, None, 1.0, "forward", torch.float16, torch.float16, 0),
    (257, 97, 20, 1.0, "reverse", torch.float32, torch.float32, 0),
    (257, 97, 64, 0.6, "forward", torch.bfloat16, torch.bfloat16, 0),
    (3, 1000, 1, 2.0, "reverse", torch.bfloat16, torch.bfloat16, 0),
    (3, 1000, 64, 0.5, "forward", torch.float32, torch.float32, 24),
    (3, 32000, 20, 1.0, "reverse", torch.float32, torch.bfloat16, 0),
    (1, 151936, 64, 0.8, "forward", torch.float32, torch.float32, 0),
    (2, 151936, 20, 1.0, "reverse", torch.bfloat16, torch.float32, 100),
]


@requires_cpp
@pytest.mark.parametrize(
    ("n", "v", "top_m", "temperature", "divergence", "s_dtype", "t_dtype", "pad"), CPU_CASES
)
def test_cpu_matches_reference(n, v, top_m, temperature, divergence, s_dtype, t_dtype, pad):
    ignore = (1,) if n > 2 else ()
    s, t, target = make_inputs(
        n, v, s_dtype=s_dtype, t_dtype=t_dtype, ignore_rows=ignore, pad=pad, seed=v + n
    )
    check_against_reference(
        s, t, target, "cpu", top_m=top_m, temperature=temperature, divergence=divergence
    )


@requires_cpp
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_cpu_every_isa_copy(isa, monkeypatch):
    """Each per-ISA build of the kernel (chosen at run time) matches the reference; V is not a
    multiple of any vector width, so the scalar remainders run too."""
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    s, t, target = make_inputs(5, 4099, s_dtype=torch.bfloat16, ignore_rows=(3,), pad=5, seed=3)
    for top_m, div in ((20, "reverse"), (None, "forward")):
        check_against_reference(s, t, target, "cpu", top_m=top_m, temperature=0.9, divergence=div)


@requires_cpp
@pytest.mark.parametrize("top_m", [20, None])
def test_cpu_all_ignored_is_zero(top_m):
    s, t, target = make_inputs(4, 50, ignore_rows=range(4))
    up = random_upstream(4)
    out, gs, gt = run(lk.topk_tail_kl, s, t, target, up, backend="cpu", top_m=top_m)
    for x in out:
        assert torch.all(x == 0)
    assert torch.all(gs == 0) and torch.all(gt == 0)
    s.requires_grad_(True)
    loss = lk.TopKTailKL(reduction="mean", backend="cpu")(s, t, target)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(s.grad == 0)


@requires_cpp
def test_cpu_neg_inf_entries_no_nan():
    """Padded entries inside the top-M and a tail made only of -inf entries (zero mass)."""
    s, t, target = make_inputs(4, 12, pad=5, ignore_rows=(0,), seed=5)
    for top_m in (9, 3, None):
        for div in ("reverse", "forward"):
            check_against_reference(s, t, target, "cpu", top_m=top_m, divergence=div)


@requires_cpp
def test_cpu_tail_exact_for_tiny_tail_mass():
    """A sharp teacher leaves ~1e-19 of its mass in the tail: the tail log-mass must still be
    exact (no 1 - sum cancellation, no 1e-7 clamp), and so must the gradient it drives."""
    n, v, m = 3, 1000, 20
    s, t, target = make_inputs(n, v, seed=11)
    t[:, m:] -= 50.0  # teacher: top-20 around 0, the other 980 entries near -50
    s[:, m:] -= 30.0
    _kl, _, _, ids, _lse, bucket = torch.ops.lopd.topk_tail_kl_cpu_fwd(
        s, t, target, m, 1.0, "reverse", 1.0, "teacher", -100
    )
    t64 = t.double()
    keep = torch.ones(n, v, dtype=torch.bool).scatter(1, ids, False)
    exact_tail_q = torch.logsumexp(t64.masked_fill(~keep, -math.inf), 1) - torch.logsumexp(t64, 1)
    assert exact_tail_q.max() < -40  # the tail really is tiny
    torch.testing.assert_close(bucket[:, 1, m].double(), exact_tail_q, rtol=1e-6, atol=0)
    check_against_reference(s, t, target, "cpu", top_m=m)


@requires_cpp
@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_cpu_tail_stabilizer_jumps_and_empty_tails(isa, monkeypatch):
    """The forward's one-pass tail sums are relative to a running stabilizer that is raised only
    when a tail term would exceed e^64 (csrc/cpu/isa/topk_tail_kl_kernel.cpp). Rows that force
    every branch of it, against the reference: tail logits that jump by +80 and +300 mid-row
    (teacher and student; the jump comes from far below, so that no logit is large enough for
    float32 rounding to dominate the comparison), a tail that falls by 300 (its terms underflow
    against the earlier maximum, harmlessly), a student whose first 3,000 entries are -inf (no
    stabilizer yet), a student that is -inf outside the top-M, and -inf blocks on both sides
    mid-row. Reverse KL on every row; forward KL where it is finite."""
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    n, v, m = 6, 9001, 16
    s, t, target = make_inputs(n, v, seed=31)
    t[0, m:4000] -= 80.0
    s[0, m:4000] -= 80.0
    t[1, m:2500] -= 80.0
    s[1, m:6000] -= 300.0
    t[2, 5000:] -= 300.0
    s[2, 5000:] -= 300.0
    s[3, :3000] = -math.inf
    s[4, m:] = -math.inf
    for x in (s, t):
        x[5, 100:200] = -math.inf
        x[5, 7000:] = -math.inf
    target[3] = 3500
    target[4] = 0
    check_against_reference(s, t, target, "cpu", top_m=m, divergence="reverse")
    finite = [0, 1, 2, 5]
    check_against_reference(
        s[finite], t[finite], target[finite], "cpu", top_m=m, divergence="forward"
    )


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("cpu", marks=requires_cpp),
                pytest.param("triton", marks=requires_triton)]
)  # fmt: skip
def test_infinite_divergence_is_inf_not_nan(backend):
    """A bucket with mass on the weighting side against none on the other is an infinite
    divergence, also when that mass underflows float32 (log-mass -390: exp gives 0, and 0 * inf
    was NaN): forward KL with a student that is -inf outside the teacher's top-M."""
    n, v, m = 2, 3000, 16
    s, t, target = make_inputs(n, v, seed=41)
    t[:, :m] += 400.0  # the teacher's tail holds ~e^-390 of its mass
    s[:, m:] = -math.inf
    target[:] = 0
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    out = lk.topk_tail_kl(
        s.to(dev), t.to(dev), target.to(dev), top_m=m, divergence="forward", backend=backend
    )
    assert torch.all(out.kl == math.inf), (backend, out.kl)


@requires_cpp
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_cpu_lopsided_buckets_finite_gradients(divergence):
    """One side gives some buckets ~e^-100 of the other's mass (a very sharp teacher against a
    flat student, and the reverse): the ratios P_b / Q_b of math.md overflow float32 there, but
    the gradients are finite and must match the reference."""
    n, v, m = 4, 300, 8
    g = torch.Generator().manual_seed(21)
    sharp = torch.randn(n, v, generator=g, dtype=torch.float64)
    sharp[:, 1:] -= 100.0  # one dominant entry; the rest of the top-M holds ~e^-100
    flat = torch.randn(n, v, generator=g, dtype=torch.float64) * 0.1
    target = torch.randint(0, v, (n,), generator=g)
    for s, t in ((flat, sharp), (sharp, flat)):
        check_against_reference(
            s.float(), t.float(), target, "cpu", top_m=m, temperature=1.0, divergence=divergence
        )


@requires_cpp
def test_cpu_shapes_strides_and_requires_grad():
    """[B, L, V] inputs, non-contiguous logits, int32 targets, one side without grad."""
    s, t, target = make_inputs(6, 33, seed=2, ignore_rows=(4,))
    s3 = s.reshape(2, 3, 33)
    t_nc = t.t().contiguous().t().reshape(2, 3, 33)  # same values, transposed strides
    assert not t_nc.is_contiguous()
    out = lk.topk_tail_kl(s3, t_nc, target.reshape(2, 3).int(), top_m=4, backend="cpu")
    ref = topk_tail_kl_reference(s.double(), t.double(), target, top_m=4)
    assert out.kl.shape == (2, 3) and out.topk_ids.shape == (2, 3, 4)
    assert_close(out.kl.reshape(-1), ref.kl, torch.float32, "kl")
    assert torch.equal(out.topk_ids.reshape(6, 4), ref.topk_ids)
    s_leaf = s.clone().requires_grad_(True)
    out = lk.topk_tail_kl(s_leaf, t, target, top_m=4, backend="cpu")
    (out.kl.sum() + out.privilege.sum()).backward()  # teacher has no grad: nothing computed
    ref_s = s.double().requires_grad_(True)
    ref = topk_tail_kl_reference(ref_s, t.double(), target, top_m=4)
    ref.kl.sum().backward()
    assert_grad_close(s_leaf.grad, ref_s.grad, torch.float32, "grad student")


@requires_cpp
def test_module_reductions():
    s, t, target = make_inputs(5, 40, ignore_rows=(0, 3))
    kl = lk.topk_tail_kl(s, t, target, top_m=5, backend="cpu").kl
    mods = {r: lk.TopKTailKL(top_m=5, reduction=r, backend="cpu") for r in ("none", "sum", "mean")}
    torch.testing.assert_close(mods["none"](s, t, target), kl)
    torch.testing.assert_close(mods["sum"](s, t, target), kl.sum())
    torch.testing.assert_close(mods["mean"](s, t, target), kl.sum() / 3)


# --------------------------------------------------------------------------------- TRL oracle


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_trl_oracle(divergence):
    """TRL's top-k self-distillation loss with the top-k of its *first* argument, a tail bucket,
    and alpha = 0 (KL(second || first)) / alpha = 1 (KL(first || second)) per row, without
    reduction. Called with (teacher, student) it is our reverse / forward KL. Tail mass here is
    far above TRL's 1e-7 clamp, so the two must agree, values and both gradients."""
    from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

    m = 8
    s, t, target = make_inputs(6, 300, s_dtype=torch.float64, scale=1.0, seed=4)
    s.requires_grad_(True)
    t.requires_grad_(True)
    trl_kl = compute_topk_self_distillation_loss(
        t,
        s,
        distillation_topk=m,
        distillation_alpha=0.0 if divergence == "reverse" else 1.0,
        distillation_add_tail=True,
    )
    assert trl_kl.shape == (6,)  # per-row: TRL sums over buckets and does not reduce rows
    tail_mass = 1 - torch.softmax(t, -1).topk(m, -1).values.sum(-1)
    assert tail_mass.min() > 1e-3
    backend = "cpu" if HAS_CPP else "torch"
    ours = lk.topk_tail_kl(
        s.float().detach().requires_grad_(True),
        t.float().detach().requires_grad_(True),
        target,
        top_m=m,
        divergence=divergence,
        backend=backend,
    )
    assert_close(ours.kl, trl_kl, torch.float32, "kl vs TRL")
    u = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g_trl = torch.autograd.grad((trl_kl * u).sum(), (s, t))
    s32 = s.detach().float().requires_grad_(True)
    t32 = t.detach().float().requires_grad_(True)
    ours = lk.topk_tail_kl(s32, t32, target, top_m=m, divergence=divergence, backend=backend)
    g_ours = torch.autograd.grad((ours.kl.double() * u).sum(), (s32, t32))
    assert_grad_close(g_ours[0], g_trl[0], torch.float32, "grad student vs TRL")
    assert_grad_close(g_ours[1], g_trl[1], torch.float32, "grad teacher vs TRL")


# --------------------------------------------------------------------------------- custom ops


OPCHECK_CASES = [
    # (backend, top_m, support, divergence, beta): the C++ ops with their default options and
    # every option, the Triton ops with each option once (tiny shapes for the interpreter).
    *(("cpu", m, "teacher", "reverse", 1.0) for m in (5, 0)),
    *(("cpu", m, support, div, beta) for m in (5, 0) for support in lk.SUPPORTS
      for div, beta in (("jsd", 0.3), ("forward", 0.0))),
    ("triton", 5, "teacher", "reverse", 1.0), ("triton", 5, "union", "jsd", 0.5),
    ("triton", 4, "student", "forward", 0.0), ("triton", 0, "union", "jsd", 0.25),
]  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "top_m", "support", "divergence", "beta"),
    [pytest.param(*c, marks=requires_cpp if c[0] == "cpu" else requires_triton)
     for c in OPCHECK_CASES],
)  # fmt: skip
def test_opcheck(backend, top_m, support, divergence, beta):
    """The ops' schema, fakes (the union's [N, 2M] ids) and autograd, with every option; the C++
    backward also with one side's gradient only."""
    fwd = getattr(torch.ops.lopd, f"topk_tail_kl_{backend}_fwd")
    bwd = getattr(torch.ops.lopd, f"topk_tail_kl_{backend}_bwd")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    fwd_args, bwd_args = opcheck_samples(fwd, top_m, device, support, divergence, beta)
    k = 0 if top_m == 0 else (2 * top_m if support == "union" else top_m)
    assert bwd_args[6].shape == (3, k)
    torch.library.opcheck(fwd, fwd_args)
    torch.library.opcheck(bwd, bwd_args)
    if backend == "cpu":
        torch.library.opcheck(bwd, (*bwd_args[:-2], False, True))


@requires_triton
@pytest.mark.parametrize(("top_m", "divergence"), [(4, "reverse"), (None, "forward")])
def test_triton_backend_matches_reference(top_m, divergence):
    """The Triton custom ops through the public API (the launchers' own tests are in
    test_topk_tail_kl_triton.py); tiny shapes for the interpreter."""
    s, t, target = make_inputs(
        3, 40, s_dtype=torch.bfloat16, t_dtype=torch.float32, ignore_rows=(0,), pad=3
    )
    s, t, target = s.to(TRITON_DEVICE), t.to(TRITON_DEVICE), target.to(TRITON_DEVICE)
    check_against_reference(
        s, t, target, "triton", top_m=top_m, temperature=1.3, divergence=divergence
    )


@requires_cpp
def test_torch_compile_fullgraph():
    s, t, target = make_inputs(6, 64, ignore_rows=(2,), seed=7)

    def loss_fn(s_, t_, a_):
        out = lk.topk_tail_kl(s_, t_, a_, top_m=8, temperature=0.9)
        return (
            out.kl.mean()
            - 0.1 * (out.privilege * out.teacher_logprob).mean()
            + out.student_logprob.sum()
        )

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (loss_fn, compiled):
        s_ = s.clone().requires_grad_(True)
        t_ = t.clone().requires_grad_(True)
        loss = fn(s_, t_, target)
        loss.backward()
        results.append((loss.detach(), s_.grad, t_.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)


# --------------------------------------------------------------------------------- bad input


BAD_INPUTS = [
    # (description, kwargs override, expected exception, message fragment)
    ("vocab mismatch", {"t": torch.zeros(3, 9)}, ValueError, "teacher_logits"),
    ("shape mismatch", {"t": torch.zeros(4, 10)}, ValueError, "teacher_logits"),
    ("integer logits", {"s": torch.zeros(3, 10, dtype=torch.int64)}, TypeError, "student_logits"),
    ("target shape", {"target": torch.zeros(4, dtype=torch.int64)}, ValueError, "target_ids"),
    ("float target", {"target": torch.zeros(3)}, TypeError, "target_ids"),
    ("target >= V", {"target": torch.tensor([0, 10, 1])}, (ValueError, RuntimeError), "target_ids"),
    (
        "negative target",
        {"target": torch.tensor([0, -5, 1])},
        (ValueError, RuntimeError),
        "target_ids",
    ),
    ("top_m = 0", {"top_m": 0}, ValueError, "top_m"),
    ("top_m float", {"top_m": 2.5}, ValueError, "top_m"),
    ("temperature 0", {"temperature": 0.0}, ValueError, "temperature"),
    ("temperature < 0", {"temperature": -1.0}, ValueError, "temperature"),
    ("divergence", {"divergence": "js"}, ValueError, "divergence"),
    ("backend", {"backend": "tpu"}, ValueError, "backend"),
    (
        "meta target",
        {"target": torch.zeros(3, dtype=torch.int64, device="meta")},
        ValueError,
        "target_ids",
    ),
    ("meta teacher", {"t": torch.zeros(3, 10, device="meta")}, ValueError, "teacher_logits"),
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=requires_cpp)])
@pytest.mark.parametrize(
    ("desc", "override", "exc", "fragment"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_names_argument(backend, desc, override, exc, fragment):
    args = {"s": torch.zeros(3, 10), "t": torch.zeros(3, 10), "target": torch.tensor([0, 1, 2])}
    kw = {"top_m": 4, "temperature": 1.0, "divergence": "reverse", "backend": backend}
    for k, v in override.items():
        (args if k in args else kw)[k] = v
    with pytest.raises(exc, match=fragment):
        lk.topk_tail_kl(args["s"], args["t"], args["target"], **kw)


@requires_cpp
def test_backend_errors():
    s, t, target = make_inputs(2, 10)
    with pytest.raises(TypeError, match="float64"):
        lk.topk_tail_kl(s.double(), t, target, backend="cpu")
    with pytest.raises(ValueError, match="target_ids"):  # TORCH_CHECK_VALUE, as every backend
        torch.ops.lopd.topk_tail_kl_cpu_fwd(
            s, t, torch.tensor([0, 99]), 3, 1.0, "reverse", 1.0, "teacher", -100
        )
    with pytest.raises(RuntimeError, match="top_m"):
        torch.ops.lopd.topk_tail_kl_cpu_fwd(s, t, target, 10, 1.0, "reverse", 1.0, "teacher", -100)
    with pytest.raises(RuntimeError, match="temperature"):
        torch.ops.lopd.topk_tail_kl_cpu_fwd(s, t, target, 3, 0.0, "reverse", 1.0, "teacher", -100)
    with pytest.raises(ValueError, match="reduction"):
        lk.TopKTailKL(reduction="avg")
    with pytest.raises(RuntimeError, match="backend='cuda' needs CUDA tensors"):
        lk.topk_tail_kl(s, t, target, backend="cuda")
    meta = [x.to("meta") for x in (s, t, target)]
    with pytest.raises(RuntimeError, match="backend='cpu' needs CPU tensors"):
        lk.topk_tail_kl(*meta, backend="cpu")
    # float64 on "auto" goes to the reference, not to an error.
    out = lk.topk_tail_kl(s.double(), t.double(), target)
    assert out.kl.dtype == torch.float64


@requires_cpp
@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_cpu_fast_exp_accuracy(monkeypatch, isa):
    """The CPU kernels' vectorized exp (csrc/cpu/vec_exp.h) on each instruction set: within
    2 ULP of float64 exp of the same float32 input over the normal range, and the special values
    every kernel relies on (exp(-inf) = 0 for masked logits, NaN stays NaN)."""
    from lopd_kernels import _C

    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    g = torch.Generator().manual_seed(21)
    x = torch.cat([torch.rand(20000, generator=g) * 174 - 87, torch.randn(20000, generator=g)])
    got = torch.tensor(_C._cpu_exp(x.tolist()), dtype=torch.float64)
    want = x.double().exp()
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 24)
    assert float(((got - want).abs() / ulp).max()) <= 2.0, _C.cpu_isa()
    special = _C._cpu_exp([float("-inf"), 0.0, float("nan"), -200.0, 200.0])
    assert special[0] == 0.0 and special[1] == 1.0 and math.isnan(special[2])
    assert 0.0 <= special[3] < 1.2e-38 and special[4] >= 3.4e38


@requires_cpp
@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_cpu_fast_exp2_accuracy(monkeypatch, isa):
    """The CPU kernels' vectorized 2^x (csrc/cpu/vec_exp.h, the forward's tail sums): within
    2 ULP of float64 2^x of the same float32 input over the normal range, and the special values
    the forward relies on (2^-inf = 0 for masked logits, NaN stays NaN, 0 below the range)."""
    from lopd_kernels import _C

    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    g = torch.Generator().manual_seed(22)
    x = torch.cat([torch.rand(20000, generator=g) * 250 - 125, torch.randn(20000, generator=g)])
    got = torch.tensor(_C._cpu_exp2(x.tolist()), dtype=torch.float64)
    want = torch.exp2(x.double())
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 24)
    assert float(((got - want).abs() / ulp).max()) <= 2.0, _C.cpu_isa()
    special = _C._cpu_exp2([float("-inf"), 0.0, float("nan"), -300.0, 300.0, 1.0, -1.0])
    assert special[0] == 0.0 and special[1] == 1.0 and math.isnan(special[2])
    assert 0.0 <= special[3] < 1.2e-38 and special[4] >= 3.4e38
    assert special[5] == 2.0 and special[6] == 0.5


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=requires_cpp)])
def test_empty_batch(backend):
    """No rows: empty outputs and gradients, never an error (every top-M op)."""
    s = torch.randn(0, 10, requires_grad=True)
    t = torch.randn(0, 10, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long)
    out = lk.topk_tail_kl(s, t, target, top_m=3, backend=backend)
    assert out.kl.shape == (0,) and out.topk_ids.shape == (0, 3)
    (out.kl.sum() + out.privilege.sum()).backward()
    assert s.grad.shape == (0, 10) and t.grad.shape == (0, 10)
    lp, ids = torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.long)
    sparse = lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend=backend)
    assert sparse.kl.shape == (0,)
