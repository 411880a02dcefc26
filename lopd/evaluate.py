"""Benchmark evaluation of one model: ``python -m lopd.evaluate --model PATH --bench NAME``.

Benchmarks (``--bench``):

* ``bfcl-multi-turn``: BFCL v3 multi-turn, the four categories base / miss_func / miss_param /
  long_context (200 entries each, :mod:`lopd.envs.bfcl`). Score per category = 100 x the
  fraction of entries BFCL's checker accepts; ``overall`` = their mean (the paper's BFCL-v3).
* ``envscaler``: EnvScaler's held-out tasks (:mod:`lopd.envs.envscaler`; ``--tasks`` names its
  release directory or a tasks JSONL; the test split unless ``--split train``). Score = 100 x the
  mean reward (checks held / checks), the paper's EnvScaler figure; the class code and the checks
  run in the sandbox only.
* ``acebench``: ACEBench's agent tasks (:mod:`lopd.envs.acebench`; ``--data`` names its
  ``data_all/data_en``), categories ``multi_step`` (20) and ``multi_turn`` (30; ``--split``
  picks one). Score = 100 x ACEBench's end-to-end accuracy, with its process accuracy beside it;
  ``overall`` weighs the categories by task count. Multi-turn needs ``--user-model PATH`` (a local
  chat model plays ACEBench's user, :mod:`lopd.envs.acebench.user`): ``--split multi_turn``
  without one is refused, and without ``--split`` only multi-step runs. At most 20 steps.
* ``humaneval``: the 164 HumanEval tasks (:mod:`lopd.envs.humaneval`), pass@1 = 100 x the
  fraction solved with one sample per task.
* ``builtin``: the built-in tool-use worlds' held-out split (120 tasks, 40 per world); score per
  world = 100 x success rate.

Per category the results also hold the mean reward (BFCL: fraction of turns passed) and the
paper's Table 3 behaviour metrics (:func:`lopd.eval.summary.summarize`: interaction steps, tool
calls per step, repeated tool calls, first-step length in tokens) plus reward per tool call (total
reward / total tool calls). ``--out`` receives ``results.json`` (settings, metrics, one record per
episode) and ``results.md`` (the tables); the tables are also printed.

Generation follows the paper's Table 5 unless overridden: temperature 0.7, top-p 0.95, top-k 20,
thinking on (Qwen3's switch; the tiny model's template ignores it), a token budget of 40,960
(tool use) / 16,384 (coding) per episode and 30 steps. The budget is cut to the model's
``max_position_embeddings``; a task whose prompt alone does not fit scores 0 and is counted in
``skipped_prompt_too_long``. Without ``--model`` (the shipped tiny model, a plumbing check) the
budgets are the ones that model is trained and evaluated with by ``python -m lopd.train``
(:data:`TINY_TURN_TOKENS` per turn, :data:`TINY_EPISODE_TOKENS` per episode, :data:`TINY_STEPS`
steps): its turns are short tool calls, and given a paper budget it writes degenerate text to the
end of its 4,096-token context at every step (8 BFCL episodes took 10 minutes on 2 cores).
``--max-new-tokens``, ``--max-total-tokens`` and ``--max-steps`` override either set.

``--export-tasks FILE`` writes the benchmark's tasks as a lopd tasks JSONL (no model needed):
BFCL entries carry their train/test label (disjoint by scenario, :mod:`lopd.envs.bfcl_data`),
so ``python -m lopd.train --tasks FILE`` trains on the train split and evaluates on the test
split; HumanEval tasks are all ``test``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lopd.atomic import atomic_write_text
from lopd.config import PRESETS
from lopd.config.checks import checkpoint_dir_problem
from lopd.envs import save_tasks_jsonl
from lopd.envs.loaders import SkippedItemWarning
from lopd.eval.benchmark import (
    BENCH_STEPS,
    BENCHES,
    CODE_BUDGET,
    MAX_STEPS,
    TOOL_BUDGET,
    BenchSource,
    bench_metrics,
    evaluate_tasks,
    load_bench,
    overall_score,
    render_markdown,
)
from lopd.models.loading import load_model
from lopd.rollout.multi_turn import GenerationConfig

__all__ = ["TINY_EPISODE_TOKENS", "TINY_STEPS", "TINY_TURN_TOKENS", "main", "parse_args"]

_TINY_GEN = PRESETS["default"]().gen
TINY_TURN_TOKENS: int = _TINY_GEN.max_new_tokens
"""Tokens per assistant turn for the shipped tiny model (the default preset's ``gen``)."""
TINY_EPISODE_TOKENS: int = _TINY_GEN.max_total_tokens
"""Tokens per episode (prompt, turns, observations) for the shipped tiny model."""
TINY_STEPS: int = _TINY_GEN.max_steps
"""Assistant turns per episode for the shipped tiny model."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lopd.evaluate",
        description="Evaluate a model on BFCL v3 multi-turn, EnvScaler, ACEBench, HumanEval or the "
        "built-in worlds.",
    )
    p.add_argument("--bench", required=True, choices=BENCHES)
    p.add_argument(
        "--model", default=None, help="local HF checkpoint directory (default: the tiny model)"
    )
    p.add_argument("--n", type=int, default=None, help="first N tasks of each category")
    p.add_argument(
        "--split",
        default="all",
        choices=("all", "train", "test", "multi_step", "multi_turn"),
        help="train/test (BFCL, EnvScaler, builtin), multi_step/multi_turn (ACEBench)",
    )
    p.add_argument("--tasks", default=None, help="EnvScaler: release directory or tasks JSONL")
    p.add_argument("--data", default=None, help="ACEBench: its data directory (data_all/data_en)")
    p.add_argument(
        "--user-model", default=None, help="ACEBench multi-turn: local chat model playing the user"
    )
    p.add_argument(
        "--user-device", default=None, help="where the user model runs (default: --device)"
    )
    p.add_argument("--categories", nargs="+", default=None, help="BFCL categories to run")
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<bench>)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 with --device cpu, as the trainer: intra-op threads "
        "gain small models little and spin-wait on a busy CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None, help="per assistant turn")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument(
        "--thinking", action=argparse.BooleanOptionalAction, default=True, help="Qwen3 thinking"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--export-tasks", default=None, metavar="FILE", help="write the tasks JSONL and exit"
    )
    args = p.parse_args(argv)
    if args.n is not None and args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def _first_non_directory(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` (or ``path`` itself) when it is not a
    directory: nothing can be created under it."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _check_export_path(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"--export-tasks {path} is a directory; give a file path (tasks.jsonl)")
    if path.exists() and not path.is_file():
        raise ValueError(f"--export-tasks {path} exists and is not a regular file")
    blocker = _first_non_directory(path.parent)
    if blocker is not None:
        raise ValueError(f"--export-tasks {path}: {blocker} is a file, not a directory")


def _check_out_dir(out: Path) -> None:
    """``--out`` before the run, so an evaluation is never lost at its final write."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {out} is a file; give a directory (the results go to results.json and "
            "results.md inside it)"
        )
    blocker = _first_non_directory(out)
    if blocker is not None:
        raise ValueError(f"--out {out}: {blocker} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out} cannot be created ({err.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable")


