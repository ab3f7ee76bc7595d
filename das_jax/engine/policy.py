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

from das_jax.drafter.base import DraftBatch, propose_batch
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
class RowBatch:
    """The live rows of a decode step as a policy sees them, as arrays `[A]` (A live rows, in
    the step's order): request_ids int64, generated int64 (tokens emitted so far), remaining
    int64 (tokens each may still emit, the max_new_tokens bound)."""

    request_ids: np.ndarray
    generated: np.ndarray
    remaining: np.ndarray

    def __len__(self) -> int:
        return int(self.request_ids.shape[0])

    @staticmethod
    def of(rows: "Sequence[RowView] | RowBatch") -> "RowBatch":
        """The batch of `rows` (a `RowBatch` is returned as is)."""
        if isinstance(rows, RowBatch):
            return rows
        return RowBatch(np.array([r.request_id for r in rows], np.int64),
                        np.array([r.generated for r in rows], np.int64),
                        np.array([r.remaining for r in rows], np.int64))


def as_draft_batch(drafts, draft_support=None) -> DraftBatch:
    """`drafts` as a `DraftBatch`: a `DraftBatch` as is, else a sequence of per-row path
    probabilities (float `[len_b]`, kept in float64; the tokens left 0) with optional per-row
    supports (`draft_support[b]`: int `[len_b]` or None)."""
    if isinstance(drafts, DraftBatch):
        return drafts
    lens = np.array([len(p) for p in drafts], np.int32)
    K = int(lens.max(initial=0))
    out = DraftBatch.empty(len(lens), K)
    out = dataclasses.replace(out, probs_AxK=out.probs_AxK.astype(np.float64))  # as given
    for b, p in enumerate(drafts):
        out.probs_AxK[b, :lens[b]] = p
        sup = None if draft_support is None else draft_support[b]
        if sup is not None and lens[b]:
            out.support_AxK[b, :lens[b]] = sup
            out.has_support_A[b] = True
    return DraftBatch(out.tokens_AxK, out.probs_AxK, out.support_AxK, lens, out.has_support_A)


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
    observes; None: batch * width and batch * kv_len); read_kv: the cached positions the step
    read when not attended_kv (a paged cache read by a kernel; None: attended_kv);
    accepted_per_row: committed accepted draft
    tokens of each live row, in the order of the rows the policy was shown (None: unknown);
    compile_s: seconds spent compiling the step's program, when the step was the first of its
    shape (0.0 otherwise; not part of `seconds`, and not compared: a program compiled by an
    earlier run of the process is not compiled again); wide_rows: the split query block's R
    (`schedule.wide_rows_for`; 0: one `[B, W]` block); branch_rows: a two-branch token tree's
    R2 (`schedule.branch_rows_for`; 0: one draft per row; `drafted` then counts both drafts);
    alt_per_row: each live row's second-draft tokens verified, and won_per_row: whether the
    row emitted its second draft's tokens (then `accepted_per_row` counts the second draft's
    accepted tokens; None: no tree).
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
    read_kv: int | None = None
    compile_s: float = dataclasses.field(default=0.0, compare=False)
    wide_rows: int = 0
    branch_rows: int = 0
    alt_per_row: tuple[int, ...] | None = None
    won_per_row: tuple[bool, ...] | None = None

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
    """How much to speculate. Per-step calls see every live row at once (`RowBatch`,
    `DraftBatch`: arrays, so a policy's host time need not grow with per-row Python); policies
    also accept a sequence of `RowView`s and, for `choose`, per-row path probabilities (see
    `RowBatch.of`, `as_draft_batch`)."""

    def admission_order(self, problem_ids: Sequence[Hashable]) -> list[int]:
        """Order in which queued requests enter slots (indices into problem_ids)."""

    def begin(self, request_id: int, problem_id: Hashable, prompt_len: int) -> None:
        """A request entered a slot."""

    def draft_budgets(self, rows: RowBatch, batch: int, max_width: int, record: bool = True
                      ) -> np.ndarray:
        """int32 `[A]`: draft tokens to request per row (0 = do not draft for it). With
        `record` false nothing of the rows is kept (the scheduler asks so for the rows as
        they will be after the running step, `ahead_inputs`)."""

    def choose(self, rows: RowBatch, drafts: DraftBatch, step_shape: ShapeFn
               ) -> tuple[np.ndarray, float | None]:
        """(int32 n_draft `[A]`, each in 0..drafts.lens_A[b], predicted seconds or None).

        drafts: the drafter's drafts (`DraftBatch`): probs_AxK[b, i] the path probability that
        row b's first i + 1 tokens are all accepted (nonincreasing along i), support_AxK the
        past occurrences each estimate rests on where has_support_A[b].
        step_shape: n_draft_B -> (num_tokens, attended_kv) of the verify step the engine would
        run for that choice (`padded_step_shape`, `packed_step_shape`)."""

    def observe(self, record: StepRecord) -> None:
        """Called after each step with what it measured. A policy that also has
        `learn_deferred()` accepts `observe(record, defer_learning=True)`: the scheduler then
        runs the update it kept while the device computes the next step (`DASPolicy`)."""

    def end(self, request_id: int, num_tokens: int) -> None:
        """A request finished with num_tokens generated."""

    def step_classes(self, rows: RowBatch) -> dict | None:
        """Per-class live counts for the stats (or None)."""

    def fork(self, drafter) -> "SpeculationPolicy":
        """A copy for another device (`das_jax.rollout.Rollout.fork`), starting from this one's
        learned state, that reads problem history from `drafter` (the shared, locked drafter
        view, or None)."""


