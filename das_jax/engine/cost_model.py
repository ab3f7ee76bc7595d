"""The decode-step cost model the DAS policy plans with, fitted from the engine's own timings.

    t(B, W, S) = c_base + c_tok * B * W + c_kv * B * S          [seconds]

c_base is the per-step cost independent of batch (reading the weights once, launch and host
overhead), c_tok the cost of each verified token row (matmul FLOPs, logits, sampling), c_kv the
cost of reading one cached position of one row (attention). This is the cost decomposition of DAS
(arXiv 2511.13841, §4: "base and token-level costs") with an attention term added, since on a
CPU at long contexts the cache read is not negligible. The coefficients are fitted by
non-negative least squares over recent (B, W, S, seconds) observations: first at warm-up
(`calibrate`), then refined with every step the engine runs.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Iterable

import numpy as np

log = logging.getLogger("das_jax.engine")


@dataclasses.dataclass(frozen=True)
class CostModelConfig:
    """Settings of the step-cost model: the `das.cost_model` section of a run config.

    c_base, c_tok, c_kv: the prior coefficients (seconds per step, seconds per verified token
      row, seconds per cached position per row) the policy plans with until observations
      arrive; the defaults are neutral (a step costs about as much as 16 extra token rows).
    history: how many recent (B, W, S, seconds) observations the fit uses.
    calibrate: time the verify step at a few shapes before the first rollout of a policy that
      plans with the cost model (`das`), and fit the model to them (`calibrate` below).
    calibrate_kv_lens: attended lengths S timed by the calibration (each at batch 1 and
      max_slots, every compiled width).
    calibrate_repeats: timed calls per shape (the median is one observation).
    """

    c_base: float = 0.05
    c_tok: float = 0.003
    c_kv: float = 0.0
    history: int = 512
    calibrate: bool = True
    calibrate_kv_lens: tuple[int, ...] = (128, 512)
    calibrate_repeats: int = 3

    def __post_init__(self):
        for name in ("c_base", "c_tok", "c_kv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (seconds), got {getattr(self, name)}")
        if self.history < 3:
            raise ValueError(f"history must be >= 3 observations, got {self.history}")
        if not self.calibrate_kv_lens or min(self.calibrate_kv_lens) < 1:
            raise ValueError("calibrate_kv_lens must be a non-empty list of positive lengths, "
                             f"got {list(self.calibrate_kv_lens)}")
        if self.calibrate_repeats < 1:
            raise ValueError(f"calibrate_repeats must be >= 1, got {self.calibrate_repeats}")


_PRIOR = CostModelConfig()


@dataclasses.dataclass
class CostModel:
    """t(B, W, S) = c_base + c_tok * B * W + c_kv * B * S, seconds.

    Attributes:
      c_base, c_tok, c_kv: coefficients (seconds, seconds per token row, seconds per cached
        position per row). The defaults are a neutral prior (a step costs about as much as 16
        extra token rows) used until observations arrive.
      history: how many recent observations the fit uses (older ones are dropped, so the model
        follows drift such as thermal throttling or a co-tenant).
    """

    c_base: float = _PRIOR.c_base
    c_tok: float = _PRIOR.c_tok
    c_kv: float = _PRIOR.c_kv
    history: int = _PRIOR.history
    observations: collections.deque = dataclasses.field(default_factory=collections.deque)

    @classmethod
    def from_config(cls, config: CostModelConfig) -> "CostModel":
        """A model starting from `config`'s prior coefficients and history length."""
        return cls(c_base=config.c_base, c_tok=config.c_tok, c_kv=config.c_kv,
                   history=config.history)

    def predict(self, batch: int, width: int, kv_len: int = 0) -> float:
        return self.c_base + self.c_tok * batch * width + self.c_kv * batch * kv_len

    def observe(self, batch: int, width: int, kv_len: int, seconds: float, refit: bool = True):
        self.observations.append((batch, width, kv_len, seconds))
        while len(self.observations) > self.history:
            self.observations.popleft()
        if refit:
            self.fit()

    def fit(self) -> None:
        """Non-negative least squares over the observations. Terms the observations cannot
        identify (e.g. every step at one width) keep their ratio to the identified ones."""
        if len(self.observations) < 3:
            return
        # One point per shape, its median time: robust to stray slow steps (first runs, GC).
        by_shape: dict[tuple, list[float]] = {}
        for b, w, s, t in self.observations:
            by_shape.setdefault((b, w, s), []).append(t)
        obs = np.array([(b, w, s, np.median(ts)) for (b, w, s), ts in by_shape.items()], np.float64)
        X = np.stack([np.ones(len(obs)), obs[:, 0] * obs[:, 1], obs[:, 0] * obs[:, 2]], axis=1)
        y = obs[:, 3]
        cols = [0] + [j for j in (1, 2) if np.ptp(X[:, j]) > 0]
        if len(cols) == 1:
            # One shape cannot separate the terms: keep the current ratios, match the level.
            scale = float(np.median(y)) / max(float(np.median(X @ self._coef())), 1e-12)
            self.c_base, self.c_tok, self.c_kv = (c * scale for c in self._coef())
            return
        coef = _nnls(X[:, cols], y)
        full = dict(zip(cols, coef))
        self.c_base = float(full.get(0, 0.0))
        if 1 in full:
            self.c_tok = float(full[1])
        if 2 in full:
            self.c_kv = float(full[2])

    def _coef(self) -> np.ndarray:
        return np.array([self.c_base, self.c_tok, self.c_kv])

    def to_dict(self) -> dict:
        return {"c_base": self.c_base, "c_tok": self.c_tok, "c_kv": self.c_kv}


