"""``bank.grow``: the student's verified successes enter the bank during training (one per task
per refresh, the newest), the index, every task's retrievals and the cached c_phi0 follow, only
training tasks ever enter, and a resumed run continues with the same bank (the tiny model's smoke
bank, real FAISS and embedder)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch

from lopd.config import load_config
from lopd.latent.growth import latents_with_phi
from lopd.memory import format_experience
from lopd.trainer import Trainer
from lopd.types import TraceStep


def _trainer(run_dir, *overrides):
    cfg = load_config(
        "smoke",
        overrides=[f"run_dir={run_dir}", "bank.grow=true", "bank.min_reward=1.0", *overrides],
    )
    tr = Trainer(cfg, progress=False)
    tr.setup()
    return tr


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    torch.set_num_threads(1)
    # The smoke bank keeps every base-model rollout (bank.min_reward 0): enough entries to
    # retrieve J = 2 from; the growth's own success threshold is the paper's 1.0.
    run_dir = tmp_path_factory.mktemp("growth")
    cfg = load_config("smoke", overrides=[f"run_dir={run_dir}"])
    Trainer(cfg, progress=False).setup()  # collects the bank (min_reward 0) and cold start
    return _trainer(run_dir, "bank.grow_every=2")


def _success(trainer, task, calls, reward=1.0):
    """A trajectory of ``task`` with the given tool calls as its trace."""
    t = copy.deepcopy(trainer.experience.trajectories[0])
    t.task, t.reward = task, reward
    t.trace = [TraceStep(action=c, result="ok") for c in calls]
    return t


def test_one_entry_per_task_per_refresh_the_newest_and_retrievals_follow(trainer):
    tr, growth = trainer, trainer.context.bank_growth
    assert growth is not None and tr.method.bank_growth is growth
    a, b = tr.train_tasks[0], tr.train_tasks[1]
    size = len(growth)
    growth.observe([_success(tr, a, ["first()"]), _success(tr, b, ["miss()"], reward=0.5)])
    assert growth.after_step() == {
        "bank_size": float(size), "bank_added": 0.0, "bank_retrieval_changed": 0.0
    }  # fmt: skip
    growth.observe([_success(tr, a, ["second()"]), _success(tr, a, ["third()"])])
    out = growth.after_step()  # step 2: the refresh
    assert out["bank_added"] == 1.0 and out["bank_size"] == size + 1
    ((entry, _),) = growth.grown
    assert entry.task_id == a.task_id and "third()" in entry.trace_text  # the newest
    assert entry.meta["source"] == "student" and entry.meta["split"] == "train"
    assert entry.entry_id in {e.entry_id for e in growth.retriever.entries}
    # Every task's retrievals are the grown index's, and the changed c_phi0 are phi_0's.
    tasks = tr.train_tasks + tr.test_tasks
    hits = growth.retriever.retrieve_batch(tasks, k=tr.cfg.composer.num_retrieved)
    for task, found in zip(tasks, hits):
        assert tr.experience.retrieved[task.task_id] == [format_experience(e) for e in found]
    assert out["bank_retrieval_changed"] >= 1
    retrieving = [
        t for t in tasks if entry.trace_text in " ".join(tr.experience.retrieved[t.task_id])
    ]
    assert retrieving and a not in retrieving  # never the task's own
    phi0 = torch.load(tr.run_dir.phi0)
    fresh = [t for t in retrieving if t.split == "train"]
    want = latents_with_phi(tr.context.latents, phi0, fresh, chunk=2)
    for t in fresh:
        torch.testing.assert_close(tr.context.latents0[t.task_id], want[t.task_id])
    lines = tr.run_dir.bank_grown.read_text().splitlines()
    assert [json.loads(x)["entry_id"] for x in lines] == [entry.entry_id]
    # The same trace again is not a new entry.
    growth.observe([_success(tr, a, ["third()"])])
    growth.after_step()
    assert growth.after_step()["bank_added"] == 0.0 and len(growth.grown) == 1


def test_only_training_tasks_enter(trainer):
    growth = trainer.context.bank_growth
    held_out = trainer.test_tasks[0]  # the smoke run's held-out split
    for task in (held_out, dataclasses.replace(trainer.train_tasks[0], split="val")):
        with pytest.raises(ValueError, match="only training tasks may enter the bank"):
            growth.observe([_success(trainer, task, ["leak()"])])
    assert all(e.task_id in growth.train_ids for e, _ in growth.grown)


def test_a_resumed_run_continues_with_the_same_bank(trainer, tmp_path):
    """Steps 0-3 straight, with a checkpoint after step 1 (a pending success not yet indexed);
    a fresh trainer resumed from that checkpoint runs steps 2-3 again: the same metrics, grown
    entries, retrievals, c_phi0 and EMA teacher."""
    overrides = [
        "train.method=lopd-ppo", "train.tasks_per_step=4", "lopd_ppo.group_size=2",
        "bank.grow_every=3", "lopd.teacher_backbone=ema", "bank.min_reward=0.0",
    ]  # fmt: skip
    cfg = load_config(
        "smoke", overrides=[f"run_dir={tmp_path / 'a'}", "bank.grow=true", *overrides]
    )

    def rows_of(tr, steps):
        rows = []
        for step in steps:
            m = tr.train_step(step)
            rows.append({k: v for k, v in m.items() if not k.startswith("seconds_")})
            if step + 1 == 2:
                tr.save_checkpoint(2)
        return rows

    (tmp_path / "a").mkdir()
    for name in ("bank", "phi0.pt", "latents0.pt"):  # the smoke bank and cold start, reused
        src = trainer.run_dir.root / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / "a" / name)
    straight = Trainer(cfg, progress=False)
    straight.setup()
    rows = rows_of(straight, range(4))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = Trainer(dataclasses.replace(cfg, run_dir=str(tmp_path / "b")), progress=False)
    resumed.setup()
    assert resumed.load_checkpoint() == 2
    assert rows_of(resumed, range(2, 4)) == rows[2:]
    assert rows[2]["bank_added"] > 0  # the refresh after step 2 indexed the pending of 0-1
    g1, g2 = straight.context.bank_growth, resumed.context.bank_growth
    assert [e.to_dict() for e, _ in g1.grown] == [e.to_dict() for e, _ in g2.grown]
    assert all(e.task_id in g1.train_ids for e, _ in g1.grown)
    assert straight.experience.retrieved == resumed.experience.retrieved
    for k, v in straight.context.latents0.items():
        torch.testing.assert_close(resumed.context.latents0[k], v, rtol=0, atol=0)
    for (n, p), q in zip(
        straight.method.teacher_model().named_parameters(),
        resumed.method.teacher_model().parameters(),
    ):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
    assert (tmp_path / "b" / "bank_grown.jsonl").read_text() == (
        tmp_path / "a" / "bank_grown.jsonl"
    ).read_text()
