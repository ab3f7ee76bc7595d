"""What the host scheduler (`scheduler.run_schedule`) and a `StepExecutor` exchange: the executor
protocol, each verify step's plan (`StepInput`) and result (`StepOutput`) as arrays over the
live rows, an admission's result (`Prefilled`), and where a request ends (`Limits`)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """What an executor's prefill returns for the k admitted requests: first_tokens[k] /
    first_logprobs[k] (the token sampled after each prompt and its log-prob), seconds spent,
    tokens (token slots computed, padding included), and ends[k] ("" or a finish reason the
    executor knows, e.g. the trace's recorded end; None: none known)."""

    first_tokens: Sequence[int]
    first_logprobs: Sequence[float]
    seconds: float
    tokens: int
    ends: Sequence[str] | None = None


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One verify step as the scheduler planned it (A live rows of B cache rows).

    batch: B; live: int64 `[A]` cache rows; request_ids / generated: int64 `[A]` each live
    row's request index and tokens committed so far; cache_len_B: int32 `[B]` tokens in each
    cache row's KV (stale for free rows); kv_len: attended-length bucket; width: W (query
    block); drafts_AxK: int32 `[A, K]` draft tokens per live row (row j's are
    drafts_AxK[j, :n_draft_B[live[j]]], K <= W - 1); n_draft_B: int32 `[B]` (0 for free rows);
    num_tokens / attended_kv: the step shape (`step_shape_fn`); predicted_seconds: the
    policy's prediction; read_kv: the cached positions the step reads when not attended_kv
    (a paged cache read by a kernel, `schedule.pages_read_kv`; None: attended_kv); overlap:
    host work that does not need this step's outputs (the drafter's deferred appends): the
    executor calls it once, after dispatching the step and before waiting for its outputs, so
    it runs while the device computes; it returns its seconds (None: nothing to run);
    wide_rows: the split query block's R (`schedule.wide_rows_for`; 0: one `[B, W]` block).
    alt_AxK / n_alt_B: each live row's second draft, verified beside its first as branch B of
    a two-branch token tree (row j's: alt_AxK[j, :n_alt_B[live[j]]]; `step.verify_packed`),
    and branch_rows: the tree program's R2 (>= the rows with one); None / 0: one draft per row.
    """

    batch: int
    live: np.ndarray
    request_ids: np.ndarray
    generated: np.ndarray
    cache_len_B: np.ndarray
    kv_len: int
    width: int
    drafts_AxK: np.ndarray
    n_draft_B: np.ndarray
    num_tokens: int
    attended_kv: int
    predicted_seconds: float | None
    read_kv: int | None = None
    overlap: Callable[[], float] | None = None
    wide_rows: int = 0
    alt_AxK: np.ndarray | None = None
    n_alt_B: np.ndarray | None = None
    branch_rows: int = 0

    def draft(self, j: int) -> np.ndarray:
        """int32 `[n]`: the draft tokens of live row j."""
        return self.drafts_AxK[j, :int(self.n_draft_B[self.live[j]])]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a verify step returns per live row (`[A]`, in the order of `StepInput.live`):
    tokens_AxW int32 / logprobs_AxW float32 `[A, W']` with row j's n_A[j] (>= 1) sampled
    tokens (1 + accepted drafts, before the stop / max_new_tokens cut) and their log-probs
    first; ends[j] ("" or a finish reason the executor knows; a sequence or a str array;
    None: none known); the step's
    seconds (compilation excluded); compile_s, the seconds spent compiling the step's
    program when this step was its first (0.0 otherwise, and in the replay); and won_A, bool
    `[A]`, the row emitted its second draft's tokens (a token tree; None: no tree)."""

    tokens_AxW: np.ndarray
    logprobs_AxW: np.ndarray
    n_A: np.ndarray
    seconds: float
    ends: Sequence[str] | None = None
    compile_s: float = 0.0
    won_A: np.ndarray | None = None

    @staticmethod
    def from_rows(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                  seconds: float, ends: Sequence[str] | None = None,
                  compile_s: float = 0.0) -> "StepOutput":
        """A `StepOutput` from per-row token and log-prob lists (each row non-empty)."""
        n_A = np.array([len(t) for t in tokens], np.int32)
        W = int(n_A.max(initial=1))
        tok = np.zeros((len(tokens), W), np.int32)
        logp = np.zeros((len(tokens), W), np.float32)
        for j, (t, lp) in enumerate(zip(tokens, logprobs)):
            tok[j, :len(t)] = t
            logp[j, :len(t)] = lp
        return StepOutput(tok, logp, n_A, seconds, ends, compile_s)


class StepExecutor(Protocol):
    """Runs the steps `run_schedule` plans (device steps in the engine, recorded tokens in the
    replay)."""

    def start(self, batch: int, cache_len: int) -> None:
        """Allocates `batch` empty rows of `cache_len` positions."""

    def prefill(self, request_ids: Sequence[int], rows: np.ndarray, batch: int) -> Prefilled:
        """Writes the prompts of `request_ids` into cache rows `rows` and samples each first
        token."""

    def compact(self, live: np.ndarray, new_batch: int) -> None:
        """Moves cache rows `live` (in order) to rows 0..len(live)-1 of `new_batch` rows."""

    def verify(self, step: StepInput) -> StepOutput:
        """Verifies each live row's pending token and drafts."""

    # Optional: decode(step, steps, budget_A, stop_ids) -> StepOutput: up to `steps` plain
    # decode steps of the live rows in one call (`step` has no drafts; row j stops after a
    # stop token or budget_A[j] tokens); n_A[j] tokens per row, `seconds` for the whole call.
    # Without it, the scheduler runs one `verify` per step.
    # Optional: release(rows): the requests of cache rows `rows` finished (called once per
    # commit with every row that finished in it); an executor that frees a row's memory then
    # (the paged KV cache) has it.
    # Optional: kv_read_page: int | None, the page size when attention reads each row's own
    # pages (a paged cache read by a kernel): the scheduler then prices a step's KV reads by
    # the pages its live rows hold (`schedule.pages_read_kv`), not by the bucket.
    # Optional: model_drafts(live) -> (tokens_AxJ int32, probs_AxJ float32): the drafts a
    # draft model (`DraftModel`) made on device for cache rows `live` from the features of
    # their last committed position (path probabilities 0 where it has none); the scheduler
    # hands them to the drafter (`set_model_drafts`) before each verify step's plan.


class DraftModel(Protocol):
    """A drafter that runs on the device from the policy's own features (`das_jax.draft_head`'s
    EAGLE-3 head, `HeadRuntime`). The executor asks the prefill and verify programs for the
    outputs of the blocks `feature_layers` at every position they commit and hands them over,
    still on the device:

    * `admit(rows_R, feats_RxTxFD, next_RxT, n_R)`: rows filled by an admission, each with its
      prefilled positions' features (its first n_R[r] columns) and the token after each
      position (the next prompt token, then the pending token);
    * `extend(live_B, feats_BxWxFD, next_BxW, n_emit_B, kv_len)`: after a verify step, not
      waited for: each live row's committed positions (the first n_emit_B[b]) and the tokens
      after them (the step's sampled tokens); kv_len bounds every row's length after it (the
      step's attended bucket + its width);
    * `compact(live, new_batch)`: the rows move as the KV cache's do.

    `admit` and `extend` commit the positions to the model's own cache and return its drafts
    from each row's last position: device arrays (tokens int32 `[R or B, steps]`, path
    probabilities float32, 0 where a row has none)."""

    feature_layers: tuple
    steps: int

    def start(self, programs, batch: int, cache_len: int, policy_params) -> None:
        """An empty cache of `batch` rows x `cache_len` positions where the engine computes
        (`programs`: the engine's `Programs`, which compiles and runs the model's programs);
        `policy_params`: the params this generate call samples from."""

    def admit(self, rows_R, feats_RxTxFD, next_RxT, n_R):
        """Commits admitted rows' prefilled positions (their rows reset first)."""

    def extend(self, live_B, feats_BxWxFD, next_BxW, n_emit_B, kv_len: int):
        """Commits a verify step's positions of the live rows."""

    def compact(self, live: np.ndarray, new_batch: int) -> None:
        """Moves rows `live` to 0..len(live)-1 of `new_batch` rows."""

    def stop(self) -> None:
        """The generate call ended: frees the cache and drops the params it was given."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The end of a request: max_new_tokens, or (inclusive) a token of stop_ids."""

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
