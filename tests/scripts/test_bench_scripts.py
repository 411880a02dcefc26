"""The precision and scaling benchmarks keep working: each runs its ``--quick`` mode here.

``python benchmarks/precision.py`` and ``python benchmarks/scaling.py`` produce the README's
precision tables and scaling plots; their quick modes run the same code at tiny shapes, so an API
change that breaks a script (ours or a peer's) fails here instead of at the next full run.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import precision, scaling
from benchmarks.precision_tail import MASSES
from benchmarks.scaling_ops import OPS
from benchmarks.scaling_point import PointRunner

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def precision_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    records = precision.main(["--quick", "--results", str(out)])
    return out, records


def _row(records, table, method, div, top_m=None):
    found = [r for r in records if r["backend"] == method and r["shapes"].get("table") == table
             and r["shapes"]["divergence"] == div and r["shapes"]["top_m"] == top_m]  # fmt: skip
    assert len(found) == 1, (table, method, div, top_m)
    return found[0]


def test_precision_writes_every_row(precision_run):
    out, records = precision_run
    saved = json.loads((out / "precision.json").read_text())
    tail = json.loads((out / "precision_tail.json").read_text())
    assert len(saved) + len(tail) == len(records)
    for div in ("reverse", "forward", "jsd"):
        for table, methods in (("dense", precision.dense_methods(True)),
                               ("fused", precision.fused_methods(True, None))):  # fmt: skip
            for name, top_m, _fn, _probe in methods:
                row = _row(saved, table, name, div, top_m)
                # A row is measured or says why not (an option this install lacks, a missing
                # peer): never silently absent.
                assert "unsupported" in row or row["loss_rel_err"] is not None, row
    assert {r["shapes"]["teacher_top_mass"] for r in tail} == set(MASSES)


def test_our_ops_reach_the_bf16_floor(precision_run):
    """Our ops compute in float32: loss within 1e-5 of float64, gradients at the floor that
    storing the exact gradient in bf16 sets (x 1.2); bf16 arithmetic (TRL's GKD loss on bf16
    logits) is measurably worse."""
    _, records = precision_run
    for div in ("reverse", "forward"):
        floor = _row(records, "dense", "float64 truth rounded to bf16", div)
        for top_m in (None, precision.TOP_M):
            ours = _row(records, "dense", "lk.topk_tail_kl cpu", div, top_m)
            assert ours["loss_rel_err"] < 1e-5 and ours["loss_worst_row_rel_err"] < 1e-4
            for g in ("s", "t"):
                assert ours[f"grad_{g}_rel_err"] < 1.2 * floor[f"grad_{g}_rel_err"], (div, g)
        fused = _row(records, "fused", "lk.fused_linear_topk_tail_kl cpu", div)
        ffloor = _row(records, "fused", "float64 truth rounded to bf16", div)
        for g in ("h_s", "W_s", "h_t"):
            assert fused[f"grad_{g}_rel_err"] < 1.2 * ffloor[f"grad_{g}_rel_err"], (div, g)
        gkd = _row(records, "dense", "TRL GKD generalized_jsd_loss (bf16)", div)
        assert gkd["grad_s_rel_err"] > 2 * ours["grad_s_rel_err"]


def test_tail_table_shows_the_clamp_floor(precision_run):
    """The exact tail stays at float32 rounding for every teacher; the clamped ``1 - sum``
    tail is biased once the teacher's tail is below its 1e-7 floor (broad student, reverse KL)."""
    _, records = precision_run
    tail = [r for r in records if "teacher_top_mass" in r["shapes"]]
    for r in tail:
        if r["backend"].startswith("exact tail"):
            assert r["loss_rel_err"] < 1e-5 and r["grad_s_rel_err"] < 1e-5, r["shapes"]
    want = {"teacher_top_mass": MASSES[-1], "student": "broad", "divergence": "reverse"}
    clamped = [
        r for r in tail
        if r["backend"].startswith("clamped") and all(r["shapes"][k] == v for k, v in want.items())
    ]  # fmt: skip
    assert clamped and all(r["loss_rel_err"] > 1e-2 for r in clamped)


def test_scaling_quick_runs_every_point_and_plots(tmp_path):
    points, fits, paths = scaling.main(["--quick", "--results", str(tmp_path)])
    assert sorted(p.name for p in paths) == sorted(f"scaling_{op}.png" for op in OPS)
    assert all(p.stat().st_size > 10_000 for p in paths)
    for op_name, op in OPS.items():
        for variant in op.variants:
            for axis, (_fixed, values) in op.quick_sweeps.items():
                got = [p for p in points if p["shapes"]["op"] == op_name
                       and p["backend"] == variant and p["shapes"]["sweep"] == axis]  # fmt: skip
                assert [p["shapes"][axis] for p in got] == values
                assert any(f["backend"] == variant and f["shapes"]["op"] == op_name
                           and f["shapes"]["sweep"] == axis for f in fits)  # fmt: skip
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert len(saved) == len(points)


def test_scaling_child_measures_its_own_peak():
    """One point in a fresh process: the gradients it returns are the two [N, V] float32
    tensors, its peak covers them, and the timings are positive."""
    n, v = 64, 4096
    res = PointRunner(preload=["torch", "lopd_kernels", "benchmarks.scaling_point"])(
        {"op": "topk_tail_kl", "variant": "lk.topk_tail_kl (C++)", "N": n, "V": v, "d": 0,
         "reps": 2, "warm_budget_s": 5.0},
        threads=1,
    )  # fmt: skip
    assert res["grad_bytes"] == 2 * n * v * 4
    assert res["peak_rss_bytes"] >= res["rss_before_bytes"] + res["grad_bytes"] // 2
    assert res["median_s"] > 0


def test_slope_and_prediction():
    xs = [256, 512, 1024, 2048]
    assert math.isclose(scaling.fit_slope(xs, [3.0 * x**1.5 for x in xs]), 1.5)
    assert scaling.fit_slope([1], [1]) is None
    assert math.isclose(scaling.predict([100, 200], [1.0, 2.0], 800), 8.0)
    # Never extrapolates below linear growth (a flat start must not hide a large point).
    assert math.isclose(scaling.predict([100, 200], [5.0, 5.0], 400), 10.0)


def test_ab_trees_times_both_trees_and_gives_ratios(tmp_path):
    """``benchmarks/ab_trees.py`` on this checkout against itself, at tiny shapes: every op in
    the record, a ratio per op, and a tree that is not a checkout refused in one line."""
    from pathlib import Path

    from benchmarks import ab_trees

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "ab.json"
    args = ["--a", str(root), "--b", str(root), "--rounds", "2", "--reps", "1"]
    assert ab_trees.main([*args, "--n", "16", "--vocab", "300", "--d", "8", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["ops"]) == 4 and record["rounds"] == 2
    for entry in record["ops"].values():
        ratio = entry["cpu_s"]["b_over_a"]
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    with pytest.raises(SystemExit, match="not a lopd checkout"):
        ab_trees.main(["--a", str(tmp_path), "--b", str(root)])
