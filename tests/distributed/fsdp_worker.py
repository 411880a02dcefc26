"""One side of the FSDP2 equivalence test (tests/distributed/test_fsdp.py); run under ``torchrun``
or alone.

Trains the smoke configuration for a few steps on *fixed* rollouts (the bank's trajectories:
the same data whatever the world size, so the global losses must match a single process) with
the real trainer: FSDP2 sharding (under torchrun), micro-batches, gradient sync, clipping, AdamW,
the method's dual update. Then checkpoints (torch.distributed.checkpoint under FSDP2), resumes a
fresh trainer from the checkpoint and re-runs the last step. Rank 0 writes ``OUT``
(``torch.save``): per-step metrics, the resumed step's metrics, the full student and phi
weights, and whether every rank holds identical (gathered) parameters.

Usage: ``[torchrun --nproc-per-node 2] python tests/distributed/fsdp_worker.py RUN_DIR OUT
[key=value ...]`` (the one-process side is also :func:`run`, called in the test's own process).
"""

from __future__ import annotations

import copy
import hashlib
import sys
from typing import Any

import torch
import torch.distributed as dist

from lopd.config import load_config
from lopd.parallel.distributed import is_sharded
from lopd.trainer import Trainer

STEPS = 2
PER_STEP = 4  # trajectories per step across ranks (2 per rank under 2 processes)


class FixedRollouts:
    """A method whose rollouts are given (this rank's share of each step's batch)."""

    def __init__(self, method: Any, batches: list[list[Any]], rank: int, world: int) -> None:
        self.method, self.batches, self.rank, self.world = method, batches, rank, world

    def rollouts(self, step: int) -> list[Any]:
        return [copy.deepcopy(t) for t in self.batches[step][self.rank :: self.world]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if is_sharded(t) else t).detach().cpu()


def _trainer(cfg: Any, resume: bool = False) -> Trainer:
    tr = Trainer(copy.deepcopy(cfg), resume=resume, progress=False)
    tr.setup()
    data = tr.experience.trajectories
    n = len(data)
    batches = [[data[(s * PER_STEP + k) % n] for k in range(PER_STEP)] for s in range(STEPS)]
    tr.method = FixedRollouts(tr.method, batches, tr.dist.rank, tr.dist.world)
    return tr


def run(run_dir: str, out: str, overrides: list[str]) -> None:
    """Train, checkpoint, resume; rank 0 writes the results to ``out``."""
    cfg = load_config(
        "smoke",
        overrides=[f"run_dir={run_dir}", "train.micro_batch=1", "lopd.beta_init=0.5", *overrides],
    )
    tr = _trainer(cfg)
    metrics = []
    for step in range(STEPS):
        if step == STEPS - 1:
            tr.save_checkpoint(step)
        metrics.append(tr.train_step(step))
    named = {f"student.{n}": p for n, p in tr.models.student.named_parameters()}
    phi = tr.models.composer.named_parameters()
    named.update({f"phi.{n}": p for n, p in phi if p.requires_grad})
    weights = {n: _full(p) for n, p in named.items()}  # a collective for sharded parameters
    digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights.values())).hexdigest()
    digests = [digest]
    if dist.is_initialized():
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
    sharded = sum(is_sharded(p) for p in named.values())

    resumed = _trainer(cfg, resume=True)
    start = resumed.load_checkpoint()
    resumed_metrics = resumed.train_step(start)
    if tr.is_main:
        torch.save(
            {
                "world": tr.dist.world,
                "metrics": metrics,
                "resumed_from": start,
                "resumed_metrics": resumed_metrics,
                "weights": weights,
                "ranks_identical": len(set(digests)) == 1,
                "sharded_params": sharded,
                "num_params": len(named),
                "checkpoints": sorted(p.name for p in tr.run_dir.checkpoints.iterdir()),
            },
            out,
        )
    resumed.close()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
