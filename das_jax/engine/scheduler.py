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
import functools
import itertools
import time
from typing import Any, Callable, Sequence

import numpy as np

from das_jax.drafter.base import append_batch, flush_appends
from das_jax.engine.gc_freeze import frozen_gc
from das_jax.engine.outputs import GenerateStats, RequestOutput  # noqa: F401 - re-exported
from das_jax.engine.policy import (DraftPlan, FixedPolicy, RowBatch, SpeculationPolicy,
                                   StepRecord, ahead_inputs, plan_step)
from das_jax.engine.schedule import (bucket, cache_len_for, compact_rows, kv_len_bucket,
                                     pages_read_kv, prompt_bucket, step_shape_fn, tail_bucket,
                                     token_buckets)
from das_jax.engine.step_io import (Limits, Prefilled,  # noqa: F401 - re-exported
                                    StepExecutor, StepInput, StepOutput)


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

    The objects that exist when it starts are kept out of Python's garbage collections until it
    returns (`gc_freeze.frozen_gc`): no full collection of the whole heap stalls a step.
    """
    with frozen_gc():
        return _run_schedule(requests, executor, engine_config, limits, drafter, policy,
                             progress, keep_tokens, stats)


def _run_schedule(requests, executor, engine_config, limits, drafter, policy, progress,
                  keep_tokens, stats):
    t_start = time.perf_counter()
    draft_model_s0 = getattr(executor, "draft_model_s", 0.0)
    run = _Run(requests, _TimedExecutor(executor), engine_config, limits, drafter,
               policy or FixedPolicy(), progress, keep_tokens,
               stats if stats is not None else GenerateStats())
    while run.queue or (run.row_req >= 0).any():
        free = np.flatnonzero(run.row_req < 0)
        if run.queue and len(free):
            n = run.admissible(free)
            if n:
                run.admit(free, n)
                continue  # rows may have finished at once: refill before decoding
        live = np.flatnonzero(run.row_req >= 0)
        if len(live):
            live = run.compact(live)
            live = run.make_room(live)
            run.decode(live) if run.decode_k > 1 else run.step(live)
    run.catch_up()
    run.collect()
    run.stats.host_s += time.perf_counter() - t_start - run.executor.seconds
    run.stats.draft_model_s += getattr(executor, "draft_model_s", 0.0) - draft_model_s0
    return run.outputs, run.stats


class _TimedExecutor:
    """An executor whose calls' wall time is summed in `seconds` (what is not host time)."""

    def __init__(self, executor: StepExecutor):
        self.executor, self.seconds = executor, 0.0

    def __getattr__(self, name):
        fn = getattr(self.executor, name)
        if not callable(fn):
            return fn

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


