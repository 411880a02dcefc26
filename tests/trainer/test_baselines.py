"""Baselines (GRPO, OPSD, SDPO, SDFT, Skill-SD) and LOPD ablations: losses against hand-written
references on a real toy batch of the tiny model, rollout-budget accounting, method state across
a checkpoint, and the ``--quick`` comparison (pure pieces of SDFT and Skill-SD:
``tests/trainer/test_skills.py``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math

import pytest
import torch

from lopd.config import ConfigError, load_config
from lopd.latent.experience import Experience
from lopd.methods import METHODS, GRPOMethod, SDFTMethod, SDPOMethod, SkillSDMethod
from lopd.methods.ema import ema_update_
from lopd.methods.groups import group_advantages, group_rollouts, ppo_clip_loss
from lopd.methods.opsd import OPSD_SYSTEM_TEMPLATE
from lopd.methods.sdft import SDFT_USER_TEMPLATE
from lopd.methods.sdpo import SDPO_USER_TEMPLATE
from lopd.methods.skills import (
    ModelSkillSummarizer,
    RuleSkillSummarizer,
    SkillText,
    parse_skill_text,
    skill_agreement,
)
from lopd.methods.text_teacher import build_text_teacher_sequence
from lopd.run.seeds import Stream
from lopd.run.tasks import TaskSampler
from lopd.trainer import Trainer
from lopd.types import TraceStep


# ----------------------------------------------------------------------------- pure pieces
def test_group_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.3])
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 2, 2, 9, 9, 4])  # ids need not be contiguous
    eps = 1e-4
    # group 7: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 2: all equal -> 0; group 9: mean 0.5, std sqrt(0.5) ; group 4: singleton -> 0
    s9 = math.sqrt(0.5)
    expected = [0.75 / (0.5 + eps)] + [-0.25 / (0.5 + eps)] * 3 + [0.0] * 4
    expected += [0.5 / (s9 + eps), -0.5 / (s9 + eps), 0.0]
    torch.testing.assert_close(
        group_advantages(rewards, groups, eps=eps), torch.tensor(expected), atol=1e-6, rtol=0
    )
    with pytest.raises(ValueError, match="rewards and groups"):
        group_advantages(rewards, groups[:3])


def test_ppo_clip_values_and_gradients_match_hand_computation():
    logp_old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
    rho = torch.tensor([0.5, 1.0, 1.5, 0.5, 1.5])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    logp = (logp_old + rho.log()).requires_grad_(True)
    loss = ppo_clip_loss(logp, logp_old, adv, clip_eps=0.2)
    # -min(rho A, clip(rho, 0.8, 1.2) A): clipped branch chosen for tokens 2 and 3 (no gradient)
    torch.testing.assert_close(loss, torch.tensor([-0.5, -1.0, -1.2, 0.8, 1.5]))
    loss.sum().backward()
    # d/dlogp (-rho A) = -rho A where the unclipped branch is chosen, else 0
    torch.testing.assert_close(logp.grad, torch.tensor([-0.5, -1.0, 0.0, 0.0, 1.5]))
    # One update per batch: rho = 1, the gradient is the policy gradient -A.
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ppo_clip_loss(lp, lp.detach(), torch.tensor([2.0, -3.0])).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-2.0, 3.0]))
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_clip_loss(lp, lp, lp, clip_eps=0.0)


def test_ema_update_is_a_convex_step_toward_the_student():
    torch.manual_seed(0)
    teacher, student = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = copy.deepcopy(teacher)
    ema_update_(teacher, student, 0.05)
    for t, t0, s in zip(teacher.parameters(), before.parameters(), student.parameters()):
        torch.testing.assert_close(t, 0.95 * t0 + 0.05 * s)
    with pytest.raises(ValueError, match="rate"):
        ema_update_(teacher, student, 1.5)
    with pytest.raises(ValueError, match="parameter tensors"):
        ema_update_(teacher, torch.nn.Sequential(student, torch.nn.Linear(2, 2)), 0.1)


def test_all_methods_are_registered_with_their_phases():
    from lopd.compare import _RUN_ORDER, ALL_METHODS

    assert ALL_METHODS == (
        "lopd", "lopd-ppo", "grpo", "opsd", "sdpo", "sdft", "skill-sd", "lopd-frozen", "lopd-m0",
    )  # fmt: skip
    assert _RUN_ORDER == (
        "lopd", "lopd-ppo", "lopd-frozen", "lopd-m0", "opsd", "sdft", "grpo", "sdpo", "skill-sd",
    )  # fmt: skip
    composer = {"lopd", "lopd-ppo", "lopd-frozen", "lopd-m0"}
    assert {m for m, s in METHODS.items() if s.uses_composer} == composer
    assert {m for m, s in METHODS.items() if s.builds_bank} == composer | {"opsd", "sdft"}
    cfg = load_config("smoke", overrides=["grpo.group_size=3", "skill_sd.group_size=2"])
    assert METHODS["grpo"].group_size(cfg) == 3 and METHODS["lopd"].group_size(cfg) == 1
    assert METHODS["skill-sd"].group_size(cfg) == 2
    assert all(spec.supports_fsdp2 for spec in METHODS.values())


def test_sdft_and_skill_sd_settings_are_the_papers_and_bad_values_name_the_field():
    paper = load_config("paper")
    assert (paper.sdft.ema_rate, paper.sdft.top_m, paper.sdft.divergence) == (0.01, None, "forward")
    s = paper.skill_sd
    assert (s.group_size, s.clip_eps_low, s.clip_eps_high, s.sdl_weight) == (4, 0.2, 0.28, 0.001)
    assert s.ucb_c == math.sqrt(2.0) and s.summarizer == "model"
    assert load_config("default").skill_sd.summarizer == "rule"  # the tiny model's stand-in
    for override in (
        "sdft.ema_rate=1.5", "sdft.top_m=0", "sdft.divergence=up", "skill_sd.group_size=0",
        "skill_sd.clip_eps_low=0", "skill_sd.clip_eps_high=-0.1", "skill_sd.sdl_weight=-1",
        "skill_sd.ucb_c=-1", "skill_sd.teacher_sync_every=0", "skill_sd.summarizer=oracle",
        "skill_sd.summary_max_tokens=0", "skill_sd.max_skills=0",
    ):  # fmt: skip
        field = override.split("=")[0]
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("smoke", overrides=[override]).validate()


# ----------------------------------------------------------------------------- real toy batch
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The tiny model with the smoke bank (6 base-model rollouts), no composer."""
    run_dir = tmp_path_factory.mktemp("baselines")
    cfg = load_config("smoke", overrides=[f"run_dir={run_dir}", "train.method=opsd"])
    tr = Trainer(cfg, progress=False)
    tr.setup()
    return tr


