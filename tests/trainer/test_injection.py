"""Latent injection (paper A.4): teacher prompt layout, the student->teacher token map, numerics."""

from __future__ import annotations

import pytest
import torch

from lopd.envs import builtin_tasks
from lopd.latent.injection import (
    FRAMING,
    LATENT_SENTINEL,
    build_teacher_sequence,
    frame_user_message,
    inject_latents,
)
from lopd.models.loading import load_model
from lopd.rollout.batch import action_rows, pad_batch
from lopd.tiny.data import demonstration
from tests.utils import assert_close, assert_close_reordered

N_LATENTS = 6


@pytest.fixture(scope="module")
def tiny():
    # Eager attention: these tests reason about one attention implementation's masking; under
    # SDPA the masked and unmasked calls may also run different library kernels.
    torch.manual_seed(0)
    model, tok = load_model(attn_implementation="eager")
    return model, tok


@pytest.fixture(scope="module")
def conversation(tiny):
    """A real multi-turn tool-use conversation (oracle actions played in the env)."""
    _, tok = tiny
    task = builtin_tasks("tool_use", "train", n=1)[0]
    demo = demonstration(tok, task)
    prompt_len = demo.action_mask.index(1)
    user = next(m["content"] for m in demo.messages if m["role"] == "user")
    return demo, prompt_len, user


def test_teacher_prompt_layout_and_exact_token_map(tiny, conversation):
    _, tok = tiny
    demo, prompt_len, user = conversation
    seq = build_teacher_sequence(tok, demo.input_ids, prompt_len, user, "tool_use", N_LATENTS)
    pad = tok.pad_token_id
    start = seq.latent_start
    # A contiguous span of J*K pad ids, inside the first user message, after the framing text.
    assert seq.input_ids[start : start + N_LATENTS] == [pad] * N_LATENTS
    assert pad not in seq.input_ids[:start]
    before = tok.decode(seq.input_ids[:start], skip_special_tokens=False)
    after = tok.decode(seq.input_ids[start + N_LATENTS : seq.prompt_len], skip_special_tokens=False)
    assert before.rstrip().endswith(FRAMING["tool_use"][0])
    assert before.count("<|im_start|>user") == 1
    assert after.startswith("\n\n" + FRAMING["tool_use"][1])
    assert user in after
    # The system turn is untouched: the teacher prompt starts with the student's system turn.
    system_end = demo.input_ids.index(tok.convert_tokens_to_ids("<|im_end|>"))
    assert seq.input_ids[: system_end + 1] == demo.input_ids[: system_end + 1]
    # Exact map: every student token after the prompt is at p + offset in the teacher.
    p = torch.arange(prompt_len, len(demo.input_ids))
    teacher_ids = torch.tensor(seq.input_ids)
    student_ids = torch.tensor(demo.input_ids)
    assert torch.equal(teacher_ids[seq.teacher_position(p)], student_ids[p])
    assert len(seq.input_ids) == len(demo.input_ids) + seq.offset
    # In particular every action token (what the KL supervises) maps onto itself.
    rows = action_rows(demo.action_mask)
    assert rows.numel() == sum(demo.action_mask)
    assert torch.equal(teacher_ids[rows + 1 + seq.offset], student_ids[rows + 1])


def test_injected_token_embeddings_equal_the_token_id_path(tiny, conversation):
    """A.4 equivalence check: fill the latent span with real token embeddings."""
    model, tok = tiny
    demo, prompt_len, user = conversation
    seq = build_teacher_sequence(tok, demo.input_ids, prompt_len, user, "tool_use", N_LATENTS)
    fill = tok("find_customer order", add_special_tokens=False)["input_ids"][:N_LATENTS]
    fill = (fill * N_LATENTS)[:N_LATENTS]
    start = seq.latent_start
    ids_tokens = list(seq.input_ids)
    ids_tokens[start : start + N_LATENTS] = fill
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids_tokens])).logits[0]
        emb = model.get_input_embeddings()
        embeds = emb(torch.tensor(seq.input_ids))  # placeholders embedded as pad
        latents = emb(torch.tensor(fill))
        injected = inject_latents(embeds, latents, start)
        out = model(inputs_embeds=injected[None]).logits[0]
    assert_close(out, ref, torch.float32, "logits, embedding path vs token-id path")
    assert torch.equal(out[-50:].argmax(-1), ref[-50:].argmax(-1))
    # The placeholder (pad) embeddings alone differ: the injection is what makes them equal.
    with torch.no_grad():
        plain = model(inputs_embeds=embeds[None]).logits[0]
    assert not torch.allclose(plain[start + N_LATENTS :], ref[start + N_LATENTS :], atol=1e-3)


