"""The backends of a BFCL episode in a worker process, every call under a time and memory limit.

bfcl-eval runs its backends in-process with no limit, and some calls a policy can write never end
(``GorillaFileSystem.cp``/``mv`` share subtrees, so a few dozen rounds make ``du``/``find``
exponential; ``MathAPI`` precisions run in C code no signal interrupts). Here an episode's two
sides (:class:`lopd.envs._bfcl_worker.Episode`) live in a persistent worker process, and each
request (a call, a turn's ground truth, a check) waits at most ``call_time_limit_s``; the worker's
address space is capped at ``call_memory_bytes``. A request that runs past either is stopped by
killing the worker; a fresh worker then replays the episode's log of completed requests (the
backends are deterministic: their random generators are seeded from the scenario), so the state
is exactly as if the stopped call had failed before doing anything, and the call's result is
BFCL's error observation (``Error during execution: ...``). A check that runs past the limit
fails the turn as an ``instance_state_mismatch`` (comparing a state equal to the ground truth's
takes the time of the ground truth's own state, far below the limit). If a replay itself fails
(the new worker dies, runs past a limit or cannot start), the episode's backends are lost: its
env ends the episode with the stopped call's error observation and reward 0, and no exception
leaves the env; the next episode takes another worker (a ``reset`` that fails on a pooled worker
is retried once in a new process).

Workers are pooled per process (an episode takes one at ``reset`` and gives it back when its env
is closed or dropped), so the cost per call is one round trip over a pipe (about 0.1 ms) and
the process start (about 0.2 s) is paid once per concurrent episode (a worker holds about
21 MiB).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WORKER = Path(__file__).with_name("_bfcl_worker.py")
_POOL_SIZE = 16
BACKEND_LOST = "lopd:backend_lost"
"""Error type of the turns checked after the episode's backends were lost."""
LOST_TEXT = "Error during execution: the episode's backends were lost after a stopped call"
"""The result of a call once the episode's backends are lost."""