@pytest.fixture(scope="module")
def lopd_trainer(trainer):
    """A LOPD trainer on the same run directory: loads the bank, builds the composer."""
    cfg = copy.deepcopy(trainer.cfg)
    cfg.train.method = "lopd"
    tr = Trainer(cfg, progress=False)
    tr.setup()
    return tr


@pytest.fixture(scope="module")
def group(trainer):
    """One group of G = 4 student rollouts of one task (and what it cost the budget)."""
    before = trainer.engine.rollouts
    trajs = group_rollouts(trainer.context, 0, 4, trainer.cfg.train.tasks_per_step)
    return trajs, trainer.engine.rollouts - before


def _full_logits(model, ids, tau=1.0):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double() / tau


def _action_positions(traj):
    return [p for p in range(1, len(traj.input_ids)) if traj.action_mask[p]]


def test_budget_counts_bank_and_every_group_rollout(trainer, group):
    trajs, spent = group
    cfg = trainer.cfg
    assert trainer.experience.bank_rollouts == cfg.data.n_train * cfg.bank.rollouts_per_task
    assert len(trajs) == 4 and spent == 4  # tasks_per_step=2 < G: one group of 4
    assert len({t.task.task_id for t in trajs}) == 1
    assert [t.info["group"] for t in trajs] == [0, 0, 0, 0]


def test_text_teacher_sequence_keeps_the_exact_action_token_map(trainer, group):
    traj = group[0][0]
    cases = (
        (dict(system_suffix="\n\nSYS-REF"), "system"),
        (dict(user_suffix="\n\nUSR-REF"), "user"),
    )
    for kwargs, role in cases:
        seq = build_text_teacher_sequence(trainer.models.tokenizer, traj, **kwargs)
        for p in _action_positions(traj):
            assert seq.input_ids[p + seq.offset] == traj.input_ids[p]
        text = trainer.models.tokenizer.decode(seq.input_ids[: seq.prompt_len])
        content = next(m["content"] for m in traj.messages if m["role"] == role)
        assert content + next(iter(kwargs.values())) in text
    with pytest.raises(ValueError, match="no system message"):
        no_sys = copy.copy(traj)
        no_sys.messages = [m for m in traj.messages if m["role"] != "system"]
        build_text_teacher_sequence(trainer.models.tokenizer, no_sys, system_suffix="x")


def test_grpo_loss_gradient_matches_hand_written_policy_gradient(trainer, group):
    trajs = [copy.deepcopy(t) for t in group[0]]
    for t, r in zip(trajs, [1.0, 0.0, 0.5, 0.0]):
        t.reward = r
    adv = group_advantages(
        torch.tensor([t.reward for t in trajs]), torch.zeros(4, dtype=torch.long)
    )
    for t, a in zip(trajs, adv.tolist()):
        t.info["advantage"] = a
    method, student = GRPOMethod.from_config(trainer.context, trainer.cfg), trainer.models.student
    head = student.get_output_embeddings().weight
    student.zero_grad(set_to_none=True)
    loss, sums = method.loss(trajs, num_total=4)
    loss.backward()
    got = head.grad.clone()
    student.zero_grad(set_to_none=True)
    # Reference: -(1/B) sum_i A_i mean_{p in actions(i)} log softmax(z_{p-1} / tau)[x_p]
    tau = trainer.cfg.gen.temperature
    ref = 0.0
    for t, a in zip(trajs, adv.tolist()):
        logits = student(input_ids=torch.tensor([t.input_ids])).logits[0].float() / tau
        pos = torch.tensor(_action_positions(t))
        logp = torch.log_softmax(logits[pos - 1], -1).gather(
            1, torch.tensor(t.input_ids)[pos, None]
        )
        ref = ref - a * logp.mean() / 4
    ref.backward()
    torch.testing.assert_close(got, head.grad, atol=1e-5, rtol=1e-4)
    student.zero_grad(set_to_none=True)
    assert loss.item() == pytest.approx(-float(adv.mean()), abs=1e-6)  # ratio 1: value -mean A
    assert sums["clip_fraction"] == 0.0


