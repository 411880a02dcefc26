"""lopd.run.host_memory: the CLIs give freed blocks back to the OS (and back them with huge
pages), unless the user set the allocator themselves. Each case runs in a fresh interpreter:
the settings are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

PROBE = """
import json, sys
from lopd.run.host_memory import configure_host_memory
done = configure_host_memory() if sys.argv[1] == "on" else []
import torch
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
x = torch.ones(1 << 20); del x  # a freed 4 MiB block: glibc's adaptive threshold rises above it
big, small = [], []
for _ in range(100):  # 3 MiB tensors pinned apart by small ones: freed, they leave holes
    big.append(torch.ones(3 << 18)); small.append(torch.ones(16))
before = rss(); del big
print(json.dumps({"done": done, "returned_mib": (before - rss()) / 2**20}))
"""


def probe(mode: str, **env: str) -> dict:
    import json

    base = {k: v for k, v in os.environ.items()}
    for k in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "LOPD_HOST_MEMORY"):
        base.pop(k, None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_freed_blocks_go_back_to_the_os():
    on, off = probe("on"), probe("off")
    assert on["done"] == ["THP_MEM_ALLOC_ENABLE=1", "MALLOC_MMAP_THRESHOLD_=1048576"]
    assert on["returned_mib"] > 250  # the 300 MiB of freed 3 MiB tensors
    assert off["returned_mib"] < 50  # glibc's default keeps them in its heap


def test_the_users_settings_are_left_alone():
    assert probe("on", THP_MEM_ALLOC_ENABLE="0")["done"] == ["MALLOC_MMAP_THRESHOLD_=1048576"]
    assert probe("on", MALLOC_MMAP_THRESHOLD_="33554432")["done"] == ["THP_MEM_ALLOC_ENABLE=1"]
    assert probe("on", LOPD_HOST_MEMORY="default")["done"] == []
