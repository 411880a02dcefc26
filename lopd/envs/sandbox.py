"""A subprocess sandbox for untrusted Python (model-written solutions).

:func:`run_sandboxed` runs ``python -I -B <argv>`` (and :func:`run_sequence` several such runs
one after the other) in a fresh temporary work dir under a trusted supervisor
(``_sandbox_launcher.py``, a separate non-dumpable process). It

* starts each run in its own session and process group, as a child subreaper, and on wall-clock
  timeout (or normal exit) SIGKILLs the group and every remaining descendant, including ones that
  called ``setsid()`` or double-forked;
* sets ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (file
  size), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0`` and ``RLIMIT_NPROC`` (fork-bomb defence);
* passes a clean environment (``PATH``, ``HOME``/``TMPDIR`` = the work dir, ``LANG``): nothing
  of the caller's environment (tokens, keys) is inherited, and ``-I`` ignores ``PYTHON*``
  variables and the user site dir;
* captures stdout/stderr in files outside the work dir (capped by ``RLIMIT_FSIZE``); the program
  inherits no other descriptor, and its argv and environment hold no secret.

Three modes, picked automatically (``SandboxResult.isolation`` says which one a run got):

* **root** (the usual container; root with ``CAP_SETUID``): the program runs under a fresh,
  otherwise unused uid/gid (no supplementary groups, ``no_new_privs``), in new mount, network
  and pid namespaces. ``RLIMIT_NPROC`` counts processes per real uid and is ignored for root, so a
  uid of its own is what makes the process cap exact and lets the supervisor kill every process
  of that uid afterwards.
* **user namespace** (not root, and the kernel allows unprivileged user namespaces): the same
  namespaces inside a new user namespace that maps only the caller's uid; the program keeps the
  caller's uid and has no capabilities.
* **plain** (not root and no user namespaces, or ``isolate=False``): limits, clean environment
  and the process-tree kill only. A warning is issued once when the namespaces do not work here.
  (Root that cannot switch uid, or ``drop_privileges=False``, runs the program *as root* without
  namespaces or a process cap: only the limits, the clean environment and the tree kill hold; a
  warning is issued once when root cannot switch uid.)

In both namespace modes the program's root is a new read-only file system (``pivot_root``; the
host's tree is detached) holding only the interpreter's own files, every ``site-packages``
masked (:mod:`lopd.envs._sandbox_layout`): no installed package or benchmark data, no ``$HOME``,
``/etc``, ``/run`` or host UNIX socket, wherever the venv lives. The work dir (a private copy of
``files``; each run of a :func:`run_sequence` starts from it), ``/tmp``, ``/var/tmp`` and
``/dev/shm`` are one tmpfs per run, capped at ``SandboxLimits.disk_bytes`` and ``max_files`` in
total: nothing reaches the host's disk. There is no network (loopback and abstract UNIX sockets
included), and ``/proc`` is a private procfs of the run's pid namespace (``hidepid=invisible``)
listing the run's own processes only, so the caller, the trainer and the supervisor have no pid
the program could read, signal, ptrace or ``pidfd_open``; the namespace's trusted init takes
down whatever the program left. The supervisor is non-dumpable in every mode (a same-uid program
can neither ptrace it nor take its descriptors), and in every mode the run's host directory is
removed by :func:`~lopd.envs._tree_removal.remove_tree` (any depth, any modes). Details and
measured figures: ``docs/sandbox.md``.

What each mode contains ("yes" = prevented; every row is checked in
``tests/envs/test_sandbox_containment.py``, ``tests/envs/test_sandbox.py`` or
``tests/envs/test_sandbox_host.py``):

==============================================================  ====  ==============  =====
the program tries to ...                                         root  user namespace  plain
==============================================================  ====  ==============  =====
run forever, exhaust memory, fork-bomb, leave orphans            yes   yes             yes
read environment variables of the caller (inherited)             yes   yes             yes
read the caller's ``/proc/PID/environ`` or ``cmdline``           yes   yes             no
signal the caller or take its descriptors (``pidfd_getfd``)      yes   yes             no [1]
take the supervisor's descriptors                                yes   yes             yes
write outside the work dir (repo, ``$HOME``, checkpoints)        yes   yes             no
see the host's ``/tmp`` (other runs' files)                      yes   yes             no
read host files: installed packages and their data, ``/etc``,    yes   yes             no
``$HOME``, the repository
connect to a filesystem UNIX socket of the host (``/run/...``)   yes   yes             no
use the network (loopback and abstract UNIX sockets included)    yes   yes             no
start more than ``max_processes`` processes                      yes   no [2]          no [2]
write more than ``disk_bytes`` / ``max_files`` in total          yes   yes             no [3]
leave a tree on the host disk (deep, ``chmod 000``)              yes   yes             yes
read the standard library and the interpreter's libraries        no    no              no
==============================================================  ====  ==============  =====

[1] in plain mode the program runs as the caller's uid: it can signal and (without
``kernel.yama.ptrace_scope`` >= 1) ptrace every process of that uid, the trainer included, and
so read or alter anything in it, rewards too. Use root or user namespaces for RL.
[2] ``RLIMIT_NPROC`` counts all processes of the caller's uid; the cap is set to their current
count plus the budget, so concurrent runs share it. [3] plain mode writes to a directory on the
host's disk: only each file is capped (``RLIMIT_FSIZE``); the directory is removed after the run.

The scratch tmpfs is memory: a run may hold ``disk_bytes`` there besides ``memory_bytes``.
CPU contention with the host is not prevented (the CPU limit bounds the total). This is
process-level hygiene for RL on model-written code, not a security boundary against a
determined attacker with a kernel exploit: use a container or VM for that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopd.envs import _sandbox_layout
from lopd.envs._sandbox_identity import (
    pick_uid,
    privilege_drop_available,
    sandbox_python,
    tasks_of_current_user,
)
from lopd.envs._tree_removal import remove_tree

_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
_PAGE = 4096


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
        disk_bytes: bytes the run may write in total, in the work dir, ``/tmp``, ``/var/tmp``
            and ``/dev/shm`` together (namespace modes; one tmpfs, ``ENOSPC`` past it). The
            caller's ``files`` come on top.
        max_files: files and directories the run may create there in total (the tmpfs's
            inode count; the caller's ``files`` come on top).
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 32
    open_files: int = 64
    disk_bytes: int = 32 << 20
    max_files: int = 10_000

    def __post_init__(self) -> None:
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_bytes",
            "file_size_bytes",
            "disk_bytes",
            "max_files",
        ):
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
        isolation: what confinement was actually in effect: ``uid`` (``None``: the caller's),
            ``user_namespace``, ``private_tmp``, ``read_only_root``, ``minimal_root`` (the
            interpreter's files only), ``disk_cap`` (``disk_bytes`` / ``max_files`` hold),
            ``no_network``, ``private_proc``, plus ``stray_processes_killed``.
        stdout_truncated: stdout reached ``SandboxLimits.file_size_bytes`` (the program could
            not write more; ``stdout`` holds the first ``file_size_bytes``).
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_time_s: float
    isolation: dict[str, Any] = field(default_factory=dict)
    stdout_truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exited with status 0 within the time limit."""
        return self.returncode == 0 and not self.timed_out


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
    **kw: Any,
) -> SandboxResult:
    """Run ``python -I -B *argv`` confined, in a fresh work dir holding ``files``.

    Args:
        argv: interpreter arguments, e.g. ``["main.py"]`` (paths relative to the work dir).
        files: relative path -> content, written into the work dir before the run.
        stdin: the program's standard input.
        limits: resource limits (defaults: 10 s wall, 10 s CPU, 1 GiB, 32 processes).
        **kw: ``python``, ``drop_privileges``, ``isolate``, ``no_network``: see
            :func:`run_sequence`.

    Returns:
        The :class:`SandboxResult`.

    Raises:
        ValueError: a file path escaping the work dir.
        RuntimeError: the supervisor itself failed (not the sandboxed program).
    """
    return run_sequence([(argv, stdin)], files, limits, **kw)[0]


