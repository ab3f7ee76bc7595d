"""The decode-step cost model the DAS policy plans with, fitted from the engine's own timings.

    t(N, K) = c_base + c_tok * N + c_kv * K                      [seconds]

N (`num_tokens`) is the number of token slots the verify step computes (padded engine:
B_bucket * W; packed engine: its N bucket), K (`attended_kv`) the sum over the computed rows of
the cache positions attention reads for that row (padded engine: B_bucket * the attended-length
bucket). c_base is the per-step cost independent of both (reading the weights once, launch and
host overhead), c_tok the cost of each computed token slot (matmul FLOPs, logits, sampling),
c_kv the cost of reading one cached position of one row (attention). This is the cost
decomposition of DAS (arXiv 2511.13841, §4: "base and token-level costs") with an attention
term added. The coefficients are fitted by non-negative least squares over the most recent
`history` observations (a bounded window, so the fit follows a machine whose speed drifts: once
the window holds only new steps, the fit is that of the new machine): first at warm-up
(`calibrate`), then refined with every step the engine runs.

Measured step times per compiled shape. A linear model misprices the steps a real engine runs:
on this CPU (SmolLM2-135M, f32) one draft slot at B = 1 costs +38% (a one-row matmul is a
faster class than two rows) where the fit predicts +6%, the first draft bucket at B = 16
(N 16 -> 24) +28% where it predicts +17%, and a query block of W = 4 at the same N +9% where it
predicts nothing. So the model also keeps, per shape (N, K, W) a step was observed at with its
query-block width W, the recent measured seconds (`table_window` of them), and
`predict_step(N, K, width=W)` returns their median once `table_min` are there (the linear fit
otherwise, and whenever no width is given). `seen(N, K, W)` says whether a shape has been
measured, i.e. whether its program is compiled (the DAS policy prefers compiled shapes).

A paged cache read by a kernel (`models.paged_attention`: the TPU and CUDA lowerings) reads
each row's own pages, not the bucket: its K is the positions of the pages the live rows hold
(`read_kv`, `schedule.pages_read_kv`), while the compiled program, and so the table's key, is
still the bucket's (B * kv_len). `predict_step(..., read_kv=R)` prices such a step: the linear
fit at K = R, or the program's measured median shifted by c_kv * (R - the median R of its
measured steps); `observe_step(..., read_kv=R)` fits the KV term on R.

`predict(batch, width, kv_len)` / `observe(batch, width, kv_len, seconds)` are the padded-engine
spelling of `predict_step(batch * width, batch * kv_len)` / `observe_step(...)`.

Cost models can be saved to / read from a JSON file (`das_jax.speculation.cost_file`);
`das_jax.speculation.gpu_cost` derives GPU models from published figures.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Iterable

import numpy as np

from das_jax.engine import (full_width_rows, kv_len_bucket, precompile_token_buckets,
                            shape_key, wide_rows_for)
from das_jax.speculation.gpu_cost import resolve_cost_model

log = logging.getLogger("das_jax.engine")


@dataclasses.dataclass(frozen=True)
class CostModelConfig:
    """Settings of the step-cost model: the `das.cost_model` section of a run config.

    c_base, c_tok, c_kv: the prior coefficients (seconds per step, seconds per computed token
      slot, seconds per attended cached position per row) the policy plans with until
      observations arrive; the defaults are neutral (a step costs about as much as 16 extra
      token slots).
    source: where the prior comes from instead of c_base / c_tok / c_kv: null (those keys), a
      named model (`cpu`, `h100-7b`, `h200-7b`: `das_jax.speculation.gpu_cost.PRESETS`) or the path of
      a cost-model JSON file (`save_cost_model`; e.g. one measured on a GPU).
    history: how many recent (N, K, seconds) observations the fit uses (the window that lets
      it follow drift).
    calibrate: time the verify step at a few shapes before the first rollout of a policy that
      plans with the cost model (`das`), and fit the model to them (`calibrate` below).
    calibrate_kv_lens: attended lengths S timed by the calibration (each at batch 1 and
      max_slots, every compiled width).
    calibrate_repeats: timed calls per shape (the median is one observation).
    compile_s: seconds one new verify-step shape costs to compile, the prior until a compile is
      measured (then the mean of the measured ones: the calibration's and the rollouts'). The
      DAS policy compiles a new shape only once the time it would have saved reaches this
      (`das_policy`, "Measured shapes"); 0: never wait.
    """

    c_base: float = 0.05
    c_tok: float = 0.003
    c_kv: float = 0.0
    source: str | None = None
    history: int = 512
    calibrate: bool = True
    calibrate_kv_lens: tuple[int, ...] = (128, 512)
    calibrate_repeats: int = 3
    compile_s: float = 1.0

    def __post_init__(self):
        for name in ("c_base", "c_tok", "c_kv", "compile_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (seconds), got {getattr(self, name)}")
        if self.history < 3:
            raise ValueError(f"history must be >= 3 observations, got {self.history}")
        if not self.calibrate_kv_lens or min(self.calibrate_kv_lens) < 1:
            raise ValueError("calibrate_kv_lens must be a non-empty list of positive lengths, "
                             f"got {list(self.calibrate_kv_lens)}")
        if self.calibrate_repeats < 1:
            raise ValueError(f"calibrate_repeats must be >= 1, got {self.calibrate_repeats}")
        if self.source is not None:
            resolve_cost_model(self.source)   # a bad name or file fails at config load


_PRIOR = CostModelConfig()


@dataclasses.dataclass
class CostModel:
    """t(N, K) = c_base + c_tok * N + c_kv * K, seconds (module docstring).

    Attributes:
      c_base, c_tok, c_kv: coefficients (seconds, seconds per computed token slot, seconds per
        attended cached position per row). The defaults are a neutral prior used until
        observations arrive.
      history: how many recent observations the fit uses (older ones are dropped, so the model
        follows drift such as thermal throttling or a co-tenant).
      observations: the window, (num_tokens, attended_kv, seconds) tuples, oldest first.
      table_window / table_min: measured seconds kept per shape (N, K, W), and how many are
        needed before `predict_step` with a width returns their median instead of the fit.
      table: {(num_tokens, attended_kv, width[, wide_rows]): deque of recent seconds}
        (`schedule.shape_key`).
      table_read: {the same keys: deque of the cached positions those steps read} (their
        `read_kv`; the key's attended_kv when not given).
      compile_s: seconds to compile one new verify-step shape: the prior, replaced by the mean of
        the `compile_count` compiles measured so far (`observe_compile`).
    """

    c_base: float = _PRIOR.c_base
    c_tok: float = _PRIOR.c_tok
    c_kv: float = _PRIOR.c_kv
    history: int = _PRIOR.history
    observations: collections.deque = dataclasses.field(default_factory=collections.deque)
    table_window: int = 16
    table_min: int = 2
    table: dict = dataclasses.field(default_factory=dict)
    table_read: dict = dataclasses.field(default_factory=dict)
    compile_s: float = _PRIOR.compile_s
    compile_count: int = 0
    # (median seconds, median read_kv) per shape, dropped whenever the shape is observed
    _medians: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                       compare=False)
    # The fit's points, kept as the window moves (`_window_points`): per (N, read K) of the
    # window, [its seconds oldest first, their median]; and the deque they were built from
    # with its length then (another deque or length: rebuilt).
    _points: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                      compare=False)
    _points_of: tuple = dataclasses.field(default=(None, -1), init=False, repr=False,
                                          compare=False)

    @classmethod
    def from_config(cls, config: CostModelConfig) -> "CostModel":
        """A model starting from `config`'s prior (its `source` when set, else c_base / c_tok /
        c_kv) and history length.

        Raises:
          ValueError: `source` is neither a known name nor a readable cost-model file.
        """
        coef = {"c_base": config.c_base, "c_tok": config.c_tok, "c_kv": config.c_kv}
        if config.source is not None:
            coef = resolve_cost_model(config.source)
        return cls(c_base=coef["c_base"], c_tok=coef["c_tok"], c_kv=coef["c_kv"],
                   history=config.history, compile_s=config.compile_s)

    # ----- the step-shape interface (shared contract with the packed engine) -------------------
    def predict_step(self, num_tokens: int, attended_kv: int, width: int | None = None,
                     read_kv: int | None = None, wide_rows: int = 0,
                     branch_rows: int = 0) -> float:
        """Predicted seconds of a verify step computing `num_tokens` token slots that attend
        `attended_kv` cached positions in total (summed over rows), with query-block `width`
        W when known: the median of the shape's recent measured times once `table_min` are
        there, else (and without a width) the linear fit. `read_kv`: the cached positions the
        step actually reads when that is not `attended_kv` (a paged cache read by a kernel,
        module docstring): the fit's KV term, and the median shifted by c_kv times its
        difference from the measured steps' median read. `wide_rows`: the split query block's R
        (`schedule.wide_rows_for`), and `branch_rows` a token tree's R2
        (`schedule.branch_rows_for`), part of the shape's key."""
        read = attended_kv if read_kv is None else read_kv
        if width is not None:
            key = shape_key(num_tokens, attended_kv, width, wide_rows, branch_rows)
            ts = self.table.get(key)
            if ts is not None and len(ts) >= self.table_min:
                med = self._medians.get(key)
                if med is None:   # recomputed only after the shape's window changed
                    med = self._medians[key] = (float(np.median(ts)),
                                                float(np.median(self.table_read[key])))
                shift = 0.0
                if read_kv is not None:
                    shift = max(self.c_kv, 0.0) * (read - med[1])
                return max(med[0] + shift, 0.0)
        return self.c_base + self.c_tok * num_tokens + self.c_kv * read

    def seen(self, num_tokens: int, attended_kv: int, width: int, wide_rows: int = 0,
             branch_rows: int = 0) -> bool:
        """Whether a step of this shape has been measured (so its program is compiled)."""
        return shape_key(num_tokens, attended_kv, width, wide_rows, branch_rows) in self.table

    def observe_step(self, num_tokens: int, attended_kv: int, seconds: float,
                     refit: bool = True, width: int | None = None,
                     read_kv: int | None = None, wide_rows: int = 0,
                     branch_rows: int = 0) -> None:
        """Adds one measured step to the window (dropping the oldest beyond `history`) and, with
        `refit`, refits the coefficients; with its query-block `width`, also to the shape's
        entry of `table`. `read_kv`: the cached positions the step read, when not
        `attended_kv` (the fit's KV term; see `predict_step`); `wide_rows`: its split query
        block's R (0: one block); `branch_rows`: its token tree's R2 (0: none)."""
        read = int(attended_kv if read_kv is None else read_kv)
        if width is not None:
            key = shape_key(num_tokens, attended_kv, width, wide_rows, branch_rows)
            self._medians.pop(key, None)
            self.table.setdefault(key, collections.deque(maxlen=self.table_window)).append(
                float(seconds))
            self.table_read.setdefault(key, collections.deque(maxlen=self.table_window)).append(
                read)
        points = self._window_points()
        obs = (int(num_tokens), read, float(seconds))
        self.observations.append(obs)
        _add_point(points, obs)
        while len(self.observations) > self.history:
            _drop_point(points, self.observations.popleft())
        self._points_of = (self.observations, len(self.observations))
        if refit:
            self.fit()

    def _window_points(self) -> dict:
        """{(N, read K): [seconds oldest first, their median]} of the observations in the
        window, kept as it moves (O(1) shapes touched per step, not the whole window), rebuilt
        when `observations` was replaced or changed length outside `observe_step`."""
        of, n = self._points_of
        if of is not self.observations or n != len(self.observations):
            self._points = {}
            for obs in self.observations:
                _add_point(self._points, obs)
            self._points_of = (self.observations, len(self.observations))
        return self._points

    # ----- padded-engine spelling -----------------------------------------------------------------
    def predict(self, batch: int, width: int, kv_len: int = 0) -> float:
        """`predict_step(batch * width, batch * kv_len)`."""
        return self.predict_step(batch * width, batch * kv_len)

    def observe(self, batch: int, width: int, kv_len: int, seconds: float, refit: bool = True):
        """`observe_step(batch * width, batch * kv_len, seconds, refit)`."""
        self.observe_step(batch * width, batch * kv_len, seconds, refit)

    def fit(self) -> None:
        """Non-negative least squares over the window. Terms the observations cannot identify
        (e.g. every step at one shape) keep their ratio to the identified ones."""
        if len(self.observations) < 3:
            return
        # One point per shape, its median time: robust to stray slow steps (first runs, GC).
        obs = np.array([(n, k, med) for (n, k), (_, med) in self._window_points().items()],
                       np.float64)
        X = np.stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]], axis=1)
        y = obs[:, 2]
        cols = [0] + [j for j in (1, 2) if np.ptp(X[:, j]) > 0]
        if len(cols) == 1:
            # One shape cannot separate the terms: keep the current ratios, match the level.
            scale = float(np.median(y)) / max(float(np.median(X @ self._coef())), 1e-12)
            self.c_base, self.c_tok, self.c_kv = (c * scale for c in self._coef())
            return
        from scipy.optimize import nnls  # deferred import: scipy (slow to import; a fit only)
        coef, _ = nnls(X[:, cols], y)
        full = dict(zip(cols, coef))
        self.c_base = float(full.get(0, 0.0))
        if 1 in full:
            self.c_tok = float(full[1])
        if 2 in full:
            self.c_kv = float(full[2])

    def _coef(self) -> np.ndarray:
        return np.array([self.c_base, self.c_tok, self.c_kv])

    def observe_compile(self, seconds: float) -> None:
        """One measured compile of a new verify-step shape: `compile_s` becomes the mean of the
        measured compiles (the prior is dropped at the first one)."""
        self.compile_count += 1
        self.compile_s += (float(seconds) - self.compile_s) / self.compile_count

    def to_dict(self) -> dict:
        """The coefficients and the compile time, as `CostModelConfig` keys."""
        return {"c_base": self.c_base, "c_tok": self.c_tok, "c_kv": self.c_kv,
                "compile_s": self.compile_s}


