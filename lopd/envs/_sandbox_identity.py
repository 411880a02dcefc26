"""Which interpreter and which uid a sandboxed program runs as (:mod:`lopd.envs.sandbox`).

In root mode each run gets a fresh, otherwise unused uid (exact ``RLIMIT_NPROC``, kill by uid);
the interpreter must then be executable by that uid, and a venv's base interpreter is used so
that no ``site-packages`` is on the program's path.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path

_UID_RANGE = (1_000_000, 2_000_000)


def _others_can_execute(path: str) -> bool:
    """Whether a uid that is neither owner nor group member can run ``path``."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return False
    if not (st.st_mode & stat.S_IXOTH and st.st_mode & stat.S_IROTH):
        return False
    parent = os.path.dirname(real)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def sandbox_python(unprivileged: bool | None = None) -> str:
    """The interpreter for sandboxed code.

    Without privilege dropping this is the real path of the running interpreter, or in a venv of
    its base interpreter (``sys._base_executable``): sandboxed code needs only the standard
    library, and a venv's ``site-packages`` must not be on its path. When the run drops to an
    unprivileged uid, that uid must be able to execute the interpreter: that one if its path is
    open to others, else the first of ``python3`` on ``PATH``, ``/usr/bin/python3``,
    ``/usr/local/bin/python3`` that is (a pyenv/conda interpreter under ``/root`` is not).

    Raises:
        RuntimeError: no interpreter usable by an unprivileged uid was found.
    """
    if unprivileged is None:
        unprivileged = os.geteuid() == 0
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not unprivileged:
        return base
    candidates = [
        base,
        shutil.which("python3"),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ]
    for c in candidates:
        if c and _others_can_execute(c):
            return os.path.realpath(c)
    raise RuntimeError(
        "no Python interpreter executable by an unprivileged uid was found; pass python=... "
        "or run_sandboxed(..., drop_privileges=False)"
    )


@functools.lru_cache(maxsize=1)
def privilege_drop_available() -> bool:
    """Whether this process can run children under another uid (root with CAP_SETUID).

    Probed once with a throwaway child, since containers may run as root without the capability.
    """
    if os.geteuid() != 0:
        return False
    try:
        sandbox_python(True)
        uid = pick_uid()
    except RuntimeError:
        return False
    probe = f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid})"
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    return r.returncode == 0


def _mapped(uid: int) -> bool:
    try:
        lines = Path("/proc/self/uid_map").read_text().splitlines()
    except OSError:
        return True
    for line in lines:
        inside, _, count = (int(x) for x in line.split())
        if inside <= uid < inside + count:
            return True
    return False


def pick_uid() -> int:
    """A random uid no process currently runs as (a uid per run: exact NPROC and kill-by-uid)."""
    rng = random.SystemRandom()
    in_use = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                in_use.add(os.stat(f"/proc/{name}").st_uid)
            except OSError:
                continue
    for _ in range(100):
        uid = rng.randrange(*_UID_RANGE)
        if uid not in in_use and _mapped(uid):
            return uid
    if _mapped(65534):
        return 65534  # nobody: shared with other runs, still unprivileged
    raise RuntimeError("no unprivileged uid is mapped in this user namespace")


def tasks_of_current_user() -> int:
    """Threads owned by our real uid (what ``RLIMIT_NPROC`` counts against)."""
    uid = os.getuid()
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                lines = {ln.split(b":")[0]: ln for ln in f}
            if int(lines[b"Uid"].split()[1]) == uid:
                n += int(lines[b"Threads"].split()[1])
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return n
