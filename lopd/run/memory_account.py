"""Where the memory of a run goes, per phase (``--profile-memory``, ``profile_memory=true``).

At the end of each phase (models loaded, bank, cold start, setup, vanilla evaluation, every
training step, final evaluation, final save) :class:`MemoryAccount` writes one line to
``run_dir/memory.jsonl`` and the log, all sizes in bytes:

* ``weights``: parameters and buffers of the student, of the frozen backbone (the teacher,
  encoder base and embedder, one copy) and phi (LoRA + QFormer), tied or shared storage counted
  once; per dtype in ``weights_by_dtype``.
* ``grads``: every ``.grad`` alive at the end of the phase.
* ``optimizer``: the tensors in the AdamW states (the cold start's own AdamW is freed with it).
* ``activations``: tensors autograd saved for the backward in the phase's largest forward
  (training steps: the largest micro-batch), parameters excluded, shared storage counted once
  (autocast's 16-bit weight copies are counted here: they are saved for the backward too).
* ``peak`` and ``now``: on CUDA ``torch.cuda.max_memory_allocated`` / ``memory_allocated``
  (reset per phase), on CPU the process's peak and current resident set (``VmHWM``, reset per
  phase, and ``VmRSS``).
* ``allocator``: memory the allocator holds beyond live tensors: on CUDA reserved minus
  allocated; on CPU what ``malloc_trim`` returns to the OS at the phase end (glibc keeps freed
  heap pages mapped, so the resident set stays at its high-water mark after a phase ends).
* ``runtime``: the resident set before any model was loaded (interpreter, torch, transformers).

What a step's LM head adds on top of weights, gradients, optimizer and activations is predicted by
:func:`lm_head_bytes`: the fused kernels' bounded working set (the ``lopd_kernels`` block plan),
or the three float32 ``[N, V]`` tensors of the materialized path, for any token count.

Whatever the profile flag, the trainer releases freed memory at every phase boundary
(:func:`release_memory`: ``gc``, ``malloc_trim`` on glibc, ``torch.cuda.empty_cache``), so the
resident set of one phase does not carry the peak of the previous one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lopd_kernels.fused_linear_logprob_chunked import workspace_bytes

__all__ = ["MemoryAccount", "lm_head_bytes", "release_memory", "resident_bytes", "tensor_bytes"]

_GLIBC: Any = None


def _glibc() -> Any:
    global _GLIBC
    if _GLIBC is None:
        _GLIBC = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL("libc.so.6")
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                _GLIBC = lib
            except (OSError, AttributeError):
                pass
    return _GLIBC


def resident_bytes() -> tuple[int, int]:
    """``(current, peak)`` resident set of this process in bytes (``(0, 0)`` off Linux)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0, 0
    now = re.search(r"VmRSS:\s+(\d+) kB", status)
    peak = re.search(r"VmHWM:\s+(\d+) kB", status)
    return (int(now.group(1)) * 1024 if now else 0, int(peak.group(1)) * 1024 if peak else 0)


def _reset_peak_resident() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def release_memory(device: torch.device | None = None) -> int:
    """Give freed memory back: ``gc.collect``, glibc ``malloc_trim(0)``, CUDA's cached blocks.

    Returns:
        Bytes the resident set shrank by (CPU; 0 where it cannot be measured).
    """
    gc.collect()
    before, _ = resident_bytes()
    lib = _glibc()
    if lib:
        lib.malloc_trim(0)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    after, _ = resident_bytes()
    return max(0, before - after)


def tensor_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage counted once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor shards
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@contextlib.contextmanager
def saved_tensor_bytes(modules: Iterable[nn.Module] = ()) -> Iterator[Callable[[], int]]:
    """Inside the block, count the bytes of the distinct storages autograd saves for the
    backward (parameters of ``modules`` excluded); yields a function giving the count so far."""
    params = {
        p.untyped_storage().data_ptr()
        for m in modules
        for p in m.parameters()
        if p.device.type != "meta"
    }
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and key not in params:
                seen.add(key)
                total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield lambda: total


def lm_head_bytes(
    tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype = torch.float32,
    device_type: str = "cpu",
    *,
    fused: bool = True,
    head_grad: bool = True,
    hidden_grad: bool = True,
) -> int:
    """Transient bytes of scoring ``tokens`` rows through an LM head, forward and backward (token
    log-probabilities: the cold start's NLL, GRPO's and Skill-SD's ratios).

    ``fused``: :func:`lopd_kernels.fused_linear_logprob`'s working set
    (:func:`lopd_kernels.fused_linear_logprob_chunked.workspace_bytes`; a frozen head whose hidden
    states need a gradient takes the gradient projection), plus its ``[N]`` float32 outputs.
    Otherwise the materialized ``cross_entropy(head(h).float())``: the float32 logits, their log
    softmax (saved for the backward) and the logits' gradient, three float32 ``[N, V]`` tensors
    (and a 16-bit copy of the logits for a half-precision head).

    Args:
        tokens: rows scored (action tokens of a micro-batch).
        vocab, hidden: the head's ``[V, d]``.
        dtype: the head's compute dtype.
        device_type: ``"cpu"`` or ``"cuda"`` (the block budget differs).
        fused: the fused kernel (what the trainer uses) or the materialized path.
        head_grad: the head is trained; hidden_grad: the hidden states need a gradient.
    """
    if not fused:
        half = 2 if dtype in (torch.bfloat16, torch.float16) else 0
        return tokens * vocab * (3 * 4 + half)
    projection = hidden_grad and not head_grad
    work = workspace_bytes(
        tokens, vocab, hidden, dtype, device_type, head_grad=head_grad, projection=projection
    )
    return work + 3 * 4 * tokens


