"""Fill an experience bank from base-model rollouts (paper A.3).

:func:`collect_bank` rolls the base model out on training-split tasks, stores the successful
trajectories in an :class:`~lopd.memory.ExperienceBank`, indexes it with a FAISS
:class:`~lopd.memory.Retriever` and precomputes the query embedding of every task, saving index
and query cache in the bank directory so training never has to load the embedder. Only
training-split tasks feed the bank; held-out tasks may get cached *queries* (for evaluating the
teacher with retrieval) but never entries. It serves the run's bank phase
(:mod:`lopd.latent.experience`) and the ``python -m lopd.collect`` command.

Collection is incremental and crash-tolerant: rollouts run in chunks and each chunk's successes
are appended durably before the next starts, so an interrupted run keeps what it collected and a
second run adds to the same bank (identical traces are stored once).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lopd.memory import Embedder, ExperienceBank, HiddenStateEmbedder, Retriever
from lopd.rollout.multi_turn import GenerationConfig, TurnGenerator, rollout
from lopd.types import Task, Trajectory

__all__ = ["CollectResult", "collect_bank"]


@dataclass
class CollectResult:
    """Outcome of :func:`collect_bank`.

    Attributes:
        num_tasks: distinct tasks rolled out.
        num_rollouts: episodes run (``num_tasks * rollouts_per_task``).
        num_success: episodes with ``reward >= min_reward``.
        mean_reward: mean verifier reward over all episodes.
        num_added: new bank entries (successes minus traces already stored).
        bank_size: entries in the bank afterwards.
        seconds: wall-clock time of the whole call.
        rollout_seconds: of which generating rollouts.
        rewards: every episode's reward, in rollout order (task-major: ``rollouts_per_task``
            consecutive episodes per task).
        successes: the successful trajectories, in rollout order (the cold-start data).
        retriever: the built retriever (``None`` with ``build_index=False``).
    """

    num_tasks: int
    num_rollouts: int
    num_success: int
    mean_reward: float
    num_added: int
    bank_size: int
    seconds: float
    rollout_seconds: float
    rewards: list[float] = field(default_factory=list, repr=False)
    successes: list[Trajectory] = field(default_factory=list, repr=False)
    retriever: Retriever | None = field(default=None, repr=False)

    @property
    def success_rate(self) -> float:
        """Fraction of episodes that entered (or would have entered) the bank."""
        return self.num_success / self.num_rollouts if self.num_rollouts else 0.0

    def summary(self) -> dict[str, Any]:
        """The JSON-serializable figures (no trajectories, no retriever)."""
        return {
            "tasks": self.num_tasks,
            "rollouts": self.num_rollouts,
            "successes": self.num_success,
            "success_rate": round(self.success_rate, 4),
            "mean_reward": round(self.mean_reward, 4),
            "added": self.num_added,
            "bank_size": self.bank_size,
            "seconds": round(self.seconds, 2),
            "rollout_seconds": round(self.rollout_seconds, 2),
        }


def collect_bank(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    bank_dir: str | Path,
    gen: Any = None,
    *,
    min_reward: float = 1.0,
    rollouts_per_task: int = 1,
    seed: int = 0,
    batch_size: int = 32,
    chunk_size: int = 128,
    embedder: Embedder | None = None,
    build_index: bool = True,
    query_tasks: Sequence[Task] | None = None,
    index: str = "auto",
    index_batch_size: int = 256,
    progress: bool = True,
    turn_generator: TurnGenerator | None = None,
) -> CollectResult:
    """Roll ``model`` out on ``tasks``, add the successes to the bank, index it.

    Args:
        model: the base policy (a Hugging Face causal LM), used frozen.
        tokenizer: its tokenizer, with a chat template.
        tasks: training-split tasks to roll out (their successes become bank entries).
        bank_dir: the bank directory; created if missing, appended to if it exists.
        gen: a :class:`lopd.rollout.multi_turn.GenerationConfig` (default sampling when ``None``).
        min_reward: success threshold: an episode enters the bank when ``reward >= min_reward``.
        rollouts_per_task: episodes per task (the paper samples several to cover more tasks).
        seed: sampling seed; chunk ``c`` rolls out with ``seed * 1_000_003 + c`` (mod 2**63),
            so the result is deterministic for a fixed ``(seed, chunk_size, batch_size)``,
            device and threads.
        batch_size: episodes generated together (see :func:`lopd.rollout.multi_turn.rollout`).
        chunk_size: episodes per durable chunk: successes are appended and the progress bar
            advances after each chunk; a chunk refills its batch continuously, so only its tail
            runs under-full (keep it a few times ``batch_size``).
        embedder: retrieval embedder; default :class:`HiddenStateEmbedder` over ``model``.
        build_index: index the bank, precompute query embeddings and save both to ``bank_dir``.
        query_tasks: tasks whose query embeddings to precompute (default: ``tasks``); add the
            held-out split here to evaluate with retrieval without loading the embedder.
        index: FAISS placement, ``"auto"``, ``"cpu"`` or ``"gpu"``.
        index_batch_size: bank entries / query tasks per embedder call while indexing
            (:class:`~lopd.memory.Retriever`'s ``doc_batch_size``).
        progress: show a tqdm bar over episodes.
        turn_generator: generates the turns instead of ``model`` (which still embeds for
            retrieval), e.g. the filler of ``gen.engine=filler``; see
            :func:`lopd.rollout.multi_turn.rollout`.

    Returns:
        A :class:`CollectResult` with the figures, the successful trajectories and the retriever.

    Raises:
        ValueError: a non-training task in ``tasks`` (the bank must hold train-split experience
            only), or a bad numeric argument.
    """

    t_start = time.perf_counter()
    tasks = list(tasks)
    for name, v in (("rollouts_per_task", rollouts_per_task), ("batch_size", batch_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    leaked = [t.task_id for t in tasks if t.split != "train"]
    if leaked:
        raise ValueError(
            f"tasks must all be from the train split (the bank never holds held-out "
            f"experience); got {len(leaked)} others, e.g. {leaked[:3]}"
        )
    gen = gen or GenerationConfig()
    bank = ExperienceBank(bank_dir, min_reward=min_reward)
    episodes = [t for t in tasks for _ in range(rollouts_per_task)]

    bar = None
    if progress:
        bar = tqdm(total=len(episodes), desc="collect", unit="ep")
    successes: list[Trajectory] = []
    rewards: list[float] = []
    added, rollout_s = 0, 0.0
    try:
        for c, s in enumerate(range(0, len(episodes), chunk_size)):
            chunk = episodes[s : s + chunk_size]
            t0 = time.perf_counter()
            # Modulo 2**63: torch generators take at most 64-bit seeds, whatever ``seed`` is.
            chunk_seed = (seed * 1_000_003 + c) % (1 << 63)
            trajs = rollout(
                model,
                tokenizer,
                chunk,
                gen,
                seed=chunk_seed,
                batch_size=batch_size,
                turn_generator=turn_generator,
            )
            rollout_s += time.perf_counter() - t0
            wins = [t for t in trajs if bank.is_success(t)]
            added += len(bank.add_many(wins, meta={"collect_seed": seed}))
            successes += wins
            rewards += [float(t.reward) for t in trajs]
            if bar is not None:
                bar.update(len(chunk))
                bar.set_postfix(success=f"{len(successes) / (s + len(chunk)):.2f}", bank=len(bank))
    finally:
        if bar is not None:
            bar.close()

    retriever = None
    if build_index:
        if embedder is None:
            embedder = HiddenStateEmbedder(model, tokenizer)
        retriever = Retriever.load_or_build(
            bank, embedder, index=index, save=False, doc_batch_size=index_batch_size
        )
        retriever.sync()
        retriever.precompute_queries(
            query_tasks if query_tasks is not None else tasks, batch_size=index_batch_size
        )
        retriever.save()
    return CollectResult(
        num_tasks=len(tasks),
        num_rollouts=len(episodes),
        num_success=len(successes),
        mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        num_added=added,
        bank_size=len(bank),
        seconds=time.perf_counter() - t_start,
        rollout_seconds=rollout_s,
        rewards=rewards,
        successes=successes,
        retriever=retriever,
    )
