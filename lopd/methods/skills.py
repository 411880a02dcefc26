"""Skill-SD's skill bank: skills written from rollouts, chosen per task by UCB1 (paper B.1).

A *skill* is a structured summary of one task's rollout group, in the three parts the paper's
teacher prompt shows (:data:`SKILL_USER_TEMPLATE`): what works, what to avoid, and a suggested
workflow. It is written from the group's successful *and* failed trajectories either

* by the model itself (:class:`ModelSkillSummarizer`: the student, greedy decoding, asked for the
  three sections; a text that lacks one of them falls back to the rule summary), or
* by :class:`RuleSkillSummarizer`, a deterministic summarizer of the observation-lite traces. It
  is a **stand-in** for models too small to write a summary, such as the ~1M-parameter tiny
  default (its world-only tokenizer and SFT on tool calls leave it unable to write English); it
  is not the Skill-SD paper's LLM-written skill.

The :class:`SkillBank` holds the skills and their UCB1 statistics. A task's candidates are the
skills written from *other* tasks of the same world (the paper's "similar past task"; other
worlds have other tools). Among them UCB1 picks ``argmax_s mean_s + c sqrt(ln N / n_s)``
(:func:`ucb1_scores`), where ``n_s`` counts the skill's pulls, ``mean_s`` its mean bandit
reward and ``N`` the candidates' total pulls; a skill never pulled comes first, ties go to the
oldest skill. Choices within one step see the step's earlier choices as pulls already made
(without a reward yet), so two tasks of one step spread over the candidates.

The bandit reward of a pull is computed by :class:`~lopd.methods.skill_sd.SkillSDMethod` from the
rewards of the rollouts the skill guided (see :func:`skill_agreement`).

Everything here is plain data: :meth:`SkillBank.state_dict` is saved in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lopd.rollout.chat import render_prompt, stop_token_ids
from lopd.types import Task, Trajectory

__all__ = [
    "SKILL_SUMMARY_REQUEST",
    "SKILL_USER_TEMPLATE",
    "ModelSkillSummarizer",
    "RuleSkillSummarizer",
    "Skill",
    "SkillBank",
    "SkillText",
    "call_shape",
    "parse_skill_text",
    "skill_agreement",
    "ucb1_scores",
]

# Paper B.1, verbatim: appended to the teacher's first user message for Skill-SD.
SKILL_USER_TEMPLATE = (
    "\n\nHere is a skill summary from a similar past task that may help guide your approach:"
    "\n\n**What works:** {success_analysis}"
    "\n\n**What to avoid:** {mistake_analysis}"
    "\n\n**Suggested workflow:** {golden_workflow}"
    "\n\nNow solve the current task using your own reasoning."
)

# The request the model answers when it writes a skill itself (ours: the paper gives none).
SKILL_SUMMARY_REQUEST = (
    "Below are attempts at one task, with the tool calls each made and what they returned. "
    "Write a reusable skill for similar tasks in exactly three labelled parts:\n"
    "What works: <what the successful attempts did right>\n"
    "What to avoid: <the mistakes of the failed attempts>\n"
    "Suggested workflow: <the steps to follow, in order>\n\n"
    "Task: {instruction}\n\n"
    "Successful attempts:\n{successes}\n\n"
    "Failed attempts:\n{failures}"
)

_SECTION_RE = re.compile(
    r"(?:\*\*)?(What works|What to avoid|Suggested workflow)(?:\*\*)?\s*:\s*(?:\*\*)?",
    re.IGNORECASE,
)
_MAX_ATTEMPT_CHARS = 1500  # per attempt shown to the model summarizer
_MAX_ATTEMPTS = 2  # successes and failures shown to the model summarizer, each


@dataclasses.dataclass(frozen=True)
class SkillText:
    """The three parts of a skill (the placeholders of :data:`SKILL_USER_TEMPLATE`)."""

    success_analysis: str
    mistake_analysis: str
    golden_workflow: str

    def render(self) -> str:
        """The skill as appended to the teacher's first user message."""
        return SKILL_USER_TEMPLATE.format(**dataclasses.asdict(self))

    def map(self, fn: Callable[[str], str]) -> SkillText:
        """The skill with ``fn`` applied to each part (emptied under ``lopd.null_context``)."""
        return SkillText(**{k: fn(v) for k, v in dataclasses.asdict(self).items()})


