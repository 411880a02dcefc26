"""BFCL's backends and checks for one episode, and the worker process that runs them.

:class:`Backends` holds the backend instances of one side (model or ground truth) and dispatches
calls like BFCL's executor; :class:`Episode` holds both sides of one episode, the model's
results so far and the ground truth's per turn, and runs BFCL's own turn checks
(``state_checker``, ``response_checker``). Both work in-process, but :mod:`lopd.envs.bfcl_backends`
runs an :class:`Episode` here, in a worker process (``python _bfcl_worker.py MEMORY_BYTES``), so
that a call that would run for hours or take all memory can be stopped.

The worker sets ``RLIMIT_AS`` to ``MEMORY_BYTES``, exits when its stdin closes, and answers framed
pickled requests on stdin (a 4-byte big-endian length, then the pickle) with framed responses
on stdout, one per request, in order:

* ``("init", sys_path)`` (first): the parent's ``sys.path``, so bfcl-eval imports as there;
* ``("reset", involved_classes, initial_config, long_context)``: a new episode;
* ``("call", name, kwargs, clip)``: a model call; answers the first ``clip`` characters of the
  result and its length (the full result stays here for the response check);
* ``("note", text)``: a model result produced outside (a call that was stopped);
* ``("advance", turn, calls)``: run the ground truth's calls of a turn;
* ``("check", turn, had_call, pending)``: BFCL's verdict of a turn (``pending``: the turn in
  progress, checked on a copy of the ground truth advanced by its calls, given as ``calls``).

A response is ``("ok", value)``, ``("memory",)`` when a call or check ran out of memory (its
effects are then unknown: the worker exits and the parent replaces it), or ``("error", message)``.

It must not import anything from ``lopd`` (it runs as a script, and its imports stay light:
bfcl-eval's backends, imported on the first reset).
"""

from __future__ import annotations

import copy
import decimal
import functools
import importlib
import inspect
import json
import os
import pickle
import resource
import signal
import struct
import sys
from typing import Any

# BFCL refuses these names before its eval (multi_turn_utils.execute_multi_turn_func_call).
REFUSED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})
# MathAPI arguments past these bounds would run (effectively) forever in C code no signal can
# interrupt; the benchmark's data stays far below them. A numeric string counts as its number
# (mpmath takes ``mp.dps = "100000000"``).
MATH_LIMITS = {"power": ("exponent", 10_000), "round_number": ("decimal_places", 10_000)}
MATH_PRECISION_LIMIT = 10_000
MAX_KEPT_RESULT_CHARS = 1 << 20
"""A model result longer than this is kept for the response check as a short placeholder: BFCL's
check looks for each ground-truth result (a few hundred characters at most) among the model's
results, so a longer one can never match, and keeping it (``find`` on a blown-up tree returns
hundreds of MB) would leave the worker no memory for the next call."""


@functools.cache
def backend_class(name: str) -> tuple[type, tuple[str, ...]]:
    """A backend class and its public method names."""
    # bfcl-eval: optional heavy dependency, imported on use.
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)
    methods = tuple(
        m for m, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not m.startswith("_")
    )
    return cls, methods


def format_result(result: Any) -> str:
    """A call's result as BFCL's executor renders it."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError, RecursionError):
            return str(result)
    return str(result)


def _magnitude(value: Any) -> float | None:
    """``|value|`` for a number or a string that Python or mpmath would read as one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return abs(value)
    if isinstance(value, str):
        try:
            return abs(float(value.strip()))
        except ValueError:
            return None
    return None


def check_math_arguments(name: str, method: Any, args: list, kwargs: dict) -> None:
    """Refuse MathAPI arguments that would run (effectively) forever.

    Raises:
        ValueError: an argument is past its bound (the message names it and the bound).
    """
    try:
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
    except TypeError:
        return  # the call itself reports the bad arguments
    limits = dict(MATH_LIMITS)
    limits.setdefault(name, ("precision", MATH_PRECISION_LIMIT))
    param, bound_value = limits[name]
    value = bound.get(param)
    magnitude = _magnitude(value)
    if magnitude is not None and not magnitude <= bound_value:
        raise ValueError(
            f"{param}={value!r} is outside this environment's limit (|{param}| <= {bound_value})"
        )


class _isolated_precision:
    """Restore mpmath's and decimal's global precision after a call (MathAPI sets them)."""

    def __enter__(self) -> None:
        import mpmath  # optional: the [bfcl] extra (BFCL's MathAPI backend)

        self._dps = mpmath.mp.dps
        self._prec = decimal.getcontext().prec

    def __exit__(self, *exc: Any) -> None:
        import mpmath  # optional: the [bfcl] extra (BFCL's MathAPI backend)

        mpmath.mp.dps = self._dps
        decimal.getcontext().prec = self._prec


