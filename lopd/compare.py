"""``python -m lopd.compare``: LOPD against its baselines and ablations at equal rollout budgets.

Runs every method of :data:`lopd.methods.METHODS` (LOPD, its ablations, the baselines) on the
embedded tool-use world over several seeds with the same model, tasks, optimizer, evaluation and
rollout budget, then writes to ``--out``:

* ``report.md``: a table of held-out reward (mean +- stderr over seeds, per-seed values, n) per
  method and the answers to the paper's three claims in miniature: does LOPD beat each baseline at
  equal budget; what fraction of GRPO's (and Skill-SD's) rollouts LOPD needs to reach its final
  reward; does m = 0 fall below the frozen composer; and the rollouts-to-target table (the
  rollouts each method needs to reach vanilla + 0.05 ... + 0.20 and the best final reward)
  (:mod:`lopd.eval.compare_report`).
* ``learning_curve.png``: held-out reward against generated rollouts (mean over seeds).
* ``results.json``: every run's summary and curve; ``runs/<method>-seed<k>/``: the run directories.

Usage::

    python -m lopd.compare                          # default comparison (12 runs x 3 seeds)
    python -m lopd.compare --quick                  # seconds-scale plumbing run (tests)
    python -m lopd.compare --seeds 0 1 --methods lopd grpo --out runs/cmp data.n_test=32
    python -m lopd.compare --methods lopd opsd sdpo sdft skill-sd lopd.null_context=true
                                                    # the null-context controls
    python -m lopd.compare --methods lopd-m0 lopd-m0.01 lopd-m0.02 lopd lopd-m0.1 lopd-frozen \
        eval.with_composer=true --out runs/margin   # the margin sweep (paper Fig. 3)
    python -m lopd.compare --methods opsd-a5 sdpo-a5 sdft-a5 skill-sd-a5 --out runs/a5
                                                    # every text teacher in LOPD's framing
    python -m lopd.compare --methods lopd lopd-grow lopd-ppo lopd-ppo-ema-grow lopd-ppo-null
                                                    # LOPD-PPO, a moved teacher, a growing bank
    python -m lopd.compare --from-results runs/compare/results.json   # rewrite the report only
    python -m lopd.compare --from-runs runs/compare  # the report of the runs a stopped
                                                    # comparison finished (same settings)
    python -m lopd.compare --from-runs runs/a --from-runs runs/b --out runs/ab   # merged
    python -m lopd.compare --from-results runs/a/results.json --from-results runs/b/results.json \
        --out runs/ab   # merged; its results.json keeps the commands that ran the runs

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

from lopd.config import COMPARE_BUDGETS, BankTooSmallError, ConfigError, load_config
from lopd.eval.compare_report import ALL_METHODS, write_report
from lopd.eval.run_names import method_spec, parse_run_name
from lopd.eval.run_results import collect_run, fill_teacher_traces
from lopd.methods import METHODS
from lopd.run.claim import clear_run_dir, refuse_used_runs
from lopd.run.host_memory import configure_host_memory
from lopd.run.run_dir import RunDir, RunDirError
from lopd.trainer import Trainer

__all__ = ["ALL_METHODS", "CompareSettings", "main", "run_method", "settings_for", "write_report"]

# Within a seed, composer methods run first (they produce the bank, phi_0 and c_phi0 the others
# reuse), then the other bank methods, then the bank-free ones.
_RUN_ORDER = tuple(
    sorted(ALL_METHODS, key=lambda m: (not METHODS[m].uses_composer, not METHODS[m].builds_bank))
)
# Methods whose teacher reads text (a reference or a skill), so ``lopd.context_format`` applies.
A5_METHODS = tuple(
    m for m in ALL_METHODS if METHODS[m].has_teacher and not METHODS[m].uses_composer
)
# The default comparison: every method, and every text teacher once more in LOPD's framing (the
# embedded tiny model reads a reference in that framing only: docs/results.md).
DEFAULT_RUNS = ALL_METHODS + tuple(f"{m}-a5" for m in A5_METHODS)


def resolve_run(name: str) -> tuple[str, list[str]]:
    """The method and the extra overrides of a run name (:mod:`lopd.eval.run_names`): a method
    of :data:`lopd.methods.METHODS` or ``lopd-m<m>`` (LOPD with margin ``m``; ``lopd-m0`` is the
    registered ablation), with suffixes ``-a5`` (a text teacher in LOPD's A.5 framing), ``-sync``
    / ``-ema`` (a latent teacher's backbone), ``-grow`` (a growing bank), ``-null`` (the
    teacher's context emptied).

    Raises:
        ValueError: none of these.
    """
    parsed = parse_run_name(name)
    return parsed.method, list(parsed.overrides)


def _run_order(name: str) -> tuple[int, str]:
    return _RUN_ORDER.index(resolve_run(name)[0]), name


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


def _config(settings: CompareSettings, name: str, seed: int, run_dir: Path, steps: int) -> Any:
    every = [] if settings.eval_every is None else [f"eval.every={settings.eval_every}"]
    method, extra = resolve_run(name)
    cfg = load_config(
        settings.preset,
        overrides=[
            *settings.overrides,
            f"train.method={method}",
            *extra,
            f"seed={seed}",
            f"run_dir={json.dumps(str(run_dir))}",
            f"train.steps={steps}",
            *every,
        ],
    )
    cfg.validate()
    return cfg


def _steps_for(settings: CompareSettings, method: str) -> tuple[int, int]:
    """``(steps, bank_rollouts)`` that spend ``settings.budget`` rollouts with ``method``."""
    cfg = _config(settings, "lopd", 0, Path("."), 0)
    tps = cfg.train.tasks_per_step
    bank = cfg.data.n_train * cfg.bank.rollouts_per_task if method_spec(method).builds_bank else 0
    if settings.budget <= bank:
        raise ValueError(
            f"budget={settings.budget} does not exceed the {bank} bank rollouts of {method!r}"
        )
    return (settings.budget - bank) // tps, bank


def _share(sources: Sequence[Path], dst: Path, method: str) -> None:
    """Copy the seed's shared phases from earlier run directories (see the module docstring)."""
    dst.mkdir(parents=True, exist_ok=True)
    spec = method_spec(method)
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
        its losses and backward passes, and the whole step. LOPD and its ablations add
        ``dual`` (``margin``, and per step the privilege ``delta`` and ``beta`` after the dual
        update) and, under ``eval.with_composer``, ``base_composer_phi0`` and ``base_composer``
        (the frozen base model generating with c_phi0 and with the trained c_phi). Methods with
        a teacher add ``teacher`` (:func:`lopd.eval.run_results.teacher_trace`);
        ``student_composer`` and ``teacher_composer`` (the trained student and a moved teacher
        generating with the latents, ``eval.with_composer``), ``trace`` (per step: LOPD-PPO's
        ``grad_ppo``, ``grad_distill``, ``grad_cosine``; a growing bank's ``bank_size``,
        ``bank_added``) and ``teacher_curve`` (``[[rollouts, the latent teacher's held-out
        reward], ...]``, ``eval.teacher_curve``) where the run logged them.
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
            trainer.run()
        finally:
            trainer.close()
        result.update(collect_run(method, run_dir))
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
    for method in sorted(methods, key=_run_order):
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


# ------------------------------------------------------------------------------ CLI
def _run_name(name: str) -> str:
    try:
        resolve_run(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lopd.compare",
        description="LOPD vs GRPO, OPSD, SDPO, SDFT, Skill-SD and ablations at equal rollout "
        "budgets.",
    )
    p.add_argument("--quick", action="store_true", help="seconds-scale plumbing run")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_RUNS),
        type=_run_name,
        help=f"default: {' '.join(DEFAULT_RUNS)}; any of {' '.join(ALL_METHODS)}, "
        "lopd-m<margin> (LOPD with that margin, e.g. "
        "lopd-m0.02: the margin sweep), with suffixes: -a5 for "
        f"{', '.join(A5_METHODS)} (its teacher reads its reference in LOPD's A.5 framing: the "
        "same reader as LOPD), -sync / -ema (the latent teacher's backbone follows the "
        "student), -grow (the bank grows with the student's successes), -null (the teacher's "
        "context emptied); e.g. lopd-ppo-ema-grow",
    )
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
    p.add_argument(
        "--from-results",
        action="append",
        default=None,
        metavar="RESULTS_JSON",
        help="run nothing: write the report of an earlier comparison's results.json into --out "
        "(default: its directory); repeat it to merge several comparisons' results (a run found "
        "in two is refused)",
    )
    p.add_argument(
        "--from-runs",
        action="append",
        default=None,
        metavar="DIR",
        help="run nothing: the report of the finished runs under DIR/runs (a comparison that was "
        "stopped) into --out (default: the first DIR); repeat it to merge the runs of several "
        "comparisons; give the settings the runs used",
    )
    p.add_argument("overrides", nargs="*", help="section.field=value applied to every run")
    return p.parse_args(argv)


