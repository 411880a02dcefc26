"""``python -m lopd.train``: run LOPD end to end and print vanilla vs LOPD held-out reward.

Usage::

    python -m lopd.train                                   # the tiny default (<= 15 min, 2 CPUs)
    python -m lopd.train --preset smoke --run-dir /tmp/s   # seconds; every phase runs
    python -m lopd.train --preset paper --model /ckpt/Qwen3-4B --tasks tasks.jsonl
    python -m lopd.train --config my.yaml lopd.margin=0.1 train.steps=50
    python -m lopd.train --preset smoke --profile-memory   # memory account per phase
    python -m lopd.train --run-dir runs/x --resume         # continue a killed run
    python -m lopd.train --run-dir runs/x --overwrite      # delete the run there, start anew
    torchrun --nproc-per-node 2 -m lopd.train --preset smoke   # data parallel (gloo on CPU)
    torchrun --nproc-per-node 8 -m lopd.train --preset paper --model M model.parallel=fsdp2

Phases: experience bank (base-model rollouts, cached in the run directory), composer cold start,
LOPD joint training, held-out evaluation of the vanilla and the trained student (and of the
frozen base model with latents). Read on in :mod:`lopd.trainer` (``Trainer.train_step``) and
:mod:`lopd.methods.lopd`; configuration in :mod:`lopd.config`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lopd.config import PRESETS, ConfigError, load_config
from lopd.parallel.watchdog import StoppedBySignal, sigterm_raises
from lopd.run.claim import read_saved_run
from lopd.run.host_memory import configure_host_memory
from lopd.run.run_dir import RunDir, RunDirError
from lopd.trainer import Trainer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lopd.train",
        description="Latent On-Policy Self-Distillation: bank, cold start, LOPD, evaluation.",
    )
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="base config")
    p.add_argument("--config", default=None, help="YAML file applied over the preset")
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint (model.path)")
    p.add_argument("--tasks", default=None, help="tasks JSONL file (data.tasks_path)")
    p.add_argument("--run-dir", default=None, help="output directory (run_dir)")
    p.add_argument(
        "--method",
        default=None,
        help="training objective (train.method), a name in lopd.methods.METHODS: lopd, its "
        "ablations or a baseline",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue the run in --run-dir (newest checkpoint)"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run found in --run-dir and start a new one (a fresh run refuses a "
        "directory that holds a run)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--profile-memory",
        action="store_true",
        help="log a memory account per phase to memory.jsonl (profile_memory=true)",
    )
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.steps=5")
    # Intermixed: overrides may come before, between or after the options
    # (`python -m lopd.train train.steps=5 --run-dir x seed=1`).
    return p.parse_intermixed_args(argv)


def build_config(args: argparse.Namespace):
    """Preset -> YAML -> CLI flags -> ``key=value`` overrides, then start-up validation."""
    overrides = list(args.overrides)
    if args.model is not None:
        overrides.insert(0, f"model.path={json.dumps(args.model)}")
    if args.tasks is not None:
        overrides.insert(0, f"data.tasks_path={json.dumps(args.tasks)}")
    if args.run_dir is not None:
        overrides.insert(0, f"run_dir={json.dumps(args.run_dir)}")
    if args.method is not None:
        overrides.insert(0, f"train.method={json.dumps(args.method)}")
    if args.profile_memory:
        overrides.insert(0, "profile_memory=true")
    cfg = load_config(args.preset, args.config, overrides)
    if args.resume:
        # A resumed run continues with the configuration it was started with (saved in its run
        # directory, checked whole and unedited); command-line overrides still apply on top.
        run_dir = RunDir(cfg.run_dir)
        read_saved_run(run_dir)
        cfg = load_config(args.preset, run_dir.config, overrides)
    cfg.validate()
    return cfg


def _failure(trainer: Trainer, err: BaseException) -> Exception | None:
    """The one-line failure of ``err`` under torchrun (``None``: another error), also when
    the launcher's SIGTERM interrupts it before it has begun."""
    try:
        return trainer.dist.failure(err)
    except StoppedBySignal:
        return trainer.dist.failure(err)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_host_memory()  # before any model is loaded
    try:
        cfg = build_config(args)

        trainer = Trainer(
            cfg, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite
        )
        try:
            # Under torchrun: a failed collective, a lost or stuck rank, or the launcher's
            # SIGTERM is one line naming the ranks and phases (lopd.parallel.watchdog); the
            # SIGTERM handler stays while the line is written (the launcher sends it then).
            with sigterm_raises(trainer.dist.board):
                try:
                    summary = trainer.run()
                except BaseException as err:
                    failure = _failure(trainer, err)
                    if failure is None:
                        raise
                    print(f"lopd.train: {failure}", file=sys.stderr, flush=True)
                    return 1
        finally:
            trainer.close()
    except ConfigError as err:
        print(f"lopd.train: config error: {err}", file=sys.stderr)
        return 2
    except RunDirError as err:
        print(f"lopd.train: {err}", file=sys.stderr)
        return 2
    if trainer.is_main:
        v, lo = summary["vanilla"], summary["lopd"]
        print(
            f"held-out reward  vanilla {v['reward_mean']:.3f} ± {v['reward_stderr']:.3f}  |  "
            f"{cfg.train.method} {lo['reward_mean']:.3f} ± {lo['reward_stderr']:.3f}  (n={lo['n']})"
        )
        print(
            f"success rate     vanilla {v['success_rate']:.3f}  |  "
            f"{cfg.train.method} {lo['success_rate']:.3f}"
        )
        for key, label in (("base_composer_phi0", "phi_0"), ("base_composer", "trained phi")):
            if key in summary:
                bc = summary[key]
                print(
                    f"base + composer  {bc['reward_mean']:.3f} ± {bc['reward_stderr']:.3f}"
                    f"  ({label})"
                )
        print(
            f"rollouts {summary['rollouts']}, wall {summary['wall_seconds']:.1f} s, "
            f"run dir {cfg.run_dir}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
