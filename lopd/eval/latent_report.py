"""The report's tables on the latent teacher inside the PPO recipe (``python -m lopd.compare``).

For the runs of a latent teacher (LOPD, its ablations, LOPD-PPO, with any suffix of
:mod:`lopd.eval.run_names`):

* :func:`versus_table`: each run minus GRPO and minus Skill-SD, paired over seeds, and whether it
  is above both beyond 2 stderr (the aim of the recipe);
* :func:`latent_reader_table`: what the trained latents do for the frozen base and for weights
  that moved (the trained student, a moved teacher), each generating with them
  (``eval.with_composer``);
* :func:`signal_table`: how the run learnt: the distillation term's share of the gradient into
  the student (LOPD-PPO), Delta, the latent teacher's held-out reward along the run
  (``eval.teacher_curve``) and a growing bank's size.

A result is one run's dictionary of :func:`lopd.compare.run_method`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lopd.eval.run_names import parse_run_name
from lopd.eval.stats import fmt, mean_se, side
from lopd.methods import METHODS

__all__ = ["latent_reader_table", "latent_runs", "signal_table", "versus_table"]

REFERENCES = ("grpo", "skill-sd")
"""The recipe's references: the runs a latent-teacher run is held against."""


def latent_runs(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The run names of ``by`` whose method has a latent teacher (a composer)."""
    names = []
    for name in by:
        try:
            method = parse_run_name(name).method
        except ValueError:
            continue
        if METHODS[method].uses_composer:
            names.append(name)
    return names


def _paired(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> tuple[float, float, int]:
    fa = {r["seed"]: r["final"]["reward_mean"] for r in a}
    fb = {r["seed"]: r["final"]["reward_mean"] for r in b}
    seeds = sorted(set(fa) & set(fb))
    if not seeds:
        return float("nan"), float("nan"), 0
    mean, se = mean_se([fa[s] - fb[s] for s in seeds])
    return mean, se, len(seeds)


def versus_table(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each latent-teacher run minus each reference, paired over seeds (markdown lines; none
    without a reference among the runs)."""
    refs = [r for r in REFERENCES if r in by]
    names = latent_runs(by)
    if not refs or not names:
        return []
    lines = [
        "| run | held-out reward | " + " | ".join(f"− {r} (paired)" for r in refs)
        + " | above every reference by > 2 stderr |",
        "|---|---|" + "---|" * len(refs) + "---|",
    ]  # fmt: skip
    for name in names:
        cells, above = [], True
        for ref in refs:
            d, se, n = _paired(by[name], by[ref])
            cells.append(f"{fmt(d, se)} ({side(d, se)})" if n else "–")
            above = above and n > 1 and d > 2 * se
        reward = fmt(*mean_se([r["final"]["reward_mean"] for r in by[name]]))
        verdict = "yes" if above else "no"
        lines.append(f"| {name} | {reward} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def latent_reader_table(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What the trained latents do for whoever reads them, per run (with ``eval.with_composer``):
    the frozen base and the trained student with and without them, a moved teacher with them;
    differences paired over seeds (markdown lines)."""
    names = [n for n in latent_runs(by) if all("student_composer" in r for r in by[n])]
    if not names:
        return []
    lines = [
        "| run | base | base + latents | student | student + latents | moved teacher + latents "
        "| latents for the base (paired) | latents for the student (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        runs = by[name]

        def cell(key: str, runs: Sequence[dict[str, Any]] = runs) -> str:
            vals = [r[key]["reward_mean"] for r in runs if key in r]
            return fmt(*mean_se(vals)) if len(vals) == len(runs) else "–"

        base = [r["base_composer"]["reward_mean"] - r["vanilla"]["reward_mean"] for r in runs]
        student = [r["student_composer"]["reward_mean"] - r["final"]["reward_mean"] for r in runs]
        lines.append(
            f"| {name} | {cell('vanilla')} | {cell('base_composer')} | {cell('final')} | "
            f"{cell('student_composer')} | {cell('teacher_composer')} | "
            f"{fmt(*mean_se(base))} | {fmt(*mean_se(student))} |"
        )
    return lines


def _run_mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _over_seeds(values: Sequence[float | None], digits: int = 3) -> str:
    kept = [v for v in values if v is not None]
    return fmt(*mean_se(kept), digits) if kept else "–"


def signal_table(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """How each latent-teacher run learnt, per run then mean +- stderr over seeds (markdown
    lines): the distillation term's share of the gradient into the student's action-row hidden
    states, ``sum |g_distill| / sum (|g_ppo| + |g_distill|)`` over the run's steps, and the
    mean cosine between the two (LOPD-PPO; LOPD has no PPO term), Delta's mean over steps, the
    latent teacher's held-out reward at its first and last evaluation along the run, and the
    bank's size at the end (entries added in training)."""
    names = latent_runs(by)
    if not names:
        return []
    lines = [
        "| run | distillation share of the student's gradient | cosine(PPO, distillation) | "
        "Delta (mean over steps) | latent teacher's reward, first / last evaluation | bank at "
        "the end (added) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        runs = by[name]
        share, cosine, delta, first, last, bank, added = [], [], [], [], [], [], []
        for r in runs:
            t = r.get("trace", {})
            g_p, g_d = sum(t.get("grad_ppo", [])), sum(t.get("grad_distill", []))
            share.append(g_d / (g_p + g_d) if g_p + g_d > 0 else None)
            cosine.append(_run_mean(t.get("grad_cosine", [])))
            delta.append(_run_mean(r.get("dual", {}).get("delta", [])))
            curve = r.get("teacher_curve", [])
            first.append(curve[0][1] if curve else None)
            last.append(curve[-1][1] if curve else None)
            bank.append(t["bank_size"][-1] if t.get("bank_size") else None)
            added.append(sum(t["bank_added"]) if t.get("bank_added") else None)
        grown = "–"
        if any(b is not None for b in bank):
            grown = f"{_over_seeds(bank, 0)} ({_over_seeds(added, 0)})"
        lines.append(
            f"| {name} | {_over_seeds(share, 2)} | {_over_seeds(cosine, 2)} | "
            f"{_over_seeds(delta, 4)} | {_over_seeds(first)} / {_over_seeds(last)} | {grown} |"
        )
    return lines
