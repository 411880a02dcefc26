"""The containment table of ``docs/sandbox.md`` for EnvScaler's environment and check code: the
file system, the network, processes, other tasks' state and the trainer's memory.

This process stands for the trainer: it holds a secret in its environment, a marker file and a
listening socket. An environment class whose tool probes all of them, and checks that try each,
run through :class:`lopd.envs.envscaler.EnvScalerEnv` as any task would. Rows hold in the root
and user-namespace modes of the sandbox; in plain mode the sandbox says what it does not contain
(``lopd/envs/sandbox.py``), and these tests are skipped there.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import uuid

import pytest

from lopd.envs.base import ToolCall
from lopd.envs.envscaler import EnvScalerEnv
from lopd.envs.sandbox import run_python
from lopd.envs.tool_use import format_tool_call
from lopd.types import Task

PROBE_CLASS = r'''
import json, os, socket


def reach(cfg):
    seen = {}

    def reads(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            return b""

    seen["host_file"] = reads(cfg["marker"]) == cfg["secret"].encode()
    try:
        with open(os.path.join(cfg["host_dir"], "written-by-env"), "w") as f:
            f.write("x")
        seen["host_write"] = True
    except OSError:
        seen["host_write"] = False
    try:
        socket.create_connection(("127.0.0.1", cfg["port"]), timeout=2).close()
        seen["network"] = True
    except OSError:
        seen["network"] = False
    try:
        os.kill(cfg["pid"], 0)
        seen["signal_trainer"] = True
    except OSError:
        seen["signal_trainer"] = False
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    seen["sees_trainer"] = str(cfg["pid"]) in pids
    blob = reads(f"/proc/{cfg['pid']}/environ") + reads(f"/proc/{cfg['pid']}/cmdline")
    seen["trainer_environ"] = cfg["secret"].encode() in blob
    seen["trainer_memory"] = bool(reads(f"/proc/{cfg['pid']}/mem"))
    seen["inherited_env"] = cfg["secret"] in repr(dict(os.environ))
    seen["other_task_file"] = os.path.exists("/tmp/left-by-another-task")
    seen["other_task_global"] = bool(globals().get("LEFT_BY_ANOTHER_TASK"))
    return seen


class Prober:
    def __init__(self, config):
        self.runs = 0

    def probe(self, cfg: str) -> dict:
        """Report what the environment's code can reach."""
        self.runs += 1
        return reach(json.loads(cfg))

    def leave_traces(self) -> dict:
        """Leave a file and a module global behind for a later task to find."""
        global LEFT_BY_ANOTHER_TASK
        LEFT_BY_ANOTHER_TASK = True
        with open("/tmp/left-by-another-task", "w") as f:
            f.write("x")
        return {"left": True}
'''


@pytest.fixture(scope="module")
def isolated():
    if not run_python("pass").isolation.get("minimal_root"):
        pytest.skip("the sandbox runs in plain mode here (no namespaces): see lopd/envs/sandbox.py")


@pytest.fixture()
def trainer(tmp_path, monkeypatch):
    """What the trainer holds: a secret, a marker file, a directory, a listening socket."""
    secret = f"lopd-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("LOPD_TRAINER_SECRET", secret)
    marker = tmp_path / "marker"
    marker.write_text(secret)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield {
        "secret": secret,
        "marker": str(marker),
        "host_dir": str(tmp_path),
        "port": server.getsockname()[1],
        "pid": os.getpid(),
    }
    server.close()


def task(checks: dict[str, str]) -> Task:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {}}}
        for n in ("probe", "leave_traces")
    ]
    spec = {
        "env_id": "prober",
        "env_class_name": "Prober",
        "env_class_code": PROBE_CLASS,
        "tools": tools,
        "environment_introduction": "probes",
        "constraints_rules": [],
        "init_config": {},
        "checklist_with_func": [{"check_item": k, "check_func": v} for k, v in checks.items()],
    }
    return Task("prober-1", "tool_use", "envscaler", "probe", spec, "test")


def probe(env: EnvScalerEnv, cfg: dict) -> dict:
    obs, _ = env.step(format_tool_call(ToolCall("probe", {"cfg": json.dumps(cfg)})))
    return ast.literal_eval(obs)


def test_environment_code_reaches_nothing_outside_its_state(isolated, trainer, tmp_path):
    first = EnvScalerEnv()
    first.reset(task({"c": "def check_func(final_state):\n    return True"}))
    first.step(format_tool_call(ToolCall("leave_traces", {})))
    seen = probe(first, trainer)  # the next call of the same episode: a fresh process too
    assert seen == dict.fromkeys(seen, False), seen
    other = EnvScalerEnv()  # another task, after the first left its traces
    other.reset(task({"c": "def check_func(final_state):\n    return True"}))
    seen = probe(other, trainer)
    assert seen == dict.fromkeys(seen, False), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker"]
    assert first.snapshots[-1] == {"runs": 1}  # only the state travels between calls


def test_check_code_reaches_nothing_and_each_attempt_fails_the_check(isolated, trainer, tmp_path):
    cfg = json.dumps(trainer)
    head = f"import json, os, socket\nCFG = json.loads({cfg!r})\ndef check_func(final_state):\n"
    checks = {
        "read a host file": head + "    return open(CFG['marker']).read() == CFG['secret']",
        "write a host file": head + "    open(CFG['host_dir'] + '/by-check', 'w')\n    return True",
        "network": head
        + "    socket.create_connection(('127.0.0.1', CFG['port']))\n    return True",
        "signal the trainer": head + "    os.kill(CFG['pid'], 0)\n    return True",
        "list processes": head + "    return str(CFG['pid']) in os.listdir('/proc')",
        "trainer memory": head + "    return bool(open(f\"/proc/{CFG['pid']}/mem\", 'rb').read(1))",
        "another task's file": head + "    return os.path.exists('/tmp/left-by-another-task')",
        "the environment": head + "    return CFG['secret'] in repr(dict(os.environ))",
        "fine": "def check_func(final_state):\n    return final_state['runs'] == 0",
    }
    env = EnvScalerEnv()
    env.reset(task(checks))
    env.step(format_tool_call(ToolCall("leave_traces", {})))
    assert env.reward() == pytest.approx(1 / len(checks))
    got = {r.item: (r.held, r.reason) for r in env.check_results}
    # Looking is not flagged where Python raises no audit event; what it looked for is not there.
    assert got.pop("the environment") == (False, None)
    assert got.pop("another task's file") == (False, None)
    assert got.pop("fine") == (True, None)
    for item, (held, reason) in got.items():
        assert held is False and reason.startswith("it reached outside its state: "), (item, reason)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker"]