@dataclasses.dataclass
class Skill:
    """One skill of the bank.

    Attributes:
        skill_id: unique, increasing with creation (the tie-break order of UCB1).
        source_task_id: the task whose rollouts it summarizes (never offered to that task).
        world: that task's world (skills are offered within a world).
        text: its three parts.
        author: ``"model"`` or ``"rule"``.
        step: the training step whose rollouts it summarizes.
        pulls: n_s, times UCB1 chose it and a reward was recorded.
        reward_sum: the sum of those rewards (``mean_s = reward_sum / pulls``).
    """

    skill_id: int
    source_task_id: str
    world: str
    text: SkillText
    author: str
    step: int
    pulls: int = 0
    reward_sum: float = 0.0

    @property
    def mean(self) -> float:
        return self.reward_sum / self.pulls if self.pulls else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Skill:
        return cls(**{**d, "text": SkillText(**d["text"])})


def ucb1_scores(pulls: torch.Tensor, means: torch.Tensor, c: float) -> torch.Tensor:
    """UCB1 scores ``mean_s + c sqrt(ln N / n_s)`` with ``N = sum_s n_s``; ``+inf`` where
    ``n_s = 0`` (every arm is tried once before any is tried twice).

    Args:
        pulls: ``[S]`` pull counts ``n_s`` (>= 0).
        means: ``[S]`` mean rewards.
        c: exploration constant (paper: sqrt 2).

    Returns:
        ``[S]`` float64 scores.
    """
    if pulls.dim() != 1 or pulls.shape != means.shape:
        raise ValueError(
            f"pulls and means must be [S] of one shape, got {tuple(pulls.shape)} and "
            f"{tuple(means.shape)}"
        )
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    n = pulls.double()
    total = n.sum()
    bonus = c * torch.sqrt(torch.log(total.clamp_min(1.0)) / n.clamp_min(1.0))
    scores = means.double() + bonus
    return torch.where(n > 0, scores, torch.full_like(scores, math.inf))


