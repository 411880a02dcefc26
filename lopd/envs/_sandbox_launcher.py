"""Trusted half of the sandbox: confines and supervises untrusted Python runs.

Run by :mod:`lopd.envs.sandbox` as ``python -I -S _sandbox_launcher.py CONFIG`` (stdlib only, no
site-packages) in a new session, with pipes on its stdin and stdout. It makes itself
non-dumpable (a process of the same uid can then neither ptrace it, nor open its
``/proc/PID/fd``, ``environ`` or ``mem``, nor take its descriptors with ``pidfd_getfd``) and a
child subreaper (every orphaned descendant is re-parented here and can be killed), then executes
the configured runs one after the other. For each run it

1. forks a child that redirects stdin/stdout/stderr to per-run files outside the work dir and,
   when configured, enters new namespaces: mount, network, pid (and, when not root, a user
   namespace mapping only the caller's own uid). In them the root is a new read-only tmpfs
   holding only the interpreter's files, bound read-only with site directories masked (the
   layout computed by ``_sandbox_layout.py``), and one capped scratch tmpfs for ``/tmp``,
   ``/var/tmp``, ``/dev/shm`` and a fresh copy of the work dir; the host's tree is detached
   (``pivot_root``); there is no network; and a private ``/proc`` (``hidepid=invisible``) shows
   only the run's own processes;
2. with a pid namespace, the child forks a small trusted init (pid 1 of the namespace, which
   reaps orphans and, when it exits, makes the kernel kill everything left in the namespace);
   the init (or, without one, the child itself) forks the program's process, which sets resource
   limits, drops to the unprivileged uid (root only) with no supplementary groups and
   ``no_new_privs``, closes every other descriptor and ``execve``\\ s the interpreter with the
   clean environment;
3. waits with a wall-clock timer, then SIGKILLs the run's process group and every remaining
   descendant (and, under a uid of its own, every process of that uid);
4. writes one JSON line on stdout (exit status, timeout flag, isolation achieved) and reads one
   line from stdin: ``next`` starts the next run, anything else (or EOF) stops.

The program never holds a descriptor of these pipes, and the reports carry no secret.

It must not import anything from ``lopd`` (it runs without site-packages).
"""

import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import stat
import struct
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_RDONLY = 1
MS_MOVE = 8192
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_MOUNT_SETATTR = 442  # same number on every architecture (added in Linux 5.12)
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
# pivot_root(2) has no libc wrapper and its number differs between architectures.
SYS_PIVOT_ROOT = {
    "x86_64": 155,
    "aarch64": 41,
    "riscv64": 41,
    "loongarch64": 41,
    "ppc64le": 203,
    "ppc64": 203,
    "s390x": 217,
    "i686": 217,
    "i386": 217,
    "armv7l": 218,
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _mount_setattr(path: str, recursive: bool, set_: int, clear: int) -> None:
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", set_, clear, 0, 0), 32)
    flags = AT_RECURSIVE if recursive else 0
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, attr, 32)
    _check(0 if ret == 0 else -1, f"mount_setattr {path}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces(cfg: dict) -> dict:
    """In the run's child: new namespaces and a minimal read-only root (see :func:`_build_root`).

    Returns:
        What was achieved (``private_tmp``, ``no_network``, ``read_only_root``, ``minimal_root``,
        ``disk_cap``, ``pid_namespace``, ``user_namespace``); all False when namespaces are not
        configured for this mode.

    Raises:
        OSError: a configured step failed (the run then does not start).
    """
    info = {
        "private_tmp": False,
        "no_network": False,
        "read_only_root": False,
        "minimal_root": False,
        "disk_cap": False,
        "pid_namespace": False,
        "user_namespace": False,
    }
    mode = cfg["namespaces"]
    if mode is None:
        return info
    flags = CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWNET if cfg["no_network"] else 0)
    if mode == "user":
        # The uid/gid maps are written through /proc/self, which a non-dumpable process cannot
        # open; nothing untrusted runs yet (the previous run's processes are all dead).
        uid, gid = os.getuid(), os.getgid()
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
        _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
        info["user_namespace"] = True
    else:
        _check(_libc.unshare(flags), "unshare")
    info["pid_namespace"] = True
    info["no_network"] = bool(cfg["no_network"])
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    _build_root(cfg, keep_host_proc=mode == "user")
    for key in ("private_tmp", "read_only_root", "minimal_root", "disk_cap"):
        info[key] = True
    return info


def _inside(path: str, tops) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _makedirs(path: str, mode: int = 0o755) -> None:
    """``mkdir -p`` inside the new root (every component is a directory made here)."""
    if not os.path.isdir(path):
        _makedirs(os.path.dirname(path), mode)
        os.mkdir(path, mode)


