"""The trainer: one configured experiment, from the experience bank to the held-out summary.

Reading order: :mod:`lopd.train` (the CLI) -> :meth:`Trainer.run` -> :meth:`Trainer.train_step`
-> the method's ``rollouts``, ``loss`` and ``after_step`` (LOPD: :mod:`lopd.methods.lopd`, top to
bottom, with the paper's equations).

Phases of :meth:`Trainer.run` (each in its own module):

1. **Bank** (:mod:`lopd.latent.experience`, paper A.3): base-model rollouts; successes fill the
   experience bank, and every task's J retrieved experiences are looked up once.
2. **Cold start** (:mod:`lopd.latent.cold_start`, eq. 14): phi fitted to the bank's trajectories;
   saves phi_0 and caches c_phi0 of every train task.
3. **Joint training** (Algorithm 1): per step the method's rollouts, a loss per micro-batch,
   averaged gradients, clipped AdamW steps on theta and phi, then the method's ``after_step``
   (LOPD: the dual update of beta). Metrics: :mod:`lopd.run.metrics`; checkpoints:
   :mod:`lopd.run.checkpoint`.
4. **Evaluation** (:mod:`lopd.eval.held_out`) on the held-out split: the vanilla student (before
   training), the trained student, and "base + composer" (the frozen model generating with
   latents) twice: with the cold-started phi_0 before training and with the trained phi.

Models (:func:`lopd.models.loading.load_run_models`): the trained student and the frozen backbone,
which is both the teacher and the composer encoder's base (peft injects LoRA into it; the teacher
runs with the adapter disabled). Every phase is given the same
:class:`~lopd.run.context.RunContext`. Token budgets are checked against the model and every prompt
before anything is generated (:mod:`lopd.rollout.budget`); ``--profile-memory`` accounts for memory
per phase (:mod:`lopd.run.memory_account`).

Under ``torchrun``: data parallel (``model.parallel=ddp``, :mod:`lopd.parallel.distributed`) or
FSDP2 (``fsdp2``, :mod:`lopd.parallel.fsdp`); every rank runs the same passes
(:mod:`lopd.parallel.lockstep`) and reports its phase (:mod:`lopd.parallel.watchdog`). Every
generated rollout is counted (``rollouts`` in the metrics: the budget methods are compared at).
"""

from __future__ import annotations

import json
import random
import resource
import time
from typing import Any

import numpy as np
import torch

from lopd.config import Config, ConfigError
from lopd.eval.held_out import HeldOutEvaluator
from lopd.latent.cold_start import build_composer, cold_start
from lopd.latent.conditioned import LatentFraming
from lopd.latent.experience import Experience, build_experience
from lopd.latent.growth import build_bank_growth
from lopd.latent.teacher import TaskLatents
from lopd.methods import METHODS, MethodContext
from lopd.models.loading import load_run_models, resolve_model_dir
from lopd.parallel.distributed import Dist
from lopd.parallel.precision import Precision
from lopd.rollout.budget import BudgetReport, check_token_budgets
from lopd.rollout.engine import RolloutEngine
from lopd.rollout.vllm import VLLMRollout
from lopd.run.checkpoint import Checkpoints, TrainState, save_run_outputs
from lopd.run.claim import RunLock, claim_on_rank0
from lopd.run.context import RunContext
from lopd.run.memory_account import MemoryAccount
from lopd.run.metrics import MetricsLog
from lopd.run.micro_batches import backward_micro_batches
from lopd.run.optim import build_optimizers
from lopd.run.run_dir import RunDir
from lopd.run.tasks import TaskSampler, load_tasks

__all__ = ["Trainer"]