@dataclass
class _MergeCheck:
    """What a merge of comparisons has taken so far, for the checks every merge path makes
    (``--from-results`` and ``--from-runs``): each run (method and seed) once, and each seed's
    untrained model scored the same in every source.

    Attributes:
        seen: (method, seed) -> the source that brought that run.
        vanilla: seed -> (its untrained model's reward, the source that first scored it).
    """

    seen: dict[tuple[str, int], Path] = field(default_factory=dict)
    vanilla: dict[int, tuple[float, Path]] = field(default_factory=dict)

    def add(self, runs: Sequence[dict[str, Any]], source: Path) -> None:
        """Take ``source``'s ``runs`` (result dicts with ``method``, ``seed`` and, when the run
        did not fail, ``vanilla``).

        Raises:
            ValueError: a run is also in an earlier source (the report would hold it twice), or
                a seed's vanilla reward differs from an earlier source's: the comparisons
                evaluated another model, task set or held-out split, and a merge would pair runs
                that share nothing (a five-format reader's with the default model's, val with
                test).
        """
        for r in runs:
            key = (r["method"], r["seed"])
            if key in self.seen:
                raise ValueError(f"{key[0]}-seed{key[1]} is also in {str(self.seen[key])!r}")
            self.seen[key] = source
            if not r.get("vanilla"):
                continue  # a failed run has none
            reward = float(r["vanilla"]["reward_mean"])
            earlier = self.vanilla.setdefault(r["seed"], (reward, source))
            if abs(earlier[0] - reward) > 1e-9:
                raise ValueError(
                    f"seed {r['seed']}'s vanilla reward is {reward:.3f} here and "
                    f"{earlier[0]:.3f} in {str(earlier[1])!r}: the comparisons evaluated "
                    "different models, tasks or splits and cannot be merged"
                )


