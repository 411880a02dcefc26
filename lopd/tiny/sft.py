"""Supervised fine-tuning of the tiny model on a stream of demonstrations (loss on actions only).

Two exact savings make the tiny model's build fit a 2-core CPU:

* **Shared prefix.** Every episode of one world starts with the same system prompt and tool list
  (about 240 of its 400-700 tokens). A step draws its batch from one world, runs that common
  prefix once (batch 1, with gradients) and broadcasts its keys and values to the rows, which
  then run only their own suffix against it. Causal attention makes this the same computation as
  running every row whole: the same loss and, up to float rounding, the same gradients (the
  prefix's gradient is the sum over rows, which the broadcast's backward computes).
* **Length buckets.** The batch is sorted by length and split into micro-batches (bare episodes
  are ~200 tokens shorter than reference-conditioned ones), each weighted by its share of the
  batch's action tokens, so the step's loss is still the token mean over the whole batch.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from lopd.envs.base import parse_tool_calls
from lopd.rollout.batch import lm_head_logprobs
from lopd.tiny.data import Demonstration, Episode, action_spans, turn_excerpt
from lopd_kernels.hf import decoder_of

__all__ = ["collate", "greedy_hits", "lm_loss", "sft", "shared_prefix_len"]


def collate(
    demos: Sequence[Demonstration], pad_id: int, context_weight: float = 0.0
) -> tuple[torch.Tensor, ...]:
    """Right-pad demonstrations into ``[B, L]`` ids, attention mask, labels and loss weights.

    Weights are 1 on action tokens, ``context_weight`` on the other tokens from the first user
    message on (the reference, the instruction, tool results), 0 on the system turn and padding;
    labels are the ids where the weight is positive, else -100. The causal shift inside the loss
    makes token ``n`` predict ``n + 1``.
    """
    width = max(len(d.input_ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(demos), width), dtype=torch.long)
    weights = torch.zeros((len(demos), width), dtype=torch.float32)
    for i, d in enumerate(demos):
        n = len(d.input_ids)
        ids[i, :n] = torch.tensor(d.input_ids)
        attn[i, :n] = 1
        w = torch.tensor(d.action_mask, dtype=torch.float32)
        if context_weight:
            ctx = torch.zeros(n)
            ctx[d.context_start :] = context_weight
            w = torch.where(w > 0, w, ctx)
        weights[i, :n] = w
    labels = torch.where(weights > 0, ids, torch.tensor(-100))
    return ids, attn, labels, weights


def shared_prefix_len(ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor) -> int:
    """Length ``P`` of the prefix every row shares, ending before any supervised prediction.

    The logits at position ``P - 1`` (inside the prefix) predict token ``P``, so ``P`` stops one
    short of the first labelled position of any row.
    """
    same = ((ids == ids[:1]) & (attn == 1)).all(dim=0)
    lcp = int(same.int().cumprod(dim=0).sum())
    labelled = (labels != -100).any(dim=0).nonzero()
    first = int(labelled[0]) if labelled.numel() else ids.shape[1]
    return max(0, min(lcp, first - 1))


def lm_loss(
    model: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    min_prefix: int = 16,
    stats: dict[str, int] | None = None,
) -> torch.Tensor:
    """Weighted *sum* of next-token losses of a right-padded batch, its shared prefix run once.

    Args:
        model: a Hugging Face causal LM with a KV cache (``Qwen3ForCausalLM``).
        ids, attn, labels, weights: ``[B, L]`` from :func:`collate` (``weights`` ``None``: 1 on
            every labelled token).
        min_prefix: below this shared length (or for one row) the batch runs whole.
        stats: if given, ``correct`` / ``actions`` are incremented by the greedy hits and the
            count of action tokens (weight 1).

    Returns:
        ``sum_t w_t * CE_t`` over the predicted tokens; divide by ``weights[:, 1:].sum()`` for
        the mean (with unit weights: ``model(ids, attention_mask=attn, labels=labels).loss``).
    """

    if weights is None:
        weights = (labels != -100).float()
    decoder = decoder_of(model)
    p = shared_prefix_len(ids, attn, labels)
    if ids.shape[0] == 1 or p < min_prefix:
        p = 0
        hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state
    else:
        prefix = decoder(input_ids=ids[:1, :p], use_cache=True).past_key_values
        cache = DynamicCache()
        b = ids.shape[0]
        for i, layer in enumerate(prefix.layers):
            cache.update(
                layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1), layer_idx=i
            )
        with warnings.catch_warnings():
            # transformers >= 5.2x renames ``past_key_values`` to ``cache``; the old name keeps
            # working across the supported range (>= 4.51), so it is the one passed.
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
            hidden = decoder(
                input_ids=ids[:, p:], attention_mask=attn, past_key_values=cache
            ).last_hidden_state
    # hidden[:, j] (position p + j) predicts the token at p + j + 1; only the labelled rows go
    # through the LM head, by the fused kernel (no [B, L, V] logits).
    target = labels[:, p + 1 :]
    w = weights[:, p + 1 :]
    rows = target != -100
    h = hidden[:, :-1][rows]
    head = model.get_output_embeddings()
    ce = -lm_head_logprobs(head, h, target[rows])
    if stats is not None:
        # Teacher-forced greedy accuracy on the action tokens (weight 1): a cheap learning curve.
        act = w[rows] == 1.0
        stats["correct"] = stats.get("correct", 0) + greedy_hits(head, h[act], target[rows][act])
        stats["actions"] = stats.get("actions", 0) + int(act.sum())
    return (ce * w[rows]).sum()


def greedy_hits(head: Any, h: torch.Tensor, targets: torch.Tensor) -> int:
    """How many rows of ``h`` (``[N, d]``) have ``targets`` (``[N]``) as their arg-max token.

    No gradient. The logits are formed ``[R, Vb]`` (at most 1,024 x 8,192) at a time, an arg-max
    running over vocabulary blocks, so no tensor has a vocabulary-sized axis; ties go to the lowest
    id, as
    ``argmax`` over the whole row gives them."""
    weight, bias = head.weight, getattr(head, "bias", None)
    vocab = weight.shape[0]
    rows = min(max(1, h.shape[0]), 1024)
    block = min(8192, max(1, (32 << 20) // (4 * rows)))
    hits = 0
    with torch.no_grad():
        for start in range(0, h.shape[0], rows):
            x = h[start : start + rows].to(weight.dtype)
            best = torch.full((x.shape[0],), -math.inf, dtype=torch.float32, device=x.device)
            arg = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            for v0 in range(0, vocab, block):
                b = None if bias is None else bias[v0 : v0 + block]
                top, idx = F.linear(x, weight[v0 : v0 + block], b).float().max(-1)
                better = top > best  # strict: an equal later block does not displace the first
                best = torch.where(better, top, best)
                arg = torch.where(better, idx + v0, arg)
            hits += int((arg == targets[start : start + rows]).sum())
    return hits


def _micro_batches(demos: list[Demonstration], parts: int) -> list[list[Demonstration]]:
    order = sorted(demos, key=lambda d: len(d.input_ids))
    size = math.ceil(len(order) / parts)
    return [order[i : i + size] for i in range(0, len(order), size)]


def sft(
    model: Any,
    batches: Iterator[list[Demonstration]],
    steps: int,
    lr: float,
    *,
    warmup: float = 0.05,
    final_lr_frac: float = 0.1,
    micro_batches: int = 2,
    context_weight: float = 0.0,
    log_every: int = 50,
    on_step: Callable[[int], None] | None = None,
    copy_source: Iterator[tuple[torch.Tensor, ...]] | None = None,
    copy_weight: float = 0.0,
) -> list[float]:
    """Fine-tune ``model`` in place on ``steps`` batches from ``batches``.

    AdamW (betas 0.9/0.98, weight decay 0.01, gradient clip 1.0); the learning rate rises
    linearly over the first ``warmup`` share of the steps, then follows a cosine down to
    ``final_lr_frac * lr``.

    Args:
        model: the causal LM (left in eval mode).
        batches: yields one list of demonstrations per step (all sharing a prompt prefix for the
            shared-prefix saving to apply).
        steps: optimizer steps.
        lr: peak learning rate.
        warmup: warmup share of the steps.
        final_lr_frac: the last step's learning rate over the peak.
        micro_batches: length buckets per step (gradients accumulated, weighted by tokens).
        context_weight: loss weight of the non-action tokens after the system turn (the
            reference, the instruction, tool results); actions weigh 1.
        log_every: print the mean loss every this many steps (``0``: silent).
        on_step: called with the step number after each step (evaluation hooks).
        copy_source: batches of :func:`copy_batches`; with ``copy_weight > 0`` every step adds
            ``copy_weight`` times the mean loss of one of them (see :func:`copy_batches` for
            why).
        copy_weight: weight of that auxiliary copy loss (``0``: episodes only).

    Returns:
        The loss of every step.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    pad_id = model.config.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    n_warm = max(1, round(steps * warmup))

    def factor(step: int) -> float:
        if step < n_warm:
            return (step + 1) / n_warm
        t = (step - n_warm) / max(1, steps - n_warm)
        return final_lr_frac + (1 - final_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    losses: list[float] = []
    stats: dict[str, int] = {}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        batch = next(batches)
        parts = [collate(mb, pad_id, context_weight) for mb in _micro_batches(batch, micro_batches)]
        total = sum(float(w[:, 1:].sum()) for *_, w in parts)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for ids, attn, labels, w in parts:
            loss = lm_loss(model, ids, attn, labels, w, stats=stats) / total
            loss.backward()
            step_loss += float(loss.detach())
        if copy_weight and copy_source is not None:
            c_ids, c_attn, c_labels, c_w = next(copy_source)
            c_loss = lm_loss(model, c_ids, c_attn, c_labels, c_w, min_prefix=c_ids.shape[1])
            (copy_weight * c_loss / c_w[:, 1:].sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(step_loss)
        if log_every and step % log_every == 0:
            acc = stats["correct"] / max(1, stats["actions"])
            stats.clear()
            print(
                f"  sft step {step}/{steps}  loss {sum(losses[-log_every:]) / log_every:.4f}"
                f"  action-token accuracy {acc:.4f}  ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        if on_step is not None:
            on_step(step)
            model.train()
    model.eval()
    return losses


def episode_batches(
    source: Any, tokenizer: Any, batch_size: int, seed: int
) -> Iterator[list[Demonstration]]:
    """Endless batches from an :class:`~lopd.tiny.data.EpisodeSource`, one world per batch in
    turn (so a batch shares its system prompt and tool list), deterministic in ``seed``."""
    rng = random.Random(seed)
    step = 0
    while True:
        world = source.worlds[step % len(source.worlds)]
        step += 1
        yield [
            source.demonstration(tokenizer, source.episode(rng, world)) for _ in range(batch_size)
        ]


def is_grounded(demo: Demonstration, tokenizer: Any) -> bool:
    """Whether every argument value of ``demo``'s supervised tool calls is in its context.

    An excerpt that leaves out the tool result an id came from would teach the model to make the
    id up; :func:`excerpt_batches` draws only grounded excerpts (a first action always is: its
    values come from the instruction).
    """

    context = tokenizer.decode([i for i, m in zip(demo.input_ids, demo.action_mask) if not m])
    action = tokenizer.decode([i for i, m in zip(demo.input_ids, demo.action_mask) if m])
    values = [v for call in parse_tool_calls(action) for v in call.arguments.values()]
    return all(str(v) in context for v in values)


def excerpt_batches(
    source: Any,
    tokenizer: Any,
    batch_size: int,
    seed: int,
    first_only: bool = False,
    with_references: bool = False,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless collated batches of short turn excerpts (:func:`~lopd.tiny.data.turn_excerpt`)
    of bare episodes, one random grounded action each (:func:`is_grounded`), no system turn,
    worlds mixed; ``first_only``: always the first action (instruction -> first call);
    ``with_references``: episodes drawn from the source's mixture (bare and
    reference-conditioned, in its formats), so the first user turn may hold a reference whose
    ids and names must *not* be copied.

    The tiny model's curriculum: at the start of training attention is spread evenly, so the
    gradient that teaches "take the key from the instruction" or "take the id from the tool
    result" shrinks with the context length; on these 30-100-token excerpts the copy circuits
    form in a few hundred steps and then carry over to full episodes behind the system turn
    (numbers: :class:`lopd.tiny.build.TinyBuildConfig`).
    """
    rng = random.Random(seed)
    turn_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    while True:
        demos = []
        for _ in range(batch_size):
            world = rng.choice(source.worlds)
            if with_references:
                episode = source.episode(rng, world)
            else:
                episode = Episode(source.bare_episode(rng, world), None)
            demo = source.demonstration(tokenizer, episode)
            if first_only:
                demos.append(turn_excerpt(demo, 0, turn_start))
                continue
            excerpts = [turn_excerpt(demo, k, turn_start) for k in range(len(action_spans(demo)))]
            demos.append(rng.choice([e for e in excerpts if is_grounded(e, tokenizer)]))
        yield collate(demos, tokenizer.pad_token_id)


def copy_batches(
    tokenizer: Any, batch_size: int, length: int, seed: int
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless batches of random token strings shown twice, ``[x, gap, x]``, loss on the repeat.

    The classic task that grows induction (copy) heads: predicting the second copy is looking up
    where the current token occurred before and taking the token after it. Each row draws its
    string length in ``[4, length]`` and a gap of random tokens in ``[0, length]``, so the
    distance between the copies varies: with a fixed distance the model learns to read the token
    that many positions back (a copy of length 32 at 0.97 accuracy, of length 8 at 0.00), which
    copies nothing in an episode. The repeat's first token is not scored (nothing predicts it).
    ``x`` is drawn from the tokenizer's ordinary pieces (no special or byte-fallback tokens),
    numbers included; rows are right-padded.
    """
    if length < 4:
        raise ValueError(f"length must be >= 4, got {length}")
    special = set(tokenizer.all_special_ids)
    vocab = [
        i
        for t, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        if i not in special and not (t.startswith("<0x") and t.endswith(">")) and t != "<unk>"
    ]
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(vocab)
    width = 3 * length
    pad = tokenizer.pad_token_id
    while True:
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attn = torch.zeros((batch_size, width), dtype=torch.long)
        for r in range(batch_size):
            n = int(torch.randint(4, length + 1, (1,), generator=g))
            gap = int(torch.randint(0, length + 1, (1,), generator=g))
            x = pool[torch.randint(len(pool), (n,), generator=g)]
            filler = pool[torch.randint(len(pool), (gap,), generator=g)]
            row = torch.cat([x, filler, x])
            ids[r, : len(row)] = row
            attn[r, : len(row)] = 1
            labels[r, n + gap + 1 : len(row)] = x[1:]
        yield ids, attn, labels, (labels != -100).float()


def warmup(
    model: Any, batches: Iterator[tuple[torch.Tensor, ...]], steps: int, lr: float
) -> list[float]:
    """Train ``model`` on ``steps`` collated batches (AdamW, constant ``lr``, clip 1.0), e.g. of
    :func:`copy_batches` or :func:`excerpt_batches`; returns each step's mean loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    losses = []
    for _ in range(steps):
        ids, attn, labels, w = next(batches)
        loss = lm_loss(model, ids, attn, labels, w, min_prefix=ids.shape[1]) / w[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
