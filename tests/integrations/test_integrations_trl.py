"""lopd.integrations.trl: TRL trainers trained for 2 real steps on the shipped tiny Qwen3.

With ``top_m=None`` the lopd loss is TRL's own full-vocabulary reverse KL, so the logged losses
and the trained weights must equal TRL's (same seed, same on-policy completions). With a finite
``top_m`` the top-M + tail KL is a coarsening of the full KL, so it can only be smaller on the
same completions (the data-processing inequality), and the weights still move.
"""

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from packaging.version import Version

trl = pytest.importorskip("trl", reason="TRL not installed (pip install 'lopd[trl]')")
if Version(trl.__version__) < Version("1.16"):
    pytest.skip(f"lopd.integrations.trl needs trl>=1.16, found {trl.__version__}",
                allow_module_level=True)  # fmt: skip

from datasets import Dataset  # noqa: E402
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402
from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

import lopd_kernels as lk  # noqa: E402
from lopd.integrations.trl import (  # noqa: E402
    LopdDistillationConfig,
    LopdDistillationTrainer,
    LopdGKDConfig,
    LopdGKDTrainer,
    divergence_from_beta,
    plain_head_tensor,
)

TINY = str(Path(__file__).resolve().parents[2] / "lopd" / "assets" / "tiny-qwen3")
COMMON = dict(
    per_device_train_batch_size=2, max_steps=2, learning_rate=0.05, optim="sgd", logging_steps=1,
    report_to=[], bf16=False, save_strategy="no", gradient_checkpointing=False, seed=0,
    use_cpu=True, disable_tqdm=True,
)  # fmt: skip
PROBE = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


@functools.cache
def _tiny_pair():
    student = AutoModelForCausalLM.from_pretrained(TINY)
    teacher = AutoModelForCausalLM.from_pretrained(TINY)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return student, teacher


def student_and_teacher():
    """Fresh copies of the tiny model and of a seeded perturbation of it (so the KL is far
    from 0); loaded once per session, copied per run (every run starts from the same weights)."""
    return tuple(copy.deepcopy(m) for m in _tiny_pair())


def train(trainer_cls, config, tokenizer, dataset):
    """Trains 2 steps; returns (per-step logged losses, per-step logs, weight before, after)."""
    student, teacher = student_and_teacher()
    before = student.get_parameter(PROBE).detach().clone()
    trainer = trainer_cls(
        model=student, teacher_model=teacher, args=config, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    transformers.set_seed(0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    return [h["loss"] for h in logs], logs, before, student.get_parameter(PROBE).detach()


PROMPTS = Dataset.from_dict({"prompt": ["Hello there", "Write a function", "Tell me", "Add 2"]})


@pytest.fixture(scope="module")
def trl_distillation_run(tokenizer, tmp_path_factory):
    config = DistillationConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), max_completion_length=4, **COMMON
    )
    return train(DistillationTrainer, config, tokenizer, PROMPTS)


def test_full_vocabulary_matches_trl_loss_and_update(trl_distillation_run, tokenizer, tmp_path):
    trl_losses, _, before, trl_after = trl_distillation_run
    config = LopdDistillationConfig(
        output_dir=str(tmp_path), max_completion_length=4, top_m=None, **COMMON
    )
    losses, logs, before_lopd, after = train(LopdDistillationTrainer, config, tokenizer, PROMPTS)
    assert torch.equal(before, before_lopd)
    assert trl_losses[0] > 0.5  # the teacher is really different
    assert losses == pytest.approx(trl_losses, rel=1e-5)
    assert (after - before).abs().max() > 1e-4  # trained
    torch.testing.assert_close(after, trl_after, rtol=1e-4, atol=1e-6)
    assert all(h["teacher_topk_mass"] == pytest.approx(1.0) for h in logs)


def test_top_m_trains_below_the_full_kl(trl_distillation_run, tokenizer, tmp_path):
    trl_losses, _, before, _ = trl_distillation_run
    config = LopdDistillationConfig(
        output_dir=str(tmp_path), max_completion_length=4, top_m=4, **COMMON
    )
    losses, logs, _, after = train(LopdDistillationTrainer, config, tokenizer, PROMPTS)
    # Step 1 runs on the same completions as TRL's step 1 (same seed, same initial student).
    assert 0 < losses[0] < trl_losses[0]
    assert all(0 < h["teacher_topk_mass"] < 1 for h in logs)
    assert (after - before).abs().max() > 1e-4
    assert torch.isfinite(after).all()


