"""Teachers whose privileged context is text (OPSD's retrieved trajectory, SDPO's sibling).

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

from lopd.rollout.batch import ActionRows, pad_batch
from lopd.rollout.chat import encode
from lopd.run.context import Models
from lopd.types import Trajectory

__all__ = ["TextTeacherSequence", "build_text_teacher_sequence", "text_teacher_hidden"]


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
) -> TextTeacherSequence:
    """The teacher input of a trajectory with text appended to its system / first user message.

    The student's rendered prompt is decoded (special tokens kept as text, so the chat-template
    structure survives re-encoding), the suffixes are inserted right after the system message and
    the first user message, the text is re-encoded, and ``traj.input_ids[prompt_len:]`` is
    appended unchanged.

    Args:
        tokenizer: the backbone's tokenizer.
        traj: the student's trajectory (``messages`` holds the system and first user message).
        system_suffix: appended to the system message.
        user_suffix: appended to the first user message.

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
        if not suffix:
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
        text = text[:end] + suffix + text[end:]
    ids = encode(tokenizer, text)
    return TextTeacherSequence(
        input_ids=ids + list(traj.input_ids[traj.prompt_len :]),
        prompt_len=len(ids),
        offset=len(ids) - traj.prompt_len,
    )


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