def _reverse_topk_tail(s_logits, t_logits, top_m):
    """KL(student || teacher) over the teacher's top-M ids plus one tail bucket, per row."""
    ls, lt = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    top = t_logits.topk(top_m, -1).indices
    s_top, t_top = ls.gather(-1, top), lt.gather(-1, top)
    s_tail = torch.log1p(-s_top.exp().sum(-1).clamp(max=1 - 1e-12))
    t_tail = torch.log1p(-t_top.exp().sum(-1).clamp(max=1 - 1e-12))
    s_b, t_b = torch.cat([s_top, s_tail[:, None]], -1), torch.cat([t_top, t_tail[:, None]], -1)
    return (s_b.exp() * (s_b - t_b)).sum(-1)


def test_opsd_is_forward_kl_over_the_full_vocabulary_against_the_frozen_base(trainer, group):
    trajs = group[0][:2]
    method, models = trainer.method, trainer.models  # the fixture's method is opsd
    loss, sums = method.loss(trajs, num_total=2)
    ref = []
    for t in trajs:
        gt = trainer.experience.retrieved[t.task.task_id][0]
        seq = method.teacher_sequence(t)
        prompt_text = models.tokenizer.decode(seq.input_ids[: seq.prompt_len])
        assert OPSD_SYSTEM_TEMPLATE.format(gt_text=gt).strip() in prompt_text
        pos = torch.tensor(_action_positions(t))
        s = _full_logits(models.student, t.input_ids)[pos - 1]
        tt = _full_logits(models.backbone, seq.input_ids)[pos - 1 + seq.offset]
        lp_s, lp_t = torch.log_softmax(s, -1), torch.log_softmax(tt, -1)
        ref.append((lp_t.exp() * (lp_t - lp_s)).sum(-1).mean())  # KL(teacher || student)
    assert loss.item() == pytest.approx(float(sum(ref) / 2), rel=1e-4, abs=1e-6)
    assert sums["teacher_top_m_mass"] == pytest.approx(2.0)  # full vocabulary: all mass


def test_sdpo_sibling_selection_reverse_topk_kl_and_ema(trainer, group):
    trajs = [copy.deepcopy(t) for t in group[0]]
    rewards = [1.0, 0.0, 1.0, 0.0]
    cfg = copy.deepcopy(trainer.cfg)
    cfg.bank.min_reward = 1.0  # the success criterion (the smoke preset's is 0)
    method, models = SDPOMethod.from_config(trainer.context, cfg), trainer.models
    # Re-run the sibling choice of the rollouts hook on this group with known rewards.
    for t, r in zip(trajs, rewards):
        t.reward = r
    method.pick_siblings(trajs, 0)
    traces = [t.trace_text() or "(no tool calls)" for t in trajs]
    assert trajs[0].info["sibling_text"] == traces[2]  # a success never uses itself
    assert trajs[2].info["sibling_text"] == traces[0]
    assert trajs[1].info["sibling_text"] in (traces[0], traces[2])
    for t in trajs:
        t.reward = 0.0
    method.pick_siblings(trajs, 0)
    assert all(t.info["sibling_text"] is None for t in trajs)  # no success: nothing to distill
    loss0, sums0 = method.loss(trajs, num_total=4)
    assert loss0.item() == 0.0 and sums0["distilled"] == 0.0

    for t, r in zip(trajs, rewards):
        t.reward = r
    method.pick_siblings(trajs, 0)
    loss, sums = method.loss(trajs, num_total=4)
    assert sums["distilled"] == 4.0
    top_m = trainer.cfg.lopd.top_m
    ref = []
    for t in trajs:
        seq = method.teacher_sequence(t)
        solution = SDPO_USER_TEMPLATE.format(solution=t.info["sibling_text"]).strip()
        assert solution in models.tokenizer.decode(seq.input_ids[: seq.prompt_len])
        pos = torch.tensor(_action_positions(t))
        s = _full_logits(models.student, t.input_ids)[pos - 1]
        tt = _full_logits(method.teacher.get(), seq.input_ids)[pos - 1 + seq.offset]
        ref.append(_reverse_topk_tail(s, tt, top_m).mean())
    assert loss.item() == pytest.approx(float(sum(ref) / 4), rel=1e-4, abs=1e-6)

    # EMA: after a step the teacher moves 5% of the way to the (changed) student.
    _assert_ema_step(method, models.student, rate=0.05)


