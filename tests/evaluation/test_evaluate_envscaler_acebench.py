"""``python -m lopd.evaluate --bench envscaler|acebench`` end to end with the shipped tiny model
(short budgets), the simulated user of ACEBench's multi-turn tasks (the tiny model plays it), and
the task export the trainer reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lopd.envs import load_task_file
from lopd.eval.benchmark import render_markdown
from lopd.evaluate import main

DATA = Path(__file__).parents[1] / "data"
TINY = str(Path(__file__).resolve().parents[2] / "lopd" / "assets" / "tiny-qwen3")
SHORT = ["--max-new-tokens", "8", "--max-steps", "2", "--threads", "1", "--no-progress"]


def run(tmp_path, *args, logs=None):
    out = tmp_path / "out"
    log = logs.append if logs is not None else (lambda _: None)
    assert main([*args, "--out", str(out), *SHORT], log=log) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text() == render_markdown(results)
    return results


def test_envscaler_scores_the_mean_reward_with_each_checks_verdict(tmp_path):
    res = run(tmp_path, "--bench", "envscaler", "--tasks", str(DATA / "envscaler"))
    cat = res["categories"]["envscaler"]
    m, (ep,) = cat["metrics"], cat["episodes"]
    assert res["settings"]["split"] == "test" and m["n"] == 1
    assert m["score"] == pytest.approx(100 * m["reward_mean"])
    assert ep["task_id"] == "env_lib-task_1" and len(ep["checks"]) == 4
    assert ep["reward"] == sum(c["held"] for c in ep["checks"]) / 4
    assert ep["stopped_calls"] == 0 and "broken" not in ep
    res = run(tmp_path, "--bench", "envscaler", "--tasks", str(DATA / "envscaler"), "--split",
              "train", "--n", "2")  # fmt: skip
    assert res["categories"]["envscaler"]["metrics"]["n"] == 2


def test_acebench_multi_step_runs_without_a_user_model_and_says_multi_turn_is_left_out(tmp_path):
    logs: list[str] = []
    res = run(tmp_path, "--bench", "acebench", "--data", str(DATA / "acebench"), logs=logs)
    assert list(res["categories"]) == ["multi_step"] and "overall" not in res
    assert res["settings"]["split"] == "multi_step"
    assert any("multi_turn left out: it needs --user-model" in line for line in logs)
    m = res["categories"]["multi_step"]["metrics"]
    assert m["n"] == 3 and m["score"] == pytest.approx(100 * m["success_rate"])
    assert 0.0 <= m["process_score"] <= 100.0
    for ep in res["categories"]["multi_step"]["episodes"]:
        assert set(ep) >= {"end_to_end", "process", "errors", "calls"}
        assert ep["success"] is ep["end_to_end"]
    assert "| multi_step | 0.00 |" in (tmp_path / "out" / "results.md").read_text()


def test_acebench_multi_turn_with_the_tiny_model_as_the_user(tmp_path):
    res = run(
        tmp_path, "--bench", "acebench", "--data", str(DATA / "acebench"), "--user-model", TINY,
        "--n", "1",
    )  # fmt: skip
    assert list(res["categories"]) == ["multi_step", "multi_turn"]
    assert res["settings"]["split"] == "multi_step + multi_turn"
    turn = res["categories"]["multi_turn"]
    (ep,) = turn["episodes"]
    assert ep["task_id"] == "agent_multi_turn_0" and ep["steps"] >= 1
    n = {c: res["categories"][c]["metrics"]["n"] for c in res["categories"]}
    scores = {c: res["categories"][c]["metrics"]["score"] for c in res["categories"]}
    assert res["overall"] == pytest.approx(sum(scores[c] * n[c] for c in n) / sum(n.values()))


def test_exported_tasks_load_as_the_trainer_reads_them(tmp_path):
    envscaler = tmp_path / "envscaler.jsonl"
    args = ["--bench", "envscaler", "--tasks", str(DATA / "envscaler"), "--split", "train"]
    assert main([*args, "--export-tasks", str(envscaler)], log=lambda _: None) == 0
    assert {t.split for t in load_task_file(envscaler)} == {"train"}
    acebench = tmp_path / "acebench.jsonl"
    args = ["--bench", "acebench", "--data", str(DATA / "acebench"), "--user-model", TINY]
    assert main([*args, "--export-tasks", str(acebench)], log=lambda _: None) == 0
    tasks = load_task_file(acebench)
    assert [t.split for t in tasks] == ["train"] * 3 + ["test"] * 2
    assert {t.spec.get("user_model") for t in tasks[3:]} == {str(Path(TINY).resolve())}
