"""The trainer: one configured experiment, from the experience bank to the held-out summary.

Reading order: :mod:`lopd.train` (the CLI) -> :meth:`Trainer.run` -> :meth:`Trainer.train_step`
-> the method's ``rollouts``, ``loss`` and ``after_step`` (LOPD: :mod:`lopd.methods.lopd`, top to
bottom, with the paper's equations).

Phases of :meth:`Trainer.run` (each in its own module):

1. **Bank** (:mod:`lopd.experience`, paper A.3): base-model rollouts; successes fill the
   experience bank, and every task's J retrieved experiences are looked up once.
2. **Cold start** (:mod:`lopd.cold_start`, eq. 14): phi fitted to the bank's trajectories;
   saves phi_0 and caches c_phi0 of every train task.
3. **Joint training** (Algorithm 1): per step the method's rollouts, a loss per micro-batch,
   averaged gradients, clipped AdamW steps on theta and phi, then the method's ``after_step``
   (LOPD: the dual update of beta). Metrics: :mod:`lopd.metrics`; checkpoints:
   :mod:`lopd.checkpoint`.
4. **Evaluation** (:mod:`lopd.evaluate`) on the held-out split: the vanilla student (before
   training), the trained student, and "base + composer" (the frozen model generating with
   latents) twice: with the cold-started phi_0 before training and with the trained phi.

Models. ``load_model`` gives the backbone once. The student is a copy (trainable): a deep copy
in float32 runs, a second float32 load under mixed precision (:mod:`lopd.precision`: float32
master weights for everything trained, the frozen backbone in the 16-bit compute dtype, forwards
under autocast). The backbone itself is frozen and serves as both the teacher (a frozen copy of
the initial weights) and the composer encoder's base: peft injects LoRA into it and the teacher
runs with the adapter disabled. So the base weights exist twice (student, backbone), never three
times. Token budgets are checked against the model and every prompt before anything is generated
(:mod:`lopd.budget`); ``--profile-memory`` accounts for memory per phase
(:mod:`lopd.memory_account`).

Parallelism under ``torchrun``: data parallel with all-reduced gradients (``model.parallel=ddp``,
:mod:`lopd.distributed`) or FSDP2 sharding of student, teacher and encoder backbone
(``model.parallel=fsdp2``, :mod:`lopd.fsdp`). The trainer counts every generated rollout
(``rollouts`` in the metrics: the budget all methods are compared at).
"""

from __future__ import annotations

import copy
import json
import random
import resource
import time
from typing import Any

import numpy as np
import torch

from lopd.budget import BudgetReport, check_token_budgets
from lopd.checkpoint import Checkpoints, TrainState, save_deployable
from lopd.cold_start import cold_start
from lopd.composer import LatentComposer
from lopd.config import Config, ConfigError
from lopd.distributed import Dist
from lopd.engine import RolloutEngine
from lopd.evaluate import HeldOutEvaluator
from lopd.experience import Experience, build_experience
from lopd.fsdp import Sharding
from lopd.memory_account import MemoryAccount
from lopd.methods import METHODS, MethodContext, Models
from lopd.methods.latent_teacher import compose
from lopd.metrics import MetricsLog, plot_rewards
from lopd.optim import build_optimizers
from lopd.precision import Precision, fsdp_mixed_precision
from lopd.run_dir import RunDir, atomic_torch_save, atomic_write_text
from lopd.seeds import Stream, seed_of
from lopd.tasks import TaskSampler, load_tasks

__all__ = ["Trainer"]


_NOT_METRICS = ("seconds", "task_rewards")
"""Evaluation results that are not per-step scalar metrics."""


