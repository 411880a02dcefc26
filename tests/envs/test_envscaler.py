"""EnvScaler environments as a world: the release files as released, the turn rules, the reward
(checks held / checks), check failures with their reasons, per-call limits with undo, broken
environments. The fixtures (``tests/data/envscaler``) are this project's own environments and
tasks in EnvScaler's shapes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lopd.envs import load_task_file, make_env, oracle_actions, save_tasks_jsonl
from lopd.envs.base import ToolCall
from lopd.envs.envscaler import EnvScalerEnv, EnvScalerLimits
from lopd.envs.envscaler_release import load_envscaler
from lopd.envs.tool_use import format_tool_call, run_actions

DATA = Path(__file__).parents[1] / "data" / "envscaler"
ORACLE = [
    {"name": "find_book", "arguments": {"title": "Dune"}},
    {"name": "lend_book", "arguments": {"book_id": "B1", "member_id": "M1"}},
    {"name": "return_book", "arguments": {"loan_id": "L-old"}},
    {"name": "set_member_status", "arguments": {"member_id": "M2", "status": "suspended"}},
]


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for t in load_envscaler(DATA).tasks}


def with_spec(task, **changes):
    t = type(task)(**task.to_dict())
    t.spec = {**task.spec, **changes}
    return t


def call(name, **arguments):
    return format_tool_call(ToolCall(name, arguments))


def test_release_files_load_as_released_in_every_shape(tasks, tmp_path):
    assert len(tasks) == 8
    task = tasks["env_lib-task_1"]
    assert task.world == "envscaler" and task.instruction.startswith("Lend a copy of 'Dune'")
    assert task.spec["env_class_name"] == "LibraryCatalogSystem"
    assert len(task.spec["checklist_with_func"]) == 4
    assert sorted(t.split for t in tasks.values()) == ["test"] + ["train"] * 7
    # The Hugging Face shape: JSON lines, init_config and tools as JSON text, env items a list.
    envs = json.loads((DATA / "env_items.json").read_text())
    items = json.loads((DATA / "task_items.json").read_text())
    hf = tmp_path / "hf"
    hf.mkdir()
    with open(hf / "envs.jsonl", "w") as f:
        for env in envs.values():
            f.write(json.dumps({**env, "tools": json.dumps(env["tools"])}) + "\n")
    with open(hf / "scenarios.jsonl", "w") as f:
        for item in items:
            f.write(json.dumps({**item, "init_config": json.dumps(item["init_config"])}) + "\n")
    again = {t.task_id: t for t in load_task_file(hf)}
    assert {k: (t.spec, t.split) for k, t in again.items()} == {
        k: (t.spec, t.split) for k, t in tasks.items()
    }
    # The native JSONL: what --export-tasks writes, line per task, self-contained.
    native = tmp_path / "tasks.jsonl"
    save_tasks_jsonl(list(tasks.values()), native)
    assert [t.to_dict() for t in load_task_file(native)] == [t.to_dict() for t in tasks.values()]


def test_oracle_scores_one_and_perturbed_actions_score_less(tasks):
    task = with_spec(tasks["env_lib-task_1"], oracle=ORACLE)
    env = make_env(task)
    assert isinstance(env, EnvScalerEnv)
    assert run_actions(env, task, oracle_actions(task)) == 1.0
    assert [r.held for r in env.check_results] == [True] * 4 and env.success
    # One step left out: that check fails, the others hold.
    assert run_actions(env, task, [*oracle_actions(task)[:3], "Task Completed"]) == 0.75
    assert env.check_results[2].held is False and env.check_results[2].reason is None
    # A wrong argument: M2 is lent the book instead of M1.
    wrong = [call("lend_book", book_id="B1", member_id="M2"), *oracle_actions(task)[2:]]
    assert run_actions(env, task, wrong) == 0.75
    assert [r.held for r in env.check_results] == [False, True, True, True]
    # Nothing done: only the check that holds on the initial state pays (EnvScaler's reward).
    assert run_actions(env, task, ["Task Completed"]) == 0.25


def test_turn_rules_observations_and_state_snapshots(tasks):
    task = tasks["env_lib-task_1"]
    env = EnvScalerEnv()
    assert env.reset(task) == task.instruction
    assert "Rules and constraints" in env.system_prompt() and "Suspended members" in (
        env.system_prompt()
    )
    assert [t["function"]["name"] for t in env.tools()][:2] == ["find_book", "get_member"]
    obs, done = env.step(call("find_book", title="Dune"))
    assert obs == "{'success': True, 'data': {'book_id': 'B1', 'title': 'Dune', 'copies': 2}}"
    assert not done
    obs, _ = env.step(call("set_member_status", member_id="M2", status="gone"))
    assert obs == "Error: ValueError: unknown status gone"  # a tool exception, the episode goes on
    assert env.step(call("_audit"))[0] == "Error: unknown tool '_audit'"  # private: not a tool
    assert env.step(call("no_such_tool"))[0] == "Error: unknown tool 'no_such_tool'"
    obs, _ = env.step('<tool_call>\n{"name": "find_book", "arguments": [1]}\n</tool_call>')
    assert obs.startswith("Error: tool call 'arguments'")
    two = call("lend_book", book_id="B1", member_id="M1") + call("find_book", title="x")
    obs, _ = env.step(two)
    assert "only the first of the 2 tool calls was run" in obs
    assert len(env.snapshots) == env.num_steps + 1  # after reset and after every step
    assert env.snapshots[0]["books"]["B1"]["copies"] == 2
    assert env.snapshots[-1]["books"]["B1"]["copies"] == 1
    assert env.step("I am done here.") == ("", True)  # a text turn ends the episode
    assert env.stats()["num_tool_calls"] == 7 and len(env.trace) == 5


def test_checks_that_raise_loop_return_non_bools_or_reach_outside_fail_with_reasons(tasks):
    checks = {
        "holds": "def check_func(s):\n    return s['loans']['L-old']['returned'] is False",
        "raises": "def check_func(final_state):\n    return final_state['nope']",
        "loops": "def check_func(final_state):\n    while True:\n        pass",
        "non-bool": "def check_func(final_state):\n    return 1",
        "opens": "def check_func(final_state):\n    return bool(open('/etc/hostname').read())",
        "lists": "import os\ndef check_func(final_state):\n    return bool(os.listdir('/'))",
        "imports": "def check_func(final_state):\n    import socket\n    return True",
        "swallows": (
            "def check_func(final_state):\n    try:\n        open('x', 'w')\n"
            "    except Exception:\n        pass\n    return True"
        ),
        "frames": "import sys\ndef check_func(s):\n    return sys._getframe(1) is not None",
    }
    checklist = [{"check_item": k, "check_func": v} for k, v in checks.items()]
    task = with_spec(tasks["env_lib-task_1"], checklist_with_func=checklist)
    env = EnvScalerEnv(limits=EnvScalerLimits(check_time_limit_s=2.0))
    env.reset(task)
    assert env.reward() == pytest.approx(1 / len(checks))
    got = {r.item: (r.held, r.reason) for r in env.check_results}
    assert got["holds"] == (True, None)
    assert got["raises"] == (False, "it raised KeyError: 'nope'")
    assert got["loops"] == (False, "it ran past the 2 s limit")
    assert got["non-bool"] == (False, "it returned int, not a bool")
    assert got["opens"] == (False, "it reached outside its state: open(/etc/hostname)")
    assert got["lists"] == (False, "it reached outside its state: os.listdir(/)")
    assert got["imports"] == (False, "it reached outside its state: import(socket)")
    assert got["swallows"] == (False, "it reached outside its state: open(x)")
    assert got["frames"][0] is False and "sys._getframe" in got["frames"][1]
    assert env.episode_record()["checks"][1] == {
        "item": "raises",
        "held": False,
        "reason": "it raised KeyError: 'nope'",
    }


SLOW_CODE = """
class Slow:
    def __init__(self, config):
        self.counter = 0

    def bump(self) -> dict:
        self.counter += 1
        return {"counter": self.counter}

    def bump_then_spin(self) -> None:
        self.counter += 100
        while True:
            pass

    def bump_then_hog(self) -> None:
        self.counter += 100
        self.blob = bytearray(1 << 31)
