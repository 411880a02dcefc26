"""Memory of a real-checkpoint-shaped run, per phase: the README's stand-in table.

    python -m benchmarks.bench_standin_memory --shape 218m --out /tmp/mem          # fp32, 4 layers
    python -m benchmarks.bench_standin_memory --shape qwen3-0.6b --out /tmp/mem \
        data.n_train=4 data.n_test=2 train.steps=2 \
        model.gradient_checkpointing=true train.micro_batch=1   # 28 layers; fits 24 GiB on CPU
    python -m benchmarks.bench_standin_memory --shape qwen3-0.6b --out /tmp/mem \
        --trajectory-tokens 8192 model.gradient_checkpointing=true   # every trajectory 8,192
    python -m benchmarks.bench_standin_memory --report /tmp/mem/run-218m           # table only

Builds the random-init stand-in (:mod:`lopd.standin`) into ``OUT/standin-<shape>`` unless it is
there, runs the smoke preset on it with ``--profile-memory`` and a short budget in a fresh
process (so the resident-set peaks are this run's), and prints one markdown row per phase of
``memory.jsonl``: the expected bytes (weights, gradients and AdamW moments counted from the
parameters, plus the interpreter's resident set before loading), what autograd saved for the
backward, the measured peak and end-of-phase resident set, and what ``malloc_trim`` gave back.

``--trajectory-tokens L`` measures at a trajectory length instead of at whatever the random
model decodes: the turns come from the filler (``gen.engine=filler``, :mod:`lopd.rollout.filler`:
random ids, no decoding), every trajectory is exactly ``L`` tokens, and the budget shrinks to
what a peak needs (:data:`AT_LENGTH`: one cold-start step of one trajectory, one training step of
one trajectory per micro-batch). Its run directory is ``OUT/run-<shape>-<L>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

GIB = 2.0**30
SHORT = ["data.n_train=4", "data.n_test=2", "train.steps=2"]
"""The default short budget: 4 bank rollouts, 2 training steps, 2 held-out tasks."""
AT_LENGTH = [
    "data.n_train=4", "data.n_test=2", "cold_start.steps=1", "cold_start.batch_size=1",
    "train.steps=1", "train.tasks_per_step=1", "train.micro_batch=1", "gen.max_steps=1",
]  # fmt: skip
"""The budget of ``--trajectory-tokens``: every phase once, one trajectory at a time."""


def at_length(tokens: int) -> list[str]:
    """The overrides that make every trajectory exactly ``tokens`` long (the filler's one turn
    fills what the prompt leaves), with the :data:`AT_LENGTH` budget."""
    return [
        "gen.engine=filler",
        f"gen.max_total_tokens={tokens}",
        f"gen.max_new_tokens={tokens - 1}",
        f"gen.max_prompt_tokens={min(2048, tokens - 2)}",
        *AT_LENGTH,
    ]


def report(run_dir: Path) -> str:
    """The markdown table of ``run_dir/memory.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "memory.jsonl").read_text().splitlines()]
    load = next(r for r in rows if r["phase"] == "load")
    student = load["weights_by_part"]["student"]
    lines = [
        "| phase | expected: weights + grads + AdamW + runtime | saved activations | measured "
        "peak | at phase end | allocator retained |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        weights, optimizer = r["weights"], r["optimizer"]
        # During a step the float32 gradients of everything trained exist until the update.
        trained = (student + r["weights_by_part"].get("phi", 0)) if r["phase"] == "step" else 0
        expected = weights + trained + optimizer + r["runtime"]
        name = r["phase"] + (f" {r['step']}" if "step" in r else "")
        lines.append(
            f"| {name} | {expected / GIB:.2f} GiB ({weights / GIB:.2f} + {trained / GIB:.2f} + "
            f"{optimizer / GIB:.2f} + {r['runtime'] / GIB:.2f}) | {r['activations'] / GIB:.2f} "
            f"GiB | {r['peak'] / GIB:.2f} GiB | {r['now'] / GIB:.2f} GiB | "
            f"{r['allocator'] / GIB:.2f} GiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_standin_memory")
    p.add_argument("--shape", default="218m", help="a name in lopd.standin.build.SHAPES")
    p.add_argument("--out", default="/tmp/lopd-memory", help="stand-ins and run directories")
    p.add_argument("--report", default=None, help="print the table of an existing run dir")
    p.add_argument(
        "--trajectory-tokens",
        type=int,
        default=None,
        help="measure with every trajectory this long (random-id turns, no decoding)",
    )
    p.add_argument("overrides", nargs="*", help=f"trainer overrides (default: {' '.join(SHORT)})")
    args = p.parse_intermixed_args(argv)
    if args.report:
        print(report(Path(args.report)))
        return 0
    from lopd.standin.build import build_standin

    out = Path(args.out)
    model = out / f"standin-{args.shape}"
    if not (model / "config.json").exists():
        build_standin(model, args.shape)
    run = out / f"run-{args.shape}"
    overrides = args.overrides or SHORT
    if args.trajectory_tokens is not None:
        if args.trajectory_tokens < 4:
            p.error(f"--trajectory-tokens must be >= 4, got {args.trajectory_tokens}")
        run = out / f"run-{args.shape}-{args.trajectory_tokens}"
        overrides = [*at_length(args.trajectory_tokens), *args.overrides]
    if run.exists():  # a fresh run: an existing one would load its bank and cold start
        shutil.rmtree(run)
    cmd = [
        sys.executable, "-m", "lopd.train", "--preset", "smoke", "--model", str(model),
        "--run-dir", str(run), "--no-progress", "--profile-memory", *overrides,
    ]  # fmt: skip
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env)
    print(report(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
