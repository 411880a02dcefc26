"""The report of ``python -m lopd.compare``: the statistics over seeds and the files it writes.

* the table of held-out reward per method (mean +- stderr over seeds, per-seed values, n);
* the answers to the paper's three claims in miniature (:func:`answers`);
* the **rollouts-to-target table** (:func:`rollouts_to_target_table`): for targets vanilla +
  0.05, 0.10, 0.15, 0.20 and the best final reward, the generated rollouts each method needs to
  reach the target on its held-out learning curve (linearly interpolated between evaluations, per
  seed), and LOPD's fraction of GRPO's and of Skill-SD's (the paper's efficiency claim: "less than
  30% of their rollout budget");
* ``learning_curve.png`` and ``results.json``.

A result (one method, one seed) is the dictionary :func:`lopd.compare.run_method` returns; its
``curve`` is ``[[rollouts, held-out reward], ...]`` in increasing rollouts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from lopd.atomic import atomic_write_text
from lopd.eval.latent_report import latent_reader_table, latent_runs, signal_table, versus_table
from lopd.eval.run_names import RUN_SUFFIXES, parse_run_name
from lopd.eval.stats import fmt, mean_se, side, verdict
from lopd.methods import METHODS

__all__ = [
    "ALL_METHODS",
    "TARGET_GAINS",
    "answers",
    "margin_table",
    "rollouts_to_reach",
    "rollouts_to_target_table",
    "teacher_table",
    "write_report",
]

ALL_METHODS = tuple(METHODS)
"""Every comparable method, in the order the report lists them."""

TARGET_GAINS = (0.05, 0.10, 0.15, 0.20)
"""Held-out reward gains over a seed's vanilla reward that the rollouts-to-target table asks for."""


# ------------------------------------------------------------------------------ statistics
def _report_order(name: str) -> tuple[int, float, tuple[int, ...], str]:
    """Registered methods in :data:`ALL_METHODS` order, each method's suffixed runs (``-a5``,
    ``-sync``, ``-ema``, ``-grow``, ``-null``: :mod:`lopd.eval.run_names`) right after it, then
    margin runs (``lopd-m0.02``) by m."""
    try:
        parsed = parse_run_name(name)
    except ValueError:
        return len(ALL_METHODS) + 1, 0.0, (), name
    order = tuple(list(RUN_SUFFIXES).index(s) + 1 for s in parsed.suffixes)
    if parsed.base in ALL_METHODS:
        return ALL_METHODS.index(parsed.base), 0.0, order, name
    return len(ALL_METHODS), float(parsed.base.removeprefix("lopd-m")), order, name


