"""Shared benchmark plumbing: one record format, machine and commit names, timing and memory.

Every figure is a *record* (:func:`make_record`): op, backend, shapes, median seconds, peak
memory, device, commit, torch, date, plus extra fields. Two writers:

* the pytest-benchmark files (``benchmarks/bench_*.py``) append one record per (op, backend,
  shape) to ``benchmarks/results/<op>.json`` with :func:`record`; the README tables are made from
  those files by ``python benchmarks/report.py``;
* the GPU scripts (``benchmarks/gpu_*.py``, run by ``bash benchmarks/gpu_all.sh OUT``) time one
  variant per process and append each record the moment it exists to a JSON-lines file
  (:class:`Recorder`); ``python benchmarks/gpu_results.py merge`` adds them to
  ``benchmarks/results/gpu_<op>.json``. The GPU scripts use only the public ``lopd_kernels`` API
  (``backend=`` strings), so the library's internal layout can change under them.

Benchmarks leave no global state behind: thread counts are set inside :func:`torch_threads`
(restored on exit, also when a benchmark fails), and anything else a measurement needs (an
environment variable, an allocator setting) is set in the fresh child process of
:func:`peak_rss_bytes`, never in the pytest process.

GPU timing: CUDA events (wall clock on the CPU, where the GPU scripts only dry-run), median over
repetitions after a warm-up (Triton JIT, cuBLAS handles, allocator); GPU memory: the caching
allocator's peak above what was allocated before the measured call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the GPU scripts run as ``python benchmarks/gpu_x.py``
    sys.path.insert(0, str(ROOT))

RESULTS_DIR = Path(os.environ.get("LOPD_BENCH_RESULTS", ROOT / "benchmarks" / "results"))

#: Environment variables ``benchmarks/gpu_run.py`` sets for its steps: where the records go, and
#: the commit of the run (so that every record of one run names the same commit).
RECORDS_ENV = "LOPD_GPU_RECORDS"
COMMIT_ENV = "LOPD_GPU_COMMIT"


# ------------------------------------------------------------------------------ records


def device_name(device: str | torch.device = "cpu") -> str:
    """The GPU's name, or the CPU's model name and the torch thread count."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The commit measured: ``$LOPD_GPU_COMMIT`` (set by the GPU run for its steps), else
    ``git rev-parse --short HEAD``, else "unknown" (``gpu_results.py merge --commit`` fills it
    in, for a source tree without ``.git``)."""
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


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``path`` through a temporary file and a rename: a reader sees the old or the new
    content, never half of it (a run killed mid-write leaves the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def make_record(
    op: str,
    backend: str,
    shapes: dict[str, Any],
    median_s: float,
    peak_mem_bytes: int | None,
    device: str,
    commit: str,
    **extra: Any,
) -> dict[str, Any]:
    """One record of the results format (``device``: its name, :func:`device_name`)."""
    return {
        "op": op,
        "backend": backend,
        "shapes": shapes,
        "median_s": median_s,
        "peak_mem_bytes": peak_mem_bytes,
        "device": device,
        "commit": commit,
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def record_key(rec: dict[str, Any]) -> tuple:
    """What a newer record of the same configuration replaces: (op, backend, shapes, device)."""
    return (rec["op"], rec["backend"], json.dumps(rec["shapes"], sort_keys=True), rec["device"])


def record(
    op: str,
    backend: str,
    shapes: dict[str, Any],
    median_s: float,
    peak_mem_bytes: int | None = None,
    device: str = "cpu",
    results_dir: Path | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Append one benchmark result to ``RESULTS_DIR/<op>.json`` (a JSON list) and return it.

    A record with the same (op, backend, shapes, device name) replaces the older one, so the file
    holds the latest measurement per configuration. CPU records carry the load average (unless
    ``extra`` gives one). ``results_dir`` replaces ``RESULTS_DIR`` for this call (a script's
    ``--results``, a test's temporary folder).
    """
    extra.setdefault("load_avg_1min", load_average())
    rec = make_record(
        op, backend, shapes, median_s, peak_mem_bytes, device_name(device), git_commit(), **extra
    )
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{op}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if record_key(r) != record_key(rec)]
    rows.append(rec)
    atomic_write_text(path, json.dumps(rows, indent=1) + "\n")
    return rec


# ------------------------------------------------------------------------------ CPU measurements


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


# ------------------------------------------------------------------------------ GPU scripts


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
        help="cuda (default); cpu only dry-runs the script (tests/scripts/test_gpu_scripts.py)",
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


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, reps: int
) -> tuple[argparse.Namespace, torch.device | None]:
    """A GPU script's arguments (its own and :func:`add_common_args`' with ``reps`` repetitions)
    and its device (None, after saying so, when CUDA is asked for but absent: nothing to run)."""
    add_common_args(parser, reps)
    args = parser.parse_args(argv)
    return args, resolve_device(args.device)


def resolve_device(name: str) -> torch.device | None:
    """``torch.device(name)``, or None (after saying so) when CUDA is asked for but absent."""
    if name == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped (use --device cpu for a dry run)")
        return None
    return torch.device(name)


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
        peak = None if peak_mem_bytes is None else int(peak_mem_bytes)
        rec = make_record(
            op, backend, shapes, float(median_s), peak, self.device, self.commit,
            **{k: _plain(v) for k, v in extra.items()},
        )  # fmt: skip
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


def run_each(
    label: str, items: Iterable[str], fn: Callable[[str], None], device: torch.device
) -> bool:
    """``fn(item)`` for every item under :func:`run_guarded` (one failing item does not stop the
    others), freeing the CUDA cache after each; whether all passed."""
    ok = True
    for item in items:
        ok &= run_guarded(f"{label} {item}", lambda item=item: fn(item))
        free_cuda(device)
    return ok
