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
    it runs while the device computes; it returns its seconds (None: nothing to run).
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
    seconds (compilation excluded); and compile_s, the seconds spent compiling the step's
    program when this step was its first (0.0 otherwise, and in the replay)."""

    tokens_AxW: np.ndarray
    logprobs_AxW: np.ndarray
    n_A: np.ndarray
    seconds: float
    ends: Sequence[str] | None = None
    compile_s: float = 0.0

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


@dataclasses.dataclass(frozen=True)
class Limits:
    """The end of a request: max_new_tokens, or (inclusive) a token of stop_ids."""

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