def _assert_ema_step(method, student, rate):
    """After ``method.after_step`` the EMA teacher is ``(1 - rate) * old + rate * student``
    (checked with a student moved by +0.1 everywhere; the student is restored afterwards)."""
    teacher0 = copy.deepcopy(method.teacher.get())
    saved = copy.deepcopy(student.state_dict())
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.1)
    method.after_step({})
    for t, t0, s in zip(
        method.teacher.get().parameters(), teacher0.parameters(), student.parameters()
    ):
        torch.testing.assert_close(t, (1 - rate) * t0 + rate * s)
    student.load_state_dict(saved)


def _forward_and_reverse_kl(s_logits, t_logits):
    """Per-row KL(teacher || student) and KL(student || teacher) over the full vocabulary."""
    ls, lt = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    return (lt.exp() * (lt - ls)).sum(-1), (ls.exp() * (ls - lt)).sum(-1)


def test_sdft_is_forward_kl_to_an_ema_teacher_with_the_demo_in_the_first_user_message(
    trainer, group
):
    trajs = group[0][:2]
    models = trainer.models
    method = SDFTMethod.from_config(trainer.context, trainer.cfg)
    assert method.teacher.rate == 0.01 and method.spec.top_m is None
    with torch.no_grad():  # an EMA teacher that has drifted from the student
        for p in method.teacher.get().parameters():
            p.add_(0.02 * torch.randn_like(p))
    loss, sums = method.loss(trajs, num_total=2)
    fwd, rev = [], []
    for t in trajs:
        demo, own = method.demonstration(t.task.task_id)
        assert own and demo == method.own_demos[t.task.task_id]
        seq = method.teacher_sequence(t)
        prompt = models.tokenizer.decode(seq.input_ids[: seq.prompt_len])
        user = next(m["content"] for m in t.messages if m["role"] == "user")
        system = next(m["content"] for m in t.messages if m["role"] == "system")
        # In the first user message, right after its text; the system message is untouched.
        assert user + SDFT_USER_TEMPLATE.format(demo_text=demo) in prompt
        assert system + SDFT_USER_TEMPLATE.format(demo_text=demo)[:20] not in prompt
        pos = torch.tensor(_action_positions(t))
        s = _full_logits(models.student, t.input_ids)[pos - 1]
        tt = _full_logits(method.teacher.get(), seq.input_ids)[pos - 1 + seq.offset]
        f, r = _forward_and_reverse_kl(s, tt)
        fwd.append(f.mean())
        rev.append(r.mean())
    assert loss.item() == pytest.approx(float(sum(fwd) / 2), rel=1e-4, abs=1e-6)
    assert abs(float(sum(rev) - sum(fwd))) / 2 > 1e-2  # the direction is distinguishable
    assert sums["teacher_top_m_mass"] == pytest.approx(2.0) and sums["demo_own_task"] == 2.0

    # EMA: after the step the teacher moves 1% of the way to the (changed) student.
    _assert_ema_step(method, models.student, rate=0.01)


def test_sdft_demo_is_the_tasks_best_pool_trajectory_else_the_nearest_other_task(trainer, group):
    traj = group[0][0]
    task_id = traj.task.task_id
    win, half = copy.deepcopy(traj), copy.deepcopy(traj)
    win.reward, win.trace = 1.0, [TraceStep('a(x="1")', "ok"), TraceStep('b(y="2")', "done")]
    half.reward, half.trace = 0.5, [TraceStep('c(z="3")', "meh")]
    other = copy.deepcopy(traj)
    other.task = dataclasses.replace(traj.task, task_id="someone-else")
    retrieved = trainer.experience.retrieved
    pool = Experience(0, [half, win, other], retrieved)
    method = SDFTMethod.from_config(
        dataclasses.replace(trainer.context, experience=pool), trainer.cfg
    )
    assert method.demonstration(task_id) == (win.trace_text(), True)  # the best, not the first
    without = Experience(0, [other], retrieved)
    method = SDFTMethod.from_config(
        dataclasses.replace(trainer.context, experience=without), trainer.cfg
    )
    assert method.demonstration(task_id) == (retrieved[task_id][0], False)
    with pytest.raises(ValueError, match="shared pool"):
        SDFTMethod.from_config(dataclasses.replace(trainer.context, experience=None), trainer.cfg)


def _skill_sd(trainer, **changes):
    cfg = copy.deepcopy(trainer.cfg)
    cfg.bank.min_reward = 1.0  # the success criterion (the smoke preset's is 0)
    for k, v in changes.items():
        setattr(cfg.skill_sd, k, v)
    return SkillSDMethod.from_config(trainer.context, cfg), cfg


