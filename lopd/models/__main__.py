"""``python -m lopd.models``: build the tiny default model, or probe what a reference is worth.

* ``build-tiny``: a shipped tiny Qwen3, deterministically from its recipe
  (:data:`lopd.tiny.build.TINY_RECIPES`, :func:`lopd.tiny.build.build_tiny`; ``--recipe
  tiny-qwen3``, the default, writes ``lopd/assets/tiny-qwen3``, ``--recipe tiny-qwen3-formats``
  the five-format reader ``lopd/assets/tiny-qwen3-formats``).
* ``probe-reference``: held-out reward of a model alone, with a retrieved reference trajectory,
  and with a mismatched one (:func:`lopd.tiny.probe.probe_reference`).
* ``probe-formats``: val reward of a model alone and with one reference in each method's
  privileged-context format (:func:`lopd.tiny.probe.probe_formats`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from lopd.atomic import atomic_write_text
from lopd.envs import builtin_tasks, load_tasks_jsonl
from lopd.models.loading import load_model
from lopd.tiny.build import ASSETS_DIR, TINY_RECIPES, build_tiny
from lopd.tiny.formats import FORMATS
from lopd.tiny.probe import format_formats_report, format_report, probe_formats, probe_reference


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``probe-reference`` command line."""
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the tiny)")
    parser.add_argument("--task-seed", type=int, default=0, help="built-in task-set seed")
    parser.add_argument("--tasks", default=None, help="JSONL task file with train/val/test splits")
    parser.add_argument("--splits", nargs="+", default=["val", "test"])
    parser.add_argument("--n", type=int, default=None, help="held-out tasks per split (all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="write the JSON report here")


def _write(report: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(report, indent=1) + "\n")


def run_probe_formats(args: argparse.Namespace) -> int:
    """Run the per-format probe on the built-in val split; prints the table, writes the JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    train = builtin_tasks("tool_use", "train", seed=args.task_seed)
    val = builtin_tasks("tool_use", "val", n=args.n, seed=args.task_seed)
    report = probe_formats(
        model, tokenizer, train, val, formats=args.formats, seeds=args.seeds, emptied=args.emptied
    )
    report["model"] = args.model or "tiny (lopd/assets/tiny-qwen3)"
    report["tasks"] = f"built-in val split, task-set seed {args.task_seed}"
    print(format_formats_report(report))
    _write(report, args.out)
    return 0


def run_probe(args: argparse.Namespace) -> int:
    """Run the probe from parsed arguments; prints the table, optionally writes the JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    if args.tasks:
        tasks = load_tasks_jsonl(args.tasks)
        train = [t for t in tasks if t.split == "train"]
        heldout = {s: [t for t in tasks if t.split == s][: args.n] for s in args.splits}
    else:
        train = builtin_tasks("tool_use", "train", seed=args.task_seed)
        heldout = {
            s: builtin_tasks("tool_use", s, n=args.n, seed=args.task_seed) for s in args.splits
        }
    report = probe_reference(model, tokenizer, train, heldout, seeds=args.seeds)
    report["model"] = args.model or "tiny (lopd/assets/tiny-qwen3)"
    report["tasks"] = args.tasks or f"built-in, task-set seed {args.task_seed}"
    print(format_report(report))
    _write(report, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lopd.models", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-tiny", help="build a shipped tiny model deterministically")
    b.add_argument(
        "--recipe",
        choices=sorted(TINY_RECIPES),
        default="tiny-qwen3",
        help="which shipped model (tiny-qwen3-formats: the five-format reader)",
    )
    b.add_argument("--out", default=None, help="output directory (default: its shipped asset)")
    for flag in ("seed", "threads", "sft-steps", "first-call-steps", "excerpt-steps", "eval-tasks"):
        b.add_argument(f"--{flag}", type=int, default=None, help="override the recipe's")
    b.add_argument(
        "--formats",
        nargs="+",
        choices=[*FORMATS, "all"],
        default=None,
        help="privileged-context formats of the reference episodes (all: every method's)",
    )
    add_probe_arguments(
        sub.add_parser(
            "probe-reference",
            help="base model alone vs with a retrieved reference trajectory (held-out reward)",
        )
    )
    f = sub.add_parser(
        "probe-formats",
        help="base model alone vs with a reference in each method's format (val reward)",
    )
    f.add_argument("--model", default=None, help="checkpoint directory (default: the tiny)")
    f.add_argument("--task-seed", type=int, default=0, help="built-in task-set seed")
    f.add_argument("--n", type=int, default=64, help="val tasks")
    f.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    f.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    f.add_argument(
        "--emptied",
        action="store_true",
        help="each template with nothing in it (the null-context controls' teachers)",
    )
    f.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    f.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.command == "probe-reference":
        return run_probe(args)
    if args.command == "probe-formats":
        return run_probe_formats(args)
    if args.command == "build-tiny":
        flags = ("seed", "threads", "sft_steps", "first_call_steps", "excerpt_steps", "eval_tasks")
        overrides = {k: v for k in flags if (v := getattr(args, k)) is not None}
        if args.formats is not None:
            overrides["formats"] = FORMATS if "all" in args.formats else tuple(args.formats)
        cfg = dataclasses.replace(TINY_RECIPES[args.recipe], **overrides)
        res = build_tiny(cfg, out=args.out or ASSETS_DIR / args.recipe)
        print(
            f"built in {res['seconds']:.0f}s: weights sha256 {res['weights_sha256'][:16]}, "
            f"val reward bare {res['val_reward_bare']}, with reference "
            f"{res['val_reward_reference']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
