"""The GPU check: build, test and benchmark everything GPU-side on one CUDA machine, in one run.

    bash benchmarks/gpu_all.sh OUT [--dry-run-cpu] [--only STEP,...] [--list]

``benchmarks/gpu_all.sh`` runs this file with the machine's python3 (``PYTHON=...`` picks
another): the torch, Triton and nvcc installed there, and this checkout. Every step is a
subprocess of its own (a device fault or a hang loses that step only), killed with its process
group at its time cap, and reported in ``OUT/summary.md`` / ``OUT/summary.json`` as soon as it
ends. The steps, most valuable first (``--list`` prints them with their weights; the commands
are in ``benchmarks/gpu_steps.py``):

1. ``build`` (in the background from the start, CPU only): the extension with the CUDA kernels
   for this machine's GPU (``LOPD_CUDA_ARCHS``, default from ``nvidia-smi``), copied into
   ``lopd_kernels/`` when it succeeds; a failed build leaves the Triton path, and the CUDA steps
   say they were skipped;
2. ``env``: versions, device, copy bandwidth and bf16 matrix rate;
3. ``topk_*``: ``topk_tail_kl`` Triton, then its baselines, then the launch sweep;
4. ``tests_triton``: the kernel tests of every op on real CUDA tensors (Triton paths);
5. ``probe``: waits for the build, then checks which backends run (``gpu_probe.py``);
6. ``tests_cuda``: the real-GPU CUDA kernel tests; ``topk_cuda``;
7. ``fused_*``: materialized -> chunked -> Triton at N=8192, d=4096, V=151,936, then TRL and
   Liger where they are installed (``pip install trl liger-kernel``; steps whose peer is missing
   are skipped and say so);
8. ``varlen_*`` / ``qformer_*``: varlen attention (Triton, CUDA, padded SDPA, flash-attn where
   installed) and the QFormer module (fused vs padded);
9. ``train_*``: one LOPD step of a Qwen3-0.6B-shaped model, fused linear on and off;
10. ``memcheck``: the CUDA (and Triton out-of-bounds) tests under compute-sanitizer memcheck,
    small shapes, ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (the caching allocator hides overruns
    inside its blocks), no compile-check tests.

Time: the whole run is bounded by ``LOPD_GPU_BUDGET_S`` (default 1800 s). Each step's cap is its
weight's share of the time left, so time a step does not use goes to the ones after it, and a
step that runs to its cap cannot starve them.

What it writes in OUT: ``summary.md`` (the step table and every figure), ``summary.json``,
``records.jsonl`` (every figure, appended the moment it is measured, in the record format of
``benchmarks/results/*.json``), ``env.json``, ``gpu_all.log`` (every step's output, streamed)
and ``logs/`` (per-step logs, junit XML of the test steps, the build log). Then, in the
checkout:

    python benchmarks/gpu_results.py merge OUT/records.jsonl   # -> benchmarks/results/gpu_<op>.json
    python benchmarks/report.py                                # every table, the GPU ones too

``--dry-run-cpu`` runs every step on the CPU at tiny shapes (Triton under its interpreter, the
C++ kernels standing in for CUDA, pytest selections collected but not run, no build): the CI
check that this script keeps working on machines without a GPU (tests/scripts/test_gpu_scripts.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import gpu_fork  # noqa: E402
import gpu_results  # noqa: E402
from gpu_steps import MEMCHECK_K, MEMCHECK_K_TRITON_ONLY, Step, plan  # noqa: E402

MIN_CAP_S = 10.0  # below this a step is skipped: a python + torch process needs ~5 s to start
FINISH_RESERVE_S = 10.0  # kept back for the summary
BUILD_CAP_S = 600.0
DEFAULT_BUDGET_S = 1800.0


class Run:
    """State of one run: paths, clock, the steps and their results."""

    def __init__(self, out: Path, dry: bool, budget: float, py: str) -> None:
        self.out, self.dry, self.budget, self.py = out, dry, budget, py
        out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="lopd_gpu_"))  # the extension's build folder
        self.logs = out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.records = out / "records.jsonl"
        self.env_json = out / "env.json"
        # Open for the whole run (line-buffered): every step's output is appended as it comes.
        self.log = open(out / "gpu_all.log", "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self.steps: list[Step] = []
        self.build: subprocess.Popen | None = None
        self.build_status = "not started"
        self.backends: dict[str, str] = {}
        self.current: subprocess.Popen | None = None
        self.commit = common.git_commit()
        self.env = dict(os.environ)
        self.env.update(
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), self.env.get("PYTHONPATH", "")) if p),
            **{common.RECORDS_ENV: str(self.records), common.COMMIT_ENV: self.commit},
        )
        if dry:
            self.env["TRITON_INTERPRET"] = "1"  # Triton kernels on CPU tensors

    # ------------------------------------------------------------------ clock and output

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget - FINISH_RESERVE_S - self.elapsed()

    def say(self, msg: str) -> None:
        line = f"== [+{self.elapsed():.0f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")

    # ------------------------------------------------------------------ steps

    def cap_for(self, step: Step) -> float:
        pending = [s for s in self.steps if s.status == "pending"]
        share = self.left() * step.weight / max(1e-9, sum(s.weight for s in pending))
        return min(self.left(), max(MIN_CAP_S, share))

    def run_cmd(self, step: Step, cmd: list[str], cap: float, env: dict[str, str]) -> int | None:
        """Runs ``cmd`` in its own process group, streaming its output to the console, the
        combined log and the step's log; kills the group at ``cap``. Returns the exit code,
        None on a timeout."""
        step_log = open(self.logs / f"{step.name}.log", "w", encoding="utf-8")  # noqa: SIM115
        if self.dry and gpu_fork.forkable(cmd, self.py):
            proc: Any = gpu_fork.Forked(cmd, env)
        else:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace",
            )  # fmt: skip
        self.current = proc

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()  # each line on the console at once
                self.log.write(line)
                step_log.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        reader.join(timeout=10)
        self.current = None
        step_log.close()
        return rc

    def unrunnable(self, step: Step, probed: bool) -> str | None:
        """Why ``step`` cannot run here (a missing peer; a backend the probe found absent), or
        None. ``probed``: whether the probe has run (before it, ``needs`` cannot be judged)."""
        missing = [m for m in step.requires if not _importable(m, self.env)]
        if missing:
            return f"{', '.join(missing)} not importable here"
        bad = [k for k in step.needs if self.backends.get(k) != "ok"]
        if bad and probed:
            return "needs " + "; ".join(f"{k}: {self.backends.get(k, 'not probed')}" for k in bad)
        return None

    def skip_unrunnable(self, probed: bool) -> None:
        """Skips, now, the pending steps that cannot run, so that their share of the time goes
        to the others (called at the start and after the probe)."""
        for s in self.steps:
            why = self.unrunnable(s, probed) if s.status == "pending" else None
            if why:
                self.finish(s, "skipped", why)

    def run_step(self, step: Step) -> None:
        self.poll_build()
        why = self.unrunnable(step, probed=True)
        if why:
            return self.finish(step, "skipped", why)
        if self.left() < MIN_CAP_S:
            return self.finish(step, "skipped", f"budget spent ({self.left():.0f} s left)")
        cap = self.cap_for(step)
        step.cap_s = round(cap, 1)
        self.say(f"step {step.name} (cap {cap:.0f} s): {' '.join(step.cmd or [step.name])}")
        start = time.monotonic()
        if step.name == "probe":
            rc = self.probe(step, cap)
        else:
            cmd = step.cmd
            if step.name == "memcheck" and self.backends.get("topk_tail_kl/cuda") != "ok":
                cmd = [MEMCHECK_K_TRITON_ONLY if a == MEMCHECK_K else a for a in cmd]
                step.note = "no CUDA kernels: the Triton out-of-bounds test only"
            rc = self.run_cmd(step, cmd, cap, {**self.env, **step.env})
        step.elapsed_s = round(time.monotonic() - start, 1)
        step.rc = rc
        if step.tests:
            step.details = self.test_details(step)
        log = self.logs / f"{step.name}.log"
        if (
            step.name == "memcheck"
            and log.exists()
            and "Device not supported" in log.read_text(errors="replace")
        ):
            return self.finish(step, "skipped", "compute-sanitizer: device not supported here")
        if rc is None:
            self.finish(step, "TIMEOUT", f"killed at its cap of {cap:.0f} s")
        elif rc == 0:
            self.finish(step, "ok", step.note)
        else:
            self.finish(
                step, "FAILED", f"exit status {rc}" + (f"; {step.note}" if step.note else "")
            )

    def finish(self, step: Step, status: str, note: str) -> None:
        step.status, step.note = status, note
        took = "" if step.elapsed_s is None else f" in {step.elapsed_s:.0f} s"
        self.say(f"{step.name}: {status}{took}{' (' + note + ')' if note else ''}")
        self.write_summary()

    # ------------------------------------------------------------------ built-in steps

    def probe(self, step: Step, cap: float) -> int | None:
        """Waits for the background build (within the build's own cap), installs what it built,
        then runs ``gpu_probe.py``; its results gate the CUDA steps."""
        self.wait_build(self.left())
        backends = "cpu,triton,chunked" if self.dry else "triton,cuda,chunked"
        cmd = [self.py, "benchmarks/gpu_probe.py", "--env-json", str(self.env_json),
               "--backends", backends, *self.device_args()]  # fmt: skip
        rc = self.run_cmd(step, cmd, max(MIN_CAP_S, min(cap, self.left())), self.env)
        try:
            self.backends = json.loads(self.env_json.read_text()).get("backends", {})
        except (OSError, json.JSONDecodeError):
            self.backends = {}
        if self.dry:  # the C++ kernels stand in for CUDA on the CPU
            self.backends.update({k.replace("/cpu", "/cuda"): v for k, v in self.backends.items()})
        if not self.build_status.startswith("ok"):
            for k in [k for k in self.backends if k.endswith("/cuda")]:
                self.backends[k] = f"not built (build {self.build_status})"
        step.note = f"build {self.build_status}"
        step.details = {"backends": self.backends, "build": self.build_status}
        return rc

    # ------------------------------------------------------------------ build

    def start_build(self) -> None:
        build_dir = self.work / "build"
        arch = _local_cuda_arch() or "80;90a"
        default = (
            "true" if self.dry else
            f"LOPD_CUDA=1 LOPD_CUDA_ARCHS=${{LOPD_CUDA_ARCHS:-'{arch}'}} "
            f"MAX_JOBS=${{MAX_JOBS:-{os.cpu_count() or 4}}} "
            f"nice -n 10 {self.py} setup.py build_ext --build-lib {build_dir}/lib "
            f"--build-temp {build_dir}/tmp"
        )  # fmt: skip
        cmd = os.environ.get("LOPD_GPU_BUILD_CMD", default)
        self.say(f"build (background, cap {BUILD_CAP_S:.0f} s): {cmd}")
        self.build_log = open(self.logs / "build.log", "w", encoding="utf-8")  # noqa: SIM115
        self.build_started = time.monotonic()
        self.build = subprocess.Popen(
            ["bash", "-c", cmd], cwd=ROOT, env=self.env, stdout=self.build_log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.build_status = "running"
        self.build_end: float | None = None

    def poll_build(self) -> None:
        """Notes when the background build ended (checked between steps)."""
        if self.build is not None and self.build_end is None and self.build.poll() is not None:
            self.build_end = time.monotonic()

    def wait_build(self, wait: float) -> None:
        if self.build is None or self.build_status != "running":
            return
        wait = min(wait, BUILD_CAP_S - (time.monotonic() - self.build_started))
        try:
            rc = self.build.wait(timeout=max(0.0, wait))
        except subprocess.TimeoutExpired:
            _kill_group(self.build)
            rc = None
        self.poll_build()
        took = (self.build_end or time.monotonic()) - self.build_started
        self.build_log.close()
        if rc == 0:
            built = sorted((self.work / "build" / "lib" / "lopd_kernels").glob("_C*.so"))
            for so in built:  # into the tree only now: no process saw a half-written file
                tmp = ROOT / "lopd_kernels" / (so.name + ".tmp")
                shutil.copyfile(so, tmp)
                os.replace(tmp, ROOT / "lopd_kernels" / so.name)
            self.build_status = f"ok in {took:.0f} s" + ("" if built else " (nothing new built)")
        else:
            why = "timed out" if rc is None else f"FAILED (exit {rc})"
            self.build_status = f"{why} after {took:.0f} s: the Triton path only"
            tail = (self.logs / "build.log").read_text(errors="replace").splitlines()[-40:]
            self.log.write("\n".join(tail) + "\n")
            print("\n".join(tail))
        self.say(f"build {self.build_status}")

    # ------------------------------------------------------------------ tests

    def device_args(self) -> list[str]:
        return ["--device", "cpu", "--size", "tiny", "--reps", "1"] if self.dry else []

    def pytest_cmd(self, name: str, files: list[str], expr: str) -> list[str]:
        junit = self.logs / f"{name}.xml"
        cmd = [self.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
               "--durations=10", f"--junitxml={junit}", *files, "-k", expr]  # fmt: skip
        if self.dry:
            return [*cmd, "--collect-only"]
        cmd[cmd.index("-q")] = "-v"  # each test's outcome in the log, even if the step is killed
        if name != "memcheck":  # under memcheck a test runs 10-100x slower, in one process
            if _importable("xdist", self.env):
                cmd += ["-n", "8"]
            if _importable("pytest_timeout", self.env):
                cmd += ["--timeout", "120"]  # a hung test fails alone, the step goes on
        return cmd

    def test_details(self, step: Step) -> dict[str, Any]:
        """Counts and failed test ids from the junit XML (the selected ids in a dry run)."""
        if self.dry:
            text = (self.logs / f"{step.name}.log").read_text(errors="replace")
            ids = [ln.strip() for ln in text.splitlines() if "::" in ln and ln.startswith("tests/")]
            per_file: dict[str, int] = {}
            for i in ids:
                per_file[i.split("::")[0]] = per_file.get(i.split("::")[0], 0) + 1
            return {"collected": len(ids), "per_file": per_file, "ids": ids}
        path = self.logs / f"{step.name}.xml"
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):  # killed before pytest wrote it: read the -v lines
            text = (self.logs / f"{step.name}.log").read_text(errors="replace")
            seen: dict[str, list[str]] = {k: [] for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
            outcome = "PASSED|FAILED|ERROR|SKIPPED"
            for m in re.finditer(rf"\b({outcome}) (tests/\S+)|(tests/\S+) ({outcome})\b", text):
                seen[m.group(1) or m.group(4)].append(m.group(2) or m.group(3))
            return {"junit": "missing (step killed); counts from the log",
                    "counts": {k.lower(): len(v) for k, v in seen.items() if v},
                    "failed": (seen["FAILED"] + seen["ERROR"])[:50]}  # fmt: skip
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        failed = []
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
        counts["passed"] = (
            counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        )
        return {**counts, "failed": failed[:50]}

    # ------------------------------------------------------------------ summary

    def write_summary(self) -> tuple[str, str]:
        """Rewrites ``summary.json`` and ``summary.md``; returns the markdown's two parts (the
        step table, the figures)."""
        records = (
            gpu_results.derive(gpu_results.load(self.records)) if self.records.exists() else []
        )
        data = {
            "commit": self.commit, "dry_run": self.dry, "budget_s": self.budget,
            "wall_s": round(self.elapsed(), 1), "build": self.build_status,
            "records": len(records),
            "steps": [{k: v for k, v in dataclasses.asdict(s).items() if k not in ("env",)}
                      for s in self.steps],
        }  # fmt: skip
        common.atomic_write_text(self.out / "summary.json", json.dumps(data, indent=1) + "\n")
        lines = [f"# GPU run at {self.commit} ({'CPU dry run' if self.dry else 'GPU'})", "",
                 f"wall {self.elapsed():.0f} s of a {self.budget:.0f} s budget; "
                 f"build: {self.build_status}; {len(records)} records", "",
                 "| step | cap s | took s | status | note |", "|---|---|---|---|---|"]  # fmt: skip
        failed = []
        for s in self.steps:
            note = s.note
            if s.tests and s.details:
                note = _tests_note(s.details, self.dry) + (f"; {note}" if note else "")
                failed += [f"- {s.name}: {i}" for i in s.details.get("failed", [])[:15]]
            lines.append(f"| {s.name} | {_cell(s.cap_s)} | {_cell(s.elapsed_s)} | {s.status} | "
                         f"{note.replace('|', '/')[:300]} |")  # fmt: skip
        if failed:
            lines += ["", "Failed tests (first 15 per step; all in logs/<step>.xml):", *failed]
        steps_md = "\n".join(lines)
        figures_md = "\n".join(["```", gpu_results.table(records), "```", ""])
        common.atomic_write_text(self.out / "summary.md", steps_md + "\n\n" + figures_md)
        return steps_md, figures_md

    def stop_children(self) -> None:
        for proc in (self.current, self.build):
            if proc is not None and proc.poll() is None:
                _kill_group(proc)


def _tests_note(d: dict[str, Any], dry: bool) -> str:
    if dry:
        return f"{d.get('collected')} selected"
    if "junit" in d:
        counts = ", ".join(f"{n} {k}" for k, n in d.get("counts", {}).items())
        return f"{counts or 'no test finished'} ({d['junit']})"
    return (f"{d['passed']} passed, {d['failures']} failed, {d['errors']} errors, "
            f"{d['skipped']} skipped")  # fmt: skip


def _cell(v: Any) -> str:
    return "" if v is None else f"{v:g}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (it was started in a session of its own), SIGKILL
    after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # not (yet) a group leader: the process alone
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _importable(module: str, env: dict[str, str]) -> bool:
    """Whether ``module`` imports under ``env``'s PYTHONPATH."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    saved = sys.path[:]
    sys.path[:0] = paths
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved
        importlib.invalidate_caches()


