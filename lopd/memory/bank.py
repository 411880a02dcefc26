"""The experience bank: successful trajectories stored append-only as JSONL (paper A.3).

Each :class:`BankEntry` pairs a task description with the observation-lite ``action -> result``
trace of one successful rollout of it. The bank file is the single source of truth; the FAISS
index and the query cache of :mod:`lopd.memory.retriever` are derived from it and can always be
rebuilt.

Durability model (one JSON object per line, ``bank.jsonl`` inside the bank directory):

* A batch of records is appended with one ``write`` on an ``O_APPEND`` descriptor under an
  exclusive ``flock``, then ``fsync``-ed before :meth:`ExperienceBank.add` returns. Several
  processes (or threads, or bank objects) may append to the same bank concurrently: each batch
  lands contiguously, never interleaved with another writer's bytes. Readers take a shared lock,
  so they never see half of a live writer's batch; :meth:`ExperienceBank.refresh` picks up what
  other processes appended.
* A crash mid-write can only leave a torn *last* line (the one batch whose ``fsync`` never
  returned). Loading skips a truncated or unparsable last line with a warning; the next append
  first cuts that torn tail off so the new record starts on a clean line. A corrupt line
  *followed by* valid records cannot come from a crash and raises :class:`BankCorruptionError`.
* Entry ids are content hashes of ``(task_id, trace_text)``, so the same successful trace is
  stored once even if several writers collect it, and ids agree across processes without
  coordination.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopd.types import Trajectory

BANK_FILE = "bank.jsonl"
"""Name of the JSONL file inside a bank directory."""

_FORMAT_VERSION = 1
_REQUIRED_KEYS = frozenset(("entry_id", "task_id", "world", "instruction", "trace_text", "reward"))


class BankCorruptionError(ValueError):
    """A bank file has an unreadable record before its last line (not a crash artifact)."""


@dataclass(frozen=True)
class BankEntry:
    """One experience: a task description plus the observation-lite trace that solved it.

    Attributes:
        entry_id: stable content id, ``make_entry_id(task_id, trace_text)``.
        task_id: id of the task the trace solved; the retriever never returns an entry whose
            ``task_id`` equals the query's (no self-retrieval).
        world: the environment/world the task ran in (e.g. ``"insurance"``, ``"coding"``).
        instruction: the task description (the paper's ``x_i``).
        trace_text: linearized ``"1. action -> result"`` lines (the paper's ``tau_i``).
        reward: verifier reward of the trajectory, in ``[0, 1]``.
        meta: free-form JSON-serializable extras (split, domain, step counts, source model).
    """

    entry_id: str
    task_id: str
    world: str
    instruction: str
    trace_text: str
    reward: float
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Spelled out rather than dataclasses.asdict, whose recursive deep copy dominated the
        # cost of a bank write (about 5x slower for 100k records).
        return {
            "entry_id": self.entry_id,
            "task_id": self.task_id,
            "world": self.world,
            "instruction": self.instruction,
            "trace_text": self.trace_text,
            "reward": self.reward,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BankEntry:
        if not d.keys() >= _REQUIRED_KEYS:
            missing = sorted(_REQUIRED_KEYS - d.keys())
            raise ValueError(f"bank record is missing keys {missing}")
        return cls(
            entry_id=str(d["entry_id"]),
            task_id=str(d["task_id"]),
            world=str(d["world"]),
            instruction=str(d["instruction"]),
            trace_text=str(d["trace_text"]),
            reward=float(d["reward"]),
            meta=dict(d.get("meta") or {}),
        )

    @classmethod
    def from_trajectory(cls, traj: Trajectory, meta: dict[str, Any] | None = None) -> BankEntry:
        """Build the entry of one trajectory (its task and observation-lite trace)."""
        trace_text = traj.trace_text()
        base_meta = {
            "domain": traj.task.domain,
            "split": traj.task.split,
            "num_steps": traj.num_steps,
            "num_tool_calls": traj.num_tool_calls,
        }
        return cls(
            entry_id=make_entry_id(traj.task.task_id, trace_text),
            task_id=traj.task.task_id,
            world=traj.task.world,
            instruction=traj.task.instruction,
            trace_text=trace_text,
            reward=float(traj.reward),
            meta={**base_meta, **(meta or {})},
        )


def make_entry_id(task_id: str, trace_text: str) -> str:
    """Content id of an entry: 16 hex digits of SHA-256 over ``task_id`` and ``trace_text``."""
    h = hashlib.sha256()
    h.update(task_id.encode())
    h.update(b"\x00")
    h.update(trace_text.encode())
    return h.hexdigest()[:16]


def format_experience(entry: BankEntry) -> str:
    """Render an entry as privileged text in the paper's A.3 layout.

    Example::

        Task: Acting on behalf of Alice Chan, update her health policy XJ-439220: ...
        Example steps (from a different task, NOT yet executed):
        1. get_policy_by_policy_number(policy_number="XJ-439220") -> policy_id=POL-001
        2. get_exclusions_for_policy(policy_id="POL-001") -> exclusion_id=EXCL-001, ...

    The "from a different task, NOT yet executed" header matters for text-conditioned teachers:
    the reader must not mistake the retrieved steps for actions already taken in its own episode.
    """
    steps = entry.trace_text if entry.trace_text else "(no tool calls)"
    return (
        f"Task: {entry.instruction}\n"
        "Example steps (from a different task, NOT yet executed):\n"
        f"{steps}"
    )


def document_prefix(instruction: str) -> str:
    """The task part that opens every retrieval document: ``"Task: ...\nTrajectory:\n"``."""
    return f"Task: {instruction}\nTrajectory:\n"


def task_part(document: str) -> str:
    """The task part of a retrieval document (:func:`document_text`): its
    :func:`document_prefix`, without the trace. A text not in that layout is returned whole."""
    marker = "\nTrajectory:\n"
    if not document.startswith("Task: ") or marker not in document:
        return document
    return document[: document.index(marker) + len(marker)]


def document_text(entry: BankEntry) -> str:
    """The document-side retrieval text of an entry: task followed by trace (paper eq. 15).

    Kept free of the :func:`format_experience` framing sentence, which is identical for every
    entry and would only dilute a mean-pooled embedding.
    """
    return document_prefix(entry.instruction) + entry.trace_text


class ExperienceBank:
    """Append-only, crash-safe store of successful trajectories.

    Args:
        path: bank directory (created if missing); records live in ``path / "bank.jsonl"``, the
            retriever stores its index and query cache next to it.
        min_reward: trajectories with ``reward >= min_reward`` are successes and get stored by
            :meth:`add`; others are ignored. :meth:`add_entry` does not filter.
        dedup: skip entries whose ``entry_id`` (content hash) is already stored.

    The in-memory view is loaded at construction; :meth:`refresh` picks up records appended by
    other processes since, :meth:`reload` re-reads the whole file.

    Example:
        >>> bank = ExperienceBank("runs/bank", min_reward=1.0)
        >>> bank.add(trajectory)  # stored only if trajectory.reward >= 1.0
        >>> [format_experience(e) for e in bank][:1]
    """

    def __init__(self, path: str | os.PathLike[str], min_reward: float = 1.0, dedup: bool = True):
        if not 0.0 <= float(min_reward) <= 1.0:
            raise ValueError(f"min_reward must be in [0, 1], got {min_reward}")
        self.dir = Path(path)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"path must be a directory (the bank directory), got file {self.dir}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / BANK_FILE
        self.file.touch(exist_ok=True)
        self.min_reward = float(min_reward)
        self.dedup = dedup
        self._lock = threading.Lock()  # guards the in-memory view within one process
        self.reload()

    # ----------------------------------------------------------------------------- reading
    def reload(self) -> None:
        """Re-read the whole bank file (discarding the in-memory view)."""
        with self._lock:
            self._entries: list[BankEntry] = []
            self._by_id: dict[str, int] = {}
            self._offset = 0  # bytes of the file consumed into the view (ends on a newline)
            self._read_new(final=True)

    def refresh(self) -> int:
        """Load records appended (by any process) since the last read; return how many."""
        with self._lock:
            before = len(self._entries)
            self._read_new(final=False)
            return len(self._entries) - before

    def _read_new(self, final: bool, locked: bool = False) -> None:
        """Parse the bytes past ``self._offset`` into the view.

        Args:
            final: also take (or warn about) an unterminated last line; otherwise leave it
                for a later read.
            locked: the caller already holds the exclusive append lock (a shared lock taken
                on a second descriptor would then deadlock against it).
        """
        with open(self.file, "rb") as f:
            if not locked:
                # Writers hold LOCK_EX for a whole batch: under LOCK_SH no live write is half
                # done, so a torn tail seen here really is left over from a crash.
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            f.seek(self._offset)
            data = f.read()
        if not data:
            return
        lines = data.split(b"\n")
        # After split, the last element is b"" when the data ends with a newline, otherwise it is
        # an unterminated (possibly torn) line.
        tail = lines.pop()
        bad: list[tuple[int, bytes]] = []
        consumed = 0
        parsed: list[BankEntry] = []
        for i, raw in enumerate(lines):
            consumed += len(raw) + 1
            if not raw.strip():
                continue
            entry = _parse_line(raw)
            if entry is None:
                bad.append((i, raw))
            else:
                parsed.append(entry)
        if bad:
            last_idx = len(lines) - 1
            # Only the very last complete line may be bad, and only when nothing follows it.
            if len(bad) > 1 or bad[0][0] != last_idx or tail.strip():
                line_no = self._line_number(bad[0][0])
                raise BankCorruptionError(
                    f"{self.file}: unreadable record at line {line_no} followed by further "
                    "records; this is not a crash artifact (only the last line can be torn)"
                )
            warnings.warn(
                f"{self.file}: skipping corrupt last record ({len(bad[0][1])} bytes)",
                RuntimeWarning,
                stacklevel=3,
            )
            # Leave it unconsumed: the next append cuts it off, and the view's offset must not
            # point past bytes that are about to disappear.
            consumed -= len(bad[0][1]) + 1
        if tail.strip():
            entry = _parse_line(tail) if final else None
            if final and entry is not None:
                # A complete JSON record whose newline never made it to disk.
                parsed.append(entry)
                consumed += len(tail)
            elif final:
                warnings.warn(
                    f"{self.file}: skipping truncated last record ({len(tail)} bytes); "
                    "it was being written when its writer stopped",
                    RuntimeWarning,
                    stacklevel=3,
                )
        for entry in parsed:
            self._insert(entry)
        self._offset += consumed

    def _line_number(self, idx_in_chunk: int) -> int:
        with open(self.file, "rb") as f:
            head = f.read(self._offset)
        return head.count(b"\n") + idx_in_chunk + 1

    def _insert(self, entry: BankEntry) -> bool:
        if self.dedup and entry.entry_id in self._by_id:
            return False
        self._by_id.setdefault(entry.entry_id, len(self._entries))
        self._entries.append(entry)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BankEntry]:
        return iter(list(self._entries))

    def __getitem__(self, i: int) -> BankEntry:
        return self._entries[i]

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._by_id

    def get(self, entry_id: str) -> BankEntry:
        """The entry with this id (``KeyError`` if absent)."""
        return self._entries[self._by_id[entry_id]]

    def entries(self) -> list[BankEntry]:
        """A snapshot list of all entries in insertion (file) order."""
        return list(self._entries)

    def task_ids(self) -> set[str]:
        """Ids of the tasks that have at least one stored experience."""
        return {e.task_id for e in self._entries}

    # ----------------------------------------------------------------------------- writing
    def is_success(self, traj: Trajectory) -> bool:
        """Whether ``traj`` clears the bank's reward threshold."""
        return float(traj.reward) >= self.min_reward

    def add(self, trajectory: Trajectory, meta: dict[str, Any] | None = None) -> BankEntry | None:
        """Store one trajectory if it is a success; return its entry, or ``None`` if skipped.

        Skipped means below ``min_reward`` or (with ``dedup``) an identical trace of the same
        task is already stored.
        """
        added = self.add_many([trajectory], meta=meta)
        return added[0] if added else None

    def add_many(
        self, trajectories: Iterable[Trajectory], meta: dict[str, Any] | None = None
    ) -> list[BankEntry]:
        """Store the successes among ``trajectories`` as one durable batch; return those stored."""
        entries = [BankEntry.from_trajectory(t, meta) for t in trajectories if self.is_success(t)]
        return self.add_entries(entries)

    def add_entry(self, entry: BankEntry) -> bool:
        """Store one ready-made entry (no reward filter); return whether it was new."""
        return bool(self.add_entries([entry]))

    def add_entries(self, entries: Iterable[BankEntry]) -> list[BankEntry]:
        """Append ``entries`` as one batch: one ``write`` + ``fsync`` under the file lock.

        Returns:
            The entries actually written (duplicates, by ``entry_id``, are dropped when
            ``dedup`` is on, including duplicates written meanwhile by other processes).
        """
        entries = list(entries)
        for e in entries:
            if not isinstance(e, BankEntry):
                raise TypeError(f"entries must be BankEntry objects, got {type(e).__name__}")
        if not entries:
            return []
        with self._lock, self._locked_append() as fd:
            # Under the exclusive lock the file cannot grow behind our back: first catch up with
            # records other writers appended, so dedup sees them.
            self._read_new(final=False, locked=True)
            fresh: list[BankEntry] = []
            seen: set[str] = set()
            for e in entries:
                if self.dedup and (e.entry_id in self._by_id or e.entry_id in seen):
                    continue
                seen.add(e.entry_id)
                fresh.append(e)
            if not fresh:
                return []
            payload = b"".join(_dump_line(e) for e in fresh)
            _write_all(fd, payload)
            os.fsync(fd)
            for e in fresh:
                self._insert(e)
            self._offset += len(payload)
        return fresh

    @contextlib.contextmanager
    def _locked_append(self) -> Iterator[int]:
        fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._repair_torn_tail(fd)
            yield fd
        finally:
            # Closing the descriptor releases the flock.
            os.close(fd)

    def _repair_torn_tail(self, fd: int) -> None:
        """Make the file end on a clean record boundary before appending.

        An interrupted write leaves a torn last line: unterminated, or (after file-system level
        damage) terminated but unparsable. Appending after it would bury it mid-file, where it
        reads as real corruption, so it is cut off here. A last record that is complete but lost
        only its newline is kept and terminated.
        """
        size = os.fstat(fd).st_size
        if size == 0:
            return
        with open(self.file, "rb") as f:
            f.seek(max(0, size - 1))
            terminated = f.read(1) == b"\n"
            end = size - 1 if terminated else size
            # Scan back in blocks for the newline that starts the last line.
            pos, start = end, 0
            while pos > 0:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                nl = f.read(step).rfind(b"\n", 0, end - pos)
                if nl >= 0:
                    start = pos + nl + 1
                    break
            f.seek(start)
            last = f.read(end - start)
        if not last.strip() or _parse_line(last) is not None:
            if not terminated:
                _write_all(fd, b"\n")
                os.fsync(fd)
            return
        warnings.warn(
            f"{self.file}: removing a torn last record ({size - start} bytes) left by an "
            "interrupted write before appending",
            RuntimeWarning,
            stacklevel=4,
        )
        os.ftruncate(fd, start)
        os.fsync(fd)
        self._offset = min(self._offset, start)

    def __repr__(self) -> str:
        return (
            f"ExperienceBank({str(self.dir)!r}, entries={len(self)}, min_reward={self.min_reward})"
        )


def _dump_line(entry: BankEntry) -> bytes:
    rec = {"v": _FORMAT_VERSION, **entry.to_dict()}
    # ensure_ascii keeps every record a single physical line whatever the trace contains.
    return (json.dumps(rec, ensure_ascii=True, separators=(",", ":")) + "\n").encode()


def _parse_line(raw: bytes) -> BankEntry | None:
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            return None
        return BankEntry.from_dict(d)
    except (ValueError, TypeError, UnicodeDecodeError):
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
