"""The environment interface shared by the tool-use worlds and the coding sandbox.

An :class:`Env` runs one :class:`~lopd.types.Task` at a time as a multi-turn episode::

    env = make_env(task)
    first_user = env.reset(task)          # instruction (+ problem statement for coding)
    while True:
        text = policy(...)                # one assistant turn, raw model text
        obs, done = env.step(text)        # observation for the next turn
        if done:
            break
    r = env.reward()                      # in [0, 1], from the final state / the tests

Rendering conventions the rollout code relies on:

* ``system_prompt()`` is the system message (paper A.5 wording) and ``tools()`` the OpenAI-style
  function schemas to pass to the chat template (``[]`` for coding).
* Every observation returned by ``step`` of a tool-use env is the content of one ``tool`` message
  (Qwen3 renders it as ``<tool_response>...</tool_response>`` inside a user turn). This includes
  error observations (bad JSON, unknown tool, bad arguments, a turn without a tool call), so the
  conversation alternates strictly assistant / tool. When ``done`` is True the observation is
  final bookkeeping text and is not shown to the model. A multi-turn benchmark env (BFCL) sets
  ``observation_role = "user"`` after a step whose observation is the next user request; the
  rollout reads the attribute after every step and renders the observation with that role.
* Tool calls are parsed from the model text in Qwen3's format (see :func:`parse_tool_calls`).
"""

from __future__ import annotations

import abc
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from lopd.types import Task, TraceStep

TASK_COMPLETED = "Task Completed"
"""The answer that ends a tool-use episode (paper A.5)."""

TOOL_USE_SYSTEM_PROMPT = (
    "You are a helpful assistant. When given a specific task, your goal is to complete it in an "
    "interactive environment by making step-by-step use of available tools.\n"
    "- Before completing the task, at each step, select a tool from the tool list and fill in all "
    "required parameters, making sure that the values are valid. Avoid making parallel tool calls "
    "in one step.\n"
    "- When you believe the task has been completed, respond only with 'Task Completed' to end the "
    "trajectory, without adding any other content or making any tool calls.\n"
    "- It is recommended to first call query tools to gather sufficient information, then use "
    "modification tools to complete the task. Adjust actions promptly based on the feedback from "
    "the environment."
)
"""Agentic system prompt, verbatim from paper A.5."""

CODING_SYSTEM_PROMPT = (
    "You are an expert Python programmer. You will be given a question (problem specification) "
    "and will generate a correct Python program that matches the specification and passes all "
    "tests."
)
"""Coding system prompt, verbatim from paper A.5 (TACO / LiveCodeBench)."""


class ToolCallParseError(ValueError):
    """A ``<tool_call>`` block whose body is not a valid tool call.

    Raised by :func:`parse_tool_calls` for a block that is not valid JSON, is not a JSON object,
    lacks a string ``"name"``, has ``"arguments"`` that is not an object (a JSON string holding
    an object is accepted, as some chat templates emit it), or exceeds a limit (see
    :func:`parse_tool_calls`). The message is short, printable ASCII and safe to show to the
    model as an error observation.
    """


MAX_TOOL_CALLS = 32
"""Tool-call blocks read from one turn by default; more is a parse error. Each env sets its own
(:attr:`Env.max_tool_calls`): the tool-use worlds take one call per step, BFCL takes as many as
its benchmark admits (:data:`lopd.envs.bfcl.MAX_PARALLEL_CALLS`)."""
MAX_TOOL_CALL_CHARS = 65_536
"""Characters of one ``<tool_call>`` body."""
MAX_TOOL_NAME_CHARS = 128
"""Characters of a tool name."""
MAX_JSON_DEPTH = 32
"""Nesting depth of a tool call's JSON (the call object itself is depth 1)."""
MAX_NUMBER_CHARS = 64
"""Characters of one JSON number (Python's int parsing is quadratic and capped at 4,300 digits)."""
MAX_OBSERVATION_CHARS = 8_192
"""Characters of one tool observation; a longer one is cut (tool results are a few dozen tokens,
but an error may echo an argument the model wrote)."""

# C0/C1 control characters other than tab and newlines, and lone surrogates (a JSON "\ud800"
# escape decodes to one; it cannot be encoded as UTF-8, so no tokenizer accepts it).
_BAD_CHAR_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_text(text: str, limit: int | None = None) -> str:
    """``text`` made safe to tokenize and show: valid UTF-8, no control characters, bounded.

    Lone surrogates and control characters (other than tab, newline, carriage return) become
    U+FFFD; text over ``limit`` characters is cut with a note saying how long it was.
    """
    text = _BAD_CHAR_RE.sub("\ufffd", text)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... [cut: {len(text)} characters]"
    return text


