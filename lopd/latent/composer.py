"""The latent composer Phi_phi (paper 3.2, A.1): LoRA encoder + QFormer compressor.

For a task ``x`` and its ``J`` retrieved experiences ``m_j`` the encoder (the frozen backbone with
a trainable LoRA adapter, rank 8, alpha 16, dropout 0 on q, k, v, o, gate, up, down) reads
``"Task to solve:\\n{x}\\n\\nReference past trajectory:\\n{m_j}"``; the last hidden states of the
``B*J`` inputs are packed (no padding rows) into ``[total, d]`` with ``cu_seqlens`` and the
QFormer compresses each into ``K`` latents, giving ``c_phi`` of shape ``[B, J*K, d]``.

The encoder's backbone *is* the frozen teacher: peft injects the adapter into the backbone's
modules, and :meth:`LatentComposer.teacher_mode` (``peft_model.disable_adapter()``) turns it off
for teacher forwards (A.4 "Encoder LoRA isolation"). One copy of the base weights serves both
roles. phi = (LoRA parameters, QFormer parameters); nothing else is trainable here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lopd.latent.checkpointing import checkpoint_each_layer, decoder_layers
from lopd.rollout.batch import pad_batch
from lopd_kernels import QFormerCompressor
from lopd_kernels.hf import decoder_of

__all__ = ["ENCODER_TEMPLATE", "LORA_TARGETS", "LatentComposer", "decoder_of"]

ENCODER_TEMPLATE = "Task to solve:\n{task}\n\nReference past trajectory:\n{experience}"
"""Encoder input format (paper A.5): the task first, so compression is task-conditional."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven linear projections per block that carry the encoder's LoRA (paper A.1)."""


