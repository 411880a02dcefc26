"""How a coding test's output is compared with the expected one (:mod:`lopd.envs.coding`).

stdin/stdout tests compare tokens (whitespace-insensitive, numbers within 1e-6); function-call
tests compare JSON values (:func:`values_match`: float tolerance, TACO's one-element-list unwrap;
:func:`python_equal`: Python's ``==``, for ``"compare": "exact"``) or apply a test's own rule
(``abs_tol``, ``truthy``, ``identical``: :func:`value_passes`).
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any


def _float_or_none(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def tokens_match(got: str, expected: str) -> bool:
    """Whitespace-insensitive token comparison, numbers within 1e-6 (streamed: no token lists)."""
    if got.strip() == expected.strip():
        return True
    a, b = re.finditer(r"\S+", got), re.finditer(r"\S+", expected)
    for x, y in itertools.zip_longest(a, b):
        if x is None or y is None:
            return False
        tx, ty = x.group(), y.group()
        if tx == ty:
            continue
        fx, fy = _float_or_none(tx), _float_or_none(ty)
        if fx is None or fy is None or not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def values_match(got: Any, expected: Any) -> bool:
    """Equality of JSON values with float tolerance 1e-6; tuples are lists after JSON.

    A one-element list ``expected`` also matches its element (TACO wraps call outputs in a list).
    Values nested too deeply to compare do not match.
    """

    def eq(a: Any, b: Any) -> bool:
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
        return a == b

    try:
        if eq(got, expected):
            return True
        return isinstance(expected, list) and len(expected) == 1 and eq(got, expected[0])
    except (RecursionError, OverflowError):
        return False


def python_equal(got: Any, expected: Any) -> bool:
    """Python's ``==`` on JSON values (``True == 1``, ``2 == 2.0``, no tolerance).

    Values nested too deeply to compare do not match.
    """

    def eq(a: Any, b: Any) -> bool:
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a == b
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b

    try:
        return eq(got, expected)
    except (RecursionError, OverflowError):
        return False


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def value_passes(got: Any, test: dict[str, Any], spec: dict[str, Any]) -> bool:
    """Whether a returned value passes one function-call test (see the module docstring);
    judge tests are decided by ``lopd.envs.coding``'s judge run, not here."""
    expected = test.get("output")
    try:
        if "abs_tol" in test:
            return (
                _is_number(got) and _is_number(expected) and abs(got - expected) < test["abs_tol"]
            )
        if "truthy" in test:
            return bool(got) is bool(test["truthy"])
    except (OverflowError, RecursionError):
        return False
    if test.get("identical"):
        return type(got) is type(expected) and got == expected and expected in (True, False, None)
    if spec.get("compare") == "exact":
        return python_equal(got, expected)
    return values_match(got, expected)
