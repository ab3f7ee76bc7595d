"""The speculation's host kernels compiled ahead of the first rollout (`das_jax.rollout.warmup`):
the warm-up compiles every numba kernel, with every argument type, that a real rollout calls."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.drafter import _batch_kernels, _kernels
from das_jax.engine import Engine, EngineConfig, Request, SamplingParams
from das_jax.rollout import Rollout
from das_jax.rollout.warmup import exercise_kernels, warm_up
from das_jax.speculation import (CostModel, CostModelConfig, DASSection, _budget_kernels,
                                 build_speculation)
from das_jax.testing import tiny_model_config, tiny_params


def _compiled():
    """{kernel: compiled signatures} of every numba dispatcher of the drafters and the policy."""
    out = {}
    for mod in (_kernels, _batch_kernels, _budget_kernels):
        for name in dir(mod):
            fn = getattr(mod, name)
            if hasattr(fn, "signatures") and hasattr(fn, "py_func"):
                out[f"{mod.__name__}.{name}"] = set(fn.signatures)
    return out


@pytest.mark.parametrize("name", ["das", "suffix"])
def test_a_rollout_after_the_warm_up_compiles_no_kernel(name):
    cfg = tiny_model_config()
    ec = EngineConfig(max_slots=4, max_cache_len=96, draft_widths=(1, 4, 8))
    drafter, policy = build_speculation(name, None, CostModel(c_base=1e-3, c_tok=1e-5))
    exercise_kernels(drafter, policy, EngineConfig(max_slots=4, max_cache_len=64,
                                           draft_widths=ec.draft_widths))
    if name == "das":
        assert sum(policy.acceptance_by_age()["drafted"]) > 0   # the exercise drafted
    before = _compiled()
    # a fixed cost model where drafts pay (a calibrated one times this machine's steps, and
    # under load may find that no draft pays)
    das = DASSection(cost_model=CostModelConfig(c_base=1e-3, c_tok=1e-5, calibrate=False))
    rollout = Rollout(Engine(cfg, tiny_params(cfg), eos_token_ids=(), engine_config=ec), name,
                      das, warm_kernels=False)
    reqs = [Request((1, 2, 3, 4), problem_id=f"p{i % 3}", sample_index=i) for i in range(6)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, seed=0)
    for version in range(2):
        rollout.set_policy_version(version)
        out, stats = rollout.generate(reqs, sampling=sampling)
        rollout.advance_epoch()
    assert stats.drafted_tokens > 0
    after = _compiled()
    new = {k: after[k] - before.get(k, set()) for k in after if after[k] - before.get(k, set())}
    assert new == {}, f"compiled by the rollout, not by the warm-up: {new}"


def test_warm_up_runs_on_a_thread_only_for_a_drafter():
    assert warm_up("none", None) is None
    thread = warm_up("das", None, (1, 4))
    thread.join(timeout=600)
    assert not thread.is_alive()
    cfg = tiny_model_config()
    engine = Engine(cfg, None, dtype="float32")
    assert Rollout(engine, "none").warm_up_thread is None
    warm = Rollout(engine, "das").warm_up_thread
    assert warm is not None and warm.daemon
    warm.join(timeout=600)
    assert Rollout(engine, "das", warm_kernels=False).warm_up_thread is None
