"""The results of a finished comparison run, read from its run directory alone.

:func:`collect_run` turns a run directory of :mod:`lopd.compare` (``summary.json``,
``metrics.jsonl``, the bank's marker) into the fields its ``results.json`` keeps for that run,
so a comparison that was stopped keeps the runs it finished; :func:`teacher_trace` is how far
each step's teacher was from the student.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lopd.eval.run_names import method_spec
from lopd.run.run_dir import RunDir

__all__ = ["collect_run", "fill_teacher_traces", "teacher_trace"]


def collect_run(method: str, run_dir: Path) -> dict[str, Any]:
    """The result fields of a finished run of ``method``, read from its run directory alone
    (``summary.json``, ``metrics.jsonl``, the bank's marker), so a comparison that was stopped
    keeps the runs it finished (``python -m lopd.compare --from-runs``). ``steps`` counts the
    steps the run logged; ``wall_seconds`` is the trainer's own
    (:func:`lopd.compare.run_method` replaces it with the time it measured around the trainer).

    Raises:
        OSError, ValueError, KeyError: the run directory holds no finished run.
    """
    files = RunDir(run_dir)
    summary = json.loads(files.summary.read_text())
    bank = 0
    if method_spec(method).builds_bank and files.bank_done.exists():
        bank = int(json.loads(files.bank_done.read_text())["rollouts"])
    vanilla = summary["vanilla"]["reward_mean"]
    curve = [[0, vanilla]] + ([[bank, vanilla]] if bank else [])
    rows = [json.loads(line) for line in files.metrics.read_text().splitlines()]
    for row in rows:
        if "eval_reward_mean" in row:
            curve.append([int(row["rollouts"]), row["eval_reward_mean"]])
    curve.append([int(summary["rollouts"]), summary["lopd"]["reward_mean"]])
    result: dict[str, Any] = {
        # Where a training step's time goes (means over steps; evaluation not included).
        "step_seconds": {
            part: sum(r.get(f"seconds_{part}", 0.0) for r in rows) / max(len(rows), 1)
            for part in ("rollout", "loss_backward", "step")
        }
    }
    if method_spec(method).uses_composer:
        # The privileged margin's dual ascent, step by step (the margin table).
        result["dual"] = {
            "margin": rows[0]["margin"] if rows else None,
            "delta": [r["delta"] for r in rows],
            "beta": [r["beta_next"] for r in rows],
        }
    for key in ("base_composer_phi0", "base_composer", "student_composer", "teacher_composer"):
        if key in summary:
            result[key] = summary[key]
    # LOPD-PPO's gradient split, a growing bank, the latent teacher's curve (where logged).
    trace = {k: [r[k] for r in rows if k in r] for k in _TRACED}
    result.update({"trace": {k: v for k, v in trace.items() if v}} if any(trace.values()) else {})
    teacher_curve = [
        [int(r["rollouts"]), r["eval_teacher_reward_mean"]]
        for r in rows
        if "eval_teacher_reward_mean" in r
    ]
    if teacher_curve:
        result["teacher_curve"] = teacher_curve
    if method_spec(method).has_teacher:
        result["teacher"] = teacher_trace(rows)
    result.update(
        steps=sum("step" in r for r in rows),
        rollouts=int(summary["rollouts"]),
        bank_rollouts=bank,
        vanilla=summary["vanilla"],
        final=summary["lopd"],
        curve=curve,
        wall_seconds=summary["wall_seconds"],
        error=None,
    )
    return result


_TRACED = ("grad_ppo", "grad_distill", "grad_cosine", "bank_size", "bank_added")
"""Per-step metrics a result keeps under ``trace`` (those a run logged)."""


def teacher_trace(rows: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """How far each step's teacher is from the student, from a run's ``metrics.jsonl`` rows:
    per step its ``kl`` (the method's divergence on the action tokens it distils) and the
    student's minus the teacher's mean log-prob of the student's action tokens (``None`` where
    the step distilled nothing, e.g. SDPO without a successful sibling)."""
    trace: dict[str, list[float | None]] = {"kl": [], "logprob_gap": []}
    for row in rows:
        distilled = "kl" in row and (
            row.get("distilled", 1.0) > 0 and row.get("skill_guided", 1.0) > 0
        )
        trace["kl"].append(row["kl"] if distilled else None)
        gap = None
        if distilled and "teacher_logprob" in row and "student_logprob" in row:
            gap = row["student_logprob"] - row["teacher_logprob"]
        trace["logprob_gap"].append(gap)
    return trace


def fill_teacher_traces(results: Sequence[dict[str, Any]]) -> None:
    """Add :func:`teacher_trace` to results written before it existed, from their run
    directories' ``metrics.jsonl`` where those are still on disk."""
    for r in results:
        if r.get("error") is None and "teacher" not in r and method_spec(r["method"]).has_teacher:
            metrics = RunDir(Path(r.get("run_dir") or "")).metrics
            if r.get("run_dir") and metrics.exists():
                rows = [json.loads(line) for line in metrics.read_text().splitlines()]
                r["teacher"] = teacher_trace(rows)
