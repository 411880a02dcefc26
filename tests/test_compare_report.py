"""The comparison's report (lopd.compare_report): rollouts to reach a target read off learning
curves by hand, the rollouts-to-target table with its per-seed fractions, and
``python -m lopd.compare --from-results`` rewriting a report without running anything."""

from __future__ import annotations

import json

import pytest

from lopd.compare import main
from lopd.compare_report import rollouts_to_reach, rollouts_to_target_table


def test_rollouts_to_reach_interpolates_between_evaluations():
    curve = [[0, 0.3], [96, 0.3], [232, 0.5], [368, 0.4], [504, 0.6]]
    assert rollouts_to_reach(curve, 0.4) == pytest.approx(96 + 136 * 0.5)  # halfway up
    assert rollouts_to_reach(curve, 0.5) == 232.0  # exactly at an evaluation
    assert rollouts_to_reach(curve, 0.55) == pytest.approx(368 + 136 * 0.75)  # after the dip
    assert rollouts_to_reach(curve, 0.3) == 0.0  # already there
    assert rollouts_to_reach(curve, 0.61) is None  # never
    # At one rollout count the last evaluation counts (the one after training up to it).
    repeated = [[0, 0.1], [10, 0.9], [10, 0.2], [20, 0.4]]
    assert rollouts_to_reach(repeated, 0.3) == pytest.approx(15.0)


def _run(method, seed, curve, vanilla):
    final = {"reward_mean": curve[-1][1], "reward_stderr": 0.0, "success_rate": 0.0, "n": 4}
    return {
        "method": method,
        "seed": seed,
        "curve": curve,
        "final": final,
        "vanilla": {"reward_mean": vanilla, "success_rate": 0.0, "n": 4},
        "error": None,
    }


def _results():
    out = []
    for seed, v in ((0, 0.30), (1, 0.40)):
        out += [
            _run("grpo", seed, [[0, v], [100, v + 0.10], [200, v + 0.20]], v),
            _run("lopd", seed, [[0, v], [100, v], [150, v + 0.10], [200, v + 0.15]], v),
            _run("skill-sd", seed, [[0, v], [200, v + 0.05]], v),
        ]
    return out


def test_rollouts_to_target_table_by_hand():
    lines = rollouts_to_target_table(_results())
    assert lines[0].startswith("| rollouts to reach | vanilla + 0.05 | vanilla + 0.10 |")
    # Best final: grpo's mean final (0.50 + 0.60) / 2 = 0.55.
    assert lines[0].endswith("| best final (0.550, grpo) |")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines[2:]}
    # GRPO reaches v + 0.05 at 50 and v + 0.10 at 100 on both seeds; v + 0.15 at 150.
    assert rows["grpo"][:3] == ["50 ± 0", "100 ± 0", "150 ± 0"]
    # LOPD: flat to 100, +0.10 at 150: v + 0.05 at 125, v + 0.10 at 150, v + 0.15 at 200.
    assert rows["lopd"][:4] == ["125 ± 0", "150 ± 0", "200 ± 0", "not reached"]
    # Best final 0.55: seed 0's LOPD ends at 0.45 (never), seed 1's ends there (200); GRPO's
    # seed 0 ends at 0.50 (never), seed 1 passes 0.50 at 100 and 0.60 at 200: 150.
    assert rows["lopd"][4].startswith("200 (1/2 seeds")
    assert rows["grpo"][4].startswith("150 (1/2 seeds")
    assert rows["skill-sd"][:2] == ["200 ± 0", "not reached"]
    # Fractions, per seed: 125 / 50, 150 / 100, 200 / 150; where GRPO or LOPD misses: "–".
    assert rows["LOPD / GRPO"][:3] == ["250% ± 0%", "150% ± 0%", "133% ± 0%"]
    assert rows["LOPD / GRPO"][3] == "–"
    assert rows["LOPD / Skill-SD"][0] == "62% ± 0%"


def test_from_results_rewrites_the_report_and_bad_input_is_one_line(tmp_path, capsys):
    res = tmp_path / "results.json"
    meta = {"seeds": [0, 1], "budget": 200, "preset": "compare", "overrides": []}
    meta.update(wall_seconds=60.0, command="python -m lopd.compare", eval_every=8)
    runs = _results()
    for r in runs:
        r.update(rollouts=200, wall_seconds=1.0)
    res.write_text(json.dumps({"meta": meta, "runs": runs}))
    assert main(["--from-results", str(res), "--out", str(tmp_path / "again")]) == 0
    report = (tmp_path / "again" / "report.md").read_text()
    assert "## Rollouts to target" in report and "| LOPD / GRPO | 250% ± 0%" in report
    assert "evaluations (every 8 steps)" in report
    assert json.loads((tmp_path / "again" / "results.json").read_text())["runs"] == runs
    capsys.readouterr()
    for bad in ("{not json", json.dumps({"runs": []}), json.dumps([1])):
        res.write_text(bad)
        assert main(["--from-results", str(res)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--from-results" in err[0], err
    assert main(["--from-results", str(tmp_path / "missing.json")]) == 2
