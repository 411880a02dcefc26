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
from collections.abc import Sequence
from typing import Any

import torch

from lopd.envs import builtin_tasks, load_tasks_jsonl
from lopd.latent.collect import collect_bank
from lopd.memory import (
    DOCUMENT_STYLES,
    Embedder,
    HiddenStateEmbedder,
    SentenceTransformerEmbedder,
)
from lopd.models import load_model
from lopd.rollout.multi_turn import GenerationConfig

DEFAULT_BANK_DIR = "runs/bank"


def _make_embedder(
    spec: str, model: Any, tokenizer: Any, device: str, document_style: str | None = None
) -> Embedder:
    """``hidden`` or a sentence-transformers model; ``document_style=None``: the embedder's
    own default (``task`` for hidden states, the paper's ``task_trace`` for a text embedder)."""
    style = {} if document_style is None else {"document_style": document_style}
    if spec == "hidden":
        return HiddenStateEmbedder(model, tokenizer, **style)

    return SentenceTransformerEmbedder(spec, device=device, **style)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""

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

        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    query_tasks = None
    if args.tasks is None:
        tasks = builtin_tasks(args.domain, "train", n=args.n, seed=args.seed)
        if not args.no_test_queries:
            query_tasks = tasks + builtin_tasks(args.domain, "test", seed=args.seed)
    else:
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
