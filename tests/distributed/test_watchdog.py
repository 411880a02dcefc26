"""The phase board of lopd.parallel.watchdog on a real c10d TCPStore, its ranks in one process:
barriers that wait for a live rank and stop for a silent or failed one, and the one-line
messages of failed collectives (the torchrun side:
tests/distributed/test_distributed_failures.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from lopd.parallel.watchdog import (
    DistributedFailure,
    PhaseBoard,
    StoppedBySignal,
    is_collective_error,
)


@pytest.fixture
def boards(request):
    """Two ranks' boards (beating every 0.1 s) on one store, timeout 1.5 s."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    made = [PhaseBoard(store, r, 2, 1.5, beat_s=0.1, prefix=request.node.name) for r in (0, 1)]
    yield made
    for b in made:
        b.close()


def test_a_barrier_waits_for_a_live_rank_past_the_timeout(boards):
    first, second = boards
    second.enter("evaluation", 3)
    late = threading.Timer(2.5, second.barrier)  # longer than the 1.5 s timeout, but beating
    late.start()
    t0 = time.monotonic()
    first.barrier()
    assert time.monotonic() - t0 > 2.0
    late.join()


def test_a_barrier_stops_for_a_silent_rank_naming_it_and_its_phase(boards):
    first, second = boards
    second.enter("evaluation", 3)
    second.close()  # its heartbeat stops, as when the process died or froze
    first.enter("checkpoint", 3)
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure) as err:
        first.barrier()
    assert 1.5 < time.monotonic() - t0 < 5.0
    assert str(err.value).startswith("rank 0: rank 1 sent no sign of life for ")
    assert "waited for it in phase 'checkpoint' at step 3" in str(err.value)
    assert "it was last in phase 'evaluation' at step 3" in str(err.value)


def test_a_barrier_stops_at_once_for_a_rank_that_failed(boards):
    first, second = boards
    second.record_failure("rank 1: ValueError: a bad task file")
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure, match="rank 1, waited for in phase 'setup', failed"):
        first.barrier()
    assert time.monotonic() - t0 < 1.5


def test_a_timed_out_collective_names_the_rank_in_another_phase(boards):
    first, second = boards
    first.enter("loss", 0)
    second.enter("rollout", 0)
    gloo = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1500ms")
    assert is_collective_error(gloo) and not is_collective_error(RuntimeError("shape mismatch"))
    line = str(first.explain(gloo))
    assert line.startswith("rank 0: a collective timed out after 1.5 s in phase 'loss' at step 0")
    assert "rank 1 is in phase 'rollout' at step 0 since" in line
    assert "raise model.collective_timeout_minutes" in line and "--resume" in line
    # The failure is recorded: rank 1, stopped by the launcher, repeats it.
    stopped = str(second.explain(StoppedBySignal("SIGTERM")))
    assert stopped.startswith("rank 1: stopped by SIGTERM")
    assert "rank 0 failed first: a collective timed out" in stopped


def test_ranks_in_the_same_phase_ran_different_collectives(boards):
    first, second = boards
    first.enter("loss", 2)
    second.enter("loss", 2)
    line = str(first.explain(RuntimeError("gloo: Timed out waiting 1500ms for recv")))
    assert "every rank is in phase 'loss' at step 2" in line
    assert "ranks ran different collectives" in line


def test_a_lost_connection_names_the_rank_that_stopped_beating(boards):
    first, second = boards
    second.enter("optimizer", 5)
    second.close()
    line = str(first.explain(RuntimeError("gloo pair.cc: Connection reset by peer")))
    assert "a collective lost its connection to another rank" in line
    assert "rank 1 (last in phase 'optimizer' at step 5) is gone without a word" in line
