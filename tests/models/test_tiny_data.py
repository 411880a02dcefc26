"""The tiny model's training data: random conventions, references of other train tasks only,
no held-out task anywhere, and the exact shared-prefix loss of its SFT."""

from __future__ import annotations

import collections
import random

import pytest
import torch

import lopd.tiny.data as tiny_data
from lopd.envs import builtin_tasks, get_world
from lopd.latent.injection import FRAMING
from lopd.tiny.build import TinyBuildConfig, build_tiny, build_tokenizer, tiny_model_config
from lopd.tiny.data import (
    Episode,
    EpisodeSource,
    Mixture,
    experience_text,
    same_template_references,
    sample_conventions,
    tokenizer_corpus,
)
from lopd.tiny.formats import FORMATS
from lopd.tiny.sft import collate, greedy_hits, lm_loss, shared_prefix_len


@pytest.fixture(scope="module")
def train():
    return builtin_tasks("tool_use", "train")


@pytest.fixture(scope="module")
def tokenizer(train):
    return build_tokenizer(tokenizer_corpus(train[:90]))


def test_reference_is_another_train_task_under_the_same_conventions(train, tokenizer):
    source = EpisodeSource(train, Mixture(bare=0.3, same_template=0.75))
    rng = random.Random(0)
    kinds = collections.Counter()
    for i in range(300):
        episode = source.episode(rng, source.worlds[i % 3])
        target, ref = episode.target, episode.reference
        assert target.split == "train" and episode.format == "lopd"
        if ref is None:
            kinds["bare"] += 1
            continue
        assert ref.split == "train" and ref.world == target.world
        assert ref.task_id != target.task_id and ref.instruction != target.instruction
        assert ref.spec["conventions"] == target.spec["conventions"]
        kinds["same" if ref.spec["template"] == target.spec["template"] else "other"] += 1
        if i < 30:
            demo = source.demonstration(tokenizer, episode)
            user = demo.messages[1]["content"]
            assert user.startswith(FRAMING["tool_use"][0]) and user.endswith(target.instruction)
            assert experience_text(ref) in user and target.instruction not in user[:-1]
            assert demo.reward == 1.0
    assert 60 <= kinds["bare"] <= 120
    assert 0.65 <= kinds["same"] / (kinds["same"] + kinds["other"]) <= 0.85
    with pytest.raises(ValueError, match="own reference"):
        source.demonstration(tokenizer, Episode(target, target))


def test_conventions_are_drawn_uniformly():
    rng = random.Random(1)
    cls = get_world("shop")
    counts = collections.Counter()
    for _ in range(2000):
        counts.update(sample_conventions("shop", rng).items())
    for slot, alts in cls.conventions.items():
        for alt in alts:
            assert abs(counts[(slot, alt)] / 2000 - 1 / len(alts)) < 0.05


def test_model_data_never_holds_a_heldout_task(monkeypatch):
    """Everything the build tokenizes or trains on is a train-split task of task-set seed 0."""
    heldout = builtin_tasks("tool_use", "val") + builtin_tasks("tool_use", "test")
    with pytest.raises(ValueError, match="train-split tasks only"):
        EpisodeSource(heldout[:5])
    seen: list = []
    real = tiny_data.demonstration

    def spy(tokenizer, task, user_message=None, system_suffix=""):
        seen.append((task, (user_message or "") + system_suffix or None))
        return real(tokenizer, task, user_message, system_suffix)

    monkeypatch.setattr(tiny_data, "demonstration", spy)
    cfg = TinyBuildConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        sft_steps=4,
        batch_size=8,
        first_call_steps=2,
        excerpt_steps=3,
        excerpt_batch_size=4,
        eval_tasks=0,
        threads=1,
        formats=FORMATS,
    )
    build_tiny(cfg, out=None, verbose=False)
    assert len(seen) == 32 + 12 + 8  # the SFT's episodes and both curricula's excerpts
    bad_ids = {t.task_id for t in heldout}
    bad_text = {t.instruction for t in heldout}
    bad_seeds = {t.spec["seed"] for t in heldout}
    for task, user in seen:
        assert task.split == "train" and task.task_id not in bad_ids
        assert task.instruction not in bad_text and task.spec["seed"] not in bad_seeds
        if user is not None:
            assert not any(t in user for t in bad_text)


def test_mismatched_references_have_another_template(train):
    val = builtin_tasks("tool_use", "val", n=12)
    same = same_template_references(val, train, seed=0)
    other = same_template_references(val, train, seed=0, match=False)
    by_instruction = {t.instruction: t for t in train}
    for t in val:
        for refs, match in ((same, True), (other, False)):
            (text,) = refs[t.task_id]
            ref = by_instruction[text.split("\n")[0].removeprefix("Task: ")]
            assert ref.world == t.world
            assert (ref.spec["template"] == t.spec["template"]) == match