def test_config_accepts_every_beta_and_rejects_bad_fields(tmp_path):
    for beta in (0.0, 0.25, 0.5, 0.9, 1.0):
        LopdDistillationConfig(output_dir=str(tmp_path), beta=beta, use_cpu=True)
        LopdGKDConfig(output_dir=str(tmp_path), beta=beta, use_cpu=True)
    assert LopdGKDConfig(output_dir=str(tmp_path), use_cpu=True).beta == 0.5  # TRL's GKD default
    with pytest.raises(ValueError, match="beta"):
        LopdGKDConfig(output_dir=str(tmp_path), beta=1.5, use_cpu=True)
    with pytest.raises(ValueError, match="top_m"):
        LopdDistillationConfig(output_dir=str(tmp_path), top_m=0, use_cpu=True)
    with pytest.raises(ValueError, match="lopd_backend"):
        LopdDistillationConfig(output_dir=str(tmp_path), lopd_backend="gpu", use_cpu=True)
    with pytest.raises(ValueError, match="lopd_support"):
        LopdGKDConfig(output_dir=str(tmp_path), lopd_support="both", use_cpu=True)
    assert divergence_from_beta(1.0) == "reverse"
    assert divergence_from_beta(0.0) == "forward"
    assert divergence_from_beta(0.5) == "jsd"