def test_skill_sd_loss_is_ppo_clip_plus_importance_weighted_reverse_kl(trainer, group):
    trajs = [copy.deepcopy(t) for t in group[0]]
    lam = 0.5  # large, so the distillation term is visible in the gradient (paper: 0.001)
    method, cfg = _skill_sd(trainer, sdl_weight=lam)
    models, student = trainer.models, trainer.models.student
    rewards = [1.0, 0.0, 1.0, 0.0]
    adv = group_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long))
    skill = SkillText("look the holder up first", "guessing ids", "1. find_holder 2. update")
    for k, (t, r, a) in enumerate(zip(trajs, rewards, adv.tolist())):
        t.reward, t.info["advantage"] = r, a
        guided = k < 3  # the last rollout has no skill: PPO only
        t.info["skill_id"] = 7 if guided else None
        t.info["step_group"] = 0
        t.info["skill_text"] = skill.render() if guided else None
    head = student.get_output_embeddings().weight
    student.zero_grad(set_to_none=True)
    loss, sums = method.loss(trajs, num_total=4)
    loss.backward()
    got = head.grad.clone()
    student.zero_grad(set_to_none=True)
    # Reference, per trajectory i (ratio 1): mean_t [-A_i logp + lam sg(logp - logp_T) logp]
    # for the gradient and mean_t [-A_i + lam (logp - logp_T)] for the value, over B = 4.
    tau = cfg.gen.temperature
    surrogate, value, log_ratios = 0.0, 0.0, []
    for t, a in zip(trajs, adv.tolist()):
        pos = torch.tensor(_action_positions(t))
        targets = torch.tensor(t.input_ids)[pos, None]
        logits = student(input_ids=torch.tensor([t.input_ids])).logits[0].float() / tau
        logp = torch.log_softmax(logits[pos - 1], -1).gather(1, targets)[:, 0]
        surrogate = surrogate - a * logp.mean() / 4
        value += -a / 4
        if t.info["skill_text"] is None:
            continue
        seq = build_text_teacher_sequence(models.tokenizer, t, user_suffix=skill.render())
        assert seq.input_ids == method.teacher_sequence(t).input_ids
        prompt = models.tokenizer.decode(seq.input_ids[: seq.prompt_len])
        assert "Here is a skill summary from a similar past task" in prompt
        assert "**What works:** look the holder up first" in prompt
        with torch.no_grad():  # the teacher is the current student, conditioned on the skill
            lt = torch.log_softmax(
                student(input_ids=torch.tensor([seq.input_ids]))
                .logits[0]
                .float()[pos - 1 + seq.offset]
                / tau,
                -1,
            ).gather(1, targets)[:, 0]
        kl = logp.detach() - lt
        surrogate = surrogate + lam * (kl * logp).mean() / 4
        value += lam * float(kl.mean()) / 4
        log_ratios.append(float(-kl.mean()))
    surrogate.backward()
    torch.testing.assert_close(got, head.grad, atol=1e-5, rtol=1e-4)
    student.zero_grad(set_to_none=True)
    assert loss.item() == pytest.approx(value, rel=1e-4, abs=1e-6)
    assert sums["skill_guided"] == 3.0 and sums["clip_fraction"] == 0.0
    assert sums["kl"] == pytest.approx(-sum(log_ratios), rel=1e-4)
    # What the bandit will be told: one record per guided rollout.
    assert [(r[2], r[3]) for r in method.records] == [(7, 1.0), (7, 0.0), (7, 1.0)]
    assert [r[4] for r in method.records] == pytest.approx(log_ratios, rel=1e-4, abs=1e-6)


def test_skill_sd_steps_choose_by_ucb1_reward_the_pull_and_grow_the_bank(trainer):
    method, cfg = _skill_sd(trainer)
    ctx, success = trainer.context, cfg.bank.min_reward
    trajs = method.rollouts(0)  # one task, G = 4 rollouts; the bank is empty
    assert len(trajs) == 4 and all(t.info["skill_text"] is None for t in trajs)
    _, sums = method.loss(trajs, num_total=4)
    assert sums["skill_guided"] == 0.0 and sums["kl"] == 0.0
    out = method.after_step({})
    assert (out["skills"], out["skill_pulls"], out["skills_new"]) == (1.0, 0.0, 1.0)
    written = method.bank.skills[0]
    assert (written.source_task_id, written.step, written.author) == (
        trajs[0].task.task_id,
        0,
        "rule",
    )
    assert written.text == RuleSkillSummarizer().summarize(trajs, success)[0]

    # A skill of another task of step 1's world: with the step-0 skill (if of that world) both
    # are unpulled, so UCB1 takes the oldest candidate.
    nxt = ctx.step_tasks(1, 1)[0]
    planted = method.bank.add(
        dataclasses.replace(nxt, task_id="elsewhere"), SkillText("w", "a", "g"), "rule", 0
    )
    cands = [
        s for s in method.bank.skills if s.world == nxt.world and s.source_task_id != nxt.task_id
    ]
    expected = min(s.skill_id for s in cands)
    trajs = method.rollouts(1)
    assert all(t.task.task_id == nxt.task_id for t in trajs)
    chosen = method.bank.get(expected)
    assert all(t.info["skill_id"] == expected for t in trajs)
    assert all(t.info["skill_text"] == chosen.text.render() for t in trajs)
    method.loss(trajs, num_total=4)
    recs = list(method.records)
    assert len(recs) == 4 and {r[2] for r in recs} == {expected}
    reward = skill_agreement([r[3] for r in recs], [r[4] for r in recs], success)
    out = method.after_step({})
    assert (chosen.pulls, chosen.reward_sum) == (1, reward)
    assert out["skill_pulls"] == 1.0 and out["skill_bandit_reward"] == reward
    assert out["skills"] == 3.0 and method.bank.skills[-1].step == 1
    assert planted.pulls == (1 if expected == planted.skill_id else 0)
    assert method.records == [] and method.pending_skills == []


