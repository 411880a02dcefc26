"""topk_tail_kl's CUDA kernels (csrc/cuda/topk_tail_kl_kernels.cuh, and the base-2 forward
csrc/cuda/topk_tail_kl_kernels_base2.cuh: every test runs once per forward of the kernel slot
topk_tail_kl.cuda_forward) against the float64 reference: the same checks as the other backends
(all outputs, both gradients under random upstream gradients), on two targets:

- ``cuda``: the real kernels on a GPU (where the extension was built with CUDA; elsewhere these
  skip with the reason). benchmarks/gpu_all.sh runs them, also under compute-sanitizer memcheck
  with LOPD_TEST_SMALL=1;
- ``emulated``: the same kernel source compiled by g++ and run on CPU tensors by the SIMT
  emulator (csrc/emu/, tests/kernels/simt_emu.py), on every machine with a C++ compiler. It checks
  the kernels' indexing, arithmetic, and barrier / warp-collective structure (a divergent
  ``__syncthreads`` fails the test with the source lines), not their speed or memory model.
"""

from __future__ import annotations

import os

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.kernel_variants import SLOTS, selected, selecting
from lopd_kernels.topk_tail_kl import TopKTailKLOutput, topk_tail_kl_reference
from tests.kernels import simt_emu
from tests.kernels.utils import assert_grad_close, copies, make_inputs, random_upstream, run
from tests.utils import assert_close

FWD_SLOT = "topk_tail_kl.cuda_forward"

EMU_UNAVAILABLE = simt_emu.unavailable_reason()
SMALL = os.environ.get("LOPD_TEST_SMALL") == "1"


def cuda_op(s, t, target, **kw):
    """The CUDA backend on copies of CPU leaves; outputs back on the CPU (autograd crosses)."""
    out = lk.topk_tail_kl(s.cuda(), t.cuda(), target.cuda(), backend="cuda", **kw)
    return TopKTailKLOutput(*(o.cpu() for o in out))


@pytest.fixture(autouse=True, params=SLOTS[FWD_SLOT].choices)
def fwd_variant(request):
    """Runs every test once per CUDA forward kernel (lopd_kernels/kernel_variants.py), selected
    by the process setting the C++ launcher reads at every call."""
    with selecting(FWD_SLOT, request.param):
        yield request.param


@pytest.fixture(params=simt_emu.cuda_targets("topk_tail_kl_cuda_fwd"))
def target(request):
    """Where the CUDA kernels run: ``"cuda"`` (a GPU) or ``"emulated"`` (SIMT emulator, CPU)."""
    return simt_emu.prepare_target(request.param)


def op_for(where: str):
    return cuda_op if where == "cuda" else simt_emu.topk_tail_kl_emulated


def check(where, s, t, target_ids, **kw):
    up = random_upstream(target_ids.numel())
    out, gs, gt = run(op_for(where), s, t, target_ids, up, **kw)
    ref, rgs, rgt = run(topk_tail_kl_reference, s.double(), t.double(), target_ids, up, **kw)
    for name in ("kl", "privilege", "student_logprob", "teacher_logprob"):
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, f"{where} {name}")
    assert torch.equal(out.topk_ids, ref.topk_ids), f"{where} topk_ids"
    assert_close(out.teacher_topk_mass, ref.teacher_topk_mass, torch.float32, f"{where} mass")
    assert_grad_close(gs, rgs, s.dtype, f"{where} grad student")
    assert_grad_close(gt, rgt, t.dtype, f"{where} grad teacher")


# (N, V, M). The kernel's tile is 2,048 entries per block step and its candidate buffer
# compacts at ~4k keys, so V = 5003 and 32000 cover several tiles and several compactions;
# M = 1000 and 1024 sit at the 1024 limit of the selection buffer.
SHAPES = [(1, 1, 1), (3, 7, 1), (3, 97, 20), (17, 1000, 64), (5, 5003, 20), (4, 32000, 1000)]
SHAPES += [(2, 9001, 1024)]  # M at the kernel's limit (kMaxTopM)
SHAPES += [(2, 2048, 20), (2, 6144, 20)]  # one / three whole tiles, no partial tile
LARGE_SHAPES = [(257, 1000, 20), (2, 151936, 20)]


