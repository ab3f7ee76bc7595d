"""The host scheduler of continuous batching, one loop for `Engine.generate` and the trace replay.

`run_schedule` owns everything on the host side of generation: the admission queue (in the policy's
`admission_order`), which request is in which cache row, refilling freed rows, compacting the live
rows into a smaller batch bucket for the tail, the attended-length bucket of each step, the per-row
bookkeeping (tokens committed, stop tokens, max_new_tokens), the drafter and policy calls
(`plan_step`, `begin` / `append` / `end` / `observe`), and the stats (`GenerateStats`, one
`StepRecord` per verify step).

What a step *does* is a `StepExecutor`'s job:

* `Engine.generate` drives a device executor (`das_jax.engine.generate.DeviceExecutor`): jitted
  prefill and verify steps on the KV cache, timed with the real clock;
* the trace replay (`das_jax.bench.replay.simulate`) drives a trace executor: the recorded
  rollouts decide which drafts are accepted, the cost model says how long a step takes.

Since both go through this one loop, a replay with the engine's drafter, policy and (frozen) cost
model takes the engine's decisions step for step by construction (tests/test_scheduler.py).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from das_jax.engine.policy import (FixedPolicy, RowView, SpeculationPolicy, StepRecord,
                                   acceptance_length, plan_step)
from das_jax.engine.schedule import (bucket, cache_len_for, compact_rows, kv_len_bucket,
                                     prompt_bucket, step_shape_fn, tail_bucket, token_buckets)


@dataclasses.dataclass
class RequestOutput:
    """token_ids / logprobs: generated tokens and their log-probs under the policy (the
    temperature-scaled full softmax, also with top-k / top-p on; see `sampling.sample`);
    finish_reason: "stop" (a stop token, included) or "length" (max_new_tokens).
    request: the `Request` (a `TraceRollout` in the replay, which keeps no tokens)."""

    request: Any
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    forward_passes: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclasses.dataclass
class GenerateStats:
    """Counters and timers of one `generate` call (seconds of wall time; compile time excluded
    from the phase timers and reported as `compile_s`). accepted_draft_tokens counts accepted
    draft tokens that were committed (not those past a stop token or max_new_tokens);
    prefill_tokens: token slots the prefill calls computed (padding included), over
    prefill_calls admissions. In the replay, decode_s is the cost model's prediction."""

    forward_passes: int = 0
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    policy_s: float = 0.0
    wall_s: float = 0.0
    compile_s: float = 0.0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step per row (1.0 without speculation)."""
        return acceptance_length(self.steps)

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "steps"}
        d["acceptance_length"] = self.acceptance_length
        if with_steps:
            d["steps"] = [dataclasses.asdict(s) for s in self.steps]
        return d


@dataclasses.dataclass(frozen=True)
class PrefillLayout:
    """The shapes of one admission's prefill call: the distinct prompts (`prompts`, in first-seen
    order; `src[k]`: the prompt of the k-th admitted request), padded to T tokens (a power-of-two
    bucket >= min_prompt_bucket, capped at the cache length) in U rows (a batch bucket), inserted
    into R cache rows (a batch bucket of the admitted requests). tokens: the token slots computed,
    U * T padded, or N (`N`, set for the packed prefill: the prompts concatenated, see
    `schedule.pack_prompts`)."""

    prompts: list[tuple[int, ...]]
    src: list[int]
    T: int
    U: int
    R: int
    N: int | None = None

    @property
    def tokens(self) -> int:
        return self.U * self.T if self.N is None else self.N


def prefill_layout(prompts: Sequence[Sequence[int]], batch_buckets: Sequence[int],
                   min_prompt_bucket: int, cache_len: int,
                   packed_batch: int | None = None) -> PrefillLayout:
    """`PrefillLayout` of admitting requests with these prompts (one per request, in order);
    `packed_batch`: the cache's rows B when the prefill is packed (sets `N`, the slot bucket of
    the prompts' total length, as `schedule.pack_prompts` computes it)."""
    uniq: dict[tuple, int] = {}
    src = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
    distinct = list(uniq)
    T = prompt_bucket(max(len(p) for p in distinct), min_prompt_bucket, cache_len)
    N = None
    if packed_batch is not None:
        N = bucket(sum(len(p) for p in distinct), token_buckets(packed_batch * T))
    return PrefillLayout(distinct, src, T, bucket(len(distinct), batch_buckets),
                         bucket(len(prompts), batch_buckets), N)


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

    batch: B; live: int `[A]` cache rows; request_ids / generated: `[A]` each live row's request
    index and tokens committed so far; cache_len_B: int32 `[B]` tokens in each cache row's KV
    (stale for free rows); kv_len: attended-length bucket; width: W (query block); drafts:
    `[A]` int32 draft tokens per live row; n_draft_B: int32 `[B]` (0 for free rows); num_tokens /
    attended_kv: the step shape (`step_shape_fn`); predicted_seconds: the policy's prediction.
    """

    batch: int
    live: np.ndarray
    request_ids: list[int]
    generated: list[int]
    cache_len_B: np.ndarray
    kv_len: int
    width: int
    drafts: list[np.ndarray]
    n_draft_B: np.ndarray
    num_tokens: int
    attended_kv: int
    predicted_seconds: float | None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a verify step returns per live row (`[A]`): tokens[j] (1 + accepted drafts sampled
    tokens, before the stop / max_new_tokens cut), logprobs[j], ends[j] ("" or a finish reason
    the executor knows; None: none known); the step's seconds (compilation excluded); and
    compile_s, the seconds spent compiling the step's program when this step was its first
    (0.0 otherwise, and in the replay)."""

    tokens: Sequence[Sequence[int]]
    logprobs: Sequence[Sequence[float]]
    seconds: float
    ends: Sequence[str] | None = None
    compile_s: float = 0.0


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


