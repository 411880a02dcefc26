"""Triton kernels of ``topk_tail_kl`` against a float64 PyTorch oracle.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py) on CPU tensors,
with small ``block_v`` so that a few hundred vocabulary entries already span several blocks and
the running top-M is exercised across block boundaries. Cases needing a GPU skip with a reason.

The launchers are checked against ``_oracle``: autograd through float64 PyTorch on the same
(already rounded) inputs, whose bucket masses are direct float64 sums of softmax probabilities
(so the tail is exact there too). It also yields the saved tensors ``lse`` and ``bucket_logp``,
which the library's ``topk_tail_kl_reference`` does not expose; the public API
(``lk.topk_tail_kl(..., backend="triton")``, custom op + autograd) is checked against that
reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.triton_compile import assert_script_compiles
from tests.utils import TRITON_DEVICE, assert_close, requires_cuda, requires_triton

triton = pytest.importorskip("triton", reason="the triton backend needs the triton package")

from lopd_kernels._constants import TRITON_TOPK_MAX_TOP_M as MAX_TOP_M  # noqa: E402
from lopd_kernels.kernel_variants import SLOTS, selected, selecting  # noqa: E402
from lopd_kernels.triton.topk_tail_kl import (  # noqa: E402
    FWD_SLOT,
    topk_tail_kl_bwd_triton,
    topk_tail_kl_fwd_triton,
)

IGNORE = -100


def kl_args(reverse: bool) -> tuple[str, float, str]:
    """The forward launcher's ``(divergence, beta, support)`` of one of the two KLs over the
    teacher's top-M."""
    return ("reverse", 1.0, "teacher") if reverse else ("forward", 0.0, "teacher")