class Trainer:
    """Runs one configured experiment in ``cfg.run_dir``.

    Args:
        cfg: the run configuration (validated here).
        resume: continue from the newest checkpoint in ``run_dir/checkpoints`` (a run that was
            killed); phases already finished (bank, cold start, vanilla evaluation) are loaded
            from the run directory, not redone.
        progress: show tqdm bars (rank 0 only).
        overwrite: :meth:`run` deletes another run found in ``run_dir`` (else it refuses).
        shared_phases: :meth:`run` may find the phases a seed's methods share in ``run_dir``
            (``lopd.compare`` copies them there). See :mod:`lopd.run.claim`.

    Example:
        >>> trainer = Trainer(load_config("smoke"))
        >>> summary = trainer.run()   # {"vanilla": {...}, "lopd": {...}, "wall_seconds": ...}

    After :meth:`setup` the trainer exposes ``models``, ``train_tasks``, ``test_tasks``,
    ``experience`` (methods with a bank), ``context`` (what the method was built from),
    ``method``, ``optimizers``, ``engine`` and ``evaluate``.
    """

    def __init__(
        self,
        cfg: Config,
        resume: bool = False,
        progress: bool = True,
        overwrite: bool = False,
        shared_phases: bool = False,
    ) -> None:
        cfg.validate()
        if cfg.train.method not in METHODS:
            raise ConfigError(
                f"train.method must be one of {sorted(METHODS)}, got {cfg.train.method!r}"
            )
        self.cfg = cfg
        self.spec = METHODS[cfg.train.method]
        self.resume, self.overwrite, self.shared_phases = resume, overwrite, shared_phases
        self.lock: RunLock | None = None
        self.dist = Dist(cfg.model.device, cfg.threads, cfg.model.collective_timeout_minutes)
        self.spec.check(cfg, self.dist.world)
        self.is_main = self.dist.is_main
        self.progress = progress and self.is_main
        for line in self.spec.warnings(cfg):
            self.log(line)
        self.run_dir = RunDir(cfg.run_dir)
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

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def log(self, msg: str) -> None:
        if self.is_main:
            print(f"[lopd] {msg}", flush=True)

    # -------------------------------------------------------------- setup
    def setup(self) -> None:
        """Models, tasks, bank, composer and cold start (as the method needs), the method and
        the optimizers: everything :meth:`train_step` uses."""
        cfg, dist, precision, spec = self.cfg, self.dist, self.precision, self.spec
        if dist.is_main:  # claimed by run(); a caller driving the phases itself gets it created
            self.run_dir.checkpoints.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.memory.phase("start")
        self.models, attn = load_run_models(cfg, dist, precision)
        models = self.models
        self.engine = RolloutEngine(
            models.tokenizer, cfg.gen, models.sharding, precision, self._build_vllm()
        )
        self.sampler = TaskSampler(cfg.seed, dist.rank, dist.world)
        num_latents = cfg.composer.num_latents * cfg.composer.num_retrieved
        self.train_tasks, self.test_tasks, self.budget = check_token_budgets(
            cfg,
            models.backbone.config,
            models.tokenizer,
            *load_tasks(cfg),
            LatentFraming(num_latents) if spec.uses_composer else None,
            self.log,
            enable_thinking=self.engine.generation_config().enable_thinking,
        )
        self.log(
            f"{len(self.train_tasks)} train / {len(self.test_tasks)} test tasks; "
            f"world size {dist.world}; device {self.device}; {cfg.model.dtype} compute "
            f"({'float32 master weights, ' if precision.mixed else ''}attention {attn}); "
            f"longest prompt {self.budget.longest_prompt} tokens"
        )
        ctx = self.run_context = RunContext(
            cfg, self.run_dir, dist, precision, models, self.engine, self.sampler,
            self.train_tasks, self.test_tasks, self.memory, self.log, self.progress,
        )  # fmt: skip
        self.memory.phase("load", models)
        latents = latents0 = None
        if spec.builds_bank:
            self.experience = build_experience(ctx)
            # The bank's rollouts count toward the budget once (rank 0 generated them).
            if self.is_main:
                self.engine.count_rollouts(self.experience.bank_rollouts)
            self.memory.phase("bank", models)
        if spec.uses_composer:
            models.composer = build_composer(ctx)
            latents = TaskLatents(models.composer, self.experience.retrieved)
            latents0 = cold_start(ctx, self.experience, latents)
            self.memory.phase("cold_start", models)
        grow = cfg.bank.grow  # spec.check refused it for methods without a bank
        growth = build_bank_growth(ctx, self.experience, latents, latents0) if grow else None
        # The bank and the cold start read the backbone whole; training shards it.
        models.sharding.shard(models.backbone, trainable=False)
        self.context = MethodContext(
            models, self.engine, self.sampler, self.train_tasks, self.experience,
            latents0=latents0, latents=latents, seed=cfg.seed, rank=dist.rank, dist=dist,
            null_context=cfg.lopd.null_context, context_format=cfg.lopd.context_format,
            bank_growth=growth,
        )  # fmt: skip
        self.method = spec.build(self.context, cfg)
        self.optimizers = build_optimizers(
            models.student,
            models.composer.trainable_parameters() if models.composer is not None else [],
            cfg.train,
            precision.grad_scaler(),
        )
        self.evaluate = HeldOutEvaluator(ctx, latents, getattr(self.method, "teacher_model", None))
        self.memory.phase("setup", models, self._optimizer_list())

    def _build_vllm(self) -> VLLMRollout | None:
        """The vLLM engine of ``gen.engine=vllm`` (``None`` for the HF path)."""
        cfg = self.cfg
        if cfg.gen.engine != "vllm":
            return None
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

    # -------------------------------------------------------------- one step of Algorithm 1
    def train_step(self, step: int) -> dict[str, float]:
        """One training iteration (all ranks): the method's rollouts, a loss and backward per
        micro-batch, averaged and clipped gradients, the optimizer steps, the method's
        ``after_step``; returns the step's global metrics."""
        cfg = self.cfg.train
        t_start = time.perf_counter()
        self.dist.enter("rollout", step)
        self.models.sharding.gather_frozen_roots()  # FSDP2 only
        trajs = self.method.rollouts(step)
        t_rollout = time.perf_counter() - t_start
        self.dist.enter("loss", step)
        self.optimizers.zero_grad()
        t0 = time.perf_counter()
        models = [self.models.student, self.models.backbone]
        # Every rank runs the same passes, whatever its rollouts hold (lopd.parallel.lockstep).
        done = backward_micro_batches(
            self.dist, self.models.sharding, self.method, trajs, cfg.micro_batch,
            self.optimizers.backward,
            lambda: (self.memory.activations(models), self.precision.autocast()),
        )  # fmt: skip
        t_backward = time.perf_counter() - t0
        self.dist.enter("optimizer", step)
        gnorm_s, gnorm_c = self.optimizers.sync_clip_step(self.dist)
        self.engine.weights_updated(self.models.student)  # the vLLM engine syncs here
        # Gradients are not needed again until the next backward recreates them: freeing them
        # now keeps 4 bytes per trained parameter out of the next rollouts and evaluations.
        self.optimizers.zero_grad()
        # Global means over every rank's trajectories (one all-reduce of the sums).
        rewards = [t.reward for t in trajs]
        keys = sorted(done.sums)
        local = [
            float(len(trajs)), done.loss_sum, sum(rewards), sum(r >= 1.0 - 1e-9 for r in rewards),
            *[done.sums[k] for k in keys],
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
        optimizer = step < self.cfg.train.steps or self.cfg.checkpoint_final_optimizer
        self.checkpoints.save(step, self._train_state(), rollouts, self.wall_seconds(), optimizer)

    def load_checkpoint(self) -> int:
        """Restore the newest checkpoint; returns the number of finished steps (0 if none)."""
        resumed = self.checkpoints.load_latest(self._train_state())
        if resumed is None:
            return 0
        self.engine.load_state_dict({"rollouts": resumed.rollouts})
        self.engine.weights_updated(self.models.student)
        self.wall_before = resumed.wall_seconds
        self.log(f"resumed from {resumed.name} (step {resumed.step})")
        if not resumed.optimizer_restored and resumed.step < self.cfg.train.steps:
            self.log(
                f"{resumed.name} holds no optimizer state (checkpoint_final_optimizer=false): "
                "AdamW restarts from zero moments, so the continued run is not the one an "
                "uninterrupted run would give"
            )
        return resumed.step

    # -------------------------------------------------------------- the whole run
    def run(self) -> dict[str, Any]:
        """Claim the run directory -> setup -> vanilla eval -> training steps -> final eval;
        returns ``summary.json``."""
        self.session_start = time.perf_counter()
        shared = self.run_dir.shared_phases(self.spec.builds_bank, self.spec.uses_composer)
        self.lock = claim_on_rank0(
            self.dist, self.run_dir, self.cfg, resume=self.resume, overwrite=self.overwrite,
            shared_phases=tuple(shared) if self.shared_phases else (),
        )  # fmt: skip
        self.setup()
        cfg, run_dir, steps = self.cfg, self.run_dir, self.cfg.train.steps
        start = self.load_checkpoint() if self.resume else 0
        vanilla = self.evaluate.cached("vanilla", run_dir.eval_vanilla)
        base_composer0 = self._evaluate_base_composer0(start)
        self.memory.phase("eval_vanilla", self.models, self._optimizer_list())
        metrics_log = MetricsLog(run_dir, start, enabled=self.is_main)
        bar = self.run_context.bar(range(start, steps), desc=cfg.train.method, unit="step")
        for step in bar:
            m = self.train_step(step)
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < steps:
                m.update(self.evaluate.curve_point())
            metrics_log.write(m)
            if self.is_main:
                bar.set_postfix(
                    reward=f"{m['reward_mean']:.2f}", kl=f"{m.get('kl', 0):.3f}",
                    beta=f"{m.get('beta_next', 0.0):.3f}",
                )  # fmt: skip
                if (step + 1) % cfg.log_every == 0 and not self.progress:
                    self.log(json.dumps({k: round(v, 5) for k, v in m.items()}))
            done = step + 1
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == steps:
                self.save_checkpoint(done)
        summary: dict[str, Any] = {"vanilla": vanilla, "lopd": self.evaluate("lopd")}
        if base_composer0 is not None:
            summary["base_composer_phi0"] = base_composer0
        if self.models.composer is not None and cfg.eval.with_composer:
            summary.update(self.evaluate.with_latents())
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
        save_run_outputs(self.run_context, summary)
        self.memory.phase("save", self.models, self._optimizer_list())
        self.dist.barrier()
        return summary

    def _evaluate_base_composer0(self, start: int) -> dict[str, Any] | None:
        """Held-out "base + composer" with the cold-started phi_0 (before joint training), cached
        in ``eval_base_composer0.json``; ``None`` without a composer or ``eval.with_composer``,
        or when a run resumed after its first step lacks the file (phi has moved since)."""
        path = self.run_dir.eval_base_composer0
        if self.models.composer is None or not self.cfg.eval.with_composer:
            return None
        if start > 0 and not path.exists():
            self.log("eval base_composer_phi0: skipped (resumed after step 0, phi_0 is gone)")
            return None
        return self.evaluate.cached("base_composer", path)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
        engine = getattr(self, "engine", None)
        if engine is not None and engine.vllm is not None:
            engine.vllm.close()
        self.dist.close()