@dataclass(frozen=True)
class BackendLimits:
    """Limits of one BFCL episode's backend requests.

    Attributes:
        call_time_limit_s: wall-clock seconds per call (and per turn check).
        call_memory_bytes: the worker's address-space cap (``RLIMIT_AS``).
        start_time_limit_s: seconds to start a worker and load an episode (imports included).
    """

    call_time_limit_s: float = 5.0
    call_memory_bytes: int = 2 << 30
    start_time_limit_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("call_time_limit_s", "call_memory_bytes", "start_time_limit_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"BackendLimits.{name} must be > 0, got {getattr(self, name)}")


class _Overrun(Exception):
    """A request ran past its time or memory limit, or the worker died (``str``: which)."""


# What a request to a worker can raise besides _Overrun: the worker's error answer (RuntimeError),
# a pipe or process failure (OSError), or an unreadable answer.
_WORKER_FAILURES = (
    _Overrun, RuntimeError, OSError, pickle.UnpicklingError, EOFError, ValueError, struct.error,
)  # fmt: skip


class _PlainUnpickler(pickle.Unpickler):
    """Responses hold only built-in values: refuse every global (no code on unpickling)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a worker response may not reference {module}.{name}")


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.proc = subprocess.Popen(
            [sys.executable, str(_WORKER), str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()

    def request(self, message: tuple, timeout_s: float) -> Any:
        """Send ``message``; the value of its ``("ok", value)`` response.

        Raises:
            _Overrun: no response within ``timeout_s``, the worker died, or ran out of memory.
            RuntimeError: the worker answered an error (a bug, not the policy's doing).
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            view = memoryview(struct.pack(">I", len(data)) + data)  # one write: one wake-up
            while view:
                view = view[os.write(self._in, view) :]
        except OSError:  # BrokenPipeError: the worker is gone
            raise _Overrun("died") from None
        deadline = time.monotonic() + timeout_s
        head = self._read(4, deadline)
        (n,) = struct.unpack(">I", head[:4])
        body = head[4:] + self._read(n - (len(head) - 4), deadline)
        response = _PlainUnpickler(io.BytesIO(body)).load()
        if response[0] == "ok":
            return response[1]
        if response[0] == "memory":
            raise _Overrun("memory")
        raise RuntimeError(f"BFCL backend worker: {response[1]}")

    def _read(self, n: int, deadline: float) -> bytes:
        """At least ``n`` bytes (the first read takes whatever is there: a whole small frame).

        The worker writes exactly one response per request, so nothing read here belongs to
        the next one."""
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise _Overrun("time")
            chunk = os.read(self._out, max(n - got, 65536))
            if not chunk:
                raise _Overrun("died")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class _Pool:
    """Idle workers of this process, by memory cap (an episode's state is reset on reuse)."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, memory_bytes: int, timeout_s: float) -> _Worker:
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the parent's workers are not ours
                self._idle, self._pid = [], os.getpid()
            # The most recently given back first.
            for i in reversed(range(len(self._idle))):
                w = self._idle[i]
                if w.memory_bytes == memory_bytes and w.alive():
                    return self._idle.pop(i)
        return self.start(memory_bytes, timeout_s)

    @staticmethod
    def start(memory_bytes: int, timeout_s: float) -> _Worker:
        """A new worker process (not one of the idle ones), initialized."""
        w = _Worker(memory_bytes)
        try:
            w.request(("init", list(sys.path)), timeout_s)
        except BaseException:
            w.kill()
            raise
        return w

    def give_back(self, w: _Worker) -> None:
        with self._lock:
            if w.alive() and len(self._idle) < _POOL_SIZE and os.getpid() == self._pid:
                self._idle.append(w)
                return
        w.kill()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_POOL = _Pool()
atexit.register(_POOL.close)


def _release(box: list) -> None:
    if box and box[0] is not None:
        _POOL.give_back(box.pop())


class EpisodeBackends:
    """One episode's backends (model side and ground truth) in a pooled worker process.

    Args:
        limits: the per-request limits.
    """

    def __init__(self, limits: BackendLimits | None = None) -> None:
        self.limits = limits or BackendLimits()
        self._box: list = []  # the worker (a list, so the finalizer holds no reference to self)
        self._log: list[tuple] = []  # completed requests that changed the state, in order
        self.lost = False
        self.overruns = 0
        self._finalizer = weakref.finalize(self, _release, self._box)

    # ------------------------------------------------------------------ requests
    def reset(self, involved_classes: list[str], initial_config: dict, long_context: bool) -> None:
        """Start a new episode (fresh instances of both sides).

        Raises:
            RuntimeError: the worker could not start or load the scenario.
        """
        self._log, self.lost = [], False
        message = ("reset", list(involved_classes), initial_config, long_context)
        try:
            self._worker().request(message, self.limits.start_time_limit_s)
        except _WORKER_FAILURES:
            # A pooled worker may have been left broken: once more in a new process.
            self._drop_worker()
            try:
                limits = self.limits
                self._box.append(_POOL.start(limits.call_memory_bytes, limits.start_time_limit_s))
                self._box[0].request(message, self.limits.start_time_limit_s)
            except _WORKER_FAILURES as e:
                self._drop_worker()
                raise RuntimeError(
                    f"BFCL backend worker could not load the scenario ({e})"
                ) from None
        self._log.append(message)

    def call(self, name: str, kwargs: dict[str, Any], clip: int) -> tuple[str, int]:
        """Run a model call: ``(the first clip characters of the result, its length)``."""
        if self.lost:
            return LOST_TEXT[:clip], len(LOST_TEXT)
        message = ("call", name, kwargs, clip)
        why = self._run(message)
        if why is None:
            return self._last
        text = f"Error during execution: {self._overrun_text(why)}"
        self.note(text)
        return text[:clip], len(text)

    def note(self, text: str) -> None:
        """Add a model result produced outside the worker (BFCL's response check sees it)."""
        if not self.lost:
            self._run(("note", text))

    def advance(self, turn: int, calls: list[tuple[str, list, dict]]) -> None:
        """Run the ground truth's calls of ``turn`` on the ground-truth side."""
        if not self.lost and self._run(("advance", turn, calls)) is not None:
            self.lost = True  # the ground truth's own calls never run long: a broken worker

    def check(
        self, turn: int, had_call: bool, pending: list[tuple[str, list, dict]] | None = None
    ) -> tuple[bool | None, str | None]:
        """BFCL's verdict of ``turn`` (see :meth:`lopd.envs._bfcl_worker.Episode.check`)."""
        if self.lost:
            return False, BACKEND_LOST
        why = self._run(("check", turn, had_call, pending), logged=False)
        if why is None:
            return self._last
        return False, "multi_turn:instance_state_mismatch"

    def close(self) -> None:
        """Give the worker back to the pool (the env's episode is over)."""
        self._finalizer()

    # ------------------------------------------------------------------ internals
    def _overrun_text(self, why: str) -> str:
        if why == "time":
            return (
                f"the call ran past the {self.limits.call_time_limit_s:g} s limit and was stopped"
            )
        if why == "memory":
            mib = self.limits.call_memory_bytes >> 20
            return f"the call ran past the {mib} MiB memory limit and was stopped"
        return "the call stopped the backend process"

    def _worker(self) -> _Worker:
        if not self._box:
            limits = self.limits
            self._box.append(_POOL.take(limits.call_memory_bytes, limits.start_time_limit_s))
        return self._box[0]

    def _drop_worker(self) -> None:
        if self._box:
            self._box.pop().kill()

    def _run(self, message: tuple, logged: bool = True) -> str | None:
        """Run a request; None on success (value in ``self._last``), else why it was stopped.

        A stopped request leaves the state as it was before it: the worker is replaced and the
        log replayed (or, if that fails, the episode is marked lost).
        """
        try:
            self._last = self._worker().request(message, self.limits.call_time_limit_s)
        except _WORKER_FAILURES as e:
            self.overruns += 1
            self._drop_worker()
            self._replay()
            return str(e) if isinstance(e, _Overrun) else "died"
        if logged:
            self._log.append(message)
        return None

    def _replay(self) -> None:
        try:
            worker = self._worker()
            for i, message in enumerate(self._log):
                limit = self.limits.start_time_limit_s if i == 0 else self.limits.call_time_limit_s
                worker.request(message, limit)
        except _WORKER_FAILURES:
            self._drop_worker()
            self.lost = True
