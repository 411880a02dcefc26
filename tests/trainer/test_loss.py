"""The LOPD objective (eq. 10-13) and the dual update of beta."""

from __future__ import annotations

import itertools

import pytest
import torch

from lopd.loss import (
    advantages_from_rewards,
    dual_update,
    lopd_loss,
    lopd_row_weights,
    segment_mean,
    segment_mean_weights,
)
from tests.utils import assert_close


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seg = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3])  # trajectory lengths 3, 1, 5, 2
    n, b = seg.numel(), 4
    kl = torch.rand(n, generator=g, dtype=torch.float64).requires_grad_()
    priv = torch.randn(n, generator=g, dtype=torch.float64).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    lat = torch.randn(b, 6, 5, generator=g, dtype=torch.float64).requires_grad_()
    lat0 = torch.randn(b, 6, 5, generator=g, dtype=torch.float64).requires_grad_()
    return kl, priv, seg, rewards, lat, lat0


def test_segment_mean_matches_loop_and_empty_segment_is_zero():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 4.0])
    seg = torch.tensor([0, 0, 0, 2, 2])
    out = segment_mean(values, seg, 4)
    torch.testing.assert_close(out, torch.tensor([2.0, 0.0, 7.0, 0.0]))


def test_lopd_loss_matches_the_paper_formula():
    kl, priv, seg, rewards, lat, lat0 = _batch()
    beta, m, lam = 0.7, 0.05, 0.2
    adv = advantages_from_rewards(rewards)
    assert adv.tolist() == [1.0, -1.0, 0.0, 1.0]
    terms = lopd_loss(kl, priv, seg, adv, lat, lat0, beta, m, lam)
    # Direct transcription of eq. 10, 12 and 13 (trajectory loop, token means).
    distill, delta, anchor = [], [], []
    for i in range(4):
        rows = seg == i
        distill.append(kl[rows].mean())
        delta.append(adv[i] * priv[rows].mean())
        anchor.append((lat[i] - lat0[i]).pow(2).mean())
    expected = (
        torch.stack(distill).mean()
        + beta * (m - torch.stack(delta).mean())
        + lam * torch.stack(anchor).mean()
    )
    assert_close(terms.loss, expected, torch.float64, "loss")
    assert_close(terms.distill, torch.stack(distill), torch.float64, "distill")
    assert_close(terms.delta, torch.stack(delta), torch.float64, "delta")


def test_anchor_has_no_gradient_into_cphi0_and_pulls_cphi_toward_it():
    kl, priv, seg, rewards, lat, lat0 = _batch(1)
    terms = lopd_loss(kl, priv, seg, advantages_from_rewards(rewards), lat, lat0, 0.0, 0.05, 0.2)
    terms.loss.backward()
    assert lat0.grad is None
    per_elem = 0.2 * 2 * (lat - lat0) / lat[0].numel() / 4
    assert_close(lat.grad, per_elem, torch.float64, "anchor grad")


def test_margin_term_pushes_privilege_up_on_success_and_down_on_failure():
    kl, priv, seg, rewards, _lat, _lat0 = _batch(2)
    terms = lopd_loss(kl, priv, seg, advantages_from_rewards(rewards), None, None, 1.0, 0.05, 0.0)
    terms.loss.backward()
    g = priv.grad
    assert (g[seg == 0] < 0).all()  # r = 1: gradient descent raises the teacher's log-prob
    assert (g[seg == 1] > 0).all()  # r = 0: lowers it
    assert (g[seg == 2] == 0).all()  # r = 0.5: A = 0