def test_skill_sd_model_summarizer_writes_greedily_and_falls_back_to_the_rule(trainer, group):
    trajs = [copy.deepcopy(t) for t in group[0]]
    for t, r in zip(trajs, [1.0, 0.0, 1.0, 0.0]):
        t.reward = r
    models = trainer.models
    writer = ModelSkillSummarizer(models.student, models.tokenizer, max_new_tokens=12)
    request = writer.request(trajs, success=1.0)
    assert "Successful attempts:\nAttempt 1 (reward 1.00)" in request
    assert "Failed attempts:\nAttempt 1 (reward 0.00)" in request
    raw = writer.write(trajs, success=1.0)
    assert raw == writer.write(trajs, success=1.0)  # greedy: deterministic
    assert models.student.training  # the student's mode is restored
    text, author = writer.summarize(trajs, success=1.0)
    if parse_skill_text(raw) is None:  # the tiny model cannot write the three parts
        assert author == "rule" and writer.fallbacks == 1
        assert text == RuleSkillSummarizer().summarize(trajs, 1.0)[0]
    else:
        assert author == "model" and text == parse_skill_text(raw)


def test_skill_sd_on_one_of_two_ranks_takes_its_share_of_the_whole_steps_choices(trainer):
    # Rank 1 of 2 chooses for the whole step's task list and keeps every second choice: the
    # skills one process would give the same tasks (tests/distributed/test_distributed_methods.py
    # runs it under torchrun).
    cfg = copy.deepcopy(trainer.cfg)
    cfg.train.tasks_per_step = 2 * cfg.skill_sd.group_size  # two groups: one per rank
    bank = SkillSDMethod.from_config(trainer.context, cfg).bank
    for task in trainer.train_tasks:
        bank.add(dataclasses.replace(task, task_id=f"{task.task_id}-src"),
                 SkillText("w", "a", "g"), "rule", 0)  # fmt: skip
    everyone = TaskSampler(cfg.seed).draw(trainer.train_tasks, 2, Stream.STEP_TASKS, 3)
    whole = bank.select(everyone)
    assert all(s is not None for s in whole)
    ctx = dataclasses.replace(trainer.context, sampler=TaskSampler(cfg.seed, rank=1, world=2))
    share = SkillSDMethod.from_config(ctx, cfg)
    share.bank.load_state_dict(bank.state_dict())
    trajs = share.rollouts(3)
    assert len(trajs) == cfg.skill_sd.group_size
    assert {t.task.task_id for t in trajs} == {everyone[1].task_id}
    assert {t.info["skill_id"] for t in trajs} == {whole[1].skill_id}
    assert {t.info["step_group"] for t in trajs} == {1}  # its one group is the step's second


def test_lopd_m0_is_lopd_with_margin_zero(lopd_trainer):
    tr = lopd_trainer
    method = METHODS["lopd-m0"].build(tr.context, tr.cfg)
    assert method.beta == 0.0
    out = method.after_step({"delta": -0.1})
    assert out["beta_next"] == pytest.approx(tr.cfg.lopd.dual_lr * (0.0 + 0.1))  # m = 0
    assert tr.cfg.lopd.margin == 0.05 and tr.method.settings.lopd.margin == 0.05
    assert method.state_dict() == {"beta": out["beta_next"]}


def test_lopd_frozen_reads_c_phi0_and_gives_the_composer_no_gradient(lopd_trainer):
    tr = lopd_trainer
    method = METHODS["lopd-frozen"].build(tr.context, tr.cfg)
    tasks = tr.train_tasks[:2]
    lat = method.latents(tasks)
    torch.testing.assert_close(lat, method.cached_latents0(tasks))
    assert not lat.requires_grad
    traj = group_rollouts(tr.context, 0, 2, tr.cfg.train.tasks_per_step)
    composer = tr.models.composer
    composer.zero_grad(set_to_none=True)  # the cold start's last gradients
    loss, sums = method.loss(traj, num_total=2)
    loss.backward()
    assert all(p.grad is None for p in composer.trainable_parameters())
    assert sums["anchor"] == 0.0
    assert any(p.grad is not None for p in tr.models.student.parameters())


def test_the_held_out_log_names_the_method_whose_student_is_evaluated(trainer, capsys):
    # The summary's key is ``lopd`` for every method's student; the log line names the method.
    result = trainer.evaluate("lopd")
    out = capsys.readouterr().out
    assert f"eval opsd student: reward {result['reward_mean']:.3f}" in out
    assert "eval lopd" not in out