pytestmark = [
    requires_triton,
    # The interpreter evaluates masked-off lanes too (-inf - -inf there); numpy warns, the
    # kernels discard those lanes.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

DEVICE = TRITON_DEVICE


@pytest.fixture(params=SLOTS[FWD_SLOT].choices)
def fwd_variant(request):
    """Runs a test once per top-M forward kernel (lopd_kernels/kernel_variants.py), selected
    by the process setting as a user would."""
    with selecting(FWD_SLOT, request.param):
        yield request.param


# ------------------------------------------------------------------------------------------
# Oracle and helpers
# ------------------------------------------------------------------------------------------


def _kl_terms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``exp(a) * (a - b)`` per bucket, 0 where the mass is 0, NaN-free under autograd."""
    p = a.exp()
    live = p > 0
    a_safe = torch.where(live, a, torch.zeros_like(a))
    b_safe = torch.where(live, b, torch.zeros_like(b))
    return torch.where(live, p * (a_safe - b_safe), torch.zeros_like(p))


def _safe_log(x: torch.Tensor) -> torch.Tensor:
    pos = x > 0
    return torch.where(pos, torch.where(pos, x, torch.ones_like(x)).log(), -torch.inf)


def _oracle(s, t, target, top_m, temperature, reverse):
    """float64 reference: ``(kl, student_logprob, teacher_logprob, topk_ids, lse, bucket_logp)``.

    ``s``, ``t``: float64 [N, V] (leaves, possibly requiring grad). ``top_m == 0``: full KL.
    """
    n = s.shape[0]
    ls = torch.log_softmax(s / temperature, -1)
    lt = torch.log_softmax(t / temperature, -1)
    if top_m == 0:
        ids = torch.zeros(n, 0, dtype=torch.int64, device=s.device)
        lp, lq = ls, lt
        blp = torch.zeros(n, 2, 1, dtype=torch.float64, device=s.device)
    else:
        ids = torch.topk(t.detach(), top_m, dim=-1).indices
        in_top = torch.zeros_like(s, dtype=torch.bool).scatter_(1, ids, True)
        p_tail = torch.where(in_top, 0.0, ls.exp()).sum(-1, keepdim=True)
        q_tail = torch.where(in_top, 0.0, lt.exp()).sum(-1, keepdim=True)
        lp = torch.cat([ls.gather(1, ids), _safe_log(p_tail)], 1)
        lq = torch.cat([lt.gather(1, ids), _safe_log(q_tail)], 1)
        blp = torch.stack([lp, lq], 1)
    kl = _kl_terms(lp, lq).sum(-1) if reverse else _kl_terms(lq, lp).sum(-1)
    keep = target != IGNORE
    tgt = torch.where(keep, target, 0)[:, None]
    zero = torch.zeros((), dtype=torch.float64, device=s.device)
    slp = torch.where(keep, ls.gather(1, tgt)[:, 0], zero)
    tlp = torch.where(keep, lt.gather(1, tgt)[:, 0], zero)
    kl = torch.where(keep, kl, zero)
    lse = torch.stack([(s / temperature).logsumexp(-1), (t / temperature).logsumexp(-1)], 1)
    return kl, slp, tlp, ids, lse.detach(), blp.detach()


def _distinct_logits(n: int, v: int, dtype: torch.dtype, scale: float, gen) -> torch.Tensor:
    """[n, v] logits with pairwise distinct values in each row (no top-M ties in ``dtype``)."""
    if dtype == torch.float32:
        return (torch.randn(n, v, generator=gen) * scale).to(dtype)
    # Every finite value of the 16-bit dtype in [-4 scale, 4 scale]; each row draws v of them.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    pool = bits.view(dtype).float()
    pool = pool[torch.isfinite(pool) & (pool.abs() <= 4 * scale) & (pool != 0)].unique()
    assert pool.numel() >= v, "not enough distinct values for this vocabulary size"
    rows = [pool[torch.randperm(pool.numel(), generator=gen)[:v]] for _ in range(n)]
    return torch.stack(rows).to(dtype)


def _run_and_check(
    s,
    t,
    target,
    top_m,
    temperature,
    reverse,
    block_v,
    *,
    compare_ids=True,
    grads=(True, True),
    bulk_min=None,
):
    """Run forward + backward of the Triton launchers and compare everything with the oracle."""
    n, _ = s.shape
    gen = torch.Generator().manual_seed(1234)
    # Random upstream gradients on every output (the teacher's includes the privilege's).
    u_kl, u_ls, u_lt = (torch.randn(n, generator=gen).to(s.device) for _ in range(3))

    # Small blocks and 4 warps for the interpreter; None: the launchers' GPU defaults.
    warps = None if block_v is None else 4
    out = topk_tail_kl_fwd_triton(
        s, t, target, top_m, temperature, *kl_args(reverse), IGNORE,
        block_v=block_v, num_warps=warps, bulk_min=bulk_min,
    )  # fmt: skip
    kl, slp, tlp, ids, lse, blp = out
    s64 = s.detach().double().requires_grad_(grads[0])
    t64 = t.detach().double().requires_grad_(grads[1])
    r_kl, r_slp, r_tlp, r_ids, r_lse, r_blp = _oracle(s64, t64, target, top_m, temperature, reverse)

    # Forward outputs are float32 whatever the inputs: compare at float32 tolerance.
    f32 = torch.float32
    assert kl.dtype == slp.dtype == tlp.dtype == lse.dtype == blp.dtype == f32
    assert ids.dtype == torch.int64 and ids.shape == (n, top_m)
    assert blp.shape == (n, 2, top_m + 1) and lse.shape == (n, 2)
    assert_close(kl, r_kl, f32, "kl")
    assert_close(slp, r_slp, f32, "student_logprob")
    assert_close(tlp, r_tlp, f32, "teacher_logprob")
    keep = target != IGNORE
    assert_close(lse[keep], r_lse[keep], f32, "lse")
    finite = torch.isfinite(r_blp[keep])
    assert torch.equal(torch.isfinite(blp[keep]), finite), "bucket_logp: -inf pattern"
    assert_close(blp[keep][finite], r_blp[keep][finite], f32, "bucket_logp")
    if compare_ids:
        assert torch.equal(ids[keep], r_ids[keep]), "topk_ids"
    ignored = ~keep
    for name, x in (("kl", kl), ("slp", slp), ("tlp", tlp), ("lse", lse), ("blp", blp)):
        assert not x[ignored].any(), f"{name}: ignored rows must be 0"
    assert not ids[ignored].any(), "topk_ids: ignored rows must be 0"

    if not any(grads):
        return
    loss = (u_kl.double() * r_kl + u_ls.double() * r_slp + u_lt.double() * r_tlp).sum()
    loss.backward()
    gs, gt = topk_tail_kl_bwd_triton(
        u_kl, u_ls, u_lt, s, t, target, ids, kl, lse, blp,
        temperature, *kl_args(reverse)[:2], IGNORE, grads[0], grads[1], block_v=block_v,
        num_warps=warps,
    )  # fmt: skip
    for side, (g, x, x64) in enumerate(((gs, s, s64), (gt, t, t64))):
        name = ("grad_student", "grad_teacher")[side]
        if grads[side]:
            assert g.dtype == x.dtype and g.shape == x.shape, name
            assert_close(g, x64.grad, x.dtype, name)
        else:
            assert g.shape == (0,), f"{name}: a side without grad returns an empty tensor"


# ------------------------------------------------------------------------------------------
# Correctness against the oracle
# ------------------------------------------------------------------------------------------

# (N, V, M, temperature, reverse, student dtype, teacher dtype, block_v)
CASES = [
    pytest.param(3, 97, 20, 0.7, True, torch.float32, torch.float32, 32, id="V97-M20-rev"),
    pytest.param(3, 97, 20, 1.3, False, torch.float32, torch.float32, 32, id="V97-M20-fwd"),
    pytest.param(17, 7, 1, 1.0, True, torch.float32, torch.float32, 16, id="N17-V7-M1"),
    pytest.param(1, 1, 1, 1.0, True, torch.float32, torch.float32, 16, id="V1-M1-no-tail"),
    pytest.param(1, 1, 0, 2.0, False, torch.float32, torch.float32, 16, id="V1-full"),
    pytest.param(3, 97, 97, 0.9, False, torch.float32, torch.float32, 32, id="V97-M=V"),
    pytest.param(3, 97, 0, 0.7, True, torch.float32, torch.float32, 32, id="V97-full-rev"),
    pytest.param(3, 1000, 0, 1.5, False, torch.bfloat16, torch.float32, 128, id="V1000-full-fwd"),
    pytest.param(3, 1000, 64, 0.5, True, torch.float32, torch.bfloat16, 128, id="V1000-M64-mixed"),
    pytest.param(3, 1000, 20, 2.0, False, torch.bfloat16, torch.bfloat16, 128, id="V1000-bf16"),
    pytest.param(3, 1000, 20, 1.0, True, torch.float16, torch.float16, 256, id="V1000-fp16"),
    pytest.param(2, 300, MAX_TOP_M, 1.0, True, torch.float32, torch.float32, 64, id="M256"),
    pytest.param(1, 5003, 20, 0.8, True, torch.float32, torch.float32, 512, id="V5003-blocks"),
]


@pytest.mark.parametrize("n, v, m, temperature, reverse, s_dtype, t_dtype, block_v", CASES)
def test_matches_oracle(n, v, m, temperature, reverse, s_dtype, t_dtype, block_v, fwd_variant):
    if fwd_variant != "separate_reductions" and not 1 <= m <= 64:
        # top_m = 0 (the full-vocabulary kernel) and top_m > 64 (the bitonic merge) run
        # separate_reductions.
        pytest.skip(f"{fwd_variant}: the launcher runs separate_reductions for top_m={m}")
    gen = torch.Generator().manual_seed(n * 1000 + v + m)
    s = _distinct_logits(n, v, s_dtype, 3.0, gen).to(DEVICE)
    t = _distinct_logits(n, v, t_dtype, 3.0, gen).to(DEVICE)
    target = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    if n > 1:
        target[1] = IGNORE  # one ignored row among live ones
    _run_and_check(s, t, target, m, temperature, reverse, block_v)


@pytest.mark.parametrize("bulk_min", [0, -1], ids=["always-merge", "always-insert"])
@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
def test_top_m_update_paths(bulk_min, order, fwd_variant):
    """Both ways of updating the running top-M (bitonic merge, sequential inserts) alone.

    An ascending teacher makes every entry of every block a candidate that evicts earlier ones
    (the worst case of the tail bookkeeping); a descending one settles in the first block.
    """
    if fwd_variant != "separate_reductions" and bulk_min >= 0:
        pytest.skip(f"{fwd_variant} has no bitonic merge: the launcher runs separate_reductions")
    gen = torch.Generator().manual_seed(21)
    n, v = 2, 200
    s = torch.randn(n, v, generator=gen) * 2
    t = torch.randn(n, v, generator=gen) * 2
    if order != "random":
        t = t.sort(dim=-1, descending=order == "descending").values
    target = torch.tensor([7, 150])
    _run_and_check(
        s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), 20, 0.8, True, 32, bulk_min=bulk_min
    )


def test_all_ignored_rows_are_zero():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(3, 97, generator=gen).to(DEVICE)
    t = torch.randn(3, 97, generator=gen).to(DEVICE)
    target = torch.full((3,), IGNORE, dtype=torch.int64, device=DEVICE)
    for m in (20, 0):
        out = topk_tail_kl_fwd_triton(
            s, t, target, m, 0.7, *kl_args(True), IGNORE, block_v=32, num_warps=4
        )
        for x in out:
            assert not x.any(), "every output of an ignored row is 0"
        ones = torch.ones(3, device=DEVICE)
        gs, gt = topk_tail_kl_bwd_triton(
            ones, ones, ones, s, t, target, *out[3:4], out[0], out[4], out[5],
            0.7, "reverse", 1.0, IGNORE, True, True, block_v=32, num_warps=4,
        )  # fmt: skip
        assert not gs.any() and not gt.any(), "ignored rows get 0 gradient"


@pytest.mark.parametrize("reverse", [True, False], ids=["rev", "fwd"])
def test_neg_inf_logits(reverse, fwd_variant):
    """Padded vocabularies (-inf on both sides) and masked entries: no NaN anywhere."""
    gen = torch.Generator().manual_seed(7)
    n, v = 3, 200
    s = torch.randn(n, v, generator=gen) * 2
    t = torch.randn(n, v, generator=gen) * 2
    pad = torch.zeros(n, v, dtype=torch.bool)
    pad[:, 150:] = True  # padded vocabulary tail, spans whole blocks
    pad[:, ::17] = True  # scattered masked ids, inside the top-M's blocks too
    pad[2, 12:] = True  # row 2: fewer finite entries (12 - 1 masked) than M
    s, t = s.masked_fill(pad, -torch.inf), t.masked_fill(pad, -torch.inf)
    target = torch.tensor([3, 5, 1])
    for m in (20, 0):
        # Row 2 puts -inf entries in its top-M; they tie and carry zero mass, so which of them
        # are picked is arbitrary: compare everything but the ids.
        _run_and_check(
            s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), m, 0.9, reverse, 32, compare_ids=False
        )


@pytest.mark.parametrize("reverse", [True, False], ids=["rev", "fwd"])
def test_tiny_tail_is_exact(reverse, fwd_variant):
    """A sharp teacher leaves ~1e-30 mass in the tail: its log-mass must still be exact.

    ``1 - sum(top)`` would give 0 (log = -inf) and a clamp at 1e-7 would give -16; the KL's tail
    term (student mass times log Q_tail ~ -69) and the gradients depend on the exact value.
    """
    gen = torch.Generator().manual_seed(3)
    n, v, m = 2, 300, 8
    t = torch.randn(n, v, generator=gen)
    top = torch.randperm(v, generator=gen)[:m]
    t[:, top] += 75.0 + torch.arange(m, dtype=torch.float32)  # distinct, far above the rest
    s = torch.randn(n, v, generator=gen)
    target = torch.tensor([int(top[0]), 5])
    out = topk_tail_kl_fwd_triton(
        s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), m, 1.0, *kl_args(reverse), IGNORE,
        block_v=64,
    )  # fmt: skip
    lq_tail = out[5][:, 1, m].cpu().double()
    expected = _oracle(s.double(), t.double(), target, m, 1.0, reverse)[5][:, 1, m]
    assert (expected < -60).all(), "the test needs a tail far below float32 epsilon"
    torch.testing.assert_close(lq_tail, expected, rtol=1e-5, atol=0)
    _run_and_check(s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), m, 1.0, reverse, 64)


@pytest.mark.parametrize("reverse", [True, False], ids=["rev", "fwd"])
def test_student_excludes_teacher_mass(reverse, fwd_variant):
    """The student gives e^-110 of the teacher's mass to some buckets (a top-M entry in row 0,
    the whole tail in row 1): S_j underflows in float32 and Q_b / P_b overflows, yet the
    gradients are finite and exact (forward KL: d/ds_j = S_j - T_j-share, not 0 * inf)."""
    gen = torch.Generator().manual_seed(9)
    n, v, m = 2, 64, 4
    t = torch.randn(n, v, generator=gen)
    s = torch.randn(n, v, generator=gen)
    top = t.topk(m, dim=-1).indices
    s[0, top[0, :2]] -= 110.0
    tail = torch.ones(v, dtype=torch.bool)
    tail[top[1]] = False
    s[1, tail] -= 110.0
    target = torch.tensor([int(top[0, 0]), 3])
    _run_and_check(s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), m, 1.0, reverse, 16)


@pytest.mark.parametrize("grads", [(True, False), (False, True)], ids=["student", "teacher"])
def test_one_side_gradient(grads):
    gen = torch.Generator().manual_seed(11)
    s = torch.randn(3, 97, generator=gen).to(DEVICE)
    t = torch.randn(3, 97, generator=gen).to(DEVICE)
    target = torch.tensor([4, IGNORE, 90], device=DEVICE)
    _run_and_check(s, t, target, 20, 1.7, True, 32, grads=grads)


@pytest.mark.parametrize("m", [20, 0], ids=["M20", "full"])
def test_strided_rows_and_no_out_of_bounds_reads(m, fwd_variant):
    """Rows of a wider buffer (row stride > V) are read in place; the buffer around them holds
    NaN, so a read past a row's V entries (or before/after the rows) would poison the outputs."""
    gen = torch.Generator().manual_seed(5)
    n, v = 3, 97

    def canary(width, offset):
        buf = torch.full((n + 2, width), float("nan"))
        buf[1 : n + 1, offset : offset + v] = torch.randn(n, v, generator=gen)
        return buf[1 : n + 1, offset : offset + v]

    s, t = canary(130, 0), canary(160, 5)
    assert s.stride(0) != v and t.stride(0) != v
    target = torch.tensor([0, 96, 50])
    _run_and_check(s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), m, 0.7, False, 32)


