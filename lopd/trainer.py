"""The LOPD trainer: bank, cold start, the joint loop of Algorithm 1, evaluation, checkpoints.

One process (or one ``torchrun`` rank) runs every phase in-process:

1. **Bank** (paper A.3): base-model rollouts on the train split; successes enter an
   :class:`~lopd.memory.ExperienceBank` in ``run_dir/bank`` with a FAISS retriever. The
   trajectories themselves are kept too (``bank/trajectories.jsonl``): they are the cold start's
   data. Retrieval is fixed once the bank is frozen, so the ``J`` experiences of every task are
   looked up once and cached (``retrieval.json``).
2. **Cold start** (eq. 14): NLL of the bank's successful trajectories under the frozen backbone
   conditioned on ``c_phi``; trains LoRA + QFormer; saves phi_0 (``phi0.pt``) and caches
   ``c_phi0`` of every train task (``latents0.pt``) for the anchor.
3. **Joint training** (Algorithm 1): per step, student rollouts without latents -> rewards ->
   ``c_phi`` -> teacher and student forwards on the student's tokens -> ``topk_tail_kl`` on the
   action rows -> eq. 13 -> AdamW on theta and phi -> dual update of beta.
4. **Evaluation** on the held-out split: the vanilla student (before training), the trained
   student, and "base + composer" (the frozen model generating with latents).

Models. ``load_model`` gives the backbone once. The student is a deep copy (trainable). The
backbone itself is frozen and serves as both the teacher (a frozen copy of the initial weights)
and the composer encoder's base: peft injects LoRA into it and the teacher runs with the adapter
disabled. So the base weights exist twice (student, backbone), never three times.

Methods. The per-method loss lives in one place, :data:`METHODS` (``name -> Method``): LOPD is
:class:`LOPDMethod`; baselines register their own. The trainer counts every generated rollout
(``rollouts`` in the metrics: the budget all methods are compared at).

Data parallel. Under ``torchrun`` (``WORLD_SIZE > 1``) each rank rolls out and differentiates a
disjoint share of the step's tasks; gradients are averaged with one flat ``all_reduce`` per
parameter group (gloo on CPU, nccl on GPU) and beta's dual step uses the global Delta, so every
rank stays bitwise in sync. (Gradients are reduced after the step's micro-batches rather than
through ``DistributedDataParallel`` hooks: the teacher forward re-enters the shared backbone
with the adapter toggled, which DDP's per-forward bookkeeping does not model.)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lopd.composer import LatentComposer, decoder_of
from lopd.config import Config, ConfigError
from lopd.injection import (
    TeacherSequence,
    action_rows,
    build_teacher_sequence,
    inject_latents,
    pad_batch,
)
from lopd.loss import advantages_from_rewards, dual_update, lopd_loss, segment_mean
from lopd.types import Task, TraceStep, Trajectory

__all__ = [
    "METHODS",
    "ActionRows",
    "LOPDMethod",
    "Method",
    "Trainer",
    "register_method",
    "student_action_hidden",
    "teacher_action_hidden",
]


# ------------------------------------------------------------------------------ forward helpers
@dataclasses.dataclass
class ActionRows:
    """Where the supervised tokens of a batch of trajectories are.

    Attributes:
        batch: ``[N]`` int64 trajectory index of each supervised row.
        rows: ``[N]`` int64 student position ``p - 1`` whose logits predict action token ``p``.
        targets: ``[N]`` int64 the sampled action token ``input_ids[p]``.
    """

    batch: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory], device: torch.device) -> ActionRows:
        batch, rows, targets = [], [], []
        for i, traj in enumerate(trajectories):
            r = action_rows(traj.action_mask)
            ids = torch.as_tensor(traj.input_ids, dtype=torch.long)
            batch.append(torch.full_like(r, i))
            rows.append(r)
            targets.append(ids[r + 1])
        return cls(
            torch.cat(batch).to(device), torch.cat(rows).to(device), torch.cat(targets).to(device)
        )


def student_action_hidden(
    model: nn.Module, trajectories: Sequence[Trajectory], where: ActionRows, pad_id: int
) -> torch.Tensor:
    """Final hidden states of ``model`` at the action rows, ``[N, d]`` (no ``[L, V]`` logits).

    Args:
        model: the student ``*ForCausalLM``.
        trajectories: B trajectories (right-padded into one batch).
        where: their :class:`ActionRows`.
        pad_id: padding id.
    """
    device = where.rows.device
    ids, mask = pad_batch([t.input_ids for t in trajectories], pad_id, device)
    hidden = decoder_of(model)(input_ids=ids, attention_mask=mask).last_hidden_state
    return hidden[where.batch, where.rows]


def teacher_action_hidden(
    composer: LatentComposer,
    sequences: Sequence[TeacherSequence],
    latents: torch.Tensor,
    where: ActionRows,
    pad_id: int,
    checkpointed: bool = False,
) -> torch.Tensor:
    """Frozen-teacher final hidden states at the student's action rows, ``[N, d]``.

    The placeholder embeddings are replaced by ``latents`` (concatenation: gradient reaches phi),
    the backbone runs with the encoder adapter disabled, and row ``p - 1`` of the student is row
    ``p - 1 + offset`` of the teacher (:class:`~lopd.injection.TeacherSequence`).

    Args:
        composer: owns the frozen backbone.
        sequences: B teacher sequences.
        latents: ``[B, J*K, d]`` c_phi.
        where: the student's :class:`ActionRows`.
        pad_id: padding id.
        checkpointed: recompute the whole teacher forward in the backward (activation memory
            of one teacher forward is not kept); the recompute re-enters ``teacher_mode``.
    """
    device = where.rows.device
    ids, mask = pad_batch([s.input_ids for s in sequences], pad_id, device)

    def run(lat: torch.Tensor) -> torch.Tensor:
        with composer.teacher_mode() as backbone:
            embeds = backbone.get_input_embeddings()(ids)
            embeds = torch.stack(
                [inject_latents(embeds[i], lat[i], s.latent_start) for i, s in enumerate(sequences)]
            )
            return decoder_of(backbone)(inputs_embeds=embeds, attention_mask=mask).last_hidden_state

    hidden = checkpoint(run, latents, use_reentrant=False) if checkpointed else run(latents)
    offsets = torch.as_tensor([s.offset for s in sequences], dtype=torch.long, device=device)
    return hidden[where.batch, where.rows + offsets[where.batch]]


def _lm_head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")
    return head


# ------------------------------------------------------------------------------ methods
class Method:
    """One training objective. Subclasses implement :meth:`loss`; :meth:`after_step` is optional.

    Attributes:
        name: the ``lopd.method`` value.
        uses_composer: whether the trainer must build the bank, composer and cold start.
    """

    name = ""
    uses_composer = True
    uses_bank = False  # build the experience bank even without a composer (text baselines)

    def loss(
        self, trainer: Trainer, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch (already divided by ``num_total``, the step's trajectories on
        this rank) and metric *sums over trajectories* (the trainer averages them globally)."""
        raise TypeError(f"method {self.name!r} does not define loss()")

    def after_step(self, trainer: Trainer, means: dict[str, float]) -> dict[str, float]:
        """Called after the optimizer step with the step's global metric means; returns extra
        metrics to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State of the objective itself that a resumed run needs (e.g. SDPO's EMA teacher);
        saved in every checkpoint next to the student's."""
        return {}

    def load_state_dict(self, trainer: Trainer, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` after the trainer restored the student."""

    def rollouts(self, trainer: Trainer, step: int) -> list[Trajectory]:
        """This rank's training rollouts of step ``step``: by default one student rollout of
        each of ``trainer.step_tasks(step)``; group methods (GRPO, SDPO) override it."""
        return trainer.generate(
            trainer.student,
            trainer.step_tasks(step),
            seed=_mix_seed(trainer.cfg.seed, 6, step, trainer.rank),
        )


METHODS: dict[str, Callable[[], Method]] = {}
"""Registered training objectives, ``lopd.method`` name -> factory."""


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator adding a :class:`Method` to :data:`METHODS`."""

    def wrap(cls: type[Method]) -> type[Method]:
        cls.name = name
        METHODS[name] = cls
        return cls

    return wrap


@register_method("lopd")
class LOPDMethod(Method):
    """Eq. 13: top-M + tail reverse KL on action tokens + beta (m - Delta) + latent anchor."""

    def loss(
        self, trainer: Trainer, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = trainer.cfg.lopd
        device = trainer.device
        where = ActionRows.of(trajectories, device)
        latents = self.latents(trainer, [t.task for t in trajectories])
        latents0 = trainer.cached_latents0([t.task for t in trajectories])
        sequences = [trainer.teacher_sequence(t) for t in trajectories]
        h_t = teacher_action_hidden(
            trainer.composer,
            sequences,
            latents,
            where,
            trainer.pad_id,
            checkpointed=trainer.cfg.model.gradient_checkpointing,
        )
        h_s = student_action_hidden(trainer.student, trajectories, where, trainer.pad_id)
        head_s, head_t = _lm_head(trainer.student), _lm_head(trainer.composer.backbone)
        out = distill_rows(h_s, head_s, h_t, head_t, where.targets, cfg)
        rewards = torch.tensor([t.reward for t in trajectories], device=device)
        terms = lopd_loss(
            out.kl,
            out.privilege,
            where.batch,
            advantages_from_rewards(rewards),
            latents,
            latents0,
            beta=trainer.beta,
            margin=cfg.margin,
            anchor_weight=cfg.anchor_weight,
            num_total=num_total,
        )
        with torch.no_grad():
            b = len(trajectories)
            kl, delta, anchor = torch.stack(
                [terms.distill.sum(), terms.delta.sum(), terms.anchor.sum()]
            ).tolist()
            sums = {"kl": kl, "delta": delta, "anchor": anchor}
            sums.update(distill_metric_sums(out, where, b))
        return terms.loss, sums

    def latents(self, trainer: Trainer, tasks: Sequence[Task]) -> torch.Tensor:
        """The teacher's latent context c_phi, ``[B, J*K, d]`` (ablations override it)."""
        return trainer.compose(tasks)

    def after_step(self, trainer: Trainer, means: dict[str, float]) -> dict[str, float]:
        cfg = trainer.cfg.lopd
        before = trainer.beta
        trainer.beta = dual_update(before, cfg.margin, means["delta"], cfg.dual_lr)
        return {"beta": before, "beta_next": trainer.beta}


def distill_rows(
    h_s: torch.Tensor,
    head_s: nn.Module,
    h_t: torch.Tensor,
    head_t: nn.Module,
    targets: torch.Tensor,
    cfg: Any,
) -> Any:
    """Top-M + tail KL of the action rows (fused with the LM heads when ``cfg.fused_linear``).

    Args:
        h_s, h_t: ``[N, d]`` final hidden states of student / teacher at the action rows.
        head_s, head_t: their LM heads.
        targets: ``[N]`` sampled action tokens.
        cfg: :class:`~lopd.config.LOPDConfig` (top_m, temperature, divergence, fused_linear).

    Returns:
        The kernel's :class:`~lopd_kernels.topk_tail_kl.TopKTailKLOutput` (``kl, privilege,
        student_logprob, teacher_logprob, topk_ids, teacher_topk_mass``).
    """
    # The HF-facing helper users get: packed action rows, fused with the heads or on their
    # materialized [N, V] logits (action rows only).
    from lopd_kernels.hf import lm_head_topk_tail_kl

    return lm_head_topk_tail_kl(
        h_s,
        head_s,
        h_t,
        head_t,
        targets,
        fused=cfg.fused_linear,
        top_m=cfg.top_m,
        temperature=cfg.temperature,
        divergence=cfg.divergence,
    )


def distill_metric_sums(out: Any, where: ActionRows, num_traj: int) -> dict[str, float]:
    """Per-trajectory token means of the distillation outputs, summed over the ``num_traj``
    trajectories (the trainer averages these sums globally), and the action-token count.

    All of them leave the device in one transfer. ``teacher_top_m_mass`` comes from the kernel's
    own bucket masses (``out.teacher_topk_mass``): no second pass over the teacher logits.
    """
    names = ("privilege", "student_logprob", "teacher_logprob", "teacher_topk_mass")
    with torch.no_grad():
        means = torch.stack(
            [segment_mean(getattr(out, n).detach().float(), where.batch, num_traj) for n in names]
        )
        privilege, student_lp, teacher_lp, mass = means.sum(1).tolist()
    return {
        "teacher_top_m_mass": mass,
        "privilege": privilege,
        "student_logprob": student_lp,
        "teacher_logprob": teacher_lp,
        "action_tokens": float(where.rows.numel()),
    }


# ------------------------------------------------------------------------------ serialization
def trajectory_to_dict(t: Trajectory) -> dict[str, Any]:
    d = dataclasses.asdict(t)
    d["task"] = t.task.to_dict()
    return d


def trajectory_from_dict(d: dict[str, Any]) -> Trajectory:
    d = dict(d)
    d["task"] = Task.from_dict(d["task"])
    d["trace"] = [TraceStep(**s) for s in d.get("trace", [])]
    d["turn_spans"] = [tuple(s) for s in d.get("turn_spans", [])]
    return Trajectory(**d)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _mix_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (Python's hash of ints is not salted)."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0]
    ) & ((1 << 31) - 1)


# ------------------------------------------------------------------------------ the trainer
class Trainer:
    """Runs one configured LOPD experiment in ``cfg.run_dir``.

    Args:
        cfg: the run configuration (validated here).
        resume: continue from the newest checkpoint in ``run_dir/checkpoints`` (a run that was
            killed); phases already finished (bank, cold start, vanilla evaluation) are loaded
            from the run directory, not redone.
        progress: show tqdm bars (rank 0 only).

    Example:
        >>> trainer = Trainer(load_config("smoke"))
        >>> summary = trainer.run()   # {"vanilla": {...}, "lopd": {...}, "wall_seconds": ...}
    """

    def __init__(self, cfg: Config, resume: bool = False, progress: bool = True) -> None:
        cfg.validate()
        import lopd.baselines  # noqa: F401  (registers the baseline methods in METHODS)

        if cfg.lopd.method not in METHODS:
            raise ConfigError(
                f"lopd.method must be one of {sorted(METHODS)}, got {cfg.lopd.method!r}"
            )
        self.cfg = cfg
        self.method = METHODS[cfg.lopd.method]()
        self.resume = resume
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.distributed = self.world > 1
        self.device = self._pick_device()
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or 1)
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.is_main = self.rank == 0
        self.progress = progress and self.is_main
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        if self.is_main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")
        self._barrier()
        self.beta = cfg.lopd.beta_init
        self.step = 0
        self.rollouts = 0  # every generated rollout, all phases, all ranks
        self.wall_before = 0.0  # wall seconds of earlier (killed) sessions of this run
        self.composer: LatentComposer | None = None
        self._latents0: dict[str, torch.Tensor] = {}
        self._retrieved: dict[str, list[str]] = {}
        self._teacher_seq_cache: dict[int, TeacherSequence] = {}

    # -------------------------------------------------------------- plumbing
    def _pick_device(self) -> torch.device:
        want = self.cfg.model.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda" and self.distributed:
            want = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        if want.startswith("cuda"):
            torch.cuda.set_device(torch.device(want))
        return torch.device(want)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _average_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Average gradients over ranks with one flat all-reduce (ranks with no grad send 0)."""
        if not self.distributed or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def _broadcast_parameters(self, module: nn.Module) -> None:
        if self.distributed:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)

    def _bar(self, iterable: Any, **kwargs: Any) -> Any:
        from tqdm.auto import tqdm

        return tqdm(iterable, disable=not self.progress, **kwargs)

    def log(self, msg: str) -> None:
        if self.is_main:
            print(f"[lopd] {msg}", flush=True)

    def gen_config(self, temperature: float | None = None) -> Any:
        from lopd.rollout import GenerationConfig

        g = self.cfg.gen
        return GenerationConfig(
            temperature=g.temperature if temperature is None else temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_new_tokens_per_turn=g.max_new_tokens,
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
        """Roll out ``model`` on ``tasks``; with ``count`` the rollouts count toward the training
        budget of this rank (evaluation rollouts do not)."""
        from lopd.rollout import rollout

        if not tasks:
            return []
        trajs = rollout(
            model, self.tokenizer, list(tasks), self.gen_config(temperature), seed=seed, **kwargs
        )
        if count:
            self.rollouts += len(trajs)
        return trajs

    # -------------------------------------------------------------- setup
    def setup(self) -> None:
        """Load the backbone, make the student, load the tasks."""
        from lopd.models import load_model

        torch.manual_seed(self.cfg.seed)
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        try:
            backbone, tokenizer = load_model(
                self.cfg.model.path, device=self.device, dtype=_dtype(self.cfg.model.dtype)
            )
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"model.path: {err}") from None
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        backbone.requires_grad_(False)
        backbone.eval()
        self.backbone = backbone
        # The student starts as an exact copy of the initial backbone and is the only model
        # whose weights change; the backbone stays the frozen teacher.
        self.student = copy.deepcopy(backbone)
        self.student.requires_grad_(True)
        self.student.train()
        if self.cfg.model.gradient_checkpointing:
            self.student.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.train_tasks, self.test_tasks = self._load_tasks()
        self.log(
            f"{len(self.train_tasks)} train / {len(self.test_tasks)} test tasks; "
            f"world size {self.world}; device {self.device}"
        )

    def _load_tasks(self) -> tuple[list[Task], list[Task]]:
        d = self.cfg.data
        if d.tasks_path is not None:
            from lopd.envs import load_tasks_jsonl

            tasks = load_tasks_jsonl(d.tasks_path)
            train = [t for t in tasks if t.split == "train"][: d.n_train]
            test = [t for t in tasks if t.split == "test"][: d.n_test]
            if not train:
                raise ConfigError(f"data.tasks_path {d.tasks_path!r} holds no split='train' task")
            if not test:
                raise ConfigError(f"data.tasks_path {d.tasks_path!r} holds no split='test' task")
            return train, test
        from lopd.envs import builtin_tasks

        return (
            builtin_tasks(d.domain, "train", n=d.n_train, seed=self.cfg.seed),
            builtin_tasks(d.domain, "test", n=d.n_test, seed=self.cfg.seed),
        )

    # -------------------------------------------------------------- phase 1: bank
    def build_bank(self) -> None:
        """Fill (or load) the experience bank, index it, cache every task's retrievals."""
        from lopd.memory import ExperienceBank, HiddenStateEmbedder, Retriever, format_experience

        bank_dir = self.run_dir / "bank"
        traj_file = bank_dir / "trajectories.jsonl"
        done_file = bank_dir / "DONE"
        if self.is_main and not done_file.exists():
            # A bank left half-built by a killed run is rebuilt from scratch (same seed, same
            # rollouts), so the bank and its trajectory file never mix two sessions.
            if bank_dir.exists():
                shutil.rmtree(bank_dir)
            from lopd.collect import collect_bank

            reps = len(self.train_tasks) * self.cfg.bank.rollouts_per_task
            self.log(f"bank: {reps} base-model rollouts on the train split")
            res = collect_bank(
                self.backbone,
                self.tokenizer,
                self.train_tasks,
                bank_dir,
                self.gen_config(),
                min_reward=self.cfg.bank.min_reward,
                rollouts_per_task=self.cfg.bank.rollouts_per_task,
                seed=_mix_seed(self.cfg.seed, 1),
                embedder=HiddenStateEmbedder(self.backbone, self.tokenizer),
                query_tasks=self.train_tasks + self.test_tasks,
                index="cpu",
                progress=self.progress,
            )
            # Every successful trajectory (duplicated traces included) is cold-start data.
            with traj_file.open("w") as f:
                for t in res.successes:
                    f.write(json.dumps(trajectory_to_dict(t)) + "\n")
            _atomic_write_text(done_file, json.dumps(res.summary()))
        self._barrier()
        bank = ExperienceBank(bank_dir, min_reward=self.cfg.bank.min_reward)
        info = json.loads(done_file.read_text())
        self.bank_rollouts = int(info["rollouts"])
        # The bank's rollouts count toward the budget once (rank 0 generated them).
        self.rollouts = self.bank_rollouts if self.is_main else 0
        self.bank_trajectories = [
            trajectory_from_dict(json.loads(line)) for line in traj_file.read_text().splitlines()
        ]
        self.log(
            f"bank: {len(bank)} entries from {self.bank_rollouts} rollouts "
            f"({len(self.bank_trajectories)} successful, mean reward {info['mean_reward']:.3f})"
        )
        self.cfg.check_bank_size(len(bank))
        # The retriever embeds with the *frozen* backbone: do this before peft injects the
        # composer's LoRA into it.
        retriever = Retriever.load_or_build(
            bank, HiddenStateEmbedder(self.backbone, self.tokenizer), index="cpu", save=False
        )
        j = self.cfg.composer.num_retrieved
        tasks = self.train_tasks + self.test_tasks
        hits = retriever.retrieve_batch(tasks, k=j)
        for task, entries in zip(tasks, hits):
            if len(entries) < j:
                raise ConfigError(
                    f"composer.num_retrieved={j} but task {task.task_id!r} has only "
                    f"{len(entries)} bank entries of other tasks to retrieve: lower "
                    "composer.num_retrieved or collect a larger bank"
                )
            self._retrieved[task.task_id] = [format_experience(e) for e in entries]
        if self.is_main:
            _atomic_write_text(self.run_dir / "retrieval.json", json.dumps(self._retrieved))

    # -------------------------------------------------------------- composer
    def build_composer(self) -> None:
        c = self.cfg.composer
        torch.manual_seed(_mix_seed(self.cfg.seed, 2))
        self.composer = LatentComposer(
            self.backbone,
            self.tokenizer,
            num_latents=c.num_latents,
            num_retrieved=c.num_retrieved,
            qformer_layers=c.qformer_layers,
            ffn_mult=c.ffn_mult,
            lora_r=c.lora_r,
            lora_alpha=c.lora_alpha,
            lora_dropout=c.lora_dropout,
            max_encoder_tokens=c.max_encoder_tokens,
        )
        # No dropout anywhere in the composer/teacher: eval mode keeps them deterministic.
        self.composer.eval()
        self._broadcast_parameters(self.composer)

    def compose(self, tasks: Sequence[Task]) -> torch.Tensor:
        """c_phi for ``tasks``, ``[B, J*K, d]`` (differentiable in phi)."""
        return self.composer(
            [t.instruction for t in tasks], [self._retrieved[t.task_id] for t in tasks]
        )

    def cached_latents0(self, tasks: Sequence[Task]) -> torch.Tensor:
        """c_phi0 of ``tasks`` from the cache, ``[B, J*K, d]``."""
        return torch.stack([self._latents0[t.task_id] for t in tasks]).to(self.device)

    def teacher_sequence(self, traj: Trajectory) -> TeacherSequence:
        """The teacher input of a trajectory (A.4): framed prompt + placeholders + continuation."""
        user = next(m["content"] for m in traj.messages if m["role"] == "user")
        c = self.cfg.composer
        return build_teacher_sequence(
            self.tokenizer,
            traj.input_ids,
            traj.prompt_len,
            user,
            traj.task.domain,
            c.num_latents * c.num_retrieved,
            placeholder_id=self.pad_id,
        )

    # -------------------------------------------------------------- phase 2: cold start
    def cold_start(self) -> None:
        """Eq. 14: fit phi to the NLL of successful trajectories given c_phi.

        Saves phi_0 (``phi0.pt``) and caches c_phi0 of every train task (``latents0.pt``).
        """
        phi0_file = self.run_dir / "phi0.pt"
        lat_file = self.run_dir / "latents0.pt"
        if phi0_file.exists() and lat_file.exists():
            self.composer.load_phi_state_dict(torch.load(phi0_file, map_location=self.device))
            self._latents0 = torch.load(lat_file, map_location="cpu")
            self.log("cold start: loaded phi_0 and c_phi0 from the run directory")
            return
        cfg = self.cfg.cold_start
        data = self.bank_trajectories
        params = self.composer.trainable_parameters()
        t0 = time.perf_counter()
        if cfg.steps > 0 and data:
            opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
            for step in self._bar(range(cfg.steps), desc="cold start", unit="step"):
                rng = np.random.default_rng(_mix_seed(self.cfg.seed, 3, step))
                idx = rng.choice(len(data), size=cfg.batch_size, replace=len(data) < cfg.batch_size)
                mine = [data[i] for i in idx[self.rank :: self.world]]
                opt.zero_grad(set_to_none=True)
                loss = self._cold_start_loss(mine, cfg.batch_size) if mine else None
                if loss is not None:
                    loss.backward()
                self._average_gradients(params)
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                if loss is not None and step % max(1, cfg.steps // 10) == 0:
                    nll = loss.item() * cfg.batch_size / len(mine)
                    self.log(f"cold start step {step}: nll {nll:.4f}")
        elif not data:
            self.log("cold start: the bank holds no trajectory; phi_0 is the initialization")
        self.cold_start_seconds = time.perf_counter() - t0
        with torch.no_grad():
            latents0 = {}
            tasks = self.train_tasks
            bs = max(1, self.cfg.lopd.micro_batch)
            for i in range(0, len(tasks), bs):
                chunk = tasks[i : i + bs]
                for task, lat in zip(chunk, self.compose(chunk)):
                    latents0[task.task_id] = lat.detach().cpu()
        self._latents0 = latents0
        if self.is_main:
            _atomic_torch_save(self.composer.phi_state_dict(), phi0_file)
            _atomic_torch_save(latents0, lat_file)
        self._barrier()

    def _cold_start_loss(self, trajs: Sequence[Trajectory], batch_size: int) -> torch.Tensor:
        """Per-trajectory token-mean NLL of the action tokens under the latent-conditioned
        frozen backbone, summed and divided by the global batch size."""
        where = ActionRows.of(trajs, self.device)
        latents = self.compose([t.task for t in trajs])
        seqs = [self.teacher_sequence(t) for t in trajs]
        h = teacher_action_hidden(
            self.composer, seqs, latents, where, self.pad_id,
            checkpointed=self.cfg.model.gradient_checkpointing,
        )  # fmt: skip
        logits = _lm_head(self.composer.backbone)(h).float()
        nll = torch.nn.functional.cross_entropy(logits, where.targets, reduction="none")
        return segment_mean(nll, where.batch, len(trajs)).sum() / batch_size

    # -------------------------------------------------------------- evaluation
    def evaluate(self, which: str) -> dict[str, float]:
        """Evaluate on the held-out split (rank 0; other ranks wait).

        Args:
            which: ``vanilla`` or ``lopd`` (the student) or ``base_composer`` (the frozen base
                model generating with retrieved latents).
        """
        from lopd.evaluate import summarize

        result: dict[str, float] = {}
        if self.is_main:
            t0 = time.perf_counter()
            seed = _mix_seed(self.cfg.seed, 4)
            temp = self.cfg.eval.temperature
            if which == "base_composer":
                trajs = self._rollout_with_latents(self.test_tasks, seed, temp)
            else:
                trajs = self.generate(
                    self.student,
                    self.test_tasks,
                    seed,
                    temperature=temp,
                    count=False,
                    progress=self.progress,
                )
            result = summarize(trajs)
            result["seconds"] = time.perf_counter() - t0
            self.log(
                f"eval {which}: reward {result['reward_mean']:.3f} ± {result['reward_stderr']:.3f} "
                f"(n={result['n']}), success {result['success_rate']:.3f}"
            )
        self._barrier()
        return result

    @torch.no_grad()
    def _rollout_with_latents(
        self, tasks: Sequence[Task], seed: int, temperature: float
    ) -> list[Trajectory]:
        from lopd.chat import render_prompt
        from lopd.envs import make_env
        from lopd.evaluate import LatentConditionedLM, LatentPromptEnv

        c = self.cfg.composer
        n = c.num_latents * c.num_retrieved
        ph = self.tokenizer.convert_ids_to_tokens(self.pad_id)
        domain_of = {t.task_id: t.domain for t in tasks}

        def env_factory(task: Task) -> LatentPromptEnv:
            return LatentPromptEnv(make_env(task), domain_of[task.task_id], n, ph)

        prompts, starts, latents = [], [], []
        bs = max(1, self.cfg.lopd.micro_batch)
        for i in range(0, len(tasks), bs):
            chunk = list(tasks[i : i + bs])
            lat = self.compose(chunk)
            for task, lt in zip(chunk, lat):
                env = env_factory(task)
                ids = render_prompt(
                    self.tokenizer, env.system_prompt(), env.reset(task), env.tools()
                )
                start = _find_run(ids, self.pad_id, n)
                prompts.append(ids)
                starts.append(start)
                latents.append(lt)
        with self.composer.teacher_mode() as backbone:
            lm = LatentConditionedLM(backbone, prompts, latents, starts)
            return self.generate(
                lm,
                tasks,
                seed,
                temperature=temperature,
                count=False,
                make_env=env_factory,
                progress=self.progress,
            )

    # -------------------------------------------------------------- phase 3: joint training
    def _make_optimizers(self) -> None:
        cfg = self.cfg.lopd
        self.student_params = [p for p in self.student.parameters() if p.requires_grad]
        self.opt_student = torch.optim.AdamW(
            self.student_params, lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.composer_params = (
            self.composer.trainable_parameters() if self.composer is not None else []
        )
        self.opt_composer = (
            torch.optim.AdamW(
                self.composer_params, lr=cfg.composer_lr, weight_decay=cfg.weight_decay
            )
            if self.composer_params
            else None
        )

    def step_tasks(self, step: int) -> list[Task]:
        """This rank's tasks of training step ``step``: a pure function of (seed, step), so the
        data position of a resumed run is just the step number."""
        cfg = self.cfg.lopd
        rng = np.random.default_rng(_mix_seed(self.cfg.seed, 5, step))
        n = len(self.train_tasks)
        idx = rng.choice(n, size=cfg.tasks_per_step, replace=n < cfg.tasks_per_step)
        return [self.train_tasks[i] for i in idx[self.rank :: self.world]]

    def train_step(self, step: int) -> dict[str, float]:
        """One iteration of Algorithm 1 (all ranks)."""
        cfg = self.cfg.lopd
        t_start = time.perf_counter()
        trajs = self.method.rollouts(self, step)
        t_rollout = time.perf_counter() - t_start
        self.opt_student.zero_grad(set_to_none=True)
        if self.opt_composer is not None:
            self.opt_composer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_sum = 0.0
        t0 = time.perf_counter()
        for i in range(0, len(trajs), cfg.micro_batch):
            mb = trajs[i : i + cfg.micro_batch]
            loss, mb_sums = self.method.loss(self, mb, num_total=len(trajs))
            loss.backward()
            loss_sum += loss.item() * len(trajs)
            for k, v in mb_sums.items():
                sums[k] = sums.get(k, 0.0) + v
        t_backward = time.perf_counter() - t0
        self._average_gradients(self.student_params)
        self._average_gradients(self.composer_params)
        gnorm_s = float(torch.nn.utils.clip_grad_norm_(self.student_params, cfg.grad_clip))
        gnorm_c = (
            float(torch.nn.utils.clip_grad_norm_(self.composer_params, cfg.grad_clip))
            if self.composer_params
            else 0.0
        )
        self.opt_student.step()
        if self.opt_composer is not None:
            self.opt_composer.step()
        rewards = [t.reward for t in trajs]
        keys = sorted(sums)
        local = [
            float(len(trajs)), loss_sum, sum(rewards), sum(r >= 1.0 - 1e-9 for r in rewards),
            *[sums[k] for k in keys],
        ]  # fmt: skip
        glob = self._all_reduce_sum(local)
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
        metrics.update(self.method.after_step(self, means))
        metrics.update(
            grad_norm_student=gnorm_s,
            grad_norm_composer=gnorm_c,
            rollouts=self._global_rollouts(),
            seconds_rollout=t_rollout,
            seconds_loss_backward=t_backward,
            seconds_step=time.perf_counter() - t_start,
        )
        return metrics

    def _global_rollouts(self) -> int:
        return int(self._all_reduce_sum([float(self.rollouts)])[0])

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, step: int) -> None:
        """Everything a resumed run needs to continue exactly (rank 0 writes)."""
        rollouts = self._global_rollouts()
        if not self.is_main:
            self._barrier()
            return
        state = {
            "step": step,
            "student": self.student.state_dict(),
            "composer": self.composer.phi_state_dict() if self.composer is not None else None,
            "opt_student": self.opt_student.state_dict(),
            "opt_composer": self.opt_composer.state_dict() if self.opt_composer else None,
            "beta": self.beta,
            "method": self.method.state_dict(),
            "rollouts": rollouts,  # global count; restored on rank 0
            "wall_seconds": self.wall_before + (time.perf_counter() - self._t_session),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            "data_position": step,  # step_tasks() is a pure function of (seed, step)
        }
        _atomic_torch_save(state, self.ckpt_dir / f"step_{step:06d}.pt")
        for old in sorted(self.ckpt_dir.glob("step_*.pt"))[:-2]:
            old.unlink()
        self._barrier()

    def load_checkpoint(self) -> int:
        """Restore the newest checkpoint; returns the number of finished steps (0 if none)."""
        ckpts = sorted(self.ckpt_dir.glob("step_*.pt"))
        if not ckpts:
            return 0
        state = torch.load(ckpts[-1], map_location=self.device, weights_only=False)
        self.student.load_state_dict(state["student"])
        if state["composer"] is not None:
            self.composer.load_phi_state_dict(state["composer"])
        self.opt_student.load_state_dict(state["opt_student"])
        if self.opt_composer is not None and state["opt_composer"] is not None:
            self.opt_composer.load_state_dict(state["opt_composer"])
        self.beta = float(state["beta"])
        self.method.load_state_dict(self, state.get("method") or {})
        self.rollouts = int(state["rollouts"]) if self.is_main else 0
        self.wall_before = float(state["wall_seconds"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
        self.log(f"resumed from {ckpts[-1].name} (step {state['step']})")
        return int(state["step"])

    # -------------------------------------------------------------- the whole run
    def run(self) -> dict[str, Any]:
        """Bank -> cold start -> vanilla eval -> LOPD -> final eval; returns ``summary.json``."""
        self._t_session = time.perf_counter()
        self.setup()
        if self.method.uses_composer or self.method.uses_bank:
            self.build_bank()
        if self.method.uses_composer:
            self.build_composer()
            self.cold_start()
        self._make_optimizers()
        start = self.load_checkpoint() if self.resume else 0
        vanilla_file = self.run_dir / "eval_vanilla.json"
        if vanilla_file.exists():
            vanilla = json.loads(vanilla_file.read_text())
        else:
            vanilla = self.evaluate("vanilla")
            if self.is_main:
                _atomic_write_text(vanilla_file, json.dumps(vanilla))
        metrics_file = self.run_dir / "metrics.jsonl"
        writer = None
        if self.is_main:
            _truncate_metrics(metrics_file, start)
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start)
        cfg = self.cfg
        bar = self._bar(range(start, cfg.lopd.steps), desc=cfg.lopd.method, unit="step")
        for step in bar:
            m = self.train_step(step)
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.lopd.steps:
                ev = self.evaluate("lopd")
                m.update({f"eval_{k}": v for k, v in ev.items() if k != "seconds"})
            if self.is_main:
                with metrics_file.open("a") as f:
                    f.write(json.dumps(m) + "\n")
                for k, v in m.items():
                    if k != "step" and isinstance(v, (int, float)):
                        writer.add_scalar(k, v, step)
                writer.flush()
                bar.set_postfix(
                    reward=f"{m['reward_mean']:.2f}", kl=f"{m.get('kl', 0):.3f}",
                    beta=f"{self.beta:.3f}",
                )  # fmt: skip
                if (step + 1) % cfg.log_every == 0 and not self.progress:
                    self.log(json.dumps({k: round(v, 5) for k, v in m.items()}))
            done = step + 1
            if (
                cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            ) or done == cfg.lopd.steps:
                self.save_checkpoint(done)
        lopd_eval = self.evaluate("lopd")
        summary: dict[str, Any] = {"vanilla": vanilla, "lopd": lopd_eval}
        if self.composer is not None and cfg.eval.with_composer:
            summary["base_composer"] = self.evaluate("base_composer")
        summary["rollouts"] = self._global_rollouts()
        summary["wall_seconds"] = self.wall_before + (time.perf_counter() - self._t_session)
        # CPU time of this process in this session: on a shared, oversubscribed machine it is
        # the better estimate of the wall time the run would take on idle cores.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        summary["cpu_seconds_session"] = usage.ru_utime + usage.ru_stime
        if self.is_main:
            writer.close()
            _atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            self.student.save_pretrained(self.run_dir / "student")
            self.tokenizer.save_pretrained(self.run_dir / "student")
            if self.composer is not None:
                _atomic_torch_save(self.composer.phi_state_dict(), self.run_dir / "composer.pt")
            plot_rewards(metrics_file, self.run_dir / "reward_curve.png", summary)
        self._barrier()
        return summary

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _find_run(ids: Sequence[int], value: int, n: int) -> int:
    """Index of the first run of ``n`` consecutive ``value`` ids."""
    run = 0
    for i, x in enumerate(ids):
        run = run + 1 if x == value else 0
        if run == n:
            return i - n + 1
    raise ValueError(f"no run of {n} placeholder ids ({value}) in the rendered prompt")


def _truncate_metrics(path: Path, steps_done: int) -> None:
    """Keep the metrics of finished (checkpointed) steps only: a killed run may have logged
    steps after its last checkpoint, which the resumed run recomputes."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] < steps_done
    ]
    _atomic_write_text(path, "".join(line + "\n" for line in kept))


def plot_rewards(metrics_file: Path, out: Path, summary: dict[str, Any] | None = None) -> None:
    """Training reward per step (and the held-out rewards as horizontal lines) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if rows:
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["reward_mean"] for r in rows], label="train rollouts", alpha=0.6)
        w = max(1, len(rows) // 10)
        smooth = np.convolve([r["reward_mean"] for r in rows], np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1 :], smooth, label=f"train (moving avg {w})")
    for key, style in (("vanilla", "--"), ("lopd", "-")):
        if summary and summary.get(key):
            ax.axhline(
                summary[key]["reward_mean"], ls=style, color="k", lw=1, label=f"held-out {key}"
            )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
