"""das_jax.engine: the rollout engine.

Public surface:
  Engine, RequestOutput, GenerateStats                                         (generate.py)
  add_counts: per-position counters added in place                            (outputs.py)
  EngineConfig, Request, GenerateError                                         (engine_config.py)
  DeviceExecutor (the engine's step executor)                                  (executor.py)
  Programs (the owner of every compiled program), register_program,           (programs.py)
    compiled_memory (a compiled program's bytes from XLA's memory analysis)
  VerifySpec, VerifyBatch, DecodeSpec, DecodeBatch, PrefillSpec, PrefillBatch, ShareSpec,
    ShareBatch, GatherSpec, GatherBatch, CacheSpec: the programs' typed inputs  (specs.py)
  time_verify_padded (the padded verify, timed as the benchmark's baseline)    (reference.py)
  run_schedule, prefill_layout: the host scheduler shared with the trace replay  (scheduler.py)
  PagedRows: a page pool's admission, placement, preemption and release, shared
    by the paged executor and the trace replay                                 (paged_rows.py)
  StepExecutor, StepInput, StepOutput, Prefilled, Limits: what it and an executor
    exchange                                                                   (step_io.py)
  SamplingParams, SamplingError, request_seed                                  (sampling.py)
  SpeculationPolicy, FixedPolicy, RowView, RowBatch, StepRecord, DraftPlan, plan_step,
    acceptance_length, padded_step_shape, packed_step_shape, width_for         (policy.py)
  bucket, pow2_at_least, cache_len_for, kv_len_bucket, tail_bucket, compact_rows (schedule.py)
  token_buckets, packed_width, step_shape_fn, StepShape, shape_key, wide_rows_for,
    full_width_rows, pages_read_kv, branch_rows_for,
    verify_token_buckets, precompile_token_buckets, PromptRows (prompt sharing's row
    bookkeeping)                                                               (schedule.py)

The jitted programs (`prefill_packed`, `share_prompt_rows`, `verify_packed`, `gather_rows`) are in
`step.py`; the padded steps, the tests' oracle, in `reference.py`. Names are imported
lazily (PEP 562) so `das_jax.cli.generate` registers without importing jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "Engine": "generate", "EngineConfig": "engine_config", "Request": "engine_config",
    "RequestOutput": "generate", "GenerateStats": "generate", "add_counts": "outputs", "GenerateError": "engine_config",
    "SamplingParams": "sampling", "SamplingError": "sampling", "request_seed": "sampling",
    "SpeculationPolicy": "policy", "FixedPolicy": "policy", "RowView": "policy",
    "RowBatch": "policy",
    "StepRecord": "policy", "DraftPlan": "policy", "plan_step": "policy",
    "acceptance_length": "policy", "padded_step_shape": "policy", "packed_step_shape": "policy",
    "width_for": "policy",
    "bucket": "schedule", "pow2_at_least": "schedule", "cache_len_for": "schedule",
    "kv_len_bucket": "schedule", "tail_bucket": "schedule", "compact_rows": "schedule",
    "token_buckets": "schedule", "packed_width": "schedule",
    "step_shape_fn": "schedule", "verify_token_buckets": "schedule",
    "precompile_token_buckets": "schedule", "PromptRows": "schedule",
    "DeviceExecutor": "executor", "Programs": "programs", "register_program": "programs",
    "compiled_memory": "programs",
    "VerifySpec": "specs", "VerifyBatch": "specs", "full_width_rows": "schedule", "DecodeSpec": "specs",
    "DecodeBatch": "specs", "PrefillSpec": "specs",
    "PrefillBatch": "specs", "ShareSpec": "specs", "ShareBatch": "specs", "GatherSpec": "specs",
    "GatherBatch": "specs", "CacheSpec": "specs", "StepShape": "schedule",
    "pages_read_kv": "schedule", "shape_key": "schedule", "wide_rows_for": "schedule",
    "branch_rows_for": "schedule",
    "PagedRows": "paged_rows",
    "time_verify_padded": "reference",
    "StepExecutor": "step_io", "StepInput": "step_io",
    "StepOutput": "step_io", "Prefilled": "step_io", "Limits": "step_io",
    "prefill_layout": "scheduler", "run_schedule": "scheduler",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
