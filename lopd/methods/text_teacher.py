"""Teachers whose privileged context is text (OPSD's retrieved trajectory, SDPO's sibling).

Each method has its own wording and place for the text (``lopd.context_format=own``, the
paper's). Under ``lopd.context_format=a5`` every one of them puts it where LOPD's latents go
instead: LOPD's A.5 framing of the first user message (:func:`framed_teacher_sequence`), a
trajectory written as the bank's A.3 experience text (:func:`reference_text`). The reader is
then the same for every method: the framing the embedded tiny model was taught to read.

The teacher prompt is the student's rendered prompt with text inserted into one message; the
student's tokens after its prompt are appended unchanged, so student position ``p >= prompt_len``
is teacher position ``p + offset`` with one constant offset: the same exact student-to-teacher map
of action tokens as the latent injection (:mod:`lopd.latent.injection`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lopd.latent.injection import frame_with_references
from lopd.memory import BankEntry, format_experience
from lopd.rollout.batch import ActionRows, pad_batch
from lopd.rollout.chat import encode
from lopd.run.context import Models
from lopd.types import Trajectory

__all__ = [
    "TextTeacherSequence",
    "build_text_teacher_sequence",
    "framed_teacher_sequence",
    "reference_text",
    "text_teacher_hidden",
]


@dataclasses.dataclass(frozen=True)
class TextTeacherSequence:
    """A teacher input whose privileged context is text.

    Attributes:
        input_ids: ``[L_t]`` teacher prompt followed by the student's tokens after its prompt.
        prompt_len: length of the teacher prompt.
        offset: student position ``p >= student prompt_len`` is teacher position ``p + offset``.
    """

    input_ids: list[int]
    prompt_len: int
    offset: int


def build_text_teacher_sequence(
    tokenizer: Any,
    traj: Trajectory,
    *,
    system_suffix: str = "",
    user_suffix: str = "",
    user_text: str | None = None,
) -> TextTeacherSequence:
    """The teacher input of a trajectory with text appended to its system / first user message
    (or the first user message replaced).

    The student's rendered prompt is decoded (special tokens kept as text, so the chat-template
    structure survives re-encoding), the suffixes are inserted right after the system message and
    the first user message, the text is re-encoded, and ``traj.input_ids[prompt_len:]`` is
    appended unchanged.

    Args:
        tokenizer: the backbone's tokenizer.
        traj: the student's trajectory (``messages`` holds the system and first user message).
        system_suffix: appended to the system message.
        user_suffix: appended to the first user message.
        user_text: replaces the first user message (before ``user_suffix`` is appended); e.g.
            the message in LOPD's A.5 framing with a reference in it.

    Returns:
        A :class:`TextTeacherSequence`.

    Raises:
        ValueError: a suffix is given for a message the trajectory does not have, or the message
            text is not found in the decoded prompt.
    """

    prompt = traj.input_ids[: traj.prompt_len]
    text = tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # Insert the user suffix first (searching from the right: the first user message is the
    # prompt's last message), then the system suffix (from the left: the first message), so
    # neither insertion shifts the other's anchor.
    for role, suffix, find in (("user", user_suffix, text.rfind), ("system", system_suffix, None)):
        replace = user_text if role == "user" else None
        if not suffix and replace is None:
            continue
        content = next((m["content"] for m in traj.messages if m["role"] == role), None)
        if content is None:
            raise ValueError(f"trajectory of task {traj.task.task_id!r} has no {role} message")
        at = (find or text.find)(content)
        if at < 0:
            raise ValueError(
                f"the {role} message of task {traj.task.task_id!r} is not in its decoded prompt"
            )
        end = at + len(content)
        text = text[:at] + (content if replace is None else replace) + suffix + text[end:]
    ids = encode(tokenizer, text)
    return TextTeacherSequence(
        input_ids=ids + list(traj.input_ids[traj.prompt_len :]),
        prompt_len=len(ids),
        offset=len(ids) - traj.prompt_len,
    )


def reference_text(traj: Trajectory, context_format: str) -> str:
    """A successful trajectory as a teacher reads it: its observation-lite trace (``own``, the
    paper's demonstration / solution text) or the bank's A.3 experience text (``a5``)."""
    if context_format == "a5":
        return format_experience(BankEntry.from_trajectory(traj))
    return traj.trace_text() or "(no tool calls)"


def framed_teacher_sequence(
    tokenizer: Any,
    traj: Trajectory,
    reference: str,
    context_format: str,
    *,
    system_suffix: str = "",
    user_suffix: str = "",
) -> TextTeacherSequence:
    """The teacher input of ``traj`` with its privileged ``reference`` in ``context_format``.

    Args:
        tokenizer: the backbone's tokenizer.
        traj: the student's trajectory.
        reference: the privileged text (empty under ``lopd.null_context``).
        context_format: ``own``: the method's wording, ``system_suffix`` / ``user_suffix``
            (which already hold ``reference``); ``a5``: ``reference`` in LOPD's A.5 framing
            of the first user message (:func:`~lopd.latent.injection.frame_with_references`),
            the suffixes unused.

    Raises:
        ValueError: an unknown ``context_format``, or see :func:`build_text_teacher_sequence`.
    """
    if context_format == "own":
        return build_text_teacher_sequence(
            tokenizer, traj, system_suffix=system_suffix, user_suffix=user_suffix
        )
    if context_format != "a5":
        raise ValueError(f"context_format must be 'own' or 'a5', got {context_format!r}")
    user = next((m["content"] for m in traj.messages if m["role"] == "user"), None)
    if user is None:
        raise ValueError(f"trajectory of task {traj.task.task_id!r} has no user message")
    framed = frame_with_references(user, traj.task.domain, [reference])
    return build_text_teacher_sequence(tokenizer, traj, user_text=framed)


def text_teacher_hidden(
    models: Models,
    model: nn.Module,
    sequences: Sequence[TextTeacherSequence],
    where: ActionRows,
) -> torch.Tensor:
    """Final hidden states of a text-conditioned teacher at the student's action rows, ``[N, d]``.

    Args:
        models: the run's models (tokenizer's padding id, sharding).
        model: the teacher ``*ForCausalLM`` (frozen base or EMA shadow).
        sequences: B teacher sequences, one per trajectory of ``where``.
        where: the student's :class:`~lopd.rollout.batch.ActionRows`.
    """
    device = where.rows.device
    ids, mask = pad_batch([s.input_ids for s in sequences], models.pad_id, device)
    hidden = models.hidden_states(model, input_ids=ids, attention_mask=mask)
    offsets = torch.as_tensor([s.offset for s in sequences], dtype=torch.long, device=device)
    return hidden[where.batch, where.rows + offsets[where.batch]]
