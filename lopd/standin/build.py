"""Random-init stand-ins of real Qwen3 checkpoints, built offline (tests and memory accounts).

A real-checkpoint run (``--preset paper --model /ckpt/Qwen3-4B``) differs from the tiny default
in exactly the places that break first: a 151,936-row vocabulary of which the tokenizer covers
151,669 (Qwen3 pads 267 rows), Qwen3's own chat template with full JSON tool schemas, bf16
weights, 16 query / 8 KV heads of dim 128, a 40,960-token context. Nothing can be downloaded
here, so :func:`build_standin` writes a Hugging Face checkpoint directory with that shape:

* **Tokenizer**: byte-level BPE with Qwen2/3's pre-tokenizer (the same split regex, NFC, byte
  level without prefix space), merges trained on the built-in tool-use worlds' text and the
  paper's framing text, the base vocabulary filled up to Qwen3's 151,643 ids with unreachable
  byte-string tokens (they decode, they are never produced by encoding), then Qwen3's 26 added
  tokens at their ids (``<|endoftext|>`` = 151643 (pad), ``<|im_start|>`` = 151644,
  ``<|im_end|>`` = 151645 (EOS), ..., ``<tool_call>`` = 151657, ``<think>`` = 151667). The chat
  template is Qwen3's original, read from the installed ``trl`` package
  (``trl/chat_templates/qwen3.jinja``; ``trl`` is in the ``[test]`` extra).
* **Model**: ``Qwen3ForCausalLM`` with random initialization (``initializer_range`` 0.02) from a
  seed, in the requested dtype, ``vocab_size`` 151,936, tied embeddings, RoPE theta 1e6.

The weights are random: rollouts are noise and rewards 0. A stand-in measures memory, shapes,
budgets and plumbing, never learning. Shapes (:data:`SHAPES`): ``ci`` (2 layers, hidden 256,
40.5 M parameters, what the CI test trains), ``218m`` (4 layers of Qwen3-0.6B, fp32) and
``qwen3-0.6b`` (28 layers, bf16, 596 M)::

    python -m lopd.standin --shape qwen3-0.6b --out /tmp/qwen3-0.6b-standin
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from lopd.envs import builtin_tasks, make_env, oracle_actions
from lopd.latent.injection import FRAMING

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "QWEN3_BASE_VOCAB",
    "SHAPES",
    "StandinShape",
    "build_qwen3_tokenizer",
    "build_standin",
    "qwen3_chat_template",
]

QWEN3_BASE_VOCAB = 151_643
"""Ids of Qwen3's byte-level BPE vocabulary; the added tokens start here."""

QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
"""Qwen3's added tokens in id order from :data:`QWEN3_BASE_VOCAB`, with their ``special`` flag."""

