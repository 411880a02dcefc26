"""The memory prediction (lopd.run.memory_prediction, lopd.run.model_shape): the arithmetic on a
tiny shape against hand counts, the per-layer activation counts against what autograd saves in a
Hugging Face Qwen3, and the weights, gradients and AdamW of the measured stand-in runs of
docs/trainer.md."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from lopd.config.presets import PRESETS
from lopd.run.memory_account import saved_tensor_bytes
from lopd.run.memory_prediction import (
    CONTEXT_BYTES,
    GIB,
    MODELS,
    TOPM_BLOCK_BYTES,
    ModelShape,
    RunSetting,
    fits,
    main,
    predict,
    qformer_params,
    standin_predictions,
)

# layers 2, hidden 8, intermediate 12, 2 heads, 1 KV head, head_dim 4: q_dim 8, kv_dim 4.
TINY = ModelShape(2, 8, 12, 2, 1, 4, vocab=16)


def test_parameter_and_per_token_counts_by_hand():
    # Layer: q, o 2 * 8 * 8, k, v 2 * 8 * 4, q/k norms 2 * 4, MLP 3 * 8 * 12, norms 2 * 8.
    assert TINY.layer_params() == 128 + 64 + 8 + 288 + 16 == 504
    assert TINY.root_params() == 16 * 8 + 8 == 136
    assert TINY.params() == 2 * 504 + 136 == 1144
    assert dataclasses.replace(TINY, tied=False).params() == 1144 + 128
    assert TINY.lora_params(2) == 2 * 2 * ((8 + 8) * 2 + (8 + 4) * 2 + (8 + 12) * 3) == 464
    # Trained, mixed: norms 2(8d + 4) + bf16 casts 2 * 5d, q/k norms 6(q + kv), 1/rms of q/k
    # 4 * 3, attention 2(2q + 2kv) + lse 4 * 2, MLP 8i.
    assert TINY.trained_layer_bytes(True) == 136 + 80 + 72 + 12 + 48 + 8 + 96 == 452
    assert TINY.trained_layer_bytes(False) == 200 + 96 + 12 + 96 + 8 + 192 == 604
    # Frozen: norms 2(4d + 4), q/k norms 4(q + kv) + 12, attention b(2q + 2kv) + 8, MLP 3bi.
    assert TINY.frozen_layer_bytes(True) == 72 + 48 + 12 + 48 + 8 + 72 == 260
    assert TINY.frozen_layer_bytes(False) == 72 + 48 + 12 + 96 + 8 + 144 == 380
    # Whole forwards: layers + final norm + rotary cos/sin (float32 unless frozen bf16).
    assert TINY.forward_bytes(10, True, True) == 10 * (2 * 452 + 68 + 32)
    assert TINY.forward_bytes(10, False, True) == 10 * (2 * 260 + 36 + 16)
    assert TINY.kv_cache_bytes_per_token() == 2 * 2 * 4 * 2


def test_phases_by_hand_with_and_without_fsdp():
    one = RunSetting(
        tokens=10,
        action_tokens=5,
        cold_start_batch=8,
        num_latents=2,
        lora_r=2,
        max_encoder_tokens=2,
        teacher_layer_checkpointing=False,
    )
    pred = predict(TINY, one)
    # Load: float32 master student, bf16 frozen backbone, whole on every rank.
    assert pred.phases["load"] == {"student weights": 4 * 1144, "backbone weights": 2 * 1144}
    cold = pred.phases["cold start"]
    assert cold["teacher recompute"] == 8 * TINY.forward_bytes(10, False, True)
    step = pred.phases["step teacher backward"]
    assert step["student grads + AdamW"] == 12 * 1144
    # Checkpointed student: layers + 1 float32 boundaries of [tokens, d].
    assert step["student saved activations"] == 3 * 10 * 8 * 4
    assert step["teacher recompute"] == TINY.forward_bytes(10, False, True)
    assert step["hidden-state gradients"] == 4 * 5 * 8
    # Checkpointed encoder (3 x 2 tokens): layers + 1 bf16 boundaries, final norm and rotary
    # tables; one LoRA layer recomputed (408 B/token) fits under the teacher's recompute.
    rest = TINY.forward_bytes(6, False, True) - 6 * 2 * 260
    assert step["encoder activations"] == 3 * 6 * 8 * 2 + rest
    assert 6 * TINY.encoder_layer_bytes(True, 2) < TINY.forward_bytes(10, False, True)
    whole = predict(TINY, dataclasses.replace(one, checkpointing=False))
    # Not checkpointed, the teacher keeps its forward's activations until its backward.
    teacher = TINY.forward_bytes(10, False, True)
    assert whole.phases["step LM head"]["teacher saved activations"] == teacher
    assert whole.phases["step teacher backward"]["teacher recompute"] == teacher
    assert pred.phases["step LM head"]["teacher saved activations"] == 0  # one block
    assert whole.phases["cold start"]["encoder activations"] == 8 * (
        6 * 2 * TINY.encoder_layer_bytes(True, 2) + rest
    )
    assert pred.phases["step forward"]["autocast bf16 weight cache"] == 2 * 1144

    sharded = predict(TINY, dataclasses.replace(one, fsdp=True, world=4))
    assert sharded.phases["load"] == pred.phases["load"]  # loaded whole, sharded afterwards
    cold = sharded.phases["cold start"]
    assert cold["student weights"] == 1144 and cold["backbone weights"] == 2 * 1144
    assert cold["teacher recompute"] == 2 * TINY.forward_bytes(10, False, True)  # 8 / 4 ranks
    step = sharded.phases["step teacher backward"]
    assert step["student weights"] == 4 * 1144 // 4
    assert step["student grads + AdamW"] == 12 * 1144 // 4
    assert step["backbone weights"] == 2 * (2 * 504 // 4 + 136)  # layers sharded, root not
    assert step["FSDP gathered root + layers"] == 2 * 136 + 4 * 504 + 4 * 504
    assert "autocast bf16 weight cache" not in step
    # The teacher recomputed per layer (the default): bf16 boundaries plus one frozen layer.
    alt = predict(TINY, dataclasses.replace(one, teacher_layer_checkpointing=True))
    assert RunSetting().teacher_layer_checkpointing
    assert alt.phases["step teacher backward"]["teacher recompute"] == 3 * 10 * 8 * 2 + 10 * 260
    assert pred.peak == max(pred.totals().values()) and pred.peak_phase in pred.phases
    kv = 10 * 32
    assert pred.rollout_sequences(CONTEXT_BYTES + pred.rollout_state + 3 * kv) == 3


def test_kernel_budget_is_the_chunked_paths_gpu_cap():
    from lopd_kernels.chunked_linear import CHUNK_BUDGET_CAP

    assert CHUNK_BUDGET_CAP["cuda"] == TOPM_BLOCK_BYTES


def test_fits_keeps_the_context_and_a_tenth():
    cap = 12 * GIB
    assert fits(9 * GIB, cap) == "yes"  # 9 <= 0.9 * 10
    assert fits(int(9.5 * GIB), cap) == "tight"
    assert fits(11 * GIB, cap) == "no"


def _saved_bytes(model: torch.nn.Module, tokens: int, trained: bool, mixed: bool) -> int:
    """Bytes autograd saves in a decoder forward (storages once, parameters excluded)."""
    model.requires_grad_(trained)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    with saved_tensor_bytes([model]) as counted, autocast:
        model.model(inputs_embeds=embeds)
    return counted()


def _tiny_qwen3() -> tuple[ModelShape, Qwen3ForCausalLM]:
    torch.manual_seed(0)
    shape = ModelShape(3, 64, 160, 4, 2, 16, vocab=128)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return shape, Qwen3ForCausalLM(config)


@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "frozen"])
def test_per_token_counts_equal_what_autograd_saves_in_a_qwen3(trained, mixed):
    """Per token (the difference of two lengths: the autocast weight copies cancel), the count
    is exact for a Hugging Face Qwen3 with SDPA attention on CPU."""
    shape, model = _tiny_qwen3()
    if mixed and not trained:
        model = model.to(torch.bfloat16)  # the frozen backbone is stored in bf16
    measured = _saved_bytes(model, 96, trained, mixed) - _saved_bytes(model, 48, trained, mixed)
    predicted = shape.forward_bytes(96, trained, mixed) - shape.forward_bytes(48, trained, mixed)
    assert measured == predicted


@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "bf16-autocast"])
def test_encoder_counts_equal_what_autograd_saves_with_lora(mixed):
    """The composer's encoder: a frozen backbone with float32 LoRA on the seven projections.
    Exact but for the first layer's input norm (its input needs no gradient: 4d + 4 bytes per
    token fewer than counted)."""
    shape, model = _tiny_qwen3()
    if mixed:
        model = model.to(torch.bfloat16)
    model.requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    for name, p in peft_model.named_parameters():
        if "lora" in name:
            p.data = p.data.float()  # phi is float32 master weights
    base = peft_model.get_base_model()

    def saved(tokens: int) -> int:
        ids = torch.randint(0, 128, (1, tokens))
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
        )
        with saved_tensor_bytes([peft_model]) as so_far, autocast:
            base.model(input_ids=ids)
        return so_far()

    def counted(tokens: int) -> int:
        frozen = shape.forward_bytes(tokens, False, mixed)
        lora = shape.encoder_layer_bytes(mixed, 8) - shape.frozen_layer_bytes(mixed)
        return frozen + tokens * (shape.layers * lora - (4 * shape.hidden + 4))

    assert saved(96) - saved(48) == counted(96) - counted(48)


def test_standin_weights_grads_adamw_match_the_measured_expected_columns():
    """docs/trainer.md's 'expected' columns (measured from the parameters): 218M stand-in 1.67
    GiB weights after the cold start, 0.86 gradients, 1.72 AdamW; 596M: 4.50, 2.28, 4.56."""
    smoke = RunSetting.of(PRESETS["smoke"](), mixed=False)
    for name, (weights, grads, adamw) in {
        "standin-218m": (1.67, 0.86, 1.72),
        "qwen3-0.6b": (4.50, 2.28, 4.56),
    }.items():
        shape = MODELS[name]
        p, phi = shape.params(), shape.lora_params(smoke.lora_r) + qformer_params(shape, smoke)
        assert round((8 * p + 4 * phi) / GIB, 2) == weights
        assert round(4 * (p + phi) / GIB, 2) == grads
        assert round(8 * (p + phi) / GIB, 2) == adamw
    preds = standin_predictions()
    assert round(preds["qwen3-0.6b"].totals()["load"] / GIB, 2) == 4.44  # measured: 4.44 + runtime


def test_cli_table_and_bad_input(capsys):
    assert main(["--models", "qwen3-0.6b", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.count("| qwen3-0.6b |") == 4 and "141 GB" in out
    assert main(["--models", "qwen3-99b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "qwen3-99b" in err
    assert main(["--tokens", "0"]) == 2 and "tokens=0" in capsys.readouterr().err
    assert main(["--standins", "--tokens", "8192", "--action-tokens", "9000"]) == 2
    assert "action_tokens=9000" in capsys.readouterr().err


def test_standins_at_a_trajectory_length_count_one_trajectory_at_a_time(capsys):
    """``--standins --tokens L`` predicts the ``--trajectory-tokens L`` runs: one trajectory per
    cold-start step (the smoke preset's batch is 2), so the cold start's activations halve."""
    both = standin_predictions(8192, 6900)["qwen3-0.6b"].totals()
    one = standin_predictions(8192, 6900, one_at_a_time=True)["qwen3-0.6b"].totals()
    assert one["load"] == both["load"] and one["cold start"] < both["cold start"]
    assert main(["--standins", "--tokens", "8192", "--action-tokens", "6900"]) == 0
    out = capsys.readouterr().out
    assert "8,192 tokens, 6,900 action tokens" in out
    assert f"cold start: {one['cold start'] / GIB:.2f} GiB" in out
