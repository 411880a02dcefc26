"""The subprocess sandbox against hostile programs (real subprocesses, no mocks)."""

from __future__ import annotations

import ast
import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

import lopd
from lopd.envs.sandbox import SandboxLimits, run_python, run_sandboxed

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not ROOT, reason="uid switching and mount/network namespaces need root (euid 0)"
)
FAST = SandboxLimits(wall_time_s=1.5, cpu_time_s=5)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_runs_program_with_stdin_and_files():
    r = run_sandboxed(
        ["main.py", "arg"],
        {
            "main.py": "import sys\nprint(input().upper(), sys.argv[1], open('data/x.txt').read())",
            "data/x.txt": "payload",
        },
        stdin="hello\n",
    )
    assert r.ok and r.stdout == "HELLO arg payload\n" and r.stderr == ""
    r = run_python("import sys; sys.exit(3)")
    assert r.returncode == 3 and not r.ok


def test_timeout_kills_sleeping_program():
    t0 = time.monotonic()
    r = run_python("import time; time.sleep(60)", limits=SandboxLimits(wall_time_s=1.0))
    assert r.timed_out and r.returncode < 0
    assert time.monotonic() - t0 < 10


def test_infinite_loop_is_killed_by_the_cpu_limit():
    # Wall clock generous, CPU limit 1 s: RLIMIT_CPU stops the loop (SIGXCPU, then SIGKILL).
    r = run_python("while True:\n    pass", limits=SandboxLimits(wall_time_s=20, cpu_time_s=1))
    assert not r.timed_out and r.returncode < 0
    r = run_python("while True:\n    pass", limits=FAST)
    assert r.timed_out and not r.ok


def test_memory_bomb_fails_fast():
    r = run_python(
        "x = bytearray(8 << 30)\nprint('allocated')", limits=SandboxLimits(memory_bytes=256 << 20)
    )
    assert r.returncode != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout
    # Growing allocation too.
    r = run_python(
        "xs = []\nwhile True:\n    xs.append(bytearray(64 << 20))",
        limits=SandboxLimits(memory_bytes=256 << 20),
    )
    assert r.returncode != 0 and "MemoryError" in r.stderr


def test_fork_bomb_is_contained_and_cleaned_up():
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    before = len(os.listdir("/proc"))
    t0 = time.monotonic()
    r = run_python(code, limits=SandboxLimits(wall_time_s=1.5, max_processes=16))
    assert r.timed_out and time.monotonic() - t0 < 15
    if r.isolation["uid"] is not None:
        uid = r.isolation["uid"]
        owned = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]
        assert owned == []
        # RLIMIT_NPROC held (exactness: test_process_cap_is_exact_...). The pid namespace's
        # init takes the bomb down with it, so the sweep may find nothing left to kill.
        assert r.isolation["stray_processes_killed"] <= 16
    assert len(os.listdir("/proc")) < before + 5


@needs_root
def test_process_cap_is_exact_under_a_uid_of_its_own():
    code = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    r = run_python(code, limits=SandboxLimits(wall_time_s=10, max_processes=8))
    assert r.ok and r.isolation["uid"] is not None
    assert int(r.stdout) == 7  # the program itself is the eighth


def _uid_of(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
    return found


def test_escaped_daemon_is_killed():
    # Double fork + setsid: leaves the process group; the subreaper supervisor (and, in a pid
    # namespace, its init) still kills it. Its pid inside a namespace means nothing on the host:
    # it is found by a marker in its command line.
    marker = f"lopd-daemon-{uuid.uuid4().hex}"
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
        f"'{marker}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
    )
    r = run_python(code, limits=SandboxLimits(wall_time_s=5))
    assert r.ok, r.stderr
    assert _processes_with(marker) == []


def test_no_inherited_environment(monkeypatch):
    monkeypatch.setenv("LOPD_TEST_SECRET", "hunter2")
    monkeypatch.setenv("PYTHONPATH", "/nonexistent/evil")
    r = run_python("import os, sys, json\nprint(json.dumps(dict(os.environ)))\nprint(sys.path)")
    assert r.ok and "hunter2" not in r.stdout and "evil" not in r.stdout
    env = json.loads(r.stdout.splitlines()[0])
    assert sorted(env) == ["HOME", "LANG", "PATH", "TMPDIR"]


