"""Model loading and the embedded default: a tiny Qwen3 that plays the built-in tool-use worlds.

``load_model()`` returns the shipped tiny model (``lopd/assets/tiny-qwen3``), a
``transformers.Qwen3ForCausalLM`` of about 1 M parameters with a tokenizer this module builds, so
the whole LOPD pipeline runs offline on a laptop CPU. ``load_model(path)`` loads any local Hugging
Face checkpoint (Qwen3, Olmo, ...) for GPU runs.

The tiny model is made by :func:`build_tiny` (``python -m lopd.models build-tiny --seed 0``),
deterministically from a seed:

1. **Tokenizer.** A ``tokenizers`` Unigram model over a hand-built vocabulary: every printable
   ASCII character, the 256 byte-fallback tokens (any other UTF-8 text round-trips), and the
   identifiers (tool names, field names, entity words) and short punctuation runs (JSON
   scaffolding such as ``": "``) that occur at least ``min_count`` times in the train split's
   text: the system prompt, the tool list, instructions, oracle actions and tool results. All
   multi-character pieces score the same, so Viterbi picks the segmentation with the fewest
   tokens; digits are single characters, so numbers and ids are copied digit by digit. A newline
   is always its own token, which makes every line break of the chat template a token boundary:
   segments tokenized separately concatenate to the tokenization of the whole conversation.
   Special tokens as in Qwen3: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS,
   end of turn). The chat template is :data:`lopd.chat.TINY_CHAT_TEMPLATE`.
2. **Model.** ``Qwen3ForCausalLM`` (hidden 128, 4 layers, 4 query / 2 KV heads of dim 32, tied
   embeddings), initialized from the seed.
3. **Warm start.** Supervised fine-tuning on oracle demonstrations of the train split (each task's
   correct tool calls, played in its environment to get the real tool results, ending with
   ``Task Completed``), loss on assistant tokens only. The recipe (demonstration count, steps)
   is tuned so the held-out (test split) mean reward under the default sampling (temperature 0.7)
   lands between 0.2 and 0.6: good enough to succeed sometimes, with room for LOPD to improve.

Bitwise reproducibility holds for a fixed torch version, CPU and thread count (the build pins the
thread count, ``--threads``).
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lopd.chat import (
    TINY_CHAT_TEMPLATE,
    encode,
    end_of_turn_id,
    render_observation,
    render_prompt,
)
from lopd.types import Task

TINY_ASSET_DIR = Path(__file__).parent / "assets" / "tiny-qwen3"
"""Where the shipped tiny model lives (config, safetensors, tokenizer, build_info.json)."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen3's chat special tokens, in id order after the base vocabulary."""


def default_cache_dir() -> Path:
    """Cache for a tiny model built on first use: ``$LOPD_CACHE`` or ``~/.cache/lopd``."""
    return Path(os.environ.get("LOPD_CACHE", Path.home() / ".cache" / "lopd"))


# --------------------------------------------------------------------------- tool-use data


def _tool_use_api() -> tuple[Any, Any, Any]:
    """``(builtin_tasks, make_env, oracle_actions)`` from :mod:`lopd.envs` (imported lazily)."""
    from lopd.envs import builtin_tasks, make_env, oracle_actions

    return builtin_tasks, make_env, oracle_actions


@dataclass
class Demonstration:
    """One oracle conversation, tokenized the way :func:`lopd.rollout.rollout` lays out turns.

    Attributes:
        input_ids: ``[L]`` prompt + (action ids + end-of-turn + observation segment)*.
        action_mask: ``[L]`` 1 on assistant tokens (each action and its end-of-turn token).
        messages: the chat messages (for re-rendering checks).
        tools: the tool schemas rendered into the system turn.
        reward: the environment's reward after the oracle actions (1.0 for a sound oracle).
    """

    input_ids: list[int]
    action_mask: list[int]
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    reward: float


