"""The shape of a Qwen3-style decoder and what it costs per parameter and per token.

:class:`ModelShape` counts parameters and the bytes autograd saves per token in one decoder
layer; :data:`MODELS` holds the Qwen3 checkpoints' shapes. :mod:`lopd.run.memory_prediction`
adds them up into a run's per-phase peak.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-style decoder (Hugging Face config names in the comments).

    Attributes:
        layers (num_hidden_layers), hidden (hidden_size), intermediate (intermediate_size),
        heads (num_attention_heads), kv_heads (num_key_value_heads), head_dim: the decoder.
        vocab: embedding / LM-head rows. tied: tie_word_embeddings.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 151_936
    tied: bool = True

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o, the q/k norms, the MLP, two RMSNorms."""
        d = self.hidden
        attn = 2 * d * self.q_dim + 2 * d * self.kv_dim + 2 * self.head_dim
        return attn + 3 * d * self.intermediate + 2 * d

    def root_params(self) -> int:
        """Embedding, LM head (when not tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def lora_params(self, r: int) -> int:
        """LoRA of rank ``r`` on q, k, v, o, gate, up, down of every layer."""
        d, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        per_layer = (d + q) * 2 + (d + kv) * 2 + (d + i) * 3
        return self.layers * r * per_layer

    def trained_layer_bytes(self, mixed: bool) -> int:
        """Bytes one trained decoder layer saves per token (the student's).

        Mixed (bf16 autocast over float32 master weights; the residual stream stays float32):
        per RMSNorm its float32 input, 1/rms and normalized output (8d + 4), then the bf16 casts
        of the projections' inputs (3 * 2d for q, k, v; 2 * 2d for gate, up); the q/k norms'
        float32 inputs, 1/rms and bf16 outputs (6(q + kv) + 4(heads + kv_heads)); attention's
        q, k, v, output in bf16 and float32 log-sum-exp (2(2q + 2kv) + 4 heads); the MLP's gate,
        up, activation and product in bf16 (8i). Float32: every RMSNorm keeps its input, 1/rms,
        normalized and scaled output (12d + 4), the q/k norms input, 1/rms and normalized
        (8(q + kv) + 4(heads + kv_heads)), attention 4(2q + 2kv) + 4 heads, the MLP 16i.
        (``tests/trainer/test_memory_prediction.py`` checks these against autograd's saved tensors
        of a Hugging Face ``Qwen3`` layer.)
        """
        d, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        rms = 4 * (self.heads + self.kv_heads)
        attn = 4 * self.heads
        if mixed:
            norms = 2 * (8 * d + 4) + 2 * (5 * d)
            return norms + 6 * (q + kv) + rms + 2 * (2 * q + 2 * kv) + attn + 8 * i
        return 2 * (12 * d + 4) + 8 * (q + kv) + rms + 4 * (2 * q + 2 * kv) + attn + 16 * i

    def frozen_layer_bytes(self, mixed: bool) -> int:
        """Bytes one frozen decoder layer saves per token when the gradient flows to its input
        only (the teacher's recompute): no projection input; the float32 copies of the RMSNorm
        inputs and 1/rms (2(4d + 4)), of the q/k norm inputs and 1/rms
        (4(q + kv) + 4(heads + kv_heads)), attention's q, k, v, output and log-sum-exp
        (b(2q + 2kv) + 4 heads), the MLP's gate, up and activation (3bi); ``b`` the compute
        dtype's bytes."""
        d, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        b = 2 if mixed else 4
        rms = 4 * (self.heads + self.kv_heads)
        return (
            2 * (4 * d + 4) + 4 * (q + kv) + rms + b * (2 * q + 2 * kv) + 4 * self.heads + 3 * b * i
        )

    def forward_bytes(self, tokens: int, trained: bool, mixed: bool) -> int:
        """Saved bytes of a whole decoder forward over ``tokens`` (no checkpointing): every layer,
        the final RMSNorm and the rotary cos/sin tables (float32 unless a frozen bf16 model)."""
        if trained:
            layer, final = self.trained_layer_bytes(mixed), 8 * self.hidden + 4
        else:
            layer, final = self.frozen_layer_bytes(mixed), 4 * self.hidden + 4
        rope = 2 * self.head_dim * (2 if (mixed and not trained) else 4)
        return tokens * (self.layers * layer + final + rope)

    def encoder_layer_bytes(self, mixed: bool, lora_r: int) -> int:
        """A frozen layer plus what its seven LoRA adapters save (the composer's encoder): each
        adapter's input and its ``r``-wide intermediate. Under autocast every adapter saves its
        own bf16 cast of its input (q, k, v, gate, up: 5d; o: q; down: i); in float32 q/k/v and
        gate/up share their input (2d), o's is attention's saved output, down's the MLP product.
        """
        if mixed:
            extra = 2 * (5 * self.hidden + self.q_dim + self.intermediate + 7 * lora_r)
        else:
            extra = 4 * (2 * self.hidden + self.intermediate + 7 * lora_r)
        return self.frozen_layer_bytes(mixed) + extra

    def kv_cache_bytes_per_token(self) -> int:
        """bf16 keys and values of every layer, one token."""
        return self.layers * 2 * self.kv_dim * 2


MODELS: dict[str, ModelShape] = {
    "qwen3-0.6b": ModelShape(28, 1024, 3072, 16, 8, 128),
    "qwen3-4b": ModelShape(36, 2560, 9728, 32, 8, 128),
    "qwen3-8b": ModelShape(36, 4096, 12288, 32, 8, 128, tied=False),
    # The 4-layer fp32 stand-in of benchmarks/bench_standin_memory.py (calibration only).
    "standin-218m": ModelShape(4, 1024, 3072, 16, 8, 128),
}
"""The Qwen3 configs (``config.json`` of the Hugging Face checkpoints; the 0.6B and 218M shapes
are ``lopd.standin``'s)."""
