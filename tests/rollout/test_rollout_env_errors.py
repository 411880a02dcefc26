"""An env that raises mid-rollout fails its own episode (reward 0, reason recorded), not the run.

Fault injection: the envs below are the real tool-use env with a verifier bug planted.
"""

from __future__ import annotations

import pytest
import torch

from lopd.envs import ToolUseEnv, builtin_tasks, make_env
from lopd.models.loading import load_model
from lopd.rollout.multi_turn import GenerationConfig, rollout


class StepBug(ToolUseEnv):
    def step(self, model_text):
        super().step(model_text)
        raise KeyError("verifier bug in step")


class RewardBug(ToolUseEnv):
    def reward(self):
        raise ZeroDivisionError("verifier bug in reward")


def test_env_exceptions_become_failed_episodes():
    model, tok = load_model()
    tasks = builtin_tasks("tool_use", "test", n=4)
    broken = {tasks[1].task_id: StepBug, tasks[2].task_id: RewardBug}

    def factory(task):
        return broken[task.task_id]() if task.task_id in broken else make_env(task)

    gen = GenerationConfig(max_new_tokens_per_turn=8, max_steps=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only spin on a loaded machine
    try:
        with pytest.warns(RuntimeWarning, match="verifier bug") as caught:
            trajs = rollout(model, tok, tasks, gen, seed=0, batch_size=4, make_env=factory)
    finally:
        torch.set_num_threads(threads)
    assert len(caught) == 2 and len(trajs) == 4
    step_bug, reward_bug = trajs[1], trajs[2]
    assert step_bug.reward == 0.0 and step_bug.info["stop_reason"] == "env_error"
    assert step_bug.info["env_error"] == "env.step() raised KeyError: 'verifier bug in step'"
    assert len(step_bug.turn_spans) == 1  # stopped at the turn that raised
    assert reward_bug.reward == 0.0 and reward_bug.info["stop_reason"] == "env_error"
    assert "ZeroDivisionError: verifier bug in reward" in reward_bug.info["env_error"]
    for t in (trajs[0], trajs[3]):
        assert "env_error" not in t.info and t.info["stop_reason"] in ("done", "max_steps")
        assert 0.0 <= t.reward <= 1.0
