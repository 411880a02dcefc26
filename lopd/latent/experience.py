"""Phase 1, the experience bank (paper A.3), and every task's retrieved experiences.

Base-model rollouts on the train split; successes enter an :class:`~lopd.memory.ExperienceBank`
in ``run_dir/bank`` with a FAISS retriever. The trajectories themselves are kept too
(``bank/trajectories.jsonl``): they are the cold start's data. Retrieval is fixed once the bank is
frozen, so the ``J`` experiences of every task (train and held-out) are looked up once and cached
(``retrieval.json``). A finished bank (its ``DONE`` marker) is loaded, not rebuilt; a bank left
half-built by a killed run is rebuilt from scratch with the same seed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from typing import Any

from lopd.atomic import atomic_write_text
from lopd.config import ConfigError
from lopd.latent.collect import collect_bank
from lopd.memory import ExperienceBank, HiddenStateEmbedder, Retriever, format_experience
from lopd.run.context import RunContext
from lopd.run.seeds import Stream, seed_of
from lopd.types import Task, TraceStep, Trajectory

__all__ = ["Experience", "build_experience", "trajectory_from_dict", "trajectory_to_dict"]


@dataclasses.dataclass
class Experience:
    """What the bank phase gives the later phases.

    Attributes:
        bank_rollouts: base-model rollouts generated to fill the bank (they count toward the
            rollout budget once).
        trajectories: every successful bank trajectory (duplicated traces included): the cold
            start's data.
        retrieved: ``task_id -> `` the ``composer.num_retrieved`` formatted experiences of every
            train and held-out task (never the task's own).
        retriever: the bank's FAISS retriever with its embedder (what a growing bank indexes
            its new entries in, :mod:`lopd.latent.growth`).
    """

    bank_rollouts: int
    trajectories: list[Trajectory]
    retrieved: dict[str, list[str]]
    retriever: Retriever | None = None


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


def _embedder(ctx: RunContext) -> HiddenStateEmbedder:
    """The retrieval embedder: the frozen backbone's mean-pooled hidden states, batched and
    truncated as ``bank.embed_batch_size`` / ``bank.embed_max_length`` say."""
    b = ctx.cfg.bank
    return HiddenStateEmbedder(
        ctx.models.backbone,
        ctx.models.tokenizer,
        batch_size=b.embed_batch_size,
        max_length=b.embed_max_length,
        document_style=b.document_style,
    )


def build_experience(ctx: RunContext) -> Experience:
    """Fill (or load) the experience bank, index it, and retrieve every task's experiences.

    Rank 0 collects the bank; the others wait and load it. Must run before peft injects the
    composer's LoRA into ``ctx.models.backbone``: the retriever embeds with the frozen base model.

    Raises:
        BankTooSmallError: the bank cannot serve ``composer.num_retrieved`` experiences.
        ConfigError: a task has fewer than ``composer.num_retrieved`` entries to retrieve.
    """

    cfg, run_dir, log = ctx.cfg, ctx.run_dir, ctx.log
    ctx.dist.enter("bank")
    train_tasks, test_tasks = ctx.train_tasks, ctx.test_tasks
    if ctx.dist.is_main and not run_dir.bank_done.exists():
        # A bank left half-built by a killed run is rebuilt from scratch (same seed, same
        # rollouts), so the bank and its trajectory file never mix two sessions.
        if run_dir.bank.exists():
            shutil.rmtree(run_dir.bank)

        reps = len(train_tasks) * cfg.bank.rollouts_per_task
        log(f"bank: {reps} base-model rollouts on the train split")
        res = collect_bank(
            ctx.models.backbone,
            ctx.models.tokenizer,
            list(train_tasks),
            run_dir.bank,
            ctx.engine.generation_config(),
            min_reward=cfg.bank.min_reward,
            rollouts_per_task=cfg.bank.rollouts_per_task,
            seed=seed_of(cfg.seed, Stream.BANK),
            batch_size=cfg.gen.rollout_batch_size,
            embedder=_embedder(ctx),
            query_tasks=list(train_tasks) + list(test_tasks),
            index="cpu",
            index_batch_size=cfg.bank.index_batch_size,
            progress=ctx.progress,
            turn_generator=ctx.engine.filler_turns(seed_of(cfg.seed, Stream.BANK)),
        )
        # Every successful trajectory (duplicated traces included) is cold-start data.
        with run_dir.bank_trajectories.open("w") as f:
            for t in res.successes:
                f.write(json.dumps(trajectory_to_dict(t)) + "\n")
        atomic_write_text(run_dir.bank_done, json.dumps(res.summary()))
    ctx.dist.barrier()
    bank = ExperienceBank(run_dir.bank, min_reward=cfg.bank.min_reward)
    info = json.loads(run_dir.bank_done.read_text())
    bank_rollouts = int(info["rollouts"])
    trajectories = [
        trajectory_from_dict(json.loads(line))
        for line in run_dir.bank_trajectories.read_text().splitlines()
    ]
    log(
        f"bank: {len(bank)} entries from {bank_rollouts} rollouts "
        f"({len(trajectories)} successful, mean reward {info['mean_reward']:.3f})"
    )
    cfg.check_bank_size(len(bank))
    retriever = Retriever.load_or_build(
        bank,
        _embedder(ctx),
        index="cpu",
        save=False,
        doc_batch_size=cfg.bank.index_batch_size,
    )
    j = cfg.composer.num_retrieved
    tasks = list(train_tasks) + list(test_tasks)
    hits = retriever.retrieve_batch(tasks, k=j)
    retrieved: dict[str, list[str]] = {}
    for task, entries in zip(tasks, hits):
        if len(entries) < j:
            raise ConfigError(
                f"composer.num_retrieved={j} but task {task.task_id!r} has only "
                f"{len(entries)} bank entries of other tasks to retrieve: lower "
                "composer.num_retrieved or collect a larger bank"
            )
        retrieved[task.task_id] = [format_experience(e) for e in entries]
    if ctx.dist.is_main:
        atomic_write_text(run_dir.retrieval, json.dumps(retrieved))
    return Experience(bank_rollouts, trajectories, retrieved, retriever)
