"""Chat rendering for rollouts: token ids of prompts and observations, from the chat template.

A multi-turn trajectory is stored as the concatenation of three kinds of segments::

    segment                             mask  text
    render_prompt(system, user, tools)  0     <|im_start|>system ... <|im_start|>assistant\\n
    sampled ids of turn 1 + <|im_end|>  1     what the policy sampled
    render_observation(obs_1)           0     \\n<|im_start|>user\\n<tool_response>...
    sampled ids of turn 2 + <|im_end|>  1
    ...

Generated text is never re-tokenized (a sampled id sequence need not be the canonical tokenization
of its text), so the action mask is aligned with what the policy produced token by token. The
template segments come from the tokenizer's own chat template (``apply_chat_template``), which
makes rendering model-agnostic: Qwen3's template for real Qwen3 checkpoints (tools listed in the
system turn, ``enable_thinking`` switchable), and :data:`TINY_CHAT_TEMPLATE` for the embedded tiny
model.

The observation segment is cut out of a rendered conversation with sentinels: render
``[system, user, assistant(A), tool(O)]`` plus the generation prompt and take the text between
``A<end-of-turn>`` and the next assistant header, splitting it around ``O``. Tokenizing that text
on its own gives the same ids as inside the whole conversation because it starts right after a
special token (the end-of-turn token), where tokenizers always split.
"""

from __future__ import annotations

import functools
import json
from typing import Any

# Sentinels for cutting template segments; plain ASCII so no template escapes them.
_SENT_ASSISTANT = "LOPDSENTINELASSISTANT"
_SENT_OBSERVATION = "LOPDSENTINELOBSERVATION"

TINY_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- '- ' + fn.name + '(' }}"
    "{%- if fn.parameters is defined and fn.parameters.properties is defined %}"
    "{{- fn.parameters.properties.keys() | join(', ') }}"
    "{%- endif %}"
    "{{- ')\\n' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The tiny model's chat template: Qwen3's layout with a compact tool list.

Rendered conversation (``\\n`` are newlines)::

    <|im_start|>system
    {system prompt}

    # Tools
    - find_customer(name)
    - update_order(order_id, status)
    <|im_end|>
    <|im_start|>user
    {task instruction}<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "find_customer", "arguments": {"name": "Lena Park"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {tool result}
    </tool_response><|im_end|>
    <|im_start|>assistant
    Task Completed<|im_end|>

Differences from Qwen3's template, all to keep sequences short for a 2-core CPU: tools are one
line each (``name(parameter names)``, no descriptions or types) instead of full JSON schemas,
there is no tool-call format paragraph (the tiny model learns the format from its SFT data), and
there are no ``<think>`` blocks (``enable_thinking`` is accepted and ignored). Tool results are
``user`` turns wrapped in ``<tool_response>`` exactly like Qwen3, with consecutive tool messages
sharing one turn.
"""


def end_of_turn_token(tokenizer: Any) -> str:
    """The token that closes an assistant turn: ``<|im_end|>`` for ChatML templates, else EOS.

    Args:
        tokenizer: a Hugging Face tokenizer.

    Raises:
        ValueError: the tokenizer has neither ``<|im_end|>`` nor an EOS token.
    """
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        return "<|im_end|>"
    if tokenizer.eos_token is None:
        raise ValueError("tokenizer has no '<|im_end|>' token and no eos_token to end a turn")
    return tokenizer.eos_token


def end_of_turn_id(tokenizer: Any) -> int:
    """Token id of :func:`end_of_turn_token`."""
    return tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end a generated turn: the end-of-turn token first, then EOS and pad if different.

    A real checkpoint may emit ``<|endoftext|>`` instead of ``<|im_end|>``; the rollout stops on
    either and closes the turn with the end-of-turn token.
    """
    ids = [end_of_turn_id(tokenizer)]
    for tok_id in (tokenizer.eos_token_id, tokenizer.pad_token_id):
        if tok_id is not None and tok_id not in ids:
            ids.append(tok_id)
    return ids


def _check_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "tokenizer has no chat_template; load a chat/instruct checkpoint or set "
            "tokenizer.chat_template (lopd.rollout.chat.TINY_CHAT_TEMPLATE is a Qwen3-style one)"
        )


