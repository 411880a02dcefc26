"""Skill-SD's and SDFT's pure pieces against hand-written references on toy inputs: the paper's
prompt wording, UCB1 selection and its statistics, the bandit reward, the asymmetric PPO-clip
range, the importance-weighted reverse KL, and the deterministic skill summarizer."""

from __future__ import annotations

import math

import pytest
import torch

from lopd.methods.groups import ppo_clip_loss
from lopd.methods.sdft import SDFT_USER_TEMPLATE
from lopd.methods.skill_sd import importance_weighted_reverse_kl
from lopd.methods.skills import (
    SKILL_USER_TEMPLATE,
    RuleSkillSummarizer,
    SkillBank,
    SkillText,
    call_shape,
    parse_skill_text,
    skill_agreement,
    ucb1_scores,
)
from lopd.types import Task, TraceStep, Trajectory


# ----------------------------------------------------------------------------- wording
def test_templates_are_the_papers_b1_wording():
    # Typed from the paper's Appendix B.1 ("Appended to user message").
    sdft = (
        "This is an example for a response to the question:\n\nDEMO\n\n"
        "Now answer with a response of your own, including the thinking process."
    )
    assert SDFT_USER_TEMPLATE.format(demo_text="DEMO") == "\n\n" + sdft
    skill = (
        "Here is a skill summary from a similar past task that may help guide your approach:\n\n"
        "**What works:** W\n\n**What to avoid:** A\n\n**Suggested workflow:** G\n\n"
        "Now solve the current task using your own reasoning."
    )
    assert SkillText("W", "A", "G").render() == "\n\n" + skill
    assert SKILL_USER_TEMPLATE.count("{") == 3


# ----------------------------------------------------------------------------- UCB1
def test_ucb1_scores_match_hand_computation():
    pulls = torch.tensor([2, 1, 3, 0])
    means = torch.tensor([0.5, 1.0, 0.2, 0.9], dtype=torch.float64)
    c = math.sqrt(2.0)
    got = ucb1_scores(pulls, means, c)
    n_total = 6  # 2 + 1 + 3
    expected = [m + c * math.sqrt(math.log(n_total) / n) for m, n in ((0.5, 2), (1.0, 1), (0.2, 3))]
    torch.testing.assert_close(got[:3], torch.tensor(expected, dtype=torch.float64))
    assert got[3] == math.inf  # never pulled: tried first
    assert torch.equal(ucb1_scores(torch.zeros(2), torch.zeros(2), c), torch.full((2,), math.inf))
    with pytest.raises(ValueError, match="pulls and means"):
        ucb1_scores(pulls, means[:2], c)


def _task(world: str, k: int) -> Task:
    return Task(f"{world}-train-{k:05d}", "tool_use", world, f"do {world} {k}", {})


def test_ucb1_selection_and_statistics_follow_the_hand_computed_bandit():
    bank = SkillBank(c=math.sqrt(2.0), max_skills=10)
    text = SkillText("w", "a", "g")
    s0 = bank.add(_task("shop", 0), text, "rule", step=0)
    bank.add(_task("shop", 1), text, "rule", step=0)
    s2 = bank.add(_task("shop", 2), text, "rule", step=1)
    bank.add(_task("insurance", 0), text, "rule", step=1)
    # Candidates: same world, never the task's own skill, oldest first.
    assert [s.skill_id for s in bank.candidates(_task("shop", 1))] == [s0.skill_id, s2.skill_id]
    assert [s.skill_id for s in bank.candidates(_task("shop", 9))] == [0, 1, 2]
    assert bank.select([_task("logistics", 0)]) == [None]  # no skill of its world
    # All unpulled: the oldest first; later choices of the same step see the earlier ones as
    # pulls, so three tasks spread over the three skills.
    picks = bank.select([_task("shop", 7), _task("shop", 8), _task("shop", 9)])
    assert [s.skill_id for s in picks] == [0, 1, 2]
    assert all(s.pulls == 0 for s in bank.skills)  # selection records nothing
    for sid, reward in ((0, 1.0), (1, 0.0), (2, 0.5), (0, 0.5)):
        bank.update(sid, reward)
    assert [(s.pulls, s.reward_sum) for s in bank.skills[:3]] == [(2, 1.5), (1, 0.0), (1, 0.5)]
    assert bank.get(0).mean == 0.75
    # Hand-computed UCB1 over the three: N = 4.
    c, n = math.sqrt(2.0), 4
    scores = [
        0.75 + c * math.sqrt(math.log(n) / 2),
        c * math.sqrt(math.log(n)),
        0.5 + c * math.sqrt(math.log(n)),
    ]
    best = max(range(3), key=lambda i: scores[i])
    assert best == 2 and bank.select([_task("shop", 9)])[0].skill_id == 2
    # For shop-2 the candidates are skills 0 and 1 only (its own skill 2 is excluded).
    scores01 = scores[:2]
    assert bank.select([_task("shop", 2)])[0].skill_id == max(range(2), key=lambda i: scores01[i])
    # Ties go to the oldest skill.
    tie = SkillBank()
    for k in range(3):
        tie.add(_task("shop", k), text, "rule", 0)
    for sid in range(3):
        tie.update(sid, 0.5)
    assert tie.select([_task("shop", 5)])[0].skill_id == 0
    with pytest.raises(ValueError, match="bandit reward"):
        bank.update(0, 1.5)