class FixedPolicy:
    """Speculate up to `max_width - 1` tokens for every row (vLLM-style fixed k).

    W is the smallest compiled width that holds the longest draft, so a step with no drafts at
    all runs the cheap W = 1 variant. `max_draft` caps k below the widest compiled width.
    `tree`: where the drafter offers each row a second draft (`DraftBatch.alternative`),
    verify it beside the first as a two-branch token tree (`second_branch`), the row's k draft
    tokens split between them (ceil(k / 2) to the first); False: the first only.
    """

    def __init__(self, max_draft: int | None = None, tree: bool = False):
        self.max_draft = max_draft
        self.tree = tree

    def second_branch(self, rows, chosen, other, step_shape):
        """(first-draft lengths, second drafts) to verify (`plan_step`) with `tree`, else None:
        a row with two drafts that differ at their first token verifies ceil(k / 2) tokens of
        its first and floor(k / 2) of its second, k its chosen length; other rows keep their
        first draft whole (a second draft starting with the first's token would repeat its
        prefix)."""
        if not self.tree:
            return None
        k = chosen.lens_A.astype(np.int64)
        both = (k > 0) & (other.lens_A > 0)
        if other.width and chosen.width:
            both &= chosen.tokens_AxK[:, 0] != other.tokens_AxK[:, 0]
        first = np.where(both, (k + 1) // 2, k)
        return first, other.cut(np.where(both, np.minimum(k // 2, other.lens_A), 0))

    def admission_order(self, problem_ids):
        return list(range(len(problem_ids)))

    def begin(self, request_id, problem_id, prompt_len):
        pass

    def draft_budgets(self, rows, batch, max_width, record=True):
        rows = RowBatch.of(rows)
        k = max_width - 1 if self.max_draft is None else min(self.max_draft, max_width - 1)
        return np.clip(rows.remaining - 1, 0, k).astype(np.int32)

    def choose(self, rows, drafts, step_shape):
        return as_draft_batch(drafts).lens_A.astype(np.int32), None

    def observe(self, record):
        pass

    def end(self, request_id, num_tokens):
        pass

    def step_classes(self, rows):
        return None

    def fork(self, drafter):
        return FixedPolicy(self.max_draft, self.tree)


@dataclasses.dataclass
class DraftPlan:
    """One step's speculation: width W, the drafts the policy chose (`DraftBatch`, each row
    <= W - 1 tokens, in the order of the live rows), the policy's predicted step seconds, and
    host time spent (seconds); `second`: each row's second draft, verified beside the first as
    a two-branch token tree (`step.verify_packed`; a row's two drafts together <= the widest
    width - 1 tokens), or None; `proposed`: the drafter's drafts before the policy cut them
    (each chosen draft is a prefix of its row's), or None where a row's chosen draft may come
    from elsewhere (a second source)."""

    width: int
    drafts: DraftBatch
    predicted_seconds: float | None
    draft_s: float = 0.0
    policy_s: float = 0.0
    second: DraftBatch | None = None
    proposed: DraftBatch | None = None


def step_budgets(policy: "SpeculationPolicy", rows: RowBatch, batch: int,
                 widths: Sequence[int], record: bool = True) -> np.ndarray:
    """int32 `[A]`: the draft tokens `plan_step` asks the drafter for per row: the policy's
    budgets (`draft_budgets`; `record`: as there), within the row's remaining tokens less one
    and the widest width less one."""
    w = max(int(x) for x in widths)
    budgets = (policy.draft_budgets(rows, batch, w) if record
               else policy.draft_budgets(rows, batch, w, record=False))
    # np.minimum / np.maximum: np.clip costs twice as much on a step's few hundred rows
    return np.maximum(np.minimum(np.minimum(budgets, rows.remaining - 1), w - 1), 0
                      ).astype(np.int32)


def ahead_inputs(plan: DraftPlan, rows: RowBatch, policy: "SpeculationPolicy", batch: int,
                 widths: Sequence[int], stop_ids: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """What the drafter may draft ahead while the device verifies `plan` (the scheduler calls
    `SuffixDrafter.propose_ahead` with it): for each row with a proposed draft, the step
    that accepts the chosen draft (a prefix of it) and samples the next token, the row's committed
    tokens then, and its next budget (`step_budgets` of the rows as they would be, nothing
    recorded). The next token is the proposal's where it goes on past the chosen draft;
    where the chosen draft is the whole proposal, the drafter guesses it (`guess_A`: the
    last assumed token is a placeholder). Rows that would end there (a known assumed token in
    `stop_ids`, int64, or no tokens left) are left out. Returns (request_ids int64 [A'],
    tokens_AxW int32, n_A int32 [A'], budgets int32 [A'], guess_A bool [A']) or None (no
    row, or `plan` has no `proposed` drafts or has a second branch)."""
    prop = plan.proposed
    if prop is None or plan.second is not None or not len(rows):
        return None
    n_A = plan.drafts.lens_A.astype(np.int64)
    go = prop.lens_A > 0
    if not go.any():
        return None
    rows_A = np.flatnonzero(go)
    commit_A = n_A[rows_A] + 1
    guess_A = prop.lens_A[rows_A] == n_A[rows_A]
    W = int(commit_A.max())
    tok_AxW = np.zeros((len(rows_A), W), np.int32)
    K = min(W, prop.tokens_AxK.shape[1])
    tok_AxW[:, :K] = prop.tokens_AxK[rows_A, :K]
    known_AxW = np.arange(W)[None, :] < (commit_A - guess_A)[:, None]
    tok_AxW = np.where(known_AxW, tok_AxW, 0).astype(np.int32)
    remaining_A = rows.remaining[rows_A] - commit_A
    keep = remaining_A > 0
    if stop_ids.size:
        keep &= ~(np.isin(tok_AxW, stop_ids) & known_AxW).any(axis=1)
    if not keep.any():
        return None
    rows_A, commit_A, tok_AxW = rows_A[keep], commit_A[keep], tok_AxW[keep]
    after = RowBatch(rows.request_ids[rows_A], rows.generated[rows_A] + commit_A,
                     remaining_A[keep])
    budgets = step_budgets(policy, after, batch, widths, record=False)
    return after.request_ids, tok_AxW, commit_A.astype(np.int32), budgets, guess_A[keep]


def plan_step(drafter, policy: "SpeculationPolicy", rows: "RowBatch | Sequence[RowView]",
              batch: int, widths: Sequence[int], kv_len: int,
              step_shape: ShapeFn | None = None) -> DraftPlan:
    """Asks the policy for budgets, the drafter for every row's draft in one call
    (`das_jax.drafter.propose_batch`), the policy for n_draft per row; W is the smallest
    compiled width holding the longest chosen draft. Drafts with an `alternative` (another
    source's draft per row): a policy with `pick_sources(rows, drafts, step_shape)` picks per
    row which to verify (timed as policy work; it returns the pick with the other draft as its
    `alternative`); other policies verify the drafter's pick. A policy with
    `second_branch(rows, chosen, other, step_shape)` may then verify the other draft beside
    the chosen one (a two-branch token tree: it returns None, or the first drafts' new lengths
    and the second drafts, `DraftPlan.second`, cut so a row's two drafts hold at most the
    widest width - 1 tokens).

    step_shape: what a choice costs (default: `padded_step_shape(batch, widths, kv_len)`).
    Shared by `Engine.generate` and the trace-replay simulator, so both take exactly the same
    decisions. With no drafter: W = 1 and no drafts.
    """
    rows = RowBatch.of(rows)
    if drafter is None:
        return DraftPlan(1, DraftBatch.empty(len(rows)), None)
    ws = sorted(int(w) for w in widths)
    t0 = time.perf_counter()
    budgets = step_budgets(policy, rows, batch, ws)
    t1 = time.perf_counter()
    drafts = propose_batch(drafter, rows.request_ids, budgets)
    drafts = drafts.cut(budgets)
    proposed = drafts if drafts.alternative is None else None
    t2 = time.perf_counter()
    shape = step_shape or padded_step_shape(batch, ws, kv_len)
    other = None
    if drafts.alternative is not None:
        pick = getattr(policy, "pick_sources", None)
        if pick is not None:
            drafts = pick(rows, drafts, shape)
        other = drafts.alternative
        drafts = dataclasses.replace(drafts, alternative=None)
    n_draft, predicted = policy.choose(rows, drafts, shape)
    drafts = drafts.cut(np.minimum(np.asarray(n_draft, np.int32), ws[-1] - 1))
    second = None
    branch = getattr(policy, "second_branch", None)
    if other is not None and branch is not None and hasattr(shape, "tree"):
        out = branch(rows, drafts, other, shape)
        if out is not None:
            n_first, second = out
            drafts = drafts.cut(np.asarray(n_first, np.int32))
            second = second.cut(np.maximum(ws[-1] - 1 - drafts.lens_A, 0))
            if not second.lens_A.any():
                second = None
            else:
                predicted = getattr(policy, "tree_seconds", lambda *_: predicted)(
                    shape.tree(drafts.lens_A, second.lens_A))
    t3 = time.perf_counter()
    width = width_for(drafts.lens_A if second is None
                      else np.maximum(drafts.lens_A, second.lens_A), ws)
    return DraftPlan(width, drafts, predicted, draft_s=t2 - t1, policy_s=(t1 - t0) + (t3 - t2),
                     second=second, proposed=proposed)
