"""Drop-in integrations of the ``lopd_kernels`` losses into other on-policy distillation codebases.

Each submodule imports its framework lazily-by-module (importing :mod:`lopd.integrations.trl`
needs TRL, :mod:`lopd.integrations.verl` needs verl only to register), so ``import lopd`` never
requires either:

- :mod:`lopd.integrations.trl`: ``LopdDistillationTrainer`` / ``LopdGKDTrainer``, TRL trainers
  whose divergence is the top-M + tail KL (``lopd_kernels.fused_linear_topk_tail_kl`` /
  ``lopd_kernels.topk_tail_kl``).
- :mod:`lopd.integrations.verl`: a ``verl.plugins`` entry point registering the top-M + tail
  loss as the verl distillation loss ``"lopd_topk_tail"``.
"""
