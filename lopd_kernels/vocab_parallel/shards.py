"""Where each rank's vocabulary shard lies, and the agreement every op reaches before its first
data collective.

A vocabulary-parallel op runs on every rank of a tensor-parallel group with that rank's shard of
the vocabulary (``[N, V_local]`` logits, or a ``[V_local, d]`` head shard) and the same rows
(targets, hidden states, teacher top-M) everywhere. Before any collective whose sizes depend on
the inputs, :func:`agree` runs one fixed-size ``all_gather`` of a few integers per rank: whether
this rank's own checks passed, ``N``, ``V_local``, its ``vocab_start`` and a fingerprint of the
arguments that must agree (options, target ids, ...). Every rank then reaches the same verdict
from the same gathered numbers, so bad input (a shard layout that does not tile the vocabulary,
a ``vocab_start`` given on some ranks only, mismatched ``N``, a bad argument on one rank) raises
the same one-line error on every rank instead of leaving the others waiting in a collective.

What this cannot catch: a process that is not a member of ``group`` raises at once, but the
members then wait for it in their first collective until ``torch.distributed``'s timeout; and
ranks that pass *different* groups cannot meet in any collective (docs/kernels.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "LocalShard",
    "ShardLayout",
    "agree",
    "all_gather_rows",
    "checksum",
    "fingerprint",
    "local_ignore_index",
]

#: The metadata header of :func:`agree`: error code, N, V_local, vocab_start, whether given.
_HEADER = 5
#: Integers per rank of :func:`agree`'s gather (the header, the fingerprint, the minimums).
_META_WIDTH = 32
#: Bytes of a rank's error message sent to the others (the error path only).
_MESSAGE_BYTES = 480
_ERRORS = {1: ValueError, 2: TypeError}


class LocalShard(NamedTuple):
    """What one rank's own checks found (the ``check`` of :func:`agree`).

    Attributes:
        rows: ``N``, the rows this rank holds.
        vocab_local: ``V_local``, its vocabulary shard's size.
        vocab_start: its first global id, or None (Megatron's ``rank * V_local``).
        fingerprint: named integers that must be equal on every rank (:func:`fingerprint`).
        minimums: named integers every rank replaces by the group's minimum (e.g. the rows per
            chunk of a loop that runs a collective per chunk, from each rank's free memory).
    """

    rows: int
    vocab_local: int
    vocab_start: int | None
    fingerprint: tuple[tuple[str, int], ...] = ()
    minimums: tuple[tuple[str, int], ...] = ()


class ShardLayout(NamedTuple):
    """The vocabulary shards of a group, identical on every rank after :func:`agree`.

    Attributes:
        group: the process group (``None``: the default group).
        rank: this process's rank in ``group``.
        starts: ``vocab_start`` of each group rank (their first global id).
        sizes: ``V_local`` of each group rank.
        vocab: ``V``, the whole (padded) vocabulary, ``sum(sizes)``.
        rows: ``N``, the rows every rank holds.
        minimums: the group's minimum of each of :attr:`LocalShard.minimums`.
    """

    group: dist.ProcessGroup | None
    rank: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    vocab: int
    rows: int
    minimums: dict[str, int]

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def start(self) -> int:
        """This rank's first global id."""
        return self.starts[self.rank]

    @property
    def size(self) -> int:
        """This rank's ``V_local``."""
        return self.sizes[self.rank]

    def owned(self, ids: Tensor) -> Tensor:
        """Whether each global id lies in this rank's shard."""
        return (ids >= self.start) & (ids < self.start + self.size)

    def owner(self, ids: Tensor) -> Tensor:
        """The group rank holding each global id (``ids`` in ``[0, V)``; others: garbage)."""
        order = sorted(range(self.world), key=lambda r: self.starts[r])
        bounds = torch.tensor([self.starts[r] for r in order[1:]], device=ids.device)
        pos = torch.bucketize(ids, bounds, right=True)
        return torch.tensor(order, device=ids.device)[pos]

    def local_targets(self, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, int]:
        """``(local_target, owned, local_ignore)``: the targets as this rank's kernels take them.

        A target in this shard becomes its local id; one in another shard becomes local id 0
        (any id would do: the kernels' target entry at that id is corrected afterwards,
        :mod:`lopd_kernels.vocab_parallel.shard_grads`); an ignored row gets ``local_ignore``,
        an ignore marker outside ``[0, V_local)`` (``ignore_index`` itself unless it is a local
        id). ``owned``: ``[N]`` bool, the rows whose target this rank holds.
        """
        ignore = local_ignore_index(ignore_index, self.size)
        valid = target != ignore_index
        owned = valid & self.owned(target)
        local = torch.where(owned, target - self.start, torch.zeros_like(target))
        local = torch.where(valid, local, torch.full_like(target, ignore))
        return local, owned, ignore


def local_ignore_index(ignore_index: int, vocab_local: int) -> int:
    """An ignore marker for a shard's kernels that is no local id: ``ignore_index`` unless it
    lies in ``[0, V_local)`` (then a global target with that local id would be ignored)."""
    return -1 if 0 <= ignore_index < vocab_local else ignore_index


def checksum(x: Tensor) -> int:
    """A position-weighted integer checksum of ``x``'s values (its bits for floating tensors):
    equal on every rank for equal tensors, whatever the device. Reads the data (one host sync)."""
    if x.numel() == 0:
        return 0
    flat = x.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.float().view(torch.int32)
    flat = flat.to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 2654435761 + 1
    return int((flat * weights).sum())


def fingerprint(**fields: object) -> tuple[tuple[str, int], ...]:
    """Named integers to compare across ranks: ints as they are, anything else by the CRC-32 of
    its ``repr`` (options such as temperatures and names)."""
    out = []
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int):
            value = zlib.crc32(repr(value).encode())
        out.append((name, int(value)))
    return tuple(out)