@pytest.mark.parametrize(("n", "v", "m"), SHAPES + ([] if SMALL else LARGE_SHAPES))
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_matches_reference(target, n, v, m, divergence):
    s, t, tgt = make_inputs(n, v, seed=n + v)
    check(target, s, t, tgt, top_m=m if m < v else None, divergence=divergence, temperature=0.7)


@pytest.mark.parametrize("v", [7, 1000] + ([] if SMALL else [151936]))
def test_full_vocabulary(target, v):
    s, t, tgt = make_inputs(3, v, seed=v)
    check(target, s, t, tgt, top_m=None, divergence="forward")


@pytest.mark.parametrize(
    ("s_dtype", "t_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_dtypes(target, s_dtype, t_dtype):
    s, t, tgt = make_inputs(5, 4096, s_dtype=s_dtype, t_dtype=t_dtype, seed=3)
    check(target, s, t, tgt, top_m=20)


def test_unaligned_rows(target):
    # V % 8 != 0 and a storage offset: the kernels fall back from 16-byte vector loads.
    s, t, tgt = make_inputs(3, 2 * 2048 + 13, seed=11)
    check(target, s[:, 1:], t[:, 1:], torch.clamp(tgt, max=2 * 2048 + 11), top_m=33)


@pytest.mark.parametrize("v", [64, 61], ids=["aligned", "unaligned"])
def test_causal_view_rows_in_place(target, v):
    """``logits[:, :-1]`` of ``[B, T, V]`` buffers (rows of stride V, items of stride T * V; no
    ``[N, V]`` view exists) are read in place, with the results and gradients of the contiguous
    copy and the reference's (V = 61 and 64: rows that do not and do allow 16-byte vector
    loads)."""
    g = torch.Generator().manual_seed(v)
    s_base = torch.randn(2, 5, v, generator=g).requires_grad_(True)
    t_base = torch.randn(2, 5, v, generator=g).requires_grad_(True)
    tgt = torch.randint(0, v, (2, 4), generator=g)
    tgt[0, 1] = -100
    up = [u.reshape(tgt.shape) for u in random_upstream(tgt.numel())]
    s_copy = s_base[:, :-1].detach().contiguous().requires_grad_(True)
    t_copy = t_base[:, :-1].detach().contiguous().requires_grad_(True)
    out = op_for(target)(s_base[:, :-1], t_base[:, :-1], tgt, top_m=8)
    copy = op_for(target)(s_copy, t_copy, tgt, top_m=8)
    for o in (out, copy):
        sum((x.double() * u).sum() for x, u in zip(o[:4], up)).backward()
    for name in ("kl", "student_logprob", "teacher_logprob", "topk_ids"):
        assert torch.equal(getattr(out, name), getattr(copy, name)), name
    assert torch.equal(s_base.grad[:, :-1], s_copy.grad)
    assert torch.equal(t_base.grad[:, :-1], t_copy.grad)
    assert not s_base.grad[:, -1].any()
    ref = topk_tail_kl_reference(s_base[:, :-1].double(), t_base[:, :-1].double(), tgt, top_m=8)
    assert_close(out.kl, ref.kl, torch.float32, f"{target} kl")


def raw_ops(where: str):
    """(forward, backward, device) of the CUDA custom ops: the real ones or the emulated ones."""
    if where == "cuda":
        return torch.ops.lopd.topk_tail_kl_cuda_fwd, torch.ops.lopd.topk_tail_kl_cuda_bwd, "cuda"
    simt_emu.load()
    ops = torch.ops.lopd_simt_emu
    return ops.topk_tail_kl_cuda_fwd, ops.topk_tail_kl_cuda_bwd, "cpu"


@pytest.mark.parametrize("v", [64, 61], ids=["aligned", "unaligned"])
def test_strided_logits_are_not_copied(target, v):
    """The ops take row-strided logits (a causal view, a row slice of a wider buffer) as they
    are: no copy of the logits' size in forward or backward (the CPU ops' check, in
    tests/kernels/test_topk_tail_kl_strided.py), and dense gradients in the logits' shape."""
    fwd, bwd, dev = raw_ops(target)
    g = torch.Generator().manual_seed(v)
    s_base, t_base = (torch.randn(2, 5, v, generator=g).to(dev) for _ in range(2))
    wide = torch.randn(8, 2 * v, generator=g).to(dev)
    for s, t in ((s_base[:, :-1], t_base[:, 1:]), (wide[:, :v], wide[:, v:])):
        assert not s.is_contiguous() and not t.is_contiguous()
        n = s.numel() // v
        tgt = torch.randint(0, v, (n,), generator=g).to(dev)
        out = fwd(s, t, tgt, 8, 1.0, "reverse", 1.0, "teacher", -100)
        assert (
            copies(
                lambda s=s, t=t, tgt=tgt: fwd(s, t, tgt, 8, 1.0, "reverse", 1.0, "teacher", -100),
                n * v,
            )
            == []
        )
        kl, _slp, _tlp, ids, lse, bucket = out
        ones = torch.ones_like(kl)
        args = (
            ones,
            ones,
            ones,
            s,
            t,
            tgt,
            ids,
            kl,
            lse,
            bucket,
            1.0,
            "reverse",
            1.0,
            -100,
            True,
            True,
        )
        assert copies(lambda args=args: bwd(*args), n * v) == []
        gs, gt = bwd(*args)
        assert gs.shape == s.shape and gs.is_contiguous() and gt.is_contiguous()
        dense = fwd(s.contiguous(), t.contiguous(), tgt, 8, 1.0, "reverse", 1.0, "teacher", -100)
        for a, b in zip(out, dense):
            assert torch.equal(a, b)


def test_ignored_and_padded_rows(target):
    s, t, tgt = make_inputs(6, 1003, seed=5, pad=40, ignore_rows=(0, 3))
    check(target, s, t, tgt, top_m=20)
    s, t, tgt = make_inputs(4, 64, seed=6, ignore_rows=(0, 1, 2, 3))
    out = op_for(target)(s, t, tgt, top_m=8)
    assert not torch.isnan(out.kl).any() and (out.kl == 0).all()


def test_sorted_adversarial_row(target):
    # Ascending teacher logits: every tile beats the running threshold (the slow, rare path).
    v = 20000
    t = torch.linspace(-5, 5, v).repeat(2, 1)
    s = t.flip(-1) * 0.5
    tgt = torch.tensor([3, v - 2])
    check(target, s, t, tgt, top_m=64)


def test_ties_select_lower_ids(target):
    # Equal teacher logits: the selection breaks ties to the lower vocabulary id, as the
    # reference does.
    t = torch.zeros(2, 300)
    t[:, 100:140] = 1.0
    s = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    tgt = torch.tensor([120, 5])
    check(target, s, t, tgt, top_m=25)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_threshold_edges(target, temperature):
    """The admission test's edges (v2 compares raw logits against a threshold lowered by a
    margin, then the exact 64-bit key): tiny and denormal teacher logits of both signs and
    signed zeros (a scaled product may underflow to -0), an all-negative row, and hundreds of
    entries tied with the M-th value (ties go to the lower id). Temperatures whose scaling is
    exact, so the float64 reference orders the entries as float32 does."""
    g = torch.Generator().manual_seed(5)
    v, m = 6000, 24
    t = torch.randn(3, v, generator=g)
    tiny = torch.tensor([-1e-40, 0.0, 1e-40, -0.0, 1e-45, -1e-45, 2e-38, -2e-38])
    t[0] = tiny[torch.randint(0, len(tiny), (v,), generator=g)]
    t[0, 4000:4010] = torch.tensor(
        [3e-39, 3e-39, 5e-39, 1e-38, 4e-39, 6e-39, 7e-39, 8e-39, 9e-39, 2e-39]
    )
    t[1] = -5.0 - torch.rand(v, generator=g)
    t[2] = torch.where(
        torch.rand(v, generator=g) < 0.1, torch.tensor(1.5), torch.randn(v, generator=g)
    )
    s = torch.randn(3, v, generator=g)
    tgt = torch.tensor([4003, 17, 5999])
    check(target, s, t, tgt, top_m=m, temperature=temperature)


def test_fwd_choice_is_read_by_the_launcher(target, fwd_variant):
    """The C++ launcher reads the process setting at every call (lopd_kernels/kernel_variants.py
    passes it to the op library); the library refuses a name or value it does not know."""
    slot = SLOTS[FWD_SLOT]
    fwd, _bwd, dev = raw_ops(target)
    s, t, tgt = (x.to(dev) for x in make_inputs(4, 5000, seed=9))
    runs = {}
    for value in slot.choices:
        with selecting(FWD_SLOT, value):
            outs = fwd(s, t, tgt, 20, 1.4, "reverse", 1.0, "teacher", -100)
            runs[value] = torch.cat([x.flatten().float() for x in outs])
    assert not torch.equal(runs["natural_exp"], runs["base2"])  # the two round differently
    assert selected(FWD_SLOT) == fwd_variant  # restored after each block
    assert slot.default == "base2"
    setter = (torch.ops.lopd if target == "cuda" else torch.ops.lopd_simt_emu).set_kernel_choice
    with pytest.raises(ValueError, match=r"topk_tail_kl\.cuda_forward must be 'natural_exp' or"):
        setter(FWD_SLOT, "v3")
    with pytest.raises(ValueError, match="no compiled kernel choice named 'cuda_fwd'"):
        setter("cuda_fwd", "base2")


def test_infinite_divergence_is_inf_not_nan(target):
    """Forward KL with a student that is -inf outside the teacher's top-M, whose tail holds
    ~e^-390 of its mass (exp underflows): +inf, not 0 * inf = NaN
    (tests/kernels/test_topk_tail_kl.py has the same check for the other backends)."""
    s, t, tgt = make_inputs(2, 3000, seed=41)
    t[:, :16] += 400.0
    s[:, 16:] = -float("inf")
    out = op_for(target)(s, t, tgt, top_m=16, divergence="forward")
    assert torch.all(out.kl == float("inf")), out.kl


# ---------------------------------------------------------------------------- support / JSD
# The whole option matrix (support x divergence x dtype, strided rows, masked rows, -inf) runs in
# tests/kernels/test_topk_tail_kl_options.py on one tile of the default forward; these run what
# differs per option in BOTH forward kernels (the autouse switch fixture): the student's selection
# and the union's two selections over several tiles and compactions, M at the kernel's limit (a
# union of 2 x 1024 ids), adversarial and tied rows, a union that covers the vocabulary, and the
# full-vocabulary JSD's two passes over several tiles.

OPTIONS = [("student", "reverse", None), ("student", "jsd", 0.3), ("union", "forward", None),
           ("union", "jsd", 0.7)]  # fmt: skip


@pytest.mark.parametrize(("n", "v", "m"), [(3, 97, 1), (5, 5003, 20), (2, 4500, 600)])
@pytest.mark.parametrize(("support", "divergence", "beta"), OPTIONS)
def test_options_match_reference(target, n, v, m, support, divergence, beta):
    s, t, tgt = make_inputs(n, v, seed=n + v + 1, pad=3)
    kw = {"support": support, "divergence": divergence, "beta": beta, "temperature": 0.7}
    check(target, s, t, tgt, top_m=m, **kw)


@pytest.mark.parametrize("support", ["student", "union"])
def test_options_sorted_adversarial_rows(target, support):
    """Rows where every tile beats a running threshold: the teacher's selection at the end of
    the row with the student's at its start (a union of 2M ids), and both at the end (every
    tile compacts both buffers; the union is the teacher's M, then -1 padding)."""
    v = 9000
    t = torch.linspace(-5, 5, v).repeat(2, 1)
    s = torch.stack([t[0].flip(-1) * 0.5, t[1] * 0.7])
    check(target, s, t, torch.tensor([3, v - 2]), top_m=64, support=support)


def test_union_at_the_limits(target):
    """M = 1024 (the kernel's limit: 2 x 1024 slots) at V = 2048; a union covering the whole
    vocabulary (an empty tail, -inf on both sides) at V = 7."""
    s, t, tgt = make_inputs(2, 2048, seed=3)
    check(target, s, t, tgt, top_m=1024, support="union", divergence="jsd", beta=0.5)
    t = torch.arange(7.0).repeat(3, 1)
    s = -t + torch.tensor([[0.0], [0.5], [1.0]])
    out = op_for(target)(s, t, torch.tensor([0, 6, 3]), top_m=5, support="union")
    assert (out.support_size == 7).all()
    check(target, s, t, torch.tensor([0, 6, 3]), top_m=5, support="union")


@pytest.mark.parametrize("support", ["student", "union"])
def test_options_ties_select_lower_ids(target, support):
    """Exact ties in both rows, overlapping: each selection breaks them to the lower id, and an
    id in both appears once, at its teacher position."""
    t = torch.zeros(2, 300)
    t[:, 100:140] = 1.0
    s = torch.zeros(2, 300)
    s[:, 120:170] = 2.0
    check(target, s, t, torch.tensor([120, 5]), top_m=25, support=support, divergence="jsd",
          beta=0.5)  # fmt: skip


@pytest.mark.parametrize("support", ["student", "union"])
def test_options_threshold_edges(target, support):
    """test_threshold_edges with the tiny, denormal and tied logits in the student's row (the
    row the student's selection and the union's second one are built from)."""
    g = torch.Generator().manual_seed(6)
    v = 6000
    s = torch.randn(3, v, generator=g)
    tiny = torch.tensor([-1e-40, 0.0, 1e-40, -0.0, 1e-45, -1e-45, 2e-38, -2e-38])
    s[0] = tiny[torch.randint(0, len(tiny), (v,), generator=g)]
    s[1] = -5.0 - torch.rand(v, generator=g)
    s[2] = torch.where(
        torch.rand(v, generator=g) < 0.1, torch.tensor(1.5), torch.randn(v, generator=g)
    )
    t = torch.randn(3, v, generator=g)
    check(target, s, t, torch.tensor([4003, 17, 5999]), top_m=24, support=support,
          temperature=0.5)  # fmt: skip


@pytest.mark.parametrize("beta", [0.25, 0.9])
def test_full_vocabulary_jsd(target, beta):
    """top_m=None with the JSD: both log-sum-exps, then the terms, over several tiles."""
    s, t, tgt = make_inputs(3, 5003, seed=7, pad=11, ignore_rows=(1,))
    s[2, :100] = -float("inf")
    check(target, s, t, tgt, top_m=None, divergence="jsd", beta=beta, temperature=1.3)


@pytest.mark.parametrize(
    ("top_m", "support", "divergence", "beta"),
    [(5, "union", "jsd", 0.3), (5, "student", "forward", 0.0), (0, "teacher", "jsd", 0.6)],
)
def test_opcheck_options(target, top_m, support, divergence, beta):
    fwd, bwd, dev = raw_ops(target)
    s, t, tgt = (x.to(dev) for x in make_inputs(3, 37, ignore_rows=(1,), pad=2, seed=9))
    fwd_args = (s, t, tgt, top_m, 0.9, divergence, beta, support, -100)
    kl, _slp, _tlp, ids, lse, bucket = fwd(*fwd_args)
    assert ids.shape == (3, 2 * top_m if support == "union" else top_m)
    g = [u.float().to(dev) for u in random_upstream(3)]
    bwd_args = (*g[:3], s, t, tgt, ids, kl, lse, bucket, 0.9, divergence, beta, -100, True, True)
    torch.library.opcheck(fwd, fwd_args)
    torch.library.opcheck(bwd, bwd_args)


@pytest.mark.skipif(EMU_UNAVAILABLE is not None, reason=str(EMU_UNAVAILABLE))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_emulated_random_schedules(seed):
    """The kernels give the reference's results whatever order the emulated threads resume in
    at each barrier and atomic (a seeded random schedule instead of round-robin)."""
    simt_emu.load()
    simt_emu.set_schedule_seed(seed)
    try:
        for n, v, m, support in [(3, 97, 1, "teacher"), (2, 5003, 20, "teacher"),
                                 (2, 4500, 600, "teacher"), (2, 5003, 20, "union"),
                                 (2, 3000, 200, "student")]:  # fmt: skip
            s, t, tgt = make_inputs(n, v, seed=seed + v)
            check("emulated", s, t, tgt, top_m=m, support=support)
    finally:
        simt_emu.set_schedule_seed(0)


@pytest.mark.skipif(EMU_UNAVAILABLE is not None, reason=str(EMU_UNAVAILABLE))
def test_emulated_rejects_bad_input_like_the_cuda_op():
    simt_emu.load()
    s, t, tgt = make_inputs(2, 50, seed=0)
    with pytest.raises(RuntimeError, match="top_m must be <= 1024"):
        torch.ops.lopd_simt_emu.topk_tail_kl_cuda_fwd(
            torch.zeros(1, 3000),
            torch.zeros(1, 3000),
            tgt[:1],
            1025,
            1.0,
            "reverse",
            1.0,
            "teacher",
            -100,
        )
    with pytest.raises(RuntimeError, match="same shape"):
        torch.ops.lopd_simt_emu.topk_tail_kl_cuda_fwd(
            s, t[:, :49], tgt, 5, 1.0, "reverse", 1.0, "teacher", -100
        )
