"""Per-layer activation checkpointing of the frozen backbone's decoder (teacher and encoder).

The student is checkpointed by transformers (``gradient_checkpointing_enable``), which acts only
in training mode; the backbone stays in eval mode (frozen, no dropout), yet gradients flow
through it: to phi through every teacher layer (the latents are its input) and to the encoder's
LoRA. Without checkpointing, those activations stay saved until the backward, for every layer at
once: for Qwen3-4B at 40,960 tokens the teacher alone holds about 165 GiB, the encoder (3 x 2,048
tokens) 36 GiB (``python -m lopd.run.memory_prediction --breakdown``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint

from lopd_kernels.hf import decoder_of

__all__ = ["checkpoint_each_layer", "decoder_layers"]


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's layer list of a ``*ForCausalLM`` (``None`` when it has no ``layers``)."""
    layers = getattr(decoder_of(model), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


@contextlib.contextmanager
def checkpoint_each_layer(
    layers: nn.ModuleList,
    recompute_mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Iterator[None]:
    """Inside it, every layer's ``forward`` is recomputed in the backward (non-reentrant
    ``torch.utils.checkpoint``), with ``recompute_mode()`` entered around each recompute.

    The forward keeps each layer's inputs (``[B, L, d]`` hidden states, shared rotary tables and
    mask); the backward holds one layer's activations at a time. ``forward`` is replaced on the
    instance, not ``__call__``, so module hooks (FSDP2's unshard) stay outside the checkpoint
    and run once. A ``forward`` set on an instance before is kept and restored.

    Args:
        layers: the decoder layers (:func:`decoder_layers`).
        recompute_mode: the state the layers must run in again in the backward (the teacher's
            ``teacher_mode``: the encoder adapter off); the default changes nothing.
    """

    def wrap(inner: Callable[..., object]) -> Callable[..., object]:
        def forward(*args: object, **kwargs: object) -> object:
            return checkpoint(
                inner,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), recompute_mode()),
                **kwargs,
            )

        return forward

    own = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = wrap(layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, own, strict=True):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward
