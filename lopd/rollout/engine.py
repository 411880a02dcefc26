"""The trainer's rollout engine: sampling settings, the rollout budget and sharded generation.

Every rollout a method generates goes through :meth:`RolloutEngine.generate`, which counts it
(``rollouts`` in the metrics: the budget all methods are compared at; the experience bank's
base-model rollouts are counted once, on rank 0). Held-out evaluation rollouts are generated
with ``count=False``.

With ``gen.engine=vllm`` the turns come from a :class:`~lopd.rollout.vllm.VLLMRollout`: before each
rollout the engine is given the weights of the model being rolled out (the student, or the frozen
backbone of a :class:`~lopd.latent.conditioned.LatentConditionedLM`, whose latents then enter as
``prompt_embeds``); :meth:`RolloutEngine.weights_updated` marks the student's weights as changed
after an optimizer step. With ``gen.engine=filler`` no model runs: every turn is random ids
(:mod:`lopd.rollout.filler`, for measuring memory at a trajectory length).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lopd.config import GenConfig
from lopd.parallel.fsdp import Sharding
from lopd.parallel.precision import Precision
from lopd.rollout.chat import stop_token_ids
from lopd.rollout.filler import filler_turn_generator
from lopd.rollout.multi_turn import GenerationConfig, TurnGenerator, rollout
from lopd.rollout.vllm import VLLMRollout
from lopd.types import Task, Trajectory

__all__ = ["EmbedsConditionedLM", "RolloutEngine"]


@runtime_checkable
class EmbedsConditionedLM(Protocol):
    """A frozen backbone that generates from per-context input embeddings.

    :class:`lopd.latent.conditioned.LatentConditionedLM` is one: the vLLM engine loads
    ``backbone``'s weights and feeds each prompt as ``prompt_embeds(ids)``, ``[L, d]``.
    """

    backbone: nn.Module

    def prompt_embeds(self, ids: Sequence[int]) -> torch.Tensor: ...


class RolloutEngine:
    """Multi-turn generation for the trainer.

    Args:
        tokenizer: the backbone's tokenizer.
        gen: the ``gen`` section (temperature, top-p, top-k, token and step budgets, the
            rollout batch size).
        sharding: the run's :class:`~lopd.parallel.fsdp.Sharding` (generation gathers sharded
        models). precision: the run's precision; generation runs under its autocast (the student's
            float32 master weights compute in the 16-bit dtype, cast once per rollout call).
        vllm: the vLLM engine (``gen.engine=vllm``); ``None`` generates with the HF path.

    Attributes:
        rollouts: rollouts generated on this rank so far (all phases; see the module docstring).
    """

    def __init__(
        self,
        tokenizer: Any,
        gen: GenConfig,
        sharding: Sharding,
        precision: Precision | None = None,
        vllm: VLLMRollout | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.gen = gen
        self.sharding = sharding
        self.precision = precision
        self.vllm = vllm
        self._rollouts = 0
        # Bumped whenever a model's weights change in place (the vLLM engine reloads then).
        self.weights_version = 0

    @property
    def rollouts(self) -> int:
        """Rollouts counted on this rank so far."""
        return self._rollouts

    def count_rollouts(self, n: int) -> None:
        """Count ``n`` rollouts generated outside :meth:`generate` (the experience bank's,
        which rank 0 collects straight from the backbone)."""
        self._rollouts += n

    def state_dict(self) -> dict[str, int]:
        """The rollout count a resumed run continues from."""
        return {"rollouts": self._rollouts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._rollouts = int(state["rollouts"])

    def weights_updated(self, student: nn.Module | None = None) -> None:
        """The trainer changed weights in place (an optimizer step, a restored checkpoint).

        With the vLLM engine, ``student``'s weights are pushed to it at once, so the next
        rollout does not pay for the sync; any other model is reloaded when next rolled out.
        """
        self.weights_version += 1
        if self.vllm is not None and student is not None:
            self.vllm.load_weights(student, self.weights_version)

    def generation_config(self, temperature: float | None = None) -> Any:
        """:class:`~lopd.rollout.multi_turn.GenerationConfig` of the ``gen`` section
        (``temperature`` overrides the sampling temperature, e.g. for evaluation)."""

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
        """Roll out ``model`` on ``tasks`` (see :func:`lopd.rollout.multi_turn.rollout` for
        ``kwargs``).

        Under FSDP2 every rank must call this together (or inside one
        :meth:`~lopd.parallel.fsdp.Sharding.gathered` block), since the weights are gathered first.

        Args:
            model: a causal LM (the student, the backbone, or a latent-conditioned wrapper).
            tasks: tasks to roll out, one rollout each.
            seed: sampling seed.
            temperature: overrides ``gen.temperature``.
            count: whether the rollouts count toward this rank's budget.
        """

        kwargs.setdefault("batch_size", self.gen.rollout_batch_size)
        autocast = self.precision.autocast() if self.precision is not None else nullcontext()
        with self.sharding.gathered(), autocast:
            if not tasks:
                return []
            if self.vllm is not None:
                kwargs["turn_generator"] = self._vllm_turns(model, seed, temperature)
            elif self.gen.engine == "filler":
                kwargs["turn_generator"] = self.filler_turns(seed)
            trajs = rollout(
                model,
                self.tokenizer,
                list(tasks),
                self.generation_config(temperature),
                seed=seed,
                **kwargs,
            )
        if count:
            self._rollouts += len(trajs)
        return trajs

    def filler_turns(self, seed: int) -> TurnGenerator | None:
        """The turn generator of ``gen.engine=filler`` seeded with ``seed``; ``None`` under any
        other engine (the model decodes)."""
        if self.gen.engine != "filler":
            return None
        return filler_turn_generator(self.tokenizer, seed)

    def _vllm_turns(self, model: nn.Module, seed: int, temperature: float | None) -> Any:
        """The vLLM turn generator for rolling out ``model`` (its weights loaded first)."""

        assert self.vllm is not None
        prompt_embeds = None
        weights = model
        if isinstance(model, EmbedsConditionedLM):
            # The frozen backbone generates; its latents enter through the prompt embeddings.
            weights, prompt_embeds = model.backbone, model.prompt_embeds
        self.vllm.load_weights(weights, self.weights_version)
        return self.vllm.turn_generator(
            self.generation_config(temperature),
            stop_token_ids(self.tokenizer),
            seed=seed,
            prompt_embeds=prompt_embeds,
        )
