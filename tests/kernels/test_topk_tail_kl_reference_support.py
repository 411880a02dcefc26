"""The float64 reference of ``topk_tail_kl`` for every ``support`` (teacher, student, union) and
divergence (reverse, forward, TRL's generalized JSD) against an independent brute force (Python
sorts, explicit sums of probabilities), its gradients against the closed forms of docs/math.md
and finite differences, TRL's own ``generalized_jsd_loss`` as an outside oracle, the union's
layout (order, ties, duplicates, padding, size), the teacher support bit for bit as before, and
the options' validation and routing."""

from __future__ import annotations

import math

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.bucket_math import op_divergence, rows_bwd_torch, rows_fwd_torch
from lopd_kernels.topk_tail_kl import topk_tail_kl_reference
from tests.kernels.utils import make_inputs

SUPPORTS = ("teacher", "student", "union")
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


# --------------------------------------------------------------------------------- brute force


def brute_support(s_row: list[float], t_row: list[float], m: int, support: str) -> list[int]:
    """Bucket ids of one row by Python sorts of (-x_j, j); the union padded with -1 to 2M."""
    v = len(s_row)
    by_t = sorted(range(v), key=lambda j: (-t_row[j], j))[:m]
    by_s = sorted(range(v), key=lambda j: (-s_row[j], j))[:m]
    if support == "teacher":
        return by_t
    if support == "student":
        return by_s
    union = by_t + [j for j in by_s if j not in by_t]
    return union + [-1] * (2 * m - len(union))


def brute_divergence(pb: list[float], qb: list[float], divergence: str, beta: float | None):
    """The divergence of two bucket distributions from its definition (TRL's convention)."""

    def kl(a, b):
        return sum(x * (math.log(x) - math.log(y)) for x, y in zip(a, b) if x > 0)

    if divergence == "jsd" and beta not in (None, 0.0, 1.0):
        mix = [(1 - beta) * p + beta * q for p, q in zip(pb, qb)]
        return beta * kl(qb, mix) + (1 - beta) * kl(pb, mix)
    reverse = divergence == "reverse" or (divergence == "jsd" and beta == 1.0)
    return kl(pb, qb) if reverse else kl(qb, pb)


def brute_force(s, t, target, top_m, temperature, divergence, beta, support, ignore_index=-100):
    """Float64 outputs ``(kl, slp, tlp, ids, mass, size)``: explicit bucket masses (sums of
    probabilities over each bucket, the tail over the complement of the row's ids)."""
    s = s.double() / temperature
    t = t.double() / temperature
    n, v = s.shape
    m = 0 if top_m is None or top_m >= v else top_m
    k = 2 * m if support == "union" else m
    out = {x: torch.zeros(n, dtype=torch.float64) for x in ("kl", "slp", "tlp", "mass")}
    ids = torch.zeros(n, k, dtype=torch.int64)
    size = torch.zeros(n, dtype=torch.int64)
    for r in range(n):
        a = int(target[r])
        if a == ignore_index:
            continue
        p = torch.softmax(s[r], 0).tolist()
        q = torch.softmax(t[r], 0).tolist()
        out["slp"][r] = math.log(p[a])
        out["tlp"][r] = math.log(q[a])
        if m == 0:
            pb, qb, size[r], out["mass"][r] = p, q, v, 1.0
        else:
            row = brute_support(s[r].tolist(), t[r].tolist(), m, support)
            ids[r] = torch.tensor(row)
            real = [j for j in row if j >= 0]
            rest = [j for j in range(v) if j not in real]
            pb = [p[j] for j in real] + [sum(p[j] for j in rest)]
            qb = [q[j] for j in real] + [sum(q[j] for j in rest)]
            size[r] = len(real)
            out["mass"][r] = sum(qb[:-1])
        out["kl"][r] = brute_divergence(pb, qb, divergence, beta)
    return out["kl"], out["slp"], out["tlp"], ids, out["mass"], size