def run_sequence(
    runs: Sequence[tuple[Sequence[str], str | bytes]],
    files: dict[str, str | bytes] | None = None,
    limits: SandboxLimits | None = None,
    *,
    keep_going: Callable[[int, SandboxResult], bool] | None = None,
    python: str | None = None,
    drop_privileges: bool | None = None,
    isolate: bool = True,
    no_network: bool = True,
) -> list[SandboxResult]:
    """Several confined runs, one after the other, sharing one work dir and one supervisor.

    Each run is a fresh ``python -I -B *argv`` process with its own stdin, wall clock and
    namespaces; nothing it started survives into the next run. This is how a program is run
    once per test without paying the supervisor's start-up per test.

    Args:
        runs: ``(argv, stdin)`` per run.
        files: relative path -> content, written into the work dir before the first run.
        limits: resource limits of every run (``wall_time_s`` is per run).
        keep_going: called with ``(index, result)`` after each run (the last one too);
            ``False`` skips the remaining runs.
        python: interpreter path (default: :func:`sandbox_python`).
        drop_privileges: run under a fresh unprivileged uid; default: when running as root and
            the uid switch works (probed once; a warning is issued if root cannot switch).
        isolate: use the namespaces of the root / user-namespace modes (module docstring) when
            they work here (probed once per mode).
        no_network: with ``isolate``, also a network namespace without interfaces.

    Returns:
        One :class:`SandboxResult` per run that was started.

    Raises:
        ValueError: a file path escaping the work dir, or no runs.
        RuntimeError: the supervisor itself failed (not the sandboxed program).
    """
    if not runs:
        raise ValueError("runs must not be empty")
    limits = limits or SandboxLimits()
    root = os.geteuid() == 0
    if drop_privileges is None:
        drop_privileges = privilege_drop_available()
        if not drop_privileges and root:
            _warn_once(
                "lopd sandbox: running as root but cannot switch to an unprivileged uid "
                "(no CAP_SETUID, or no interpreter readable by other users): sandboxed code runs "
                "as root without a process cap; see lopd.envs.sandbox"
            )
    if drop_privileges and not root:
        raise ValueError("drop_privileges=True needs root (euid 0)")
    namespaces = None
    if isolate and (drop_privileges or not root):
        mode = "root" if root else "user"
        if _namespaces_work(mode, no_network):
            namespaces = mode
        elif not root:
            _warn_once(
                "lopd sandbox: not root and no unprivileged user namespaces: sandboxed code runs "
                "with your uid and can see, signal and write to what you can; see "
                "lopd.envs.sandbox"
            )
        else:
            _warn_once(
                "lopd sandbox: mount/pid/network namespaces do not work here: sandboxed code "
                "sees the host's files (installed packages included) and network; see "
                "lopd.envs.sandbox"
            )
    python = python or sandbox_python(drop_privileges)
    uid = pick_uid() if drop_privileges else None
    return _launch(runs, files, limits, keep_going, python, uid, namespaces, no_network)


