"""The table of a hyper-parameter sweep run as several ``python -m lopd.compare`` folders.

Each setting of a sweep is one comparison (``--out DIR``, one or more per setting when its seeds
ran as separate processes) of the same run name with different overrides, so the run names
collide and one compare report cannot hold them. This script reads each setting's
``results.json`` files and writes one table: per setting, its held-out reward on each seed, the
mean ± stderr over seeds, the difference to the best setting paired within a seed, the rollouts
to each seed's vanilla + 0.10 (bank included), and, where the runs logged them, the
distillation term's share of the gradient and Delta.

    python -m benchmarks.sweep_report --out benchmarks/results/ppo_sweep_formats \\
        --setting "topk 0.1" runs/topk-0.1-s0 runs/topk-0.1-s1 \\
        --setting "sampled 0.1" runs/sampled-0.1-s0 runs/sampled-0.1-s1

Writes ``OUT/report.md`` and ``OUT/results.json`` (every setting's runs, with its label).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lopd.eval.compare_report import rollouts_to_reach
from lopd.eval.stats import fmt, mean_se


def _share(run: dict[str, Any]) -> float | None:
    """Σ|g_distill| / Σ(|g_ppo| + |g_distill|) over the run's steps (LOPD-PPO's trace)."""
    t = run.get("trace", {})
    g_p, g_d = sum(t.get("grad_ppo", [])), sum(t.get("grad_distill", []))
    return g_d / (g_p + g_d) if g_p + g_d > 0 else None


def _mean(values: list[float | None], digits: int = 3) -> str:
    kept = [v for v in values if v is not None]
    return fmt(*mean_se(kept), digits) if kept else "–"


def table(settings: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The sweep's markdown table (module docstring)."""
    finals = {
        label: {r["seed"]: r["final"]["reward_mean"] for r in runs}
        for label, runs in settings.items()
    }
    best = max(finals, key=lambda k: sum(finals[k].values()) / len(finals[k]))
    lines = [
        "| setting | per seed | mean ± stderr | − best (paired) | rollouts to vanilla + 0.10 | "
        "distillation share of the gradient | Delta (mean over steps) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, runs in settings.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        seeds = sorted(set(finals[label]) & set(finals[best]))
        diff = "–"
        if label != best and seeds:
            diff = fmt(*mean_se([finals[label][s] - finals[best][s] for s in seeds]))
        reach = [rollouts_to_reach(r["curve"], r["vanilla"]["reward_mean"] + 0.10) for r in runs]
        delta = [
            sum(r["dual"]["delta"]) / len(r["dual"]["delta"]) if r.get("dual") else None
            for r in runs
        ]
        per_seed = ", ".join(f"{r['final']['reward_mean']:.3f}" for r in runs)
        lines.append(
            f"| {label}{' (best)' if label == best else ''} | {per_seed} | "
            f"{fmt(*mean_se([r['final']['reward_mean'] for r in runs]))} | {diff} | "
            f"{_mean(reach, 0)} | {_mean([_share(r) for r in runs], 2)} | {_mean(delta, 4)} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_report", description=__doc__)
    p.add_argument(
        "--setting",
        nargs="+",
        action="append",
        required=True,
        metavar=("LABEL", "DIR"),
        help="a setting's label and the compare folders holding its runs",
    )
    p.add_argument("--out", required=True, help="where report.md and results.json go")
    p.add_argument("--title", default="Sweep", help="the report's heading")
    p.add_argument("--note", default="", help="a paragraph under the heading (command, machine)")
    args = p.parse_args(argv)
    settings: dict[str, list[dict[str, Any]]] = {}
    for label, *dirs in args.setting:
        if not dirs:
            print(f"sweep_report: --setting {label!r} names no folder", file=sys.stderr)
            return 2
        runs = []
        for d in dirs:
            try:
                data = json.loads((Path(d) / "results.json").read_text())
            except (OSError, ValueError) as err:
                print(f"sweep_report: {d}: no readable results.json ({err})", file=sys.stderr)
                return 2
            runs += [r for r in data["runs"] if r.get("error") is None]
        if not runs:
            print(f"sweep_report: --setting {label!r}: no finished run", file=sys.stderr)
            return 2
        settings[label] = runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = {len(runs) for runs in settings.values()}
    lines = [f"# {args.title}", "", args.note, "", *table(settings), ""]
    if len(n) > 1:
        lines.append(f"Settings hold different numbers of runs: {sorted(n)}.")
    (out / "report.md").write_text("\n".join(lines))
    dump = {label: runs for label, runs in settings.items()}
    (out / "results.json").write_text(json.dumps({"settings": dump}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
