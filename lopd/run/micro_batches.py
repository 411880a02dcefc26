"""A step's losses and backwards, micro-batch by micro-batch, in step with the other ranks.

:func:`backward_micro_batches` runs the passes of a :class:`~lopd.parallel.lockstep.StepPlan`:
this rank's micro-batches, then its padding passes (loss scaled by zero, metrics dropped), and
under FSDP2 each loss reaches every sharded output its forwards produced, so that every rank
runs the same forwards and backwards whatever its rollouts hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from lopd.parallel.distributed import Dist
from lopd.parallel.fsdp import Sharding, reach
from lopd.parallel.lockstep import PADDING, plan_step
from lopd.types import Trajectory

__all__ = ["StepLoss", "backward_micro_batches"]


class _Scored(Protocol):
    """The part of a training method used here (:meth:`lopd.methods.base.Method.loss`)."""

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: float
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclasses.dataclass
class StepLoss:
    """This rank's share of a step's loss.

    Attributes:
        loss_sum: the sum over this rank's trajectories of their loss (the global mean is the
            all-reduced sum over the global count).
        sums: the methods' metric sums over this rank's trajectories (the same keys on every
            rank that ran a pass).
    """

    loss_sum: float
    sums: dict[str, float]


def backward_micro_batches(
    dist: Dist,
    sharding: Sharding,
    method: _Scored,
    trajectories: Sequence[Trajectory],
    micro_batch: int,
    backward: Callable[[torch.Tensor], None],
    scopes: Callable[[], Sequence[contextlib.AbstractContextManager]] = tuple,
) -> StepLoss:
    """The loss and backward of every pass of the step's plan, agreed with the other ranks
    (:func:`lopd.parallel.lockstep.plan_step`, a collective).

    Args:
        dist: the process group facts.
        sharding: the models' FSDP2 sharding (every sharded output the loss reads gets a
            gradient path, :meth:`~lopd.parallel.fsdp.Sharding.outputs_reached`).
        method: the training method (its ``loss``).
        trajectories: this rank's trajectories of the step.
        micro_batch: ``train.micro_batch``.
        backward: the backward of a loss (:meth:`lopd.run.optim.Optimizers.backward`).
        scopes: the contexts of each loss (autocast, the memory account), made anew per pass.
    """
    plan = plan_step(dist, trajectories, micro_batch)
    out = StepLoss(0.0, {})
    for i in range(plan.micro_batches):
        mb = plan.batch(trajectories, i, micro_batch)
        with contextlib.ExitStack() as stack:
            for scope in scopes():
                stack.enter_context(scope)
            outputs = stack.enter_context(sharding.outputs_reached())
            loss, mb_sums = method.loss(mb, num_total=plan.divisor)
            if outputs:  # FSDP2 only
                loss = loss + reach(outputs)
        padding = PADDING in mb[0].info
        backward(loss * 0.0 if padding else loss)
        if padding:  # the metric keys only (every rank reduces the same keys)
            out.sums.update((k, out.sums.get(k, 0.0)) for k in mb_sums)
            continue
        out.loss_sum += loss.item() * plan.divisor
        for k, v in mb_sums.items():
            out.sums[k] = out.sums.get(k, 0.0) + v
    return out
