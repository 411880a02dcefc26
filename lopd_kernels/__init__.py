"""lopd_kernels: fused distillation kernels for on-policy (self-)distillation.

Public API (see README and ``docs/kernels.md``): the loss ops ``topk_tail_kl``,
``fused_linear_topk_tail_kl`` (and ``fused_linear_topk_tail_kl_loss``, its weighted
scalar with the gradients formed in the forward), ``sparse_teacher_topk_tail_kl`` (a teacher
given by its top-M ids and log-probs only), each with its ``nn.Module`` (``TopKTailKL``,
``FusedLinearTopKTailKL``, ``SparseTeacherTopKTailKL``); ``fused_linear_logprob`` (token
log-probs and entropies from hidden states and an LM head) and its loss module
``FusedLinearCrossEntropy``;
``varlen_cross_attention`` and its module ``QFormerCompressor``;
the Hugging Face helpers of :mod:`lopd_kernels.hf`; :mod:`lopd_kernels.vocab_parallel`: the
top-M + tail ops and the log-prob op over an LM head sharded over the vocabulary (tensor
parallelism, Megatron-core's layout). Each op has a PyTorch reference and C++ CPU,
Triton and CUDA kernels behind ``backend=`` (the words of :data:`BACKENDS`, chosen by
:mod:`lopd_kernels._backend`); kernels are the custom ops ``torch.ops.lopd.<op>_<impl>_fwd/_bwd``
(:mod:`lopd_kernels._custom_ops`). ``python -m lopd_kernels.info`` prints what this install was
built with and what ``"auto"`` picks.
"""

from lopd_kernels import vocab_parallel
from lopd_kernels._backend import BACKENDS, BackendUnavailableError, extension_loaded
from lopd_kernels._constants import DIVERGENCES, KL_DIVERGENCES, SUPPORTS
from lopd_kernels.fused_linear_logprob import (
    FusedLinearCrossEntropy,
    FusedLinearLogprobOutput,
    fused_linear_logprob,
    fused_linear_logprob_reference,
)
from lopd_kernels.fused_linear_topk_tail_kl import (
    fused_linear_topk_tail_kl,
    fused_linear_topk_tail_kl_reference,
)
from lopd_kernels.fused_linear_topk_tail_kl_loss import (
    FusedLinearTopKTailKL,
    FusedLinearTopKTailKLLoss,
    fused_linear_topk_tail_kl_loss,
)
from lopd_kernels.hf import causal_lm_topk_tail_kl, decoder_of, lm_head_topk_tail_kl
from lopd_kernels.qformer import QFormerCompressor
from lopd_kernels.sparse_teacher_topk_tail_kl import (
    SparseTeacherTopKTailKL,
    SparseTeacherTopKTailKLOutput,
    sparse_teacher_topk_tail_kl,
    sparse_teacher_topk_tail_kl_reference,
)
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
    "DIVERGENCES",
    "KL_DIVERGENCES",
    "SUPPORTS",
    "BackendUnavailableError",
    "FusedLinearCrossEntropy",
    "FusedLinearLogprobOutput",
    "FusedLinearTopKTailKL",
    "FusedLinearTopKTailKLLoss",
    "QFormerCompressor",
    "SparseTeacherTopKTailKL",
    "SparseTeacherTopKTailKLOutput",
    "TopKTailKL",
    "TopKTailKLOutput",
    "__version__",
    "causal_lm_topk_tail_kl",
    "decoder_of",
    "extension_loaded",
    "fused_linear_logprob",
    "fused_linear_logprob_reference",
    "fused_linear_topk_tail_kl",
    "fused_linear_topk_tail_kl_loss",
    "fused_linear_topk_tail_kl_reference",
    "lm_head_topk_tail_kl",
    "sparse_teacher_topk_tail_kl",
    "sparse_teacher_topk_tail_kl_reference",
    "topk_tail_kl",
    "topk_tail_kl_reference",
    "varlen_cross_attention",
    "vocab_parallel",
]
