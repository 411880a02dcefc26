"""The embedded tiny model: tokenizer, deterministic build, shipped asset, held-out reward."""

from __future__ import annotations

import json

import pytest
import torch

from lopd.envs import builtin_tasks
from lopd.latent.injection import FRAMING
from lopd.models.loading import load_model
from lopd.rollout.multi_turn import GenerationConfig, rollout
from lopd.tiny.build import (
    FORMATS_ASSET_DIR,
    SPECIAL_TOKENS,
    TINY_ASSET_DIR,
    TINY_RECIPES,
    TinyBuildConfig,
    build_tiny,
    build_tokenizer,
    evaluate_reward,
    weights_hash,
)
from lopd.tiny.data import reference_env_factory, same_template_references, tokenizer_corpus

# A build small enough for a test: a 1-layer, 32-wide model, 3 SFT steps of 2 episodes.
SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    sft_steps=3,
    batch_size=2,
    first_call_steps=2,
    excerpt_steps=2,
    excerpt_batch_size=2,
    eval_tasks=0,
    threads=1,
)


@pytest.fixture(scope="module")
def shipped():
    return load_model()


def test_tokenizer_round_trips_and_splits_lines():
    # Each piece twice (min_count=2): "find_policy", "policy_id" and '": "' become tokens.
    tok = build_tokenizer(["find_policy", "find_policy", "policy_id", "policy_id", '": "', '": "'])
    assert {"find_policy", "policy_id", '": "'} <= set(tok.get_vocab())
    for text in [
        '<tool_call>\n{"name": "find_policy", "arguments": {"policy_id": "PL-11"}}\n</tool_call>',
        "naïve café — 東京 ✓\n\nTask Completed",
        "",
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    ids = tok("find_policy\n\npolicy_id", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["find_policy", "\n", "\n", "policy_id"]
    # Special tokens are atomic and never produced from plain text pieces.
    for t in SPECIAL_TOKENS:
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)]
    with pytest.raises(ValueError, match="min_count"):
        build_tokenizer(["x"], min_count=0)


def test_tokenizer_makes_copying_one_token_per_value():
    """The recipe's tokenizer: numbers below 1000 are single tokens; a value starts with the same
    token (word or prefix) in the instruction, the tool result and the tool call; the A.5 framing
    costs about a token per word. (The shipped asset predates this tokenizer: see lopd.models.)"""
    tok = build_tokenizer(tokenizer_corpus(builtin_tasks("tool_use", split="train")[:90]))
    pieces = lambda text: tok.convert_ids_to_tokens(
        tok(text, add_special_tokens=False)["input_ids"]
    )
    assert all(pieces(str(n)) == [str(n)] for n in range(0, 1000, 37))
    instruction = pieces("Ship order #482 to Elm Rd 60. Set the ER limit of policy PN-7 to $450.")
    call = pieces('{"number": "#482", "address": "Elm Rd 60", "number": "PN-7", "limit": "$450"}')
    for value in (["#", "482"], ["Elm", " Rd", " ", "60"], ["PN-", "7"], ["$", "450"]):
        for seq in (instruction, call):
            assert any(seq[i : i + len(value)] == value for i in range(len(seq))), (value, seq)
    before, after = FRAMING["tool_use"]
    words = len((before + " " + after).split())
    assert len(pieces(before + after)) <= 1.5 * words


def test_build_is_deterministic(tmp_path):
    a = build_tiny(TinyBuildConfig(seed=3, **SMALL), out=tmp_path / "a", verbose=False)
    b = build_tiny(TinyBuildConfig(seed=3, **SMALL), out=None, verbose=False)
    assert a["weights_sha256"] == b["weights_sha256"] == weights_hash(b["model"])
    assert a["tokenizer"].get_vocab() == b["tokenizer"].get_vocab()
    c = build_tiny(TinyBuildConfig(seed=4, **SMALL), out=None, verbose=False)
    assert c["weights_sha256"] != a["weights_sha256"]
    # The saved directory loads back bit-identically, tokenizer and chat template included.
    model, tok = load_model(tmp_path / "a")
    assert weights_hash(model) == a["weights_sha256"]
    text = "Set the Glass limit of policy PN-3301 to $2000."
    assert tok(text)["input_ids"] == a["tokenizer"](text)["input_ids"]
    assert tok.chat_template == a["tokenizer"].chat_template
    info = json.loads((tmp_path / "a" / "build_info.json").read_text())
    assert info["weights_sha256"] == a["weights_sha256"] and info["config"]["seed"] == 3


