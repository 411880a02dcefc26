"""lopd_kernels: fused distillation kernels for on-policy (self-)distillation.

Public API (see README): ``topk_tail_kl``, ``TopKTailKL``, ``fused_linear_topk_tail_kl``,
``varlen_cross_attention``, ``QFormerCompressor``. Each op has a PyTorch reference, a C++ CPU
kernel, a Triton kernel and a CUDA kernel behind ``backend=``; ops are ``torch.ops.lopd.*``.
"""

from lopd_kernels._backend import BACKENDS, extension_loaded
from lopd_kernels.fused_linear_topk_tail_kl import (
    causal_lm_topk_tail_kl,
    fused_linear_topk_tail_kl,
    fused_linear_topk_tail_kl_reference,
    lm_head_topk_tail_kl,
)
from lopd_kernels.qformer import QFormerCompressor
from lopd_kernels.topk_tail_kl import (
    TopKTailKL,
    TopKTailKLOutput,
    topk_tail_kl,
    topk_tail_kl_reference,
)
from lopd_kernels.varlen_cross_attention import varlen_cross_attention

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "QFormerCompressor",
    "TopKTailKL",
    "TopKTailKLOutput",
    "__version__",
    "causal_lm_topk_tail_kl",
    "extension_loaded",
    "fused_linear_topk_tail_kl",
    "fused_linear_topk_tail_kl_reference",
    "lm_head_topk_tail_kl",
    "topk_tail_kl",
    "topk_tail_kl_reference",
    "varlen_cross_attention",
]
