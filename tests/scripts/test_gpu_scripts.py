"""The GPU check (``bash benchmarks/gpu_all.sh OUT``) works, checked on the CPU: CI has no GPU,
and a GPU run must not be lost to a script that broke when an API around it changed.

``bash benchmarks/gpu_all.sh OUT --dry-run-cpu`` runs every step of the GPU run at tiny shapes
(Triton under its interpreter, the C++ kernels standing in for CUDA, pytest selections collected
instead of run); these tests check that every step passed, that every benchmark wrote its records
in the results format, that the test selections hold the GPU tests of every op and nothing the
GPU run must skip, and that the run writes its summary, records and logs into OUT. The
orchestrator's own guarantees (a crash, a hang or a failed build loses nothing else) are checked
on stand-in steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_results  # noqa: E402
import gpu_run  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
RECORD_KEYS = {"op", "backend", "shapes", "median_s", "peak_mem_bytes", "device", "commit", "date"}
OUT_FILES = {"env.json", "gpu_all.log", "records.jsonl", "summary.json", "summary.md"}
# Steps a CPU dry run may skip, and why (packages CI does not install).
MAY_SKIP = {"fused_liger": "liger_kernel", "varlen_flash_attn": "flash_attn"}


def _run_all(out: Path, *args: str, env: dict | None = None, timeout: int = 900):
    run_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    run_env.pop("LOPD_GPU_BUDGET_S", None)
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_all.sh"), str(out), *args],
        cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_out")
    t0 = time.monotonic()
    proc = _run_all(out, "--dry-run-cpu")
    wall = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    records = gpu_results.load(out / "records.jsonl")
    return proc, out, summary, records, wall


def _steps(summary) -> dict:
    return {s["name"]: s for s in summary["steps"]}


def test_dry_run_passes_every_step(dry_run):
    proc, _out, summary, _records, wall = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = _steps(summary)
    for name, step in steps.items():
        if step["status"] == "skipped":
            assert name in MAY_SKIP or (not HAS_TRL and "trl" in name), (name, step["note"])
            assert MAY_SKIP.get(name, "trl") in step["note"], (name, step["note"])
        else:
            assert step["status"] == "ok", (name, step["status"], step["note"])
    assert summary["wall_s"] < summary["budget_s"], summary["wall_s"]
    print(f"dry run: {wall:.0f} s wall, {summary['records']} records")


def test_every_benchmark_wrote_its_records(dry_run):
    _proc, _out, _summary, records, _wall = dry_run
    for r in records:
        assert set(r) >= RECORD_KEYS, r
        assert r["median_s"] > 0 and r["commit"] != "", r
        assert r.get("check_ok", True), r  # the LOPD kernels' figures come with a check
    have = {
        (r["op"], r["backend"], r["shapes"].get("pass", r["shapes"].get("part"))) for r in records
    }
    want = {("device", "copy", None), ("device", "matmul", None)}
    # "triton[joined_reductions]" / "cpu[natural_exp]": each forward slot's other kernel, timed
    # next to the default one (on the CPU dry run the C++ kernel stands in for CUDA, under both
    # labels).
    lopd_topk = ["triton", "triton[joined_reductions]", "cpu", "cpu[natural_exp]"]
    lopd_topk += ["torch_reference"]
    lopd_topk += ["trl_eager"] if HAS_TRL else []
    want |= {("topk_tail_kl", b, p) for b in lopd_topk for p in ("fwd", "bwd", "fwd+bwd")}
    want.add(("topk_tail_kl", "torch_topk", "fwd"))
    fused = ["materialized", "chunked", "triton"]
    fused += ["trl_chunked_divergence"] if HAS_TRL else []
    want |= {("fused_linear_topk_tail_kl", b, p) for b in fused for p in ("fwd", "bwd")}
    want |= {("varlen_cross_attention", b, p) for b in ("triton", "cuda", "sdpa_padded")
             for p in ("fwd", "bwd")}  # fmt: skip
    want |= {("qformer", b, "fwd") for b in ("module_fused", "module_padded")}
    want |= {("lopd_train_step", b, p) for b in ("fused_linear", "materialized")
             for p in ("step", "forward", "loss", "backward", "optimizer")}  # fmt: skip
    # The multi-GPU step (2 gloo ranks in the dry run): every vocabulary-parallel op and its
    # all-gather baseline, its loss checked against the baseline's (check_ok above).
    vocab_ops = ("topk_tail_kl", "sparse_teacher_topk_tail_kl", "fused_linear_topk_tail_kl_loss",
                 "fused_linear_logprob")  # fmt: skip
    want |= {(f"vocab_parallel.{op}", b, None) for op in vocab_ops
             for b in ("vocab_parallel", "allgather")}  # fmt: skip
    assert want <= have, sorted(want - have)
    teachers = {r["shapes"]["teacher"] for r in records if r["op"] == "topk_tail_kl"}
    assert teachers == {"iid", "zipf"}
    sweep = {(r["backend"], r["shapes"]["pass"]) for r in records
             if r["op"] == "topk_tail_kl_triton_sweep"}  # fmt: skip
    assert len({b for b, p in sweep if p == "fwd"}) >= 2 and any(p == "bwd" for _, p in sweep)
    grads = {r["shapes"]["grads"] for r in records if r["op"] == "fused_linear_topk_tail_kl"}
    assert grads == {"frozen-heads", "student-head"}
    # The support / JSD cases, each checked against the reference like the teacher's (check_ok
    # above) and timed against it.
    options = {(r["op"], r["backend"], r["shapes"]["support"], r["shapes"]["divergence"])
               for r in records if "support" in r["shapes"] and "time_vs_teacher" in r}  # fmt: skip
    cases = (("student", "reverse"), ("union", "reverse"), ("teacher", "jsd"))
    want = {("topk_tail_kl", b, *c) for b in ("triton", "cpu") for c in cases}
    want |= {("fused_linear_topk_tail_kl", b, *c) for b in ("chunked", "triton") for c in cases}
    assert want <= options, sorted(want - options)


def test_test_selections_hold_the_gpu_tests_of_every_op(dry_run):
    _proc, _out, summary, _records, _wall = dry_run
    steps = _steps(summary)
    triton_ids = steps["tests_triton"]["details"]["ids"]
    cuda_ids = steps["tests_cuda"]["details"]["ids"]
    memcheck_ids = steps["memcheck"]["details"]["ids"]
    for prefix in (
        "tests/kernels/test_topk_tail_kl.py::test_opcheck[triton",
        "tests/kernels/test_topk_tail_kl.py::test_triton_backend_matches_reference",
        "tests/kernels/test_topk_tail_kl_triton.py::test_matches_oracle",
        "tests/kernels/test_topk_tail_kl_triton.py::test_gpu_qwen_vocab_bf16",
        "tests/kernels/test_fused_linear_topk_tail_kl.py::test_opcheck[triton",
        "tests/kernels/test_fused_linear_topk_tail_kl.py::test_triton_matches_reference",
        "tests/kernels/test_varlen_cross_attention.py::test_backend_matches_reference[gqa-bf16-triton]",
        "tests/kernels/test_qformer.py::test_module_matches_straightforward",
    ):
        assert any(i.startswith(prefix) for i in triton_ids), prefix
    for prefix in (
        # both forward kernels of the slot topk_tail_kl.cuda_forward
        "tests/kernels/test_topk_tail_kl_cuda.py::test_matches_reference[natural_exp-cuda",
        "tests/kernels/test_topk_tail_kl_cuda.py::test_matches_reference[base2-cuda",
        "tests/kernels/test_varlen_cross_attention_cuda.py::",
        "tests/kernels/test_fused_linear_topk_tail_kl.py::test_chunked_cuda_on_gpu",
    ):
        assert any(i.startswith(prefix) for i in cuda_ids), prefix
    assert any(i.startswith("tests/kernels/test_topk_tail_kl_cuda.py::") for i in memcheck_ids)
    assert any("out_of_bounds" in i for i in memcheck_ids)
    for ids in (triton_ids, cuda_ids, memcheck_ids):
        assert not [i for i in ids if "emulated" in i or "compile" in i]
    assert not set(triton_ids) & set(cuda_ids)


def test_the_run_writes_summary_records_and_logs(dry_run):
    proc, out, summary, _records, _wall = dry_run
    assert {p.name for p in out.iterdir() if p.is_file()} == OUT_FILES
    logs = {p.name for p in (out / "logs").iterdir()}
    ran = {s["name"] for s in summary["steps"] if s["status"] == "ok"}
    assert {f"{name}.log" for name in ran} <= logs, sorted(logs)
    assert {"build.log", "tests_triton.xml", "tests_cuda.xml"} <= logs, sorted(logs)
    text = (out / "summary.md").read_text()
    assert "| topk_triton |" in text and "## topk_tail_kl" in text
    assert "RECORD topk_tail_kl triton" in (out / "gpu_all.log").read_text()
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith(f"wrote {out}: ") and "gpu_results.py merge" in last


def test_results_merge_into_the_results_format(dry_run, tmp_path):
    _proc, out, _summary, _records, _wall = dry_run
    for _ in range(2):  # merging again replaces, never duplicates
        gpu_results.main(["merge", str(out / "records.jsonl"), "--results-dir", str(tmp_path),
                          "--commit", "abc1234"])  # fmt: skip
    rows = json.loads((tmp_path / "gpu_topk_tail_kl.json").read_text())
    keys = [(r["backend"], json.dumps(r["shapes"], sort_keys=True)) for r in rows]
    assert len(keys) == len(set(keys))
    assert all(r["commit"] != "unknown" for r in rows)
    # The peers' baselines are the teacher's reverse KL; the option cases carry time_vs_teacher.
    teacher = [r for r in rows if r["backend"] == "triton" and "support" not in r["shapes"]]
    if HAS_TRL:
        assert teacher and all("speedup_vs_trl_eager" in r for r in teacher)
    fused = json.loads((tmp_path / "gpu_fused_linear_topk_tail_kl.json").read_text())
    fused = [r for r in fused if r["backend"] == "triton" and "support" not in r["shapes"]]
    assert fused and all("time_ratio" in r for r in fused)
    report = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(tmp_path)],
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert "gpu_topk_tail_kl" in report.stdout and "torch_reference" in report.stdout


def test_failed_build_leaves_the_triton_path(tmp_path):
    proc = _run_all(
        tmp_path, "--dry-run-cpu", "--only", "env,topk_triton,probe,tests_cuda,topk_cuda",
        env={"LOPD_GPU_BUILD_CMD": "echo 'nvcc: error: planted' >&2; exit 3"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = _steps(summary)
    assert "FAILED (exit 3)" in summary["build"] and "Triton path only" in summary["build"]
    assert steps["topk_triton"]["status"] == "ok"
    for name in ("tests_cuda", "topk_cuda"):
        assert steps[name]["status"] == "skipped" and "not built" in steps[name]["note"], name
    assert "nvcc: error: planted" in proc.stdout  # the build log's tail is shown


def _stand_in_run(tmp_path, monkeypatch, steps, budget=60.0):
    monkeypatch.setattr(gpu_run, "MIN_CAP_S", 1.0)
    monkeypatch.setattr(gpu_run, "FINISH_RESERVE_S", 0.0)
    run = gpu_run.Run(tmp_path, dry=True, budget=budget, py=sys.executable)
    run.steps = steps
    try:
        for step in steps:
            run.run_step(step)
    finally:
        shutil.rmtree(run.work, ignore_errors=True)
    return run


def _record_cmd(backend: str, then: str) -> list[str]:
    rec = {"op": "stand_in", "backend": backend, "shapes": {}, "median_s": 1.0}
    line = json.dumps({**rec, "peak_mem_bytes": None, "device": "cpu", "commit": "x", "date": "d"})
    return ["bash", "-c", f"echo '{line}' >> \"$LOPD_GPU_RECORDS\"; {then}"]


def test_a_crash_or_a_hang_loses_nothing_else(tmp_path, monkeypatch):
    steps = [
        gpu_run.Step("crashes", 1, _record_cmd("a", "kill -SEGV $$")),
        gpu_run.Step("hangs", 1, _record_cmd("b", "sleep 600")),
        gpu_run.Step("passes", 1, _record_cmd("c", "exit 0")),
    ]
    t0 = time.monotonic()
    run = _stand_in_run(tmp_path, monkeypatch, steps, budget=8.0)
    assert time.monotonic() - t0 < 30  # the hang was killed at its cap
    assert [s.status for s in steps] == ["FAILED", "TIMEOUT", "ok"]
    assert steps[0].rc == -11
    assert [r["backend"] for r in gpu_results.load(run.records)] == ["a", "b", "c"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["FAILED", "TIMEOUT", "ok"]


def test_a_killed_test_step_is_counted_from_its_log(tmp_path, monkeypatch):
    """No junit XML when a pytest step is killed at its cap: the -v lines give the outcomes."""
    lines = ["[gw0] [ 50%] PASSED tests/test_a.py::test_x[1]", "tests/test_b.py::test_y FAILED"]
    cmd = ["bash", "-c", 'printf "%s\\n" "$0" "$1"; sleep 600', *lines]
    step = gpu_run.Step("tests_stand_in", 1, cmd, tests=True)
    run = gpu_run.Run(tmp_path, dry=False, budget=3.0, py=sys.executable)
    monkeypatch.setattr(gpu_run, "MIN_CAP_S", 1.0)
    monkeypatch.setattr(gpu_run, "FINISH_RESERVE_S", 0.0)
    run.steps = [step]
    try:
        run.run_step(step)
    finally:
        shutil.rmtree(run.work, ignore_errors=True)
    assert step.status == "TIMEOUT"
    assert step.details["counts"] == {"passed": 1, "failed": 1}
    assert step.details["failed"] == ["tests/test_b.py::test_y"]


def test_time_a_step_leaves_unused_goes_to_the_next(tmp_path, monkeypatch):
    steps = [gpu_run.Step(f"s{i}", w, ["true"]) for i, w in enumerate((10, 10, 20))]
    _stand_in_run(tmp_path, monkeypatch, steps, budget=40.0)
    # Each cap is the step's share of what is left: 40 * 10/40, then ~40 * 10/30, then ~all.
    assert 9 < steps[0].cap_s <= 10 and 12 < steps[1].cap_s <= 13.4 and steps[2].cap_s > 38
    spent = _stand_in_run(tmp_path / "x", monkeypatch, [gpu_run.Step("late", 1, ["true"])], 0.5)
    assert spent.steps[0].status == "skipped" and "budget" in spent.steps[0].note


def test_steps_run_most_valuable_first(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), str(tmp_path), "--list"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert names.index("topk_triton") < names.index("tests_triton") < names.index("fused_triton")
    fused = [n for n in names if n.startswith("fused_")]
    assert fused[:3] == ["fused_materialized", "fused_chunked", "fused_triton"]
    assert names[-1] == "memcheck"


def test_gpu_all_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_all.sh")]).returncode == 0