def test_micro_batches_add_up_to_the_full_batch():
    kl, priv, seg, rewards, lat, lat0 = _batch(3)
    adv = advantages_from_rewards(rewards)
    full = lopd_loss(kl, priv, seg, adv, lat, lat0, 0.3, 0.05, 0.2)
    g_full = torch.autograd.grad(full.loss, (kl, priv, lat))
    total = 0.0
    grads = [torch.zeros_like(x) for x in (kl, priv, lat)]
    for trajs in ([0, 1], [2, 3]):
        rows = torch.isin(seg, torch.tensor(trajs))
        local = seg[rows] - trajs[0]
        part = lopd_loss(
            kl[rows], priv[rows], local, adv[trajs], lat[trajs], lat0[trajs], 0.3, 0.05, 0.2,
            num_total=4,
        )  # fmt: skip
        total = total + part.loss
        for acc, gr in zip(grads, torch.autograd.grad(part.loss, (kl, priv, lat))):
            acc += gr
    assert_close(total, full.loss, torch.float64, "micro-batched loss")
    for a, b in zip(grads, g_full):
        assert_close(a, b, torch.float64, "micro-batched grad")


def test_beta_grows_while_delta_below_margin_then_decays_to_zero():
    m, eta = 0.05, 0.5
    beta, history = 0.0, []
    for _ in range(5):  # the composer has collapsed: Delta = 0 < m
        beta = dual_update(beta, m, 0.0, eta)
        history.append(beta)
    assert all(b2 > b1 for b1, b2 in itertools.pairwise(history))
    assert history[-1] == pytest.approx(5 * eta * m)
    for _ in range(20):  # privilege above the margin: Delta = 0.2 > m
        beta = dual_update(beta, m, torch.tensor(0.2), eta)
        assert beta >= 0.0
    assert beta == 0.0


def test_bad_shapes_are_named():
    kl, priv, seg, rewards, lat, lat0 = _batch()
    with pytest.raises(ValueError, match="kl and privilege"):
        lopd_loss(kl, priv[:-1], seg, rewards, None, None, 0.0, 0.05, 0.0)
    with pytest.raises(ValueError, match="latents and latents0"):
        lopd_loss(kl, priv, seg, rewards, lat, lat0[:, :3], 0.0, 0.05, 0.2)
    with pytest.raises(ValueError, match="num_total"):
        lopd_loss(kl, priv, seg, rewards, None, None, 0.0, 0.05, 0.0, num_total=2)


def test_segment_mean_weights_turn_segment_means_into_a_row_sum():
    g = torch.Generator().manual_seed(3)
    seg = torch.tensor([0, 0, 0, 2, 2, 3])  # segment 1 is empty
    values = torch.randn(6, generator=g, dtype=torch.float64)
    factor = torch.randn(4, generator=g, dtype=torch.float64)
    w = segment_mean_weights(seg, factor, 4)
    assert w.dtype == torch.float64 and not w.requires_grad
    torch.testing.assert_close((w * values).sum(), (factor * segment_mean(values, seg, 4)).sum())
    torch.testing.assert_close(segment_mean_weights(seg, 0.5, 4)[:3], torch.full((3,), 0.5 / 3))


@pytest.mark.parametrize("num_total", [4, 9])
def test_row_weights_give_the_gradient_of_the_distill_and_privilege_terms(num_total):
    """What the trainer backpropagates with the fused loss: sum(w_kl KL + w_t log pT) has the
    gradient of eq. 13's distillation and privilege terms in KL and log pT (privilege =
    log pT - sg log pS), micro-batched too."""
    kl, _, seg, rewards, _, _ = _batch(5)
    g = torch.Generator().manual_seed(6)
    lp_t = torch.randn(kl.shape, generator=g, dtype=torch.float64).requires_grad_()
    lp_s = torch.randn(kl.shape, generator=g, dtype=torch.float64)
    adv, beta = advantages_from_rewards(rewards), 0.8
    terms = lopd_loss(kl, lp_t - lp_s, seg, adv, None, None, beta, 0.05, 0.0, num_total)
    want = torch.autograd.grad(terms.loss, (kl, lp_t))
    w_kl, w_t = lopd_row_weights(seg, adv, beta, num_total)
    got = torch.autograd.grad((w_kl * kl).sum() + (w_t * lp_t).sum(), (kl, lp_t))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
