"""A bank that grows during training (``bank.grow``): the student's verified successes enter it.

The experience bank of phase 1 (:mod:`lopd.latent.experience`) holds the base model's successful
rollouts. With ``bank.grow`` the student's own successes on training tasks join it while it
trains, for every method that reads the bank (LOPD and its ablations, LOPD-PPO, OPSD, SDFT):

1. :meth:`BankGrowth.observe` takes each step's training rollouts; a rollout whose reward is at
   least ``bank.min_reward`` becomes a pending :class:`~lopd.memory.BankEntry`, one per task:
   a newer success of the same task replaces the pending one (the newest is kept).
2. Every ``bank.grow_every`` optimizer steps :meth:`BankGrowth.after_step` refreshes: the pending
   entries not already in the bank (same task, same trace) are embedded with the frozen base
   model (the encoder's LoRA off) and added to the FAISS index, every task's ``J`` retrievals
   are looked up again (in place: the composer, the text teachers and the held-out evaluation
   read the same dictionary), and the cached c_phi0 of the training tasks whose retrievals
   changed is recomputed with phi_0 (the anchor's target and ``lopd-frozen``'s latents).
3. Each step's metrics say how far it grew (``bank_size``, ``bank_added``,
   ``bank_retrieval_changed``), and ``bank_grown.jsonl`` in the run directory lists every entry
   that joined, with its step.

Only the training split enters: a rollout of any other split is refused (a rollout of a held-out
task in a training step would be a leak, never a success to keep). The phase-1 bank's files are
never written: ``bank/`` is shared between the runs of a seed (``lopd.compare``), so the grown
entries live in memory, in the method's checkpointed state and in ``bank_grown.jsonl``. A
resumed run restores them with their stored embeddings and c_phi0, so it continues with exactly
the index, the retrievals and the anchors of the run it continues.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lopd.atomic import atomic_write_text
from lopd.latent.experience import Experience
from lopd.latent.teacher import TaskLatents
from lopd.memory import BankEntry, Retriever, document_text, format_experience
from lopd.run.context import RunContext
from lopd.types import Task, Trajectory

__all__ = ["BankGrowth", "build_bank_growth", "latents_with_phi"]


def latents_with_phi(
    latents: TaskLatents, phi: dict[str, torch.Tensor], tasks: Sequence[Task], chunk: int
) -> dict[str, torch.Tensor]:
    """``task_id -> [J*K, d]`` latents of ``tasks`` composed with the weights ``phi`` (e.g.
    phi_0), without gradient; the composer's own phi is put back afterwards."""
    composer = latents.composer
    current = {k: v.detach().clone() for k, v in composer.phi_state_dict().items()}
    composer.load_phi_state_dict(phi)
    out: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for i in range(0, len(tasks), chunk):
                part = list(tasks[i : i + chunk])
                for task, lat in zip(part, latents(part)):
                    out[task.task_id] = lat.detach().cpu()
    finally:
        composer.load_phi_state_dict(current)
    return out