def _median(xs: list) -> float:
    """`np.median` of a short list of floats (the same value: the middle one, or the mean of
    the two middle ones), without numpy's per-call overhead."""
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2.0


def _add_point(points: dict, obs: tuple) -> None:
    """Observation (N, read K, seconds) joins its shape's point (`CostModel._window_points`)."""
    point = points.setdefault(obs[:2], [[], 0.0])
    point[0].append(obs[2])
    point[1] = _median(point[0])


def _drop_point(points: dict, obs: tuple) -> None:
    """The window's oldest observation leaves its shape's point (the shape's oldest too)."""
    point = points[obs[:2]]
    point[0].pop(0)
    if point[0]:
        point[1] = _median(point[0])
    else:
        del points[obs[:2]]


def _observe_step(cost_model, num_tokens: int, attended_kv: int, seconds: float,
                  width: int, wide_rows: int = 0) -> None:
    """One calibration observation in the step terms (num_tokens, attended_kv, query-block
    width, split block's R): through `observe_step` where the model has it, else as the old
    (batch 1, width N, kv attended)."""
    if hasattr(cost_model, "observe_step"):
        # a split block's R only where there is one: duck-typed models may lack the keyword
        kw = {"wide_rows": wide_rows} if wide_rows else {}
        cost_model.observe_step(num_tokens, attended_kv, seconds, width=width, **kw)
    else:
        cost_model.observe(1, num_tokens, attended_kv, seconds, refit=False)


