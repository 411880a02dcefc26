"""LOPD-PPO and the latent teacher's backbone: the loss against a float64 reference on a fixed
batch of the tiny model (both distillation forms, margin and anchor on and off), the teacher
backbone's sync / EMA copies and their checkpoint, and the run names of ``lopd.compare``."""

from __future__ import annotations

import copy

import pytest
import torch

from lopd.config import ConfigError, load_config
from lopd.latent.teacher import teacher_action_hidden
from lopd.methods import METHODS, LOPDPPOMethod
from lopd.methods.groups import group_advantages, group_rollouts
from lopd.methods.teacher_backbone import TeacherBackbone
from lopd.rollout.batch import ActionRows, lm_head
from lopd.trainer import Trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The smoke run's bank and cold start with LOPD-PPO (the tiny model, composer included)."""
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("lopd_ppo")
    cfg = load_config("smoke", overrides=[f"run_dir={run_dir}", "train.method=lopd-ppo"])
    tr = Trainer(cfg, progress=False)
    tr.setup()
    return tr


@pytest.fixture(scope="module")
def group(trainer):
    """One group of G = 4 rollouts of one task, with fixed rewards and their group advantages."""
    trajs = group_rollouts(trainer.context, 0, 4, trainer.cfg.train.tasks_per_step)
    rewards = [1.0, 0.0, 0.5, 0.0]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.zeros(4).long())
    for t, r, a in zip(trajs, rewards, adv.tolist()):
        t.reward, t.info["advantage"] = r, a
    return trajs


def _reverse_topk_tail(s_logits, t_logits, top_m):
    """KL(student || teacher) over the teacher's top-M ids plus one tail bucket, per row."""
    ls, lt = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    top = t_logits.topk(top_m, -1).indices
    s_top, t_top = ls.gather(-1, top), lt.gather(-1, top)
    s_tail = torch.log1p(-s_top.exp().sum(-1).clamp(max=1 - 1e-12))
    t_tail = torch.log1p(-t_top.exp().sum(-1).clamp(max=1 - 1e-12))
    s_b, t_b = torch.cat([s_top, s_tail[:, None]], -1), torch.cat([t_top, t_tail[:, None]], -1)
    return (s_b.exp() * (s_b - t_b)).sum(-1)


def _method(trainer, **ppo):
    cfg = copy.deepcopy(trainer.cfg)
    for k, v in ppo.items():
        setattr(cfg.lopd_ppo, k, v)
    return LOPDPPOMethod.from_config(trainer.context, cfg), cfg


def _grads(tr):
    student, composer = tr.models.student, tr.models.composer
    head = student.get_output_embeddings().weight
    phi = [p for p in composer.trainable_parameters()]
    return [
        head.grad.clone(),
        *[torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in phi],
    ]


def _zero(tr):
    for p in (*tr.models.student.parameters(), *tr.models.composer.parameters()):
        p.grad = None