def test_empty_batch():
    s = torch.zeros(0, 10, device=DEVICE)
    target = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = topk_tail_kl_fwd_triton(s, s, target, 4, 1.0, *kl_args(True), IGNORE)
    shapes = [tuple(x.shape) for x in out]
    assert shapes == [(0,), (0,), (0,), (0, 4), (0, 2), (0, 2, 5)]


# ------------------------------------------------------------------------------------------
# Through the public API (custom op + autograd) against the library's float64 reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_m, divergence", [(20, "reverse"), (None, "forward")], ids=["M20-rev", "full-fwd"]
)
def test_public_api_backend_triton(top_m, divergence):
    """``lk.topk_tail_kl(..., backend="triton")`` on ``[B, L, V]`` logits: all five outputs and
    both gradients (random upstream gradients on kl, privilege and both log-probs)."""
    import lopd_kernels as lk

    gen = torch.Generator().manual_seed(17)
    shape = (2, 3, 150)
    s = (torch.randn(shape, generator=gen) * 2).to(DEVICE).requires_grad_()
    t = (torch.randn(shape, generator=gen) * 2).to(DEVICE).requires_grad_()
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen).to(DEVICE)
    target[0, 1] = IGNORE
    kwargs = {"top_m": top_m, "temperature": 0.8, "divergence": divergence}
    out = lk.topk_tail_kl(s, t, target, backend="triton", **kwargs)
    s64 = s.detach().double().requires_grad_()
    t64 = t.detach().double().requires_grad_()
    ref = lk.topk_tail_kl_reference(s64, t64, target, **kwargs)

    names = ("kl", "privilege", "student_logprob", "teacher_logprob")
    upstream = [torch.randn(shape[:-1], generator=gen).to(DEVICE) for _ in names]
    for name in names:
        assert_close(getattr(out, name), getattr(ref, name), torch.float32, name)
    assert torch.equal(out.topk_ids, ref.topk_ids), "topk_ids"
    sum(getattr(out, n) * u for n, u in zip(names, upstream)).sum().backward()
    sum(getattr(ref, n) * u.double() for n, u in zip(names, upstream)).sum().backward()
    assert_close(s.grad, s64.grad, torch.float32, "grad_student")
    assert_close(t.grad, t64.grad, torch.float32, "grad_teacher")


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"top_m": MAX_TOP_M + 1}, ValueError, "top_m"),
        ({"top_m": 98}, ValueError, "top_m"),
        ({"top_m": -1}, ValueError, "top_m"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"teacher_logits": torch.zeros(3, 96)}, ValueError, "teacher_logits"),
        ({"student_logits": torch.zeros(3, 97, dtype=torch.int32)}, TypeError, "student_logits"),
        ({"student_logits": torch.zeros(97)}, ValueError, "student_logits"),
        ({"target_ids": torch.zeros(3, dtype=torch.int32)}, TypeError, "target_ids"),
        ({"target_ids": torch.zeros(4, dtype=torch.int64)}, ValueError, "target_ids"),
        ({"divergence": "js"}, ValueError, "divergence"),
        ({"divergence": "jsd", "beta": 1.5}, ValueError, "beta"),
        ({"divergence": "jsd", "beta": float("nan")}, ValueError, "beta"),
        ({"support": "both"}, ValueError, "support"),
    ],
)
def test_bad_input(kwargs, exc, match):
    args = {
        "student_logits": torch.zeros(3, 97),
        "teacher_logits": torch.zeros(3, 97),
        "target_ids": torch.zeros(3, dtype=torch.int64),
        "top_m": 20,
        "temperature": 1.0,
        "divergence": "reverse",
        "beta": 1.0,
        "support": "teacher",
        "ignore_index": IGNORE,
    }
    args.update(kwargs)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(exc, match=match):
        topk_tail_kl_fwd_triton(**args)


