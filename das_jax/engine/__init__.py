"""das_jax.engine: the rollout engine.

Public surface:
  Engine, EngineConfig, Request, RequestOutput, GenerateStats, GenerateError   (generate.py)
  DeviceExecutor (the engine's step executor)                                  (generate.py)
  run_schedule, StepExecutor, StepInput, StepOutput, Prefilled, Limits,
    prefill_layout: the host scheduler shared with the trace replay             (scheduler.py)
  SamplingParams, SamplingError, request_seed                                  (sampling.py)
  SpeculationPolicy, FixedPolicy, RowView, StepRecord, DraftPlan, plan_step,
    acceptance_length, padded_step_shape, packed_step_shape, width_for         (policy.py)
  bucket, pow2_at_least, cache_len_for, kv_len_bucket, tail_bucket, compact_rows (schedule.py)
  token_buckets, packed_width, step_shape_fn, verify_token_buckets,
    precompile_token_buckets, PromptRows (prompt sharing's row bookkeeping)    (schedule.py)

The jitted device functions (`prefill_insert`, `prefill_packed`, `share_prompt_rows`, `verify`,
`verify_packed`) are in `step.py`. Names are imported
lazily (PEP 562) so `das_jax.cli.generate` registers without importing jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "Engine": "generate", "EngineConfig": "generate", "Request": "generate",
    "RequestOutput": "generate", "GenerateStats": "generate", "GenerateError": "generate",
    "SamplingParams": "sampling", "SamplingError": "sampling", "request_seed": "sampling",
    "SpeculationPolicy": "policy", "FixedPolicy": "policy", "RowView": "policy",
    "StepRecord": "policy", "DraftPlan": "policy", "plan_step": "policy",
    "acceptance_length": "policy", "padded_step_shape": "policy", "packed_step_shape": "policy",
    "width_for": "policy",
    "bucket": "schedule", "pow2_at_least": "schedule", "cache_len_for": "schedule",
    "kv_len_bucket": "schedule", "tail_bucket": "schedule", "compact_rows": "schedule",
    "token_buckets": "schedule", "packed_width": "schedule",
    "step_shape_fn": "schedule", "verify_token_buckets": "schedule",
    "precompile_token_buckets": "schedule", "PromptRows": "schedule",
    "DeviceExecutor": "generate", "StepExecutor": "scheduler", "StepInput": "scheduler",
    "StepOutput": "scheduler", "Prefilled": "scheduler", "Limits": "scheduler",
    "prefill_layout": "scheduler", "run_schedule": "scheduler",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