def _by_method(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Successful runs per run name, in report order, each list by seed."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: (_report_order(r["method"]), r["seed"])):
        if r["error"] is None:
            out.setdefault(r["method"], []).append(r)
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
        for base in by:
            if base == "lopd":
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


# ------------------------------------------------------------------------------ rollouts to target
def rollouts_to_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Generated rollouts at which a learning curve first reaches ``target``.

    The curve is read as straight lines between its evaluations: the first evaluation at or
    above ``target`` and the one before it are interpolated linearly; at several evaluations at
    one rollout count the last one counts (the one after training up to it).

    Args:
        curve: ``[[rollouts, held-out reward], ...]`` in increasing rollouts.
        target: the held-out reward to reach.

    Returns:
        The rollouts (a float: interpolated), or ``None`` if the curve never reaches ``target``.
    """
    points: list[tuple[float, float]] = []
    for x, y in curve:
        if points and points[-1][0] == x:
            points[-1] = (x, y)
        else:
            points.append((x, y))
    for i, (x, y) in enumerate(points):
        if y >= target:
            if i == 0:
                return float(x)
            x0, y0 = points[i - 1]
            return x0 + (target - y0) * (x - x0) / (y - y0)
    return None


def _reach_cell(needed: Sequence[float | None]) -> str:
    """Mean +- stderr over seeds of the rollouts needed; seeds that never reach are counted."""
    reached = [x for x in needed if x is not None]
    if not reached:
        return "not reached"
    mean, se = mean_se(reached)
    cell = f"{mean:.0f}" + ("" if math.isnan(se) else f" ± {se:.0f}")
    if len(reached) < len(needed):
        cell += f" ({len(reached)}/{len(needed)} seeds; the others not reached)"
    return cell


def _fraction_cell(lopd: dict[int, float | None], ref: dict[int, float | None]) -> str:
    """LOPD's rollouts over ``ref``'s for the target, mean +- stderr of per-seed ratios (seeds
    where both reach it)."""
    ratios = [lopd[s] / ref[s] for s in sorted(set(lopd) & set(ref)) if lopd[s] and ref[s]]
    if not ratios:
        return "–"
    mean, se = mean_se(ratios)
    cell = f"{mean:.0%}" + ("" if math.isnan(se) else f" ± {se:.0%}")
    seeds = len(set(lopd) & set(ref))
    return cell if len(ratios) == seeds else f"{cell} ({len(ratios)}/{seeds} seeds)"


def _without_bank(result: dict[str, Any]) -> list[list[float]]:
    """A run's curve counted from its first training rollout (the bank's rollouts left out, as
    the paper counts)."""
    bank = result.get("bank_rollouts", 0)
    return [[x - bank, y] for x, y in result["curve"] if x >= bank]


def rollouts_to_target_table(
    results: Sequence[dict[str, Any]], count_bank: bool = True
) -> list[str]:
    """The rollouts-to-target table (markdown lines).

    Targets: each seed's vanilla held-out reward plus every gain of :data:`TARGET_GAINS`, and
    the best method's mean final reward (one target for all seeds). Per method and target, the
    rollouts (bank included; ``count_bank=False``: counted from the first training rollout) at
    which its held-out curve reaches the target (:func:`rollouts_to_reach`), mean +- stderr over
    the seeds that reach it; then every latent-teacher run's fraction of GRPO's and of
    Skill-SD's (``LOPD / GRPO`` for ``lopd``), per seed where both reach it.
    """
    by = _by_method(results)
    if not by:
        return []
    finals = {m: mean_se([r["final"]["reward_mean"] for r in runs])[0] for m, runs in by.items()}
    best = max(finals, key=finals.get)
    targets: list[tuple[str, Any]] = [
        (f"vanilla + {g:.2f}", lambda r, g=g: r["vanilla"]["reward_mean"] + g) for g in TARGET_GAINS
    ]
    targets.append((f"best final ({finals[best]:.3f}, {best})", lambda r: finals[best]))
    curve = (lambda r: r["curve"]) if count_bank else _without_bank
    needed = {
        m: [{r["seed"]: rollouts_to_reach(curve(r), at(r)) for r in runs} for _, at in targets]
        for m, runs in by.items()
    }
    lines = [
        "| rollouts to reach | " + " | ".join(name for name, _ in targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for method, per_target in needed.items():
        cells = [_reach_cell(list(per_seed.values())) for per_seed in per_target]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for ref, name in (("grpo", "GRPO"), ("skill-sd", "Skill-SD")):
        for run in latent_runs(needed) if ref in needed else []:
            cells = [_fraction_cell(a, b) for a, b in zip(needed[run], needed[ref])]
            label = "LOPD" if run == "lopd" else run
            lines.append(f"| {label} / {name} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------ the margin
def _over_seeds(values: Sequence[float], digits: int = 3) -> str:
    return fmt(*mean_se(values), digits) if values else "–"


def margin_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """The paper's margin ablation (Fig. 3) from the runs that record LOPD's dual ascent:
    per run, m, the held-out reward, the share of steps whose privilege Delta met m, beta after
    the last step (and its largest value), and base + trained phi minus base + phi_0 (both
    generating with latents; ``eval.with_composer``), each mean +- stderr over seeds; then the
    paper's order m = 0 < frozen < m >= 0.02 tested pairwise (markdown lines; none without
    such runs)."""
    by = {m: runs for m, runs in _by_method(results).items() if all("dual" in r for r in runs)}
    if not by:
        return []
    lines = [
        "| run | m | held-out reward | steps with Delta >= m | beta after the last step "
        "(largest) | base + phi − base + phi_0 |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in by.items():
        duals = [r["dual"] for r in runs]
        margin = duals[0]["margin"]
        met = [sum(d >= margin for d in x["delta"]) / max(len(x["delta"]), 1) for x in duals]
        gain = [
            r["base_composer"]["reward_mean"] - r["base_composer_phi0"]["reward_mean"]
            for r in runs
            if "base_composer" in r and "base_composer_phi0" in r
        ]
        lines.append(
            f"| {name} | {margin:g}{' (phi frozen)' if name == 'lopd-frozen' else ''} | "
            f"{_over_seeds([r['final']['reward_mean'] for r in runs])} | {_over_seeds(met, 2)} | "
            f"{_over_seeds([x['beta'][-1] for x in duals], 2)} "
            f"({max(max(x['beta']) for x in duals):.2f}) | {_over_seeds(gain)} |"
        )
    if "lopd-frozen" in by:
        lines.append("")
        shape = [("lopd-m0", "lopd-frozen")]
        shape += [(m, "lopd-frozen") for m, runs in by.items() if runs[0]["dual"]["margin"] >= 0.02]
        for a, b in shape:
            if a in by and a != b:
                d, se, n = _paired(by[a], by[b])
                lines.append(
                    f"- {a} − {b} = {fmt(d, se)} (paired over {n} seed(s)): {side(d, se)}."
                )
    return lines


# ------------------------------------------------------------------------------ the teachers
def teacher_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """How far each method's teacher is from its student (runs with a ``teacher`` trace): the
    divergence its loss computes at the first step it distilled, its mean over the run and at
    the last distilled step, and the student's minus the teacher's mean log-prob of the
    student's action tokens at the first step (> 0: the teacher finds the student's own tokens
    less likely), each mean +- stderr over seeds (markdown lines; none without such runs)."""
    by = {m: runs for m, runs in _by_method(results).items() if all("teacher" in r for r in runs)}
    if not by:
        return []
    lines = [
        "| run | divergence at the first distilled step | mean over the run | at the last "
        "distilled step | student − teacher log-prob at the first step |",
        "|---|---|---|---|---|",
    ]
    for name, runs in by.items():
        kls = [[k for k in r["teacher"]["kl"] if k is not None] for r in runs]
        gaps = [[g for g in r["teacher"]["logprob_gap"] if g is not None] for r in runs]
        kls = [k for k in kls if k]
        firsts = [k[0] for k in kls]
        lines.append(
            f"| {name} | {_over_seeds(firsts)} | {_over_seeds([sum(k) / len(k) for k in kls])} "
            f"| {_over_seeds([k[-1] for k in kls])} | {_over_seeds([g[0] for g in gaps if g])} |"
        )
    return lines


# ------------------------------------------------------------------------------ report
def _run_commands(meta: dict[str, Any]) -> list[str]:
    """A merged report's lines naming the commands that ran its runs (``meta["run_commands"]``,
    kept by ``python -m lopd.compare --from-results`` through merges of merges); none when the
    report is one comparison's."""
    cmds = meta.get("run_commands") or []
    return ["", "The runs came from:", "", *(f"- `{c}`" for c in cmds)] if cmds else []


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
        "n (seeds × tasks) | rollouts | wall s / run | s / step (rollout + loss & backward) | "
        "− vanilla (paired over seeds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    vanilla = [r for runs in by.values() for r in runs]
    if vanilla:
        per_seed = {r["seed"]: r["vanilla"] for r in vanilla}
        vals = [per_seed[s]["reward_mean"] for s in sorted(per_seed)]
        succ = [per_seed[s]["success_rate"] for s in sorted(per_seed)]
        rows.append(
            f"| vanilla (no training) | {fmt(*mean_se(vals))} | "
            f"{', '.join(f'{v:.3f}' for v in vals)} | {sum(succ) / len(succ):.3f} | "
            f"{len(vals)} × {per_seed[min(per_seed)]['n']} | 0 | – | – | – |"
        )
    for method, runs in by.items():
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
            f"{'/'.join(map(str, rollouts))} | {wall:.0f} | {per_step} | "
            f"{_versus_vanilla(runs)} |"
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
        *_run_commands(meta),
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
        "## Rollouts to target",
        "",
        "Generated rollouts (bank included) at which each method's held-out curve first reaches "
        "the target: per seed, linearly interpolated between evaluations (every "
        f"{_eval_interval(meta)}), mean ± stderr over the seeds that reach it. Vanilla + g is "
        "each seed's own vanilla reward plus g. LOPD / X: LOPD's rollouts over X's, per seed.",
        "",
        *rollouts_to_target_table(results),
        "",
        *_section(
            "Rollouts to target, the bank's rollouts left out",
            "The same, each curve counted from the run's first training rollout (the paper's "
            "count: the base model's bank rollouts are not charged to the method).",
            rollouts_to_target_table(results, count_bank=False)
            if any(r.get("bank_rollouts") for r in results if r["error"] is None)
            else [],
        ),
        *_section(
            "The latent teacher against GRPO and Skill-SD",
            "Each latent-teacher run's final held-out reward minus GRPO's and Skill-SD's, "
            "paired within a seed (mean ± stderr over seeds).",
            versus_table(by),
        ),
        *_section(
            "Who reads the latents",
            "Held-out reward of the frozen base and of the trained student, each without and "
            "with the trained latents (`eval.with_composer`), and of a moved teacher's weights "
            "with them.",
            latent_reader_table(by),
        ),
        *_section(
            "How the latent-teacher runs learnt",
            "Per run, then mean ± stderr over seeds. Share: Σ|g_distill| / Σ(|g_ppo| + "
            "|g_distill|) over the run's steps, of the gradients the two terms send into the "
            "student's action-row hidden states (LOPD-PPO); cosine and Delta: means over steps.",
            signal_table(by),
        ),
        *_section(
            "The margin",
            "LOPD's privileged margin m (paper Fig. 3: m = 0 below the frozen composer, m >= 0.02 "
            "above it). Delta is a step's privilege (eq. 12), beta its dual variable.",
            margin_table(results),
        ),
        *_section(
            "The teachers",
            "How far each teacher is from its student on the student's own rollouts (the "
            "divergence the method's loss computes: forward or reverse KL over its support; "
            "Skill-SD's sampled-token reverse KL). A teacher that cannot read its context sits "
            "far from the student from the first step on; `-a5` runs put the same text in "
            "LOPD's framing.",
            teacher_table(results),
        ),
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


