"""Turns of random tokens, generated without a model (``gen.engine=filler``): for sizing memory.

What a training step costs in memory depends on how long its trajectories are, not on what they
say. Decoding a 40,960-token trajectory to find out takes hours on a CPU and minutes on a GPU; the
filler takes none: every turn is exactly its token budget of random ordinary token ids (no stop or
special token, so no turn ends early), drawn from one seeded generator. With
``gen.max_new_tokens = gen.max_total_tokens - 1`` every trajectory of a run is exactly
``gen.max_total_tokens`` long (prompt, one turn, the end-of-turn token), and
``--profile-memory`` then measures every phase at that length::

    python -m lopd.train --preset paper --profile-memory gen.engine=filler \\
        gen.max_total_tokens=40960 gen.max_new_tokens=40959 gen.max_prompt_tokens=4096 ...

(``benchmarks/bench_standin_memory.py --trajectory-tokens`` sets these.) The verifiers score the
random text like any other (a reward of 0 in every built-in world), so rewards, the bank's
successes and every learning metric of such a run mean nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from lopd.rollout.chat import stop_token_ids
from lopd.rollout.multi_turn import TurnGenerator

__all__ = ["filler_turn_generator"]


def filler_turn_generator(tokenizer: Any, seed: int) -> TurnGenerator:
    """A :data:`~lopd.rollout.multi_turn.TurnGenerator` whose row ``i`` is ``budgets[i]`` random
    ordinary token ids (never a stop or special token), drawn in row order from a generator
    seeded with ``seed``."""
    excluded = set(stop_token_ids(tokenizer)) | set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in excluded])
    generator = torch.Generator().manual_seed(int(seed))

    def generate(contexts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        del contexts  # the filler reads nothing: its turns depend on the seed alone
        picks = [torch.randint(len(ordinary), (max(0, b),), generator=generator) for b in budgets]
        return [ordinary[p].tolist() for p in picks]

    return generate
