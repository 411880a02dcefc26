"""What a training method is, and what it is built from.

A method is one training objective run by :class:`~lopd.trainer.Trainer`: it draws a step's
rollouts, computes the loss of a micro-batch of them, and reacts to the finished optimizer step.
Everything the objective itself must remember across steps (LOPD's dual variable beta, SDPO's EMA
teacher) lives in the method and is saved through its ``state_dict`` in every checkpoint.

A method is built by its :class:`MethodSpec` from a :class:`MethodContext` (the models, the
rollout engine, the task sampler, the bank's retrievals) and the run's config, of which it reads
its own section. The registry of specs is :data:`lopd.methods.METHODS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lopd.config import Config, ConfigError, LOPDConfig
from lopd.latent.experience import Experience
from lopd.latent.growth import BankGrowth
from lopd.latent.teacher import TaskLatents
from lopd.parallel.distributed import Dist
from lopd.rollout.engine import RolloutEngine
from lopd.run.context import Models
from lopd.run.seeds import Stream, seed_of
from lopd.run.tasks import TaskSampler
from lopd.types import Task, Trajectory

__all__ = [
    "DistillSpec",
    "Method",
    "MethodBase",
    "MethodContext",
    "MethodSpec",
]


@dataclass(frozen=True)
class DistillSpec:
    """How the distillation kernel compares student and teacher on the action rows.

    Attributes:
        top_m: M, teacher top-M support plus a tail bucket; ``None`` = the full vocabulary.
        temperature: applied to both logits.
        divergence: ``reverse`` (KL(student || teacher)) or ``forward``.
        fused_linear: compute from final hidden states and the LM heads
            (``fused_linear_topk_tail_kl``, no ``[N, V]`` logits; the default) instead of
            ``topk_tail_kl`` on the heads' logits of the action rows.
    """

    top_m: int | None
    temperature: float
    divergence: str
    fused_linear: bool

    @classmethod
    def of(cls, lopd: LOPDConfig, **changes: Any) -> DistillSpec:
        """The ``lopd`` section's kernel settings, with ``changes`` applied."""
        spec = cls(lopd.top_m, lopd.temperature, lopd.divergence, lopd.fused_linear)
        return dataclasses.replace(spec, **changes)


@dataclass
class MethodContext:
    """What a method is built from.

    Attributes:
        models: the models.
        engine: generates (and counts) rollouts.
        sampler: this rank's share of a step's seeded draws.
        train_tasks: the training split.
        experience: the bank's trajectories and every task's retrieved experiences (methods
            that build a bank), else ``None``.
        latents0: ``task_id -> [J*K, d]`` c_phi0 from the cold start (composer methods).
        latents: c_phi of any task, the composer over the bank's retrievals (composer methods).
        seed: the run seed.
        rank: this process's rank.
        null_context: ``lopd.null_context``: teachers read an emptied privileged context.
        context_format: ``lopd.context_format``: the wording text teachers read their
            privileged context in (``own`` or ``a5``, :mod:`lopd.methods.text_teacher`).
        dist: the process group (a method whose state is built from every rank's rollouts
            gathers through it); ``None``: one process.
        bank_growth: the growing bank (``bank.grow``, :mod:`lopd.latent.growth`), or ``None``.
    """

    models: Models
    engine: RolloutEngine
    sampler: TaskSampler
    train_tasks: list[Task]
    experience: Experience | None = None
    latents0: dict[str, torch.Tensor] | None = None
    latents: TaskLatents | None = None
    seed: int = 0
    rank: int = 0
    null_context: bool = False
    context_format: str = "own"
    dist: Dist | None = None
    bank_growth: BankGrowth | None = None

    def step_tasks(self, step: int, size: int) -> list[Task]:
        """This rank's share of ``size`` training tasks drawn for step ``step``."""
        return self.sampler.draw(self.train_tasks, size, Stream.STEP_TASKS, step)

    def rollout_seed(self, step: int) -> int:
        """The sampling seed of this rank's training rollouts at ``step``."""
        return seed_of(self.seed, Stream.TRAIN_ROLLOUT, step, self.rank)


