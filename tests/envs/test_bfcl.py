"""BFCL v3 multi-turn as an env: ground-truth replay, agreement with bfcl-eval's own checker,
the turn protocol (user turns, held-out functions, step limit), dispatch without eval, the
train/test split, and the tiny model end to end. Real backends and checker throughout."""

from __future__ import annotations

import decimal
import json
import random
import time
from collections import Counter

import pytest

pytest.importorskip("bfcl_eval")

from lopd.envs import load_tasks_jsonl, make_env, oracle_actions, save_tasks_jsonl
from lopd.envs.base import ToolCall
from lopd.envs.bfcl import (
    BACKEND_CLASSES,
    CATEGORIES,
    BfclEnv,
    bfcl_tasks,
    ground_truth_calls,
    scenario_index,
    scenario_split,
)
from lopd.envs.loaders import TaskFormatError
from lopd.envs.tool_use import format_tool_call
from lopd.rollout.chat import render_observation_text
from tests.envs.bfcl_checks import MALFORMED, both_verdicts, by_id, play


@pytest.fixture(scope="module")
def tasks():
    return bfcl_tasks()


def test_ground_truth_replay_scores_100_on_every_entry_of_every_category(tasks):
    t0 = time.perf_counter()
    scores = Counter()
    for task in tasks:
        env, _, _ = play(task, oracle_actions(task))
        assert env.done and env.reward() == 1.0 and env.success, (task.task_id, env.turn_errors)
        scores[task.spec["category"]] += 1
    assert scores == {c: 200 for c in CATEGORIES}
    print(f"replayed 800 entries in {time.perf_counter() - t0:.1f} s")


def test_split_is_disjoint_by_scenario_and_shares_no_user_message(tasks):
    labels = scenario_split()
    assert sorted(labels) == list(range(200))
    assert Counter(labels.values()) == {"train": 160, "test": 40}
    train, test = bfcl_tasks(split="train"), bfcl_tasks(split="test")
    assert (len(train), len(test)) == (640, 160)
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert not {scenario_index(t.spec["bfcl_id"]) for t in train} & {
        scenario_index(t.spec["bfcl_id"]) for t in test
    }

    def messages(ts):
        return {m["content"].strip().lower() for t in ts for q in t.spec["question"] for m in q}

    assert not messages(train) & messages(test)
    assert {t.task_id: t.split for t in tasks} == {t.task_id: t.split for t in train + test}


# ----------------------------------------------------------------- agreement with bfcl-eval


def perturb(gt, mode, k, rng):
    steps = [[[c] for c in calls] for calls in gt]
    if mode == "wrong":
        c = steps[k][0][0]
        args = dict(c.arguments)
        for key in sorted(args):
            v = args[key]
            if isinstance(v, str):
                args[key] = v + "_x"
            elif isinstance(v, bool):
                args[key] = not v
            elif isinstance(v, (int, float)):
                args[key] = v + 1
            break
        steps[k][0] = [ToolCall(c.name, args)]
    elif mode == "malformed":
        steps[k].insert(rng.randrange(len(steps[k]) + 1), MALFORMED)
    elif mode == "unknown":
        steps[k].insert(rng.randrange(len(steps[k]) + 1), [ToolCall("no_such_tool", {"x": 1})])
    elif mode == "skip":
        steps[k].pop(rng.randrange(len(steps[k])))
    elif mode == "extra":
        steps[k].append(steps[k][-1])
    elif mode == "silent":
        steps[k] = []
    return steps


def test_verdicts_agree_with_bfcl_evals_checker_on_wrong_malformed_and_unknown_calls(tasks):
    rng = random.Random(0)
    sample = rng.sample(tasks, 24)
    outcomes = Counter()
    for task in sample:
        gt = ground_truth_calls(task.spec)
        k = rng.choice([i for i, c in enumerate(gt) if c])
        for mode in ("exact", "wrong", "malformed", "unknown", "skip", "extra", "silent"):
            env, official = both_verdicts(task, perturb(gt, mode, k, rng))
            assert env.success == official["valid"], (task.task_id, mode, official)
            if not official["valid"] and official["error_type"] != "multi_turn:force_terminated":
                first = next(e for e in env.turn_errors if e is not None)
                assert first == official["error_type"], (task.task_id, mode)
            outcomes[mode, env.success] += 1
    # Each kind of behaviour must actually occur both ways or fail, not pass vacuously.
    assert outcomes["exact", True] >= 22 and outcomes["unknown", True] >= 22
    assert outcomes["wrong", False] >= 12 and outcomes["silent", True] == 0
    assert outcomes["malformed", False] >= 6 and outcomes["malformed", True] >= 2


