"""The embedded default model: a tiny Qwen3 that plays the built-in tool-use worlds.

The shipped asset (``lopd/assets/tiny-qwen3``, what :func:`lopd.models.load_model` returns
without a path) is a ``transformers.Qwen3ForCausalLM`` of about 1 M parameters with a tokenizer
this module builds, so the whole LOPD pipeline runs offline on a laptop CPU.

The tiny model is made by :func:`build_tiny` (``python -m lopd.models build-tiny --seed 0``),
deterministically from a seed:

1. **Tokenizer.** A ``tokenizers`` Unigram model over a hand-built vocabulary: every printable
   ASCII character, the 256 byte-fallback tokens (any other UTF-8 text round-trips), one token per
   number below 1000 (the worlds' order numbers, amounts and limits are below 1000, so copying
   one is copying a token), id prefixes such as ``PN-``, and the identifiers and short punctuation
   runs that occur at least ``min_count`` times in the train split's text
   (:func:`lopd.tiny.data.tokenizer_corpus`: system prompt, tool list, instructions, oracle
   actions and tool results under every convention, the worlds' lexicon, and the A.5 framing and
   experience-bank layout a reference arrives in, so a reference costs about a token per word).
   All multi-character pieces score the same, so Viterbi picks the fewest tokens. A newline is
   always its own token, which makes every line break of the chat template a token boundary:
   segments tokenized separately concatenate to the tokenization of the whole conversation.
   Special tokens as in Qwen3: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS,
   end of turn). The chat template is :data:`lopd.rollout.chat.TINY_CHAT_TEMPLATE`.
2. **Model.** ``Qwen3ForCausalLM`` (hidden 128, 4 layers, 4 query / 2 KV heads of dim 32, tied
   embeddings), initialized from the seed.
3. **Training mixture** (:class:`lopd.tiny.data.EpisodeSource`), why: the tiny model stands in for
   a pretrained LLM, whose property LOPD relies on is *in-context* use of experience. Each episode
   is an oracle conversation of a train-split task played under random house rules (one
   alternative per convention slot, uniformly), so a bare prompt cannot tell the rules apart;
   ``1 - bare_share`` of the episodes carry, in the first user message and in the paper's A.5
   framing (:func:`lopd.latent.injection.frame_with_references`), the successful trajectory of a
   *different* train task of the same world under the same rules, as the experience bank renders
   it; ``same_template_share`` of those references share the target's template. A reference's
   ids and numbers belong to another database: what transfers is the procedure. Loss on
   assistant tokens only (:func:`lopd.tiny.sft.sft`: shared-prefix batches, AdamW, cosine
   schedule). Only train-split tasks (task-set seed 0) enter the tokenizer corpus or the data; no
   val or test task, entity or trajectory does (``tests/models/test_tiny_data.py`` asserts it). The
   build evaluates on the **val** split only (bare, and with a same-template train trajectory as
   reference); it never looks at the test split.

Status (measured, see the README): the shipped asset is ``TinyBuildConfig()`` (its
``build_info.json`` records the recipe and the weights' sha256). Val reward (60 tasks,
temperature 0.7): bare 0.292, with a same-template train trajectory as reference 0.467. The
first-call curriculum (``first_call_steps``) made the difference: without it (bare 0.250, with a
reference 0.242) the model copied words from the instruction (names, cities, coverages) only
~0.65 of the time teacher-forced, so most episodes failed on a lookup of another entity's name
whatever the reference said; now most bare failures are the procedure, which a reference
supplies. ``python -m lopd.models probe-reference`` measures the same with retrieved references.

**The five-format reader** (``lopd/assets/tiny-qwen3-formats``, ``build-tiny --recipe
tiny-qwen3-formats``) continues from the default with a reference in every method's format, so
each baseline's teacher reads its own context (docs/results.md, "A reader for every format").

Bitwise reproducibility holds for a fixed torch version, CPU and thread count (the build pins the
thread count, ``--threads``).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lopd.envs import builtin_tasks
from lopd.rollout.chat import TINY_CHAT_TEMPLATE
from lopd.rollout.multi_turn import GenerationConfig, rollout
from lopd.tiny.data import (
    Demonstration,
    EpisodeSource,
    Mixture,
    demonstration,
    reference_env_factory,
    same_template_plays,
    same_template_references,
    tokenizer_corpus,
)
from lopd.tiny.formats import FORMATS, framed_env_factory
from lopd.tiny.sft import copy_batches, episode_batches, excerpt_batches, sft, warmup
from lopd.types import Task

__all__ = [
    "ASSETS_DIR",
    "FORMATS_ASSET_DIR",
    "SPECIAL_TOKENS",
    "TINY_ASSET_DIR",
    "TINY_RECIPES",
    "Demonstration",
    "EpisodeSource",
    "Mixture",
    "TinyBuildConfig",
    "build_tiny",
    "build_tokenizer",
    "demonstration",
    "evaluate_reward",
    "save_tiny",
    "tiny_model_config",
    "tokenizer_corpus",
    "weights_hash",
]

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
"""The package's shipped assets (the tiny models, the coding tasks)."""
TINY_ASSET_DIR = ASSETS_DIR / "tiny-qwen3"
"""Where the shipped tiny model lives (config, safetensors, tokenizer, build_info.json)."""
FORMATS_ASSET_DIR = ASSETS_DIR / "tiny-qwen3-formats"
"""The shipped five-format reader (:data:`TINY_RECIPES` ``["tiny-qwen3-formats"]``)."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen3's chat special tokens, in id order after the base vocabulary."""


