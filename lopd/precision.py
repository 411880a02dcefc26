"""Numeric precision of the models: parameter dtype and FSDP2's mixed-precision policy.

``model.dtype`` is the dtype the backbone is loaded in (student, teacher and composer encoder
share it; the QFormer follows it). Under ``model.parallel=fsdp2`` on a GPU with a 16-bit dtype,
the sharded modules compute in that dtype and reduce gradients in float32
(:func:`fsdp_mixed_precision`). Everything about precision is decided here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DTYPES", "fsdp_mixed_precision", "param_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` names."""


def param_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``model.dtype`` name."""
    return DTYPES[name]


def fsdp_mixed_precision(dtype_name: str, device: torch.device) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``fully_shard``, or ``None`` (compute in the
    parameters' dtype, reduce in it too).

    On CUDA with bfloat16/float16 parameters: all-gathered parameters in that dtype, gradients
    reduce-scattered in float32 (a sum over ranks in 16 bits loses the small per-rank terms).
    """
    dtype = param_dtype(dtype_name)
    if device.type != "cuda" or dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
