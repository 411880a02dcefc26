"""Latent injection into the teacher's context (paper A.4, framing text of A.5).

The teacher sees exactly the student's conversation, except that its first user message is
wrapped in the paper's framing text around a ``<|LATENT_PH|>`` sentinel::

    <framing before> <|LATENT_PH|> <framing after> <original first user message>

The student's rendered prompt is decoded to text, the framing is inserted around the first user
message, the text is split on the sentinel and each half is tokenized independently; ``J * K``
placeholder ids (the pad token) go between the halves. The student's tokens after its prompt (all
assistant turns and observations) are appended unchanged, so every student position
``p >= prompt_len`` sits at teacher position ``p + offset`` with one constant ``offset``: the map
from student action tokens to teacher positions is exact by construction.

At forward time the placeholder embeddings are replaced by the composer's latents with
``torch.cat`` over slices (never in-place assignment), so autograd reaches the composer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "FRAMING",
    "LATENT_SENTINEL",
    "TeacherSequence",
    "build_teacher_prompt",
    "build_teacher_sequence",
    "frame_user_message",
    "frame_with_references",
    "inject_latents",
]

LATENT_SENTINEL = "<|LATENT_PH|>"

# Paper A.5, verbatim (per domain): the teacher is told the latents are a reference from a
# DIFFERENT task, so it conditions on the approach rather than copying actions.
FRAMING: dict[str, tuple[str, str]] = {
    "tool_use": (
        "The following is a REFERENCE EXAMPLE of how a DIFFERENT, already-solved task was "
        "handled, shown only to illustrate the general approach. It was performed in a SEPARATE "
        "session \u2013 in YOUR task below, NOTHING has been done yet and the environment is in "
        "its initial state. You must perform every step yourself by calling the tools and "
        "reading their actual results; do NOT assume any step is already complete.",
        "\u2014 end of reference example \u2014\n\nNow complete YOUR task below, starting from "
        "scratch (the environment is untouched):",
    ),
    "coding": (
        "The following is a reference from a similar programming problem. Study the approach "
        "and algorithm, then solve YOUR problem below.",
        "\u2014 end of reference \u2014",
    ),
}


def frame_user_message(user: str, domain: str) -> str:
    """The teacher's first user message: framing text around the sentinel, then ``user``."""
    if domain not in FRAMING:
        raise ValueError(f"domain must be one of {sorted(FRAMING)}, got {domain!r}")
    before, after = FRAMING[domain]
    return f"{before}\n\n{LATENT_SENTINEL}\n\n{after}\n\n{user}"


def frame_with_references(user: str, domain: str, references: Sequence[str]) -> str:
    """The first user message with experiences as *text* where the latents would go.

    The same A.5 framing as :func:`frame_user_message`, the sentinel replaced by the references
    (each one :func:`~lopd.memory.format_experience` text) separated by blank lines: the prompt of
    "base + retrieved trajectory as text", and of the tiny model's reference-conditioned training
    episodes.

    Raises:
        ValueError: no references, or an unknown ``domain``.
    """
    if not references:
        raise ValueError("references must hold at least one experience text")
    return frame_user_message(user, domain).replace(LATENT_SENTINEL, "\n\n".join(references))


@dataclass(frozen=True)
class TeacherSequence:
    """One teacher input built from one student trajectory.

    Attributes:
        input_ids: ``[L_t]`` teacher prompt (with ``num_latents`` placeholders) followed by the
            student's tokens after its prompt.
        latent_start: index of the first placeholder.
        num_latents: ``J * K`` placeholders.
        prompt_len: length of the teacher prompt (``input_ids[:prompt_len]``).
        offset: student position ``p >= student_prompt_len`` is teacher position ``p + offset``.
    """

    input_ids: list[int]
    latent_start: int
    num_latents: int
    prompt_len: int
    offset: int

    def teacher_position(self, student_positions: torch.Tensor) -> torch.Tensor:
        """Map student positions (all ``>= student prompt_len``) to teacher positions."""
        return student_positions + self.offset


