"""The CPU cost of ``topk_tail_kl``'s options, and ``support="teacher"`` against a previous build.

Shape of ``benchmarks/bench_topk_tail_kl.py``: N = 256 rows, V = 151,936, M = 20, float32, both
logits requiring grad, loss ``sum(kl) + sum(privilege) + sum(student_logprob)``, forward +
backward, ``backend="cpu"`` (the C++ kernels), 2 threads. Two measurements, each interleaved so
that the load of a shared machine hits every variant alike:

* **options** (this tree): rounds of one call per variant, in a rotating order:
  ``support`` in (teacher, student, union) x divergence in (reverse, forward, jsd at beta 0.5),
  and the full vocabulary (``top_m=None``) reverse and jsd. Reported: each variant's median and
  its ratio to teacher / reverse (the per-round ratios' median, and their spread).
* **A/B** (``--baseline PATH``: a checkout of an earlier commit with its extension built in
  place): two long-lived worker processes, one importing ``lopd_kernels`` from this tree and one
  from ``PATH``, alternately run ``--reps`` calls of teacher / reverse (ABBA order per pair of
  rounds). Reported: both medians, and B/A as the median of the per-round ratios with its
  spread: "unchanged within noise" means the ratio's spread contains 1.

Records go to ``benchmarks/results/topk_tail_kl_options.json`` (``benchmarks.common.record``:
device, CPU kind, commit, load, shapes, median).

    python benchmarks/bench_topk_tail_kl_options.py --rounds 12  # options
    python benchmarks/bench_topk_tail_kl_options.py --baseline ../lopd-prev --rounds 10 \
        --skip-options
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

N, V, M = 256, 151_936, 20
# name -> topk_tail_kl keyword arguments (beyond top_m), in TRL's beta convention for the JSD.
VARIANTS = {
    "teacher/reverse": {},
    "teacher/forward": {"divergence": "forward"},
    "teacher/jsd0.5": {"divergence": "jsd", "beta": 0.5},
    "student/reverse": {"support": "student"},
    "student/jsd0.5": {"support": "student", "divergence": "jsd", "beta": 0.5},
    "union/reverse": {"support": "union"},
    "union/jsd0.5": {"support": "union", "divergence": "jsd", "beta": 0.5},
    "full/reverse": {"top_m": None},
    "full/jsd0.5": {"top_m": None, "divergence": "jsd", "beta": 0.5},
}


# ------------------------------------------------------------------------------------ worker


def worker(n: int, threads: int) -> None:
    """Reads ``<variant> <reps>`` lines, answers each with a JSON list of per-call seconds."""
    import torch

    import lopd_kernels as lk

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    s = torch.randn(n, V, generator=g).mul_(2).requires_grad_(True)
    t = torch.randn(n, V, generator=g).add_(s.detach()).requires_grad_(True)
    a = torch.randint(0, V, (n,), generator=g)

    def call(kw: dict) -> float:
        kw = {"top_m": M, **kw}
        start = time.perf_counter()
        out = lk.topk_tail_kl(s, t, a, backend="cpu", **kw)
        (out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()).backward()
        elapsed = time.perf_counter() - start
        s.grad = t.grad = None
        return elapsed

    print("ready", flush=True)
    for line in sys.stdin:
        name, reps = line.split()
        kw = VARIANTS[name]
        call(kw)  # warm: the gradient buffers' pages, lazy initialization
        print(json.dumps([call(kw) for _ in range(int(reps))]), flush=True)


class Worker:
    """A worker process importing ``lopd_kernels`` from ``tree``."""

    def __init__(self, tree: Path, n: int, threads: int):
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--n", str(n),
               "--threads", str(threads)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, name: str, reps: int) -> list[float]:
        self.proc.stdin.write(f"{name} {reps}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------------------------ parent


def spread(xs: list[float]) -> tuple[float, float]:
    """(10th, 90th) percentiles."""
    qs = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return qs[0], qs[-1]


def git_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    return out.stdout.strip() or "unknown"


def measure_options(args) -> dict:
    w = Worker(ROOT, args.n, args.threads)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    try:
        for r in range(args.rounds):
            rot = names[r % len(names) :] + names[: r % len(names)]
            this = {k: statistics.median(w.run(k, args.reps)) for k in rot}
            for k in names:
                times[k].append(this[k])
                ratios[k].append(this[k] / this["teacher/reverse"])
    finally:
        w.close()
    out = {}
    for k in names:
        lo, hi = spread(ratios[k])
        out[k] = {"median_s": statistics.median(times[k]),
                  "ratio_vs_teacher_reverse": statistics.median(ratios[k]),
                  "ratio_p10": lo, "ratio_p90": hi}  # fmt: skip
    return out


def measure_ab(args) -> dict:
    base = Path(args.baseline).resolve()
    workers = {"A": Worker(base, args.n, args.threads), "B": Worker(ROOT, args.n, args.threads)}
    times = {"A": [], "B": []}
    ratios = []
    try:
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            this = {}
            for side in order:
                this[side] = statistics.median(workers[side].run("teacher/reverse", args.reps))
                times[side].append(this[side])
            ratios.append(this["B"] / this["A"])
    finally:
        for w in workers.values():
            w.close()
    lo, hi = spread(ratios)
    return {
        "baseline_commit": git_commit(base),
        "A_median_s": statistics.median(times["A"]),
        "B_median_s": statistics.median(times["B"]),
        "ratio_B_over_A": statistics.median(ratios),
        "ratio_p10": lo,
        "ratio_p90": hi,
        "rounds": args.rounds,
        "reps": args.reps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="a checkout of an earlier commit, its _C built in place")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--reps", type=int, default=3, help="calls per variant and round (median)")
    p.add_argument("--n", type=int, default=N)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-options", action="store_true")
    p.add_argument("--no-record", action="store_true", help="print only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        # Imports lopd_kernels from its PYTHONPATH (this tree or the baseline's), nothing else.
        worker(args.n, args.threads)
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import load_average, record

    shapes = {"N": args.n, "V": V, "M": M, "dtype": "float32", "pass": "fwd+bwd"}
    load = load_average()
    if args.baseline:
        ab = measure_ab(args)
        print(json.dumps(ab, indent=1))
        if not args.no_record:
            record("topk_tail_kl_options", "cpu teacher/reverse A/B", shapes, ab["B_median_s"],
                   threads=args.threads, load_avg_start=load, **ab)  # fmt: skip
    if not args.skip_options:
        res = measure_options(args)
        for k, v in res.items():
            print(f"{k:18s} {v['median_s'] * 1e3:9.1f} ms  x{v['ratio_vs_teacher_reverse']:.3f}"
                  f"  [{v['ratio_p10']:.3f}, {v['ratio_p90']:.3f}]")  # fmt: skip
            if not args.no_record:
                extra = {x: y for x, y in v.items() if x != "median_s"}
                record("topk_tail_kl_options", f"cpu {k}", shapes, v["median_s"],
                       threads=args.threads, load_avg_start=load, rounds=args.rounds,
                       reps=args.reps, **extra)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
