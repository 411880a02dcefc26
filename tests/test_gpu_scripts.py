"""The prepared GPU scripts work, checked on the CPU: a GPU session (rare, and billed by the
minute) must never be lost to a script that broke when an API around it changed. Each
``benchmarks/gpu_*.py`` runs here with ``--device cpu`` at tiny shapes and must write its results;
``benchmarks/gpu_all.sh`` must at least parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE = {
    "gpu_topk_tail_kl.py": (
        ["--n", "6", "--v", "1000", "--m", "8", "--reps", "1"],
        "topk_tail_kl.json",
    ),
    "gpu_qformer.py": (["--reps", "1"], "qformer_gpu.json"),
    "gpu_fused_linear.py": (
        ["--n", "16", "--d", "32", "--v", "500", "--m", "8", "--reps", "1"],
        "fused_linear_topk_tail_kl.json",
    ),
}


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_gpu_benchmark_script_runs_on_cpu(script, tmp_path):
    args, result_file = SMOKE[script]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", "--out",
         str(tmp_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "LOPD_BENCH_RESULTS": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = json.loads((tmp_path / result_file).read_text())
    assert records and all(r["median_s"] > 0 for r in records), records


def test_every_gpu_script_has_a_cpu_smoke_run():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("gpu_*.py")}
    assert scripts <= set(SMOKE), scripts - set(SMOKE)


def test_gpu_all_parses():
    run = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_all.sh")])
    assert run.returncode == 0
