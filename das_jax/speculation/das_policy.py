"""The DAS length-aware speculation policy (arXiv 2511.13841, §4), with the budget as an
optimisation.

Decides how much to speculate, for whom, at each decode step:

1. Length classes. A request starts in the class (short / medium / long) most common among its
   problem's past rollout lengths (ties go to the longer class; no history: medium). Class
   thresholds default to the 1/3 and 2/3 quantiles of the run's own finished lengths. At run time
   a request is re-classed by its partial length: one that has outgrown its class is promoted,
   so rows still running in the tail of the length distribution count as long.
2. Row weights. A synchronous RL step ends with its longest rollout, so the cost a step pays
   whatever the drafts -- its fixed cost c_base and its attention reads c_kv * K -- is paid for
   the rows that will finish last: each row bears a share beta_b of it. While requests wait for a
   slot every live row bears an equal share (a row that finishes early is replaced, so the step
   count follows the total work); once none wait, the share goes by class weight, w_b / sum w
   with w_b = `weight_short` / `weight_medium` / `weight_long` (a row predicted long, or still
   running in the tail, is more likely the last one).
3. The budget. Row b then costs each step f_b = c_tok + beta_b * (c_base + c_kv * K), plus
   c_tok per draft token, and a draft of n tokens emits 1 + Q_b(n) tokens in expectation,
   Q_b(n) = sum_{d <= n} q_b,d, q_b,d the calibrated chance that its first d draft tokens are
   all accepted (the drafter's path probability times a per-depth calibration factor, made
   nonincreasing in d). So a token of row b is worth lambda_b = min_n (f_b + c_tok * n) /
   (1 + Q_b(n)) seconds, its least expected decoding cost on a later step, and the step
   chooses every row's draft length n_b in 0..len(draft_b) to minimise the net time

       F(n) = t(step_shape(n)) - sum_b lambda_b * (1 + Q_b(n_b)),

   t the fitted cost model (`CostModel.predict_step`) and `step_shape` the engine's map from a
   choice to the token slots and attended KV it computes (packed: sum_b (1 + n_b); padded:
   B * W(max n_b)). That is Dinkelbach's form of minimising the rollout's expected decoding
   time per emitted token, row by row (W. Dinkelbach, "On nonlinear fractional programming",
   Management Science 13(7), 1967): with a packed step linear in the token slots the optimum
   is each row's own argmin of g_b(n) = (f_b + c_tok * n) / (1 + Q_b(n)), a draft token being
   added exactly when lambda_b * q_b,d >= c_tok. Candidates: no drafts, that per-row optimum
   and all drafts, each capped at every depth 1..longest (a padded step's cost jumps with the
   widest draft), and up to `MAX_VALUE_CUTS` cut-offs of the greedy order of marginal value
   lambda_b * q_b,d (nonincreasing along a row's draft, so every prefix of that order is a
   valid choice); the smallest F wins. No drafts and all drafts are among the candidates, so
   the chosen budget never has a larger F than either (tests/test_das_policy.py checks it on
   random cost models). Because t grows with the computed tokens while the per-step costs are
   shared by many rows, the optimum drafts only well-accepted tokens while the batch is large
   and compute-bound, and more as it shrinks to the memory-bound stragglers, whose share of
   the per-step cost grows.
4. Calibration. A suffix-trie draft says for each token how many past occurrences its estimate
   rests on (`Draft.support`: the count of the context path it continues). The drafter's count
   ratio of a token seen once is 1 whatever the model does next, and such tokens were accepted
   only about half the time on GSM8K at T=0.6 (SmolLM2-135M: drafted path probability >= 0.95,
   46% of those paths accepted). So each token's conditional chance of acceptance is its count
   ratio P_i / P_{i-1} times the factor of its support bucket (1, 2-3, 4-7, 8-15, 16-31, 32+;
   starting at c / (c + 1), `support_prior`), and q_b,d is their product. The factors are
   calibrated online: per bucket, an EMA (`acceptance_ema`) of accepted over predicted tokens
   among the tokens a step verified after an accepted prefix (each such token is one trial of
   its own ratio). The history a draft is found in was sampled by older policies, and the
   policy moves with every update, so the drafts of an older history are accepted less: the
   support factors are kept per age bucket of the row's history too (`DraftBatch.age_A`, in
   policy versions: under 1, 1, 2-3, 4-7, 8-15, 16+), each bucket learning from its own rows,
   a bucket seen for the first time starting from the nearest younger bucket's factors
   (`age_calibration`). A draft without support is calibrated per depth instead (an EMA of committed
   accepted tokens at each depth over the predicted ones). Both factor sets are kept per draft
   source (`DraftBatch.source_A`: the history's problem, request and global tries, a draft
   head, other drafters; `source_calibration`): the global trie's counts come from other
   problems and a request's own from its loops, so a count ratio means something else in each,
   and a head's softmax probabilities are calibrated apart from any other support-less
   drafter's. A source's (age) row seen for the first time starts from its nearest younger
   age's factors, else from the problem trie's (off by default: `source_calibration`). Every
   `explore_every`-th step whose best choice is no drafts although drafts exist verifies the
   best speculative candidate anyway, so the cost model and the calibration keep learning.
5. Admission. Predicted-long requests enter slots first, so they start early.
6. Measured shapes. With a cost model that keeps measured times per step shape (`CostModel`
   with a width: `CostModel.predict_step`), a choice is priced by its shape's measured time.
   A drafting shape never run is priced by the linear fit and costs a compile
   (`CostModel.compile_s`, measured), so it is bought as in the ski-rental problem: every step
   on which it would have beaten the best measured choice adds the predicted seconds it would
   have saved to its account, and it is compiled once the account reaches the compile time
   (`_buy_unmeasured`). A shape that would pay once is never compiled, and a compile is paid
   only once the savings it was predicted to bring have reached its price. Before any drafting shape is measured (no
   calibration), an exploration step may run the best drafting choice, at most once per
   `UNSEEN_EVERY` * explore_every steps.

7. Two drafts per row (`tree`). When a row has drafts from two sources (the history's and a
   draft head's) whose first tokens differ, verifying both in one step (a two-branch token
   tree, `engine.step.verify_packed`) emits the longer accepted one; the two cannot both accept
   their first token, so the expected tokens add: 1 + Q_b(n_b) + Q'_b(m_b), Q' the second
   draft's calibrated acceptance. After the budget above chose n_b, the second draft's token d
   is added while lambda_b * q'_b,d >= c_tok (the rule of item 3) within the slots the row's
   widest width leaves, and the tree is verified when its step's predicted time less the
   step without it is below sum_b lambda_b * Q'_b(m_b); an unmeasured tree shape is bought by
   the ski-rental rule of item 6. Both drafts are verified, so both sources' calibrations
   learn from every tree step (the losing branch accepted none: they differ at their first
   token).

Ablations: `unlimited=True` is "das-unlimited" (every row verifies its whole draft; no classes,
no cost model); `budget_short` / `budget_medium` / `budget_long` cap the draft tokens requested
per class (the paper's class budgets; the optimiser still chooses within the caps).
"""
from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import math
from typing import Callable, Hashable, Sequence

