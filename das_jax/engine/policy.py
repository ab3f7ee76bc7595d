"""The speculation-policy protocol the engine consults each decode step, and the fixed policy.

A policy decides *how much* to speculate: how many draft tokens to ask the drafter for per row,
then, seeing the drafts and their path probabilities, each row's `n_draft` (0..its draft's
length). The engine says what a choice costs through a step-shape function
`step_shape(n_draft_B) -> (num_tokens, attended_kv)` (the token slots the verify step computes
and the cached positions it attends, summed over rows: the engine's `schedule.step_shape_fn`;
`padded_step_shape`, where every row pays for the widest draft, and `packed_step_shape` model
other engines), which the
policy prices with its cost model (`CostModel.predict_step`). It also sees every step's measured
time and shape (to fit the cost model) and may reorder admission. The DAS length-aware policy (`das_jax.speculation.DASPolicy`) implements
the same protocol.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Protocol, Sequence

import numpy as np

from das_jax.engine import schedule


@dataclasses.dataclass(frozen=True)
class RowView:
    """One live request as a policy sees it at a decode step.

    generated: tokens emitted so far; remaining: tokens it may still emit (max_new_tokens bound).
    """

    request_id: int
    problem_id: Hashable
    generated: int
    remaining: int


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one verify step did (also the per-step stats `generate` returns).

    batch: compiled batch bucket B; active: live rows; width: W; kv_len: attended cache length;
    drafted: draft tokens verified; accepted: accepted draft tokens *committed* (a row that stops
    at a stop token or max_new_tokens inside its draft counts only the tokens up to there, i.e.
    committed tokens - 1 per row); emitted: tokens committed; seconds: measured wall time of the
    step (device + host sync); predicted_seconds: the policy's prediction for it (None without a
    cost model); classes: per-class live row counts (policy-defined, e.g.
    {"long": 3, "medium": 5, "short": 0}); num_tokens / attended_kv: the token slots the step
    computed and the cached positions it attended, summed over rows (what the cost model
    observes; None: batch * width and batch * kv_len); accepted_per_row: committed accepted draft
    tokens of each live row, in the order of the rows the policy was shown (None: unknown);
    compile_s: seconds spent compiling the step's program, when the step was the first of its
    shape (0.0 otherwise; not part of `seconds`, and not compared: a program compiled by an
    earlier run of the process is not compiled again).
    """

    batch: int
    active: int
    width: int
    kv_len: int
    drafted: int
    accepted: int
    emitted: int
    seconds: float
    predicted_seconds: float | None = None
    classes: dict | None = None
    num_tokens: int | None = None
    attended_kv: int | None = None
    accepted_per_row: tuple[int, ...] | None = None
    compile_s: float = dataclasses.field(default=0.0, compare=False)

    def step_shape(self) -> tuple[int, int]:
        """(num_tokens, attended_kv) of the step (from batch, width, kv_len when not given)."""
        n = self.batch * self.width if self.num_tokens is None else self.num_tokens
        k = self.batch * self.kv_len if self.attended_kv is None else self.attended_kv
        return int(n), int(k)


# What a choice of per-row draft lengths computes: `schedule.StepShape` (num_tokens, attended_kv).
ShapeFn = Callable[[np.ndarray], "tuple[int, int]"]


def padded_step_shape(batch: int, widths: Sequence[int], kv_len: int) -> ShapeFn:
    """The step shape of a padded verify (`das_jax.engine.reference`): every row of the batch
    bucket computes W token slots, W the smallest compiled width holding 1 + the longest draft
    (the widest width when none does), and attends the attended-length bucket `kv_len`:
    (batch * W, batch * kv_len)."""
    ws = sorted(int(w) for w in widths)

    def shape(n_draft_B: np.ndarray) -> schedule.StepShape:
        W = schedule.packed_width(n_draft_B, ws)
        return schedule.StepShape(batch * W, batch * kv_len, W)
    return shape


def width_for(n_draft_B: np.ndarray, widths: Sequence[int]) -> int:
    """The smallest of `widths` >= 1 + max(n_draft_B) (the largest when none is)."""
    return schedule.packed_width(n_draft_B, widths)


def packed_step_shape(kv_lens_B: np.ndarray, token_buckets: Sequence[int] | None = None,
                      ) -> ShapeFn:
    """A reference step shape of a packed engine: each live row computes 1 + n_b token slots
    (its pending token and its own draft) and attends its own cache length;
    num_tokens = sum_b (1 + n_b), rounded up to the smallest of `token_buckets` (ascending)
    that holds it (None: no buckets); attended_kv = sum_b kv_lens_B[b].
    (The packed engine passes its own function; this one is for tests and the replay.)"""
    kv = int(np.sum(kv_lens_B))
    buckets = sorted(token_buckets) if token_buckets else None

    def shape(n_draft_B: np.ndarray) -> tuple[int, int]:
        n = int(len(n_draft_B) + np.sum(n_draft_B))
        if buckets:
            n = next((b for b in buckets if b >= n), buckets[-1])
        return n, kv
    return shape


def acceptance_length(steps: Sequence[StepRecord]) -> float:
    """Mean tokens emitted per verify step per live row (1.0 without speculation; 0.0 for no
    steps)."""
    rows = sum(s.active for s in steps)
    return sum(s.emitted for s in steps) / rows if rows else 0.0


