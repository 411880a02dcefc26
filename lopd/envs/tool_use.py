"""Stateful tool-use worlds (EnvScaler style): the world framework, final-state checks, the env.

A *world* (:class:`World` subclass) owns an in-memory database ``{table: {record_id: record}}``
built deterministically from a seed, a set of query and modification tools (methods
``tool_<name>``) described by :class:`ToolSpec`, and task templates (methods ``gen_<template>``)
that pick random entities from the database and write the instruction, the final-state checks and
an oracle sequence of tool calls.

A tool-use :class:`~lopd.types.Task` carries everything as JSON in ``task.spec``::

    {
      "seed": 1234,                 # builds the initial database (World.build_db)
      "db": {...},                  # optional: an explicit initial database (overrides "seed")
      "conventions": {...},         # optional: slot -> alternative (default: the world's own)
      "template": "change_address", # the template that wrote the task (informative)
      "params": {...},              # the entities the template picked (informative, dedup key)
      "checks": [...],              # final-state checks, see below
      "oracle": [{"name": ..., "arguments": {...}}, ...],  # one correct call sequence (optional)
    }

Checks (all evaluated on the final database, some against the initial one):

* ``{"op": "equals", "table": t, "id": i, "path": "a.b", "value": v}``: field ``a.b`` equals ``v``.
* ``{"op": "absent", "table": t, "id": i, "path": "a.b"}``: the (nested) key does not exist.
* ``{"op": "count_new", "table": t, "where": {field: value}, "count": n}``: exactly ``n`` records
  created during the episode match ``where``.
* ``{"op": "unchanged", "allow": {t: {i: [field, ...]}}, "new": {t: n}}``: the "don't touch other
  records" guard. Every initial record still exists and equals its initial value except the
  allowed fields, and each table gained exactly ``new.get(t, 0)`` records.

Any check may carry ``"gate": true``. Reward = the fraction of the non-gate checks that hold,
except that it is 0 when any gate check fails or when the episode left the database untouched.
A guard such as ``unchanged`` holds for a database nobody touched, so it must never pay on its
own: the built-in worlds make it a gate (collateral damage zeroes the episode), and every one of
their non-gate checks fails on the initial database (credit needs a real change).

*Conventions.* A world may declare convention slots (:attr:`World.conventions`): procedure rules
the task text does not state (which step a modification needs first, which follow-up it needs),
enforced by the world's tools and its tasks' checks. A task runs under the world's default
alternatives unless its spec names others; the built-in task sets always use the defaults.

Tool results are observations in one format: the JSON text of the result object (a few dozen
tokens), or ``Error: <reason>`` for a failed call. See :class:`ToolUseEnv` for the turn rules.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
from lopd.types import Task, TraceStep

Db = dict[str, dict[str, dict[str, Any]]]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}

NO_TOOL_CALL_MESSAGE = (
    'Error: no tool call found. Call one tool as <tool_call>{"name": ..., "arguments": {...}}'
    f"</tool_call>, or answer {TASK_COMPLETED} when the task is done."
)
"""Observation for a turn with neither a tool call nor ``Task Completed``."""


class ToolError(Exception):
    """A tool call that cannot be executed; its message becomes ``Error: <message>``."""


@dataclass(frozen=True)
class Param:
    """One tool parameter: a JSON type (``string``/``integer``/``number``/``boolean``)."""

    type: str
    description: str
    enum: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name, description and parameters (all required).

    Attributes:
        name: the function name the model calls; implemented by ``World.tool_<name>``.
        description: one line for the tool list.
        params: parameter name -> :class:`Param`, in signature order.
        kind: ``"query"`` (read-only) or ``"modify"``.
    """

    name: str
    description: str
    params: dict[str, Param] = field(default_factory=dict)
    kind: str = "query"

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema passed to chat templates."""
        props: dict[str, Any] = {}
        for pname, p in self.params.items():
            prop: dict[str, Any] = {"type": p.type, "description": p.description}
            if p.enum is not None:
                prop["enum"] = list(p.enum)
            props[pname] = prop
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {"type": "object", "properties": props, "required": list(props)},
            },
        }

    def validate(self, args: dict[str, Any]) -> None:
        """Check the arguments against the parameters.

        Raises:
            ToolError: a missing, unexpected or ill-typed argument, or a value outside the enum.
        """
        missing = [p for p in self.params if p not in args]
        if missing:
            raise ToolError(f"missing argument '{missing[0]}' for {self.name}")
        extra = [a for a in args if a not in self.params]
        if extra:
            raise ToolError(f"unexpected argument '{extra[0]}' for {self.name}")
        for pname, p in self.params.items():
            v = args[pname]
            # bool is an int subclass in Python; JSON true/false is never a valid number here.
            wrong_bool = isinstance(v, bool) and p.type != "boolean"
            if wrong_bool or not isinstance(v, _JSON_TYPES[p.type]):
                article = "an" if p.type[0] in "aeiou" else "a"
                raise ToolError(f"argument '{pname}' must be {article} {p.type}")
            if p.enum is not None and v not in p.enum:
                allowed = ", ".join(map(str, p.enum))
                raise ToolError(f"argument '{pname}' must be one of: {allowed}")


class TemplateNotApplicable(Exception):
    """Raised by a template whose entities do not exist in this seed's database (seed skipped)."""