def default_cache_dir() -> Path:
    """Cache for a tiny model built on first use: ``$LOPD_CACHE`` or ``~/.cache/lopd``."""
    return Path(os.environ.get("LOPD_CACHE", Path.home() / ".cache" / "lopd"))


# --------------------------------------------------------------------------- tokenizer

# Pieces harvested into the vocabulary: identifiers (optionally with their leading space) and
# short punctuation runs (JSON scaffolding), never spanning a newline.
_PIECE_RE = re.compile(
    r"[A-Z]{1,3}-(?=[0-9])| ?[A-Za-z][A-Za-z_]*|[^\sA-Za-z0-9]{1,3}(?: [^\sA-Za-z0-9]{1,2})?"
)
NUMBER_PIECES = tuple(str(n) for n in range(1000))
# Value prefixes ("#482", "$450") stay single tokens, never fused into JSON scaffolding such as
# '": "#': a value then starts with the same token in the instruction and in the tool call.
_STANDALONE = "#$"
"""Digit strings that are single tokens of the tiny tokenizer."""
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
            if c >= min_count
            and (1 < len(p) <= max_piece_len or (len(p) == 1 and not p.isascii()))
            and not _is_spaced(p, quoted)
            and not any(ch in p for ch in _STANDALONE)
        ),
        key=lambda p: (-counts[p], p),
    )
    pieces += [p for p in _FIXED_PIECES if p not in pieces]
    # One token per number below 1000 (whatever the corpus holds): the worlds' numbers are below
    # 1000, so copying an order number or an amount is copying one token.
    pieces += [n for n in NUMBER_PIECES if n not in pieces]
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
    """Recipe of the embedded tiny model (defaults = the shipped model; tuned on the val split).

    Attributes:
        seed: seeds weights init, the episode stream and the evaluation rollouts.
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: Qwen3
            architecture of the model.
        min_count: tokenizer piece frequency threshold.
        bare_share: share of bare episodes in the training stream (the rest carry a reference).
        same_template_share: share of reference episodes whose reference has the same template.
        formats: the privileged-context formats reference episodes are shown in, equal shares
            (:mod:`lopd.tiny.formats`; ``("lopd",)``: the A.5 framing only).
        context_weight: loss weight of the non-action tokens after the system turn (actions 1).
        copy_warmup_steps: steps of the copy task (:func:`lopd.tiny.sft.copy_batches`) before
            the SFT, which grow the induction heads a pretrained LLM has.
        copy_weight: weight of the copy loss added to every SFT step (keeps every token's
            embedding copyable, see :func:`lopd.tiny.sft.copy_batches`; ``0``: none).
        copy_length: length of the copied random string (the sequence is twice as long).
        copy_batch_size: strings per copy batch.
        first_call_steps: steps on first-call excerpts alone (instruction -> first call, no
            system turn) before the mixed curriculum. Copying a *word* (a name, a city) has no
            induction key (``customer Marco`` in the instruction, ``"name": "Marco`` in the
            call), unlike a number behind its prefix (``PN-30``): from scratch on 32 mixed
            excerpts per step the first call's names stay at 0.04 teacher-forced on val after
            300 steps, while on first calls alone they jump from 0.07 (200 steps) to 0.68 (300)
            and 1.00 (400). The model trained without this phase copied words from the
            instruction ~0.65 of the time in full episodes, the commonest failure.
        excerpt_steps: steps on short excerpts of bare episodes before the SFT
            (:func:`lopd.tiny.sft.excerpt_batches`: one action after the instruction, or after
            the instruction, the previous action and its tool result; no system turn), a
            curriculum. Trained on full episodes from the start, the model does not learn to
            copy: teacher-forced accuracy of the first call's key on 120 val tasks (1.2M
            parameters, 32 episodes per step) is 0.011 after 300 steps with the ~240-token
            system turn, 0.056 with an empty system prompt (tool list only) and 0.056 on full
            episodes without the system turn; after 300 steps on first calls alone it is 0.59
            on val first calls *with* the system turn, 0.99 after 100 more steps with it. A
            build with first calls only copies the first call's numbers (0.97 on 48 val tasks)
            but not the later calls' ids from tool results (0.15), hence the later turns.
        excerpt_batch_size: excerpts per curriculum step.
        excerpt_references: the curricula's excerpts come from the training mixture (bare and
            reference-conditioned episodes in every format) instead of bare episodes only.
            A format that puts the reference *after* the instruction (SDFT's, SDPO's,
            Skill-SD's) places another task's ids and names between the instruction and the
            first call, where a copy circuit learnt on bare excerpts takes the nearest ones.
        sft_steps: optimizer steps.
        batch_size: episodes per step.
        lr: peak AdamW learning rate (linear warmup over 5% of the steps, cosine to 10%).
        eval_tasks: val-split tasks rolled out after the build, bare and with a reference
            (``0`` skips the evaluation).
        threads: torch CPU threads during the build (pinned for bitwise reproducibility).
        init: a model to continue from instead of building a tokenizer and initializing from
            the seed: the name of a shipped asset under ``lopd/assets`` (``"tiny-qwen3"``) or a
            checkpoint directory; its weights and tokenizer carry over and every stage above
            trains on from there (``""``: from scratch).
    """

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    min_count: int = 2
    bare_share: float = 0.4
    same_template_share: float = 0.8
    formats: tuple[str, ...] = ("lopd",)
    context_weight: float = 0.0
    copy_warmup_steps: int = 0
    copy_weight: float = 1.0
    copy_length: int = 32
    copy_batch_size: int = 16
    first_call_steps: int = 400
    excerpt_steps: int = 300
    excerpt_batch_size: int = 32
    excerpt_references: bool = False
    sft_steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    eval_tasks: int = 60
    threads: int = 1
    init: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The recipe as JSON types (``build_info.json``'s ``config``)."""
        return {**asdict(self), "formats": list(self.formats)}


TINY_RECIPES: dict[str, TinyBuildConfig] = {
    "tiny-qwen3": TinyBuildConfig(),
    # From scratch on all five formats a model learns none of them well, so this one continues
    # from the default (which copies from the instruction) at a third of its learning rate (at
    # 3e-3 every format ends lower); docs/results.md, "A reader for every format".
    "tiny-qwen3-formats": TinyBuildConfig(
        init="tiny-qwen3",
        formats=FORMATS,
        bare_share=0.2,
        excerpt_references=True,
        first_call_steps=400,
        excerpt_steps=200,
        sft_steps=700,
        lr=1e-3,
    ),
}
"""The shipped tiny models' recipes by asset name (``build-tiny --recipe``)."""


_HEADS = ("num_attention_heads", "num_key_value_heads")


def _load_init(cfg: TinyBuildConfig) -> tuple[Any, Any]:
    """The weights and tokenizer a build continues from (:attr:`TinyBuildConfig.init`); an init
    whose architecture is not the recipe's is refused (``build_info.json`` would misstate it)."""
    init = cfg.init
    path = ASSETS_DIR / init if (ASSETS_DIR / init / "config.json").exists() else Path(init)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"init {init!r} is neither a shipped asset nor a checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    want = tiny_model_config(tokenizer, cfg)
    differ = [
        f"{k} {getattr(model.config, k)} (recipe {getattr(want, k)})"
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", *_HEADS)
        if getattr(model.config, k) != getattr(want, k)
    ]
    if differ:
        raise ValueError(f"init {init!r} has another architecture: {', '.join(differ)}")
    return model, tokenizer


def tiny_model_config(tokenizer: Any, cfg: TinyBuildConfig) -> Any:
    """The ``Qwen3Config`` of the tiny model for this tokenizer."""

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


def evaluate_reward(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    seed: int = 0,
    batch_size: int = 32,
    references: dict[str, list[str]] | None = None,
    make_env: Any = None,
) -> float:
    """Mean reward of rollouts under the default sampling (``GenerationConfig()``).

    Args:
        references: task id -> experience texts to show as a reference in the first user
            message (:class:`~lopd.tiny.data.ReferencePromptEnv`); ``None``: bare prompts.
        make_env: task -> environment (e.g. :func:`lopd.tiny.formats.framed_env_factory`);
            exclusive with ``references``.
    """

    if references is not None:
        if make_env is not None:
            raise ValueError("give references or make_env, not both")
        make_env = reference_env_factory(references)
    trajs = rollout(
        model,
        tokenizer,
        tasks,
        GenerationConfig(),
        seed=seed,
        batch_size=batch_size,
        make_env=make_env,
    )
    return sum(t.reward for t in trajs) / max(1, len(trajs))


def _train_tasks() -> list[Task]:
    return builtin_tasks("tool_use", split="train", seed=0)


def build_tiny(
    cfg: TinyBuildConfig | None = None, out: str | Path | None = None, verbose: bool = True
) -> dict[str, Any]:
    """Build the tiny model deterministically from ``cfg.seed`` (tokenizer, init, SFT, eval).

    Args:
        cfg: the recipe (defaults: the shipped model's).
        out: directory to save the model and tokenizer to (``None``: do not save).
        verbose: print progress and the val rewards.

    Returns:
        ``{"model", "tokenizer", "weights_sha256", "val_reward_bare", "val_reward_reference",
        "num_params", "seconds", "config", ...}``; the rewards are ``None`` when
        ``cfg.eval_tasks == 0``.
    """

    cfg = cfg or TinyBuildConfig()
    log = print if verbose else (lambda *a, **k: None)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    try:
        train = _train_tasks()
        mixture = Mixture(cfg.bare_share, cfg.same_template_share, tuple(cfg.formats))
        source = EpisodeSource(train, mixture)
        init_digest = None
        if cfg.init:
            model, tokenizer = _load_init(cfg)
            init_digest = weights_hash(model)
            log(f"continuing from {cfg.init} (weights sha256 {init_digest[:16]})")
        else:
            tokenizer = build_tokenizer(tokenizer_corpus(train, cfg.formats), cfg.min_count)
            log(f"tokenizer: {len(tokenizer)} tokens ({time.perf_counter() - t0:.0f}s)")
            torch.manual_seed(cfg.seed)
            model = Qwen3ForCausalLM(tiny_model_config(tokenizer, cfg))
        num_params = sum(p.numel() for p in model.parameters())
        log(f"model: Qwen3ForCausalLM, {num_params / 1e6:.2f} M parameters")
        if cfg.copy_warmup_steps:
            copies = copy_batches(tokenizer, cfg.copy_batch_size, cfg.copy_length, cfg.seed)
            warm = warmup(model, copies, cfg.copy_warmup_steps, cfg.lr)
            log(f"copy warmup: {cfg.copy_warmup_steps} steps, final loss {warm[-1]:.4f}")
        if cfg.first_call_steps:
            firsts = excerpt_batches(
                source,
                tokenizer,
                cfg.excerpt_batch_size,
                cfg.seed + 3,
                first_only=True,
                with_references=cfg.excerpt_references,
            )
            warm = warmup(model, firsts, cfg.first_call_steps, cfg.lr)
            log(
                f"first-call curriculum: {cfg.first_call_steps} steps, final loss {warm[-1]:.4f}"
                f" ({time.perf_counter() - t0:.0f}s)"
            )
        if cfg.excerpt_steps:
            excerpts = excerpt_batches(
                source,
                tokenizer,
                cfg.excerpt_batch_size,
                cfg.seed + 2,
                with_references=cfg.excerpt_references,
            )
            warm = warmup(model, excerpts, cfg.excerpt_steps, cfg.lr)
            log(
                f"excerpt curriculum: {cfg.excerpt_steps} steps, final loss {warm[-1]:.4f}"
                f" ({time.perf_counter() - t0:.0f}s)"
            )
        losses = sft(
            model,
            episode_batches(source, tokenizer, cfg.batch_size, cfg.seed),
            cfg.sft_steps,
            cfg.lr,
            context_weight=cfg.context_weight,
            log_every=20 if verbose else 0,
            copy_source=copy_batches(tokenizer, cfg.copy_batch_size, cfg.copy_length, cfg.seed + 1),
            copy_weight=cfg.copy_weight,
        )
        digest = weights_hash(model)
        sft_seconds = time.perf_counter() - t0
        bare = ref = None
        by_format: dict[str, float] = {}
        if cfg.eval_tasks:
            # Validation split only: the build never looks at the test split.
            val = builtin_tasks("tool_use", split="val", n=cfg.eval_tasks, seed=0)
            bare = evaluate_reward(model, tokenizer, val, seed=cfg.seed)
            refs = same_template_references(val, train, seed=cfg.seed)
            ref = evaluate_reward(model, tokenizer, val, seed=cfg.seed, references=refs)
            log(
                f"val reward ({len(val)} tasks, temperature 0.7): bare {bare:.3f}, with a "
                f"same-template train trajectory as reference {ref:.3f}"
            )
            plays = same_template_plays(val, train, seed=cfg.seed)
            for fmt in (f for f in cfg.formats if f != "lopd"):
                by_format[fmt] = evaluate_reward(
                    model, tokenizer, val, seed=cfg.seed, make_env=framed_env_factory(fmt, plays)
                )
                log(f"  the same reference in {fmt}'s format: {by_format[fmt]:.3f}")
        seconds = time.perf_counter() - t0
        info = {
            "weights_sha256": digest,
            **({"init_weights_sha256": init_digest} if init_digest else {}),
            "val_reward_bare": bare,
            "val_reward_reference": ref,
            "val_tasks": cfg.eval_tasks,
            **({"val_reward_other_formats": by_format} if by_format else {}),
            "num_params": num_params,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "sft_seconds": round(sft_seconds, 1),
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


def tiny_model_dir(seed: int = 0) -> Path:
    """The shipped asset's directory, or that of a tiny model built into the cache on first use
    (:func:`default_cache_dir`; an install without the asset builds it once, in minutes)."""
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
