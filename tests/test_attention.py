"""``model.attn_implementation``: the attention backends agree, and the choice is validated.

On CPU the comparable backends are ``eager`` and ``sdpa`` (flash-attn needs CUDA; the GPU check
runs it). Both are float32 here and differ only in summation order, so the tolerance is
``tests.utils.assert_close_reordered``'s: a few float32 roundings per layer at the logits' scale.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lopd.config import ConfigError, load_config
from lopd.injection import pad_batch
from lopd.models import load_model, resolve_attn_implementation
from tests.utils import assert_close_reordered


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
