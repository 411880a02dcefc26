"""Shared benchmark plumbing: machine-readable results, peak-memory measurement, and scoped
process settings.

Every benchmark appends one record per (op, backend, shape) to ``benchmarks/results/<op>.json``
(device, commit, shapes, median seconds, peak memory, load average) via :func:`record`; the README
tables are made from those files by ``python benchmarks/report.py``.

Benchmarks leave no global state behind: thread counts are set inside :func:`torch_threads`
(restored on exit, also when a benchmark fails), and anything else a measurement needs (an
environment variable, an allocator setting) is set in the fresh child process of
:func:`peak_rss_bytes`, never in the pytest process.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(os.environ.get("LOPD_BENCH_RESULTS", Path(__file__).parent / "results"))


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block with ``n`` torch intra-op threads (``None``: unchanged); restores the previous
    count on exit. Yields the count in effect."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def load_average() -> float:
    """The 1-minute load average (runnable tasks): on a shared machine, the context of a timing."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(
    op: str,
    backend: str,
    shapes: dict[str, Any],
    median_s: float,
    peak_mem_bytes: int | None = None,
    device: str = "cpu",
    **extra: Any,
) -> dict[str, Any]:
    """Append one benchmark result to ``RESULTS_DIR/<op>.json`` (a JSON list) and return it.

    A record with the same (op, backend, shapes, device name) replaces the older one, so the file
    holds the latest measurement per configuration.
    """
    rec = {
        "op": op,
        "backend": backend,
        "shapes": shapes,
        "median_s": median_s,
        "peak_mem_bytes": peak_mem_bytes,
        "device": device_name(device),
        "commit": git_commit(),
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "load_avg_1min": load_average(),
        **extra,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{op}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    key = (op, backend, json.dumps(shapes, sort_keys=True), rec["device"])
    rows = [
        r
        for r in rows
        if (r["op"], r["backend"], json.dumps(r["shapes"], sort_keys=True), r["device"]) != key
    ]
    rows.append(rec)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return rec


def child_call_seconds(
    setup: str, run: str, calls: int = 2, threads: int | None = None
) -> list[float]:
    """Wall seconds of the first ``calls`` executions of ``run`` in a fresh Python process (after
    ``setup``): what a process's first calls cost (fresh memory, cold caches), for comparison
    with a warm median measured in a long-lived one."""
    code = textwrap.dedent(
        f"""
        import time
        import torch
        {f"torch.set_num_threads({threads})" if threads else ""}
        """
    )
    code += textwrap.dedent(setup)
    code += "\n_times = []\n"
    code += f"for _ in range({calls}):\n    _t0 = time.perf_counter()\n"
    code += textwrap.indent(textwrap.dedent(run), "    ")
    code += "\n    _times.append(time.perf_counter() - _t0)\n"
    code += 'print("LOPD_TIMES", *_times)\n'
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOPD_TIMES"))
    return [float(x) for x in line.split()[1:]]


def peak_rss_bytes(
    setup: str, run: str, threads: int | None = None, env: dict[str, str] | None = None
) -> tuple[int, int]:
    """Run ``setup`` then ``run`` in a fresh Python process; return (rss after setup, peak RSS).

    Peak RSS of a fresh process is the honest CPU memory figure: it counts every temporary the
    allocator ever held, which ``tracemalloc``-style counters miss for torch. The child reads
    ``VmHWM`` from ``/proc/self/status`` after resetting it (``/proc/self/clear_refs``) at the
    start of ``run``, not ``ru_maxrss``: Linux carries ``ru_maxrss`` over fork+exec, so a parent
    holding large tensors would hide the child's peak. ``peak - after_setup`` is the memory the
    measured call needed beyond its inputs. ``env`` adds environment variables for the child only.
    """
    code = textwrap.dedent(
        f"""
        import torch
        {f"torch.set_num_threads({threads})" if threads else ""}
        def _status_kib(field):
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
            raise RuntimeError(field + " missing from /proc/self/status")
        """
    )
    code += textwrap.dedent(setup) + textwrap.dedent(
        """
        import gc
        gc.collect()
        _before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        """
    )
    code += textwrap.dedent(run) + textwrap.dedent(
        """
        _peak = max(_status_kib("VmHWM"), _before)
        print("LOPD_RSS", _before * 1024, _peak * 1024)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, **(env or {})},
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOPD_RSS"))
    _, before, peak = line.split()
    return int(before), int(peak)
