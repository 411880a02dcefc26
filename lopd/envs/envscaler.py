"""EnvScaler environments as a world: the class code and the checks run only in the sandbox.

A task of world ``"envscaler"`` (:mod:`lopd.envs.envscaler_spec`; EnvScaler's release is read by
:mod:`lopd.envs.envscaler_release`) carries the source of a Python class whose public methods are
the tools and whose attributes are the state, the initial state and the checks. Neither the class
code nor the check code ever runs in this process: every operation is a run of
:mod:`lopd.envs._envscaler_runner` in the sandbox (:mod:`lopd.envs.sandbox`; what it contains:
``docs/sandbox.md``), and the state travels between runs as a pickle that only the sandbox reads.

* ``reset``: one run builds the instance as EnvScaler's ``init_env_instance`` does; its state is
  the initial state (the checks' ``initial_state``). If the class cannot be built (the code
  raises, the constructor fails) the episode is *broken*: its first step ends it with the reason
  and it scores 0 (a dataset bug costs that task, not the run).
* each tool call: one run rebuilds the instance from the last state (without ``__init__``),
  calls the method and returns its result as EnvScaler renders it (``str(result)``), or
  ``Error: <exception>`` if it raised (the episode goes on, the state is what the instance holds
  after the exception). The state snapshot after every step is kept (:attr:`EnvScalerEnv.
  snapshots`, a JSON view). A call past the wall-clock or memory limit (:class:`EnvScalerLimits`)
  is stopped and undone: the state stays the snapshot of the last completed call (the same
  guarantee as BFCL's undo-by-replay, without replaying: EnvScaler's classes draw ids and
  timestamps from ``uuid``/``time``, so a replay would not reproduce them), and the observation
  is ``Error: the call ran past the 5 s limit and was stopped``.
* ``reward``: each check runs in its own sandboxed process (a ``run_sequence``), with EnvScaler's
  globals (``initial_state``) and ``check_func(final_state)`` on private copies; reward = checks
  held / checks, continuous in [0, 1] (the paper's EnvScaler reward). A check that raises, runs
  past its limit, returns a non-bool or reaches outside its states (a file, a process, a socket,
  this program's frames, a new import: an audit hook stops it) fails, and the reason is in
  :attr:`EnvScalerEnv.check_results` and in the episode record.

Turn rules (EnvScaler's non-conversational environment, ``envscaler_env/rl_non_conv_env.py``):
a turn with ``<tool_call>`` blocks runs the first call (EnvScaler runs the first; a note says how
many others were not run); a malformed call is an error observation; a turn without a tool call
ends the episode ("Task Completed" is what the system prompt asks for; EnvScaler ends on any text
turn); a name that is not a public method of the class is ``Error: unknown tool``. The system
prompt is the paper's (A.5) followed by the environment's introduction and rules, as EnvScaler's
agent builds it. Differences from EnvScaler's runner: a tool exception is an observation (EnvScaler
ends the episode with it), and an episode cut by the step limit is scored on its final state
(EnvScaler's runner gives it 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lopd.envs.base import (
    MAX_OBSERVATION_CHARS,
    TASK_COMPLETED,
    TOOL_USE_SYSTEM_PROMPT,
    Env,
    ToolCall,
    ToolCallParseError,
    clean_text,
    parse_tool_calls,
)
from lopd.envs.envscaler_spec import WORLD, validate_spec
from lopd.envs.sandbox import SandboxLimits, SandboxResult, run_sandboxed, run_sequence
from lopd.envs.tool_use import format_tool_call
from lopd.types import Task, TraceStep

__all__ = [
    "WORLD",
    "CheckResult",
    "EnvScalerEnv",
    "EnvScalerLimits",
    "oracle_actions",
    "system_prompt_for",
]

_RUNNER = Path(__file__).with_name("_envscaler_runner.py").read_text(encoding="utf-8")
TRACE_RESULT_CHARS = 1_000
"""Characters of a result kept in the observation-lite trace (experience bank)."""


@dataclass(frozen=True)
class EnvScalerLimits:
    """Limits of the sandboxed runs of one EnvScaler episode.

    Attributes:
        call_time_limit_s: wall-clock seconds of one tool call's run (the interpreter's start,
            about 0.1 s, included), and of ``reset``.
        check_time_limit_s: wall-clock seconds of one check's run.
        memory_bytes: address space of each run (``RLIMIT_AS``).
    """

    call_time_limit_s: float = 5.0
    check_time_limit_s: float = 5.0
    memory_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("call_time_limit_s", "check_time_limit_s", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EnvScalerLimits.{name} must be > 0, got {getattr(self, name)}")

    def sandbox(self, wall_s: float) -> SandboxLimits:
        return SandboxLimits(
            wall_time_s=wall_s,
            cpu_time_s=max(1, math.ceil(wall_s)),
            memory_bytes=self.memory_bytes,
            file_size_bytes=64 << 20,  # the answer: a pickled state and its JSON view
        )


class CheckResult(NamedTuple):
    """One check of an episode's reward.

    Attributes:
        item: the check's ``check_item`` text.
        held: whether it held on the final state.
        reason: why it failed without a verdict of its own (it raised, ran past its limit,
            returned a non-bool, reached outside its states), else ``None``.
    """

    item: str
    held: bool
    reason: str | None


class _Stopped(NamedTuple):
    why: str


def _answer(result: SandboxResult) -> dict[str, Any] | None:
    """The runner's JSON answer (its last line), or None if it gave none."""
    for line in reversed(result.stdout.splitlines()):
        if line.strip():
            try:
                answer = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                return None
            return answer if isinstance(answer, dict) else None
    return None


