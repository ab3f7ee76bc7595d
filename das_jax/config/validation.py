"""Cross-section validation of a run config: the constraints no single field states alone, and the
defaults that depend on another section (`grpo.max_completion_length`). Reward names are read
from `das_jax.registry.REWARDS`."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Sequence

from das_jax.config.schema import (INFINITE_OK, Config, ConfigError, DataSection,
                                   DistributedSection, MeshSection)
from das_jax.data.synthetic import ARITHMETIC_TEMPLATES
from das_jax.json_values import is_int
from das_jax.registry import REWARDS

__all__ = ["validate"]


def _check(cond: bool, msg: str):
    if not cond:
        raise ConfigError(msg)


def _check_finite(section, prefix: str = "") -> None:
    """Refuses a NaN or infinite float anywhere in `section` (every float field of every section,
    nested ones included, and every item of a list of floats): no config value means "not a
    number", and infinity only where a key documents it (`schema.INFINITE_OK`). Runs after the
    keys' own range checks, so a NaN those refuse keeps their message."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_finite(value, key + ".")
            continue
        items = ([(f"{key}[{i}]", v) for i, v in enumerate(value)]
                 if isinstance(value, tuple) else [(key, value)])
        for name, v in items:
            if not isinstance(v, float) or math.isfinite(v):
                continue
            if math.isinf(v) and key in INFINITE_OK:
                continue
            what = "a number (inf allowed)" if key in INFINITE_OK else "a finite number"
            default = f.default if name == key else dataclasses.MISSING
            hint = (f" (the default is {default!r})" if isinstance(default, float) else
                    " or null (the default)" if default is None else "")
            raise ConfigError(f"{name} must be {what}, got {v}; set it to {what}{hint}")


def _check_unique(values: Sequence, key: str, why: str) -> None:
    """Refuses a list that names an entry twice (`why`: what a repeat would mean / the fix)."""
    seen = set()
    for v in values:
        _check(v not in seen, f"{key} lists {v!r} twice ({list(values)}); {why}")
        seen.add(v)


