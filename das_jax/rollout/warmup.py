"""Compiling a speculation's host kernels before the first rollout needs them.

The suffix drafters and the DAS policy run their per-step work as numba kernels, compiled on
their first call (`cache=True`: later processes load them from numba's disk cache). In a process
whose cache is empty (a fresh install, a GPU node's fresh checkout, a container) the first
rollout pays every compile inside its first decode steps: ~15 s on a GPU node's host, where a
verify step takes 5-15 ms, so the first rollout's host time per step was 120 ms instead of 5 ms.

`warm_up(name, das)` starts a daemon thread that builds a throwaway drafter and policy of the
same speculation (`build_speculation`: the same classes and settings, its own state, so nothing
the rollout uses is touched) and runs a few small synthetic rollouts through the engine's own
host scheduler (`das_jax.engine.scheduler.run_schedule`) with a model-free executor: every
kernel a real rollout calls is compiled (or loaded from the cache) with the argument types a
real rollout passes. The thread overlaps what the run does meanwhile (building the engine,
calibrating the cost model, XLA's compiles, which release the GIL); a rollout that calls a
kernel still being compiled waits for that compile (numba compiles under one lock), never
compiles it twice.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from das_jax.drafter.base import set_policy_version
from das_jax.engine.engine_config import EngineConfig
from das_jax.engine.scheduler import run_schedule
from das_jax.engine.step_io import Limits, Prefilled, StepInput, StepOutput
from das_jax.speculation import CostModel, build_speculation

_PERIOD = 7          # the synthetic rollouts repeat a 7-token phrase, so drafts exist
_VOCAB_BASE = 11


class _PhraseExecutor:
    """A model-free `StepExecutor`: request r's target sequence repeats a phrase of `_PERIOD`
    tokens (shifted by r % 2, so siblings of a problem agree and problems differ); a draft is
    accepted up to its first disagreement with it, as a verify step would."""

    def __init__(self, requests):
        self.requests = requests

    @staticmethod
    def _target(request_id: int, pos_A: np.ndarray) -> np.ndarray:
        return (_VOCAB_BASE + (pos_A + request_id % 2) % _PERIOD).astype(np.int32)

    def start(self, batch: int, cache_len: int) -> None:
        pass

    def prefill(self, request_ids, rows, batch) -> Prefilled:
        first = [int(self._target(int(r), np.zeros(1, np.int64))[0]) for r in request_ids]
        return Prefilled(first, [0.0] * len(first), 0.0, sum(
            len(self.requests[int(r)].prompt_ids) for r in request_ids))

    def compact(self, live, new_batch) -> None:
        pass

    def verify(self, st: StepInput) -> StepOutput:
        ri_A, g_A = np.asarray(st.request_ids), np.asarray(st.generated)
        n_draft_A = np.asarray(st.n_draft_B)[st.live].astype(np.int64)
        K = st.drafts_AxK.shape[1]
        col = np.arange(K + 1)[None, :]
        rec_AxK1 = np.stack([self._target(int(r), g + np.arange(K + 1))
                             for r, g in zip(ri_A, g_A)]) if len(ri_A) else \
            np.zeros((0, K + 1), np.int32)
        miss_AxK = (st.drafts_AxK != rec_AxK1[:, :K]) | (col[:, :K] >= n_draft_A[:, None])
        acc_A = (np.where(miss_AxK.any(axis=1), miss_AxK.argmax(axis=1), K) if K
                 else np.zeros(len(ri_A), np.int64))
        if st.overlap is not None:
            st.overlap()
        return StepOutput(rec_AxK1, np.zeros(rec_AxK1.shape, np.float32),
                          (acc_A + 1).astype(np.int32), 1e-3)


class _Request:
    def __init__(self, prompt_ids, problem_id):
        self.prompt_ids, self.problem_id, self.seed = prompt_ids, problem_id, 0


def exercise_kernels(drafter, policy, engine_config: EngineConfig) -> None:
    """Two epochs of 4 problems x 2 samples of the synthetic phrase through `run_schedule` with
    `drafter` and `policy` (throwaway ones: their state changes)."""
    requests = [_Request(tuple(range(3, 3 + 8 + p)), f"warm-up-{p}")
                for p in range(4) for _ in range(2)]
    for epoch in range(2):
        set_policy_version(drafter, epoch)
        run_schedule(requests, _PhraseExecutor(requests), engine_config,
                     Limits(max_new_tokens=24), drafter, policy, keep_tokens=False)
        if drafter is not None:
            drafter.advance_epoch()


def warm_up(name: str, das: Any, draft_widths=(1, 4, 8)) -> threading.Thread | None:
    """Starts compiling speculation `name`'s host kernels on a daemon thread (module
    docstring); returns it (join it to wait), or None for a speculation without a drafter.
    `das`: the `das:` settings (`DASSection`); `draft_widths`: the engine's compiled widths
    (the synthetic steps draft up to the widest). A failure in the thread is not raised: the
    rollout then compiles what it needs itself, as without a warm-up."""
    drafter, policy = build_speculation(name, das, CostModel(c_base=1e-3, c_tok=1e-5))
    if drafter is None:
        return None
    small = EngineConfig(max_slots=4, max_cache_len=64, draft_widths=tuple(draft_widths))

    def run():
        try:
            exercise_kernels(drafter, policy, small)
        except Exception:   # noqa: BLE001 - best effort: the rollout compiles on its own
            pass
    thread = threading.Thread(target=run, name="das-jax-kernel-warm-up", daemon=True)
    thread.start()
    return thread
