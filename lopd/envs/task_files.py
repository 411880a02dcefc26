"""Every kind of task file ``--tasks`` reads, behind one function.

:func:`load_task_file` takes

* an ACEBench data directory or agent file (``data_agent_multi_step.json`` /
  ``data_agent_multi_turn.json`` with ``possible_answer/`` beside them):
  :mod:`lopd.envs.acebench.data`;
* EnvScaler's release, a directory holding its env-item and task-item files or one such file
  (a JSON array or object, or JSON lines of items): :mod:`lopd.envs.envscaler_release`;
* a lopd tasks JSONL (the native format, TACO and LiveCodeBench rows; tasks of every world,
  EnvScaler's and ACEBench's included): :func:`lopd.envs.loaders.load_tasks_jsonl`.

Items a release loader skips are issued as :class:`~lopd.envs.loaders.SkippedItemWarning`
lines; a load that fails raises :class:`~lopd.envs.loaders.TaskFormatError` (one line).
"""

from __future__ import annotations

import os
from pathlib import Path

from lopd.envs.acebench.data import is_acebench_path, load_acebench
from lopd.envs.acebench.spec import WORLD as ACEBENCH_WORLD
from lopd.envs.envscaler_release import is_release_file, load_envscaler
from lopd.envs.loaders import load_tasks_jsonl
from lopd.types import Task

__all__ = ["load_task_file", "missing_requirement"]


def load_task_file(path: str | os.PathLike[str]) -> list[Task]:
    """The tasks of a task file or release directory (module docstring).

    Raises:
        FileNotFoundError: no such path.
        TaskFormatError: a bad file or line (one line, naming it).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if is_acebench_path(p):
        return load_acebench(p).tasks
    if p.is_dir() or is_release_file(p):
        return load_envscaler(p).tasks
    return load_tasks_jsonl(p)


def missing_requirement(task: Task) -> str | None:
    """What a task needs to run that it does not name (``None``: it runs as it is).

    An ACEBench multi-turn task needs its simulated user's model (``spec["user_model"]``).
    """
    if (
        task.world == ACEBENCH_WORLD
        and task.spec.get("category") == "multi_turn"
        and not task.spec.get("user_model")
    ):
        return (
            f"task {task.task_id!r} is an ACEBench multi-turn task and names no user model: write "
            "the tasks with one (python -m lopd.evaluate --bench acebench --data DIR --user-model "
            "PATH --export-tasks FILE) or keep only multi-step tasks"
        )
    return None
