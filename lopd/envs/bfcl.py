"""BFCL v3 multi-turn (base, miss_func, miss_param, long_context) as tool-use tasks and an Env.

Everything benchmark-specific comes from the ``bfcl-eval`` package (2026.3.23, Apache-2.0; its
v4 release ships the v3 multi-turn sets under ``BFCL_v4_multi_turn_*`` names): the 4 x 200
entries, their ground truth, the function docs of the 8 backend classes and the backends
themselves (``GorillaFileSystem``, ``MathAPI``, ``MessageAPI``, ``TwitterAPI``, ``TicketAPI``,
``TradingBot``, ``TravelAPI``, ``VehicleControlAPI``). Install it without its dependencies (its
hard pins clash with ours; the backends need only ``mpmath``)::

    pip install "lopd[bfcl]" && pip install --no-deps bfcl-eval==2026.3.23

What follows BFCL's own code (``bfcl_eval.model_handler.base_handler`` for the inference loop,
``bfcl_eval.eval_checker.multi_turn_eval`` for the verdict):

* Per episode, fresh backend instances for the model and for the ground truth, each loaded with
  ``_load_scenario(initial_config[class], long_context=...)``. A call is dispatched to the public
  method of that name (later classes win a name clash, as in BFCL) with ``getattr``: model text
  is never evaluated. Results are rendered like BFCL (``str`` as is, ``dict`` as JSON, else
  ``str(result)``; an exception is ``Error during execution: <message>``).
* User turns are fed in order. Within a turn, every assistant step with tool calls is executed
  and answered with the results; a step without a tool call (any text, ``Task Completed``
  included) or with an undecodable one ends the turn, and the next user message follows as a
  ``user`` observation. A ``miss_func`` held-out turn (empty in the data) is BFCL's prompting
  message with the held-out function docs (``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_
  PROMPTING``), so the tool list of the system turn never changes mid-episode. More than
  BFCL's ``MAXIMUM_STEP_LIMIT`` (20) call steps in one turn force-quits the episode.
* At the end of each turn with a non-empty ground truth, the official checks, imported from
  ``multi_turn_checker``: the turn must hold a step with a call, ``state_checker`` compares every
  public attribute of the model's instances with the ground truth's, and ``response_checker``
  requires the ground-truth results of the turn among all the model's results so far. Turns
  whose ground truth is empty (the model cannot act yet) are not checked, as in BFCL.

Reward = fraction of the checked turns that pass (a turn never reached fails); ``success`` =
every checked turn passed and every turn was reached, which is BFCL's binary entry verdict
(``valid``). Category score = 100 x mean success.

Deliberate differences from ``bfcl-eval``'s runner, none of which changes a verdict on its data:
the data is read without its loader (which takes file locks and creates directories inside
``site-packages`` on import); the backends run in a worker process per episode
(:mod:`lopd.envs.bfcl_backends`), every call under a wall-clock limit (5 s) and a memory limit (2
GiB), and a call past either is stopped, undone, and answered with BFCL's error observation
(``Error during execution: the call ran past the 5 s limit and was stopped``), the turn then judged
as bfcl-eval judges a call that failed (if the episode's state cannot be restored after it, the
episode ends there with that observation and reward 0); the calls of one step stop running once
they have taken 30
s together (the rest are answered ``Error during execution: not run: ...``); calls of ``MathAPI``
that would run for hours (huge exponents, precisions or rounding digits, numeric strings included;
BFCL's data uses none) are refused with an error result at once; at most :data:`MAX_PARALLEL_CALLS`
calls are read from one step (bfcl-eval has no cap; its ground truth needs 34 in a turn); the
global ``mpmath`` / ``decimal`` precision a call sets is restored after it (BFCL leaks it into
later calls); each instance owns its state (BFCL's ``_load_scenario`` links module-level
long-context records into every instance, so a call that changes one changes it for the ground
truth and for later entries too); the tool schemas are BFCL's docs with JSON-schema types (``dict``
-> ``object``, ``float`` -> ``number``), wrapped as OpenAI functions for the chat template; the
results of a step's parallel calls form one observation, one result per line (BFCL's Qwen handler
sends one tool message each); a step with any malformed ``<tool_call>`` block counts as undecodable
as a whole (BFCL's Qwen handler drops the bad blocks and runs the others).

Tasks, the train/test split (disjoint by scenario) and the tool schemas: :mod:`lopd.envs.bfcl_data`.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Any

from lopd.envs._bfcl_worker import Backends, backend_class, format_result
from lopd.envs.base import (
    TASK_COMPLETED,
    Env,
    ToolCall,
    ToolCallParseError,
    clean_text,
    parse_tool_calls,
)
from lopd.envs.bfcl_backends import BACKEND_LOST, LOST_TEXT, BackendLimits, EpisodeBackends
from lopd.envs.bfcl_data import (
    BACKEND_CLASSES,
    BFCL_VERSION,
    CATEGORIES,
    SPLIT_SEED,
    TEST_FRACTION,
    WORLD,
    bfcl_tasks,
    entry_tools,
    load_entries,
    parse_call_string,
    require_bfcl,
    scenario_index,
    scenario_split,
    task_from_entry,
    tool_schema,
    turn_text,
    validate_spec,
)
from lopd.envs.tool_use import format_tool_call
from lopd.types import Task, TraceStep

__all__ = [
    "BACKEND_CLASSES",
    "BACKEND_LOST",
    "BFCL_VERSION",
    "CATEGORIES",
    "MAX_PARALLEL_CALLS",
    "SPLIT_SEED",
    "TEST_FRACTION",
    "WORLD",
    "BackendLimits",
    "Backends",
    "BfclEnv",
    "bfcl_tasks",
    "entry_tools",
    "format_result",
    "ground_truth_calls",
    "load_entries",
    "oracle_actions",
    "parse_call_string",
    "require_bfcl",
    "scenario_index",
    "scenario_split",
    "task_from_entry",
    "tool_schema",
    "validate_spec",
]

MAX_OBSERVATION_CHARS = 32_768
"""Characters of one observation shown to the model (long-context results run to a few
thousand; the verdict always uses the full results)."""
TRACE_RESULT_CHARS = 1_000
"""Characters of a result kept in the observation-lite trace (experience bank)."""

MAX_PARALLEL_CALLS = 256
"""Calls read from one assistant step (bfcl-eval reads them all; its ground truth needs up to 34
in one turn, and a 4,096-token step holds fewer than 256)."""
STEP_TIME_LIMIT_S = 30.0
"""Seconds the calls of one step may take together; later calls of the step are not run."""


def ground_truth_calls(spec: dict[str, Any]) -> list[list[ToolCall]]:
    """The ground truth of every turn as keyword-argument tool calls (positional arguments of
    the data are bound to their parameter names)."""
    methods: dict[str, Any] = {}
    for name in spec["involved_classes"]:
        cls, method_names = backend_class(name)
        methods.update({m: getattr(cls, m) for m in method_names})
    turns = []
    for calls in spec["ground_truth"]:
        out = []
        for text in calls:
            name, args, kwargs = parse_call_string(text)
            bound = inspect.signature(methods[name]).bind(None, *args, **kwargs).arguments
            bound.pop(next(iter(bound)))  # self
            out.append(ToolCall(name, dict(bound)))
        turns.append(out)
    return turns


# --------------------------------------------------------------------------- the env


def _clip(prefix: str, length: int, limit: int) -> str:
    """``clean_text(result, limit)`` from the result's first ``>= limit`` characters and its
    length (the full result stays in the backend worker)."""
    if length <= limit:
        return clean_text(prefix)
    return f"{clean_text(prefix[:limit])}... [cut: {length} characters]"


class BfclEnv(Env):
    """One BFCL multi-turn entry as an episode (turn rules in the module docstring).

    Attributes:
        turn_passed: per turn, ``True``/``False`` once checked, ``None`` for turns with an empty
            ground truth (not checked) and turns not yet finished.
        turn_errors: per turn, BFCL's error type of a failed check (e.g.
            ``multi_turn:instance_state_mismatch``), else ``None``.
        force_quit: the episode was ended by the per-turn step limit.
        max_tool_calls: calls read from one step (:data:`MAX_PARALLEL_CALLS`).

    Args:
        max_steps: assistant steps per episode (default: no cap beyond the per-turn limit).
        max_call_steps_per_turn: BFCL's ``MAXIMUM_STEP_LIMIT`` (20) by default.
        system_prompt: the system message; ``""`` (BFCL's FC mode: tools only).
        limits: time and memory limit of each backend call (:class:`BackendLimits`).
        step_time_limit_s: seconds the calls of one step may take together.
    """

    max_tool_calls = MAX_PARALLEL_CALLS

    def __init__(
        self,
        max_steps: int | None = None,
        max_call_steps_per_turn: int | None = None,
        system_prompt: str = "",
        limits: BackendLimits | None = None,
        step_time_limit_s: float = STEP_TIME_LIMIT_S,
    ) -> None:
        super().__init__()
        require_bfcl()
        # bfcl-eval is optional (the [bfcl] extra): imported when a BFCL env is made.
        from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT

        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if not step_time_limit_s > 0:
            raise ValueError(f"step_time_limit_s must be > 0, got {step_time_limit_s}")
        self._max_steps_arg = max_steps
        self.max_call_steps_per_turn = max_call_steps_per_turn or MAXIMUM_STEP_LIMIT
        self.step_time_limit_s = step_time_limit_s
        self._system = system_prompt
        self._tools: list[dict[str, Any]] = []
        self._backends = EpisodeBackends(limits)
        self.turn_passed: list[bool | None] = []
        self.turn_errors: list[str | None] = []
        self.force_quit = False

    @property
    def limits(self) -> BackendLimits:
        return self._backends.limits

    @property
    def backend_overruns(self) -> int:
        """Backend requests of this env stopped at a limit so far."""
        return self._backends.overruns

    # ------------------------------------------------------------------ interface
    def system_prompt(self) -> str:
        return self._system

    def tools(self) -> list[dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("tools() needs a task: call reset(task) first")
        return self._tools

    def reset(self, task: Task) -> str:
        self._reset_stats(task)
        if task.domain != "tool_use" or task.world != WORLD:
            raise ValueError(f"task {task.task_id} is not a BFCL task (world {task.world!r})")
        spec = task.spec
        validate_spec(spec)
        # BFCL keys the flag on the entry id ("long_context" in its category part).
        long_context = "long_context" in str(spec["bfcl_id"])
        self._tools, self._held_out = entry_tools(spec)
        self._gt_calls = [[parse_call_string(c) for c in calls] for calls in spec["ground_truth"]]
        self._backends.reset(spec["involved_classes"], spec["initial_config"], long_context)
        n = len(spec["question"])
        self.max_steps = self._max_steps_arg or n * (self.max_call_steps_per_turn + 1)
        self.turn_passed = [None] * n
        self.turn_errors = [None] * n
        self.force_quit = False
        self.observation_role = "tool"
        self._finished = 0  # turns finished and checked; the next one is in progress
        self._turn_call_steps = 0
        self._turn_has_call = False
        self._in_progress_error: str | None = None
        self._num_results = 0  # model results so far (the worker holds them)
        self._seen: set[str] = set()
        self._pending: tuple[Any, ...] | None = None
        return self._user_message(0)

    def close(self) -> None:
        """Give the episode's backend worker back to the pool (``reset`` takes one again)."""
        self._backends.close()

    def step(self, model_text: str) -> tuple[str, bool]:
        self._check_can_step()
        self.num_steps += 1
        self.observation_role = "tool"
        try:
            calls = parse_tool_calls(model_text, self.max_tool_calls)
        except ToolCallParseError:
            # BFCL: a response that does not decode ends the turn.
            self.num_tool_calls += 1
            calls = []
        if calls:
            self.num_tool_calls += len(calls)
            self._turn_call_steps += 1
            self._turn_has_call = True
            results = self._execute_step(calls)
            if self._backends.lost:
                # A stopped call whose state could not be restored (the new worker died or
                # overran too): the episode ends with the error observation, reward 0.
                self.done = True
                joined = "\n".join(prefix for prefix, _ in results)
                total = sum(length for _, length in results) + len(results) - 1
                return _clip(joined, total, MAX_OBSERVATION_CHARS), True
            if self._turn_call_steps > self.max_call_steps_per_turn:
                self.force_quit = True
                self._end_turn()
                self.done = True
                return "", True
            joined = "\n".join(prefix for prefix, _ in results)
            total = sum(length for _, length in results) + len(results) - 1
            obs = _clip(joined, total, MAX_OBSERVATION_CHARS)
        else:
            self._end_turn()
            if self._backends.lost:  # the turn's ground truth or check lost the backends
                self.done = True
                return LOST_TEXT, True
            if self._finished == len(self.turn_passed):
                self.done = True
                return "", True
            obs = clean_text(self._user_message(self._finished), MAX_OBSERVATION_CHARS)
            self.observation_role = "user"
        if self.num_steps >= self.max_steps:
            self.done = True
        return obs, self.done

    def reward(self) -> float:
        """Fraction of the checked turns (non-empty ground truth) that passed.

        The turn in progress when the episode stopped (step budget, token budget) is checked as
        it stands, on a copy of the ground-truth instances; turns never reached fail. 0 when the
        episode's backends were lost (their state is unknown).
        """
        passed, _ = self._final_turns()
        checked = [p for p, gt in zip(passed, self.task.spec["ground_truth"]) if gt]
        return sum(bool(p) for p in checked) / len(checked) if checked else 0.0

    def verdicts(self) -> list[bool | None]:
        """Per turn: passed, failed (a turn never reached fails) or ``None`` (not checked: its
        ground truth is empty); the turn in progress is checked as it stands."""
        passed, _ = self._final_turns()
        return [p if gt else None for p, gt in zip(passed, self.task.spec["ground_truth"])]

    @property
    def success(self) -> bool:
        """BFCL's verdict on the episode: every turn reached, every checked turn passed."""
        passed, reached_all = self._final_turns()
        gts = self.task.spec["ground_truth"]
        return reached_all and all(p for p, gt in zip(passed, gts) if gt)

    # ------------------------------------------------------------------ internals
    def _user_message(self, turn: int) -> str:
        # bfcl-eval is optional (the [bfcl] extra).
        from bfcl_eval.constants.default_prompts import (
            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
        )

        if turn in self._held_out:
            functions = json.dumps(self._held_out[turn])
            return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=functions)
        return turn_text(self.task.spec["question"][turn])

    def _execute_step(self, calls: list[ToolCall]) -> list[tuple[str, int]]:
        """Run a step's calls in order until they have taken ``step_time_limit_s`` together."""
        t0 = time.monotonic()
        results = []
        for call in calls:
            if time.monotonic() - t0 < self.step_time_limit_s:
                results.append(self._execute(call))
                continue
            text = (
                f"Error during execution: not run: this step's calls took more than "
                f"{self.step_time_limit_s:g} s"
            )
            self._backends.note(text)
            self._record(call, text, len(text))
            results.append((text, len(text)))
        return results

    def _execute(self, call: ToolCall) -> tuple[str, int]:
        prefix, length = self._backends.call(call.name, dict(call.arguments), MAX_OBSERVATION_CHARS)
        self._record(call, prefix, length)
        return prefix, length

    def _record(self, call: ToolCall, prefix: str, length: int) -> None:
        key = call.key()
        if key in self._seen:
            self.repeated_tool_calls += 1
        self._seen.add(key)
        self._num_results += 1
        trace_result = _clip(prefix, length, TRACE_RESULT_CHARS)
        self.trace.append(TraceStep(action=clean_text(call.render()), result=trace_result))

    def _check(self, turn: int, pending: bool) -> tuple[bool | None, str | None]:
        """BFCL's checks of a turn (``pending``: the turn in progress, state left untouched)."""
        calls = self._gt_calls[turn]
        if not pending:
            self._backends.advance(turn, calls)
        if not calls:
            return None, None
        return self._backends.check(turn, self._turn_has_call, calls if pending else None)

    def _end_turn(self) -> None:
        k = self._finished
        self.turn_passed[k], self.turn_errors[k] = self._check(k, pending=False)
        self._finished += 1
        self._turn_call_steps = 0
        self._turn_has_call = False

    def _final_turns(self) -> tuple[list[bool | None], bool]:
        """Per-turn verdicts with the turn in progress checked, and whether all were reached."""
        if self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        passed = list(self.turn_passed)
        n, k = len(passed), self._finished
        if self._backends.lost:  # the episode's state is unknown: every turn fails
            return [False] * n, False
        in_progress = k < n and not self.force_quit
        if in_progress:
            key = (k, self._num_results)
            if self._pending is None or self._pending[0] != key:
                self._pending = (key, self._check(k, pending=True))
            passed[k], self._in_progress_error = self._pending[1]
        for j in range(k + int(in_progress), n):
            passed[j] = False  # never reached
        return passed, k == n or (in_progress and k == n - 1)


def oracle_actions(task: Task, calls_per_step: int = 16) -> list[str]:
    """Assistant turns that replay the ground truth: per user turn, its calls as parallel tool
    calls (at most ``calls_per_step`` per step), then ``Task Completed`` to end the turn."""
    actions = []
    for calls in ground_truth_calls(task.spec):
        for i in range(0, len(calls), calls_per_step):
            actions.append("\n".join(format_tool_call(c) for c in calls[i : i + calls_per_step]))
        actions.append(TASK_COMPLETED)
    return actions