def _group_position(group: dist.ProcessGroup | None, op: str) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"vocab_parallel.{op}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first (one process per vocabulary shard)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"vocab_parallel.{op}: this process (global rank {dist.get_rank()}) is not a member "
            "of the group it was given; pass the tensor-parallel group this rank belongs to"
        )
    return rank, dist.get_world_size(group)


def _gather_fixed(x: Tensor, group: dist.ProcessGroup | None, world: int) -> Tensor:
    # The concatenated form (gloo takes no other), viewed as one slab per rank.
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x, group)
    return out.view(world, *x.shape)


def all_gather_single(out: Tensor, x: Tensor, group: dist.ProcessGroup | None) -> None:
    """``torch.distributed``'s single-tensor all-gather under its name in this torch (2.11 calls
    it ``all_gather_into_tensor``, 2.13 ``all_gather_single``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def all_gather_rows(x: Tensor, layout: ShardLayout) -> Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (same shape and dtype on every rank), in group
    rank order. One collective."""
    if layout.world == 1:
        return x.unsqueeze(0)
    return _gather_fixed(x.contiguous(), layout.group, layout.world)


def _comm_device(group: dist.ProcessGroup | None, like: Tensor | None) -> torch.device:
    """Where the metadata travels: the inputs' device, else what the group's backend takes."""
    if isinstance(like, Tensor):
        return like.device
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_gathered(codes: Tensor, message: str, layout_args: tuple, op: str) -> None:
    """Every rank learns the first failing rank's message (a second small all-gather: only on
    this error path) and raises it."""
    group, world, device = layout_args
    raw = message.encode()[:_MESSAGE_BYTES]
    buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    texts = _gather_fixed(buf.to(device), group, world).cpu()
    bad = [r for r in range(world) if int(codes[r]) != 0]
    first = bad[0]
    text = bytes(texts[first].tolist()).rstrip(b"\0").decode(errors="replace")
    error = _ERRORS.get(int(codes[first]), ValueError)
    others = f" (and ranks {bad[1:]})" if len(bad) > 1 else ""
    raise error(f"vocab_parallel.{op}: rank {first}{others}: {text}")