class _Run:
    """The state of one `run_schedule` call: the queue, each cache row's request and cache
    length, each request's committed tokens (`[R]` arrays over the R requests), the outputs and
    stats. Per step, the work is array operations over the live rows; per-row Python runs only
    when a request is admitted or finishes."""

    def __init__(self, requests, executor, ec, limits: Limits, drafter,
                 policy: SpeculationPolicy, progress, keep_tokens: bool, stats: GenerateStats):
        self.requests, self.executor, self.ec = requests, executor, ec
        self.drafter, self.policy, self.progress = drafter, policy, progress
        self.keep_tokens, self.stats = keep_tokens, stats
        self.widths = ec.draft_widths if drafter is not None else (1,)
        self.wide_buckets = getattr(ec, "wide_row_buckets", ())
        # plain decoding: up to `decode_steps` steps per device call when the executor can
        self.decode_k = (int(getattr(ec, "decode_steps", 1)) if drafter is None
                         and hasattr(executor.executor, "decode") else 1)
        # an executor that frees a finished row's memory at once (the paged KV cache), and one
        # that admits by free memory and preempts rows when it runs short
        self.releases = hasattr(executor.executor, "release")
        self.pages = hasattr(executor.executor, "make_room")
        self.resume: dict[int, np.ndarray] = {}       # preempted request -> its tokens so far
        self.stop_ids = np.array(sorted(limits.stop_ids), np.int64)
        # a drafter's appends indexed while the device computes the next step
        self.overlap = (drafter is not None and bool(getattr(ec, "overlap_host", False))
                        and hasattr(drafter, "flush_appends"))
        self.flushed = True
        # the step's bookkeeping that the next plan does not need (the acceptance counts, the
        # policy's calibration update), run with the deferred appends while the device computes
        self.later: list[Callable[[], None]] = []
        self.defer_learning = self.overlap and hasattr(policy, "learn_deferred")
        # a draft model on the device (a draft head): its drafts go to the drafter each step
        self.model_drafts = (drafter is not None and
                             getattr(executor.executor, "draft_model", None) is not None)
        # the next step's drafts made there too, after the appends (`SuffixDrafter.propose_ahead`)
        self.ahead = (self.overlap and bool(getattr(ec, "draft_ahead", False))
                      and hasattr(drafter, "propose_ahead") and not self.model_drafts)
        self.max_new = limits.max_new_tokens
        n = len(requests)
        self.outputs = [RequestOutput(r, [], [], "") for r in requests]
        self.generated_R = np.zeros(n, np.int64)     # tokens committed per request
        self.passes_R = np.zeros(n, np.int64)        # RequestOutput counters, filled at the end
        self.drafted_R = np.zeros(n, np.int64)
        self.accepted_R = np.zeros(n, np.int64)
        self.log: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []   # committed tokens
        self.queue = collections.deque(policy.admission_order([r.problem_id for r in requests]))
        self.S = cache_len_for(ec.max_cache_len, ec.draft_widths,
                               max(len(r.prompt_ids) for r in requests), self.max_new)
        self.B = bucket(min(n, ec.max_slots), ec.batch_buckets)
        executor.start(self.B, self.S)
        self.row_req = np.full(self.B, -1, np.int64)      # request index in each row, -1 = free
        self.cache_len = np.zeros(self.B, np.int32)       # tokens in the cache per row
        self.admitted = np.zeros(self.B, np.int64)        # admission sequence number per row
        self.seq = 0
        self.finished = 0

    def finish(self, row: int, reason: str) -> None:
        ri = int(self.row_req[row])
        self.outputs[ri].finish_reason = reason
        if self.drafter is not None:
            self.drafter.end(ri)
        self.policy.end(ri, int(self.generated_R[ri]))
        self.row_req[row] = -1
        self.finished += 1
        if self.progress:
            self.progress(self.finished, len(self.requests))

    def commit(self, rows_A: np.ndarray, tokens_AxW: np.ndarray, logprobs_AxW: np.ndarray,
               n_A: np.ndarray, ends: Sequence[str] | None) -> np.ndarray:
        """Commits each row's n_A[j] sampled tokens up to a stop token (included) or
        max_new_tokens, finishing the row there, or with `ends[j]` (the executor's finish
        reason); returns int64 `[A]` the tokens committed per row."""
        req_A = self.row_req[rows_A]
        gen_A = self.generated_R[req_A]
        n_A = np.minimum(np.asarray(n_A, np.int64), self.max_new - gen_A)
        valid_AxW = np.arange(tokens_AxW.shape[1])[None, :] < n_A[:, None]
        stop_A = np.zeros(len(rows_A), bool)
        if self.stop_ids.size:
            hit_AxW = np.isin(tokens_AxW, self.stop_ids) & valid_AxW
            stop_A = hit_AxW.any(axis=1)
            n_A = np.where(stop_A, hit_AxW.argmax(axis=1) + 1, n_A)
            valid_AxW &= np.arange(tokens_AxW.shape[1])[None, :] < n_A[:, None]
        if self.keep_tokens or self.pages:     # a preempted request resumes from its tokens
            self.log.append((np.broadcast_to(req_A[:, None], valid_AxW.shape)[valid_AxW],
                             tokens_AxW[valid_AxW], logprobs_AxW[valid_AxW]))
        self.generated_R[req_A] = gen_A + n_A
        self.stats.generated_tokens += int(n_A.sum())
        if self.drafter is not None:
            t0 = time.perf_counter()
            append_batch(self.drafter, req_A, tokens_AxW, n_A.astype(np.int32), self.overlap)
            self.stats.draft_s += time.perf_counter() - t0
            self.flushed = not self.overlap
        length_A = ~stop_A & (gen_A + n_A >= self.max_new)
        end_A = stop_A | length_A
        if ends is not None:
            end_A = end_A | (np.asarray(ends) != "")
        ended = np.flatnonzero(end_A)
        for j in ended:
            reason = "stop" if stop_A[j] else "length" if length_A[j] else ends[j]
            self.finish(int(rows_A[j]), reason)
        if len(ended) and self.releases:
            self.executor.release(rows_A[ended])
        return n_A

    def flush(self) -> float:
        """The drafter's deferred appends (`StepInput.overlap`); returns their seconds."""
        t0 = time.perf_counter()
        flush_appends(self.drafter)
        self.catch_up()
        self.flushed = True
        seconds = time.perf_counter() - t0
        self.stats.overlap_s += seconds
        return seconds

    def overlapped(self, plan: DraftPlan, rows: RowBatch) -> float:
        """The host work while the device verifies `plan` (`StepInput.overlap`): the deferred
        appends (`flush`), then the next step's drafts made ahead (`ahead_inputs`,
        `SuffixDrafter.propose_ahead`); returns its seconds."""
        seconds = 0.0 if self.flushed else self.flush()
        t0 = time.perf_counter()
        args = ahead_inputs(plan, rows, self.policy, self.B, self.widths, self.stop_ids)
        if args is not None:
            self.drafter.propose_ahead(*args)
        ahead = time.perf_counter() - t0
        self.stats.overlap_s += ahead
        return seconds + ahead

    def catch_up(self) -> None:
        """Runs the bookkeeping deferred to the device's next step (`later`, the policy's
        calibration update)."""
        later, self.later = self.later, []
        for fn in later:
            fn()
        if self.defer_learning:
            self.policy.learn_deferred()

    def collect(self) -> None:
        """Fills the outputs' tokens, log-probs and counters from the run's arrays."""
        if self.keep_tokens and self.log:
            req_T = np.concatenate([c[0] for c in self.log])
            order = np.argsort(req_T, kind="stable")
            tok_T = np.concatenate([c[1] for c in self.log])[order]
            logp_T = np.concatenate([c[2] for c in self.log])[order]
            ends = np.cumsum(np.bincount(req_T, minlength=len(self.outputs)))
            for ri, o in enumerate(self.outputs):
                lo = ends[ri - 1] if ri else 0
                o.token_ids = tok_T[lo:ends[ri]].tolist()
                o.logprobs = logp_T[lo:ends[ri]].astype(np.float64).tolist()
        self.log = []
        for ri, o in enumerate(self.outputs):
            o.forward_passes = int(self.passes_R[ri])
            o.drafted_tokens = int(self.drafted_R[ri])
            o.accepted_draft_tokens = int(self.accepted_R[ri])

    def admissible(self, free: np.ndarray) -> int:
        """How many queued requests to admit into the free rows now: all that fit, or with a
        paged executor those whose pages fit (`StepExecutor.admissible`), at least one when no
        row is live."""
        n = min(len(free), len(self.queue))
        if not self.pages:
            return n
        head = list(itertools.islice(self.queue, n))
        lengths = [self.resumed_length(ri) for ri in head]
        live = int((self.row_req >= 0).sum())
        k = int(self.executor.admissible(head, lengths, live))
        return max(k, 1) if live == 0 else k

    def resumed_length(self, ri: int) -> int:
        """Positions a request's admission writes: its prompt, plus for a preempted request the
        tokens it had committed but the last (pending)."""
        extra = len(self.resume[ri]) - 1 if ri in self.resume else 0
        return len(self.requests[ri].prompt_ids) + extra

    def tokens_of(self, ri: int) -> np.ndarray:
        """int32 the tokens request `ri` committed so far (from the run's log)."""
        return np.concatenate([c[1][c[0] == ri] for c in self.log] or
                              [np.zeros(0, np.int32)]).astype(np.int32)

    def make_room(self, live: np.ndarray) -> np.ndarray:
        """With a paged executor: pages for every position the next call may write; when the
        pool runs short, the most recently admitted rows are preempted (their pages freed, their
        requests back at the front of the queue, resumed later from their tokens: the same
        tokens as without preemption). Returns the live rows that stay."""
        if not self.pages:
            return live
        reach = self.decode_k if self.decode_k > 1 else max(self.widths)
        req_A = self.row_req[live]
        reach_A = np.minimum(reach, self.max_new - self.generated_R[req_A])
        victims = np.asarray(self.executor.make_room(
            live, self.cache_len[live].astype(np.int64) + reach_A, self.admitted[live]),
            np.int64)
        if not len(victims):
            return live
        for row in victims[np.argsort(self.admitted[victims])[::-1]]:
            ri = int(self.row_req[row])
            self.resume[ri] = self.tokens_of(ri)
            self.queue.appendleft(ri)
            self.row_req[row] = -1
        self.stats.preemptions += len(victims)
        return live[~np.isin(live, victims)]

    def admit(self, free: np.ndarray, n: int) -> None:
        """Admits `n` queued requests into the free rows (prefill) and commits their first
        tokens; a preempted request resumes (its tokens prefilled, nothing committed)."""
        stats, drafter, queue = self.stats, self.drafter, self.queue
        take = [queue.popleft() for _ in range(n)]
        rows = free[:len(take)]
        resumed = {ri: self.resume.pop(ri) for ri in take if ri in self.resume}
        pre = (self.executor.prefill(take, rows, self.B, resumed) if resumed
               else self.executor.prefill(take, rows, self.B))
        stats.prefill_s += pre.seconds
        stats.prefill_tokens += pre.tokens
        stats.prefill_calls += 1
        new = np.array([ri not in resumed for ri in take], bool)
        for ri, row in zip(take, rows):
            req = self.requests[ri]
            self.row_req[row] = ri
            self.seq += 1
            self.admitted[row] = self.seq
            if ri in resumed:
                self.cache_len[row] = len(req.prompt_ids) + len(resumed[ri]) - 1
                continue
            self.cache_len[row] = len(req.prompt_ids)
            t0 = time.perf_counter()
            self.policy.begin(int(ri), req.problem_id, len(req.prompt_ids))
            t1 = time.perf_counter()
            if drafter is not None:
                drafter.begin(int(ri), req.problem_id, list(req.prompt_ids))
            stats.policy_s += t1 - t0
            stats.draft_s += time.perf_counter() - t1
        if new.any():
            ends = None if pre.ends is None else np.asarray(pre.ends, object)[new]
            self.commit(rows[new], np.asarray(pre.first_tokens, np.int32).reshape(-1, 1)[new],
                        np.asarray(pre.first_logprobs, np.float32).reshape(-1, 1)[new],
                        np.ones(int(new.sum()), np.int64), ends)

    def compact(self, live: np.ndarray) -> np.ndarray:
        """Compacts the live rows into a smaller bucket for the tail (once the queue is empty
        and they fit one); returns the live rows after it."""
        nb = tail_bucket(len(live), self.B, self.ec.batch_buckets, queue_empty=not self.queue)
        if nb is None:
            return live
        self.executor.compact(live, nb)
        self.row_req, self.cache_len = compact_rows(live, nb, self.row_req, -1, self.cache_len, 0)
        self.admitted = compact_rows(live, nb, self.admitted, 0)[0]
        self.B = nb
        return np.arange(len(live))

    def read_kv(self, cache_len_A) -> int | None:
        """The cached positions a step of rows holding `cache_len_A` tokens reads, when the
        executor's attention reads each row's own pages (`StepExecutor.kv_read_page`:
        `pages_read_kv`); None (the bucket's `batch * kv_len`) otherwise."""
        page = getattr(self.executor, "kv_read_page", None)
        return None if page is None else pages_read_kv(cache_len_A, page)

    def decode(self, live: np.ndarray) -> None:
        """Up to `decode_k` plain decode steps of the live rows in one executor call (no
        drafter): commit, and one `StepRecord` per device step (its rows: those still running;
        each the call's seconds / steps)."""
        stats, B, k = self.stats, self.B, self.decode_k
        req_A = self.row_req[live]
        gen_A = self.generated_R[req_A]
        remaining_A = self.max_new - gen_A
        kv_len = kv_len_bucket(self.cache_len[live] + k - 1, self.S)
        n0_A = np.zeros(len(live), np.int32)
        read_kv = self.read_kv(self.cache_len[live] + (k - 1) // 2)   # the call's mean step
        num_tokens, attended_kv = step_shape_fn(B, kv_len, (1,), read_kv)(n0_A)
        n0_B = np.zeros(B, np.int32)
        out = self.executor.decode(StepInput(
            batch=B, live=live, request_ids=req_A, generated=gen_A, cache_len_B=self.cache_len,
            kv_len=kv_len, width=1, drafts_AxK=np.zeros((len(live), 0), np.int32),
            n_draft_B=n0_B, num_tokens=num_tokens, attended_kv=attended_kv,
            predicted_seconds=None, read_kv=read_kv), k, remaining_A, self.stop_ids)
        n_A = np.asarray(out.n_A, np.int64)
        steps = int(n_A.max(initial=1))
        stats.decode_s += out.seconds
        stats.forward_passes += steps
        self.passes_R[req_A] += n_A
        self.cache_len[live] += n_A.astype(np.int32)
        committed_A = self.commit(live, out.tokens_AxW, out.logprobs_AxW, n_A, out.ends)
        for i in range(steps):
            active = int((n_A > i).sum())
            emitted = int((committed_A > i).sum())
            record = StepRecord(batch=B, active=active, width=1, kv_len=kv_len, drafted=0,
                                accepted=0, emitted=emitted, seconds=out.seconds / steps,
                                num_tokens=num_tokens, attended_kv=attended_kv,
                                accepted_per_row=None, read_kv=read_kv,
                                compile_s=out.compile_s if i == 0 else 0.0)
            stats.steps.append(record)
            self.policy.observe(record)

    def step(self, live: np.ndarray) -> None:
        """One verify step of the live rows: draft, verify, commit, record."""
        stats, policy, B = self.stats, self.policy, self.B
        kv_len = kv_len_bucket(self.cache_len[live], self.S)
        req_A = self.row_req[live]
        gen_A = self.generated_R[req_A]
        rows = RowBatch(req_A, gen_A, self.max_new - gen_A)
        read_kv = self.read_kv(self.cache_len[live])
        step_shape = step_shape_fn(B, kv_len, self.widths, read_kv, self.wide_buckets)
        if self.model_drafts:
            tok_AxJ, probs_AxJ = self.executor.model_drafts(live)
            self.drafter.set_model_drafts(req_A, tok_AxJ, probs_AxJ)
        plan = plan_step(self.drafter, policy, rows, B, self.widths, kv_len, step_shape)
        stats.draft_s += plan.draft_s
        stats.policy_s += plan.policy_s

        n_draft_A = plan.drafts.lens_A
        n_draft_B = np.zeros(B, np.int32)
        n_draft_B[live] = n_draft_A
        second, alt_AxK, n_alt_B = plan.second, None, None
        if second is not None:          # a two-branch token tree
            shape = step_shape.tree(n_draft_A, second.lens_A)
            alt_AxK = second.tokens_AxK
            n_alt_B = np.zeros(B, np.int32)
            n_alt_B[live] = second.lens_A
        else:
            shape = step_shape(n_draft_A)
        num_tokens, attended_kv = shape
        out = self.executor.verify(StepInput(
            batch=B, live=live, request_ids=req_A, generated=gen_A,
            cache_len_B=self.cache_len, kv_len=kv_len, width=plan.width,
            drafts_AxK=plan.drafts.tokens_AxK, n_draft_B=n_draft_B, num_tokens=num_tokens,
            attended_kv=attended_kv, predicted_seconds=plan.predicted_seconds,
            read_kv=read_kv,
            overlap=(functools.partial(self.overlapped, plan, rows) if self.ahead
                     else None if self.flushed else self.flush),
            wide_rows=shape.wide_rows, alt_AxK=alt_AxK, n_alt_B=n_alt_B,
            branch_rows=getattr(shape, "branch_rows", 0)))
        if not self.flushed:            # an executor that does not overlap
            self.flush()
        stats.decode_s += out.seconds
        stats.forward_passes += 1
        drafted = int(n_draft_A.sum()) + (0 if second is None else int(second.lens_A.sum()))
        stats.drafted_tokens += drafted
        classes = policy.step_classes(rows)
        self.passes_R[req_A] += 1
        self.drafted_R[req_A] += n_draft_A if second is None else n_draft_A + second.lens_A
        self.cache_len[live] += np.asarray(out.n_A, np.int32)
        # Count what was committed: tokens past a stop token or max_new_tokens are not.
        committed_A = self.commit(live, out.tokens_AxW, out.logprobs_AxW, out.n_A, out.ends)
        accepted_A = np.maximum(committed_A - 1, 0)
        self.accepted_R[req_A] += accepted_A
        accepted = int(accepted_A.sum())
        stats.accepted_draft_tokens += accepted
        won_A = np.zeros(len(live), bool)
        if second is not None and out.won_A is not None:
            won_A = np.asarray(out.won_A, bool)
        if drafted:         # the accepted tokens are the winning branch's
            count = functools.partial(_count_acceptance, stats, n_draft_A, accepted_A, won_A,
                                      plan.drafts.source_A, second)
            if self.overlap:
                self.later.append(count)
            else:
                count()
        record = StepRecord(batch=B, active=len(live), width=plan.width, kv_len=kv_len,
                            drafted=drafted, accepted=accepted, emitted=int(committed_A.sum()),
                            seconds=out.seconds,
                            predicted_seconds=plan.predicted_seconds, classes=classes,
                            num_tokens=num_tokens, attended_kv=attended_kv,
                            accepted_per_row=tuple(accepted_A.tolist()), read_kv=read_kv,
                            compile_s=out.compile_s, wide_rows=shape.wide_rows,
                            branch_rows=getattr(shape, "branch_rows", 0),
                            alt_per_row=(None if second is None
                                         else tuple(second.lens_A.tolist())),
                            won_per_row=(None if second is None
                                         else tuple(bool(w) for w in won_A)))
        stats.steps.append(record)
        t0 = time.perf_counter()
        if self.defer_learning:
            policy.observe(record, defer_learning=True)
        else:
            policy.observe(record)
        stats.policy_s += time.perf_counter() - t0


def _count_acceptance(stats: GenerateStats, n_draft_A: np.ndarray, accepted_A: np.ndarray,
                      won_A: np.ndarray, source_A, second) -> None:
    """A verify step's per-position and per-source counts (`GenerateStats.count_acceptance`),
    the accepted tokens counted for the winning branch of a two-branch step."""
    stats.count_acceptance(n_draft_A, np.where(won_A, 0, accepted_A), source_A)
    if second is not None:
        stats.count_acceptance(second.lens_A, np.where(won_A, accepted_A, 0), second.source_A)