def _local_cuda_arch() -> str | None:
    """This machine's first GPU as a CUDA architecture for ``LOPD_CUDA_ARCHS`` ("90a" for compute
    capability 9.0, the architecture-specific target CI compiles for; "80" for 8.0), from
    ``nvidia-smi``; None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    major, _, minor = (out.split() or [""])[0].partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    return f"{major}{minor}" + ("a" if major == "9" else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="results folder (created if missing)")
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny CPU run of every step")
    parser.add_argument("--only", default="", help="comma-separated step names to run")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = float(os.environ.get("LOPD_GPU_BUDGET_S", DEFAULT_BUDGET_S))
    run = Run(out, args.dry_run_cpu, budget, os.environ.get("PYTHON", sys.executable))
    run.steps = plan(run)
    if args.list:
        # If every step ran to its cap, each would get exactly this share: its guaranteed time.
        total = sum(s.weight for s in run.steps)
        print(f"{'step':24s} {'weight':>6s} {'min cap s':>9s}  command ({budget:.0f} s budget)")
        for s in run.steps:
            floor = (budget - FINISH_RESERVE_S) * s.weight / total
            print(f"{s.name:24s} {s.weight:6.0f} {floor:9.0f}  {' '.join(s.cmd or [s.name])}")
        shutil.rmtree(run.work, ignore_errors=True)
        return 0
    only = {x for x in args.only.split(",") if x}
    unknown = only - {s.name for s in run.steps}
    if unknown:
        parser.error(f"--only: unknown steps {sorted(unknown)}")
    for s in run.steps:
        if only and s.name not in only and s.status == "pending":
            s.status, s.note = "skipped", "not in --only"
    if run.dry and run.py == sys.executable:
        os.environ.update(TRITON_INTERPRET="1")  # before triton is imported
        gpu_fork.preload(
            any(s.name.startswith("train_") for s in run.steps if s.status == "pending")
        )

    def on_signal(signum, _frame) -> None:
        run.say(f"signal {signum}: stopping; the summary keeps what finished")
        run.stop_children()
        run.write_summary()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run.say(f"GPU run at {run.commit}: budget {budget:.0f} s, dry run {run.dry}, out {out}")
    if not only or "probe" in only:
        run.start_build()
    else:
        run.build_status = "not needed by --only"
    run.skip_unrunnable(probed=False)  # steps whose optional peer is not installed
    run.write_summary()
    for step in run.steps:
        if step.status != "pending":
            continue
        run.run_step(step)
        if step.name == "probe":
            run.skip_unrunnable(probed=True)
        if step.name == "env" and not run.dry and not _has_device(run):
            run.say("no CUDA device here: nothing GPU-side ran (--dry-run-cpu for a CPU check)")
            for s in run.steps:
                if s.status == "pending":
                    s.status, s.note = "skipped", "no CUDA device"
            break
    if run.build_status == "running":
        run.wait_build(0)
    run.stop_children()
    steps_md, figures_md = run.write_summary()
    shutil.rmtree(run.work, ignore_errors=True)  # the build folder (its log is in logs/)
    bad = [s for s in run.steps if s.status in ("FAILED", "TIMEOUT")]
    print(figures_md)  # the step table last, where the terminal shows it
    print(steps_md)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    n_logs = sum(1 for p in run.logs.iterdir() if p.is_file())
    print(f"wrote {out}: {', '.join(files)}, logs/ ({n_logs} files); merge the figures with "
          f"`python benchmarks/gpu_results.py merge {out / 'records.jsonl'}`")  # fmt: skip
    failed_build = not run.build_status.startswith(("ok", "not needed"))
    return 1 if bad or failed_build or (not _has_device(run) and not run.dry) else 0


def _has_device(run: Run) -> bool:
    try:
        return bool(json.loads(run.env_json.read_text()).get("device"))
    except (OSError, json.JSONDecodeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