@dataclass
class Draft:
    """What a template method returns: the task text, its checks and an oracle call sequence."""

    instruction: str
    params: dict[str, Any]
    checks: list[dict[str, Any]]
    oracle: list[ToolCall]


class World:
    """Base class of a tool-use world: a database plus the tools that read and modify it.

    Subclasses set ``name``, ``tools_spec`` and ``templates``, implement :meth:`build_db`, one
    ``tool_<name>(**args) -> dict`` per tool (raise :class:`ToolError` on failure) and one
    ``gen_<template>(rng) -> Draft`` per template, and register with :func:`register_world`.
    Optional ``conventions``: ``slot -> alternatives``, the first alternative being the world's
    default; tools and templates read the active one with :meth:`convention`.

    Args:
        db: the live database.
        conventions: ``slot -> alternative`` overrides (``None``: the defaults).

    Attributes:
        db: the live database, ``{table: {record_id: record}}``.
        active: the active alternative of every convention slot.

    Raises:
        ValueError: an unknown slot or alternative in ``conventions``.
    """

    name: ClassVar[str] = ""
    tools_spec: ClassVar[tuple[ToolSpec, ...]] = ()
    templates: ClassVar[tuple[str, ...]] = ()
    conventions: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, db: Db, conventions: dict[str, str] | None = None) -> None:
        self.db = db
        self._specs = {t.name: t for t in self.tools_spec}
        self.active = self.default_conventions()
        if not isinstance(conventions, (dict, type(None))):
            raise ValueError(f"conventions must be an object, got {type(conventions).__name__}")
        for slot, alt in (conventions or {}).items():
            if slot not in self.conventions:
                raise ValueError(
                    f"world {self.name!r} has no convention slot {slot!r}; "
                    f"slots: {sorted(self.conventions)}"
                )
            if alt not in self.conventions[slot]:
                raise ValueError(
                    f"convention {slot!r} of world {self.name!r} has no alternative {alt!r}; "
                    f"alternatives: {list(self.conventions[slot])}"
                )
            self.active[slot] = alt

    @classmethod
    def default_conventions(cls) -> dict[str, str]:
        """The world's own alternative of every slot (the first one listed)."""
        return {slot: alts[0] for slot, alts in cls.conventions.items()}

    def convention(self, slot: str) -> str:
        """The active alternative of convention ``slot``."""
        return self.active[slot]

    @classmethod
    def build_db(cls, seed: int) -> Db:
        """The initial database for ``seed`` (deterministic, independent of global RNG state)."""
        raise TypeError(f"world {cls.__name__} must implement build_db")

    def call(self, tool: ToolCall) -> dict[str, Any]:
        """Validate and execute one call; returns the result object.

        Raises:
            ToolError: unknown tool, bad arguments, or a failure reported by the tool.
        """
        spec = self._specs.get(tool.name)
        if spec is None:
            raise ToolError(f"unknown tool '{tool.name}'")
        spec.validate(tool.arguments)
        return getattr(self, f"tool_{tool.name}")(**tool.arguments)

    def new_id(self, table: str, prefix: str) -> str:
        """The next free ``<prefix>-<n>`` id of a table (deterministic: max existing + 1)."""
        nums = [int(k.rsplit("-", 1)[1]) for k in self.db[table] if k.startswith(prefix + "-")]
        return f"{prefix}-{max(nums, default=0) + 1}"

    def generate(self, template: str, rng: random.Random) -> Draft:
        """Run template ``template`` against this world's (initial) database."""
        if template not in self.templates:
            raise ValueError(f"world {self.name!r} has no template {template!r}")
        return getattr(self, f"gen_{template}")(rng)


