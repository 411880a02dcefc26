"""How a training process asks the host for memory (Linux): freed blocks go back, in huge pages.

A CPU run of a real-sized model frees and allocates tensors of 1-32 MiB by the thousand per
step (layer activations recomputed under gradient checkpointing, logit blocks of the fused
kernels). glibc keeps freed blocks under its adaptive ``mmap`` threshold (up to 32 MiB) in its
heap, so the resident set's peak counts memory that is free: on the Qwen3-0.6B-shaped stand-in
the cold start peaked at 1.26-1.49x its live bytes. Returning every block of 1 MiB or more at once
(``mallopt(M_MMAP_THRESHOLD)``) removes that, but each fresh mapping then costs a page fault per
4 KiB page; PyTorch's ``THP_MEM_ALLOC_ENABLE`` backs its allocations of 2 MiB or more with
transparent huge pages, one fault per 2 MiB. Together, measured on that stand-in (docs/trainer.md,
"Host memory"): cold-start peak 6.60 -> 5.67 GiB, step peak 13.93 -> 13.31 GiB, step time
226 -> 227 s. The CLIs (``python -m lopd.train``, ``lopd.compare``, ``lopd.chain``) call
:func:`configure_host_memory` before loading a model; a setting the user made in the environment
(``MALLOC_MMAP_THRESHOLD_``, ``THP_MEM_ALLOC_ENABLE``, e.g. ``=0``) is left as it is, and
``LOPD_HOST_MEMORY=default`` leaves both at the system's defaults. Neither changes a computed
value.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD", "configure_host_memory"]

MMAP_THRESHOLD = 1 << 20
"""Blocks of this many bytes or more are mapped on their own and unmapped when freed."""

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the ``mmap`` threshold (``malloc.h``)."""


def configure_host_memory() -> list[str]:
    """Set the two allocator options of the module docstring where the user has not; returns
    what was set (nothing off Linux or without glibc). Must run before the first tensor of 2 MiB
    or more: PyTorch reads ``THP_MEM_ALLOC_ENABLE`` once, at that allocation."""
    if not sys.platform.startswith("linux") or os.environ.get("LOPD_HOST_MEMORY") == "default":
        return []
    done = []
    if "THP_MEM_ALLOC_ENABLE" not in os.environ:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        done.append("THP_MEM_ALLOC_ENABLE=1")
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        try:
            libc = ctypes.CDLL("libc.so.6")
            applied = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        except (OSError, AttributeError):  # not glibc (musl has no mallopt)
            applied = False
        if applied:
            # The worker processes of lopd.compare / lopd.chain: glibc reads it at their start.
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
            done.append(f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}")
    return done
