"""Data-parallel plumbing under ``torchrun``: ranks, device, collectives and gradient sync.

``WORLD_SIZE > 1`` starts a process group (gloo on CPU, nccl on GPU) whose collectives time out
after ``model.collective_timeout_minutes``, and a :class:`~lopd.parallel.watchdog.PhaseBoard` on
its rendezvous store (which phase each rank is in; barriers that wait on it; the one-line
message of a failed collective). Each rank rolls out and differentiates a disjoint share of a
step's tasks. Gradients of replicated parameters are
averaged with one flat ``all_reduce`` per parameter group after the step's micro-batches rather
than through ``DistributedDataParallel`` hooks: the teacher forward re-enters the shared backbone
with the adapter toggled, which DDP's per-forward bookkeeping does not model. Parameters sharded
by FSDP2 (:mod:`lopd.parallel.fsdp`, DTensors) are already averaged by their reduce-scatter and are
skipped here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lopd.parallel.watchdog import (
    DistributedFailure,
    PhaseBoard,
    StoppedBySignal,
    is_collective_error,
)

__all__ = ["Dist", "is_sharded"]

# The rendezvous store of the process group this module started (a later Dist in the same
# process, e.g. a second trainer, reuses the group and its store).
_store: Any = None


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient managed by FSDP2)."""
    # Optional: FSDP2/DCP exist only in torch builds with distributed support.
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class Dist:
    """This process's place in the run: rank, world size, device, and the collectives.

    Args:
        device: ``model.device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``); under ``torchrun``
            with CUDA each rank takes ``cuda:LOCAL_RANK``.
        threads: torch CPU threads (``threads`` of the config; 0 means 1).
        timeout_minutes: ``model.collective_timeout_minutes``.

    Attributes:
        board: this rank's :class:`~lopd.parallel.watchdog.PhaseBoard` (``None`` in one
            process).
    """

    def __init__(
        self, device: str = "auto", threads: int = 0, timeout_minutes: float = 30.0
    ) -> None:
        global _store
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.distributed = self.world > 1
        self.is_main = self.rank == 0
        self.device = self._pick_device(device)
        self.timeout_s = 60.0 * timeout_minutes
        self.board: PhaseBoard | None = None
        self.failed = False  # a collective failed: the group is not ended cleanly
        if self.device.type == "cpu":
            torch.set_num_threads(threads or 1)
        if not self.distributed:
            return
        if not dist.is_initialized():
            timeout = timedelta(seconds=max(1.0, self.timeout_s))
            store, _, _ = next(dist.rendezvous("env://", self.rank, self.world, timeout=timeout))
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout
            )
            _store = store
        elif _store is None:  # a group someone else started: its store, a private attribute
            _store = dist.distributed_c10d._get_default_store()
        self.board = PhaseBoard(_store, self.rank, self.world, self.timeout_s)

    def _pick_device(self, want: str) -> torch.device:
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda" and self.distributed:
            want = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        if want.startswith("cuda"):
            torch.cuda.set_device(torch.device(want))
        return torch.device(want)

    def enter(self, name: str, step: int | None = None) -> None:
        """This rank is now in phase ``name`` at training step ``step`` (``None``: the last
        one), as the others will read in a failure message
        (:data:`lopd.parallel.watchdog.PHASES`); a no-op in one process."""
        if self.board is not None:
            self.board.enter(name, step)

    def barrier(self) -> None:
        """Wait for every rank, without a limit while the absent ones show signs of life
        (:meth:`lopd.parallel.watchdog.PhaseBoard.barrier`)."""
        if self.board is not None:
            self.board.barrier()

    def failure(self, err: BaseException) -> DistributedFailure | None:
        """The one-line :class:`~lopd.parallel.watchdog.DistributedFailure` of a failed
        collective, barrier or ``SIGTERM``; ``None`` for any other error (recorded for the
        other ranks' messages) and in one process."""
        if self.board is None:
            return None
        if isinstance(err, (DistributedFailure, StoppedBySignal)) or is_collective_error(err):
            self.failed = True
            return self.board.explain(err)
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        self.board.record_failure(f"rank {self.rank}: {type(err).__name__}: {first}")
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (``[obj]`` in one process)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks (float64; the input when not distributed)."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def average_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Average the gradients of replicated ``params`` over ranks with one flat all-reduce
        (ranks with no gradient send 0); sharded parameters are left to FSDP."""
        params = [p for p in params if not is_sharded(p)]
        if not self.distributed or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def broadcast_parameters(self, module: nn.Module) -> None:
        """Rank 0's parameter values on every rank."""
        if self.distributed:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)

    def clip_grad_norm_(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """Clip the global gradient norm of ``params`` to ``max_norm``; returns the norm.

        Without sharded parameters this is ``torch.nn.utils.clip_grad_norm_``. With FSDP2 the
        squared norms of the local gradient shards are summed over ranks (replicated gradients
        counted once), so every rank applies the same clip coefficient.
        """
        if not any(is_sharded(p) for p in params):
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        sharded, replicated = 0.0, 0.0
        for p in params:
            if p.grad is None:
                continue
            if is_sharded(p.grad):
                sharded += float(p.grad.to_local().float().pow(2).sum())
            else:
                replicated += float(p.grad.float().pow(2).sum())
        total = math.sqrt(self.all_reduce_sum([sharded])[0] + replicated)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total

    def close(self) -> None:
        """Stop the heartbeat and end the process group (left alone after a failed collective,
        whose peers may be gone: the process is about to exit)."""
        if self.board is not None:
            self.board.close()
        if self.distributed and dist.is_initialized() and not self.failed:
            dist.destroy_process_group()
