"""``gen.engine=filler`` (lopd.rollout.filler): trajectories of a chosen length without decoding,
so ``--profile-memory`` measures each phase at that length."""

from __future__ import annotations

import json

import pytest

from lopd.config import ConfigError, load_config
from lopd.envs import builtin_tasks
from lopd.models.loading import load_model
from lopd.rollout.chat import stop_token_ids
from lopd.rollout.filler import filler_turn_generator
from lopd.rollout.multi_turn import GenerationConfig, rollout


@pytest.fixture(scope="module")
def tokenizer():
    return load_model()[1]


def test_filler_turns_fill_every_trajectory_to_the_total_budget(tokenizer):
    tasks = builtin_tasks("tool_use", split="test", n=5)
    length = 300
    gen = GenerationConfig(max_new_tokens_per_turn=length - 1, max_total_tokens=length, max_steps=1)
    trajs = rollout(None, tokenizer, tasks, gen, turn_generator=filler_turn_generator(tokenizer, 7))
    never = set(stop_token_ids(tokenizer)) | set(tokenizer.all_special_ids)
    for t in trajs:
        assert len(t.input_ids) == len(t.action_mask) == length
        start, end = t.turn_spans[0]
        assert (start, end) == (t.prompt_len, length - 1)  # then the closing end-of-turn token
        assert sum(t.action_mask) == end - start
        assert not never & set(t.input_ids[start:end])
        assert t.info["stop_reason"] == "max_steps"
    # Seeded: the same seed gives the same turns, another seed others.
    again = rollout(None, tokenizer, tasks, gen, turn_generator=filler_turn_generator(tokenizer, 7))
    other = rollout(None, tokenizer, tasks, gen, turn_generator=filler_turn_generator(tokenizer, 8))
    assert [t.input_ids for t in again] == [t.input_ids for t in trajs]
    assert [t.input_ids for t in other] != [t.input_ids for t in trajs]


def test_filler_engine_is_a_config_choice():
    cfg = load_config("smoke", overrides=["gen.engine=filler"])
    assert cfg.gen.engine == "filler"
    with pytest.raises(ConfigError, match=r"gen\.engine"):
        load_config("smoke", overrides=["gen.engine=random"]).validate()


def test_filler_run_trains_every_phase_at_the_chosen_length(tmp_path):
    """A whole smoke run under the filler: the bank, the cold start and the training rollouts are
    all exactly the chosen length, and the memory account logs every phase."""
    from lopd.trainer import Trainer

    length = 640
    cfg = load_config(
        "smoke",
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            "profile_memory=true",
            "gen.engine=filler",
            f"gen.max_total_tokens={length}",
            f"gen.max_new_tokens={length - 1}",
            "gen.max_prompt_tokens=500",
            "gen.max_steps=1",
            "train.steps=1",
            "cold_start.steps=1",
        ],
    )
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.setup()
        bank = [
            json.loads(line) for line in trainer.run_dir.bank_trajectories.read_text().splitlines()
        ]
        assert bank and all(len(t["input_ids"]) == length for t in bank)
        trajs = trainer.method.rollouts(0)
        assert trajs and all(len(t.input_ids) == length for t in trajs)
        trainer.train_step(0)
    finally:
        trainer.close()
    phases = [json.loads(line)["phase"] for line in trainer.run_dir.memory.read_text().splitlines()]
    assert {"bank", "cold_start", "setup", "step"} <= set(phases)
