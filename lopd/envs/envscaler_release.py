"""EnvScaler's released data as tasks: its env items, its task items, the split.

EnvScaler (Song et al., 2026) releases environments and scenarios as JSON:

* **env items** (``191_env_metadata.json``; the ``EnvScaler-191-Env`` dataset): a JSON object
  ``{env_id: item}`` (as in EnvScaler's repository), a JSON array of items or JSON lines, each
  item with ``env_id``, ``env_class_name``, ``env_class_code`` (the source of a Python class:
  public methods are the tools, attributes the state), ``tools`` (OpenAI function schemas, a
  list or the JSON text of one), ``environment_introduction`` and ``constraints_rules``;
* **task items** (``rl_scenario_metadata.json``; ``EnvScaler-RL-Scenario``): a JSON array or
  JSON lines, each with ``task_id``, ``env_id``, ``env_class_name``, ``init_config`` (an object,
  or the JSON text of one), ``task`` (the instruction) and ``checklist_with_func`` (``[{
  "check_item": text, "check_func": "def check_func(final_state): ..."}]``; a check reads the
  global ``initial_state`` and returns a bool).

:func:`load_envscaler` reads a directory holding both kinds of file (or the files themselves) as
released; each task becomes a :class:`~lopd.types.Task` of world ``"envscaler"`` whose spec holds
the task's fields and its environment's (:mod:`lopd.envs.envscaler_spec`), so a task line of a
lopd tasks JSONL is self-contained. Nothing in the code is run here: it is parsed only (syntax,
the class, ``check_func``); it runs in the sandbox (:mod:`lopd.envs.envscaler`).

Bad input is one line naming the file and the item. A broken **item** is skipped with a
:class:`SkippedItemWarning` that ends in "item skipped" (code with a syntax error, a class name
the code does not define, an ``env_id`` with no environment, a check without ``check_func``,
missing or ill-typed fields, an item over a size limit); EnvScaler's SFT scenario files, which
have no checks, are skipped as a whole ("file skipped"). The **load fails**
(:class:`~lopd.envs.loaders.TaskFormatError`, ending in "load failed") on what would make the
result ambiguous or empty: a file that is neither JSON nor JSON lines, a duplicate ``env_id`` or
``task_id``, no environment or no task left.

Split: the paper evaluates on a held-out set of 200 tasks drawn at random from the pool and
trains on the rest; EnvScaler does not publish which. Here the test split is :data:`TEST_TASKS`
tasks (a fifth of a smaller pool) drawn with seed :data:`SPLIT_SEED` from the task ids sorted:
the same on every machine, but not the paper's 200.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from lopd.envs.envscaler_spec import (
    WORLD,
    check_class_code,
    check_tools,
    validate_spec,
)
from lopd.envs.loaders import (
    MAX_INSTRUCTION_CHARS,
    MAX_LINE_BYTES,
    SkippedItemWarning,
    TaskFormatError,
    read_lines,
    regular_file_problem,
)
from lopd.types import Task

TEST_TASKS = 200
"""Size of the held-out split of a released pool (paper Table 5: 200 tasks)."""
SPLIT_SEED = 0
MAX_FILE_BYTES = 1 << 30
"""Largest release file read (EnvScaler's are tens of MB)."""


class EnvScalerLoad(NamedTuple):
    """What :func:`load_envscaler` read.

    Attributes:
        tasks: the tasks, in file order (files sorted by name).
        skipped: one line per skipped item or file (also issued as warnings).
    """

    tasks: list[Task]
    skipped: list[str]


def _json_field(item: dict[str, Any], key: str) -> Any:
    """A field the Hugging Face release stores as JSON text (``init_config``, ``tools``)."""
    value = item.get(key)
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f"{key} is text that is not valid JSON") from None
    return value


def read_items(path: Path) -> list[tuple[str, Any]]:
    """``(item name, item)`` of a JSON object (``{id: item}``), array, or JSON-lines file.

    Raises:
        TaskFormatError: not a regular file, too large, or neither JSON nor JSON lines.
    """
    problem = regular_file_problem(path)
    if problem is not None:
        raise TaskFormatError(f"{path}: {problem}; load failed")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise TaskFormatError(f"{path}: {size:,} bytes, over the {MAX_FILE_BYTES:,} limit")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskFormatError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    except RecursionError:
        raise TaskFormatError(f"{path}: invalid JSON (nested too deeply)") from None
    if isinstance(data, dict):
        return [(f"item {k!r}", v) for k, v in data.items()]
    if isinstance(data, list):
        return [(f"item {i}", v) for i, v in enumerate(data)]
    items = []
    for lineno, line in read_lines(path):
        try:
            items.append((f"line {lineno}", json.loads(line)))
        except (json.JSONDecodeError, RecursionError):
            raise TaskFormatError(
                f"{path}: line {lineno}: neither a JSON file nor JSON lines; load failed"
            ) from None
    return items


