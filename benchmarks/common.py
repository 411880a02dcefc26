"""Shared benchmark plumbing: machine-readable results and peak-memory measurement.

Every benchmark appends one record per (op, backend, shape) to ``benchmarks/results/<op>.json``
(device, commit, shapes, median seconds, peak memory) via :func:`record`; the README tables are
made from those files by ``python benchmarks/report.py``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(os.environ.get("LOPD_BENCH_RESULTS", Path(__file__).parent / "results"))


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


def peak_rss_bytes(setup: str, run: str, threads: int | None = None) -> tuple[int, int]:
    """Run ``setup`` then ``run`` in a fresh Python process; return (rss after setup, peak RSS).

    Peak RSS of a fresh process is the honest CPU memory figure: it counts every temporary the
    allocator ever held, which ``tracemalloc``-style counters miss for torch. The child reads
    ``VmHWM`` from ``/proc/self/status`` after resetting it (``/proc/self/clear_refs``) at the
    start of ``run``, not ``ru_maxrss``: Linux carries ``ru_maxrss`` over fork+exec, so a parent
    holding large tensors would hide the child's peak. ``peak - after_setup`` is the memory the
    measured call needed beyond its inputs.
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
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOPD_RSS"))
    _, before, peak = line.split()
    return int(before), int(peak)
