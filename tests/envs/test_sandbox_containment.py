"""The containment table of ``lopd/envs/sandbox.py``, checked row by row in each mode.

A *caller* process (standing for the trainer) holds a secret in its environment, a marker in its
command line, a listening socket, a marker file in ``/tmp`` and a world-writable directory
outside the work dir; it runs one probe program in the sandbox, which reports what it could
reach. The caller runs as root (root mode) or as a fresh unprivileged uid (user-namespace mode,
and plain mode with ``isolate=False``), using a copy of the sandbox modules (standard library
only) so that no part of the checkout needs to be readable by that uid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from lopd.envs import sandbox

REPO = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="switching the caller's uid needs root")

PROBE = r"""
import ctypes, json, os, socket, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
me, caller = os.getpid(), cfg["caller_pid"]
seen = {"inherited_env": cfg["secret"] in repr(dict(os.environ))}


def reads(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
blob = b"".join(reads(f"/proc/{p}/environ") + reads(f"/proc/{p}/cmdline") for p in pids)
blob += reads(f"/proc/{caller}/environ") + reads(f"/proc/{caller}/cmdline")
seen["caller_environ"] = cfg["secret"].encode() in blob
seen["caller_cmdline"] = cfg["marker"].encode() in blob
try:
    os.kill(caller, 0)
    seen["signal_caller"] = True
except OSError:
    seen["signal_caller"] = False


def steals(pid):
    pidfd = libc.syscall(434, pid, 0)
    if pidfd < 0:
        return False
    got = [libc.syscall(438, pidfd, fd, 0) for fd in range(0, 8)]
    for fd in [pidfd, *got]:
        if fd >= 0:
            os.close(fd)
    return any(fd >= 0 for fd in got)


seen["getfd_caller"] = steals(caller)
seen["getfd_parent"] = steals(os.getppid()) if os.getppid() > 0 else False
seen["getfd_any"] = any(steals(int(p)) for p in pids)
try:
    with open(os.path.join(cfg["outside_dir"], "pwned"), "w") as f:
        f.write("x")
    seen["write_outside"] = True
except OSError:
    seen["write_outside"] = False
seen["host_tmp"] = os.path.exists(cfg["tmp_marker"])
try:
    socket.create_connection(("127.0.0.1", cfg["port"]), timeout=2).close()
    seen["network"] = True
except OSError:
    seen["network"] = False
seen["world_readable"] = bool(reads("/etc/passwd"))
seen["host_file"] = bool(reads(cfg["readable_file"]))
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(cfg["unix_socket"])
    seen["unix_socket"] = s.recv(16) == b"hello"
except OSError:
    seen["unix_socket"] = False
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect("\0" + cfg["abstract_socket"])
    seen["abstract_socket"] = s.recv(16) == b"hello"
except OSError:
    seen["abstract_socket"] = False
print(json.dumps(seen))
"""

PAYLOADS = {
    "loop": "while True:\n    pass",
    "memory": "x = bytearray(8 << 30)",
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    ),
    "daemon": (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
        "sys.argv[1]])\n"
    ),
}

# Runs as the caller: imports the copied sandbox modules, probes, runs the payloads. It serves
# a 0777 filesystem UNIX socket and an abstract one (each answers "hello").
CALLER = r"""
import json, os, socket, sys, threading
sys.path.insert(0, sys.argv[1])
from lopd.envs import sandbox
cfg = json.loads(sys.argv[2])
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(4)
cfg["probe"]["port"] = srv.getsockname()[1]


def serve(address):
    s = socket.socket(socket.AF_UNIX)
    s.bind(address)
    if not address.startswith("\0"):
        os.chmod(address, 0o777)
    s.listen(4)

    def loop():
        while True:
            conn, _ = s.accept()
            conn.sendall(b"hello")
            conn.close()

    threading.Thread(target=loop, daemon=True).start()


serve(cfg["probe"]["unix_socket"])
serve("\0" + cfg["probe"]["abstract_socket"])
cfg["probe"]["caller_pid"] = os.getpid()
kw = cfg["kw"]
r = sandbox.run_sandboxed(
    ["probe.py", json.dumps(cfg["probe"])], {"probe.py": cfg["probe_code"]}, "",
    sandbox.SandboxLimits(wall_time_s=20), **kw
)
out = {"probe": r.stdout, "stderr": r.stderr[-2000:], "isolation": r.isolation, "payloads": {}}
limits = sandbox.SandboxLimits(
    wall_time_s=2, cpu_time_s=5, memory_bytes=256 << 20, max_processes=8
)
for name, code in cfg["payloads"].items():
    argv = ["main.py", cfg["probe"]["marker"]]
    p = sandbox.run_sandboxed(argv, {"main.py": code}, "", limits, **kw)
    out["payloads"][name] = {"returncode": p.returncode, "timed_out": p.timed_out,
                             "memory_error": "MemoryError" in p.stderr}
print(json.dumps(out))
"""


def _marker_processes(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            # The caller's own command line carries the marker too: only payload sleepers count.
            if marker.encode() in cmdline and b"time.sleep" in cmdline:
                found.append(pid)
    return found


def run_caller(mode: str) -> dict:
    """Run the probe and the payloads from a caller in ``mode`` (root / user / plain)."""
    uid = None if mode == "root" else sandbox.pick_uid()
    python = sandbox.sandbox_python(True)
    secret, marker = f"secret-{uuid.uuid4().hex}", f"marker-{uuid.uuid4().hex}"
    mod_dir = Path(tempfile.mkdtemp(prefix="lopd-sbx-copy-"))
    outside = Path(tempfile.mkdtemp(prefix=".lopd-outside-", dir=REPO))
    tmp_marker = Path(tempfile.mkdtemp(prefix="lopd-host-tmp-")) / "marker"
    try:
        # The sandbox's modules as a package of their own (empty __init__ files).
        pkg = mod_dir / "lopd" / "envs"
        pkg.mkdir(parents=True)
        (mod_dir / "lopd" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        for name in (
            "sandbox.py",
            "_sandbox_identity.py",
            "_sandbox_launcher.py",
            "_sandbox_layout.py",
            "_tree_removal.py",
        ):
            shutil.copy(Path(sandbox.__file__).with_name(name), pkg / name)
        for p in [mod_dir, *mod_dir.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(outside, 0o777)  # only the read-only mount (or the mode) can stop a write
        tmp_marker.write_text("x")
        readable = outside / "readable.txt"
        readable.write_text("x")
        os.chmod(readable, 0o644)
        os.chmod(tmp_marker.parent, 0o755)
        os.chmod(tmp_marker, 0o644)
        if uid is not None:
            os.chown(outside, uid, uid)
        kw = {"isolate": mode != "plain"}
        cfg = {
            "probe": {
                "secret": secret,
                "marker": marker,
                "outside_dir": str(outside),
                "tmp_marker": str(tmp_marker),
                "readable_file": str(readable),
                "unix_socket": str(outside / "service.sock"),
                "abstract_socket": f"lopd-test-{uuid.uuid4().hex}",
            },
            "probe_code": PROBE,
            "payloads": PAYLOADS,
            "kw": kw,
        }

        def become():
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)

        res = subprocess.run(
            [python, "-I", "-c", CALLER, str(mod_dir), json.dumps(cfg), marker],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "LOPD_SECRET": secret, "HOME": str(mod_dir)},
            cwd=str(mod_dir),
            preexec_fn=become,
            timeout=240,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout.splitlines()[-1])
        out["seen"] = json.loads(out["probe"]) if out["probe"] else None
        out["wrote_outside"] = (outside / "pwned").exists()
        out["left_running"] = _marker_processes(marker)
        out["warnings"] = res.stderr
        return out
    finally:
        shutil.rmtree(mod_dir, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)
        shutil.rmtree(tmp_marker.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def root_mode():
    return run_caller("root")


@pytest.fixture(scope="module")
def user_mode():
    out = run_caller("user")
    if not out["isolation"].get("user_namespace"):
        pytest.skip("this kernel does not allow unprivileged user namespaces")
    return out


@pytest.fixture(scope="module")
def plain_mode():
    return run_caller("plain")


CONTAINED = {
    "inherited_env": False,
    "caller_environ": False,
    "caller_cmdline": False,
    "signal_caller": False,
    "getfd_caller": False,
    "getfd_parent": False,
    "getfd_any": False,
    "write_outside": False,
    "host_tmp": False,
    "network": False,
    "world_readable": False,
    "host_file": False,
    "unix_socket": False,
    "abstract_socket": False,
}


def _check_payloads(out: dict) -> None:
    p = out["payloads"]
    assert p["loop"]["timed_out"] or p["loop"]["returncode"] < 0
    assert p["memory"]["returncode"] != 0 and p["memory"]["memory_error"]
    assert p["fork_bomb"]["timed_out"]
    assert p["daemon"]["returncode"] == 0
    assert out["left_running"] == []


def test_root_mode(root_mode):
    iso = root_mode["isolation"]
    assert iso["uid"] is not None and not iso["user_namespace"]
    assert iso["private_proc"] and iso["private_tmp"] and iso["read_only_root"]
    assert iso["no_network"] and iso["minimal_root"] and iso["disk_cap"]
    assert root_mode["seen"] == CONTAINED, root_mode["stderr"]
    assert not root_mode["wrote_outside"]
    _check_payloads(root_mode)


def test_user_namespace_mode(user_mode):
    iso = user_mode["isolation"]
    assert iso["uid"] is None and iso["user_namespace"]
    assert iso["private_proc"] and iso["private_tmp"] and iso["read_only_root"]
    assert iso["no_network"] and iso["minimal_root"] and iso["disk_cap"]
    assert user_mode["seen"] == CONTAINED, user_mode["stderr"]
    assert not user_mode["wrote_outside"]
    _check_payloads(user_mode)


def test_plain_mode_contains_only_what_the_table_says(plain_mode):
    iso = plain_mode["isolation"]
    assert iso["uid"] is None and not any(
        iso[k] for k in ("user_namespace", "private_proc", "private_tmp", "read_only_root")
    )
    seen = plain_mode["seen"]
    # Contained in every mode: the inherited environment and the (non-dumpable) supervisor's
    # descriptors.
    assert seen["inherited_env"] is False and seen["getfd_parent"] is False
    # The documented gaps of plain mode: all of them really are open.
    for key in ("caller_environ", "caller_cmdline", "signal_caller", "getfd_caller"):
        assert seen[key] is True, key
    assert seen["write_outside"] and plain_mode["wrote_outside"]
    assert seen["host_tmp"] and seen["network"] and seen["world_readable"]
    assert seen["host_file"] and seen["unix_socket"] and seen["abstract_socket"]
    _check_payloads(plain_mode)
