"""One tensor-parallel rank of the verl Megatron test
(tests/integrations/test_integrations_verl.py): the plugin's loss modes on vocabulary-parallel
student logits, called as verl's Megatron engine calls them, in a gloo group with Megatron-core's
``parallel_state`` at TP = 2.

What runs is verl 0.9.1's own code from the Megatron engine's logits processor down:
``MegatronEngineWithLMHead._lm_head_logits_processor`` (the temperature division, the top-k loss
dispatch and the log-probs by Megatron-core's ``vocab_parallel_cross_entropy``) with
``logits_processor_func = partial(distillation_ppo_loss, config=McoreActorConfig, ...)`` as
``verl.workers.engine_workers`` builds it, verl's ``compute_topk_loss`` dispatching on the
``megatron`` strategy, and verl's ``preprocess_thd_engine`` / ``preprocess_bshd_engine`` splitting
the teacher's top-M. The logits are random stand-ins for the model's output layer (no
``GPTModel`` forward: that needs TransformerEngine and a GPU).

Usage: ``python tests/integrations/verl_megatron_worker.py PORT OUT_DIR`` (forks both ranks); each
rank writes ``OUT_DIR/rank<r>.json`` with its checks' verdicts.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

TP = 2
VOCAB = 2 * 31  # padded to the TP multiple
M = 5


def _batch(gen, data_format):
    """A verl micro-batch (nested): 2 sequences of prompt + response, one padded position."""
    import torch
    from verl.utils import tensordict_utils as tu

    prompt_lens, response_lens = [3, 2], [4, 3]
    seq_lens = [p + r for p, r in zip(prompt_lens, response_lens)]
    nnz = sum(seq_lens)
    teacher = torch.randn(nnz, VOCAB, generator=gen) * 3
    ids = teacher.topk(M, dim=-1).indices
    logprobs = teacher.log_softmax(-1).gather(-1, ids)
    ids[seq_lens[0] - 1], logprobs[seq_lens[0] - 1] = 7, 0.0  # verl's padding of a position

    def nested(x):
        return torch.nested.nested_tensor(list(x.split(seq_lens)), layout=torch.jagged)

    def ones(lens):
        return torch.nested.nested_tensor(
            [torch.ones(n, dtype=torch.long) for n in lens], layout=torch.jagged
        )

    td = tu.get_tensordict(
        {
            "input_ids": nested(torch.randint(0, VOCAB, (nnz,), generator=gen)),
            "prompts": ones(prompt_lens),
            "responses": ones(response_lens),
            "response_mask": ones(response_lens),
            "teacher_logprobs": nested(logprobs),
            "teacher_ids": nested(ids),
        },
        non_tensor_dict={"dp_size": 1, "batch_num_tokens": sum(response_lens),
                         "global_batch_size": 2},
    )  # fmt: skip
    return td


def _configs(mode):
    from verl.workers.config import DistillationConfig, DistillationLossConfig, McoreActorConfig

    actor = McoreActorConfig(ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=2)
    loss = DistillationLossConfig(
        loss_mode=mode, topk=M, use_policy_gradient=False, use_task_rewards=False
    )
    return actor, DistillationConfig(distillation_loss=loss)


def check(rank: int, mode: str, data_format: str, dtype) -> None:
    """verl's Megatron logits processor on this rank's shard against the plugin's
    whole-vocabulary path on the whole logits (same padded rows): losses, masses, log-probs
    (Megatron-core's) and the gradient of this rank's shard."""
    import torch
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
    from verl.trainer.distillation import losses
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    import lopd.integrations.verl as plugin

    gen = torch.Generator().manual_seed(5)
    td = _batch(gen, data_format)
    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    input_ids = split(td["input_ids"], pre_process=True)[0]  # the padded layout of the logits
    lead = input_ids.shape[:2]
    full = (torch.randn(*lead, VOCAB, generator=gen, dtype=torch.float64) * 2).to(dtype)
    label = torch.randint(0, VOCAB, lead, generator=gen)
    temperature = torch.full(lead, 0.8)
    lo, hi = rank * (VOCAB // TP), (rank + 1) * (VOCAB // TP)
    shard = full[..., lo:hi].clone().requires_grad_(True)
    actor, distill = _configs(mode)
    loss_fn = partial(losses.distillation_ppo_loss, config=actor, distillation_config=distill)
    out = MegatronEngineWithLMHead._lm_head_logits_processor(
        None, shard * 1.0, label, temperature.clone(), calculate_sum_pi_squared=False,
        calculate_entropy=False, distillation_use_topk=True, distillation_only=False,
        logits_processor_func=loss_fn, batch=td, data_format=data_format,
    )  # fmt: skip
    assert out["distillation_losses"].shape == lead, out["distillation_losses"].shape
    assert int(out["lopd_invalid"].sum()) >= 1  # verl's padded position (and the layout's)
    (out["distillation_losses"].sum() + 0.5 * out["log_probs"].sum()).backward()

    whole = full.clone().requires_grad_(True)
    scaled = whole / temperature.unsqueeze(-1).to(dtype)  # as the engine divides
    lp, *_ = split(td["teacher_logprobs"], pre_process=True)
    ids, *_ = split(td["teacher_ids"], pre_process=True)
    want = plugin.topk_tail_kl_from_teacher_topk(
        scaled, lp, ids, divergence=plugin.LOSS_MODES[mode], on_invalid="ignore"
    )
    log_probs = -torch.nn.functional.cross_entropy(
        scaled.float().reshape(-1, VOCAB), label.reshape(-1), reduction="none"
    ).reshape(lead)
    (want.kl.sum() + 0.5 * log_probs.sum()).backward()
    tol = {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(out["distillation_losses"], want.kl, **tol)
    torch.testing.assert_close(out["student_mass"], want.student_mass, **tol)
    torch.testing.assert_close(out["teacher_mass"], want.teacher_mass, **tol)
    torch.testing.assert_close(out["lopd_invalid"].bool(), want.invalid)
    torch.testing.assert_close(out["log_probs"].float(), log_probs.float(), **tol)
    grad_tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(shard.grad, whole.grad[..., lo:hi], **grad_tol)


def _run_rank(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    verdicts = {}
    cases = [("lopd_topk_tail", "thd", torch.float32), ("lopd_topk_tail", "bshd", torch.bfloat16),
             ("lopd_topk_tail_forward", "thd", torch.bfloat16),
             ("lopd_topk_tail_forward", "bshd", torch.float32)]  # fmt: skip
    for mode, data_format, dtype in cases:
        name = f"{mode}-{data_format}-{str(dtype).split('.')[-1]}"
        try:
            check(rank, mode, data_format, dtype)
            verdicts[name] = "ok"
        except Exception as err:
            verdicts[name] = f"FAIL: {err}\n{traceback.format_exc(limit=8)}"
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(verdicts))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    # Imported once here and forked into both ranks (on 2 loaded cores each rank importing verl
    # and Megatron-core itself took most of the test's time).
    import megatron.core.parallel_state  # noqa: F401
    import torch.multiprocessing as mp
    import verl.trainer.distillation.losses
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401

    import lopd.integrations.verl  # noqa: F401

    port, out_dir = int(sys.argv[1]), sys.argv[2]
    mp.start_processes(_run_rank, args=(port, out_dir), nprocs=TP, start_method="fork")


if __name__ == "__main__":
    main()