class Trainer:
    """Runs one configured experiment in ``cfg.run_dir``.

    Args:
        cfg: the run configuration (validated here).
        resume: continue from the newest checkpoint in ``run_dir/checkpoints`` (a run that was
            killed); phases already finished (bank, cold start, vanilla evaluation) are loaded
            from the run directory, not redone.
        progress: show tqdm bars (rank 0 only).

    Example:
        >>> trainer = Trainer(load_config("smoke"))
        >>> summary = trainer.run()   # {"vanilla": {...}, "lopd": {...}, "wall_seconds": ...}

    After :meth:`setup` the trainer exposes ``models``, ``train_tasks``, ``test_tasks``,
    ``experience`` (methods with a bank), ``context`` (what the method was built from),
    ``method``, ``optimizers``, ``engine`` and ``evaluate``.
    """

    def __init__(self, cfg: Config, resume: bool = False, progress: bool = True) -> None:
        cfg.validate()
        if cfg.lopd.method not in METHODS:
            raise ConfigError(
                f"lopd.method must be one of {sorted(METHODS)}, got {cfg.lopd.method!r}"
            )
        self.cfg = cfg
        self.spec = METHODS[cfg.lopd.method]
        self.resume = resume
        self.dist = Dist(cfg.model.device, cfg.threads)
        self._check_parallel()
        self.is_main = self.dist.is_main
        self.progress = progress and self.is_main
        self.run_dir = RunDir(cfg.run_dir)
        if self.is_main:
            self.run_dir.checkpoints.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir.config)
        self.dist.barrier()
        self.checkpoints = Checkpoints(
            self.run_dir.checkpoints,
            self.dist,
            sharded=cfg.model.parallel == "fsdp2",
            keep=cfg.checkpoint_keep,
        )
        self.session_start = time.perf_counter()
        self.wall_before = 0.0  # wall seconds of earlier (killed) sessions of this run
        self.experience: Experience | None = None
        self.precision = Precision.of(cfg.model.dtype, self.device)
        self.memory = MemoryAccount(
            cfg.profile_memory and self.is_main,
            self.run_dir.memory if self.is_main else None,
            self.device,
            self.log,
        )
        self.budget: BudgetReport | None = None

    def _check_parallel(self) -> None:
        """FSDP2 runs every sharded forward as a collective: ranks need equal work."""
        cfg, world = self.cfg, self.dist.world
        if cfg.model.parallel != "fsdp2" or world == 1:
            return
        if not self.spec.supports_fsdp2:
            raise ConfigError(f"lopd.method={self.spec.name} does not support model.parallel=fsdp2")
        per_step = cfg.lopd.tasks_per_step // self.spec.group_size(cfg)
        if max(1, per_step) % world:
            raise ConfigError(
                f"model.parallel=fsdp2 needs the {max(1, per_step)} tasks a step draws "
                f"(lopd.tasks_per_step) to split evenly over {world} ranks"
            )
        if self.spec.uses_composer and cfg.cold_start.batch_size % world:
            raise ConfigError(
                f"model.parallel=fsdp2 needs cold_start.batch_size={cfg.cold_start.batch_size} "
                f"to split evenly over {world} ranks"
            )

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def log(self, msg: str) -> None:
        if self.is_main:
            print(f"[lopd] {msg}", flush=True)

    def _bar(self, iterable: Any, **kwargs: Any) -> Any:
        from tqdm.auto import tqdm

        return tqdm(iterable, disable=not self.progress, **kwargs)

    # -------------------------------------------------------------- setup
    def setup(self) -> None:
        """Models, tasks, bank, composer and cold start (as the method needs), the method and
        the optimizers: everything :meth:`train_step` uses."""
        from lopd.models import (
            enable_activation_checkpointing,
            load_model,
            resolve_attn_implementation,
        )

        cfg, dist, precision = self.cfg, self.dist, self.precision
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.memory.phase("start")
        try:
            attn = resolve_attn_implementation(
                cfg.model.attn_implementation, self.device, precision.compute
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            backbone, tokenizer = load_model(
                cfg.model.path, device=self.device, dtype=precision.frozen, attn_implementation=attn
            )
            # The student starts as an exact copy of the initial backbone and is the only model
            # whose weights change; the backbone stays the frozen teacher. Under mixed precision
            # it is loaded again in float32 (master weights), not upcast from the 16-bit copy.
            if precision.mixed:
                student, _ = load_model(
                    cfg.model.path,
                    device=self.device,
                    dtype=precision.master,
                    attn_implementation=attn,
                )
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"model.path: {err}") from None
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        backbone.requires_grad_(False)
        backbone.eval()
        if not precision.mixed:
            student = copy.deepcopy(backbone)
        student.requires_grad_(True)
        student.train()
        if cfg.model.gradient_checkpointing:
            enable_activation_checkpointing(student)
        sharding = Sharding(
            cfg.model.parallel == "fsdp2" and dist.distributed,
            dist,
            fsdp_mixed_precision(cfg.model.dtype, self.device),
            pad_id,
        )
        sharding.shard(student, trainable=True)
        self.models = Models(student, backbone, None, tokenizer, pad_id, self.device, sharding)
        self.engine = RolloutEngine(tokenizer, cfg.gen, sharding, precision, self._build_vllm())
        self.sampler = TaskSampler(cfg.seed, dist.rank, dist.world)
        train_tasks, test_tasks = load_tasks(cfg)
        self.train_tasks, self.test_tasks, self.budget = check_token_budgets(
            cfg,
            backbone.config,
            tokenizer,
            train_tasks,
            test_tasks,
            self.spec.uses_composer,
            self.log,
            enable_thinking=self.engine.generation_config().enable_thinking,
        )
        self.log(
            f"{len(self.train_tasks)} train / {len(self.test_tasks)} test tasks; "
            f"world size {dist.world}; device {self.device}; {cfg.model.dtype} compute "
            f"({'float32 master weights, ' if precision.mixed else ''}attention {attn}); "
            f"longest prompt {self.budget.longest_prompt} tokens"
        )
        self.memory.phase("load", self.models)
        latents0 = None
        if self.spec.builds_bank:
            self.experience = build_experience(
                cfg, self.run_dir, backbone, tokenizer, self.train_tasks, self.test_tasks,
                self.engine, dist, self.log, self.progress,
            )  # fmt: skip
            # The bank's rollouts count toward the budget once (rank 0 generated them).
            self.engine.rollouts = self.experience.bank_rollouts if self.is_main else 0
            self.memory.phase("bank", self.models)
        if self.spec.uses_composer:
            self.models.composer = self._build_composer()
            latents0 = cold_start(
                cfg, self.run_dir, self.models.composer, self.experience, self.train_tasks,
                tokenizer, pad_id, self.device, dist, self.sampler, self.log, self._bar,
                precision=precision, activations=self.memory.activations,
            )  # fmt: skip
            self.memory.phase("cold_start", self.models)
        # The bank and the cold start read the backbone whole; training shards it.
        sharding.shard(backbone, trainable=False)
        self.context = MethodContext(
            self.models, self.engine, self.sampler, self.train_tasks, self.experience, latents0,
            cfg.seed, dist.rank,
        )  # fmt: skip
        self.method = self.spec.build(self.context, cfg)
        composer = self.models.composer
        self.optimizers = build_optimizers(
            student,
            composer.trainable_parameters() if composer is not None else [],
            cfg.lopd,
            precision.grad_scaler(),
        )
        self.evaluate = HeldOutEvaluator(
            self.models, self.engine, self.test_tasks, seed_of(cfg.seed, Stream.EVAL),
            cfg.eval.temperature, dist, self.log, self.progress,
            compose=self._compose if composer is not None else None,
            num_placeholders=cfg.composer.num_latents * cfg.composer.num_retrieved,
            chunk=cfg.lopd.micro_batch,
        )  # fmt: skip
        self.memory.phase("setup", self.models, self._optimizer_list())

    def _build_vllm(self) -> Any:
        """The vLLM engine of ``gen.engine=vllm`` (``None`` for the HF path)."""
        cfg = self.cfg
        if cfg.gen.engine != "vllm":
            return None
        from lopd.models import resolve_model_dir
        from lopd.vllm_engine import VLLMRollout

        self.log("gen.engine=vllm: starting the vLLM engine")
        return VLLMRollout(
            resolve_model_dir(cfg.model.path),
            num_tokens=len(self.models.tokenizer),
            dtype=self.precision.compute,
            max_model_len=cfg.gen.max_total_tokens,
            seed=cfg.seed,
            gpu_memory_utilization=cfg.gen.vllm_gpu_memory_utilization,
            kv_cache_gib=cfg.gen.vllm_kv_cache_gib,
        )

    def _optimizer_list(self) -> list[torch.optim.Optimizer | None]:
        opts = getattr(self, "optimizers", None)
        return [] if opts is None else [opts.student, opts.composer]

    def _build_composer(self) -> LatentComposer:
        c = self.cfg.composer
        torch.manual_seed(seed_of(self.cfg.seed, Stream.COMPOSER_INIT))
        composer = LatentComposer(
            self.models.backbone,
            self.models.tokenizer,
            num_latents=c.num_latents,
            num_retrieved=c.num_retrieved,
            qformer_layers=c.qformer_layers,
            ffn_mult=c.ffn_mult,
            lora_r=c.lora_r,
            lora_alpha=c.lora_alpha,
            lora_dropout=c.lora_dropout,
            max_encoder_tokens=c.max_encoder_tokens,
        )
        # phi trains in float32 whatever model.dtype computes in (the LoRA already is: peft
        # keeps adapters of a 16-bit base in float32; the QFormer follows the backbone).
        self.precision.to_master(composer)
        # No dropout anywhere in the composer/teacher: eval mode keeps them deterministic.
        composer.eval()
        self.dist.broadcast_parameters(composer)
        return composer

    def _compose(self, tasks: Any) -> torch.Tensor:
        with self.precision.autocast():
            return compose(self.models.composer, self.experience.retrieved, tasks)

    # -------------------------------------------------------------- one step of Algorithm 1
    def train_step(self, step: int) -> dict[str, float]:
        """One training iteration (all ranks): the method's rollouts, a loss and backward per
        micro-batch, averaged and clipped gradients, the optimizer steps, the method's
        ``after_step``; returns the step's global metrics."""
        cfg = self.cfg.lopd
        t_start = time.perf_counter()
        self.models.sharding.gather_frozen_roots()  # FSDP2 only
        trajs = self.method.rollouts(step)
        t_rollout = time.perf_counter() - t_start
        self.optimizers.zero_grad()
        sums: dict[str, float] = {}
        loss_sum = 0.0
        t0 = time.perf_counter()
        models = [self.models.student, self.models.backbone]
        for i in range(0, len(trajs), cfg.micro_batch):
            mb = trajs[i : i + cfg.micro_batch]
            with self.memory.activations(models), self.precision.autocast():
                loss, mb_sums = self.method.loss(mb, num_total=len(trajs))
            self.optimizers.backward(loss)
            loss_sum += loss.item() * len(trajs)
            for k, v in mb_sums.items():
                sums[k] = sums.get(k, 0.0) + v
        t_backward = time.perf_counter() - t0
        gnorm_s, gnorm_c = self.optimizers.sync_clip_step(self.dist)
        self.engine.weights_updated(self.models.student)  # the vLLM engine syncs here
        # Gradients are not needed again until the next backward recreates them: freeing them
        # now keeps 4 bytes per trained parameter out of the next rollouts and evaluations.
        self.optimizers.zero_grad()
        # Global means over every rank's trajectories (one all-reduce of the sums).
        rewards = [t.reward for t in trajs]
        keys = sorted(sums)
        local = [
            float(len(trajs)), loss_sum, sum(rewards), sum(r >= 1.0 - 1e-9 for r in rewards),
            *[sums[k] for k in keys],
        ]  # fmt: skip
        glob = self.dist.all_reduce_sum(local)
        n = glob[0]
        means = {k: v / n for k, v in zip(keys, glob[4:])}
        metrics: dict[str, float] = {
            "step": step,
            "loss": glob[1] / n,
            "reward_mean": glob[2] / n,
            "success_rate": glob[3] / n,
            **means,
            "action_tokens": means.get("action_tokens", 0.0) * n,
        }
        metrics.update(self.method.after_step(means))
        metrics.update(
            grad_norm_student=gnorm_s,
            grad_norm_composer=gnorm_c,
            rollouts=self.global_rollouts(),
            seconds_rollout=t_rollout,
            seconds_loss_backward=t_backward,
            seconds_step=time.perf_counter() - t_start,
        )
        self.memory.phase("step", self.models, self._optimizer_list(), release=False, step=step)
        return metrics

    def global_rollouts(self) -> int:
        """Rollouts generated so far by all ranks (a collective)."""
        return int(self.dist.all_reduce_sum([float(self.engine.rollouts)])[0])

    def wall_seconds(self) -> float:
        """Wall time of the run: earlier sessions plus this one."""
        return self.wall_before + (time.perf_counter() - self.session_start)

    # -------------------------------------------------------------- checkpoints
    def _train_state(self) -> TrainState:
        return TrainState(self.models.student, self.models.composer, self.optimizers, self.method)

    def save_checkpoint(self, step: int) -> None:
        """Everything a resumed run needs to continue exactly (all ranks call it); the final
        step's checkpoint without optimizer states when ``checkpoint_final_optimizer=false``."""
        rollouts = self.global_rollouts()
        optimizer = step < self.cfg.lopd.steps or self.cfg.checkpoint_final_optimizer
        self.checkpoints.save(step, self._train_state(), rollouts, self.wall_seconds(), optimizer)

    def load_checkpoint(self) -> int:
        """Restore the newest checkpoint; returns the number of finished steps (0 if none)."""
        resumed = self.checkpoints.load_latest(self._train_state())
        if resumed is None:
            return 0
        self.engine.rollouts = resumed.rollouts
        self.engine.weights_updated(self.models.student)
        self.wall_before = resumed.wall_seconds
        self.log(f"resumed from {resumed.name} (step {resumed.step})")
        if not resumed.optimizer_restored and resumed.step < self.cfg.lopd.steps:
            self.log(
                f"{resumed.name} holds no optimizer state (checkpoint_final_optimizer=false): "
                "AdamW restarts from zero moments, so the continued run is not the one an "
                "uninterrupted run would give"
            )
        return resumed.step

    # -------------------------------------------------------------- the whole run
    def run(self) -> dict[str, Any]:
        """Setup -> vanilla eval -> training steps -> final eval; returns ``summary.json``."""
        self.session_start = time.perf_counter()
        self.setup()
        cfg, run_dir = self.cfg, self.run_dir
        start = self.load_checkpoint() if self.resume else 0
        if run_dir.eval_vanilla.exists():
            vanilla = json.loads(run_dir.eval_vanilla.read_text())
        else:
            vanilla = self.evaluate("vanilla")
            if self.is_main:
                atomic_write_text(run_dir.eval_vanilla, json.dumps(vanilla))
        base_composer0 = self._evaluate_base_composer0(start)
        self.memory.phase("eval_vanilla", self.models, self._optimizer_list())
        metrics_log = MetricsLog(run_dir, start, enabled=self.is_main)
        bar = self._bar(range(start, cfg.lopd.steps), desc=cfg.lopd.method, unit="step")
        for step in bar:
            m = self.train_step(step)
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.lopd.steps:
                ev = self.evaluate("lopd")
                m.update({f"eval_{k}": v for k, v in ev.items() if k not in _NOT_METRICS})
            metrics_log.write(m)
            if self.is_main:
                bar.set_postfix(
                    reward=f"{m['reward_mean']:.2f}", kl=f"{m.get('kl', 0):.3f}",
                    beta=f"{m.get('beta_next', 0.0):.3f}",
                )  # fmt: skip
                if (step + 1) % cfg.log_every == 0 and not self.progress:
                    self.log(json.dumps({k: round(v, 5) for k, v in m.items()}))
            done = step + 1
            if (
                cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            ) or done == cfg.lopd.steps:
                self.save_checkpoint(done)
        summary: dict[str, Any] = {"vanilla": vanilla, "lopd": self.evaluate("lopd")}
        if base_composer0 is not None:
            summary["base_composer_phi0"] = base_composer0
        if self.models.composer is not None and cfg.eval.with_composer:
            summary["base_composer"] = self.evaluate("base_composer")
        self.memory.phase("eval_final", self.models, self._optimizer_list())
        summary["rollouts"] = self.global_rollouts()
        summary["wall_seconds"] = self.wall_seconds()
        # CPU time of this process in this session: on a shared, oversubscribed machine it is
        # the better estimate of the wall time the run would take on idle cores.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        summary["cpu_seconds_session"] = usage.ru_utime + usage.ru_stime
        if self.budget is not None:
            summary["token_budget"] = self.budget.to_dict()
        metrics_log.close()
        self._save_final(summary)
        self.memory.phase("save", self.models, self._optimizer_list())
        self.dist.barrier()
        return summary

    def _evaluate_base_composer0(self, start: int) -> dict[str, Any] | None:
        """Held-out "base + composer" with the cold-started phi_0 (before joint training), cached in
        ``eval_base_composer0.json``; ``None`` without a composer or ``eval.with_composer``.

        A run resumed after its first step that lacks the file cannot measure it any more (phi
        has moved): it logs that and returns ``None``.
        """
        path = self.run_dir.eval_base_composer0
        if self.models.composer is None or not self.cfg.eval.with_composer:
            return None
        if path.exists():
            return json.loads(path.read_text())
        if start > 0:
            self.log("eval base_composer_phi0: skipped (resumed after step 0, phi_0 is gone)")
            return None
        result = self.evaluate("base_composer")
        if self.is_main:
            atomic_write_text(path, json.dumps(result))
        return result

    def _save_final(self, summary: dict[str, Any]) -> None:
        """``summary.json``, the deployable student, phi, and the reward plot (rank 0 writes;
        under FSDP2 every rank takes part in gathering the weights)."""
        models, run_dir = self.models, self.run_dir
        sharded = models.sharding.enabled
        student_sd = models.sharding.full_state_dict(models.student) if sharded else None
        phi = None
        if models.composer is not None:
            phi = (
                models.sharding.full_state_dict(models.composer, trainable_only=True)
                if sharded
                else models.composer.phi_state_dict()
            )
        if not self.is_main:
            return
        atomic_write_text(run_dir.summary, json.dumps(summary, indent=2))
        save_deployable(models.student, run_dir.student, self.precision.compute, student_sd)
        models.tokenizer.save_pretrained(run_dir.student)
        if phi is not None:
            atomic_torch_save(phi, run_dir.composer)
        plot_rewards(run_dir.metrics, run_dir.reward_curve, summary)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and engine.vllm is not None:
            engine.vllm.close()
        self.dist.close()