def test_skill_bank_capacity_and_state_round_trip():
    bank = SkillBank(c=1.0, max_skills=2)
    for k in range(3):
        bank.add(_task("shop", k), SkillText(f"w{k}", "a", "g"), "rule", step=k)
    assert [s.skill_id for s in bank.skills] == [1, 2]  # the oldest left
    bank.update(0, 1.0)  # a dropped skill's late reward is ignored
    bank.update(2, 0.25)
    copy = SkillBank(c=1.0, max_skills=2)
    copy.load_state_dict(bank.state_dict())
    assert copy.state_dict() == bank.state_dict()
    assert copy.next_id == 3 and copy.get(2).reward_sum == 0.25
    assert copy.get(2).text == SkillText("w2", "a", "g")


def test_bandit_reward_is_the_teachers_agreement_with_the_outcome():
    # success, failure: agree when log pi_T - log pi_theta > 0 on a success, < 0 on a failure.
    assert skill_agreement([1.0, 0.0, 1.0, 0.0], [0.3, -0.2, -0.1, 0.4], success=1.0) == 0.5
    assert skill_agreement([1.0, 0.0], [0.1, -0.1], success=1.0) == 1.0
    assert skill_agreement([0.5], [0.1], success=0.5) == 1.0  # threshold inclusive
    with pytest.raises(ValueError, match="one log-ratio per reward"):
        skill_agreement([1.0], [], success=1.0)


# ----------------------------------------------------------------------------- losses
def test_asymmetric_ppo_clip_matches_hand_computation():
    rho = torch.tensor([0.7, 1.25, 1.3, 0.7, 1.3], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    logp_old = torch.tensor([-1.0, -0.5, -2.0, -1.5, -0.3], dtype=torch.float64)
    logp = (logp_old + rho.log()).requires_grad_(True)
    loss = ppo_clip_loss(logp, logp_old, adv, 0.2, clip_eps_high=0.28)
    # -min(rho A, clip(rho, 0.8, 1.28) A): 1.25 is inside [0.8, 1.28] (the symmetric 0.2 range
    # would clip it to 1.2); 1.3 clips to 1.28 for A > 0; 0.7 clips to 0.8 for A < 0.
    torch.testing.assert_close(loss, torch.tensor([-0.7, -1.25, -1.28, 0.8, 1.3]).double())
    loss.sum().backward()
    # d/dlogp (-rho A) = -rho A where the unclipped branch is taken, 0 where the clip binds.
    torch.testing.assert_close(logp.grad, torch.tensor([-0.7, -1.25, 0.0, 0.0, 1.3]).double())
    sym = ppo_clip_loss(logp.detach(), logp_old, adv, 0.2)
    assert sym[1].item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="clip_eps_high"):
        ppo_clip_loss(logp, logp_old, adv, 0.2, clip_eps_high=0.0)


def test_importance_weighted_reverse_kl_values_and_gradients():
    logp_old = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    rho = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    logp_t = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    logp = (logp_old + rho.log()).requires_grad_(True)
    out = importance_weighted_reverse_kl(logp, logp_old, logp_t)
    diff = (logp_old + rho.log()) - logp_t
    torch.testing.assert_close(out, rho * diff)
    out.sum().backward()
    torch.testing.assert_close(logp.grad, rho * diff)  # rho (logp - logp_T) d logp
    with pytest.raises(ValueError, match="same shape"):
        importance_weighted_reverse_kl(logp, logp_old, logp_t[:2])


