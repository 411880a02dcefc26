"""The program that runs an EnvScaler environment's code inside the sandbox.

:mod:`lopd.envs.envscaler` copies this file into a sandboxed run (:mod:`lopd.envs.sandbox`) with
``payload.json`` beside it and runs ``python -I -B runner.py OP [INDEX]``; the environment's
class code and the task's check code are executed here and nowhere else. Every run is a fresh
process: the state travels between runs as a pickle made and read only in here (the host keeps
it as opaque bytes and never unpickles it), plus a JSON rendering of it for the host to record.

Operations (``payload.json`` fields in brackets):

* ``reset`` [code, class_name, init_config]: execute the class code, build the instance as
  EnvScaler does (``Class(init_config)``, falling back to ``Class()`` on ``TypeError``, then every
  ``init_config`` key set as an attribute); answers the state, its view and the public methods.
* ``call`` [code, class_name, state, name, arguments]: rebuild the instance from the state
  (without running ``__init__``), call the method, answer its result as text (``str(result)``,
  as EnvScaler renders it) or the exception it raised, and the state after the call.
* ``check INDEX`` [code, initial, final, checks]: run check ``INDEX`` as EnvScaler does (its
  globals hold ``initial_state``; ``check_func(final_state)`` must return a bool), on private
  copies of the states, with an audit hook that stops it at the first operation reaching outside
  its states (files, processes, sockets, frames of this program, new imports...).

The answer is one JSON line on the descriptor that was stdout when the run started (the
environment's own prints go to ``/dev/null``). Only the standard library is used: the sandbox has
nothing else.
"""

import base64
import builtins
import copy
import datetime
import json
import math
import os
import pickle
import sys
import types

MODULE = "envscaler_env"
"""Name of the module the class code is executed in (so its classes pickle by reference)."""
MAX_RESULT_CHARS = 65_536
"""Characters of a tool result sent back (the host cuts further for the model)."""
MAX_STATE_BYTES = 8 << 20
"""Largest pickled state (a state past it is an error: it cannot be carried to the next call)."""
MAX_VIEW_CHARS = 2 << 20
"""Largest JSON view of a state sent back (past it, the view says how long it was)."""
MAX_REASON_CHARS = 500

# Modules a check may import: loaded before the audit hook is on, so importing them again is a
# lookup in sys.modules (no file is opened). Any other import counts as touching the outside.
PRELOADED = (
    "_strptime", "bisect", "calendar", "collections", "copy", "datetime", "decimal", "enum",
    "fractions", "functools", "hashlib", "heapq", "itertools", "json", "math", "numbers",
    "operator", "random", "re", "statistics", "string", "textwrap", "time", "typing",
    "unicodedata", "uuid",
)  # fmt: skip
# Audit events a check may not raise (by name, or by the prefix before the dot).
DENIED_EVENTS = frozenset(
    {
        "open", "import", "builtins.input", "sys._getframe", "sys._current_frames",
        "sys.addaudithook", "sys.settrace", "sys.setprofile", "object.__getattr__",
        "object.__setattr__", "object.__delattr__", "code.__new__", "function.__new__",
        "pickle.find_class", "marshal.loads", "marshal.load",
    }
)  # fmt: skip
DENIED_PREFIXES = (
    "os.", "socket.", "subprocess.", "ctypes.", "shutil.", "gc.", "urllib.", "http.", "ftplib.",
    "smtplib.", "telnetlib.", "webbrowser.", "pty.", "fcntl.", "resource.", "signal.", "mmap.",
    "sqlite3.", "glob.", "tempfile.", "syslog.", "msvcrt.", "winreg.", "cpython.", "_posixsub",
)  # fmt: skip


def _answer(fd: int, obj: dict) -> None:
    data = ("\n" + json.dumps(obj) + "\n").encode("utf-8", "replace")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _text(value: object, limit: int) -> str:
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception as e:  # a __str__ that raises is the environment's problem, not ours
        text = f"<unprintable {type(value).__name__}: {type(e).__name__}>"
    return text[:limit]


def _error(e: BaseException) -> str:
    return _text(f"{type(e).__name__}: {e}", MAX_REASON_CHARS)