def closed_form_grads(s, t, target, top_m, temperature, divergence, beta, support, u_kl):
    """``d(sum_r u_kl[r] kl[r]) / d(s, t)`` from the formulas of docs/math.md (section 2), in
    float64 and without autograd."""
    div, b = op_divergence(divergence, beta)
    s = s.double() / temperature
    t = t.double() / temperature
    gs, gt = torch.zeros_like(s), torch.zeros_like(t)
    n, v = s.shape
    m = 0 if top_m is None or top_m >= v else top_m
    for r in range(n):
        if int(target[r]) == -100:
            continue
        S = torch.softmax(s[r], 0)
        T = torch.softmax(t[r], 0)
        if m == 0:
            bucket_of = list(range(v))
            nb = v
        else:
            real = [j for j in brute_support(s[r].tolist(), t[r].tolist(), m, support) if j >= 0]
            slot = {j: i for i, j in enumerate(real)}
            bucket_of = [slot.get(j, len(real)) for j in range(v)]
            nb = len(real) + 1
        bo = torch.tensor(bucket_of)
        P = torch.zeros(nb, dtype=torch.float64).index_add_(0, bo, S)
        Q = torch.zeros(nb, dtype=torch.float64).index_add_(0, bo, T)
        with torch.no_grad():
            if div == "reverse":
                kl = (P * (P.log() - Q.log())).nansum()
                cs = (P.log() - Q.log()) - kl
                ct = 1 - P / Q
            elif div == "forward":
                f = (Q * (Q.log() - P.log())).nansum()
                cs = 1 - Q / P
                ct = (Q.log() - P.log()) - f
            else:
                M = (1 - b) * P + b * Q
                kp = (P * (P.log() - M.log())).nansum()
                kq = (Q * (Q.log() - M.log())).nansum()
                cs = (1 - b) * (P.log() - M.log() - kp)
                ct = b * (Q.log() - M.log() - kq)
        gs[r] = u_kl[r] * S * cs[bo] / temperature
        gt[r] = u_kl[r] * T * ct[bo] / temperature
    return gs, gt


