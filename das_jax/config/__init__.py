"""Run configuration: frozen, nested dataclasses loaded from YAML plus `--set a.b=v` overrides.

    cfg = load_config("configs/gsm8k.yaml", ["grpo.beta=0.04", "rollout.draft_widths=[1,8]"])
    save_config(cfg, "runs/x/config.yaml")

Every YAML key is validated: a key given twice in one mapping is refused (PyYAML would keep the
last silently), unknown keys are rejected with the list of valid keys (and a "did you
mean"), values are type-checked against the field's annotation (ints are accepted for floats,
lists become tuples, `null` only where the field is optional), floats must be finite (NaN never,
infinity only for `das.global_below` and `das.request_below`: `schema.INFINITE_OK`), enum-like fields are checked
against their choices (fixed, or read from a registry when first needed: `drafter` from the
speculation registry, `data.kind` from the dataset registry), and cross-field constraints are
checked once the whole config is built. This package does not import JAX (so `platform` can still
be applied before JAX initialises; see `apply_platform`). GRPO field names follow TRL's
`GRPOConfig` where one exists.

The package: `schema` (the sections), `loader` (YAML, overrides, coercion, save, platform) and
`validation` (cross-section constraints).
"""
from __future__ import annotations

from das_jax.config.loader import (MAIN_JOB_CONFIG, apply_compilation_cache, apply_overrides,
                                   apply_platform, compilation_cache_dir, config_from_dict,
                                   config_to_dict, load_config, main_job_config, parse_override,
                                   save_config)
from das_jax.config.schema import (Config, ConfigError, DASSection, DataSection,
                                   DistributedSection, DraftHeadSection, EvalSection,
                                   GRPOSection, MeshSection, ModelSection, RewardsSection, RolloutSection, TrainSection)
from das_jax.config.validation import validate

__all__ = ["MAIN_JOB_CONFIG", "main_job_config", "Config", "ConfigError", "DASSection", "DataSection", "DistributedSection",
           "DraftHeadSection",
           "EvalSection", "GRPOSection", "MeshSection", "ModelSection", "RewardsSection", "RolloutSection",
           "TrainSection", "apply_compilation_cache", "apply_overrides", "apply_platform",
           "compilation_cache_dir", "config_from_dict",
           "config_to_dict", "load_config", "parse_override", "save_config", "validate"]