@pytest.mark.parametrize(
    ("distill", "dual", "anchor"),
    [("topk", True, True), ("sampled", True, True), ("topk", False, False)],
)
def test_loss_matches_a_float64_reference(trainer, group, distill, dual, anchor):
    """Value and gradients (student head, every phi tensor) against the same loss written with
    float64 full-vocabulary logits: PPO-clip on group advantages (ratio 1), w times the top-M +
    tail reverse KL or the importance-weighted sampled-token form, beta (m - Delta) with
    A_i = 2 r_i - 1, lambda times the anchor."""
    tr, trajs = trainer, group
    w, beta = 0.7, 0.9
    method, cfg = _method(tr, distill=distill, distill_weight=w, dual=dual, anchor=anchor)
    method.beta = beta
    _zero(tr)
    loss, sums = method.loss(trajs, num_total=4)
    loss.backward()
    got = _grads(tr)
    _zero(tr)

    s, tau, m_top = method.settings, cfg.gen.temperature, cfg.lopd.top_m
    models, composer = tr.models, tr.models.composer
    where = ActionRows.of(trajs, models.device)
    latents = method.latents([t.task for t in trajs])
    latents0 = method.cached_latents0([t.task for t in trajs])
    seqs = [method.teacher_sequence(t) for t in trajs]
    h_t = teacher_action_hidden(composer, seqs, latents, where, models.pad_id)
    w_t = lm_head(composer.backbone).weight.double()
    student = models.student
    b_eff = beta if dual else 0.0
    value = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(trajs):
        rows = where.batch == i
        pos = where.rows[rows]
        logits = student(input_ids=torch.tensor([t.input_ids])).logits[0].double()[pos]
        lt = h_t[rows].double() @ w_t.T
        y = where.targets[rows, None]
        logp_tau = torch.log_softmax(logits / tau, -1).gather(1, y)[:, 0]
        ppo = (-t.info["advantage"] * torch.exp(logp_tau - logp_tau.detach())).mean()
        kl = _reverse_topk_tail(logits, lt, m_top).mean()
        if distill == "topk":
            dist = kl
        else:
            lpt_tau = torch.log_softmax(lt.detach() / tau, -1).gather(1, y)[:, 0]
            dist = (torch.exp(logp_tau - logp_tau.detach()) * (logp_tau - lpt_tau).detach()).mean()
        lp_s = torch.log_softmax(logits, -1).gather(1, y)[:, 0]
        lp_t = torch.log_softmax(lt, -1).gather(1, y)[:, 0]
        delta = (2 * t.reward - 1) * (lp_t - lp_s.detach()).mean()
        anc = ((latents[i].double() - latents0[i].double()) ** 2).mean() if anchor else 0.0
        value = (
            value + ppo + w * dist + b_eff * (s.lopd.margin - delta) + s.lopd.anchor_weight * anc
        )
    (value / 4).backward()
    want = _grads(tr)
    _zero(tr)
    assert loss.detach().item() == pytest.approx(float(value) / 4, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-6)  # the student's head
    assert any(float(g.abs().sum()) > 0 for g in want[1:])  # phi is reached
    for g, r in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-7)
    assert sums["action_tokens"] == where.rows.numel()
    assert sums["grad_ppo"] > 0 and sums["grad_distill"] > 0 and -4 <= sums["grad_cosine"] <= 4


def test_group_shares_its_tasks_latents(trainer, group):
    method, _ = _method(trainer)
    tasks = [t.task for t in group] + [trainer.train_tasks[1]]
    lat = method.latents(tasks)
    torch.testing.assert_close(lat[:4], lat[:1].expand(4, -1, -1))
    composed = method.task_latents([tasks[0], tasks[-1]])
    torch.testing.assert_close(lat[[0, 4]], composed, rtol=1e-5, atol=1e-6)


def test_teacher_backbone_sync_copies_every_k_steps_and_ema_moves_every_step():
    torch.manual_seed(0)
    student = torch.nn.Linear(3, 2)
    base = TeacherBackbone(student, "base", 1, 0.5)
    sync = TeacherBackbone(student, "sync", 2, 0.5)
    ema = TeacherBackbone(student, "ema", 1, 0.25)
    assert base.model() is None and not base.moved
    start = copy.deepcopy(student.state_dict())
    for step in range(3):
        with torch.no_grad():
            student.weight.add_(1.0)
        for tb in (base, sync, ema):
            tb.after_step()
        if step == 0:  # no sync yet: the copy is the initial student
            torch.testing.assert_close(sync.model().weight, start["weight"])
        if step == 1:
            torch.testing.assert_close(sync.model().weight, student.weight)
    # after step 3 the sync copy holds step 2's student; the EMA moved three times
    torch.testing.assert_close(sync.model().weight, student.weight - 1.0)
    expected = start["weight"].clone()
    for k in (1, 2, 3):
        expected = 0.75 * expected + 0.25 * (start["weight"] + k)
    torch.testing.assert_close(ema.model().weight, expected)
    assert not any(p.requires_grad for p in ema.model().parameters())
    state = copy.deepcopy(ema.state_dict())
    fresh = TeacherBackbone(student, "ema", 1, 0.25)
    fresh.load_state_dict(state)
    assert fresh.steps == 3
    torch.testing.assert_close(fresh.model().weight, expected)
    with pytest.raises(ValueError, match="base, sync or ema"):
        TeacherBackbone(student, "student", 1, 0.5)


