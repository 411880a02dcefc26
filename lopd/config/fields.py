"""Setting configuration fields from YAML values, with the field's type checked.

:func:`apply_mapping` applies a nested mapping (a YAML file), :func:`set_field` one value; both
coerce the value to the field's annotated type (int -> float allowed, YAML 1.1's ``"1e-3"``
strings read as floats) or raise a :class:`~lopd.config.checks.ConfigError` naming the key. A key
that moved to another section (:data:`MOVED_KEYS`) is refused naming where it lives now.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from lopd.config.checks import ConfigError

__all__ = ["MOVED_KEYS", "apply_mapping", "has_field", "set_field"]

_TRAIN_FIELDS = (
    "method",
    "steps",
    "tasks_per_step",
    "micro_batch",
    "lr",
    "composer_lr",
    "weight_decay",
    "grad_clip",
)

MOVED_KEYS: dict[str, str] = {f"lopd.{name}": f"train.{name}" for name in _TRAIN_FIELDS}
"""Keys of earlier layouts, old -> new: the trainer-wide fields left the ``lopd`` section (LOPD's
own hyper-parameters) for the ``train`` section. An old key is refused in one line naming the
new one, in an override, a YAML file or a saved ``config.yaml``."""


def has_field(obj: Any, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(obj))


def apply_mapping(obj: Any, mapping: dict[str, Any], prefix: str, source: str) -> None:
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if not has_field(obj, key):
            raise _unknown_key(dotted, source)
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {dotted!r} is a section and needs a mapping")
            apply_mapping(current, value, prefix=f"{dotted}.", source=source)
        else:
            set_field(obj, key, value, dotted, source)


def set_field(obj: Any, name: str, value: Any, dotted: str, source: str) -> None:
    if not has_field(obj, name):
        raise _unknown_key(dotted, source)
    hint = typing.get_type_hints(type(obj))[name]
    if dataclasses.is_dataclass(hint):
        raise ConfigError(f"{source}: {dotted!r} is a section; set one of its fields")
    setattr(obj, name, _coerce(value, hint, dotted, source))


def _unknown_key(dotted: str, source: str) -> ConfigError:
    """The refusal of a key no section has: where it moved (:data:`MOVED_KEYS`), or unknown."""
    if dotted in MOVED_KEYS:
        return ConfigError(f"{source}: {dotted!r} is now {MOVED_KEYS[dotted]!r}")
    return ConfigError(f"{source}: unknown config key {dotted!r}")


def _coerce(value: Any, hint: Any, dotted: str, source: str) -> Any:
    """Return ``value`` as type ``hint`` (int -> float allowed), else raise ConfigError."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, dotted, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {dotted} expects {_type_name(hint)}, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads "1e-3" as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{source}: {dotted} expects {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", str(hint))
