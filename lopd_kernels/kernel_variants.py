"""Kernels that compute the same thing by two algorithms, until a GPU benchmark keeps one.

Where only a GPU can tell which of two kernels is faster, both stay, each named by its
algorithm, and the GPU check (``bash benchmarks/gpu_all.sh``: ``benchmarks/gpu_topk_tail_kl.py``)
times both in one process; the slower one is deleted the day a GPU run shows it. Each such choice
is a *slot* of :data:`SLOTS`:

* ``topk_tail_kl.triton_forward``: the Triton top-M forward (``top_m >= 1``),
  ``"separate_reductions"`` (the default) or ``"joined_reductions"``;
* ``topk_tail_kl.cuda_forward``: the CUDA forward, ``"natural_exp"`` or ``"base2"`` (the
  default).

A slot is chosen per call where the launcher takes it
(``lopd_kernels.triton.topk_tail_kl.topk_tail_kl_fwd_triton(..., kernel=)``), else by the process
setting: :func:`select` (or :func:`selecting` for a block). The setting is a value of this module
(for a compiled slot also passed to the compiled op library, ``torch.ops.lopd.set_kernel_choice``);
nothing reads or writes environment variables. The custom ops are opaque to ``torch.compile``, so
every call reads the setting, compiled or not. It is one value per process: threads that need
different kernels at once pass them per call.

    from lopd_kernels.kernel_variants import select
    select("topk_tail_kl.cuda_forward", "natural_exp")
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch

__all__ = ["SLOTS", "Slot", "attach", "select", "selected", "selecting"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One kernel with two algorithms.

    Attributes:
        choices: the algorithms' names.
        default: the one used until :func:`select` picks another.
        compiled: whether the compiled op library reads the choice (then :func:`select` sets it
            there too).
        doc: what each algorithm does.
    """

    choices: tuple[str, ...]
    default: str
    compiled: bool
    doc: str


SLOTS: dict[str, Slot] = {
    "topk_tail_kl.triton_forward": Slot(
        choices=("separate_reductions", "joined_reductions"),
        default="separate_reductions",
        compiled=False,
        doc=(
            "Triton top-M forward (top_m >= 1; rows merged by the bitonic path, top_m > 64 by "
            "default, always take separate_reductions). separate_reductions "
            "(lopd_kernels/triton/topk_tail_kl_kernels.py): five block reductions per block on "
            "the common path (the selecting side's maximum, then maximum and sum of each side's "
            "tail), an evicted entry's other-side logit re-read from global memory. "
            "joined_reductions (lopd_kernels/triton/topk_tail_kl_kernels_joined.py): two "
            "reductions of both sides joined per block, the top-M's other-side logits kept in "
            "registers."
        ),
    ),
    "topk_tail_kl.cuda_forward": Slot(
        choices=("natural_exp", "base2"),
        default="base2",
        compiled=True,
        doc=(
            "CUDA forward of topk_tail_kl (csrc/cuda/topk_tail_kl_launch.cuh). natural_exp "
            "(csrc/cuda/topk_tail_kl_kernels.cuh): a natural-log lse_add with an accurate expf "
            "per entry and side, the 64-bit key built for every entry, one tile in flight, the "
            "full-vocabulary mode merging a one-entry state per entry. base2 "
            "(csrc/cuda/topk_tail_kl_kernels_base2.cuh): base-2 tails (one FFMA + MUFU.EX2 per "
            "entry and side, one rescale per 8 entries, admitted candidates masked to -inf), a "
            "float compare before the 64-bit key, the next tile loaded while the current one is "
            "processed, the same chunked base-2 state in the full-vocabulary mode."
        ),
    ),
}

_lock = threading.Lock()
_selected: dict[str, str] = {}
# The compiled op libraries that take the compiled slots: lopd's, and any other build of the same
# kernels attached by attach() (the SIMT-emulated test build).
_namespaces: list[str] = ["lopd"]


def _slot(name: str) -> Slot:
    try:
        return SLOTS[name]
    except KeyError:
        raise ValueError(f"no kernel slot named {name!r}; slots: {sorted(SLOTS)}") from None


def _push(namespace: str, name: str, value: str) -> None:
    """Sets a compiled slot in one op library (a no-op where that library is not loaded)."""
    ns = getattr(torch.ops, namespace)
    if hasattr(ns, "set_kernel_choice"):
        ns.set_kernel_choice(name, value)


def selected(name: str) -> str:
    """The algorithm slot ``name`` runs now (:func:`select`'s, else the default).

    Raises:
        ValueError: no such slot.
    """
    slot = _slot(name)
    return _selected.get(name, slot.default)


def select(name: str, value: str) -> None:
    """Makes slot ``name`` run ``value`` in this process, from the next call on.

    Raises:
        ValueError: no such slot, or ``value`` is not one of its choices.
    """
    slot = _slot(name)
    if value not in slot.choices:
        raise ValueError(f"{name} must be one of {slot.choices}, got {value!r}")
    with _lock:
        _selected[name] = value
        if slot.compiled:
            for namespace in _namespaces:
                _push(namespace, name, value)


@contextlib.contextmanager
def selecting(name: str, value: str) -> Iterator[None]:
    """:func:`select` for the block; the previous choice is restored after it."""
    previous = selected(name)
    select(name, value)
    try:
        yield
    finally:
        select(name, previous)


def attach(namespace: str) -> None:
    """Makes the compiled slots of the op library ``torch.ops.<namespace>`` (one loaded after
    this module, with its own ``set_kernel_choice``) follow the process setting, and sets them
    to it now."""
    with _lock:
        if namespace not in _namespaces:
            _namespaces.append(namespace)
        for name, slot in SLOTS.items():
            if slot.compiled:
                _push(namespace, name, _selected.get(name, slot.default))
