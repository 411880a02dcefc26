"""Held-out evaluation: the student alone, and the frozen base model generating with latents.

:class:`HeldOutEvaluator` is the trainer's evaluation phase (rank 0 evaluates, the other ranks
wait): ``vanilla`` (the student before training), ``lopd`` (the trained student),
``base_composer`` (the frozen base model generating with retrieved latents, through
:mod:`lopd.latent.conditioned`), ``student_composer`` (the trained student generating with the
same latents) and ``teacher_composer`` (the latent teacher's own weights with them: a copy that
followed the student, ``lopd.teacher_backbone``, else the frozen base). Metrics:
:func:`lopd.eval.summary.summarize`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lopd.atomic import atomic_write_text
from lopd.envs import make_env
from lopd.eval.summary import summarize
from lopd.latent.conditioned import LatentConditionedLM, LatentPromptEnv, find_run
from lopd.latent.teacher import TaskLatents
from lopd.rollout.chat import render_prompt
from lopd.run.context import RunContext
from lopd.run.seeds import Stream, seed_of
from lopd.types import Task, Trajectory

__all__ = ["HeldOutEvaluator"]

_NOT_METRICS = ("seconds", "task_rewards")
"""Evaluation results that are not per-step scalar metrics."""
_TEACHER_CURVE = ("reward_mean", "reward_stderr", "success_rate")
"""What the latent teacher's evaluations along the run log (``eval.teacher_curve``)."""


