"""Benchmark evaluation of one model: ``python -m lopd.evaluate --model PATH --bench NAME``.

Benchmarks (``--bench``):

* ``bfcl-multi-turn``: BFCL v3 multi-turn, the four categories base / miss_func / miss_param /
  long_context (200 entries each, :mod:`lopd.envs.bfcl`). Score per category = 100 x the
  fraction of entries BFCL's checker accepts; ``overall`` = their mean (the paper's BFCL-v3).
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
``skipped_prompt_too_long``.

``--export-tasks FILE`` writes the benchmark's tasks as a lopd tasks JSONL (no model needed):
BFCL entries carry their train/test label (disjoint by scenario, :mod:`lopd.envs.bfcl_data`),
so ``python -m lopd.train --tasks FILE`` trains on the train split and evaluates on the test
split; HumanEval tasks are all ``test``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lopd.atomic import atomic_write_text
from lopd.envs import save_tasks_jsonl
from lopd.eval.benchmark import (
    BENCHES,
    CODE_BUDGET,
    MAX_STEPS,
    TOOL_BUDGET,
    evaluate_tasks,
    load_bench,
    render_markdown,
)
from lopd.models.loading import load_model
from lopd.rollout.multi_turn import GenerationConfig

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lopd.evaluate",
        description="Evaluate a model on BFCL v3 multi-turn, HumanEval or the built-in worlds.",
    )
    p.add_argument("--bench", required=True, choices=BENCHES)
    p.add_argument(
        "--model", default=None, help="local HF checkpoint directory (default: the tiny model)"
    )
    p.add_argument("--n", type=int, default=None, help="first N tasks of each category")
    p.add_argument("--split", default="all", choices=("all", "train", "test"))
    p.add_argument("--categories", nargs="+", default=None, help="BFCL categories to run")
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<bench>)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
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


def main(argv: Sequence[str] | None = None, *, log: Callable[[str], None] | None = None) -> int:
    args = parse_args(argv)
    say = log or (lambda msg: print(f"[lopd.evaluate] {msg}", flush=True))
    try:
        cats = load_bench(args.bench, args.n, args.split, args.categories)
    except (ValueError, ImportError, RuntimeError) as err:
        print(f"lopd.evaluate: {err}", file=sys.stderr)
        return 2
    if args.export_tasks is not None:
        tasks = [t for ts in cats.values() for t in ts]
        save_tasks_jsonl(tasks, args.export_tasks)
        by_split: dict[str, int] = {}
        for t in tasks:
            by_split[t.split] = by_split.get(t.split, 0) + 1
        say(f"wrote {len(tasks)} tasks to {args.export_tasks} ({by_split})")
        return 0

    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _evaluate(args, cats, say)
    finally:
        torch.set_num_threads(threads)  # a library caller's thread count is left as it was


def _evaluate(
    args: argparse.Namespace, cats: dict[str, list[Any]], say: Callable[[str], None]
) -> int:
    try:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"lopd.evaluate: --model: {err}", file=sys.stderr)
        return 2
    coding = args.bench == "humaneval"
    budget = args.max_total_tokens or (CODE_BUDGET if coding else TOOL_BUDGET)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and budget > limit:
        say(f"budget {budget} tokens cut to the model's max_position_embeddings ({limit})")
        budget = limit
    steps = args.max_steps or (1 if coding else MAX_STEPS)
    try:
        gen = GenerationConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens_per_turn=min(args.max_new_tokens or budget, budget),
            max_total_tokens=budget,
            max_steps=steps,
            enable_thinking=args.thinking,
        )
    except ValueError as err:
        print(f"lopd.evaluate: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / "eval" / args.bench)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "settings": {
            "bench": args.bench,
            "model": args.model or "tiny (lopd/assets/tiny-qwen3)",
            "split": "test" if args.bench == "builtin" and args.split == "all" else args.split,
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
        results["categories"][name] = res
        say(f"{name}: score {res['metrics']['score']:.2f}")
    scores = [c["metrics"]["score"] for c in results["categories"].values()]
    if len(scores) > 1:
        results["overall"] = sum(scores) / len(scores)
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