def test_kernel_choice_is_validated():
    """A setting or an argument that names no kernel fails loudly, naming the choices."""
    x = torch.zeros(2, 10, device=DEVICE)
    tgt = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"topk_tail_kl\.triton_forward must be one of"):
        selecting(FWD_SLOT, "v9").__enter__()
    with pytest.raises(ValueError, match="kernel must be one of"):
        topk_tail_kl_fwd_triton(x, x, tgt, 4, 1.0, *kl_args(True), IGNORE, kernel="v9")
    with pytest.raises(ValueError, match="no kernel slot named"):
        selected("topk_tail_kl.triton_fwd")


def test_selecting_restores_the_setting_and_writes_no_environment():
    environ = dict(os.environ)
    assert selected(FWD_SLOT) == SLOTS[FWD_SLOT].default == "separate_reductions"
    with selecting(FWD_SLOT, "joined_reductions"):
        assert selected(FWD_SLOT) == "joined_reductions"
        assert dict(os.environ) == environ
    assert selected(FWD_SLOT) == "separate_reductions"


def test_cpu_tensors_without_interpreter_are_rejected(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        tgt = torch.zeros(2, dtype=torch.int64)
        topk_tail_kl_fwd_triton(x, x, tgt, 4, 1.0, *kl_args(True), IGNORE)


# ------------------------------------------------------------------------------------------
# Compiled for real GPUs, without one
# ------------------------------------------------------------------------------------------

# Runs in a subprocess: with TRITON_INTERPRET=1 (set for this process by conftest.py) triton.jit
# yields interpreter functions, which cannot be compiled.
_COMPILE_SCRIPT = """
from tests.kernels.triton_compile import compile_kernel
import lopd_kernels.triton.topk_tail_kl as k
import lopd_kernels.triton.topk_tail_kl_kernels_joined as f

FLOATS = ("scale2", "inv_t", "beta", "log_1mb", "log_b")

def arg_type(name):
    if name in ("s_ptr", "t_ptr", "gs_ptr", "gt_ptr"):
        return "*bf16"
    if name in ("tgt_ptr", "ids_ptr"):
        return "*i64"
    if name.endswith("_ptr"):
        return "*fp32"
    return "fp32" if name in FLOATS else {"V": "i32"}.get(name, "i64")

def compile_for(fn, arch, **constexprs):
    compile_kernel(
        fn, arch, arg_type, lambda n: n.endswith("_ptr") or n == "V" or n.startswith("stride"),
        **constexprs,
    )

TEACHER_REV = dict(DIV=0, SUPPORT=0)
for arch in (80, 90):
    compile_for(k._fwd_topm_kernel, arch, M=20, MP=32, K=20, BLOCK_V=2048, **TEACHER_REV,
                BULK=False, BULK_MIN=0)
    compile_for(k._fwd_full_kernel, arch, BLOCK_V=4096, DIV=1)
    for full in (False, True):
        compile_for(k._bwd_kernel, arch, K=0 if full else 20, KP=32, BLOCK_V=2048,
                    DIV=0 if full else 1, FULL=full, GRAD_S=True, GRAD_T=True)
    # The joined-reductions top-M forward (lopd_kernels/kernel_variants.py).
    compile_for(f._fwd_topm_joined_kernel, arch, M=20, MP=32, K=20, BLOCK_V=2048, **TEACHER_REV)
# The bitonic-merge path (small block: the network's size only changes compile time).
compile_for(k._fwd_topm_kernel, 90, M=20, MP=32, K=20, BLOCK_V=256, DIV=1, SUPPORT=0, BULK=True,
            BULK_MIN=12)
# The options: the union's two sets (separate reductions, their merge, joined reductions; the
# student's support is the teacher's
# code with the rows swapped), the JSD (top-M: finalization and backward factors; full
# vocabulary: the extra passes). The union's merge at a small size: compile time grows with
# the network, the code is the same.
compile_for(k._fwd_topm_kernel, 90, M=20, MP=32, K=40, BLOCK_V=2048, DIV=2, SUPPORT=2,
            BULK=False, BULK_MIN=0)
compile_for(k._fwd_topm_kernel, 90, M=8, MP=8, K=16, BLOCK_V=64, DIV=0, SUPPORT=2,
            BULK=True, BULK_MIN=4)
compile_for(f._fwd_topm_joined_kernel, 90, M=20, MP=32, K=40, BLOCK_V=2048, DIV=1, SUPPORT=2)
compile_for(k._fwd_full_kernel, 90, BLOCK_V=4096, DIV=2)
for full in (False, True):
    compile_for(k._bwd_kernel, 90, K=0 if full else 40, KP=64, BLOCK_V=2048, DIV=2, FULL=full,
                GRAD_S=True, GRAD_T=True)
print("compiled")
"""


def test_kernels_compile_for_sm80_sm90():
    """Every kernel lowers to a cubin for sm_80 and sm_90 (Triton's own ptxas; no GPU needed).

    The interpreter accepts code the compiler rejects (non-constexpr globals, unsupported ops on
    int64, type mismatches across loop iterations): this is the check that the GPU path builds.
    """
    assert_script_compiles(_COMPILE_SCRIPT)


# ------------------------------------------------------------------------------------------
# GPU-only: production shapes
# ------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, reverse",
    [(20, True), (20, False), (64, True), (256, False), (0, True), (0, False)],
    ids=["M20-rev", "M20-fwd", "M64-rev", "M256-fwd", "full-rev", "full-fwd"],
)
def test_gpu_qwen_vocab_bf16(m, reverse, fwd_variant):
    """Qwen3 vocabulary (151,936) in bf16 with the default GPU launch configuration.

    M = 256 compiles the bitonic-merge path (tens of seconds once), hence one direction only.
    """
    if fwd_variant != "separate_reductions" and not 1 <= m <= 64:
        pytest.skip(f"{fwd_variant}: the launcher runs separate_reductions for top_m={m}")
    gen = torch.Generator().manual_seed(m)
    n, v = 16, 151_936
    s = (torch.randn(n, v, generator=gen) * 4).to(torch.bfloat16).cuda()
    t = (torch.randn(n, v, generator=gen) * 4).cuda()  # fp32 teacher: no bf16 ties in top-M
    target = torch.randint(0, v, (n,), generator=gen).cuda()
    target[3] = IGNORE
    _run_and_check(s, t, target, m, 0.8, reverse, None)
