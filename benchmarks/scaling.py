"""Time and extra peak memory of the loss ops against N and V on CPU, log-log, with fitted slopes.

    python benchmarks/scaling.py              # ~35 min, 1 thread: records, two PNGs
    python benchmarks/scaling.py --plot-only  # the PNGs again from benchmarks/results/scaling.json
    python benchmarks/scaling.py --quick      # seconds, tiny grids (test_bench_scripts.py)

Ops, variants and grids: :mod:`benchmarks.scaling_ops` (``topk_tail_kl``: N = 256 .. 8192 at
V = 32,768 and V = 32k .. 256k at N = 512; ``fused_linear_topk_tail_kl``, d = 128: N = 256 .. 8192
at V = 32,768 and V = 32k .. 256k at N = 1,024; float32, M = 20).

**How a point is measured** (:mod:`benchmarks.scaling_point`). Each (op, variant, point) runs in
a fresh process (forked from a server that has only imported torch, lopd_kernels and TRL) that
builds its inputs, does one forward + backward on a tiny problem (lazy initialization), then
resets its RSS high-water mark (``/proc/self/clear_refs``) and runs the measured call: **extra
peak memory** = the process's peak RSS (``VmHWM``) during that first call minus its RSS before it
(the inputs) minus the bytes of the gradients the call returns (which any implementation must hand
back). Time: the median wall-clock of the warm calls after it (``--reps``, fewer when a call is
long: ``--warm-budget-s``; a call longer than that is timed by its first run); CPU seconds are
recorded too. Points run in increasing size; a point
whose predicted peak RSS (a power law, at least linear, through the variant's two previous points)
exceeds ``--budget-gib`` (default 8) or 80% of the memory available now, or whose predicted time
exceeds ``--point-limit-s``, is **not run** and is recorded and plotted as such (hollow marker at
the prediction, shaded column), never dropped. ``--quick`` measures in-process (memory then
approximate).

**Slopes.** Least squares of log(value) on log(N or V) over the points run (memory floored at
1 MiB), and over the last three points run (legend: "last 3 points"): a linear op has time slope
~1; the fused op's extra memory is flat in N (slope ~0) once N exceeds what its token chunks and
buffers reach (``lk.auto_chunk_rows``: 512-row chunks at V = 32,768 on CPU).

Records: ``benchmarks/results/scaling.json`` (one per point, with CPU kind, threads, load) and
``scaling_fit.json`` (slopes); plots ``scaling_<op>.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS_DIR, load_average, record, torch_threads
from benchmarks.scaling_ops import OPS
from benchmarks.scaling_point import PointRunner, measure

# ------------------------------------------------------------------------------ sweeps


def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x); None below two points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx > 0 else None


def predict(xs: list[float], ys: list[float], x: float) -> float | None:
    """A power law through the last two points (proportional from one point) at ``x``."""
    if not xs:
        return None
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    k = fit_slope(xs[-2:], ys[-2:])
    k = 1.0 if k is None else max(k, 1.0)
    return ys[-1] * (x / xs[-1]) ** k


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def run_sweep(op, variant, axis, fixed, values, args, runner) -> list:
    """Every point of one sweep, smallest first; returns ``(shapes, fields)`` per point."""
    xs, peaks, secs, out = [], [], [], []
    for val in values:
        dims = {**fixed, axis: val}
        shapes = {"op": op, "sweep": axis, "N": dims["N"], "V": dims["V"], "d": dims["d"],
                  "M": 20, "dtype": "float32", "pass": "fwd+bwd"}  # fmt: skip
        p_peak, p_time = predict(xs, peaks, val), predict(xs, secs, val)
        limit = min(args.budget_gib * 2**30, 0.8 * _mem_available())
        why = None
        if p_peak is not None and p_peak > limit:
            why = f"predicted peak RSS {p_peak / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"
        elif p_time is not None and p_time > args.point_limit_s:
            why = f"predicted {p_time:.0f} s per call > {args.point_limit_s:.0f} s"
        if why:
            print(f"  {variant:45} {axis}={val:>7}: not run ({why})", flush=True)
            out.append((shapes, {"skipped": why, "predicted_peak_rss_bytes": p_peak,
                                 "predicted_s": p_time}))  # fmt: skip
            continue
        spec = {"op": op, "variant": variant, **{k: dims[k] for k in ("N", "V", "d")}}
        spec |= {"reps": args.reps, "warm_budget_s": args.warm_budget_s, "gc": not args.quick}
        try:
            if args.quick:
                with torch_threads(args.threads):
                    res = measure(spec)
            else:
                res = runner(spec, args.threads)
        except (RuntimeError, MemoryError) as err:
            print(f"  {variant:45} {axis}={val:>7}: failed ({err})", flush=True)
            out.append((shapes, {"skipped": f"failed: {err}"}))
            continue
        xs.append(val)
        peaks.append(res["peak_rss_bytes"])
        secs.append(res["first_call_s"])
        mib = res["extra_peak_bytes"] / 2**20
        print(f"  {variant:45} {axis}={val:>7}: {res['median_s'] * 1e3:10.1f} ms  extra peak "
              f"{mib:8.1f} MiB  (load {load_average():.1f})", flush=True)  # fmt: skip
        out.append((shapes, res))
    return out


def run_all(args) -> tuple[list[dict], list[dict]]:
    points, fits = [], []
    runner = None if args.quick else PointRunner()
    meta = {"threads": args.threads, "memory": "in-process" if args.quick else "fresh process"}
    for op_name, op in OPS.items():
        if args.ops and op_name not in args.ops:
            continue
        sweeps = op.quick_sweeps if args.quick else op.sweeps
        for variant, var in op.variants.items():
            if var.needs and not _importable(var.needs):
                print(f"{op_name}: {variant} skipped ({var.needs} is not installed)")
                continue
            for axis, (fixed, values) in sweeps.items():
                print(f"{op_name} / {variant} / {axis} sweep", flush=True)
                rows = run_sweep(op_name, variant, axis, fixed, values, args, runner)
                for shapes, res in rows:
                    points.append(_emit("scaling", variant, shapes, res, meta, args))
                fit = sweep_fit(rows, axis)
                shapes = {"op": op_name, "sweep": axis, **fixed}
                fits.append(_emit("scaling_fit", variant, shapes, fit, meta, args))
                print(f"  slopes: time {_s(fit['time_slope'])}, extra memory "
                      f"{_s(fit['mem_slope'])}", flush=True)  # fmt: skip
    return points, fits


def sweep_fit(rows: list[tuple[dict, dict]], axis: str) -> dict:
    """The slopes of one sweep from its ``(shapes, fields)`` points (over all points run and
    over the last three), which points ran and which did not, the largest point's median."""
    ran = [(sh[axis], r) for sh, r in rows if "skipped" not in r]
    xs = [x for x, _ in ran]
    secs = [r["median_s"] for _, r in ran]
    mem = [max(r.get("extra_peak_bytes", r.get("peak_mem_bytes")) or 0, 2**20) for _, r in ran]
    return {
        "median_s": secs[-1] if secs else None,
        "time_slope": fit_slope(xs, secs),
        "cpu_time_slope": fit_slope(xs, [r["median_cpu_s"] for _, r in ran]),
        "mem_slope": fit_slope(xs, mem),
        "time_slope_last3": fit_slope(xs[-3:], secs[-3:]) if len(xs) > 3 else None,
        "mem_slope_last3": fit_slope(xs[-3:], mem[-3:]) if len(xs) > 3 else None,
        "points_run": xs,
        "points_not_run": [sh[axis] for sh, r in rows if "skipped" in r],
    }