def build_teacher_prompt(
    tokenizer,
    prompt_ids: Sequence[int],
    user_message: str,
    domain: str,
    num_latents: int,
    placeholder_id: int | None = None,
) -> tuple[list[int], int]:
    """The teacher prompt ids with a span of placeholder ids (A.4 eq. 17).

    Args:
        tokenizer: the backbone's Hugging Face tokenizer.
        prompt_ids: the student's rendered prompt (system + first user message + assistant
            header), ``[prompt_len]``.
        user_message: the first user message's text as it appears in the rendered prompt.
        domain: selects the framing text (``tool_use`` or ``coding``).
        num_latents: ``J * K`` placeholder positions to insert.
        placeholder_id: id to put at the placeholders; defaults to the pad token (else EOS).

    Returns:
        ``(ids, latent_start)``: the teacher prompt and the index of its first placeholder.

    Raises:
        ValueError: ``user_message`` is not found in the decoded prompt, or ``num_latents < 1``.
    """
    if num_latents < 1:
        raise ValueError(f"num_latents must be >= 1, got {num_latents}")
    if placeholder_id is None:
        placeholder_id = tokenizer.pad_token_id
        if placeholder_id is None:
            placeholder_id = tokenizer.eos_token_id
    # Decoding keeps special tokens as their literal strings; re-encoding maps them back to the
    # same ids, so the chat-template structure survives the round trip.
    text = tokenizer.decode(
        list(prompt_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    # The first user message is the last message of the prompt: search from the right so a
    # system prompt that happens to quote the task cannot capture the framing.
    at = text.rfind(user_message) if user_message else -1
    if at < 0:
        raise ValueError(
            "user_message was not found in the decoded student prompt; pass the first user "
            "message exactly as rendered"
        )
    framed = frame_user_message(user_message, domain)
    full = text[:at] + framed + text[at + len(user_message) :]
    before, after = full.split(LATENT_SENTINEL)
    ids_before = tokenizer.encode(before, add_special_tokens=False)
    ids_after = tokenizer.encode(after, add_special_tokens=False)
    return ids_before + [placeholder_id] * num_latents + ids_after, len(ids_before)


def build_teacher_sequence(
    tokenizer,
    input_ids: Sequence[int],
    prompt_len: int,
    user_message: str,
    domain: str,
    num_latents: int,
    placeholder_id: int | None = None,
) -> TeacherSequence:
    """The teacher input for one student trajectory: teacher prompt + student continuation.

    Args:
        tokenizer: the backbone's tokenizer.
        input_ids: the student's whole conversation, ``[L]``.
        prompt_len: length of the student's prompt inside ``input_ids``.
        user_message: the first user message (the task instruction as shown to the student).
        domain: framing text selector.
        num_latents: ``J * K``.
        placeholder_id: see :func:`build_teacher_prompt`.

    Returns:
        A :class:`TeacherSequence`.
    """
    if not 0 < prompt_len <= len(input_ids):
        raise ValueError(f"prompt_len must be in [1, {len(input_ids)}], got {prompt_len}")
    prompt, start = build_teacher_prompt(
        tokenizer, input_ids[:prompt_len], user_message, domain, num_latents, placeholder_id
    )
    return TeacherSequence(
        input_ids=prompt + list(input_ids[prompt_len:]),
        latent_start=start,
        num_latents=num_latents,
        prompt_len=len(prompt),
        offset=len(prompt) - prompt_len,
    )


def inject_latents(embeds: torch.Tensor, latents: torch.Tensor, start: int) -> torch.Tensor:
    """Replace ``embeds[start : start + n]`` by ``latents`` (A.4 eq. 18) with ``torch.cat``.

    Args:
        embeds: ``[L, d]`` token embeddings of one teacher sequence.
        latents: ``[n, d]`` composer output for that sequence.
        start: first placeholder index.

    Returns:
        ``[L, d]``; differentiable with respect to ``latents`` (and ``embeds`` outside the span).
    """
    n = latents.shape[0]
    if embeds.dim() != 2 or latents.dim() != 2 or embeds.shape[1] != latents.shape[1]:
        raise ValueError(
            f"embeds must be [L, d] and latents [n, d] with the same d, got "
            f"{tuple(embeds.shape)} and {tuple(latents.shape)}"
        )
    if not 0 <= start <= embeds.shape[0] - n:
        raise ValueError(f"start={start} puts {n} latents outside a length-{embeds.shape[0]} input")
    return torch.cat([embeds[:start], latents.to(embeds.dtype), embeds[start + n :]], dim=0)
