"""Named seed streams: every random draw of a run comes from ``(cfg.seed, stream, ...)``.

Each consumer of randomness has its own stream, so adding a draw in one place never shifts the
numbers another place sees, and a resumed run recomputes the same draws from the step number
alone (no generator state to save). The stream values are part of the run's identity: changing
one changes every result of that stream.

Example:
    >>> seed_of(0, Stream.TRAIN_ROLLOUT, 3, 1)   # step 3, rank 1
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["Stream", "mix_seed", "seed_of"]


class Stream(enum.IntEnum):
    """What a seed is for (the values are fixed: they are mixed into the seed)."""

    BANK = 1
    """Base-model rollouts that fill the experience bank."""
    COMPOSER_INIT = 2
    """The composer's initial weights (LoRA and QFormer; seeds torch's global generator)."""
    COLD_START_BATCH = 3
    """Which bank trajectories a cold-start step trains on (``step``)."""
    EVAL = 4
    """Held-out evaluation rollouts."""
    STEP_TASKS = 5
    """Which training tasks a step draws (``step``); all ranks draw the same list."""
    TRAIN_ROLLOUT = 6
    """Sampling of a step's training rollouts (``step, rank``)."""
    SDPO_SIBLING = 7
    """SDPO's choice of a successful sibling (``step, rank``)."""


def mix_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (Python's hash of ints is not salted)."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0]
    ) & ((1 << 31) - 1)


def seed_of(base: int, stream: Stream, *parts: int) -> int:
    """The seed of ``stream`` for the run seed ``base`` and the stream's indices ``parts``."""
    return mix_seed(base, int(stream), *parts)