class Method(Protocol):
    """One training objective (see the module docstring)."""

    def rollouts(self, step: int) -> list[Trajectory]:
        """This rank's training rollouts of step ``step``."""
        ...

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch, already divided by ``num_total`` (the step's trajectories
        over all ranks divided by the world size: this rank's count when the shares are equal,
        :mod:`lopd.parallel.lockstep`), and metric *sums over trajectories* (the trainer
        averages them globally; every micro-batch returns the same keys).

        Under ``model.parallel=fsdp2`` every forward through a sharded model is a collective:
        a micro-batch must run the same sharded forwards whatever its data holds (no skipped
        teacher forward; a placeholder weighted by zero instead). A trajectory whose ``info``
        holds :data:`lopd.parallel.lockstep.PADDING` only keeps the ranks in step: its loss is
        multiplied by zero; the method must not record anything from it."""
        ...

    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        """Called after the optimizer step with the step's global metric means; returns extra
        metrics to log."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The objective's own state a resumed run needs (saved in every checkpoint)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (after the trainer restored the student)."""
        ...


class MethodBase:
    """Defaults for :class:`Method`: one student rollout per drawn task, nothing after the
    step, no state of its own; with a growing bank (``ctx.bank_growth``) the rollouts are
    offered to it, its refresh runs after the step and its state is the method's.

    A subclass that draws its own rollouts passes them to :meth:`observe`; one that overrides
    ``after_step``, ``state_dict`` or ``load_state_dict`` merges the base class's.

    Args:
        ctx: what the method is built from.
        tasks_per_step: rollouts per step across all ranks (``train.tasks_per_step``).
    """

    def __init__(self, ctx: MethodContext, tasks_per_step: int) -> None:
        self.ctx = ctx
        self.models = ctx.models
        self.tasks_per_step = tasks_per_step
        self.bank_growth = ctx.bank_growth

    def rollouts(self, step: int) -> list[Trajectory]:
        """One student rollout of each of this rank's share of ``tasks_per_step`` tasks."""
        ctx = self.ctx
        tasks = ctx.step_tasks(step, self.tasks_per_step)
        trajs = ctx.engine.generate(self.models.student, tasks, seed=ctx.rollout_seed(step))
        self.observe(trajs)
        return trajs

    def observe(self, trajectories: Sequence[Trajectory]) -> None:
        """Offer a step's rollouts to the growing bank (their verified successes join it)."""
        if self.bank_growth is not None:
            self.bank_growth.observe(trajectories)

    def privileged(self, text: str) -> str:
        """The privileged text a teacher template is filled with: ``text``, or nothing under
        ``lopd.null_context`` (the template itself stays, so the control differs from the method
        only in the information the context carries)."""
        return "" if self.ctx.null_context else text

    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError(f"{type(self).__name__} does not define loss()")

    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        return {} if self.bank_growth is None else self.bank_growth.after_step()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.bank_growth is None else {"bank_growth": self.bank_growth.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.bank_growth is not None and "bank_growth" in state:
            self.bank_growth.load_state_dict(state["bank_growth"])


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: how to build it and which phases it needs.

    Attributes:
        name: the ``train.method`` value.
        build: ``(ctx, cfg) -> Method``.
        summary: one line for listings.
        uses_composer: the trainer builds the bank, the composer and its cold start.
        uses_bank: the trainer builds the experience bank (implied by ``uses_composer``).
        group_size: ``cfg -> G`` for methods that roll each task out G times (1 otherwise).
        supports_fsdp2: whether it runs under ``model.parallel=fsdp2``.
        has_teacher: it distils from a teacher with a privileged context (``lopd.null_context``
            can empty it).
        reward_term: its loss has a term on the verified reward (PPO-clip on advantages);
            ``False``: the student only follows its teacher (LOPD, OPSD, SDPO, SDFT).
    """

    name: str
    build: Callable[[MethodContext, Config], Method]
    summary: str
    uses_composer: bool = False
    uses_bank: bool = False
    group_size: Callable[[Config], int] = lambda cfg: 1
    supports_fsdp2: bool = True
    has_teacher: bool = True
    reward_term: bool = True

    @property
    def builds_bank(self) -> bool:
        """Whether the run collects the experience bank (its rollouts count toward the budget)."""
        return self.uses_bank or self.uses_composer

    def check(self, cfg: Config, world: int) -> None:
        """Refuse, before anything is loaded, what this method cannot run with ``cfg`` on
        ``world`` ranks (:meth:`check_teacher_settings`, :meth:`check_parallel`).

        Raises:
            ConfigError: naming the setting.
        """
        self.check_teacher_settings(cfg)
        if cfg.lopd.teacher_backbone != "base" and not self.uses_composer:
            raise ConfigError(
                f"lopd.teacher_backbone={cfg.lopd.teacher_backbone} is the latent teacher's "
                f"setting (lopd, its ablations, lopd-ppo); train.method={self.name} has none"
            )
        self.check_bank_growth(cfg, world)
        self.check_parallel(cfg, world)

    def warnings(self, cfg: Config) -> list[str]:
        """Settings this method runs with but that were measured to go wrong, one line each (the
        trainer prints them at start).

        A latent teacher that moves with the student (``lopd.teacher_backbone`` ``sync`` or
        ``ema``) under a loss without a reward term (LOPD and its ablations): the latents' shift
        is applied on top of a student that already took the last one, step after step, and
        nothing on the verified reward pulls it back (docs/results.md, "LOPD with the synced
        teacher").
        """
        backbone = cfg.lopd.teacher_backbone
        if not self.uses_composer or self.reward_term or backbone == "base":
            return []
        return [
            f"warning: train.method={self.name} with lopd.teacher_backbone={backbone}: the loss "
            "has no reward term to hold a teacher that follows the student; with sync, LOPD fell "
            "to reward 0 on the five-format reader on every seed (docs/results.md); lopd-ppo's "
            "PPO term holds it"
        ]

    def check_bank_growth(self, cfg: Config, world: int) -> None:
        """``bank.grow`` needs a method that reads the bank, in one process.

        Raises:
            ConfigError: naming ``bank.grow``.
        """
        if not cfg.bank.grow:
            return
        if not self.builds_bank:
            raise ConfigError(
                f"bank.grow=true needs a method that reads the experience bank (lopd, its "
                f"ablations, lopd-ppo, opsd, sdft); train.method={self.name} has none"
            )
        if world > 1:
            raise ConfigError(
                f"bank.grow=true runs in one process (got {world} ranks): every rank would grow "
                "its own bank from its own rollouts"
            )

    def check_teacher_settings(self, cfg: Config) -> None:
        """Refuse the settings of a teacher's context where there is no teacher.

        Raises:
            ConfigError: ``lopd.null_context`` or a non-default ``lopd.context_format`` for a
                method without a teacher (GRPO).
        """
        if self.has_teacher:
            return
        if cfg.lopd.null_context:
            raise ConfigError(
                f"lopd.null_context=true needs a method with a teacher; train.method={self.name} "
                "has none (its null-context control is itself)"
            )
        if cfg.lopd.context_format != "own":
            raise ConfigError(
                f"lopd.context_format={cfg.lopd.context_format} needs a method with a teacher; "
                f"train.method={self.name} has none"
            )

    def check_parallel(self, cfg: Config, world: int) -> None:
        """Refuse ``model.parallel=fsdp2`` for a method that does not support it. (Nothing
        needs to split evenly over the ranks: every rank runs the same passes,
        :mod:`lopd.parallel.lockstep`; the cold start runs before the models are sharded.)

        Raises:
            ConfigError: naming the method.
        """
        if cfg.model.parallel != "fsdp2" or world == 1:
            return
        if not self.supports_fsdp2:
            raise ConfigError(f"train.method={self.name} does not support model.parallel=fsdp2")