@dataclasses.dataclass(frozen=True)
class Limits:
    """The end of a request: max_new_tokens, or (inclusive) a token of stop_ids."""

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()


def run_schedule(requests: Sequence[Any], executor: StepExecutor, engine_config,
                 limits: Limits, drafter=None, policy: SpeculationPolicy | None = None,
                 progress: Callable[[int, int], None] | None = None, keep_tokens: bool = True,
                 stats: GenerateStats | None = None) -> tuple[list[RequestOutput], GenerateStats]:
    """Generates `requests` with continuous batching through `executor`.

    Args:
      requests: objects with `prompt_ids` (non-empty) and `problem_id`; request ids (for the
        drafter and policy) are their indices.
      executor: the `StepExecutor`.
      engine_config: an `EngineConfig` (max_slots / batch buckets, max_cache_len,
        draft_widths).
      limits: `Limits` (max_new_tokens, stop token ids).
      drafter: None (plain decoding) or a Drafter (`das_jax.drafter`).
      policy: speculation policy (default `FixedPolicy()`).
      progress: optional callback(finished_requests, total).
      keep_tokens: keep each output's tokens and log-probs (False: counters only).
      stats: stats to add to (default: new).

    Returns:
      (outputs in request order, stats); wall_s / compile_s are the caller's to set.
    """
    run = _Run(requests, executor, engine_config, limits, drafter, policy or FixedPolicy(),
               progress, keep_tokens, stats if stats is not None else GenerateStats())
    while run.queue or (run.row_req >= 0).any():
        free = np.flatnonzero(run.row_req < 0)
        if run.queue and len(free):
            run.admit(free)
            continue  # rows may have finished at once: refill before decoding
        live = np.flatnonzero(run.row_req >= 0)
        if len(live):
            run.step(run.compact(live))
    return run.outputs, run.stats


