"""The optional vLLM rollout backend (``gen.engine=vllm``, ``pip install 'lopd[vllm]'``).

Only generation moves to vLLM: :class:`VLLMRollout` owns one offline ``vllm.LLM`` engine and
supplies :func:`lopd.rollout.multi_turn.rollout` with a
:data:`~lopd.rollout.multi_turn.TurnGenerator`, so the episode loop (environments, budgets, masks,
turn spans) is the one of the Hugging Face path, and every teacher / student forward of the losses
stays in torch.

* **Weights.** The engine starts from the checkpoint on disk, but never generates from it: before
  a rollout :meth:`VLLMRollout.load_weights` pushes the module's full state dict (the tied
  ``lm_head`` included: with ``named_parameters()``, which lists a tied tensor once, the
  engine's outputs were silently wrong) as one ``torch.save`` blob through ``collective_rpc``
  into the worker (:class:`WeightSyncExtension` -> ``worker.reload_weights``) and then resets
  the prefix cache (cached KV
  blocks of the old weights must not serve the new ones). The trainer marks the weights stale
  after every optimizer step (:meth:`lopd.rollout.engine.RolloutEngine.weights_updated`), which
  syncs the student at once.
* **Latents.** The base + composer evaluation (:class:`lopd.latent.conditioned.LatentConditionedLM`)
  generates from ``prompt_embeds``: each context's token embeddings with the task's latents in
  place of the placeholders, computed in torch; the engine then holds the frozen backbone's
  weights (its LoRA adapter off, as in ``composer.teacher_mode()``).
* **Sampling.** Temperature, top-k and top-p are vLLM's (the same distribution as
  :func:`lopd.rollout.multi_turn.sample_next_token`, other random numbers); ``temperature=0`` is
  greedy, and greedy output equals the Hugging Face path token for token
  (``tests/integrations/test_vllm_engine.py``). Each request gets a seed derived from the rollout
  seed, the round and the row, so a seeded rollout is reproducible. Padded vocabulary rows past the
  tokenizer are excluded as in the HF path (``allowed_token_ids``).

vLLM is imported lazily: nothing here runs, and nothing changes, when it is not installed.
"""

from __future__ import annotations

import hashlib
import io
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lopd.config.checks import MissingDependencyError
from lopd.config.sections import VLLM_INSTALL_HINT
from lopd.rollout.multi_turn import GenerationConfig, TurnGenerator

__all__ = ["VLLMRollout", "WeightSyncExtension", "full_state_dict", "import_vllm"]


def import_vllm() -> Any:
    """``import vllm``, or a :class:`~lopd.config.MissingDependencyError` (a ``ConfigError``
    and an ``ImportError``) naming the ``lopd[vllm]`` extra."""
    try:  # optional heavy dependency: the [vllm] extra
        import vllm
    except Exception as err:  # ImportError, or a broken dependency failing inside vllm
        raise MissingDependencyError(
            f"gen.engine=vllm needs vLLM, which cannot be imported ({type(err).__name__}: "
            f"{str(err)[:300]}); {VLLM_INSTALL_HINT}",
            name="vllm",
        ) from None
    return vllm


def full_state_dict(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every weight of a Hugging Face ``*ForCausalLM`` under its checkpoint name, for vLLM.

    The tied ``lm_head.weight`` is included (``state_dict()`` keeps both names of a tied tensor,
    ``named_parameters()`` does not). A peft-injected module (the composer's encoder lives in
    the backbone) yields its base weights: ``lora_*`` tensors are dropped and ``.base_layer.``
    is removed from the names, i.e. the weights with the adapter off.

    Args:
        module: the model whose weights the engine should generate with.
        dtype: cast floating-point tensors to this dtype (the engine's).

    Returns:
        ``{name: tensor}``, detached, contiguous, on the CPU.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        if ".lora_" in name or "lora_embedding" in name:
            continue
        name = name.replace(".base_layer.", ".")
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous()
    config = getattr(module, "config", None)
    if "lm_head.weight" not in out and getattr(config, "tie_word_embeddings", False):
        out["lm_head.weight"] = module.get_input_embeddings().weight.detach().to("cpu")
    return out


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): the sync's receiving end."""

    def lopd_load_weights(self, blob: bytes) -> None:
        """Load a ``torch.save``'d ``{name: tensor}`` (tensors only: ``weights_only``)."""
        weights = torch.load(io.BytesIO(blob), weights_only=True)
        self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]