def _launch(
    runs: Sequence[tuple[Sequence[str], str | bytes]],
    files: dict[str, str | bytes] | None,
    limits: SandboxLimits,
    keep_going: Callable[[int, SandboxResult], bool] | None,
    python: str,
    uid: int | None,
    namespaces: str | None,
    no_network: bool,
) -> list[SandboxResult]:
    # Without a uid of our own, RLIMIT_NPROC counts every process of the calling user: allow the
    # current count plus the budget, so the run may start max_processes processes.
    nproc = (
        limits.max_processes if uid is not None else tasks_of_current_user() + limits.max_processes
    )
    layout = _sandbox_layout.root_layout(python) if namespaces else None
    base = Path(tempfile.mkdtemp(prefix="lopd-sbx-")).resolve()
    try:
        # base: traversable but not listable; io/: supervisor only; work/: the sandboxed uid's
        # (in the namespace modes the caller's copy, which the program never sees: it gets a
        # private copy on its own tmpfs); root/, scratch/: mount points in the run's namespace.
        os.chmod(base, 0o711)
        work, io = base / "work", base / "io"
        work.mkdir(mode=0o700)
        io.mkdir(mode=0o700)
        initial_bytes, initial_inodes, initial_dirs = 0, 0, set()
        for rel, content in (files or {}).items():
            target = (work / rel).resolve()
            if not target.is_relative_to(work.resolve()):
                raise ValueError(f"files: path {rel!r} escapes the work dir")
            target.parent.mkdir(parents=True, exist_ok=True)
            data = (
                content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass")
            )
            target.write_bytes(data)
            initial_bytes += -(-len(data) // _PAGE) * _PAGE
            initial_inodes += 1
            initial_dirs.update(target.relative_to(work.resolve()).parents)
        if uid is not None and namespaces is None:
            for p in [work, *work.rglob("*")]:
                os.chown(p, uid, uid)
        root_cfg = None
        if layout is not None:
            (base / "root").mkdir(mode=0o700)
            (base / "scratch").mkdir(mode=0o700)
            # The caller's files, the tmpfs's own directories (its root, /tmp, /var/tmp,
            # /dev/shm, the work dir and at most its parents) and page rounding come on top.
            size = limits.disk_bytes + initial_bytes + 64 * _PAGE
            own_dirs = 5 + len(work.parts)
            inodes = limits.max_files + initial_inodes + len(initial_dirs - {Path(".")}) + own_dirs
            root_cfg = {
                "new_root": str(base / "root"),
                "scratch": str(base / "scratch"),
                "scratch_options": f"size={size},nr_inodes={inodes}",
                "layout": layout,
            }
        run_cfgs = []
        for i, (argv, stdin) in enumerate(runs):
            data = (
                stdin.encode("utf-8", errors="surrogatepass") if isinstance(stdin, str) else stdin
            )
            (io / f"stdin{i}").write_bytes(data)
            run_cfgs.append(
                {
                    "argv": [str(a) for a in argv],
                    "stdin": str(io / f"stdin{i}"),
                    "stdout": str(io / f"stdout{i}"),
                    "stderr": str(io / f"stderr{i}"),
                    "wall_time_s": limits.wall_time_s,
                }
            )
        cfg = {
            "python": python,
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": str(work),
                "TMPDIR": str(work),
                "LANG": "C.UTF-8",
            },
            "cwd": str(work),
            "host_work": str(work),
            "root": root_cfg,
            "uid": uid,
            "own_uid": uid is not None and uid != 65534,
            "namespaces": namespaces,
            "no_network": no_network,
            "limits": {
                "cpu_s": limits.cpu_time_s,
                "memory_bytes": limits.memory_bytes,
                "file_size_bytes": limits.file_size_bytes,
                "open_files": limits.open_files,
                "nproc": nproc,
            },
            "runs": run_cfgs,
        }
        (io / "config.json").write_text(json.dumps(cfg))
        with open(io / "supervisor.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_LAUNCHER), str(io / "config.json")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,
            )
        try:
            results = _supervise(proc, io, limits, len(run_cfgs), uid, keep_going)
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
        return results
    finally:
        _remove_run_dir(base)


