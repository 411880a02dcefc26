"""``python -m lopd.train --tasks`` on EnvScaler's release files (sandboxed class and check code
through the bank, the cold start, training and evaluation) and on ACEBench's tasks (train on
multi-step, evaluate on multi-turn with a simulated user), with the shipped tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from lopd.evaluate import main as evaluate_main
from lopd.train import main as train_main

DATA = Path(__file__).parents[1] / "data"
TINY = str(Path(__file__).resolve().parents[2] / "lopd" / "assets" / "tiny-qwen3")
QUICK = [
    "--preset", "smoke", "--no-progress", "data.n_train=4", "data.n_test=1", "train.steps=1",
    "train.tasks_per_step=1", "cold_start.steps=1", "checkpoint_every=100",
]  # fmt: skip


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_lopd_trains_and_evaluates_on_envscalers_release_files(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["--tasks", str(DATA / "envscaler"), "--run-dir", str(run_dir), *QUICK]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "held-out reward  vanilla" in out
    s = summary(run_dir)
    assert s["vanilla"]["n"] == 1 and 0.0 <= s["lopd"]["reward_mean"] <= 1.0


def test_acebench_trains_on_multi_step_and_evaluates_multi_turn_with_a_user_model(tmp_path, capsys):
    # The release directory as it is: its multi-turn tasks name no user model.
    argv = ["--tasks", str(DATA / "acebench"), "--run-dir", str(tmp_path / "a"), *QUICK]
    assert train_main([*argv, "data.n_train=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "ACEBench multi-turn task and names no user model" in err and "\n" not in err
    # Exported with one, the same tasks train (multi-step) and evaluate (multi-turn).
    tasks = tmp_path / "acebench.jsonl"
    export = ["--bench", "acebench", "--data", str(DATA / "acebench"), "--user-model", TINY]
    assert evaluate_main([*export, "--export-tasks", str(tasks)], log=lambda _: None) == 0
    run_dir = tmp_path / "b"
    argv = ["--tasks", str(tasks), "--run-dir", str(run_dir), "--method", "grpo", *QUICK]
    assert train_main([*argv, "data.n_train=3"]) == 0
    s = summary(run_dir)
    assert s["vanilla"]["n"] == 1 and s["lopd"]["n"] == 1
