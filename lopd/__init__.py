"""lopd: Latent On-Policy Self-Distillation (LOPD) of LLM agents.

The trainer layer: task worlds with verifiers, student rollouts, an experience bank with a FAISS
retriever, the latent composer, latent injection into a frozen teacher, the LOPD loss with the
privileged-margin dual update, evaluation and baselines. Kernels live in ``lopd_kernels``.
"""

__version__ = "0.1.0"
