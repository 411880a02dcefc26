"""The Megatron-core block of docs/integrations.md in 2 processes, as ``torchrun`` would start it
(tests/scripts/test_readme_snippets.py): each rank executes the block as written, then checks it
against the single-process ops on the whole heads (the block's seed rebuilds them): the same loss
and log-probs, its slice of the head's gradient, the whole hidden states' gradient.

Usage: ``python tests/scripts/megatron_snippet_worker.py PORT OUT_DIR``; each rank writes
``OUT_DIR/rank<r>.json`` (``{"verdict": "ok" | "FAIL: ..."}``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
WORLD = 2


def check(ns: dict) -> None:
    import torch

    import lopd_kernels as lk

    vocab, hidden, tokens = ns["vocab"], ns["hidden"], ns["tokens"]
    torch.manual_seed(0)  # the block's draws, in its order
    w_s = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
    w_t = torch.randn(vocab, hidden) / hidden**0.5 * 2
    h_s = torch.randn(tokens, hidden, requires_grad=True)
    h_t = torch.randn(tokens, hidden)
    target = torch.randint(0, vocab, (tokens,))
    assert torch.equal(target, ns["target_ids"]) and torch.equal(h_s, ns["student_hidden"])
    ref = lk.fused_linear_topk_tail_kl_loss(h_s, w_s, h_t, w_t, target, top_m=20)
    ref.loss.backward()
    lo, hi = ns["start"], ns["end"]
    # Float32 sums over the rows (head) and the vocabulary (hidden states), chunked differently.
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(ns["res"].loss, ref.loss, **tol)
    torch.testing.assert_close(ns["student_head"].grad, w_s.grad[lo:hi], **tol)
    torch.testing.assert_close(ns["student_hidden"].grad, h_s.grad, **tol)
    want = lk.fused_linear_logprob(h_s.detach(), w_s.detach(), target).logprob
    torch.testing.assert_close(ns["logprob"], want, **tol)


def _run_rank(rank: int, port: int, out_dir: str, code: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    try:
        ns: dict = {"__name__": "snippet_megatron"}
        exec(compile(code, "snippet:megatron", "exec"), ns)
        check(ns)
        verdict = "ok"
    except Exception as err:  # reported to the test, not raised
        verdict = f"FAIL: {err}\n{traceback.format_exc(limit=8)}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"verdict": verdict}))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    # Imported once and forked into both ranks (on 2 loaded cores each rank importing
    # Megatron-core itself took most of the test's time).
    import megatron.core.parallel_state  # noqa: F401
    import torch.multiprocessing as mp

    import lopd_kernels.vocab_parallel  # noqa: F401
    from tests.scripts.doc_snippets import snippets

    port, out_dir = int(sys.argv[1]), sys.argv[2]
    code = snippets()["megatron"]
    mp.start_processes(_run_rank, args=(port, out_dir, code), nprocs=WORLD, start_method="fork")


if __name__ == "__main__":
    main()
