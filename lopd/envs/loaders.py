"""JSONL task files: the native format, plus TACO and LiveCodeBench rows for coding.

Native format: one :class:`~lopd.types.Task` per line, as ``Task.to_dict()`` writes it::

    {"task_id": "...", "domain": "tool_use"|"coding", "world": "...", "instruction": "...",
     "spec": {...}, "split": "train"|"val"|"test"}

For tool use, ``world`` is one of

* a registered world (:func:`lopd.envs.register_world`): the spec holds the initial database
  (``"db"``, or a ``"seed"`` for the world's generator) and the final-state ``"checks"`` (see
  :mod:`lopd.envs.tool_use`);
* ``"envscaler"``: an EnvScaler task with its environment's class code and checks
  (:mod:`lopd.envs.envscaler_spec`; EnvScaler's release files themselves load through
  :func:`lopd.envs.task_files.load_task_file`);
* ``"acebench"``: an ACEBench agent task (:mod:`lopd.envs.acebench.spec`);
* ``"bfcl"``: a BFCL multi-turn entry (:func:`lopd.envs.bfcl_data.task_from_entry`).

For coding, see :mod:`lopd.envs.coding` (``world`` ``"humaneval"``: :mod:`lopd.envs.humaneval`).

:func:`load_tasks_jsonl` also accepts, line by line,

* TACO rows (``question`` + ``input_output`` JSON with ``inputs``/``outputs``/``fn_name``),
* LiveCodeBench rows (``question_content`` + ``public_test_cases``/``private_test_cases``,
  ``metadata`` with ``func_name`` for functional tests; private tests may be LiveCodeBench's
  base64+zlib+pickle encoding, which is decoded with an unpickler that refuses every object
  other than plain strings, lists and dicts).

Every line is checked before a model sees it, and a bad one is named by ``path:line``: types
(``task_id``, ``domain``, ``world``, ``instruction``, ``split`` are strings; a stdin/stdout test's
``input`` and ``output`` are strings, a function-call test's ``input`` a list of arguments or a
string), sizes (a line of at most :data:`MAX_LINE_BYTES`, an instruction of at most
:data:`MAX_INSTRUCTION_CHARS`), and the file itself must be a regular file (a FIFO or a device
would block or never end).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lopd.atomic import atomic_write_text
from lopd.envs.acebench.spec import WORLD as ACEBENCH_WORLD
from lopd.envs.acebench.spec import validate_spec as validate_acebench_spec
from lopd.envs.bfcl_data import validate_spec
from lopd.envs.envscaler_spec import WORLD as ENVSCALER_WORLD
from lopd.envs.envscaler_spec import validate_spec as validate_envscaler_spec
from lopd.envs.tool_use import evaluate_checks, get_world
from lopd.types import Task

_TASK_KEYS = {"task_id", "domain", "world", "instruction", "spec"}

MAX_LINE_BYTES = 64 << 20
"""Longest line of a task file (64 MiB; the longest BFCL or HumanEval line is under 20 KB)."""

MAX_INSTRUCTION_CHARS = 1_000_000
"""Longest instruction: longer ones could never fit a model's context, and a tokenizer given
hundreds of MB may abort the process rather than raise."""


class TaskFormatError(ValueError):
    """A JSONL line that is not a valid task in any supported format (message names the line)."""


class SkippedItemWarning(UserWarning):
    """An item of a benchmark's release file that was skipped while loading (the message names
    the file, the item and why, and ends in "item skipped" or "file skipped")."""


SPLITS = ("train", "val", "test")
"""The split labels a task file may use (``val``: for tuning, never for reporting)."""


def _json_type(value: Any) -> str:
    """How a JSON value's type reads in a message (``null``, ``a list``, ``a number``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "a list", dict: "an object", str: "a string"}.get(
        type(value), type(value).__name__
    )


def _check_types(task: Task, where: str) -> None:
    for name in ("task_id", "domain", "world", "instruction", "split"):
        value = getattr(task, name)
        if not isinstance(value, str):
            raise TaskFormatError(f"{where}: {name} must be a string, got {_json_type(value)}")
    if not task.task_id:
        raise TaskFormatError(f"{where}: task_id must not be empty")
    if len(task.instruction) > MAX_INSTRUCTION_CHARS:
        raise TaskFormatError(
            f"{where}: instruction is {len(task.instruction):,} characters, over the "
            f"{MAX_INSTRUCTION_CHARS:,} limit"
        )


