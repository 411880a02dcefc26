"""Token budgets and config honesty: start-up errors instead of crashes mid-run.

Budgets from config checked against the model's context and every prompt (lopd.rollout.budget), task
counts a source cannot supply, intermixed ``key=value`` overrides, and padded vocabulary rows
never sampled (lopd.rollout).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from lopd.config import ConfigError, load_config
from lopd.envs import builtin_tasks, make_env
from lopd.latent.conditioned import LatentFraming
from lopd.models.loading import load_model
from lopd.rollout.budget import check_token_budgets, prompt_budget
from lopd.rollout.chat import render_prompt
from lopd.run.tasks import load_tasks
from lopd.train import build_config, parse_args


@pytest.fixture(scope="module")
def tiny():
    return load_model()


def _split(n_train: int = 6, n_test: int = 4):
    return (
        builtin_tasks("tool_use", "train", n=n_train),
        builtin_tasks("tool_use", "test", n=n_test),
    )


def _prompt_lengths(tokenizer, tasks) -> list[int]:
    out = []
    for t in tasks:
        env = make_env(t)
        out.append(len(render_prompt(tokenizer, env.system_prompt(), env.reset(t), env.tools())))
    return out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("gen.max_new_tokens=2048", "gen.max_new_tokens=2048 must be below gen.max_total_tokens"),
        (
            "gen.max_prompt_tokens=2047",
            r"gen.max_prompt_tokens must be null or in \[1, gen.max_total_tokens - 2 = 2046\]",
        ),
        ("gen.prompt_overflow=truncate", "gen.prompt_overflow must be one of"),
        ("gen.rollout_batch_size=0", "gen.rollout_batch_size must be >= 1"),
        ("bank.embed_max_length=0", "bank.embed_max_length must be >= 1"),
        ("checkpoint_keep=0", "checkpoint_keep must be >= 1"),
        ("model.attn_implementation=flash", "model.attn_implementation must be one of"),
        ("model.attn_implementation=flash_attention_2", "needs model.dtype bfloat16 or float16"),
    ],
)
def test_budget_and_batch_keys_are_validated(override, message):
    cfg = load_config("smoke", overrides=[override])
    with pytest.raises(ConfigError, match=message):
        cfg.validate(check_paths=False)


def _framing(cfg):
    return LatentFraming(cfg.composer.num_latents * cfg.composer.num_retrieved)


def test_prompts_are_checked_at_startup_error_or_counted_drop(tiny):
    model, tokenizer = tiny
    train, test = _split()
    lengths = sorted(_prompt_lengths(tokenizer, train + test))
    assert lengths[0] < lengths[-1]  # worlds differ in tool lists
    cfg = load_config("smoke", overrides=["eval.with_composer=false"])
    tr, te, report = check_token_budgets(
        cfg, model.config, tokenizer, train, test, _framing(cfg), print
    )
    assert (tr, te) == (train, test)
    assert report.longest_prompt == lengths[-1] and report.teacher_overhead > 8  # J*K=8 + text
    assert report.max_prompt_tokens == prompt_budget(cfg) == 2048 - 16

    cut = lengths[-1] - 1  # only the longest prompts are over
    cfg = load_config("smoke", overrides=[f"gen.max_prompt_tokens={cut}"])
    over = sum(n > cut for n in lengths)
    with pytest.raises(ConfigError, match=rf"over gen.max_prompt_tokens={cut}.* {lengths[-1]} "):
        check_token_budgets(cfg, model.config, tokenizer, train, test, None, print)
    cfg.gen.prompt_overflow = "drop"
    logged = []
    tr, te, report = check_token_budgets(
        cfg, model.config, tokenizer, train, test, None, logged.append
    )
    assert len(report.dropped_train) + len(report.dropped_test) == over
    assert len(tr) + len(te) == len(train) + len(test) - over
    assert re.search(rf"dropped {over} tasks \(gen.prompt_overflow=drop\)", logged[0])
    assert report.to_dict()["dropped_train"] == len(report.dropped_train)


def test_budgets_over_the_context_length_stop_at_startup(tiny):
    model, tokenizer = tiny
    ctx = model.config.max_position_embeddings  # 4096 for the tiny model
    train, test = _split(2, 2)
    cfg = load_config("smoke", overrides=[f"gen.max_total_tokens={ctx + 1}"])
    with pytest.raises(ConfigError, match=f"gen.max_total_tokens={ctx + 1} exceeds .* {ctx}"):
        check_token_budgets(cfg, model.config, tokenizer, train, test, None, print)
    # With a composer the teacher reads framing text and J*K placeholders on top.
    cfg = load_config("smoke", overrides=[f"gen.max_total_tokens={ctx}"])
    check_token_budgets(cfg, model.config, tokenizer, train, test, None, print)
    with pytest.raises(ConfigError, match=r"plus the latent teacher's framing .* set gen.max_tot"):
        check_token_budgets(cfg, model.config, tokenizer, train, test, _framing(cfg), print)


def test_a_prompt_over_budget_stops_the_trainer_before_any_rollout(tmp_path):
    """Before: rollout() raised ValueError on the first long prompt, mid-run."""
    from lopd.trainer import Trainer

    cfg = load_config("smoke", overrides=[f"run_dir={tmp_path / 'r'}", "gen.max_total_tokens=200"])
    trainer = Trainer(cfg, progress=False)
    with pytest.raises(ConfigError, match=r"train and .* test tasks have prompts over"):
        trainer.setup()
    assert not (tmp_path / "r" / "bank").exists()


def test_task_counts_a_source_cannot_supply_are_errors(tmp_path):
    cfg = load_config("smoke", overrides=["data.n_train=601"])
    with pytest.raises(ConfigError, match=r"data.n_train=601 but the built-in tool_use generator"):
        load_tasks(cfg)
    assert load_config("paper").data.n_train == 2349  # the paper's count needs --tasks
    with pytest.raises(ConfigError, match=r"data.n_train=2349 .* only 600 train tasks"):
        load_tasks(load_config("paper"))
    path = tmp_path / "tasks.jsonl"
    rows = [t.to_dict() for t in _split(3, 1)[0] + _split(3, 1)[1]]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config("smoke", overrides=[f"data.tasks_path={path}", "data.n_train=3"])
    with pytest.raises(ConfigError, match=r"data.n_test=4 but data.tasks_path .* has only 1 test"):
        load_tasks(cfg)
    cfg.data.n_test = 1
    train, test = load_tasks(cfg)
    assert (len(train), len(test)) == (3, 1)


def test_overrides_parse_anywhere_on_the_command_line(tmp_path):
    args = parse_args(["train.steps=5", "--preset", "smoke", "seed=3", "--run-dir", str(tmp_path)])
    cfg = build_config(args)
    assert (cfg.train.steps, cfg.seed, cfg.run_dir) == (5, 3, str(tmp_path))
    assert build_config(parse_args(["--profile-memory", "--preset", "smoke"])).profile_memory


def test_padded_vocabulary_rows_are_never_sampled(tiny):
    """A model with 16 rows past its tokenizer whose logits always win: greedy decoding would
    pick them every time; the rollout samples only ids the tokenizer has."""
    import copy

    from lopd.rollout.multi_turn import GenerationConfig, rollout

    base, tokenizer = tiny
    n = len(tokenizer)
    model = copy.deepcopy(base)
    model.resize_token_embeddings(n + 16)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.zero_()
        norm[0] = 1.0  # final hidden state h = (h_0, 0, ..., 0)
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[n : n + 8, 0] = 100.0  # whichever sign h_0 has, a padded row scores 100 |h_0|
        head[n + 8 :, 0] = -100.0
    ids = torch.tensor([tokenizer("hello world")["input_ids"]])
    assert int(model(input_ids=ids).logits[0, -1].argmax()) >= n  # the unmasked argmax
    gen = GenerationConfig(temperature=0.0, max_new_tokens_per_turn=8, max_steps=1)
    trajs = rollout(model, tokenizer, _split(2, 1)[0], gen, seed=0)
    sampled = [i for t in trajs for i, m in zip(t.input_ids, t.action_mask) if m]
    assert sampled and max(sampled) < n