class HeldOutEvaluator:
    """Evaluation on the held-out split (rank 0 generates; the other ranks wait).

    Args:
        ctx: the run (its models, engine, held-out tasks, precision and ranks). Every evaluation
            of a run uses the same seed (``Stream.EVAL``) and ``eval.temperature`` (0 = greedy).
        latents: c_phi of any task, for ``base_composer`` (``None`` without a composer).
        teacher_model: ``() ->`` the latent teacher's weights when they moved, ``None`` for the
            frozen base (the method's ``teacher_model``); ``None``: always the frozen base.
    """

    def __init__(
        self,
        ctx: RunContext,
        latents: TaskLatents | None = None,
        teacher_model: Callable[[], nn.Module | None] | None = None,
    ) -> None:
        self.ctx, self.latents = ctx, latents
        self.teacher_model = teacher_model
        self.models, self.engine, self.tasks = ctx.models, ctx.engine, list(ctx.test_tasks)
        self.seed = seed_of(ctx.cfg.seed, Stream.EVAL)
        self.temperature = ctx.cfg.eval.temperature
        self.num_placeholders = ctx.cfg.composer.num_latents * ctx.cfg.composer.num_retrieved
        # Tasks composed per forward.
        self.chunk = max(1, ctx.cfg.train.micro_batch)

    def __call__(self, which: str) -> dict[str, Any]:
        """Summary metrics (:func:`summarize`, ``task_rewards`` in the order of the held-out
        tasks, and ``seconds``) of one evaluation on rank 0, ``{}`` on the others.

        Args:
            which: ``vanilla`` or ``lopd`` (the student), or a model generating with retrieved
                latents: ``base_composer`` (the frozen base), ``student_composer`` (the
                student), ``teacher_composer`` (the latent teacher's weights).
        """
        result: dict[str, Any] = {}
        self.ctx.dist.enter("evaluation")
        # Under FSDP2 every rank gathers the weights; rank 0 alone generates.
        with self.models.sharding.gathered():
            if self.ctx.dist.is_main:
                t0 = time.perf_counter()
                if which.endswith("_composer"):
                    trajs = self.rollout_with_latents(self.latent_reader(which))
                else:
                    trajs = self.engine.generate(
                        self.models.student,
                        self.tasks,
                        self.seed,
                        temperature=self.temperature,
                        count=False,
                        progress=self.ctx.progress,
                    )
                result = summarize(trajs)
                # Per-task rewards (task order) for paired comparisons across evaluations.
                result["task_rewards"] = [float(t.reward) for t in trajs]
                result["seconds"] = time.perf_counter() - t0
                # ``lopd`` names the trained student of every method (the summary's key).
                label = f"{self.ctx.cfg.train.method} student" if which == "lopd" else which
                self.ctx.log(
                    f"eval {label}: reward {result['reward_mean']:.3f} ± "
                    f"{result['reward_stderr']:.3f} (n={result['n']}), "
                    f"success {result['success_rate']:.3f}"
                )
            self.ctx.dist.barrier()
        return result

    def curve_point(self) -> dict[str, float]:
        """An evaluation along the run as metrics: the student's (``eval_*``) and, with
        ``eval.teacher_curve``, the latent teacher's (``eval_teacher_*``)."""
        ev = {f"eval_{k}": v for k, v in self("lopd").items() if k not in _NOT_METRICS}
        if self.ctx.cfg.eval.teacher_curve and self.latents is not None:
            teacher = self("teacher_composer")
            ev.update({f"eval_teacher_{k}": v for k, v in teacher.items() if k in _TEACHER_CURVE})
        return ev

    def with_latents(self) -> dict[str, dict[str, Any]]:
        """After training: the frozen base (``base_composer``), the trained student
        (``student_composer``) and a moved teacher's weights (``teacher_composer``), each
        generating with the trained latents."""
        out = {which: self(which) for which in ("base_composer", "student_composer")}
        if self.teacher_moved():
            out["teacher_composer"] = self("teacher_composer")
        return out

    def teacher_moved(self) -> bool:
        """Whether the latent teacher's weights are a copy that follows the student."""
        return self.teacher_model is not None and self.teacher_model() is not None

    def latent_reader(self, which: str) -> nn.Module | None:
        """The weights that generate with latents in evaluation ``which`` (``None``: the frozen
        base, through ``teacher_mode``)."""
        if which == "base_composer":
            return None
        if which == "student_composer":
            return self.models.student
        if which == "teacher_composer":
            return self.teacher_model() if self.teacher_model is not None else None
        raise ValueError(f"unknown evaluation {which!r}")

    def cached(self, which: str, path: Path) -> dict[str, Any]:
        """:meth:`__call__`, or its result from an earlier session of the run at ``path``
        (written atomically by rank 0 the first time)."""
        if path.exists():
            return json.loads(path.read_text())
        result = self(which)
        if self.ctx.dist.is_main:
            atomic_write_text(path, json.dumps(result))
        return result

    def task_latents(self, tasks: list[Task]) -> torch.Tensor:
        """The latents the base model generates with, ``[B, J*K, d]``: c_phi of ``tasks``, or
        zeros under ``lopd.null_context`` (the null-context control's teacher, evaluated)."""
        if self.latents is None:
            raise ValueError("base_composer evaluation needs a composer")
        with self.ctx.precision.autocast():
            lat = self.latents(tasks)
        return torch.zeros_like(lat) if self.ctx.cfg.lopd.null_context else lat

    @torch.no_grad()
    def rollout_with_latents(self, model: nn.Module | None = None) -> list[Trajectory]:
        """A model rolled out on the held-out tasks with their c_phi injected
        (:meth:`task_latents`): ``model``, or the frozen base (``None``, the encoder's LoRA
        off)."""
        if self.latents is None:
            raise ValueError("base_composer evaluation needs a composer")
        tokenizer, pad_id, n = self.models.tokenizer, self.models.pad_id, self.num_placeholders
        ph = tokenizer.convert_ids_to_tokens(pad_id)
        domain_of = {t.task_id: t.domain for t in self.tasks}

        def env_factory(task: Task) -> LatentPromptEnv:
            return LatentPromptEnv(make_env(task), domain_of[task.task_id], n, ph)

        prompts, starts, latents = [], [], []
        bs = self.chunk
        for i in range(0, len(self.tasks), bs):
            chunk = self.tasks[i : i + bs]
            for task, lt in zip(chunk, self.task_latents(chunk)):
                env = env_factory(task)
                user = env.reset(task)  # first: a system prompt may depend on the task
                ids = render_prompt(tokenizer, env.system_prompt(), user, env.tools())
                prompts.append(ids)
                starts.append(find_run(ids, pad_id, n))
                latents.append(lt)
        mode = self.latents.composer.teacher_mode()
        with mode if model is None else contextlib.nullcontext(model) as backbone:
            lm = LatentConditionedLM(backbone, prompts, latents, starts)
            return self.engine.generate(
                lm,
                self.tasks,
                self.seed,
                temperature=self.temperature,
                count=False,
                make_env=env_factory,
                progress=self.ctx.progress,
            )
