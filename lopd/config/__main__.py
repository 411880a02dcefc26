"""``python -m lopd.config --write-presets``: regenerate the preset YAML files; ``--check``:
exit 1 if any of them is out of date."""

from __future__ import annotations

import argparse

from lopd.atomic import atomic_write_text
from lopd.config.presets import PRESET_DIR, PRESETS, preset_yaml


def main(argv: list[str] | None = None) -> int:
    """``python -m lopd.config --write-presets``: regenerate ``lopd/config/yaml/*.yaml``;
    ``--check``: exit 1 if any of them is out of date."""
    p = argparse.ArgumentParser(prog="python -m lopd.config")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-presets", action="store_true", help="regenerate the YAML files")
    group.add_argument("--check", action="store_true", help="fail if a YAML file is stale")
    args = p.parse_args(argv)
    stale = []
    for name in PRESETS:
        path = PRESET_DIR / f"{name}.yaml"
        text = preset_yaml(name)
        if args.write_presets:
            atomic_write_text(path, text)
            print(f"wrote {path}")
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path))
    if stale:
        print("stale (run python -m lopd.config --write-presets): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
