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
  final bookkeeping text and is not shown to the model.
* Tool calls are parsed from the model text in Qwen3's format (see :func:`parse_tool_calls`).
"""

from __future__ import annotations

import abc
import json
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
    lacks a string ``"name"``, or has ``"arguments"`` that is not an object (a JSON string holding
    an object is accepted, as some chat templates emit it). The message is short and safe to show
    to the model as an error observation.
    """


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


_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_UNCLOSED_RE = re.compile(r"<tool_call>(?!.*</tool_call>)(.*)\Z", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_thinking(text: str) -> str:
    """Remove Qwen3 ``<think>...</think>`` blocks (reasoning is never parsed as an action)."""
    return _THINK_RE.sub("", text)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Parse every tool call in one assistant turn.

    The format is Qwen3's (the one its chat template teaches)::

        <tool_call>
        {"name": "find_customer", "arguments": {"name": "Lena Park"}}
        </tool_call>

    ``<think>`` blocks are ignored. A final ``<tool_call>`` without its closing tag (generation
    stopped at the end-of-turn token before the tag) is parsed up to the end of the text.

    Args:
        text: the raw assistant text of one turn.

    Returns:
        The calls in order of appearance; ``[]`` if the text has no ``<tool_call>`` block.

    Raises:
        ToolCallParseError: a block's body is not ``{"name": str, "arguments": object}`` JSON.
    """
    text = strip_thinking(text)
    bodies = _TOOL_CALL_RE.findall(text)
    tail = _UNCLOSED_RE.search(_TOOL_CALL_RE.sub("", text))
    if tail is not None:
        bodies.append(tail.group(1))
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            raise ToolCallParseError(f"tool call is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ToolCallParseError("tool call must be a JSON object with 'name' and 'arguments'")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallParseError("tool call has no 'name' string")
        args = obj.get("arguments", {})
        if isinstance(args, str):
            # Some templates serialize arguments as a JSON string; accept it if it decodes.
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ToolCallParseError("tool call 'arguments' is not a JSON object") from None
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
