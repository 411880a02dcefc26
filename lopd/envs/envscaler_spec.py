"""EnvScaler task specs: what a task of world ``"envscaler"`` holds, and the checks on it.

A task's ``spec`` holds the fields of its EnvScaler task item and of its environment item (names
as in EnvScaler's release, :data:`SPEC_KEYS`)::

    {
      "env_id": "env_148_rl",
      "env_class_name": "ContactLensSubscriptionManagementSystem",
      "env_class_code": "class ContactLensSubscriptionManagementSystem: ...",
      "tools": [{"type": "function", "function": {"name": ..., "parameters": ...}}, ...],
      "environment_introduction": "...",
      "constraints_rules": ["...", ...],
      "init_config": {...},                      # the initial state (attribute -> value)
      "checklist_with_func": [
        {"check_item": "Has ...?", "check_func": "def check_func(final_state): ..."}, ...
      ],
      "oracle": [{"name": ..., "arguments": {...}}, ...]    # optional: a correct call sequence
    }

The code is parsed here, never run (it runs in the sandbox, :mod:`lopd.envs.envscaler`). Reading
EnvScaler's release files: :mod:`lopd.envs.envscaler_release`.
"""

from __future__ import annotations

import ast
import json
from typing import Any

WORLD = "envscaler"
"""``Task.world`` of EnvScaler tasks (``make_env`` dispatches on it)."""
MAX_CLASS_CODE_CHARS = 512 * 1024
"""Longest environment class (EnvScaler's longest is 58.5 k characters)."""
MAX_CHECK_CHARS = 64 * 1024
MAX_CHECKS = 100
MAX_TOOLS = 256
MAX_INIT_CONFIG_BYTES = 8 << 20
"""Largest initial state, as JSON (it is pickled into the sandbox at every call)."""
SPEC_KEYS = (
    "env_id",
    "env_class_name",
    "env_class_code",
    "tools",
    "environment_introduction",
    "constraints_rules",
    "init_config",
    "checklist_with_func",
)


# --------------------------------------------------------------------------- spec checks


def _parse(source: str, what: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"{what} has a syntax error (line {e.lineno}: {e.msg})") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise ValueError(f"{what} cannot be parsed ({type(e).__name__})") from None


def _top_level_names(tree: ast.Module, kind: type) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, kind)}


def check_class_code(code: Any, class_name: Any) -> None:
    """The class code parses and defines ``class_name`` at its top level (nothing is run).

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(class_name, str) or not class_name.isidentifier():
        raise ValueError(f"env_class_name must be a Python name, got {class_name!r}")
    if not isinstance(code, str) or not code.strip():
        raise ValueError("env_class_code must be non-empty text")
    if len(code) > MAX_CLASS_CODE_CHARS:
        raise ValueError(
            f"env_class_code is {len(code):,} characters, over the {MAX_CLASS_CODE_CHARS:,} limit"
        )
    tree = _parse(code, "env_class_code")
    if class_name not in _top_level_names(tree, ast.ClassDef):
        raise ValueError(f"env_class_code defines no class {class_name!r}")


def check_checklist(checklist: Any) -> None:
    """Each check parses and defines a top-level ``check_func``.

    Raises:
        ValueError: naming the check and what is wrong.
    """
    if not isinstance(checklist, list) or not checklist:
        raise ValueError("checklist_with_func must be a non-empty list")
    if len(checklist) > MAX_CHECKS:
        raise ValueError(f"{len(checklist)} checks, over the {MAX_CHECKS} limit")
    for i, check in enumerate(checklist):
        where = f"check {i}"
        if not isinstance(check, dict) or not isinstance(check.get("check_func"), str):
            raise ValueError(f"{where} must be an object with a 'check_func' text")
        if not isinstance(check.get("check_item", ""), str):
            raise ValueError(f"{where}: check_item must be text")
        source = check["check_func"]
        if len(source) > MAX_CHECK_CHARS:
            raise ValueError(
                f"{where} is {len(source):,} characters, over the {MAX_CHECK_CHARS:,} limit"
            )
        tree = _parse(source, where)
        if "check_func" not in _top_level_names(tree, ast.FunctionDef):
            raise ValueError(f"{where} defines no function check_func")


def check_tools(tools: Any) -> None:
    """The tool schemas are OpenAI functions with names.

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function schemas")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools, over the {MAX_TOOLS} limit")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                f"tool {i} must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )


def validate_spec(spec: dict[str, Any]) -> None:
    """Check an EnvScaler task spec (the fields of :data:`SPEC_KEYS`); nothing is run.

    Raises:
        ValueError: one line naming what is wrong.
    """
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise ValueError(f"EnvScaler spec needs {missing[0]!r}")
    if not isinstance(spec["env_id"], str) or not spec["env_id"]:
        raise ValueError("env_id must be non-empty text")
    if not isinstance(spec["environment_introduction"], str):
        raise ValueError("environment_introduction must be text")
    rules = spec["constraints_rules"]
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise ValueError("constraints_rules must be a list of texts")
    if not isinstance(spec["init_config"], dict):
        raise ValueError("init_config must be an object")
    size = len(json.dumps(spec["init_config"]))
    if size > MAX_INIT_CONFIG_BYTES:
        raise ValueError(
            f"init_config is {size:,} bytes of JSON, over the {MAX_INIT_CONFIG_BYTES:,} limit"
        )
    check_class_code(spec["env_class_code"], spec["env_class_name"])
    check_tools(spec["tools"])
    check_checklist(spec["checklist_with_func"])
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