def _apply(
    tokenizer: Any,
    messages: list[dict[str, str]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    enable_thinking: bool,
) -> str:
    _check_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        enable_thinking=enable_thinking,
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Tokenize template text: special tokens are parsed, no BOS/EOS is added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt_text(
    tokenizer: Any,
    system: str,
    user: str,
    tools: list[dict[str, Any]] | None = None,
    *,
    enable_thinking: bool = False,
) -> str:
    """The text of :func:`render_prompt` (system + first user turn + assistant header)."""
    messages = [{"role": "user", "content": user}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return _apply(tokenizer, messages, tools, True, enable_thinking)


def render_prompt(
    tokenizer: Any,
    system: str,
    user: str,
    tools: list[dict[str, Any]] | None = None,
    *,
    enable_thinking: bool = False,
) -> list[int]:
    """Token ids the student is conditioned on before its first turn.

    A pure function of its inputs: the LOPD trainer re-renders the prompt with a modified first
    user message (latent placeholders inside framing text) to build the teacher's input, and the
    assistant part of the trajectory (``input_ids[prompt_len:]``) is appended unchanged.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        system: the system message (``""`` for none).
        user: the first user message (the task instruction).
        tools: OpenAI-style function schemas rendered into the system turn, or ``None``.
        enable_thinking: Qwen3's switch; with ``False`` Qwen3's template appends an empty
            ``<think></think>`` block to the assistant header. Ignored by templates without it.

    Returns:
        ``[prompt_len]`` token ids, ending with the first assistant header.
    """
    if not isinstance(user, str):
        raise TypeError(f"user must be a str, got {type(user).__name__}")
    return encode(
        tokenizer,
        render_prompt_text(tokenizer, system, user, tools, enable_thinking=enable_thinking),
    )


OBSERVATION_ROLES = ("tool", "user")
"""Roles an observation may be rendered as: a tool result, or the next user turn (multi-turn
benchmarks such as BFCL feed the next user request after the model ends its turn)."""


@functools.lru_cache(maxsize=64)
def _observation_affixes(
    tokenizer: Any, enable_thinking: bool, role: str = "tool"
) -> tuple[str, str]:
    eot = end_of_turn_token(tokenizer)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _SENT_ASSISTANT},
        {"role": role, "content": _SENT_OBSERVATION},
    ]
    text = _apply(tokenizer, messages, None, True, enable_thinking)
    anchor = _SENT_ASSISTANT + eot
    start = text.find(anchor)
    if start < 0 or text.count(_SENT_OBSERVATION) != 1:
        raise ValueError(
            "the tokenizer's chat template does not render an assistant turn as "
            f"'<content>{eot}' followed by one {role} turn; cannot derive observation segments"
        )
    segment = text[start + len(anchor) :]
    prefix, suffix = segment.split(_SENT_OBSERVATION)
    return prefix, suffix


def render_observation_text(
    tokenizer: Any, observation: str, *, enable_thinking: bool = False, role: str = "tool"
) -> str:
    """The text of :func:`render_observation`."""
    if not isinstance(observation, str):
        raise TypeError(f"observation must be a str, got {type(observation).__name__}")
    if role not in OBSERVATION_ROLES:
        raise ValueError(f"role must be one of {OBSERVATION_ROLES}, got {role!r}")
    prefix, suffix = _observation_affixes(tokenizer, enable_thinking, role)
    return prefix + observation + suffix


def render_observation(
    tokenizer: Any, observation: str, *, enable_thinking: bool = False, role: str = "tool"
) -> list[int]:
    """Token ids between an assistant turn's end-of-turn token and the next generated token.

    The observation is rendered as one ``tool`` message (Qwen3: a ``user`` turn wrapping the text
    in ``<tool_response>``), or with ``role="user"`` as the next user turn, followed by the next
    assistant header (with Qwen3's empty think block when ``enable_thinking`` is False).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        observation: the environment's observation text.
        enable_thinking: as in :func:`render_prompt`.
        role: ``"tool"`` (a tool result) or ``"user"`` (the next user message).

    Returns:
        The segment's token ids (all template/observation tokens: action mask 0).

    Raises:
        ValueError: an unknown ``role``.
    """
    return encode(
        tokenizer,
        render_observation_text(tokenizer, observation, enable_thinking=enable_thinking, role=role),
    )


def render_messages(
    tokenizer: Any,
    messages: list[dict[str, str]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    enable_thinking: bool = False,
) -> list[int]:
    """Tokenize a whole conversation with the chat template (messages as in ``Trajectory``).

    A conversation that ends with an assistant message is cut right after its end-of-turn token,
    where a trajectory ends (templates append a newline after it). For the tiny model's
    template, a trajectory whose generated turns are canonical tokenizations re-renders to exactly
    its ``input_ids``. Qwen3's template rewrites earlier assistant turns (it drops their think
    blocks), so trajectories of real models are only defined by their incremental segments.
    """
    text = _apply(tokenizer, messages, tools, add_generation_prompt, enable_thinking)
    if messages and messages[-1]["role"] == "assistant" and not add_generation_prompt:
        eot = end_of_turn_token(tokenizer)
        cut = text.rfind(eot)
        if cut >= 0:
            text = text[: cut + len(eot)]
    return encode(tokenizer, text)


def tools_fingerprint(tools: list[dict[str, Any]] | None) -> str:
    """A stable string key for a tool list (for caching prompts per world)."""
    return json.dumps(tools or [], sort_keys=True)