# ----------------------------------------------------------------------------- compare
def test_a5_runs_are_the_text_teachers_in_lopds_framing_and_run_by_default():
    from lopd.compare import A5_METHODS, DEFAULT_RUNS, resolve_run
    from lopd.eval.compare_report import _report_order

    assert A5_METHODS == ("opsd", "sdpo", "sdft", "skill-sd")
    assert DEFAULT_RUNS[-4:] == ("opsd-a5", "sdpo-a5", "sdft-a5", "skill-sd-a5")
    assert resolve_run("sdft-a5") == ("sdft", ["lopd.context_format=a5"])
    assert resolve_run("sdft") == ("sdft", [])
    for bad in ("grpo-a5", "lopd-a5", "lopd-frozen-a5", "sdft-a6"):
        with pytest.raises(ValueError, match="unknown method"):
            resolve_run(bad)
    order = sorted(["skill-sd-a5", "lopd-m0.02", "sdft", "opsd-a5", "opsd"], key=_report_order)
    assert order == ["opsd", "opsd-a5", "sdft", "skill-sd-a5", "lopd-m0.02"]


def test_quick_compare_spends_equal_budgets_and_writes_the_report(tmp_path, capsys):
    from lopd.compare import main

    out = tmp_path / "cmp"
    methods = ["lopd", "grpo", "sdft", "skill-sd"]
    rc = main(["--quick", "--out", str(out), "--methods", *methods, "--jobs", "1"])
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "| vanilla (no training) |" in report
    assert all(f"| {m} |" in report for m in methods)
    assert "LOPD vs grpo" in report and "GRPO's final reward" in report
    assert "LOPD vs sdft" in report and "LOPD vs skill-sd" in report
    assert "Skill-SD's final reward" in report
    assert (out / "learning_curve.png").stat().st_size > 1000
    runs = json.loads((out / "results.json").read_text())["runs"]
    budget = 16
    for r in runs:
        assert r["error"] is None
        # bank (8) + 2 LOPD / SDFT steps x 4 == 4 GRPO / Skill-SD steps x 4
        assert r["rollouts"] == budget
        xs = [x for x, _ in r["curve"]]
        assert xs == sorted(xs) and xs[-1] == budget
        metrics = out / "runs" / f"{r['method']}-seed0" / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        per_step = [b["rollouts"] - a["rollouts"] for a, b in itertools.pairwise(rows)]
        assert per_step and all(d == 4 for d in per_step)  # every generated rollout counted
        sec = r["step_seconds"]
        assert sec["step"] == pytest.approx(sum(x["seconds_step"] for x in rows) / len(rows))
        assert 0 < sec["rollout"] + sec["loss_backward"] <= sec["step"]
    assert "s / step (rollout + loss & backward)" in report
    assert "## The teachers" in report and "| sdft | " in report.split("## The teachers")[1]
    teachers = {r["method"]: r.get("teacher") for r in runs}
    assert teachers["grpo"] is None and len(teachers["sdft"]["kl"]) == 2
    assert teachers["sdft"]["kl"][0] > 0  # SDFT distils from its first step
    steps = {r["method"]: (r["steps"], r["bank_rollouts"]) for r in runs}
    assert steps == {"lopd": (2, 8), "sdft": (2, 8), "grpo": (4, 0), "skill-sd": (4, 0)}
    skill_rows = (out / "runs" / "skill-sd-seed0" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(skill_rows[-1])["skills"] == 4.0  # one skill per step's task group
    lopd_rows = (out / "runs" / "lopd-seed0" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x)["margin"] == 0.05 for x in lopd_rows)  # the run records its m

    # A stopped comparison keeps what it finished: --from-runs rebuilds the same results from
    # the run directories alone, and names an unfinished run instead of failing on it.
    (out / "runs" / "sdpo-seed0").mkdir()
    rc = main(["--quick", "--from-runs", str(out)])
    assert rc == 0
    again = json.loads((out / "results.json").read_text())["runs"]
    keys = ("method", "seed", "steps", "rollouts", "bank_rollouts", "curve", "final", "teacher")
    assert [{k: r.get(k) for k in keys} for r in again] == [
        {k: r.get(k) for k in keys} for r in runs
    ]
    assert [r.get("dual") for r in again] == [r.get("dual") for r in runs]
    assert "| lopd |" in (out / "report.md").read_text()
    # --out puts the report elsewhere and leaves the runs' folder as it was.
    before = (out / "results.json").read_bytes()
    assert main(["--quick", "--from-runs", str(out), "--out", str(out / "elsewhere")]) == 0
    assert (out / "results.json").read_bytes() == before
    moved = json.loads((out / "elsewhere" / "results.json").read_text())["runs"]
    assert [r["method"] for r in moved] == [r["method"] for r in again]
    # Runs of two comparisons merge into one report (each folder's runs, no symlinks needed).
    second = tmp_path / "second" / "runs"
    second.mkdir(parents=True)
    for name in ("grpo-seed0", "sdft-seed0"):
        (out / "runs" / name).rename(second / name)
    merged = tmp_path / "merged"
    argv = ["--quick", "--from-runs", str(out), "--from-runs", str(second.parent)]
    assert main([*argv, "--out", str(merged)]) == 0
    both = json.loads((merged / "results.json").read_text())["runs"]
    assert [{k: r.get(k) for k in keys} for r in both] == [
        {k: r.get(k) for k in keys} for r in runs
    ]
    # A run found in two of the folders would be counted twice: one line, nothing written.
    capsys.readouterr()
    (merged / "report.md").unlink()
    assert main([*argv, "--from-runs", str(out), "--out", str(merged)]) == 2
    err = [e for e in capsys.readouterr().err.splitlines() if not e.startswith("[compare]")]
    assert len(err) == 1 and "lopd-seed0 is also in" in err[0], err  # [compare]: unfinished runs
    assert not (merged / "report.md").exists()


