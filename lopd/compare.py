"""``python -m lopd.compare``: LOPD against its baselines and ablations at equal rollout budgets.

Runs every method of :data:`lopd.methods.METHODS` (LOPD, its ablations, the baselines) on the
embedded tool-use world over several seeds with the same model, tasks, optimizer, evaluation and
rollout budget, then writes to ``--out``:

* ``report.md``: a table of held-out reward (mean +- stderr over seeds, per-seed values, n) per
  method and the answers to the paper's three claims in miniature: does LOPD beat each baseline at
  equal budget; what fraction of GRPO's (and Skill-SD's) rollouts LOPD needs to reach its final
  reward; does m = 0 fall below the frozen composer.
* ``learning_curve.png``: held-out reward against generated rollouts (mean over seeds).
* ``results.json``: every run's summary and curve; ``runs/<method>-seed<k>/``: the run directories.

Usage::

    python -m lopd.compare                          # default comparison (8 methods x 3 seeds)
    python -m lopd.compare --quick                  # seconds-scale plumbing run (tests)
    python -m lopd.compare --seeds 0 1 --methods lopd grpo --out runs/cmp data.n_test=32

Settings. The runs use the ``compare`` preset (``--quick``: ``compare-quick``) of
:mod:`lopd.config` and its rollout budget :data:`lopd.config.COMPARE_BUDGETS`.

Equal budgets. Every generated rollout counts (:attr:`lopd.rollout.engine.RolloutEngine.rollouts`),
the experience bank's base-model rollouts included: methods that build a bank (LOPD and its
ablations, OPSD, SDFT) train for ``(budget - bank) / tasks_per_step`` steps, the others (GRPO, SDPO,
Skill-SD) for ``budget / tasks_per_step`` steps, so all end at the same count. Skill-SD's skills are
written from its own training rollouts (already counted); no other rollout is made. Evaluation
rollouts (greedy, on the held-out split) do not count. Held-out rewards are measured, never used to
pick anything.

Shared phases. For one seed the bank, the composer cold start and the vanilla evaluation are the
same computation for every method (same seed, base model and tasks), so they are run once (by the
first method that needs them) and copied into the other run directories, where the trainer loads
them; the bank's rollouts still count toward every method's budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from lopd.atomic import atomic_write_text
from lopd.config import COMPARE_BUDGETS, BankTooSmallError, ConfigError, load_config
from lopd.eval.stats import fmt, mean_se, verdict
from lopd.methods import METHODS
from lopd.run.claim import clear_run_dir, refuse_used_runs
from lopd.run.host_memory import configure_host_memory
from lopd.run.run_dir import RunDir, RunDirError
from lopd.trainer import Trainer

__all__ = ["ALL_METHODS", "CompareSettings", "main", "run_method", "settings_for", "write_report"]

ALL_METHODS = tuple(METHODS)
"""Every comparable method, in the order the report lists them."""

# Within a seed, composer methods run first (they produce the bank, phi_0 and c_phi0 the others
# reuse), then the other bank methods, then the bank-free ones.
_RUN_ORDER = tuple(
    sorted(ALL_METHODS, key=lambda m: (not METHODS[m].uses_composer, not METHODS[m].builds_bank))
)


@dataclass
class CompareSettings:
    """One comparison's shared configuration.

    Attributes:
        preset: base preset of :mod:`lopd.config` (``compare`` or ``compare-quick``).
        overrides: ``section.field=value`` applied to every run (before the per-method ones).
        budget: generated rollouts per run (bank included).
        eval_every: held-out evaluation every this many training steps (learning-curve points);
            ``None`` keeps the preset's ``eval.every``.
    """

    preset: str
    overrides: list[str] = field(default_factory=list)
    budget: int = 0
    eval_every: int | None = None


def settings_for(quick: bool) -> CompareSettings:
    """The default comparison (preset ``compare``), or the ``--quick`` plumbing run (preset
    ``compare-quick``; nothing converges, every code path runs), at the preset's budget."""
    preset = "compare-quick" if quick else "compare"
    return CompareSettings(preset=preset, budget=COMPARE_BUDGETS[preset])