def _state_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


class MemoryAccount:
    """Per-phase memory lines (see the module docstring); every method is a no-op (bar the
    release of freed memory) when ``enabled`` is false.

    Args:
        enabled: ``profile_memory``.
        path: ``run_dir/memory.jsonl`` (appended; ``None``: log only).
        device: where the models live.
        log: the trainer's log function.
    """

    def __init__(self, enabled: bool, path: Path | None, device: torch.device, log: Any) -> None:
        self.enabled = enabled
        self.path = path
        self.device = device
        self.log = log
        self.runtime = resident_bytes()[0]
        self._activations = 0
        self._param_ptrs: set[int] = set()
        self.records: list[dict[str, Any]] = []
        self._reset_peak()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_resident()

    @contextlib.contextmanager
    def activations(self, modules: Iterable[nn.Module] = ()) -> Iterator[None]:
        """Count the bytes autograd saves for the backward inside the block (the phase keeps
        the largest block's figure); parameters of ``modules`` are not counted."""
        if not self.enabled:
            yield
            return
        with saved_tensor_bytes(modules) as counted:
            yield
        self._activations = max(self._activations, counted())

    def phase(
        self,
        name: str,
        models: Any = None,
        optimizers: Iterable[torch.optim.Optimizer | None] = (),
        release: bool = True,
        **extra: Any,
    ) -> dict[str, Any] | None:
        """Close phase ``name``: release freed memory, record the account, reset the peaks.

        Args:
            name: the phase.
            models: the run's :class:`~lopd.run.context.Models` (``None`` before loading).
            optimizers: optimizers whose states to count.
            release: release freed memory (:func:`release_memory`) even when not profiling.
            **extra: more fields for the line (e.g. the step).
        """
        if not self.enabled:
            if release:
                release_memory(self.device)
            return None
        peak_rss = resident_bytes()[1]
        peak_cuda = torch.cuda.max_memory_allocated(self.device) if self._cuda else 0
        retained = release_memory(self.device)
        seen: set[int] = set()
        weights: dict[str, int] = {}
        by_dtype: dict[str, int] = {}
        grads = 0
        if models is not None:
            parts = {"student": models.student}
            composer = models.composer
            phi = composer.trainable_parameters() if composer is not None else []
            phi_ids = {id(p) for p in phi}
            parts["backbone"] = [p for p in models.backbone.parameters() if id(p) not in phi_ids]
            parts["phi"] = phi
            for part, obj in parts.items():
                if isinstance(obj, nn.Module):
                    tensors = [*obj.parameters(), *obj.buffers()]
                else:
                    tensors = list(obj)
                weights[part] = 0
                for t in tensors:
                    n = tensor_bytes([t], seen)
                    key = str(t.dtype).replace("torch.", "")
                    weights[part] += n
                    by_dtype[key] = by_dtype.get(key, 0) + n
            grad_seen: set[int] = set()
            for module in (models.student, models.backbone, composer):
                if module is not None:
                    grads += tensor_bytes(
                        (p.grad for p in module.parameters() if p.grad is not None), grad_seen
                    )
        opt_bytes = tensor_bytes(t for opt in optimizers for t in _state_tensors(opt))
        now, _ = resident_bytes()
        record: dict[str, Any] = {
            "phase": name,
            **extra,
            "weights": sum(weights.values()),
            "weights_by_part": weights,
            "weights_by_dtype": by_dtype,
            "grads": grads,
            "optimizer": opt_bytes,
            "activations": self._activations,
            "runtime": self.runtime,
        }
        if self._cuda:
            record.update(
                peak=peak_cuda,
                now=torch.cuda.memory_allocated(self.device),
                allocator=torch.cuda.memory_reserved(self.device)
                - torch.cuda.memory_allocated(self.device),
                peak_rss=peak_rss,
            )
        else:
            record.update(peak=peak_rss, now=now, allocator=retained)
        self.records.append(record)
        gib = 2.0**30
        self.log(
            f"memory {name}: peak {record['peak'] / gib:.2f} GiB, now {record['now'] / gib:.2f} "
            f"| weights {record['weights'] / gib:.2f} grads {grads / gib:.2f} optimizer "
            f"{opt_bytes / gib:.2f} activations {self._activations / gib:.2f} allocator "
            f"{record['allocator'] / gib:.2f} runtime {self.runtime / gib:.2f} GiB"
        )
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        self._activations = 0
        self._reset_peak()
        return record

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"