def test_dtensor_head_is_gathered_and_gets_its_gradient(tmp_path):
    """A Shard(0) head (FSDP2's layout) on a 1-process gloo mesh: plain_head_tensor gathers it,
    the fused loss equals the plain-tensor loss and the gradient lands on the DTensor."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        gen = torch.Generator().manual_seed(1)
        weight = torch.randn(37, 16, generator=gen)
        h_s, h_t = torch.randn(9, 16, generator=gen), torch.randn(9, 16, generator=gen)
        target = torch.randint(0, 37, (9,), generator=gen)
        target[3] = -100
        sharded = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_(True)
        plain = weight.clone().requires_grad_(True)
        gathered = plain_head_tensor(sharded, torch.float32)
        assert not isinstance(gathered, torch.distributed.tensor.DTensor)
        losses = []
        for w in (gathered, plain):
            out = lk.fused_linear_topk_tail_kl(h_s, w, h_t, weight, target, top_m=5)
            out.kl.sum().backward()
            losses.append(out.kl.sum().detach())
        torch.testing.assert_close(losses[0], losses[1])
        torch.testing.assert_close(sharded.grad.full_tensor(), plain.grad)
        assert plain.grad.abs().sum() > 0
    finally:
        dist.destroy_process_group()


BETAS = (0.0, 0.25, 0.5, 0.9, 1.0)


def test_gkd_loss_matches_trl_full_vocabulary_and_shrinks_with_top_m(tmp_path, tokenizer):
    """At top_m=None the loss is TRL's generalized_jsd_loss at every beta (its forward / reverse
    ends included), value and gradient; a finite top_m coarsens the buckets, which can only
    shrink an f-divergence (the JSD is one)."""
    trainer_stub = LopdGKDTrainer.__new__(LopdGKDTrainer)  # the loss reads only self.args
    gen = torch.Generator().manual_seed(2)
    student = torch.randn(2, 7, 53, generator=gen, dtype=torch.float32, requires_grad=True)
    teacher = torch.randn(2, 7, 53, generator=gen) * 2
    labels = torch.randint(0, 53, (2, 7), generator=gen)
    labels[0, :3] = -100
    for beta in BETAS:
        trainer_stub.args = LopdGKDConfig(output_dir=str(tmp_path), top_m=None, use_cpu=True)
        ours = trainer_stub.generalized_jsd_loss(student, teacher, labels, beta=beta)
        theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        (g_ours,) = torch.autograd.grad(ours, student)
        (g_theirs,) = torch.autograd.grad(theirs, student)
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-6)
        for support in ("teacher", "student", "union"):
            trainer_stub.args = LopdGKDConfig(
                output_dir=str(tmp_path), top_m=3, lopd_support=support, use_cpu=True
            )
            top3 = trainer_stub.generalized_jsd_loss(student, teacher, labels, beta=beta)
            assert 0 < top3 < ours, (beta, support)
        n = 7
        per_token = trainer_stub.generalized_jsd_loss(
            student, teacher, labels, beta=beta, reduction="none", num_items_in_batch=None
        )
        assert per_token.shape == ((labels != -100).sum(),)
        torch.testing.assert_close(
            trainer_stub.generalized_jsd_loss(student, teacher, labels, beta, num_items_in_batch=n),
            per_token.sum() / n,
        )


def other_teacher():
    """A second, different model with the tiny Qwen3's vocabulary: two narrower layers, seeded
    random weights (logits of std ~1, so every divergence is far from 0)."""
    cfg = transformers.AutoConfig.from_pretrained(TINY)
    cfg.update(dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                    layer_types=["full_attention"] * 2, initializer_range=0.1))  # fmt: skip
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _student_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(stock, ours, inputs):
    """compute_loss of both trainers on the same batch: loss and every student gradient."""
    losses, grads = [], []
    for trainer in (stock, ours):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        losses.append(loss.detach())
        grads.append(_student_grads(trainer.model))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    return losses[0]


def test_distillation_trainer_is_trls_loss_at_every_beta(tokenizer, tmp_path):
    """LopdDistillationTrainer at top_m=None equals trl.DistillationTrainer's chunked divergence
    at every beta (loss and all student gradients, one batch), with a different teacher model."""
    student = AutoModelForCausalLM.from_pretrained(TINY)
    teacher = other_teacher()
    gen = torch.Generator().manual_seed(4)
    inputs = {
        "prompt_ids": torch.randint(0, 1700, (2, 3), generator=gen),
        "prompt_mask": torch.ones(2, 3, dtype=torch.long),
        "completion_ids": torch.randint(0, 1700, (2, 5), generator=gen),
        "completion_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
    }
    kw = dict(COMMON, max_completion_length=5)
    stock = DistillationTrainer(
        model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
        args=DistillationConfig(output_dir=str(tmp_path / "stock"), **kw), train_dataset=PROMPTS,
    )  # fmt: skip
    ours = LopdDistillationTrainer(
        model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
        args=LopdDistillationConfig(output_dir=str(tmp_path / "ours"), top_m=None, **kw),
        train_dataset=PROMPTS,
    )  # fmt: skip
    for beta in BETAS:
        stock.beta = ours.beta = beta
        loss = _assert_same_step(stock, ours, inputs)
        assert loss > 1e-3, beta


def test_gkd_trainer_default_beta_is_stock_gkd_and_trains(tokenizer, tmp_path):
    """LopdGKDTrainer with its default beta = 0.5 (the JSD) at top_m=None: stock GKD's step-0
    loss and student gradients on the same batch, then both train 2 on-policy steps to the same
    logged losses and weights."""
    student = AutoModelForCausalLM.from_pretrained(TINY)
    teacher = other_teacher()
    common = dict(COMMON, max_new_tokens=4, max_length=64, lmbda=1.0, temperature=1.0)
    trainers = []
    for cls, cfg_cls, extra in ((GKDTrainer, GKDConfig, {}),
                                (LopdGKDTrainer, LopdGKDConfig, {"top_m": None})):  # fmt: skip
        config = cfg_cls(output_dir=str(tmp_path / cls.__name__), **common, **extra)
        assert config.beta == 0.5
        trainers.append(cls(
            model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=config,
            train_dataset=CHATS, processing_class=tokenizer,
        ))  # fmt: skip
    stock, ours = trainers
    batch = stock.data_collator([CHATS[i] for i in range(2)])
    assert _assert_same_step(stock, ours, batch) > 1e-3
    results = []
    for trainer in trainers:
        trainer.model.zero_grad()
        before = trainer.model.get_parameter(PROBE).detach().clone()
        transformers.set_seed(0)
        trainer.train()
        logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((logs, before, trainer.model.get_parameter(PROBE).detach()))
    (stock_losses, before, stock_after), (losses, _, after) = results
    assert len(losses) == 2 and losses == pytest.approx(stock_losses, rel=1e-5)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, stock_after, rtol=1e-4, atol=1e-6)


CHATS = Dataset.from_dict(
    {
        "messages": [
            [{"role": "user", "content": q}, {"role": "assistant", "content": "ok " + q}]
            for q in ("Hello", "Write code", "Tell me", "Add 2")
        ]
    }
)


def test_gkd_trainer_trains_on_policy_with_top_m(tokenizer, tmp_path):
    # lmbda=1: every step trains on the student's own samples (on-policy).
    common = dict(COMMON, max_new_tokens=4, max_length=64, lmbda=1.0, temperature=1.0)
    config = LopdGKDConfig(output_dir=str(tmp_path), top_m=4, beta=1.0, **common)
    losses, _, before, after = train(LopdGKDTrainer, config, tokenizer, CHATS)
    assert all(0 < loss < 20 for loss in losses)
    assert (after - before).abs().max() > 1e-4
    assert torch.isfinite(after).all()
