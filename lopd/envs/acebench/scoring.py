"""ACEBench's agent scores: end-to-end accuracy and process accuracy, as ACEBench defines them.

**End to end** (``eval_main.agent_eval`` and ``model_eval.checker.agent_checker`` in ACEBench):
the end state is one ``{class: {saved attribute: value}}`` per involved class (the attributes of
:data:`~lopd.envs.acebench.spec.SAVED_ATTRIBUTES`, through JSON, so integer keys read as text,
as ACEBench saves and reloads them). It is correct when

1. it has as many classes as the ground truth, and
2. for each class of the ground truth, the first end-state class with the same name passes the
   attribute check: every saved attribute must be in the ground truth; where the ground truth's
   value is an object, each of *its* keys must be in the end state's value with an equal value
   (keys the end state has beyond them are not looked at: an extra message in an inbox passes),
   and any other value must be equal (an extra order in a list fails).

A ground-truth class whose name no end-state class has is not compared (ACEBench carries the
previous class's verdict over, which never changes the outcome): ACEBench's data names
``ReminderAPI`` (and once ``Reminderpi``, ``BaseAPI``) where the class is ``ReminderApi``, and
those end states are not checked there either.

**Process** (``agent_eval_process``): 1.0 when the end state is correct; else the fraction of the
milestone calls found in the model's calls in order (each found at or after the previous match;
texts compared whitespace-stripped), the best over alternative milestone lists. A call is
written as ACEBench's environment logs it: ``[name(key='text', key=3)]``, text values in single
quotes as they are, other values as Python prints them.
"""

from __future__ import annotations

import ast
import json
from typing import Any, NamedTuple

__all__ = [
    "EndToEnd",
    "end_state",
    "end_to_end",
    "format_call",
    "parse_call",
    "process_accuracy",
]


class EndToEnd(NamedTuple):
    """ACEBench's end-to-end verdict.

    Attributes:
        correct: the end state matches the ground truth.
        errors: what differs (ACEBench's error kinds: a wrong number of classes, an attribute
            missing from the answer, a wrong attribute value).
    """

    correct: bool
    errors: list[str]


def end_state(instances: dict[str, Any], saved: dict[str, tuple[str, ...]]) -> list[dict]:
    """The end state of an episode's instances, as ACEBench saves it (through JSON).

    Args:
        instances: class name -> instance, in the task's ``involved_classes`` order.
        saved: class name -> the attributes saved of it.
    """
    state = [
        {name: {k: v for k, v in vars(inst).items() if k in saved[name]}}
        for name, inst in instances.items()
    ]
    return json.loads(json.dumps(state, default=str))


def _attributes_match(name: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    errors = []
    for attr, value in got.items():
        if attr not in want:
            errors.append(f"class {name}: attribute {attr} is not in the answer")
            continue
        expected = want[attr]
        if isinstance(expected, dict):
            if not isinstance(value, dict):
                errors.append(f"class {name}: attribute {attr} is not an object")
                continue
            for key, item in expected.items():
                if key not in value:
                    errors.append(f"class {name}: attribute {attr} lacks key {key}")
                elif item != value[key]:
                    errors.append(
                        f"class {name}: attribute {attr}.{key} is {value[key]!r}, expected {item!r}"
                    )
        elif expected != value:
            errors.append(f"class {name}: attribute {attr} is {value!r}, expected {expected!r}")
    return errors


def end_to_end(state: list[dict[str, Any]], ground_truth: Any) -> EndToEnd:
    """ACEBench's end-to-end check of an end state (module docstring)."""
    expected = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    if len(expected) != len(state):
        return EndToEnd(False, [f"wrong number of classes: {len(state)}, expected {len(expected)}"])
    errors: list[str] = []
    for answer in expected:
        match = next((s for s in state if set(s) == set(answer)), None)
        if match is None:
            continue
        (name, want), (got,) = next(iter(answer.items())), match.values()
        errors += _attributes_match(name, got, want)
    return EndToEnd(not errors, errors)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as ACEBench's environment logs it for the process score."""
    args = ", ".join(
        f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in arguments.items()
    )
    return f"[{name}({args})]"


def parse_call(text: str) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of a call written as ``[name(key=literal, ...)]``.

    Raises:
        ValueError: not one call with literal keyword arguments.
    """
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    try:
        node = ast.parse(body, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        return node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise ValueError(f"milestone {text[:80]!r} is not a call ({type(e).__name__})") from None


def _in_order(milestones: list[str], calls: list[str]) -> float:
    if not milestones:
        return 1.0
    found, i = 0, 0
    for stone in milestones:
        while i < len(calls):
            i += 1
            if calls[i - 1].strip() == stone.strip():
                found += 1
                break
    return found / len(milestones)


def process_accuracy(calls: list[str], milestones: list[Any], correct: bool) -> float:
    """ACEBench's process score of one task (module docstring)."""
    if correct:
        return 1.0
    if milestones and isinstance(milestones[0], list):
        return max(_in_order(m, calls) for m in milestones)
    return _in_order(milestones, calls)
