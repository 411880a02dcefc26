"""Configuration errors and the checks every section's ``validate`` is written with.

Each message names the field (``section.field``) and what it must be, so a bad value stops the
run with one line before any model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

__all__ = [
    "BankTooSmallError",
    "ConfigError",
    "MissingDependencyError",
    "at_least",
    "checkpoint_dir_problem",
    "greater_than",
    "in_unit_interval",
    "one_of",
    "optional_at_least",
]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (or file line)."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional dependency the configuration asks for cannot be imported.

    The message names the extra to install (``pip install 'lopd[vllm]'``). A
    :class:`ConfigError` for the command line's one-line errors, and an :class:`ImportError` for
    code that catches missing packages.

    Attributes:
        name: the missing module (``ImportError.name``).
    """

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class BankTooSmallError(ConfigError):
    """The experience bank cannot serve ``composer.num_retrieved`` experiences per task.

    Attributes:
        bank_size: entries in the bank (0: the base model had no rollout with reward >=
            ``bank.min_reward``).
    """

    def __init__(self, message: str, bank_size: int) -> None:
        super().__init__(message)
        self.bank_size = bank_size


def at_least(bound: int, **fields: float) -> None:
    """Every ``name=value`` is ``>= bound`` (names written ``section__field``)."""
    for name, value in fields.items():
        if value < bound:
            raise ConfigError(f"{_dotted(name)} must be >= {bound}, got {value}")


def greater_than(bound: int, **fields: float) -> None:
    """Every ``name=value`` is ``> bound``."""
    for name, value in fields.items():
        if not value > bound:
            raise ConfigError(f"{_dotted(name)} must be > {bound}, got {value}")


def optional_at_least(bound: int, **fields: int | None) -> None:
    """Every ``name=value`` is ``None`` or ``>= bound``."""
    for name, value in fields.items():
        if value is not None and value < bound:
            raise ConfigError(f"{_dotted(name)} must be >= {bound} or null, got {value}")


def in_unit_interval(**fields: float) -> None:
    """Every ``name=value`` is in ``[0, 1]``."""
    for name, value in fields.items():
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{_dotted(name)} must be in [0, 1], got {value}")


def one_of(allowed: Collection[Any], **fields: Any) -> None:
    """Every ``name=value`` is one of ``allowed``."""
    for name, value in fields.items():
        if value not in allowed:
            raise ConfigError(f"{_dotted(name)} must be one of {allowed}, got {value!r}")


def checkpoint_dir_problem(path: str | Path) -> str | None:
    """What keeps ``path`` from being a Hugging Face checkpoint directory, or ``None``.

    Checked before a model loads, so a wrong path or a damaged ``config.json`` is one line
    (transformers would raise an ``OSError`` with a traceback, or load for minutes first):
    the directory exists, and its ``config.json`` is a JSON object naming a ``model_type``.
    """
    path = Path(path)
    if not path.is_dir():
        return "is not a directory" if path.exists() else "does not exist"
    config = path / "config.json"
    if not config.is_file():
        return "holds no config.json (not a Hugging Face checkpoint directory)"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        why = err.strerror if isinstance(err, OSError) else f"not valid JSON: {err}"
        return f"has a config.json that cannot be read ({str(why).splitlines()[0][:120]})"
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return "has a config.json without a model_type (not a transformers model config)"
    return None


def _dotted(name: str) -> str:
    return name.replace("__", ".")
