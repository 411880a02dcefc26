"""Trusted half of the sandbox: confines and supervises one untrusted Python run.

Run by :func:`lopd.envs.sandbox.run_sandboxed` as ``python -I -S _sandbox_launcher.py CONFIG``
(stdlib only, no site-packages) in a new session. It

1. makes itself a child subreaper, so every descendant of the untrusted process that loses its
   parent (double fork, ``setsid``) is re-parented here and can be killed;
2. forks the untrusted child, which: redirects stdin/stdout/stderr to files outside the sandbox,
   enters new mount and network namespaces when allowed (private empty ``/tmp``, ``/var/tmp``,
   ``/dev/shm`` with the work dir bind-mounted back; no network), sets resource limits, drops to an
   unprivileged uid with no supplementary groups and ``no_new_privs``, and ``execve``s the
   interpreter with the clean environment;
3. waits with a wall-clock timer, then SIGKILLs the child's process group and every remaining
   descendant (and, when it ran under a uid of its own, every process of that uid);
4. writes a JSON report (exit status, timeout flag, isolation actually achieved).

It must not import anything from ``lopd`` (it runs without site-packages).
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _private_namespaces(cwd: str, masked: list, want_net: bool) -> dict:
    """Best effort: fresh mount (+ network) namespace, empty tmpfs over world-writable dirs."""
    flags = CLONE_NEWNS | (CLONE_NEWNET if want_net else 0)
    if _libc.unshare(flags) != 0:
        return {"private_tmp": False, "no_network": False}
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    cwd_fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY)
    for d in masked:
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
            if cwd.startswith(d.rstrip("/") + "/"):
                # The work dir lived under the masked dir: bind the original back at its path.
                os.makedirs(cwd, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{cwd_fd}", cwd, None, MS_BIND, None)
    os.close(cwd_fd)
    return {"private_tmp": True, "no_network": want_net}


def _children_of(pid: int) -> list:
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
        if int(fields[1]) == pid:
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


def _run_child(cfg: dict) -> None:
    """In the forked child: confine, then exec. Never returns."""
    try:
        os.setpgid(0, 0)
        fds = [
            os.open(cfg["stdin"], os.O_RDONLY),
            os.open(cfg["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            os.open(cfg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        ]
        # Opened before the namespace setup: io/ may live under a dir that gets masked.
        report_fd = os.open(cfg["isolation_report"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        info = {"private_tmp": False, "no_network": False}
        uid = cfg["uid"]
        if uid is not None and cfg["isolate"]:
            try:
                info = _private_namespaces(cfg["cwd"], cfg["masked_dirs"], cfg["no_network"])
            except OSError as e:
                os.write(2, f"sandbox: namespace setup failed: {e}\n".encode())
                os._exit(125)
        os.write(report_fd, json.dumps(info).encode())
        os.closerange(3, 1 << 16)
        os.chdir(cfg["cwd"])
        lim = cfg["limits"]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_bytes"], lim["file_size_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        # Die with the launcher even if it is SIGKILLed (set after setuid, which clears it).
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        os.umask(0o077)
        os.execve(cfg["python"], [cfg["python"], *cfg["argv"]], cfg["env"])
    except BaseException as e:
        try:
            os.write(2, f"sandbox: could not start: {e!r}\n".encode())
        finally:
            os._exit(125)


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _run_child(cfg)
    timed_out = False
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, cfg["wall_time_s"])
    try:
        _, status = os.waitpid(pid, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        timed_out = True
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    wall = time.monotonic() - t0
    killed = _kill_all(pid, cfg["uid"] if cfg["own_uid"] else None)
    report = {
        "returncode": os.waitstatus_to_exitcode(status),
        "timed_out": timed_out,
        "wall_time_s": wall,
        "stray_processes_killed": killed,
    }
    with open(cfg["report"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
