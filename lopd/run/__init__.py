"""A run's plumbing: what every phase is given and what a run writes.

* :mod:`lopd.run.context`: the run's models and the context every phase takes.
* :mod:`lopd.run.run_dir`: the run directory, every file named once.
* :mod:`lopd.run.claim`: one run per directory (lock, fresh / resume / overwrite, identity).
* :mod:`lopd.run.checkpoint`: checkpoints a killed run resumes from.
* :mod:`lopd.run.metrics`: ``metrics.jsonl``, TensorBoard, the reward plot.
* :mod:`lopd.run.optim`: the optimizers of theta and phi.
* :mod:`lopd.run.tasks`: the run's tasks and the seeded task sampler.
* :mod:`lopd.run.seeds`: named seed streams.
* :mod:`lopd.run.memory_account`: where a run's memory goes, per phase.
"""