def _check_coding_tests(spec: dict[str, Any], where: str) -> None:
    tests = spec.get("tests")
    if not isinstance(tests, list) or not tests:
        raise TaskFormatError(f"{where}: coding spec needs a non-empty 'tests' list")
    fn_name = spec.get("fn_name")
    if fn_name is not None and not isinstance(fn_name, str):
        raise TaskFormatError(
            f"{where}: fn_name must be a string or null, got {_json_type(fn_name)}"
        )
    for i, t in enumerate(tests, 1):
        if not isinstance(t, dict) or "input" not in t or "output" not in t:
            raise TaskFormatError(f"{where}: each test needs 'input' and 'output'")
        if not fn_name:
            for key in ("input", "output"):
                if not isinstance(t[key], str):
                    raise TaskFormatError(
                        f"{where}: test {i}: a stdin/stdout test's {key} must be a string (the "
                        f"program's text), got {_json_type(t[key])}"
                    )
        elif not isinstance(t["input"], (list, str)):
            raise TaskFormatError(
                f"{where}: test {i}: a function-call test's input must be a list of arguments "
                f"(or a string holding a Python tuple), got {_json_type(t['input'])}"
            )
    limit = spec.get("time_limit_s")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < 1e6
    ):
        raise TaskFormatError(f"{where}: time_limit_s must be a positive number, got {limit!r}")


def _validate(task: Task, where: str) -> Task:
    _check_types(task, where)
    if task.split not in SPLITS:
        raise TaskFormatError(f"{where}: split must be one of {list(SPLITS)}, got {task.split!r}")
    if task.domain not in ("tool_use", "coding"):
        raise TaskFormatError(
            f"{where}: domain must be 'tool_use' or 'coding', got {task.domain!r}"
        )
    if not isinstance(task.spec, dict):
        raise TaskFormatError(f"{where}: spec must be an object")
    if task.domain == "coding":
        _check_coding_tests(task.spec, where)
    elif task.world in ("bfcl", ENVSCALER_WORLD, ACEBENCH_WORLD):
        validate = {
            "bfcl": validate_spec,
            ENVSCALER_WORLD: validate_envscaler_spec,
            ACEBENCH_WORLD: validate_acebench_spec,
        }[task.world]
        try:
            validate(task.spec)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise TaskFormatError(f"{where}: {e}") from None
    else:
        if not isinstance(task.spec.get("checks"), list) or not task.spec["checks"]:
            raise TaskFormatError(f"{where}: tool-use spec needs a non-empty 'checks' list")
        if "db" not in task.spec and not isinstance(task.spec.get("seed"), int):
            raise TaskFormatError(f"{where}: tool-use spec needs 'db' or an integer 'seed'")
        try:
            get_world(task.world)
        except KeyError as e:
            raise TaskFormatError(
                f"{where}: {e.args[0]} (register the world before loading)"
            ) from None
        try:
            # On an empty database: catches unknown ops and checks missing their keys.
            evaluate_checks(task.spec["checks"], {}, {})
        except Exception as e:
            raise TaskFormatError(f"{where}: invalid check ({type(e).__name__}: {e})") from None
        if "conventions" in task.spec:
            try:
                get_world(task.world)({}, task.spec["conventions"])
            except ValueError as e:
                raise TaskFormatError(f"{where}: {e}") from None
    return task


def _time_limit(value: Any, default: float = 4.0) -> float:
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    if isinstance(value, str):
        # TACO writes e.g. "2 seconds" or "1.5".
        head = value.strip().split()[:1]
        try:
            return float(head[0]) if head else default
        except ValueError:
            return default
    return default


def from_taco(row: dict[str, Any], task_id: str, split: str = "train") -> Task:
    """Convert a TACO row into a coding task.

    Args:
        row: with ``question``, ``input_output`` (JSON string or object with ``inputs``,
            ``outputs`` and optional ``fn_name``), optional ``starter_code``, ``time_limit``.
        task_id: id to give the task (TACO rows have none).
        split: split label.

    Raises:
        TaskFormatError: missing fields or mismatched inputs/outputs.
    """
    io_spec = row.get("input_output")
    if isinstance(io_spec, str):
        io_spec = json.loads(io_spec)
    if not isinstance(io_spec, dict) or "inputs" not in io_spec or "outputs" not in io_spec:
        raise TaskFormatError(f"{task_id}: TACO row needs input_output with inputs and outputs")
    ins, outs = io_spec["inputs"], io_spec["outputs"]
    if len(ins) != len(outs) or not ins:
        raise TaskFormatError(f"{task_id}: TACO inputs/outputs are empty or of unequal length")
    fn_name = io_spec.get("fn_name") or None
    if fn_name is None:
        # Outputs are sometimes a list of lines: join them to the expected stdout text.
        outs = ["\n".join(map(str, o)) if isinstance(o, list) else str(o) for o in outs]
        ins = ["\n".join(map(str, i)) if isinstance(i, list) else str(i) for i in ins]
    spec = {
        "fn_name": fn_name,
        "starter_code": row.get("starter_code") or None,
        "tests": [{"input": i, "output": o} for i, o in zip(ins, outs)],
        "time_limit_s": _time_limit(row.get("time_limit")),
    }
    return Task(task_id, "coding", "coding", str(row["question"]), spec, split)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles only built-in data (str, list, dict, numbers): no class is ever resolved."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a task file")