_WORLDS: dict[str, type[World]] = {}


def register_world(cls: type[World]) -> type[World]:
    """Class decorator: make a world available to :class:`ToolUseEnv` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"world class {cls.__name__} has an empty name")
    _WORLDS[cls.name] = cls
    return cls


def get_world(name: str) -> type[World]:
    """The registered world class called ``name``.

    Raises:
        KeyError: no such world (the message lists the registered ones).
    """
    try:
        return _WORLDS[name]
    except KeyError:
        raise KeyError(f"unknown world {name!r}; registered: {sorted(_WORLDS)}") from None


def world_names() -> list[str]:
    """Names of all registered tool-use worlds, sorted."""
    return sorted(_WORLDS)


# --------------------------------------------------------------------------- checks


_MISSING = object()


def _get_path(record: Any, path: str) -> Any:
    cur = record
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _check_holds(check: dict[str, Any], db: Db, initial: Db) -> bool:
    op = check.get("op")
    if op in ("equals", "absent"):
        rec = db.get(check["table"], {}).get(check["id"])
        if rec is None:
            return False
        got = _get_path(rec, check["path"])
        return got is _MISSING if op == "absent" else got == check["value"]
    if op == "count_new":
        table = check["table"]
        new = [r for i, r in db.get(table, {}).items() if i not in initial.get(table, {})]
        where = check.get("where", {})
        return sum(all(r.get(k) == v for k, v in where.items()) for r in new) == check["count"]
    if op == "unchanged":
        allow = check.get("allow", {})
        new_counts = check.get("new", {})
        for table, records in initial.items():
            final = db.get(table, {})
            for rid, rec in records.items():
                if rid not in final:
                    return False
                fields = set(allow.get(table, {}).get(rid, ()))
                a = {k: v for k, v in rec.items() if k not in fields}
                b = {k: v for k, v in final[rid].items() if k not in fields}
                if a != b:
                    return False
            if len(final) - len(records) != new_counts.get(table, 0):
                return False
        return True
    raise ValueError(f"unknown check op {op!r} in {check}")


def evaluate_checks(checks: list[dict[str, Any]], db: Db, initial: Db) -> list[bool]:
    """Evaluate final-state checks (see the module docstring for the check language).

    Args:
        checks: the task's checks.
        db: the final database.
        initial: the database at reset.

    Returns:
        One bool per check.

    Raises:
        ValueError: a check with an unknown ``op``.
    """
    return [_check_holds(c, db, initial) for c in checks]


def score_checks(checks: list[dict[str, Any]], results: list[bool]) -> float:
    """The reward of per-check results: 0 if a gate fails, else the fraction of non-gate ones.

    A task whose checks are all gates scores 1 when they all hold; no checks score 0.
    """
    if len(checks) != len(results):
        raise ValueError(f"{len(checks)} checks but {len(results)} results")
    if any(not ok for c, ok in zip(checks, results) if c.get("gate")):
        return 0.0
    scored = [ok for c, ok in zip(checks, results) if not c.get("gate")]
    if not scored:
        return 1.0 if checks else 0.0
    return sum(scored) / len(scored)


# --------------------------------------------------------------------------- env


def format_tool_call(call: ToolCall) -> str:
    """Assistant text for one call in Qwen3's format (what :func:`parse_tool_calls` reads)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def format_result(result: Any) -> str:
    """The observation text of a successful tool result: its JSON text."""
    return json.dumps(result, ensure_ascii=False)


def initial_db(task: Task) -> Db:
    """A fresh copy of the task's initial database (``spec["db"]`` or built from ``spec["seed"]``).

    Raises:
        ValueError: the spec has neither ``"db"`` nor an integer ``"seed"``.
    """
    spec = task.spec
    if "db" in spec:
        return copy.deepcopy(spec["db"])
    seed = spec.get("seed")
    if not isinstance(seed, int):
        raise ValueError(f"task {task.task_id}: tool-use spec needs 'db' or an integer 'seed'")
    return get_world(task.world).build_db(seed)


