"""Held-out evaluation: the student alone, and the frozen base model generating with latents.

:class:`HeldOutEvaluator` is the trainer's evaluation phase (rank 0 evaluates, the other ranks
wait): ``vanilla`` (the student before training), ``lopd`` (the trained student) and
``base_composer`` (the frozen base model generating with retrieved latents).

Metrics (paper Table 3) over one rollout per task: mean reward with its standard error, success
rate (reward 1), interaction steps, tool calls per step, repeated tool calls and first-step
length (tokens of the first assistant turn).

"Base + composer" evaluation needs generation from ``inputs_embeds``. It reuses
:func:`lopd.rollout.rollout` unchanged through two thin adapters:

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

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lopd.injection import LATENT_SENTINEL, frame_user_message
from lopd.types import Task, Trajectory

if TYPE_CHECKING:
    from lopd.distributed import Dist
    from lopd.engine import RolloutEngine
    from lopd.methods.base import Models

__all__ = [
    "BEHAVIOUR_METRICS",
    "HeldOutEvaluator",
    "LatentConditionedLM",
    "LatentPromptEnv",
    "main",
    "summarize",
]


BEHAVIOUR_METRICS = ("steps", "tool_calls_per_step", "repeated_tool_calls", "first_step_tokens")
"""Paper Table 3's behaviour metrics among :func:`summarize`'s keys."""


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Table-3 metrics of one rollout per held-out task.

    Returns:
        ``n``, ``reward_mean``, ``reward_stderr`` (sample std / sqrt(n); 0 for n = 1),
        ``success_rate`` (reward >= 1), ``steps``, ``tool_calls_per_step``,
        ``repeated_tool_calls``, ``first_step_tokens`` (means over tasks).
    """
    n = len(trajectories)
    if n == 0:
        raise ValueError("trajectories must not be empty")
    rewards = [float(t.reward) for t in trajectories]
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    steps = [t.num_steps for t in trajectories]
    calls_per_step = [t.num_tool_calls / max(t.num_steps, 1) for t in trajectories]
    repeated = [int(t.info.get("repeated_tool_calls", 0)) for t in trajectories]
    first = [(t.turn_spans[0][1] - t.turn_spans[0][0]) if t.turn_spans else 0 for t in trajectories]
    return {
        "n": n,
        "reward_mean": mean,
        "reward_stderr": math.sqrt(var / n),
        "success_rate": sum(r >= 1.0 - 1e-9 for r in rewards) / n,
        "steps": sum(steps) / n,
        "tool_calls_per_step": sum(calls_per_step) / n,
        "repeated_tool_calls": sum(repeated) / n,
        "first_step_tokens": sum(first) / n,
    }


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


class HeldOutEvaluator:
    """Evaluation on the held-out split (rank 0 generates; the other ranks wait).

    Args:
        models: the run's models.
        engine: the rollout engine (evaluation rollouts do not count toward the budget).
        tasks: the held-out tasks.
        seed: the evaluation seed (the same for every evaluation of a run).
        temperature: decoding temperature (``eval.temperature``; 0 = greedy).
        dist: rank facts and the barrier.
        log: progress messages.
        progress: show a progress bar.
        compose: ``tasks -> [B, J*K, d]`` latents for ``base_composer`` (``None`` without a
            composer).
        num_placeholders: ``J*K``.
        chunk: tasks composed per forward (``lopd.micro_batch``).
    """

    def __init__(
        self,
        models: Models,
        engine: RolloutEngine,
        tasks: Sequence[Task],
        seed: int,
        temperature: float,
        dist: Dist,
        log: Callable[[str], None],
        progress: bool = False,
        compose: Callable[[Sequence[Task]], torch.Tensor] | None = None,
        num_placeholders: int = 0,
        chunk: int = 1,
    ) -> None:
        self.models, self.engine, self.tasks = models, engine, list(tasks)
        self.seed, self.temperature = seed, temperature
        self.dist, self.log, self.progress = dist, log, progress
        self.compose, self.num_placeholders, self.chunk = compose, num_placeholders, chunk

    def __call__(self, which: str) -> dict[str, Any]:
        """Summary metrics (:func:`summarize`, ``task_rewards`` in the order of the held-out
        tasks, and ``seconds``) of one evaluation on rank 0, ``{}`` on the others.

        Args:
            which: ``vanilla`` or ``lopd`` (the student) or ``base_composer`` (the frozen base
                model generating with retrieved latents).
        """
        result: dict[str, Any] = {}
        # Under FSDP2 every rank gathers the weights; rank 0 alone generates.
        with self.models.sharding.gathered():
            if self.dist.is_main:
                t0 = time.perf_counter()
                if which == "base_composer":
                    trajs = self.rollout_with_latents()
                else:
                    trajs = self.engine.generate(
                        self.models.student,
                        self.tasks,
                        self.seed,
                        temperature=self.temperature,
                        count=False,
                        progress=self.progress,
                    )
                result = summarize(trajs)
                # Per-task rewards (task order) for paired comparisons across evaluations.
                result["task_rewards"] = [float(t.reward) for t in trajs]
                result["seconds"] = time.perf_counter() - t0
                self.log(
                    f"eval {which}: reward {result['reward_mean']:.3f} ± "
                    f"{result['reward_stderr']:.3f} (n={result['n']}), "
                    f"success {result['success_rate']:.3f}"
                )
            self.dist.barrier()
        return result

    @torch.no_grad()
    def rollout_with_latents(self) -> list[Trajectory]:
        """The frozen base model rolled out on the held-out tasks with their c_phi injected."""
        from lopd.chat import render_prompt
        from lopd.envs import make_env

        if self.compose is None or self.models.composer is None:
            raise ValueError("base_composer evaluation needs a composer")
        tokenizer, pad_id, n = self.models.tokenizer, self.models.pad_id, self.num_placeholders
        ph = tokenizer.convert_ids_to_tokens(pad_id)
        domain_of = {t.task_id: t.domain for t in self.tasks}

        def env_factory(task: Task) -> LatentPromptEnv:
            return LatentPromptEnv(make_env(task), domain_of[task.task_id], n, ph)

        prompts, starts, latents = [], [], []
        bs = max(1, self.chunk)
        for i in range(0, len(self.tasks), bs):
            chunk = self.tasks[i : i + bs]
            lat = self.compose(chunk)
            for task, lt in zip(chunk, lat):
                env = env_factory(task)
                ids = render_prompt(tokenizer, env.system_prompt(), env.reset(task), env.tools())
                prompts.append(ids)
                starts.append(find_run(ids, pad_id, n))
                latents.append(lt)
        with self.models.composer.teacher_mode() as backbone:
            lm = LatentConditionedLM(backbone, prompts, latents, starts)
            return self.engine.generate(
                lm,
                self.tasks,
                self.seed,
                temperature=self.temperature,
                count=False,
                make_env=env_factory,
                progress=self.progress,
            )


# --------------------------------------------------------------------------------------- CLI
# ``python -m lopd.evaluate --model PATH --bench bfcl-multi-turn | humaneval | builtin``: the
# benchmark driver is lopd.bench_eval; this entry point stays a thin wrapper so the evaluation
# helpers above can be reorganized freely.


def main(argv: Sequence[str] | None = None) -> int:
    """Benchmark evaluation CLI (see :mod:`lopd.bench_eval`)."""
    from lopd.bench_eval import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
