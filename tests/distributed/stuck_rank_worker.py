"""``lopd.train`` under ``torchrun`` with one rank stuck in its rollouts (a failure test).

Rank ``STUCK`` sleeps ``SECONDS`` at the start of its step-0 rollouts (``--method grpo``: no
bank to build first), so the other ranks wait for it in the step's first collective; with
``model.collective_timeout_minutes`` below ``SECONDS`` they must stop with one line naming it
and its phase.

Usage: ``torchrun --nproc-per-node 2 tests/distributed/stuck_rank_worker.py STUCK SECONDS
[lopd.train args]``.
"""

from __future__ import annotations

import os
import sys
import time

import lopd.train
from lopd.methods.grpo import GRPOMethod

if __name__ == "__main__":
    stuck, seconds = int(sys.argv[1]), float(sys.argv[2])
    if int(os.environ["RANK"]) == stuck:
        rollouts = GRPOMethod.rollouts

        def late(self, step):
            if step == 0:
                time.sleep(seconds)
            return rollouts(self, step)

        GRPOMethod.rollouts = late
    sys.exit(lopd.train.main(sys.argv[3:]))