class LatentComposer(nn.Module):
    """LoRA encoder over the frozen backbone + QFormer compressor: ``(x, m_1..m_J) -> c_phi``.

    Args:
        backbone: a Hugging Face ``*ForCausalLM``; frozen in place and wrapped by peft. It is
            the teacher as well: run teacher forwards inside :meth:`teacher_mode`.
        tokenizer: its tokenizer.
        num_latents: K, latents per experience.
        num_retrieved: J, experiences per task.
        qformer_layers: QFormer depth (weights shared across layers, paper A.1).
        ffn_mult: QFormer feed-forward multiplier.
        lora_r, lora_alpha, lora_dropout: the encoder adapter.
        max_encoder_tokens: encoder inputs are truncated to this many tokens (the task comes
            first, so truncation cuts the end of the trajectory, never the task).
        checkpoint_layers: recompute the encoder per decoder layer in the backward
            (``model.gradient_checkpointing``): its ``B*J`` inputs then keep one ``[tokens, d]``
            boundary per layer instead of every layer's activations.
    """

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer,
        num_latents: int = 32,
        num_retrieved: int = 3,
        qformer_layers: int = 8,
        ffn_mult: int = 4,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        max_encoder_tokens: int = 2048,
        checkpoint_layers: bool = False,
    ) -> None:
        super().__init__()

        if num_latents < 1:
            raise ValueError(f"num_latents must be >= 1, got {num_latents}")
        if num_retrieved < 1:
            raise ValueError(f"num_retrieved must be >= 1, got {num_retrieved}")
        backbone.requires_grad_(False)
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated ``is_gradient_checkpointing`` alias in
            # PeftModel.__init__; the deprecated call is peft's, not one lopd can change.
            warnings.filterwarnings(
                "ignore",
                message=r"`is_gradient_checkpointing` is deprecated",
                category=FutureWarning,
            )
            self.encoder = get_peft_model(
                backbone,
                LoraConfig(
                    r=lora_r,
                    lora_alpha=lora_alpha,
                    lora_dropout=lora_dropout,
                    target_modules=list(LORA_TARGETS),
                    bias="none",
                ),
            )
        cfg = backbone.config
        param = next(backbone.parameters())
        self.compressor = QFormerCompressor(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            num_queries=num_latents,
            num_layers=qformer_layers,
            ffn_mult=ffn_mult,
            share_layers=True,
        ).to(device=param.device, dtype=param.dtype)
        # The QFormer ends in a LayerNorm (unit-RMS outputs) while token embeddings are far
        # smaller (RMS ~0.07 for the tiny model, a few 1e-2 for Qwen3): start the latents at the
        # embedding scale so the frozen teacher first sees inputs of the size it was trained on
        # instead of ~15x outliers. The scale stays a learnable parameter of phi.
        final_norm = getattr(self.compressor, "final_norm", None)
        if isinstance(final_norm, nn.LayerNorm) and final_norm.weight is not None:
            emb = backbone.get_input_embeddings().weight.detach().float()
            with torch.no_grad():
                final_norm.weight.fill_(float(emb.pow(2).mean().sqrt()))
        self.tokenizer = tokenizer
        self.num_latents = num_latents
        self.num_retrieved = num_retrieved
        self.max_encoder_tokens = max_encoder_tokens
        self.checkpoint_layers = checkpoint_layers
        self.hidden_size = cfg.hidden_size

    # ------------------------------------------------------------------ roles
    @property
    def backbone(self) -> nn.Module:
        """The frozen base ``*ForCausalLM`` (teacher weights; adapters are injected in it)."""
        return self.encoder.get_base_model()

    @contextlib.contextmanager
    def teacher_mode(self) -> Iterator[nn.Module]:
        """Adapter off: yields the backbone acting as the pure frozen teacher ``pi_theta_bar``."""
        with self.encoder.disable_adapter():
            yield self.backbone

    def trainable_parameters(self) -> list[nn.Parameter]:
        """phi: the LoRA parameters and the QFormer parameters."""
        return [p for p in self.parameters() if p.requires_grad]

    def phi_state_dict(self) -> dict[str, torch.Tensor]:
        """Only phi (LoRA + QFormer): what checkpoints and phi_0 store."""
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names}

    def load_phi_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a :meth:`phi_state_dict` (strict on phi's keys, ignores the frozen backbone)."""
        expected = {n for n, p in self.named_parameters() if p.requires_grad}
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise KeyError(
                f"phi state dict mismatch: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(unexpected)[:4]}"
            )
        self.load_state_dict(state, strict=False)

    # ------------------------------------------------------------------ encoding
    def encoder_texts(
        self, tasks: Sequence[str], experiences: Sequence[Sequence[str]]
    ) -> list[str]:
        """The ``B*J`` encoder inputs, task-major (``[i * J + j]`` = task i, experience j)."""
        if len(tasks) != len(experiences):
            raise ValueError(
                f"tasks and experiences must have the same length, got {len(tasks)} and "
                f"{len(experiences)}"
            )
        texts = []
        for i, (task, exps) in enumerate(zip(tasks, experiences)):
            if len(exps) != self.num_retrieved:
                raise ValueError(
                    f"experiences[{i}] holds {len(exps)} items, the composer expects "
                    f"num_retrieved={self.num_retrieved}"
                )
            texts.extend(ENCODER_TEMPLATE.format(task=task, experience=m) for m in exps)
        return texts

    def forward(self, tasks: Sequence[str], experiences: Sequence[Sequence[str]]) -> torch.Tensor:
        """Compose latents for ``B`` tasks.

        Args:
            tasks: ``B`` task descriptions x.
            experiences: ``B`` lists of ``J`` experience texts (``format_experience(entry)``).

        Returns:
            c_phi, ``[B, J*K, d]`` in the backbone's dtype; differentiable in phi.
        """
        texts = self.encoder_texts(tasks, experiences)
        ids = [
            self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.max_encoder_tokens]
            for t in texts
        ]
        device = next(self.compressor.parameters()).device
        pad = self.tokenizer.pad_token_id
        input_ids, mask = pad_batch(ids, pad if pad is not None else 0, device)
        layers = decoder_layers(self.backbone) if self.checkpoint_layers else None
        # The recompute needs the adapter on, as in the forward: backwards never run inside
        # teacher_mode (the teacher's own recompute enters and leaves it per layer).
        recomputed = (
            checkpoint_each_layer(layers) if layers is not None else contextlib.nullcontext()
        )
        with recomputed:
            # The decoder (not the LM head): only hidden states, never [T, V] logits; no KV cache.
            hidden = decoder_of(self.backbone)(
                input_ids=input_ids, attention_mask=mask, use_cache=False
            ).last_hidden_state
        packed = hidden[mask.bool()]  # [total, d], rows of sequence i contiguous (row-major)
        lengths = mask.sum(dim=1)
        cu_seqlens = torch.zeros(len(ids) + 1, dtype=torch.int32, device=device)
        cu_seqlens[1:] = torch.cumsum(lengths, dim=0).to(torch.int32)
        latents = self.compressor(packed, cu_seqlens)  # [B*J, K, d]
        return latents.reshape(len(tasks), self.num_retrieved * self.num_latents, -1)