def test_answers_compute_the_rollout_fraction_and_ablation_verdict():
    from lopd.eval.compare_report import answers

    def run(method, seed, curve):
        final = {"reward_mean": curve[-1][1], "reward_stderr": 0.0, "success_rate": 0.0, "n": 4}
        return {"method": method, "seed": seed, "curve": curve, "final": final, "error": None}

    results = []
    for seed, shift in ((0, 0.0), (1, 0.02)):
        results += [
            run("grpo", seed, [[0, 0.1], [24, 0.2 + shift], [48, 0.3 + shift]]),
            run("lopd", seed, [[0, 0.1], [24, 0.1], [36, 0.35 + shift], [48, 0.4 + shift]]),
            run("lopd-frozen", seed, [[0, 0.1], [48, 0.3 + shift]]),
            run("lopd-m0", seed, [[0, 0.1], [48, 0.2 + 2 * shift]]),
        ]
    text = "\n".join(answers(results))
    # GRPO final mean 0.31 at 48; LOPD's mean curve first reaches it at 36 -> 75 %.
    assert "36 rollouts (bank included) = 75% of GRPO's" in text
    assert "LOPD − grpo = 0.100 ± 0.000" in text
    assert "lopd-m0 − lopd-frozen = -0.090 ± 0.010" in text and "→ yes" in text


def test_sdpo_ema_teacher_survives_a_checkpoint(tmp_path):
    """A resumed SDPO run continues with the saved EMA teacher, not a copy of the student."""
    cfg = load_config("smoke", overrides=[f"run_dir={tmp_path}", "train.method=sdpo"])
    tr = Trainer(cfg, progress=False)
    tr.setup()  # SDPO needs no bank: model and tasks only
    with torch.no_grad():
        for p in tr.method.teacher.get().parameters():
            p.add_(0.25)  # an EMA teacher that has drifted from the student
    expected = copy.deepcopy(tr.method.teacher.get().state_dict())
    tr.save_checkpoint(step=7)
    fresh = Trainer(copy.deepcopy(cfg), progress=False)
    fresh.setup()
    assert fresh.method.teacher.model is None
    assert fresh.load_checkpoint() == 7
    teacher = fresh.method.teacher.model
    assert teacher is not None and not teacher.training
    for name, value in teacher.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert not any(p.requires_grad for p in teacher.parameters())


def test_skill_sd_skill_bank_ucb_statistics_and_teacher_survive_a_resume(tmp_path):
    """Steps 0-3 straight equal steps 0-1, a checkpoint, a fresh process state, steps 2-3."""
    overrides = [
        "train.method=skill-sd", "train.tasks_per_step=4", "skill_sd.group_size=2",
        "skill_sd.teacher_sync_every=2",  # a teacher copy, synced after steps 1 and 3
    ]  # fmt: skip

    def run(run_dir, steps, resume=False):
        cfg = load_config("smoke", overrides=[f"run_dir={run_dir}", *overrides])
        tr = Trainer(cfg, progress=False)
        tr.setup()
        start = tr.load_checkpoint() if resume else 0
        rows = []
        for step in range(start, steps):
            m = tr.train_step(step)
            rows.append({k: v for k, v in m.items() if not k.startswith("seconds_")})
            if step + 1 == 2:
                tr.save_checkpoint(2)
        return tr, rows

    straight, rows = run(tmp_path / "a", 4)
    _, first = run(tmp_path / "b", 2)
    resumed, second = run(tmp_path / "b", 4, resume=True)
    assert first + second == rows
    bank = straight.method.bank.state_dict()
    assert resumed.method.bank.state_dict() == bank
    # The run exercised the bandit after the resume: skills were chosen and rewarded.
    assert sum(r["skill_pulls"] for r in rows[2:]) > 0 and rows[-1]["skills"] == 8.0
    assert sum(s["pulls"] for s in bank["skills"]) == sum(r["skill_pulls"] for r in rows)
    for name, value in resumed.method.teacher.get().state_dict().items():
        torch.testing.assert_close(
            value, straight.method.teacher.get().state_dict()[name], rtol=0, atol=0, msg=name
        )
