"""Loading the run's models: a local Hugging Face checkpoint, or the embedded tiny Qwen3.

``load_model()`` returns the shipped tiny model (``lopd/assets/tiny-qwen3``, :mod:`lopd.tiny`),
so the whole pipeline runs offline on a laptop CPU; ``load_model(path)`` loads any local Hugging
Face checkpoint (Qwen3, Olmo, ...) for GPU runs. Nothing is downloaded. Also: the attention
backend a run uses, and activation checkpointing.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lopd.config import Config, ConfigError
from lopd.parallel.distributed import Dist
from lopd.parallel.fsdp import Sharding
from lopd.parallel.precision import Precision, fsdp_mixed_precision
from lopd.run.context import Models
from lopd.tiny.build import tiny_model_dir

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "enable_activation_checkpointing",
    "flash_attn_available",
    "load_model",
    "load_run_models",
    "resolve_attn_implementation",
    "resolve_model_dir",
]


def resolve_model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory :func:`load_model` reads for ``path`` (``None``: the tiny
    model's)."""
    return tiny_model_dir() if path is None else Path(path)


def load_model(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for :func:`lopd.rollout.multi_turn.rollout`.

    Args:
        path: ``None`` for the embedded tiny Qwen3 (shipped asset, else built on first use into
            :func:`default_cache_dir`); otherwise a local Hugging Face checkpoint directory
            (Qwen3 / Olmo instruct models; nothing is downloaded).
        device: where to put the model.
        dtype: parameter dtype (``torch.bfloat16`` or ``"bfloat16"`` for GPU runs); ``None``
            keeps the checkpoint's (float32 for the tiny model).
        attn_implementation: the transformers attention backend (``"eager"``, ``"sdpa"``,
            ``"flash_attention_2"``); ``None`` keeps the checkpoint's (``"sdpa"`` for the tiny
            model). Tests that compare two paths through the model (padding, masks, batch
            invariance) pin ``"eager"``: SDPA may pick different kernels for the two paths.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode and the tokenizer has a pad token.

    Raises:
        FileNotFoundError: ``path`` is not an existing directory.
        ValueError: the checkpoint's tokenizer has no chat template.
    """
    if path is None:
        path = tiny_model_dir()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"path {str(path)!r} is not a local checkpoint directory")
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype name")
        dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer at {str(path)!r} has no chat template")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.to(device)
    model.eval()
    return model, tokenizer


ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
"""The attention backends ``model.attn_implementation`` names (besides ``auto``)."""


def flash_attn_available() -> bool:
    """Whether the ``flash-attn`` package (the ``[gpu]`` extra) can be imported."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(
    name: str, device: str | torch.device, dtype: torch.dtype | None
) -> str:
    """The transformers attention backend for ``model.attn_implementation``.

    Args:
        name: ``auto``, ``eager``, ``sdpa`` or ``flash_attention_2``.
        device: where the models run.
        dtype: the compute dtype (flash-attn has 16-bit kernels only).

    Returns:
        ``auto``: ``flash_attention_2`` on CUDA with a 16-bit dtype when flash-attn is
        installed, else ``sdpa``; any other name as given.

    Raises:
        ValueError: an unknown name, or ``flash_attention_2`` where it cannot run (no CUDA,
            float32, flash-attn not installed).
    """
    device = torch.device(device)
    half = dtype in (torch.bfloat16, torch.float16)
    if name == "auto":
        usable = device.type == "cuda" and half and flash_attn_available()
        return "flash_attention_2" if usable else "sdpa"
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attn_implementation must be auto or one of {ATTN_IMPLEMENTATIONS}, got {name!r}"
        )
    if name == "flash_attention_2":
        if device.type != "cuda" or not half:
            raise ValueError(
                "model.attn_implementation=flash_attention_2 needs a CUDA device and model.dtype "
                f"bfloat16/float16 (got device {device}, dtype {dtype})"
            )
        if not flash_attn_available():
            raise ValueError(
                "model.attn_implementation=flash_attention_2 needs flash-attn: pip install "
                "'lopd[gpu]' --no-build-isolation (or use sdpa)"
            )
    return name


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in the backward (non-reentrant ``torch.utils.checkpoint``).

    transformers >= 5.2x names it ``activation_checkpointing_enable`` (the old
    ``gradient_checkpointing_enable`` warns that it goes away in v6); older 5.x releases have
    only the old name.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_run_models(cfg: Config, dist: Dist, precision: Precision) -> tuple[Models, str]:
    """The run's student and frozen backbone, with the tokenizer, sharded as configured.

    ``load_model`` gives the backbone once. The student is a copy (trainable): a deep copy in
    float32 runs, a second float32 load under mixed precision (float32 master weights, not
    upcast from the 16-bit copy). The backbone stays frozen: the teacher, and the composer
    encoder's base. So the base weights exist twice (student, backbone), never three times.

    Returns:
        ``(models, attention)``: the models (no composer yet) and the attention backend used.

    Raises:
        ConfigError: an attention backend that cannot run here, or a bad ``model.path``.
    """
    device = dist.device
    try:
        attn = resolve_attn_implementation(cfg.model.attn_implementation, device, precision.compute)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        backbone, tokenizer = load_model(
            cfg.model.path, device=device, dtype=precision.frozen, attn_implementation=attn
        )
        if precision.mixed:
            student, _ = load_model(
                cfg.model.path, device=device, dtype=precision.master, attn_implementation=attn
            )
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"model.path: {err}") from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    backbone.requires_grad_(False)
    backbone.eval()
    if not precision.mixed:
        student = copy.deepcopy(backbone)
    student.requires_grad_(True)
    student.train()
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(student)
    sharding = Sharding(
        cfg.model.parallel == "fsdp2" and dist.distributed,
        dist,
        fsdp_mixed_precision(cfg.model.dtype, device),
        pad_id,
    )
    sharding.shard(student, trainable=True)
    return Models(student, backbone, None, tokenizer, pad_id, device, sharding), attn
