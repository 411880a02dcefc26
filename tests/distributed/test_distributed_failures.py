"""Several ranks as a user meets them: the FSDP2 smoke command, two nodes, a stuck rank, a lost
rank, each with the real ``python -m lopd.train`` under ``torchrun`` (gloo on the CPU).

* ``torchrun --nproc-per-node 2 -m lopd.train --preset smoke model.parallel=fsdp2`` finishes (it
  deadlocked on step 0: rank 0's evaluation left FSDP2 a forward record the others lacked);
* the multi-node command of docs/trainer.md, run as two launchers on this machine with a c10d
  rendezvous on loopback, trains the smoke preset to the end (data parallel over two processes:
  the step's tasks split across them, every rollout counted once);
* a rank stuck in its rollouts turns into one line on every rank, naming it and its phase,
  within ``model.collective_timeout_minutes``;
* a rank killed (SIGKILL) mid-step: the other exits with one line, no process of the run is
  left, and ``--resume`` gives the metrics of the run that was never killed (DDP: the two-node
  run, FSDP2: the smoke command's run; both have two ranks and the same configuration; the
  killed run continues a copy of it from its step-2 checkpoint).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lopd.config import load_config
from tests.distributed.launch import REPO, env, free_port, metrics, run, torchrun

SMOKE = ["-m", "lopd.train", "--preset", "smoke", "--no-progress"]
SECONDS: dict[str, float] = {}


def _timed(name: str, fn):
    t0 = time.perf_counter()
    out = fn()
    SECONDS[name] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """The FSDP2 smoke command (two ranks), run to the end."""
    run_dir = tmp_path_factory.mktemp("fsdp2") / "run"
    res = _timed(
        "fsdp2 smoke",
        lambda: run(torchrun(2, *SMOKE, "--run-dir", str(run_dir), "model.parallel=fsdp2")),
    )
    return run_dir, res


def test_the_fsdp2_smoke_command_finishes(fsdp2_run):
    run_dir, res = fsdp2_run
    assert "world size 2" in res.stdout
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lopd"]["n"] == 4 and (run_dir / "checkpoints" / "step_000003").is_dir()


# ----------------------------------------------------------------------------- two nodes
def _multi_node_command() -> str:
    """The one multi-node line of docs/trainer.md (its placeholders in capitals)."""
    text = (REPO / "docs" / "trainer.md").read_text()
    lines = [x.strip() for x in text.splitlines() if x.strip().startswith("torchrun --nnodes")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The documented command as two launchers (one rank each) on this machine."""
    run_dir = tmp_path_factory.mktemp("nodes") / "run"
    line = (
        _multi_node_command()
        .replace("HOST:29500", f"127.0.0.1:{free_port()}")
        .replace("GPUS", "1")
        .replace("RUN_ID", "lopd-two-nodes")
        .replace("RUN_DIR", str(run_dir))
    )
    assert not re.search(r"\b[A-Z]{3,}(_[A-Z]+)*\b", line), line  # every placeholder filled
    argv = shlex.split(line)
    assert argv[0] == "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv[1:], "--no-progress"]

    def launch():
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs = [subprocess.Popen(cmd, env=env(), cwd=REPO, **pipes) for _ in range(2)]
        return [(p.communicate(timeout=600), p.returncode) for p in procs]

    return run_dir, _timed("two nodes", launch)


def test_two_launchers_train_the_smoke_preset_to_the_end(two_nodes):
    run_dir, outputs = two_nodes
    for (out, err), code in outputs:
        assert code == 0, out[-2000:] + err[-4000:]
    printed = "".join(out for (out, _), _ in outputs)
    assert "world size 2" in printed and "held-out reward" in printed
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    cfg = load_config("smoke")
    # Both ranks' rollouts are counted (the step's tasks are split across them), and the bank's.
    bank = cfg.data.n_train * cfg.bank.rollouts_per_task
    assert rows[-1]["rollouts"] == bank + cfg.train.steps * cfg.train.tasks_per_step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lopd"]["n"] == cfg.data.n_test and summary["rollouts"] == rows[-1]["rollouts"]


# ----------------------------------------------------------------------------- failures
def _rank_logs(log_dir: Path) -> dict[int, str]:
    """Each rank's stderr (``torchrun --redirects 2|3 --log-dir``)."""
    return {int(p.parent.name): p.read_text() for p in sorted(log_dir.rglob("stderr.log"))}


def _own_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("lopd.train:")]


