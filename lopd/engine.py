"""The trainer's rollout engine: sampling settings, the rollout budget and sharded generation.

Every rollout a method generates goes through :meth:`RolloutEngine.generate`, which counts it
(``rollouts`` in the metrics: the budget all methods are compared at; the experience bank's
base-model rollouts are counted once, on rank 0). Held-out evaluation rollouts are generated
with ``count=False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from torch import nn

from lopd.config import GenConfig
from lopd.fsdp import Sharding
from lopd.precision import Precision
from lopd.types import Task, Trajectory

__all__ = ["RolloutEngine"]


class RolloutEngine:
    """Multi-turn generation for the trainer.

    Args:
        tokenizer: the backbone's tokenizer.
        gen: the ``gen`` section (temperature, top-p, top-k, token and step budgets, the
            rollout batch size).
        sharding: the run's :class:`~lopd.fsdp.Sharding` (generation gathers sharded models).
        precision: the run's precision; generation runs under its autocast (the student's
            float32 master weights compute in the 16-bit dtype, cast once per rollout call).

    Attributes:
        rollouts: rollouts generated on this rank so far (all phases; see the module docstring).
    """

    def __init__(
        self,
        tokenizer: Any,
        gen: GenConfig,
        sharding: Sharding,
        precision: Precision | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.gen = gen
        self.sharding = sharding
        self.precision = precision
        self.rollouts = 0

    def generation_config(self, temperature: float | None = None) -> Any:
        """:class:`~lopd.rollout.GenerationConfig` of the ``gen`` section (``temperature``
        overrides the sampling temperature, e.g. for evaluation)."""
        from lopd.rollout import GenerationConfig

        g = self.gen
        return GenerationConfig(
            temperature=g.temperature if temperature is None else temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_new_tokens_per_turn=g.max_new_tokens,
            max_total_tokens=g.max_total_tokens,
            max_steps=g.max_steps,
        )

    def generate(
        self,
        model: nn.Module,
        tasks: Sequence[Task],
        seed: int,
        temperature: float | None = None,
        count: bool = True,
        **kwargs: Any,
    ) -> list[Trajectory]:
        """Roll out ``model`` on ``tasks`` (see :func:`lopd.rollout.rollout` for ``kwargs``).

        Under FSDP2 every rank must call this together (or inside one
        :meth:`~lopd.fsdp.Sharding.gathered` block), since the weights are gathered first.

        Args:
            model: a causal LM (the student, the backbone, or a latent-conditioned wrapper).
            tasks: tasks to roll out, one rollout each.
            seed: sampling seed.
            temperature: overrides ``gen.temperature``.
            count: whether the rollouts count toward this rank's budget.
        """
        from lopd.rollout import rollout

        kwargs.setdefault("batch_size", self.gen.rollout_batch_size)
        autocast = self.precision.autocast() if self.precision is not None else nullcontext()
        with self.sharding.gathered(), autocast:
            if not tasks:
                return []
            trajs = rollout(
                model,
                self.tokenizer,
                list(tasks),
                self.generation_config(temperature),
                seed=seed,
                **kwargs,
            )
        if count:
            self.rollouts += len(trajs)
        return trajs
