"""Tool-use worlds: parsing, dynamics, final-state rewards, oracle demos, splits, JSONL."""

from __future__ import annotations

import copy
import itertools
import json

import pytest

from lopd.envs import (
    TASK_COMPLETED,
    ToolCall,
    ToolCallParseError,
    ToolUseEnv,
    builtin_tasks,
    evaluate_checks,
    format_tool_call,
    get_world,
    load_tasks_jsonl,
    make_env,
    oracle_actions,
    parse_tool_calls,
    run_actions,
    save_tasks_jsonl,
    world_names,
)
from lopd.envs.loaders import TaskFormatError
from lopd.envs.tool_use import (
    NO_TOOL_CALL_MESSAGE,
    Param,
    TemplateNotApplicable,
    ToolError,
    ToolSpec,
    initial_db,
    score_checks,
)
from lopd.envs.tool_use_tasks import SPLITS, make_task
from lopd.types import Task

WORLDS = ["insurance", "logistics", "shop"]


def call(tool_name: str, /, **args) -> str:
    return format_tool_call(ToolCall(tool_name, args))


def first(world: str, template: str, split: str = "train") -> Task:
    return next(
        t
        for t in builtin_tasks("tool_use", split)
        if t.world == world and t.spec["template"] == template
    )


# --------------------------------------------------------------------------- parsing


def test_parse_qwen3_format_think_and_unclosed_tail():
    text = (
        '<think>maybe <tool_call>{"name": "x"}</tool_call></think>\n<tool_call>\n'
        '{"name": "find_customer", "arguments": {"name": "Lena Park"}}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("find_customer", {"name": "Lena Park"})]
    # Generation stopped before the closing tag.
    assert parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n') == [
        ToolCall("a", {"k": 1})
    ]
    # Arguments serialized as a JSON string, or absent.
    assert parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>'
    ) == [ToolCall("a", {"k": 2})]
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>') == [ToolCall("a", {})]
    assert parse_tool_calls("no call here") == []
    two = call("a", x=1) + "\n" + call("b", y="z")
    assert [c.name for c in parse_tool_calls(two)] == ["a", "b"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
        ('["a", {}]', "JSON object"),
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": 5, "arguments": {}}', "no 'name'"),
        ('{"name": "a", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "a", "arguments": "not json"}', "not a JSON object"),
    ],
)
def test_parse_malformed_raises(body, fragment):
    with pytest.raises(ToolCallParseError, match=fragment):
        parse_tool_calls(f"<tool_call>{body}</tool_call>")


def test_render_and_key():
    c = ToolCall("find_policy", {"number": "PN-1234", "n": 3})
    assert c.render() == 'find_policy(number="PN-1234", n=3)'
    assert c.key() == ToolCall("find_policy", {"n": 3, "number": "PN-1234"}).key()
    assert parse_tool_calls(format_tool_call(c)) == [c]


# --------------------------------------------------------------------------- oracle + splits


@pytest.mark.parametrize("world", WORLDS)
def test_oracle_reaches_full_reward_on_every_task(world):
    for split in SPLITS:
        tasks = [t for t in builtin_tasks("tool_use", split) if t.world == world]
        for t in tasks:
            env = make_env(t)
            assert run_actions(env, t, oracle_actions(t)) == 1.0, t.task_id
            assert env.done and env.num_tool_calls == len(t.spec["oracle"])
            assert env.repeated_tool_calls == 0
            assert all(not s.result.startswith("Error") for s in env.trace), t.task_id