@needs_root
def test_cannot_read_the_callers_environment_via_proc(monkeypatch):
    monkeypatch.setenv("LOPD_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        f"pids = sorted({{'self', str(os.getppid()), '{os.getpid()}', '{os.getppid()}'}}\n"
        "    | {p for p in os.listdir('/proc') if p.isdigit()})\n"
        "for pid in pids:\n"
        "    for what in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            print(pid, what, open(f'/proc/{pid}/{what}', 'rb').read())\n"
        "        except OSError as e:\n"
        "            print(pid, what, type(e).__name__)\n"
    )
    r = run_python(code)
    assert r.ok, r.stderr
    assert "hunter2" not in r.stdout and "pytest" not in r.stdout
    assert f"{os.getpid()} environ FileNotFoundError" in r.stdout  # no such pid in there
    assert r.isolation["private_proc"]


def test_work_dir_is_writable_and_is_home():
    r = run_python(
        "import os\nopen('out.txt', 'w').write('ok')\n"
        "print(os.getcwd() == os.environ['HOME'], open(os.path.expanduser('~/out.txt')).read())"
    )
    assert r.ok and r.stdout == "True ok\n"


def _denied(stderr: str) -> bool:
    # Refused by the uid (root-owned target) or by the read-only mount, whichever comes first.
    return "PermissionError" in stderr or "Read-only file system" in stderr


@needs_root
def test_writing_outside_the_work_dir_fails(tmp_path):
    # The sandbox's standard library (bound read-only from the host) stands for any root-owned
    # place outside /tmp that the program can see.
    stdlib = Path(run_python("import os\nprint(os.path.dirname(os.__file__))").stdout.strip())
    target = stdlib / f"pwned-{uuid.uuid4().hex}.txt"
    try:
        r = run_python(f"open({str(target)!r}, 'w').write('x')")
        assert r.returncode != 0 and _denied(r.stderr)
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    # The installed package (the repo): read-only, or invisible when the checkout itself lies
    # under /tmp (as in CI), which the sandbox replaces with a private one.
    target = Path(lopd.__file__).parent / f"pwned-{uuid.uuid4().hex}.txt"
    try:
        r = run_python(f"open({str(target)!r}, 'w').write('x')")
        assert r.returncode != 0
        assert _denied(r.stderr) or "FileNotFoundError" in r.stderr
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    # A root-owned dir under /tmp is not even visible (private /tmp).
    r = run_python(f"open({str(tmp_path / 'pwned.txt')!r}, 'w').write('x')")
    assert r.returncode != 0 and not (tmp_path / "pwned.txt").exists()
    r = run_python("import os\nos.makedirs('../escape')")
    assert r.returncode != 0 and "PermissionError" in r.stderr


@needs_root
def test_world_writable_dirs_are_private():
    name = f"lopd-sandbox-probe-{uuid.uuid4().hex}"
    code = (
        f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        f"    open(d + '/{name}', 'w').write('x')\n"
        f"import os\nprint(sorted(os.listdir('/tmp')))"
    )
    r = run_python(code)
    assert r.ok, r.stderr
    assert r.isolation["private_tmp"]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(d, name).exists()
    # The host's /tmp content is invisible: only the probe and the path to the work dir.
    assert len(ast.literal_eval(r.stdout)) == 2


@needs_root
def test_no_network():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    finally:
        srv.close()
    assert r.returncode != 0 and "OSError" in r.stderr and r.isolation["no_network"]


def test_file_size_limit():
    r = run_python(
        "with open('big', 'wb') as f:\n    f.write(b'x' * (8 << 20))\nprint('done')",
        limits=SandboxLimits(file_size_bytes=1 << 20),
    )
    assert not r.ok and "done" not in r.stdout


def test_bad_arguments():
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=0)
    with pytest.raises(ValueError, match="escapes the work dir"):
        run_sandboxed(["main.py"], {"../x.py": "pass"})


def test_without_privilege_drop_still_clean_and_killed(monkeypatch):
    # The mode used when the caller is not root: same clean env, timeout and cleanup.
    monkeypatch.setenv("LOPD_TEST_SECRET", "hunter2")
    r = run_python(
        "import os\nprint(os.getcwd())\nprint('LOPD_TEST_SECRET' in os.environ)",
        drop_privileges=False,
    )
    assert r.ok and r.isolation["uid"] is None and r.stdout.splitlines()[1] == "False"
    work = Path(r.stdout.splitlines()[0])
    assert not work.exists() and not work.parent.exists()  # the whole run dir is removed
    r = run_python("import time\ntime.sleep(30)", limits=FAST, drop_privileges=False)
    assert r.timed_out