class ToolUseEnv(Env):
    """Multi-turn episode in a registered :class:`World`.

    Turn rules (one ``step`` per assistant turn):

    * exactly one ``<tool_call>``: validated and executed; the observation is the result JSON or
      ``Error: <reason>`` (unknown tool, missing/unexpected/ill-typed argument, a failure such as
      an unknown id). The episode goes on either way.
    * malformed call (bad JSON, no name, arguments not an object): ``Error: <reason>``.
    * several calls in one turn (parallel calls, forbidden by the system prompt): none is executed,
      the observation is an error; each parsed call still counts in ``num_tool_calls``.
    * no call and ``Task Completed`` in the text: the episode ends (observation ``""``).
    * no call and no ``Task Completed``: an observation telling the model the expected format.
    * the ``max_steps``-th turn ends the episode after it is applied.

    Args:
        max_steps: turns per episode (paper: 30).
    """

    def __init__(self, max_steps: int = 30) -> None:
        super().__init__()
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self.world: World | None = None
        self._initial: Db = {}
        self._seen: set[str] = set()

    def system_prompt(self) -> str:
        return TOOL_USE_SYSTEM_PROMPT

    def tools(self) -> list[dict[str, Any]]:
        if self.world is None:
            raise RuntimeError("tools() needs a world: call reset(task) first")
        return [t.schema() for t in self.world.tools_spec]

    def reset(self, task: Task) -> str:
        self._reset_stats(task)
        if task.domain != "tool_use":
            raise ValueError(f"task {task.task_id} has domain {task.domain!r}, not 'tool_use'")
        world_cls = get_world(task.world)
        self._initial = initial_db(task)
        self.world = world_cls(copy.deepcopy(self._initial), task.spec.get("conventions"))
        self._seen = set()
        return task.instruction

    def _execute(self, call: ToolCall) -> str:
        assert self.world is not None
        key = call.key()
        if key in self._seen:
            self.repeated_tool_calls += 1
        self._seen.add(key)
        try:
            obs = format_result(self.world.call(call))
        except ToolError as e:
            obs = f"Error: {e}"
        except TypeError as e:
            # A tool implementation rejecting its arguments: report it, never crash the rollout.
            obs = f"Error: bad arguments for {call.name} ({e})"
        except Exception as e:
            obs = f"Error: {call.name} failed ({type(e).__name__})"
        # Errors may echo what the model wrote: keep the observation tokenizable and bounded.
        obs = clean_text(obs, MAX_OBSERVATION_CHARS)
        self.trace.append(TraceStep(action=call.render(), result=obs))
        return obs

    def step(self, model_text: str) -> tuple[str, bool]:
        self._check_can_step()
        self.num_steps += 1
        try:
            calls = parse_tool_calls(model_text, self.max_tool_calls)
        except ToolCallParseError as e:
            self.num_tool_calls += 1
            obs = f"Error: {e}"
        else:
            self.num_tool_calls += len(calls)
            if len(calls) == 1:
                obs = self._execute(calls[0])
            elif len(calls) > 1:
                obs = (
                    f"Error: {len(calls)} tool calls in one step; make exactly one call per step "
                    "(none was executed)"
                )
            elif is_task_completed(model_text):
                self.done = True
                return "", True
            else:
                obs = NO_TOOL_CALL_MESSAGE
        if self.num_steps >= self.max_steps:
            self.done = True
        return obs, self.done

    def check_results(self) -> list[bool]:
        """Per-check results on the current state (for diagnostics and tests)."""
        if self.world is None or self.task is None:
            raise RuntimeError("check_results() called before reset(task)")
        return evaluate_checks(self.task.spec["checks"], self.world.db, self._initial)

    def reward(self) -> float:
        """The task's checks scored by :func:`score_checks`; 0 if the database is unchanged."""
        if self.world is None or self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        if self.world.db == self._initial:
            return 0.0
        return score_checks(self.task.spec["checks"], self.check_results())


# --------------------------------------------------------------------------- oracles


def oracle_calls(task: Task) -> list[ToolCall]:
    """The task's oracle call sequence (``spec["oracle"]``).

    Raises:
        ValueError: the task carries no oracle.
    """
    oracle = task.spec.get("oracle")
    if oracle is None:
        raise ValueError(f"task {task.task_id} has no 'oracle' in its spec")
    return [ToolCall(c["name"], dict(c["arguments"])) for c in oracle]


def run_actions(env: Env, task: Task, actions: list[str]) -> float:
    """Play a fixed list of assistant turns in ``env``; returns the final reward."""
    env.reset(task)
    for text in actions:
        _, done = env.step(text)
        if done:
            break
    return env.reward()