def test_no_credit_without_doing_the_task():
    """Every non-gate check fails on the initial database, the guard is a gate, and doing
    nothing (or only looking things up) scores 0."""
    for t in builtin_tasks("tool_use", "train")[::7] + builtin_tasks("tool_use", "test"):
        db = initial_db(t)
        results = evaluate_checks(t.spec["checks"], db, db)
        gates = [c for c in t.spec["checks"] if c.get("gate")]
        assert [c["op"] for c in gates] == ["unchanged"], t.task_id
        for c, ok in zip(t.spec["checks"], results):
            assert c.get("gate") or not ok, (t.task_id, c)
        queries = {s.name for s in get_world(t.world).tools_spec if s.kind == "query"}
        lookups = [a for a, c in zip(oracle_actions(t), t.spec["oracle"]) if c["name"] in queries]
        assert run_actions(make_env(t), t, [*lookups, TASK_COMPLETED]) == 0.0


def test_score_checks_gates_and_fractions():
    eq = {"op": "equals"}
    gate = {"op": "unchanged", "gate": True}
    assert score_checks([eq, eq, gate], [True, False, True]) == 0.5
    assert score_checks([eq, eq, gate], [True, True, False]) == 0.0
    assert score_checks([eq, eq], [True, False]) == 0.5  # no gate: the plain fraction
    assert score_checks([gate], [True]) == 1.0 and score_checks([], []) == 0.0
    with pytest.raises(ValueError, match="results"):
        score_checks([eq], [])


def test_splits_sizes_disjoint_deterministic():
    train = builtin_tasks("tool_use", "train")
    val = builtin_tasks("tool_use", "val")
    test = builtin_tasks("tool_use", "test")
    assert len(train) >= 500 and len(val) >= 100 and len(test) >= 100
    assert {t.world for t in train} == set(WORLDS) == set(world_names()) & set(WORLDS)
    for split, tasks in (("train", train), ("val", val), ("test", test)):
        assert {t.split for t in tasks} == {split}
        # Database seeds of a split lie in its own residue class mod 3, for every task-set seed.
        assert {t.spec["seed"] % 3 for t in tasks} == {SPLITS.index(split)}
    everything = train + val + test
    # No shared ids, entity combinations (instructions) or database seeds.
    assert len({t.task_id for t in everything}) == len(everything)
    assert len({t.instruction for t in everything}) == len(everything)
    assert not {t.spec["seed"] for t in train} & {t.spec["seed"] for t in val + test}
    assert not {t.spec["seed"] for t in val} & {t.spec["seed"] for t in test}
    # Deterministic: regenerating from the spec gives the same task; other seeds differ.
    for t in train[:30] + val[:15] + test[:30]:
        again = make_task(t.world, t.spec["template"], t.spec["seed"], t.task_id, t.split)
        assert again == t
    assert builtin_tasks("tool_use", "train", n=7) == train[:7]
    assert [t.world for t in train[:3]] == sorted(WORLDS)
    # Another task-set seed is another task set, with the same split guarantees.
    other = builtin_tasks("tool_use", "train", seed=1)
    other_test = builtin_tasks("tool_use", "test", seed=1)
    assert {t.instruction for t in other[:50]} != {t.instruction for t in train[:50]}
    assert not {t.spec["seed"] for t in train} & {t.spec["seed"] for t in other_test}
    # Every template of a world in every split; 3- and 4-call procedures.
    for tasks in (train, val, test):
        for w in WORLDS:
            have = {t.spec["template"] for t in tasks if t.world == w}
            assert have == set(get_world(w).templates)
    assert {len(t.spec["oracle"]) for t in train} == {3, 4}


def test_builtin_tasks_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        builtin_tasks("tool_use", "valid")
    with pytest.raises(ValueError, match="split"):
        builtin_tasks("coding", "val")
    with pytest.raises(ValueError, match="domain"):
        builtin_tasks("math")
    with pytest.raises(ValueError, match="n must be"):
        builtin_tasks(n=-1)