def _parse_number(text: str) -> int | float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number longer than {MAX_NUMBER_CHARS} characters")
    value = float(text) if any(c in text for c in ".eE") else int(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _load_limited_json(text: str) -> Any:
    """``json.loads`` for model-written JSON, with the limits of :func:`parse_tool_calls`.

    Raises:
        ToolCallParseError: invalid JSON, a limit exceeded, or a string holding a control
            character or a lone surrogate.
    """
    try:
        obj = json.loads(
            text,
            parse_int=_parse_number,
            parse_float=_parse_number,
            parse_constant=_reject_constant,
        )
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"tool call is not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ToolCallParseError(f"tool call is nested deeper than {MAX_JSON_DEPTH}") from None
    except ValueError as e:
        raise ToolCallParseError(f"tool call is not valid JSON ({e})") from None
    # Iterative walk: depth and string contents (keys included).
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ToolCallParseError(f"tool call is nested deeper than {MAX_JSON_DEPTH}")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            bad = _BAD_CHAR_RE.search(value)
            if bad is not None:
                char = ord(bad.group())
                what = "a lone surrogate" if 0xD800 <= char <= 0xDFFF else "a control character"
                raise ToolCallParseError(
                    f"tool call contains {what} (U+{char:04X}) in a string; write plain text"
                )
    return obj


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call.

    Attributes:
        name: the tool (function) name.
        arguments: the keyword arguments, as decoded from JSON.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def render(self) -> str:
        """The call in the observation-lite trace format, e.g. ``find_customer(name="Lena Park")``.

        Values are JSON-encoded so the text is unambiguous and round-trips.
        """
        args = ", ".join(f"{k}={json.dumps(v)}" for k, v in self.arguments.items())
        return f"{self.name}({args})"

    def key(self) -> str:
        """Canonical text of the call (name + sorted arguments): repeated calls compare equal."""
        return self.name + json.dumps(self.arguments, sort_keys=True)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _split_blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], list[str]]:
    """Non-overlapping ``open ... close`` blocks, left to right, shortest match; linear time.

    Returns:
        ``(bodies, outside)``: the block bodies, and the text pieces around them.
    """
    bodies, outside = [], []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        end = -1 if start < 0 else text.find(close_tag, start + len(open_tag))
        if end < 0:
            # No further complete block: no close tag after any later open tag either.
            outside.append(text[pos:])
            return bodies, outside
        outside.append(text[pos:start])
        bodies.append(text[start + len(open_tag) : end])
        pos = end + len(close_tag)


def strip_thinking(text: str) -> str:
    """Remove Qwen3 ``<think>...</think>`` blocks (reasoning is never parsed as an action)."""
    return "".join(_split_blocks(text, _THINK_OPEN, _THINK_CLOSE)[1])


def parse_tool_calls(text: str, max_calls: int = MAX_TOOL_CALLS) -> list[ToolCall]:
    """Parse every tool call in one assistant turn.

    The format is Qwen3's (the one its chat template teaches)::

        <tool_call>
        {"name": "find_customer", "arguments": {"name": "Lena Park"}}
        </tool_call>

    ``<think>`` blocks are ignored. A final ``<tool_call>`` without its closing tag (generation
    stopped at the end-of-turn token before the tag) is parsed up to the end of the text. Runs in
    time linear in the text, whatever it holds.

    Limits (each a :class:`ToolCallParseError`, never another exception): at most
    ``max_calls`` blocks of at most :data:`MAX_TOOL_CALL_CHARS` characters, JSON nested
    at most :data:`MAX_JSON_DEPTH` deep, numbers of at most :data:`MAX_NUMBER_CHARS` characters
    (no NaN/Infinity), names of at most :data:`MAX_TOOL_NAME_CHARS` characters, and no control
    character or lone surrogate (a JSON ``"\\ud800"`` escape) in any string.

    Args:
        text: the raw assistant text of one turn.
        max_calls: tool-call blocks read from it (an env passes its :attr:`Env.max_tool_calls`).

    Returns:
        The calls in order of appearance; ``[]`` if the text has no ``<tool_call>`` block.

    Raises:
        ToolCallParseError: a block's body is not ``{"name": str, "arguments": object}`` JSON
            within the limits.
    """
    text = strip_thinking(text)
    bodies, outside = _split_blocks(text, _OPEN, _CLOSE)
    rest = "".join(outside)
    # An unclosed call: the first open tag with no close tag anywhere after it.
    last_close = rest.rfind(_CLOSE)
    tail = rest.find(_OPEN, last_close + len(_CLOSE) if last_close >= 0 else 0)
    if tail >= 0:
        bodies.append(rest[tail + len(_OPEN) :])
    if len(bodies) > max_calls:
        raise ToolCallParseError(
            f"{len(bodies)} tool calls in one turn (at most {max_calls} are read)"
        )
    calls = []
    for body in bodies:
        if len(body) > MAX_TOOL_CALL_CHARS:
            raise ToolCallParseError(
                f"tool call is {len(body)} characters long (at most {MAX_TOOL_CALL_CHARS})"
            )
        obj = _load_limited_json(body.strip())
        if not isinstance(obj, dict):
            raise ToolCallParseError("tool call must be a JSON object with 'name' and 'arguments'")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallParseError("tool call has no 'name' string")
        if len(name) > MAX_TOOL_NAME_CHARS:
            raise ToolCallParseError(
                f"tool call 'name' is {len(name)} characters long (at most {MAX_TOOL_NAME_CHARS})"
            )
        args = obj.get("arguments", {})
        if isinstance(args, str):
            # Some templates serialize arguments as a JSON string; accept it if it decodes.
            try:
                args = _load_limited_json(args) if args.strip() else {}
            except ToolCallParseError as e:
                if "not valid JSON" in str(e):
                    raise ToolCallParseError("tool call 'arguments' is not a JSON object") from None
                raise
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ToolCallParseError("tool call 'arguments' must be a JSON object")
        calls.append(ToolCall(name=name, arguments=args))
    return calls


