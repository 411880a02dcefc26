"""Chat rendering and multi-turn rollouts: masks aligned with the rendered conversation token by
token, template consistency, determinism, batching invariance and budgets.

Uses the shipped tiny model (``lopd/assets/tiny-qwen3``) and the built-in tool-use worlds.
"""

from __future__ import annotations

import pytest
import torch

from lopd.envs import builtin_tasks, make_env
from lopd.models.loading import load_model
from lopd.rollout.chat import (
    TINY_CHAT_TEMPLATE,
    end_of_turn_id,
    render_messages,
    render_observation,
    render_observation_text,
    render_prompt,
    render_prompt_text,
    stop_token_ids,
)
from lopd.rollout.multi_turn import GenerationConfig, rollout, sample_next_token
from lopd.tiny.data import demonstration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find_customer",
            "description": "Look a customer up by full name.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "description": "full name"}},
                "required": ["name"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_email",
            "description": "Change a customer's email.",
            "parameters": {
                "type": "object",
                "properties": {
                    "customer_id": {"type": "string", "description": "id"},
                    "email": {"type": "string", "description": "new email"},
                },
                "required": ["customer_id", "email"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def tiny():
    # Eager attention: the batch-invariance test compares padded batches with lone rows token
    # for token; under SDPA the two calls may run different library kernels.
    torch.manual_seed(0)
    return load_model(attn_implementation="eager")


@pytest.fixture(scope="module")
def tasks():
    # Interleaved over the worlds: any prefix mixes shop, insurance and logistics.
    return builtin_tasks("tool_use", split="test", n=12)


@pytest.fixture(scope="module")
def sampled(tiny, tasks):
    model, tok = tiny
    return rollout(model, tok, tasks, GenerationConfig(), seed=123, batch_size=8)


# --------------------------------------------------------------------------- rendering


def test_tiny_template_layout(tiny):
    _, tok = tiny
    text = render_prompt_text(tok, "SYS", "Do it.", TOOLS)
    assert text == (
        "<|im_start|>system\nSYS\n\n# Tools\n- find_customer(name)\n"
        "- set_email(customer_id, email)\n<|im_end|>\n"
        "<|im_start|>user\nDo it.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_observation_text(tok, '{"id": "C-1"}') == (
        '\n<|im_start|>user\n<tool_response>\n{"id": "C-1"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    # No tools: a plain system turn.
    assert render_prompt_text(tok, "SYS", "hi") == (
        "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_prompt_is_pure_and_user_local(tiny):
    _, tok = tiny
    a = render_prompt(tok, "SYS", "Change the email of Lena Park.", TOOLS)
    assert a == render_prompt(tok, "SYS", "Change the email of Lena Park.", TOOLS)
    b = render_prompt(tok, "SYS", "Reference: x y z\nChange the email of Lena Park.", TOOLS)
    # Only the user segment differs: same system-turn prefix, same assistant-header suffix.
    header = tok("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert a[-len(header) :] == b[-len(header) :] == header
    sys_end = a.index(tok.convert_tokens_to_ids("<|im_end|>")) + 1
    assert a[:sys_end] == b[:sys_end]
    assert tok.decode(a) == render_prompt_text(tok, "SYS", "Change the email of Lena Park.", TOOLS)


def test_special_tokens_and_stops(tiny):
    _, tok = tiny
    eot = end_of_turn_id(tok)
    assert tok.convert_ids_to_tokens(eot) == "<|im_end|>"
    assert stop_token_ids(tok)[0] == eot
    assert tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == TINY_CHAT_TEMPLATE


def test_demonstrations_rerender_exactly(tiny):
    """Segment-wise tokenization == tokenizing the whole conversation with the template."""
    _, tok = tiny
    for task in builtin_tasks("tool_use", split="train", n=6):
        demo = demonstration(tok, task)
        assert demo.reward == 1.0, task.task_id
        assert render_messages(tok, demo.messages, demo.tools) == demo.input_ids
        # Every masked run decodes to one assistant message (plus the end-of-turn token).
        runs = _runs(demo.action_mask)
        contents = [m["content"] for m in demo.messages if m["role"] == "assistant"]
        assert [tok.decode(demo.input_ids[s:e]) for s, e in runs] == [
            c + "<|im_end|>" for c in contents
        ]


def test_generation_prompt_suffix_is_part_of_the_observation_segment(tiny):
    """A template whose generation prompt adds text (like Qwen3's empty think block when
    enable_thinking=False) puts that text at the end of the observation segment."""
    _, tok = tiny
    think = (
        "{%- if add_generation_prompt and not (enable_thinking is defined and enable_thinking) %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    )
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = TINY_CHAT_TEMPLATE + think
    off = render_observation_text(tok2, "R", enable_thinking=False)
    on = render_observation_text(tok2, "R", enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")
    assert render_prompt_text(tok2, "S", "U").endswith("assistant\n<think>\n\n</think>\n\n")


def test_render_errors(tiny):
    _, tok = tiny
    with pytest.raises(TypeError, match="observation"):
        render_observation(tok, None)
    with pytest.raises(TypeError, match="user"):
        render_prompt(tok, "s", 3)
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        render_prompt(tok2, "s", "u")


# --------------------------------------------------------------------------- sampling


def test_sample_next_token_filters():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    greedy = sample_next_token(logits, 0.0, 20, 0.95, g)
    assert (greedy == 0).all()
    top2 = sample_next_token(logits, 1.0, 2, 1.0, g)
    assert set(top2.tolist()) == {0, 1}
    # Renormalized top-2 probabilities: e^4 / (e^4 + e^3) = 0.731.
    assert abs((top2 == 0).float().mean().item() - 0.731) < 0.03
    # Softmax of the logits: 0.636, 0.234, 0.086, ...; top_p=0.8 keeps {0, 1} (0.87 >= 0.8).
    nucleus = sample_next_token(logits, 1.0, 0, 0.8, g)
    assert set(nucleus.tolist()) == {0, 1}
    # top_p below the first probability keeps only the argmax.
    assert (sample_next_token(logits, 1.0, 0, 0.5, g) == 0).all()


# --------------------------------------------------------------------------- rollouts


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_rollout_masks_align_token_by_token(tiny, tasks, sampled):
    _, tok = tiny
    eot = end_of_turn_id(tok)
    assert [t.task.task_id for t in sampled] == [t.task_id for t in tasks]
    for traj, task in zip(sampled, tasks):
        ids, mask = traj.input_ids, traj.action_mask
        assert len(ids) == len(mask)
        env = make_env(task)
        user = env.reset(task)
        prompt = render_prompt(tok, env.system_prompt(), user, env.tools())
        assert traj.prompt_len == len(prompt) and ids[: len(prompt)] == prompt
        assert not any(mask[: traj.prompt_len])
        # The mask is exactly the union of the turn spans, and spans are its maximal runs.
        assert _runs(mask) == traj.turn_spans
        assert sum(mask) == traj.info["generated_tokens"]
        assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        observations = [m["content"] for m in traj.messages if m["role"] == "tool"]
        assert len(assistant) == len(traj.turn_spans) == traj.num_steps
        pos = traj.prompt_len
        for k, (s, e) in enumerate(traj.turn_spans):
            assert s == pos
            turn = ids[s:e]
            # The generated text of each turn is the decode of its masked ids.
            content = turn[:-1] if turn[-1] == eot else turn
            assert tok.decode(content) == assistant[k]
            pos = e if turn[-1] == eot else e + 1  # + the template-closed end-of-turn token
            if k < len(observations):
                seg = render_observation(tok, observations[k])
                assert ids[pos : pos + len(seg)] == seg
                pos += len(seg)
        assert pos == len(ids)


def test_rollout_rerenders_with_template(tiny, sampled):
    """The whole trajectory is the template rendering of its messages (the tiny model samples
    canonical tokenizations, so the generated ids survive a decode/encode round trip)."""
    _, tok = tiny
    for traj in sampled:
        env = make_env(traj.task)
        env.reset(traj.task)
        assert render_messages(tok, traj.messages, env.tools()) == traj.input_ids


def test_rollout_results_and_trace(sampled):
    for traj in sampled:
        assert 0.0 <= traj.reward <= 1.0
        assert traj.info["stop_reason"] in ("done", "max_steps", "max_total_tokens")
        # Every executed call is traced; malformed or parallel calls count without a trace step.
        assert len(traj.trace) <= traj.num_tool_calls
        for step in traj.trace:
            assert step.action and isinstance(step.result, str)
    assert any(t.reward > 0 for t in sampled)


def test_rollout_deterministic_under_seed(tiny, tasks, sampled):
    model, tok = tiny
    again = rollout(model, tok, tasks, GenerationConfig(), seed=123, batch_size=8)
    assert [t.input_ids for t in again] == [t.input_ids for t in sampled]
    assert [t.reward for t in again] == [t.reward for t in sampled]
    other = rollout(model, tok, tasks, GenerationConfig(), seed=7, batch_size=8)
    assert [t.input_ids for t in other] != [t.input_ids for t in sampled]


def test_greedy_rollout_is_batch_invariant(tiny, tasks):
    """Left padding, position ids and dropping finished rows from the KV cache do not change
    what a row generates."""
    model, tok = tiny
    gen = GenerationConfig(temperature=0.0, max_new_tokens_per_turn=48, max_steps=3)
    batched = rollout(model, tok, tasks[:5], gen, batch_size=5)
    single = [rollout(model, tok, [t], gen, batch_size=1)[0] for t in tasks[:5]]
    assert [t.input_ids for t in batched] == [t.input_ids for t in single]
    # Turn-level refill (batch smaller than the task count) gives the same result too.
    refilled = rollout(model, tok, tasks[:5], gen, batch_size=2)
    assert [t.input_ids for t in refilled] == [t.input_ids for t in single]


def test_rollout_budgets(tiny, tasks):
    model, tok = tiny
    gen = GenerationConfig(max_new_tokens_per_turn=6, max_total_tokens=400, max_steps=4)
    trajs = rollout(model, tok, tasks[:4], gen, seed=0, batch_size=4)
    eot = end_of_turn_id(tok)
    for traj in trajs:
        assert len(traj.input_ids) <= gen.max_total_tokens
        assert traj.num_steps <= gen.max_steps
        for s, e in traj.turn_spans:
            assert e - s <= gen.max_new_tokens_per_turn
        # A 6-token turn cannot finish a tool call: turns are cut and closed by the template.
        assert traj.info["truncated_turns"] >= 1
        cut = [e for s, e in traj.turn_spans if traj.input_ids[e - 1] != eot]
        assert all(traj.input_ids[e] == eot and traj.action_mask[e] == 0 for e in cut)
    # Total budget: a prompt of ~250 tokens leaves room for a few turns only.
    tight = GenerationConfig(max_total_tokens=300, max_steps=30)
    trajs = rollout(model, tok, tasks[:4], tight, seed=0, batch_size=4)
    for traj in trajs:
        assert len(traj.input_ids) <= 300
    assert any(t.info["stop_reason"] == "max_total_tokens" for t in trajs)


def test_rollout_argument_errors(tiny, tasks):
    model, tok = tiny
    with pytest.raises(ValueError, match="batch_size"):
        rollout(model, tok, tasks[:1], batch_size=0)
    with pytest.raises(ValueError, match="max_total_tokens"):
        rollout(model, tok, tasks[:1], GenerationConfig(max_total_tokens=50))
    with pytest.raises(TypeError, match=r"tasks\[0\]"):
        rollout(model, tok, ["not a task"])
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens_per_turn"):
        GenerationConfig(max_new_tokens_per_turn=0)