def test_a_stuck_rank_is_named_on_every_rank_within_the_timeout(tmp_path):
    timeout_s = 12
    logs = tmp_path / "logs"
    cmd = torchrun(
        2, "--redirects", "2", "--log-dir", str(logs),
        str(REPO / "tests" / "distributed" / "stuck_rank_worker.py"), "1", "120",
        "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "--no-progress",
        "--method", "grpo", f"model.collective_timeout_minutes={timeout_s / 60}",
        "data.n_test=1",
    )  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    SECONDS["stuck rank"] = time.perf_counter() - t0
    assert res.returncode != 0
    ranks = _rank_logs(logs)
    first, second = _own_lines(ranks[0]), _own_lines(ranks[1])
    assert len(first) == 1 and len(second) == 1, ranks
    assert "Traceback" not in ranks[0] and "Traceback" not in ranks[1]
    # Rank 0 waited in the step's first collective; rank 1 never left its rollouts.
    assert first[0].startswith(f"lopd.train: rank 0: a collective timed out after {timeout_s} s")
    assert "phase 'loss' at step 0" in first[0]
    assert "rank 1 is in phase 'rollout' at step 0" in first[0]
    assert "raise model.collective_timeout_minutes" in first[0] and "--resume" in first[0]
    # Rank 1, stopped by the launcher, says where it was and repeats rank 0's reason.
    assert second[0].startswith("lopd.train: rank 1: stopped by SIGTERM")
    assert "phase 'rollout' at step 0" in second[0] and "rank 0 failed first" in second[0]
    # Both within the timeout of the collective (plus the start-up of two processes).
    assert SECONDS["stuck rank"] < 120


def _pids_of_run(run_dir: Path) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(run_dir) in cmdline:
                out.append(int(proc.name))
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(child)
    return None


def _rewound(reference: Path, run_dir: Path) -> None:
    """A copy of the finished two-rank ``reference`` run as it stood after its step-2
    checkpoint (its last step, step 2, not yet run): what a run killed in that step leaves."""
    shutil.copytree(reference, run_dir)
    for late in (run_dir / "checkpoints").glob("step_000003*"):
        shutil.rmtree(late) if late.is_dir() else late.unlink()
    (run_dir / "summary.json").unlink()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_a_killed_rank_stops_the_other_and_resume_continues(
    parallel, fsdp2_run, two_nodes, tmp_path
):
    # The run to kill continues the reference run from its step-2 checkpoint (its bank, cold
    # start and first two steps are the reference's: no need to pay for them twice); rank 1 is
    # SIGKILLed in step 2, the last step.
    reference = fsdp2_run[0] if parallel == "fsdp2" else two_nodes[0]
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    _rewound(reference, run_dir)
    args = [*SMOKE, "--run-dir", str(run_dir), "--resume", f"model.parallel={parallel}",
            "model.collective_timeout_minutes=0.5"]  # fmt: skip
    t0 = time.perf_counter()
    launcher = subprocess.Popen(
        torchrun(2, "--redirects", "3", "--log-dir", str(logs), *args),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO,
    )  # fmt: skip
    deadline = time.time() + 300
    while launcher.poll() is None and time.time() < deadline:
        out = "".join(p.read_text() for p in logs.rglob("stdout.log"))
        if "resumed from step_000002" in out:
            break
        time.sleep(0.05)
    time.sleep(0.2)  # into step 2 (the cached evaluations are read, not rerun)
    victim = _rank_pid(launcher.pid, 1)
    assert victim is not None, "the run ended before rank 1 could be killed"
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter()
    launcher.wait(timeout=120)
    stopped = time.perf_counter() - killed
    assert launcher.returncode != 0
    assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
    assert stopped < 30 + 15, stopped  # the collective timeout, and torchrun's grace
    assert _pids_of_run(run_dir) == [], "a process of the killed run is still alive"
    survivor = _rank_logs(logs)[0]
    lines = _own_lines(survivor)
    assert len(lines) == 1 and "Traceback" not in survivor, survivor[-3000:]
    assert lines[0].startswith("lopd.train: rank 0: ") and "--resume" in lines[0]
    assert "rank 1" in lines[0] or "stopped by SIGTERM" in lines[0], lines[0]
    res = run(torchrun(2, *args))
    SECONDS[f"killed + resumed {parallel}"] = time.perf_counter() - t0
    # From the last complete checkpoint: step 2's, or, on a fast machine where step 2 ended
    # before the kill landed, step 3's (the kill then stopped the final evaluation).
    resumed = re.search(r"resumed from step_(\d+)", res.stdout)
    assert resumed and int(resumed.group(1)) >= 2, res.stdout[-2000:]
    assert metrics(run_dir) == metrics(reference)
    assert (run_dir / "summary.json").exists()


def test_distributed_failure_tests_stay_cheap():
    # Every launch above with its interpreters' start-up, on 2 loaded cores.
    assert sum(SECONDS.values()) < 420, SECONDS