def test_right_padded_batch_keeps_logits_of_real_positions(tiny, conversation):
    model, tok = tiny
    demo, prompt_len, _ = conversation
    short = demo.input_ids[: prompt_len + 10]
    ids, mask = pad_batch([demo.input_ids, short], tok.pad_token_id)
    assert mask[1].sum() == len(short) and ids[1, len(short) :].eq(tok.pad_token_id).all()
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits[1, : len(short)]
        alone = model(input_ids=torch.tensor([short])).logits[0]
    # Padded and lone rows sum over different key lengths: the tolerance is that of a
    # reordered fp32 sum, not the kernel table's (see assert_close_reordered).
    assert_close_reordered(batched, alone, model, "right padding")
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))


def test_gradient_reaches_latents_through_the_concatenation(tiny):
    model, _ = tiny
    d = model.config.hidden_size
    embeds = torch.randn(20, d)
    latents = torch.randn(N_LATENTS, d, requires_grad=True)
    out = inject_latents(embeds, latents, 5)
    assert torch.equal(out[5 : 5 + N_LATENTS], latents.detach())
    assert torch.equal(out[:5], embeds[:5]) and torch.equal(out[11:], embeds[11:])
    logits = model(inputs_embeds=out[None]).logits
    logits[0, -1].logsumexp(-1).backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0


def test_bad_inputs_name_the_argument(tiny, conversation):
    _, tok = tiny
    demo, prompt_len, user = conversation
    with pytest.raises(ValueError, match="user_message"):
        build_teacher_sequence(tok, demo.input_ids, prompt_len, "not in prompt", "tool_use", 4)
    with pytest.raises(ValueError, match="num_latents"):
        build_teacher_sequence(tok, demo.input_ids, prompt_len, user, "tool_use", 0)
    with pytest.raises(ValueError, match="prompt_len"):
        build_teacher_sequence(tok, demo.input_ids, 0, user, "tool_use", 4)
    with pytest.raises(ValueError, match="domain"):
        frame_user_message(user, "chess")
    with pytest.raises(ValueError, match="start"):
        inject_latents(torch.zeros(5, 3), torch.zeros(4, 3), 3)
    with pytest.raises(ValueError, match="same d"):
        inject_latents(torch.zeros(5, 3), torch.zeros(2, 4), 0)


def test_framing_is_the_papers_text_around_the_sentinel():
    framed = frame_user_message("Cancel order O-1.", "tool_use")
    before, after = framed.split(LATENT_SENTINEL)
    assert before.startswith("The following is a REFERENCE EXAMPLE")
    assert "Now complete YOUR task below, starting from scratch" in after
    assert after.endswith("Cancel order O-1.")
    assert frame_user_message("x", "coding").startswith("The following is a reference from")


def test_latent_generation_matches_the_token_path_when_latents_are_token_embeddings(tiny):
    """Generation from ``inputs_embeds`` ("base + composer" evaluation) vs plain token ids.

    With the pad embedding as every latent, the latent-conditioned model must roll out exactly
    what the plain model does on the placeholder prompt (greedy, a left-padded batch of two).
    """
    from lopd.envs import make_env
    from lopd.latent.conditioned import LatentConditionedLM, LatentPromptEnv
    from lopd.rollout.chat import render_prompt
    from lopd.rollout.multi_turn import GenerationConfig, rollout

    model, tok = tiny
    tasks = builtin_tasks("tool_use", "test", n=2)
    ph = tok.convert_ids_to_tokens(tok.pad_token_id)

    def env_factory(task):
        return LatentPromptEnv(make_env(task), "tool_use", N_LATENTS, ph)

    prompts, starts = [], []
    for task in tasks:
        env = env_factory(task)
        ids = render_prompt(tok, env.system_prompt(), env.reset(task), env.tools())
        run = [
            i for i in range(len(ids)) if ids[i : i + N_LATENTS] == [tok.pad_token_id] * N_LATENTS
        ]
        assert len(run) == 1, "one contiguous placeholder span per prompt"
        prompts.append(ids)
        starts.append(run[0])
    assert len(prompts[0]) != len(prompts[1])  # the batch really is left-padded
    pad_embed = model.get_input_embeddings().weight[tok.pad_token_id].detach()
    latents = [pad_embed.expand(N_LATENTS, -1).clone() for _ in tasks]
    gen = GenerationConfig(temperature=0.0, max_new_tokens_per_turn=12, max_steps=2)
    plain = rollout(model, tok, tasks, gen, seed=0, make_env=env_factory)
    lm = LatentConditionedLM(model, prompts, latents, starts)
    injected = rollout(lm, tok, tasks, gen, seed=0, make_env=env_factory)
    for a, b, prompt in zip(plain, injected, prompts):
        assert a.input_ids[: len(prompt)] == prompt
        assert a.input_ids == b.input_ids