def _config(settings: CompareSettings, method: str, seed: int, run_dir: Path, steps: int) -> Any:
    every = [] if settings.eval_every is None else [f"eval.every={settings.eval_every}"]
    cfg = load_config(
        settings.preset,
        overrides=[
            *settings.overrides,
            f"lopd.method={method}",
            f"seed={seed}",
            f"run_dir={json.dumps(str(run_dir))}",
            f"lopd.steps={steps}",
            *every,
        ],
    )
    cfg.validate()
    return cfg


def _steps_for(settings: CompareSettings, method: str) -> tuple[int, int]:
    """``(steps, bank_rollouts)`` that spend ``settings.budget`` rollouts with ``method``."""
    cfg = _config(settings, "lopd", 0, Path("."), 0)
    tps = cfg.lopd.tasks_per_step
    bank = cfg.data.n_train * cfg.bank.rollouts_per_task if METHODS[method].builds_bank else 0
    if settings.budget <= bank:
        raise ValueError(
            f"budget={settings.budget} does not exceed the {bank} bank rollouts of {method!r}"
        )
    return (settings.budget - bank) // tps, bank


def _share(sources: Sequence[Path], dst: Path, method: str) -> None:
    """Copy the seed's shared phases from earlier run directories (see the module docstring)."""
    dst.mkdir(parents=True, exist_ok=True)
    spec = METHODS[method]
    target = RunDir(dst)
    for path in target.shared_phases(spec.builds_bank, spec.uses_composer):
        name = path.relative_to(target.root)
        done = [s / name for s in sources if RunDir(s).is_complete(s / name)]
        if not done or path.exists():
            continue
        if done[0].is_dir():
            shutil.copytree(done[0], path)
        else:
            shutil.copy2(done[0], path)