def _lcb_tests(value: Any) -> list[dict[str, Any]]:
    if not value:
        return []
    if isinstance(value, list):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raw = zlib.decompress(base64.b64decode(value))
        decoded = _PlainUnpickler(io.BytesIO(raw)).load()
        return json.loads(decoded) if isinstance(decoded, str) else decoded


def from_livecodebench(
    row: dict[str, Any], task_id: str | None = None, split: str = "test"
) -> Task:
    """Convert a LiveCodeBench (code_generation) row into a coding task.

    Functional tests (``testtype == "functional"``) have one JSON argument per input line and a
    JSON output; stdin tests are text.

    Raises:
        TaskFormatError: no tests, or functional tests without ``metadata.func_name``.
    """
    tid = task_id or str(row.get("question_id") or row.get("question_title") or "lcb")
    tests = _lcb_tests(row.get("public_test_cases")) + _lcb_tests(row.get("private_test_cases"))
    if not tests:
        raise TaskFormatError(f"{tid}: LiveCodeBench row has no test cases")
    meta = row.get("metadata") or {}
    if isinstance(meta, str):
        meta = json.loads(meta) if meta.strip() else {}
    functional = tests[0].get("testtype") == "functional"
    fn_name = meta.get("func_name") if functional else None
    if functional and not fn_name:
        raise TaskFormatError(f"{tid}: functional tests need metadata.func_name")
    if functional:
        conv = [
            {
                "input": [json.loads(a) for a in t["input"].split("\n") if a.strip()],
                "output": json.loads(t["output"]),
            }
            for t in tests
        ]
    else:
        conv = [{"input": t["input"], "output": t["output"]} for t in tests]
    spec = {
        "fn_name": fn_name,
        "starter_code": row.get("starter_code") or None,
        "tests": conv,
        "time_limit_s": 6.0,
    }
    return Task(tid, "coding", "coding", str(row["question_content"]), spec, split)


def task_from_record(record: dict[str, Any], where: str = "record") -> Task:
    """Build a task from one decoded JSON record of any supported format.

    Raises:
        TaskFormatError: the record matches no format or fails validation.
    """
    if not isinstance(record, dict):
        raise TaskFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    try:
        if record.keys() >= _TASK_KEYS:
            task = Task.from_dict(record)
        elif "question" in record and "input_output" in record:
            task = from_taco(
                record, str(record.get("task_id") or where), record.get("split", "train")
            )
        elif "question_content" in record:
            task = from_livecodebench(record, record.get("task_id"), record.get("split", "test"))
        else:
            raise TaskFormatError(
                f"{where}: unknown task format (keys {sorted(record)[:8]}); expected a lopd task, "
                "a TACO row or a LiveCodeBench row"
            )
    except (TypeError, KeyError, json.JSONDecodeError, zlib.error, pickle.UnpicklingError) as e:
        raise TaskFormatError(f"{where}: {type(e).__name__}: {e}") from None
    return _validate(task, where)


def regular_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a task file (``"does not exist"``, ``"is a FIFO, not a
    regular file"``, ...), or ``None``: a regular file (symlinks followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "a device")
    return f"is {kind}, not a regular file"


def read_lines(path: str | os.PathLike[str]) -> Iterable[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a task file, size and encoding checked.

    Raises:
        FileNotFoundError: no such file.
        TaskFormatError: not a regular file, a line over :data:`MAX_LINE_BYTES` or not UTF-8
            (the message gives ``path:line``).
    """
    problem = regular_file_problem(path)
    if problem == "does not exist":
        raise FileNotFoundError(f"{path} does not exist")
    if problem is not None:
        raise TaskFormatError(f"{path}: {problem}")
    with open(path, "rb") as f:
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise TaskFormatError(f"{where}: line longer than {MAX_LINE_BYTES >> 20} MiB")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskFormatError(
                    f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})"
                ) from None
            if line.strip():
                yield lineno, line


def load_tasks_jsonl(path: str | os.PathLike[str]) -> list[Task]:
    """Load tasks from a JSONL file (blank lines ignored; formats and checks in the module
    docstring).

    Tool-use tasks must name a registered world (register custom worlds before loading) and
    use known check ops.

    Raises:
        FileNotFoundError: no such file.
        TaskFormatError: a bad line (the message gives ``path:line``), duplicate task ids, or a
            path that is not a regular file.
    """
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in read_lines(path):
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{where}: invalid JSON ({e.msg})") from None
        except RecursionError:
            raise TaskFormatError(f"{where}: invalid JSON (nested too deeply)") from None
        task = task_from_record(record, where)
        if task.task_id in seen:
            raise TaskFormatError(f"{where}: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    return tasks


def save_tasks_jsonl(tasks: Iterable[Task], path: str | os.PathLike[str]) -> None:
    """Write tasks in the native format, atomically (temp file + rename: never half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(t.to_dict(), ensure_ascii=False) + "\n" for t in tasks)
    atomic_write_text(path, text)
