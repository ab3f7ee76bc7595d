"""The DAS length-aware speculation policy (arXiv 2511.13841, §4).

Decides how much to speculate, for whom, at each decode step:

1. Length classes. A request starts in the class (short / medium / long) most common among its
   problem's past rollout lengths (ties go to the longer class; no history: medium). Class
   thresholds default to the 1/3 and 2/3 quantiles of the run's own finished lengths. At run time
   a request is re-classed by its partial length: one that has outgrown its class is promoted.
2. Budgets. Short requests get no draft, medium a moderate budget, long ones the widest budget
   from their first decode step (early speculation: long rollouts decide the makespan).
3. Width. Given the drafts and their path probabilities p_b,i (the drafter's expected
   acceptance of the first i tokens of row b), the step width is

       W* = argmax_W  sum_b (1 + sum_{i < min(len_b, W-1)} p_b,i)  /  t(B, W, S)

   i.e. expected emitted tokens per second under the fitted cost model t (`cost_model.py`).
   Rows share W (one static-shape step), so each row verifies min(len_b, W-1) of its tokens.
   The path probabilities are calibrated online: they are scaled by the running ratio of
   accepted to predicted draft tokens, and every `explore_every`-th step that would not
   speculate verifies the next width anyway, so both the cost model and the calibration keep
   learning.
   Because t grows with B * W, the argmax speculates little while the batch is large and
   compute-bound, and more as the batch shrinks to the memory-bound stragglers. This replaces the
   paper's closed-form per-class budget (its Eq. 7) with an argmax over the measured cost model;
   the class budgets above are the caps the argmax works under.
4. Admission. Predicted-long requests enter slots first, so they start early.

`unlimited=True` gives the "das-unlimited" ablation: every request gets the widest budget and W
is the smallest compiled width that holds the longest draft (no classes, no cost model).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Callable, Hashable, Sequence

import numpy as np

from das_jax.engine.cost_model import CostModel
from das_jax.engine.policy import RowView, StepRecord

SHORT, MEDIUM, LONG = "short", "medium", "long"
_ORDER = {SHORT: 0, MEDIUM: 1, LONG: 2}


@dataclasses.dataclass(frozen=True)
class DASConfig:
    """Settings of the DAS policy.

    short_quantile / long_quantile: quantiles of the run's finished lengths that separate the
      classes (used unless short_threshold / long_threshold, in tokens, are given).
    budget_short / budget_medium / budget_long: draft-token caps per class (None = widest).
    min_history: finished rollouts needed before quantile thresholds are trusted (before that
      every request is medium).
    length_history: most recent finished lengths the quantile thresholds are taken over.
    acceptance_ema: weight of each step in the running ratio of accepted to predicted draft
      tokens, which rescales the drafter's path probabilities (calibration).
    explore_every: every n-th step whose best choice is W = 1 although drafts exist verifies
      the next width instead, so the cost model and the calibration keep seeing speculative
      steps (0 disables).
    unlimited: the das-unlimited ablation (see module docstring).
    """

    short_quantile: float = 1 / 3
    long_quantile: float = 2 / 3
    short_threshold: int | None = None
    long_threshold: int | None = None
    budget_short: int = 0
    budget_medium: int = 3
    budget_long: int | None = None
    min_history: int = 8
    length_history: int = 4096
    acceptance_ema: float = 0.1
    explore_every: int = 16
    unlimited: bool = False

    def __post_init__(self):
        if not 0 < self.short_quantile < self.long_quantile < 1:
            raise ValueError("DAS quantiles need 0 < short_quantile < long_quantile < 1, got "
                             f"{self.short_quantile}, {self.long_quantile}")
        for name in ("budget_short", "budget_medium"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


class DASPolicy:
    """Implements `das_jax.engine.policy.SpeculationPolicy`.

    Args:
      lengths_fn: problem id -> generated lengths of that problem's past rollouts (the drafter's
        `ProblemHistory.lengths`); may return [] for an unseen problem.
      config: `DASConfig`.
      cost_model: the `CostModel` (fitted at warm-up by `cost_model.calibrate`, refined online).
    """

    def __init__(self, lengths_fn: Callable[[Hashable], Sequence[int]] | None = None,
                 config: DASConfig = DASConfig(), cost_model: CostModel | None = None):
        self.lengths_fn = lengths_fn or (lambda pid: ())
        self.config = config
        self.cost_model = cost_model or CostModel()
        self.finished_lengths: collections.deque = collections.deque(maxlen=config.length_history)
        self.classes: dict[int, str] = {}
        self.acceptance_scale = 1.0
        self._expected_accepted: float | None = None
        self._steps = 0

    # ----- classes ------------------------------------------------------------------------------
    def thresholds(self) -> tuple[float, float] | None:
        """(short, long) length thresholds in tokens, or None while there is too little history."""
        c = self.config
        if c.short_threshold is not None and c.long_threshold is not None:
            return float(c.short_threshold), float(c.long_threshold)
        if len(self.finished_lengths) < c.min_history:
            return None
        lens = np.asarray(self.finished_lengths, np.float64)
        lo = c.short_threshold if c.short_threshold is not None else np.quantile(lens, c.short_quantile)
        hi = c.long_threshold if c.long_threshold is not None else np.quantile(lens, c.long_quantile)
        return float(lo), float(max(hi, lo))

    def classify_length(self, n: float, th: tuple[float, float] | None) -> str:
        if th is None:
            return MEDIUM
        lo, hi = th
        if n > hi:
            return LONG
        # A degenerate history (every rollout the same length) has no short class.
        return SHORT if n <= lo and lo < hi else MEDIUM

    def initial_class(self, problem_id: Hashable) -> str:
        """The class most common among the problem's past rollouts (ties: the longer class)."""
        th = self.thresholds()
        past = list(self.lengths_fn(problem_id))
        if th is None or not past:
            return MEDIUM
        counts = collections.Counter(self.classify_length(n, th) for n in past)
        return max(counts, key=lambda k: (counts[k], _ORDER[k]))

    def predicted_length(self, problem_id: Hashable) -> float:
        past = list(self.lengths_fn(problem_id))
        return float(np.median(past)) if past else -1.0

    # ----- SpeculationPolicy --------------------------------------------------------------------
    def admission_order(self, problem_ids: Sequence[Hashable]) -> list[int]:
        cache: dict[Hashable, float] = {}
        pred = [cache.setdefault(p, self.predicted_length(p)) for p in problem_ids]
        return sorted(range(len(problem_ids)), key=lambda i: -pred[i])  # stable: ties keep order

    def begin(self, request_id: int, problem_id: Hashable, prompt_len: int) -> None:
        self.classes[request_id] = self.initial_class(problem_id)

    def current_class(self, row: RowView, th) -> str:
        cls = self.classes.get(row.request_id, MEDIUM)
        grown = self.classify_length(row.generated, th)
        if th is not None and _ORDER[grown] > _ORDER[cls]:
            cls = self.classes[row.request_id] = grown   # promotion: outgrew its class
        return cls

    def draft_budgets(self, rows: Sequence[RowView], batch: int, max_width: int) -> np.ndarray:
        widest = max_width - 1
        c = self.config
        if c.unlimited:
            return np.array([min(widest, max(r.remaining - 1, 0)) for r in rows], np.int32)
        th = self.thresholds()
        caps = {SHORT: c.budget_short, MEDIUM: c.budget_medium,
                LONG: widest if c.budget_long is None else c.budget_long}
        return np.array([min(caps[self.current_class(r, th)], widest, max(r.remaining - 1, 0))
                         for r in rows], np.int32)

    def choose(self, rows, draft_probs, batch, widths, kv_len):
        lens = np.array([len(p) for p in draft_probs], np.int32)
        longest = int(lens.max(initial=0))
        self._expected_accepted = None
        if self.config.unlimited or longest == 0:
            need = 1 + longest
            width = next((w for w in sorted(widths) if w >= need), max(widths))
            return width, np.minimum(lens, width - 1), self.cost_model.predict(batch, width, kv_len)
        # Candidate widths: every width up to the smallest one that holds the longest draft.
        cands = []
        for w in sorted(widths):
            cands.append(w)
            if w >= 1 + longest:
                break
        scale = self.acceptance_scale
        scored = []
        for w in cands:
            raw = sum(float(np.sum(p[:w - 1])) for p in draft_probs)
            expected = len(draft_probs) + float(sum(np.sum(np.minimum(p[:w - 1] * scale, 1.0))
                                                    for p in draft_probs))
            t = self.cost_model.predict(batch, w, kv_len)
            scored.append((expected / max(t, 1e-9), w, t, raw))
        best = max(scored, key=lambda x: (x[0], -x[1]))
        self._steps += 1
        if (best[1] == cands[0] and len(cands) > 1 and self.config.explore_every
                and self._steps % self.config.explore_every == 0):
            best = scored[1]   # exploration: keep measuring a speculative width
        _, width, t, raw = best
        self._expected_accepted = raw if width > 1 else None
        return width, np.minimum(lens, width - 1), t

    def observe(self, record: StepRecord) -> None:
        self.cost_model.observe(record.batch, record.width, record.kv_len, record.seconds)
        if self._expected_accepted and record.drafted:
            # Calibrate the drafter's path probabilities against what verification accepted.
            ratio = record.accepted / self._expected_accepted
            a = self.config.acceptance_ema
            self.acceptance_scale = float(np.clip((1 - a) * self.acceptance_scale + a * ratio,
                                                  0.02, 2.0))

    def end(self, request_id: int, num_tokens: int) -> None:
        self.classes.pop(request_id, None)
        self.finished_lengths.append(num_tokens)

    def step_classes(self, rows: Sequence[RowView]) -> dict:
        counts = {SHORT: 0, MEDIUM: 0, LONG: 0}
        for r in rows:
            counts[self.classes.get(r.request_id, MEDIUM)] += 1
        return counts

    def fork(self, drafter=None) -> "DASPolicy":
        """A copy for another device: the same config, a copy of the fitted cost model (with its
        observations) and of the finished lengths; problem history from `drafter.lengths` (the
        shared, locked drafter) when given, else this policy's `lengths_fn`."""
        lengths_fn = drafter.lengths if drafter is not None else self.lengths_fn
        p = DASPolicy(lengths_fn, self.config, copy.deepcopy(self.cost_model))
        p.finished_lengths.extend(self.finished_lengths)
        return p

    # ----- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"finished_lengths": list(self.finished_lengths),
                "cost_model": self.cost_model.to_dict(),
                "acceptance_scale": self.acceptance_scale}

    def load_state_dict(self, state: dict) -> None:
        self.finished_lengths.clear()
        self.finished_lengths.extend(int(n) for n in state.get("finished_lengths", ()))
        for k, v in state.get("cost_model", {}).items():
            setattr(self.cost_model, k, float(v))
        self.acceptance_scale = float(state.get("acceptance_scale", 1.0))
