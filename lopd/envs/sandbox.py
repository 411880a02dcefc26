"""A subprocess sandbox for untrusted Python (model-written solutions).

:func:`run_sandboxed` runs ``python -I -B <argv>`` in a fresh temporary work dir under a trusted
supervisor (``_sandbox_launcher.py``) that:

* starts it in its own session and process group, as a child subreaper, and on wall-clock timeout
  (or normal exit) SIGKILLs the group and every remaining descendant, including ones that called
  ``setsid()`` or double-forked;
* sets ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (file
  size), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0`` and ``RLIMIT_NPROC`` (fork-bomb defence);
* passes a clean environment (``PATH``, ``HOME``/``TMPDIR`` = the work dir, ``LANG``): nothing
  of the caller's environment (tokens, keys) is inherited, and ``-I`` ignores ``PYTHON*``
  variables and the user site dir;
* captures stdout/stderr in files outside the work dir (capped by ``RLIMIT_FSIZE``).

When the caller is root (the usual container), the run is further confined:

* it executes under a fresh, otherwise unused uid/gid (no supplementary groups,
  ``no_new_privs``). ``RLIMIT_NPROC`` counts processes per *real uid* and is ignored for root, so
  a uid of its own is what makes the process cap exact and lets the supervisor kill every process
  of that uid afterwards. The uid cannot write anything owned by root (the repo, ``$HOME``, other
  work dirs: they are mode 0700) nor read other processes' ``/proc/PID/environ``;
* it runs in new mount and network namespaces: ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (the
  world-writable places) are replaced by empty private tmpfs mounts, with only the work dir bound
  back, and there is no network (not even loopback).

What is **not** prevented: reading world-readable files (the Python stdlib, ``/etc/passwd``, the
repo if it is world-readable), CPU contention with the host (the CPU limit bounds the total), and,
when not root, writes to any place the calling user can write besides ``/tmp``-style dirs being
private (no namespaces without root). This is process-level hygiene for RL on model-written code,
not a security boundary against a determined attacker: use a container or VM for that.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
_MASKED_DIRS = ["/tmp", "/var/tmp", "/dev/shm"]
_UID_RANGE = (1_000_000, 2_000_000)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        wall_time_s: wall-clock seconds before the whole process tree is killed.
        cpu_time_s: CPU seconds per process (``RLIMIT_CPU``; SIGXCPU then SIGKILL).
        memory_bytes: address-space cap per process (``RLIMIT_AS``).
        file_size_bytes: largest file (and captured stdout/stderr) the run may write.
        max_processes: processes/threads the run may have at once (``RLIMIT_NPROC``).
        open_files: file descriptors per process (``RLIMIT_NOFILE``).
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 32
    open_files: int = 64

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_bytes", "file_size_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.max_processes < 1:
            raise ValueError(f"SandboxLimits.max_processes must be >= 1, got {self.max_processes}")
        if self.open_files < 8:
            raise ValueError(f"SandboxLimits.open_files must be >= 8, got {self.open_files}")


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: exit code, or ``-signal`` if killed by a signal (``125``: could not start).
        stdout: captured standard output (UTF-8, undecodable bytes replaced).
        stderr: captured standard error.
        timed_out: the wall-clock limit was hit.
        wall_time_s: seconds from start to exit/kill of the main process.
        isolation: what confinement was actually in effect (``uid``, ``private_tmp``,
            ``no_network``), plus ``stray_processes_killed``.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_time_s: float
    isolation: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Exited with status 0 within the time limit."""
        return self.returncode == 0 and not self.timed_out


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

    Without privilege dropping this is ``sys.executable``. When the run drops to an unprivileged
    uid, that uid must be able to execute the interpreter: ``sys.executable`` if its path is open
    to others, else the first of ``python3`` on ``PATH``, ``/usr/bin/python3``,
    ``/usr/local/bin/python3`` that is (a pyenv/conda interpreter under ``/root`` is not).
    Sandboxed code needs only the standard library.

    Raises:
        RuntimeError: no interpreter usable by an unprivileged uid was found.
    """
    if unprivileged is None:
        unprivileged = os.geteuid() == 0
    if not unprivileged:
        return sys.executable
    candidates = [
        sys.executable,
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
def _privilege_drop_available() -> bool:
    """Whether this process can run children under another uid (root with CAP_SETUID).

    Probed once with a throwaway child, since containers may run as root without the capability.
    """
    if os.geteuid() != 0:
        return False
    try:
        sandbox_python(True)
        uid = _pick_uid()
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


def _pick_uid() -> int:
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


def _tasks_of_current_user() -> int:
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


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _read_capped(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def run_sandboxed(
    argv: list[str],
    files: dict[str, str | bytes] | None = None,
    stdin: str | bytes = "",
    limits: SandboxLimits | None = None,
    *,
    python: str | None = None,
    drop_privileges: bool | None = None,
    isolate: bool = True,
    no_network: bool = True,
) -> SandboxResult:
    """Run ``python -I -B *argv`` confined, in a fresh work dir holding ``files``.

    Args:
        argv: interpreter arguments, e.g. ``["main.py"]`` (paths relative to the work dir).
        files: relative path -> content, written into the work dir before the run.
        stdin: the program's standard input.
        limits: resource limits (defaults: 10 s wall, 10 s CPU, 1 GiB, 32 processes).
        python: interpreter path (default: :func:`sandbox_python`).
        drop_privileges: run under a fresh unprivileged uid; default: when running as root and
            the uid switch works (probed once; a warning is issued if root cannot switch).
        isolate: with dropped privileges, also use private ``/tmp``-style mounts and, if
            ``no_network``, a network namespace without interfaces (when the kernel allows).
        no_network: see ``isolate``.

    Returns:
        The :class:`SandboxResult`.

    Raises:
        ValueError: a file path escaping the work dir.
        RuntimeError: the supervisor itself failed (not the sandboxed program).
    """
    limits = limits or SandboxLimits()
    if drop_privileges is None:
        drop_privileges = _privilege_drop_available()
        if not drop_privileges and os.geteuid() == 0:
            _warn_once(
                "lopd sandbox: running as root but cannot switch to an unprivileged uid "
                "(no CAP_SETUID, or no interpreter readable by other users): sandboxed code runs "
                "as root without a process cap; see lopd.envs.sandbox"
            )
    if drop_privileges and os.geteuid() != 0:
        raise ValueError("drop_privileges=True needs root (euid 0)")
    python = python or sandbox_python(drop_privileges)
    uid = _pick_uid() if drop_privileges else None
    # Without a uid of our own, RLIMIT_NPROC counts every process of the calling user: allow the
    # current count plus the budget, so the run may start max_processes processes.
    nproc = (
        limits.max_processes if uid is not None else _tasks_of_current_user() + limits.max_processes
    )

    base = Path(tempfile.mkdtemp(prefix="lopd-sbx-"))
    try:
        # base: traversable but not listable; io/: supervisor only; work/: the sandboxed uid's.
        os.chmod(base, 0o711)
        work, io = base / "work", base / "io"
        work.mkdir(mode=0o700)
        io.mkdir(mode=0o700)
        for rel, content in (files or {}).items():
            target = (work / rel).resolve()
            if not target.is_relative_to(work.resolve()):
                raise ValueError(f"files: path {rel!r} escapes the work dir")
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content, encoding="utf-8")
        if uid is not None:
            for p in [work, *work.rglob("*")]:
                os.chown(p, uid, uid)
        (io / "stdin").write_bytes(stdin.encode() if isinstance(stdin, str) else stdin)
        cfg = {
            "python": python,
            "argv": ["-I", "-B", *argv],
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": str(work),
                "TMPDIR": str(work),
                "LANG": "C.UTF-8",
            },
            "cwd": str(work),
            "stdin": str(io / "stdin"),
            "stdout": str(io / "stdout"),
            "stderr": str(io / "stderr"),
            "report": str(io / "report.json"),
            "isolation_report": str(io / "isolation.json"),
            "uid": uid,
            "own_uid": uid is not None and uid != 65534,
            "isolate": isolate,
            "no_network": no_network,
            "masked_dirs": _MASKED_DIRS,
            "wall_time_s": limits.wall_time_s,
            "limits": {
                "cpu_s": limits.cpu_time_s,
                "memory_bytes": limits.memory_bytes,
                "file_size_bytes": limits.file_size_bytes,
                "open_files": limits.open_files,
                "nproc": nproc,
            },
        }
        (io / "config.json").write_text(json.dumps(cfg))
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_LAUNCHER), str(io / "config.json")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=limits.wall_time_s + 30)
        except subprocess.TimeoutExpired:
            # Backstop only: the supervisor enforces the wall clock itself.
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise RuntimeError("sandbox supervisor did not finish; killed it") from None
        if proc.returncode != 0 or not (io / "report.json").exists():
            msg = err.decode(errors="replace")[-2000:]
            raise RuntimeError(f"sandbox supervisor failed (exit {proc.returncode}): {msg}")
        report = json.loads((io / "report.json").read_text())
        isolation: dict[str, Any] = {"uid": uid, "private_tmp": False, "no_network": False}
        if (io / "isolation.json").exists():
            isolation.update(json.loads((io / "isolation.json").read_text()))
        isolation["stray_processes_killed"] = report["stray_processes_killed"]
        cap = limits.file_size_bytes
        return SandboxResult(
            returncode=report["returncode"],
            stdout=_read_capped(io / "stdout", cap),
            stderr=_read_capped(io / "stderr", cap),
            timed_out=report["timed_out"],
            wall_time_s=report["wall_time_s"],
            isolation=isolation,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_python(
    code: str, stdin: str = "", limits: SandboxLimits | None = None, **kw: Any
) -> SandboxResult:
    """Run a Python program text in the sandbox (``main.py`` in the work dir).

    Args:
        code: program source.
        stdin: its standard input.
        limits: resource limits.
        **kw: forwarded to :func:`run_sandboxed`.

    Returns:
        The :class:`SandboxResult`.
    """
    return run_sandboxed(["main.py"], {"main.py": code}, stdin, limits, **kw)