def calibration_shapes(engine, batches: Iterable[int], widths: Iterable[int],
                       kv_lens: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """The (batch, width, num_tokens, kv_len) shapes `calibrate` times.

    Packed engine: at each batch bucket B and attended length, the step without drafts (W = 1,
    N = B), and at the largest B, for every width W > 1, the step with drafts at the smallest
    slot count above B (the first drafting bucket, what the DAS budget mostly chooses), so the
    fit sees N vary at fixed attended KV and the attended KV vary at fixed N. These are the
    shapes generation runs (and `Engine.precompile` compiles), so their executables are reused
    there. Other drafting shapes are not timed: each costs a compile that a rollout may never
    reuse; the online fit and the per-shape table
    learn them when they run.
    """
    widths = tuple(widths)
    wmax = max(widths)
    out = []
    batches = tuple(batches)
    for B in batches:
        for S in kv_lens:
            out.append((B, 1, B, S))
            out.extend((B, W, n, S) for W in widths if W > 1 and B == max(batches)
                       for n in precompile_token_buckets(B, wmax)[1:2] if n <= B * W)
    return list(dict.fromkeys(out))


def calibration_wide_rows(engine, batch: int, width: int, num_tokens: int) -> int:
    """R of the split query block the engine runs for the timing layout of (B, W, N)
    (`VerifySpec.dummy`: the first (N - B) // (W - 1) rows draft W - 1 tokens, the others
    none; `schedule.wide_rows_for` over `EngineConfig.wide_row_buckets`), so the calibration
    times the program generation runs for that layout."""
    full = full_width_rows(batch, width, num_tokens)
    n_draft = [width - 1] * full + [0] * (batch - full)
    return wide_rows_for(n_draft, batch, width,
                         getattr(engine.engine_config, "wide_row_buckets", ()))


def calibrate(engine, cost_model: CostModel, cache_len: int | None = None,
              batches: Iterable[int] | None = None, widths: Iterable[int] | None = None,
              kv_lens: Iterable[int] = (128, 512), repeats: int = 3,
              sampling_key: tuple = (1.0, 0, 1.0), draft_model=None) -> CostModel:
    """Times the engine's verify step at several shapes and fits `cost_model` on what each step
    computes: num_tokens (token slots: the packed slot bucket N) and
    attended_kv (B * kv_len), the terms of `predict_step` (see `calibration_shapes`).

    Runs on dummy tokens, compiling each shape once (not timed; with `cache_len` equal to what
    `generate` will use, those executables are reused there). The median of `repeats` timed calls
    per shape is one observation. `draft_model`: the draft head `generate` will run beside
    the steps (its drafting after each step is part of the step's time there, so here too).
    Returns the fitted model.
    """
    ec = engine.engine_config
    batches = tuple(batches or sorted({1, ec.max_slots}))
    widths = tuple(widths or ec.draft_widths)
    cache_len = cache_len or ec.max_cache_len

    # The attended lengths `generate` compiles (quarter-octave buckets, capped at the cache
    # length), so the executables compiled here are the ones generation reuses.
    kv = sorted({kv_len_bucket(np.array([s]), cache_len) for s in kv_lens})
    shapes = calibration_shapes(engine, batches, widths, kv)
    log.info("calibrating the cost model: timing the verify step at %d shapes (B %s, W %s, "
             "S %s; each compiled once) ...", len(shapes), list(batches),
             list(widths), kv)
    t0 = time.perf_counter()
    compiled = getattr(engine, "programs", None)     # the engine's compile counter
    for B, W, N, S in shapes:
        c0 = compiled.compile_s if compiled is not None else 0.0
        R = calibration_wide_rows(engine, B, W, N)
        seconds = engine.time_verify_step(B, W, S, cache_len, repeats, sampling_key,
                                          num_tokens=N, draft_model=draft_model, wide_rows=R)
        _observe_step(cost_model, N, B * S, seconds, W, R)
        if compiled is not None and compiled.compile_s > c0 and hasattr(cost_model,
                                                                        "observe_compile"):
            cost_model.observe_compile(compiled.compile_s - c0)
    cost_model.fit()
    log.info("calibrated the cost model in %.1f s: t = %.1f ms + %.2f ms * tokens + %.2f us * "
             "attended KV", time.perf_counter() - t0, cost_model.c_base * 1e3,
             cost_model.c_tok * 1e3, cost_model.c_kv * 1e6)
    return cost_model