def system_prompt_for(spec: dict[str, Any]) -> str:
    """The paper's agentic prompt (A.5), then the environment's introduction and rules."""
    rules = "".join(f"- {r}\n" for r in spec["constraints_rules"])
    intro = (
        f"# Environment\n\n## Introduction\n{spec['environment_introduction']}\n\n"
        f"## Rules and constraints\n{rules}"
    )
    return f"{TOOL_USE_SYSTEM_PROMPT}\n\nThe environment you work in:\n{intro}".rstrip()


def _tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = dict(tool["function"])
    params = fn.get("parameters")
    if not isinstance(params, dict):
        fn["parameters"] = {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


class EnvScalerEnv(Env):
    """One EnvScaler task as an episode (see the module docstring).

    Attributes:
        snapshots: the state (a JSON view) after reset and after every step.
        check_results: per check, whether it held and why not (after :meth:`reward`).
        broken: why the environment could not be built or carried on, else ``None``.
        stopped_calls: calls of this episode stopped at a limit.

    Args:
        max_steps: assistant turns per episode (paper Table 5: 30).
        limits: the sandboxed runs' limits.
    """

    max_steps = 30

    def __init__(self, max_steps: int = 30, limits: EnvScalerLimits | None = None) -> None:
        super().__init__()
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self.limits = limits or EnvScalerLimits()
        self.snapshots: list[Any] = []
        self.check_results: list[CheckResult] = []
        self.broken: str | None = None
        self.stopped_calls = 0
        self._spec: dict[str, Any] = {}
        self._tools: list[dict[str, Any]] = []
        self._methods: set[str] = set()
        self._initial: str | None = None
        self._state: str | None = None
        self._view: Any = None
        self._version = 0
        self._scored: tuple[int, float] | None = None
        self._seen: set[str] = set()

    # ------------------------------------------------------------------ interface
    def system_prompt(self) -> str:
        if self.task is None:
            raise RuntimeError("system_prompt() needs a task: call reset(task) first")
        return system_prompt_for(self._spec)

    def tools(self) -> list[dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("tools() needs a task: call reset(task) first")
        return self._tools

    def reset(self, task: Task) -> str:
        self._reset_stats(task)
        if task.domain != "tool_use" or task.world != WORLD:
            raise ValueError(f"task {task.task_id} is not an EnvScaler task (world {task.world!r})")
        validate_spec(task.spec)
        self._spec = task.spec
        self._tools = [_tool_schema(t) for t in task.spec["tools"]]
        self.snapshots, self.check_results = [], []
        self.broken, self.stopped_calls = None, 0
        self._initial = self._state = self._view = None
        self._methods, self._seen = set(), set()
        self._version, self._scored = 0, None
        payload = {
            "code": task.spec["env_class_code"],
            "class_name": task.spec["env_class_name"],
            "init_config": task.spec["init_config"],
        }
        answer = self._run("reset", payload)
        if isinstance(answer, _Stopped):
            self.broken = f"the environment could not be built: {answer.why}"
        elif not answer.get("ok"):
            self.broken = f"the environment could not be built: {answer.get('error')}"
        else:
            self._initial = self._state = answer["state"]
            self._methods = set(answer["tools"])
            self._view = json.loads(answer["view"])
            self.snapshots.append(self._view)
        return task.instruction

    def step(self, model_text: str) -> tuple[str, bool]:
        """One turn (module docstring); ``snapshots`` gains the state after it."""
        self._check_can_step()
        self.num_steps += 1
        try:
            calls = parse_tool_calls(model_text, self.max_tool_calls)
        except ToolCallParseError as e:
            self.num_tool_calls += 1
            obs = f"Error: {e}"
        else:
            self.num_tool_calls += len(calls)
            if not calls:
                self.done = True
                return "", True
            obs = self._execute(calls[0])
            if len(calls) > 1:
                obs += f"\n(only the first of the {len(calls)} tool calls was run: one per step)"
        if self.broken is not None:
            self.done = True
        if self.num_steps >= self.max_steps:
            self.done = True
        self.snapshots.append(self._view)
        return obs, self.done

    def reward(self) -> float:
        """Checks held / checks on the current state (0 for a broken episode)."""
        if self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        if self._scored is not None and self._scored[0] == self._version:
            return self._scored[1]
        checks = self._spec["checklist_with_func"]
        if self._state is None:
            why = self.broken or "no state"
            self.check_results = [CheckResult(c.get("check_item", ""), False, why) for c in checks]
        else:
            self.check_results = self._run_checks(checks)
        value = sum(r.held for r in self.check_results) / len(checks)
        self._scored = (self._version, value)
        return value

    @property
    def success(self) -> bool:
        """Every check held."""
        return self.reward() >= 1.0

    def episode_record(self) -> dict[str, Any]:
        """What the evaluation keeps of the episode: the checks, the breakage, stopped calls."""
        self.reward()
        record: dict[str, Any] = {
            "checks": [r._asdict() for r in self.check_results],
            "stopped_calls": self.stopped_calls,
        }
        if self.broken is not None:
            record["broken"] = self.broken
        return record

    # ------------------------------------------------------------------ internals
    def _run(self, op: str, payload: dict[str, Any]) -> dict[str, Any] | _Stopped:
        wall = self.limits.call_time_limit_s
        result = run_sandboxed(
            ["runner.py", op],
            {"runner.py": _RUNNER, "payload.json": json.dumps(payload)},
            limits=self.limits.sandbox(wall),
        )
        if result.timed_out:
            return _Stopped(f"the call ran past the {wall:g} s limit and was stopped")
        answer = _answer(result)
        if answer is None:
            return _Stopped(f"the call stopped its process (exit status {result.returncode})")
        if not answer.get("ok") and str(answer.get("error", "")).startswith("MemoryError"):
            mib = self.limits.memory_bytes >> 20
            return _Stopped(f"the call ran past the {mib} MiB memory limit and was stopped")
        return answer

    def _execute(self, call: ToolCall) -> str:
        key = call.key()
        if key in self._seen:
            self.repeated_tool_calls += 1
        self._seen.add(key)
        if self.broken is not None:
            obs = f"Error: {self.broken}"
        elif call.name not in self._methods:
            obs = f"Error: unknown tool '{call.name}'"
        else:
            obs = self._call(call)
        obs = clean_text(obs, MAX_OBSERVATION_CHARS)
        self.trace.append(
            TraceStep(action=clean_text(call.render()), result=clean_text(obs, TRACE_RESULT_CHARS))
        )
        return obs

    def _call(self, call: ToolCall) -> str:
        payload = {
            "code": self._spec["env_class_code"],
            "class_name": self._spec["env_class_name"],
            "state": self._state,
            "name": call.name,
            "arguments": call.arguments,
        }
        answer = self._run("call", payload)
        if isinstance(answer, _Stopped):
            self.stopped_calls += 1
            return f"Error: {answer.why}"
        if not answer.get("ok"):
            # The state could not be carried on (unpicklable, too large): the call is undone.
            return f"Error: {answer.get('error')}"
        if answer.get("unknown"):
            return f"Error: unknown tool '{call.name}'"
        self._state = answer["state"]
        self._version += 1
        self._view = json.loads(answer["view"])
        if answer.get("error") is not None:
            return f"Error: {answer['error']}"
        return str(answer.get("result"))

    def _run_checks(self, checks: list[dict[str, Any]]) -> list[CheckResult]:
        payload = {
            "code": self._spec["env_class_code"],
            "class_name": self._spec["env_class_name"],
            "initial": self._initial,
            "final": self._state,
            "checks": [c["check_func"] for c in checks],
        }
        wall = self.limits.check_time_limit_s
        runs = [(["runner.py", "check", str(i)], "") for i in range(len(checks))]
        results = run_sequence(
            runs,
            {"runner.py": _RUNNER, "payload.json": json.dumps(payload)},
            self.limits.sandbox(wall),
        )
        out = []
        for check, result in zip(checks, results):
            item = check.get("check_item", "")
            answer = _answer(result)
            if result.timed_out:
                out.append(CheckResult(item, False, f"it ran past the {wall:g} s limit"))
            elif answer is None or "held" not in answer:
                why = (answer or {}).get("error") or f"exit status {result.returncode}"
                out.append(CheckResult(item, False, f"it stopped its process ({why})"))
            else:
                out.append(CheckResult(item, answer["held"] is True, answer.get("reason")))
        return out


def oracle_actions(task: Task) -> list[str]:
    """The task's oracle calls (``spec["oracle"]``), one per turn, then ``Task Completed``.

    Raises:
        ValueError: the task carries no oracle (EnvScaler's release has none).
    """
    oracle = task.spec.get("oracle")
    if oracle is None:
        raise ValueError(f"task {task.task_id} has no 'oracle' in its spec")
    calls = [ToolCall(c["name"], dict(c.get("arguments", {}))) for c in oracle]
    return [format_tool_call(c) for c in calls] + [TASK_COMPLETED]