def demonstration(tokenizer: Any, task: Task) -> Demonstration:
    """Play ``task``'s oracle actions in its environment and tokenize the conversation.

    Action turns are tokenized canonically (``tokenizer(text)``), observations and template
    tokens with :func:`lopd.chat.render_observation`, exactly as a rollout concatenates them.
    """
    _, make_env, oracle_actions = _tool_use_api()
    env = make_env(task)
    user = env.reset(task)
    system, tools = env.system_prompt(), env.tools()
    ids = render_prompt(tokenizer, system, user, tools)
    mask = [0] * len(ids)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    eot = end_of_turn_id(tokenizer)
    for text in oracle_actions(task):
        action = [*encode(tokenizer, text), eot]
        ids += action
        mask += [1] * len(action)
        messages.append({"role": "assistant", "content": text})
        observation, done = env.step(text)
        if done:
            break
        segment = render_observation(tokenizer, observation)
        ids += segment
        mask += [0] * len(segment)
        messages.append({"role": "tool", "content": observation})
    return Demonstration(ids, mask, messages, tools, float(env.reward()))


def tool_use_corpus(tasks: Sequence[Task]) -> list[str]:
    """Texts a tokenizer for the tool-use worlds must cover well.

    Per task: the system prompt and rendered tool list (once per world), the instruction, and each
    oracle action with the tool result it gets.
    """
    _, make_env, oracle_actions = _tool_use_api()
    texts: list[str] = []
    seen_worlds: set[str] = set()
    for task in tasks:
        env = make_env(task)
        texts.append(env.reset(task))
        if task.world not in seen_worlds:
            seen_worlds.add(task.world)
            texts.append(env.system_prompt())
            for tool in env.tools():
                fn = tool.get("function", tool)
                texts.append(f"- {fn['name']}({', '.join(fn['parameters']['properties'])})")
        for text in oracle_actions(task):
            texts.append(text)
            observation, done = env.step(text)
            if done:
                break
            texts.append(observation)
    return texts


# --------------------------------------------------------------------------- tokenizer

# Pieces harvested into the vocabulary: identifiers (optionally with their leading space) and
# short punctuation runs (JSON scaffolding), never spanning a newline.
_PIECE_RE = re.compile(r" ?[A-Za-z][A-Za-z_]*|[^\sA-Za-z0-9]{1,3}(?: [^\sA-Za-z0-9]{1,2})?")
_QUOTED_WORD_RE = re.compile(r'"([A-Za-z][A-Za-z_]*)')


def _is_spaced(piece: str, quoted: set[str]) -> bool:
    return piece.startswith(" ") and piece[1:] in quoted


# Template words (role names, tool tags) are always whole tokens.
_FIXED_PIECES = (
    "system",
    "user",
    "assistant",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "# Tools",
)


def build_tokenizer(texts: Sequence[str], min_count: int = 2, max_piece_len: int = 32) -> Any:
    """Build the tiny model's tokenizer from a corpus (deterministic: no training randomness).

    Args:
        texts: corpus texts (see :func:`tool_use_corpus`).
        min_count: a harvested piece enters the vocabulary if it occurs this often.
        max_piece_len: longest piece kept.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with the chat template set; ids are
        ``<unk>`` = 0, byte-fallback tokens, printable ASCII and newline, harvested pieces
        (sorted by frequency, then text), then the special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    counts: collections.Counter[str] = collections.Counter()
    quoted: set[str] = set()
    for text in texts:
        counts.update(m.group(0) for m in _PIECE_RE.finditer(text))
        quoted.update(_QUOTED_WORD_RE.findall(text))
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    base = set(chars)
    # A word that starts a JSON string value ("Portland", "Omar Costa") gets no leading-space
    # piece: in the instruction it is then " " + "Portland", the same token the model must emit
    # inside the tool call, so filling an argument is a plain copy of token ids.
    pieces = sorted(
        (
            p
            for p, c in counts.items()
            if c >= min_count and 1 < len(p) <= max_piece_len and not _is_spaced(p, quoted)
        ),
        key=lambda p: (-counts[p], p),
    )
    pieces += [p for p in _FIXED_PIECES if p not in pieces]
    pieces = [p for p in pieces if p not in base]
    # Scores are log-probabilities for Viterbi: equal scores for all pieces means the fewest
    # tokens win; single characters cost more so any covering piece beats spelling it out, and
    # byte fallback is the last resort.
    vocab = [("<unk>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(c, -2.0) for c in chars]
    vocab += [(p, -1.0) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    # A newline is always its own token: template line breaks are token boundaries.
    tok.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------- model


@dataclass
class TinyBuildConfig:
    """Recipe of the embedded tiny model (defaults = the shipped model).

    Attributes:
        seed: seeds weights init, data order and the evaluation rollouts.
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: Qwen3
            architecture of the model.
        min_count: tokenizer piece frequency threshold.
        calib_tasks: train-split tasks held back from the demonstrations; the warm start stops
            at the first check where their mean reward reaches ``target_reward`` (``0``: no
            stopping rule, run all ``sft_steps``).
        target_reward: the stopping threshold (the held-out target range is 0.2-0.6).
        check_every: optimizer steps between two stopping checks.
        sft_tasks: train-split tasks used as demonstrations (``None``: all not held back).
        sft_steps: maximum optimizer steps of the warm start.
        batch_size: demonstrations per step.
        lr: peak AdamW learning rate (linear warmup, then constant).
        eval_tasks: held-out test tasks rolled out to measure the reward after the build
            (``0`` skips the evaluation).
        threads: torch CPU threads during the build (pinned for bitwise reproducibility).
    """

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    min_count: int = 2
    calib_tasks: int = 40
    target_reward: float = 0.35
    check_every: int = 60
    sft_tasks: int | None = None
    sft_steps: int = 1500
    batch_size: int = 16
    lr: float = 3e-3
    eval_tasks: int = 120
    threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tiny_model_config(tokenizer: Any, cfg: TinyBuildConfig) -> Any:
    """The ``Qwen3Config`` of the tiny model for this tokenizer."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 over the state dict (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _collate(demos: Sequence[Demonstration], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(d.input_ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(demos), width), dtype=torch.long)
    labels = torch.full((len(demos), width), -100, dtype=torch.long)
    for i, d in enumerate(demos):
        n = len(d.input_ids)
        ids[i, :n] = torch.tensor(d.input_ids)
        attn[i, :n] = 1
        keep = torch.tensor(d.action_mask, dtype=torch.bool)
        labels[i, :n] = torch.where(keep, ids[i, :n], torch.tensor(-100))
    return ids, attn, labels


