"""ACEBench's agent tasks as an episode: the phone and travel environments, ACEBench's scores.

Per episode, one fresh instance of every involved class (:mod:`lopd.envs.acebench.phone`,
:mod:`lopd.envs.acebench.travel`), each given its section of the task's ``initial_config`` and
then ``BaseApi``'s, as ACEBench loads them. A tool call runs the public method of that name on
every involved instance that has one (ACEBench's dispatch: ``turn_on_wifi`` reaches the device
and each app); the observation is each distinct result (a dict as JSON, anything else as text,
an exception as ``Error during execution: ...``), one per line. Every call of the model, in
order, is logged for the process score in ACEBench's format (:func:`scoring.format_call`).

Turns (as EnvScaler's port of ACEBench, which the paper's protocol follows; at most
:data:`MAX_STEPS` assistant turns, paper Table 5):

* ``multi_step``: the question is the first user message; a turn with tool calls runs them all
  in order; a text turn with ``Task Completed`` ends the episode; any other text turn is answered
  (as a user message) that the task must be done without asking.
* ``multi_turn``: the simulated user (:mod:`lopd.envs.acebench.user`) opens with its first
  request; a text turn goes to it and its reply comes back as a user message; the episode ends
  when the user says ``finish conversation``. It needs a user model: ``spec["user_model"]`` (a
  local checkpoint; ``spec["user_device"]``, default ``cpu``) or one given to the env.

The system prompt is the paper's (A.5); a multi-turn task adds the domain's rules for the
assistant (:data:`PHONE_RULES`, :data:`TRAVEL_RULES`, this project's wording of ACEBench's).
Reward = end-to-end correctness (0 or 1, ACEBench's headline score); :attr:`AceBenchEnv.process`
is the process score (:mod:`lopd.envs.acebench.scoring`).
"""

from __future__ import annotations

import copy
import inspect
import json
from typing import Any

from lopd.envs.acebench.scoring import (
    end_state,
    end_to_end,
    format_call,
    parse_call,
    process_accuracy,
)
from lopd.envs.acebench.spec import CLASSES, SAVED_ATTRIBUTES, WORLD, validate_spec
from lopd.envs.acebench.user import FINISH, Chat, UserConversation, local_chat
from lopd.envs.base import (
    MAX_OBSERVATION_CHARS,
    TASK_COMPLETED,
    TOOL_USE_SYSTEM_PROMPT,
    Env,
    ToolCall,
    ToolCallParseError,
    clean_text,
    is_task_completed,
    parse_tool_calls,
)
from lopd.envs.tool_use import format_tool_call
from lopd.types import Task, TraceStep

MAX_STEPS = 20
"""Assistant turns per ACEBench episode (paper Table 5)."""
NO_QUESTIONS = "Do not ask me anything: complete the task with the information you have."
"""The multi-step answer to a text turn (ACEBench's multi-step user never answers)."""
TRACE_RESULT_CHARS = 1_000
_SCHEMA_TYPES = {
    "dict": "object",
    "list": "array",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "str": "string",
}

PHONE_RULES = """It is 2024-06-11 16:00 (Beijing time). You are a phone assistant: you send text \
messages, add reminders and order food delivery for the user.
- Use only what the user and the tools tell you; give no advice or opinions of your own.
- One tool per step (parallel calls of the same tool are allowed); do not talk to the user and \
call a tool in the same step.
- When information is missing or a call fails, ask the user.
- Before sending a message, know its sender and receiver. When the inbox is full, ask the user \
which message to delete.
- Before viewing messages, log in to the device (login_device) and know the sender and the \
receiver. After viewing them, ask whether to add their content to a reminder, whether to reply, \
and, if they concern food, whether to order it.
- Before adding a reminder, know its title and content; its time defaults to now. A reminder \
made from a message needs that message viewed first.
- After viewing a reminder by its title, ask whether to carry out its tasks.
- Before ordering food, get the user's platform account and password and log in \
(login_food_platform); ask for the merchant, products and quantities if not given; order from \
one merchant at a time; if the balance is short, say "Insufficient balance" and ask whether to \
change the order.
- Report what was done and do not call the same function again needlessly. When the task is \
done, say "finish conversation"."""

