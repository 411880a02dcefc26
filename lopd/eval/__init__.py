"""Evaluation: held-out rewards during training, benchmarks of one model, statistics.

* :mod:`lopd.eval.summary`: the held-out metrics of paper Table 3.
* :mod:`lopd.eval.held_out`: the trainer's evaluation phase.
* :mod:`lopd.eval.benchmark`: BFCL v3 multi-turn, HumanEval, built-in worlds
  (``python -m lopd.evaluate``).
* :mod:`lopd.eval.stats`: the small statistics the reports share.
"""
