"""Batched multi-turn rollouts of a Hugging Face causal LM in the task environments.

:func:`rollout` plays every task as a multi-turn episode (assistant turn -> ``env.step`` ->
observation -> next assistant turn) and returns one :class:`~lopd.types.Trajectory` per task with
the token ids exactly as the policy saw and sampled them, an action mask, turn spans, the
verifier reward and the observation-lite trace.

How the batching works (chosen for small models on CPU as much as for GPUs):

* Up to ``batch_size`` episodes are *active*. Each round generates one assistant turn for all
  active episodes: their current contexts are left-padded into one batch, prefilled once, then
  decoded token by token with a KV cache (``DynamicCache``), sampling with temperature / top-k /
  top-p from one seeded ``torch.Generator``.
* Only ids the tokenizer has are sampled: a model whose vocabulary is padded past the tokenizer
  (Qwen3: 151,936 rows for 151,669 tokens) has the padded columns cut off its logits.
* A row stops at a stop token (the end-of-turn token ``<|im_end|>``, or EOS) or at its token
  budget; stopped rows are dropped from the batch and from the KV cache immediately, so the cost
  of a round follows the rows still generating.
* Between rounds each environment steps on its turn's text; finished episodes leave the pool and
  queued episodes take their place (turn-level continuous batching).

Re-prefilling the context every turn costs one forward over the prompt per turn, which for agent
episodes (a handful of turns of tens of tokens) is far cheaper than the token-by-token decode it
avoids complicating: no ragged cache surgery when rows receive observations of different lengths.

Determinism: with a ``seed``, the output is a function of (model weights, tasks, config, seed,
``batch_size``, device and thread count): the sampled noise is drawn from one generator in a
fixed order.

The episode loop does not depend on how a turn is generated: ``turn_generator`` (a
:data:`TurnGenerator`) replaces the Hugging Face decode above, e.g. by a vLLM engine
(:mod:`lopd.rollout.vllm`, ``gen.engine=vllm``).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from lopd.envs import make_env as default_make_env
from lopd.rollout.chat import end_of_turn_id, render_observation, render_prompt, stop_token_ids
from lopd.types import Task, Trajectory

TurnGenerator = Callable[[list[list[int]], list[int]], list[list[int]]]
"""``(contexts, budgets) -> sampled``: one assistant turn for every context (token ids of the
whole conversation so far), at most ``budgets[i]`` tokens for row ``i``; each row's sampled ids end
with its stop token when it stopped on one (the contract of the built-in decode)."""


@dataclass
class GenerationConfig:
    """Sampling and budget settings for :func:`rollout`.

    Attributes:
        temperature: softmax temperature; ``0`` means greedy decoding.
        top_p: nucleus sampling mass in ``(0, 1]`` (``1`` disables it).
        top_k: keep the ``top_k`` most likely tokens (``0`` disables it).
        max_new_tokens_per_turn: generated tokens per assistant turn, end-of-turn token included;
            a turn cut by this budget is closed with a (non-generated) end-of-turn token.
        max_total_tokens: cap on the whole trajectory length (prompt + all turns and
            observations); the episode ends when the next turn or observation would not fit.
        max_steps: assistant turns per episode (the environment may end it earlier; tool-use
            worlds allow at most 30).
        enable_thinking: Qwen3 chat-template switch (ignored by the tiny model's template).
    """

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens_per_turn: int = 96
    max_total_tokens: int = 2048
    max_steps: int = 12
    enable_thinking: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens_per_turn < 1:
            raise ValueError(
                f"max_new_tokens_per_turn must be >= 1, got {self.max_new_tokens_per_turn}"
            )
        if self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample one token per row, Hugging Face order: temperature, then top-k, then top-p.

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; computed in float32).
        temperature: ``0`` for greedy (argmax), else the softmax temperature.
        top_k: keep the k largest logits (``0``: all).
        top_p: keep the smallest prefix of the sorted distribution whose mass reaches ``top_p``
            (the most likely token is always kept).
        generator: source of randomness (``None``: torch's global generator).

    Returns:
        ``[B]`` int64 token ids.
    """
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    # Sorting only the top-k candidates (k=20 by default) instead of the whole vocabulary.
    k = vocab if top_k <= 0 else min(top_k, vocab)
    vals, idx = logits.topk(k, dim=-1)  # sorted, descending
    if top_p < 1.0:
        probs = vals.softmax(dim=-1)
        # Mass strictly before each candidate; a candidate is dropped once that mass already
        # reaches top_p, which always keeps the first one.
        before = probs.cumsum(dim=-1) - probs
        vals = vals.masked_fill(before >= top_p, float("-inf"))
    choice = torch.multinomial(vals.softmax(dim=-1), 1, generator=generator)
    return idx.gather(-1, choice).squeeze(-1)


@dataclass
class _Episode:
    """Mutable state of one episode while it is being rolled out."""

    index: int
    task: Task
    env: Any
    messages: list[dict[str, str]]
    ids: list[int]
    mask: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    truncated_turns: int = 0
    generated_tokens: int = 0
    stop_reason: str = ""
    env_error: str | None = None


@torch.inference_mode()
def _generate_turn(
    model: Any,
    contexts: list[list[int]],
    budgets: list[int],
    stop_ids: list[int],
    pad_id: int,
    gen: GenerationConfig,
    generator: torch.Generator | None,
    device: torch.device,
    num_tokens: int | None = None,
) -> list[list[int]]:
    """Generate one turn for each context (left-padded batch, KV cache, rows drop out when done).

    ``num_tokens`` (the tokenizer's size): logit columns at and past it (padded vocabulary rows
    that decode to nothing) are never sampled.

    Returns, per row, the sampled ids; a row that stopped on a stop token ends with it.
    """

    n = len(contexts)
    width = max(len(c) for c in contexts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, ctx in enumerate(contexts):
        input_ids[i, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        attn[i, width - len(ctx) :] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    # Left padding: positions count real tokens only (HF would otherwise use 0..width-1).
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    budget = torch.tensor(budgets, dtype=torch.long, device=device)

    out: list[list[int]] = [[] for _ in range(n)]
    rows = torch.arange(n, device=device)  # original row index of each live batch row
    cache = DynamicCache()
    step_ids, step_pos = input_ids, position_ids
    for t in range(max(budgets)):
        with warnings.catch_warnings():
            # transformers >= 5.2x renames ``past_key_values`` to ``cache``; the old name keeps
            # working with every supported version (and with wrappers that take it by name).
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
            logits = model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]
        if num_tokens is not None and logits.shape[-1] > num_tokens:
            logits = logits[:, :num_tokens]
        tok = sample_next_token(logits, gen.temperature, gen.top_k, gen.top_p, generator)
        for r, tid in zip(rows.tolist(), tok.tolist()):
            out[r].append(tid)
        done = torch.isin(tok, stop) | (budget[rows] <= t + 1)
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, tok, attn = rows[keep], tok[keep], attn[keep]
            step_pos = step_pos[keep]
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        step_ids = tok.unsqueeze(-1)
        step_pos = step_pos[:, -1:] + 1
    return out


def rollout(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    gen: GenerationConfig | None = None,
    *,
    seed: int | None = None,
    progress: bool = False,
    batch_size: int = 32,
    make_env: Callable[[Task], Any] | None = None,
    turn_generator: TurnGenerator | None = None,
) -> list[Trajectory]:
    """Roll ``model`` out on every task and return the trajectories, in task order.

    Args:
        model: a Hugging Face causal LM (``Qwen3ForCausalLM``, any ``AutoModelForCausalLM``).
            Put into eval mode for the rollout and restored afterwards.
        tokenizer: its tokenizer, with a chat template (see :mod:`lopd.rollout.chat`).
        tasks: the tasks; each gets a fresh environment from ``make_env``.
        gen: sampling and budget settings (defaults: temperature 0.7, top-p 0.95, top-k 20).
        seed: seeds the sampling generator; ``None`` draws fresh randomness.
        progress: show a tqdm progress bar over finished episodes.
        batch_size: episodes generated together (rows of one forward).
        make_env: ``Task -> Env`` factory; defaults to :func:`lopd.envs.make_env`.
        turn_generator: generates the turns instead of ``model`` (which may then be ``None``):
            e.g. :meth:`lopd.rollout.vllm.VLLMRollout.turn_generator`. It brings its own
            sampling randomness; ``seed`` then only seeds the built-in decode.

    Returns:
        One :class:`Trajectory` per task: ``input_ids`` ``[L]`` = prompt + (sampled turn ids +
        observation segment)*, ``action_mask`` ``[L]`` with 1 exactly on sampled ids (the
        end-of-turn token included when it was sampled), ``turn_spans`` the half-open
        ``(start, end)`` of each turn's sampled ids, ``prompt_len``, ``reward`` from the env's
        verifier, the env's ``trace`` and step statistics. ``info`` holds ``stop_reason``
        (``"done"``, ``"max_steps"``, ``"max_total_tokens"`` or ``"env_error"``),
        ``truncated_turns``, ``generated_tokens``, ``repeated_tool_calls``; an episode whose
        ``env.step`` or ``env.reward`` raised has reward 0, ``info["env_error"]`` with the
        exception, and a ``RuntimeWarning`` is issued (the other episodes go on).

    Raises:
        ValueError: bad ``batch_size``, or a task whose prompt alone exceeds
            ``gen.max_total_tokens``.
    """
    gen = gen or GenerationConfig()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if make_env is None:
        make_env = default_make_env
    eot = end_of_turn_id(tokenizer)
    stop_ids = stop_token_ids(tokenizer)
    if turn_generator is None:
        turn_generator = _hf_turn_generator(model, tokenizer, gen, seed, stop_ids)

    episodes: list[_Episode] = []
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise TypeError(f"tasks[{i}] must be a lopd.types.Task, got {type(task).__name__}")
        env = make_env(task)
        user = env.reset(task)
        system = env.system_prompt()
        ids = render_prompt(
            tokenizer, system, user, env.tools(), enable_thinking=gen.enable_thinking
        )
        if len(ids) + 2 > gen.max_total_tokens:
            raise ValueError(
                f"task {task.task_id!r}: prompt is {len(ids)} tokens, which leaves no room under "
                f"gen.max_total_tokens={gen.max_total_tokens}"
            )
        messages = [{"role": "user", "content": user}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        episodes.append(_Episode(i, task, env, messages, ids, [0] * len(ids), prompt_len=len(ids)))

    bar = None
    if progress:
        bar = tqdm(total=len(episodes), desc="rollout", unit="ep")
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    queue = deque(episodes)
    active: list[_Episode] = []
    t0 = time.perf_counter()
    try:
        while queue or active:
            while queue and len(active) < batch_size:
                active.append(queue.popleft())
            # One slot is kept for the closing end-of-turn token of a budget-cut turn.
            budgets = [
                min(gen.max_new_tokens_per_turn, gen.max_total_tokens - len(ep.ids) - 1)
                for ep in active
            ]
            outs = turn_generator([ep.ids for ep in active], budgets)
            still: list[_Episode] = []
            for ep, sampled in zip(active, outs):
                if _advance(ep, sampled, tokenizer, eot, stop_ids, gen):
                    still.append(ep)
                elif bar is not None:
                    bar.update(1)
            active = still
    finally:
        if model is not None:
            model.train(was_training)
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0

    trajectories = []
    for ep in episodes:
        env = ep.env
        if ep.env_error is None:
            try:
                reward = float(env.reward())
            except Exception as e:
                _env_failed(ep, "reward", e)
        if ep.env_error is not None:
            reward = 0.0
        info: dict[str, Any] = {
            "stop_reason": ep.stop_reason,
            "truncated_turns": ep.truncated_turns,
            "generated_tokens": ep.generated_tokens,
            "repeated_tool_calls": int(getattr(env, "repeated_tool_calls", 0)),
            "rollout_seconds": elapsed,
        }
        if ep.env_error is not None:
            info["env_error"] = ep.env_error
        trajectories.append(
            Trajectory(
                task=ep.task,
                messages=ep.messages,
                input_ids=ep.ids,
                action_mask=ep.mask,
                turn_spans=ep.spans,
                prompt_len=ep.prompt_len,
                reward=reward,
                trace=list(env.trace),
                num_steps=int(env.num_steps),
                num_tool_calls=int(env.num_tool_calls),
                info=info,
            )
        )
    return trajectories


def _hf_turn_generator(
    model: Any,
    tokenizer: Any,
    gen: GenerationConfig,
    seed: int | None,
    stop_ids: list[int],
) -> TurnGenerator:
    """The built-in decode of ``model`` (:func:`_generate_turn`) as a :data:`TurnGenerator`."""
    if model is None:
        raise ValueError("rollout needs a model or a turn_generator")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[-1]
    num_tokens = len(tokenizer)

    def generate(contexts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        return _generate_turn(
            model, contexts, budgets, stop_ids, pad_id, gen, generator, device, num_tokens
        )

    return generate


def _env_failed(ep: _Episode, what: str, error: Exception) -> None:
    """Record an unexpected env exception: the episode ends with reward 0 and says why."""
    ep.env_error = f"env.{what}() raised {type(error).__name__}: {str(error)[:500]}"
    ep.stop_reason = "env_error"
    warnings.warn(
        f"task {ep.task.task_id!r}: {ep.env_error}; episode scored 0", RuntimeWarning, stacklevel=3
    )


def _advance(
    ep: _Episode,
    sampled: list[int],
    tokenizer: Any,
    eot: int,
    stop_ids: list[int],
    gen: GenerationConfig,
) -> bool:
    """Append one generated turn, step the env, append its observation; False when finished."""
    start = len(ep.ids)
    ep.ids.extend(sampled)
    ep.mask.extend([1] * len(sampled))
    ep.spans.append((start, len(ep.ids)))
    ep.generated_tokens += len(sampled)
    ep.turns += 1
    stopped = bool(sampled) and sampled[-1] in stop_ids
    content_ids = sampled[:-1] if stopped else sampled
    if not stopped or sampled[-1] != eot:
        # Cut by the budget, or ended with EOS instead of the end-of-turn token: close the turn
        # with a template token (mask 0) so the conversation stays well-formed.
        ep.ids.append(eot)
        ep.mask.append(0)
        ep.truncated_turns += int(not stopped)
    text = tokenizer.decode(content_ids, skip_special_tokens=False)
    ep.messages.append({"role": "assistant", "content": text})
    try:
        observation, done = ep.env.step(text)
    except Exception as e:
        # A verifier bug (or a program it failed to contain) fails this episode, not the run.
        _env_failed(ep, "step", e)
        return False
    if done:
        ep.stop_reason = "done"
        return False
    if ep.turns >= gen.max_steps:
        ep.stop_reason = "max_steps"
        return False
    # An env may feed the next user turn instead of a tool result (multi-turn benchmarks).
    role = getattr(ep.env, "observation_role", "tool")
    segment = render_observation(
        tokenizer, observation, enable_thinking=gen.enable_thinking, role=role
    )
    # Room for the observation, one generated token and a closing end-of-turn token.
    if len(ep.ids) + len(segment) + 2 > gen.max_total_tokens:
        ep.stop_reason = "max_total_tokens"
        return False
    ep.ids.extend(segment)
    ep.mask.extend([0] * len(segment))
    ep.messages.append({"role": role, "content": observation})
    return True