def validate(cfg: Config) -> Config:
    """Checks cross-field constraints and resolves defaults that depend on other sections
    (`grpo.max_completion_length`). Returns the resolved config."""
    r, g, t, d, das = cfg.rollout, cfg.grpo, cfg.train, cfg.data, cfg.das
    _check(cfg.model.source.strip() != "",
           f"model.source is empty ({cfg.model.source!r}); set it to a named model source (see "
           "`das-jax models`) or the path of an HF model directory or a GGUF file")
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
    _check(r.page_size >= 1, f"rollout.page_size must be >= 1, got {r.page_size}")
    _check(r.max_prefill_tokens is None or r.max_prefill_tokens >= 1,
           f"rollout.max_prefill_tokens must be >= 1 (or null: one prefill call per "
           f"admission), got {r.max_prefill_tokens}")
    _check(r.decode_steps >= 1,
           f"rollout.decode_steps must be >= 1 (1: one decode step per device call), got "
           f"{r.decode_steps}")
    _check(r.replicas is None or r.replicas >= 1,
           f"rollout.replicas must be >= 1 (or unset: one per local device), got {r.replicas}")
    _check(r.max_cache_len > r.max_new_tokens,
           f"rollout.max_cache_len={r.max_cache_len} must exceed rollout.max_new_tokens="
           f"{r.max_new_tokens} (the cache holds prompt + completion)")
    _check(all(is_int(w) and w >= 1 for w in r.wide_row_buckets),
           "rollout.wide_row_buckets must be a list of ints >= 1 ([] for one query block), got "
           f"{list(r.wide_row_buckets)}")
    _check(len(r.draft_widths) >= 1 and all(w >= 1 for w in r.draft_widths),
           "rollout.draft_widths must be a non-empty list of positive ints, got "
           f"{list(r.draft_widths)}")
    _check(1 in r.draft_widths,
           f"rollout.draft_widths must include 1 (the plain decoding step every row can fall "
           f"back to), got {list(r.draft_widths)}; e.g. {sorted({1, *r.draft_widths})}")
    _check_unique(r.draft_widths, "rollout.draft_widths",
                  "each width is one compiled verify program: list each once")
    _check_unique(r.wide_row_buckets, "rollout.wide_row_buckets",
                  "each bucket is one compiled program: list each once")
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
    for name in ("adam_beta1", "adam_beta2"):
        b = getattr(g, name)
        _check(0 <= b < 1, f"grpo.{name} must be in [0, 1) (Adam's moment decay), got {b}; "
                           "the defaults are adam_beta1 0.9, adam_beta2 0.999")
    _check(g.adam_epsilon > 0,
           f"grpo.adam_epsilon must be > 0 (it keeps Adam's update finite), got "
           f"{g.adam_epsilon}; the default is 1e-08")
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
    _check_unique(g.reward_funcs, "grpo.reward_funcs",
                  "list each reward function once and weight it with grpo.reward_weights "
                  "instead (a repeat would compute and log the same reward twice)")
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
        bad = [t for t in d.templates if t not in ARITHMETIC_TEMPLATES]
        _check(bool(d.templates) and not bad, f"data.templates: unknown {bad or 'empty list'}; "
               f"choices: {', '.join(ARITHMETIC_TEMPLATES)}")
        _check_unique(d.templates, "data.templates",
                      "list each template once (a set of templates, not weights)")
    _check(das.window >= 1, f"das.window must be >= 1, got {das.window}")
    _check(das.max_depth >= 1, f"das.max_depth must be >= 1, got {das.max_depth}")
    _check(das.drafter_threads >= 1,
           f"das.drafter_threads must be >= 1 (1: draft on the rollout's thread), got "
           f"{das.drafter_threads}")
    _check("problem" in das.scopes and set(das.scopes) <= {"problem", "request", "global"},
           f"das.scopes must hold 'problem' and only problem, request, global; got "
           f"{list(das.scopes)}")
    _check_unique(das.scopes, "das.scopes", "list each scope once")
    _check(das.global_rollouts >= 1, f"das.global_rollouts must be >= 1, got "
           f"{das.global_rollouts}")
    _check(das.global_below >= 0, f"das.global_below must be >= 0 (0: never search the global "
           f"trie), got {das.global_below}")
    _check(das.request_below >= 0, f"das.request_below must be >= 0 (0: never search the "
           f"request trie), got {das.request_below}")
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
    _check(t.async_steps >= 0,
           f"train.async_steps must be >= 0 (0: synchronous rollout then update), got "
           f"{t.async_steps}")
    _check(g.importance_sampling_cap >= 1,
           f"grpo.importance_sampling_cap must be >= 1 (the truncated importance weight's upper "
           f"bound), got {g.importance_sampling_cap}")
    _check(t.log_samples >= 0, f"train.log_samples must be >= 0 (0 disables), got {t.log_samples}")
    for key, seed in (("train.seed", t.seed), ("data.seed", d.seed)):   # numpy's seed range
        _check(0 <= seed < 2**32, f"{key} must be an integer in [0, 2**32), got {seed}; e.g. 0")
    _check(r.kv_memory_gb is None or r.kv_memory_gb > 0,
           f"rollout.kv_memory_gb must be > 0 or null, got {r.kv_memory_gb}")
    _check(t.device_memory_gb is None or t.device_memory_gb > 0,
           f"train.device_memory_gb must be > 0 (one device's memory in GB) or null (read the "
           f"device), got {t.device_memory_gb}")
    _check(0 < r.kv_memory_fraction <= 1,
           f"rollout.kv_memory_fraction must be in (0, 1], got {r.kv_memory_fraction}")
    _check(t.logits_chunk >= 1 and t.attention_chunk >= 1,
           "train.logits_chunk and train.attention_chunk must be >= 1")
    _check(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    _check_mesh(cfg.mesh)
    _check_distributed(cfg.distributed)
    _check_draft_head(cfg.draft_head)
    _check(t.draft_loss_weight >= 0,
           f"train.draft_loss_weight must be >= 0 (0: the draft head stays frozen), got "
           f"{t.draft_loss_weight}")
    _check(t.draft_loss_weight == 0 or cfg.draft_head.path is not None,
           f"train.draft_loss_weight={t.draft_loss_weight} trains a draft head, but "
           "draft_head.path is null; fit one to start from with `das-jax draft-head fit TRACE "
           "--out HEAD.safetensors` and set draft_head.path, or set train.draft_loss_weight: 0")
    _check(t.draft_learning_rate > 0,
           f"train.draft_learning_rate must be > 0, got {t.draft_learning_rate}")
    _check(t.draft_max_grad_norm > 0,
           f"train.draft_max_grad_norm must be > 0, got {t.draft_max_grad_norm}")
    rw = cfg.rewards
    _check(rw.workers is None or rw.workers >= 1, f"rewards.workers must be >= 1 or null, got {rw.workers}")
    _check(rw.timeout_s > 0, f"rewards.timeout_s must be > 0 (CPU seconds), got {rw.timeout_s}")
    _check(rw.memory_mb >= 64, f"rewards.memory_mb must be >= 64, got {rw.memory_mb}")
    _check_finite(cfg)   # every float key, after the range checks above
    return dataclasses.replace(cfg, grpo=g)


def _check_draft_head(h) -> None:
    _check(h.steps >= 1, f"draft_head.steps must be >= 1 (draft tokens per step), got {h.steps}")
    _check(h.scale > 0, f"draft_head.scale must be > 0, got {h.scale}")
    _check(h.path is None or os.path.isfile(h.path),
           f"draft_head.path {h.path}: no such file; fit one with `das-jax draft-head fit TRACE "
           "--out HEAD.safetensors`, or set draft_head.path: null")


def _check_mesh(m: MeshSection) -> None:
    _check(m.rollout_devices >= 0,
           f"mesh.rollout_devices must be >= 0 (0: rollout and training share the devices), got "
           f"{m.rollout_devices}")
    sizes = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
             if f.name != "rollout_devices"}
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
    for name in names:
        if name not in REWARDS:
            close = difflib.get_close_matches(name, list(REWARDS.names()), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"grpo.reward_funcs: unknown reward function {name!r}{hint}; valid "
                              f"names: {', '.join(sorted(REWARDS.names()))}")


_FILE_KINDS = ("gsm8k", "math", "humaneval")
# the synthetic-only fields and their defaults (read from the schema, so they cannot drift)
_DATA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataSection)
                  if f.name in ("num_problems", "seed")}


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