"""


def slow_task(tasks):
    tool = {"type": "function", "function": {"name": "bump", "parameters": {}}}
    check = "def check_func(final_state):\n    return final_state['counter'] == 2"
    return with_spec(
        tasks["env_green-task_1"],
        env_class_name="Slow",
        env_class_code=SLOW_CODE,
        tools=[tool],
        init_config={},
        checklist_with_func=[{"check_item": "twice", "check_func": check}],
    )


def test_a_call_past_its_time_or_memory_limit_is_stopped_and_undone(tasks):
    task = slow_task(tasks)
    env = EnvScalerEnv(limits=EnvScalerLimits(call_time_limit_s=1.5, memory_bytes=512 << 20))
    env.reset(task)
    assert env.step(call("bump"))[0] == "{'counter': 1}"
    obs, done = env.step(call("bump_then_spin"))
    assert obs == "Error: the call ran past the 1.5 s limit and was stopped" and not done
    obs, _ = env.step(call("bump_then_hog"))
    assert obs == "Error: the call ran past the 512 MiB memory limit and was stopped"
    assert env.stopped_calls == 2
    assert env.snapshots[-1] == {"counter": 1}  # neither stopped call left a trace
    assert env.step(call("bump"))[0] == "{'counter': 2}"
    assert env.reward() == 1.0


@pytest.mark.parametrize(
    "code, why",
    [
        ("raise RuntimeError('boom')\nclass Slow:\n    pass\n", "RuntimeError: boom"),
        (
            "class Slow:\n    def __init__(self, config):\n        raise KeyError('x')\n",
            "KeyError: 'x'",
        ),
    ],
)
def test_an_environment_that_cannot_be_built_ends_its_episode_with_the_reason(tasks, code, why):
    task = with_spec(slow_task(tasks), env_class_code=code)
    env = EnvScalerEnv()
    env.reset(task)
    obs, done = env.step(call("bump"))
    assert done and obs == f"Error: the environment could not be built: {why}"
    assert env.reward() == 0.0
    record = env.episode_record()
    assert record["broken"] == f"the environment could not be built: {why}"
    assert record["checks"] == [{"item": "twice", "held": False, "reason": record["broken"]}]


def test_the_class_code_and_the_checks_never_run_in_this_process(tasks):
    code = SLOW_CODE + "\nimport sys\nsys.lopd_class_code_ran = True\n"
    check = "import sys\nsys.lopd_check_ran = True\ndef check_func(final_state):\n    return True"
    task = with_spec(
        slow_task(tasks),
        env_class_code=code,
        checklist_with_func=[{"check_item": "c", "check_func": check}],
    )
    env = EnvScalerEnv()
    env.reset(task)
    assert env.broken is None and env.step(call("bump"))[0] == "{'counter': 1}"
    assert env.reward() == 1.0
    assert not hasattr(sys, "lopd_class_code_ran") and not hasattr(sys, "lopd_check_ran")
    assert "envscaler_env" not in sys.modules
