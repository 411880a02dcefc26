"""The comparison's report (lopd.eval.compare_report): rollouts to reach a target read off learning
curves by hand, the rollouts-to-target table with its per-seed fractions, and
``python -m lopd.compare --from-results`` rewriting a report without running anything."""

from __future__ import annotations

import json

import pytest

from lopd.compare import main, resolve_run
from lopd.eval.compare_report import (
    margin_table,
    rollouts_to_reach,
    rollouts_to_target_table,
    teacher_table,
)
from lopd.eval.run_results import fill_teacher_traces, teacher_trace
from lopd.run.run_dir import RunDir


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
    # Final minus vanilla, paired: GRPO +0.20 on both seeds, Skill-SD +0.05 on both.
    assert "| +0.200 ± 0.000 (above, > 2 stderr) |" in report
    assert report.count("| +0.050 ± 0.000 (above, > 2 stderr) |") == 1
    assert json.loads((tmp_path / "again" / "results.json").read_text())["runs"] == runs
    capsys.readouterr()
    for bad in ("{not json", json.dumps({"runs": []}), json.dumps([1])):
        res.write_text(bad)
        assert main(["--from-results", str(res)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--from-results" in err[0], err
    assert main(["--from-results", str(tmp_path / "missing.json")]) == 2


def test_merged_results_carry_the_merge_command_and_the_summed_wall_time(tmp_path):
    sources = []
    for k, seed in enumerate((0, 1)):
        meta = {"seeds": [seed], "budget": 200, "preset": "compare", "overrides": []}
        meta.update(wall_seconds=60.0 * (k + 1), command=f"python -m lopd.compare --seeds {seed}")
        runs = [r for r in _results() if r["seed"] == seed]
        for r in runs:
            r.update(rollouts=200, wall_seconds=1.0)
        sources.append(tmp_path / f"r{k}.json")
        sources[-1].write_text(json.dumps({"meta": {**meta, "eval_every": 8}, "runs": runs}))
    argv = ["--from-results", str(sources[0]), "--from-results", str(sources[1])]
    assert main([*argv, "--out", str(tmp_path / "merged")]) == 0
    meta = json.loads((tmp_path / "merged" / "results.json").read_text())["meta"]
    assert meta["command"] == "python -m lopd.compare " + " ".join(
        [*argv, "--out", str(tmp_path / "merged")]
    )
    assert meta["wall_seconds"] == 180.0 and meta["seeds"] == [0, 1]
    report = (tmp_path / "merged" / "report.md").read_text()
    assert "Total wall time 3.0 min" in report
    runs_by = ["python -m lopd.compare --seeds 0", "python -m lopd.compare --seeds 1"]
    assert meta["run_commands"] == runs_by
    assert "The runs came from:\n\n- `python -m lopd.compare --seeds 0`\n" in report
    # A merge of that merge and a third comparison names the three commands that ran runs, not
    # the first merge.
    third = json.loads(sources[0].read_text())
    third["meta"]["command"] = "python -m lopd.compare --methods lopd --seeds 0"
    third["runs"] = [{**r, "method": "lopd-grow"} for r in third["runs"] if r["method"] == "lopd"]
    (tmp_path / "third.json").write_text(json.dumps(third))
    again = ["--from-results", str(tmp_path / "merged" / "results.json")]
    again += ["--from-results", str(tmp_path / "third.json"), "--out", str(tmp_path / "again")]
    assert main(again) == 0
    meta = json.loads((tmp_path / "again" / "results.json").read_text())["meta"]
    assert meta["run_commands"] == [*runs_by, third["meta"]["command"]]
    assert meta["command"] == "python -m lopd.compare " + " ".join(again)


def test_a_merge_of_comparisons_with_different_vanilla_rewards_is_refused(tmp_path, capsys):
    """Another model, task set or split scores a seed's untrained model differently: merging
    would pair runs that share nothing, so it is one line and no report."""
    meta = {"seeds": [0, 1], "budget": 200, "preset": "compare", "overrides": [], "eval_every": 8}
    grpo = [r for r in _results() if r["method"] == "grpo"]
    lopd = [r for r in _results() if r["method"] == "lopd"]
    for r in grpo + lopd:
        r.update(rollouts=200, wall_seconds=1.0)
    lopd[1]["vanilla"]["reward_mean"] = 0.41  # seed 1 evaluated on other tasks
    for name, runs in (("a", grpo), ("b", lopd)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    argv = ["--from-results", str(tmp_path / "a.json"), "--from-results", str(tmp_path / "b.json")]
    assert main([*argv, "--out", str(tmp_path / "merged")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "seed 1's vanilla reward is 0.410 here and 0.400 in" in err and "a.json" in err
    assert not (tmp_path / "merged").exists()
    lopd[1]["vanilla"]["reward_mean"] = 0.40  # the same tasks: merged
    (tmp_path / "b.json").write_text(json.dumps({"meta": meta, "runs": lopd}))
    assert main([*argv, "--out", str(tmp_path / "merged")]) == 0


def test_from_runs_bad_input_is_one_line(tmp_path, capsys):
    assert main(["--from-runs", str(tmp_path)]) == 2  # no runs at all
    run = tmp_path / "runs" / "grpo-seed0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{damaged")
    assert main(["--from-runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("lopd.compare: --from-runs") for e in err), err
    assert "no finished run" in err[0] and "grpo-seed0" in err[1]


def test_from_runs_refuses_folders_with_different_vanilla_rewards(tmp_path, capsys):
    """--from-runs merges run folders as --from-results merges results: a seed whose untrained
    model scored differently in two folders is one line and no report."""
    for folder, method, vanilla in (("a", "grpo", 0.30), ("b", "sdpo", 0.35)):
        run = tmp_path / folder / "runs" / f"{method}-seed0"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("")
        summary = {"vanilla": {"reward_mean": vanilla}, "lopd": {"reward_mean": 0.5}}
        (run / "summary.json").write_text(
            json.dumps({**summary, "rollouts": 200, "wall_seconds": 1.0})
        )
    argv = ["--from-runs", str(tmp_path / "a"), "--from-runs", str(tmp_path / "b")]
    assert main([*argv, "--out", str(tmp_path / "merged")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("lopd.compare: --from-runs") and "seed 0's vanilla reward is 0.350" in err
    assert not (tmp_path / "merged").exists()


def _lopd_run(name, seed, final, margin, delta, beta, phi0=None, phi=None):
    r = _run(name, seed, [[0, 0.3], [200, final]], 0.3)
    r["dual"] = {"margin": margin, "delta": delta, "beta": beta}
    if phi0 is not None:
        r["base_composer_phi0"] = {"reward_mean": phi0}
        r["base_composer"] = {"reward_mean": phi}
    return r


def test_margin_table_by_hand():
    results = []
    for seed, shift in ((0, 0.0), (1, 0.02)):
        results += [
            _lopd_run("lopd-m0", seed, 0.40 + shift, 0.0, [-0.1, 0.1], [0.05, 0.0], 0.5, 0.5),
            _lopd_run("lopd-frozen", seed, 0.45 + shift, 0.05, [0.0, 0.0], [0.03, 0.05], 0.5, 0.5),
            _lopd_run("lopd", seed, 0.50 + shift, 0.05, [0.1, 0.0, 0.06, 0.0], [0, 0.03, 0, 0.2]),
            _lopd_run("lopd-m0.1", seed, 0.47 + 4 * shift, 0.1, [0.2], [0.0], 0.5, 0.6 + shift),
            _run("grpo", seed, [[0, 0.3], [200, 0.6]], 0.3),  # no dual ascent: not in the table
        ]
    lines = margin_table(results)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines[2:6]}
    assert list(rows) == ["lopd", "lopd-frozen", "lopd-m0", "lopd-m0.1"]  # report order
    assert rows["lopd"][:3] == ["0.05", "0.510 ± 0.010", "0.50 ± 0.00"]  # 2 of 4 steps met m
    assert rows["lopd"][3:] == ["0.20 ± 0.00 (0.20)", "– |"]  # no composer evaluation
    assert rows["lopd-frozen"][0] == "0.05 (phi frozen)" and rows["lopd-frozen"][2] == "0.00 ± 0.00"
    assert rows["lopd-m0"][2:4] == ["0.50 ± 0.00", "0.00 ± 0.00 (0.05)"]
    assert rows["lopd-m0.1"][0] == "0.1" and rows["lopd-m0.1"][4] == "0.110 ± 0.010 |"
    assert "grpo" not in "\n".join(lines)
    shape = "\n".join(lines[6:])
    assert (
        "- lopd-m0 − lopd-frozen = -0.050 ± 0.000 (paired over 2 seed(s)): below, > 2 stderr."
        in shape
    )
    assert (
        "- lopd − lopd-frozen = 0.050 ± 0.000 (paired over 2 seed(s)): above, > 2 stderr." in shape
    )
    within = (
        "lopd-m0.1 − lopd-frozen = 0.050 ± 0.030 (paired over 2 seed(s)): above, within 2 stderr."
    )
    assert within in shape
    assert margin_table([r for r in results if r["method"] == "grpo"]) == []


def test_margin_runs_are_named_by_their_margin():
    assert resolve_run("lopd-m0.02") == ("lopd", ["lopd.margin=0.02"])
    assert resolve_run("lopd-m0") == ("lopd-m0", [])  # the registered ablation
    assert resolve_run("sdft") == ("sdft", [])
    for bad in ("lopd-m", "lopd-mx", "lopd-m-0.1", "sft"):
        with pytest.raises(ValueError, match="unknown method"):
            resolve_run(bad)


def test_quick_margin_sweep_shares_the_seeds_phases_and_reports_the_dual_ascent(tmp_path):
    out = tmp_path / "cmp"
    argv = ["--quick", "--out", str(out), "--methods", "lopd-m0.1", "lopd", "--jobs", "1"]
    assert main([*argv, "eval.with_composer=true"]) == 0
    runs = {r["method"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert list(runs) == ["lopd", "lopd-m0.1"]  # LOPD first: it builds the shared phases
    for name, margin in (("lopd", 0.05), ("lopd-m0.1", 0.1)):
        r = runs[name]
        assert r["error"] is None and r["rollouts"] == 16
        assert r["dual"]["margin"] == margin and len(r["dual"]["delta"]) == r["steps"] == 2
        assert len(r["dual"]["beta"]) == 2 and r["dual"]["beta"][0] >= 0
        assert 0 <= r["base_composer"]["reward_mean"] <= 1
        assert 0 <= r["base_composer_phi0"]["reward_mean"] <= 1
        cfg_text = (out / "runs" / f"{name}-seed0" / "config.yaml").read_text()
        assert "method: lopd\n" in cfg_text and f"margin: {margin}\n" in cfg_text
    # The same bank and phi_0, copied (copy2 keeps the time stamp), not rebuilt.
    first, second = (RunDir(out / "runs" / f"{n}-seed0") for n in runs)
    for a, b in zip(first.shared_phases(True, True), second.shared_phases(True, True)):
        assert a.stat().st_mtime_ns == b.stat().st_mtime_ns, a.name
    phi0 = [runs[n]["base_composer_phi0"]["task_rewards"] for n in runs]
    assert phi0[0] == phi0[1]
    report = (out / "report.md").read_text()
    assert "## The margin" in report and "| lopd-m0.1 | 0.1 |" in report
    assert "| lopd-m0.1 |" in report.split("## Answers")[0]  # in the reward table too


def test_teacher_trace_and_table_by_hand(tmp_path):
    rows = [
        {"kl": 0.0, "distilled": 0.0, "student_logprob": -0.1, "teacher_logprob": 0.0},  # none
        {"kl": 0.6, "distilled": 2.0, "student_logprob": -0.1, "teacher_logprob": -0.5},
        {"kl": 0.2, "distilled": 1.0},
        {"kl": 0.0, "skill_guided": 0.0},
        {"reward_mean": 0.3},  # a row without the method's divergence
    ]
    trace = teacher_trace(rows)
    assert trace["kl"] == [None, 0.6, 0.2, None, None]
    assert trace["logprob_gap"] == [None, pytest.approx(0.4), None, None, None]
    runs = [_run("sdft", s, [[0, 0.3], [200, 0.1]], 0.3) for s in (0, 1)]
    runs[0]["teacher"] = trace
    runs[1]["teacher"] = {"kl": [0.4, 0.1], "logprob_gap": [0.2, 0.0]}
    # First distilled step: 0.6 and 0.4; mean over the run 0.4 and 0.25; last 0.2 and 0.1;
    # the log-prob gap at the first step 0.4 and 0.2.
    assert teacher_table(runs)[2] == (
        "| sdft | 0.500 ± 0.100 | 0.325 ± 0.075 | 0.150 ± 0.050 | 0.300 ± 0.100 |"
    )
    assert teacher_table([_run("grpo", 0, [[0, 0.3], [200, 0.4]], 0.3)]) == []
    # Results written before the trace existed get it from their run directory.
    run_dir = tmp_path / "sdft-seed0"
    run_dir.mkdir()
    RunDir(run_dir).metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    old = _run("sdft", 0, [[0, 0.3], [200, 0.1]], 0.3)
    old["run_dir"] = str(run_dir)
    gone = _run("opsd", 0, [[0, 0.3], [200, 0.1]], 0.3)
    gone["run_dir"] = str(tmp_path / "deleted")
    fill_teacher_traces([old, gone])
    assert old["teacher"] == trace and "teacher" not in gone
