"""Training data of the embedded tiny model: bare and reference-conditioned oracle episodes.

The tiny model stands in for a pretrained LLM, whose useful property here is *in-context*
ability: shown a successful trajectory of a similar task, it follows the procedure. It has never
seen the built-in worlds' house rules, so bare it can only guess them. The data reproduces both
properties (recipe and rationale: :mod:`lopd.models`):

* every episode runs under **random conventions** (:attr:`lopd.envs.World.conventions`, one
  alternative per slot drawn uniformly), so no rule of the built-in task sets is more likely in
  the data than its alternative: a bare prompt gives the model nothing to tell them apart;
* a **reference-conditioned** episode puts the successful (oracle) trajectory of *another* train
  task of the same world, played under the *same* conventions, into the prompt as text, in one
  method's privileged-context format (:mod:`lopd.tiny.formats`; by default the paper's A.5
  framing, :func:`lopd.latent.injection.frame_with_references`, around the experience bank's
  layout, :func:`lopd.memory.format_experience`). Its ids and numbers belong to another database,
  so the only thing worth taking from it is the procedure: which tools, in which order.

Only train-split tasks enter the data; a reference is never the episode's own task (nor one with
the same instruction).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lopd.envs
from lopd.envs.tool_use_tasks import make_task
from lopd.envs.worlds import lexicon
from lopd.latent.composer import ENCODER_TEMPLATE
from lopd.latent.injection import FRAMING, frame_with_references
from lopd.memory.bank import BankEntry, format_experience
from lopd.rollout.chat import encode, end_of_turn_id, render_observation, render_prompt_text
from lopd.tiny.formats import FORMATS, frame_reference
from lopd.types import Task, Trajectory

__all__ = [
    "Demonstration",
    "Episode",
    "EpisodeSource",
    "Mixture",
    "ReferencePromptEnv",
    "action_spans",
    "demonstration",
    "experience_text",
    "oracle_play",
    "reference_env_factory",
    "same_template_plays",
    "same_template_references",
    "sample_conventions",
    "tokenizer_corpus",
    "turn_excerpt",
    "with_conventions",
]


def _envs() -> Any:
    return lopd.envs


@dataclass
class Demonstration:
    """One oracle conversation, tokenized the way :func:`lopd.rollout.multi_turn.rollout` lays out
    turns.

    Attributes:
        input_ids: ``[L]`` prompt + (action ids + end-of-turn + observation segment)*.
        action_mask: ``[L]`` 1 on assistant tokens (each action and its end-of-turn token).
        messages: the chat messages (for re-rendering checks).
        tools: the tool schemas rendered into the system turn.
        reward: the environment's reward after the oracle actions (1.0 for a sound oracle).
        context_start: index of the first token of the first user message (everything before
            it is the system turn: system prompt and tool list).
    """

    input_ids: list[int]
    action_mask: list[int]
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    reward: float
    context_start: int = 0


def demonstration(
    tokenizer: Any, task: Task, user_message: str | None = None, system_suffix: str = ""
) -> Demonstration:
    """Play ``task``'s oracle actions in its environment and tokenize the conversation.

    Action turns are tokenized canonically (``tokenizer(text)``), observations and template
    tokens with :func:`lopd.rollout.chat.render_observation`, exactly as a rollout concatenates
    them.

    Args:
        tokenizer: the model's tokenizer.
        task: a task with an oracle.
        user_message: the first user message (default: what the environment shows, the
            instruction); a reference-conditioned episode passes the framed message.
        system_suffix: appended to the system message (OPSD's reference format).
    """
    envs = _envs()
    env = envs.make_env(task)
    user = env.reset(task)
    if user_message is not None:
        user = user_message
    system, tools = env.system_prompt() + system_suffix, env.tools()
    text = render_prompt_text(tokenizer, system, user, tools)
    ids = encode(tokenizer, text)
    # The user message follows a newline (a token boundary), so the text before it encodes to a
    # prefix of the prompt's ids.
    context_start = len(encode(tokenizer, text[: text.rindex(user)]))
    mask = [0] * len(ids)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    eot = end_of_turn_id(tokenizer)
    for text in envs.oracle_actions(task):
        action = [*encode(tokenizer, text), eot]
        ids += action
        mask += [1] * len(action)
        messages.append({"role": "assistant", "content": text})
        observation, done = env.step(text)
        if done:
            break
        segment = render_observation(tokenizer, observation)
        ids += segment
        mask += [0] * len(segment)
        messages.append({"role": "tool", "content": observation})
    return Demonstration(ids, mask, messages, tools, float(env.reward()), context_start)


def action_spans(demo: Demonstration) -> list[tuple[int, int]]:
    """``(start, end)`` (end exclusive) of every action of ``demo``, in order."""
    spans, start = [], None
    for i, m in enumerate([*demo.action_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def turn_excerpt(demo: Demonstration, k: int, turn_start_id: int) -> Demonstration:
    """A short excerpt of ``demo`` that ends with its action ``k``: no system turn.

    Action 0 comes after the first user turn alone; action ``k > 0`` after the first user turn,
    action ``k - 1`` and the tool result that followed it (the turns in between are left out).
    Only action ``k`` is supervised. Used by the tiny model's curriculum
    (:class:`lopd.tiny.build.TinyBuildConfig`): a model this small learns to copy a key from the
    instruction or an id from a tool result only on such short contexts, and then keeps the
    skill in full episodes.

    Raises:
        ValueError: no ``turn_start_id`` before the first user message, or no action ``k``.
    """
    cut = next(
        (i for i in range(demo.context_start - 1, -1, -1) if demo.input_ids[i] == turn_start_id),
        None,
    )
    if cut is None:
        raise ValueError("no turn-start token before the first user message")
    spans = action_spans(demo)
    if not 0 <= k < len(spans):
        raise ValueError(f"action {k} of a demonstration with {len(spans)} actions")
    start, end = spans[k]
    first = spans[0][0]
    ids = demo.input_ids
    if k == 0:
        keep = list(range(cut, end))
    else:
        keep = [*range(cut, first), *range(spans[k - 1][0], end)]
    mask = [1 if start <= i < end else 0 for i in keep]
    users = [m for m in demo.messages if m["role"] != "system"]
    return Demonstration(
        [ids[i] for i in keep], mask, users, demo.tools, demo.reward, demo.context_start - cut
    )


def oracle_play(task: Task) -> Trajectory:
    """The oracle episode of ``task`` as an (untokenized) trajectory: trace, reward, steps."""
    envs = _envs()
    env = envs.make_env(task)
    env.reset(task)
    actions = envs.oracle_actions(task)
    for text in actions:
        _, done = env.step(text)
        if done:
            break
    return Trajectory(
        task=task,
        messages=[],
        input_ids=[],
        action_mask=[],
        turn_spans=[],
        prompt_len=0,
        reward=float(env.reward()),
        trace=list(env.trace),
        num_steps=env.num_steps,
        num_tool_calls=env.num_tool_calls,
    )


def experience_text(task: Task) -> str:
    """The oracle trajectory of ``task`` as the bank renders a stored success (A.3 text)."""

    return format_experience(BankEntry.from_trajectory(oracle_play(task)))


def sample_conventions(world: str, rng: random.Random) -> dict[str, str]:
    """One alternative per convention slot of ``world``, uniformly at random."""
    cls = _envs().get_world(world)
    return {slot: rng.choice(alts) for slot, alts in cls.conventions.items()}


_VARIANTS: dict[tuple[str, tuple[tuple[str, str], ...]], Task] = {}


def with_conventions(task: Task, conventions: dict[str, str]) -> Task:
    """``task`` regenerated under ``conventions``: same database, entities and instruction,
    the oracle and checks of those conventions (cached)."""

    key = (task.task_id, tuple(sorted(conventions.items())))
    if key not in _VARIANTS:
        spec = task.spec
        t = make_task(
            task.world, spec["template"], spec["seed"], task.task_id, task.split, conventions
        )
        if t.instruction != task.instruction:
            raise ValueError(f"task {task.task_id} is not a built-in task (instruction differs)")
        _VARIANTS[key] = t
    return _VARIANTS[key]


@dataclass(frozen=True)
class Mixture:
    """Shares of the episode kinds in the tiny model's training stream.

    Attributes:
        bare: episodes whose first user message is the bare instruction.
        same_template: among reference-conditioned episodes, the share whose reference is a task
            of the same template (the rest: another template of the same world, which shares
            only the world-level rules, if any, so the model learns to weigh a reference by how
            similar its task is).
        formats: the privileged-context formats (:data:`lopd.tiny.formats.FORMATS`) a
            reference-conditioned episode is drawn from, in equal shares; each has the same
            same-template / other-template mixture.
    """

    bare: float = 0.4
    same_template: float = 0.8
    formats: tuple[str, ...] = ("lopd",)

    def __post_init__(self) -> None:
        for name in ("bare", "same_template"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if not self.formats or unknown or len(set(self.formats)) != len(self.formats):
            raise ValueError(f"formats must be distinct names of {FORMATS}, got {self.formats}")


@dataclass(frozen=True)
class Episode:
    """One drawn training episode: the target task, its reference (``None``: bare) and the
    format the reference is shown in."""

    target: Task
    reference: Task | None
    format: str = "lopd"


class EpisodeSource:
    """A deterministic stream of training episodes over train-split tool-use tasks.

    Args:
        tasks: the tasks episodes are drawn from (all must be ``split == "train"``).
        mixture: the episode kinds' shares.

    Raises:
        ValueError: a task outside the train split, or a world with a single task.
    """

    def __init__(self, tasks: Sequence[Task], mixture: Mixture | None = None) -> None:
        leaked = [t.task_id for t in tasks if t.split != "train"]
        if leaked:
            raise ValueError(f"the tiny model trains on train-split tasks only, got {leaked[:3]}")
        self.tasks = list(tasks)
        self.mixture = mixture or Mixture()
        self.worlds = sorted({t.world for t in self.tasks})
        self._by_world = {w: [t for t in self.tasks if t.world == w] for w in self.worlds}
        for w, ts in self._by_world.items():
            if len(ts) < 2:
                raise ValueError(f"world {w!r} needs at least 2 tasks (a task and a reference)")

    def episode(self, rng: random.Random, world: str) -> Episode:
        """Draw an episode of ``world`` under fresh random conventions.

        Its ``reference`` is ``None`` for a bare episode; otherwise another task of the world
        (never the target, never one with the target's instruction) under the same conventions,
        shown in one of the mixture's formats.
        """
        pool = self._by_world[world]
        conventions = sample_conventions(world, rng)
        target = rng.choice(pool)
        if rng.random() < self.mixture.bare:
            return Episode(with_conventions(target, conventions), None)
        others = [t for t in pool if t.instruction != target.instruction]
        template = target.spec["template"]
        same = [t for t in others if t.spec["template"] == template]
        other = [t for t in others if t.spec["template"] != template]
        candidates = same if (rng.random() < self.mixture.same_template or not other) else other
        reference = rng.choice(candidates or others)
        formats = self.mixture.formats
        # A single format draws nothing, so the one-format stream is the earlier builds' stream.
        fmt = formats[0] if len(formats) == 1 else rng.choice(formats)
        return Episode(
            with_conventions(target, conventions), with_conventions(reference, conventions), fmt
        )

    def bare_episode(self, rng: random.Random, world: str) -> Task:
        """Draw a target task of ``world`` under fresh random conventions (no reference)."""
        conventions = sample_conventions(world, rng)
        return with_conventions(rng.choice(self._by_world[world]), conventions)

    def demonstration(self, tokenizer: Any, episode: Episode) -> Demonstration:
        """The tokenized episode: bare, or with its reference's oracle trajectory as text in the
        episode's format."""

        target, reference = episode.target, episode.reference
        if reference is None:
            return demonstration(tokenizer, target)
        if reference.task_id == target.task_id or reference.instruction == target.instruction:
            raise ValueError(f"task {target.task_id} cannot be its own reference")
        framed = frame_reference(
            episode.format, target.instruction, target.domain, oracle_play(reference)
        )
        return demonstration(tokenizer, target, framed.user, framed.system_suffix)


class ReferencePromptEnv:
    """A task environment whose first user message carries references as text (A.5 framing).

    Everything except :meth:`reset` is delegated to the wrapped environment.

    Args:
        env: the task's environment.
        references: the experience texts (:func:`lopd.memory.format_experience`) to show.
    """

    def __init__(self, env: Any, references: Sequence[str]) -> None:
        self._env = env
        self._references = list(references)

    def reset(self, task: Task) -> str:
        return frame_with_references(self._env.reset(task), task.domain, self._references)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def reference_env_factory(references: dict[str, Sequence[str]]) -> Any:
    """A ``make_env`` for :func:`lopd.rollout.multi_turn.rollout`: task id -> its references as
    text."""
    envs = _envs()

    def make(task: Task) -> ReferencePromptEnv:
        return ReferencePromptEnv(envs.make_env(task), references[task.task_id])

    return make


def same_template_references(
    tasks: Sequence[Task], pool: Sequence[Task], seed: int = 0, match: bool = True
) -> dict[str, list[str]]:
    """For each task, the oracle trajectory of one ``pool`` task of the same world as text.

    The references of :func:`same_template_plays` in the bank's layout: ``task_id -> [experience
    text]``.
    """
    plays = same_template_plays(tasks, pool, seed, match)
    return {k: [format_experience(BankEntry.from_trajectory(t))] for k, t in plays.items()}


def same_template_plays(
    tasks: Sequence[Task], pool: Sequence[Task], seed: int = 0, match: bool = True
) -> dict[str, Trajectory]:
    """For each task, the oracle trajectory of one ``pool`` task of the same world.

    Args:
        tasks: the tasks to give references.
        pool: candidate reference tasks (train split).
        seed: picks the candidate (deterministically per task id).
        match: the reference has the task's template (``False``: another template of the same
            world, the mismatched control).

    Returns:
        ``task_id -> `` the reference's oracle trajectory.
    """
    out: dict[str, Trajectory] = {}
    for task in tasks:
        rng = random.Random(f"{seed}/{task.task_id}")
        cands = [
            t
            for t in pool
            if t.world == task.world
            and t.task_id != task.task_id
            and t.instruction != task.instruction
            and (t.spec["template"] == task.spec["template"]) == match
        ]
        if not cands:
            raise ValueError(f"no reference candidate for task {task.task_id}")
        out[task.task_id] = oracle_play(rng.choice(cands))
    return out


def tokenizer_corpus(tasks: Sequence[Task], formats: Sequence[str] = ("lopd",)) -> list[str]:
    """Texts a tokenizer for the tool-use worlds must cover well.

    Per world: the system prompt and the tool list; per task (under every combination of the
    world's conventions): the instruction, each oracle action and its tool result; the worlds'
    lexicon (every name, city, product, coverage); the framing and experience texts a reference
    arrives in (paper A.5 framing, the bank's layout, the composer's encoder template, and the
    wording of every other format in ``formats``), so a reference costs about one token per word.
    """

    envs = _envs()
    texts: list[str] = []
    seen_worlds: set[str] = set()
    for i, task in enumerate(tasks):
        cls = envs.get_world(task.world)
        env = envs.make_env(task)
        if task.world not in seen_worlds:
            seen_worlds.add(task.world)
            env.reset(task)
            texts.append(env.system_prompt())
            for tool in env.tools():
                fn = tool.get("function", tool)
                texts.append(f"- {fn['name']}({', '.join(fn['parameters']['properties'])})")
        # The first tasks under every combination of conventions (each process tool's results),
        # the rest under the defaults: the pieces are the same, the corpus 4x smaller.
        combos = itertools.product(*cls.conventions.values()) if i < 60 else [()]
        for combo in combos:
            variant = with_conventions(task, dict(zip(cls.conventions, combo)))
            texts.append(variant.instruction)
            play = oracle_play(variant)
            texts += [s.action for s in play.trace] + [s.result for s in play.trace]
        texts += envs.oracle_actions(task)
    texts += lexicon()
    texts += list(FRAMING["tool_use"]) * 2

    header = format_experience(BankEntry("x", "x", "x", "x", "", 1.0))
    texts += [header, header, ENCODER_TEMPLATE, ENCODER_TEMPLATE]
    texts += [envs.TASK_COMPLETED] * 2
    # Every other format's wording, around a reference of each world.
    firsts = {t.world: t for t in reversed(tasks)}
    for fmt in (f for f in formats if f != "lopd"):
        for task in firsts.values():
            framed = frame_reference(fmt, "", task.domain, oracle_play(task))
            texts += [framed.system_suffix, framed.user] * 2
    return texts