def _remove_run_dir(base: Path) -> None:
    """Remove a run's directory whatever the program left in it (never raises: a leftover is a
    warning, not a failed run)."""
    try:
        remove_tree(base)
    except OSError as e:
        _warn_once(f"lopd sandbox: could not remove the run directory {base}: {e}")


def _supervise(
    proc: subprocess.Popen,
    io: Path,
    limits: SandboxLimits,
    n: int,
    uid: int | None,
    keep_going: Callable[[int, SandboxResult], bool] | None,
) -> list[SandboxResult]:
    """Read one report line per run from the supervisor; answer ``next`` or ``stop``."""
    assert proc.stdin is not None and proc.stdout is not None
    results: list[SandboxResult] = []
    cap = limits.file_size_bytes
    for i in range(n):
        # Backstop only: the supervisor enforces the wall clock itself.
        ready, _, _ = select.select([proc.stdout], [], [], limits.wall_time_s + 30)
        line = proc.stdout.readline() if ready else b""
        if not line:
            if not ready:
                raise RuntimeError("sandbox supervisor did not finish; killed it")
            proc.wait()
            log = (io / "supervisor.log").read_bytes()[-2000:].decode(errors="replace")
            raise RuntimeError(f"sandbox supervisor failed (exit {proc.returncode}): {log}")
        report = json.loads(line)
        isolation: dict[str, Any] = {"uid": uid, **report["isolation"]}
        isolation["stray_processes_killed"] = report["stray_processes_killed"]
        out_path, err_path = io / f"stdout{i}", io / f"stderr{i}"
        result = SandboxResult(
            returncode=report["returncode"],
            stdout=_read_capped(out_path, cap),
            stderr=_read_capped(err_path, cap),
            timed_out=report["timed_out"],
            wall_time_s=report["wall_time_s"],
            isolation=isolation,
            stdout_truncated=_size(out_path) >= cap,
        )
        results.append(result)
        go = keep_going is None or keep_going(i, result)
        if i + 1 == n:
            break
        proc.stdin.write(b"next\n" if go else b"stop\n")
        proc.stdin.flush()
        if not go:
            break
    return results


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@functools.cache
def _namespaces_work(mode: str, no_network: bool) -> bool:
    """Whether the namespace mode ``"root"`` / ``"user"`` sets up here (probed once per mode).

    A throwaway run (``pass``) with the full setup: unprivileged user namespaces may be disabled
    (sysctl, AppArmor) and containers may lack ``CAP_SYS_ADMIN``.
    """
    try:
        python = sandbox_python(mode == "root")
        uid = pick_uid() if mode == "root" else None
        probe = SandboxLimits(wall_time_s=30, cpu_time_s=10)
        r = _launch([(["-c", "pass"], "")], None, probe, None, python, uid, mode, no_network)[0]
    except (RuntimeError, OSError):
        return False
    return r.returncode == 0 and bool(
        r.isolation.get("private_proc") and r.isolation.get("minimal_root")
    )


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
