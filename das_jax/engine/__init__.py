"""das_jax.engine: the rollout engine.

Public surface:
  Engine, EngineConfig, Request, RequestOutput, GenerateStats, GenerateError   (generate.py)
  SamplingParams, SamplingError, request_seed                                  (sampling.py)
  SpeculationPolicy, FixedPolicy, RowView, StepRecord                          (policy.py)
  DASPolicy, DASConfig                                                         (das_policy.py)
  CostModel, calibrate                                                         (cost_model.py)
  OracleDrafter, AdversaryDrafter                                              (reference_drafters.py)

The jitted device functions (`prefill_insert`, `verify`) are in `step.py`. Names are imported
lazily (PEP 562) so `das_jax.engine.cli` registers without importing jax.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "generate", "EngineConfig": "generate", "Request": "generate",
    "RequestOutput": "generate", "GenerateStats": "generate", "GenerateError": "generate",
    "SamplingParams": "sampling", "SamplingError": "sampling", "request_seed": "sampling",
    "SpeculationPolicy": "policy", "FixedPolicy": "policy", "RowView": "policy",
    "StepRecord": "policy", "DASPolicy": "das_policy", "DASConfig": "das_policy",
    "CostModel": "cost_model", "calibrate": "cost_model",
    "OracleDrafter": "reference_drafters", "AdversaryDrafter": "reference_drafters",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"das_jax.engine.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'das_jax.engine' has no attribute {name!r}")


def __dir__():
    return __all__
