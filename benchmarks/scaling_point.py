"""One point of ``benchmarks/scaling.py``: a forward + backward measured in its own process.

:func:`measure` builds the point's inputs, runs the variant once on a tiny problem (lazy
initialization: the extension, thread pools, a peer's import), resets the process's RSS
high-water mark (``/proc/self/clear_refs``), runs the measured call, and reads the peak
(``VmHWM``). ``extra_peak_bytes`` = peak - RSS before the call (the inputs) - the bytes of the
gradients the call returns. Then up to ``reps`` warm calls are timed (fewer when a call is long;
none past ``warm_budget_s``: the first call's time stands).

:class:`PointRunner` runs each point in a fresh process forked from a *forkserver* that has
imported torch, lopd_kernels and the peers once (nothing else: no tensor, no thread pool), so a
point's peak is its own and its start costs a fork, not an interpreter and a TRL import.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import statistics
import time

import torch

from benchmarks.scaling_ops import OPS, clear_grads, point_inputs

WARMUP_SIZE = (8, 512, 16)  # (N, V, d) of the initialization call
# Imported once by the forkserver; a module that is not installed is skipped.
PRELOAD = ["torch", "lopd_kernels", "benchmarks.scaling_ops", "benchmarks.scaling_point",
           "trl.experimental.sdpo.loss_utils", "trl.kernels.chunked_divergence"]  # fmt: skip


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def measure(spec: dict) -> dict:
    """One point in this process: ``spec`` has op, variant, N, V, d, reps, warm_budget_s and
    ``gc`` (collect garbage first: seconds in a large process, so the in-process quick mode
    skips it)."""
    op, variant = spec["op"], spec["variant"]
    fn = OPS[op].variants[variant].run
    warm = point_inputs(op, variant, *WARMUP_SIZE)
    fn(warm)
    del warm
    x = point_inputs(op, variant, spec["N"], spec["V"], spec["d"])
    if spec.get("gc", True):
        gc.collect()
    before = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    w0, c0 = time.perf_counter(), time.process_time()
    fn(x)
    first, first_cpu = time.perf_counter() - w0, time.process_time() - c0
    peak = max(_status_kib("VmHWM") * 1024, before)
    grad_bytes = clear_grads(x)
    # Warm calls within the budget; a call longer than the budget is timed by its first run
    # (its page faults are then a small part of it).
    n_warm = min(spec["reps"], int(spec["warm_budget_s"] // max(first, 1e-9)))
    walls, cpus = [], []
    for _ in range(n_warm):
        w0, c0 = time.perf_counter(), time.process_time()
        fn(x)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        clear_grads(x)
    return {
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "grad_bytes": grad_bytes,
        "extra_peak_bytes": max(0, peak - before - grad_bytes),
        "first_call_s": first,
        "first_call_cpu_s": first_cpu,
        "calls_s": walls,
        "calls_cpu_s": cpus,
        "median_s": statistics.median(walls) if walls else first,
        "median_cpu_s": statistics.median(cpus) if cpus else first_cpu,
        "timed_first_call_only": not walls,
    }


def _child(spec: dict, threads: int, conn) -> None:
    torch.set_num_threads(threads)  # this process is the measurement's own
    try:
        conn.send(("ok", measure(spec)))
    except Exception as err:  # reported to the parent, which records the point as failed
        conn.send(("error", f"{type(err).__name__}: {str(err)[:300]}"))
    finally:
        conn.close()


class PointRunner:
    """Runs :func:`measure` in a fresh forked process per point (see the module docstring)."""

    def __init__(self, preload: list[str] = PRELOAD) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(preload)

    def __call__(self, spec: dict, threads: int) -> dict:
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_child, args=(spec, threads, send))
        proc.start()
        send.close()
        try:
            status, payload = recv.recv()
        except EOFError:
            status, payload = "error", "the process died without a result"
        proc.join()
        if status != "ok":
            raise RuntimeError(f"{payload} (exit code {proc.exitcode})")
        return payload
