"""ACEBench's released agent files as tasks.

ACEBench (``data_all/data_en/`` in its repository) ships each agent category as JSON lines:
``data_agent_multi_step.json`` (20 tasks) and ``data_agent_multi_turn.json`` (30), each line with
``id``, ``question``, ``initial_config``, ``involved_classes`` and ``function`` (the tools' docs),
and ``possible_answer/`` beside them with the same file names, each line with ``id``,
``ground_truth`` (the end state of every involved class) and ``mile_stone`` (the expected calls,
or several alternative lists of them). :func:`load_acebench` reads a directory holding them (or
one of the two files) as released; a task is paired with its answer by ``id``.

Split labels (for ``python -m lopd.train --tasks``): multi-step tasks are ``train``, multi-turn
tasks ``test``, so a run trains on one category and is evaluated on the other (multi-turn needs a
user model: see :mod:`lopd.envs.acebench.env`). ``python -m lopd.evaluate --bench acebench``
picks a category with ``--split``.

Bad input is one line naming the file and the item: an entry without an answer, with an unknown
class or ill-typed fields is skipped (a :class:`~lopd.envs.loaders.SkippedItemWarning` ending in
"item skipped"); a file that is not JSON lines, a duplicate ``id`` or no task left fails the
load (:class:`~lopd.envs.loaders.TaskFormatError`, ending in "load failed").
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from lopd.envs.acebench.spec import CATEGORIES, WORLD, validate_spec
from lopd.envs.loaders import SkippedItemWarning, TaskFormatError, read_lines
from lopd.types import Task

SPLIT_OF = {"multi_step": "train", "multi_turn": "test"}
"""The split label of each category's tasks when used as training tasks."""


class AceBenchLoad(NamedTuple):
    """What :func:`load_acebench` read.

    Attributes:
        tasks: the tasks, multi-step first, each category in file order.
        skipped: one line per skipped item (also issued as warnings).
    """

    tasks: list[Task]
    skipped: list[str]


def file_name(category: str) -> str:
    """The released file of a category (``data_agent_multi_step.json``)."""
    return f"data_agent_{category}.json"


def find_agent_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """``category -> task file`` under an ACEBench data directory (or one agent file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TaskFormatError: no agent file there.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():
        found = {c: path for c in CATEGORIES if path.name == file_name(c)}
        if not found:
            raise TaskFormatError(
                f"{path}: not an ACEBench agent file ({' or '.join(map(file_name, CATEGORIES))})"
            )
        return found
    found = {c: path / file_name(c) for c in CATEGORIES if (path / file_name(c)).is_file()}
    if not found:
        raise TaskFormatError(
            f"{path}: holds neither {file_name(CATEGORIES[0])} nor {file_name(CATEGORIES[1])}"
        )
    return found


def is_acebench_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an ACEBench data directory or agent file."""
    try:
        find_agent_files(path)
    except (FileNotFoundError, TaskFormatError):
        return False
    return True


def _records(path: Path) -> list[tuple[str, Any]]:
    out = []
    for lineno, line in read_lines(path):
        try:
            out.append((f"{path}: line {lineno}", json.loads(line)))
        except (json.JSONDecodeError, RecursionError):
            raise TaskFormatError(f"{path}: line {lineno}: not valid JSON; load failed") from None
    return out


def load_acebench(
    path: str | os.PathLike[str], categories: list[str] | tuple[str, ...] | None = None
) -> AceBenchLoad:
    """ACEBench's agent tasks under ``path`` (module docstring), of ``categories`` (default:
    every category found).

    Raises:
        FileNotFoundError: ``path`` or a needed answer file does not exist.
        TaskFormatError: a load failure (module docstring), one line.
    """
    files = find_agent_files(path)
    wanted = list(categories or files)
    for c in wanted:
        if c not in CATEGORIES:
            raise ValueError(f"ACEBench category must be one of {CATEGORIES}, got {c!r}")
        if c not in files:
            raise TaskFormatError(f"{path}: no {file_name(c)} for category {c!r}")
    tasks: list[Task] = []
    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        warnings.warn(line, SkippedItemWarning, stacklevel=3)

    seen: dict[str, str] = {}
    for category in wanted:
        task_file = files[category]
        answer_file = task_file.parent / "possible_answer" / task_file.name
        if not answer_file.is_file():
            raise FileNotFoundError(f"{answer_file} does not exist (ACEBench's possible answers)")
        answers: dict[str, dict[str, Any]] = {}
        for where, record in _records(answer_file):
            if isinstance(record, dict) and isinstance(record.get("id"), str):
                answers.setdefault(record["id"], record)
            else:
                skip(f"{where}: an answer without an 'id'; item skipped")
        for where, entry in _records(task_file):
            entry_id = entry.get("id") if isinstance(entry, dict) else None
            label = f"{where} (id {entry_id!r})"
            if not isinstance(entry_id, str) or not entry_id:
                skip(f"{label}: an entry without an 'id'; item skipped")
                continue
            if entry_id in seen:
                raise TaskFormatError(f"{label}: duplicate id (also {seen[entry_id]}); load failed")
            seen[entry_id] = where
            answer = answers.get(entry_id)
            if answer is None:
                skip(f"{label}: no possible answer has this id; item skipped")
                continue
            spec = {
                "acebench_id": entry_id,
                "category": category,
                "question": entry.get("question"),
                "initial_config": entry.get("initial_config"),
                "involved_classes": entry.get("involved_classes"),
                "functions": entry.get("function"),
                "ground_truth": answer.get("ground_truth"),
                "mile_stone": answer.get("mile_stone"),
            }
            try:
                validate_spec(spec)
            except ValueError as e:
                skip(f"{label}: {e}; item skipped")
                continue
            tasks.append(
                Task(entry_id, "tool_use", WORLD, spec["question"], spec, SPLIT_OF[category])
            )
    if not tasks:
        raise TaskFormatError(f"{path}: no usable ACEBench agent task; load failed")
    return AceBenchLoad(tasks, skipped)


def acebench_tasks(
    path: str | os.PathLike[str],
    category: str,
    n: int | None = None,
    user_model: str | None = None,
    user_device: str = "cpu",
) -> list[Task]:
    """The first ``n`` tasks of one category, multi-turn ones with their user model.

    Raises:
        as :func:`load_acebench`.
    """
    tasks = load_acebench(path, [category]).tasks
    if user_model is not None:
        for t in tasks:
            if t.spec["category"] == "multi_turn":
                t.spec["user_model"] = str(Path(user_model).resolve())
                t.spec["user_device"] = user_device
    return tasks if n is None else tasks[:n]