class Backends:
    """The backend instances of one side (model or ground truth) of one episode.

    Args:
        involved_classes: class names (``lopd.envs.bfcl_data.BACKEND_CLASSES``).
        initial_config: ``class name -> scenario`` (deep-copied before loading).
        long_context: BFCL's long-context flag (the backends add long distractor data).
    """

    def __init__(
        self, involved_classes: list[str], initial_config: dict[str, Any], long_context: bool
    ) -> None:
        # bfcl-eval is optional (the [bfcl] extra).
        from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

        self.instances: dict[str, Any] = {}
        self._methods: dict[str, tuple[str, Any]] = {}
        for name in involved_classes:
            cls, method_names = backend_class(name)
            inst = cls()
            if name not in STATELESS_CLASSES:
                inst._load_scenario(
                    copy.deepcopy(initial_config.get(name, {})), long_context=long_context
                )
                # _load_scenario links module-level long-context records into the instance; a
                # private copy keeps one side's calls from changing the other's (or later
                # episodes') state.
                inst.__dict__.update(copy.deepcopy(inst.__dict__))
            self.instances[name] = inst
            for method_name in method_names:
                self._methods[method_name] = (name, getattr(inst, method_name))

    def has(self, name: str) -> bool:
        return name in self._methods

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """Run one call; a failure is an ``Error during execution: ...`` result.

        Raises:
            MemoryError: the call ran out of memory (its effects are unknown).
        """
        try:
            if name in REFUSED_NAMES:
                raise Exception(f"Function call {name} is not allowed.")
            if name not in self._methods:
                raise NameError(f"name '{name}' is not defined")
            class_name, method = self._methods[name]
            if class_name == "MathAPI":
                check_math_arguments(name, method, args, kwargs)
            with _isolated_precision():
                return format_result(method(*args, **kwargs))
        except MemoryError:
            raise
        except Exception as e:
            return f"Error during execution: {e}"


def check_turn(
    model: Backends, truth: Backends, gt_results: list[str], results: list[str], turn: int
) -> tuple[bool, str | None]:
    """BFCL's checks of a turn with a call: the state, then the responses (in its order)."""
    # bfcl-eval is optional (the [bfcl] extra).
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
        response_checker,
        state_checker,
    )

    for check in (
        state_checker(model.instances, truth.instances),
        response_checker(results, gt_results, turn),
    ):
        if not check["valid"]:
            return False, check["error_type"]
    return True, None


class Episode:
    """Both sides of one BFCL episode, the model's results so far, and the turn checks."""

    def __init__(
        self, involved_classes: list[str], initial_config: dict[str, Any], long_context: bool
    ) -> None:
        self.model = Backends(involved_classes, initial_config, long_context)
        self.truth = Backends(involved_classes, initial_config, long_context)
        self.results: list[str] = []  # every model result so far (BFCL's response check)
        self.gt_results: dict[int, list[str]] = {}

    def call(self, name: str, kwargs: dict[str, Any], clip: int) -> tuple[str, int]:
        """Run a model call: ``(its first clip characters, its length)``."""
        result = self.model.call(name, [], kwargs)
        answer = (result[:clip], len(result))
        if len(result) > MAX_KEPT_RESULT_CHARS:
            result = f"<a result of {len(result)} characters, not kept>"
        self.results.append(result)
        return answer

    def advance(self, turn: int, calls: list[tuple[str, list, dict]]) -> None:
        """Run the ground truth's calls of ``turn`` (``(name, args, kwargs)`` each)."""
        self.gt_results[turn] = [self.truth.call(*c) for c in calls]

    def check(
        self,
        turn: int,
        had_call: bool,
        pending: list[tuple[str, list, dict]] | None = None,
    ) -> tuple[bool | None, str | None]:
        """BFCL's verdict of ``turn``: ``(None, None)`` for an empty ground truth (not checked).

        ``pending``: check the turn in progress, on a copy of the ground truth advanced by these
        calls (this episode's state is not changed).
        """
        truth, gt_results = self.truth, self.gt_results.get(turn, [])
        if pending is not None:
            truth = copy.deepcopy(self.truth)
            gt_results = [truth.call(*c) for c in pending]
            calls = pending
        else:
            calls = gt_results
        if not calls:
            return None, None
        if not had_call:
            return False, "multi_turn:empty_turn_model_response"
        return check_turn(self.model, truth, gt_results, self.results, turn)


# --------------------------------------------------------------------------- the worker


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _frame(message: tuple) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack(">I", len(data)) + data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _handle(state: dict, request: tuple) -> tuple:
    kind = request[0]
    if kind == "init":
        sys.path[:] = list(request[1])
        return ("ok", None)
    if kind == "reset":
        state["episode"] = Episode(*request[1:])
        return ("ok", None)
    episode: Episode = state["episode"]
    if kind == "call":
        _, name, kwargs, clip = request
        return ("ok", episode.call(name, kwargs, clip))
    if kind == "note":
        episode.results.append(request[1])
        return ("ok", None)
    if kind == "advance":
        episode.advance(request[1], request[2])
        return ("ok", None)
    if kind == "check":
        _, turn, had_call, pending = request
        return ("ok", episode.check(turn, had_call, pending))
    return ("error", f"unknown request {kind!r}")


def main() -> None:
    memory = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
    # The protocol moves to descriptors of its own: a backend that prints or reads stdin (some
    # of bfcl-eval's do) sees /dev/null. At EOF (the parent closed its end or exited) we exit.
    fd_in, fd_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    # Made before any request: answering "out of memory" must not need memory.
    memory_frame = _frame(("memory",))
    state: dict = {}
    while True:
        try:
            (n,) = struct.unpack(">I", _read_exact(fd_in, 4))
            request = pickle.loads(_read_exact(fd_in, n))
        except EOFError:
            return
        try:
            try:
                frame = _frame(_handle(state, request))
            except MemoryError:
                raise
            except Exception as e:
                frame = _frame(("error", f"{type(e).__name__}: {e}"))
        except MemoryError:
            # The heap may stay full after the failed allocation (fragmented arenas stay mapped
            # under RLIMIT_AS): answer with the frame made at start and leave; the parent
            # replaces this worker.
            os.write(fd_out, memory_frame)
            os._exit(1)
        _write_all(fd_out, frame)


if __name__ == "__main__":
    # Run as a script: its own directory (lopd/envs) must not shadow top-level modules.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    main()
