"""Task worlds with verifiers: tool-use worlds, the coding sandbox, JSONL loaders.

Entry points::

    from lopd.envs import builtin_tasks, make_env, oracle_actions

    tasks = builtin_tasks("tool_use", "train")        # 600 tasks over shop/insurance/logistics
    val = builtin_tasks("tool_use", "val")            # 120 tuning tasks; "test": 120 more
    env = make_env(tasks[0])
    first_user_message = env.reset(tasks[0])
    obs, done = env.step('<tool_call>\\n{"name": "find_customer", ...}\\n</tool_call>')
    r = env.reward()
"""

from __future__ import annotations

import random
from importlib import resources

from lopd.envs import worlds as _worlds  # noqa: F401  (registers the built-in worlds)
from lopd.envs.acebench.env import AceBenchEnv
from lopd.envs.acebench.env import oracle_actions as acebench_oracle_actions
from lopd.envs.acebench.spec import WORLD as ACEBENCH_WORLD
from lopd.envs.base import (
    CODING_SYSTEM_PROMPT,
    TASK_COMPLETED,
    TOOL_USE_SYSTEM_PROMPT,
    Env,
    ToolCall,
    ToolCallParseError,
    is_task_completed,
    parse_tool_calls,
    strip_thinking,
)
from lopd.envs.bfcl import BfclEnv
from lopd.envs.bfcl import oracle_actions as bfcl_oracle_actions
from lopd.envs.coding import CodingEnv, TestReport, coding_prompt, extract_code, run_tests
from lopd.envs.envscaler import EnvScalerEnv
from lopd.envs.envscaler import oracle_actions as envscaler_oracle_actions
from lopd.envs.envscaler_spec import WORLD as ENVSCALER_WORLD
from lopd.envs.humaneval import HumanEvalEnv
from lopd.envs.loaders import (
    TaskFormatError,
    from_livecodebench,
    from_taco,
    load_tasks_jsonl,
    save_tasks_jsonl,
    task_from_record,
)
from lopd.envs.sandbox import SandboxLimits, SandboxResult, run_python, run_sandboxed
from lopd.envs.task_files import load_task_file, missing_requirement
from lopd.envs.tool_use import (
    ToolError,
    ToolSpec,
    ToolUseEnv,
    World,
    evaluate_checks,
    format_tool_call,
    get_world,
    oracle_calls,
    register_world,
    run_actions,
    world_names,
)
from lopd.envs.tool_use_tasks import tool_use_tasks
from lopd.types import Task


def make_env(task: Task, max_steps: int | None = None) -> Env:
    """A fresh environment able to run ``task`` (call ``reset(task)`` on it).

    Args:
        task: the task; its ``domain`` picks the env class, and its ``world`` among the
            benchmark envs (``"bfcl"``: :class:`lopd.envs.bfcl.BfclEnv`, ``"envscaler"``:
            :class:`lopd.envs.envscaler.EnvScalerEnv`, ``"acebench"``:
            :class:`lopd.envs.acebench.env.AceBenchEnv`, ``"humaneval"``:
            :class:`lopd.envs.humaneval.HumanEvalEnv`).
        max_steps: override the tool-use step cap (default 30; ACEBench 20; BFCL: no cap beyond
            its per-turn limit; coding is always one turn).

    Raises:
        ValueError: unknown ``task.domain``.
    """
    if task.domain == "tool_use" and task.world == "bfcl":
        return BfclEnv(max_steps=max_steps)
    if task.domain == "tool_use" and task.world == ENVSCALER_WORLD:
        return EnvScalerEnv() if max_steps is None else EnvScalerEnv(max_steps=max_steps)
    if task.domain == "tool_use" and task.world == ACEBENCH_WORLD:
        return AceBenchEnv() if max_steps is None else AceBenchEnv(max_steps=max_steps)
    if task.domain == "tool_use":
        return ToolUseEnv() if max_steps is None else ToolUseEnv(max_steps=max_steps)
    if task.domain == "coding" and task.world == "humaneval":
        return HumanEvalEnv()
    if task.domain == "coding":
        return CodingEnv()
    raise ValueError(f"task {task.task_id}: unknown domain {task.domain!r}")


