"""ACEBench agent tasks: what a task of world ``"acebench"`` holds, and the checks on it.

A task's ``spec`` holds the fields of one ACEBench agent entry and of its possible answer::

    {
      "acebench_id": "agent_multi_step_0",
      "category": "multi_step" | "multi_turn",
      "question": "...",                        # the instruction (multi-turn: the user's brief)
      "initial_config": {"BaseApi": {"wifi": true, "logged_in": true}},
      "involved_classes": ["BaseApi", "ReminderApi", "FoodPlatform"],
      "functions": [{"name": ..., "description": ..., "parameters": {...}}, ...],
      "ground_truth": [{"BaseApi": {...}}, {"FoodPlatform": {...}}, ...],
      "mile_stone": ["[turn_on_wifi()]", ...]      # or a list of such lists (alternatives)
      "user_model": "/path/to/chat-model",         # optional: multi-turn's simulated user
      "user_device": "cpu",                        # optional: where it runs
      "oracle": [{"name": ..., "arguments": {...}}]  # optional: a correct call sequence
    }
"""

from __future__ import annotations

from typing import Any

from lopd.envs.acebench.phone import BaseApi, FoodPlatform, MessageApi, ReminderApi
from lopd.envs.acebench.travel import Travel

WORLD = "acebench"
"""``Task.world`` of ACEBench tasks (``make_env`` dispatches on it)."""
CATEGORIES = ("multi_step", "multi_turn")
"""ACEBench's agent categories (paper Table 1: M-Step 20 tasks, M-Turn 30)."""
CLASSES: dict[str, type] = {
    "BaseApi": BaseApi,
    "MessageApi": MessageApi,
    "ReminderApi": ReminderApi,
    "FoodPlatform": FoodPlatform,
    "Travel": Travel,
}
"""The environment classes a task may involve, by the names ACEBench's data uses."""
SAVED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "BaseApi": ("wifi", "logged_in"),
    "MessageApi": ("inbox",),
    "ReminderApi": ("reminder_list",),
    "FoodPlatform": ("users", "logged_in_users", "orders"),
    "Travel": ("users", "reservations"),
}
"""The attributes ACEBench saves of each class and compares with the ground truth."""
MAX_FUNCTIONS = 256
MAX_MILESTONES = 1_000


def _is_milestones(value: Any) -> bool:
    if not isinstance(value, list) or len(value) > MAX_MILESTONES:
        return False
    if value and isinstance(value[0], list):
        return all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in value)
    return all(isinstance(s, str) for s in value)


def validate_spec(spec: dict[str, Any]) -> None:
    """Check an ACEBench task spec's shape.

    Raises:
        ValueError: one line naming what is wrong.
    """
    for key in ("acebench_id", "category", "question", "initial_config", "involved_classes"):
        if key not in spec:
            raise ValueError(f"ACEBench spec needs {key!r}")
    for key in ("functions", "ground_truth", "mile_stone"):
        if key not in spec:
            raise ValueError(f"ACEBench spec needs {key!r}")
    if spec["category"] not in CATEGORIES:
        raise ValueError(f"category must be one of {CATEGORIES}, got {spec['category']!r}")
    if not isinstance(spec["question"], str) or not spec["question"].strip():
        raise ValueError("question must be non-empty text")
    if not isinstance(spec["initial_config"], dict):
        raise ValueError("initial_config must be an object")
    classes = spec["involved_classes"]
    if not isinstance(classes, list) or not classes:
        raise ValueError("involved_classes must be a non-empty list")
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        raise ValueError(f"involved class {unknown[0]!r} is not one of {sorted(CLASSES)}")
    functions = spec["functions"]
    if not isinstance(functions, list) or len(functions) > MAX_FUNCTIONS:
        raise ValueError(f"functions must be a list of at most {MAX_FUNCTIONS} function docs")
    for i, fn in enumerate(functions):
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"function {i} must be an object with a 'name'")
    answer = spec["ground_truth"]
    answers = answer if isinstance(answer, list) else [answer]
    if not all(isinstance(a, dict) and len(a) == 1 for a in answers):
        raise ValueError("ground_truth must be a list of {class name: attributes} objects")
    if not all(isinstance(v, dict) for a in answers for v in a.values()):
        raise ValueError("ground_truth: each class's attributes must be an object")
    if not _is_milestones(spec["mile_stone"]):
        raise ValueError("mile_stone must be a list of call texts, or a list of such lists")
    user = spec.get("user_model")
    if user is not None and not (isinstance(user, str) and user):
        raise ValueError("user_model must be a checkpoint path")
    if not isinstance(spec.get("user_device", "cpu"), str):
        raise ValueError("user_device must be a device name such as 'cpu' or 'cuda'")
    oracle = spec.get("oracle")
    if oracle is not None and not (
        isinstance(oracle, list)
        and all(
            isinstance(c, dict) and isinstance(c.get("name"), str)
            and isinstance(c.get("arguments", {}), dict)
            for c in oracle
        )
    ):  # fmt: skip
        raise ValueError("oracle must be a list of {'name': ..., 'arguments': {...}} calls")