def _report_from(sources: Sequence[Path], out: str | None, command: str) -> int:
    """``--from-results``: the report of finished comparisons, rewritten (a newer report
    format) or merged (the first one's settings, the seeds and methods of all, the sum of their
    wall times, ``command``, the merge itself, and ``run_commands``, the commands that ran the
    runs, carried through merges of merges; a run, method and seed, found in two is refused)."""
    runs: list[dict[str, Any]] = []
    merge = _MergeCheck()
    meta: dict[str, Any] = {}
    wall = 0.0
    run_commands: list[str] = []
    for results_json in sources:
        try:
            data = json.loads(results_json.read_text())
            fill_teacher_traces(data["runs"])
            merge.add(data["runs"], results_json)
            meta = meta or dict(data["meta"])
            wall += float(data["meta"].get("wall_seconds") or 0.0)
            # A merged source names the commands of its runs; an older merge only its own.
            own = [data["meta"]["command"]] if data["meta"].get("command") else []
            for cmd in data["meta"].get("run_commands") or own:
                if cmd not in run_commands:
                    run_commands.append(cmd)
            runs += data["runs"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            why = f"{type(err).__name__}: {err}"
            print(
                f"lopd.compare: --from-results {str(results_json)!r}: not a readable results.json "
                f"of python -m lopd.compare ({why})",
                file=sys.stderr,
            )
            return 2
    if len(sources) > 1:
        meta["seeds"] = sorted({r["seed"] for r in runs})
        meta["methods"] = sorted({r["method"] for r in runs}, key=_run_order)
        meta["merged_from"] = [str(p) for p in sources]
        meta.update(command=command, run_commands=run_commands, wall_seconds=wall)
    try:
        paths = write_report(runs, Path(out) if out else sources[0].parent, meta)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"lopd.compare: --from-results: cannot write the report ({err})", file=sys.stderr)
        return 2
    print(f"[compare] wrote {paths['report']}, {paths['plot']}, {paths['results']}")
    return 0


