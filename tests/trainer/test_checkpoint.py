"""Checkpoint contents (lopd.run.checkpoint): keep-last-N, an optional optimizer state, and the
deployable student in safetensors in the compute dtype."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from lopd.config import TrainConfig
from lopd.parallel.distributed import Dist
from lopd.run.checkpoint import Checkpoints, TrainState, save_deployable
from lopd.run.optim import build_optimizers
from lopd.run.run_dir import RunDirError


class _Beta:
    """The smallest method state a checkpoint carries (the Method protocol's state part)."""

    def __init__(self) -> None:
        self.beta = 0.0

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    opts = build_optimizers(model, [], TrainConfig(lr=1e-2))
    return TrainState(model, None, opts, _Beta())


def _step(state: TrainState) -> None:
    loss = state.student(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.square().mean()
    state.optimizers.backward(loss)
    state.optimizers.sync_clip_step(Dist("cpu", 1))
    state.optimizers.zero_grad()


def test_keep_last_n_and_a_final_checkpoint_without_optimizer(tmp_path):
    dist = Dist("cpu", 1)
    ckpts = Checkpoints(tmp_path, dist, keep=1)
    state = _state()
    for step in (1, 2):
        _step(state)
        state.method.beta = float(step)
        ckpts.save(step, state, rollouts=step * 4, wall_seconds=1.0, optimizer=step < 2)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_000002.pt"]
    final = torch.load(tmp_path / "step_000002.pt", weights_only=False)
    assert "opt_student" not in final and final["has_optimizer"] is False
    fresh = _state(seed=1)
    resumed = ckpts.load_latest(fresh)
    assert (resumed.step, resumed.rollouts, resumed.optimizer_restored) == (2, 8, False)
    assert fresh.method.beta == 2.0
    for a, b in zip(state.student.state_dict().values(), fresh.student.state_dict().values()):
        assert torch.equal(a, b)
    assert not fresh.optimizers.student.state  # AdamW restarts (the trainer logs it)

    with_opt = Checkpoints(tmp_path / "b", dist, keep=2)
    (tmp_path / "b").mkdir()
    with_opt.save(3, state, rollouts=12, wall_seconds=2.0)
    full = torch.load(tmp_path / "b" / "step_000003.pt", weights_only=False)
    weights = sum(t.numel() * t.element_size() for t in full["student"].values())
    moments = sum(
        t.numel() * t.element_size()
        for s in full["opt_student"]["state"].values()
        for t in s.values()
        if t.dim() > 0
    )
    assert moments == 2 * weights  # exp_avg + exp_avg_sq, float32 like the weights
    again = _state(seed=1)
    assert with_opt.load_latest(again).optimizer_restored
    assert again.optimizers.student.state


def test_deployable_student_is_safetensors_in_the_compute_dtype(tmp_path):
    model = _state().student
    save_deployable(model, tmp_path / "bf16", torch.bfloat16)
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32  # the live student is untouched
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "bf16")
    assert reloaded.dtype == torch.bfloat16
    w = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(reloaded.model.layers[0].mlp.up_proj.weight, w.to(torch.bfloat16))
    save_deployable(model, tmp_path / "fp32", torch.float32)
    tensors = load_file(tmp_path / "fp32" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}


def _other_shapes(path) -> None:
    """A checkpoint of another model (hidden size 48): loads as a file, fits nothing here."""
    torch.manual_seed(5)
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    other = TrainState(Qwen3ForCausalLM(cfg), None, None, _Beta())
    step = int(path.stem.removeprefix("step_"))
    Checkpoints(path.parent, Dist("cpu", 1), keep=3).save(step, other, 0, 0.0, optimizer=False)


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "random bytes": lambda p: p.write_bytes(
        torch.randint(0, 256, (4096,)).byte().numpy().tobytes()
    ),
    "zero bytes": lambda p: p.write_bytes(b""),
    "other weight shapes": _other_shapes,
    "not a checkpoint": lambda p: torch.save({"hello": 1}, p),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_loadable_one(tmp_path, damage):
    dist = Dist("cpu", 1)
    ckpts = Checkpoints(tmp_path, dist, keep=3)
    state = _state()
    for step in (1, 2):
        _step(state)
        state.method.beta = float(step)
        if step == 1:
            good = {k: v.clone() for k, v in state.student.state_dict().items()}
        ckpts.save(step, state, rollouts=step * 4, wall_seconds=1.0)
    DAMAGE[damage](tmp_path / "step_000002.pt")
    fresh = _state(seed=1)
    with pytest.warns(RuntimeWarning, match=r"checkpoint step_000002.pt cannot be loaded \(.+\); "):
        resumed = ckpts.load_latest(fresh)
    assert (resumed.step, resumed.rollouts, resumed.name) == (1, 4, "step_000001.pt")
    assert fresh.method.beta == 1.0 and fresh.optimizers.student.state
    for key, value in fresh.student.state_dict().items():
        assert torch.equal(value, good[key]), key
    # Nothing loadable at all: one line, not a traceback from torch.load.
    DAMAGE[damage](tmp_path / "step_000001.pt")
    with pytest.warns(RuntimeWarning), pytest.raises(RunDirError) as err:
        ckpts.load_latest(_state(seed=2))
    assert str(err.value).startswith(f"--resume: no checkpoint in {tmp_path} can be loaded (")
    assert "\n" not in str(err.value)
