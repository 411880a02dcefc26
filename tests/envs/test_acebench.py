"""ACEBench's agent tasks: the environments' state transitions, the loaders, the episode's turn
rules, and the scorer against ACEBench's definitions on hand-made end states. The fixtures
(``tests/data/acebench``) are this project's own tasks and answers in ACEBench's shapes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from lopd.envs import load_task_file, make_env, oracle_actions
from lopd.envs.acebench.env import NO_QUESTIONS, AceBenchEnv, build_instances, tool_schemas
from lopd.envs.acebench.scoring import end_state, end_to_end, format_call, process_accuracy
from lopd.envs.acebench.spec import SAVED_ATTRIBUTES
from lopd.envs.acebench.user import OPENING, PHONE_USER_PROMPT, UserConversation
from lopd.envs.base import ToolCall
from lopd.envs.tool_use import format_tool_call, run_actions

DATA = Path(__file__).parents[1] / "data" / "acebench"


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for t in load_task_file(DATA)}


def call(name, **arguments):
    return format_tool_call(ToolCall(name, arguments))


class ScriptedUser:
    """A chat function standing for the user model: replies from a script, records prompts."""

    def __init__(self, *replies):
        self.replies, self.seen = list(replies), []

    def __call__(self, messages):
        self.seen.append(copy.deepcopy(messages))
        return self.replies.pop(0)


def test_release_files_load_with_their_answers_and_split_labels(tasks):
    assert sorted(tasks) == [
        "agent_multi_step_0",
        "agent_multi_step_1",
        "agent_multi_step_2",
        "agent_multi_turn_0",
        "agent_multi_turn_1",
    ]
    step, turn = tasks["agent_multi_step_0"], tasks["agent_multi_turn_1"]
    assert (step.split, step.spec["category"]) == ("train", "multi_step")
    assert (turn.split, turn.spec["category"]) == ("test", "multi_turn")
    assert step.spec["ground_truth"][0] == {"BaseApi": {"wifi": True, "logged_in": True}}
    assert load_task_file(DATA / "data_agent_multi_turn.json")[1].task_id == "agent_multi_turn_1"
    schema = tool_schemas(step.spec["functions"])[3]["function"]
    assert schema["parameters"]["type"] == "object"
    assert schema["parameters"]["properties"]["items"]["type"] == "array"


def test_oracle_scores_one_and_perturbed_actions_score_less(tasks):
    for task in tasks.values():
        user = ScriptedUser("hello", *["finish conversation"] * 30)
        env = AceBenchEnv(user=user) if task.spec["category"] == "multi_turn" else make_env(task)
        assert run_actions(env, task, oracle_actions(task)) == 1.0, task.task_id
        assert env.process == 1.0 and env.errors == []
    task = tasks["agent_multi_step_1"]
    env = make_env(task)
    actions = oracle_actions(task)
    # The device is never logged in: every later call fails. The first milestone is never
    # found, and ACEBench's in-order search has then passed every call: process 0.
    assert run_actions(env, task, actions[1:]) == 0.0
    assert env.process == 0.0
    assert "class BaseApi: attribute logged_in is False, expected True" in env.errors
    # The wrong message is deleted: the search for that milestone passes the later send too.
    wrong = [actions[0], actions[1], call("delete_message", message_id=4), *actions[3:]]
    assert run_actions(env, task, wrong) == 0.0 and env.process == 0.5
    record = env.episode_record()
    assert record["end_to_end"] is False and record["calls"][2] == "[delete_message(message_id=4)]"


def test_environments_follow_acebenchs_state_transitions():
    phone = build_instances(
        ["BaseApi", "MessageApi", "ReminderApi", "FoodPlatform"],
        {"MessageApi": {"wifi": True}, "BaseApi": {"logged_in": False}},
    )
    # BaseApi's section is read last and wins; absent keys are wifi off, logged in.
    assert [(p.wifi, p.logged_in) for p in phone.values()] == [(False, False)] * 4
    msg, rem, food = phone["MessageApi"], phone["ReminderApi"], phone["FoodPlatform"]
    assert msg.send_message("Eve", "Frank", "hi")["status"] is False  # not logged in
    msg.logged_in = msg.wifi = True
    assert "full" in msg.send_message("Eve", "Frank", "hi")["message"]  # six of six at start
    assert msg.delete_message(6)["status"] and msg.send_message("Eve", "Frank", "hi")["status"]
    assert msg.inbox[7] == {"sender_id": "USR100", "receiver_id": "USR101", "message": "hi"}
    with pytest.raises(KeyError):  # a sent message has no time
        msg.get_latest_message_id()
    rem.logged_in = True
    assert rem.add_reminder("Gym", "Leg day", "2024-07-20 18:00")["status"]
    assert rem.reminder_list[4]["reminder_id"] == 4
    assert food.login_food_platform("Eve", "password123")["status"] is False  # wifi off
    food.wifi = True
    assert food.login_food_platform("Eve", "password123")["status"]
    bad = food.add_food_delivery_order(
        "Eve", "Heytea", [{"product": "Cheese Milk Tea", "quantity": 0}]
    )
    assert bad["status"] is False and food.orders == []
    assert food.add_food_delivery_order("Eve", "Heytea", [{"product": "Cheese Milk Tea"}])["status"]
    assert food.users["Eve"]["balance"] == 475.0 and food.orders[0]["total_price"] == 25.0
    (travel,) = build_instances(["Travel"], {"Travel": {"users": {}}}).values()
    assert len(travel.users) == 3  # the travel scenario reads no initial_config
    assert "not enough" in travel.reserve_flight(
        "user1", "password123", "CZ4352", "Business Class", "cash", 4
    )
    assert "res_5" in travel.reserve_flight(
        "user1", "password123", "CZ4352", "Business Class", "bank", 4
    )
    assert travel.users["user1"]["bank_balance"] == 50000.0 - 2500 - 2 * 50  # 2 bags free
    assert travel.flights[3]["seats_available"] == 7
    travel.cancel_reservation("user1", "res_5", "Change of plans")
    assert travel.users["user1"]["cash_balance"] == 2000.0 + 2500  # the fare, to cash
    assert travel.reservations[-1]["reservation_id"] == "res_5"  # and kept
    with pytest.raises(KeyError):  # a wrong password fails on the missing membership level
        travel.reserve_flight("user1", "nope", "CZ4352", "Economy Class", "bank", 1)


def test_a_call_reaches_every_instance_with_the_method(tasks):
    task = tasks["agent_multi_step_0"]
    env = make_env(task)
    env.reset(task)
    obs, _ = env.step(call("turn_on_wifi"))
    assert json.loads(obs) == {"status": True, "message": "Wi-Fi is on"}  # one distinct result
    assert all(inst.wifi for inst in env._instances.values())
    obs, _ = env.step(call("send_message", sender_name="A", receiver_name="B", message="x"))
    assert obs == "Error during execution: no function named send_message is available"
    obs, _ = env.step(
        call("check_balance", user_name="Eve") + call("get_products", merchant_name="X")
    )
    assert obs.splitlines()[0] == "500.0" and '"status": false' in obs.splitlines()[1]
    obs, _ = env.step(call("login_food_platform", username="Eve"))
    assert obs.startswith("Error during execution: ") and "password" in obs


def test_multi_step_text_turns_and_step_limit(tasks):
    task = tasks["agent_multi_step_2"]
    env = AceBenchEnv(max_steps=3)
    assert env.reset(task) == task.spec["question"]
    assert env.step("Which title?") == (NO_QUESTIONS, False) and env.observation_role == "user"
    env.step(call("add_reminder", title="Gym", description="Leg day", time="2024-07-20 18:00"))
    assert env.observation_role == "tool"
    assert env.step("Task Completed") == ("", True)
    assert env.reward() == 1.0
    env.reset(task)
    for _ in range(3):
        _, done = env.step("hm")
    assert done and env.num_steps == 3


def test_multi_turn_plays_the_user_and_ends_when_it_says_so(tasks):
    task = tasks["agent_multi_turn_0"]
    user = ScriptedUser("Send Eve a message, please.", "Delete message 6.", "finish conversation")
    env = AceBenchEnv(user=user)
    assert env.reset(task) == "Send Eve a message, please."
    assert "finish conversation" in env.system_prompt() and "inbox is full" in env.system_prompt()
    first = user.seen[0]
    assert first[0] == {
        "role": "system",
        "content": PHONE_USER_PROMPT.format(question=task.spec["question"]),
    }
    assert first[1] == {"role": "user", "content": OPENING}
    obs, done = env.step("<think>hmm</think>Which message should I delete?")
    assert (obs, done, env.observation_role) == ("Delete message 6.", False, "user")
    assert user.seen[1][-1] == {"role": "user", "content": "Which message should I delete?"}
    env.step(call("delete_message", message_id=6))
    env.step(
        call(
            "send_message",
            sender_name="Frank",
            receiver_name="Eve",
            message="Meeting moved to 5 PM",
        )
    )
    assert env.step("Done.") == ("finish conversation", True)
    assert env.reward() == 1.0
    with pytest.raises(ValueError, match="multi-turn task needs a user model"):
        make_env(task).reset(task)


def test_user_conversation_picks_the_travel_prompt_and_strips_thinking():
    user = ScriptedUser("<think>plan</think>  I want to fly.  ", "ok")
    conv = UserConversation(user, "Book a flight.", ["Travel"])
    assert conv.opening() == "I want to fly."
    assert "airline's booking assistant" in user.seen[0][0]["content"]
    assert conv.reply("<think>x</think>Which day?") == "ok"
    assert conv.messages[-2] == {"role": "user", "content": "Which day?"}


GT = [
    {"BaseApi": {"wifi": True, "logged_in": True}},
    {"MessageApi": {"inbox": {"1": {"message": "a"}, "2": {"message": "b"}}}},
    {
        "FoodPlatform": {
            "users": {"Eve": {"balance": 1.0}},
            "logged_in_users": ["Eve"],
            "orders": [{"id": 1}],
        }
    },
]


@pytest.mark.parametrize(
    "edit, correct, error",
    [
        (lambda s: None, True, None),
        (
            lambda s: s[0]["BaseApi"].update(wifi=False),
            False,
            "attribute wifi is False, expected True",
        ),
        (lambda s: s.pop(1), False, "wrong number of classes: 2, expected 3"),
        (
            lambda s: s[2]["FoodPlatform"]["orders"].append({"id": 2}),
            False,
            "attribute orders is [{'id': 1}, {'id': 2}], expected [{'id': 1}]",
        ),
        (lambda s: s[1]["MessageApi"]["inbox"].update({"9": {"message": "extra"}}), True, None),
        (lambda s: s[1]["MessageApi"]["inbox"].pop("2"), False, "attribute inbox lacks key 2"),
        (
            lambda s: s[2]["FoodPlatform"]["users"]["Eve"].update(balance=2.0),
            False,
            "attribute users.Eve is {'balance': 2.0}, expected {'balance': 1.0}",
        ),
        (lambda s: s[0]["BaseApi"].update(extra=1), False, "attribute extra is not in the answer"),
        (lambda s: s.append(s.pop(0)), True, None),  # classes are matched by name, not order
    ],
    ids=[
        "same",
        "wrong-attribute",
        "missing-class",
        "extra-order",
        "extra-inbox-message",
        "missing-message",
        "wrong-balance",
        "unsaved-attribute",
        "other-order",
    ],
)
def test_end_to_end_agrees_with_acebenchs_definitions(edit, correct, error):
    state = copy.deepcopy(GT)
    edit(state)
    verdict = end_to_end(state, GT)
    assert verdict.correct is correct
    if error is not None:
        assert any(error in e for e in verdict.errors), verdict.errors


def test_a_misnamed_answer_class_is_not_compared_as_in_acebench():
    answer = [{"BaseApi": {"wifi": True}}, {"ReminderAPI": {"reminder_list": {"1": {}}}}]
    state = [{"BaseApi": {"wifi": True}}, {"ReminderApi": {"reminder_list": {}}}]
    assert end_to_end(state, answer).correct
    state[0]["BaseApi"]["wifi"] = False
    assert not end_to_end(state, answer).correct


def test_process_accuracy_matches_milestones_in_order():
    stones = ["[a()]", "[b(x=1)]", "[c(y='z')]"]
    assert process_accuracy(["[a()]", "[c(y='z')]", "[b(x=1)]"], stones, False) == 2 / 3
    assert process_accuracy([" [a()] ", "[q()]", "[b(x=1)]", "[c(y='z')]"], stones, False) == 1.0
    assert process_accuracy([], stones, False) == 0.0
    assert process_accuracy([], stones, True) == 1.0  # a correct end state counts in full
    alternatives = [["[a()]", "[b(x=1)]"], ["[q()]"]]
    assert process_accuracy(["[q()]"], alternatives, False) == 1.0
    assert format_call("f", {"s": "it's", "n": 3, "l": [{"p": "x"}]}) == (
        "[f(s='it's', n=3, l=[{'p': 'x'}])]"
    )


def test_end_state_is_saved_through_json_as_acebench_saves_it():
    instances = build_instances(["BaseApi", "MessageApi"], {"BaseApi": {"wifi": True}})
    state = end_state(instances, SAVED_ATTRIBUTES)
    assert state[0] == {"BaseApi": {"wifi": True, "logged_in": True}}
    assert list(state[1]["MessageApi"]) == ["inbox"] and "1" in state[1]["MessageApi"]["inbox"]
