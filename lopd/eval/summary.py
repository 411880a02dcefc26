"""Held-out metrics of one rollout per task (paper Table 3).

Mean reward with its standard error, success rate (reward 1), interaction steps, tool calls per
step, repeated tool calls and first-step length (tokens of the first assistant turn).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lopd.types import Trajectory

__all__ = ["BEHAVIOUR_METRICS", "summarize"]


BEHAVIOUR_METRICS = ("steps", "tool_calls_per_step", "repeated_tool_calls", "first_step_tokens")
"""Paper Table 3's behaviour metrics among :func:`summarize`'s keys."""


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Table-3 metrics of one rollout per held-out task.

    Returns:
        ``n``, ``reward_mean``, ``reward_stderr`` (sample std / sqrt(n); 0 for n = 1),
        ``success_rate`` (reward >= 1), ``steps``, ``tool_calls_per_step``,
        ``repeated_tool_calls``, ``first_step_tokens`` (means over tasks).
    """
    n = len(trajectories)
    if n == 0:
        raise ValueError("trajectories must not be empty")
    rewards = [float(t.reward) for t in trajectories]
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    steps = [t.num_steps for t in trajectories]
    calls_per_step = [t.num_tool_calls / max(t.num_steps, 1) for t in trajectories]
    repeated = [int(t.info.get("repeated_tool_calls", 0)) for t in trajectories]
    first = [(t.turn_spans[0][1] - t.turn_spans[0][0]) if t.turn_spans else 0 for t in trajectories]
    return {
        "n": n,
        "reward_mean": mean,
        "reward_stderr": math.sqrt(var / n),
        "success_rate": sum(r >= 1.0 - 1e-9 for r in rewards) / n,
        "steps": sum(steps) / n,
        "tool_calls_per_step": sum(calls_per_step) / n,
        "repeated_tool_calls": sum(repeated) / n,
        "first_step_tokens": sum(first) / n,
    }
