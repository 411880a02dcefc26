"""Rollout throughput of the embedded tiny Qwen3 on CPU: generated tokens per second.

Runs :func:`lopd.rollout.multi_turn.rollout` end to end (prompt rendering, batched prefill +
KV-cache decode with the default sampling, environment steps, observation rendering) on held-out
tool-use tasks, and reports generated (action-mask) tokens per second, episodes per second and the
mean reward, per batch size. Each configuration is timed ``--reps`` times with the same seed
(identical work); the median is recorded.

    python -m benchmarks.bench_rollout                       # 64 tasks, batch 8 and 32, 2 threads
    python -m benchmarks.bench_rollout --tasks 128 --batch-sizes 16,64 --threads 1

Results go to ``benchmarks/results/rollout.json`` via ``benchmarks.common.record``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import record
from lopd.envs import builtin_tasks
from lopd.models.loading import load_model
from lopd.rollout.multi_turn import GenerationConfig, rollout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=64, help="held-out tool-use tasks per run")
    ap.add_argument("--batch-sizes", default="8,32", help="comma-separated batch sizes")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per configuration")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    tasks = builtin_tasks("tool_use", split="test", n=args.tasks)
    gen = GenerationConfig()
    rollout(model, tok, tasks[:4], gen, seed=args.seed, batch_size=4)  # warm-up
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        times, trajs = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            trajs = rollout(model, tok, tasks, gen, seed=args.seed, batch_size=bs)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        generated = sum(sum(t.action_mask) for t in trajs)
        total = sum(len(t.input_ids) for t in trajs)
        turns = sum(t.num_steps for t in trajs)
        reward = sum(t.reward for t in trajs) / len(trajs)
        rec = record(
            "rollout",
            "hf-dynamic-cache",
            {"model": "tiny-qwen3", "tasks": len(tasks), "batch_size": bs},
            median,
            generated_tokens=generated,
            generated_tokens_per_s=generated / median,
            episodes_per_s=len(tasks) / median,
            trajectory_tokens=total,
            turns=turns,
            mean_reward=reward,
            threads=args.threads,
            gen=gen.to_dict(),
        )
        print(
            f"batch {bs:3d}: {median:7.2f} s  {rec['generated_tokens_per_s']:8.1f} gen tok/s  "
            f"{rec['episodes_per_s']:6.2f} ep/s  ({generated} generated / {total} total tokens, "
            f"{turns} turns, mean reward {reward:.3f})"
        )


if __name__ == "__main__":
    main()
