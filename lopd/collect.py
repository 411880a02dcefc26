"""Build the experience bank from base-model rollouts: ``python -m lopd.collect``.

Rolls the base model out on the training split, stores the successful trajectories in an
:class:`~lopd.memory.ExperienceBank`, indexes it with a FAISS :class:`~lopd.memory.Retriever` and
precomputes the query embedding of every task, saving index and query cache in the bank
directory so training never has to load the embedder (paper A.3). Only training-split tasks
feed the bank; held-out tasks may get cached *queries* (for evaluating the teacher with
retrieval) but never entries.

Usage::

    python -m lopd.collect                          # tiny model, built-in tool-use train split
    python -m lopd.collect --domain coding --min-reward 1   # built-in coding train split
    python -m lopd.collect --model /ckpt/Qwen3-4B --tasks train.jsonl --bank runs/bank \\
        --rollouts-per-task 4 --embedder Qwen/Qwen3-Embedding-8B

Collection is incremental and crash-tolerant: rollouts run in chunks and each chunk's successes
are appended durably before the next starts, so an interrupted run keeps what it collected and a
second run adds to the same bank (identical traces are stored once).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopd.memory import DOCUMENT_STYLES, Embedder, ExperienceBank, HiddenStateEmbedder, Retriever
from lopd.types import Task, Trajectory

DEFAULT_BANK_DIR = "runs/bank"


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
) -> CollectResult:
    """Roll ``model`` out on ``tasks``, add the successes to the bank, index it.

    Args:
        model: the base policy (a Hugging Face causal LM), used frozen.
        tokenizer: its tokenizer, with a chat template.
        tasks: training-split tasks to roll out (their successes become bank entries).
        bank_dir: the bank directory; created if missing, appended to if it exists.
        gen: a :class:`lopd.rollout.GenerationConfig` (default sampling when ``None``).
        min_reward: success threshold: an episode enters the bank when ``reward >= min_reward``.
        rollouts_per_task: episodes per task (the paper samples several to cover more tasks).
        seed: sampling seed; chunk ``c`` rolls out with ``seed * 1_000_003 + c`` (mod 2**63),
            so the result is deterministic for a fixed ``(seed, chunk_size, batch_size)``,
            device and threads.
        batch_size: episodes generated together (see :func:`lopd.rollout.rollout`).
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

    Returns:
        A :class:`CollectResult` with the figures, the successful trajectories and the retriever.

    Raises:
        ValueError: a non-training task in ``tasks`` (the bank must hold train-split experience
            only), or a bad numeric argument.
    """
    from lopd.rollout import GenerationConfig, rollout

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
        from tqdm.auto import tqdm

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
            trajs = rollout(model, tokenizer, chunk, gen, seed=chunk_seed, batch_size=batch_size)
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


def _make_embedder(
    spec: str, model: Any, tokenizer: Any, device: str, document_style: str | None = None
) -> Embedder:
    """``hidden`` or a sentence-transformers model; ``document_style=None``: the embedder's
    own default (``task`` for hidden states, the paper's ``task_trace`` for a text embedder)."""
    style = {} if document_style is None else {"document_style": document_style}
    if spec == "hidden":
        return HiddenStateEmbedder(model, tokenizer, **style)
    from lopd.memory import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder(spec, device=device, **style)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    from lopd.rollout import GenerationConfig

    p = argparse.ArgumentParser(
        prog="python -m lopd.collect",
        description="Roll the base model out on the train split and build the experience bank.",
    )
    p.add_argument("--model", default=None, help="local HF checkpoint (default: the tiny model)")
    p.add_argument(
        "--tasks",
        default=None,
        help="JSONL of train tasks (lopd tasks or TACO rows, see lopd.envs.load_tasks_jsonl; "
        "default: the built-in train split of --domain)",
    )
    p.add_argument(
        "--domain",
        default="tool_use",
        choices=["tool_use", "coding"],
        help="built-in task set when --tasks is not given",
    )
    p.add_argument("--bank", default=DEFAULT_BANK_DIR, help="bank directory (appended to)")
    p.add_argument("--n", type=int, default=None, help="use the first N tasks")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and built-in task seed)")
    p.add_argument("--min-reward", type=float, default=1.0, help="success threshold")
    p.add_argument("--rollouts-per-task", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="episodes generated together")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=128,
        help="episodes per durable chunk (the progress bar advances per chunk)",
    )
    p.add_argument("--temperature", type=float, default=GenerationConfig.temperature)
    p.add_argument("--max-steps", type=int, default=GenerationConfig.max_steps)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=GenerationConfig.max_new_tokens_per_turn,
        help="generated tokens per assistant turn",
    )
    p.add_argument(
        "--embedder",
        default="hidden",
        help="'hidden' (mean-pooled hidden states of --model) or a sentence-transformers "
        "model name/path, e.g. Qwen/Qwen3-Embedding-8B",
    )
    p.add_argument(
        "--document-style",
        default=None,
        choices=DOCUMENT_STYLES,
        help="what of a bank entry is embedded: its task text ('task', the default for "
        "'hidden') or task and trajectory ('task_trace', paper eq. 15, the default for a "
        "sentence-transformers model)",
    )
    p.add_argument("--device", default="cpu", help="model device, e.g. cuda")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; 1 on a shared or busy machine)",
    )
    p.add_argument("--dtype", default=None, help="model dtype, e.g. bfloat16")
    p.add_argument("--index", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument(
        "--no-test-queries",
        action="store_true",
        help="built-in tasks: do not precompute held-out query embeddings",
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.n is not None and args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)

    from lopd.models import load_model

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    query_tasks = None
    if args.tasks is None:
        from lopd.envs import builtin_tasks

        tasks = builtin_tasks(args.domain, "train", n=args.n, seed=args.seed)
        if not args.no_test_queries:
            query_tasks = tasks + builtin_tasks(args.domain, "test", seed=args.seed)
    else:
        from lopd.envs import load_tasks_jsonl

        tasks = load_tasks_jsonl(args.tasks)[: args.n]
    gen = GenerationConfig(
        temperature=args.temperature,
        max_steps=args.max_steps,
        max_new_tokens_per_turn=args.max_new_tokens,
    )
    embedder = _make_embedder(args.embedder, model, tokenizer, args.device, args.document_style)
    res = collect_bank(
        model,
        tokenizer,
        tasks,
        args.bank,
        gen,
        min_reward=args.min_reward,
        rollouts_per_task=args.rollouts_per_task,
        seed=args.seed,
        batch_size=args.batch_size,
        chunk_size=args.chunk_size,
        embedder=embedder,
        query_tasks=query_tasks,
        index=args.index,
        progress=not args.no_progress,
    )
    s = res.summary()
    print(
        f"collected {s['rollouts']} rollouts of {s['tasks']} tasks in {s['seconds']:.1f}s "
        f"(rollouts {s['rollout_seconds']:.1f}s)\n"
        f"  success rate {s['success_rate']:.3f} (reward >= {args.min_reward}), "
        f"mean reward {s['mean_reward']:.3f}\n"
        f"  bank {args.bank}: {s['bank_size']} entries ({s['added']} new), "
        f"index {len(res.retriever) if res.retriever else 0} rows, "
        f"{len(query_tasks or tasks)} cached queries"
    )
    print(json.dumps({"summary": s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