def _check_args(args: argparse.Namespace) -> None:
    """Every argument problem as one ``ValueError`` line, before anything is loaded."""
    for flag, value, bench in (
        ("--tasks", args.tasks, "envscaler"),
        ("--data", args.data, "acebench"),
        ("--user-model", args.user_model, "acebench"),
    ):
        if value is not None and args.bench != bench:
            raise ValueError(f"{flag} applies to --bench {bench} only, not {args.bench}")
    if args.user_model is not None:
        problem = checkpoint_dir_problem(args.user_model)
        if problem is not None:
            raise ValueError(f"--user-model {args.user_model} {problem}")
    if args.export_tasks is not None:
        _check_export_path(Path(args.export_tasks))
        return
    for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    for flag, value, low in (
        ("--top-k", args.top_k, 0),
        ("--max-total-tokens", args.max_total_tokens, 2),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--max-steps", args.max_steps, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.model is not None:
        problem = checkpoint_dir_problem(args.model)
        if problem is not None:
            raise ValueError(f"--model {args.model} {problem}")
    _check_out_dir(_out_dir(args))


def _split_label(args: argparse.Namespace) -> str:
    """The split the results are of, as the run chose it."""
    if args.split == "all" and args.bench in ("builtin", "envscaler"):
        return "test"
    if args.split == "all" and args.bench == "acebench":
        return "multi_step + multi_turn" if args.user_model else "multi_step"
    return args.split


def _out_dir(args: argparse.Namespace) -> Path:
    return Path(args.out or Path("runs") / "eval" / args.bench)


def main(argv: Sequence[str] | None = None, *, log: Callable[[str], None] | None = None) -> int:
    args = parse_args(argv)
    say = log or (lambda msg: print(f"[lopd.evaluate] {msg}", flush=True))
    source = BenchSource(
        tasks=args.tasks,
        data=args.data,
        user_model=args.user_model,
        user_device=args.user_device or args.device,
    )
    try:
        _check_args(args)
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always", SkippedItemWarning)
            cats = load_bench(args.bench, args.n, args.split, args.categories, source)
        for w in skipped:
            if issubclass(w.category, SkippedItemWarning):
                say(str(w.message))
    except (ValueError, ImportError, RuntimeError, OSError) as err:
        print(f"lopd.evaluate: {err}", file=sys.stderr)
        return 2
    if args.bench == "acebench" and args.split == "all" and args.user_model is None:
        say("multi_turn left out: it needs --user-model PATH (a local chat model plays the user)")
    if args.export_tasks is not None:
        tasks = [t for ts in cats.values() for t in ts]
        save_tasks_jsonl(tasks, args.export_tasks)
        by_split: dict[str, int] = {}
        for t in tasks:
            by_split[t.split] = by_split.get(t.split, 0) + 1
        say(f"wrote {len(tasks)} tasks to {args.export_tasks} ({by_split})")
        return 0

    threads = torch.get_num_threads()
    # One thread on CPU unless asked: measured on a loaded 2-core machine, the quick start's
    # BFCL "base" category took 10 s of evaluation with 1 thread and 88 s with 2.
    want = args.threads if args.threads is not None else (1 if args.device == "cpu" else None)
    if want is not None:
        torch.set_num_threads(want)
    try:
        return _evaluate(args, cats, say)
    finally:
        torch.set_num_threads(threads)  # a library caller's thread count is left as it was


def _evaluate(
    args: argparse.Namespace, cats: dict[str, list[Any]], say: Callable[[str], None]
) -> int:
    try:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    except (OSError, ValueError) as err:  # a checkpoint that passed the checks but still fails
        print(f"lopd.evaluate: --model: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    coding = args.bench == "humaneval"
    if args.model is None:  # the tiny model: the budgets it is built for (module docstring)
        turn, total, most_steps = TINY_TURN_TOKENS, TINY_EPISODE_TOKENS, TINY_STEPS
        say(
            f"the shipped tiny model: {turn} tokens per turn, {total} per episode, "
            f"{most_steps} steps (its own budgets; --max-new-tokens, --max-total-tokens, "
            "--max-steps override)"
        )
    else:
        turn, total = None, CODE_BUDGET if coding else TOOL_BUDGET
        most_steps = BENCH_STEPS.get(args.bench, MAX_STEPS)
    budget = args.max_total_tokens or total
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and budget > limit:
        say(f"budget {budget} tokens cut to the model's max_position_embeddings ({limit})")
        budget = limit
    steps = args.max_steps or (1 if coding else most_steps)
    try:
        gen = GenerationConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens_per_turn=min(args.max_new_tokens or turn or budget, budget),
            max_total_tokens=budget,
            max_steps=steps,
            enable_thinking=args.thinking,
        )
    except ValueError as err:
        print(f"lopd.evaluate: {err}", file=sys.stderr)
        return 2
    out = _out_dir(args)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "settings": {
            "bench": args.bench,
            "model": args.model or "tiny (lopd/assets/tiny-qwen3)",
            "split": _split_label(args),
            "n_per_category": args.n,
            "seed": args.seed,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
            "max_total_tokens": gen.max_total_tokens,
            "max_new_tokens_per_turn": gen.max_new_tokens_per_turn,
            "max_steps": gen.max_steps,
            "enable_thinking": gen.enable_thinking,
            "batch_size": args.batch_size,
            "threads": torch.get_num_threads(),
        },
        "categories": {},
    }
    for k, (name, tasks) in enumerate(cats.items()):
        say(f"{name}: {len(tasks)} tasks")
        res = evaluate_tasks(
            model,
            tokenizer,
            tasks,
            gen,
            seed=args.seed * 1000 + k,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
        bench_metrics(args.bench, res)
        results["categories"][name] = res
        say(f"{name}: score {res['metrics']['score']:.2f}")
    if len(results["categories"]) > 1:
        results["overall"] = overall_score(args.bench, results["categories"])
    results["seconds"] = time.perf_counter() - t0
    table = render_markdown(results)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    atomic_write_text(out / "results.md", table)
    print(table, flush=True)
    say(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
