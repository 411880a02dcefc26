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
``site-packages`` on import); calls of ``MathAPI`` that would run for hours (huge exponents,
precisions or rounding digits; BFCL's data uses none) are refused with an error result; the
global ``mpmath`` / ``decimal`` precision a call sets is restored after it (BFCL leaks it into
later calls); each instance owns its state (BFCL's ``_load_scenario`` links module-level
long-context records into every instance, so a call that changes one changes it for the ground
truth and for later entries too); the tool schemas are BFCL's docs with JSON-schema types
(``dict`` -> ``object``, ``float`` -> ``number``), wrapped as OpenAI functions for the chat
template; the results of a step's parallel calls form one observation, one result per line
(BFCL's Qwen handler sends one tool message each); a step with any malformed ``<tool_call>``
block counts as undecodable as a whole (BFCL's Qwen handler drops the bad blocks and runs the
others).

Tasks, the train/test split (disjoint by scenario) and the tool schemas: :mod:`lopd.envs.bfcl_data`.
"""

from __future__ import annotations

import copy
import decimal
import functools
import importlib
import inspect
import json
from typing import Any

from lopd.envs.base import (
    TASK_COMPLETED,
    Env,
    ToolCall,
    ToolCallParseError,
    clean_text,
    parse_tool_calls,
)
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
    "BFCL_VERSION",
    "CATEGORIES",
    "SPLIT_SEED",
    "TEST_FRACTION",
    "WORLD",
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

# BFCL refuses these names before its eval (multi_turn_utils.execute_multi_turn_func_call).
_REFUSED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})
# MathAPI arguments past these bounds would run (effectively) forever in C code no signal can
# interrupt; the benchmark's data stays far below them.
_MATH_LIMITS = {"power": ("exponent", 10_000), "round_number": ("decimal_places", 10_000)}
_MATH_PRECISION_LIMIT = 10_000


@functools.cache
def _backend_class(name: str) -> tuple[type, tuple[str, ...]]:
    """A backend class and its public method names."""
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)
    methods = tuple(
        m for m, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not m.startswith("_")
    )
    return cls, methods


# --------------------------------------------------------------------------- backends


def format_result(result: Any) -> str:
    """A call's result as BFCL's executor renders it."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError, RecursionError):
            return str(result)
    return str(result)


class Backends:
    """The backend instances of one side (model or ground truth) of one episode.

    Args:
        involved_classes: class names (:data:`BACKEND_CLASSES`).
        initial_config: ``class name -> scenario`` (deep-copied before loading).
        long_context: BFCL's long-context flag (the backends add long distractor data).
    """

    def __init__(
        self, involved_classes: list[str], initial_config: dict[str, Any], long_context: bool
    ) -> None:
        from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

        self.instances: dict[str, Any] = {}
        self._methods: dict[str, tuple[str, Any]] = {}
        for name in involved_classes:
            cls, method_names = _backend_class(name)
            inst = cls()
            if name not in STATELESS_CLASSES:
                inst._load_scenario(
                    copy.deepcopy(initial_config.get(name, {})), long_context=long_context
                )
                # _load_scenario links module-level long-context records into the instance; a
                # private copy keeps one side's calls from changing the other's (or later
                # episodes') state.
                inst.__dict__.update(copy.deepcopy(inst.__dict__))
            self.instances[name] = inst
            for method_name in method_names:
                self._methods[method_name] = (name, getattr(inst, method_name))

    def has(self, name: str) -> bool:
        return name in self._methods

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """Run one call; never raises (a failure is an ``Error during execution: ...`` result)."""
        try:
            if name in _REFUSED_NAMES:
                raise Exception(f"Function call {name} is not allowed.")
            if name not in self._methods:
                raise NameError(f"name '{name}' is not defined")
            class_name, method = self._methods[name]
            if class_name == "MathAPI":
                _check_math_arguments(name, method, args, kwargs)
            with _isolated_precision():
                return format_result(method(*args, **kwargs))
        except Exception as e:
            return f"Error during execution: {e}"


def _check_math_arguments(name: str, method: Any, args: list, kwargs: dict) -> None:
    try:
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
    except TypeError:
        return  # the call itself reports the bad arguments
    limits = dict(_MATH_LIMITS)
    limits.setdefault(name, ("precision", _MATH_PRECISION_LIMIT))
    param, bound_value = limits[name]
    value = bound.get(param)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > bound_value:
        raise ValueError(
            f"{param}={value!r} is outside this environment's limit (|{param}| <= {bound_value})"
        )


class _isolated_precision:
    """Restore mpmath's and decimal's global precision after a call (MathAPI sets them)."""

    def __enter__(self) -> None:
        import mpmath

        self._dps = mpmath.mp.dps
        self._prec = decimal.getcontext().prec

    def __exit__(self, *exc: Any) -> None:
        import mpmath

        mpmath.mp.dps = self._dps
        decimal.getcontext().prec = self._prec


def ground_truth_calls(spec: dict[str, Any]) -> list[list[ToolCall]]:
    """The ground truth of every turn as keyword-argument tool calls (positional arguments of
    the data are bound to their parameter names)."""
    methods: dict[str, Any] = {}
    for name in spec["involved_classes"]:
        cls, method_names = _backend_class(name)
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


class BfclEnv(Env):
    """One BFCL multi-turn entry as an episode (turn rules in the module docstring).

    Attributes:
        turn_passed: per turn, ``True``/``False`` once checked, ``None`` for turns with an empty
            ground truth (not checked) and turns not yet finished.
        turn_errors: per turn, BFCL's error type of a failed check (e.g.
            ``multi_turn:instance_state_mismatch``), else ``None``.
        force_quit: the episode was ended by the per-turn step limit.

    Args:
        max_steps: assistant steps per episode (default: no cap beyond the per-turn limit).
        max_call_steps_per_turn: BFCL's ``MAXIMUM_STEP_LIMIT`` (20) by default.
        system_prompt: the system message; ``""`` (BFCL's FC mode: tools only).
    """

    def __init__(
        self,
        max_steps: int | None = None,
        max_call_steps_per_turn: int | None = None,
        system_prompt: str = "",
    ) -> None:
        super().__init__()
        require_bfcl()
        from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT

        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self._max_steps_arg = max_steps
        self.max_call_steps_per_turn = max_call_steps_per_turn or MAXIMUM_STEP_LIMIT
        self._system = system_prompt
        self._tools: list[dict[str, Any]] = []
        self.turn_passed: list[bool | None] = []
        self.turn_errors: list[str | None] = []
        self.force_quit = False

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
        self._model = Backends(spec["involved_classes"], spec["initial_config"], long_context)
        self._truth = Backends(spec["involved_classes"], spec["initial_config"], long_context)
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
        self._model_results: list[str] = []  # every model result so far (BFCL's response check)
        self._seen: set[str] = set()
        self._pending: tuple[Any, ...] | None = None
        return self._user_message(0)

    def step(self, model_text: str) -> tuple[str, bool]:
        self._check_can_step()
        self.num_steps += 1
        self.observation_role = "tool"
        try:
            calls = parse_tool_calls(model_text)
        except ToolCallParseError:
            # BFCL: a response that does not decode ends the turn.
            self.num_tool_calls += 1
            calls = []
        if calls:
            self.num_tool_calls += len(calls)
            self._turn_call_steps += 1
            self._turn_has_call = True
            results = [self._execute(c) for c in calls]
            if self._turn_call_steps > self.max_call_steps_per_turn:
                self.force_quit = True
                self._end_turn()
                self.done = True
                return "", True
            obs = "\n".join(results)
        else:
            self._end_turn()
            if self._finished == len(self.turn_passed):
                self.done = True
                return "", True
            obs = self._user_message(self._finished)
            self.observation_role = "user"
        if self.num_steps >= self.max_steps:
            self.done = True
        return clean_text(obs, MAX_OBSERVATION_CHARS), self.done

    def reward(self) -> float:
        """Fraction of the checked turns (non-empty ground truth) that passed.

        The turn in progress when the episode stopped (step budget, token budget) is checked as
        it stands, on a copy of the ground-truth instances; turns never reached fail.
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
        from bfcl_eval.constants.default_prompts import (
            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
        )

        if turn in self._held_out:
            functions = json.dumps(self._held_out[turn])
            return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=functions)
        return turn_text(self.task.spec["question"][turn])

    def _execute(self, call: ToolCall) -> str:
        key = call.key()
        if key in self._seen:
            self.repeated_tool_calls += 1
        self._seen.add(key)
        result = self._model.call(call.name, [], dict(call.arguments))
        self._model_results.append(result)
        trace_result = clean_text(result, TRACE_RESULT_CHARS)
        self.trace.append(TraceStep(action=clean_text(call.render()), result=trace_result))
        return result

    def _check(self, turn: int, truth: Backends, model_results: list[str], had_call: bool) -> tuple:
        """BFCL's checks of one finished turn (advances ``truth`` by the turn's ground truth)."""
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
            response_checker,
            state_checker,
        )

        gt_calls = self.task.spec["ground_truth"][turn]
        gt_results = [truth.call(*parse_call_string(c)) for c in gt_calls]
        if not gt_calls:
            return None, None
        if not had_call:
            return False, "multi_turn:empty_turn_model_response"
        for check in (
            state_checker(self._model.instances, truth.instances),
            response_checker(model_results, gt_results, turn),
        ):
            if not check["valid"]:
                return False, check["error_type"]
        return True, None

    def _end_turn(self) -> None:
        k = self._finished
        self.turn_passed[k], self.turn_errors[k] = self._check(
            k, self._truth, self._model_results, self._turn_has_call
        )
        self._finished += 1
        self._turn_call_steps = 0
        self._turn_has_call = False

    def _final_turns(self) -> tuple[list[bool | None], bool]:
        """Per-turn verdicts with the turn in progress checked, and whether all were reached."""
        if self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        passed = list(self.turn_passed)
        n, k = len(passed), self._finished
        in_progress = k < n and not self.force_quit
        if in_progress:
            key = (k, len(self._model_results))
            if self._pending is None or self._pending[0] != key:
                truth = copy.deepcopy(self._truth)
                verdict = self._check(k, truth, list(self._model_results), self._turn_has_call)
                self._pending = (key, verdict)
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
