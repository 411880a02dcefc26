"""How ``[..., V]`` logits reach the kernels without a copy: a 2-D ``[N, V]`` or 3-D ``[B, L, V]``
view chosen from the strides alone (row-strided inputs such as ``logits[:, :-1]``)."""

from __future__ import annotations

import itertools
import math

from torch import Tensor

__all__ = ["rows_in_place"]


def _fold(sizes, strides) -> bool:
    """Whether dims ``sizes`` / ``strides`` fold into one dim of a view (each dim of size > 1
    steps over the next as one block)."""
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    return all(st == n_next * st_next for (_, st), (n_next, st_next) in itertools.pairwise(dims))


def rows_in_place(x: Tensor) -> Tensor:
    """``[..., V]`` logits as the ops take them, ``[N, V]`` or ``[B, L, V]``, without a copy
    whenever the vocabulary axis is dense: a 2-D view if the leading dims fold into one, else a
    3-D one (``logits[:, :-1]`` of a ``[B, T, V]`` buffer: rows of stride V, items of stride
    T * V, which no 2-D view covers). Copies only a strided vocabulary axis, or leading dims
    that fold into neither. Decided from the strides (no failed ``view``: torch.compile traces
    it)."""
    vocab = x.shape[-1]
    lead, lead_strides = x.shape[:-1], x.stride()[:-1]
    # Sizes spelled out, never -1: an empty batch (a zero-size leading dim) has any view.
    rows = math.prod(lead)
    if x.stride(-1) == 1 or vocab <= 1:
        if rows == 0 or _fold(lead, lead_strides):
            return x.view(rows, vocab)
        if len(lead) >= 2 and _fold(lead[:-1], lead_strides[:-1]):
            return x.view(math.prod(lead[:-1]), lead[-1], vocab)
        if len(lead) >= 3 and _fold(lead[1:], lead_strides[1:]):
            return x.view(lead[0], math.prod(lead[1:]), vocab)
    return x.reshape(rows, vocab).contiguous()