def is_task_completed(text: str) -> bool:
    """Whether a turn without tool calls declares the end of the episode.

    Lenient on purpose: case-insensitive and anywhere in the (think-stripped) text, so a real model
    that adds a word of politeness still ends its episode; whether the task is actually done is
    for :meth:`Env.reward` to judge from the final state.
    """
    return TASK_COMPLETED.lower() in strip_thinking(text).lower()


class Env(abc.ABC):
    """One environment episode at a time (reset -> step* -> reward).

    Attributes:
        max_steps: assistant turns allowed per episode (30 for tool use, 1 for coding); the episode
            ends with ``done=True`` after this many steps.
        trace: observation-lite action -> result pairs of the episode so far (paper A.3); the
            experience bank stores it for successful episodes.
        num_steps: assistant turns taken (calls to :meth:`step`).
        num_tool_calls: parsed tool calls, valid or not (a parallel call counts each call).
        repeated_tool_calls: calls identical (name and arguments) to an earlier call of the episode.
        task: the current task (``None`` before the first :meth:`reset`).
        done: whether the current episode has ended.
    """

    max_steps: int = 30
    max_tool_calls: int = MAX_TOOL_CALLS
    """Tool-call blocks read from one assistant turn (more is a parse error)."""
    observation_role: str = "tool"
    """How the rollout renders the observation of the last step: ``"tool"`` or ``"user"``."""

    def __init__(self) -> None:
        self.task: Task | None = None
        self.done = False
        self.trace: list[TraceStep] = []
        self.num_steps = 0
        self.num_tool_calls = 0
        self.repeated_tool_calls = 0

    def _reset_stats(self, task: Task) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"task must be a lopd.types.Task, got {type(task).__name__}")
        self.task = task
        self.done = False
        self.trace = []
        self.num_steps = 0
        self.num_tool_calls = 0
        self.repeated_tool_calls = 0

    def _check_can_step(self) -> None:
        if self.task is None:
            raise RuntimeError("step() called before reset(task)")
        if self.done:
            raise RuntimeError("step() called after the episode ended (done=True); call reset()")

    @abc.abstractmethod
    def system_prompt(self) -> str:
        """The system message (paper A.5 wording for the domain)."""

    @abc.abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas (``{"type": "function", "function": {...}}``) or ``[]``."""

    @abc.abstractmethod
    def reset(self, task: Task) -> str:
        """Start an episode of ``task``; returns the first user message content."""

    @abc.abstractmethod
    def step(self, model_text: str) -> tuple[str, bool]:
        """Apply one assistant turn; returns ``(observation, done)``.

        Raises:
            RuntimeError: before :meth:`reset` or after the episode ended.
        """

    @abc.abstractmethod
    def reward(self) -> float:
        """The verifier reward in ``[0, 1]`` of the current episode state."""

    def stats(self) -> dict[str, int]:
        """Episode statistics for evaluation (paper Table 3)."""
        return {
            "num_steps": self.num_steps,
            "num_tool_calls": self.num_tool_calls,
            "repeated_tool_calls": self.repeated_tool_calls,
        }
