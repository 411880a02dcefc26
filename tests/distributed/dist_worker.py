"""One ``torchrun`` launch of tests/distributed/test_distributed_methods.py: several methods, real
rollouts.

For each method named, every rank builds the smoke trainer in ``OUT/<method>`` (its bank and cold
start copied from ``SHARED``, built once by the test), trains ``STEPS`` steps on its own real
rollouts, and rank 0 writes ``OUT/<method>.pt``: the per-step metrics, every rank's rollouts of
every step (what a one-process replay needs), whether all ranks hold identical parameters,
every rank's method state (Skill-SD's bank and UCB statistics), and for methods with an EMA
teacher whether it comes back identical from a checkpoint.

``--zero-actions RANK:STEP`` empties the action masks of that rank's first micro-batch at that
step (a micro-batch with no action token: nothing to score, and still the same collectives).

Usage: ``torchrun --nproc-per-node N tests/distributed/dist_worker.py SHARED OUT --methods lopd,grpo
[--zero-actions 1:0] [key=value ...]``. :func:`replay` is the one-process side (called in the
test's own process).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import shutil
from pathlib import Path
from typing import Any

import torch

import lopd.methods.skill_sd as skill_sd
from lopd.config import load_config
from lopd.methods import METHODS
from lopd.parallel.distributed import is_sharded
from lopd.trainer import Trainer

STEPS = 2
SHARED_FILES = ("bank", "phi0.pt", "latents0.pt")


def copy_shared(shared: Path, run_dir: Path) -> None:
    """The bank and cold start of ``shared`` into a fresh ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in SHARED_FILES:
        src = shared / name
        if src.exists() and not (run_dir / name).exists():
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, run_dir / name)


def config(run_dir: Path, method: str, overrides: list[str]) -> Any:
    """The smoke preset for ``method`` with the launch's overrides; ``lopd.teacher_backbone``
    only for the methods with LOPD's latent teacher (the others refuse it)."""
    if not METHODS[method].uses_composer:
        overrides = [o for o in overrides if not o.startswith("lopd.teacher_backbone=")]
    return load_config(
        "smoke", overrides=[f"run_dir={run_dir}", f"train.method={method}", *overrides]
    )


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if is_sharded(p) else p  # a collective for sharded parameters
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _zero_actions(trajs: list[Any], micro_batch: int) -> None:
    for t in trajs[:micro_batch]:
        t.action_mask = [0] * len(t.action_mask)


def _teacher_copy(method) -> torch.nn.Module | None:
    """The method's teacher weights that move with training (an EMA or synced copy), if any:
    SDPO's, SDFT's and Skill-SD's ``EMATeacher``; LOPD's ``TeacherBackbone`` (``None`` for the
    frozen base)."""
    teacher = getattr(method, "teacher", None)
    if teacher is None:
        return None
    return teacher.get() if hasattr(teacher, "get") else teacher.model()


def train(shared: Path, out: Path, method: str, overrides: list[str], zero: tuple | None) -> None:
    run_dir = out / method
    cfg = config(run_dir, method, overrides)
    tr = Trainer(copy.deepcopy(cfg), progress=False)
    if tr.is_main and METHODS[method].builds_bank:
        copy_shared(shared, run_dir)
    tr.dist.barrier()
    tr.setup()
    rank, world = tr.dist.rank, tr.dist.world
    produced: list[list[Any]] = []
    rollouts = tr.method.rollouts

    def recorded(step: int) -> list[Any]:
        trajs = rollouts(step)
        if zero is not None and zero == (rank, step):
            _zero_actions(trajs, cfg.train.micro_batch)
        produced.append(copy.deepcopy(trajs))
        return trajs

    tr.method.rollouts = recorded
    metrics = [tr.train_step(step) for step in range(STEPS)]
    digests = tr.dist.all_gather_object(_digest(tr.models.student))
    per_rank = tr.dist.all_gather_object(produced)
    states = tr.dist.all_gather_object(tr.method.state_dict() if method == "skill-sd" else {})
    teacher = _teacher_copy(tr.method)
    resumed_teacher = None
    if teacher is not None:
        # The EMA teacher through a checkpoint (under FSDP2 gathered whole, then resharded).
        tr.save_checkpoint(STEPS)
        again = Trainer(copy.deepcopy(cfg), resume=True, progress=False)
        again.setup()
        assert again.load_checkpoint() == STEPS
        resumed_teacher = _digest(_teacher_copy(again.method)) == _digest(teacher)
    if tr.is_main:
        torch.save(
            {
                "world": world,
                "metrics": metrics,
                # rollouts[step][rank]: that rank's trajectories of the step
                "rollouts": [[per_rank[r][s] for r in range(world)] for s in range(STEPS)],
                "ranks_identical": len(set(digests)) == 1,
                "method_states": states,
                "resumed_teacher_identical": resumed_teacher,
            },
            out / f"{method}.pt",
        )


class FixedRollouts:
    """A method whose rollouts are given."""

    def __init__(self, method: Any, batches: list[list[Any]]) -> None:
        self.method, self.batches = method, batches

    def rollouts(self, step: int) -> list[Any]:
        return copy.deepcopy(self.batches[step])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


def _one_process_order(shares: list[list[Any]]) -> list[Any]:
    """Every rank's rollouts of a group method in one process's order: rank r's k-th group is
    the step's group k * world + r (the sampler deals draw[rank::world]); ``info["group"]``
    renumbered to that index."""
    world, groups = len(shares), []
    for r, share in enumerate(shares):
        for t in share:
            t = copy.deepcopy(t)
            t.info["group"] = t.info["group"] * world + r
            groups.append(t)
    return sorted(groups, key=lambda t: t.info["group"])  # stable: a group keeps its order


def replay(shared: Path, out: Path, method: str, overrides: list[str]) -> tuple[list, Any]:
    """One process trained on the distributed run's rollouts: every rank's, in one process's
    order. Returns the per-step metrics and the method (Skill-SD: its own rollouts() runs on
    them, choosing skills and writing its bank)."""
    done = torch.load(out / f"{method}.pt", weights_only=False)
    run_dir = out / f"{method}-one"
    copy_shared(shared, run_dir)
    tr = Trainer(config(run_dir, method, overrides), progress=False)
    tr.setup()
    group = METHODS[method].group_size(tr.cfg) > 1
    batches = [
        _one_process_order(shares) if group else [t for share in shares for t in share]
        for shares in done["rollouts"]
    ]
    if method != "skill-sd":
        tr.method = FixedRollouts(tr.method, batches)
        return [tr.train_step(step) for step in range(STEPS)], tr.method
    real = skill_sd.group_rollouts
    skill_sd.group_rollouts = lambda ctx, step, *_: copy.deepcopy(batches[step])
    try:
        return [tr.train_step(step) for step in range(STEPS)], tr.method
    finally:
        skill_sd.group_rollouts = real


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shared", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--methods", required=True, help="comma-separated")
    p.add_argument("--zero-actions", default=None, help="RANK:STEP")
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args()
    zero = tuple(int(x) for x in args.zero_actions.split(":")) if args.zero_actions else None
    for method in args.methods.split(","):
        train(args.shared, args.out, method, args.overrides, zero)


if __name__ == "__main__":
    main()
