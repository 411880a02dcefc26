"""Every method under ``torchrun`` on real rollouts, with ranks that hold unequal work.

Two launches over gloo on the CPU, all eight methods each (tests/distributed/dist_worker.py: one
launch trains them one after another; the bank and cold start are built once here and copied):

* FSDP2 on 3 ranks with activations recomputed per layer (``model.gradient_checkpointing``), 4
  tasks a step and micro-batches of 1: LOPD-like methods hold 2, 1 and 1
  trajectories (2, 1 and 1 passes), group methods 2, 2 and 0 (the third rank pads with another
  rank's trajectory); rank 1's first micro-batch of step 1 has its action tokens removed;
  Skill-SD keeps a teacher copy synchronized every 2 steps (a sharded EMA copy, as SDPO's and
  SDFT's), LOPD's latent teacher reads a copy synchronized every step
  (``lopd.teacher_backbone=sync``), and every teacher copy goes through a checkpoint and back;
* DDP on 2 ranks, 3 tasks a step: 2 and 1 trajectories, group methods 2 and 0; rank 0's first
  micro-batch of step 0 has no action token.

Before the lockstep plan the FSDP2 launch deadlocked (a rank without a pass, or whose loss did
not reach the sharded outputs, skipped collectives the others ran). Each launch must finish,
keep identical weights on every rank, and equal one process trained on the same rollouts
(:func:`tests.distributed.dist_worker.replay`): the losses are divided by the global trajectory
count, so unequal shares do not reweight trajectories. Skill-SD's bank and UCB statistics must be
the same on every rank and equal the one-process bank.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from lopd.config import load_config
from lopd.methods import METHODS
from lopd.trainer import Trainer
from tests.distributed.dist_worker import STEPS, replay
from tests.distributed.launch import REPO, run, torchrun

GROUPS = [
    "grpo.group_size=2", "sdpo.group_size=2", "skill_sd.group_size=2", "lopd_ppo.group_size=2",
]  # fmt: skip
FSDP2 = [
    "model.parallel=fsdp2", "model.gradient_checkpointing=true", "train.tasks_per_step=4",
    "skill_sd.teacher_sync_every=2", "lopd.teacher_backbone=sync",
]  # fmt: skip
# name -> (ranks, overrides, rank:step whose first micro-batch has no action token)
LAUNCHES = {
    "fsdp2-3": (3, [*FSDP2, *GROUPS], "1:1"),
    "ddp-2": (2, ["train.tasks_per_step=3", *GROUPS], "0:0"),
}
COMMON = [
    "train.micro_batch=1", "gen.max_new_tokens=12", "gen.max_steps=1",
    "model.collective_timeout_minutes=3",
]  # fmt: skip
# Replayed in one process: every method of the FSDP2 launch; of the DDP launch one of each
# kind of split (LOPD 2/1, SDPO's groups 2/0; Skill-SD in its own test).
REPLAYED = {"fsdp2-3": tuple(METHODS), "ddp-2": ("lopd", "sdpo")}
# What each rank holds per step: (LOPD-like methods, group methods).
SHARES = {"fsdp2-3": ([2, 1, 1], [2, 2, 0]), "ddp-2": ([2, 1], [2, 0])}
# The methods that keep an EMA teacher copy (Skill-SD: with teacher_sync_every > 1).
EMA_TEACHERS = {
    "fsdp2-3": ("sdpo", "sdft", "skill-sd", "lopd", "lopd-ppo", "lopd-frozen", "lopd-m0"),
    "ddp-2": ("sdpo", "sdft"),
}
SECONDS: dict[str, float] = {}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The smoke bank and cold start (phi_0, c_phi0), built once in this process."""
    root = tmp_path_factory.mktemp("dist-shared")
    t0 = time.perf_counter()
    tr = Trainer(load_config("smoke", overrides=[f"run_dir={root}"]), progress=False)
    tr.setup()
    SECONDS["shared"] = time.perf_counter() - t0
    return root


