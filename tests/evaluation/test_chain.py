"""``python -m lopd.chain``: the chain-of-effects report (paired statistics) and a quick run."""

from __future__ import annotations

import json
import math

import pytest

from lopd.chain import CONDITIONS, chain_report, main


def _ev(rewards):
    n = len(rewards)
    return {
        "n": n,
        "reward_mean": sum(rewards) / n,
        "reward_stderr": 0.0,
        "success_rate": sum(r == 1.0 for r in rewards) / n,
        "steps": 3.0,
        "tool_calls_per_step": 1.0,
        "repeated_tool_calls": 0.0,
        "first_step_tokens": 10.0,
        "task_rewards": list(rewards),
    }


def _run(seed, vanilla, phi0, trained, lopd, delta):
    summary = {
        "vanilla": _ev(vanilla),
        "base_composer_phi0": _ev(phi0),
        "base_composer": _ev(trained),
        "lopd": _ev(lopd),
    }
    step0 = {"delta": delta, "privilege": -delta}
    return {"seed": seed, "summary": summary, "step0": step0, "error": None}


def test_report_pairs_within_seeds_and_pools_task_pairs():
    runs = [
        _run(0, [0.0, 1.0], [0.5, 1.0], [1.0, 1.0], [1.0, 0.0], 0.02),
        _run(1, [0.5, 0.5], [0.5, 1.0], [0.0, 0.5], [1.0, 1.0], 0.04),
    ]
    failed = {"seed": 2, "error": "RuntimeError: boom"}
    reference = {
        "seeds": [0, 1, 2],
        "splits": {
            "test": {"n_tasks": 64, "retrieved_minus_bare": {
                "mean": 0.23, "stderr_paired_over_tasks": 0.04}},
        },
    }  # fmt: skip
    numbers, report = chain_report([runs[1], failed, runs[0]], reference)
    assert numbers["seeds"] == [0, 1]
    # (d) per seed: lopd - vanilla = 0.0 and +0.5; task pairs +1, -1, +0.5, +0.5.
    d = numbers["d"]
    assert d["per_seed"] == pytest.approx([0.0, 0.5])
    assert d["mean"] == pytest.approx(0.25)
    assert d["stderr_seeds"] == pytest.approx(0.25)  # std 0.3536 / sqrt(2)
    pairs = [1.0, -1.0, 0.5, 0.5]
    m = sum(pairs) / 4
    se = math.sqrt(sum((p - m) ** 2 for p in pairs) / 3 / 4)
    assert d["stderr_pairs"] == pytest.approx(se) and d["n_pairs"] == 4
    assert numbers["b_phi0"]["per_seed"] == pytest.approx([0.25, 0.25])
    assert numbers["b_trained"]["per_seed"] == pytest.approx([0.5, -0.25])
    assert numbers["step0_delta"]["mean"] == pytest.approx(0.03)
    assert numbers["a"]["test"]["mean"] == 0.23
    assert set(numbers["conditions"]) == set(CONDITIONS)
    assert "seed 2 FAILED: RuntimeError: boom" in report
    assert "(d) LOPD student − vanilla: 0.250 ± 0.250" in report
    assert "(a) base + retrieved trajectory as text − base (test" in report
    assert "| first_step_tokens |" in report


def test_report_skips_links_a_run_lacks():
    run = _run(0, [0.0], [1.0], [1.0], [1.0], 0.01)
    del run["summary"]["base_composer_phi0"]
    del run["summary"]["lopd"]["task_rewards"]  # a summary from before per-task rewards
    numbers, report = chain_report([run])
    assert "b_phi0" not in numbers and "d" in numbers
    assert math.isnan(numbers["d"]["stderr_seeds"])  # one seed: unknown, not zero
    assert math.isnan(numbers["d"]["stderr_pairs"]) and numbers["d"]["n_pairs"] == 0
    assert "phi_0" not in report.split("## The links")[1].split("## Paper")[0]


def test_quick_chain_writes_every_link(tmp_path):
    import torch

    out = tmp_path / "chain"
    threads = torch.get_num_threads()
    assert main(["--quick", "--out", str(out), "--jobs", "1"]) == 0
    assert torch.get_num_threads() == threads  # the caller's thread count is left as it was
    payload = json.loads((out / "results.json").read_text())
    (run,) = payload["runs"]
    assert run["error"] is None
    for key in CONDITIONS:
        assert run["summary"][key]["n"] == 4
    for link in ("b_phi0", "b_trained", "d", "step0_delta", "step0_privilege"):
        assert link in payload["chain"], link
    assert payload["meta"]["overrides"][:3] == [
        "data.n_test=4", "eval.temperature=0.7", "eval.with_composer=true"
    ]  # fmt: skip
    assert "## The links" in (out / "report.md").read_text()


def test_bad_arguments_are_rejected_before_any_run(tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path / "x"), "lopd.margin=-1"]) == 2
    assert "lopd.chain:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    missing = str(tmp_path / "none.json")
    assert main(["--quick", "--out", str(tmp_path / "y"), "--reference-json", missing]) == 2
