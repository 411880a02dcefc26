"""Same-run A/B of the fused LM-head ops between two source trees of lopd.

A change to the kernel library (a refactor that must not cost time, a new variant) is judged by
timing both trees' ops in one run on one machine: each round runs one fresh process per tree,
the order alternating round by round, each timing forward + backward of every op (median of
``--reps`` calls after a warm-up) in CPU seconds of the process (the figure that survives a
shared machine's load) and wall seconds. The ratio B / A is taken round by round, so a drift in
the machine's speed cancels; the report gives its median and range over the rounds.

Usage::

    python benchmarks/ab_trees.py --a /path/to/old/checkout --b . --rounds 6
    python benchmarks/ab_trees.py --a OLD --b NEW --d 256 1024 --n 1024 --vocab 32768 \
        --out benchmarks/results/ab_fused_linear.json

Each tree needs its own built extension (``lopd_kernels/_C*.so``, ``pip install -e .`` or
``python setup.py build_ext --inplace`` in it). Ops: ``fused_linear_topk_tail_kl`` (per-row,
both heads trained), the same with frozen heads, ``fused_linear_topk_tail_kl_loss`` and
``fused_linear_logprob`` (``backend="auto"``, float32).
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

# Runs in the child, with PYTHONPATH set to one tree: only the public API both trees share.
_CHILD = r"""
import json, sys, time
import torch
import lopd_kernels as lk

n, vocab, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
dims = [int(x) for x in sys.argv[3].split(",")]
torch.manual_seed(0)


def timed(fn):
    fn()  # warm-up: buffers, caches, lazy registration
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    cpu.sort(), wall.sort()
    return {"cpu_s": cpu[len(cpu) // 2], "wall_s": wall[len(wall) // 2]}


out = {"extension": lk.extension_loaded()}
for d in dims:
    hs = (torch.randn(n, d) * 0.5).requires_grad_()
    ht = (torch.randn(n, d) * 0.5).requires_grad_()
    ws = (torch.randn(vocab, d) / d**0.5).requires_grad_()
    wt = (torch.randn(vocab, d) / d**0.5).requires_grad_()
    tgt = torch.randint(0, vocab, (n,))

    def per_row():
        r = lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, tgt, top_m=20)
        (r.kl.sum() + r.student_logprob.sum()).backward()

    def frozen():
        r = lk.fused_linear_topk_tail_kl(hs, ws.detach(), ht, wt.detach(), tgt, top_m=20)
        r.kl.sum().backward()

    def loss():
        lk.fused_linear_topk_tail_kl_loss(hs, ws, ht, wt, tgt, top_m=20).loss.backward()

    def logprob():
        lk.fused_linear_logprob(hs, ws, tgt).logprob.sum().backward()

    for name, fn in [("fused_linear_topk_tail_kl", per_row),
                     ("fused_linear_topk_tail_kl frozen heads", frozen),
                     ("fused_linear_topk_tail_kl_loss", loss),
                     ("fused_linear_logprob", logprob)]:
        out[f"{name}, d={d}"] = timed(fn)
print(json.dumps(out))
"""


def _commit(tree: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _placeholders(argv: list[str]) -> list[str]:
    """``argv`` with the trees after ``--a`` / ``--b`` written as ``A`` / ``B``."""
    return [
        {"--a": "A", "--b": "B"}.get(argv[i - 1], arg) if i else arg for i, arg in enumerate(argv)
    ]


def _run_tree(tree: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-c", _CHILD, str(args.n), str(args.vocab)]
    cmd += [",".join(map(str, args.d)), str(args.reps)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"ab_trees: {tree}: the timing process failed: {tail}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="tree A (the baseline)")
    p.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=3, help="timed calls per op and process")
    p.add_argument("--n", type=int, default=1024, help="rows (tokens)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--d", type=int, nargs="+", default=[256, 1024], help="hidden sizes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the records here (JSON)")
    args = p.parse_args(argv)
    for tree in (args.a, args.b):
        if not (tree / "lopd_kernels" / "__init__.py").exists():
            raise SystemExit(f"ab_trees: {tree} is not a lopd checkout (no lopd_kernels/)")
    rounds = []
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        got = {side: _run_tree(getattr(args, side), args) for side in order}
        rounds.append(got)
        print(f"[ab_trees] round {r + 1}/{args.rounds} done", file=sys.stderr)
    ops = [k for k in rounds[0]["a"] if k != "extension"]
    table = {}
    for op in ops:
        entry = {}
        for fig in ("cpu_s", "wall_s"):
            ratios = sorted(rd["b"][op][fig] / rd["a"][op][fig] for rd in rounds)
            entry[fig] = {
                "a_median": statistics.median(rd["a"][op][fig] for rd in rounds),
                "b_median": statistics.median(rd["b"][op][fig] for rd in rounds),
                "b_over_a": {
                    "median": statistics.median(ratios),
                    "min": ratios[0],
                    "max": ratios[-1],
                },
            }
        table[op] = entry
    record = {
        "what": "same-run A/B of the fused LM-head ops (forward + backward, float32, top_m 20)",
        # The trees by their commits (a path names only the measuring machine).
        "command": "python benchmarks/ab_trees.py "
        + " ".join(_placeholders(list(argv if argv is not None else sys.argv[1:]))),
        "a": {"commit": _commit(args.a)},
        "b": {"commit": _commit(args.b)},
        "shapes": {"n": args.n, "vocab": args.vocab, "d": args.d},
        "threads": args.threads,
        "rounds": args.rounds,
        "reps": args.reps,
        "cpu": common.cpu_model(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "extension": {"a": rounds[0]["a"]["extension"], "b": rounds[0]["b"]["extension"]},
        "ops": table,
    }
    print("| op | A CPU s | B CPU s | B / A CPU (median [min, max] over rounds) | B / A wall |")
    print("|---|---|---|---|---|")
    for op, e in table.items():
        c, w = e["cpu_s"], e["wall_s"]
        rc, rw = c["b_over_a"], w["b_over_a"]
        print(
            f"| {op} | {c['a_median']:.3f} | {c['b_median']:.3f} | {rc['median']:.3f} "
            f"[{rc['min']:.3f}, {rc['max']:.3f}] | {rw['median']:.3f} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
