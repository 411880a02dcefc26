"""``python -m lopd.chain``: LOPD's chain of effects on held-out tasks, over seeds.

The default run (:mod:`lopd.train`) once per seed, every link of the chain measured on the same
held-out tasks of that seed, under the default sampling (``--temperature 0.7`` with ``gen``'s
top-p and top-k, like the probe; ``--temperature 0``: greedy):

* (a) base + a retrieved successful trajectory as text vs base: not trained here; measured by
  ``python -m lopd.models probe-reference`` (:mod:`lopd.tiny.probe`), whose ``reference.json`` the
  report quotes with ``--reference-json``;
* (b) base + composer (latents only) vs base, twice: with the cold-started phi_0 (before joint
  training) and with the jointly trained phi (paper Table 3's "Base + Composer");
* (c) the privilege Delta of eq. 12 (metric ``delta``) at step 0 of joint training, and the mean
  per-token privilege of eq. 11 (metric ``privilege``) beside it;
* (d) the LOPD-trained student vs vanilla (the untrained student = the base model);
* paper Table 3's behaviour metrics for vanilla, base + composer and LOPD.

"Base" is the vanilla evaluation of the same run: the same model, tasks and sampling seed.
Differences are paired within a seed; the report gives their mean over seeds with the standard
error over seeds, and a pooled standard error over all (task, seed) pairs beside it. The task
set follows the run seed (``data.task_seed`` unset), so each seed also draws other tasks.

Usage::

    python -m lopd.chain                                  # default preset, seeds 0 1 2, n_test 64
    python -m lopd.chain --temperature 0                  # greedy evaluation
    python -m lopd.chain --seeds 0 1 --n-test 32 --out runs/chain train.steps=20
    python -m lopd.chain --quick                          # seconds-scale plumbing (tests)

Writes ``report.md`` and ``results.json`` (every seed's summary and step-0 metrics) to ``--out``
and the run directories to ``--out/runs/seed<k>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from lopd.atomic import atomic_write_text
from lopd.config import ConfigError, load_config
from lopd.eval.stats import fmt, mean_se, verdict
from lopd.eval.summary import BEHAVIOUR_METRICS
from lopd.run.claim import refuse_used_runs
from lopd.run.host_memory import configure_host_memory
from lopd.run.run_dir import RunDir, RunDirError
from lopd.trainer import Trainer

__all__ = ["CONDITIONS", "chain_report", "main", "run_seed"]

CONDITIONS = {
    "vanilla": "vanilla (base model)",
    "base_composer_phi0": "base + composer (phi_0, cold start only)",
    "base_composer": "base + composer (trained phi)",
    "lopd": "LOPD student",
}
"""Held-out evaluations of one run (keys of ``summary.json``) and their names in the report."""


def run_seed(
    preset: str, overrides: Sequence[str], seed: int, out: Path, overwrite: bool = False
) -> dict[str, Any]:
    """Train and evaluate one seed (in a worker process); never raises (errors are recorded).
    ``overwrite``: an earlier run in the seed's run directory is deleted first.

    Returns:
        ``{"seed", "run_dir", "summary", "step0", "error", "wall_seconds"}``; ``step0`` is the
        first line of ``metrics.jsonl`` (``delta``, ``privilege``, ``beta_next``, ...).
    """

    # The trainer sets its thread count (config ``threads``, 1 by default: each seed is one
    # process on one core); an in-process caller's is restored after.
    previous_threads = torch.get_num_threads()
    run_dir = out / "runs" / f"seed{seed}"
    result: dict[str, Any] = {"seed": seed, "run_dir": str(run_dir)}
    t0 = time.perf_counter()
    try:
        cfg = load_config(preset, None, [*overrides, f"seed={seed}", f"run_dir={str(run_dir)!r}"])
        cfg.validate()
        trainer = Trainer(cfg, progress=False, overwrite=overwrite)
        try:
            result["summary"] = trainer.run()
        finally:
            trainer.close()
        lines = RunDir(run_dir).metrics.read_text().splitlines()
        result["step0"] = json.loads(lines[0]) if lines else {}
        result["error"] = None
    except Exception as err:  # a failed seed is reported, the others go on
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        torch.set_num_threads(previous_threads)  # a caller's (in-process: jobs=1) is kept
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def _paired(runs: Sequence[dict[str, Any]], a: str, b: str) -> dict[str, Any] | None:
    """``a - b`` held-out reward, paired within each seed; ``None`` if a run lacks either."""
    if not runs or any(a not in r["summary"] or b not in r["summary"] for r in runs):
        return None
    per_seed = [r["summary"][a]["reward_mean"] - r["summary"][b]["reward_mean"] for r in runs]
    # Summaries written before per-task rewards were kept have none: no pooled error then.
    pairs = [
        x - y
        for r in runs
        for x, y in zip(
            r["summary"][a].get("task_rewards", []), r["summary"][b].get("task_rewards", [])
        )
    ]
    mean, se_seeds = mean_se(per_seed)
    se_pairs = mean_se(pairs)[1] if pairs else float("nan")
    return {
        "mean": mean,
        "stderr_seeds": se_seeds,
        "stderr_pairs": se_pairs,
        "per_seed": per_seed,
        "n_pairs": len(pairs),
    }


def _scalar(runs: Sequence[dict[str, Any]], key: str) -> dict[str, Any] | None:
    vals = [r["step0"][key] for r in runs if key in r["step0"]]
    if not vals:
        return None
    mean, se = mean_se(vals)
    return {"mean": mean, "stderr_seeds": se, "per_seed": vals}


def chain_report(results: Sequence[dict[str, Any]], reference: dict[str, Any] | None = None):
    """The chain's numbers (``dict``) and its Markdown report (``str``) from :func:`run_seed`
    results; ``reference`` is a probe ``reference.json`` (for link (a))."""
    runs = sorted((r for r in results if r["error"] is None), key=lambda r: r["seed"])
    numbers: dict[str, Any] = {"seeds": [r["seed"] for r in runs], "conditions": {}}
    lines = ["# LOPD's chain of effects (held-out reward, paired within a seed)", ""]
    failed = [r for r in results if r["error"] is not None]
    for r in failed:
        lines.append(f"- seed {r['seed']} FAILED: {r['error']}")
    if not runs:
        lines.append("No seed finished.")
        return numbers, "\n".join(lines) + "\n"
    n = runs[0]["summary"]["vanilla"]["n"]
    lines += [
        f"Seeds {numbers['seeds']}, {n} held-out tasks per seed; mean ± stderr over seeds.",
        "",
        "| condition | reward | success | per seed |",
        "|---|---|---|---|",
    ]
    for key, name in CONDITIONS.items():
        evs = [r["summary"][key] for r in runs if key in r["summary"]]
        if len(evs) != len(runs):
            continue
        rew = mean_se([e["reward_mean"] for e in evs])
        suc = mean_se([e["success_rate"] for e in evs])
        numbers["conditions"][key] = {"reward": rew, "success": suc}
        per = ", ".join(f"{e['reward_mean']:.3f}" for e in evs)
        lines.append(f"| {name} | {fmt(*rew)} | {fmt(*suc)} | {per} |")
    lines += ["", "## The links", ""]
    if reference is not None:
        for split, rows in reference.get("splits", {}).items():
            g = rows.get("retrieved_minus_bare")
            if g:
                lines.append(
                    f"- (a) base + retrieved trajectory as text − base ({split}, "
                    f"{rows['n_tasks']} tasks x seeds {reference.get('seeds')}, from "
                    f"probe-reference): {g['mean']:+.3f} ± {g['stderr_paired_over_tasks']:.3f} "
                    "(paired over tasks)"
                )
                numbers.setdefault("a", {})[split] = g
    links = (
        ("b_phi0", "base_composer_phi0", "vanilla", "(b) base + composer (phi_0) − base"),
        ("b_trained", "base_composer", "vanilla", "(b) base + composer (trained phi) − base"),
        ("d", "lopd", "vanilla", "(d) LOPD student − vanilla"),
    )
    for name, a, b, label in links:
        p = _paired(runs, a, b)
        if p is None:
            continue
        numbers[name] = p
        lines.append(
            f"- {label}: {fmt(p['mean'], p['stderr_seeds'])} over seeds "
            f"(pooled over {p['n_pairs']} task pairs: ± {p['stderr_pairs']:.3f}) → "
            f"{verdict(p['mean'], p['stderr_seeds'])}; per seed "
            + ", ".join(f"{x:+.3f}" for x in p["per_seed"])
        )
    for key, label in (("delta", "(c) Delta (eq. 12)"), ("privilege", "mean per-token privilege")):
        s = _scalar(runs, key)
        if s is not None:
            numbers[f"step0_{key}"] = s
            per = ", ".join(f"{x:+.4f}" for x in s["per_seed"])
            se = "" if s["stderr_seeds"] != s["stderr_seeds"] else f" ± {s['stderr_seeds']:.4f}"
            lines.append(f"- {label} at step 0: {s['mean']:+.4f}{se} (per seed {per})")
    lines += ["", "## Paper Table 3's behaviour metrics (mean over seeds)", ""]
    lines += ["| metric | " + " | ".join(CONDITIONS[k] for k in numbers["conditions"]) + " |"]
    lines += ["|---|" + "---|" * len(numbers["conditions"])]
    for metric in BEHAVIOUR_METRICS:
        cells = []
        for key in numbers["conditions"]:
            cells.append(f"{mean_se([r['summary'][key][metric] for r in runs])[0]:.2f}")
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return numbers, "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lopd.chain",
        description="LOPD's chain of effects over seeds: base + composer, Delta, LOPD vs vanilla.",
    )
    p.add_argument("--quick", action="store_true", help="smoke preset: seconds-scale plumbing")
    p.add_argument("--preset", default=None, help="base preset (default: default; quick: smoke)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    p.add_argument("--n-test", type=int, default=None, help="held-out tasks (default 64)")
    p.add_argument("--out", default=None, help="output directory (default runs/chain[-quick])")
    p.add_argument("--jobs", type=int, default=None, help="seeds in parallel (default: all)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="evaluation temperature (eval.temperature; default 0.7: the default sampling, "
        "top-p and top-k from gen; 0 = greedy)",
    )
    p.add_argument("--reference-json", default=None, help="probe-reference's reference.json")
    p.add_argument(
        "--overwrite", action="store_true", help="delete the runs an earlier chain left in --out"
    )
    p.add_argument("overrides", nargs="*", help="section.field=value applied to every seed")
    return p.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_host_memory()  # before any model is loaded
    preset = args.preset or ("smoke" if args.quick else "default")
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    n_test = args.n_test if args.n_test is not None else (4 if args.quick else 64)
    out = Path(args.out or ("runs/chain-quick" if args.quick else "runs/chain"))
    jobs = max(1, args.jobs if args.jobs is not None else len(seeds))
    overrides = [
        f"data.n_test={n_test}",
        f"eval.temperature={args.temperature}",
        "eval.with_composer=true",
        *args.overrides,
    ]
    reference = None
    try:
        load_config(preset, None, overrides).validate()
        if args.reference_json is not None:
            reference = json.loads(Path(args.reference_json).read_text())
        if not args.overwrite:
            refuse_used_runs(out / "runs")
    except (ConfigError, RunDirError, OSError, ValueError) as err:
        print(f"lopd.chain: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if jobs > 1 and len(seeds) > 1:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = [
                pool.submit(run_seed, preset, overrides, s, out, args.overwrite) for s in seeds
            ]
            results = [f.result() for f in futures]
    else:
        results = [run_seed(preset, overrides, s, out, args.overwrite) for s in seeds]
    numbers, report = chain_report(results, reference)
    meta = {
        "preset": preset,
        "overrides": overrides,
        "seeds": seeds,
        "jobs": jobs,
        "wall_seconds": time.perf_counter() - t0,
        "command": "python -m lopd.chain " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out.mkdir(parents=True, exist_ok=True)
    report += f"\nCommand: `{meta['command']}`; wall {meta['wall_seconds']:.0f} s.\n"
    atomic_write_text(out / "report.md", report)
    payload = {"meta": meta, "chain": numbers, "runs": results}
    atomic_write_text(out / "results.json", json.dumps(payload, indent=1))
    print(report)
    print(f"[chain] wrote {out / 'report.md'}, {out / 'results.json'}")
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