def test_tools_schemas_match_implementations():
    for name in WORLDS:
        cls = get_world(name)
        env = ToolUseEnv()
        env.reset(first(name, cls.templates[0]))
        schemas = env.tools()
        assert len(schemas) == len(cls.tools_spec) >= 6
        for s in schemas:
            fn = s["function"]
            assert s["type"] == "function" and callable(getattr(cls, f"tool_{fn['name']}"))
            assert fn["parameters"]["required"] == list(fn["parameters"]["properties"])
        assert {t.kind for t in cls.tools_spec} == {"query", "modify"}
        for template in cls.templates:
            assert callable(getattr(cls, f"gen_{template}"))


# --------------------------------------------------------------------------- conventions


@pytest.mark.parametrize("world", WORLDS)
def test_conventions_decide_the_procedure(world):
    """Every combination of a world's conventions has a sound oracle; the default oracle played
    under other conventions scores 0 whenever the two procedures differ; each world has more
    than one procedure shape (a precondition step before the change, a follow-up after it)."""
    cls = get_world(world)
    assert len(cls.conventions) >= 2
    assert all(len(alts) >= 2 for alts in cls.conventions.values())
    tasks = [t for t in builtin_tasks("tool_use", "train") if t.world == world][:20]
    differ = 0
    for t in tasks:
        for combo in itertools.product(*cls.conventions.values()):
            conv = dict(zip(cls.conventions, combo))
            u = make_task(t.world, t.spec["template"], t.spec["seed"], t.task_id, t.split, conv)
            assert u.instruction == t.instruction and u.spec["conventions"] == conv
            assert run_actions(make_env(u), u, oracle_actions(u)) == 1.0, (t.task_id, conv)
            if u.spec["oracle"] != t.spec["oracle"]:
                differ += 1
                assert run_actions(make_env(u), u, oracle_actions(t)) == 0.0, (t.task_id, conv)
    assert differ >= len(tasks)
    shapes = {tuple(c["name"] for c in t.spec["oracle"]) for t in tasks}
    assert len(shapes) == len(cls.templates)


def test_precondition_refuses_and_follow_up_is_checked():
    t = first("shop", "change_address")  # default: verify the customer before an order change
    env = make_env(t)
    env.reset(t)
    calls = t.spec["oracle"]
    assert [c["name"] for c in calls] == ["find_order", "verify_customer", "update_address"]
    env.step(oracle_actions(t)[0])
    obs, _ = env.step(call("update_address", **calls[2]["arguments"]))
    assert obs == f"Error: customer {calls[1]['arguments']['customer_id']} is not verified"
    assert env.world.db == initial_db(t)
    # A follow-up convention: the email change is done but the notice is missing.
    e = first("shop", "change_email")
    acts = oracle_actions(e)
    assert [c["name"] for c in e.spec["oracle"]][-1] == "notify_customer"
    assert run_actions(make_env(e), e, [*acts[:2], TASK_COMPLETED]) == 0.5
    with pytest.raises(ValueError, match="no convention slot 'tea_rule'"):
        make_task("shop", "change_email", 3, "x", "train", {"tea_rule": "always"})
    with pytest.raises(ValueError, match="no alternative 'maybe'"):
        make_task("shop", "change_email", 3, "x", "train", {"order_rule": "maybe"})


# --------------------------------------------------------------------------- dynamics


def test_shop_episode_dynamics_and_stats():
    t = first("shop", "change_address")
    env = make_env(t)
    assert env.reset(t) == t.instruction
    number = t.spec["params"]["number"]
    obs, done = env.step(call("find_order", number=number))
    found = json.loads(obs)
    oid, cid = found["order_id"], found["customer_id"]
    assert not done and oid.startswith("O-") and cid.startswith("C-")
    obs, _ = env.step(call("find_order", number=number))  # a repeat
    assert env.repeated_tool_calls == 1
    assert env.reward() == 0.0  # nothing changed yet
    obs, _ = env.step(call("verify_customer", customer_id=cid))
    assert json.loads(obs) == {"customer_id": cid, "verified": True}
    obs, _ = env.step(call("update_address", order_id=oid, address=t.spec["params"]["address"]))
    assert json.loads(obs)["address"] == t.spec["params"]["address"]
    obs, done = env.step("I think we are done. Task Completed.")
    assert (obs, done) == ("", True)
    assert env.reward() == 1.0
    assert env.stats() == {"num_steps": 5, "num_tool_calls": 4, "repeated_tool_calls": 1}
    assert env.trace[0].action == f'find_order(number="{number}")'
    assert env.trace[0].result == json.dumps(found)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(call("find_order", number=number))


