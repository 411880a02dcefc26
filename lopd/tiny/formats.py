"""Every method's privileged-context format, as the embedded tiny model reads a reference.

Each text-conditioned teacher puts a successful trajectory (or a skill distilled from one) into
its prompt in its own wording and place:

========== ============================================================ =====================
format     wording                                                      reference as
========== ============================================================ =====================
lopd       paper A.5 framing around the first user message              the bank's A.3 text
           (:func:`lopd.latent.injection.frame_with_references`)
opsd       :data:`lopd.methods.opsd.OPSD_SYSTEM_TEMPLATE`, system msg   the bank's A.3 text
sdft       :data:`lopd.methods.sdft.SDFT_USER_TEMPLATE`, after the      the trace lines
           first user message
sdpo       :data:`lopd.methods.sdpo.SDPO_USER_TEMPLATE`, after it       the trace lines
skill-sd   :data:`lopd.methods.skills.SKILL_USER_TEMPLATE`, after it    a rule-written skill
========== ============================================================ =====================

The tiny model's training data (:class:`lopd.tiny.data.EpisodeSource`) draws one of its
``Mixture.formats`` per reference-conditioned episode, so each method's teacher is a reader of
its own context; :func:`lopd.tiny.probe.probe_formats` measures what each format is worth to the
base model (paper 3.1's (a), per method).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lopd.envs
from lopd.latent.injection import frame_with_references
from lopd.memory.bank import BankEntry, format_experience
from lopd.methods.opsd import OPSD_SYSTEM_TEMPLATE
from lopd.methods.sdft import SDFT_USER_TEMPLATE
from lopd.methods.sdpo import SDPO_USER_TEMPLATE
from lopd.methods.skills import RuleSkillSummarizer
from lopd.types import Task, Trajectory

__all__ = ["FORMATS", "FramedPrompt", "FramedPromptEnv", "frame_reference", "framed_env_factory"]

FORMATS = ("lopd", "opsd", "sdft", "sdpo", "skill-sd")


@dataclass(frozen=True)
class FramedPrompt:
    """A prompt with a reference in one method's format.

    Attributes:
        system_suffix: appended to the system message (where the method puts it there).
        user: the first user message.
    """

    system_suffix: str
    user: str


def frame_reference(
    fmt: str, user: str, domain: str, reference: Trajectory, *, emptied: bool = False
) -> FramedPrompt:
    """``user`` (the first user message) with ``reference`` in the format ``fmt``.

    Args:
        fmt: one of :data:`FORMATS`.
        user: the bare first user message (the instruction).
        domain: the task's domain (the A.5 framing's wording).
        reference: a successful trajectory of another task (its ``trace`` and ``reward``).
        emptied: the format's template with nothing in it, as a teacher reads it under
            ``lopd.null_context`` (:meth:`lopd.methods.base.MethodBase.privileged`; the skill's
            parts emptied; ``lopd``: the framing around an empty experience, the text twin of
            the zero latents).

    Raises:
        ValueError: an unknown format.
    """

    def fill(text: str) -> str:
        return "" if emptied else text

    trace = fill(reference.trace_text() or "(no tool calls)")
    if fmt in ("lopd", "opsd"):
        experience = fill(format_experience(BankEntry.from_trajectory(reference)))
        if fmt == "lopd":
            return FramedPrompt("", frame_with_references(user, domain, [experience]))
        return FramedPrompt(OPSD_SYSTEM_TEMPLATE.format(gt_text=experience), user)
    if fmt == "sdft":
        return FramedPrompt("", user + SDFT_USER_TEMPLATE.format(demo_text=trace))
    if fmt == "sdpo":
        return FramedPrompt("", user + SDPO_USER_TEMPLATE.format(solution=trace))
    if fmt == "skill-sd":
        skill = RuleSkillSummarizer().text([reference], success=reference.reward)
        return FramedPrompt("", user + skill.map(fill).render())
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


class FramedPromptEnv:
    """A task environment whose prompt carries a reference in one method's format.

    :meth:`reset` returns the framed first user message and :meth:`system_prompt` the system
    message with the format's suffix; everything else is delegated to the wrapped environment.

    Args:
        env: the task's environment.
        fmt: one of :data:`FORMATS`.
        reference: the successful trajectory to show.
        emptied: show the format's template with nothing in it (:func:`frame_reference`).
    """

    def __init__(self, env: Any, fmt: str, reference: Trajectory, emptied: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
        self._env = env
        self._fmt = fmt
        self._reference = reference
        self._emptied = emptied
        self._system_suffix = ""

    def reset(self, task: Task) -> str:
        framed = frame_reference(
            self._fmt, self._env.reset(task), task.domain, self._reference, emptied=self._emptied
        )
        self._system_suffix = framed.system_suffix
        return framed.user

    def system_prompt(self) -> str:
        return self._env.system_prompt() + self._system_suffix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def framed_env_factory(
    fmt: str, references: Mapping[str, Trajectory], make_env: Any = None, emptied: bool = False
) -> Any:
    """A ``make_env`` for :func:`lopd.rollout.multi_turn.rollout`: each task's environment
    (``make_env``, default :func:`lopd.envs.make_env`) with its reference
    (``references[task_id]``) in the format ``fmt`` (``emptied``: the template alone)."""
    inner = make_env or lopd.envs.make_env

    def make(task: Task) -> FramedPromptEnv:
        return FramedPromptEnv(inner(task), fmt, references[task.task_id], emptied)

    return make