def _nnls(X: np.ndarray, y: np.ndarray, iters: int = 200) -> np.ndarray:
    """Least squares with x >= 0 by active-set elimination (few columns, so this is exact enough)."""
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    for _ in range(iters):
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
        if not active:
            break
    return coef


def _observe_step(cost_model, num_tokens: int, attended_kv: int, seconds: float) -> None:
    """One calibration observation in the step terms (num_tokens, attended_kv): through
    `observe_step` where the model has it, else as the old (batch 1, width N, kv attended)."""
    if hasattr(cost_model, "observe_step"):
        cost_model.observe_step(num_tokens, attended_kv, seconds)
    else:
        cost_model.observe(1, num_tokens, attended_kv, seconds, refit=False)


def calibration_shapes(engine, batches: Iterable[int], widths: Iterable[int],
                       kv_lens: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """The (batch, width, num_tokens, kv_len) shapes `calibrate` times.

    Packed engine: at each batch bucket and attended length, for each compiled width W, a step
    where every row drafts W - 1 tokens (N = the slot bucket of B * W) and one where a single
    row does (N = the slot bucket of B + W - 1), so the fit sees N vary at fixed attended KV and
    the attended KV vary at fixed N. Padded engine: N = B * W.
    """
    from das_jax.engine.schedule import bucket, token_buckets

    out = []
    for B in batches:
        nb = token_buckets(engine.max_step_tokens(B))
        for S in kv_lens:
            for W in widths:
                if engine.engine_config.verify == "packed":
                    ns = sorted({bucket(B * W, nb), bucket(B + W - 1, nb)})
                else:
                    ns = [B * W]
                out.extend((B, W, n, S) for n in ns)
    return list(dict.fromkeys(out))


def calibrate(engine, cost_model: CostModel, cache_len: int | None = None,
              batches: Iterable[int] | None = None, widths: Iterable[int] | None = None,
              kv_lens: Iterable[int] = (128, 512), repeats: int = 3,
              sampling_key: tuple = (1.0, 0, 1.0)) -> CostModel:
    """Times the engine's verify step at several shapes and fits `cost_model` on what each step
    computes: num_tokens (token slots: the packed slot bucket N, or B * W padded) and
    attended_kv (B * kv_len), the terms of `predict_step` (see `calibration_shapes`).

    Runs on dummy tokens, compiling each shape once (not timed; with `cache_len` equal to what
    `generate` will use, those executables are reused there). The median of `repeats` timed calls
    per shape is one observation. Returns the fitted model.
    """
    ec = engine.engine_config
    batches = tuple(batches or sorted({1, ec.max_slots}))
    widths = tuple(widths or ec.draft_widths)
    cache_len = cache_len or ec.max_cache_len
    kv = sorted({min(s, cache_len - max(widths)) for s in kv_lens})
    shapes = calibration_shapes(engine, batches, widths, kv)
    log.info("calibrating the cost model: timing the %s verify step at %d shapes (B %s, W %s, "
             "S %s; each compiled once) ...", ec.verify, len(shapes), list(batches),
             list(widths), kv)
    t0 = time.perf_counter()
    for B, W, N, S in shapes:
        seconds = engine.time_verify_step(B, W, S, cache_len, repeats, sampling_key,
                                          num_tokens=N)
        _observe_step(cost_model, N, B * S, seconds)
    cost_model.fit()
    log.info("calibrated the cost model in %.1f s: t = %.1f ms + %.2f ms * tokens + %.2f us * "
             "attended KV", time.perf_counter() - t0, cost_model.c_base * 1e3,
             cost_model.c_tok * 1e3, cost_model.c_kv * 1e6)
    return cost_model