def run_method(
    settings: CompareSettings,
    method: str,
    seed: int,
    out: Path,
    share_from: Sequence[Path] = (),
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train and evaluate one method for one seed; never raises (errors are recorded).

    ``overwrite``: an earlier run in the run directory is deleted first (else it stops the run).

    Returns:
        ``{"method", "seed", "run_dir", "steps", "rollouts", "vanilla", "final", "curve",
        "step_seconds", "wall_seconds", "error"}``; ``curve`` is ``[[rollouts, held-out
        reward], ...]``; ``step_seconds`` the mean seconds per training step of its rollouts,
        its losses and backward passes, and the whole step.
    """

    run_dir = out / "runs" / f"{method}-seed{seed}"
    files = RunDir(run_dir)
    result: dict[str, Any] = {"method": method, "seed": seed, "run_dir": str(run_dir)}
    t0 = time.perf_counter()
    try:
        steps, _ = _steps_for(settings, method)
        result["steps"] = steps
        if overwrite:
            clear_run_dir(files)
        _share(share_from, run_dir, method)
        cfg = _config(settings, method, seed, run_dir, steps)
        trainer = Trainer(cfg, progress=False, shared_phases=True)
        try:
            summary = trainer.run()
        finally:
            trainer.close()
        bank = 0
        if METHODS[method].builds_bank and files.bank_done.exists():
            bank = int(json.loads(files.bank_done.read_text())["rollouts"])
        vanilla = summary["vanilla"]["reward_mean"]
        curve = [[0, vanilla]] + ([[bank, vanilla]] if bank else [])
        rows = [json.loads(line) for line in files.metrics.read_text().splitlines()]
        for row in rows:
            if "eval_reward_mean" in row:
                curve.append([int(row["rollouts"]), row["eval_reward_mean"]])
        # Where a training step's time goes (means over steps; evaluation not included).
        result["step_seconds"] = {
            part: sum(r.get(f"seconds_{part}", 0.0) for r in rows) / max(len(rows), 1)
            for part in ("rollout", "loss_backward", "step")
        }
        curve.append([int(summary["rollouts"]), summary["lopd"]["reward_mean"]])
        result.update(
            rollouts=int(summary["rollouts"]),
            bank_rollouts=bank,
            vanilla=summary["vanilla"],
            final=summary["lopd"],
            curve=curve,
            error=None,
        )
    except Exception as err:  # a failed run is reported, the comparison goes on
        msg = f"{type(err).__name__}: {err}"
        if isinstance(err, BankTooSmallError) and err.bank_size == 0:
            msg += (
                " [the base model had no rollout with reward >= bank.min_reward; "
                "bank.min_reward=0.0 fills the bank with unsuccessful rollouts instead, which is "
                "not the paper's setting]"
            )
        result.update(error=msg, trace=traceback.format_exc())
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def run_seed(
    settings: CompareSettings,
    methods: Sequence[str],
    seed: int,
    out: Path,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """All methods of one seed, sharing the seed's phases: composer methods first (they produce
    the bank, phi_0 and c_phi0 the others reuse), then OPSD and SDFT, then the bank-free
    methods."""
    results, sources = [], []
    for method in sorted(methods, key=_RUN_ORDER.index):
        res = run_method(settings, method, seed, out, sources, overwrite)
        print(_progress_line(res), flush=True)
        results.append(res)
        if res["error"] is None:
            sources.append(Path(res["run_dir"]))
    return results


def _progress_line(res: dict[str, Any]) -> str:
    head = f"[compare] {res['method']:<12} seed {res['seed']}"
    if res["error"] is not None:
        return f"{head}: FAILED ({res['error']})"
    f = res["final"]
    return (
        f"{head}: held-out reward {f['reward_mean']:.3f} +- {f['reward_stderr']:.3f} "
        f"(n={f['n']}), {res['rollouts']} rollouts, {res['wall_seconds']:.0f} s"
    )


# ------------------------------------------------------------------------------ statistics
def _by_method(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["error"] is None:
            out.setdefault(r["method"], []).append(r)
    for runs in out.values():
        runs.sort(key=lambda r: r["seed"])
    return out


def _mean_curve(runs: Sequence[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """``(rollouts, mean, stderr)`` over seeds at every rollout count all runs evaluated at."""
    common = set.intersection(*({x for x, _ in r["curve"]} for r in runs))
    points = []
    for x in sorted(common):
        # The last evaluation at a rollout count is the one after training up to it.
        ys = [[y for xx, y in r["curve"] if xx == x][-1] for r in runs]
        mean, se = mean_se(ys)
        points.append((x, mean, se))
    return points


def _paired(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> tuple[float, float, int]:
    """Mean and stderr of per-seed differences of final held-out reward (seeds in both)."""
    fa = {r["seed"]: r["final"]["reward_mean"] for r in a}
    fb = {r["seed"]: r["final"]["reward_mean"] for r in b}
    seeds = sorted(set(fa) & set(fb))
    if not seeds:
        return float("nan"), float("nan"), 0
    mean, se = mean_se([fa[s] - fb[s] for s in seeds])
    return mean, se, len(seeds)


def _rollout_fraction(by: dict[str, list[dict[str, Any]]], ref: str, name: str) -> str:
    """The fraction of ``ref``'s rollouts LOPD needs to reach ``ref``'s final held-out reward
    (the paper's "less than 30% of the rollout budget of GRPO and Skill-SD")."""
    if "lopd" not in by or ref not in by:
        return f"- Fraction of {name}'s rollouts: needs both `lopd` and `{ref}` runs."
    r_curve, l_curve = _mean_curve(by[ref]), _mean_curve(by["lopd"])
    r_final_x, r_final, _ = r_curve[-1]
    vanilla = r_curve[0][1]
    reach = next((x for x, y, _ in l_curve if y >= r_final), None)
    head = f"- **Rollouts LOPD needs to reach {name}'s final reward**"
    if r_final <= vanilla:
        return (
            f"{head}: not meaningful here: {name}'s final held-out reward ({r_final:.3f}) does "
            f"not exceed vanilla ({vanilla:.3f}), so any run 'reaches' it at 0 rollouts."
        )
    if reach is None:
        return (
            f"{head} ({r_final:.3f} after {r_final_x} rollouts): not reached within the budget "
            f"(LOPD's mean curve peaks at {max(y for _, y, _ in l_curve):.3f})."
        )
    return (
        f"{head} ({r_final:.3f} after {r_final_x} rollouts): {reach} rollouts (bank included) = "
        f"{reach / r_final_x:.0%} of {name}'s (resolution: the evaluation interval; mean curves "
        "over seeds)."
    )


def answers(results: Sequence[dict[str, Any]]) -> list[str]:
    """The three claims, answered from the numbers (markdown bullet lines)."""
    by = _by_method(results)
    lines = []
    if "lopd" in by:
        for base in ALL_METHODS:
            if base == "lopd" or base not in by:
                continue
            d, se, n = _paired(by["lopd"], by[base])
            lines.append(
                f"- **LOPD vs {base}** at equal budget: LOPD − {base} = {fmt(d, se)} "
                f"(paired over {n} seed(s)) → {verdict(d, se)}."
            )
    else:
        lines.append("- LOPD vs baselines: LOPD was not run (or failed).")
    for ref, name in (("grpo", "GRPO"), ("skill-sd", "Skill-SD")):
        lines.append(_rollout_fraction(by, ref, name))
    if "lopd-m0" in by and "lopd-frozen" in by:
        d, se, n = _paired(by["lopd-m0"], by["lopd-frozen"])
        below = "yes" if d < 0 else ("no (equal)" if d == 0 else "no")
        if d < 0 and not math.isnan(se) and -d <= 2 * se:
            below = "below on average, but within 2 stderr (not significant)"
        lines.append(
            f"- **Does m = 0 fall below the frozen composer?** lopd-m0 − lopd-frozen = "
            f"{fmt(d, se)} (paired over {n} seed(s)) → {below}."
        )
    else:
        lines.append("- m = 0 vs frozen composer: needs both `lopd-m0` and `lopd-frozen` runs.")
    return lines


# ------------------------------------------------------------------------------ report
def write_report(
    results: Sequence[dict[str, Any]], out: Path, meta: dict[str, Any]
) -> dict[str, Path]:
    """Write ``report.md``, ``learning_curve.png`` and ``results.json`` under ``out``.

    Args:
        results: :func:`run_method` results.
        out: output directory.
        meta: settings, seeds, command and wall time to print in the report.

    Returns:
        ``{"report": ..., "plot": ..., "results": ...}`` paths.
    """
    out.mkdir(parents=True, exist_ok=True)
    by = _by_method(results)
    rows = [
        "| method | held-out reward (mean ± stderr over seeds) | per seed | success rate | "
        "n (seeds × tasks) | rollouts | wall s / run | s / step (rollout + loss & backward) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    vanilla = [r for runs in by.values() for r in runs]
    if vanilla:
        per_seed = {r["seed"]: r["vanilla"] for r in vanilla}
        vals = [per_seed[s]["reward_mean"] for s in sorted(per_seed)]
        succ = [per_seed[s]["success_rate"] for s in sorted(per_seed)]
        rows.append(
            f"| vanilla (no training) | {fmt(*mean_se(vals))} | "
            f"{', '.join(f'{v:.3f}' for v in vals)} | {sum(succ) / len(succ):.3f} | "
            f"{len(vals)} × {per_seed[min(per_seed)]['n']} | 0 | – | – |"
        )
    for method in ALL_METHODS:
        if method not in by:
            continue
        runs = by[method]
        vals = [r["final"]["reward_mean"] for r in runs]
        succ = [r["final"]["success_rate"] for r in runs]
        wall = sum(r["wall_seconds"] for r in runs) / len(runs)
        rollouts = sorted({r["rollouts"] for r in runs})
        secs = [r.get("step_seconds") for r in runs if r.get("step_seconds")]
        per_step = "–"
        if secs:
            parts = {k: sum(x[k] for x in secs) / len(secs) for k in secs[0]}
            per_step = (
                f"{parts['step']:.2f} ({parts['rollout']:.2f} + {parts['loss_backward']:.2f})"
            )
        rows.append(
            f"| {method} | {fmt(*mean_se(vals))} | {', '.join(f'{v:.3f}' for v in vals)} | "
            f"{sum(succ) / len(succ):.3f} | {len(vals)} × {runs[0]['final']['n']} | "
            f"{'/'.join(map(str, rollouts))} | {wall:.0f} | {per_step} |"
        )
    failed = [r for r in results if r["error"] is not None]
    lines = [
        "# LOPD vs baselines on the embedded tool-use world",
        "",
        f"Seeds: {meta['seeds']}. Budget: {meta['budget']} generated rollouts per run (bank "
        f"included). Preset `{meta['preset']}` (`lopd/config/yaml/{meta['preset']}.yaml`)"
        + (f" with overrides `{' '.join(meta['overrides'])}`" if meta["overrides"] else "")
        + f". Total wall time {meta['wall_seconds'] / 60:.1f} min. "
        f"Command: `{meta['command']}`.",
        "",
        "Held-out reward: greedy decoding, one rollout per held-out task, after training. "
        "Stderr is over seeds (sample std / sqrt(seeds)); with one seed none is given "
        "(per-task stderr is in results.json).",
        "",
        *rows,
        "",
        "## Answers",
        "",
        *answers(results),
        "",
        "![learning curve](learning_curve.png)",
        "",
    ]
    if failed:
        lines += ["## Failed runs", ""]
        lines += [f"- {r['method']} seed {r['seed']}: `{r['error']}`" for r in failed]
        lines.append("")
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    plot = out / "learning_curve.png"
    _plot(by, plot)
    res_file = out / "results.json"
    atomic_write_text(res_file, json.dumps({"meta": meta, "runs": list(results)}, indent=1))
    return {"report": report, "plot": plot, "results": res_file}


def _plot(by: dict[str, list[dict[str, Any]]], path: Path) -> None:
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for method in ALL_METHODS:
        if method not in by:
            continue
        pts = _mean_curve(by[method])
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ses = [0.0 if math.isnan(p[2]) else p[2] for p in pts]
        ax.errorbar(xs, ys, yerr=ses, marker="o", ms=3, capsize=2, label=method)
    ax.set_xlabel("generated rollouts (bank included)")
    ax.set_ylabel("held-out reward")
    ax.set_title("held-out reward vs rollouts (mean ± stderr over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------ CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lopd.compare",
        description="LOPD vs GRPO, OPSD, SDPO, SDFT, Skill-SD and ablations at equal rollout "
        "budgets.",
    )
    p.add_argument("--quick", action="store_true", help="seconds-scale plumbing run")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    p.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    p.add_argument("--out", default=None, help="output directory (default runs/compare[-quick])")
    p.add_argument("--budget", type=int, default=None, help="rollouts per run (bank included)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluation interval in steps")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the runs an earlier comparison left in --out",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="seeds run in parallel, one single-threaded process each (default: all seeds; 3 on "
        "2 cores measured 52 min, the third seed after the first two would take ~1.5x)",
    )
    p.add_argument("overrides", nargs="*", help="section.field=value applied to every run")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_host_memory()  # before any model is loaded
    settings = settings_for(args.quick)
    settings.overrides += list(args.overrides)
    if args.budget is not None:
        settings.budget = args.budget
    if args.eval_every is not None:
        settings.eval_every = args.eval_every
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    out = Path(args.out or ("runs/compare-quick" if args.quick else "runs/compare"))
    jobs = args.jobs if args.jobs is not None else len(seeds)
    try:
        cfg = _config(settings, "lopd", seeds[0], out, 0)
        for m in args.methods:
            group = METHODS[m].group_size(cfg)
            if cfg.lopd.tasks_per_step % group:
                raise ConfigError(
                    f"lopd.tasks_per_step={cfg.lopd.tasks_per_step} must be a multiple of the "
                    f"group size {group} of {m} for equal per-step budgets"
                )
        for m in args.methods:
            steps, bank = _steps_for(settings, m)
            print(f"[compare] {m}: {steps} steps (+ {bank} bank rollouts)", flush=True)
        if not args.overwrite:
            refuse_used_runs(out / "runs")
    except (ConfigError, RunDirError, ValueError) as err:
        print(f"lopd.compare: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if jobs > 1 and len(seeds) > 1:
        # Spawned workers: one trainer per process, each with one CPU thread.
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = [
                pool.submit(run_seed, settings, args.methods, s, out, args.overwrite) for s in seeds
            ]
            results = [r for f in futures for r in f.result()]
    else:
        results = [
            r for s in seeds for r in run_seed(settings, args.methods, s, out, args.overwrite)
        ]
    meta = {
        **asdict(settings),
        "seeds": seeds,
        "methods": list(args.methods),
        "jobs": jobs,
        "wall_seconds": time.perf_counter() - t0,
        "command": "python -m lopd.compare " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    paths = write_report(results, out, meta)
    print(paths["report"].read_text())
    print(f"[compare] wrote {paths['report']}, {paths['plot']}, {paths['results']}")
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
