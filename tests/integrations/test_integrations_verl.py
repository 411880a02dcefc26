"""The top-M + tail loss from a teacher's top-M log-probs, and its verl plugin.

The first tests need no verl: the server-teacher loss must equal the dense kernel run on the
teacher's full logits (the same buckets), in value and student gradient, and without verl the
plugin's import error names the extra. The verl tests run when verl is installed
(``pip install "lopd[verl]"``; verl 0.9.1 needs transformers < 5.11, so CI runs them in an
environment of its own, see ``.ci/run``) and go through verl's own loss entry point on nested
(jagged) inputs and its plugin discovery.
"""

import importlib
import importlib.machinery
import importlib.metadata
import subprocess
import sys
import types

import pytest
import torch

import lopd_kernels as lk
from lopd.integrations.teacher_topk import topk_tail_kl_from_teacher_topk


def dense_case(lead=(2, 3), vocab=61, m=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(*lead, vocab, generator=gen) * 1.5
    teacher = torch.randn(*lead, vocab, generator=gen) * 3
    ids = teacher.topk(m, dim=-1).indices
    logprobs = teacher.log_softmax(-1).gather(-1, ids)
    return student, teacher, ids, logprobs


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_equals_the_dense_kernel_on_the_teachers_full_logits(divergence):
    student, teacher, ids, logprobs = dense_case()
    target = torch.zeros(student.shape[:-1], dtype=torch.long)
    s1 = student.clone().requires_grad_(True)
    s2 = student.clone().requires_grad_(True)
    ours = topk_tail_kl_from_teacher_topk(s1, logprobs, ids, divergence=divergence)
    dense = lk.topk_tail_kl(s2, teacher, target, top_m=ids.shape[-1], divergence=divergence)
    ref = lk.topk_tail_kl_reference(
        student.double(), teacher.double(), target, top_m=ids.shape[-1], divergence=divergence
    )
    torch.testing.assert_close(ours.kl, dense.kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.kl.double(), ref.kl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours.teacher_mass, dense.teacher_topk_mass, rtol=1e-5, atol=1e-6)
    want_student_mass = student.softmax(-1).gather(-1, ids).sum(-1)
    torch.testing.assert_close(ours.student_mass, want_student_mass, rtol=1e-5, atol=1e-6)
    assert not ours.invalid.any()
    assert (ours.kl > 0).all()
    ours.kl.sum().backward()
    dense.kl.sum().backward()
    torch.testing.assert_close(s1.grad, s2.grad, rtol=1e-4, atol=1e-6)


def test_a_sharp_teacher_keeps_a_finite_tail():
    """Top-M mass 1 up to rounding: the tail is floored, the reverse KL stays finite."""
    student, _, ids, _ = dense_case(lead=(4,), m=3, seed=1)
    logprobs = torch.tensor([[0.0, -40.0, -45.0]] * 4)  # sums to 1 (+4e-18)
    out = topk_tail_kl_from_teacher_topk(student, logprobs, ids)
    assert torch.isfinite(out.kl).all() and (out.kl > 0).all()


def inconsistent_rows():
    student, _, ids, logprobs = dense_case(lead=(5,), seed=2)
    ids, logprobs = ids.clone(), logprobs.clone()
    ids[0, 1] = ids[0, 0]  # duplicate id
    logprobs[1] = 0.0  # mass M > 1 (verl's padding rows look like this)
    ids[2, 0] = 61  # out of range
    logprobs[3] = -20.0  # tail spread above the given probabilities: not a top-M
    return student, ids, logprobs  # row 4 is valid


def test_inconsistent_teacher_rows_raise_by_default():
    student, ids, logprobs = inconsistent_rows()
    with pytest.raises(ValueError, match="teacher_topk") as err:
        topk_tail_kl_from_teacher_topk(student, logprobs, ids)
    assert "4 row(s)" in str(err.value)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        topk_tail_kl_from_teacher_topk(student, logprobs, ids[:, :3])
    with pytest.raises(ValueError, match="on_invalid"):
        topk_tail_kl_from_teacher_topk(student, logprobs, ids, on_invalid="skip")


def test_ignored_rows_get_no_loss_and_no_gradient():
    student, ids, logprobs = inconsistent_rows()
    s = student.clone().requires_grad_(True)
    out = topk_tail_kl_from_teacher_topk(s, logprobs, ids, on_invalid="ignore")
    assert out.invalid.tolist() == [True, True, True, True, False]
    assert (out.kl[:4] == 0).all() and out.kl[4] > 0
    out.kl.sum().backward()
    assert (s.grad[:4] == 0).all() and s.grad[4].abs().sum() > 0
    alone = topk_tail_kl_from_teacher_topk(student[4:], logprobs[4:], ids[4:])
    torch.testing.assert_close(out.kl[4:], alone.kl)


# ----------------------------------------------------------------------------------------------
# Without verl: the import error says what to install


def _reimport_plugin_with(monkeypatch, verl_module):
    """Import the plugin afresh with ``verl`` replaced (``None``: not installed); verl's
    submodules are blocked, so an installed verl cannot leak in."""
    for name in [n for n in sys.modules if n.startswith("verl.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "verl", verl_module)
    monkeypatch.delitem(sys.modules, "lopd.integrations.verl", raising=False)
    return importlib.import_module("lopd.integrations.verl")


def test_without_verl_the_import_error_names_the_extra(monkeypatch):
    with pytest.raises(ImportError, match=r"not installed: pip install 'lopd\[verl\]'") as err:
        _reimport_plugin_with(monkeypatch, None)
    assert err.value.name == "verl"


def test_an_older_verl_is_named_as_too_old(monkeypatch):
    """A verl without ``verl.trainer.distillation`` (before 0.9): the error says which version."""
    old_verl = types.ModuleType("verl")
    old_verl.__spec__ = importlib.machinery.ModuleSpec("verl", None)
    with pytest.raises(ImportError, match=r"needs verl >= 0\.9\.1 .*lopd\[verl\]"):
        _reimport_plugin_with(monkeypatch, old_verl)


# ----------------------------------------------------------------------------------------------
# verl (skipped without it; CI runs these with verl installed and LOPD_NO_SKIP=1)


@pytest.fixture(scope="module")
def verl_env():
    pytest.importorskip(
        "verl", reason="verl not installed (pip install 'lopd[verl]'; needs transformers < 5.11)"
    )
    import lopd.integrations.verl as plugin

    return plugin


def nested(tensors):
    return torch.nested.nested_tensor(tensors, layout=torch.jagged)


def verl_batch(vocab=53, m=5, seed=3):
    """A packed micro-batch as verl's FSDP actor sees it: 2 sequences, prompt + response."""
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [3, 2], [4, 3]
    seq_lens = [p + r for p, r in zip(prompt_lens, response_lens)]
    nnz = sum(seq_lens)
    teacher = torch.randn(nnz, vocab, generator=gen) * 3
    ids = teacher.topk(m, dim=-1).indices
    logprobs = teacher.log_softmax(-1).gather(-1, ids)
    # A padded position as verl pads it (eos ids, zero log-probs): the last token of sequence 0,
    # whose row predicts nothing that is trained.
    ids[seq_lens[0] - 1], logprobs[seq_lens[0] - 1] = 7, 0.0
    splits = lambda x: list(x.split(seq_lens))
    td = tu.get_tensordict(
        {
            "input_ids": nested(splits(torch.randint(0, vocab, (nnz,), generator=gen))),
            "prompts": nested([torch.zeros(n, dtype=torch.long) for n in prompt_lens]),
            "responses": nested([torch.zeros(n, dtype=torch.long) for n in response_lens]),
            "response_mask": nested([torch.ones(n, dtype=torch.long) for n in response_lens]),
            "teacher_logprobs": nested(splits(logprobs)),
            "teacher_ids": nested(splits(ids)),
        },
        non_tensor_dict={"dp_size": 1, "batch_num_tokens": sum(response_lens),
                         "global_batch_size": 2},
    )  # fmt: skip
    student = torch.randn(1, nnz, vocab, generator=gen)
    return td, student, teacher, seq_lens, response_lens


def configs(loss_mode):
    from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

    actor = FSDPActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=2
    )
    loss = DistillationLossConfig(
        loss_mode=loss_mode, topk=5, use_policy_gradient=False, use_task_rewards=False
    )
    return actor, DistillationConfig(distillation_loss=loss)


def test_plugin_is_registered_and_validated_by_verl(verl_env):
    from verl.trainer.distillation import losses

    for mode in ("lopd_topk_tail", "lopd_topk_tail_forward"):
        assert losses.get_distillation_loss_settings(mode).use_topk
        _, distill = configs(mode)  # verl's own validation of the loss mode
        assert distill.distillation_loss.loss_settings.use_topk
    eps = importlib.metadata.entry_points(group="verl.plugins")
    if "lopd" in {ep.name for ep in eps}:  # only once lopd is pip-installed with its metadata
        assert next(ep for ep in eps if ep.name == "lopd").value == "lopd.integrations.verl"


def test_import_verl_alone_loads_the_plugin(verl_env):
    """What a verl user does: ``import verl`` (nothing of lopd) registers the loss modes through
    the ``verl.plugins`` entry point of the pip-installed lopd (verl swallows a plugin's import
    error, so the modes' presence is the check)."""
    eps = importlib.metadata.entry_points(group="verl.plugins")
    if "lopd" not in {ep.name for ep in eps}:
        pytest.skip("lopd is not pip-installed here (no verl.plugins entry point)")
    code = (
        "import sys, verl\n"
        "from verl.trainer.distillation import losses\n"
        "assert 'lopd.integrations.verl' in sys.modules\n"
        "assert losses.get_distillation_loss_settings('lopd_topk_tail').use_topk\n"
        "assert losses.get_distillation_loss_settings('lopd_topk_tail_forward').use_topk\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("mode", ["lopd_topk_tail", "lopd_topk_tail_forward"])
def test_registered_loss_on_nested_inputs_equals_the_dense_kernel(verl_env, mode):
    from verl.trainer.distillation import losses

    td, student, teacher, seq_lens, response_lens = verl_batch()
    actor, distill = configs(mode)
    logits = student.clone().requires_grad_(True)
    # Stage 1, as verl's actor calls it: the logits processor on the packed logits.
    per_token = losses.distillation_ppo_loss(actor, distill, data=td, student_logits=logits)
    assert per_token["distillation_losses"].shape == (1, sum(seq_lens))
    assert per_token["lopd_invalid"].sum() == 1  # the padded row, ignored
    divergence = verl_env.LOSS_MODES[mode]
    target = torch.zeros(sum(seq_lens), dtype=torch.long)
    want = lk.topk_tail_kl(student[0], teacher, target, top_m=5, divergence=divergence).kl
    valid = per_token["lopd_invalid"][0] == 0
    torch.testing.assert_close(per_token["distillation_losses"][0][valid], want[valid])
    # Stage 2: the final loss from the nested model outputs.
    offsets = td["input_ids"].offsets()
    model_output = {
        k: torch.nested.nested_tensor_from_jagged(v[0], offsets) for k, v in per_token.items()
    }
    loss, metrics = losses.distillation_ppo_loss(actor, distill, model_output=model_output, data=td)
    # Response token j of a sequence is predicted by the row before it (verl's shift).
    starts = [0, seq_lens[0]]
    rows = [s + p - 1 + j for s, p, r in zip(starts, (3, 2), response_lens) for j in range(r)]
    expected = want[rows].sum() / sum(response_lens)
    torch.testing.assert_close(loss, expected)
    assert metrics["distillation/lopd_invalid_fraction"] == 0.0
    assert 0 < metrics["distillation/teacher_mass"] < 1
    loss.backward()
    assert logits.grad.abs().sum() > 0
    assert (logits.grad[0, seq_lens[0] - 1] == 0).all()  # the padded row trains nothing


def test_other_loss_modes_still_use_verls_kernel(verl_env):
    from verl.trainer.distillation import losses

    td, student, *_ = verl_batch()
    actor, distill = configs("forward_kl_topk")
    out = losses.distillation_ppo_loss(actor, distill, data=td, student_logits=student)
    assert "lopd_invalid" not in out and "overlap_count" in out  # verl's own outputs


def test_megatron_tensor_parallel_logits_processor(verl_env, tmp_path):
    """verl's Megatron engine path at TP = 2 over gloo (tests/integrations/verl_megatron_worker.py):
    its ``_lm_head_logits_processor`` on each rank's vocabulary shard with the plugin's loss modes
    gives the whole-vocabulary loss, masses and log-probs on both ranks and each shard's slice of
    the whole gradient, for float32 and bf16 logits, packed (thd) and padded (bshd) batches."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import json
    import os
    import socket
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = Path(__file__).with_name("verl_megatron_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(worker), str(port), str(tmp_path)], capture_output=True, text=True,
        timeout=600, env=env, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        verdicts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(verdicts) == 4
        for case, verdict in verdicts.items():
            assert verdict == "ok", f"rank {rank}, {case}: {verdict}"