def test_shared_prefix_loss_equals_the_whole_forward(train, tokenizer):
    from transformers import Qwen3ForCausalLM

    source = EpisodeSource(train, Mixture(bare=0.5))
    rng = random.Random(3)
    demos = [source.demonstration(tokenizer, source.episode(rng, "insurance")) for _ in range(4)]
    torch.manual_seed(0)
    cfg = TinyBuildConfig(hidden_size=32, intermediate_size=64, num_layers=2, head_dim=16)
    model = Qwen3ForCausalLM(tiny_model_config(tokenizer, cfg))
    for context_weight in (0.0, 0.3):
        ids, attn, labels, w = collate(demos, tokenizer.pad_token_id, context_weight)
        p = shared_prefix_len(ids, attn, labels)
        assert p >= 100 and (labels[:, : p + 1] == -100).all()
        whole = lm_loss(model, ids, attn, labels, w, min_prefix=10**9)
        whole.backward()
        g_whole = [q.grad.clone() for q in model.parameters()]
        model.zero_grad()
        shared = lm_loss(model, ids, attn, labels, w)
        shared.backward()
        g_shared = [q.grad.clone() for q in model.parameters()]
        model.zero_grad()
        torch.testing.assert_close(shared, whole, rtol=1e-5, atol=1e-5)
        for a, b in zip(g_shared, g_whole):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        if context_weight == 0.0:
            hf = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            torch.testing.assert_close(whole / w[:, 1:].sum(), hf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_greedy_hits_equal_the_whole_rows_argmax(bias):
    """Blocked over rows and vocabulary, the arg-max is the whole row's, ties to the lowest id:
    rows whose maximum repeats in a later block (past the ~32 MiB block of 1,024 rows) count
    only when the target is the first."""
    torch.manual_seed(0)
    n, d, vocab = 1100, 8, 20_000  # 2 row chunks x 3 vocabulary blocks of 8,192
    head = torch.nn.Linear(d, vocab, bias=bias)
    u = 10 * torch.randn(d)
    with torch.no_grad():
        head.weight[5] = head.weight[9_000] = u  # id 9,000 (second block) duplicates id 5
        if bias:
            head.bias[9_000] = head.bias[5]
    h = torch.randn(n, d)
    h[:50] = u  # rows whose maximum is at ids 5 and 9,000 both
    logits = head(h).detach()
    targets = logits.argmax(-1)
    targets[::3] = torch.randint(0, vocab, (len(targets[::3]),))
    first = (logits[:, 5] >= logits.max(-1).values).nonzero().flatten()
    assert len(first) >= 50
    targets[first[::2]] = 9_000  # the duplicate: never the arg-max
    assert greedy_hits(head, h, targets) == int((logits.argmax(-1) == targets).sum())
    assert greedy_hits(head, h[:0], targets[:0]) == 0


def test_turn_excerpts_keep_the_instruction_and_the_last_tool_result(train, tokenizer):
    from lopd.tiny.data import action_spans, turn_excerpt
    from lopd.tiny.sft import excerpt_batches, is_grounded

    source = EpisodeSource(train, Mixture(bare=0.5))
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    rng = random.Random(5)
    grounded = collections.Counter()
    for i in range(12):
        full = source.demonstration(tokenizer, source.episode(rng, source.worlds[i % 3]))
        spans = action_spans(full)
        assert len(spans) == sum(m["role"] == "assistant" for m in full.messages)
        assert sum(e - s for s, e in spans) == sum(full.action_mask)
        n = full.input_ids.index(start, 1)  # the user turn follows the system turn
        user = full.input_ids[n : spans[0][0]]
        for k, (s, e) in enumerate(spans):
            cut = turn_excerpt(full, k, start)
            previous = [] if k == 0 else full.input_ids[spans[k - 1][0] : s]
            assert cut.input_ids == user + previous + full.input_ids[s:e]
            # Only action k is supervised, and it is the last thing in the excerpt.
            assert cut.action_mask == [0] * (len(cut.input_ids) - (e - s)) + [1] * (e - s)
            assert cut.context_start == full.context_start - n
            assert tokenizer.decode(cut.input_ids[: cut.context_start]) == "<|im_start|>user\n"
            grounded[k == 0, is_grounded(cut, tokenizer)] += 1
    # A first action's values all come from the instruction; some later ones need a tool result
    # the excerpt left out, and those are the ones the batches never draw.
    assert grounded[True, False] == 0 and grounded[True, True] == 12
    assert grounded[False, False] > 0 and grounded[False, True] > 0
    ids, _attn, labels, w = next(excerpt_batches(source, tokenizer, 6, seed=1))
    assert ids.shape[0] == 6 and (ids[:, 0] == start).all()
    assert ((labels != -100) == (w > 0)).all() and int(w.sum()) > 6
    again = next(excerpt_batches(source, tokenizer, 6, seed=1))
    assert torch.equal(again[0], ids)  # deterministic in the seed
    # first_only: every row is an instruction followed by the episode's first call, nothing else.
    ids, _attn, labels, _w = next(excerpt_batches(source, tokenizer, 8, seed=2, first_only=True))
    for row, lab in zip(ids.tolist(), labels.tolist()):
        assert row.count(start) == 2  # the user turn and the one assistant turn
        text = tokenizer.decode([t for t, y in zip(row, lab) if y != -100])
        assert text.count("<tool_call>") == 1 and "Task Completed" not in text
    with pytest.raises(ValueError, match="turn-start"):
        turn_excerpt(full, 0, -1)
    with pytest.raises(ValueError, match="action 99"):
        turn_excerpt(full, 99, start)


def test_copy_batches_vary_the_distance_between_the_copies(tokenizer):
    from lopd.tiny.sft import copy_batches

    ids, attn, labels, _w = next(copy_batches(tokenizer, 64, 12, seed=0))
    assert ids.shape == (64, 36)
    distances = set()
    for r in range(64):
        n = int(attn[r].sum())
        scored = (labels[r] != -100).nonzero().flatten()
        # The repeat is the row's last len(x) tokens; all but its first are scored.
        x_len = len(scored) + 1
        assert 4 <= x_len <= 12 and int(scored[-1]) == n - 1
        x = ids[r, :x_len]
        assert torch.equal(ids[r, n - x_len : n], x)
        assert torch.equal(labels[r, n - x_len + 1 : n], x[1:])
        distances.add(n - 2 * x_len)  # the gap
    assert len(distances) > 5  # a fixed distance would be learnt as "read k tokens back"
    with pytest.raises(ValueError, match="length"):
        next(copy_batches(tokenizer, 2, 3, seed=0))