def test_wrong_call_in_the_last_turn_is_a_state_mismatch_of_that_turn_only(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    gt = ground_truth_calls(task.spec)
    last = max(i for i, c in enumerate(gt) if c)
    steps = [[[c] for c in calls] for calls in gt]
    steps[last][-1] = [ToolCall("diff", {"file_name1": "final_report.pdf", "file_name2": "x"})]
    env, official = both_verdicts(task, steps)
    assert not official["valid"] and not env.success
    assert env.turn_errors[last] == official["error_type"]
    assert [e for e in env.turn_errors if e] == [official["error_type"]]
    checked = sum(1 for c in gt if c)
    assert env.reward() == pytest.approx((checked - 1) / checked)
    # A wrong modification is an instance state mismatch (bfcl-eval's own words).
    steps[last][-1] = [ToolCall("mv", {"source": "previous_report.pdf", "destination": "archive"})]
    env, official = both_verdicts(task, steps)
    assert official["error_type"] == "multi_turn:instance_state_mismatch"
    assert env.turn_errors[last] == "multi_turn:instance_state_mismatch"


def test_unknown_and_private_names_are_errors_and_model_text_is_never_evaluated(tmp_path):
    task = bfcl_tasks(["base"], n=1)[0]
    env = make_env(task)
    env.reset(task)
    marker = tmp_path / "pwned"
    evil = f"__import__('os').system('touch {marker}')"
    seen = []
    for name, args in [
        ("no_such_tool", {"x": 1}),
        ("_load_scenario", {"scenario": {}}),
        ("__class__", {}),
        ("kill", {}),
        ("cd", {"folder": evil}),
        (evil, {}),
    ]:
        obs, done = env.step(format_tool_call(ToolCall(name, args)))
        assert not done and obs.startswith(("Error during execution", "{")), obs
        seen.append(obs)
    assert "name 'no_such_tool' is not defined" in seen[0]
    assert "is not allowed" in seen[3]
    assert not marker.exists()
    obs, _ = env.step(format_tool_call(ToolCall("pwd", {})))
    assert obs.endswith('/workspace"}')  # no call moved it
    for action in oracle_actions(task):
        env.step(action)
    assert env.success  # extra error results do not fail BFCL's response check


def test_malformed_call_ends_the_turn_and_the_next_user_message_follows(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env, first, obs = play(task, [MALFORMED])
    assert first == task.spec["question"][0][0]["content"]
    assert obs[0] == (task.spec["question"][1][0]["content"], "user")
    assert env.turn_errors[0] == "multi_turn:empty_turn_model_response"
    assert env.num_tool_calls == 1 and not env.done


def test_miss_func_turn_brings_the_held_out_functions(tasks):
    task = by_id(tasks, "multi_turn_miss_func_0")  # "sort" is held out until turn 3
    env = make_env(task)
    env.reset(task)
    names = {t["function"]["name"] for t in env.tools()}
    assert "sort" not in names and {"mv", "grep", "post_tweet"} <= names
    acts = oracle_actions(task)
    shown = []
    for a in acts:
        obs, _done = env.step(a)
        if env.observation_role == "user":
            shown.append(obs)
    assert len(shown) == len(task.spec["question"]) - 1
    assert "I have updated some more functions" in shown[2] and '"name": "sort"' in shown[2]
    assert env.success and env.verdicts()[2] is None  # the turn the model cannot act in


def test_in_progress_turn_is_checked_at_reward_and_unreached_turns_fail(tasks):
    task = by_id(tasks, "multi_turn_base_1")
    gt = ground_truth_calls(task.spec)
    env = make_env(task)
    env.reset(task)
    for c in gt[0]:
        env.step(format_tool_call(c))
    checked = sum(1 for c in gt if c)
    assert env.reward() == pytest.approx(1 / checked) and not env.success
    assert env.verdicts()[0] is True and env.verdicts()[1] is False
    assert env.reward() == pytest.approx(1 / checked)  # idempotent; state is untouched
    env.step("done")
    assert env.verdicts()[0] is True


def test_more_than_20_call_steps_in_a_turn_force_quits(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    env = make_env(task)
    env.reset(task)
    call = format_tool_call(ToolCall("pwd", {}))
    for i in range(21):
        _obs, done = env.step(call)
        assert done == (i == 20)
    assert env.force_quit and not env.success and env.reward() == 0.0


def test_each_episode_has_its_own_backend_instances(tasks):
    task = by_id(tasks, "multi_turn_base_0")
    a, b = make_env(task), make_env(task)
    a.reset(task)
    b.reset(task)
    a.step(format_tool_call(ToolCall("cd", {"folder": "document"})))
    pwd = format_tool_call(ToolCall("pwd", {}))
    assert a.step(pwd)[0].endswith('/document"}') and b.step(pwd)[0].endswith('/workspace"}')
    # The model's cd did not move the ground truth: the first turn still checks as BFCL would.
    env, official = both_verdicts(
        task, [[[c] for c in calls] for calls in ground_truth_calls(task.spec)]
    )
    assert env.success and official["valid"]


def test_math_calls_that_would_hang_are_refused_and_precision_is_restored():
    task = next(t for t in bfcl_tasks(["base"]) if "MathAPI" in t.spec["involved_classes"])
    env = make_env(task)
    env.reset(task)
    prec = decimal.getcontext().prec
    t0 = time.perf_counter()
    for name, args in [
        ("power", {"base": 10, "exponent": 10**15}),
        ("square_root", {"number": 2, "precision": 10**9}),
        ("logarithm", {"value": 10, "base": 2, "precision": 10**9}),
        ("round_number", {"number": 5, "decimal_places": -(10**12)}),
    ]:
        obs, _ = env.step(format_tool_call(ToolCall(name, args)))
        assert obs.startswith("Error during execution") and "limit" in obs, obs
    assert time.perf_counter() - t0 < 2.0
    obs, _ = env.step(format_tool_call(ToolCall("square_root", {"number": 2, "precision": 30})))
    assert "1.41421356237309504880168872" in obs
    assert decimal.getcontext().prec == prec


def test_tasks_round_trip_through_a_tasks_file_and_bad_specs_are_rejected(tmp_path, tasks):
    path = tmp_path / "bfcl.jsonl"
    save_tasks_jsonl(tasks[::50], path)
    loaded = load_tasks_jsonl(path)
    assert [t.to_dict() for t in loaded] == [t.to_dict() for t in tasks[::50]]
    assert make_env(loaded[0]).__class__ is BfclEnv
    bad = tasks[0].to_dict()
    bad["spec"] = dict(bad["spec"], ground_truth=bad["spec"]["ground_truth"][:-1])
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(TaskFormatError, match=r"bfcl\.jsonl:1: BFCL spec needs"):
        load_tasks_jsonl(path)


def test_user_turns_render_as_user_messages():
    from transformers import AutoTokenizer

    from lopd.models import TINY_ASSET_DIR

    tok = AutoTokenizer.from_pretrained(TINY_ASSET_DIR)
    assert render_observation_text(tok, "next", role="user") == (
        "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="role"):
        render_observation_text(tok, "x", role="system")


@pytest.fixture
def one_thread():
    """The tiny model is fastest on one thread (two spin-wait on a shared 2-core machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_tiny_model_runs_bfcl_episodes_end_to_end(tasks, one_thread):
    from lopd.models.loading import load_model
    from lopd.rollout.multi_turn import GenerationConfig, rollout

    model, tok = load_model()
    picked = [by_id(tasks, f"multi_turn_{c}_3") for c in CATEGORIES]
    gen = GenerationConfig(max_new_tokens_per_turn=16, max_total_tokens=4096, max_steps=4)
    trajs = rollout(model, tok, picked, gen, seed=0, batch_size=4)
    for traj in trajs:
        assert 0.0 <= traj.reward <= 1.0 and "env_error" not in traj.info
        assert traj.num_steps >= 1
        roles = [m["role"] for m in traj.messages]
        assert set(roles) <= {"user", "assistant", "tool"} and roles[0] == "user"
        text = tok.decode(traj.input_ids, skip_special_tokens=False)
        for m in traj.messages[1:]:
            if m["role"] == "user":
                assert f"<|im_start|>user\n{m['content']}<|im_end|>" in text
        assert sum(traj.action_mask) == sum(e - s for s, e in traj.turn_spans)
    print("tiny model rewards:", [round(t.reward, 3) for t in trajs])


def test_bfcl_tasks_argument_errors():
    with pytest.raises(ValueError, match="split"):
        bfcl_tasks(split="dev")
    with pytest.raises(ValueError, match="category"):
        bfcl_tasks(["multi_turn_base"])
    with pytest.raises(ValueError, match="n must be"):
        bfcl_tasks(n=-1)


def test_fuzzed_model_text_never_breaks_an_episode(tasks):
    """Random model text (the fragments of tests/envs/fuzz_text.py, plus calls of every tool of
    the entry with random arguments) against entries covering all eight backend classes."""
    from transformers import AutoTokenizer

    from lopd.models import TINY_ASSET_DIR
    from tests.envs.fuzz_text import random_turn

    tok = AutoTokenizer.from_pretrained(TINY_ASSET_DIR)
    rng = random.Random("bfcl-fuzz")
    picked = rng.sample(tasks, 24)
    assert {c for t in picked for c in t.spec["involved_classes"]} == set(BACKEND_CLASSES)
    slowest = 0.0
    for task in picked:
        env = make_env(task, max_steps=rng.randint(2, 12))
        env.reset(task)
        tools, oracle = env.tools(), oracle_actions(task)
        done = False
        while not done:
            text = random_turn(rng, tools, oracle)
            t0 = time.perf_counter()
            obs, done = env.step(text)
            slowest = max(slowest, time.perf_counter() - t0)
            obs.encode("utf-8")
            if not done:
                assert render_observation_text(tok, obs, role=env.observation_role)
        assert 0.0 <= env.reward() <= 1.0 and isinstance(env.success, bool)
        for s in env.trace:
            s.action.encode("utf-8")
            s.result.encode("utf-8")
    assert slowest < 2.0