def refit(points: list[dict], args) -> list[dict]:
    """The fit records again from saved points (``--plot-only``: fits are a function of the
    points, so a newer fitting rule applies to an older run)."""
    fits = []
    keys = dict.fromkeys((p["shapes"]["op"], p["backend"], p["shapes"]["sweep"]) for p in points)
    for op, variant, axis in keys:
        sel = [p for p in points if (p["shapes"]["op"], p["backend"], p["shapes"]["sweep"])
               == (op, variant, axis)]  # fmt: skip
        fixed = {k: sel[0]["shapes"][k] for k in ("N", "V", "d") if k != axis}
        meta = {"threads": sel[0].get("threads"), "memory": sel[0].get("memory")}
        shapes = {"op": op, "sweep": axis, **fixed}
        fit = sweep_fit([(p["shapes"], p) for p in sel], axis)
        fits.append(_emit("scaling_fit", variant, shapes, fit, meta, args))
    return fits


def _importable(module: str) -> bool:
    """Whether an optional peer (trl) is installed here."""
    return importlib.util.find_spec(module) is not None


def _s(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _emit(op, variant, shapes, res, meta, args) -> dict:
    median = res.get("median_s")
    peak = res.get("extra_peak_bytes")
    fields = {k: v for k, v in res.items() if k not in ("median_s", "extra_peak_bytes")}
    if args.write:
        return record(op, variant, shapes, median, peak, results_dir=args.results, **meta,
                      **fields)  # fmt: skip
    return {"op": op, "backend": variant, "shapes": shapes, "median_s": median,
            "peak_mem_bytes": peak, **meta, **fields}  # fmt: skip


# ------------------------------------------------------------------------------ plots


def plot(points: list[dict], fits: list[dict], folder: Path) -> list[Path]:
    """One PNG per op: time (top) and extra peak memory (bottom) against N (left) and V
    (right), log-log, a line per variant with its fitted slope in the legend; hollow markers:
    points not run (at their predicted value)."""
    # matplotlib is needed only for the figures: imported on use.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op in dict.fromkeys(p["shapes"]["op"] for p in points):
        fig, axes = plt.subplots(2, 2, figsize=(12, 9))
        for col, axis in enumerate(("N", "V")):
            for vi, variant in enumerate(dict.fromkeys(p["backend"] for p in points)):
                sel = [p for p in points if p["shapes"]["op"] == op and p["backend"] == variant
                       and p["shapes"]["sweep"] == axis]  # fmt: skip
                if not sel:
                    continue
                fit = next((f for f in fits if f["shapes"]["op"] == op and f["backend"] == variant
                            and f["shapes"]["sweep"] == axis), {})  # fmt: skip
                color = f"C{vi}"
                for row, (key, pred, slope, scale) in enumerate((
                    ("median_s", "predicted_s", "time_slope", 1.0),
                    ("peak_mem_bytes", None, "mem_slope", 2**-20),
                )):  # fmt: skip
                    ax = axes[row][col]
                    run = [p for p in sel if "skipped" not in p]
                    xs = [p["shapes"][axis] for p in run]
                    ys = [max(p[key], 2**20 if key == "peak_mem_bytes" else 0) * scale for p in run]
                    last3 = fit.get(f"{slope}_last3")
                    label = f"{variant} (slope {_s(fit.get(slope))}"
                    label += f"; last 3 points {_s(last3)})" if last3 is not None else ")"
                    ax.plot(xs, ys, "o-", color=color, label=label)
                    miss = [p for p in sel if "skipped" in p and pred and p.get(pred)]
                    if miss:
                        mx = [p["shapes"][axis] for p in miss]
                        ax.plot(mx, [p[pred] * scale for p in miss], "o", mfc="none", color=color)
                    for p in (p for p in sel if "skipped" in p):
                        ax.axvline(p["shapes"][axis], color=color, alpha=0.15, lw=4)
        for col, axis in enumerate(("N", "V")):
            sel = [p for p in points if p["shapes"]["op"] == op and p["shapes"]["sweep"] == axis]
            if not sel:
                continue
            other = {k: sel[0]["shapes"][k] for k in ("N", "V", "d") if k != axis}
            fixed = ", ".join(f"{k}={v}" for k, v in other.items() if v)
            for row, name in enumerate(("median seconds (fwd+bwd)", "extra peak RSS, MiB")):
                ax = axes[row][col]
                what = "time" if row == 0 else "extra peak memory"
                ax.set(xscale="log", yscale="log", xlabel=axis, ylabel=name,
                       title=f"{what} vs {axis} ({fixed})")  # fmt: skip
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
        dev, thr = points[0]["device"], points[0].get("threads")
        fig.suptitle(f"{op}, float32, M=20, {thr} thread(s), {dev}; hollow markers / shaded: "
                     "not run (predicted)", fontsize=9)  # fmt: skip
        fig.tight_layout()
        path = folder / f"scaling_{op}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------ main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny grids, in-process (seconds)")
    p.add_argument("--plot-only", action="store_true", help="replot from the results folder")
    p.add_argument("--results", type=Path, default=None, help="default benchmarks/results")
    p.add_argument("--ops", nargs="*", choices=list(OPS), help="default: all")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="warm calls timed per point")
    p.add_argument("--warm-budget-s", type=float, default=20.0, help="fewer warm calls past it")
    p.add_argument("--budget-gib", type=float, default=8.0, help="peak RSS limit per point")
    p.add_argument("--point-limit-s", type=float, default=120.0, help="predicted call limit")
    args = p.parse_args(argv)
    args.write = args.results is not None or not args.quick
    if args.quick:
        args.reps = 1
    return args


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict], list[Path]]:
    args = parse_args(argv)
    folder = args.results or RESULTS_DIR
    if args.plot_only:
        points = json.loads((folder / "scaling.json").read_text())
        args.write, args.results = True, folder
        with torch_threads(points[0].get("threads")):  # the records name the points' threads
            fits = refit(points, args)
    else:
        t0 = time.perf_counter()
        with torch_threads(args.threads):  # the records name the children's thread count
            points, fits = run_all(args)
        print(f"total {time.perf_counter() - t0:.0f} s")
    paths = plot(points, fits, folder) if (args.write or args.plot_only) else []
    for path in paths:
        print(f"wrote {path}")
    return points, fits, paths


if __name__ == "__main__":
    main()