def _versus_vanilla(runs: Sequence[dict[str, Any]]) -> str:
    """Final minus vanilla held-out reward, paired within a seed, mean +- stderr over seeds, and
    whether it is beyond 2 stderr (a null-context control should stay within)."""
    diffs = [r["final"]["reward_mean"] - r["vanilla"]["reward_mean"] for r in runs]
    d, se = mean_se(diffs)
    spread = "" if math.isnan(se) else f" ± {se:.3f}"
    return f"{d:+.3f}{spread} ({side(d, se)})"


def _section(title: str, intro: str, body: list[str]) -> list[str]:
    return [f"## {title}", "", intro, "", *body, ""] if body else []


def _eval_interval(meta: dict[str, Any]) -> str:
    every = meta.get("eval_every")
    return "`eval.every` steps of the preset" if every is None else f"{every} steps"


def _plot(by: dict[str, list[dict[str, Any]]], path: Path) -> None:
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for method, runs in by.items():
        pts = _mean_curve(runs)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ses = [0.0 if math.isnan(p[2]) else p[2] for p in pts]
        ax.errorbar(xs, ys, yerr=ses, marker="o", ms=3, capsize=2, label=method)
    ax.set_xlabel("generated rollouts (bank included)")
    ax.set_ylabel("held-out reward")
    ax.set_title("held-out reward vs rollouts (mean ± stderr over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