import numpy as np

from das_jax.drafter.base import DRAFT_SOURCES, OTHER_SOURCE, DraftBatch, pick_rows
from das_jax.engine import StepRecord, shape_key
from das_jax.engine.policy import RowBatch, as_draft_batch
from das_jax.speculation.acceptance import (AGE_BUCKET_LABELS, AGE_BUCKETS, SUPPORT_BUCKETS, age_buckets_of,
                                            calibration_args, grow_depth_scale, step_ratios,
                                            support_bucket, support_prior, update_depth_scale,
                                            update_support_scale)
from das_jax.speculation.cost_model import CostModel

__all__ = ["DASPolicy", "DASConfig", "SHORT", "MEDIUM", "LONG", "SUPPORT_BUCKETS",
           "step_ratios", "support_bucket", "support_prior"]

SHORT, MEDIUM, LONG = "short", "medium", "long"
N_SOURCES = len(DRAFT_SOURCES)
PROBLEM_SOURCE = DRAFT_SOURCES.index("problem")
CLASS_NAMES = (SHORT, MEDIUM, LONG)     # class codes 0, 1, 2 (ordered: a longer class is larger)
_ORDER = {name: i for i, name in enumerate(CLASS_NAMES)}
_NONE = -1                 # no class recorded (a request not begun): counts as medium
MAX_VALUE_CUTS = 24        # value cut-offs of the greedy order evaluated per step
UNSEEN_EVERY = 4           # cold start: one unmeasured shape per UNSEEN_EVERY * explore_every steps