TRAVEL_RULES = """It is 2024-07-15 08:00 (Beijing time). You are an airline's booking assistant: \
you book, change and cancel flight reservations.
- Before any change to the reservations (booking, changing a flight, bags or cabin), list what \
you will do and get an explicit "yes" from the user; the same kind of detail needs no second \
confirmation.
- Use only what the user and the tools tell you; give no advice or opinions of your own. Refuse \
requests against these rules; hand over to a human agent only what you cannot do.
- One tool per step (parallel calls of the same tool are allowed); do not talk to the user and \
call a tool in the same step.
- Booking: get the user id and password, then origin and destination; search flights first. A \
round trip is two bookings; without a direct flight, look for connections through a city and \
book both legs. Ask how to pay (cash or bank). Free checked bags: regular members 1 in economy \
and 2 in business, silver 2 and 3, gold 3 and 3; each further bag costs 50 yuan.
- Changes: get the user id and password; reservations are found by user id. A flight may change \
only to one with the same origin and destination. Any reservation may change cabin (the user \
pays the difference). Bags can be added, not removed. Ask how to pay or be refunded.
- Cancelling: get the user id, the reservation id and the reason (change of plans, airline \
cancellation, other). Only itineraries not yet flown can be cancelled.
- Compensation: only when a silver or gold member, or a business traveller, complains and asks \
for it: 200 yuan per passenger for a cancelled flight, 100 for a delayed one once the \
reservation is changed or cancelled.
- When the task is done, say "finish conversation"."""


