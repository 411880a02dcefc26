"""Launching ``torchrun`` from the distributed tests: environment, free ports, metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """This worktree's code first, one thread per process (the CI machine has two cores)."""
    out = dict(os.environ)
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    out["OMP_NUM_THREADS"] = "1"
    return out


def free_port() -> int:
    """A TCP port nothing listens on now (tests run beside other jobs on the same machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, port: int | None = None) -> list[str]:
    """``torchrun --nproc-per-node nproc`` on a free loopback port, then ``args``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()), *args,
    ]  # fmt: skip


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository; assert it succeeded (its output's tail otherwise)."""
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + _errors(res.stderr) + res.stderr[-3000:]
    return res


def _errors(text: str) -> str:
    """The lines of a failed launch that say why (the ranks' errors, a C++ abort's reason)."""
    keys = ("Error", "what()", "terminate called", "lopd.train:", "Timed out", "by peer")
    lines = [x for x in text.splitlines() if any(k in x for k in keys)]
    return "\n".join(lines[:40]) + "\n...\n"


def metrics(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` without its timings (``seconds_*``)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]
