"""`rollout_from_config`: the `Rollout` a run config asks for, on one device or, with several
local devices, a `ShardedRollout` of data-parallel replicas. It lives apart from both classes so
that neither imports the other's module for it: `sharded` builds on `rollout`, this builds on
both."""
from __future__ import annotations

from typing import Sequence

import jax

from das_jax.draft_head.store import check_head_for_policy, load_head
from das_jax.engine import Engine, EngineConfig, SamplingParams
from das_jax.engine.engine_config import kv_cache_for
from das_jax.errors import UserError
from das_jax.rollout.rollout import Rollout
from das_jax.rollout.sharded import ShardedRollout

__all__ = ["rollout_from_config"]


def rollout_from_config(config, model_config, params, eos_token_ids: Sequence[int] = (), *,
                        device=None, speculation: str | None = None,
                        devices=None) -> Rollout:
    """A rollout for a run `config` (`das_jax.config.Config`): an `Engine` over
    (model_config, params) with the `rollout:` shapes, the `drafter:` speculation (or
    `speculation`), the `das:` settings, and sampling from `rollout:` seeded by `train.seed`.

    Args:
      config: the run config.
      model_config: the `ModelConfig` of the model.
      params: the params pytree, or None (an engine without params: `generate` needs them).
      eos_token_ids: the ids that end a sequence.
      device: place everything on this one device (a plain `Rollout`).
      speculation: a registered speculation name overriding `config.drafter`.
      devices: the devices to spread over (default `jax.local_devices()`).

    Placement: on `device` when given; else over `devices`: with more than one (or
    `rollout.replicas` > 1), a `ShardedRollout` of `rollout.replicas` data-parallel replicas
    (default: one per device), each tensor-parallel over devices / replicas devices.

    With `draft_head.path` set, the head is loaded, checked against the model, and drafts beside
    the speculation's history drafter (`Rollout.attach_draft_head`).

    Raises:
      GenerateError: `rollout.replicas` does not divide the device count.
      SpeculationError: an unknown speculation name.
      UserError: a draft head that is missing, corrupt, fitted to another model, or set with
        several rollout replicas.
    """
    r = config.rollout
    devices = list(devices) if devices is not None else jax.local_devices()
    replicas = getattr(r, "replicas", None)
    per_engine = 1 if device is not None else len(devices) // max(1, replicas or len(devices))
    platform = (device or devices[0]).platform
    engine = Engine(model_config, params, eos_token_ids=eos_token_ids, device=device,
                    dtype=config.model.dtype,
                    engine_config=EngineConfig(max_slots=r.max_slots,
                                               max_cache_len=r.max_cache_len,
                                               draft_widths=tuple(r.draft_widths),
                                               kv_memory_gb=r.kv_memory_gb,
                                               kv_memory_fraction=r.kv_memory_fraction,
                                               exact=r.exact,
                                               precompile=r.precompile,
                                               decode_steps=r.decode_steps,
                                               kv_cache=kv_cache_for(r.kv_cache, platform,
                                                                     per_engine),
                                               page_size=r.page_size,
                                               paged_attention=r.paged_attention,
                                               max_prefill_tokens=r.max_prefill_tokens,
                                               overlap_host=r.overlap_host,
                                               draft_ahead=r.draft_ahead,
                                               layer_loop=r.layer_loop,
                                               wide_row_buckets=tuple(r.wide_row_buckets)))
    sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens,
                              stop_token_ids=tuple(r.stop_token_ids), seed=config.train.seed)
    rollout = Rollout(engine, speculation or config.drafter, config.das, sampling)
    sharded = device is None and not (len(devices) == 1 and replicas in (None, 1))
    head = getattr(config, "draft_head", None)
    if head is not None and head.path is not None:
        if sharded:
            raise UserError("draft_head runs with one rollout engine per process; set "
                            "rollout.replicas: 1 (or run one process per device), or "
                            "draft_head.path: null")
        fitted = load_head(head.path)
        check_head_for_policy(fitted, head.path, config.model.source, model_config)
        rollout.attach_draft_head(fitted, head.steps, head.scale,
                                  dtype=head.dtype or config.model.dtype)
    if not sharded:
        return rollout
    return ShardedRollout.from_rollout(rollout, devices, replicas)