class _Run:
    """The state of one `run_schedule` call: the queue, each cache row's request and cache
    length, each request's committed tokens, the outputs and stats."""

    def __init__(self, requests, executor: StepExecutor, ec, limits: Limits, drafter,
                 policy: SpeculationPolicy, progress, keep_tokens: bool, stats: GenerateStats):
        self.requests, self.executor, self.ec = requests, executor, ec
        self.drafter, self.policy, self.progress = drafter, policy, progress
        self.keep_tokens, self.stats = keep_tokens, stats
        self.widths = ec.draft_widths if drafter is not None else (1,)
        self.stop_ids = limits.stop_ids
        self.max_new = limits.max_new_tokens
        n = len(requests)
        self.outputs = [RequestOutput(r, [], [], "") for r in requests]
        self.generated = [0] * n                    # tokens committed per request
        self.queue = collections.deque(policy.admission_order([r.problem_id for r in requests]))
        self.S = cache_len_for(ec.max_cache_len, ec.draft_widths,
                               max(len(r.prompt_ids) for r in requests), self.max_new)
        self.B = bucket(min(n, ec.max_slots), ec.batch_buckets)
        executor.start(self.B, self.S)
        self.row_req = np.full(self.B, -1, np.int64)      # request index in each row, -1 = free
        self.cache_len = np.zeros(self.B, np.int32)       # tokens in the cache per row
        self.finished = 0

    def finish(self, row: int, reason: str) -> None:
        ri = int(self.row_req[row])
        self.outputs[ri].finish_reason = reason
        if self.drafter is not None:
            self.drafter.end(ri)
        self.policy.end(ri, self.generated[ri])
        self.row_req[row] = -1
        self.finished += 1
        if self.progress:
            self.progress(self.finished, len(self.requests))

    def emit(self, row: int, toks: Sequence[int], logps: Sequence[float], end: str = "") -> int:
        """Commits the row's tokens up to a stop token / max_new_tokens (finishing the row there,
        or with `end`, the executor's finish reason); returns the tokens committed."""
        ri, stats = int(self.row_req[row]), self.stats
        room = self.max_new - self.generated[ri]
        toks, logps = list(toks[:room]), list(logps[:room])
        reason = ""
        for j, t in enumerate(toks):
            if t in self.stop_ids:
                toks, logps, reason = toks[:j + 1], logps[:j + 1], "stop"
                break
        if not reason and self.generated[ri] + len(toks) >= self.max_new:
            reason = "length"
        if self.keep_tokens:
            self.outputs[ri].token_ids.extend(int(t) for t in toks)
            self.outputs[ri].logprobs.extend(float(x) for x in logps)
        self.generated[ri] += len(toks)
        stats.generated_tokens += len(toks)
        if self.drafter is not None and toks:
            t0 = time.perf_counter()
            self.drafter.append(ri, toks)
            stats.draft_s += time.perf_counter() - t0
        reason = reason or end
        if reason:
            self.finish(row, reason)
        return len(toks)

    def admit(self, free: np.ndarray) -> None:
        """Admits queued requests into the free rows (prefill) and commits their first tokens."""
        stats, drafter, queue = self.stats, self.drafter, self.queue
        take = [queue.popleft() for _ in range(min(len(free), len(queue)))]
        rows = free[:len(take)]
        pre = self.executor.prefill(take, rows, self.B)
        stats.prefill_s += pre.seconds
        stats.prefill_tokens += pre.tokens
        stats.prefill_calls += 1
        for ri, row in zip(take, rows):
            req = self.requests[ri]
            self.row_req[row] = ri
            self.cache_len[row] = len(req.prompt_ids)
            t0 = time.perf_counter()
            self.policy.begin(int(ri), req.problem_id, len(req.prompt_ids))
            t1 = time.perf_counter()
            if drafter is not None:
                drafter.begin(int(ri), req.problem_id, list(req.prompt_ids))
            stats.policy_s += t1 - t0
            stats.draft_s += time.perf_counter() - t1
        for k, row in enumerate(rows):
            self.emit(int(row), [int(pre.first_tokens[k])], [float(pre.first_logprobs[k])],
                      pre.ends[k] if pre.ends is not None else "")

    def compact(self, live: np.ndarray) -> np.ndarray:
        """Compacts the live rows into a smaller bucket for the tail (once the queue is empty
        and they fit one); returns the live rows after it."""
        nb = tail_bucket(len(live), self.B, self.ec.batch_buckets, queue_empty=not self.queue)
        if nb is None:
            return live
        self.executor.compact(live, nb)
        self.row_req, self.cache_len = compact_rows(live, nb, self.row_req, -1, self.cache_len, 0)
        self.B = nb
        return np.arange(len(live))

    def step(self, live: np.ndarray) -> None:
        """One verify step of the live rows: draft, verify, commit, record."""
        stats, policy, B, generated = self.stats, self.policy, self.B, self.generated
        kv_len = kv_len_bucket(self.cache_len[live], self.S)
        req_ids = [int(self.row_req[r]) for r in live]
        views = [RowView(ri, self.requests[ri].problem_id, generated[ri],
                         self.max_new - generated[ri]) for ri in req_ids]
        step_shape = step_shape_fn(B, kv_len, self.widths)
        plan = plan_step(self.drafter, policy, views, B, self.widths, kv_len, step_shape)
        stats.draft_s += plan.draft_s
        stats.policy_s += plan.policy_s

        n_draft_B = np.zeros(B, np.int32)
        for j, r in enumerate(live):
            n_draft_B[r] = len(plan.tokens[j])
        num_tokens, attended_kv = step_shape(n_draft_B[live])
        out = self.executor.verify(StepInput(
            batch=B, live=live, request_ids=req_ids, generated=[generated[ri] for ri in req_ids],
            cache_len_B=self.cache_len, kv_len=kv_len,
            width=plan.width, drafts=plan.tokens, n_draft_B=n_draft_B, num_tokens=num_tokens,
            attended_kv=attended_kv, predicted_seconds=plan.predicted_seconds))
        stats.decode_s += out.seconds
        stats.forward_passes += 1
        drafted = int(n_draft_B.sum())
        stats.drafted_tokens += drafted
        classes = policy.step_classes(views)
        accepted_rows = []
        emitted = 0
        for j, r in enumerate(live):
            o = self.outputs[req_ids[j]]
            o.forward_passes += 1
            o.drafted_tokens += int(n_draft_B[r])
            self.cache_len[r] += len(out.tokens[j])
            # Count what was committed: tokens past a stop token or max_new_tokens are not.
            committed = self.emit(int(r), out.tokens[j], out.logprobs[j],
                                  out.ends[j] if out.ends is not None else "")
            emitted += committed
            accepted_rows.append(max(committed - 1, 0))
            o.accepted_draft_tokens += accepted_rows[-1]
        accepted = sum(accepted_rows)
        stats.accepted_draft_tokens += accepted
        record = StepRecord(batch=B, active=len(live), width=plan.width, kv_len=kv_len,
                            drafted=drafted, accepted=accepted, emitted=emitted,
                            seconds=out.seconds,
                            predicted_seconds=plan.predicted_seconds, classes=classes,
                            num_tokens=num_tokens, attended_kv=attended_kv,
                            accepted_per_row=tuple(accepted_rows), compile_s=out.compile_s)
        stats.steps.append(record)
        t0 = time.perf_counter()
        policy.observe(record)
        stats.policy_s += time.perf_counter() - t0