class SpeculationPolicy(Protocol):
    def admission_order(self, problem_ids: Sequence[Hashable]) -> list[int]:
        """Order in which queued requests enter slots (indices into problem_ids)."""

    def begin(self, request_id: int, problem_id: Hashable, prompt_len: int) -> None:
        """A request entered a slot."""

    def draft_budgets(self, rows: Sequence[RowView], batch: int, max_width: int) -> np.ndarray:
        """int `[len(rows)]`: draft tokens to request per row (0 = do not draft for it)."""

    def choose(self, rows: Sequence[RowView], draft_probs: Sequence[np.ndarray],
               step_shape: ShapeFn, draft_support: Sequence[np.ndarray | None] | None = None
               ) -> tuple[np.ndarray, float | None]:
        """(int32 n_draft per row, each in 0..len(draft_probs[b]), predicted seconds or None).

        draft_probs[b]: the drafter's path probabilities of row b's draft (float `[len]`,
        nonincreasing: the chance that its first i + 1 tokens are all accepted).
        draft_support[b]: int32 `[len]` past occurrences each token's estimate rests on
        (`Draft.support`), or None where the drafter does not say (None: for every row).
        step_shape: n_draft_B -> (num_tokens, attended_kv) of the verify step the engine would
        run for that choice (`padded_step_shape`, `packed_step_shape`)."""

    def observe(self, record: StepRecord) -> None:
        """Called after each step with what it measured."""

    def end(self, request_id: int, num_tokens: int) -> None:
        """A request finished with num_tokens generated."""

    def step_classes(self, rows: Sequence[RowView]) -> dict | None:
        """Per-class live counts for the stats (or None)."""

    def fork(self, drafter) -> "SpeculationPolicy":
        """A copy for another device (`das_jax.rollout.Rollout.fork`), starting from this one's
        learned state, that reads problem history from `drafter` (the shared, locked drafter
        view, or None)."""


class FixedPolicy:
    """Speculate up to `max_width - 1` tokens for every row (vLLM-style fixed k).

    W is the smallest compiled width that holds the longest draft, so a step with no drafts at
    all runs the cheap W = 1 variant. `max_draft` caps k below the widest compiled width.
    """

    def __init__(self, max_draft: int | None = None):
        self.max_draft = max_draft

    def admission_order(self, problem_ids):
        return list(range(len(problem_ids)))

    def begin(self, request_id, problem_id, prompt_len):
        pass

    def draft_budgets(self, rows, batch, max_width):
        k = max_width - 1 if self.max_draft is None else min(self.max_draft, max_width - 1)
        return np.array([min(k, max(r.remaining - 1, 0)) for r in rows], np.int32)

    def choose(self, rows, draft_probs, step_shape, draft_support=None):
        return np.array([len(p) for p in draft_probs], np.int32), None

    def observe(self, record):
        pass

    def end(self, request_id, num_tokens):
        pass

    def step_classes(self, rows):
        return None

    def fork(self, drafter):
        return FixedPolicy(self.max_draft)


@dataclasses.dataclass
class DraftPlan:
    """One step's speculation: width W, per-row draft tokens (int32, each <= W - 1 long, in the
    order of the live rows), the policy's predicted step seconds, and host time spent."""

    width: int
    tokens: list[np.ndarray]
    predicted_seconds: float | None
    draft_s: float = 0.0
    policy_s: float = 0.0


def plan_step(drafter, policy: "SpeculationPolicy", rows: Sequence[RowView], batch: int,
              widths: Sequence[int], kv_len: int,
              step_shape: ShapeFn | None = None) -> DraftPlan:
    """Asks the policy for budgets, the drafter for drafts, the policy for n_draft per row; W is
    the smallest compiled width holding the longest chosen draft.

    step_shape: what a choice costs (default: `padded_step_shape(batch, widths, kv_len)`).
    Shared by `Engine.generate` and the trace-replay simulator, so both take exactly the same
    decisions. With no drafter: W = 1 and no drafts.
    """
    if drafter is None:
        return DraftPlan(1, [np.zeros(0, np.int32)] * len(rows), None)
    max_w = max(widths)
    t0 = time.perf_counter()
    budgets = policy.draft_budgets(rows, batch, max_w)
    t1 = time.perf_counter()
    tokens: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    support: list[np.ndarray | None] = []
    for row, k in zip(rows, budgets):
        k = int(min(k, max_w - 1, row.remaining - 1))
        d = drafter.propose(row.request_id, k) if k > 0 else None
        if d is None or len(d.tokens) == 0:
            tokens.append(np.zeros(0, np.int32))
            probs.append(np.zeros(0, np.float32))
            support.append(None)
        else:
            tokens.append(np.asarray(d.tokens[:k], np.int32))
            probs.append(np.asarray(d.probs[:k], np.float32))
            support.append(None if d.support is None else np.asarray(d.support[:k], np.int32))
    t2 = time.perf_counter()
    ws = sorted(int(w) for w in widths)
    shape = step_shape or padded_step_shape(batch, ws, kv_len)
    n_draft, predicted = policy.choose(rows, probs, shape, draft_support=support)
    t3 = time.perf_counter()
    n_draft = np.minimum(np.asarray(n_draft, np.int32), ws[-1] - 1)
    tokens = [t[:int(n)] for t, n in zip(tokens, n_draft)]
    width = width_for(np.array([len(t) for t in tokens], np.int32), ws)
    return DraftPlan(width, tokens, predicted, draft_s=t2 - t1, policy_s=(t1 - t0) + (t3 - t2))
