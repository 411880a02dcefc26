"""Vocabulary-parallel versions of the ops: an LM head (or its logits) sharded over the
vocabulary across the ranks of a tensor-parallel group, as Megatron-core shards it.

Each function takes the single-process op's arguments and outputs plus ``group`` (the
tensor-parallel process group; ``None``: the default group) and ``vocab_start`` (this rank's
first global id; ``None``: ``rank * V_local``, Megatron-core's contiguous equal partition). Every
rank passes its shard and the same rows, and gets the full per-row outputs (global ids);
gradients reach this rank's shards. Per row the ranks exchange O(K) candidates and a few
scalars, never the logits. docs/kernels.md lists each op's collectives and bytes per token;
docs/math.md, section 7, why the results are exact.
"""

from lopd_kernels.vocab_parallel.fused_linear_logprob import fused_linear_logprob
from lopd_kernels.vocab_parallel.fused_linear_topk_tail_kl_loss import (
    fused_linear_topk_tail_kl_loss,
)
from lopd_kernels.vocab_parallel.sparse_teacher_topk_tail_kl import sparse_teacher_topk_tail_kl
from lopd_kernels.vocab_parallel.topk_tail_kl import topk_tail_kl

__all__ = [
    "fused_linear_logprob",
    "fused_linear_topk_tail_kl_loss",
    "sparse_teacher_topk_tail_kl",
    "topk_tail_kl",
]
