"""The frozen base model generating with latents: "base + composer" rollouts (paper 4.3).

Generation from ``inputs_embeds`` reuses :func:`lopd.rollout.multi_turn.rollout` unchanged through
two thin adapters:

* :class:`LatentPromptEnv` wraps each task's environment so its first user message is the
  teacher's framed message, with ``J*K`` pad-token strings in place of the sentinel: the chat
  template renders them as a contiguous run of pad ids (the placeholders of A.4).
* :class:`LatentConditionedLM` is the frozen backbone behind a ``forward`` that embeds
  ``input_ids`` and, in every prefill, replaces each row's placeholder run by that task's
  latents (rows are matched to tasks by their rendered prompt, which the rollout prefixes to
  every context). Decode steps pass through unchanged. Run it inside
  ``composer.teacher_mode()`` so the encoder's LoRA is off, as for the teacher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lopd.envs import make_env
from lopd.latent.injection import LATENT_SENTINEL, build_teacher_prompt, frame_user_message
from lopd.rollout.chat import render_prompt
from lopd.types import Task

__all__ = ["LatentConditionedLM", "LatentFraming", "LatentPromptEnv", "find_run"]


class LatentPromptEnv:
    """An environment whose first user message carries the latent framing and placeholders.

    Everything except :meth:`reset` is delegated to the wrapped environment.

    Args:
        env: the task's environment.
        domain: framing-text selector.
        num_latents: ``J*K`` placeholders.
        placeholder_text: the pad token's string (rendered by the tokenizer as one pad id).
    """

    def __init__(self, env: Any, domain: str, num_latents: int, placeholder_text: str) -> None:
        self._env = env
        self._domain = domain
        self._num_latents = num_latents
        self._placeholder_text = placeholder_text

    def reset(self, task: Task) -> str:
        user = self._env.reset(task)
        framed = frame_user_message(user, self._domain)
        return framed.replace(LATENT_SENTINEL, self._placeholder_text * self._num_latents)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


class LatentConditionedLM(nn.Module):
    """A causal LM whose prefills have per-task latents injected at the placeholder span.

    Args:
        backbone: the frozen ``*ForCausalLM`` (call inside ``composer.teacher_mode()``).
        prompts: per task, the rendered prompt ids (with placeholders), as the rollout renders
            them; used to recognise which task a batch row belongs to.
        latents: per task, ``[J*K, d]`` latents (same order as ``prompts``).
        latent_starts: per task, index of the first placeholder inside its prompt.
    """

    def __init__(
        self,
        backbone: nn.Module,
        prompts: Sequence[Sequence[int]],
        latents: Sequence[torch.Tensor],
        latent_starts: Sequence[int],
    ) -> None:
        super().__init__()
        if not (len(prompts) == len(latents) == len(latent_starts)):
            raise ValueError("prompts, latents and latent_starts must have the same length")
        self.backbone = backbone
        self._by_prompt = {
            tuple(p): (lat, start) for p, lat, start in zip(prompts, latents, latent_starts)
        }
        self._lengths = sorted({len(p) for p in prompts})

    @property
    def config(self) -> Any:
        return self.backbone.config

    def _lookup(self, row: list[int]) -> tuple[torch.Tensor, int] | None:
        for n in self._lengths:
            hit = self._by_prompt.get(tuple(row[:n]))
            if hit is not None:
                return hit
        return None

    def prompt_embeds(self, ids: Sequence[int]) -> torch.Tensor:
        """``[L, d]`` input embeddings of one context with its task's latents injected (what a
        prefill of :meth:`forward` feeds the backbone; the vLLM engine's ``prompt_embeds``)."""
        hit = self._lookup(list(ids))
        if hit is None:
            raise RuntimeError("the context does not start with any registered latent prompt")
        lat, start = hit
        table = self.backbone.get_input_embeddings()
        with torch.no_grad():
            embeds = table(torch.tensor(list(ids), dtype=torch.long, device=table.weight.device))
            return torch.cat([embeds[:start], lat.to(embeds.dtype), embeds[start + len(lat) :]])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Same signature as the backbone's; ``input_ids`` ``[B, T]``, left-padded in prefill."""
        embeds = self.backbone.get_input_embeddings()(input_ids)
        prefill = past_key_values is None or past_key_values.get_seq_length() == 0
        if prefill:
            rows = []
            for b in range(input_ids.shape[0]):
                # Left padding: the row's real tokens start where the attention mask turns on.
                pad = 0 if attention_mask is None else int((attention_mask[b] == 0).sum())
                hit = self._lookup(input_ids[b, pad:].tolist())
                if hit is None:
                    raise RuntimeError(
                        f"batch row {b} does not start with any registered latent prompt"
                    )
                lat, start = hit
                s = pad + start
                rows.append(
                    torch.cat([embeds[b, :s], lat.to(embeds.dtype), embeds[b, s + len(lat) :]])
                )
            embeds = torch.stack(rows)
        return self.backbone(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )


def find_run(ids: Sequence[int], value: int, n: int) -> int:
    """Index of the first run of ``n`` consecutive ``value`` ids."""
    run = 0
    for i, x in enumerate(ids):
        run = run + 1 if x == value else 0
        if run == n:
            return i - n + 1
    raise ValueError(f"no run of {n} placeholder ids ({value}) in the rendered prompt")


@dataclass(frozen=True)
class LatentFraming:
    """What the latent teacher adds to a task's prompt (the start-up token-budget check,
    :func:`lopd.rollout.budget.check_token_budgets`).

    Attributes:
        num_latents: ``J*K`` placeholders (``composer.num_latents * composer.num_retrieved``).
    """

    num_latents: int

    def framed_prompt(self, tokenizer: Any, task: Task, enable_thinking: bool) -> list[int]:
        """The "base + composer" prompt: the framed first user message with ``J*K`` pad-token
        placeholders, rendered as the rollout renders it."""
        ph = tokenizer.convert_ids_to_tokens(tokenizer.pad_token_id)
        env = LatentPromptEnv(make_env(task), task.domain, self.num_latents, ph)
        user = env.reset(task)
        return render_prompt(
            tokenizer, env.system_prompt(), user, env.tools(), enable_thinking=enable_thinking
        )

    def teacher_overhead(self, tokenizer: Any, task: Task, prompt: list[int]) -> int:
        """Tokens the teacher's input (framing + ``J*K``) adds to a trajectory of ``task``."""
        user = make_env(task).reset(task)
        ids, _ = build_teacher_prompt(
            tokenizer,
            prompt,
            user,
            task.domain,
            self.num_latents,
            placeholder_id=tokenizer.pad_token_id,
        )
        return len(ids) - len(prompt)
