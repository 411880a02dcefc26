"""The reference probe (``python -m lopd.models probe-reference``): report and references."""

from __future__ import annotations

import json

import pytest

from lopd.envs import builtin_tasks, save_tasks_jsonl
from lopd.models.__main__ import main
from lopd.models.loading import load_model
from lopd.tiny.probe import CONDITIONS, format_report, probe_reference


@pytest.fixture(scope="module")
def shipped():
    return load_model()


def test_probe_report_fields_and_reference_sources(shipped, tmp_path):
    model, tok = shipped
    train = builtin_tasks("tool_use", "train", n=45)
    val = builtin_tasks("tool_use", "val", n=6)
    report = probe_reference(
        model, tok, train, {"val": val}, seeds=(0, 1), bank_dir=tmp_path / "bank", log=lambda *a: 0
    )
    bank = report["bank"]
    assert bank["rollouts"] == 45 and 0 < bank["successes"] <= 45
    r = report["splits"]["val"]
    assert r["n_tasks"] == 6 and 0.0 <= r["retrieved_same_template"] <= 1.0
    for c in CONDITIONS:
        assert len(r[c]["per_seed"]) == 2 and 0.0 <= r[c]["mean"] <= 1.0
    for c in ("retrieved", "mismatched"):
        gain = r[f"{c}_minus_bare"]["mean"]
        assert gain == pytest.approx(r[c]["mean"] - r["bare"]["mean"], abs=1e-9)
    table = format_report(report)
    assert table.count("\n") == 2 and "| val | 6 |" in table
    # The bank holds train tasks only (collect_bank refuses others).
    with pytest.raises(ValueError, match="train split"):
        probe_reference(model, tok, val, {"val": val}, seeds=(0,), log=lambda *a: 0)


def test_probe_cli_reads_a_task_file(shipped, tmp_path):
    tasks = builtin_tasks("tool_use", "train", n=30) + builtin_tasks("tool_use", "test", n=3)
    path = tmp_path / "tasks.jsonl"
    save_tasks_jsonl(tasks, path)
    out = tmp_path / "probe.json"
    argv = ["probe-reference", "--tasks", str(path), "--splits", "test", "--seeds", "0"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["splits"]["test"]["n_tasks"] == 3 and report["bank"]["rollouts"] == 30
