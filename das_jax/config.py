"""Run configuration: frozen, nested dataclasses loaded from YAML plus `--set a.b=v` overrides.

    cfg = load_config("configs/gsm8k.yaml", ["grpo.beta=0.04", "rollout.draft_widths=[1,8]"])
    save_config(cfg, "runs/x/config.yaml")

Every YAML key is validated: unknown keys are rejected with the list of valid keys (and a "did you
mean"), values are type-checked against the field's annotation (ints are accepted for floats,
lists become tuples, `null` only where the field is optional), enum-like fields are checked
against their choices (fixed, or read from a registry when first needed: `drafter` from the
speculation registry, `data.kind` from the dataset registry), and cross-field constraints are
checked once the whole config is built. This module does not import JAX (so `platform` can still
be applied before JAX initialises; see `apply_platform`). GRPO field names follow TRL's
`GRPOConfig` where one exists.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from das_jax.engine.cost_model import CostModelConfig
from das_jax.engine.das_policy import DASConfig


class ConfigError(ValueError):
    """An invalid config (names the offending key and what would be accepted)."""


def _choices(*values, default):
    return dataclasses.field(default=default, metadata={"choices": tuple(values)})


def _registry_choices(names_fn, default):
    """A field whose valid values come from a registry, read when a config is validated (so a
    name registered by a user module imported before is valid)."""
    return dataclasses.field(default=default, metadata={"choices": names_fn})


def _speculation_names() -> tuple[str, ...]:
    from das_jax.rollout.speculation import speculation_names
    return speculation_names()


def _dataset_kinds() -> tuple[str, ...]:
    from das_jax.data.registry import DATASET_KINDS
    return DATASET_KINDS


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

    kind: str = _registry_choices(_dataset_kinds, default="arithmetic")
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
    speculation (README, "Exact mode"; costs some rollout time); verify: packed (each row's
    own draft tokens as flat slots, the default) or padded (every row padded to the step's
    widest draft); same tokens either way. prefill: packed (the admitted prompts concatenated
    into flat token slots, dense work on their total length, the default) or padded (prompts
    padded to a power-of-two length); same first tokens and KV cache either way."""

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
    verify: str = _choices("packed", "padded", default="packed")
    prefill: str = _choices("packed", "padded", default="packed")
    # Compile every packed verify program a rollout can reach before its first step
    # (das_jax.engine.Engine.precompile): the compile is one-off, never inside a later step.
    precompile: bool = False


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
    # A registered advantage estimator (`das_jax.rl.advantages.register_advantage`).
    advantage_estimator: str = "grpo"

    @property
    def batch_size(self) -> int:
        """Sequences per generation batch (prompts_per_step * num_generations)."""
        return self.prompts_per_step * self.num_generations