@dataclasses.dataclass(frozen=True)
class DASConfig:
    """Settings of the DAS policy (the `das.policy` section of a run config).

    short_quantile / long_quantile: quantiles of the run's finished lengths that separate the
      classes (used unless short_threshold / long_threshold, in tokens, are given).
    weight_short / weight_medium / weight_long: by class, a row's weight in sharing the
      per-step cost (c_base + attention reads) among the live rows once no request waits for a
      slot (> 0; long rows decide when the step ends, so they weigh most). Its share raises
      what the row's tokens are worth, so it drafts deeper.
    budget_short / budget_medium / budget_long: optional caps on the draft tokens requested per
      class (null: no cap; the class-caps ablation is 0 / 3 / null).
    min_history: finished rollouts needed before quantile thresholds are trusted (before that
      every request is medium).
    length_history: most recent finished lengths the quantile thresholds are taken over.
    acceptance_ema: weight of each step in the running ratios of committed accepted to
      predicted draft tokens, per support bucket (per depth for drafts without support), which
      rescale the drafter's probabilities (calibration).
    explore_every: every n-th step whose best choice is no drafts although drafts exist verifies
      the best speculative choice of a measured shape instead (of any shape while no drafting
      shape is measured), so the cost model and the calibration keep seeing speculative steps
      (0 disables).
    unlimited: the das-unlimited ablation (module docstring).
    age_calibration: scale each draft by a factor per age of the history it comes from (policy
      versions since its rollouts were sampled; calibrated online, module docstring item 4);
      false: every history is trusted as if sampled by the current policy.
    source_calibration: keep the calibration factors per draft source (`DRAFT_SOURCES`,
      module docstring item 4); false (the default): drafts with support share the problem
      trie's factors and drafts without share one set of per-depth factors, whatever their
      source. Off by default: the factors move by a fixed EMA weight per step, so splitting a
      step's trials among sources makes each source's factors noisier, and in the paper-scale
      replay that cost more than the split gained (docs/results/draft-head.md).
    tree: where the drafter offers a row a second draft from another source (a draft head's
      beside the history's, `DraftBatch.alternative`), verify it beside the row's own as a
      two-branch token tree when its expected tokens pay for its slots (module docstring item
      7, `second_branch`); false: one draft per row, the better source's (`pick_sources`).
    """

    short_quantile: float = 1 / 3
    long_quantile: float = 2 / 3
    short_threshold: int | None = None
    long_threshold: int | None = None
    weight_short: float = 0.5
    weight_medium: float = 1.0
    weight_long: float = 2.0
    budget_short: int | None = None
    budget_medium: int | None = None
    budget_long: int | None = None
    min_history: int = 8
    length_history: int = 4096
    acceptance_ema: float = 0.1
    explore_every: int = 16
    unlimited: bool = False
    age_calibration: bool = True
    source_calibration: bool = False
    tree: bool = False

    def __post_init__(self):
        if not 0 < self.short_quantile < self.long_quantile < 1:
            raise ValueError("DAS quantiles need 0 < short_quantile < long_quantile < 1, got "
                             f"{self.short_quantile}, {self.long_quantile}")
        for name in ("budget_short", "budget_medium", "budget_long"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 or null, got {getattr(self, name)}")
        for name in ("weight_short", "weight_medium", "weight_long"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.acceptance_ema <= 1:
            raise ValueError(f"acceptance_ema must be in (0, 1], got {self.acceptance_ema}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")


def _quantile(sorted_x: Sequence[float], q: float) -> float:
    """`np.quantile(sorted_x, q)` (its default, linear method, and the same float arithmetic)
    of a nonempty ascending sequence, without sorting it again."""
    h = (len(sorted_x) - 1) * q
    lo = math.floor(h)
    a = float(sorted_x[lo])
    b = float(sorted_x[min(lo + 1, len(sorted_x) - 1)])
    t = h - lo
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def _attended(step_shape, lens_A: np.ndarray) -> tuple:
    """(read_kv or None, the attended cached positions per row) of the steps `step_shape`
    prices: the same for every choice of drafts."""
    read_kv = getattr(step_shape, "read_kv", None)
    if read_kv is not None:
        return read_kv, read_kv
    base = step_shape(np.zeros_like(lens_A))
    read_kv = getattr(base, "read_kv", None)
    return read_kv, (base[1] if read_kv is None else read_kv)


@dataclasses.dataclass(frozen=True)
class _Scored:
    """A step's C candidate choices, priced: F float64 `[C]` (the objective, seconds), t
    float64 `[C]` (predicted step seconds), k int64 `[C]` (draft tokens), measured bool `[C]`
    (the shape's program has run, or the choice drafts nothing), shapes (C shape keys)."""

    F: np.ndarray
    t: np.ndarray
    k: np.ndarray
    measured: np.ndarray
    shapes: list

    def best(self, idx: np.ndarray) -> int:
        """The index among `idx` (nonempty) of the smallest (F, t, k), the first on ties."""
        order = np.lexsort((self.k[idx], self.t[idx], self.F[idx]))
        return int(idx[order[0]])


class DASPolicy:
    """Implements `das_jax.engine.SpeculationPolicy`.

    Args:
      lengths_fn: problem id -> generated lengths of that problem's past rollouts (the drafter's
        `ProblemHistory.lengths`); may return [] for an unseen problem.
      config: `DASConfig`.
      cost_model: the `CostModel` (fitted at warm-up by `cost_model.calibrate`, refined online
        from every step's (num_tokens, attended_kv, seconds)).
    """

    def __init__(self, lengths_fn: Callable[[Hashable], Sequence[int]] | None = None,
                 config: DASConfig = DASConfig(), cost_model: CostModel | None = None):
        self.lengths_fn = lengths_fn or (lambda pid: ())
        self.config = config
        self.cost_model = cost_model or CostModel()
        self.finished_lengths: collections.deque = collections.deque(maxlen=config.length_history)
        self._class_R = np.full(0, _NONE, np.int8)   # class code by request id
        # per-depth calibration factors of drafts without support, per source index (grown on
        # demand; a source not in it starts at 1.0)
        self.depth_by_source: dict[int, np.ndarray] = {}
        # factors per (source, history age bucket, support bucket); (source, age) rows with
        # trials so far
        self.support_by_source = np.tile(support_prior(), (N_SOURCES, AGE_BUCKETS, 1))
        self.ages_seen_by_source = np.zeros((N_SOURCES, AGE_BUCKETS), bool)
        # draft tokens verified / accepted per history age bucket, cumulative (rows with an age)
        self.drafts_by_age = np.zeros((2, AGE_BUCKETS), np.int64)
        self._pending = None               # (n_draft, probabilities, supports) of last choice
        self._pending_second = None        # (n, drafts) of the last step's second branch
        self._unlearned: list[tuple] = []  # `_learn` arguments that observe deferred
        self._steps = 0
        self._last_unseen = None           # step of the last unmeasured shape explored
        self._regret: dict = {}            # unmeasured shape -> seconds it would have saved
        self._finished_count = 0           # finished rollouts seen (invalidates _th_cache)
        self._th_cache = None
        # finished_lengths sorted, kept by `end` (None: rebuilt at the next `thresholds`)
        self._sorted_lengths: list | None = None
        self._waiting = 0                  # requests of this generate call not yet in a slot
        self._step_classes = None          # (rows, class codes) of the step being planned
        self._planned_classes = None       # the same, of the step `choose` last planned
        # (age_A, its age buckets) of the last steps' drafts: each computed once, for the
        # step's choose and its calibration update (with deferred learning, after the next
        # step's choose)
        self._ages: list[tuple[np.ndarray, np.ndarray]] = []
        c = config                         # per class code: weight, draft token cap
        self._class_weights = np.array([c.weight_short, c.weight_medium, c.weight_long],
                                       np.float64)
        self._class_caps = np.array([np.iinfo(np.int64).max if x is None else x
                                     for x in (c.budget_short, c.budget_medium, c.budget_long)],
                                    np.int64)

    # ----- classes ------------------------------------------------------------------------------
    def thresholds(self) -> tuple[float, float] | None:
        """(short, long) length thresholds in tokens, or None while there is too little history."""
        c = self.config
        if c.short_threshold is not None and c.long_threshold is not None:
            return float(c.short_threshold), float(c.long_threshold)
        if len(self.finished_lengths) < c.min_history:
            return None
        if self._th_cache is not None and self._th_cache[0] == self._finished_count:
            return self._th_cache[1]
        self._th_cache = (self._finished_count, self._quantile_thresholds())
        return self._th_cache[1]

    def _quantile_thresholds(self) -> tuple[float, float]:
        c = self.config
        if self._sorted_lengths is None or len(self._sorted_lengths) != len(self.finished_lengths):
            self._sorted_lengths = sorted(self.finished_lengths)
        lens = self._sorted_lengths
        lo = c.short_threshold if c.short_threshold is not None else _quantile(lens, c.short_quantile)
        hi = c.long_threshold if c.long_threshold is not None else _quantile(lens, c.long_quantile)
        return float(lo), float(max(hi, lo))

    def classify_length(self, n: float, th: tuple[float, float] | None) -> str:
        """The class of a rollout of `n` tokens under thresholds `th` (None: medium)."""
        return CLASS_NAMES[int(self.classify_lengths(np.array([n]), th)[0])]

    @staticmethod
    def classify_lengths(n_A: np.ndarray, th: tuple[float, float] | None) -> np.ndarray:
        """int8 `[A]` class codes (0 short, 1 medium, 2 long) of lengths `n_A` (tokens): long
        above the long threshold, short at or below the short one (unless both are equal: a
        degenerate history has no short class), else medium; all medium when `th` is None."""
        n_A = np.asarray(n_A, np.float64)
        if th is None:
            return np.full(n_A.shape, 1, np.int8)
        lo, hi = th
        short = (n_A <= lo) & (lo < hi)
        return np.where(n_A > hi, 2, np.where(short, 0, 1)).astype(np.int8)

    def initial_class(self, problem_id: Hashable) -> str:
        """The class most common among the problem's past rollouts (ties: the longer class)."""
        th = self.thresholds()
        past = list(self.lengths_fn(problem_id))
        if th is None or not past:
            return MEDIUM
        counts = np.bincount(self.classify_lengths(np.array(past), th), minlength=3)
        return CLASS_NAMES[int(2 - np.argmax(counts[::-1]))]

    @property
    def classes(self) -> dict[int, str]:
        """{request id: class} of the requests begun and not ended."""
        return {int(r): CLASS_NAMES[c] for r, c in enumerate(self._class_R) if c != _NONE}

    def predicted_length(self, problem_id: Hashable) -> float:
        past = list(self.lengths_fn(problem_id))
        return float(np.median(past)) if past else -1.0

    # ----- SpeculationPolicy --------------------------------------------------------------------
    def admission_order(self, problem_ids: Sequence[Hashable]) -> list[int]:
        cache: dict[Hashable, float] = {}
        pred = [cache.setdefault(p, self.predicted_length(p)) for p in problem_ids]
        self._waiting = len(problem_ids)
        return sorted(range(len(problem_ids)), key=lambda i: -pred[i])  # stable: ties keep order

    def begin(self, request_id: int, problem_id: Hashable, prompt_len: int) -> None:
        if request_id >= len(self._class_R):
            grown = np.full(max(2 * len(self._class_R), request_id + 1, 64), _NONE, np.int8)
            grown[:len(self._class_R)] = self._class_R
            self._class_R = grown
        self._class_R[request_id] = _ORDER[self.initial_class(problem_id)]
        self._waiting = max(self._waiting - 1, 0)

    def _classes_of(self, rows: RowBatch) -> np.ndarray:
        """`current_classes` of this step's rows, computed once per step: `draft_budgets` and
        `choose` see the same `RowBatch` object (`engine.policy.plan_step`)."""
        cached = self._step_classes
        if cached is not None and cached[0] is rows:
            return cached[1]
        cls = self.current_classes(rows, self.thresholds())
        self._step_classes = (rows, cls)
        return cls

    def current_classes(self, rows: RowBatch, th, record: bool = True) -> np.ndarray:
        """int8 `[A]` each row's class code, promoting rows whose generated length outgrew
        their class (and with `record`, recording the promotion)."""
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        lo, hi = th if th is not None else (0.0, 0.0)
        return _bk.row_classes(np.asarray(rows.request_ids, np.int64),
                               np.asarray(rows.generated, np.int64), self._class_R, float(lo),
                               float(hi), th is not None, bool(record))

    def row_weights(self, rows) -> np.ndarray:
        """float64 `[A]`: each row's class weight (promoting rows that outgrew it)."""
        return self._class_weights[self._classes_of(RowBatch.of(rows))]

    def draft_budgets(self, rows, batch: int, max_width: int, record: bool = True
                      ) -> np.ndarray:
        rows = RowBatch.of(rows)
        k = np.minimum(np.maximum(rows.remaining - 1, 0), max_width - 1)
        if not self.config.unlimited:
            cls = (self._classes_of(rows) if record
                   else self.current_classes(rows, self.thresholds(), record=False))
            k = np.minimum(k, self._class_caps[cls])
        return k.astype(np.int32)

    def calibrated(self, drafts, draft_support=None) -> np.ndarray:
        """float64 `[A, longest draft]`: q_b,d, the calibrated chance that row b's first d + 1
        draft tokens are accepted (`acceptance.calibrated_paths`; drafts: a `DraftBatch`, or
        per-row path probabilities with optional `draft_support`, see
        `engine.policy.as_draft_batch`)."""
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        return _bk.calibrate(*self._calibration_args(as_draft_batch(drafts, draft_support)))

    def _calibration_args(self, db: DraftBatch) -> tuple:
        """The arguments of the calibration kernel (`acceptance.calibration_args`) for the
        drafts `db`: each row's per-depth factors (its source's, grown to the longest draft)
        and support-table row (source and age bucket; a (source, age) row seen for the first
        time takes its neighbour's factors, `_adopt_new_ages`)."""
        D = int(db.lens_A.max(initial=0))
        src = self._sources(db)
        # the per-depth factors of the sources whose drafts have no support, only those
        unsupported = ~db.has_support_A & (db.lens_A > 0)
        bare = np.unique(src[unsupported]) if unsupported.any() else src[:0]
        for k in bare:
            self.depth_by_source[int(k)] = grow_depth_scale(
                self.depth_by_source.get(int(k), np.zeros(0)), D)
        depth = [self.depth_by_source[int(k)] for k in bare] or [np.zeros(0)]
        depth_row = (np.minimum(np.searchsorted(bare, src), len(depth) - 1) if len(bare) > 1
                     else np.zeros(len(src), np.int64))
        age0 = self._table_ages(db)
        self._adopt_new_ages(src[db.has_support_A], age0[db.has_support_A])
        return calibration_args(db.probs_AxK, db.lens_A, db.support_AxK, db.has_support_A,
                                depth, self._support_table(), src * AGE_BUCKETS + age0,
                                depth_row)

    def _sources(self, db) -> np.ndarray:
        """int64 `[A]`: the calibration source of each row (an index into `DRAFT_SOURCES`): its
        `source_A`; where unknown, "problem" for a draft with support and "other" without;
        with `source_calibration` off, those two for every row."""
        default = np.where(db.has_support_A, PROBLEM_SOURCE, OTHER_SOURCE).astype(np.int64)
        if not self.config.source_calibration or db.source_A is None:
            return default
        s = np.asarray(db.source_A, np.int64)
        return np.where(s >= 0, s, default)

    def _table_ages(self, db) -> np.ndarray:
        """int64 `[A]`: each row's age bucket in the support table (unknown or off: 0)."""
        ages = self._age_buckets(db)
        return np.zeros(len(db), np.int64) if ages is None else np.maximum(ages, 0)

    def _support_table(self) -> np.ndarray:
        """`support_by_source` as `[N_SOURCES * AGE_BUCKETS, SUPPORT_BUCKETS]` (a view: row
        source * AGE_BUCKETS + age)."""
        return self.support_by_source.reshape(N_SOURCES * AGE_BUCKETS, SUPPORT_BUCKETS)

    @property
    def depth_scale(self) -> np.ndarray:
        """float64 `[D]`: the per-depth factors of drafts without support of the "other"
        source (drafters that do not say theirs; every such draft with `source_calibration`
        off)."""
        return self.depth_by_source.setdefault(OTHER_SOURCE, np.zeros(0))

    @depth_scale.setter
    def depth_scale(self, value) -> None:
        self.depth_by_source[OTHER_SOURCE] = np.asarray(value, np.float64)

    @property
    def support_by_age(self) -> np.ndarray:
        """float64 `[AGE_BUCKETS, SUPPORT_BUCKETS]`: the support factors of the problem trie's
        drafts (and of drafts with support whose source is unknown) per history age. A view
        of `support_by_source`."""
        return self.support_by_source[PROBLEM_SOURCE]

    @property
    def ages_seen(self) -> np.ndarray:
        """bool `[AGE_BUCKETS]`: the problem source's age rows with trials so far (a view)."""
        return self.ages_seen_by_source[PROBLEM_SOURCE]

    @property
    def support_scale(self) -> np.ndarray:
        """float64 `[SUPPORT_BUCKETS]`: the support factors of fresh histories (age bucket 0;
        also those of every draft without an age, and all drafts with `age_calibration`
        off) of the problem source. A view of `support_by_age[0]`."""
        return self.support_by_age[0]

    def _age_buckets(self, db) -> np.ndarray | None:
        """int64 `[A]` the age bucket of each row's history (`acceptance.age_bucket`; -1: no
        age), or None with `age_calibration` off or a drafter that reports no ages."""
        if not self.config.age_calibration or db.age_A is None:
            return None
        for age_A, buckets in self._ages:
            if age_A is db.age_A:
                return buckets
        buckets = age_buckets_of(db.age_A, len(db))
        self._ages = self._ages[-2:] + [(db.age_A, buckets)]
        return buckets

    def _adopt_new_ages(self, src: np.ndarray, ages: np.ndarray) -> None:
        """(source, age bucket) rows among the pairs (`src`, `ages`) with no trials yet take the
        factors of the same source's nearest younger bucket that has some, else of the problem
        source's nearest bucket at or below theirs (none: they keep the prior)."""
        present = np.zeros((N_SOURCES, AGE_BUCKETS), bool)
        present[src, ages] = True
        new = present & ~self.ages_seen_by_source
        if not new.any():
            return
        g, seen = self.support_by_source, self.ages_seen_by_source
        for k, j in zip(*np.nonzero(new)):
            younger = np.flatnonzero(seen[k, :j])
            if len(younger):
                g[k, j] = g[k, younger[-1]]
                continue
            base = np.flatnonzero(seen[PROBLEM_SOURCE, :j + 1])
            if k != PROBLEM_SOURCE and len(base):
                g[k, j] = g[PROBLEM_SOURCE, base[-1]]

    @property
    def acceptance_scale(self) -> float:
        """Mean calibration factor over the depths seen so far (1.0 before any)."""
        return float(np.mean(self.depth_scale)) if len(self.depth_scale) else 1.0

    def candidates(self, lens: np.ndarray, value_BxD: np.ndarray,
                   n_opt: np.ndarray | None = None) -> np.ndarray:
        """int32 `[C, A]`: the choices the budget evaluates (row c: a draft length per live row):
        no drafts, every depth cap 1..longest of all drafts (the last is all drafts) and of
        `n_opt` (each row's own best draft length), and up to `MAX_VALUE_CUTS` cut-offs of the
        greedy marginal-value order."""
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        lens = np.asarray(lens, np.int64)
        return _bk.candidates(lens, np.asarray(value_BxD, np.float64),
                              np.zeros(len(lens), np.int32) if n_opt is None
                              else np.asarray(n_opt, np.int32), MAX_VALUE_CUTS,
                              n_opt is not None)

    def _shapes(self, step_shape, n_CxA: np.ndarray, distinct: tuple | None = None
                ) -> tuple[list[tuple], np.ndarray]:
        """(the distinct shape keys of the choices `n_CxA`, int64 `[C]` each choice's index
        among them); a key is `schedule.shape_key`'s (num_tokens, attended_kv, width or None,
        and R of a split query block). From `distinct` when given (int64 `[4, C]` those four
        per choice, the first choice of each distinct shape and each choice's index among them,
        as `_budget_kernels.choice_table` returns them for a shape function with
        `kernel_args`), else one call of the shape function per choice."""
        if distinct is None:
            keys = [self._shape_key(step_shape(n)) for n in n_CxA]
            index: dict = {}
            inv = np.array([index.setdefault(k, len(index)) for k in keys], np.int64)
            return list(index), inv
        cols_4xC, first, inv = distinct
        return ([k[:3] if not k[3] else k for k in map(tuple, cols_4xC[:, first].T.tolist())],
                inv)

    def _price_choices(self, step_shape, n_CxA: np.ndarray, read_kv: int | None,
                       distinct: tuple | None = None
                       ) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
        """(float64 `[C]` predicted seconds, bool `[C]` whether the shape has run
        (`_seen_key`), the C shape keys) of the choices `n_CxA` of a step reading `read_kv`
        cached positions (`distinct`: as in `_shapes`); each distinct shape is priced once."""
        keys, inv = self._shapes(step_shape, n_CxA, distinct)
        t = np.array([self._predict_key(k, read_kv) for k in keys], np.float64)
        seen = np.array([self._seen_key(k) for k in keys], bool)
        return t[inv], seen[inv], [keys[i] for i in inv.tolist()]

    def _predict(self, shape) -> float:
        """Predicted seconds of a step shape (`schedule.StepShape`): its measured time when the
        cost model has one for the shape's width, else the linear fit
        (`CostModel.predict_step`)."""
        return self._predict_key(self._shape_key(shape), getattr(shape, "read_kv", None))

    def _seen(self, shape) -> bool:
        """Whether the cost model has measured this shape (its program is compiled). True when
        the model has measured nothing yet (then it prices every shape alike)."""
        return self._seen_key(self._shape_key(shape))

    def _predict_key(self, key: tuple, read_kv: int | None = None) -> float:
        """`_predict` of a shape key (`_shape_key`) whose step reads `read_kv` cached positions
        (None: attended_kv)."""
        kw = {"branch_rows": key[4]} if len(key) > 4 else {}   # duck-typed models may lack it
        return float(self.cost_model.predict_step(key[0], key[1], width=key[2],
                                                  read_kv=read_kv,
                                                  wide_rows=key[3] if len(key) > 3 else 0,
                                                  **kw))

    def _seen_key(self, key: tuple) -> bool:
        """`_seen` of a shape key (`_shape_key`)."""
        return key[2] is None or not self.cost_model.table or self.cost_model.seen(*key)

    @staticmethod
    def _shape_key(shape) -> tuple:
        """The compiled program a step shape runs: (num_tokens, attended_kv, width), and the
        split query block's R when it has one (`schedule.shape_key`)."""
        width = getattr(shape, "width", None)
        if width is None:
            return (int(shape[0]), int(shape[1]), None)
        return shape_key(shape[0], shape[1], width, getattr(shape, "wide_rows", 0),
                         getattr(shape, "branch_rows", 0))

    def _measured_drafting(self) -> bool:
        """Whether the cost model has measured any step shape with drafts (width > 1)."""
        return any(k[2] > 1 for k in self.cost_model.table)

    def _buy_unmeasured(self, sc: "_Scored", best: int) -> int | None:
        """Ski rental over unmeasured shapes (the break-even rule of Karlin, Manasse, Rudolph &
        Sleator 1988, "Competitive snoopy caching", Algorithmica 3: rent until the rent paid
        equals the price, then buy; never more than twice the cost of the best choice made with
        hindsight). Each unmeasured shape among this step's drafting candidates that beats the
        measured choice `best` (smaller F, seconds) adds best F - its best F to
        `_regret[shape]`, the time the rollouts would have saved so far had it been compiled.
        Returns the best such candidate (an index into `sc`) whose shape's regret reached the
        cost model's `compile_s` (that account is then closed), else None: a shape that would
        pay only once is never compiled."""
        win = np.flatnonzero(~sc.measured & (sc.k > 0) & (sc.F < sc.F[best]))
        if not len(win):
            return None
        gains: dict = {}
        for i in win.tolist():
            sh = sc.shapes[i]
            gains[sh] = max(gains.get(sh, 0.0), float(sc.F[best] - sc.F[i]))
        for k, g in gains.items():
            self._regret[k] = self._regret.get(k, 0.0) + g
        ripe = np.array([i for i in win.tolist()
                         if self._regret[sc.shapes[i]] >= self.cost_model.compile_s], np.int64)
        if not len(ripe):
            return None
        top = sc.best(ripe)
        del self._regret[sc.shapes[top]]
        return top

    def base_shares(self, rows, weights: np.ndarray) -> np.ndarray:
        """float64 `[len(rows)]`: each row's share beta_b (summing to 1) of the cost a step pays
        whatever the drafts, c_base + c_kv * K (`row_fixed_costs`).

        While requests wait for a slot, a row that finishes early is replaced at once, so the
        number of steps follows the total work and every live row bears an equal share. Once
        none wait, the steps left are those of the row that finishes last; which row that is is
        uncertain, so the share goes by class weight (w_b / sum w: rows predicted long, or still
        running in the tail, bear most)."""
        if self._waiting > 0 or not weights.sum() > 0:
            return np.full(len(rows), 1.0 / max(len(rows), 1))
        return weights / weights.sum()

    def row_fixed_costs(self, rows, weights: np.ndarray,
                        attended_kv: int) -> np.ndarray:
        """float64 `[len(rows)]`, seconds: f_b, what row b adds to every step it is live in,
        drafts aside: its pending token's slot and its share beta_b (`base_shares`) of the cost
        the step pays whatever the drafts, the fixed cost and the attention reads (the step
        attends `attended_kv` cached positions): c_tok + beta_b * (c_base + c_kv * attended_kv).
        """
        cm = self.cost_model
        fixed = max(cm.c_base, 0.0) + max(cm.c_kv, 0.0) * attended_kv
        return max(cm.c_tok, 0.0) + fixed * self.base_shares(rows, weights)

    @staticmethod
    def token_values(f_B: np.ndarray, c_tok: float, cum_q_BxD1: np.ndarray,
                     lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lambda_B float64 seconds, n_B int32): each row's least expected cost per emitted
        token, min over n in 0..lens[b] of g_b(n) = (f_b + c_tok * n) / (1 + Q_b(n)), and the n
        attaining it (the smallest on ties); Q_b(n) = cum_q_BxD1[b, n], the expected accepted
        tokens of a draft of n. lambda_b is what a token of row b is worth: the decoding time
        the row would spend to emit it on a later step."""
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        return _bk.token_values(np.asarray(f_B, np.float64), float(c_tok),
                                np.asarray(cum_q_BxD1, np.float64), np.asarray(lens, np.int64))

    def objective(self, n: np.ndarray, lam_B: np.ndarray, cum_q_BxD1: np.ndarray,
                  shape) -> tuple[float, float]:
        """(F, predicted seconds t) of choice n, whose verify step has `shape`:
        F = t - sum_b lambda_b * (1 + Q_b(n_b)), the step's time less the decoding time its
        expected emitted tokens save (`token_values`). Smaller is better."""
        t = self._predict(shape)
        saved = float((lam_B * (1.0 + cum_q_BxD1[np.arange(len(n)), n])).sum())
        return t - saved, t

    def pick_sources(self, rows, drafts, step_shape) -> DraftBatch:
        """Per row, its draft or its `alternative` (another source's: a draft head's beside
        the history's), whichever has the smaller lambda_b, the least expected seconds per
        emitted token of the row under this step's cost model (`token_values`, with each
        draft's calibrated acceptance): the choice between sources priced as `choose` prices
        lengths. das-unlimited (no cost model): the drafter's pick.

        Args:
          rows: the live rows (`RowBatch`); drafts: a `DraftBatch` (its `alternative` of the
            same rows, or None); step_shape: as in `choose`.
        Returns:
          a `DraftBatch` whose `alternative` is each row's other draft (`second_branch`).
        """
        alt = drafts.alternative
        primary = dataclasses.replace(drafts, alternative=None)
        if alt is None or self.config.unlimited or not (alt.lens_A > 0).any():
            return primary
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        rows = RowBatch.of(rows)
        _, kv = _attended(step_shape, primary.lens_A)
        f = self.row_fixed_costs(rows, self.row_weights(rows), kv)
        c_tok = max(self.cost_model.c_tok, 0.0)
        lam = [self.token_values(f, c_tok, _bk.prefix_sums(self.calibrated(d)), d.lens_A)[0]
               for d in (primary, alt)]
        use = lam[1] < lam[0]
        return dataclasses.replace(pick_rows(primary, alt, use),
                                   alternative=pick_rows(alt, primary, use))

    def second_branch(self, rows, chosen: DraftBatch, other: DraftBatch, step_shape):
        """With `tree`: (first-draft lengths, second drafts) to verify beside the chosen drafts
        as a two-branch token tree (module docstring item 7; `engine.policy.plan_step`), or
        None: no row's second draft pays for its slots, or the tree step does not pay.

        Args:
          rows: the live rows (`RowBatch`); chosen: the drafts `choose` cut (a `DraftBatch`);
            other: each row's other-source draft (a `DraftBatch` of the same rows);
            step_shape: as in `choose`, with `.tree(n_first_A, n_second_A)` (the packed step's,
            `schedule.PackedStepShape`).
        """
        if not self.config.tree or self.config.unlimited or not hasattr(step_shape, "tree"):
            return None
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        rows = RowBatch.of(rows)
        k = chosen.lens_A.astype(np.int64)
        room = int(step_shape.widths[-1]) - 1 - k
        ok = (other.lens_A > 0) & (room > 0)
        if chosen.width and other.width:
            ok &= (k == 0) | (chosen.tokens_AxK[:, 0] != other.tokens_AxK[:, 0])
        if not ok.any():
            return None
        _, kv = _attended(step_shape, chosen.lens_A)
        f = self.row_fixed_costs(rows, self.row_weights(rows), kv)
        c_tok = max(self.cost_model.c_tok, 0.0)
        lam, _ = _bk.token_values(np.asarray(f, np.float64), c_tok,
                                  _bk.prefix_sums(self.calibrated(chosen)), k)
        q = self.calibrated(other)                       # [A, D]: nonincreasing along a row
        D = q.shape[1]
        pays = (lam[:, None] * q >= c_tok) & (np.arange(D)[None, :] < other.lens_A[:, None])
        m = np.minimum(np.where(pays.all(axis=1), D, pays.argmin(axis=1)), room)
        m = np.where(ok, np.maximum(m, 0), 0)
        if not m.any():
            return None
        saved = float((lam * _bk.prefix_sums(q)[np.arange(len(m)), m]).sum())
        single, tree = step_shape(k), step_shape.tree(k, m)
        gain = saved - (self._predict(tree) - self._predict(single))
        if gain <= 0:
            return None
        key = self._shape_key(tree)
        if not self._seen_key(key):      # ski rental (item 6): compile once it would have paid
            self._regret[key] = self._regret.get(key, 0.0) + gain
            if self._regret[key] < self.cost_model.compile_s:
                return None
            del self._regret[key]
        self._pending_second = (m.copy(), other.cut(m))
        return k, other.cut(m)

    def tree_seconds(self, shape) -> float:
        """Predicted seconds of a token tree's step shape (`schedule.PackedStepShape.tree`)."""
        return self._predict(shape)

    def choose(self, rows, drafts, step_shape, draft_support=None):
        """See `SpeculationPolicy.choose` (drafts: a `DraftBatch`, or per-row path
        probabilities with optional `draft_support`)."""
        db = as_draft_batch(drafts, draft_support)
        lens = db.lens_A.astype(np.int32)
        self._pending = self._pending_second = None
        if self.config.unlimited or lens.max(initial=0) == 0:
            return lens, self._predict(step_shape(lens))
        from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
        read_kv, kv = _attended(step_shape, lens)
        f = self.row_fixed_costs(rows, self.row_weights(rows), kv)
        self._planned_classes, self._step_classes = self._step_classes, None
        c_tok = max(self.cost_model.c_tok, 0.0)
        # calibration, token values, candidates, their savings and step shapes: one kernel
        kernel_args = getattr(step_shape, "kernel_args", None)
        shape_args = (kernel_args() if kernel_args is not None
                      else (np.zeros(0, np.int64),) * 3 + (0, 0))
        _, _, _, n_CxA, saved_C, sums_C, cols, first, inv = _bk.choice_table(
            *self._calibration_args(db), np.asarray(f, np.float64), c_tok, MAX_VALUE_CUTS,
            *shape_args)
        t_C, seen_C, shapes = self._price_choices(
            step_shape, n_CxA, read_kv, None if kernel_args is None else (cols, first, inv))
        sc = _Scored(t_C - saved_C, t_C, sums_C, (sums_C == 0) | seen_C, shapes)
        # Shapes already measured (compiled) are priced by their own times. A shape never run is
        # priced by the linear fit and costs a compile (`CostModel.compile_s`; ~1.5-2.5 s for
        # SmolLM2-135M on 2 CPU cores, 30-50 plain steps), so it is bought like skis in the
        # ski-rental problem: each step it would have beaten the best measured choice adds the
        # predicted seconds it would have saved to its account, and it is compiled once its
        # account reaches the compile time (`_buy_unmeasured`).
        best = sc.best(np.flatnonzero(sc.measured))
        self._steps += 1
        bought = self._buy_unmeasured(sc, best)
        if bought is not None:
            best = bought
        elif sc.k[best] == 0 and self.config.explore_every and \
                self._steps % self.config.explore_every == 0:
            # Exploration (calibration keeps learning): a measured drafting candidate; when the
            # cost model has measured no drafting shape at all, the best drafting one, at most
            # once per UNSEEN_EVERY * explore_every steps.
            seen_spec = np.flatnonzero((sc.k > 0) & sc.measured)
            new_ok = (self._last_unseen is None or self._steps - self._last_unseen
                      >= UNSEEN_EVERY * self.config.explore_every)
            if len(seen_spec):
                best = sc.best(seen_spec)
            elif new_ok and not self._measured_drafting():
                best = sc.best(np.flatnonzero(sc.k > 0))
                self._last_unseen = self._steps
        n = n_CxA[best]
        if n.sum():
            self._pending = (n.copy(), db)
        return n.astype(np.int32), float(sc.t[best])

    def observe(self, record: StepRecord, defer_learning: bool = False) -> None:
        """The step's measured time refits the cost model; its accepted tokens per row
        calibrate the acceptance estimates (module docstring item 4) of the drafts `choose`
        planned it with.

        defer_learning: keep the calibration update for `learn_deferred` (the scheduler runs
        it while the device computes the next step, so the next step is planned with the
        calibration up to the step before; where that step's choice first extends the
        calibration, to a deeper draft position or a new history age, the new entries start
        from the factors learned up to the step before too); the cost model still refits
        now. Without it, the updates kept before are run too."""
        R2 = getattr(record, "branch_rows", 0)
        kw = {"branch_rows": R2} if R2 else {}   # duck-typed models may lack the keyword
        self.cost_model.observe_step(*record.step_shape(), record.seconds, width=record.width,
                                     read_kv=record.read_kv, wide_rows=record.wide_rows, **kw)
        self._regret.pop(shape_key(*record.step_shape(), record.width, record.wide_rows, R2),
                         None)
        if record.compile_s > 0:
            self.cost_model.observe_compile(record.compile_s)
        pending, self._pending = self._pending, None
        second, self._pending_second = self._pending_second, None
        if record.drafted:
            self._keep_update(record, pending, second)
        if not defer_learning:
            self.learn_deferred()

    def _keep_update(self, record: StepRecord, pending, second) -> None:
        """The `_learn` arguments of a verified step with drafts, kept in `_unlearned`."""
        acc = (np.asarray(record.accepted_per_row, np.int64)
               if record.accepted_per_row is not None else None)
        won = getattr(record, "won_per_row", None)
        if second is not None and won is not None and acc is not None \
                and len(won) == len(acc) == len(second[0]):
            # Both drafts were verified and differ at their first token: the losing one
            # accepted none, the winning one the row's accepted tokens.
            won = np.asarray(won, bool)
            self._unlearned.append((*second, np.where(won, acc, 0), record.accepted))
            acc = np.where(won, 0, acc)
        if pending is not None:
            self._unlearned.append((*pending, acc, record.accepted))

    def learn_deferred(self) -> None:
        """Runs the calibration updates `observe(..., defer_learning=True)` kept, in order."""
        todo, self._unlearned = self._unlearned, []
        for args in todo:
            self._learn(*args)

    def _learn(self, n: np.ndarray, db: DraftBatch, acc: np.ndarray | None,
               accepted: int) -> None:
        """Calibration from one verified step (module docstring item 4): drafts `db` cut to
        `n` per row, of which `acc` per row were accepted (None: unknown per row; `accepted`
        in total)."""
        a = self.config.acceptance_ema
        per_row = acc is not None and len(acc) == len(n)
        acc = acc if per_row else None
        with_support = db.has_support_A & (n > 0)
        src = self._sources(db)
        if per_row and with_support.any():
            # Support buckets (per source and history age): each token verified after an
            # accepted prefix is a trial of its per-token ratio; the factor tracks accepted
            # trials over predicted ones.
            self.ages_seen_by_source |= update_support_scale(
                self._support_table(), n, acc, db.probs_AxK, db.support_AxK, with_support, a,
                src * AGE_BUCKETS + self._table_ages(db)).reshape(N_SOURCES, AGE_BUCKETS)
            ages = self._age_buckets(db)
            if ages is not None:
                aged = with_support & (ages >= 0)
                self.drafts_by_age[0] += np.bincount(ages[aged], n[aged], AGE_BUCKETS
                                                     ).astype(np.int64)
                self.drafts_by_age[1] += np.bincount(ages[aged], np.minimum(acc, n)[aged],
                                                     AGE_BUCKETS).astype(np.int64)
            n = np.where(with_support, 0, n)
            if not n.any():
                return
        # Per-depth factors, per source (without per-row counts every drafted row counts, as
        # "other" where it has support)
        src = np.where(db.has_support_A, OTHER_SOURCE, src)
        for k in np.unique(src[n > 0]):
            k = int(k)
            self.depth_by_source[k] = update_depth_scale(
                self.depth_by_source.get(k, np.zeros(0)), np.where(src == k, n, 0), acc,
                accepted, db.probs_AxK, a)

    def end(self, request_id: int, num_tokens: int) -> None:
        if 0 <= request_id < len(self._class_R):
            self._class_R[request_id] = _NONE
        kept, window = self._sorted_lengths, self.finished_lengths
        if kept is not None:            # the sorted copy follows the window (no re-sort)
            if len(window) == window.maxlen:
                del kept[bisect.bisect_left(kept, window[0])]
            bisect.insort(kept, num_tokens)
        window.append(num_tokens)
        self._finished_count += 1

    def step_classes(self, rows) -> dict:
        """{class: live rows} of the step just verified: the classes `choose` planned it with
        (a row that finished in it counts in its class), else the rows' recorded classes."""
        rows = RowBatch.of(rows)
        cached, self._planned_classes = self._planned_classes, None
        if cached is not None and cached[0] is rows:    # the classes `choose` planned with
            cls = cached[1]
        else:
            ids = rows.request_ids
            cls = np.full(len(ids), 1, np.int64)
            known = (ids >= 0) & (ids < len(self._class_R))
            cls[known] = self._class_R[ids[known]]
            cls = np.where(cls == _NONE, 1, cls)
        counts = np.bincount(cls, minlength=3)
        return {SHORT: int(counts[0]), MEDIUM: int(counts[1]), LONG: int(counts[2])}

    def fork(self, drafter=None) -> "DASPolicy":
        """A copy for another device: the same config, a copy of the fitted cost model (with its
        observations) and of the finished lengths; problem history from `drafter.lengths` (the
        shared, locked drafter) when given, else this policy's `lengths_fn`."""
        self.learn_deferred()
        lengths_fn = drafter.lengths if drafter is not None else self.lengths_fn
        p = DASPolicy(lengths_fn, self.config, copy.deepcopy(self.cost_model))
        p.finished_lengths.extend(self.finished_lengths)
        p._finished_count += 1
        p.depth_by_source = {k: v.copy() for k, v in self.depth_by_source.items()}
        p.support_by_source = self.support_by_source.copy()
        p.ages_seen_by_source = self.ages_seen_by_source.copy()
        return p

    def acceptance_by_age(self) -> dict[str, list]:
        """What drafts from histories of each age did so far (rows whose drafter reports ages,
        with `age_calibration` on): {"age_buckets": bucket labels in policy versions,
        "drafted": draft tokens verified, "accepted": of them accepted (committed),
        "factors": the learned support factors per age bucket (`support_by_age`)}."""
        return {"age_buckets": list(AGE_BUCKET_LABELS),
                "drafted": self.drafts_by_age[0].tolist(),
                "accepted": self.drafts_by_age[1].tolist(),
                "factors": self.support_by_age.tolist()}

    # ----- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.learn_deferred()
        return {"finished_lengths": list(self.finished_lengths),
                "cost_model": {**self.cost_model.to_dict(),
                               "compile_count": self.cost_model.compile_count},
                "acceptance_by_depth": [float(x) for x in self.depth_scale],
                "acceptance_by_support": [float(x) for x in self.support_scale],
                "acceptance_by_age_and_support": self.support_by_age.tolist(),
                "acceptance_ages_seen": [bool(x) for x in self.ages_seen],
                "acceptance_by_source_and_depth": {
                    DRAFT_SOURCES[k]: [float(x) for x in v]
                    for k, v in sorted(self.depth_by_source.items())},
                "acceptance_by_source_age_and_support": self.support_by_source.tolist(),
                "acceptance_ages_seen_by_source": self.ages_seen_by_source.tolist(),
                "drafts_by_age": self.drafts_by_age.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._unlearned = []            # the loaded calibration replaces what was learned
        self.finished_lengths.clear()
        self.finished_lengths.extend(int(n) for n in state.get("finished_lengths", ()))
        self._finished_count += 1
        self._sorted_lengths = None
        for k, v in state.get("cost_model", {}).items():
            setattr(self.cost_model, k, int(v) if k == "compile_count" else float(v))
        if "acceptance_by_depth" in state:
            depth = np.asarray(state["acceptance_by_depth"], np.float64)
        else:   # a checkpoint of the single-factor calibration
            depth = np.full(1, float(state.get("acceptance_scale", 1.0)))
        by_source = state.get("acceptance_by_source_and_depth")
        if by_source is not None:
            self.depth_by_source = {DRAFT_SOURCES.index(k): np.asarray(v, np.float64)
                                    for k, v in by_source.items() if k in DRAFT_SOURCES}
        else:   # one set of depth factors served every source without support
            self.depth_by_source = {OTHER_SOURCE: depth,
                                    DRAFT_SOURCES.index("head"): depth.copy()}
        support = state.get("acceptance_by_support")
        fresh = (np.asarray(support, np.float64) if support is not None
                 and len(support) == SUPPORT_BUCKETS else support_prior())
        table = state.get("acceptance_by_age_and_support")
        sources = state.get("acceptance_by_source_age_and_support")
        self.ages_seen_by_source = np.zeros((N_SOURCES, AGE_BUCKETS), bool)
        if sources is not None and np.shape(sources) == (N_SOURCES, AGE_BUCKETS,
                                                         SUPPORT_BUCKETS):
            self.support_by_source = np.array(sources, np.float64)
            self.ages_seen_by_source[:] = np.asarray(
                state["acceptance_ages_seen_by_source"], bool)
        elif table is not None and np.shape(table) == (AGE_BUCKETS, SUPPORT_BUCKETS):
            # a checkpoint from before sources: every source starts from the one table
            self.support_by_source = np.tile(np.asarray(table, np.float64), (N_SOURCES, 1, 1))
            self.ages_seen_by_source[PROBLEM_SOURCE] = np.asarray(
                state.get("acceptance_ages_seen", [True] * AGE_BUCKETS), bool)
        else:   # a checkpoint from before ages: every age starts from its support factors
            self.support_by_source = np.tile(fresh, (N_SOURCES, AGE_BUCKETS, 1))
            self.ages_seen_by_source[PROBLEM_SOURCE, 0] = support is not None
        if table is not None and np.shape(table) == (AGE_BUCKETS, SUPPORT_BUCKETS):
            self.drafts_by_age = np.asarray(state.get(
                "drafts_by_age", np.zeros((2, AGE_BUCKETS))), np.int64).reshape(2, AGE_BUCKETS)
        else:
            self.drafts_by_age = np.zeros((2, AGE_BUCKETS), np.int64)
