"""The coding verifier against a hostile policy: forged reports, huge outputs, odd values.

Every program here is one a policy could write. Expected outputs are fresh random tokens, so no
honest program can produce them: a reward of 1.0 would mean the verifier was fooled. Real
sandboxed subprocesses throughout, no mocks (one fault injection for a failing supervisor).
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from pathlib import Path

import pytest

from lopd.envs import coding as coding_mod
from lopd.envs import make_env, run_tests, sandbox
from lopd.envs.coding import MAX_OUTPUT_BYTES
from lopd.types import Task


def secret_call(n: int = 3) -> dict:
    return {
        "fn_name": "f",
        "tests": [{"input": [i], "output": secrets.token_hex(8)} for i in range(n)],
        "time_limit_s": 2.0,
    }


def secret_stdio(n: int = 2) -> dict:
    return {
        "fn_name": None,
        "tests": [{"input": f"{i}\n", "output": secrets.token_hex(8)} for i in range(n)],
        "time_limit_s": 2.0,
    }


def play(spec: dict, code: str) -> tuple[float, str]:
    task = Task("t", "coding", "coding", "Solve it.", spec, "train")
    env = make_env(task)
    env.reset(task)
    obs, done = env.step(f"```python\n{code}\n```")
    assert done
    assert obs.isprintable() and obs.encode("utf-8")  # one clean line, valid UTF-8
    return env.reward(), obs


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


def _daemon(marker: str) -> str:
    """Code that leaves a detached sleeper whose command line carries ``marker``."""
    return (
        "import os, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
        f"'{marker}'], start_new_session=True, stdin=subprocess.DEVNULL,\n"
        "    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )


# --------------------------------------------------------------------------- forged reports

# The attacks verbatim: they earned 1.0 ("All n tests passed") from the old harness,
# which ran the program next to (or inside) a process holding the report channel and a result
# mark passed in argv.
ARGV_FORGE = (
    "import os, sys\n"
    "marks = [a for a in sys.argv if a.startswith('@@lopd-')] or ['@@lopd-0@@']\n"
    "for prefix in ('{\"results\": []}', '[]'):\n"
    "    sys.__stdout__.write('\\n' + marks[0] + prefix + '\\n')\n"
    "sys.__stdout__.flush()\n"
    "os._exit(0)\n"
)


def parent_forge(body: str) -> str:
    """Steal the parent's descriptors with pidfd_getfd, write a fake report, kill the parent."""
    return PARENT_FORGE.replace("BODY", body)


PARENT_FORGE = (
    "import ctypes, os, signal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "ppid = os.getppid()\n"
    "try:\n"
    "    args = open(f'/proc/{ppid}/cmdline', 'rb').read().split(b'\\0')\n"
    "except OSError:\n"
    "    args = []\n"
    "marks = [a.decode() for a in args if a.startswith(b'@@lopd-')] or ['@@lopd-0@@']\n"
    "pidfd = libc.syscall(434, ppid, 0)  # pidfd_open\n"
    "for target in range(0, 16):\n"
    "    fd = libc.syscall(438, pidfd, target, 0)  # pidfd_getfd: the parent's fd\n"
    "    if fd >= 0:\n"
    "        try:\n"
    "            os.write(fd, ('\\n' + marks[0] + 'BODY' + '\\n').encode())\n"
    "        except OSError:\n"
    "            pass\n"
    "try:\n"
    "    os.kill(ppid, signal.SIGKILL)\n"
    "except OSError:\n"
    "    pass\n"
)


def test_forged_report_via_argv_earns_nothing():
    assert play(secret_call(), ARGV_FORGE + "def f(x):\n    return None\n")[0] == 0.0
    assert play(secret_stdio(), ARGV_FORGE)[0] == 0.0


def test_forged_report_via_parent_cmdline_and_pidfd_getfd_earns_nothing():
    marker = f"lopd-attack-{uuid.uuid4().hex}"
    reward, obs = play(secret_stdio(), _daemon(marker) + parent_forge("[]"))
    assert reward == 0.0 and obs.startswith("Test 1: ")
    forge = parent_forge('{"results": []}')
    reward, obs = play(secret_call(), _daemon(marker) + forge + "def f(x):\n    pass\n")
    assert reward == 0.0
    time.sleep(0.2)
    assert _processes_with(marker) == []  # nothing the program started survives


