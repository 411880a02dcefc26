"""``model.attn_implementation`` and activation checkpointing: the attention backends agree,
the choice is validated, checkpointing uses the current transformers API.

On CPU the comparable backends are ``eager`` and ``sdpa``; ``flash_attention_2`` needs CUDA and
flash-attn (the ``[gpu]`` extra), so its test is skipped elsewhere and has not run on this project's
CPU CI. Both are float32 here and differ only in summation order, so the tolerance is
``tests.utils.assert_close_reordered``'s: a few float32 roundings per layer at the logits' scale.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lopd.config import ConfigError, load_config
from lopd.models.loading import load_model, resolve_attn_implementation
from lopd.rollout.batch import pad_batch
from tests.utils import assert_close_reordered, requires_cuda


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 64, 5)]
    return pad_batch(seqs, pad_id=0)


def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]  # real rows only


def test_eager_and_sdpa_agree_on_the_tiny_model():
    eager, tok = load_model(attn_implementation="eager")
    sdpa, _ = load_model(attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    ids, mask = _batch(len(tok))
    assert_close_reordered(_logits(sdpa, ids, mask), _logits(eager, ids, mask), eager)


def test_eager_and_sdpa_agree_on_a_qwen3_0_6b_shaped_layer():
    """16 query / 8 KV heads of dim 128 (Qwen3-0.6B's attention), random init."""
    models = {}
    for impl in ("eager", "sdpa"):
        cfg = Qwen3Config(
            vocab_size=1000, hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
            attn_implementation=impl,
        )  # fmt: skip
        torch.manual_seed(0)
        models[impl] = Qwen3ForCausalLM(cfg).eval()
        assert models[impl].config._attn_implementation == impl
    ids, mask = _batch(1000)
    out = {k: _logits(m, ids, mask) for k, m in models.items()}
    assert out["eager"].abs().max() > 0.1  # not a vacuous comparison
    assert_close_reordered(out["sdpa"], out["eager"], models["eager"])


def test_backend_resolution():
    cpu = torch.device("cpu")
    assert resolve_attn_implementation("auto", cpu, torch.bfloat16) == "sdpa"
    assert resolve_attn_implementation("eager", cpu, torch.float32) == "eager"
    with pytest.raises(ValueError, match=r"needs a CUDA device and model.dtype"):
        resolve_attn_implementation("flash_attention_2", cpu, torch.bfloat16)
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    assert resolve_attn_implementation("auto", cuda, torch.float32) == "sdpa"
    try:
        import flash_attn  # noqa: F401

        expected = "flash_attention_2"
    except ImportError:
        expected = "sdpa"
    assert resolve_attn_implementation("auto", cuda, torch.bfloat16) == expected


def test_flash_attention_needs_16_bit_and_cuda_at_startup():
    cfg = load_config("smoke", overrides=["model.attn_implementation=flash_attention_2"])
    with pytest.raises(ConfigError, match=r"needs model.dtype bfloat16 or float16"):
        cfg.validate(check_paths=False)
    cfg.model.dtype, cfg.model.device = "bfloat16", "cpu"
    with pytest.raises(ConfigError, match=r"needs a CUDA device"):
        cfg.validate(check_paths=False)


def test_activation_checkpointing_uses_the_current_api_and_keeps_gradients():
    """``enable_activation_checkpointing`` makes no deprecated transformers call, and the
    recomputed backward gives the gradients of the plain one."""
    import warnings

    from lopd.models.loading import enable_activation_checkpointing

    plain, tok = load_model(attn_implementation="eager")
    ckpt, _ = load_model(attn_implementation="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_activation_checkpointing(ckpt)
        assert ckpt.is_activation_checkpointing
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    ids, mask = _batch(len(tok))
    grads = []
    for model in (plain, ckpt):
        model.train()
        model(input_ids=ids, attention_mask=mask).logits[mask.bool()].logsumexp(-1).sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.gpu
def test_flash_attention_2_agrees_with_sdpa_in_bf16_on_cuda():
    """The Qwen3-0.6B attention shape in bf16: flash-attn vs SDPA on a padded batch (both bf16,
    so the bound is a few bf16 roundings of the logits, not fp32's)."""
    pytest.importorskip("flash_attn")
    out = {}
    for impl in ("sdpa", "flash_attention_2"):
        cfg = Qwen3Config(
            vocab_size=1000, hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
            attn_implementation=impl,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
        ids, mask = _batch(1000)
        out[impl] = _logits(model, ids.cuda(), mask.cuda()).float()
    scale = float(out["sdpa"].abs().max())
    assert scale > 0.1
    torch.testing.assert_close(out["flash_attention_2"], out["sdpa"], rtol=0.0, atol=0.03 * scale)
