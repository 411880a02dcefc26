"""Benchmark evaluation of one model: BFCL v3, EnvScaler, ACEBench, HumanEval, the built-in worlds.

The benchmarks, their scores and the generation settings are described in :mod:`lopd.evaluate`
(the ``python -m lopd.evaluate`` command that runs them). :func:`load_bench` gives a benchmark's
tasks per category, :func:`evaluate_tasks` scores one model on them (one rollout per task),
:func:`render_markdown` renders the tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lopd.envs import builtin_tasks, load_task_file, make_env
from lopd.envs.acebench.data import acebench_tasks, find_agent_files
from lopd.envs.acebench.env import MAX_STEPS as ACEBENCH_STEPS
from lopd.envs.acebench.spec import CATEGORIES as ACEBENCH_CATEGORIES
from lopd.envs.bfcl import CATEGORIES, bfcl_tasks
from lopd.envs.envscaler_spec import WORLD as ENVSCALER_WORLD
from lopd.envs.humaneval import humaneval_tasks
from lopd.eval.summary import BEHAVIOUR_METRICS, summarize
from lopd.rollout.chat import render_prompt
from lopd.rollout.multi_turn import rollout

__all__ = [
    "BENCHES",
    "BENCH_STEPS",
    "CODE_BUDGET",
    "MAX_STEPS",
    "TOOL_BUDGET",
    "BenchSource",
    "bench_metrics",
    "evaluate_tasks",
    "load_bench",
    "overall_score",
    "render_markdown",
]

BENCHES = ("bfcl-multi-turn", "envscaler", "acebench", "humaneval", "builtin")
TOOL_BUDGET, CODE_BUDGET, MAX_STEPS = 40_960, 16_384, 30
"""Paper Table 5: tokens per episode for tool use and for coding, and interaction steps."""
BENCH_STEPS = {"acebench": ACEBENCH_STEPS}
"""Interaction steps of the benchmarks that differ from :data:`MAX_STEPS` (Table 5)."""


@dataclass(frozen=True)
class BenchSource:
    """Where a benchmark's tasks come from, for the benchmarks whose data the user brings.

    Attributes:
        tasks: EnvScaler: its release directory, a release file or a lopd tasks JSONL.
        data: ACEBench: its data directory (``data_all/data_en``).
        user_model: ACEBench multi-turn: the simulated user's local checkpoint.
        user_device: where the simulated user runs.
    """

    tasks: str | None = None
    data: str | None = None
    user_model: str | None = None
    user_device: str = "cpu"


def load_bench(
    bench: str,
    n: int | None = None,
    split: str = "all",
    categories: Sequence[str] | None = None,
    source: BenchSource | None = None,
) -> dict[str, list[Any]]:
    """The benchmark's tasks per category (``n``: the first ``n`` of each category).

    Raises:
        ValueError: unknown benchmark, category or split, or data missing (one line).
    """
    source = source or BenchSource()
    if bench == "bfcl-multi-turn":
        cats = list(categories or CATEGORIES)
        return {c: bfcl_tasks([c], split=split, n=n) for c in cats}
    if categories:
        raise ValueError(f"--categories applies to bfcl-multi-turn only, not {bench!r}")
    if bench == "envscaler":
        return {"envscaler": _envscaler_tasks(source, split, n)}
    if bench == "acebench":
        return _acebench_categories(source, split, n)
    if bench == "humaneval":
        if split == "train":
            raise ValueError("HumanEval has no train split")

        return {"humaneval": humaneval_tasks(n)}
    if bench == "builtin":
        if split == "all":
            split = "test"
        tasks = builtin_tasks("tool_use", split)
        out: dict[str, list[Any]] = {}
        for t in tasks:
            out.setdefault(t.world, []).append(t)
        return {w: ts if n is None else ts[:n] for w, ts in out.items()}
    raise ValueError(f"unknown benchmark {bench!r}; expected one of {BENCHES}")


def _envscaler_tasks(source: BenchSource, split: str, n: int | None) -> list[Any]:
    if source.tasks is None:
        raise ValueError(
            "--bench envscaler needs --tasks: EnvScaler's release directory (its env items and "
            "task items) or a lopd tasks JSONL (docs/evaluation.md says where to get them)"
        )
    if split not in ("all", "train", "test"):
        raise ValueError(f"--split {split} is not an EnvScaler split (train, test)")
    tasks = [t for t in load_task_file(source.tasks) if t.world == ENVSCALER_WORLD]
    if not tasks:
        raise ValueError(f"--tasks {source.tasks}: no EnvScaler task in it")
    want = "test" if split == "all" else split
    tasks = [t for t in tasks if t.split == want]
    if not tasks:
        raise ValueError(f"--tasks {source.tasks}: no EnvScaler task of split {want!r}")
    return tasks if n is None else tasks[:n]


def _acebench_categories(source: BenchSource, split: str, n: int | None) -> dict[str, list[Any]]:
    if source.data is None:
        raise ValueError(
            "--bench acebench needs --data: ACEBench's data directory (data_all/data_en of its "
            "repository, docs/evaluation.md)"
        )
    if split not in ("all", *ACEBENCH_CATEGORIES):
        raise ValueError(f"--split {split} is not an ACEBench category {ACEBENCH_CATEGORIES}")
    if split == "multi_turn" and source.user_model is None:
        raise ValueError(
            "--split multi_turn needs --user-model PATH: a local chat model plays ACEBench's user"
        )
    found = find_agent_files(source.data)
    cats = list(ACEBENCH_CATEGORIES) if split == "all" else [split]
    if source.user_model is None:
        cats = [c for c in cats if c != "multi_turn"]
    missing = [c for c in cats if c not in found]
    if missing:
        raise ValueError(f"--data {source.data}: no data_agent_{missing[0]}.json")
    return {
        c: acebench_tasks(source.data, c, n, source.user_model, source.user_device) for c in cats
    }


def bench_metrics(bench: str, result: dict[str, Any]) -> None:
    """A benchmark's own score in ``result["metrics"]`` (in place).

    EnvScaler: 100 x the mean reward (checks held / checks; the paper's EnvScaler figure).
    ACEBench: 100 x the end-to-end accuracy (``score``) and 100 x the process accuracy
    (``process_score``). Others keep :func:`evaluate_tasks`'s success-rate score.
    """
    m, records = result["metrics"], result["episodes"]
    if bench == "envscaler":
        m["score"] = 100.0 * m["reward_mean"]
    elif bench == "acebench":
        n = len(records)
        m["process_accuracy"] = sum(r.get("process", 0.0) for r in records) / n if n else 0.0
        m["process_score"] = 100.0 * m["process_accuracy"]


def overall_score(bench: str, categories: dict[str, Any]) -> float:
    """The benchmark's aggregate: ACEBench weighs its categories by task count (the paper's
    60.6 = 0.4 x 56.6 + 0.6 x 63.3), the others take the mean of the category scores."""
    cats = list(categories.values())
    if bench == "acebench":
        n = sum(c["metrics"]["n"] for c in cats)
        return sum(c["metrics"]["score"] * c["metrics"]["n"] for c in cats) / n if n else 0.0
    return sum(c["metrics"]["score"] for c in cats) / len(cats)


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
        if hasattr(env, "episode_record") and "env_error" not in traj.info:
            rec.update(env.episode_record())
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
        how = "task-weighted" if s["bench"] == "acebench" else "mean of categories"
        lines.append(f"| **overall** ({how}) | | **{results['overall']:.2f}** | | |")
    if any("process_score" in c["metrics"] for c in cats.values()):
        lines += ["", "| category | end-to-end accuracy | process accuracy |", "|---|---|---|"]
        for name, c in cats.items():
            m = c["metrics"]
            lines.append(f"| {name} | {m['score']:.2f} | {m['process_score']:.2f} |")
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