class SkillBank:
    """The skills and their UCB1 statistics (see the module docstring).

    Args:
        c: the UCB1 exploration constant.
        max_skills: capacity; adding beyond it drops the oldest skill.
    """

    def __init__(self, c: float = math.sqrt(2.0), max_skills: int = 256) -> None:
        if c < 0:
            raise ValueError(f"c must be >= 0, got {c}")
        if max_skills < 1:
            raise ValueError(f"max_skills must be >= 1, got {max_skills}")
        self.c = c
        self.max_skills = max_skills
        self.skills: list[Skill] = []
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.skills)

    def get(self, skill_id: int) -> Skill | None:
        """The skill with this id, or ``None`` (e.g. dropped for capacity)."""
        return next((s for s in self.skills if s.skill_id == skill_id), None)

    def add(self, source: Task, text: SkillText, author: str, step: int) -> Skill:
        """Add a skill written from ``source``'s rollouts of ``step`` (oldest dropped if full)."""
        skill = Skill(self.next_id, source.task_id, source.world, text, author, step)
        self.next_id += 1
        self.skills.append(skill)
        if len(self.skills) > self.max_skills:
            del self.skills[: len(self.skills) - self.max_skills]
        return skill

    def candidates(self, task: Task) -> list[Skill]:
        """Skills offered to ``task``: written from other tasks of its world, oldest first."""
        return [
            s for s in self.skills if s.world == task.world and s.source_task_id != task.task_id
        ]

    def select(self, tasks: Sequence[Task]) -> list[Skill | None]:
        """One skill per task by UCB1 (``None`` where a task has no candidate).

        The tasks are served in order; each choice counts as a pull for the later choices of
        the same call (the step's rewards are not known yet), and is not recorded: rewards are
        recorded by :meth:`update`.
        """
        pending: dict[int, int] = {}
        chosen: list[Skill | None] = []
        for task in tasks:
            cands = self.candidates(task)
            if not cands:
                chosen.append(None)
                continue
            pulls = torch.tensor([s.pulls + pending.get(s.skill_id, 0) for s in cands])
            means = torch.tensor([s.mean for s in cands], dtype=torch.float64)
            # argmax returns the first maximum: ties go to the oldest skill.
            best = cands[int(torch.argmax(ucb1_scores(pulls, means, self.c)))]
            pending[best.skill_id] = pending.get(best.skill_id, 0) + 1
            chosen.append(best)
        return chosen

    def update(self, skill_id: int, reward: float) -> None:
        """Record one pull of a skill with bandit reward ``reward`` in ``[0, 1]`` (a skill
        dropped for capacity since it was chosen is ignored)."""
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"bandit reward must be in [0, 1], got {reward}")
        skill = self.get(skill_id)
        if skill is not None:
            skill.pulls += 1
            skill.reward_sum += reward

    def state_dict(self) -> dict[str, Any]:
        return {"skills": [s.to_dict() for s in self.skills], "next_id": self.next_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skills = [Skill.from_dict(d) for d in state["skills"]]
        self.next_id = int(state["next_id"])


def skill_agreement(rewards: Sequence[float], log_ratios: Sequence[float], success: float) -> float:
    """The bandit reward of one pull: how often the skill-conditioned teacher agrees with the
    verified outcome on the rollouts it guided.

    A rollout agrees when the teacher raises its sampled tokens' likelihood over the student's
    (mean log-ratio ``log pi_T - log pi_theta > 0``) and it succeeded (reward >= ``success``),
    or lowers it (``< 0``) and it failed.

    Args:
        rewards: the guided rollouts' rewards.
        log_ratios: their mean sampled-token ``log pi_T(y) - log pi_theta(y)``.
        success: the success threshold (``bank.min_reward``).

    Returns:
        The fraction of agreeing rollouts, in ``[0, 1]``.
    """
    if len(rewards) != len(log_ratios) or not rewards:
        raise ValueError(
            f"need one log-ratio per reward (and at least one), got {len(rewards)} rewards and "
            f"{len(log_ratios)} log-ratios"
        )
    agree = [(r >= success) == (d > 0) for r, d in zip(rewards, log_ratios)]
    return sum(agree) / len(agree)


# --------------------------------------------------------------------------- summarizers
def call_shape(action: str) -> str:
    """A tool call with its argument values elided: ``get_policy(policy_number=...)``.

    ``action`` is a trace action ``name(key=<json>, ...)`` (:meth:`lopd.envs.base.ToolCall.render`);
    anything else (a coding answer) is returned unchanged.
    """
    name, sep, rest = action.partition("(")
    if not sep or not rest.endswith(")") or not re.fullmatch(r"[A-Za-z_]\w*", name):
        return action
    body, keys, i = rest[:-1], [], 0
    decoder = json.JSONDecoder()
    while i < len(body):
        m = re.compile(r"\s*,?\s*([A-Za-z_]\w*)=").match(body, i)
        if m is None:
            break
        keys.append(m.group(1))
        try:
            _, i = decoder.raw_decode(body, m.end())
        except ValueError:
            break
    return f"{name}({', '.join(f'{k}=...' for k in keys)})"


def _calls(traj: Trajectory) -> str:
    """``calling a(...) -> b(...)``, or ``making no tool call``."""
    calls = " -> ".join(call_shape(s.action) for s in traj.trace)
    return f"calling {calls}" if calls else "making no tool call"


class RuleSkillSummarizer:
    """Deterministic skill from a task's rollouts (the stand-in of the module docstring).

    From the best rollout (highest reward, first on ties) and the rest:

    * what works: the call sequence (argument values elided) of the successful rollouts, or of
      the best one with its reward when none succeeded;
    * what to avoid: calls of failed rollouts that returned an ``Error``, calls repeated with
      the same arguments, and a failed rollout that made no tool call;
    * suggested workflow: the best rollout's calls as numbered steps, then ending the episode.

    Coding rollouts (one answer, no tool calls) show the best answer's first lines instead.
    """

    max_items = 3  # mistakes listed

    author = "rule"
    fallbacks = 0  # it never falls back (the attribute the model summarizer counts in)

    def summarize(
        self, trajectories: Sequence[Trajectory], success: float
    ) -> tuple[SkillText, str]:
        """The skill of one task's rollout group, and its author (``"rule"``).

        Args:
            trajectories: the task's rollouts (successful and failed).
            success: the success threshold (``bank.min_reward``).
        """
        return self.text(trajectories, success), self.author

    def text(self, trajectories: Sequence[Trajectory], success: float) -> SkillText:
        """The skill of one task's rollout group (see the class docstring)."""
        if not trajectories:
            raise ValueError("need at least one trajectory to summarize")
        best = max(trajectories, key=lambda t: t.reward)  # max keeps the first of ties
        wins = [t for t in trajectories if t.reward >= success]
        fails = [t for t in trajectories if t.reward < success]
        if best.task.domain == "coding":
            return self._coding(best, wins, fails)
        if wins:
            seqs = list(dict.fromkeys(_calls(t) for t in wins))
            works = (
                f"{len(wins)} of {len(trajectories)} attempts succeeded by "
                + "; or by ".join(seqs)
                + "."
            )
        else:
            works = (
                f"No attempt succeeded; the best (reward {best.reward:.2f}) got there by "
                f"{_calls(best)}."
            )
        mistakes: list[str] = []
        for t in fails:
            seen: set[str] = set()
            for s in t.trace:
                if s.result.startswith("Error"):
                    mistakes.append(f"{call_shape(s.action)} returned {s.result.splitlines()[0]}")
                if s.action in seen:
                    mistakes.append(f"repeating {call_shape(s.action)} with the same arguments")
                seen.add(s.action)
            if not t.trace:
                mistakes.append("ending without any tool call")
        mistakes = list(dict.fromkeys(mistakes))[: self.max_items]
        if mistakes:
            avoid = "; ".join(mistakes) + "."
        elif fails:
            avoid = (
                "stopping before the task is done (a failed attempt stopped after "
                f"{_calls(fails[0])})."
            )
        else:
            avoid = "No mistakes were observed in these attempts."
        steps = [f"{i + 1}. {call_shape(s.action)}" for i, s in enumerate(best.trace)]
        steps.append(f"{len(steps) + 1}. reply Task Completed once every change is made.")
        return SkillText(works, avoid, " ".join(steps))

    def _coding(
        self, best: Trajectory, wins: Sequence[Trajectory], fails: Sequence[Trajectory]
    ) -> SkillText:
        def head(t: Trajectory) -> str:
            code = t.trace[-1].action if t.trace else ""
            lines = [x for x in code.splitlines() if x.strip()][:12]
            return "\n".join(lines) or "(no answer)"

        if wins:
            works = f"{len(wins)} answers passed every test; one of them begins:\n{head(wins[0])}"
        else:
            works = f"No answer passed every test; the best (reward {best.reward:.2f}) begins:\n"
            works += head(best)
        results = list(dict.fromkeys(t.trace[-1].result.splitlines()[0] for t in fails if t.trace))
        avoid = "; ".join(results[: self.max_items]) + "." if results else "No failures observed."
        workflow = "1. read the input format. 2. write the whole program. 3. check edge cases."
        return SkillText(works, avoid, workflow)


def parse_skill_text(text: str) -> SkillText | None:
    """The three labelled parts of a model-written skill, or ``None`` if one is missing or
    empty (labels may be bold, any case, in any order; the first of each counts)."""
    marks = list(_SECTION_RE.finditer(text))
    parts: dict[str, str] = {}
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        label = m.group(1).lower()
        if label not in parts:
            parts[label] = text[m.end() : end].strip().strip("*").strip()
    keys = ("what works", "what to avoid", "suggested workflow")
    if not all(parts.get(k) for k in keys):
        return None
    return SkillText(*(parts[k] for k in keys))


class ModelSkillSummarizer:
    """The model writes the skill itself (greedy), from the group's successes and failures.

    Args:
        model: the ``*ForCausalLM`` that writes (Skill-SD: the policy itself).
        tokenizer: its tokenizer (chat template).
        max_new_tokens: the written skill's token budget.
        fallback: used when the text lacks one of the three parts.

    Attributes:
        fallbacks: skills the fallback wrote so far (a metric).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_new_tokens: int = 256,
        fallback: RuleSkillSummarizer | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.fallback = fallback or RuleSkillSummarizer()
        self.fallbacks = 0

    def request(self, trajectories: Sequence[Trajectory], success: float) -> str:
        """The user message asking for the skill (:data:`SKILL_SUMMARY_REQUEST`)."""

        def attempts(group: list[Trajectory]) -> str:
            if not group:
                return "(none)"
            shown = []
            for k, t in enumerate(group[:_MAX_ATTEMPTS]):
                trace = (t.trace_text() or "(no tool calls)")[:_MAX_ATTEMPT_CHARS]
                shown.append(f"Attempt {k + 1} (reward {t.reward:.2f}):\n{trace}")
            return "\n".join(shown)

        wins = [t for t in trajectories if t.reward >= success]
        fails = [t for t in trajectories if t.reward < success]
        return SKILL_SUMMARY_REQUEST.format(
            instruction=trajectories[0].task.instruction,
            successes=attempts(wins),
            failures=attempts(fails),
        )

    @torch.no_grad()
    def write(self, trajectories: Sequence[Trajectory], success: float) -> str:
        """The model's raw answer to :meth:`request`."""

        tok = self.tokenizer
        ids = render_prompt(tok, "", self.request(trajectories, success))
        device = next(self.model.parameters()).device
        stop = stop_token_ids(tok)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[-1],
            )
        finally:
            self.model.train(was_training)
        return tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    def summarize(
        self, trajectories: Sequence[Trajectory], success: float
    ) -> tuple[SkillText, str]:
        """The model's skill (author ``"model"``), or the fallback's (``"rule"``) when the
        model's text lacks a part."""
        parsed = parse_skill_text(self.write(trajectories, success))
        if parsed is None:
            self.fallbacks += 1
            return self.fallback.summarize(trajectories, success)
        return parsed, "model"
