"""Write a built-in task set to a JSONL file: ``python -m lopd.envs export --seed 7 --out f``.

The file holds the train, val and test splits of the tool-use worlds for one task-set seed (each
line a :class:`~lopd.types.Task` with its database seed, checks and oracle), in the format every
``--tasks`` option reads (:func:`lopd.envs.load_tasks_jsonl`). Use it to rerun training or the
comparison on tasks the defaults were not tuned on, or as a template for your own tasks.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lopd.envs import builtin_tasks, save_tasks_jsonl
from lopd.envs.tool_use_tasks import SPLITS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lopd.envs", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a built-in tool-use task set (all splits)")
    e.add_argument("--seed", type=int, default=0, help="task-set seed")
    e.add_argument("--out", required=True, help="JSONL file to write")
    e.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    args = parser.parse_args(argv)
    tasks = [t for split in args.splits for t in builtin_tasks("tool_use", split, seed=args.seed)]
    save_tasks_jsonl(tasks, args.out)
    counts = ", ".join(f"{s} {sum(t.split == s for t in tasks)}" for s in args.splits)
    print(f"wrote {len(tasks)} tasks ({counts}) of task-set seed {args.seed} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
