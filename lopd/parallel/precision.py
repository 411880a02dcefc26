"""Numeric precision of the run: what is stored in which dtype, and what computes in which.

``model.dtype`` names the *compute* dtype. With ``float32`` everything is float32 and nothing
here does anything. With ``bfloat16`` or ``float16`` (mixed precision, :class:`Precision`):

* **Everything trained has float32 master weights and float32 optimizer state**: the student
  theta, the encoder's LoRA and the QFormer (phi). AdamW at lr 1e-5 on 16-bit weights of scale
  0.02 would round most updates away (a bf16 weight of 0.02 has a spacing of 1.2e-4; measured
  in ``tests/trainer/test_precision.py``: 10 steps change a minority of bf16 weights and every
  float32 one).
* **Forwards compute in the 16-bit dtype** under ``torch.autocast`` (:meth:`Precision.autocast`:
  matmuls and attention in bf16/fp16, the gradient lands in the float32 master weights), in
  training, the cold start and rollouts. The kernels read 16-bit logits or hidden states and
  compute in float32 internally.
* **The frozen backbone** (the teacher, the composer encoder's base, the bank's embedder) is
  *stored* in the 16-bit dtype: nothing updates it, so float32 would only double its memory.
* ``float16`` additionally scales the loss (:meth:`Precision.grad_scaler`, dynamic, skipped
  steps on overflow): fp16 gradients underflow without it. bf16 has float32's range and needs
  none.

Under ``model.parallel=fsdp2`` on a GPU the sharded parameters keep their dtypes (float32 master
shards of the student and LoRA, 16-bit shards of the frozen base), all-gathers cast to the
compute dtype and gradients are reduce-scattered in float32 (:func:`fsdp_mixed_precision`).
Everything about precision is decided in this module; :mod:`lopd.run.optim` holds the optimizer
side (master state, the loss scaler in checkpoints).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DTYPES",
    "Precision",
    "autocast_cast",
    "fsdp_mixed_precision",
    "param_dtype",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` names."""


def param_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``model.dtype`` name."""
    return DTYPES[name]


@dataclass(frozen=True)
class Precision:
    """The run's precision policy (see the module docstring).

    Attributes:
        compute: ``model.dtype``: the dtype forwards compute in.
        device_type: ``"cpu"`` or ``"cuda"`` (autocast is per device type).
    """

    compute: torch.dtype
    device_type: str

    @classmethod
    def of(cls, dtype_name: str, device: torch.device | str) -> Precision:
        """The policy of ``model.dtype`` on ``device``."""
        return cls(param_dtype(dtype_name), torch.device(device).type)

    @property
    def mixed(self) -> bool:
        """16-bit compute over float32 master weights."""
        return self.compute != torch.float32

    @property
    def master(self) -> torch.dtype:
        """The dtype of trained parameters and their optimizer state: always float32."""
        return torch.float32

    @property
    def frozen(self) -> torch.dtype:
        """The dtype the frozen backbone is stored in: the compute dtype."""
        return self.compute

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` in the compute dtype; a no-op context for float32 (so the float32
        path runs exactly the code it ran before mixed precision existed)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A dynamic loss scaler, enabled for float16 only (a disabled one passes through)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.compute == torch.float16)

    def to_master(self, module: nn.Module) -> nn.Module:
        """Cast ``module``'s trainable parameters to float32 in place (frozen ones keep their
        dtype); returns it."""
        for p in module.parameters():
            if p.requires_grad and p.dtype != self.master:
                p.data = p.data.to(self.master)
        return module


def autocast_cast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast floating tensors to the active autocast dtype (differentiably), as autocast does
    for a matmul's inputs; unchanged outside autocast.

    For the custom kernels, which autocast does not cast: the fused LM-head KL reads the
    student's float32 master ``lm_head`` weight and final hidden states, and should compute its
    logit blocks in the same dtype as the unfused path's autocast ``lm_head``.
    """
    if not tensors:
        return ()
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def fsdp_mixed_precision(dtype_name: str, device: torch.device) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``fully_shard``, or ``None`` (compute in the
    parameters' dtype, reduce in it too).

    On CUDA with a 16-bit ``model.dtype``: all-gathered parameters in that dtype (the float32
    master shards of the student and LoRA, the 16-bit shards of the frozen base alike),
    gradients reduce-scattered in float32 (a sum over ranks in 16 bits loses the small per-rank
    terms) into the float32 master gradients.
    """
    dtype = param_dtype(dtype_name)
    if device.type != "cuda" or dtype == torch.float32:
        return None
    # Optional: FSDP2/DCP exist only in torch builds with distributed support.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
