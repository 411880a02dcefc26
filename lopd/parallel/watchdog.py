"""Stuck and lost ranks become one-line errors on every rank, never a silent hang.

Under ``torchrun`` every rank writes to the rendezvous's key-value store (the c10d store the
launcher serves) which phase of the run it is in (:data:`PHASES`: ``rollout``, ``loss``,
``optimizer``, ``checkpoint``, ``evaluation``, ...), since when, and, once a second, a heartbeat.
That costs one small store write per phase change and per second, and no collective.

* **Collectives** (all-reduces, FSDP2's all-gathers and reduce-scatters) wait at most
  ``model.collective_timeout_minutes``: the process group's timeout, after which gloo raises on
  the waiting rank. A peer that died (its connection closes) makes them fail at once.
* **Barriers** (the other ranks waiting for rank 0's solo work: the bank, an evaluation, writing
  files) wait on the store, without a limit while every rank that has not arrived keeps beating,
  and fail once one of them is silent for the timeout or has recorded a failure.
* **Explaining a failure** (:meth:`PhaseBoard.explain`): the failed collective's rank reads every
  rank's record and says in one line which rank did not arrive or is gone, in which phase and
  step, and what to do. A rank that fails records its message, so the others can repeat it.
* **Stopped by the launcher**: ``torchrun`` stops the other ranks with ``SIGTERM`` once one has
  failed; :func:`sigterm_raises` turns that signal into :class:`StoppedBySignal`, explained the
  same way instead of dying without a word.

On NCCL the process group's timeout is enforced by NCCL's watchdog, which ends the process
itself; the store's records still name the phase of every rank in the other ranks' messages.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = [
    "PHASES",
    "DistributedFailure",
    "PhaseBoard",
    "RankRecord",
    "StoppedBySignal",
    "is_collective_error",
    "sigterm_raises",
]

PHASES = (
    "setup",
    "bank",
    "cold_start",
    "rollout",
    "loss",
    "optimizer",
    "checkpoint",
    "evaluation",
)
"""The phases a rank reports (the trainer enters them; ``setup`` until the first)."""

_RESUME = "`--resume` continues from the last complete checkpoint"

# Every board of a process gets its own key prefix: a test (or a caller) may build several
# trainers in one process group, and a later board must not see an earlier board's barriers.
# Every rank builds its boards in the same order, so the prefixes agree across ranks.
_generations = itertools.count()


class DistributedFailure(RuntimeError):
    """A collective or barrier failed; the message is one line meant for the user."""


class StoppedBySignal(BaseException):
    """The process received ``SIGTERM`` (``torchrun`` stops every rank once one failed).

    A ``BaseException``, like ``KeyboardInterrupt``, so that code catching ``Exception`` (an
    environment's error handling) does not swallow it.
    """


_COLLECTIVE_MARKERS = (
    "gloo",
    "nccl",
    "processgroup",
    "connection closed by peer",
    "connection reset by peer",
    "timed out waiting",
)


def is_collective_error(err: BaseException) -> bool:
    """Whether ``err`` came out of a collective or the rendezvous store (not the user's data)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _COLLECTIVE_MARKERS)


@dataclass(frozen=True)
class RankRecord:
    """What the store says about one rank.

    Attributes:
        rank: the rank.
        phase: the phase it last entered (``None``: nothing recorded yet).
        step: the training step of that phase, or ``None``.
        since: wall-clock time it entered the phase (``time.time()`` of its machine).
        beats: its heartbeat counter (one a second while its process runs).
        failure: the one-line message it recorded when it failed, or ``None``.
    """

    rank: int
    phase: str | None
    step: int | None
    since: float | None
    beats: int
    failure: str | None

    def where(self) -> str:
        """``phase 'loss' at step 3``."""
        if self.phase is None:
            return "no phase yet"
        return f"phase '{self.phase}'" + (f" at step {self.step}" if self.step is not None else "")


class PhaseBoard:
    """This rank's phase and heartbeat on the store, and the barriers and failure messages that
    read every rank's.

    Args:
        store: the rendezvous store (the process group's).
        rank: this rank.
        world: the number of ranks.
        timeout_s: ``model.collective_timeout_minutes`` in seconds.
        beat_s: seconds between heartbeats.
        prefix: the store keys' prefix; ``None``: this process's next board's (every rank makes
            its boards in the same order, so theirs agree).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        timeout_s: float,
        beat_s: float = 1.0,
        prefix: str | None = None,
    ) -> None:
        self.rank, self.world = rank, world
        self.timeout_s = timeout_s
        self.beat_s = beat_s
        self.store = dist.PrefixStore(prefix or f"lopd/{next(_generations)}", store)
        self.phase: str = "setup"
        self.step: int | None = None
        self.reporting = False  # a failure message is being written: SIGTERM waits for it
        self._barriers = 0
        self._write_phase()
        self._stop = threading.Event()
        # Its own connection: the main thread may be blocked in a store call of its own.
        beat_store = self.store.clone() if hasattr(self.store, "clone") else self.store
        self._thread = threading.Thread(
            target=self._beat, args=(beat_store,), name="lopd-heartbeat", daemon=True
        )
        self._thread.start()
        # A daemon thread cut off inside a store call at interpreter exit aborts the process
        # (SIGABRT): stop it first.
        atexit.register(self.close)

    # ------------------------------------------------------------------ this rank
    def _write_phase(self) -> None:
        record = {"phase": self.phase, "step": self.step, "since": time.time()}
        self.store.set(f"phase/{self.rank}", json.dumps(record))

    def _beat(self, store: Any) -> None:
        while not self._stop.is_set():
            try:
                store.add(f"beat/{self.rank}", 1)
            except Exception:  # the store is gone (the launcher stopped): nothing to tell
                return
            self._stop.wait(self.beat_s)

    def enter(self, phase: str, step: int | None = None) -> None:
        """Record that this rank is now in ``phase``, at training step ``step`` (``None``: the
        step stays the last one entered)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase = phase
        self.step = self.step if step is None else step
        self._write_phase()

    def record_failure(self, message: str) -> None:
        """Leave this rank's one-line failure for the other ranks' messages (best effort)."""
        with contextlib.suppress(Exception):
            self.store.set(f"failed/{self.rank}", message)

    def close(self) -> None:
        """Stop the heartbeat (waits for its thread; idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    # ------------------------------------------------------------------ every rank
    def records(self) -> list[RankRecord]:
        """Every rank's record (ranks whose keys are missing have ``phase=None``)."""
        out = []
        for r in range(self.world):
            phase = step = since = failure = None
            if self.store.check([f"phase/{r}"]):
                rec = json.loads(self.store.get(f"phase/{r}"))
                phase, step, since = rec["phase"], rec["step"], rec["since"]
            if self.store.check([f"failed/{r}"]):
                failure = self.store.get(f"failed/{r}").decode()
            beats = self.store.add(f"beat/{r}", 0)
            out.append(RankRecord(r, phase, step, since, beats, failure))
        return out

    def barrier(self) -> None:
        """Wait until every rank has arrived (see the module docstring: no limit while the
        absent ranks keep beating).

        Raises:
            DistributedFailure: an absent rank recorded a failure, or sent no heartbeat for
                the timeout.
        """
        self._barriers += 1
        prefix = f"barrier/{self._barriers}"
        self.store.set(f"{prefix}/{self.rank}", "1")
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        heard: dict[int, tuple[int, float]] = {}  # rank -> (beats, local time they changed)
        delay, next_check = 0.001, time.monotonic() + 1.0
        while not self.store.check(keys):
            time.sleep(delay)
            delay = min(0.2, delay * 2)
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + 1.0
            for r in range(self.world):
                if self.store.check([f"{prefix}/{r}"]):
                    continue
                if self.store.check([f"failed/{r}"]):
                    why = self.store.get(f"failed/{r}").decode()
                    raise DistributedFailure(
                        f"rank {self.rank}: rank {r}, waited for in {self._here()}, failed: {why}"
                    )
                beats = self.store.add(f"beat/{r}", 0)
                last, changed = heard.get(r, (None, now))
                if beats != last:
                    heard[r] = (beats, now)
                elif now - changed > self.timeout_s:
                    rec = self.records()[r]
                    raise DistributedFailure(
                        f"rank {self.rank}: rank {r} sent no sign of life for "
                        f"{now - changed:.0f} s while this rank waited for it in "
                        f"{self._here()} (it was last in {rec.where()}): it died or froze; "
                        f"see its log; {_RESUME}"
                    )

    def _here(self) -> str:
        return RankRecord(self.rank, self.phase, self.step, None, 0, None).where()

    # ------------------------------------------------------------------ messages
    def explain(self, err: BaseException) -> DistributedFailure:
        """The one-line message of a failed collective, barrier or a ``SIGTERM`` on this rank
        (records it for the other ranks too)."""
        self.reporting = True
        if isinstance(err, DistributedFailure):
            message = str(err)
        else:
            try:
                message = self._message(err)
            except Exception:  # the store is gone too: say what this rank knows
                message = (
                    f"rank {self.rank}: {self._what(err)} in {self._here()}; the other ranks "
                    f"cannot be reached; {_RESUME}"
                )
        self.record_failure(message)
        return DistributedFailure(message)

    def _what(self, err: BaseException) -> str:
        text = str(err).lower()
        if isinstance(err, StoppedBySignal):
            return "stopped by SIGTERM (torchrun stops every rank once one has failed)"
        if "timed out" in text or "timeout" in text:
            return f"a collective timed out after {self.timeout_s:g} s"
        if "closed by peer" in text or "reset by peer" in text or "broken pipe" in text:
            return "a collective lost its connection to another rank"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"a collective failed ({first[:200]})"

    def _lost_ranks(self, before: list[RankRecord], wait_s: float) -> list[int]:
        """Ranks whose heartbeat does not move within ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        silent = {r.rank for r in before if r.rank != self.rank}
        while silent and time.monotonic() < deadline:
            time.sleep(0.1)
            silent = {r for r in silent if self.store.add(f"beat/{r}", 0) == before[r].beats}
        return sorted(silent)

    def _message(self, err: BaseException) -> str:
        what = self._what(err)
        records = self.records()
        head = f"rank {self.rank}: {what} in {self._here()}"
        failed = [r for r in records if r.failure is not None and r.rank != self.rank]
        if failed:
            first = failed[0]
            why = first.failure.removeprefix(f"rank {first.rank}: ")
            return f"{head}; rank {first.rank} failed first: {why}"
        if isinstance(err, StoppedBySignal) or "lost its connection" in what:
            lost = self._lost_ranks(records, wait_s=2.5 * self.beat_s + 0.5)
            if isinstance(err, StoppedBySignal) and not lost:
                return f"{head}; {_RESUME}"
            who = (
                ", ".join(f"rank {r} (last in {records[r].where()})" for r in lost)
                if lost
                else "another rank"
            )
            return (
                f"{head}; {who} is gone without a word (killed, out of memory, or its machine "
                f"failed): see its log or the launcher's report; {_RESUME}"
            )
        now = time.time()
        elsewhere = [
            r
            for r in records
            if r.rank != self.rank and (r.phase, r.step) != (self.phase, self.step)
        ]
        if elsewhere:
            where = ", ".join(
                f"rank {r.rank} is in {r.where()}"
                + (f" since {now - r.since:.0f} s" if r.since is not None else "")
                for r in elsewhere
            )
            cause = (
                f"{where}: it is stuck there or slower than the timeout; if that phase "
                "legitimately takes longer, raise model.collective_timeout_minutes"
            )
        else:
            cause = (
                f"every rank is in {self._here()}: the ranks ran different collectives there "
                "(a bug: TORCH_DISTRIBUTED_DEBUG=DETAIL names them)"
            )
        return f"{head}; {cause}; {_RESUME}"


@contextlib.contextmanager
def sigterm_raises(board: PhaseBoard | None) -> Iterator[None]:
    """Within the block ``SIGTERM`` raises :class:`StoppedBySignal` in the main thread (not while
    ``board`` is writing a failure message); the previous handler is restored on exit. A no-op
    outside the main thread or without a board."""
    if board is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if not board.reporting:
            raise StoppedBySignal(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