def _schema(value: Any) -> Any:
    if isinstance(value, list):
        return [_schema(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _schema(v) for k, v in value.items()}
    if isinstance(out.get("type"), str):
        out["type"] = _SCHEMA_TYPES.get(out["type"], out["type"])
    return out


def tool_schemas(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ACEBench's function docs as OpenAI tools (``dict`` -> ``object``, ``int`` -> ``integer``)."""
    tools = []
    for fn in functions:
        fn = _schema(fn)
        if not isinstance(fn.get("parameters"), dict):
            fn["parameters"] = {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": fn})
    return tools


def build_instances(involved: list[str], initial_config: dict[str, Any]) -> dict[str, Any]:
    """Fresh instances of the involved classes, configured as ACEBench loads them."""
    instances = {}
    for name in involved:
        inst = CLASSES[name]()
        inst._apply_config(copy.deepcopy(initial_config.get(name, {})))
        inst._apply_config(copy.deepcopy(initial_config.get("BaseApi", {})))
        instances[name] = inst
    return instances


def _render(result: Any) -> str:
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


class AceBenchEnv(Env):
    """One ACEBench agent task as an episode (module docstring).

    Attributes:
        calls: the model's calls so far, in ACEBench's logged format.
        end_state: the saved attributes of every instance (after :meth:`reward`).
        errors: why the end state is not the ground truth (after :meth:`reward`).
        process: ACEBench's process score (after :meth:`reward`).

    Args:
        max_steps: assistant turns per episode.
        user: the chat model of multi-turn's simulated user (default: ``spec["user_model"]``).
    """

    def __init__(self, max_steps: int = MAX_STEPS, user: Chat | None = None) -> None:
        super().__init__()
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self._user_chat = user
        self.calls: list[str] = []
        self.end_state: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.process = 0.0
        self._instances: dict[str, Any] = {}
        self._methods: dict[str, list[Any]] = {}
        self._user: UserConversation | None = None
        self._seen: set[str] = set()

    def system_prompt(self) -> str:
        if self.task is None:
            raise RuntimeError("system_prompt() needs a task: call reset(task) first")
        if self.task.spec["category"] != "multi_turn":
            return TOOL_USE_SYSTEM_PROMPT
        rules = PHONE_RULES if "BaseApi" in self.task.spec["involved_classes"] else TRAVEL_RULES
        return f"{TOOL_USE_SYSTEM_PROMPT}\n\nThe environment you work in:\n{rules}"

    def tools(self) -> list[dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("tools() needs a task: call reset(task) first")
        return tool_schemas(self.task.spec["functions"])

    def reset(self, task: Task) -> str:
        self._reset_stats(task)
        if task.domain != "tool_use" or task.world != WORLD:
            raise ValueError(f"task {task.task_id} is not an ACEBench task (world {task.world!r})")
        spec = task.spec
        validate_spec(spec)
        self.calls, self.end_state, self.errors, self.process = [], [], [], 0.0
        self._seen = set()
        self._instances = build_instances(spec["involved_classes"], spec["initial_config"])
        self._methods = {}
        for inst in self._instances.values():
            for name, method in inspect.getmembers(inst, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self._methods.setdefault(name, []).append(method)
        self._user = None
        self.observation_role = "tool"
        if spec["category"] == "multi_step":
            return spec["question"]
        chat = self._user_chat
        if chat is None:
            if not spec.get("user_model"):
                raise ValueError(
                    f"task {task.task_id}: an ACEBench multi-turn task needs a user model "
                    "(--user-model PATH, or 'user_model' in its spec)"
                )
            chat = local_chat(spec["user_model"], spec.get("user_device", "cpu"))
        self._user = UserConversation(chat, spec["question"], spec["involved_classes"])
        return clean_text(self._user.opening(), MAX_OBSERVATION_CHARS)

    def step(self, model_text: str) -> tuple[str, bool]:
        self._check_can_step()
        self.num_steps += 1
        self.observation_role = "tool"
        try:
            calls = parse_tool_calls(model_text, self.max_tool_calls)
        except ToolCallParseError as e:
            self.num_tool_calls += 1
            obs = f"Error: {e}"
        else:
            self.num_tool_calls += len(calls)
            if calls:
                obs = "\n".join(self._execute(c) for c in calls)
            else:
                obs = self._talk(model_text)
        if self.num_steps >= self.max_steps:
            self.done = True
        return clean_text(obs, MAX_OBSERVATION_CHARS), self.done

    def reward(self) -> float:
        """ACEBench's end-to-end verdict of the current state: 1.0 or 0.0."""
        if self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        self.end_state = end_state(self._instances, SAVED_ATTRIBUTES)
        verdict = end_to_end(self.end_state, self.task.spec["ground_truth"])
        self.errors = verdict.errors
        self.process = process_accuracy(self.calls, self.task.spec["mile_stone"], verdict.correct)
        return 1.0 if verdict.correct else 0.0

    @property
    def success(self) -> bool:
        return self.reward() == 1.0

    def episode_record(self) -> dict[str, Any]:
        """What the evaluation keeps of the episode: ACEBench's two scores and why."""
        correct = self.reward() == 1.0
        return {
            "end_to_end": correct,
            "process": self.process,
            "errors": self.errors[:20],
            "calls": self.calls,
        }

    # ------------------------------------------------------------------ internals
    def _talk(self, text: str) -> str:
        if self._user is None:  # multi-step
            if is_task_completed(text):
                self.done = True
                return ""
            self.observation_role = "user"
            return NO_QUESTIONS
        reply = self._user.reply(text)
        self.observation_role = "user"
        if FINISH in reply.lower():
            self.done = True
        return reply

    def _execute(self, call: ToolCall) -> str:
        key = call.key()
        if key in self._seen:
            self.repeated_tool_calls += 1
        self._seen.add(key)
        self.calls.append(format_call(call.name, call.arguments))
        methods = self._methods.get(call.name)
        if not methods:
            results = [f"Error during execution: no function named {call.name} is available"]
        else:
            results = []
            for method in methods:
                try:
                    text = _render(method(**call.arguments))
                except Exception as e:
                    text = f"Error during execution: {e}"
                if text not in results:
                    results.append(text)
        obs = "\n".join(results)
        self.trace.append(
            TraceStep(action=clean_text(call.render()), result=clean_text(obs, TRACE_RESULT_CHARS))
        )
        return obs


def oracle_actions(task: Task) -> list[str]:
    """Turns that replay the task's oracle: ``spec["oracle"]`` (``[{"name", "arguments"}]``) or
    else its (first) milestone list, one call per turn, then ``Task Completed``.

    Raises:
        ValueError: no oracle and a milestone that does not parse as a call (ACEBench's data
            writes some text values with unescaped quotes).
    """
    oracle = task.spec.get("oracle")
    if oracle is not None:
        calls = [ToolCall(c["name"], dict(c.get("arguments", {}))) for c in oracle]
    else:
        stones = task.spec["mile_stone"]
        if stones and isinstance(stones[0], list):
            stones = stones[0]
        calls = [ToolCall(*parse_call(s)) for s in stones]
    return [format_tool_call(c) for c in calls] + [TASK_COMPLETED]
