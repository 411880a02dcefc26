"""The real-checkpoint path on a small real-architecture stand-in (lopd.standin).

A random-init ``Qwen3ForCausalLM`` (2 layers, hidden 256) with Qwen3's vocabulary shape (151,936
rows, 151,669 tokens), a Qwen3-style byte-level BPE tokenizer with Qwen3's added tokens at their
ids and Qwen3's own chat template, trained end to end with the smoke preset under
``model.dtype=bfloat16``: full JSON tool schemas in the prompt (~1,000 tokens), float32 master
weights, padded vocabulary rows, the memory account and the checkpoint options.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from lopd.models.loading import load_model
from lopd.standin.build import QWEN3_BASE_VOCAB, SHAPES, build_qwen3_tokenizer, build_standin

FAST = ["data.n_train=4", "data.n_test=2", "train.steps=2", "gen.max_steps=1"]
"""Overrides of the smoke preset that keep the CI test fast."""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build_standin(tmp_path_factory.mktemp("standin") / "qwen3-ci", "ci")


def test_tokenizer_has_qwen3s_layout(standin):
    model, tok = load_model(standin)
    assert len(tok) == 151_669 and model.config.vocab_size == 151_936
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", QWEN3_BASE_VOCAB)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151_645)
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<tool_call>", "</tool_response>", "<think>"])
    assert ids == [151_644, 151_657, 151_666, 151_667]
    text = 'Café déjà vu: {"name": "find_customer"}\n\n  x'
    enc = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(enc) == text and len(enc) < len(text.encode())  # merges apply
    assert "<tool_call>" in tok.chat_template and "enable_thinking" in tok.chat_template
    assert model.num_parameters() == SHAPES["ci"].num_parameters()
    assert sum(p.numel() for p in model.parameters()) == SHAPES["ci"].num_parameters()
    # Deterministic: the same tokenizer again.
    assert build_qwen3_tokenizer().get_vocab() == tok.get_vocab()


def test_smoke_preset_end_to_end_in_bf16(standin, tmp_path):
    from lopd.train import main

    run = tmp_path / "run"
    argv = [
        "--preset", "smoke", "--model", str(standin), "--run-dir", str(run), "--no-progress",
        "--profile-memory", "model.dtype=bfloat16", "checkpoint_keep=1",
        "checkpoint_final_optimizer=false", "checkpoint_every=1",
        # The smoke preset with fewer tasks, steps and turns: every phase still runs (bank of
        # 4 for J=2, cold start, 2 LOPD steps, three evaluations), at half the CPU time.
        *FAST,
    ]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    # No deprecated transformers / peft call on the way (e.g. gradient_checkpointing_enable,
    # is_gradient_checkpointing): those go away in transformers v6.
    deprecated = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
        and ("transformers" in w.filename or "peft" in w.filename or "lopd" in w.filename)
    ]
    assert not deprecated, deprecated
    summary = json.loads((run / "summary.json").read_text())
    for key in ("vanilla", "lopd", "base_composer"):
        assert summary[key]["n"] == 2
    budget = summary["token_budget"]
    assert budget["context_length"] == 40_960
    assert budget["longest_prompt"] > 800  # Qwen3's template with full JSON tool schemas
    assert budget["teacher_overhead"] > 8  # J*K = 8 placeholders plus the framing text

    n = SHAPES["ci"].num_parameters()
    phases = [json.loads(line) for line in (run / "memory.jsonl").read_text().splitlines()]
    names = [p["phase"] for p in phases]
    assert names[:6] == ["start", "load", "bank", "cold_start", "setup", "eval_vanilla"]
    assert names.count("step") == 2 and names[-2:] == ["eval_final", "save"]
    load = next(p for p in phases if p["phase"] == "load")
    # float32 master student (+ its RoPE buffers), bf16 frozen backbone; tied embeddings once
    assert 4 * n <= load["weights_by_part"]["student"] <= 4 * n + 1024
    assert load["weights_by_part"]["backbone"] == 2 * n
    step = next(p for p in phases if p["phase"] == "step")
    phi = step["weights_by_part"]["phi"]
    assert 4 * n + phi <= step["weights_by_dtype"]["float32"] <= 4 * n + phi + 1024
    moments = 2 * (4 * n + phi)  # exp_avg and exp_avg_sq in float32 (+ a scalar step each)
    assert moments <= step["optimizer"] <= moments + 4 * 1000
    assert step["grads"] == 0  # freed after the optimizer step
    assert step["activations"] > 0 and step["peak"] > step["weights"] + step["optimizer"]

    ckpts = sorted((run / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000002.pt"]  # checkpoint_keep=1
    final = torch.load(ckpts[0], weights_only=False)
    assert "opt_student" not in final  # checkpoint_final_optimizer=false
    assert {t.dtype for t in final["student"].values()} == {torch.float32}
    student = load_file(run / "student" / "model.safetensors")
    assert {t.dtype for t in student.values()} == {torch.bfloat16}
    assert json.loads((run / "student" / "config.json").read_text())["dtype"] == "bfloat16"

    vocab = 151_669
    bank = (run / "bank" / "trajectories.jsonl").read_text().splitlines()
    assert bank and all(max(json.loads(t)["input_ids"]) < vocab for t in bank)


def test_memory_standins_at_a_trajectory_length(standin, tmp_path, capsys):
    """``benchmarks/bench_standin_memory.py --trajectory-tokens L``: every trajectory of the run is
    ``L`` tokens (the filler's turns), and the table has a row per phase."""
    from benchmarks.bench_standin_memory import main

    length = 2048
    (tmp_path / "standin-ci").symlink_to(standin)
    assert main(["--shape", "ci", "--out", str(tmp_path), "--trajectory-tokens", str(length)]) == 0
    run = tmp_path / f"run-ci-{length}"
    bank = [
        json.loads(line) for line in (run / "bank" / "trajectories.jsonl").read_text().splitlines()
    ]
    assert len(bank) == 4 and all(len(t["input_ids"]) == length for t in bank)
    table = capsys.readouterr().out
    for phase in ("| load |", "| bank |", "| cold_start |", "| step 0 |", "| eval_final |"):
        assert phase in table, phase