def results_from_runs(runs: Path) -> list[dict[str, Any]]:
    """The results of the finished runs under ``runs`` (``<run name>-seed<k>/`` folders with a
    ``summary.json``), in the order a comparison runs them; unfinished ones are named on stderr
    and left out."""
    results = []
    for run_dir in sorted(runs.glob("*-seed*")):
        name, _, seed = run_dir.name.rpartition("-seed")
        try:
            resolve_run(name)
            seed_k = int(seed)
        except ValueError:
            continue  # not a run of lopd.compare
        if not RunDir(run_dir).summary.exists():
            print(
                f"[compare] {run_dir.name}: not finished (no summary.json), left out",
                file=sys.stderr,
            )
            continue
        result: dict[str, Any] = {"method": name, "seed": seed_k, "run_dir": str(run_dir)}
        try:
            result.update(collect_run(name, run_dir))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{run_dir.name}: not a readable finished run ({err!r})") from None
        results.append(result)
    results.sort(key=lambda r: (r["seed"], _run_order(r["method"])))
    return results


def _report_from_runs(
    folders: Sequence[Path], out: str | None, settings: CompareSettings, command: str
) -> int:
    """``--from-runs``: the report of the finished runs under every ``folder/runs``, written
    into ``out`` (``None``: the first folder). A run (method and seed) found in two folders is
    refused: the report would hold it twice; so are folders that score a seed's untrained model
    differently (:class:`_MergeCheck`)."""
    results: list[dict[str, Any]] = []
    merge = _MergeCheck()
    for folder in folders:
        try:
            found = results_from_runs(folder / "runs")
            if not found:
                raise ValueError("no finished run of python -m lopd.compare there")
            merge.add(found, folder)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"lopd.compare: --from-runs {str(folder)!r}: {err}", file=sys.stderr)
            return 2
        results += found
    results.sort(key=lambda r: (r["seed"], _run_order(r["method"])))
    per_seed: dict[int, float] = {}
    for r in results:
        per_seed[r["seed"]] = per_seed.get(r["seed"], 0.0) + r["wall_seconds"]
    meta = {
        **asdict(settings),
        "seeds": sorted(per_seed),
        "methods": sorted({r["method"] for r in results}, key=_run_order),
        # The runs' own wall times, summed per seed; the seeds are taken to have run side by side.
        "wall_seconds": max(per_seed.values()),
        "command": command,
    }
    paths = write_report(results, Path(out) if out else folders[0], meta)
    print(f"[compare] wrote {paths['report']}, {paths['plot']}, {paths['results']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    command = "python -m lopd.compare " + " ".join(argv)
    if args.from_results is not None:
        return _report_from([Path(p) for p in args.from_results], args.out, command)
    configure_host_memory()  # before any model is loaded
    settings = settings_for(args.quick)
    settings.overrides += list(args.overrides)
    if args.budget is not None:
        settings.budget = args.budget
    if args.eval_every is not None:
        settings.eval_every = args.eval_every
    if args.from_runs is not None:
        return _report_from_runs([Path(d) for d in args.from_runs], args.out, settings, command)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    out = Path(args.out or ("runs/compare-quick" if args.quick else "runs/compare"))
    jobs = args.jobs if args.jobs is not None else len(seeds)
    try:
        cfg = _config(settings, "lopd", seeds[0], out, 0)
        for m in args.methods:
            group = method_spec(m).group_size(cfg)
            if cfg.train.tasks_per_step % group:
                raise ConfigError(
                    f"train.tasks_per_step={cfg.train.tasks_per_step} must be a multiple of the "
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
        "command": command,
    }
    paths = write_report(results, out, meta)
    print(paths["report"].read_text())
    print(f"[compare] wrote {paths['report']}, {paths['plot']}, {paths['results']}")
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
