"""``python -m lopd.standin --shape NAME --out DIR``: write a random-init stand-in checkpoint of
a real Qwen3 shape (:mod:`lopd.standin.build`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from lopd.standin.build import SHAPES, build_standin


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lopd.standin",
        description="Random-init stand-ins of real Qwen3 checkpoints, built offline.",
    )
    p.add_argument("--shape", default="ci", choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = replace(shape, num_layers=args.layers)
    if args.dtype is not None:
        shape = replace(shape, dtype=args.dtype)
    path = build_standin(args.out, shape, seed=args.seed)
    print(f"wrote {path}: {shape.num_parameters() / 1e6:.1f} M parameters, {shape.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
