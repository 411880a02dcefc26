"""A teacher's privileged context: its information and its wording.

The null-context control (``lopd.null_context``): every teacher keeps its template and loses
its information: OPSD's, SDFT's and SDPO's reference text and Skill-SD's skill parts are empty,
LOPD's teacher reads zero latents (no gradient to the composer, a zero anchor); GRPO, which has
no teacher, is refused in one line; a whole comparison runs with it.

The shared wording (``lopd.context_format=a5``): every text teacher reads its reference in
LOPD's A.5 framing instead of its own template; with ``null_context`` too, the framing is empty."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from lopd.config import ConfigError, load_config
from lopd.eval.held_out import HeldOutEvaluator
from lopd.latent.injection import frame_with_references
from lopd.methods import METHODS, OPSDMethod, SDFTMethod, SDPOMethod, SkillSDMethod
from lopd.methods.groups import group_rollouts
from lopd.methods.opsd import OPSD_SYSTEM_TEMPLATE
from lopd.methods.sdft import SDFT_USER_TEMPLATE
from lopd.methods.sdpo import SDPO_USER_TEMPLATE
from lopd.methods.skills import SkillText
from lopd.trainer import Trainer


@pytest.fixture(scope="module")
def lopd_trainer(tmp_path_factory):
    """The tiny model with the smoke bank and the composer (LOPD's phases)."""
    run_dir = tmp_path_factory.mktemp("null-context")
    cfg = load_config("smoke", overrides=[f"run_dir={run_dir}", "train.method=lopd"])
    tr = Trainer(cfg, progress=False)
    tr.setup()
    return tr


@pytest.fixture(scope="module")
def trajs(lopd_trainer):
    tr = lopd_trainer
    return group_rollouts(tr.context, 0, 2, tr.cfg.train.tasks_per_step)


def _contexts(tr):
    return tr.context, dataclasses.replace(tr.context, null_context=True)


def _prompt(tr, seq):
    return tr.models.tokenizer.decode(seq.input_ids[: seq.prompt_len])


def _action_tokens_unchanged(traj, seq):
    return all(
        seq.input_ids[p + seq.offset] == traj.input_ids[p]
        for p in range(traj.prompt_len, len(traj.input_ids))
    )


def test_text_teachers_keep_the_template_and_lose_the_reference(lopd_trainer, trajs):
    tr = lopd_trainer
    cfg = copy.deepcopy(tr.cfg)
    cfg.bank.min_reward = 1.0
    traj = copy.deepcopy(trajs[0])
    traj.info["sibling_text"] = 'find_holder(name="x")'
    task_id = traj.task.task_id
    full, null = _contexts(tr)
    cases = (
        (OPSDMethod, OPSD_SYSTEM_TEMPLATE, "gt_text", lambda m: m.retrieved[task_id][0]),
        (SDFTMethod, SDFT_USER_TEMPLATE, "demo_text", lambda m: m.demonstration(task_id)[0]),
        (SDPOMethod, SDPO_USER_TEMPLATE, "solution", lambda m: traj.info["sibling_text"]),
    )
    for cls, template, slot, reference in cases:
        with_ref, without = cls.from_config(full, cfg), cls.from_config(null, cfg)
        ref = reference(with_ref)
        assert ref.strip()  # there is something to remove
        seq, seq0 = with_ref.teacher_sequence(traj), without.teacher_sequence(traj)
        prompt, prompt0 = _prompt(tr, seq), _prompt(tr, seq0)
        assert template.format(**{slot: ref}).strip() in prompt, cls.__name__
        assert template.format(**{slot: ""}).strip() in prompt0, cls.__name__
        assert ref not in prompt0, cls.__name__
        assert _action_tokens_unchanged(traj, seq0)


def test_a5_puts_every_text_teachers_reference_in_lopds_framing(lopd_trainer, trajs):
    tr = lopd_trainer
    cfg = copy.deepcopy(tr.cfg)
    cfg.bank.min_reward = 1.0
    own_ctx = tr.context
    a5 = dataclasses.replace(own_ctx, context_format="a5")
    a5_null = dataclasses.replace(a5, null_context=True)
    traj = copy.deepcopy(trajs[0])
    task_id, user = traj.task.task_id, traj.messages[1]["content"]
    sibling = copy.deepcopy(trajs[1])
    skill = SkillText("look the holder up first", "guessing ids", "1. find_holder 2. update")

    def skill_text():
        return traj.info["skill_text"]

    cases = (
        (OPSDMethod, lambda: OPSD_SYSTEM_TEMPLATE.split("{")[0], lambda m: m.retrieved[task_id][0]),
        (
            SDFTMethod,
            lambda: SDFT_USER_TEMPLATE.split("{")[0],
            lambda m: m.demonstration(task_id)[0],
        ),
        (SDPOMethod, lambda: SDPO_USER_TEMPLATE.split("{")[0], lambda m: traj.info["sibling_text"]),
        # Skill-SD's own wording is the skill block right after the instruction.
        (SkillSDMethod, lambda: user + skill_text(), lambda m: skill_text().strip()),
    )
    for cls, own_text, reference in cases:
        method, own, empty = (cls.from_config(c, cfg) for c in (a5, own_ctx, a5_null))
        traj.info["sibling_text"] = method_sibling_text(method, sibling)
        traj.info["skill_text"] = method.skill_text(skill) if cls is SkillSDMethod else None
        ref, own_wording = reference(method), own_text()
        assert ref.strip(), cls.__name__
        seq = method.teacher_sequence(traj)
        prompt = _prompt(tr, seq)
        assert frame_with_references(user, traj.task.domain, [ref]) in prompt, cls.__name__
        assert own_wording.strip() not in prompt, cls.__name__
        assert own_wording.strip() in _prompt(tr, own.teacher_sequence(traj)), cls.__name__
        assert _action_tokens_unchanged(traj, seq)
        nothing = ""
        if cls is SkillSDMethod:  # the skill's headings stay, its three parts are emptied
            traj.info["skill_text"] = empty.skill_text(skill)
            nothing = traj.info["skill_text"].strip()
        prompt0 = _prompt(tr, empty.teacher_sequence(traj))
        assert frame_with_references(user, traj.task.domain, [nothing]) in prompt0, cls.__name__
        assert ref not in prompt0, cls.__name__


def method_sibling_text(method, sibling):
    """The sibling text ``method`` would store (SDPO writes it as its context format says)."""
    from lopd.methods.text_teacher import reference_text

    return reference_text(sibling, method.ctx.context_format)


def test_a5_writes_a_trajectory_as_the_banks_experience_text(lopd_trainer):
    tr = lopd_trainer
    cfg = copy.deepcopy(tr.cfg)
    a5 = dataclasses.replace(tr.context, context_format="a5")
    method = SDFTMethod.from_config(a5, cfg)
    own = SDFTMethod.from_config(tr.context, cfg)
    assert method.own_demos, "the smoke bank holds successful trajectories"
    for task_id, demo in method.own_demos.items():
        assert own.own_demos[task_id] in demo or own.own_demos[task_id] == "(no tool calls)"
        assert demo != own.own_demos[task_id]


def test_skill_sd_teacher_reads_an_empty_skill_for_the_same_rollouts(lopd_trainer):
    tr = lopd_trainer
    full, null = _contexts(tr)
    skill = SkillText("look the holder up first", "guessing ids", "1. find_holder 2. update")
    with_skill = SkillSDMethod.from_config(full, tr.cfg)
    without = SkillSDMethod.from_config(null, tr.cfg)
    assert with_skill.skill_text(skill) == skill.render()
    assert without.skill_text(skill) == SkillText("", "", "").render()
    assert "What works:** \n" in without.skill_text(skill)
    assert "find_holder" not in without.skill_text(skill)


def test_lopd_teacher_reads_zero_latents_and_trains_no_composer(lopd_trainer, trajs):
    tr = lopd_trainer
    full, null = _contexts(tr)
    tasks = [t.task for t in trajs]
    for name in ("lopd", "lopd-frozen", "lopd-m0"):
        with_latents = METHODS[name].build(full, tr.cfg)
        method = METHODS[name].build(null, tr.cfg)
        assert with_latents.latents(tasks).abs().sum() > 0
        lat, lat0 = method.latents(tasks), method.cached_latents0(tasks)
        assert lat.shape == with_latents.latents(tasks).shape
        assert lat.abs().sum() == 0 and lat0.abs().sum() == 0 and not lat.requires_grad
    composer = tr.models.composer
    composer.zero_grad(set_to_none=True)
    tr.models.student.zero_grad(set_to_none=True)
    loss, sums = method.loss(trajs, num_total=len(trajs))
    loss.backward()
    assert torch.isfinite(loss) and sums["anchor"] == 0.0
    assert all(p.grad is None for p in composer.trainable_parameters())
    assert any(p.grad is not None for p in tr.models.student.parameters())


def test_a_method_without_a_teacher_is_refused_in_one_line():
    cfg = load_config("smoke", overrides=["train.method=grpo", "lopd.null_context=true"])
    with pytest.raises(ConfigError, match=r"lopd\.null_context=true needs a method with a teach"):
        METHODS["grpo"].check_teacher_settings(cfg)
    for name, spec in METHODS.items():
        cfg.train.method = name
        if name != "grpo":
            spec.check_teacher_settings(cfg)  # every other method has a teacher


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("lopd.null_context=true", "lopd.null_context"),
        ("lopd.context_format=a5", "lopd.context_format=a5 needs a method with a teacher"),
    ],
)
def test_train_cli_refuses_grpo_with_a_teacher_setting(tmp_path, capsys, override, says):
    from lopd.train import main

    rc = main([f"run_dir={tmp_path / 'r'}", "train.method=grpo", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0], err


def test_an_unknown_context_format_is_one_line(tmp_path, capsys):
    from lopd.train import main

    rc = main([f"run_dir={tmp_path / 'r'}", "train.method=opsd", "lopd.context_format=A.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "lopd.context_format must be one of" in err[0], err


def test_quick_compare_runs_the_null_context_controls(tmp_path):
    from lopd.compare import main

    out = tmp_path / "cmp"
    methods = ["lopd", "sdft", "skill-sd"]
    argv = ["--quick", "--out", str(out), "--methods", *methods, "--jobs", "1"]
    assert main([*argv, "lopd.null_context=true"]) == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["overrides"] == ["lopd.null_context=true"]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {r["method"] for r in runs} == set(methods)
    assert all(r["error"] is None and r["rollouts"] == 16 for r in runs)
    for m in methods:
        cfg_text = (out / "runs" / f"{m}-seed0" / "config.yaml").read_text()
        assert "null_context: true" in cfg_text


def test_base_composer_evaluation_generates_with_zero_latents(lopd_trainer):
    tr = lopd_trainer
    tasks = tr.evaluate.tasks[:3]
    assert tr.evaluate.task_latents(tasks).abs().sum() > 0
    cfg = copy.deepcopy(tr.cfg)
    cfg.lopd.null_context = True
    null_eval = HeldOutEvaluator(dataclasses.replace(tr.run_context, cfg=cfg), tr.evaluate.latents)
    lat = null_eval.task_latents(tasks)
    assert lat.shape == tr.evaluate.task_latents(tasks).shape and lat.abs().sum() == 0
    result = null_eval("base_composer")
    assert result["n"] == len(tr.evaluate.tasks) and 0 <= result["reward_mean"] <= 1