def test_build_continues_from_init(tmp_path):
    """A recipe with ``init`` trains on from a model's weights and keeps its tokenizer (the
    five-format reader continues from the default model); the start's hash is recorded."""
    start = build_tiny(TinyBuildConfig(seed=3, **SMALL), out=tmp_path / "start", verbose=False)
    cfg = TinyBuildConfig(
        **{**SMALL, "init": str(tmp_path / "start"), "formats": ("sdft", "skill-sd")},
        excerpt_references=True,
    )
    a = build_tiny(cfg, out=tmp_path / "a", verbose=False)
    b = build_tiny(cfg, out=None, verbose=False)
    assert a["weights_sha256"] == b["weights_sha256"] != start["weights_sha256"]
    assert a["init_weights_sha256"] == start["weights_sha256"]
    assert a["tokenizer"].get_vocab() == start["tokenizer"].get_vocab()
    info = json.loads((tmp_path / "a" / "build_info.json").read_text())
    assert info["config"]["init"] == str(tmp_path / "start")
    with pytest.raises(FileNotFoundError, match="neither a shipped asset nor a checkpoint"):
        build_tiny(TinyBuildConfig(**{**SMALL, "init": str(tmp_path / "none")}), verbose=False)
    wider = TinyBuildConfig(**{**SMALL, "init": str(tmp_path / "start"), "hidden_size": 64})
    with pytest.raises(ValueError, match=r"another architecture: hidden_size 32 \(recipe 64\)"):
        build_tiny(wider, verbose=False)


def test_build_tiny_command_takes_a_recipe_and_overrides(tmp_path, capsys):
    from lopd.models.__main__ import main

    start = tmp_path / "start"
    build_tiny(TinyBuildConfig(seed=3, **SMALL), out=start, verbose=False)
    small = {k: v for k, v in SMALL.items() if k not in ("sft_steps", "first_call_steps")}
    recipe = TinyBuildConfig(**{**small, "init": str(start)}, formats=("sdpo",))
    argv = ["build-tiny", "--recipe", "small", "--out", str(tmp_path / "m")]
    argv += ["--sft-steps", "1", "--first-call-steps", "0", "--seed", "5"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TINY_RECIPES, "small", recipe)
        assert main(argv) == 0
    info = json.loads((tmp_path / "m" / "build_info.json").read_text())
    assert info["config"]["sft_steps"] == 1 and info["config"]["first_call_steps"] == 0
    assert info["config"]["seed"] == 5 and info["config"]["formats"] == ["sdpo"]
    assert info["config"]["excerpt_steps"] == SMALL["excerpt_steps"]
    assert "built in" in capsys.readouterr().out


def test_shipped_formats_asset(shipped):
    """The five-format reader: the recipe ``tiny-qwen3-formats`` continued from the shipped
    default (its recorded start is the default's weights), same tokenizer and shape."""
    model, tok = load_model(FORMATS_ASSET_DIR)
    info = json.loads((FORMATS_ASSET_DIR / "build_info.json").read_text())
    assert info["weights_sha256"] == weights_hash(model)
    assert info["config"] == TINY_RECIPES["tiny-qwen3-formats"].to_dict()
    assert info["init_weights_sha256"] == weights_hash(shipped[0])
    assert tok.get_vocab() == shipped[1].get_vocab()
    assert set(info["val_reward_other_formats"]) == {"opsd", "sdft", "sdpo", "skill-sd"}


def test_shipped_asset(shipped):
    model, tok = shipped
    files = {p.name: p.stat().st_size for p in TINY_ASSET_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "build_info.json"} <= set(files)
    assert sum(files.values()) <= 20 * 2**20
    assert type(model).__name__ == "Qwen3ForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    assert 0.8e6 <= n <= 10e6
    assert not model.training
    info = json.loads((TINY_ASSET_DIR / "build_info.json").read_text())
    assert info["weights_sha256"] == weights_hash(model)
    # The shipped weights are what `python -m lopd.models build-tiny` builds: the default recipe.
    assert info["config"] == TinyBuildConfig().to_dict()
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.vocab_size == len(tok)


def test_reference_prompt_rollout(shipped):
    """Rollouts with references as text: the first user message is the A.5 framing around the
    reference and ends with the task's instruction; everything else is the task's environment.
    (The reward effect of a reference is measured, not asserted: README, "reference probe".)"""
    model, tok = shipped
    val = builtin_tasks("tool_use", split="val", n=4)
    refs = same_template_references(val, builtin_tasks("tool_use", split="train"), seed=0)
    trajs = rollout(
        model, tok, val, GenerationConfig(), seed=0, make_env=reference_env_factory(refs)
    )
    before, _ = FRAMING["tool_use"]
    for task, traj in zip(val, trajs):
        user = traj.messages[1]["content"]
        assert user.startswith(before) and user.endswith(task.instruction)
        assert refs[task.task_id][0] in user and 0.0 <= traj.reward <= 1.0
    bare = evaluate_reward(model, tok, val, seed=0)
    assert 0.0 <= bare <= 1.0
    with pytest.raises(KeyError):
        evaluate_reward(model, tok, val, references={})


def test_load_model_dtype_and_errors(tmp_path):
    model, _ = load_model(dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="path"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="dtype"):
        load_model(dtype="float55")