@dataclasses.dataclass(frozen=True)
class DASSection:
    """Speculation settings (the speculation itself is chosen by the top-level `drafter` key).

    window: epochs of rollout history kept per problem (suffix drafters).
    max_depth: suffix-tree depth (longest match + draft), in tokens.
    min_token_prob: a suffix draft stops when its path probability drops below this.
    policy: the DAS length-aware policy (`das_jax.engine.DASConfig`): short_quantile,
      long_quantile, short_threshold, long_threshold (length classes), weight_short,
      weight_medium, weight_long (class weights sharing the per-step cost), budget_short,
      budget_medium, budget_long (optional per-class caps), min_history, length_history,
      acceptance_ema, explore_every, unlimited.
    cost_model: the step-cost model the policy plans with (`das_jax.engine.CostModelConfig`):
      c_base, c_tok, c_kv, source (cpu | h100-7b | h200-7b | PATH.json instead of the three
      coefficients), history, calibrate, calibrate_kv_lens, calibrate_repeats, compile_s
      (prior seconds per new verify-step compile, until one is measured).
    """

    window: int = 16
    max_depth: int = 32
    min_token_prob: float = 0.1
    policy: DASConfig = dataclasses.field(default_factory=DASConfig)
    cost_model: CostModelConfig = dataclasses.field(default_factory=CostModelConfig)


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


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation (das_jax.rl.evaluate): greedy accuracy on `num_problems` problems the
    run never trains on (0 disables), at step 0, every `every` steps (0: only at the start and
    the end) and at the last step; max_new_tokens: the response budget (None: rollout's)."""

    num_problems: int = 0
    every: int = 0
    max_new_tokens: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh training runs on (`das_jax.parallel.sharding`): the size of each named
    axis; -1 (at most one axis) takes the remaining devices. data: pure data parallelism (params
    replicated); fsdp: data parallelism with params, master weights, gradients and Adam moments
    sharded (FSDP); tensor: heads / MLP / vocabulary sharded. The product must equal the number of
    devices of the run (all processes' devices together). Default: every device on fsdp."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (`jax.distributed.initialize`, before JAX touches a device). Each key left
    null is read from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID); with neither, the run is single-process. coordinator_address: host:port of
    process 0; num_processes; process_id: this process (0..num_processes-1; not saved with the
    run's config.yaml); initialization_timeout: seconds to wait for every process to connect;
    heartbeat_timeout: seconds after which a silent process counts as dead and every other
    process exits with an error."""

    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    initialization_timeout: int = 300
    heartbeat_timeout: int = 100


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run. drafter: a speculation name (`das_jax.rollout.speculation_names()`: none,
    ngram, suffix, suffix-global, das, das-unlimited, and any registered by the user);
    platform: cpu | gpu | tpu (sets JAX_PLATFORMS before JAX initialises; None leaves JAX's own
    choice)."""

    output_dir: str = "runs/default"
    drafter: str = _registry_choices(_speculation_names, default="das")
    platform: Optional[str] = _choices("cpu", "gpu", "tpu", default=None)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)
    das: DASSection = dataclasses.field(default_factory=DASSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)


# ----- removed keys ----------------------------------------------------------------------------------
# Keys that had no effect and were removed: (section, key) -> (the old default, what to do instead).
# A config.yaml written before the removal holds the old default, which is dropped (it asked for
# nothing); any other value is rejected with the hint.
_REMOVED_KEYS = {
    ("train", "resume"): (None, "resume a run with `das-jax train --resume RUN_DIR`"),
    ("train", "log_every"): (1, "every step is logged to metrics.jsonl"),
    ("das", "enabled"): (True, "choose the speculation with the top-level key `drafter` "
                               "(drafter: none disables it)"),
}


def _removed_key_error(section: str, key: str) -> ConfigError:
    return ConfigError(f"{section}.{key} is no longer a config key; "
                       f"{_REMOVED_KEYS[(section, key)][1]}")


def _drop_removed_keys(raw: dict) -> dict:
    out = dict(raw)
    for (section, key), (old_default, _) in _REMOVED_KEYS.items():
        sec = out.get(section)
        if isinstance(sec, Mapping) and key in sec:
            if sec[key] != old_default or isinstance(sec[key], bool) != isinstance(old_default,
                                                                                   bool):
                raise _removed_key_error(section, key)
            out[section] = {k: v for k, v in sec.items() if k != key}
    return out


# ----- generic dataclass <-> dict with validation ------------------------------------------------

def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is tuple:
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against annotation `tp` (converting int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            try:
                return _coerce(value, inner[0], key)
            except ConfigError:
                raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} "
                                  f"({type(value).__name__})") from None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} "
                              f"({type(value).__name__})")
        (item_tp, *_) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads `1e-6` (no dot) as a string: accept numeric strings.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected float, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected int, got {value!r} ({type(value).__name__})")
        return value
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r} "
                              f"({type(value).__name__})")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover


def _unknown_key_error(cls, name: str, prefix: str) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    where = f"section {prefix[:-1]!r}" if prefix else "the top level"
    return ConfigError(f"unknown key {prefix + name!r}{hint}; valid keys in {where}: "
                       f"{', '.join(valid)}")


def _from_dict(cls, raw: Mapping[str, Any], prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in raw.items():
        if not isinstance(name, str) or name not in fields:
            raise _unknown_key_error(cls, str(name), prefix)
        key = prefix + name
        value = _coerce(value, hints[name], key)
        choices = fields[name].metadata.get("choices")
        if callable(choices):
            choices = choices()
        if choices is not None and value is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: invalid value {value!r}{hint}; choices: "
                              f"{', '.join(map(str, choices))}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own checks (e.g. DASConfig's)
        raise ConfigError(f"{prefix[:-1] or 'config'}: {e}") from None


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    return value


# ----- cross-field validation ---------------------------------------------------------------------

def _check(cond: bool, msg: str):
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config) -> Config:
    """Checks cross-field constraints and resolves defaults that depend on other sections
    (`grpo.max_completion_length`). Returns the resolved config."""
    r, g, t, d, das = cfg.rollout, cfg.grpo, cfg.train, cfg.data, cfg.das
    _check(cfg.output_dir.strip() != "",
           f"output_dir is empty ({cfg.output_dir!r}); set it to the run's own directory, e.g. "
           "--set output_dir=runs/my-run")
    _check(r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}")
    _check(r.temperature > 0,
           f"rollout.temperature must be > 0 for training, got {r.temperature}: the GRPO "
           "importance ratio and the log-probs are taken under the sampling distribution, which "
           "greedy decoding does not have; use a small temperature (e.g. 0.1) instead, or "
           "'das-jax generate --temperature 0' for greedy samples")
    _check(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _check(r.top_k >= 0, f"rollout.top_k must be >= 0 (0 disables), got {r.top_k}")
    _check(r.max_slots >= 1, f"rollout.max_slots must be >= 1, got {r.max_slots}")
    _check(r.replicas is None or r.replicas >= 1,
           f"rollout.replicas must be >= 1 (or unset: one per local device), got {r.replicas}")
    _check(r.max_cache_len > r.max_new_tokens,
           f"rollout.max_cache_len={r.max_cache_len} must exceed rollout.max_new_tokens="
           f"{r.max_new_tokens} (the cache holds prompt + completion)")
    _check(len(r.draft_widths) >= 1 and all(w >= 1 for w in r.draft_widths),
           "rollout.draft_widths must be a non-empty list of positive ints, got "
           f"{list(r.draft_widths)}")
    _check(all(s >= 0 for s in r.stop_token_ids), "rollout.stop_token_ids must be >= 0")

    _check(g.num_generations >= 2,
           f"grpo.num_generations must be >= 2 (group-relative advantages need a group), got "
           f"{g.num_generations}")
    _check(g.prompts_per_step >= 1, f"grpo.prompts_per_step must be >= 1, got {g.prompts_per_step}")
    _check(g.beta >= 0, f"grpo.beta must be >= 0, got {g.beta}")
    _check(0 <= g.epsilon < 1, f"grpo.epsilon must be in [0, 1), got {g.epsilon}")
    _check(g.epsilon_high >= g.epsilon,
           f"grpo.epsilon_high={g.epsilon_high} must be >= grpo.epsilon={g.epsilon} (clip-higher)")
    _check(g.num_iterations >= 1, f"grpo.num_iterations must be >= 1, got {g.num_iterations}")
    _check(g.learning_rate >= 0, f"grpo.learning_rate must be >= 0, got {g.learning_rate}")
    _check(g.weight_decay >= 0, f"grpo.weight_decay must be >= 0, got {g.weight_decay}")
    _check(g.warmup_steps >= 0, f"grpo.warmup_steps must be >= 0, got {g.warmup_steps}")
    _check(g.max_grad_norm is None or g.max_grad_norm >= 0,
           f"grpo.max_grad_norm must be >= 0 or null, got {g.max_grad_norm}")
    _check(g.micro_batch_size >= 1, f"grpo.micro_batch_size must be >= 1, got {g.micro_batch_size}")
    # A batch that is not a multiple of micro_batch_size is handled (padded with zero-weight rows),
    # but a micro-batch larger than the batch is only wasted work.
    _check(g.micro_batch_size <= g.batch_size,
           f"grpo.micro_batch_size={g.micro_batch_size} exceeds the batch of prompts_per_step * "
           f"num_generations = {g.batch_size} sequences")
    _check(len(g.reward_funcs) >= 1, "grpo.reward_funcs must name at least one reward function")
    _check_reward_names(g.reward_funcs)
    _check(g.reward_weights is None or len(g.reward_weights) == len(g.reward_funcs),
           f"grpo.reward_weights has {len(g.reward_weights or ())} entries but grpo.reward_funcs "
           f"has {len(g.reward_funcs)}")
    if g.max_completion_length is None:
        g = dataclasses.replace(g, max_completion_length=r.max_new_tokens)
    _check(g.max_completion_length == r.max_new_tokens,
           f"grpo.max_completion_length={g.max_completion_length} differs from "
           f"rollout.max_new_tokens={r.max_new_tokens}; completions are generated up to "
           "rollout.max_new_tokens, so set that one (or both to the same value)")

    _check(d.num_problems >= 1, f"data.num_problems must be >= 1, got {d.num_problems}")
    _check_data_kind_fields(d)
    _check(d.limit is None or d.limit >= 1, f"data.limit must be >= 1 or null, got {d.limit}")
    _check(d.kind == "arithmetic" or not d.task_kwargs(),
           f"data.{', data.'.join(d.task_kwargs())} only apply to data.kind=arithmetic (got kind "
           f"{d.kind!r}); remove them")
    lo, hi = d.min_steps or 1, d.max_steps or 5
    _check(1 <= lo <= hi <= 5, f"data.min_steps / data.max_steps must satisfy 1 <= min_steps <= "
           f"max_steps <= 5, got {d.min_steps}, {d.max_steps}")
    if d.templates is not None:
        from das_jax.data.synthetic import ARITHMETIC_TEMPLATES
        bad = [t for t in d.templates if t not in ARITHMETIC_TEMPLATES]
        _check(bool(d.templates) and not bad, f"data.templates: unknown {bad or 'empty list'}; "
               f"choices: {', '.join(ARITHMETIC_TEMPLATES)}")
    _check(das.window >= 1, f"das.window must be >= 1, got {das.window}")
    _check(das.max_depth >= 1, f"das.max_depth must be >= 1, got {das.max_depth}")
    _check(0 <= das.min_token_prob <= 1, f"das.min_token_prob must be in [0, 1], got "
           f"{das.min_token_prob}")
    _check(t.steps >= 0, f"train.steps must be >= 0, got {t.steps}")
    e = cfg.eval
    _check(e.num_problems >= 0, f"eval.num_problems must be >= 0 (0 disables), got "
           f"{e.num_problems}")
    _check(e.every >= 0, f"eval.every must be >= 0 (0: only at the start and end), got {e.every}")
    _check(e.max_new_tokens is None or 1 <= e.max_new_tokens < r.max_cache_len,
           f"eval.max_new_tokens must be null or in [1, rollout.max_cache_len={r.max_cache_len}), "
           f"got {e.max_new_tokens}")
    _check(t.save_every >= 0, f"train.save_every must be >= 0 (0 disables), got {t.save_every}")
    _check(t.log_samples >= 0, f"train.log_samples must be >= 0 (0 disables), got {t.log_samples}")
    _check(r.kv_memory_gb is None or r.kv_memory_gb > 0,
           f"rollout.kv_memory_gb must be > 0 or null, got {r.kv_memory_gb}")
    _check(0 < r.kv_memory_fraction <= 1,
           f"rollout.kv_memory_fraction must be in (0, 1], got {r.kv_memory_fraction}")
    _check(t.logits_chunk >= 1 and t.attention_chunk >= 1,
           "train.logits_chunk and train.attention_chunk must be >= 1")
    _check(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    _check_mesh(cfg.mesh)
    _check_distributed(cfg.distributed)
    return dataclasses.replace(cfg, grpo=g)


def _check_mesh(m: MeshSection) -> None:
    sizes = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    bad = {k: v for k, v in sizes.items() if v == 0 or v < -1}
    _check(not bad, f"mesh.{next(iter(bad), '')}={next(iter(bad.values()), '')}: an axis size "
           "must be >= 1, or -1 for the remaining devices")
    rest = [k for k, v in sizes.items() if v == -1]
    _check(len(rest) <= 1, f"mesh: only one axis may be -1 (the remaining devices), got "
           f"{', '.join('mesh.' + k for k in rest)}; give the others explicit sizes")


def _check_distributed(d: DistributedSection) -> None:
    _check(d.num_processes is None or d.num_processes >= 1,
           f"distributed.num_processes must be >= 1 or null, got {d.num_processes}")
    _check(d.process_id is None or d.process_id >= 0,
           f"distributed.process_id must be >= 0 or null, got {d.process_id}")
    _check(d.process_id is None or d.num_processes is None or d.process_id < d.num_processes,
           f"distributed.process_id={d.process_id} must be < distributed.num_processes="
           f"{d.num_processes}")
    _check(d.initialization_timeout >= 1 and d.heartbeat_timeout >= 1,
           "distributed.initialization_timeout and distributed.heartbeat_timeout must be >= 1 "
           "(seconds)")


def _check_reward_names(names: Sequence[str]) -> None:
    from das_jax.rl.rewards.registry import REWARD_FUNCTIONS  # no jax; cheap
    for name in names:
        if name not in REWARD_FUNCTIONS:
            close = difflib.get_close_matches(name, list(REWARD_FUNCTIONS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"grpo.reward_funcs: unknown reward function {name!r}{hint}; valid "
                              f"names: {', '.join(sorted(REWARD_FUNCTIONS))}")


_FILE_KINDS = ("gsm8k", "math", "humaneval")
_DATA_DEFAULTS = {"num_problems": 64, "seed": 0}


def _check_data_kind_fields(d: DataSection) -> None:
    kind = str(d.kind).lower().strip()
    if kind == "arithmetic":
        _check(d.path is None, f"data.path={d.path!r} has no effect with data.kind='arithmetic' "
                               "(generated in memory); remove data.path, or set data.kind to the "
                               "file's kind (gsm8k, math, humaneval)")
        return
    if kind in _FILE_KINDS:
        _check(d.path is not None, f"data.kind={d.kind!r} reads a local .jsonl file: set "
                                   "data.path=FILE")
    for name, default in _DATA_DEFAULTS.items():
        value = getattr(d, name)
        _check(value == default,
               f"data.{name}={value} applies to data.kind='arithmetic' only and has no effect "
               f"with data.kind={d.kind!r}; remove it" +
               (" (data.limit keeps the first N problems)" if name == "num_problems" else
                " (train.seed sets the order in which problems are visited)"))


# ----- public API ---------------------------------------------------------------------------------

def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b=v"` -> (["a", "b"], yaml.safe_load("v")). An empty value is the empty string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value "
                          "(e.g. grpo.beta=0.04)")
    key, _, raw = text.partition("=")
    path = [p.strip() for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"override {text!r}: empty key component in {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None
    return path, value


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Applies `a.b=v` overrides to a raw (unvalidated) nested dict; returns a new dict."""
    out = _deep_copy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node, cls, prefix = out, Config, ""
        for i, name in enumerate(path):
            fields = {f.name: f for f in dataclasses.fields(cls)}
            if name not in fields:
                if (prefix[:-1], name) in _REMOVED_KEYS:
                    raise _removed_key_error(prefix[:-1], name)
                raise _unknown_key_error(cls, name, prefix)
            sub = typing.get_type_hints(cls)[name]
            if i == len(path) - 1:
                node[name] = value
            else:
                if not dataclasses.is_dataclass(sub):
                    raise ConfigError(f"override {text!r}: {prefix}{name} is not a section")
                node = node.setdefault(name, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {text!r}: {prefix}{name} is not a mapping")
                cls, prefix = sub, prefix + name + "."
    return out


def _deep_copy(x):
    if isinstance(x, dict):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x


def config_from_dict(raw: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Config:
    """Validates a raw nested dict (as read from YAML), applies overrides, returns a `Config`."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(raw).__name__}")
    raw = apply_overrides(_drop_removed_keys(dict(raw)), overrides)
    return validate(_from_dict(Config, raw))


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Loads a YAML config file (None: all defaults), applies `--set` overrides, validates.

    Raises:
      ConfigError: unreadable/invalid YAML, unknown keys, wrong types, invalid choices or
        cross-field constraint violations; the message names the key and where the bad value
        came from (the file, or the `--set KEY=VALUE` that made the config invalid).
    """
    raw: Any = {}
    if path is not None:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise ConfigError(f"{path}:{line}: invalid UTF-8; save the config as UTF-8") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
    try:
        return config_from_dict(raw, overrides)
    except ConfigError as e:
        raise ConfigError(_blame(raw, path, overrides, str(e))) from None


def _blame(raw: Any, path, overrides: Sequence[str], msg: str) -> str:
    """`msg` prefixed with what holds the bad value: the config file, when it is invalid on its
    own, else the first `--set KEY=VALUE` after which the config fails with this message."""
    if msg.startswith("override "):
        return msg                       # a malformed --set names itself
    where = f"{path}: " if path is not None else ""
    for k in range(len(overrides) + 1):
        try:
            config_from_dict(raw, overrides[:k])
        except ConfigError as e:
            if str(e) == msg:
                return f"--set {overrides[k - 1]}: {msg}" if k else where + msg
    return where + msg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists), suitable for YAML/JSON; round-trips through
    `config_from_dict`."""
    return _to_plain(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the resolved config as YAML (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


_PLATFORM_ENV = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}


def apply_platform(cfg: Config) -> None:
    """Sets `JAX_PLATFORMS` from `cfg.platform` (no-op when None), then initialises JAX on it, so
    a platform this machine lacks is reported here, before any model is loaded. Must run before
    JAX creates its backends.

    Raises:
      ConfigError: JAX is already initialised on another platform, or JAX cannot use the
        requested platform on this machine (no GPU / TPU, or a jax build without its support).
    """
    if cfg.platform is None:
        return
    want = _PLATFORM_ENV[cfg.platform]
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge
            initialised = bool(getattr(xla_bridge, "_backends", {}))
        except Exception:  # pragma: no cover - private API moved
            initialised = False
        if initialised:
            import jax
            current = jax.default_backend()
            if current != want and not (want == "gpu" and current in ("cuda", "rocm")):
                raise ConfigError(
                    f"platform={cfg.platform!r} but JAX is already initialised on {current!r}; "
                    "set the platform before anything touches JAX (or export JAX_PLATFORMS)")
            return
    os.environ["JAX_PLATFORMS"] = want
    import jax
    try:
        jax.devices()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"platform={cfg.platform!r}: JAX cannot use a {cfg.platform.upper()} on this machine "
            f"({first}); set platform: cpu (or null to let JAX choose), or install a jax build "
            f"with {cfg.platform.upper()} support (e.g. pip install -U 'jax[cuda12]')") from None
