"""BFCL calls a policy can write that would hang or exhaust an in-process backend: each ends
within its limit with BFCL's error observation, the episode's state as if the call had failed,
and the verdicts still agree with bfcl-eval's checker. Real backends, real worker processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("bfcl_eval")

from lopd.envs import make_env
from lopd.envs.base import ToolCall
from lopd.envs.bfcl import BACKEND_LOST, BackendLimits, BfclEnv, bfcl_tasks, ground_truth_calls
from lopd.envs.tool_use import format_tool_call
from tests.envs.bfcl_checks import both_verdicts, by_id


@pytest.fixture(scope="module")
def tasks():
    return bfcl_tasks()


def step_calls(env, calls: list[ToolCall]) -> tuple[str, float]:
    t0 = time.monotonic()
    obs, _ = env.step("\n".join(format_tool_call(c) for c in calls))
    return obs, time.monotonic() - t0


def blow_up(rounds: int) -> list[ToolCall]:
    """``cp``/``mv`` share subtrees (bfcl-eval's own behaviour): each round doubles the paths
    under ``a`` (``du`` and ``find`` visit every path: 2**rounds)."""
    calls = [ToolCall("mkdir", {"dir_name": "a"})]
    for _ in range(rounds):
        calls += [
            ToolCall("cp", {"source": "a", "destination": "b"}),
            ToolCall("mkdir", {"dir_name": "c"}),
            ToolCall("mv", {"source": "a", "destination": "c"}),
            ToolCall("mv", {"source": "b", "destination": "c"}),
            ToolCall("mv", {"source": "c", "destination": "a"}),
        ]
    return calls


def test_logarithm_with_a_numeric_string_precision_ends_at_once(tasks):
    task = next(t for t in tasks if "MathAPI" in t.spec["involved_classes"])
    env = make_env(task)
    env.reset(task)
    for precision in ("100000000", "400000", " 1e8 ", "nan"):
        args = {"value": 7, "base": 3, "precision": precision}
        obs, took = step_calls(env, [ToolCall("logarithm", args)])
        assert obs.startswith("Error during execution: precision=") and "limit" in obs, obs
        assert took < 1.0
    obs, _ = step_calls(env, [ToolCall("logarithm", {"value": 7, "base": 3, "precision": "30"})])
    assert "1.7712437491614222600679283070" in obs  # a small precision as a string still works


def test_du_and_find_on_a_shared_subtree_graph_end_within_the_limit(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    limit = 1.0
    env = BfclEnv(limits=BackendLimits(call_time_limit_s=limit, call_memory_bytes=512 << 20))
    env.reset(task)
    obs, took = step_calls(env, blow_up(40))  # 201 calls in one step (each is fast)
    assert obs.count("\n") == 200 and "Error" not in obs and took < 5
    for name in ("du", "find"):
        obs, took = step_calls(env, [ToolCall(name, {})])
        assert obs.startswith("Error during execution: the call ran past the "), obs
        # The limit, then the kill, a fresh worker and the replay of the 201 earlier calls.
        assert took < limit + 3.0, (name, took)
    # The stopped calls are undone, the others kept: the episode goes on from its state.
    obs, _ = step_calls(env, [ToolCall("ls", {}), ToolCall("cd", {"folder": "a"})])
    assert obs.splitlines()[0] == '{"current_directory_content": ["document", "archive", "a"]}'
    obs, _ = step_calls(env, [ToolCall("ls", {})])
    assert obs == '{"current_directory_content": ["a", "b"]}'
    assert env.backend_overruns == 2
    env.step("I am done with this request.")
    rest = [[[c] for c in calls] for calls in ground_truth_calls(task.spec)[1:]]
    for turn in rest:
        for calls in turn:
            step_calls(env, calls)
        env.step("I am done with this request.")
    # Judged as bfcl-eval judges the episode without the two stopped calls (in bfcl-eval they
    # would never return; their error results cannot match a ground-truth result).
    first = [
        blow_up(40),
        [ToolCall("ls", {}), ToolCall("cd", {"folder": "a"})],
        [ToolCall("ls", {})],
    ]
    mirror, official = both_verdicts(task, [first, *rest])
    assert env.success == official["valid"] is False
    assert env.turn_errors == mirror.turn_errors and env.verdicts() == mirror.verdicts()
    assert next(e for e in env.turn_errors if e) == official["error_type"]
    env.close()


def test_memory_limit_stops_a_call_and_the_episode_goes_on(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env = BfclEnv(limits=BackendLimits(call_time_limit_s=30.0, call_memory_bytes=256 << 20))
    env.reset(task)
    step_calls(env, blow_up(40))
    obs, took = step_calls(env, [ToolCall("find", {})])
    assert (
        obs == "Error during execution: the call ran past the 256 MiB memory limit and was stopped"
    )
    assert took < 15
    assert step_calls(env, [ToolCall("pwd", {})])[0].endswith('/workspace"}')
    env.close()


def test_a_step_stops_running_calls_once_its_time_budget_is_spent(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env = BfclEnv(limits=BackendLimits(call_time_limit_s=1.0), step_time_limit_s=0.5)
    env.reset(task)
    step_calls(env, blow_up(40))
    obs, took = step_calls(env, [ToolCall("du", {}), ToolCall("pwd", {}), ToolCall("ls", {})])
    lines = obs.splitlines()
    assert lines[0].startswith("Error during execution: the call ran past the 1 s limit")
    assert (
        lines[1:] == ["Error during execution: not run: this step's calls took more than 0.5 s"] * 2
    )
    assert took < 4
    env.close()


def test_a_turn_of_34_parallel_calls_agrees_with_bfcl_evals_checker(tasks):
    # multi_turn_long_context_38 / _46: a turn whose ground truth is 34 calls, sent in one step.
    for entry in ("multi_turn_long_context_38", "multi_turn_long_context_46"):
        task = by_id(tasks, entry)
        gt = ground_truth_calls(task.spec)
        assert max(len(c) for c in gt) == 34
        steps = [[calls] if calls else [] for calls in gt]  # each turn's calls in one step
        env, official = both_verdicts(task, steps)
        assert env.success == official["valid"] is True, (entry, env.turn_errors, official)


def test_a_worker_killed_from_outside_is_replaced_and_the_state_replayed(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env = BfclEnv()
    env.reset(task)
    step_calls(env, [ToolCall("cd", {"folder": "document"})])
    os.kill(env._backends._box[0].proc.pid, 9)
    obs, _ = step_calls(env, [ToolCall("pwd", {})])
    assert obs == "Error during execution: the call stopped the backend process"
    assert step_calls(env, [ToolCall("pwd", {})])[0].endswith('/workspace/document"}')
    env.close()


def test_a_failed_replay_loses_the_backends_and_fails_the_remaining_turns(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env = BfclEnv(limits=BackendLimits(call_time_limit_s=10.0))
    env.reset(task)
    step_calls(env, blow_up(19))
    obs, took = step_calls(env, [ToolCall("du", {})])  # about 0.5 s: under the limit
    assert obs.startswith('{"disk_usage"') and took > 0.1
    # A tighter limit now: the next overrun's replay cannot redo the du in time.
    env._backends.limits = BackendLimits(call_time_limit_s=min(took / 4, 0.2))
    obs, _ = step_calls(env, [ToolCall("find", {})])
    assert obs.startswith("Error during execution: the call ran past")
    # The episode's state is unknown now: it ends there, every turn failed.
    assert env._backends.lost and env.done
    assert env.reward() == 0.0 and not env.success
    assert [v for v in env.verdicts() if v is not None] == [False] * 4
    assert env._backends.check(0, True) == (False, BACKEND_LOST)
    env.close()


def test_a_worker_that_dies_while_the_episode_is_restored_ends_it_in_an_observation(tasks):
    # The cp/mv DAG, then find(): the call is stopped, and the worker that replays the episode
    # dies too (here: an address space too small to start Python). step() returns BFCL's error
    # observation and ends the episode with reward 0; nothing raises; the next episode runs in
    # a fresh worker.
    task = by_id(tasks, "multi_turn_base_0")
    env = BfclEnv(limits=BackendLimits(call_time_limit_s=1.0))
    env.reset(task)
    step_calls(env, blow_up(40))
    stopped = env._backends._box[0].proc.pid
    env._backends.limits = BackendLimits(call_time_limit_s=1.0, call_memory_bytes=16 << 20)
    obs, done = env.step(format_tool_call(ToolCall("find", {})))
    assert obs == "Error during execution: the call ran past the 1 s limit and was stopped"
    assert done and env.done and env._backends.lost and env._backends._box == []
    assert env.reward() == 0.0 and not env.success and env.turn_errors[0] is None
    env._backends.limits = BackendLimits(call_time_limit_s=1.0)
    nxt = by_id(tasks, "multi_turn_base_1")
    assert env.reset(nxt) == nxt.instruction
    assert env._backends._box[0].proc.pid != stopped and not env._backends.lost
    obs, done = step_calls(env, [ToolCall("pwd", {})])
    assert obs == '{"current_working_directory": "/alex"}' and not env.done
    env.close()


def test_a_reset_on_a_broken_pooled_worker_starts_a_new_one(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env = BfclEnv(limits=BackendLimits(start_time_limit_s=5.0))
    env.reset(task)
    worker = env._backends._box[0]
    os.kill(worker.proc.pid, signal.SIGSTOP)  # alive, and never answers again
    env.close()  # back to the pool, which hands it out next
    again = BfclEnv(limits=BackendLimits(start_time_limit_s=5.0))
    again.reset(task)  # waits 5 s on the stopped worker, then loads in a new one
    assert again._backends._box[0] is not worker and not worker.alive()
    assert step_calls(again, [ToolCall("pwd", {})])[0].endswith('/workspace"}')
    again.close()


def _worker_pids() -> list[int]:
    me, found = os.getpid(), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"_bfcl_worker.py" in cmdline:
                found.append(int(pid))
    return found


def test_workers_are_reused_across_episodes_and_never_leak(tasks):
    counts = []
    for task in tasks[:30]:
        env = make_env(task)
        env.reset(task)
        step_calls(env, [ToolCall("pwd", {})])
        del env  # gives its worker back
        counts.append(len(_worker_pids()))
    assert counts == [counts[0]] * 30  # one worker served them all
    envs = [make_env(t) for t in tasks[:20]]
    for env, task in zip(envs, tasks):
        env.reset(task)
    assert len(_worker_pids()) >= 20
    held = len(_worker_pids()) - 20  # by envs of other tests still alive
    del envs, env
    assert len(_worker_pids()) <= 16 + held  # the pool keeps at most 16 idle workers


def test_bad_limits():
    with pytest.raises(ValueError, match="call_time_limit_s"):
        BackendLimits(call_time_limit_s=0)
    with pytest.raises(ValueError, match="step_time_limit_s"):
        BfclEnv(step_time_limit_s=0)
