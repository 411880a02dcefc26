"""BFCL v3 multi-turn data: entries, the train/test split, tasks, spec checks, tool schemas.

Read from the ``bfcl-eval`` package's data directory (see :mod:`lopd.envs.bfcl` for the env and
how to install the package). The data is read without ``bfcl_eval.utils`` on purpose: importing
it creates ``result/``, ``score/`` and ``.file_locks/`` directories inside ``site-packages``
(through ``bfcl_eval.constants.eval_config``) and its loader takes cross-process file locks.

Train/test split (for training on BFCL with ``--tasks``): the four categories share 200
scenarios (entry ``i`` of every category is scenario ``i``); scenarios that share a user message
(two pairs: 40/43 and 102/148) are grouped, and groups drawn with a fixed seed until 20% of the
scenarios are in it form the test split (40 scenarios, 160 entries); the other 160 scenarios
(640 entries) train. No scenario is in both. ``split="all"`` is the whole benchmark (what the
paper reports); a model trained on the train split is evaluated with ``split="test"``.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import json
import random
from importlib import resources
from typing import Any

from lopd.types import Task

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
"""The BFCL v3 multi-turn categories, in the paper's order."""
WORLD = "bfcl"
"""``Task.world`` of BFCL tasks (``make_env`` dispatches on it)."""
BFCL_VERSION = "2026.3.23"
BACKEND_CLASSES = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TwitterAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "VehicleControlAPI",
)
TEST_FRACTION = 0.2
SPLIT_SEED = 0
# bfcl_eval.utils._get_language_specific_hint for Python (not importable: see module docstring).
_PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


def require_bfcl() -> None:
    """Import ``bfcl_eval`` or raise an ImportError that says how to install it."""
    try:
        importlib.import_module("bfcl_eval.constants.executable_backend_config")
        importlib.import_module("mpmath")
    except ImportError as e:
        raise ImportError(
            f"BFCL needs the bfcl-eval package ({e}); install it without its dependencies: "
            f"pip install 'lopd[bfcl]' && pip install --no-deps bfcl-eval=={BFCL_VERSION}"
        ) from None


def _data_file(*parts: str) -> Any:
    require_bfcl()
    node = resources.files("bfcl_eval") / "data"
    for p in parts:
        node = node / p
    return node


def _read_jsonl(*parts: str) -> list[dict[str, Any]]:
    text = _data_file(*parts).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@functools.cache
def _entries_json(category: str) -> str:
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
    entries = _read_jsonl(f"BFCL_v4_multi_turn_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(
        "possible_answer", f"BFCL_v4_multi_turn_{category}.json"
    )}  # fmt: skip
    for e in entries:
        e["ground_truth"] = answers[e["id"]]
    return json.dumps(entries)


def load_entries(category: str) -> list[dict[str, Any]]:
    """The category's 200 entries (fresh copies), each with its ``ground_truth`` per turn.

    Raises:
        ValueError: unknown category. ImportError: bfcl-eval is not installed.
    """
    return json.loads(_entries_json(category))


def scenario_index(entry_id: str) -> int:
    """The scenario number of an entry id (``multi_turn_miss_func_17`` -> 17)."""
    return int(entry_id.rsplit("_", 1)[1])


@functools.cache
def scenario_split() -> dict[int, str]:
    """``scenario -> "train" | "test"`` (see the module docstring); deterministic."""
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    first_seen: dict[str, int] = {}
    for category in CATEGORIES:
        for e in load_entries(category):
            i = find(scenario_index(e["id"]))
            for turn in e["question"]:
                for m in turn:
                    key = m["content"].strip().lower()
                    j = find(first_seen.setdefault(key, i))
                    parent[max(i, j)] = min(i, j)
                    i = min(i, j)
    groups: dict[int, list[int]] = {}
    for i in sorted(parent):
        groups.setdefault(find(i), []).append(i)
    roots = sorted(groups)
    random.Random(SPLIT_SEED).shuffle(roots)
    n_test_target = round(TEST_FRACTION * len(parent))
    split, n_test = {}, 0
    for r in roots:
        label = "test" if n_test < n_test_target else "train"
        n_test += len(groups[r]) if label == "test" else 0
        for i in groups[r]:
            split[i] = label
    return split


