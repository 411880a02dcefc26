"""Shared plumbing of the GPU benchmark scripts (``benchmarks/gpu_*.py``).

Each script times one *variant* (a backend or a baseline) per process, so that a device fault in
one variant loses nothing measured by another (``benchmarks/gpu_run.py`` runs them one by one).
Every figure is appended to a JSON-lines file the moment it exists (:class:`Recorder`), in the
record format of ``benchmarks/results/*.json`` (op, backend, shapes, median seconds, peak memory,
device, commit, torch, date, extra fields); ``benchmarks/gpu_results.py`` merges those lines into
``benchmarks/results/gpu_<op>.json``.

Only the public ``lopd_kernels`` API is used by the scripts (``lk.topk_tail_kl``,
``lk.fused_linear_topk_tail_kl``, ``lk.varlen_cross_attention``, ``lk.QFormerCompressor``,
``backend=`` strings), so the library's internal layout can change under them.

Timing: CUDA events on a GPU (wall clock on the CPU, where the scripts only run as a dry run),
median over repetitions after a warm-up (Triton JIT, cuBLAS handles, allocator). Memory: the
caching allocator's peak above what was allocated before the measured call.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the scripts run as ``python benchmarks/gpu_x.py``
    sys.path.insert(0, str(ROOT))

#: Environment variables set by ``benchmarks/gpu_run.py`` for its children.
RECORDS_ENV = "LOPD_GPU_RECORDS"
COMMIT_ENV = "LOPD_GPU_COMMIT"


def add_common_args(parser: argparse.ArgumentParser, reps: int) -> None:
    """The arguments every GPU script takes: where the records go, device, size, repetitions."""
    parser.add_argument(
        "--records",
        default=os.environ.get(RECORDS_ENV, str(ROOT / "benchmarks/results/gpu_records.jsonl")),
        help=f"JSON-lines file the records are appended to (default: ${RECORDS_ENV})",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (default); cpu only dry-runs the script (tests/test_gpu_scripts.py)",
    )
    parser.add_argument(
        "--size",
        default="full",
        choices=("full", "tiny"),
        help="full: the documented GPU shapes; tiny: a seconds-long dry run",
    )
    parser.add_argument("--reps", type=int, default=reps, help="timed repetitions per figure")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed calls first (JIT compilation, allocator)"
    )


def resolve_device(name: str) -> torch.device | None:
    """``torch.device(name)``, or None (after saying so) when CUDA is asked for but absent."""
    if name == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped (use --device cpu for a dry run)")
        return None
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
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
    """The commit measured: ``$LOPD_GPU_COMMIT`` (the device copy of the tree may have no .git),
    else ``git rev-parse``, else "unknown" (``gpu_results.py merge --commit`` fills it in)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, cwd=ROOT, check=True, timeout=10,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Recorder:
    """Appends one JSON line per figure to ``path`` and flushes it to disk at once.

    Args:
        path: the JSON-lines file (created with its folder).
        device: the device measured (its name goes into every record).
    """

    def __init__(self, path: str | os.PathLike, device: torch.device) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.device = device_name(device)
        self.commit = git_commit()
        self.count = 0

    def add(
        self,
        op: str,
        backend: str,
        shapes: dict[str, Any],
        median_s: float,
        peak_mem_bytes: int | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        rec = {
            "op": op,
            "backend": backend,
            "shapes": shapes,
            "median_s": float(median_s),
            "peak_mem_bytes": None if peak_mem_bytes is None else int(peak_mem_bytes),
            "device": self.device,
            "commit": self.commit,
            "torch": torch.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **{k: _plain(v) for k, v in extra.items()},
        }
        line = json.dumps(rec, sort_keys=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.count += 1
        shape = " ".join(f"{k}={v}" for k, v in shapes.items())
        mem = "" if peak_mem_bytes is None else f"  peak +{peak_mem_bytes / 2**20:.1f} MiB"
        more = "".join(
            f"  {k}={_short(v)}" for k, v in extra.items() if isinstance(v, (int, float, bool))
        )
        print(f"RECORD {op} {backend} [{shape}] {median_s * 1e3:.3f} ms{mem}{more}", flush=True)
        return rec


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Marks points in a sequence of device work; :meth:`deltas` gives the seconds between them.

    On CUDA each mark records an event on the current stream (no synchronization until
    :meth:`deltas`); on the CPU it reads ``perf_counter``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def deltas(self) -> list[float]:
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def time_fwd_bwd(
    forward: Callable[[], Any],
    backward: Callable[[Any], None] | None,
    device: torch.device,
    reps: int,
    clear: Callable[[], None] = lambda: None,
    warmup: int = 1,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Median forward and backward seconds (separately and together) and the peak memory.

    Args:
        forward: runs the forward, returns what ``backward`` needs.
        backward: runs the backward of that output (None: a forward-only figure).
        device: where it runs.
        reps: timed repetitions (after ``warmup`` untimed ones).
        clear: called before every call (drops the previous gradients).
        warmup: untimed calls first (JIT compilation, allocator growth).
        budget_s: if given, fewer repetitions (at least one) when the last warm-up call says
            that ``reps`` of them would take longer than this.

    Returns:
        ``{"fwd": s, "bwd": s | None, "fwd+bwd": s, "peak_bytes": int | None, "reps": int}``;
        the peak is ``max_memory_allocated`` over the timed calls above what was allocated
        before them (the inputs are not in it; the gradients a call leaves behind are).
    """
    warm_s = 0.0
    for _ in range(warmup):
        clear()
        sync(device)
        t0 = time.perf_counter()
        out = forward()
        if backward is not None:
            backward(out)
        del out
        sync(device)
        warm_s = time.perf_counter() - t0
    if budget_s is not None and warm_s > 0:
        reps = max(1, min(reps, int(budget_s / warm_s)))
    clear()
    sync(device)
    base = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    fwd, bwd, total = [], [], []
    for _ in range(reps):
        clear()
        sw = Stopwatch(device)
        sw.mark()
        out = forward()
        sw.mark()
        if backward is not None:
            backward(out)
            sw.mark()
        del out
        d = sw.deltas()
        fwd.append(d[0])
        if backward is not None:
            bwd.append(d[1])
        total.append(sum(d))
    peak = None
    if base is not None:
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    clear()
    return {
        "fwd": median(fwd),
        "bwd": median(bwd) if bwd else None,
        "fwd+bwd": median(total),
        "peak_bytes": peak,
        "reps": reps,
    }


def copy_gbps(x: torch.Tensor, reps: int = 10) -> float:
    """Device copy bandwidth on ``x``'s size: bytes read + written per second (``dst.copy_``)."""
    dst = torch.empty_like(x)
    dst.copy_(x)
    times = []
    for _ in range(reps):
        sw = Stopwatch(x.device)
        sw.mark()
        dst.copy_(x)
        sw.mark()
        times.append(sw.deltas()[0])
    del dst
    return 2 * x.numel() * x.element_size() / median(times) / 1e9


def bandwidth_fields(nbytes: int, seconds: float, copy: float | None) -> dict[str, float]:
    """``achieved_gbps`` for ``nbytes`` moved in ``seconds`` and its fraction of ``copy`` GB/s."""
    gbps = nbytes / seconds / 1e9
    out = {"achieved_gbps": gbps}
    if copy:
        out["fraction_of_copy_bw"] = gbps / copy
    return out


def free_cuda(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_guarded(name: str, fn: Callable[[], None]) -> bool:
    """Runs one figure's code; an exception (out of memory included) is reported and returns
    False, so that the script's other figures still run (a device fault ends the process: the
    records written before it are kept)."""
    try:
        fn()
        return True
    except Exception as err:  # report and carry on with the next figure
        print(f"FAILED {name}: {type(err).__name__}: {str(err)[:2000]}", flush=True)
        return False