# Qwen2/3's pre-tokenization split (contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines, whitespace).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class StandinShape:
    """The architecture of a stand-in (Qwen3 field names).

    Attributes:
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim: the
            decoder's shape.
        vocab_size: rows of the embedding / LM head (Qwen3: 151,936, 267 beyond the tokenizer).
        dtype: ``float32`` / ``bfloat16`` / ``float16``, the dtype the weights are saved in.
        max_position_embeddings: the context length the config declares.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 151_936
    dtype: str = "float32"
    max_position_embeddings: int = 40_960

    def num_parameters(self) -> int:
        """Parameters of the model (tied embeddings counted once)."""
        d, h = self.hidden_size, self.head_dim
        attn = d * self.num_heads * h * 2 + d * self.num_kv_heads * h * 2 + 2 * h
        mlp = 3 * d * self.intermediate_size
        return self.vocab_size * d + self.num_layers * (attn + mlp + 2 * d) + d


SHAPES: dict[str, StandinShape] = {
    "ci": StandinShape(2, 256, 768, 4, 2, 64),
    "218m": StandinShape(4, 1024, 3072, 16, 8, 128, dtype="float32"),
    "qwen3-0.6b": StandinShape(28, 1024, 3072, 16, 8, 128, dtype="bfloat16"),
}
"""Named shapes: ``ci`` (40.5 M parameters, the CI test), ``218m`` (4 layers of Qwen3-0.6B in
fp32, 218.5 M) and ``qwen3-0.6b`` (its full 28 layers in bf16, 596.0 M)."""


def qwen3_chat_template() -> str:
    """Qwen3's original chat template, from the installed ``trl`` package.

    Raises:
        ImportError: ``trl`` is not installed (``pip install 'lopd[test]'``).
    """

    try:
        files = resources.files("trl")
    except ModuleNotFoundError as err:
        raise ImportError(
            "building a Qwen3 stand-in needs Qwen3's chat template from the trl package: "
            "pip install 'lopd[test]' (or pip install trl)"
        ) from err
    return (files / "chat_templates" / "qwen3.jinja").read_text()


def _corpus(num_tasks: int = 60) -> Iterator[str]:
    """Text the BPE merges are trained on: the built-in tool-use worlds rendered the way a
    Qwen3 prompt shows them (system prompt, JSON tool schemas), the first ``num_tasks`` train
    tasks' instructions, oracle calls and tool results, and the paper's framing texts."""

    seen: set[str] = set()
    for task in builtin_tasks("tool_use", "train", n=num_tasks):
        env = make_env(task)
        yield env.reset(task)
        if task.world not in seen:
            seen.add(task.world)
            yield env.system_prompt()
            yield from (json.dumps(tool) for tool in env.tools())
        for text in oracle_actions(task):
            yield text
            observation, done = env.step(text)
            if done:
                break
            yield observation
    for before, after in FRAMING.values():
        yield before
        yield after


def _fillers(taken: set[str], alphabet: Sequence[str], count: int) -> list[str]:
    """``count`` byte-level strings not in ``taken`` (pairs, then triples, of alphabet chars)."""
    out: list[str] = []
    for a in alphabet:
        for b in alphabet:
            if len(out) == count:
                return out
            if a + b not in taken:
                out.append(a + b)
    for a in alphabet:
        for b in alphabet:
            for c in alphabet:
                if len(out) == count:
                    return out
                if a + b + c not in taken:
                    out.append(a + b + c)
    raise ValueError(f"cannot make {count} filler tokens")  # pragma: no cover - 16.8M available


def build_qwen3_tokenizer(merges_vocab: int = 8000, texts: Sequence[str] | None = None) -> Any:
    """A Qwen3-style byte-level BPE tokenizer (see the module docstring), deterministic.

    Args:
        merges_vocab: size of the trained part of the vocabulary (byte alphabet + merges).
        texts: training text (default: the built-in worlds, :func:`_corpus`).

    Returns:
        A ``transformers`` fast tokenizer: ``len()`` 151,669, pad ``<|endoftext|>``, EOS
        ``<|im_end|>``, Qwen3's chat template.
    """

    def configure(tok: Tokenizer) -> None:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=merges_vocab, initial_alphabet=alphabet, show_progress=False
    )
    trained = Tokenizer(models.BPE())
    configure(trained)
    trained.train_from_iterator(list(texts) if texts is not None else list(_corpus()), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    for piece in _fillers(set(vocab), alphabet, QWEN3_BASE_VOCAB - len(vocab)):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    configure(tok)
    for text, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(text, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=131_072,
    )
    fast.chat_template = qwen3_chat_template()
    return fast


def build_standin(
    out: str | Path,
    shape: StandinShape | str = "ci",
    seed: int = 0,
    tokenizer: Any = None,
) -> Path:
    """Write a random-init Qwen3 checkpoint directory (config, safetensors, tokenizer).

    Args:
        out: the directory (replaced atomically if it exists).
        shape: a :class:`StandinShape` or a name in :data:`SHAPES`.
        seed: initialization seed.
        tokenizer: reuse a tokenizer from :func:`build_qwen3_tokenizer` (built if ``None``).

    Returns:
        ``out``, loadable with :func:`lopd.models.loading.load_model`.
    """

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
        shape = SHAPES[shape]
    tokenizer = tokenizer if tokenizer is not None else build_qwen3_tokenizer()
    if shape.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {shape.vocab_size} < the tokenizer's {len(tokenizer)}")
    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, shape.dtype))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"standin": asdict(shape), "seed": seed, "num_parameters": model.num_parameters()}
        (tmp / "standin.json").write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