def _plain(value: object, depth: int = 0) -> object:
    """A JSON-safe rendering of a state value (non-string keys as text, sets as lists...)."""
    if depth > 64:
        return "<nested too deeply>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {_key(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_plain(v, depth + 1) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(value, (datetime.date, datetime.time, datetime.timedelta)):
        return str(value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {"__object__": type(value).__name__, **_plain(vars(value), depth + 1)}
    return _text(value, 1000)


def _key(key: object) -> str:
    return key if isinstance(key, str) else _text(key, 1000)


def _load_class(payload: dict) -> type:
    module = types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    exec(compile(payload["code"], "<env_class_code>", "exec"), module.__dict__)
    cls = getattr(module, payload["class_name"], None)
    if not isinstance(cls, type):
        raise LookupError(f"the code defines no class {payload['class_name']!r}")
    return cls


def _state_of(attributes: dict) -> dict:
    """EnvScaler's state: the instance's attributes, built-in (dunder) names left out."""
    return {k: v for k, v in attributes.items() if not (k.startswith("__") and k.endswith("__"))}


def _dump_state(obj: object) -> dict:
    try:
        blob = pickle.dumps(dict(vars(obj)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise RuntimeError(f"the environment's state cannot be saved ({_error(e)})") from None
    if len(blob) > MAX_STATE_BYTES:
        raise RuntimeError(
            f"the environment's state is {len(blob):,} bytes pickled, over the "
            f"{MAX_STATE_BYTES:,}-byte limit"
        )
    view = json.dumps(_plain(_state_of(vars(obj))))
    if len(view) > MAX_VIEW_CHARS:
        view = json.dumps({"__cut__": f"a state view of {len(view):,} characters"})
    return {"state": base64.b64encode(blob).decode("ascii"), "view": view}


def _load_state(blob: str) -> dict:
    return pickle.loads(base64.b64decode(blob))


def _rebuild(cls: type, blob: str) -> object:
    obj = cls.__new__(cls)
    obj.__dict__.update(_load_state(blob))
    return obj


def public_methods(obj: object) -> list:
    """The tools: names of the instance's public callables (no leading underscore)."""
    names = []
    for name in dir(type(obj)):
        if name.startswith("_"):
            continue
        if callable(getattr(type(obj), name, None)):
            names.append(name)
    return sorted(names)


def _reset(payload: dict) -> dict:
    cls = _load_class(payload)
    config = copy.deepcopy(payload.get("init_config") or {})
    # EnvScaler's init_env_instance: the config dict to the constructor (an empty one when there
    # is none), a constructor without arguments on TypeError, then every key as an attribute.
    try:
        obj = cls(copy.deepcopy(config) if config else {})
    except TypeError:
        obj = cls()
    for key, value in config.items():
        setattr(obj, key, value)
    return {"ok": True, "tools": public_methods(obj), **_dump_state(obj)}


def _call(payload: dict) -> dict:
    cls = _load_class(payload)
    obj = _rebuild(cls, payload["state"])
    name = payload["name"]
    if name.startswith("_") or not callable(getattr(type(obj), name, None)):
        return {"ok": True, "unknown": True}
    result, error = None, None
    try:
        value = getattr(obj, name)(**payload["arguments"])
        result = _text(value, MAX_RESULT_CHARS)
    except MemoryError:
        raise  # past the memory limit: the host undoes the call
    except Exception as e:
        error = _error(e)
    return {"ok": True, "result": result, "error": error, **_dump_state(obj)}


class _Touched(PermissionError):
    pass


def _check(payload: dict, index: int) -> dict:
    if payload.get("code") is not None:
        _load_class(payload)  # classes the states may hold
    initial = _state_of(_load_state(payload["initial"]))
    final = _state_of(_load_state(payload["final"]))
    source = payload["checks"][index]
    for name in PRELOADED:
        __import__(name)
    touched: list = []

    def hook(event: str, args: tuple) -> None:
        if not armed:
            return
        if event in DENIED_EVENTS or event.startswith(DENIED_PREFIXES):
            if not touched:
                what = _text(args[0], 120) if args else ""
                touched.append(f"{event}({what})" if what else event)
            raise _Touched(f"a check may not use {event}")

    namespace = {"__builtins__": builtins, "initial_state": copy.deepcopy(initial)}
    armed = False
    sys.addaudithook(hook)
    armed = True
    try:
        exec(compile(source, "<check_func>", "exec"), namespace)
        func = namespace.get("check_func")
        if not callable(func):
            armed = False
            return {"held": False, "reason": "the check defines no check_func"}
        value = func(final)
    except BaseException as e:
        armed = False
        if touched:
            return {"held": False, "reason": f"it reached outside its state: {touched[0]}"}
        return {"held": False, "reason": f"it raised {_error(e)}"}
    armed = False
    if touched:
        return {"held": False, "reason": f"it reached outside its state: {touched[0]}"}
    if type(value) is not bool:
        return {"held": False, "reason": f"it returned {type(value).__name__}, not a bool"}
    return {"held": value, "reason": None}


def main() -> None:
    proto = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    op = sys.argv[1]
    try:
        with open("payload.json", encoding="utf-8") as f:
            payload = json.load(f)
        if op == "reset":
            answer = _reset(payload)
        elif op == "call":
            answer = _call(payload)
        elif op == "check":
            answer = _check(payload, int(sys.argv[2]))
        else:
            answer = {"ok": False, "error": f"unknown operation {op!r}"}
    except BaseException as e:
        answer = {"ok": False, "error": _error(e)}
    _answer(proto, answer)
    os._exit(0)


if __name__ == "__main__":
    main()
