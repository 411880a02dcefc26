"""``lopd.collect``: base-model rollouts -> experience bank -> saved index and query cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lopd.envs import builtin_tasks
from lopd.latent.collect import collect_bank
from lopd.memory import ExperienceBank, Retriever
from lopd.memory.retriever import INDEX_FILE, META_FILE, QUERY_CACHE_FILE
from lopd.models.loading import load_model
from lopd.rollout.multi_turn import GenerationConfig

REPO = Path(__file__).resolve().parents[2]
# Short episodes keep the test cheap; collection logic does not depend on their length.
GEN = GenerationConfig(max_steps=3, max_new_tokens_per_turn=32)


@pytest.fixture(scope="module")
def tiny():
    """The embedded default model (shipped asset, or built once into the cache).

    Generation runs on one thread: token-by-token decoding of a 2 M-parameter model gains
    nothing from more, and on a busy CI machine extra threads wait on each other.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model()
    torch.set_num_threads(threads)


def test_collect_bank_end_to_end_and_deterministic(tiny, tmp_path):
    model, tokenizer = tiny
    tasks = builtin_tasks("tool_use", "train", n=3)
    # Threshold 0: every episode is a success whatever the model's skill, so the bank contents
    # below are fully determined (the reward filter itself is tested in test_memory.py).
    kw = dict(min_reward=0.0, rollouts_per_task=2, seed=3, chunk_size=4, progress=False)
    res = collect_bank(model, tokenizer, tasks, tmp_path / "bank", GEN, **kw)

    assert (res.num_tasks, res.num_rollouts, len(res.rewards)) == (3, 6, 6)
    assert res.num_success == len(res.successes) == 6
    assert res.mean_reward == pytest.approx(sum(res.rewards) / 6)
    # The bank holds exactly the distinct successful traces, all from train tasks.
    bank = ExperienceBank(tmp_path / "bank")
    distinct = {(t.task.task_id, t.trace_text()) for t in res.successes}
    assert {(e.task_id, e.trace_text) for e in bank} == distinct
    assert res.bank_size == res.num_added == len(bank)
    assert all(e.meta["split"] == "train" for e in bank)
    assert sorted(e.reward for e in bank) == sorted(
        {(t.task.task_id, t.trace_text()): t.reward for t in res.successes}.values()
    )

    # Saved next to the bank: training reloads the retriever without any embedder and every
    # collected task's query is a cache hit; retrieval never returns the task's own entries.
    for f in (INDEX_FILE, META_FILE, QUERY_CACHE_FILE):
        assert (tmp_path / "bank" / f).is_file()
    r = Retriever.load(bank, index="cpu")
    assert len(r) == len(bank)
    hits = r.retrieve_batch(tasks, k=3)
    assert (r.cache_hits, r.cache_misses) == (3, 0)
    for t, entries in zip(tasks, hits):
        others = sum(e.task_id != t.task_id for e in bank)
        assert len(entries) == min(3, others)
        assert all(e.task_id != t.task_id for e in entries)

    # Same seed, same chunking: the same rollouts again, so nothing new enters the bank.
    again = collect_bank(model, tokenizer, tasks, tmp_path / "bank", GEN, **kw)
    assert again.rewards == res.rewards
    assert again.num_added == 0 and again.bank_size == len(bank)


def test_collect_refuses_held_out_tasks(tiny, tmp_path):
    model, tokenizer = tiny
    test_tasks = builtin_tasks("tool_use", "test", n=2)
    with pytest.raises(ValueError, match="train split"):
        collect_bank(model, tokenizer, test_tasks, tmp_path, GEN, progress=False)
    with pytest.raises(ValueError, match="rollouts_per_task"):
        collect_bank(model, tokenizer, [], tmp_path, GEN, rollouts_per_task=0)
    # Arguments are checked before anything touches the disk.
    assert not (tmp_path / "bank.jsonl").exists()


def test_cli_collects_from_a_task_file_and_prints_a_summary(tmp_path):
    """``python -m lopd.collect`` as a user runs it, in a real subprocess."""
    tasks_file = tmp_path / "train.jsonl"
    tasks = builtin_tasks("tool_use", "train", n=8)[5:8]
    tasks_file.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in tasks))
    bank_dir = tmp_path / "bank"
    cmd = [sys.executable, "-m", "lopd.collect", "--tasks", str(tasks_file),
           "--bank", str(bank_dir), "--n", "2", "--seed", "1", "--min-reward", "0",
           "--max-steps", "2", "--max-new-tokens", "24", "--index", "cpu", "--threads", "1",
           "--no-progress"]  # fmt: skip
    out = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "success rate" in out.stdout and f"bank {bank_dir}" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    assert (summary["tasks"], summary["rollouts"]) == (2, 2)
    # --min-reward 0: every episode is a success; both tasks are in the bank.
    assert summary["success_rate"] == 1.0
    bank = ExperienceBank(bank_dir)
    assert {e.task_id for e in bank} == {t.task_id for t in tasks[:2]}
    r = Retriever.load(bank, index="cpu")
    assert [e.task_id for e in r.retrieve(tasks[0], k=5)] == [tasks[1].task_id] * sum(
        e.task_id == tasks[1].task_id for e in bank
    )

    bad = subprocess.run(
        [sys.executable, "-m", "lopd.collect", "--n", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--n must be >= 1" in bad.stderr


def test_document_style_flag_reaches_the_embedder(tiny):
    from lopd.collect import _make_embedder

    model, tokenizer = tiny
    assert _make_embedder("hidden", model, tokenizer, "cpu").document_style == "task"
    emb = _make_embedder("hidden", model, tokenizer, "cpu", "task_trace")
    assert emb.document_style == "task_trace"