def test_a_moved_teacher_reads_latents_with_its_own_weights(trainer, group):
    """``lopd.teacher_backbone=ema``: the teacher forward runs on the EMA copy (no LoRA in it),
    gradients still reach phi, never the student through the teacher."""
    tr = trainer
    cfg = copy.deepcopy(tr.cfg)
    cfg.lopd.teacher_backbone = "ema"
    method = LOPDPPOMethod.from_config(tr.context, cfg)
    copy_model = method.teacher_model()
    assert copy_model is not None and copy_model is not tr.models.student
    with torch.no_grad():
        for p in copy_model.parameters():
            p.mul_(1.01)  # a teacher whose weights moved away from the base
    trajs = group[:2]
    where = ActionRows.of(trajs, tr.models.device)
    seqs = [method.teacher_sequence(t) for t in trajs]
    lat = method.latents([t.task for t in trajs])
    moved = method.teacher_hidden(seqs, lat, where)
    base = teacher_action_hidden(tr.models.composer, seqs, lat, where, tr.models.pad_id)
    direct = teacher_action_hidden(
        tr.models.composer, seqs, lat, where, tr.models.pad_id, model=copy_model
    )
    torch.testing.assert_close(moved, direct)
    assert not torch.allclose(moved, base, atol=1e-4)
    assert method.teacher_head() is lm_head(copy_model)
    _zero(tr)
    loss, _ = method.loss(trajs, num_total=2)
    loss.backward()
    assert sum(float(p.grad.abs().sum()) for p in tr.models.composer.trainable_parameters()
               if p.grad is not None) > 0  # fmt: skip
    assert all(p.grad is None for p in copy_model.parameters())
    _zero(tr)
    assert "ema_teacher" in method.state_dict() and method.state_dict()["teacher_steps"] == 0


