"""What every phase of a run is given: its models, configuration, directory, engine and seeds.

The trainer builds one :class:`RunContext` once the models, the rollout engine and the tasks are
loaded, and hands it to each phase: the bank (:func:`lopd.latent.experience.build_experience`),
the cold start (:func:`lopd.latent.cold_start.cold_start`), the method
(:class:`lopd.methods.base.MethodContext`) and the held-out evaluation
(:class:`lopd.eval.held_out.HeldOutEvaluator`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lopd.config import Config
from lopd.parallel.distributed import Dist
from lopd.parallel.fsdp import Sharding
from lopd.parallel.precision import Precision
from lopd.rollout.engine import RolloutEngine
from lopd.run.memory_account import MemoryAccount
from lopd.run.run_dir import RunDir
from lopd.run.tasks import TaskSampler
from lopd.types import Task

__all__ = ["Models", "RunContext"]


@dataclass
class Models:
    """The run's models.

    Attributes:
        student: the trained ``*ForCausalLM`` (theta).
        backbone: the frozen base ``*ForCausalLM``: the teacher, and the composer encoder's base
            (with peft's LoRA injected when there is a composer).
        composer: the latent composer phi (:class:`lopd.latent.composer.LatentComposer`), or
            ``None`` for methods without one; set once the bank is built (its retriever embeds
            with the backbone before the LoRA is injected).
        tokenizer: the backbone's tokenizer.
        pad_id: padding id (also the latent placeholder id).
        device: where the models live.
        sharding: FSDP2 sharding of the models (a no-op unless ``model.parallel=fsdp2``).
    """

    student: nn.Module
    backbone: nn.Module
    composer: nn.Module | None
    tokenizer: Any
    pad_id: int
    device: torch.device
    sharding: Sharding

    def hidden_states(self, model: nn.Module, **kwargs: Any) -> torch.Tensor:
        """Final hidden states ``[B, L, d]`` of ``model``'s decoder (never ``[B, L, V]`` logits);
        ``kwargs`` are the decoder's (``input_ids`` or ``inputs_embeds``, ``attention_mask``)."""
        return self.sharding.hidden_states(model, **kwargs)


@dataclass
class RunContext:
    """One run as its phases see it.

    Attributes:
        cfg: the validated run configuration (seeds: ``cfg.seed`` with :mod:`lopd.run.seeds`).
        run_dir: every file the run writes.
        dist: this process's rank, device and collectives.
        precision: which dtype stores and computes what.
        models: the run's models.
        engine: generates (and counts) every rollout.
        sampler: this rank's share of every seeded draw of tasks or data.
        train_tasks: the training split (after the token-budget check).
        test_tasks: the held-out split.
        memory: the per-phase memory account (``--profile-memory``).
        log: progress messages (rank 0 prints).
        progress: show progress bars (rank 0 only).
    """

    cfg: Config
    run_dir: RunDir
    dist: Dist
    precision: Precision
    models: Models
    engine: RolloutEngine
    sampler: TaskSampler
    train_tasks: list[Task]
    test_tasks: list[Task]
    memory: MemoryAccount
    log: Callable[[str], None] = print
    progress: bool = False

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def bar(self, iterable: Iterable[Any], **kwargs: Any) -> Any:
        """``iterable`` behind a progress bar when ``progress`` is on."""
        return tqdm(iterable, disable=not self.progress, **kwargs)
