"""No ``[tokens x vocab]`` tensor in a training step: every method's step and the cold start, on a
stand-in with a 32,768-row vocabulary, under a dispatch hook that fails on any tensor an op
creates with a vocabulary-sized axis and 16 x V elements or more (16 rows of logits; every loss
here scores more action rows than that), naming the op, and on any ``fused_linear_logprob`` op
handed a logit block that large (its C++ implementation allocates it out of the hook's sight).

The stand-in (:mod:`lopd.standin`) is the tiny model's tokenizer under a random one-layer Qwen3
whose vocabulary is padded to 32,768 rows (the sampler never draws the padded ids), so the LM
head, not the decoder, is what would be large. Tensors of a parameter's shape (``[V, d]``: the
head's gradient, AdamW moments, float32 accumulators) are what training holds anyway and are
not counted; views and in-place results of existing tensors are not allocations.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, AutoTokenizer

from lopd.config import load_config
from lopd.methods import METHODS
from lopd.standin.build import StandinShape, build_standin
from lopd.tiny.sft import copy_batches, lm_loss, warmup
from lopd.trainer import Trainer

VOCAB = 32_768
HIDDEN = 64
ROWS = 16
TINY = Path(__file__).resolve().parents[2] / "lopd" / "assets" / "tiny-qwen3"


class VocabSizedTensors(TorchDispatchMode):
    """Records every op output with a ``vocab``-sized axis and at least ``rows * vocab`` elements
    that is a new tensor (not a view or in-place result of an input) and not of one of the
    ``allowed`` shapes."""

    def __init__(self, vocab: int, rows: int, allowed: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.vocab = vocab
        self.limit = vocab * rows
        self.allowed = allowed
        self.caught: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "fused_linear_logprob" in name:
            # The C++ op's logit block lives in memory it maps itself, out of this hook's sight:
            # the block shape it is handed (its last two int arguments) is checked instead.
            chunk, vb = args[-2:] if name.endswith("_fwd.default") else args[-3:-1]
            if vb >= self.vocab and chunk * vb >= self.limit:
                self.caught.append(f"{func} -> its [{chunk}, {vb}] logit block")
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and self.vocab in t.shape
                and t.numel() >= self.limit
                and tuple(t.shape) not in self.allowed
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.caught.append(f"{func} -> {tuple(t.shape)} {t.dtype}")
        return out


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    shape = StandinShape(1, HIDDEN, 128, 2, 1, 32, vocab_size=VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    return build_standin(tmp_path_factory.mktemp("standin") / "v32k", shape, tokenizer=tokenizer)


def _hook() -> VocabSizedTensors:
    return VocabSizedTensors(VOCAB, ROWS, {(VOCAB, HIDDEN)})


def test_the_hook_catches_materialized_logits():
    """The hook sees forward and backward ops: the obvious cross-entropy is caught twice."""
    h = torch.randn(40, HIDDEN, requires_grad=True)
    w = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    with _hook() as hook:
        F.cross_entropy(h @ w.T, torch.randint(0, VOCAB, (40,))).backward()
    assert any("aten.mm" in c for c in hook.caught), hook.caught
    assert any("softmax_backward" in c for c in hook.caught), hook.caught


@pytest.fixture(scope="module")
def trainer(standin, tmp_path_factory):
    """LOPD's setup under the hook: model, bank, composer and the cold start (2 steps); the hook's
    findings go with it (checked by the first test below)."""
    cfg = load_config(
        "smoke",
        overrides=[f"run_dir={tmp_path_factory.mktemp('run')}", f"model.path={standin}",
                   "train.method=lopd", "data.n_train=4", "data.n_test=2", "gen.max_steps=1"],
    )  # fmt: skip
    with _hook() as hook:
        tr = Trainer(cfg, progress=False)
        tr.setup()
    tr.setup_caught = hook.caught
    return tr


def test_bank_composer_and_cold_start_build_no_vocab_sized_tensor(trainer):
    assert trainer.models.student.config.vocab_size == VOCAB
    assert trainer.cfg.cold_start.steps > 0
    assert not trainer.setup_caught, "\n".join(trainer.setup_caught)


@pytest.mark.parametrize("method", list(METHODS))
def test_one_step_of_every_method_builds_no_vocab_sized_tensor(method, trainer):
    """Each method built on the same models, bank and composer, then one training step (its
    rollouts, losses, backward and optimizer step) under the hook."""
    cfg = copy.deepcopy(trainer.cfg)
    cfg.train.method = method
    trainer.method = METHODS[method].build(trainer.context, cfg)
    with _hook() as hook:
        metrics = trainer.train_step(0)
    assert not hook.caught, "\n".join(hook.caught)
    assert metrics["action_tokens"] >= ROWS  # the loss scored more rows than the hook's limit


def test_a_tiny_sft_step_builds_no_vocab_sized_tensor(standin):
    """The tiny model's SFT losses on the stand-in: a shared-prefix batch with the greedy-hit
    count, and one warm-up step (loss, backward, AdamW) on copy batches."""
    model = AutoModelForCausalLM.from_pretrained(standin)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 1000, (1, 20), generator=g).expand(4, -1)
    ids = torch.cat([prefix, torch.randint(0, 1000, (4, 12), generator=g)], dim=1)
    labels = ids.clone()
    labels[:, :21] = -100
    stats: dict[str, int] = {}
    with _hook() as hook:
        lm_loss(model, ids, torch.ones_like(ids), labels, min_prefix=16, stats=stats).backward()
        warmup(model, copy_batches(tokenizer, 8, 8, seed=0), steps=1, lr=1e-3)
    assert not hook.caught, "\n".join(hook.caught)
    assert stats["actions"] == 4 * 11 >= ROWS