def test_settings_are_checked_at_startup():
    for override, field in (
        ("lopd_ppo.distill=full", "lopd_ppo.distill"),
        ("lopd_ppo.distill_weight=-1", "lopd_ppo.distill_weight"),
        ("lopd_ppo.group_size=0", "lopd_ppo.group_size"),
        ("lopd_ppo.clip_eps_low=0", "lopd_ppo.clip_eps_low"),
        ("lopd.teacher_backbone=student", "lopd.teacher_backbone"),
        ("lopd.teacher_sync_every=0", "lopd.teacher_sync_every"),
        ("lopd.teacher_ema_rate=2", "lopd.teacher_ema_rate"),
        ("bank.grow_every=0", "bank.grow_every"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("smoke", overrides=[override]).validate()
    spec = METHODS["lopd-ppo"]
    assert spec.uses_composer and spec.group_size(load_config("smoke")) == 4
    for method, override, what in (
        ("grpo", "lopd.teacher_backbone=ema", "lopd.teacher_backbone"),
        ("skill-sd", "bank.grow=true", "bank.grow"),
        ("sdpo", "bank.grow=true", "bank.grow"),
    ):
        cfg = load_config("smoke", overrides=[f"train.method={method}", override])
        with pytest.raises(ConfigError, match=what.replace(".", r"\.")):
            METHODS[method].check(cfg, 1)
    cfg = load_config("smoke", overrides=["bank.grow=true"])
    with pytest.raises(ConfigError, match="one process"):
        METHODS["lopd"].check(cfg, 2)
    with pytest.raises(ConfigError, match="fsdp2"):
        load_config("smoke", overrides=["model.parallel=fsdp2", "bank.grow=true"]).validate()
    # A moved teacher is sharded like the student (tests/distributed/test_distributed_methods.py
    # runs it).
    sharded_copy = ["model.parallel=fsdp2", "lopd.teacher_backbone=sync"]
    load_config("smoke", overrides=sharded_copy).validate()


def test_a_moved_teacher_without_a_reward_term_is_warned_of(capsys, tmp_path):
    """LOPD and its ablations with a teacher that follows the student print one warning line at
    start (measured: reward 0 on every seed with sync); LOPD-PPO, whose PPO term holds it, and
    the frozen base do not."""

    def warned(method, *overrides):
        cfg = load_config("smoke", overrides=[f"train.method={method}", *overrides])
        return METHODS[method].warnings(cfg)

    for method in ("lopd", "lopd-frozen", "lopd-m0"):
        for backbone in ("sync", "ema"):
            (line,) = warned(method, f"lopd.teacher_backbone={backbone}")
            assert line.startswith(f"warning: train.method={method} with ") and backbone in line
        assert warned(method) == []
    assert warned("lopd-ppo", "lopd.teacher_backbone=sync") == []
    for method in ("grpo", "opsd", "sdpo", "sdft", "skill-sd"):
        assert warned(method) == []
    # The trainer prints it before anything is loaded.
    cfg = load_config("smoke", overrides=["lopd.teacher_backbone=sync", f"run_dir={tmp_path}"])
    Trainer(cfg, progress=False)
    (out,) = capsys.readouterr().out.strip().splitlines()
    assert out.startswith("[lopd] warning: train.method=lopd with lopd.teacher_backbone=sync")


def test_run_names_carry_their_settings_in_one_order():
    from lopd.compare import resolve_run

    assert resolve_run("lopd-ppo") == ("lopd-ppo", [])
    assert resolve_run("lopd-ppo-ema-grow") == (
        "lopd-ppo", ["lopd.teacher_backbone=ema", "bank.grow=true"]
    )  # fmt: skip
    assert resolve_run("lopd-m0.02-sync") == (
        "lopd", ["lopd.margin=0.02", "lopd.teacher_backbone=sync"]
    )  # fmt: skip
    assert resolve_run("sdft-a5-grow-null") == (
        "sdft", ["lopd.context_format=a5", "bank.grow=true", "lopd.null_context=true"]
    )  # fmt: skip
    for bad in ("lopd-grow-ema", "lopd-ema-sync", "grpo-grow", "skill-sd-grow", "grpo-null",
                "sdpo-ema", "lopd-a5", "lopd-grow-grow", "-grow"):  # fmt: skip
        with pytest.raises(ValueError, match="unknown method"):
            resolve_run(bad)


def _result(method, seed, final, curve, bank=0, **extra):
    def ev(x):
        return {"reward_mean": x, "reward_stderr": 0.0, "success_rate": 0.0, "n": 4}

    out = {
        "method": method, "seed": seed, "curve": curve, "final": ev(final), "vanilla": ev(0.3),
        "bank_rollouts": bank, "rollouts": 200 + bank, "wall_seconds": 1.0, "error": None,
    }  # fmt: skip
    out.update({k: ev(v) if k.endswith("composer") else v for k, v in extra.items()})
    return out


def test_report_holds_the_recipe_tables_and_merges_results(tmp_path, capsys):
    import json

    from lopd.compare import main

    refs, ppo = [], []
    for seed, (g, k, p) in enumerate(((0.5, 0.55, 0.7), (0.6, 0.62, 0.75))):
        refs += [
            _result("grpo", seed, g, [[0, 0.3], [100, 0.4], [200, g]]),
            _result("skill-sd", seed, k, [[0, 0.3], [200, k]]),
        ]
        ppo.append(
            _result(
                "lopd-ppo-ema-grow", seed, p, [[0, 0.3], [96, 0.3], [196, 0.5], [296, p]], bank=96,
                trace={"grad_ppo": [1.0, 1.0], "grad_distill": [1.0, 3.0],
                       "bank_size": [10, 12], "bank_added": [0, 2]},
                dual={"margin": 0.05, "delta": [0.01, 0.03], "beta": [0.0, 0.0]},
                base_composer=0.4, student_composer=p + 0.05, teacher_composer=0.6,
            )
        )  # fmt: skip
    meta = {"seeds": [0, 1], "budget": 296, "preset": "compare", "overrides": []}
    meta.update(wall_seconds=60.0, command="python -m lopd.compare", eval_every=8)
    for name, runs in (("a", refs), ("b", ppo)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    a, b = (str(tmp_path / n / "results.json") for n in "ab")
    assert main(["--from-results", a, "--from-results", b, "--out", str(tmp_path / "ab")]) == 0
    report = (tmp_path / "ab" / "report.md").read_text()
    # lopd-ppo − grpo = 0.20, 0.15; − skill-sd = 0.15, 0.13: above both beyond 2 stderr.
    assert "| lopd-ppo-ema-grow | 0.725 ± 0.025 | 0.175 ± 0.025 (above, > 2 stderr) | " in report
    assert "0.140 ± 0.010 (above, > 2 stderr) | yes |" in report
    # Without the bank its curve starts at 0: vanilla + 0.05 / 0.10 after 25 / 50 rollouts.
    bankless = report.split("the bank's rollouts left out")[1].split("##")[0]
    assert "| lopd-ppo-ema-grow | 25 ± 0 | 50 ± 0 |" in bankless
    assert "| lopd-ppo-ema-grow / GRPO | 50% ± 0% | 50% ± 0% |" in bankless
    # Latents: base 0.3 -> 0.4 (+0.10); student p -> p + 0.05; the EMA teacher's weights 0.6.
    assert "| 0.600 ± 0.000 | 0.100 ± 0.000 | 0.050 ± 0.000 |" in report
    # Share of the gradient (4 of 6 -> 0.67), Delta 0.02, bank 12 (2 added).
    assert (
        "| lopd-ppo-ema-grow | 0.67 ± 0.00 | – | 0.0200 ± 0.0000 | – / – | 12 ± 0 (2 ± 0) |"
        in report
    )
    capsys.readouterr()
    assert main(["--from-results", a, "--from-results", a, "--out", str(tmp_path / "aa")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "grpo-seed0 is also in" in err