def bfcl_tasks(
    categories: tuple[str, ...] | list[str] = CATEGORIES, split: str = "all", n: int | None = None
) -> list[Task]:
    """BFCL entries as tasks, category by category in entry order.

    Args:
        categories: any of :data:`CATEGORIES`.
        split: ``"train"``, ``"test"`` (disjoint by scenario, see the module docstring) or
            ``"all"``; each task's ``split`` is its scenario's label either way.
        n: keep the first ``n`` tasks of each category (all if None).

    Raises:
        ValueError: unknown category or split, negative ``n``.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    labels = scenario_split()
    out = []
    for category in categories:
        tasks = []
        for e in load_entries(category):
            label = labels[scenario_index(e["id"])]
            if split in ("all", label):
                tasks.append(task_from_entry(e, category, label))
        out.extend(tasks if n is None else tasks[:n])
    return out


def task_from_entry(entry: dict[str, Any], category: str, split: str) -> Task:
    """One BFCL entry (with ``ground_truth``) as a self-contained :class:`Task`."""
    spec = {
        "bfcl_id": entry["id"],
        "category": category,
        "question": entry["question"],
        "initial_config": entry.get("initial_config", {}),
        "involved_classes": entry["involved_classes"],
        "missed_function": entry.get("missed_function", {}),
        "ground_truth": entry["ground_truth"],
    }
    validate_spec(spec)
    return Task(
        f"bfcl-{entry['id']}", "tool_use", WORLD, turn_text(entry["question"][0]), spec, split
    )


def turn_text(messages: list[dict[str, str]]) -> str:
    """The user text of one turn (its messages joined)."""
    return "\n\n".join(m["content"] for m in messages)


def parse_call_string(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """A ground-truth call such as ``mv(source='a', destination='b')`` -> name, args, kwargs.

    Parsed with ``ast`` and ``ast.literal_eval`` (ground truth is data, never evaluated).

    Raises:
        ValueError: not a call of a plain name with literal arguments.
    """
    name, args, kwargs = _parse_call_cached(text)
    return name, copy.deepcopy(list(args)), copy.deepcopy(dict(kwargs))


@functools.lru_cache(maxsize=65_536)
def _parse_call_cached(text: str) -> tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]]:
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a function call")
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = []
        for k in node.keywords:
            if k.arg is None:
                raise ValueError("**kwargs")
            kwargs.append((k.arg, ast.literal_eval(k.value)))
    except (SyntaxError, ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"ground-truth call {text[:80]!r} is not a literal call ({e})") from None
    return node.func.id, args, tuple(kwargs)


def validate_spec(spec: dict[str, Any]) -> None:
    """Check a BFCL task spec's shape (no bfcl-eval needed).

    Raises:
        ValueError: naming what is wrong.
    """
    for key in ("bfcl_id", "question", "initial_config", "involved_classes", "ground_truth"):
        if key not in spec:
            raise ValueError(f"BFCL spec needs {key!r}")
    q, gt = spec["question"], spec["ground_truth"]
    if not isinstance(q, list) or not q or not isinstance(gt, list) or len(gt) != len(q):
        raise ValueError("BFCL spec needs 'question' and 'ground_truth' lists of equal length")
    unknown = [c for c in spec["involved_classes"] if c not in BACKEND_CLASSES]
    if unknown or not spec["involved_classes"]:
        raise ValueError(f"BFCL spec: involved_classes must be among {BACKEND_CLASSES}")
    missed = spec.get("missed_function") or {}
    for k, names in missed.items():
        if not (str(k).isdigit() and 0 < int(k) < len(q)) or q[int(k)]:
            raise ValueError(f"BFCL spec: missed_function turn {k!r} is not an empty turn")
        if not all(isinstance(n, str) for n in names):
            raise ValueError("BFCL spec: missed_function lists function names")
    for i, turn in enumerate(q):
        if not turn and str(i) not in missed:
            raise ValueError(f"BFCL spec: turn {i} has no user message and no held-out functions")
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in turn):
            raise ValueError(f"BFCL spec: turn {i} must be a list of messages with 'content'")
    for calls in gt:
        for c in calls:
            parse_call_string(c)


# --------------------------------------------------------------------------- function docs


def _to_json_schema_types(schema: Any) -> Any:
    # bfcl-eval is optional (the [bfcl] extra).
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    if isinstance(schema, list):
        return [_to_json_schema_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            out[k] = GORILLA_TO_OPENAPI.get(v, "string")
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: _to_json_schema_types(p) for name, p in v.items()}
        else:
            out[k] = _to_json_schema_types(v)
    return out


@functools.cache
def _class_tools_json(class_name: str) -> str:
    """The class's function docs as tool schemas (JSON text: callers get fresh copies)."""
    # bfcl-eval is optional (the [bfcl] extra).
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    docs = _read_jsonl("multi_turn_func_doc", MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name])
    for d in docs:
        d["description"] += _PYTHON_HINT
    return json.dumps([tool_schema(d) for d in docs])


def entry_tools(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[int, list[dict]]]:
    """The tool list of an entry, and the held-out tools per turn (``miss_func``).

    As ``bfcl_eval.utils.populate_test_cases_with_predefined_functions``: the docs of every
    involved class, minus the ``missed_function`` ones, which are given at their turn.
    """
    tools = [t for c in spec["involved_classes"] for t in json.loads(_class_tools_json(c))]
    held: dict[int, list[dict]] = {}
    for turn, names in (spec.get("missed_function") or {}).items():
        for name in names:
            for i, t in enumerate(tools):
                if t["function"]["name"] == name:
                    held.setdefault(int(turn), []).append(tools.pop(i))
                    break
    return tools, held


def tool_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI-style tool (JSON-schema types) for chat templates."""
    fn = _to_json_schema_types(doc)
    fn.setdefault("parameters", {"type": "object", "properties": {}})
    fn["parameters"]["type"] = "object"
    return {"type": "function", "function": fn}