def sft(
    model: Any,
    demos: Sequence[Demonstration],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log_every: int = 50,
    check_every: int = 0,
    should_stop: Callable[[int], bool] | None = None,
) -> list[float]:
    """Supervised fine-tuning on demonstrations, loss on action tokens only.

    Labels are the action-masked input ids (the model's causal shift makes token ``n`` predict
    ``n + 1``), so the loss covers exactly what a rollout samples. Batches are drawn from a
    per-epoch shuffle seeded by ``seed``. AdamW with a linear warmup over the first 5% of the
    steps, then a constant learning rate (the run may be stopped early, so no decay).

    Args:
        model: the causal LM (trained in place; left in eval mode).
        demos: the demonstrations.
        steps: maximum optimizer steps.
        batch_size: demonstrations per step.
        lr: peak learning rate.
        seed: data-order seed.
        log_every: print the mean loss every this many steps (``0``: silent).
        check_every: call ``should_stop(step)`` every this many steps (``0``: never).
        should_stop: ``step -> bool``; ``True`` ends the run after that step.

    Returns:
        The loss of every step taken.
    """
    if not demos:
        raise ValueError("demos is empty")
    rng = random.Random(seed)
    pad_id = model.config.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    order: list[int] = []
    losses = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            perm = list(range(len(demos)))
            rng.shuffle(perm)
            order += perm
        batch = [demos[i] for i in order[:batch_size]]
        del order[:batch_size]
        ids, attn, labels = _collate(batch, pad_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and step % log_every == 0:
            print(
                f"  sft step {step}/{steps}  loss {sum(losses[-log_every:]) / log_every:.4f}"
                f"  ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        if check_every and should_stop is not None and step % check_every == 0:
            stop = should_stop(step)
            model.train()
            if stop:
                break
    model.eval()
    return losses


def evaluate_reward(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    seed: int = 0,
    batch_size: int = 32,
) -> float:
    """Mean reward of rollouts under the default sampling (``GenerationConfig()``)."""
    from lopd.rollout import GenerationConfig, rollout

    trajs = rollout(model, tokenizer, tasks, GenerationConfig(), seed=seed, batch_size=batch_size)
    return sum(t.reward for t in trajs) / max(1, len(trajs))


def build_tiny(
    cfg: TinyBuildConfig | None = None, out: str | Path | None = None, verbose: bool = True
) -> dict[str, Any]:
    """Build the tiny model deterministically from ``cfg.seed`` (tokenizer, init, SFT, eval).

    Args:
        cfg: the recipe (defaults: the shipped model's).
        out: directory to save the model and tokenizer to (``None``: do not save).
        verbose: print progress and the held-out reward.

    Returns:
        ``{"model", "tokenizer", "weights_sha256", "heldout_reward", "num_params", "seconds",
        "config"}``; ``heldout_reward`` is ``None`` when ``cfg.eval_tasks == 0``.
    """
    from transformers import Qwen3ForCausalLM

    cfg = cfg or TinyBuildConfig()
    builtin_tasks, _, _ = _tool_use_api()
    log = print if verbose else (lambda *a, **k: None)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    try:
        train = builtin_tasks("tool_use", split="train", seed=0)
        tokenizer = build_tokenizer(tool_use_corpus(train), cfg.min_count)
        log(f"tokenizer: {len(tokenizer)} tokens")
        rng = random.Random(cfg.seed)
        shuffled = list(train)
        rng.shuffle(shuffled)
        calib, sft_tasks = shuffled[: cfg.calib_tasks], shuffled[cfg.calib_tasks :]
        if cfg.sft_tasks is not None:
            sft_tasks = sft_tasks[: cfg.sft_tasks]
        demos = [demonstration(tokenizer, t) for t in sft_tasks]
        lengths = sorted(len(d.input_ids) for d in demos)
        log(
            f"demonstrations: {len(demos)}, tokens median {lengths[len(lengths) // 2]} "
            f"max {lengths[-1]}"
        )
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(tiny_model_config(tokenizer, cfg))
        num_params = sum(p.numel() for p in model.parameters())
        log(f"model: Qwen3ForCausalLM, {num_params / 1e6:.2f} M parameters")
        history: list[dict[str, float]] = []

        def should_stop(step: int) -> bool:
            # Held-back train tasks, never the test split: the reported held-out reward is not
            # used for the decision.
            r = evaluate_reward(model, tokenizer, calib, seed=cfg.seed)
            history.append({"step": step, "calib_reward": r})
            log(f"  step {step}: reward on {len(calib)} held-back train tasks {r:.3f}")
            return r >= cfg.target_reward

        losses = sft(
            model,
            demos,
            cfg.sft_steps,
            cfg.batch_size,
            cfg.lr,
            cfg.seed,
            log_every=20 if verbose else 0,
            check_every=cfg.check_every if calib else 0,
            should_stop=should_stop,
        )
        digest = weights_hash(model)
        reward = None
        if cfg.eval_tasks:
            test = builtin_tasks("tool_use", split="test", n=cfg.eval_tasks, seed=0)
            reward = evaluate_reward(model, tokenizer, test, seed=cfg.seed)
            log(f"held-out reward (test split, {len(test)} tasks, temperature 0.7): {reward:.3f}")
        seconds = time.perf_counter() - t0
        info = {
            "weights_sha256": digest,
            "heldout_reward": reward,
            "heldout_tasks": cfg.eval_tasks,
            "num_params": num_params,
            "sft_steps_taken": len(losses),
            "final_loss": losses[-1],
            "calibration": history,
            "seconds": round(seconds, 1),
            "config": cfg.to_dict(),
            "torch": torch.__version__,
        }
        if out is not None:
            save_tiny(model, tokenizer, out, info)
            log(f"saved to {out}")
        return {"model": model, "tokenizer": tokenizer, **info}
    finally:
        torch.set_num_threads(prev_threads)


def save_tiny(model: Any, tokenizer: Any, out: str | Path, info: dict[str, Any]) -> None:
    """Write model, tokenizer and ``build_info.json`` to ``out`` atomically (temp dir + rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
        # mkdtemp creates a private directory; the asset is meant to be readable by everyone.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# --------------------------------------------------------------------------- loading


def _ensure_tiny(seed: int = 0) -> Path:
    """The shipped asset, or a tiny model built into the cache on first use."""
    if (TINY_ASSET_DIR / "config.json").exists():
        return TINY_ASSET_DIR
    cached = default_cache_dir() / f"tiny-qwen3-seed{seed}"
    if (cached / "config.json").exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent first uses (parallel test workers, several jobs) build once: the others wait on
    # the lock and then find the finished directory (save_tiny renames it into place).
    with open(cached.parent / f"{cached.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cached / "config.json").exists():
            print(f"lopd: shipped tiny model missing; building it into {cached}", file=sys.stderr)
            build_tiny(TinyBuildConfig(seed=seed), out=cached)
    return cached


def resolve_model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory :func:`load_model` reads for ``path`` (``None``: the tiny
    model's)."""
    return _ensure_tiny() if path is None else Path(path)


def load_model(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for :func:`lopd.rollout.rollout`.

    Args:
        path: ``None`` for the embedded tiny Qwen3 (shipped asset, else built on first use into
            :func:`default_cache_dir`); otherwise a local Hugging Face checkpoint directory
            (Qwen3 / Olmo instruct models; nothing is downloaded).
        device: where to put the model.
        dtype: parameter dtype (``torch.bfloat16`` or ``"bfloat16"`` for GPU runs); ``None``
            keeps the checkpoint's (float32 for the tiny model).
        attn_implementation: the transformers attention backend (``"eager"``, ``"sdpa"``,
            ``"flash_attention_2"``); ``None`` keeps the checkpoint's (``"sdpa"`` for the tiny
            model). Tests that compare two paths through the model (padding, masks, batch
            invariance) pin ``"eager"``: SDPA may pick different kernels for the two paths.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode and the tokenizer has a pad token.

    Raises:
        FileNotFoundError: ``path`` is not an existing directory.
        ValueError: the checkpoint's tokenizer has no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        path = _ensure_tiny()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"path {str(path)!r} is not a local checkpoint directory")
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype name")
        dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer at {str(path)!r} has no chat template")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.to(device)
    model.eval()
    return model, tokenizer


ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
"""The attention backends ``model.attn_implementation`` names (besides ``auto``)."""


def flash_attn_available() -> bool:
    """Whether the ``flash-attn`` package (the ``[gpu]`` extra) can be imported."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(
    name: str, device: str | torch.device, dtype: torch.dtype | None
) -> str:
    """The transformers attention backend for ``model.attn_implementation``.

    Args:
        name: ``auto``, ``eager``, ``sdpa`` or ``flash_attention_2``.
        device: where the models run.
        dtype: the compute dtype (flash-attn has 16-bit kernels only).

    Returns:
        ``auto``: ``flash_attention_2`` on CUDA with a 16-bit dtype when flash-attn is
        installed, else ``sdpa``; any other name as given.

    Raises:
        ValueError: an unknown name, or ``flash_attention_2`` where it cannot run (no CUDA,
            float32, flash-attn not installed).
    """
    device = torch.device(device)
    half = dtype in (torch.bfloat16, torch.float16)
    if name == "auto":
        usable = device.type == "cuda" and half and flash_attn_available()
        return "flash_attention_2" if usable else "sdpa"
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attn_implementation must be auto or one of {ATTN_IMPLEMENTATIONS}, got {name!r}"
        )
    if name == "flash_attention_2":
        if device.type != "cuda" or not half:
            raise ValueError(
                "model.attn_implementation=flash_attention_2 needs a CUDA device and model.dtype "
                f"bfloat16/float16 (got device {device}, dtype {dtype})"
            )
        if not flash_attn_available():
            raise ValueError(
                "model.attn_implementation=flash_attention_2 needs flash-attn: pip install "
                "'lopd[gpu]' --no-build-isolation (or use sdpa)"
            )
    return name


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in the backward (non-reentrant ``torch.utils.checkpoint``).

    transformers >= 5.2x names it ``activation_checkpointing_enable`` (the old
    ``gradient_checkpointing_enable`` warns that it goes away in v6); older 5.x releases have
    only the old name.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lopd.models", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-tiny", help="build the tiny default model deterministically")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default=str(TINY_ASSET_DIR), help="output directory")
    b.add_argument("--threads", type=int, default=TinyBuildConfig.threads)
    b.add_argument("--sft-steps", type=int, default=TinyBuildConfig.sft_steps)
    b.add_argument("--sft-tasks", type=int, default=None)
    b.add_argument("--eval-tasks", type=int, default=TinyBuildConfig.eval_tasks)
    args = parser.parse_args(argv)
    if args.command == "build-tiny":
        cfg = TinyBuildConfig(
            seed=args.seed,
            threads=args.threads,
            sft_steps=args.sft_steps,
            sft_tasks=args.sft_tasks,
            eval_tasks=args.eval_tasks,
        )
        res = build_tiny(cfg, out=args.out)
        print(
            f"built in {res['seconds']:.0f}s: weights sha256 {res['weights_sha256'][:16]}, "
            f"held-out reward {res['heldout_reward']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
