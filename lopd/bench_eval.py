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
paper's Table 3 behaviour metrics (:func:`lopd.evaluate.summarize`: interaction steps, tool calls
per step, repeated tool calls, first-step length in tokens) plus reward per tool call (total
reward / total tool calls). ``--out`` receives ``results.json`` (settings, metrics, one record
per episode) and ``results.md`` (the tables); the tables are also printed.

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
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BENCHES", "evaluate_tasks", "load_bench", "main", "render_markdown"]

BENCHES = ("bfcl-multi-turn", "humaneval", "builtin")
_TOOL_BUDGET, _CODE_BUDGET, _MAX_STEPS = 40_960, 16_384, 30


def load_bench(
    bench: str, n: int | None = None, split: str = "all", categories: Sequence[str] | None = None
) -> dict[str, list[Any]]:
    """The benchmark's tasks per category (``n``: the first ``n`` of each category).

    Raises:
        ValueError: unknown benchmark, category or split.
    """
    if bench == "bfcl-multi-turn":
        from lopd.envs.bfcl import CATEGORIES, bfcl_tasks

        cats = list(categories or CATEGORIES)
        return {c: bfcl_tasks([c], split=split, n=n) for c in cats}
    if categories:
        raise ValueError(f"--categories applies to bfcl-multi-turn only, not {bench!r}")
    if bench == "humaneval":
        if split == "train":
            raise ValueError("HumanEval has no train split")
        from lopd.envs.humaneval import humaneval_tasks

        return {"humaneval": humaneval_tasks(n)}
    if bench == "builtin":
        from lopd.envs import builtin_tasks

        if split == "all":
            split = "test"
        tasks = builtin_tasks("tool_use", split)
        out: dict[str, list[Any]] = {}
        for t in tasks:
            out.setdefault(t.world, []).append(t)
        return {w: ts if n is None else ts[:n] for w, ts in out.items()}
    raise ValueError(f"unknown benchmark {bench!r}; expected one of {BENCHES}")


def _success(env: Any) -> bool:
    success = getattr(env, "success", None)
    return bool(success) if success is not None else env.reward() >= 1.0 - 1e-9


def evaluate_tasks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Any],
    gen: Any,
    *,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, Any]:
    """Roll ``model`` out once on every task and score it.

    Returns:
        ``{"metrics": {...}, "episodes": [...]}``: ``score`` (100 x success rate over all tasks),
        ``success_rate``, ``reward_mean``, the Table-3 metrics of the episodes that ran,
        ``reward_per_tool_call``, ``skipped_prompt_too_long``; one record per task.
    """
    from lopd.chat import render_prompt
    from lopd.envs import make_env
    from lopd.evaluate import BEHAVIOUR_METRICS, summarize
    from lopd.rollout import rollout

    envs: dict[str, Any] = {}

    def factory(task: Any) -> Any:
        env = make_env(task)
        envs[task.task_id] = env
        return env

    runnable, episodes = [], {}
    for task in tasks:
        env = make_env(task)
        user = env.reset(task)
        ids = render_prompt(
            tokenizer, env.system_prompt(), user, env.tools(), enable_thinking=gen.enable_thinking
        )
        if len(ids) + 2 > gen.max_total_tokens:
            episodes[task.task_id] = {
                "task_id": task.task_id,
                "reward": 0.0,
                "success": False,
                "stop_reason": "prompt_too_long",
                "prompt_tokens": len(ids),
            }
        else:
            runnable.append(task)
    trajs = rollout(
        model,
        tokenizer,
        runnable,
        gen,
        seed=seed,
        progress=progress,
        batch_size=batch_size,
        make_env=factory,
    )
    for traj in trajs:
        env = envs[traj.task.task_id]
        rec = {
            "task_id": traj.task.task_id,
            "reward": traj.reward,
            "success": False if "env_error" in traj.info else _success(env),
            "stop_reason": traj.info.get("stop_reason"),
            "steps": traj.num_steps,
            "tool_calls": traj.num_tool_calls,
            "repeated_tool_calls": traj.info.get("repeated_tool_calls", 0),
            "generated_tokens": traj.info.get("generated_tokens", 0),
        }
        if "env_error" in traj.info:
            rec["env_error"] = traj.info["env_error"]
        if hasattr(env, "verdicts") and "env_error" not in traj.info:
            rec["turns_passed"] = env.verdicts()
            rec["turn_errors"] = list(env.turn_errors)
        if getattr(env, "report", None) is not None:
            rec["tests"] = env.report.message
        episodes[traj.task.task_id] = rec
    records = [episodes[t.task_id] for t in tasks]
    n = len(records)
    metrics: dict[str, Any] = {
        "n": n,
        "score": 100.0 * sum(r["success"] for r in records) / n if n else 0.0,
        "success_rate": sum(r["success"] for r in records) / n if n else 0.0,
        "reward_mean": sum(r["reward"] for r in records) / n if n else 0.0,
        "skipped_prompt_too_long": n - len(trajs),
    }
    if trajs:
        table3 = summarize(trajs)
        for key in BEHAVIOUR_METRICS:
            metrics[key] = table3[key]
        calls = sum(t.num_tool_calls for t in trajs)
        metrics["reward_per_tool_call"] = sum(t.reward for t in trajs) / calls if calls else 0.0
    return {"metrics": metrics, "episodes": records}