def agree(
    op: str,
    group: dist.ProcessGroup | None,
    *,
    check: Callable[[], LocalShard],
    device_of: Tensor | None,
) -> ShardLayout:
    """The shard layout every rank agrees on, or the same error on every rank.

    Args:
        op: the op's name, for messages.
        group: the tensor-parallel group (``None``: the default group).
        check: this rank's checks of its own arguments. A ``TypeError`` / ``ValueError`` it
            raises is sent to every rank and raised there.
        device_of: a tensor on the device the collectives use (the inputs'), if there is one.

    Raises:
        TypeError / ValueError: on every rank, naming the rank whose argument is bad, or what
            differs between ranks (``N``, a fingerprint field, which ranks gave ``vocab_start``,
            shards that do not tile ``[0, V)``).
    """
    rank, world = _group_position(group, op)
    code, message = 0, ""
    local = LocalShard(0, 0, None)
    try:
        local = check()
    except (TypeError, ValueError) as err:
        code, message = (2 if isinstance(err, TypeError) else 1), str(err)
    device = _comm_device(group, device_of if code == 0 else None)
    # The fields after the header are the op's own (all ranks call the same op); a rank whose
    # check failed sends none (its code says so).
    prints, mins = local.fingerprint, local.minimums
    start = local.vocab_start
    header = [code, local.rows, local.vocab_local, -1 if start is None else start]
    header.append(int(start is not None))
    values = [*header, len(prints), *(v for _, v in prints), len(mins), *(v for _, v in mins)]
    # A fixed size on every rank, whatever its check found: the gather cannot mismatch.
    meta = torch.zeros(_META_WIDTH, dtype=torch.int64)
    meta[: len(values)] = torch.tensor(values[:_META_WIDTH], dtype=torch.int64)
    gathered = _gather_fixed(meta.to(device), group, world).cpu() if world > 1 else meta[None]
    codes = gathered[:, 0]
    if bool((codes != 0).any()):
        if world == 1:
            raise _ERRORS[code](f"vocab_parallel.{op}: {message}")
        _raise_gathered(codes, message, (group, world, device), op)
    rows = gathered[:, 1].tolist()
    if len(set(rows)) > 1:
        raise ValueError(
            f"vocab_parallel.{op}: every rank must hold the same rows, got N = {rows} by rank"
        )
    first = _HEADER + 1
    for i, (name, _) in enumerate(prints):
        column = gathered[:, first + i]
        if bool((column != column[0]).any()):
            differ = [r for r in range(world) if column[r] != column[0]]
            raise ValueError(
                f"vocab_parallel.{op}: {name} must be the same on every rank of the group; "
                f"ranks {differ} differ from rank 0"
            )
    first += len(prints) + 1
    minimums = {name: int(gathered[:, first + i].min()) for i, (name, _) in enumerate(mins)}
    sizes = tuple(gathered[:, 2].tolist())
    given = gathered[:, 4].tolist()
    if len(set(given)) > 1:
        with_start = [r for r in range(world) if given[r]]
        raise ValueError(
            f"vocab_parallel.{op}: vocab_start is given on ranks {with_start} and None on the "
            "others; give it on every rank or on none (None: rank * V_local, Megatron's "
            "partition)"
        )
    if given[0]:
        starts = tuple(gathered[:, 3].tolist())
    else:
        starts = tuple(r * sizes[r] for r in range(world))
    _check_tiling(op, starts, sizes, bool(given[0]))
    return ShardLayout(group, rank, starts, sizes, sum(sizes), rows[0], minimums)


def _check_tiling(op: str, starts: tuple[int, ...], sizes: tuple[int, ...], given: bool) -> None:
    """The shards ``[start, start + size)`` of the ranks partition ``[0, sum(sizes))``."""
    if min(sizes) < 1:
        empty = [r for r, v in enumerate(sizes) if v < 1]
        raise ValueError(f"vocab_parallel.{op}: ranks {empty} hold an empty vocabulary shard")
    order = sorted(range(len(sizes)), key=lambda r: starts[r])
    edge = 0
    for r in order:
        if starts[r] != edge:
            spans = ", ".join(
                f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in range(len(sizes))
            )
            how = "" if given else " (vocab_start=None is rank * V_local: equal shards)"
            raise ValueError(
                f"vocab_parallel.{op}: the vocabulary shards do not tile [0, {sum(sizes)}){how}: "
                f"{spans}"
            )
        edge += sizes[r]