def test_importance_weighted_reverse_kl_is_the_exact_reverse_kl_gradient_in_expectation():
    """Over tokens drawn from pi_old, the mean gradient equals grad KL(pi_theta || pi_T).

    (The stop-gradient on the log-ratio leaves this expectation unchanged, the extra term
    ``rho grad log pi_theta`` has mean 0, but it is what gives each sampled token the gradient
    ``rho (log pi_theta - log pi_T) grad log pi_theta``: the previous test.)
    """
    torch.manual_seed(0)
    z = torch.randn(7, dtype=torch.float64, requires_grad=True)  # student logits
    z_old = z.detach() + 0.3 * torch.randn(7, dtype=torch.float64)  # the sampling policy
    log_t = torch.log_softmax(torch.randn(7, dtype=torch.float64), -1)  # the teacher
    log_s, log_old = torch.log_softmax(z, -1), torch.log_softmax(z_old, -1)
    # E_{y ~ pi_old}[loss(y)], exactly: every token weighted by its sampling probability.
    per_token = importance_weighted_reverse_kl(log_s, log_old, log_t)
    (grad_iw,) = torch.autograd.grad((log_old.exp() * per_token).sum(), z, retain_graph=True)
    exact = (log_s.exp() * (log_s - log_t)).sum()  # KL(pi_theta || pi_T)
    (grad_kl,) = torch.autograd.grad(exact, z, retain_graph=True)
    torch.testing.assert_close(grad_iw, grad_kl)
    # The naive sampled-token loss (logp - logp_T without the stop-gradient) is not.
    naive = (log_old.exp() * (log_s - log_t)).sum()
    (grad_naive,) = torch.autograd.grad(naive, z)
    assert not torch.allclose(grad_naive, grad_kl, atol=1e-3)


# ----------------------------------------------------------------------------- summarizer
def _traj(task: Task, reward: float, steps: list[tuple[str, str]]) -> Trajectory:
    trace = [TraceStep(a, r) for a, r in steps]
    return Trajectory(task, [], [], [], [], 0, reward, trace=trace)


def test_call_shape_elides_argument_values():
    assert call_shape('find_holder(name="Ada, Lovelace", x=1)') == "find_holder(name=..., x=...)"
    assert call_shape('f(a={"k": "v=1"}, b=[1, 2])') == "f(a=..., b=...)"
    assert call_shape("g()") == "g()"
    assert call_shape("print(1)\nx = 2") == "print(1)\nx = 2"  # not a call: unchanged


def test_rule_summarizer_writes_the_three_parts_from_successes_and_failures():
    task = _task("insurance", 3)
    win = [('find_holder(name="Ada")', "holder_id=H-1"), ('get_policies(holder_id="H-1")', "P-9")]
    fail = [
        ('find_holder(name="Ada")', "holder_id=H-1"),
        ('cancel(policy_id="P-0")', "Error: unknown policy P-0"),
        ('cancel(policy_id="P-0")', "Error: unknown policy P-0"),
    ]
    trajs = [_traj(task, 0.5, fail), _traj(task, 1.0, win), _traj(task, 0.0, [])]
    text, author = RuleSkillSummarizer().summarize(trajs, success=1.0)
    assert author == "rule"
    assert text.success_analysis == (
        "1 of 3 attempts succeeded by calling find_holder(name=...) -> get_policies(holder_id=...)."
    )
    assert text.mistake_analysis == (
        "cancel(policy_id=...) returned Error: unknown policy P-0; repeating "
        "cancel(policy_id=...) with the same arguments; ending without any tool call."
    )
    assert text.golden_workflow == (
        "1. find_holder(name=...) 2. get_policies(holder_id=...) 3. reply Task Completed once "
        "every change is made."
    )
    none, _ = RuleSkillSummarizer().summarize([_traj(task, 0.25, fail[:1])], success=1.0)
    assert none.success_analysis.startswith("No attempt succeeded; the best (reward 0.25)")
    assert none.mistake_analysis.startswith("stopping before the task is done")
    with pytest.raises(ValueError, match="at least one"):
        RuleSkillSummarizer().summarize([], success=1.0)


def test_parse_skill_text_needs_all_three_parts():
    text = (
        "Sure.\n**What works:** look up first.\n**Suggested workflow:** 1. find 2. update\n"
        "what to avoid: guessing ids\n"
    )
    assert parse_skill_text(text) == SkillText(
        "look up first.", "guessing ids", "1. find 2. update"
    )
    assert parse_skill_text("What works: x\nWhat to avoid: y") is None
    assert parse_skill_text("What works: x\nWhat to avoid:\nSuggested workflow: z") is None
    assert parse_skill_text("") is None