EVERY_PROCESS_FORGE = (
    "import ctypes, os, signal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "me = os.getpid()\n"
    "for name in os.listdir('/proc'):\n"
    "    if not name.isdigit() or int(name) == me:\n"
    "        continue\n"
    "    pidfd = libc.syscall(434, int(name), 0)\n"
    "    for target in range(0, 16):\n"
    "        fd = libc.syscall(438, pidfd, target, 0)\n"
    "        if fd >= 0:\n"
    "            try:\n"
    '                os.write(fd, b\'\\n{"test": 0, "value": 1}\\n[]\\n\')\n'
    "            except OSError:\n"
    "                pass\n"
    "    try:\n"
    "        os.kill(int(name), signal.SIGKILL)\n"
    "    except OSError:\n"
    "        pass\n"
)


def _plain_mode() -> bool:
    """Not root and no user namespaces: the program shares our uid and could kill this test."""
    return os.geteuid() != 0 and not sandbox._namespaces_work("user", True)


@pytest.mark.skipif(_plain_mode(), reason="plain sandbox mode: the program can signal the caller")
def test_program_attacking_every_visible_process_earns_nothing():
    assert play(secret_stdio(), EVERY_PROCESS_FORGE)[0] == 0.0
    assert play(secret_call(), EVERY_PROCESS_FORGE + "def f(x):\n    return 0\n")[0] == 0.0


def test_missing_duplicate_and_malformed_call_reports_are_reward_zero():
    spec = secret_call()
    # Report nothing: exit before the first call.
    reward, obs = play(spec, "import os\ndef f(x):\n    os._exit(0)\n")
    assert reward == 0.0 and obs.startswith("Test 1: no result")
    # Write extra records on every descriptor (the runner's channel among them).
    spray = (
        "import os\n"
        "def f(x):\n"
        "    for fd in range(0, 32):\n"
        "        try:\n"
        '            os.write(fd, b\'{"test": 0, "value": 1}\\n{"test": 1, "value": 1}\\n\')\n'
        "        except OSError:\n"
        "            pass\n"
        "    return x\n"
    )
    reward, obs = play(spec, spray)
    assert reward == 0.0 and "malformed result" in obs
    for junk in ("b'[' * 100000", "b'9' * 5000", 'b\'{"test": 0, "value": "\\\\ud800"\''):
        code = f"import os\nfor fd in range(32):\n    try:\n        os.write(fd, {junk})\n"
        code += "    except OSError:\n        pass\nos._exit(0)\n"
        reward, obs = play(spec, code)
        assert reward == 0.0 and obs.startswith(("malformed result", "runtime error")), obs


# --------------------------------------------------------------------------- big outputs


def test_correct_12mb_answer_passes():
    answer = "7\n" * 6_000_000
    spec = {"fn_name": None, "tests": [{"input": "", "output": answer}], "time_limit_s": 20.0}
    t0 = time.monotonic()
    assert play(spec, "import sys\nsys.stdout.write('7\\n' * 6_000_000)") == (
        1.0,
        "All 1 tests passed",
    )
    # The same size returned from a function (12 MB of JSON text).
    value = "7 " * 6_000_000
    call = {"fn_name": "f", "tests": [{"input": [], "output": value}], "time_limit_s": 20.0}
    assert play(call, "def f():\n    return '7 ' * 6_000_000") == (1.0, "All 1 tests passed")
    assert time.monotonic() - t0 < 60


def test_1gib_output_fails_cleanly():
    t0 = time.monotonic()
    code = "import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(b)\n"
    spec = {**secret_stdio(1), "time_limit_s": 10.0}
    reward, obs = play(spec, code)
    assert reward == 0.0 and obs == f"Test 1: output over the {MAX_OUTPUT_BYTES >> 20} MiB cap"
    assert time.monotonic() - t0 < 30