def render_markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (scores in the paper's 0-100 style, then behaviour)."""
    s = results["settings"]
    cats = results["categories"]
    lines = [
        f"# {s['bench']}: {s['model']}",
        "",
        f"{s['split']} split, {sum(c['metrics']['n'] for c in cats.values())} tasks, "
        f"temperature {s['temperature']}, budget {s['max_total_tokens']} tokens, "
        f"{s['max_steps']} steps, thinking {'on' if s['enable_thinking'] else 'off'}, "
        f"seed {s['seed']}, {results['seconds']:.0f} s",
        "",
        "| category | n | score (0-100) | mean reward | skipped (prompt too long) |",
        "|---|---|---|---|---|",
    ]
    for name, c in cats.items():
        m = c["metrics"]
        lines.append(
            f"| {name} | {m['n']} | {m['score']:.2f} | {m['reward_mean']:.3f} | "
            f"{m['skipped_prompt_too_long']} |"
        )
    if "overall" in results:
        lines.append(f"| **overall** (mean of categories) | | **{results['overall']:.2f}** | | |")
    lines += [
        "",
        "Behaviour (paper Table 3; means over the episodes that ran):",
        "",
        "| category | steps | tool calls / step | repeated calls | first-step tokens | "
        "reward / tool call |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in cats.items():
        m = c["metrics"]
        if "steps" not in m:
            lines.append(f"| {name} | - | - | - | - | - |")
            continue
        lines.append(
            f"| {name} | {m['steps']:.2f} | {m['tool_calls_per_step']:.2f} | "
            f"{m['repeated_tool_calls']:.2f} | {m['first_step_tokens']:.1f} | "
            f"{m['reward_per_tool_call']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        from lopd.envs import save_tasks_jsonl

        tasks = [t for ts in cats.values() for t in ts]
        save_tasks_jsonl(tasks, args.export_tasks)
        by_split: dict[str, int] = {}
        for t in tasks:
            by_split[t.split] = by_split.get(t.split, 0) + 1
        say(f"wrote {len(tasks)} tasks to {args.export_tasks} ({by_split})")
        return 0

    import torch

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
    import torch

    from lopd.models import load_model
    from lopd.rollout import GenerationConfig

    try:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"lopd.evaluate: --model: {err}", file=sys.stderr)
        return 2
    coding = args.bench == "humaneval"
    budget = args.max_total_tokens or (_CODE_BUDGET if coding else _TOOL_BUDGET)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and budget > limit:
        say(f"budget {budget} tokens cut to the model's max_position_embeddings ({limit})")
        budget = limit
    steps = args.max_steps or (1 if coding else _MAX_STEPS)
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
    _write_atomic(out / "results.json", json.dumps(results, indent=1))
    _write_atomic(out / "results.md", table)
    print(table, flush=True)
    say(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0
