"""Every rank runs the same forward-backward passes in a step, whatever its rollouts hold.

Under FSDP2 every forward through a sharded model all-gathers its parameters and every backward
reduce-scatters their gradients: collectives that every rank must run, in the same order. A rank
that runs one pass fewer than another (fewer trajectories, so fewer micro-batches; or none at
all) leaves the others waiting for ever. So before its micro-batches the trainer agrees with the
other ranks on a :class:`StepPlan` (one small all-gather of the trajectory counts):

* every rank runs ``micro_batches`` passes, the most any rank needs; a rank with fewer
  trajectories runs the remaining passes on a *padding* trajectory whose loss is multiplied by
  zero (the same modules, the same collectives, zero gradient) and whose metrics are dropped;
* a rank with no trajectory at all pads with a copy of another rank's first trajectory (a second
  collective, run only in that case, which every rank knows from the counts);
* every loss is divided by ``total / world`` (:attr:`StepPlan.divisor`) rather than by the rank's
  own count: averaged over ranks, the gradient is then the mean over *all* the step's
  trajectories, as one process would compute it, however unevenly they are split.

Within a pass a method must not branch on its data in a way that changes which sharded modules
run or receive a gradient (a micro-batch with no action tokens, no guided or distilled
trajectory): such a branch runs on a placeholder instead, scaled by zero (the methods do this,
:func:`lopd.methods.rows.keep_graph`). docs/trainer.md states the invariant.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from lopd.parallel.distributed import Dist
from lopd.types import Trajectory

__all__ = ["PADDING", "StepPlan", "plan_step"]

PADDING = "padding"
"""``Trajectory.info`` key marking a padding trajectory: scored to keep the ranks' collectives
in step, its loss multiplied by zero; a method must not record anything from it."""


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How one step's micro-batches line up across ranks.

    Attributes:
        micro_batches: forward-backward passes every rank runs.
        counts: every rank's number of trajectories, in rank order.
        divisor: ``sum(counts) / world``: what each micro-batch's loss is divided by
            (``num_total`` of :meth:`lopd.methods.base.Method.loss`).
        padding: the trajectory of this rank's padding passes (``None`` when it needs none).
    """

    micro_batches: int
    counts: tuple[int, ...]
    divisor: float
    padding: Trajectory | None

    def batch(self, trajectories: Sequence[Trajectory], index: int, size: int) -> list[Trajectory]:
        """The ``index``-th micro-batch of ``size``: this rank's trajectories, or ``[padding]``
        past their end."""
        real = list(trajectories[index * size : (index + 1) * size])
        if real:
            return real
        assert self.padding is not None, "a padding pass without a padding trajectory"
        return [self.padding]


def _as_padding(traj: Trajectory) -> Trajectory:
    pad = copy.deepcopy(traj)
    pad.info[PADDING] = True
    return pad


def plan_step(dist: Dist, trajectories: Sequence[Trajectory], micro_batch: int) -> StepPlan:
    """Agree on the step's passes with the other ranks (every rank calls it; module docstring).

    Args:
        dist: the process group facts (one process: no collective).
        trajectories: this rank's trajectories of the step.
        micro_batch: ``train.micro_batch``.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    counts = tuple(int(c) for c in dist.all_gather_object(len(trajectories)))
    passes = [-(-c // micro_batch) for c in counts]
    most = max(passes)
    padding = None
    if 0 in counts and most > 0:
        # A rank without trajectories pads with the first trajectory of the first rank that has
        # one (every rank takes part: the counts said the same to all of them).
        donor = next(r for r, c in enumerate(counts) if c)
        offered = dist.all_gather_object(trajectories[0] if dist.rank == donor else None)
        if not trajectories:
            padding = _as_padding(offered[donor])
    if padding is None and passes[dist.rank] < most:
        padding = _as_padding(trajectories[0])
    return StepPlan(most, counts, sum(counts) / len(counts), padding)