@pytest.mark.parametrize(
    "text, expected",
    [
        (call("no_such_tool", x=1), "Error: unknown tool 'no_such_tool'"),
        (call("call", tool="x"), "Error: unknown tool 'call'"),  # World.call is not a tool
        (call("__init__", db={}), "Error: unknown tool '__init__'"),
        (call("find_customer"), "Error: missing argument 'name' for find_customer"),
        (call("find_customer", name="A B", admin=True), "Error: unexpected argument 'admin'"),
        (call("find_customer", name=7), "Error: argument 'name' must be a string"),
        (call("find_customer", name={"$ne": ""}), "Error: argument 'name' must be a string"),
        (call("find_customer", name="' OR 1=1 --"), "Error: no customer named"),
        (call("verify_customer", customer_id="C-999"), "Error: no customer with id 'C-999'"),
        (call("update_email", customer_id="C-1", email="nope"), "Error: invalid email"),
        (
            '<tool_call>{"name": "find_customer", "arguments": {"name": "x"</tool_call>',
            "Error: tool call is not valid JSON",
        ),
        ("Let me look that up.", NO_TOOL_CALL_MESSAGE),
        (
            call("find_order", number="1") + call("find_order", number="2"),
            "Error: 2 tool calls in one step",
        ),
    ],
)
def test_bad_calls_give_error_observations_and_episode_goes_on(text, expected):
    t = first("shop", "cancel_order")
    env = make_env(t)
    env.reset(t)
    obs, done = env.step(text)
    assert obs.startswith(expected) and not done
    assert env.reward() == 0.0  # no bad call touched the database
    # The episode continues and can still be solved.
    for a in oracle_actions(t):
        env.step(a)
    assert env.done and env.reward() == 1.0


def test_parallel_calls_execute_nothing_and_count_each():
    t = first("shop", "cancel_order")
    env = make_env(t)
    env.reset(t)
    acts = oracle_actions(t)
    env.step(acts[0])
    env.step(acts[1])
    before = copy.deepcopy(env.world.db)
    obs, _ = env.step(acts[2] + acts[2])
    assert "none was executed" in obs and env.world.db == before
    assert env.num_tool_calls == 4


def test_type_checks_bool_is_not_a_number_and_enum():
    spec = ToolSpec("f", "x", {"n": Param("integer", "n"), "p": Param("string", "p", ("a", "b"))})
    for args, message in [
        ({"n": True, "p": "a"}, "argument 'n' must be an integer"),
        ({"n": 1.5, "p": "a"}, "argument 'n' must be an integer"),
        ({"n": 1, "p": "c"}, "argument 'p' must be one of: a, b"),
    ]:
        with pytest.raises(ToolError, match=message):
            spec.validate(args)
    spec.validate({"n": 3, "p": "b"})
    t = first("insurance", "file_claim")
    env = make_env(t)
    env.reset(t)
    obs, _ = env.step(call("file_claim", policy_id="PL-1", amount=450))
    assert obs == "Error: argument 'amount' must be a string"
    obs, _ = env.step(call("file_claim", policy_id="PL-1", amount="450"))
    assert obs == "Error: amount must be written like '$500', got '450'"
    obs, _ = env.step(call("file_claim", policy_id="PL-1", amount="$0"))
    assert obs.startswith("Error: amount must be between")
    lt = first("logistics", "expedite")
    env = make_env(lt)
    env.reset(lt)
    obs, _ = env.step(call("set_priority", shipment_id="S-1", priority="overnight"))
    assert obs == "Error: argument 'priority' must be one of: standard, express"


