"""The run config's schema: frozen, nested dataclasses, one per YAML section.

Field metadata `choices` holds the valid values of an enum-like field: a tuple, or a registry's
`names` (`das_jax.registry`), read when a config is validated, so a name registered by a user
module imported before is valid. GRPO field names follow TRL's `GRPOConfig` where one exists.
This module does not import JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from das_jax.registry import DATASETS, SPECULATION
from das_jax.speculation.names import DASSection

__all__ = ["ConfigError", "INFINITE_OK", "Config", "ModelSection", "DataSection", "RolloutSection",
           "GRPOSection", "DASSection", "TrainSection", "EvalSection", "MeshSection",
           "DistributedSection", "DraftHeadSection"]


class ConfigError(ValueError):
    """An invalid config (names the offending key and what would be accepted)."""


# Every float value of a config must be a finite number (checked for every float field and list
# item when a config is validated: `validation._check_finite`), except the keys here, where
# infinity is a documented setting (NaN never is):
#   das.global_below: inf searches the global trie for every row (docs/results/rollouts.md).
#   das.request_below: inf searches the request trie for every row (docs/results/host-loop.md).
INFINITE_OK = frozenset({"das.global_below", "das.request_below"})


def _choices(*values, default):
    return dataclasses.field(default=default, metadata={"choices": tuple(values)})


def _registry_choices(names_fn, default):
    """A field whose valid values come from a registry, read when a config is validated (so a
    name registered by a user module imported before is valid)."""
    return dataclasses.field(default=default, metadata={"choices": names_fn})


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """source: a named model source (e.g. "smollm2-135m-instruct") or a path (HF dir / GGUF).
    dtype: parameter dtype, float32 (CPU) or bfloat16 (GPU/TPU); the loaders support no other."""

    source: str = "smollm2-135m-instruct"
    dtype: str = _choices("float32", "bfloat16", default="float32")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """kind: dataset kind (`das_jax.data.DATASET_KINDS`: "arithmetic" built-in synthetic, "gsm8k",
    "math", "humaneval", "hf"); path: file for file-based kinds (none for "arithmetic");
    num_problems: size of the synthetic arithmetic set; seed: seed of the synthetic arithmetic
    generator (num_problems and seed apply to "arithmetic" only: a different value with another
    kind is rejected; the order in which training visits problems follows train.seed); limit: keep
    the first `limit` problems; instruction: prompt instruction (None: the kind's default); chat:
    apply the chat template.
    Difficulty of the `arithmetic` kind (null: the generator's default; an error for other
    kinds): min_steps / max_steps: arithmetic steps per problem, drawn uniformly from
    [min_steps, max_steps] within 1..5 (default 1..5); templates: the problem templates to use
    (shopping, travel, sharing, bakery, multi_step, counting; default all but counting)."""

    kind: str = _registry_choices(DATASETS.names, default="arithmetic")
    path: Optional[str] = None
    num_problems: int = 64
    limit: Optional[int] = None
    seed: int = 0
    instruction: Optional[str] = None
    chat: bool = True
    min_steps: Optional[int] = None
    max_steps: Optional[int] = None
    templates: Optional[tuple[str, ...]] = None

    def task_kwargs(self) -> dict[str, Any]:
        """The difficulty keys that are set, as keyword arguments of `synthetic_arithmetic`."""
        return {k: getattr(self, k) for k in ("min_steps", "max_steps", "templates")
                if getattr(self, k) is not None}


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling and engine settings. temperature: sampling temperature, > 0 for training (the
    GRPO importance ratio needs the sampling distribution; `das-jax generate --temperature 0`
    decodes greedily); draft_widths: compiled draft widths of the verify step;
    exact: shape-invariant contractions, so rollouts are token-identical with and without
    speculation (README, "Exact mode"; costs some rollout time)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_slots: int = 16
    max_cache_len: int = 1024
    draft_widths: tuple[int, ...] = (1, 4, 8)
    stop_token_ids: tuple[int, ...] = ()
    # KV-cache memory budget per device in GB (None: kv_memory_fraction of the device's free
    # memory at start-up). The engine runs min(max_slots, what fits) rows and refuses to start
    # when not one row of max_cache_len fits.
    kv_memory_gb: Optional[float] = None
    kv_memory_fraction: float = 0.5
    exact: bool = False
    # Data-parallel rollout replicas over this process's devices (None: one per local device).
    # Each replica gets devices / replicas devices and runs tensor-parallel over KV heads on
    # them; whole GRPO groups stay on one replica (das_jax.rollout.sharded).
    replicas: Optional[int] = None
    # Compile every packed verify program a rollout can reach before its first step
    # (das_jax.engine.Engine.precompile): the compile is one-off, never inside a later step.
    precompile: bool = False
    # Without speculation (drafter none), up to this many decode steps run in one device call
    # (rows stop on the device), so the host waits once per k steps; 1: one step per call.
    decode_steps: int = 8
    # dense: every row holds max_cache_len positions. paged: a pool of page_size-position pages
    # and a page table per row (rows hold the pages their tokens fill, a GRPO group shares its
    # prompt's pages, finished rows free theirs at once); same tokens. One device per engine.
    # auto: paged on GPU and TPU with one device per rollout replica, else dense.
    kv_cache: str = _choices("auto", "dense", "paged", default="auto")
    page_size: int = 16
    # How attention reads the paged cache: auto (a Pallas kernel over each row's pages on TPU,
    # an XLA gather elsewhere, CUDA included) or gather (the XLA gather everywhere).
    paged_attention: str = _choices("auto", "gather", default="auto")
    # The rollout programs' loop over layers: scan (one lax.scan; fast compiles) or unroll (a
    # Python loop: no per-layer copies of the weights and KV cache; on an H200 the 7B verify
    # step 2.4x faster and each program's compile ~30x longer, so it pays in long runs with
    # the persistent compilation cache). Same tokens up to float rounding. Training scans.
    layer_loop: str = _choices("scan", "unroll", default="scan")
    # Block slots of one prefill call (distinct prompts' batch bucket x longest prompt's length
    # bucket): a larger admission runs as several calls, so the prefill's activations stay a
    # small share of the KV cache (a longer prompt is prefilled alone); null: one call. Same
    # tokens.
    max_prefill_tokens: Optional[int] = 4096
    # With the das / suffix drafters, each step's tokens are indexed into the drafter's trie
    # while the device computes the next step (drafts from a trie one step behind; the sampled
    # tokens never change), and so is the DAS policy's calibration update (a step is planned
    # with the calibration up to the step before); false: all of it before the next draft.
    overlap_host: bool = True
    # With overlap_host, the next step's drafts are also made while the device computes, for
    # the rows with a draft (assuming the step accepts the chosen draft and samples the
    # drafter's next token); the next step takes them where that happened. Same
    # drafts and tokens; less host work between two steps. No effect with a draft head or with
    # in-process replicas (rollout.replicas > 1: they share one drafter).
    draft_ahead: bool = True
    # A verify step where at most R of its B rows draft (R the smallest of these holding them)
    # runs attention as a [B, 1] block plus an [R, W] block of the drafting rows, when that is
    # under half the query rows of one [B, W] block: a few rows' drafts stop costing attention
    # for every row. Same tokens; each R is another compiled program. []: one block always.
    wide_row_buckets: tuple[int, ...] = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class GRPOSection:
    """GRPO hyper-parameters (TRL `GRPOConfig` names).

    num_generations: G completions per prompt; prompts_per_step: prompts per optimizer step (the
    batch has prompts_per_step * num_generations sequences); beta: KL coefficient (0: no reference
    model); epsilon / epsilon_high: clip range [1 - epsilon, 1 + epsilon_high] (DAPO clip-higher);
    loss_type: grpo | dr_grpo | dapo; scale_rewards: group | batch | none; num_iterations: optimizer
    steps per generation batch (PPO epochs, mu in GRPO Alg. 1); micro_batch_size: sequences per
    gradient-accumulation micro-batch; max_completion_length: the Dr. GRPO normaliser, None means
    rollout.max_new_tokens (the resolved config always holds the number); lr_schedule: constant |
    linear | cosine after linear warm-up.
    """

    num_generations: int = 8
    prompts_per_step: int = 4
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    loss_type: str = _choices("grpo", "dr_grpo", "dapo", default="dapo")
    scale_rewards: str = _choices("group", "batch", "none", default="group")
    num_iterations: int = 1
    learning_rate: float = 1e-6
    lr_schedule: str = _choices("constant", "linear", "cosine", default="constant")
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: Optional[float] = 1.0
    micro_batch_size: int = 4
    max_completion_length: Optional[int] = None
    reward_funcs: tuple[str, ...] = ("math_accuracy",)
    reward_weights: Optional[tuple[float, ...]] = None
    # Where the importance ratio's old log-probs come from: "recompute" (a forward pass of the
    # pre-update params over the rollouts, as verl does; a pure function of params and tokens,
    # so training is reproducible bit for bit) or "rollout" (the engine's log-probs of the sampled
    # tokens, under the same distribution the trainer scores: the temperature-scaled full softmax,
    # whatever top_k / top_p). rollout_logprob_gap is reported in both modes.
    old_logprobs: str = _choices("recompute", "rollout", default="recompute")
    # With train.async_steps > 0, each completion token's loss is weighted by the truncated
    # importance weight min(pi_old / pi_behaviour, cap): pi_old the pre-update params (recomputed
    # by the trainer, or with old_logprobs: rollout and num_iterations: 1 the train step's own
    # log-probs, detached: the decoupled objective), pi_behaviour the (older) params the rollout
    # sampled with (truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework
    # Secretly Brings You Off-Policy RL Training"; TRL's vllm_importance_sampling_cap).
    importance_sampling_cap: float = 2.0
    # A registered advantage estimator (`das_jax.rl.advantages.register_advantage`).
    advantage_estimator: str = "grpo"

    @property
    def batch_size(self) -> int:
        """Sequences per generation batch (prompts_per_step * num_generations)."""
        return self.prompts_per_step * self.num_generations


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """steps: optimizer steps; seed: run seed (rollout sampling, data order); save_every: save a
    checkpoint every this many steps and after the last step (0 disables saving, so such a run
    cannot be resumed); keep_checkpoints: checkpoints kept on disk; log_samples: completions (with
    prompts and rewards) of each step written to samples.jsonl and TensorBoard text (0 disables).
    Every step is logged to metrics.jsonl. To resume a run: `das-jax train --resume RUN_DIR`."""

    steps: int = 20
    seed: int = 0
    save_every: int = 10
    keep_checkpoints: int = 3
    log_samples: int = 4
    # Memory (see README "Memory"): master weights / Adam moments dtype (model.dtype is the
    # compute dtype; "bfloat16" here is pure bf16 training, lossy: small updates round away);
    # per-layer rematerialisation; tokens per chunk of the lm_head + log-softmax (the fused
    # update cuts the vocabulary instead, into slices holding as many float32 logits:
    # das_jax.rl.head_logprobs); query rows per attention chunk; check the memory plan before
    # loading weights (device_memory_gb: None reads the device).
    master_dtype: str = _choices("float32", "bfloat16", default="float32")
    remat: str = _choices("none", "full", "dots", default="full")
    logits_chunk: int = 1024
    attention_chunk: int = 1024
    memory_check: bool = True
    device_memory_gb: Optional[float] = None
    # On one device, when the whole batch is one shared-prompt packed micro-batch: AdamW applied
    # layer by layer inside the backward pass (das_jax.rl.fused_update; two backward passes for
    # the gradient clip), so the whole gradient (one float32 copy of the model) never exists;
    # same math; it keeps each layer's input and recomputes the layer whatever `remat` says.
    # false: the gradient, then the update (faster: one backward pass instead of two).
    fused_update: bool = True
    # Time: no forward / backward pass for rows whose advantage is 0 (groups with equal rewards);
    # exact for the grpo / dr_grpo / dapo losses at beta 0 (ignored otherwise); the entropy and
    # clip metrics are then over the rows trained on.
    skip_zero_advantage: bool = False
    # Asynchronous GRPO (das_jax.rl.async_rollouts): the rollouts of step t + async_steps are
    # generated from the params of step t while step t's update runs (0: the synchronous loop,
    # rollout then update). A step's rollouts are at most async_steps policy versions old;
    # grpo.importance_sampling_cap bounds the off-policy correction.
    async_steps: int = 0
    # With async_steps > 0 and the rollout colocated with the update (mesh.rollout_devices: 0):
    # true runs a rollout and an update at once (their programs share the devices: on a CPU the
    # cores, where neither side's programs keep both cores busy alone); false lets a whole
    # rollout and a whole update take turns (only the host work of a step overlaps: rewards,
    # logging). Ignored with rollout devices of their own (the two sides always run at once).
    async_overlap: bool = True
    # Online draft head training (das_jax.draft_head.online; needs draft_head.path, the head to
    # start from): each step also trains the head on the step's rollouts with the loss
    # draft_loss_weight x EAGLE-3's draft loss, read from the rollout params' features detached
    # (the policy's loss, gradient and update are unchanged); its own AdamW at
    # draft_learning_rate (constant) with a global-norm clip of draft_max_grad_norm. The head
    # drafts in the next rollout with its new params, is checkpointed with the run and written
    # to <output_dir>/draft_head.safetensors at each checkpoint. 0 keeps the head frozen.
    draft_loss_weight: float = 0.0
    draft_learning_rate: float = 3e-4
    draft_max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation (das_jax.rl.evaluate): greedy accuracy on `num_problems` problems the
    run never trains on (0 disables), at step 0, every `every` steps (0: only at the start and
    the end) and at the last step; max_new_tokens: the response budget (None: rollout's)."""

    num_problems: int = 0
    every: int = 0
    max_new_tokens: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class RewardsSection:
    """Code rewards (`das_jax.rl.rewards.sandbox`). sandbox: isolated (Linux namespaces; code
    rewards refuse to start where they are unavailable) | unisolated (accept the weaker Landlock +
    seccomp sandbox knowingly where namespaces are unavailable); workers: samples judged in parallel
    (null: the CPU count); timeout_s: CPU seconds per sample and sandbox; memory_mb: per sandbox."""

    sandbox: str = _choices("isolated", "unisolated", default="isolated")
    workers: Optional[int] = None
    timeout_s: float = 5.0
    memory_mb: int = 1024


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh training runs on (`das_jax.parallel.sharding`): the size of each named
    axis; -1 (at most one axis) takes the remaining devices. data: pure data parallelism (params
    replicated); fsdp: data parallelism with params, master weights, gradients and Adam moments
    sharded (FSDP); tensor: heads / MLP / vocabulary sharded. The product must equal the number of
    devices of the run (all processes' devices together) less `rollout_devices`. Default: every
    device on fsdp.

    rollout_devices: 0 (colocated: the rollout engine and the train step share every device) or
    the number of devices, the last ones of a one-process run, that only generate (disaggregated:
    the train mesh is over the others; the params reach the rollout devices device to device
    after each update). With train.async_steps > 0 the two sides then run at the same time."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rollout_devices: int = 0


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (`jax.distributed.initialize`, before JAX touches a device). Each key left
    null is read from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID); with neither, the run is single-process. coordinator_address: host:port of
    process 0; num_processes; process_id: this process (0..num_processes-1; not saved with the
    run's config.yaml); initialization_timeout: seconds to wait for every process to connect;
    heartbeat_timeout: seconds after which a silent process counts as dead and every other
    process exits with an error; cluster_detection: with none of the three set, let JAX detect
    the cluster (`jax.distributed.initialize()` without arguments: SLURM, Open MPI, Kubernetes
    ...), which starts one process per task and binds each to its local GPU (one process per
    GPU)."""

    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    initialization_timeout: int = 300
    heartbeat_timeout: int = 100
    cluster_detection: bool = False


@dataclasses.dataclass(frozen=True)
class DraftHeadSection:
    """An EAGLE-3 draft head (`das_jax.draft_head`) drafting beside the `drafter:` history
    drafter. path: the head file (`das-jax draft-head fit TRACE --out HEAD.safetensors`, fitted
    to this run's model); null: no head. steps: the head's draft tokens per verify step (at
    most the widest `rollout.draft_widths` - 1 are used). scale: the starting value of the head's
    calibration factor: each row takes the head's draft when factor x the sum of its path
    probabilities exceeds the history draft's (calibrated the same way), the factors learned
    from the tokens the steps emit (`das_jax.draft_head.HeadDrafts`; `das-jax bench drafter
    --trace T --head H --head-scale S` measures a good start). With `drafter: none` the head
    drafts alone. dtype: the dtype of the head's matrices where it drafts, float32 or bfloat16
    (half the bytes each draft call reads; products accumulate in float32; drafts may differ,
    rollouts do not: the verify rule decides every token); null: `model.dtype`. Fitting and
    online training keep float32 weights. Runs on one rollout engine per process
    (rollout.replicas 1)."""

    path: Optional[str] = None
    steps: int = 3
    scale: float = 2.0
    dtype: Optional[str] = _choices("float32", "bfloat16", default=None)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run. drafter: a speculation name (`das_jax.speculation.speculation_names()`: none,
    ngram, suffix, suffix-global, das, das-unlimited, and any registered by the user);
    platform: cpu | gpu | tpu (sets JAX_PLATFORMS before JAX initialises; None leaves JAX's own
    choice); compilation_cache: JAX's persistent compilation cache, so a second run or a
    `--resume` loads compiled programs instead of compiling them again: "default" (the folder
    `jax-compilation-cache` in the das-jax cache, `$DAS_JAX_CACHE`, default `~/.cache/das-jax`), a
    directory, or null to turn it off; `JAX_COMPILATION_CACHE_DIR` in the environment wins."""

    output_dir: str = "runs/default"
    drafter: str = _registry_choices(SPECULATION.names, default="das")
    platform: Optional[str] = _choices("cpu", "gpu", "tpu", default=None)
    compilation_cache: Optional[str] = "default"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)
    das: DASSection = dataclasses.field(default_factory=DASSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    rewards: RewardsSection = dataclasses.field(default_factory=RewardsSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
    draft_head: DraftHeadSection = dataclasses.field(default_factory=DraftHeadSection)
