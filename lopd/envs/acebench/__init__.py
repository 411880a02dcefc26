"""ACEBench's agent tasks (multi-step, multi-turn): environments, data, scores, simulated user.

:mod:`~lopd.envs.acebench.phone` and :mod:`~lopd.envs.acebench.travel` are ACEBench's
environments written from its specification; :mod:`~lopd.envs.acebench.spec` what a task holds;
:mod:`~lopd.envs.acebench.data` reads ACEBench's released agent files;
:mod:`~lopd.envs.acebench.scoring` is its end-to-end and process accuracy;
:mod:`~lopd.envs.acebench.env` the episode; :mod:`~lopd.envs.acebench.user` the simulated user
of multi-turn tasks.
"""