@pytest.fixture(scope="module", params=sorted(LAUNCHES))
def launch(request, shared, tmp_path_factory):
    """``(name, output folder, overrides)`` of one torchrun launch of all methods."""
    name = request.param
    ranks, overrides, zero = LAUNCHES[name]
    out = tmp_path_factory.mktemp(name)
    overrides = [*overrides, *COMMON]
    t0 = time.perf_counter()
    worker = str(REPO / "tests" / "distributed" / "dist_worker.py")
    run(
        torchrun(ranks, worker, str(shared), str(out), "--methods", ",".join(METHODS),
                 "--zero-actions", zero, *overrides),
        timeout=900,
    )  # fmt: skip
    SECONDS[name] = time.perf_counter() - t0
    return name, out, overrides


def _result(out, method):
    return torch.load(out / f"{method}.pt", weights_only=False)


def test_every_method_trains_on_unequal_ranks_in_lockstep(launch):
    name, out, _ = launch
    ranks = LAUNCHES[name][0]
    for method, spec in METHODS.items():
        res = _result(out, method)
        assert res["world"] == ranks
        assert len(res["metrics"]) == STEPS
        want = SHARES[name][spec.group_size(load_config("smoke", overrides=GROUPS)) > 1]
        assert [[len(share) for share in step] for step in res["rollouts"]] == [want] * STEPS
        assert res["ranks_identical"], method
        for m in res["metrics"]:
            assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm_student"]), method
        rank, step = map(int, LAUNCHES[name][2].split(":"))
        emptied = res["rollouts"][step][rank][0]
        assert not any(emptied.action_mask), method  # the forced micro-batch without actions
        # SDPO, SDFT (and Skill-SD with teacher_sync_every > 1) keep an EMA teacher: sharded
        # under FSDP2, whole in the checkpoint, the same after a resume.
        ema = method in EMA_TEACHERS[name]
        assert res["resumed_teacher_identical"] is (True if ema else None), method


def _compare(one: dict, dist: dict, what: str) -> None:
    keys = [k for k in one if not k.startswith("seconds_") and k != "rollouts"]
    assert set(keys) <= set(dist), what
    scale = abs(one["loss"]) + abs(one.get("privilege", 0.0)) + 1e-6
    # A KL between two nearly equal distributions (a teacher synced to its student) is a sum of
    # differences of log-probabilities of size ~1: float32 rounding (epsilon 1.2e-7) leaves it an
    # absolute error of that order whatever its own size (seen: 2.2e-8 on a KL of 1.7e-4), so no
    # key is held tighter than 2e-7.
    floor = 2e-7
    for k in keys:
        # Equal up to the summation order of float32 reductions: the one process sums every
        # trajectory's gradient, the ranks their shares and then all-reduce them.
        tol = max(1e-5 * scale, floor)
        assert dist[k] == pytest.approx(one[k], rel=1e-4, abs=tol), (what, k)


REPLAYS: dict[tuple[str, str], tuple] = {}


def _replayed(launch, shared, method: str) -> tuple:
    """:func:`tests.distributed.dist_worker.replay` of ``method``'s rollouts in this launch, made
    once."""
    name, out, overrides = launch
    if (name, method) not in REPLAYS:
        REPLAYS[name, method] = replay(shared, out, method, overrides)
    return REPLAYS[name, method]


def test_ranks_equal_one_process_on_the_same_rollouts(launch, shared):
    name, out, _ = launch
    for method in REPLAYED[name]:
        one, _ = _replayed(launch, shared, method)
        for step, (a, b) in enumerate(zip(one, _result(out, method)["metrics"], strict=True)):
            _compare(a, b, f"{name} {method} step {step}")


def test_skill_sd_ranks_hold_the_one_process_bank(launch, shared):
    name, out, _ = launch
    res = _result(out, "skill-sd")
    banks = [s["skill_bank"] for s in res["method_states"]]
    assert all(b == banks[0] for b in banks), "ranks hold different skill banks"
    _, method = _replayed(launch, shared, "skill-sd")
    assert method.bank.state_dict() == banks[0]
    # One skill from every group of every step, whichever rank rolled it out.
    groups = sum(SHARES[name][1]) // 2
    assert len(banks[0]["skills"]) == groups * STEPS


def test_distributed_method_tests_stay_cheap(launch):
    name = launch[0]
    # One launch trains eight methods for two steps each on 2 or 3 processes (CPU, gloo).
    assert SECONDS[name] < 300, SECONDS