def test_tool_call_wins_over_task_completed_text():
    t = first("logistics", "expedite")
    env = make_env(t)
    env.reset(t)
    obs, done = env.step(TASK_COMPLETED + "\n" + oracle_actions(t)[0])
    assert not done and obs.startswith('{"shipment_id"')


def test_max_steps_ends_episode_and_reset_is_required():
    env = ToolUseEnv(max_steps=3)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x")
    t = first("insurance", "set_limit")
    env.reset(t)
    assert env.step("hello") == (NO_TOOL_CALL_MESSAGE, False)
    assert env.step("hello")[1] is False
    assert env.step("hello")[1] is True and env.num_steps == 3
    with pytest.raises(ValueError, match="max_steps"):
        ToolUseEnv(max_steps=0)
    with pytest.raises(ValueError, match="not 'tool_use'"):
        env.reset(builtin_tasks("coding", "train", n=1)[0])
    with pytest.raises(TypeError, match=r"lopd\.types\.Task"):
        env.reset({"task_id": "x"})


def test_early_completion_scores_zero_not_a_string_match():
    for world in WORLDS:
        t = builtin_tasks("tool_use", "test")[WORLDS.index(world)]
        env = make_env(t)
        env.reset(t)
        assert env.step(TASK_COMPLETED) == ("", True)
        assert env.reward() == 0.0


def test_partial_progress_earns_partial_reward():
    # cancel_order: verify + cancel + refund checks and the gate; skip the refund.
    t = first("shop", "cancel_order")
    acts = oracle_actions(t)
    env = make_env(t)
    env.reset(t)
    for a in acts[:3]:
        env.step(a)
    assert env.check_results() == [True, True, False, True]
    assert env.reward() == pytest.approx(2 / 3)


def test_collateral_damage_fails_the_gate():
    t = first("shop", "cancel_order")
    env = make_env(t)
    env.reset(t)
    for a in oracle_actions(t)[:-1]:
        env.step(a)
    # Also notify the customer (a step this convention does not ask for): the goal checks hold,
    # the "others unchanged" gate fails, and the episode scores 0.
    cid = t.spec["oracle"][1]["arguments"]["customer_id"]
    env.step(call("notify_customer", customer_id=cid))
    assert env.check_results() == [True, True, True, False]
    assert env.reward() == 0.0


def test_insurance_claims_checks():
    # Filing the claim twice: the count_new check and the gate fail.
    c = first("insurance", "file_claim")
    env = make_env(c)
    acts = oracle_actions(c)
    env.reset(c)
    for a in [*acts[:3], acts[2], *acts[3:]]:
        env.step(a)
    assert env.check_results() == [False, True, False]
    assert env.reward() == 0.0
    # Removing a coverage leaves the key absent; the review precondition is enforced.
    r = first("insurance", "remove_coverage")
    env = make_env(r)
    env.reset(r)
    env.step(oracle_actions(r)[0])
    obs, _ = env.step(oracle_actions(r)[2])
    assert obs.endswith("has no open review")
    assert run_actions(make_env(r), r, oracle_actions(r)) == 1.0


def test_logistics_busy_driver_and_delivered_shipment_errors():
    t = first("logistics", "assign_driver")
    env = make_env(t)
    env.reset(t)
    db = env.world.db
    busy = next((d for d, r in db["drivers"].items() if r["shipment_id"]), None)
    delivered = next((s for s, r in db["shipments"].items() if r["status"] == "delivered"), None)
    sid = t.spec["oracle"][-1]["arguments"]["shipment_id"]
    if busy is not None:
        obs, _ = env.step(call("assign_driver", shipment_id=sid, driver_id=busy))
        assert obs.startswith(f"Error: driver {busy} is busy")
    if delivered is not None:
        obs, _ = env.step(call("set_priority", shipment_id=delivered, priority="express"))
        assert obs == f"Error: shipment {delivered} is already delivered"
    assert busy is not None or delivered is not None
    assert env.reward() == 0.0


