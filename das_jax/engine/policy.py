"""The speculation-policy protocol the engine consults each decode step, and the fixed policy.

A policy decides *how much* to speculate: how many draft tokens to ask the drafter for per row,
then, seeing the drafts and their path probabilities, the step's width W (from the compiled set)
and each row's `n_draft <= W - 1`. It also sees every step's measured time (to fit a cost model)
and may reorder admission. The DAS length-aware policy (`das_jax.engine.das_policy`) implements
the same protocol.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Hashable, Protocol, Sequence

import numpy as np


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
    drafted / accepted: draft tokens verified / accepted this step; emitted: tokens emitted;
    seconds: measured wall time of the step (device + host sync); predicted_seconds: the
    policy's prediction for it (None without a cost model); classes: per-class live row counts
    (policy-defined, e.g. {"long": 3, "medium": 5, "short": 0}); num_tokens: token slots the
    step computed (padded: batch * width; packed: the slot bucket N); attended_kv: cached
    positions its attention read, summed over computed rows (batch * kv_len): the cost model's
    inputs (None where not recorded).
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

    def choose(self, rows: Sequence[RowView], draft_probs: Sequence[np.ndarray], batch: int,
               widths: Sequence[int], kv_len: int) -> tuple[int, np.ndarray, float | None]:
        """(W from `widths`, int n_draft per row <= min(len(draft), W - 1), predicted seconds)."""

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

    def choose(self, rows, draft_probs, batch, widths, kv_len):
        lens = np.array([len(p) for p in draft_probs], np.int32)
        need = 1 + int(lens.max(initial=0))
        width = next((w for w in sorted(widths) if w >= need), max(widths))
        return width, np.minimum(lens, width - 1), None

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
              widths: Sequence[int], kv_len: int) -> DraftPlan:
    """Asks the policy for budgets, the drafter for drafts, the policy for W and n_draft.

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
    for row, k in zip(rows, budgets):
        k = int(min(k, max_w - 1, row.remaining - 1))
        d = drafter.propose(row.request_id, k) if k > 0 else None
        if d is None or len(d.tokens) == 0:
            tokens.append(np.zeros(0, np.int32))
            probs.append(np.zeros(0, np.float32))
        else:
            tokens.append(np.asarray(d.tokens[:k], np.int32))
            probs.append(np.asarray(d.probs[:k], np.float32))
    t2 = time.perf_counter()
    width, n_draft, predicted = policy.choose(rows, probs, batch, widths, kv_len)
    t3 = time.perf_counter()
    tokens = [t[:int(min(n, width - 1))] for t, n in zip(tokens, n_draft)]
    return DraftPlan(width, tokens, predicted, draft_s=t2 - t1, policy_s=(t1 - t0) + (t3 - t2))