def _kind(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    if "env_class_code" in item:
        return "env"
    if "checklist_with_func" in item:
        return "task"
    if {"task", "env_id", "init_config"} <= item.keys():
        return "unchecked_task"
    return None


def _env_fields(item: dict[str, Any], name: str) -> dict[str, Any]:
    env = {
        "env_id": item.get("env_id", name),
        "env_class_name": item.get("env_class_name"),
        "env_class_code": item.get("env_class_code"),
        "tools": _json_field(item, "tools"),
        "environment_introduction": item.get("environment_introduction", ""),
        "constraints_rules": _json_field(item, "constraints_rules") or [],
    }
    if not isinstance(env["env_id"], str) or not env["env_id"]:
        raise ValueError("env_id must be non-empty text")
    check_class_code(env["env_class_code"], env["env_class_name"])
    check_tools(env["tools"])
    return env


def _task(item: dict[str, Any], env: dict[str, Any]) -> Task:
    task_id, instruction = item.get("task_id"), item.get("task")
    if not isinstance(task_id, str) or not task_id:
        raise ValueError("task_id must be non-empty text")
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError("task (the instruction) must be non-empty text")
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        raise ValueError(f"the instruction is over {MAX_INSTRUCTION_CHARS:,} characters")
    spec = {
        **env,
        "env_class_name": item.get("env_class_name", env["env_class_name"]),
        "init_config": _json_field(item, "init_config") or {},
        "checklist_with_func": _json_field(item, "checklist_with_func"),
    }
    validate_spec(spec)
    return Task(task_id, "tool_use", WORLD, instruction, spec, "train")


def _release_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
        if not files:
            raise TaskFormatError(f"{path}: no .json or .jsonl file in it")
        return files
    return [path]


def load_envscaler(
    paths: str | os.PathLike[str] | list[str | os.PathLike[str]],
) -> EnvScalerLoad:
    """Tasks from EnvScaler's released env-item and task-item files (module docstring).

    Args:
        paths: a directory holding the release files (every ``.json`` / ``.jsonl`` in it), or
            the files themselves; env items and task items are told apart by their fields.

    Returns:
        The tasks (split labels as in the module docstring) and the skipped-item lines.

    Raises:
        FileNotFoundError: a path does not exist.
        TaskFormatError: a load failure (see the module docstring), one line.
    """
    files: list[Path] = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        files += _release_files(p)
    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        warnings.warn(line, SkippedItemWarning, stacklevel=3)

    envs: dict[str, dict[str, Any]] = {}
    env_where: dict[str, str] = {}
    task_items: list[tuple[str, dict[str, Any]]] = []
    for path in files:
        items = read_items(path)
        kinds = [_kind(item) for _, item in items]
        if items and all(k == "unchecked_task" for k in kinds):
            skip(f"{path}: task items without checklist_with_func (no reward): file skipped")
            continue
        for (name, item), kind in zip(items, kinds):
            where = f"{path}: {name}"
            if kind == "env":
                try:
                    env = _env_fields(item, name)
                except ValueError as e:
                    skip(f"{where} (env {item.get('env_id', name)!r}): {e}; item skipped")
                    continue
                if env["env_id"] in envs:
                    first = env_where[env["env_id"]]
                    raise TaskFormatError(
                        f"{where}: duplicate env_id {env['env_id']!r} (also {first}); load failed"
                    )
                envs[env["env_id"]], env_where[env["env_id"]] = env, where
            elif kind in ("task", "unchecked_task"):
                task_items.append((where, item))
            else:
                skip(f"{where}: neither an EnvScaler env item nor a task item; item skipped")
    if not envs:
        raise TaskFormatError(f"{', '.join(map(str, files))}: no EnvScaler env item; load failed")
    tasks, seen = [], {}
    for where, item in task_items:
        tid = item.get("task_id")
        label = f"{where} (task {tid!r})"
        env = envs.get(item.get("env_id"))
        if env is None:
            skip(f"{label}: env_id {item.get('env_id')!r} has no environment; item skipped")
            continue
        if isinstance(tid, str) and tid in seen:
            raise TaskFormatError(f"{label}: duplicate task_id (also {seen[tid]}); load failed")
        try:
            task = _task(item, env)
        except ValueError as e:
            skip(f"{label}: {e}; item skipped")
            continue
        seen[task.task_id] = where
        tasks.append(task)
    if not tasks:
        raise TaskFormatError(
            f"{', '.join(map(str, files))}: no usable EnvScaler task item; load failed"
        )
    test = _test_ids([t.task_id for t in tasks])
    for t in tasks:
        t.split = "test" if t.task_id in test else "train"
    return EnvScalerLoad(tasks, skipped)


def _test_ids(task_ids: list[str]) -> set[str]:
    """The held-out task ids: :data:`TEST_TASKS` (a fifth of a smaller pool), seeded."""
    n = len(task_ids)
    k = min(TEST_TASKS, max(1, n // 5)) if n >= 2 else 0
    order = sorted(task_ids)
    random.Random(SPLIT_SEED).shuffle(order)
    return set(order[:k])


def is_release_file(path: Path) -> bool:
    """Whether ``path`` is an EnvScaler release file (a JSON array or object of items, or JSON
    lines of env or task items) rather than a lopd tasks JSONL. Only a regular file is opened (a
    FIFO would block)."""
    if regular_file_problem(path) is not None:
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(MAX_LINE_BYTES + 1).strip()
    except OSError:
        return False
    if first[:1] == b"[":
        return True
    try:
        record = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return first[:1] == b"{"  # an object spread over lines: {env_id: item, ...}
    return _kind(record) is not None
