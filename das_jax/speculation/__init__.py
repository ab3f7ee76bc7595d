"""das_jax.speculation: what decides how many draft tokens the engine verifies.

Public surface:
  DASPolicy, DASConfig                    the DAS length-aware policy (das_policy.py)
  CostModel, CostModelConfig, calibrate, calibration_shapes
                                          the step-cost model it plans with (cost_model.py)
  resolve_cost_model, PRESETS             named models: GPU models from published figures
                                          (gpu_cost.py)
  save_cost_model, load_cost_model, COST_MODEL_FORMAT
                                          the cost-model file (cost_file.py)
  DASSection, register_speculation, unregister_speculation, speculation_names,
  get_speculation, build_speculation, SpeculationSpec, SpeculationError
                                          the speculation names and the `das:` settings their
                                          builders read (names.py)

Floor: above `engine` (whose `SpeculationPolicy` protocol, schedule and calibration hooks it
uses), below `config` and `rollout`. Names are imported lazily (PEP 562).
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "DASPolicy": "das_policy", "DASConfig": "das_policy",
    "CostModel": "cost_model", "CostModelConfig": "cost_model", "calibrate": "cost_model",
    "calibration_shapes": "cost_model",
    "resolve_cost_model": "gpu_cost", "PRESETS": "gpu_cost",
    "save_cost_model": "cost_file", "load_cost_model": "cost_file",
    "COST_MODEL_FORMAT": "cost_file",
    "DASSection": "names", "register_speculation": "names", "unregister_speculation": "names",
    "speculation_names": "names", "get_speculation": "names", "build_speculation": "names",
    "SpeculationSpec": "names", "SpeculationError": "names",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