class BankGrowth:
    """The student's verified successes entering the bank (see the module docstring).

    Args:
        retriever: the bank's FAISS retriever (its query cache holds every task in ``tasks``).
        embed_documents: ``texts -> [n, d]`` unit-norm document embeddings, from the same
            frozen model that embedded the bank.
        tasks: every task whose retrievals are kept (the training and held-out splits).
        retrieved: ``task_id -> `` its ``J`` formatted experiences; updated in place.
        num_retrieved: J.
        min_reward: a rollout is a verified success at this reward (``bank.min_reward``).
        every: optimizer steps between refreshes (``bank.grow_every``).
        latents0: the cached ``task_id -> `` c_phi0 of the training tasks (composer methods),
            updated in place; ``None`` without a composer.
        compose0: ``tasks -> {task_id: c_phi0}`` with phi_0 (composer methods).
        log_file: where the grown entries are listed (``run_dir/bank_grown.jsonl``); ``None``:
            nowhere.
        base_mode: ``() ->`` the context in which the embedder's model is the frozen base (the
            composer's LoRA off); embeddings and retrievals run in it, so a query missing from
            the cache is embedded as the bank was.

    Attributes:
        steps: optimizer steps seen.
        grown: the entries that joined, in order, with their ``[d]`` embeddings.
    """

    def __init__(
        self,
        retriever: Retriever,
        embed_documents: Callable[[list[str]], np.ndarray],
        tasks: Sequence[Task],
        retrieved: dict[str, list[str]],
        num_retrieved: int,
        min_reward: float,
        every: int,
        latents0: dict[str, torch.Tensor] | None = None,
        compose0: Callable[[Sequence[Task]], dict[str, torch.Tensor]] | None = None,
        log_file: Path | None = None,
        base_mode: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.retriever = retriever
        self.embed_documents = embed_documents
        self.tasks = list(tasks)
        self.train_ids = {t.task_id for t in self.tasks if t.split == "train"}
        self.retrieved = retrieved
        self.num_retrieved = num_retrieved
        self.min_reward = min_reward
        self.every = every
        self.latents0 = latents0
        self.compose0 = compose0
        self.log_file = log_file
        self.base_mode = base_mode
        self.steps = 0
        self.pending: dict[str, BankEntry] = {}
        self.grown: list[tuple[BankEntry, np.ndarray]] = []
        self.refreshed0: dict[str, torch.Tensor] = {}  # c_phi0 recomputed after a refresh
        self.listeners: list[Callable[[list[BankEntry]], None]] = []
        self.base_entries = len(retriever)

    def __len__(self) -> int:
        """Entries in the bank now (phase 1's and the grown ones)."""
        return self.base_entries + len(self.grown)

    def subscribe(self, listener: Callable[[list[BankEntry]], None]) -> None:
        """Call ``listener(entries)`` with the entries of every refresh (and of a resume)."""
        self.listeners.append(listener)

    # -------------------------------------------------------------- each step
    def observe(self, trajectories: Sequence[Trajectory]) -> None:
        """Keep the verified successes of a step's rollouts as pending entries (one per task,
        the newest: a later rollout replaces an earlier one).

        Raises:
            ValueError: a rollout of a task outside the training split.
        """
        for t in trajectories:
            if t.task.split != "train" or t.task.task_id not in self.train_ids:
                raise ValueError(
                    f"bank.grow: rollout of task {t.task.task_id!r} (split {t.task.split!r}) is "
                    "not of the training split; only training tasks may enter the bank"
                )
            if float(t.reward) >= self.min_reward:
                entry = BankEntry.from_trajectory(t, meta={"source": "student", "step": self.steps})
                self.pending.pop(t.task.task_id, None)  # re-inserted last: the newest
                self.pending[t.task.task_id] = entry

    def after_step(self) -> dict[str, float]:
        """After an optimizer step: refresh every ``every`` steps; the growth metrics."""
        self.steps += 1
        added, changed = 0, 0
        if self.steps % self.every == 0:
            added, changed = self.refresh()
        return {
            "bank_size": float(len(self)),
            "bank_added": float(added),
            "bank_retrieval_changed": float(changed),
        }

    def refresh(self) -> tuple[int, int]:
        """Index the pending entries, retrieve again, recompute the changed c_phi0; returns
        ``(entries added, tasks whose retrievals changed)``."""
        known = {e.entry_id for e in self.retriever.entries}
        fresh = [e for e in self.pending.values() if e.entry_id not in known]
        self.pending = {}
        if not fresh:
            return 0, 0
        with self.base_mode():
            z = self.embed_documents([document_text(e) for e in fresh])
        self.add(fresh, np.asarray(z, dtype=np.float32))
        changed = self.retrieve_again()
        if self.log_file is not None:
            self.write_log()
        return len(fresh), changed

    def add(self, entries: list[BankEntry], embeddings: np.ndarray) -> None:
        """Index ``entries`` with their embeddings and tell the listeners."""
        self.retriever.add(entries, embeddings)
        self.grown += list(zip(entries, embeddings))
        for listener in self.listeners:
            listener(entries)

    def retrieve_again(self) -> int:
        """Every task's J retrievals from the grown index, written into :attr:`retrieved`; the
        changed training tasks' c_phi0 recomputed. Returns how many tasks changed."""
        with self.base_mode():
            hits = self.retriever.retrieve_batch(self.tasks, k=self.num_retrieved)
        changed = []
        for task, entries in zip(self.tasks, hits):
            texts = [format_experience(e) for e in entries]
            if texts != self.retrieved.get(task.task_id):
                self.retrieved[task.task_id] = texts
                changed.append(task)
        stale = [t for t in changed if t.task_id in self.train_ids]
        if self.latents0 is not None and self.compose0 is not None and stale:
            fresh0 = self.compose0(stale)
            self.latents0.update(fresh0)
            self.refreshed0.update(fresh0)
        return len(changed)

    def write_log(self) -> None:
        """``bank_grown.jsonl``: every grown entry, one JSON line each (written whole)."""
        lines = [json.dumps(e.to_dict(), ensure_ascii=True) for e, _ in self.grown]
        atomic_write_text(self.log_file, "".join(f"{line}\n" for line in lines))

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "pending": [e.to_dict() for e in self.pending.values()],
            "entries": [e.to_dict() for e, _ in self.grown],
            "embeddings": torch.from_numpy(
                np.stack([z for _, z in self.grown]) if self.grown else np.zeros((0, 0))
            ),
            "latents0": dict(self.refreshed0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a growth object built from the phase-1 bank alone
        (a resumed run's): the grown entries are indexed with their stored embeddings, the
        retrievals looked up again and the stored c_phi0 put back."""
        if self.grown:
            raise RuntimeError("load_state_dict needs the bank as phase 1 left it (no growth)")
        self.steps = int(state["steps"])
        self.pending = {d["task_id"]: BankEntry.from_dict(d) for d in state["pending"]}
        entries = [BankEntry.from_dict(d) for d in state["entries"]]
        if entries:
            self.add(entries, state["embeddings"].numpy().astype(np.float32))
            with self.base_mode():
                hits = self.retriever.retrieve_batch(self.tasks, k=self.num_retrieved)
            for task, found in zip(self.tasks, hits):
                self.retrieved[task.task_id] = [format_experience(e) for e in found]
        self.refreshed0 = dict(state["latents0"])
        if self.latents0 is not None:
            self.latents0.update(self.refreshed0)
        if self.log_file is not None:
            self.write_log()


def build_bank_growth(
    ctx: RunContext,
    experience: Experience,
    latents: TaskLatents | None,
    latents0: dict[str, torch.Tensor] | None,
) -> BankGrowth:
    """The growth of the run's bank (``bank.grow``), after the bank phase and the cold start.

    Documents are embedded by the retriever's embedder (the frozen backbone) with the composer's
    LoRA switched off, as the bank was embedded before the LoRA existed; c_phi0 is recomputed
    with phi_0 from ``run_dir/phi0.pt``.
    """
    cfg = ctx.cfg
    retriever = experience.retriever
    if retriever is None or retriever.embedder is None:
        raise ValueError("bank.grow needs the bank's retriever with its embedder")
    composer = latents.composer if latents is not None else None

    def base_mode() -> contextlib.AbstractContextManager[Any]:
        return composer.teacher_mode() if composer is not None else contextlib.nullcontext()

    compose0 = None
    if latents is not None:
        phi0 = torch.load(ctx.run_dir.phi0, map_location=ctx.device)
        chunk = max(1, cfg.train.micro_batch)

        def compose0(tasks: Sequence[Task]) -> dict[str, torch.Tensor]:
            with ctx.precision.autocast():
                return latents_with_phi(latents, phi0, tasks, chunk)

    return BankGrowth(
        retriever,
        retriever.embedder.embed_documents,
        list(ctx.train_tasks) + list(ctx.test_tasks),
        experience.retrieved,
        cfg.composer.num_retrieved,
        cfg.bank.min_reward,
        cfg.bank.grow_every,
        latents0=latents0,
        compose0=compose0,
        log_file=ctx.run_dir.bank_grown if ctx.dist.is_main else None,
        base_mode=base_mode,
    )