def _mirror(path: str, root: str, binds, depth: int = 0) -> None:
    """Recreate under ``root`` the directories and symlinks leading to host ``path``.

    A component that is a symlink on the host becomes the same symlink under ``root`` and the
    walk goes on at its target; it stops at a path that a bind will provide. Only directories
    made here are ever written into, never through a symlink.
    """
    if depth > 40:
        raise OSError(errno.ELOOP, f"too many symlinks resolving {path}")
    parts = [p for p in path.split("/") if p]
    cur = ""
    for i, comp in enumerate(parts):
        nxt = f"{cur}/{comp}"
        if _inside(nxt, binds):
            return
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(nxt)
            if not os.path.lexists(root + nxt):
                os.symlink(target, root + nxt)
            rest = "/".join(parts[i + 1 :])
            resolved = os.path.normpath(os.path.join(cur or "/", target))
            _mirror(f"{resolved}/{rest}" if rest else resolved, root, binds, depth + 1)
            return
        if i + 1 < len(parts) and not os.path.isdir(root + nxt):
            os.mkdir(root + nxt, 0o755)
        cur = nxt


def _bind(src: str, target: str, flags: int, attrs: int) -> None:
    """Bind ``src`` at ``target`` (a mount point made here) and set mount attributes on it."""
    if os.path.isdir(src):
        _makedirs(target)
    else:
        _makedirs(os.path.dirname(target))
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(src, target, None, MS_BIND | flags, None)
    _mount_setattr(target, bool(flags & MS_REC), attrs, 0)


