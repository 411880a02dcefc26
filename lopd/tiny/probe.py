"""Does a reference help the base model? ``python -m lopd.models probe-reference``.

The measurement behind the first link of LOPD's chain (paper 3.1's premise): the frozen base model
alone versus the same model with a retrieved successful trajectory of *another* train task as
text in its first user message (the paper's A.5 framing,
:func:`lopd.latent.injection.frame_with_references`), plus a control whose reference is a success of
another template of the same world (mismatched). References come from the real retrieval path:

1. the base model is rolled out once on every train task (default sampling) and its successes
   (reward 1) go to an experience bank (:func:`lopd.latent.collect.collect_bank`);
2. a FAISS retriever over :class:`~lopd.memory.HiddenStateEmbedder` embeddings of the same model
   returns each held-out task's top-1 entry (never its own task: held-out tasks have none);
3. the mismatched control draws, per task, a bank entry of the same world and another template.

Every condition is rolled out on the held-out tasks under the default sampling (temperature 0.7,
top-p 0.95, top-k 20) for several sampling seeds. Reported per split and condition: the mean
reward over seeds with its standard error over seeds, and each reference condition's gain over
the bare prompt with a paired standard error over tasks (per-task rewards averaged over seeds).

``python -m lopd.models probe-formats`` (:func:`probe_formats`) asks the same per method: the
base model with one reference in each method's privileged-context format
(:mod:`lopd.tiny.formats`) against the bare prompt, the reference being the same for every
format (the oracle trajectory of a same-template train task), so the formats differ only in
wording and place: paper 3.1's (a) for each method's teacher.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lopd.latent.collect import collect_bank
from lopd.memory import HiddenStateEmbedder, format_experience
from lopd.rollout.multi_turn import GenerationConfig, rollout
from lopd.tiny.data import reference_env_factory, same_template_plays
from lopd.tiny.formats import FORMATS, framed_env_factory
from lopd.types import Task

__all__ = ["format_formats_report", "format_report", "probe_formats", "probe_reference"]

CONDITIONS = ("bare", "retrieved", "mismatched")


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def _rewards(
    model: Any, tokenizer: Any, tasks: list[Task], refs: Any, seed: int, make_env: Any = None
) -> list[float]:
    if refs is not None:
        make_env = reference_env_factory(refs)
    trajs = rollout(
        model, tokenizer, tasks, GenerationConfig(), seed=seed, batch_size=32, make_env=make_env
    )
    return [float(t.reward) for t in trajs]


def probe_reference(
    model: Any,
    tokenizer: Any,
    train: Sequence[Task],
    heldout: dict[str, Sequence[Task]],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    bank_dir: str | Path | None = None,
    bank_seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Measure bare vs retrieved-reference vs mismatched-reference rewards.

    Args:
        model, tokenizer: the frozen base model.
        train: train-split tasks (the bank's source).
        heldout: split name -> held-out tasks to evaluate (e.g. ``{"val": ..., "test": ...}``).
        seeds: sampling seeds of the evaluation rollouts.
        bank_dir: where to build the bank (default: a temporary directory).
        bank_seed: sampling seed of the bank's rollouts.
        log: progress printer.

    Returns:
        A JSON-serializable report (see the module docstring).
    """

    t0 = time.perf_counter()
    all_heldout = [t for ts in heldout.values() for t in ts]
    with tempfile.TemporaryDirectory() as tmp:
        res = collect_bank(
            model,
            tokenizer,
            list(train),
            bank_dir or Path(tmp) / "bank",
            GenerationConfig(),
            min_reward=1.0,
            seed=bank_seed,
            embedder=HiddenStateEmbedder(model, tokenizer),
            query_tasks=all_heldout,
            index="cpu",
            progress=False,
        )
    retriever = res.retriever
    entries = retriever.entries
    if not entries:
        raise ValueError("no train rollout succeeded: the bank is empty, nothing to retrieve")
    template_of = {t.task_id: t.spec["template"] for t in train}
    log(
        f"bank: {res.num_success}/{res.num_rollouts} successful train rollouts "
        f"({len(entries)} entries, {time.perf_counter() - t0:.0f}s)"
    )
    report: dict[str, Any] = {
        "bank": {
            "rollouts": res.num_rollouts,
            "successes": res.num_success,
            "entries": len(entries),
            "train_mean_reward": res.mean_reward,
        },
        "seeds": list(seeds),
        "splits": {},
    }
    for split, tasks in heldout.items():
        tasks = list(tasks)
        hits = retriever.retrieve_batch(tasks, k=1)
        retrieved = {t.task_id: [format_experience(h[0])] for t, h in zip(tasks, hits)}
        same = [template_of[h[0].task_id] == t.spec["template"] for t, h in zip(tasks, hits)]
        mismatched = {}
        for t in tasks:
            rng = random.Random(f"mismatch/{t.task_id}")
            other = [e for e in entries if template_of[e.task_id] != t.spec["template"]]
            # Another template of the same world if the bank has one, else of another world.
            cands = [e for e in other if e.world == t.world] or other
            if not cands:
                raise ValueError("the bank holds a single template: no mismatched reference")
            mismatched[t.task_id] = [format_experience(rng.choice(cands))]
        refs = {"bare": None, "retrieved": retrieved, "mismatched": mismatched}
        per_seed: dict[str, list[list[float]]] = {c: [] for c in CONDITIONS}
        for seed in seeds:
            for cond in CONDITIONS:
                per_seed[cond].append(_rewards(model, tokenizer, tasks, refs[cond], seed))
            log(
                f"  {split} seed {seed}: "
                + ", ".join(f"{c} {sum(per_seed[c][-1]) / len(tasks):.3f}" for c in CONDITIONS)
                + f" ({time.perf_counter() - t0:.0f}s)"
            )
        out: dict[str, Any] = {
            "n_tasks": len(tasks),
            "retrieved_same_template": sum(same) / len(same),
        }
        per_task = {
            c: [sum(r[i] for r in per_seed[c]) / len(seeds) for i in range(len(tasks))]
            for c in CONDITIONS
        }
        for c in CONDITIONS:
            m, se = _mean_se([sum(r) / len(r) for r in per_seed[c]])
            out[c] = {
                "mean": m,
                "stderr_over_seeds": se,
                "per_seed": [sum(r) / len(r) for r in per_seed[c]],
            }
        for c in ("retrieved", "mismatched"):
            gain, se = _mean_se([a - b for a, b in zip(per_task[c], per_task["bare"])])
            out[f"{c}_minus_bare"] = {"mean": gain, "stderr_paired_over_tasks": se}
        report["splits"][split] = out
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def format_report(report: dict[str, Any]) -> str:
    """A markdown table of a :func:`probe_reference` report."""
    lines = [
        "| split | n | bare | + retrieved reference | + mismatched reference | retrieved - bare "
        "| mismatched - bare | same-template retrievals |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for split, r in report["splits"].items():
        cells = [f"{r[c]['mean']:.3f} ± {r[c]['stderr_over_seeds']:.3f}" for c in CONDITIONS]
        gains = [
            f"{r[k]['mean']:+.3f} ± {r[k]['stderr_paired_over_tasks']:.3f}"
            for k in ("retrieved_minus_bare", "mismatched_minus_bare")
        ]
        lines.append(
            f"| {split} | {r['n_tasks']} | "
            + " | ".join(cells + gains)
            + f" | {r['retrieved_same_template']:.2f} |"
        )
    return "\n".join(lines)


def probe_formats(
    model: Any,
    tokenizer: Any,
    train: Sequence[Task],
    tasks: Sequence[Task],
    *,
    formats: Sequence[str] = FORMATS,
    seeds: Sequence[int] = (0, 1, 2),
    emptied: bool = False,
    log: Any = print,
) -> dict[str, Any]:
    """Held-out reward of the base model bare and with one reference in each format.

    With ``emptied`` each format's template carries nothing (the teacher of the null-context
    control, ``lopd.null_context``): whether the template alone moves the base model.

    Args:
        model, tokenizer: the frozen base model.
        train: train-split tasks (the references' source).
        tasks: the held-out tasks (the val split: this is a tuning measurement).
        formats: the formats to measure (:data:`lopd.tiny.formats.FORMATS`).
        seeds: sampling seeds of the rollouts (default sampling, temperature 0.7).
        emptied: fill every template with nothing instead of the reference.
        log: progress printer.

    Returns:
        ``{"n_tasks", "seeds", "seconds", "conditions": {name: {"mean", "stderr_over_seeds",
        "per_seed", "minus_bare": {"mean", "stderr_paired_over_seeds",
        "stderr_paired_over_tasks"}}}}`` with ``"bare"`` and every format as a condition.
    """
    t0 = time.perf_counter()
    tasks = list(tasks)
    plays = same_template_plays(tasks, train, seed=0)
    conditions = ["bare", *formats]
    per_seed: dict[str, list[list[float]]] = {c: [] for c in conditions}
    for seed in seeds:
        for c in conditions:
            make_env = None if c == "bare" else framed_env_factory(c, plays, emptied=emptied)
            per_seed[c].append(_rewards(model, tokenizer, tasks, None, seed, make_env))
        log(
            f"  seed {seed}: "
            + ", ".join(f"{c} {sum(per_seed[c][-1]) / len(tasks):.3f}" for c in conditions)
            + f" ({time.perf_counter() - t0:.0f}s)"
        )
    means = {c: [sum(r) / len(r) for r in per_seed[c]] for c in conditions}
    per_task = {
        c: [sum(r[i] for r in per_seed[c]) / len(seeds) for i in range(len(tasks))]
        for c in conditions
    }
    out: dict[str, Any] = {}
    for c in conditions:
        m, se = _mean_se(means[c])
        out[c] = {"mean": m, "stderr_over_seeds": se, "per_seed": means[c]}
        if c != "bare":
            gain, se_seeds = _mean_se([a - b for a, b in zip(means[c], means["bare"])])
            _, se_tasks = _mean_se([a - b for a, b in zip(per_task[c], per_task["bare"])])
            out[c]["minus_bare"] = {
                "mean": gain,
                "stderr_paired_over_seeds": se_seeds,
                "stderr_paired_over_tasks": se_tasks,
            }
    return {
        "n_tasks": len(tasks),
        "seeds": list(seeds),
        "reference": "none: each format's template emptied (the null-context teacher)"
        if emptied
        else "a same-template train task's oracle trajectory, the same in every format",
        "conditions": out,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def format_formats_report(report: dict[str, Any]) -> str:
    """A markdown table of a :func:`probe_formats` report."""
    lines = [
        "| context | reward (mean ± stderr over seeds) | per seed | − bare (paired over seeds) "
        "| − bare (paired over tasks) |",
        "|---|---|---|---|---|",
    ]
    for c, r in report["conditions"].items():
        gain = r.get("minus_bare")
        cells = (
            [
                f"{gain['mean']:+.3f} ± {gain['stderr_paired_over_seeds']:.3f}",
                f"{gain['mean']:+.3f} ± {gain['stderr_paired_over_tasks']:.3f}",
            ]
            if gain
            else ["–", "–"]
        )
        per_seed = ", ".join(f"{x:.3f}" for x in r["per_seed"])
        lines.append(
            f"| {c} | {r['mean']:.3f} ± {r['stderr_over_seeds']:.3f} | {per_seed} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)
