"""The run's models: local Hugging Face checkpoints or the embedded tiny Qwen3, and how they run.

:mod:`lopd.models.loading` loads them (nothing is downloaded); ``python -m lopd.models``
builds the tiny model or probes what a reference trajectory is worth to a model.
"""

from lopd.models.loading import (
    ATTN_IMPLEMENTATIONS,
    enable_activation_checkpointing,
    flash_attn_available,
    load_model,
    resolve_attn_implementation,
    resolve_model_dir,
)
from lopd.tiny.build import TINY_ASSET_DIR

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "TINY_ASSET_DIR",
    "enable_activation_checkpointing",
    "flash_attn_available",
    "load_model",
    "resolve_attn_implementation",
    "resolve_model_dir",
]
