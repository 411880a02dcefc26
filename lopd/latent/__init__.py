"""The latent privileged context of LOPD (paper 3.1-3.2, A.1-A.5) and the phases that build it.

* :mod:`lopd.latent.injection`: the framing text and the teacher's input with ``J*K`` latent
  placeholders (A.4, A.5).
* :mod:`lopd.latent.composer`: the composer Phi_phi, LoRA encoder + QFormer (A.1).
* :mod:`lopd.latent.teacher`: c_phi of a task, and the frozen teacher's forward with it.
* :mod:`lopd.latent.conditioned`: the frozen base model generating with latents.
* :mod:`lopd.latent.collect`: filling an experience bank from base-model rollouts (A.3).
* :mod:`lopd.latent.experience`: phase 1 of a run, the bank and every task's retrievals.
* :mod:`lopd.latent.cold_start`: phase 2, the composer's cold start (eq. 14, A.2).
"""