def _copy_tree(src: str, dst: str, uid) -> None:
    """The run's initial files (trusted, written by the caller) into the private work dir."""
    for top, dirs, files in os.walk(src):
        rel = os.path.relpath(top, src)
        here = dst if rel == "." else os.path.join(dst, rel)
        for d in dirs:
            os.mkdir(os.path.join(here, d), 0o700)
        for name in files:
            with open(os.path.join(top, name), "rb") as fin:
                data = fin.read()
            fd = os.open(os.path.join(here, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as fout:
                fout.write(data)
    if uid is not None:
        for top, dirs, files in os.walk(dst):
            for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                os.chown(name, uid, uid)


def _pivot(root: str) -> None:
    """Make ``root`` the root and detach the host's tree from this mount namespace."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and _libc.syscall(number, b".", b".") == 0:
        # pivot_root(".", "."): the old root is stacked on the new one; detach it.
        _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    else:
        # No pivot_root (unknown architecture, or a root that is not a mount): move the new
        # root over "/" and chroot; the program has no capability to leave a chroot.
        _mount(".", "/", None, MS_MOVE, None)
        os.chroot(".")
    os.chdir("/")


def _build_root(cfg: dict, keep_host_proc: bool) -> None:
    """A root with only the interpreter's files (read-only) and one capped scratch tmpfs.

    ``cfg["root"]``: ``new_root`` / ``scratch`` (empty host dirs used as mount points),
    ``scratch_options`` (tmpfs ``size=...,nr_inodes=...``: the run's disk caps), ``layout``
    (from ``_sandbox_layout.root_layout``). The scratch tmpfs holds ``/tmp``, ``/var/tmp``,
    ``/dev/shm`` and the work dir (a copy of the caller's files), so those caps bound everything
    the program can write; the rest is read-only and holds no host file but the layout's.
    """
    rc = cfg["root"]
    root, scratch, layout = rc["new_root"], rc["scratch"], rc["layout"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, rc["scratch_options"] + ",mode=755")
    uid = cfg["uid"]
    for sub, target in (("tmp", "/tmp"), ("var_tmp", "/var/tmp"), ("dev_shm", "/dev/shm")):
        os.mkdir(f"{scratch}/{sub}")
        os.chmod(f"{scratch}/{sub}", 0o1777)
        _makedirs(root + target)
        _mount(f"{scratch}/{sub}", root + target, None, MS_BIND, None)
    os.mkdir(f"{scratch}/work", 0o700)
    _copy_tree(cfg["host_work"], f"{scratch}/work", uid)
    _makedirs(root + cfg["cwd"])
    _mount(f"{scratch}/work", root + cfg["cwd"], None, MS_BIND, None)
    binds = layout["binds"]
    for path in layout["mirror"] + binds:
        _mirror(path, root, binds)
    for path in binds:
        _bind(path, root + path, MS_REC, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    for path in layout["masks"]:
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        _mount("tmpfs", root + path, "tmpfs", flags, "size=4k,nr_inodes=2,mode=755")
    for dev in layout["devices"]:
        _bind(dev, root + dev, 0, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC)
    for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink(f"/proc/self/fd{target}", f"{root}/dev/{name}")
    _makedirs(root + "/proc")
    if keep_host_proc:
        # In a user namespace, procfs may be mounted only where one is already fully visible;
        # the run's init covers this one with its private /proc before the program starts.
        _mount("/proc", root + "/proc", None, MS_BIND | MS_REC, None)
    _mount_setattr(root, False, MOUNT_ATTR_RDONLY, 0)
    _pivot(root)


def _mount_private_proc() -> bool:
    """As pid 1 of the new pid namespace: a /proc that lists only this namespace's processes."""
    for options in ("hidepid=invisible", "hidepid=2", None):
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
            return True
        except OSError:
            continue
    return False


def _exec_program(cfg: dict, run: dict) -> None:
    """In the program's process: limits, uid drop, exec. Never returns."""
    try:
        lim = cfg["limits"]
        os.chdir(cfg["cwd"])
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_bytes"], lim["file_size_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
        uid = cfg["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        # Die with the parent even if it is SIGKILLed (set after setuid, which clears it).
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        os.closerange(3, 1 << 16)
        os.umask(0o077)
        os.execve(cfg["python"], [cfg["python"], "-I", "-B", *run["argv"]], cfg["env"])
    except BaseException as e:
        try:
            os.write(2, f"sandbox: could not start: {e!r}\n".encode())
        finally:
            os._exit(125)


def _init(cfg: dict, run: dict, status_fd: int) -> None:
    """Pid 1 of the run's pid namespace: start the program, reap, report its status. No return."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            # Init ignores default-action signals sent from inside its namespace: the program
            # cannot kill its init (and so lose its status) with kill(1, ...).
            signal.signal(sig, signal.SIG_DFL)
        private_proc = _mount_private_proc()
        os.write(status_fd, (json.dumps({"private_proc": private_proc}) + "\n").encode())
        pid = os.fork()
        if pid == 0:
            _exec_program(cfg, run)
        while True:
            got, status = os.wait()
            if got == pid:
                break
        code = os.waitstatus_to_exitcode(status)
        os.write(status_fd, (json.dumps({"returncode": code}) + "\n").encode())
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.write(2, f"sandbox: init failed: {e!r}\n".encode())
    os._exit(0)


def _run_child(cfg: dict, run: dict, status_fd: int) -> None:
    """In the forked child: redirect, confine, then exec (or start the init). Never returns."""
    try:
        os.setpgid(0, 0)
        fds = [
            os.open(run["stdin"], os.O_RDONLY),
            os.open(run["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            os.open(run["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        ]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        try:
            info = _enter_namespaces(cfg)
        except OSError as e:
            os.write(2, f"sandbox: namespace setup failed: {e}\n".encode())
            os._exit(125)
        os.write(status_fd, (json.dumps(info) + "\n").encode())
        if not info["pid_namespace"]:
            _exec_program(cfg, run)
        pid = os.fork()
        if pid == 0:
            _init(cfg, run, status_fd)
        os.close(status_fd)
        while True:
            try:
                got, _ = os.waitpid(pid, 0)
            except ChildProcessError:
                break
            if got == pid:
                break
        os._exit(0)
    except BaseException as e:
        try:
            os.write(2, f"sandbox: could not start: {e!r}\n".encode())
        finally:
            os._exit(125)


def _children_of(pid: int) -> list:
    """Live (not zombie) children of ``pid``."""
    kids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces or parentheses: fields resume after the last ')'.
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != b"Z":
            kids.append(int(name))
    return kids


def _pids_of_uid(uid: int) -> list:
    # The real uid from /proc/PID/status: the /proc/PID owner reads as root for non-dumpable ones.
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:") and line.split()[1] == b"Z":
                        break  # dead already; reaped by whoever is its parent
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except OSError:
            continue
    return pids


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_all(child_pgid: int, uid) -> int:
    """SIGKILL the child's group and every descendant until none is left.

    Returns:
        How many distinct processes were left over and killed.
    """
    killed = set()
    with contextlib.suppress(OSError):
        os.killpg(child_pgid, signal.SIGKILL)
    me = os.getpid()
    for _ in range(1000):
        victims = set(_children_of(me))
        if uid is not None:
            victims.update(_pids_of_uid(uid))
        victims.discard(me)
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.002)
        _reap()
    _reap()
    return len(killed)


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _one_run(cfg: dict, run: dict) -> dict:
    status_r, status_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        _run_child(cfg, run, status_w)
    os.close(status_w)
    timed_out = False
    status = None
    signal.setitimer(signal.ITIMER_REAL, run["wall_time_s"])
    try:
        _, status = os.waitpid(pid, 0)
    except _Timeout:
        timed_out = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if status is None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped just as the timer fired
            status = signal.SIGKILL
    wall = time.monotonic() - t0
    killed = _kill_all(pid, cfg["uid"] if cfg["own_uid"] else None)
    # Every writer of the status pipe is dead now: reading to EOF cannot block.
    info: dict = {"private_proc": False}
    returncode = os.waitstatus_to_exitcode(status)
    for line in _read_all(status_r).splitlines():
        with contextlib.suppress(ValueError):
            info.update(json.loads(line))
    os.close(status_r)
    if info.pop("pid_namespace", False):
        # The child only waited for the init; the program's status came through the pipe.
        returncode = info.pop("returncode", -signal.SIGKILL)
    info.pop("returncode", None)
    return {
        "returncode": returncode,
        "timed_out": timed_out,
        "wall_time_s": wall,
        "stray_processes_killed": killed,
        "isolation": info,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    signal.signal(signal.SIGALRM, _on_alarm)
    for i, run in enumerate(cfg["runs"]):
        report = _one_run(cfg, run)
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
        if i + 1 < len(cfg["runs"]) and sys.stdin.readline().strip() != "next":
            break


if __name__ == "__main__":
    main()
