"""Generation: multi-turn rollouts of a causal LM in the task environments.

* :mod:`lopd.rollout.chat`: token ids of prompts and observations from the chat template.
* :mod:`lopd.rollout.multi_turn`: batched multi-turn rollouts (Hugging Face decoding by default).
* :mod:`lopd.rollout.vllm`: the optional vLLM turn generator (``gen.engine=vllm``).
* :mod:`lopd.rollout.engine`: the trainer's rollout engine (sampling settings, the rollout
  count every method is compared at, sharded generation).
* :mod:`lopd.rollout.budget`: token budgets, checked against the model at start-up.
* :mod:`lopd.rollout.batch`: trajectories as model inputs (padded batches, action-token rows).
"""

from lopd.rollout.engine import RolloutEngine
from lopd.rollout.multi_turn import GenerationConfig, rollout

__all__ = ["GenerationConfig", "RolloutEngine", "rollout"]
