"""Building a run's configuration: a preset, then a YAML file, then ``key=value`` overrides.

Later layers win:

1. a preset (``default``, ``smoke``, ``paper``, ``compare`` or ``compare-quick``,
   :data:`lopd.config.presets.PRESETS`),
2. an optional YAML file (``--config``) with the same nested layout as
   :class:`~lopd.config.config.Config`,
3. ``section.field=value`` overrides from the command line (values parsed as YAML scalars and
   type-checked against the field).

Example:
    >>> cfg = load_config(preset="smoke", overrides=["lopd.margin=0.1", "seed=3"])
    >>> cfg.lopd.margin
    0.1
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lopd.config.checks import ConfigError
from lopd.config.config import IDENTITY_KEY, Config
from lopd.config.presets import PRESETS

__all__ = ["load_config"]


def load_config(
    preset: str = "default",
    yaml_path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Build a config: preset, then the YAML file, then ``key=value`` overrides.

    Args:
        preset: a name in :data:`PRESETS`.
        yaml_path: a YAML file with the nested layout of :class:`Config` (any subset).
        overrides: ``section.field=value`` strings; values are parsed as YAML scalars
            (``null``, ``true``, ``1e-4``) and type-checked.

    Returns:
        The config (not yet validated: call :meth:`Config.validate`).

    Raises:
        ConfigError: unknown preset, key or section, malformed override, wrong type.
    """
    if preset not in PRESETS:
        raise ConfigError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = PRESETS[preset]()
    if yaml_path is not None:
        try:
            mapping = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"--config {str(yaml_path)!r} is not valid YAML: {err}") from None
        except OSError as err:
            raise ConfigError(f"--config {str(yaml_path)!r} cannot be read: {err}") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"--config {str(yaml_path)!r} must hold a mapping at the top level")
        # A run's saved config.yaml also records the run's identity: not a field.
        mapping.pop(IDENTITY_KEY, None)
        cfg.update(mapping, source=f"--config {yaml_path}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        cfg.set(key.strip(), value, source=f"override {item!r}")
    return cfg