def _request_seed(seed: int, call: int, row: int) -> int:
    """A per-request sampling seed: a fixed function of (rollout seed, round, row)."""
    digest = hashlib.blake2b(f"{seed}/{call}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # vLLM takes a signed 64-bit seed


class VLLMRollout:
    """One offline vLLM engine that generates the rollouts' assistant turns.

    Args:
        model_dir: the checkpoint directory the engine is built from (architecture, shapes;
            its weights are replaced before the first rollout).
        num_tokens: the tokenizer's size; logits columns past it are never sampled.
        dtype: the engine's compute dtype (``model.dtype``).
        max_model_len: the longest context (``gen.max_total_tokens``).
        seed: the engine seed.
        gpu_memory_utilization: the fraction of the GPU vLLM may take (CUDA builds; the
            trainer's torch models share the device).
        kv_cache_gib: KV cache size; ``None`` keeps vLLM's default.
        enable_prompt_embeds: accept ``prompt_embeds`` prompts (the latent evaluation).
        enforce_eager: skip vLLM's graph compilation (faster start, slower decode).

    Attributes:
        syncs: weight syncs so far (one per :meth:`load_weights` that pushed weights).
    """

    def __init__(
        self,
        model_dir: str | Path,
        num_tokens: int,
        dtype: torch.dtype = torch.float32,
        max_model_len: int = 2048,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: float | None = None,
        enable_prompt_embeds: bool = True,
        enforce_eager: bool = False,
    ) -> None:
        vllm = import_vllm()
        kwargs: dict[str, Any] = {}
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        self.dtype = dtype
        self.num_tokens = num_tokens
        # The tokenizer stays ours (contexts go in and turns come out as token ids); the
        # checkpoint's generation_config must not add stop tokens or sampling defaults of its
        # own ("vllm": only what each request says).
        self.llm = vllm.LLM(
            model=str(model_dir),
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prompt_embeds=enable_prompt_embeds,
            enable_prefix_caching=True,
            skip_tokenizer_init=True,
            generation_config="vllm",
            enforce_eager=enforce_eager,
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            **kwargs,
        )
        config = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(config.vocab_size)
        self._loaded: tuple[int, int] | None = None
        self.syncs = 0

    # ------------------------------------------------------------------ weights
    def load_weights(self, module: nn.Module, version: int = 0) -> bool:
        """Make the engine generate with ``module``'s current weights.

        Args:
            module: a ``*ForCausalLM`` with the engine's architecture.
            version: the caller's weight version; ``(module, version)`` already loaded is a
                no-op. Bump it whenever the weights change in place.

        Returns:
            Whether weights were pushed.
        """
        key = (id(module), version)
        if self._loaded == key:
            return False
        weights = full_state_dict(module, self.dtype)
        # One torch.save blob, not a list of tensors: the weights cross two process boundaries
        # (ours -> engine core by msgpack, engine core -> worker by pickle) and the second
        # cannot pickle the zero-copy tensor buffers the first produces. By method name: a
        # function would need VLLM_ALLOW_INSECURE_SERIALIZATION=1.
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        self.llm.collective_rpc("lopd_load_weights", args=(buffer.getvalue(),))
        # KV blocks computed with the old weights must not be reused for the new ones.
        self.llm.reset_prefix_cache()
        self._loaded = key
        self.syncs += 1
        return True

    # ------------------------------------------------------------------ generation
    def turn_generator(
        self,
        gen: GenerationConfig,
        stop_ids: Sequence[int],
        seed: int | None = None,
        prompt_embeds: Callable[[Sequence[int]], torch.Tensor] | None = None,
    ) -> TurnGenerator:
        """A :data:`lopd.rollout.multi_turn.TurnGenerator` for one
        :func:`lopd.rollout.multi_turn.rollout` call.

        Args:
            gen: sampling and budget settings.
            stop_ids: the tokens that end a turn (kept as the turn's last sampled id).
            seed: the rollout seed (``None``: unseeded requests).
            prompt_embeds: ``ids -> [L, d]`` input embeddings of a context; generate from
                embeddings instead of token ids (the latent evaluation).
        """
        from vllm import SamplingParams  # optional: the [vllm] extra (imported once above)

        calls = itertools.count()
        allowed = list(range(self.num_tokens)) if self.vocab_size > self.num_tokens else None

        def params(budget: int, request_seed: int | None) -> Any:
            return SamplingParams(
                n=1,
                temperature=gen.temperature,
                top_p=gen.top_p,
                top_k=gen.top_k if gen.top_k > 0 else -1,
                max_tokens=budget,
                stop_token_ids=list(stop_ids),
                ignore_eos=True,  # stop_ids already hold EOS; nothing else may end a turn
                seed=request_seed,
                detokenize=False,
                skip_special_tokens=False,
                allowed_token_ids=allowed,
            )

        def generate(contexts: list[list[int]], budgets: list[int]) -> list[list[int]]:
            call = next(calls)
            prompts: list[dict[str, Any]] = []
            for ctx in contexts:
                if prompt_embeds is None:
                    prompts.append({"prompt_token_ids": list(ctx)})
                else:
                    emb = prompt_embeds(ctx).detach().to("cpu", self.dtype).contiguous()
                    prompts.append({"prompt_embeds": emb})
            sampling = [
                params(b, None if seed is None else _request_seed(seed, call, i))
                for i, b in enumerate(budgets)
            ]
            outs = self.llm.generate(prompts, sampling, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        return generate

    def close(self) -> None:
        """Shut the engine down (its worker process and memory)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.llm = None