def test_modifying_a_shipped_order_is_refused():
    t = first("shop", "add_item")
    env = make_env(t)
    env.reset(t)
    shipped = [k for k, o in env.world.db["orders"].items() if o["status"] != "pending"]
    for oid in shipped[:3]:
        obs, _ = env.step(call("cancel_order", order_id=oid))
        assert obs.startswith(f"Error: order {oid} is")
    assert shipped and env.reward() == 0.0


# --------------------------------------------------------------------------- checks + JSONL


def test_evaluate_checks_language():
    db = {"t": {"a": {"x": 1, "m": {"k": 2}}}}
    init = copy.deepcopy(db)
    db["t"]["b"] = {"x": 5}
    checks = [
        {"op": "equals", "table": "t", "id": "a", "path": "m.k", "value": 2},
        {"op": "absent", "table": "t", "id": "a", "path": "m.z"},
        {"op": "count_new", "table": "t", "where": {"x": 5}, "count": 1},
        {"op": "unchanged", "allow": {}, "new": {"t": 1}},
        {"op": "unchanged", "allow": {}},
        {"op": "equals", "table": "t", "id": "zz", "path": "x", "value": 1},
    ]
    assert evaluate_checks(checks, db, init) == [True, True, True, True, False, False]
    with pytest.raises(ValueError, match="unknown check op"):
        evaluate_checks([{"op": "regex"}], db, init)


def test_jsonl_roundtrip_explicit_db_and_splits(tmp_path):
    tasks = builtin_tasks("tool_use", "test", n=12)
    path = tmp_path / "tasks.jsonl"
    save_tasks_jsonl(tasks, path)
    assert load_tasks_jsonl(path) == tasks
    # An EnvScaler-style task: explicit initial database instead of a seed, own conventions.
    t = copy.deepcopy(tasks[0])
    t.spec["db"] = get_world(t.world).build_db(t.spec.pop("seed"))
    t.task_id = "explicit-db"
    save_tasks_jsonl([t], path)
    (loaded,) = load_tasks_jsonl(path)
    assert run_actions(make_env(loaded), loaded, oracle_actions(loaded)) == 1.0
    bad = dict(t.to_dict(), spec={"checks": [], "seed": 1})
    path.write_text(json.dumps(t.to_dict()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(
        TaskFormatError, match=r"tasks.jsonl:2: tool-use spec needs a non-empty 'checks'"
    ):
        load_tasks_jsonl(path)
    # A task file with train / val / test splits; any other split name is refused.
    mixed = builtin_tasks("tool_use", "train", n=3) + builtin_tasks("tool_use", "val", n=3)
    save_tasks_jsonl(mixed + tasks[:3], path)
    assert [t.split for t in load_tasks_jsonl(path)] == ["train"] * 3 + ["val"] * 3 + ["test"] * 3
    odd = dict(tasks[0].to_dict(), split="holdout")
    path.write_text(json.dumps(odd) + "\n")
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:1: split must be one of"):
        load_tasks_jsonl(path)
    conv = dict(tasks[0].to_dict(), spec={**tasks[0].spec, "conventions": {"x": "y"}})
    path.write_text(json.dumps(conv) + "\n")
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:1: .*convention slot 'x'"):
        load_tasks_jsonl(path)


def test_unknown_world_and_inapplicable_template():
    t = copy.deepcopy(builtin_tasks(n=1)[0])
    t.world = "casino"
    with pytest.raises(KeyError, match="unknown world 'casino'"):
        make_env(t).reset(t)
    with pytest.raises(ValueError, match="no template"):
        make_task("shop", "launch_rocket", 1, "x", "train")
    assert issubclass(TemplateNotApplicable, Exception)