# --------------------------------------------------------------------------------- forward


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize(
    ("v", "top_m", "temperature"), [(7, 1, 1.0), (7, 3, 0.7), (97, 20, 1.5), (9, None, 1.0)]
)
def test_reference_matches_bruteforce(v, top_m, temperature, divergence, beta, support):
    s, t, target = make_inputs(5, v, s_dtype=torch.float64, ignore_rows=(2,), seed=v + 3)
    ref = topk_tail_kl_reference(
        s, t, target, top_m=top_m, temperature=temperature, divergence=divergence, beta=beta,
        support=support,
    )  # fmt: skip
    kl, slp, tlp, ids, mass, size = brute_force(
        s, t, target, top_m, temperature, divergence, beta, support
    )
    tol = {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(ref.kl, kl, **tol)
    torch.testing.assert_close(ref.student_logprob, slp, **tol)
    torch.testing.assert_close(ref.teacher_logprob, tlp, **tol)
    torch.testing.assert_close(ref.privilege, tlp - slp, **tol)
    assert torch.equal(ref.topk_ids, ids)
    assert torch.equal(ref.support_size, size)
    torch.testing.assert_close(ref.teacher_topk_mass, mass, **tol)
    assert ref.kl[2] == 0 and (ref.topk_ids[2] == 0).all() and ref.support_size[2] == 0


def test_union_layout_ties_duplicates_and_padding():
    """The union is the teacher's top-M in teacher order, then the student's other top-M ids in
    student order, then -1; ties go to the lower id on each side; an id in both appears once."""
    v, m = 12, 4
    t = torch.tensor([[0.0, 5, 5, 1, 9, 5, 0, 0, 2, 0, 0, 0]], dtype=torch.float64)
    s = torch.tensor([[7.0, 0, 7, 0, 9, 0, 3, 0, 0, 0, 0, 3]], dtype=torch.float64)
    out = topk_tail_kl_reference(s, t, torch.tensor([0]), top_m=m, support="union")
    # teacher: 4 (9), then the tie at 5 among 1, 2, 5 (lower ids first), then 8 (2)
    # student: 4 (9), 0 and 2 (7), then the tie at 3 between 6 and 11 -> 6
    assert out.topk_ids.tolist() == [[4, 1, 2, 5, 0, 6, -1, -1]]
    assert out.support_size.tolist() == [6]
    same = topk_tail_kl_reference(t, t, torch.tensor([0]), top_m=m, support="union")
    assert same.topk_ids.tolist() == [[4, 1, 2, 5, -1, -1, -1, -1]]
    assert same.support_size.tolist() == [m]
    # Disjoint top-M: the union has 2M ids; 2M >= V leaves an empty tail (mass 0, no NaN).
    t2 = torch.arange(v, dtype=torch.float64).unsqueeze(0)
    opposite = topk_tail_kl_reference(-t2, t2, torch.tensor([3]), top_m=6, support="union")
    assert opposite.support_size.tolist() == [12]
    assert sorted(opposite.topk_ids[0].tolist()) == list(range(v))
    assert torch.isfinite(opposite.kl).all()
    torch.testing.assert_close(opposite.teacher_topk_mass, torch.ones(1, dtype=torch.float64))


@pytest.mark.parametrize("support", SUPPORTS)
def test_full_vocabulary_ignores_the_support(support):
    s, t, target = make_inputs(4, 13, s_dtype=torch.float64, ignore_rows=(1,))
    base = topk_tail_kl_reference(s, t, target, top_m=None, divergence="jsd", beta=0.3)
    out = topk_tail_kl_reference(
        s, t, target, top_m=50, divergence="jsd", beta=0.3, support=support
    )
    for a, b in zip(base, out):
        assert torch.equal(a, b)
    assert out.topk_ids.shape == (4, 0) and out.support_size.tolist() == [13, 0, 13, 13]


def test_jsd_ends_are_the_kls_bit_for_bit():
    """TRL's convention: beta = 0 is the forward KL, beta = 1 the reverse KL (the mixture formula
    would give 0 there); the ops run the KLs' code for them."""
    s, t, target = make_inputs(6, 50, ignore_rows=(0,))
    for support in SUPPORTS:
        for beta, div in ((0.0, "forward"), (1.0, "reverse")):
            a = topk_tail_kl_reference(s, t, target, top_m=5, support=support, divergence=div)
            b = topk_tail_kl_reference(
                s, t, target, top_m=5, support=support, divergence="jsd", beta=beta
            )
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    assert op_divergence("jsd", None) == ("jsd", 0.5)
    assert op_divergence("jsd", 0) == ("forward", 0.0)


def test_jsd_limits_and_symmetry():
    """JSD_beta(P, Q) = JSD_{1-beta}(Q, P) (the union's buckets are the same set either way);
    bounded by the binary entropy of beta; small beta tends to 0, not to the forward KL (the
    ends are TRL's special cases)."""
    s, t, target = make_inputs(5, 40, s_dtype=torch.float64, scale=3.0)
    kw = {"top_m": 6, "divergence": "jsd", "support": "union"}
    for beta in (0.1, 0.5, 0.8):
        a = topk_tail_kl_reference(s, t, target, beta=beta, **kw).kl
        b = topk_tail_kl_reference(t, s, target, beta=1 - beta, **kw).kl
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        h = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        assert (a >= 0).all() and (a <= h + 1e-12).all()
    tiny = topk_tail_kl_reference(s, t, target, beta=1e-9, **kw).kl
    assert tiny.max() < 1e-7


def test_neg_inf_entries_every_divergence_and_support():
    """-inf logits (a padded vocabulary) on both sides, and a bucket one side gives no mass:
    every divergence stays finite (the KL is +inf only for mass against none) with no NaN."""
    s, t, target = make_inputs(4, 30, s_dtype=torch.float64, pad=5)
    s[1, :3] = -math.inf  # the student gives three of the teacher's ids no mass
    for support in SUPPORTS:
        for div, beta in DIVERGENCES:
            s_ = s.clone().requires_grad_(True)
            t_ = t.clone().requires_grad_(True)
            out = topk_tail_kl_reference(
                s_, t_, target, top_m=4, divergence=div, beta=beta, support=support
            )
            gs, gt = torch.autograd.grad(out.kl.sum(), (s_, t_))
            assert not out.kl.isnan().any() and not gs.isnan().any() and not gt.isnan().any()
            if div == "jsd" and beta not in (0.0, 1.0):
                assert torch.isfinite(out.kl).all() and torch.isfinite(gs).all()


# --------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("top_m", [3, None])
def test_reference_gradients_are_the_closed_forms(top_m, support, divergence, beta):
    s, t, target = make_inputs(5, 23, s_dtype=torch.float64, ignore_rows=(3,), seed=7)
    s.requires_grad_(True)
    t.requires_grad_(True)
    out = topk_tail_kl_reference(
        s, t, target, top_m=top_m, temperature=0.8, divergence=divergence, beta=beta,
        support=support,
    )  # fmt: skip
    u = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    gs, gt = torch.autograd.grad((out.kl * u).sum(), (s, t))
    es, et = closed_form_grads(s, t, target, top_m, 0.8, divergence, beta, support, u)
    torch.testing.assert_close(gs, es, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gt, et, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("divergence", "beta"), [("jsd", 0.3), ("reverse", None)])
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("top_m", [2, None])
def test_reference_gradcheck(top_m, support, divergence, beta):
    s, t, target = make_inputs(3, 6, s_dtype=torch.float64, ignore_rows=(1,), seed=5)
    s.requires_grad_(True)
    t.requires_grad_(True)

    def f(s_, t_):
        out = topk_tail_kl_reference(
            s_, t_, target, top_m=top_m, temperature=0.8, divergence=divergence, beta=beta,
            support=support,
        )  # fmt: skip
        return out.kl, out.student_logprob, out.teacher_logprob

    assert torch.autograd.gradcheck(f, (s, t))


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("top_m", [4, 0])
def test_torch_twins_match_reference(top_m, support, divergence, beta):
    """The PyTorch twins of the per-row ops (the chunked path's epilogue where no kernel has
    the options): outputs and the closed-form gradients of bucket_coefs."""
    s, t, target = make_inputs(7, 29, s_dtype=torch.float64, ignore_rows=(2,), pad=3, seed=8)
    s.requires_grad_(True)
    t.requires_grad_(True)
    ref = topk_tail_kl_reference(
        s, t, target, top_m=top_m or None, temperature=0.9, divergence=divergence, beta=beta,
        support=support,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    ups = [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3)]
    loss = (ref.kl * ups[0] + ref.student_logprob * ups[1] + ref.teacher_logprob * ups[2]).sum()
    loss.backward()
    div, b = op_divergence(divergence, beta)
    s32, t32 = s.detach().float(), t.detach().float()
    kl, lp_s, lp_t, ids, lse, bucket = rows_fwd_torch(
        s32, t32, target, top_m, 0.9, div, b, support, -100
    )
    torch.testing.assert_close(kl.double(), ref.kl, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lp_s.double(), ref.student_logprob, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lp_t.double(), ref.teacher_logprob, rtol=2e-5, atol=2e-6)
    assert torch.equal(ids, ref.topk_ids)
    gs, gt = rows_bwd_torch(
        *(u.float() for u in ups), s32, t32, target, ids, kl, lse, bucket, 0.9, div, b, -100,
        True, True,
    )  # fmt: skip
    torch.testing.assert_close(gs.double(), s.grad, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(gt.double(), t.grad, rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------------- TRL oracle


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_full_vocabulary_jsd_is_trls_generalized_jsd(beta):
    """TRL's GKDTrainer.generalized_jsd_loss (trl/experimental/gkd/gkd_trainer.py), per token
    (its per-entry values summed over the vocabulary), values and both gradients, at every
    beta including its special-cased ends."""
    from trl.experimental.gkd import GKDTrainer

    s, t, target = make_inputs(6, 50, s_dtype=torch.float64, seed=12)
    s.requires_grad_(True)
    t.requires_grad_(True)
    trl = GKDTrainer.generalized_jsd_loss(s, t, beta=beta, temperature=0.7, reduction="none")
    trl = trl.sum(-1)
    ours = topk_tail_kl_reference(
        s, t, target, top_m=None, temperature=0.7, divergence="jsd", beta=beta
    )
    torch.testing.assert_close(ours.kl, trl, rtol=1e-10, atol=1e-12)
    u = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g_trl = torch.autograd.grad((trl * u).sum(), (s, t))
    g_ours = torch.autograd.grad((ours.kl * u).sum(), (s, t))
    for a, b in zip(g_ours, g_trl):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------ teacher: as before


def _old_bucket_divergence(logp, logq, reverse):
    """``bucket_divergence`` as it was before ``support`` and ``"jsd"`` existed, verbatim."""
    w, o = (logp, logq) if reverse else (logq, logp)
    zero = w == -math.inf
    underflow = ~zero & (o == -math.inf) & (w.exp() == 0)
    w_safe = w.masked_fill(zero, 0.0)
    o_safe = o.masked_fill(zero | underflow, 0.0)
    terms = torch.where(zero, 0.0, w_safe.exp() * (w_safe - o_safe))
    return terms.masked_fill(underflow, math.inf).sum(dim=-1)


def _old_reference_kl(s, t, target, top_m, temperature, reverse):
    """The previous reference's KL and its two gradients (top-M mode, no ignored rows)."""
    from lopd_kernels.bucket_math import masked_logsumexp

    s = s.detach().to(torch.float64).requires_grad_(True)
    t = t.detach().to(torch.float64).requires_grad_(True)
    s_, t_ = s / temperature, t / temperature
    lse_s = torch.logsumexp(s_, dim=-1, keepdim=True)
    lse_t = torch.logsumexp(t_, dim=-1, keepdim=True)
    ids = torch.sort(t_.detach(), dim=-1, descending=True, stable=True).indices[:, :top_m]
    tail = torch.ones_like(s_, dtype=torch.bool).scatter(1, ids, False)
    logp = torch.cat([s_.gather(1, ids), masked_logsumexp(s_, tail).unsqueeze(1)], 1) - lse_s
    logq = torch.cat([t_.gather(1, ids), masked_logsumexp(t_, tail).unsqueeze(1)], 1) - lse_t
    kl = _old_bucket_divergence(logp, logq, reverse)
    return (kl, *torch.autograd.grad(kl.sum(), (s, t)))


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_teacher_support_reference_bitwise_as_before(divergence):
    s, t, target = make_inputs(6, 61, s_dtype=torch.float64, pad=4, seed=21)
    t[:, 5] = t[:, 9] = t[:, 2]  # ties
    old = _old_reference_kl(s, t, target, 7, 0.9, divergence == "reverse")
    s_ = s.clone().requires_grad_(True)
    t_ = t.clone().requires_grad_(True)
    new = topk_tail_kl_reference(s_, t_, target, top_m=7, temperature=0.9, divergence=divergence)
    grads = torch.autograd.grad(new.kl.sum(), (s_, t_))
    assert torch.equal(new.kl, old[0])
    assert torch.equal(grads[0], old[1]) and torch.equal(grads[1], old[2])


# --------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"support": "both"}, "support must be one of"),
        ({"divergence": "js"}, "divergence must be one of"),
        ({"divergence": "jsd", "beta": 1.5}, "beta must be a number in [0, 1]"),
        ({"divergence": "jsd", "beta": float("nan")}, "beta must be a number in [0, 1]"),
        ({"divergence": "reverse", "beta": 0.5}, "beta is the option of divergence='jsd'"),
    ],
)
def test_bad_options_name_the_argument(kwargs, fragment):
    s, t, target = make_inputs(2, 9)
    for fn in (lk.topk_tail_kl, topk_tail_kl_reference):
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            fn(s, t, target, top_m=3, **kwargs)
    with pytest.raises(ValueError, match="support must be one of"):
        lk.TopKTailKL(support="both")
    with pytest.raises(ValueError, match="divergence must be one of"):
        lk.SparseTeacherTopKTailKL(divergence="jsd")