def builtin_tasks(
    domain: str = "tool_use", split: str = "train", n: int | None = None, seed: int = 0
) -> list[Task]:
    """The built-in task set of a domain.

    Tool use: 200 train / 40 val / 40 test tasks per world (600 / 120 / 120 in all),
    interleaved across worlds so any prefix mixes them; deterministic in ``seed``, the task-set
    seed: every seed is another task set (other databases and entity combinations) with the same
    guarantees. The splits draw their databases from disjoint seed classes (whatever the
    task-set seed) and never repeat an instruction of an earlier split (train, val, test).
    Every choice of the embedded default is tuned on ``val``; ``test`` is for reporting.
    ``python -m lopd.envs export --seed S --out tasks.jsonl`` writes a task set to a file.

    Coding: the 30 easy problems of ``lopd/assets/coding_tasks.jsonl`` (23 train / 7 test; stdin
    and function-call tests, each with a reference solution; no val split). ``seed`` shuffles
    their order.

    Args:
        domain: ``"tool_use"`` or ``"coding"``.
        split: ``"train"``, ``"val"`` (tool use only) or ``"test"``.
        n: keep the first ``n`` tasks (all if None).
        seed: task-set seed.

    Raises:
        ValueError: unknown domain or split, or negative ``n``.
    """
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if domain == "tool_use":
        return tool_use_tasks(split, n, seed)
    if domain == "coding":
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test' for coding, got {split!r}")
        with resources.as_file(resources.files("lopd") / "assets" / "coding_tasks.jsonl") as p:
            tasks = [t for t in load_tasks_jsonl(p) if t.split == split]
        if seed:
            random.Random(seed).shuffle(tasks)
        return tasks if n is None else tasks[:n]
    raise ValueError(f"unknown domain {domain!r}; expected 'tool_use' or 'coding'")


def oracle_actions(task: Task) -> list[str]:
    """A correct sequence of assistant turns (model text) that earns reward 1.0.

    Tool use: one Qwen3 ``<tool_call>`` turn per oracle call, then ``Task Completed``; BFCL:
    the ground truth of each user turn as parallel calls, then ``Task Completed``; EnvScaler:
    ``spec["oracle"]`` (its release has none); ACEBench: ``spec["oracle"]`` or its milestones.
    Coding: one turn with the reference solution (``spec["solution"]``) in a python fence.

    Raises:
        ValueError: the task carries no oracle / reference solution.
    """
    if task.domain == "tool_use" and task.world == "bfcl":
        return bfcl_oracle_actions(task)
    if task.domain == "tool_use" and task.world == ENVSCALER_WORLD:
        return envscaler_oracle_actions(task)
    if task.domain == "tool_use" and task.world == ACEBENCH_WORLD:
        return acebench_oracle_actions(task)
    if task.domain == "tool_use":
        return [format_tool_call(c) for c in oracle_calls(task)] + [TASK_COMPLETED]
    if task.domain == "coding":
        solution = task.spec.get("solution")
        if not solution:
            raise ValueError(f"task {task.task_id} has no reference 'solution' in its spec")
        return [f"```python\n{solution.rstrip()}\n```"]
    raise ValueError(f"task {task.task_id}: unknown domain {task.domain!r}")


__all__ = [
    "CODING_SYSTEM_PROMPT",
    "TASK_COMPLETED",
    "TOOL_USE_SYSTEM_PROMPT",
    "AceBenchEnv",
    "CodingEnv",
    "Env",
    "EnvScalerEnv",
    "SandboxLimits",
    "SandboxResult",
    "TaskFormatError",
    "TestReport",
    "ToolCall",
    "ToolCallParseError",
    "ToolError",
    "ToolSpec",
    "ToolUseEnv",
    "World",
    "builtin_tasks",
    "coding_prompt",
    "evaluate_checks",
    "extract_code",
    "format_tool_call",
    "from_livecodebench",
    "from_taco",
    "get_world",
    "is_task_completed",
    "load_task_file",
    "load_tasks_jsonl",
    "make_env",
    "missing_requirement",
    "oracle_actions",
    "parse_tool_calls",
    "register_world",
    "run_actions",
    "run_python",
    "run_sandboxed",
    "run_tests",
    "save_tasks_jsonl",
    "strip_thinking",
    "task_from_record",
    "world_names",
]