def test_control_characters_in_output_and_errors():
    reward, obs = play(
        secret_stdio(1), "import sys\nsys.stdout.write('\\x01\\x1b[2J\\x00' * (1 << 20))"
    )
    assert reward == 0.0 and obs.startswith("Test 1: wrong answer") and "\\x1b" in obs
    reward, obs = play(
        secret_stdio(1), "import sys\nsys.stderr.write('\\x1b[31m\\udcff')\nraise SystemExit(1)"
    )
    assert reward == 0.0 and obs.startswith("Test 1: runtime error")
    reward, obs = play(secret_call(1), "def f(x):\n    raise ValueError('\\x00\\x1b[2J' * 100)")
    assert reward == 0.0 and obs.startswith("Test 1: ValueError: \\x00\\x1b[2J")


def test_20mib_return_value_fails_cleanly():
    reward, obs = play(secret_call(1), "def f(x):\n    return 'x' * (20 << 20)")
    assert reward == 0.0
    assert obs == f"Test 1: return value over the {MAX_OUTPUT_BYTES >> 20} MiB cap"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("v = []\n    for _ in range(100000):\n        v = [v]\n    return v", "Test 1: "),
        ("return 10 ** 5000", "Test 1: "),
        ("return object()", "Test 1: "),
        ("return '\\ud800'", "Test 1: wrong answer"),
        ("return float('nan')", "Test 1: wrong answer"),
    ],
)
def test_unusual_return_values_are_wrong_answers_not_crashes(body, fragment):
    reward, obs = play(secret_call(1), f"def f(x):\n    {body}\n")
    assert reward == 0.0 and obs.startswith(fragment), obs


def test_return_value_conversions_still_pass():
    spec = {
        "fn_name": "f",
        "tests": [
            {"input": [[3, 1, 2]], "output": [1, 2, 3]},
            {"input": [[1]], "output": [[1, 1]]},
        ],
    }
    # A set comes back sorted, a tuple as a list (JSON has neither).
    code = "def f(xs):\n    return set(xs) if len(xs) > 1 else (xs[0], xs[0])\n"
    assert play(spec, code) == (1.0, "All 2 tests passed")


def test_lone_surrogates_and_nul_in_the_program_text():
    assert play(secret_stdio(1), "print('\ud800')")[0] == 0.0
    assert play(secret_stdio(1), "print(1)\x00")[0] == 0.0


def test_a_failing_supervisor_is_a_failed_test_not_an_exception(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sandbox supervisor failed (exit -9): out of memory")

    monkeypatch.setattr(coding_mod, "run_sequence", broken)
    report = run_tests("print(1)", secret_stdio(1))
    assert report.passed == 0 and not report.all_passed
    assert report.message.startswith("sandbox error: ")


# --------------------------------------------------------------------------- classic payloads

CLASSIC = {
    "infinite loop": "while True:\n    pass\n",
    "memory bomb": "x = []\nwhile True:\n    x.append(bytearray(64 << 20))\n",
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    ),
    "thread bomb": (
        "import threading, time\n"
        "while True:\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    ),
    "orphans": "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os.setsid()\n",
    "env secret": "import os\nprint(os.environ.get('LOPD_TEST_SECRET', 'none'))\n",
    "write outside": "open(WHERE, 'w').write('pwned')\n",
}


@pytest.mark.parametrize("kind", sorted(CLASSIC))
@pytest.mark.parametrize("spec_kind", ["stdio", "call"])
def test_classic_payloads_earn_nothing_and_leave_nothing_running(kind, spec_kind, monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("LOPD_TEST_SECRET", secret)
    where = Path(__file__).resolve().parent / f"pwned-{uuid.uuid4().hex}.txt"
    marker = f"lopd-classic-{uuid.uuid4().hex}"
    # The expected output is the secret: a leak would be a pass.
    tests = [{"input": [] if spec_kind == "call" else "", "output": secret}]
    spec = {"fn_name": "f" if spec_kind == "call" else None, "tests": tests, "time_limit_s": 1.0}
    body = CLASSIC[kind].replace("WHERE", repr(str(where)))
    if spec_kind == "call":
        body = "def f():\n" + "".join(f"    {line}\n" for line in body.splitlines())
    t0 = time.monotonic()
    try:
        reward, obs = play(spec, _daemon(marker) + body)
        assert reward == 0.0, obs
        assert not where.exists()
    finally:
        where.unlink(missing_ok=True)
    assert time.monotonic() - t0 < 30
    time.sleep(0.1)
    assert _processes_with(marker) == []
