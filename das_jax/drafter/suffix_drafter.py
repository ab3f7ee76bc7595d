"""Suffix-tree drafters behind the `Drafter` protocol.

- `SuffixDrafter` ("suffix", what DAS uses): one trie per problem over its recent rollouts
  (`ProblemHistory`), so a request drafts from earlier rollouts of the same problem and from
  its live siblings; by default also from a trie of its own prompt and output (the request
  scope) and from a global trie of the most recent finished rollouts of every problem (the
  global scope), the best-scoring draft of the three winning.
- `GlobalSuffixDrafter` ("suffix-global", the SuffixDecoding / vLLM `method="suffix"`
  baseline): one global trie over all problems' rollouts of the last `window` epochs, plus a
  per-request trie over the request's prompt and own output; the better-scoring draft wins.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
from typing import Hashable, Sequence

import numpy as np

from . import _batch_kernels as BK
from .ahead import AheadDrafts
from .base import Draft, DraftBatch, RequestContext
from .history import ProblemHistory, ShardedHistory
from .slots import RequestSlots
from .suffix_tree import SuffixForest, SuffixTreeConfig


@dataclasses.dataclass
class _Active:
    """A SuffixDrafter request: its problem, history handle and slot in `RequestSlots`."""
    problem_id: Hashable
    handle: int
    slot: int


@dataclasses.dataclass
class _Request:
    problem_id: Hashable
    handle: int
    context: RequestContext
    local_root: int = -1      # GlobalSuffixDrafter only
    local_sid: int = -1


# A step's rows are split over the drafter's threads only at this many rows per thread (the
# propose; the appends): below it, waking a worker (50-300 us on a VM) costs more than its share
# of the work saves.
_MIN_ROWS_PER_THREAD = 32
_MIN_APPEND_ROWS_PER_THREAD = 16
# A full flush indexes finished rollouts into the global trie up to this many times the tokens
# appended since the previous full flush (the rest at the next ones, and all of them at
# `advance_epoch` and `state_dict`): a step where several long rollouts finish at once then
# costs no more than the steps around it, while the trie keeps up with the rollouts finishing.
GLOBAL_INDEX_RATE = 4

SCOPES = ("problem", "request", "global")


class SuffixDrafter:
    """Per-problem suffix-trie drafter (DAS).

    Args:
      config: trie parameters.
      window: past epochs of rollouts kept per problem.
      prompt_tail: prompt tokens indexed in front of each rollout (default config.max_depth).
      max_problems: optional cap on problems kept (least recently visited dropped).
      threads: threads a step's rows are drafted and appended on (1: the calling thread only;
        more: the history is sharded into `threads` forests (`ShardedHistory`: a problem's
        trie lives in one) and the request tries into as many request forests (a request's
        in its problem's shard); a step's drafts are split into `threads` equal parts of its
        rows (from 32 rows per thread) and its appends into a job per shard, its problem and
        request forests (from 16 rows per thread), on a pool of threads - 1 workers created
        on first use, the calling thread taking a part too; drafts are the same as with one
        thread).
      scopes: the tries a request drafts from, a subset of SCOPES that holds "problem":
        "problem" (its problem's rollouts, live siblings included), "request" (a trie of its
        own full prompt and output, as SuffixDecoding's per-request tree: it catches the
        request's own repetitions and copies from its prompt), "global" (the last
        `global_rollouts` finished rollouts of every problem, each its prompt tail + output:
        a fallback where the problem's history has little, as in epoch 0). Each draft is
        scored on the same scale (sum of its count-ratio path probabilities, the expected
        accepted length); the highest wins, ties going to the earlier scope in SCOPES. The
        global trie lives in its own forest (`scope_forest`), and so do the request tries
        with one thread; sharded, a request's trie is in its shard's request forest
        (`request_forests`), so that each thread's appends touch their own arrays. A
        finished rollout is indexed into the global trie by the next full `flush_appends`
        (off the step's critical path in the engine), each indexing at most
        `GLOBAL_INDEX_RATE` times the tokens appended since the one before (all at
        `advance_epoch` and `state_dict`).
      global_rollouts: finished rollouts the global trie keeps (oldest dropped first), >= 1.
      global_below: the global trie is searched only for rows whose problem / request draft
        scores below this (expected accepted tokens, >= 0; 0: never, inf: always). On the
        shipped GSM8K trace 2.0 drafted best (tokens per verify step 2.27 / 2.50 / 2.57 /
        2.72 in epochs 0-3 against 2.26 / 2.49 / 2.56 / 2.71 always) and halves the rows
        that search it.
      request_below: the request trie is searched only for rows whose problem draft scores
        below this (expected accepted tokens, >= 0; 0: never, inf: always). On the shipped
        GSM8K trace 4.0 drafts as well as always searching it (tokens per verify step
        2.268 / 2.504 / 2.572 / 2.724 in epochs 0-3 against 2.268 / 2.505 / 2.571 / 2.724),
        and at paper scale (256 slots) it takes 12-18% off the step's propose: a row whose
        history already drafts four expected tokens seldom gains from its own text.

    `propose_batch` / `append_batch` do every row in one kernel call (equal to the per-row
    calls in row order). Active requests live in `RequestSlots` (context, trie root, own
    sequence, output length per slot).

    Errors: `begin` with a request id already active raises ValueError; other calls with an
    unknown request id raise KeyError.
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(), window: int = 16,
                 prompt_tail: int | None = None, max_problems: int | None = None,
                 threads: int = 1, scopes: Sequence[str] = SCOPES, global_rollouts: int = 1024,
                 global_below: float = 2.0, request_below: float = 4.0):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        scopes = tuple(scopes)
        if "problem" not in scopes or not set(scopes) <= set(SCOPES):
            raise ValueError(f"scopes must hold 'problem' and only names of {SCOPES}, got "
                             f"{scopes}")
        if global_rollouts < 1:
            raise ValueError(f"global_rollouts must be >= 1, got {global_rollouts}")
        if not global_below >= 0:
            raise ValueError(f"global_below must be >= 0, got {global_below}")
        if not request_below >= 0:
            raise ValueError(f"request_below must be >= 0, got {request_below}")
        self.history = (ProblemHistory(config, window, prompt_tail, max_problems)
                        if threads == 1 else
                        ShardedHistory(config, window, prompt_tail, max_problems, threads))
        self.config = self.history.config
        self.threads = int(threads)
        self._requests: dict[int, _Active] = {}
        self._slots = RequestSlots()
        self._ahead = AheadDrafts()       # drafts made while the device computes a step
        self._executor = None
        # appends whose indexing into the trie waits for `flush_appends` (append_batch with
        # index_later): (slots int64 [A], tokens int32 [A, W], n int32 [A]) in order
        self._deferred: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.scopes = tuple(x for x in SCOPES if x in scopes)
        self.global_rollouts = int(global_rollouts)
        self.global_below = float(global_below)
        self.request_below = float(request_below)
        self._init_scopes()

    def _init_scopes(self):
        """An empty scope forest (the global trie when that scope is on) and request forests,
        one per history shard (unsharded: the scope forest itself)."""
        self.scope_forest = SuffixForest(self.config)
        self._global_root = self.scope_forest.new_tree() if "global" in self.scopes else -1
        n = len(self._forests())
        self.request_forests = ([self.scope_forest] if n == 1 else
                                [SuffixForest(self.config) for _ in range(n)])
        self._global_seqs: collections.deque = collections.deque()   # indexed sids, oldest first
        self._global_pending: list[np.ndarray] = []      # finished rollouts not yet indexed
        # tokens of _global_pending[0] indexed so far (its sequence: the newest of _global_seqs)
        self._global_head = 0
        self._appended = 0             # tokens appended since the last full flush
        # (request forest, sid, root) of ended requests' tries
        self._ended_tries: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ protocol
    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already active")
        # A new problem's trie is added beside the others (problems are dropped only when an
        # epoch advances, which flushes first), so the deferred appends wait for the device.
        new_problem = self.history.root(problem_id) < 0
        handle = self.history.start_rollout(problem_id, prompt_ids)
        sl = self._slots
        s = sl.add(request_id, prompt_ids)
        self._requests[request_id] = _Active(problem_id, handle, s)
        sl.root[s] = self.history.root(problem_id)
        sl.sid[s] = self.history.rollout(handle).sid
        sl.shard[s] = self._shard(problem_id)
        if "request" in self.scopes:
            self._new_request_trie(s, prompt_ids)
        if new_problem and (sl.root[sl.live] < 0).any():
            self._sync_slots()      # live requests whose problem was dropped draft from it again
        # the problem's mean version now counts this rollout, for its live siblings too
        same = sl.live & (sl.root == sl.root[s]) & (sl.shard == sl.shard[s])
        sl.mean_version[same] = self.history.mean_version(problem_id)
        self._ahead.void(same)      # their problem's trie took this prompt's tail

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        s = self._requests[request_id].slot
        out = self._propose_slots(np.array([s], np.int64), np.array([max_tokens], np.int32))
        k = int(out.lens_A[0]) if out.width else 0
        if k == 0:
            return Draft.empty()
        return Draft(out.tokens_AxK[0, :k].copy(), out.probs_AxK[0, :k].copy(),
                     out.support_AxK[0, :k].copy())

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        self.flush_appends()
        s, sl = self._requests[request_id].slot, self._slots
        arr = np.asarray(token_ids, np.int32).reshape(-1)
        n = arr.size
        if n == 0:
            return
        self._appended += n
        if sl.sid[s] >= 0:
            self._forests()[sl.shard[s]].append(int(sl.sid[s]), arr)
        if sl.rsid[s] >= 0:
            self.request_forests[sl.rshard[s]].append(int(sl.rsid[s]), arr)
        length = int(sl.ctx_len[s])
        sl.reserve(s, length + n)
        start = int(sl.ctx_start[s]) + length
        sl.pool[start: start + n] = arr
        sl.ctx_len[s] = length + n
        sl.out_len[s] += n

    def propose_batch(self, request_ids: np.ndarray, max_tokens_A: np.ndarray) -> DraftBatch:
        """Row b: `propose(request_ids[b], max_tokens_A[b])`, all rows in one kernel call
        (split over `threads`). K = max(max_tokens_A) (0 without rows).

        Args:
          request_ids: int64 [A] active request ids (KeyError for an unknown one).
          max_tokens_A: int32 [A], >= 0.
        """
        ids = np.asarray(request_ids, np.int64).reshape(-1)
        max_tokens_A = np.asarray(max_tokens_A, np.int32).reshape(-1)
        if ids.shape != max_tokens_A.shape:
            raise ValueError(f"request_ids {ids.shape} and max_tokens_A {max_tokens_A.shape} "
                             "differ in shape")
        return self._propose_slots(self._slots.lookup(ids), max_tokens_A)

    def append_batch(self, request_ids: np.ndarray, tokens_AxW: np.ndarray,
                     n_A: np.ndarray, index_later: bool = False) -> None:
        """`append(request_ids[b], tokens_AxW[b, :n_A[b]])` for every row with n_A[b] > 0, in
        row order, in one kernel call.

        With `index_later`, only the contexts take the tokens now (microseconds); indexing
        them into the trie, most of an append's time, waits for `flush_appends` (the scheduler
        runs it while the device computes the next step). Until then `propose` drafts from
        the full context on a trie without those tokens (the drafts may differ; the tokens
        sampled never do), and every other call flushes first (`end` only its request's).

        Args:
          request_ids: int64 [A] active request ids (KeyError for an unknown one).
          tokens_AxW: int32 [A, W]. n_A: int32 [A], each <= W.
          index_later: defer the trie indexing (above).
        """
        ids = np.asarray(request_ids, np.int64).reshape(-1)
        tokens_AxW = np.ascontiguousarray(tokens_AxW, np.int32)
        n_A = np.asarray(n_A, np.int32).reshape(-1)
        if tokens_AxW.ndim != 2 or tokens_AxW.shape[0] != ids.shape[0] or n_A.shape != ids.shape:
            raise ValueError(f"need tokens_AxW [A, W] and n_A [A] for A = {ids.shape[0]} rows, "
                             f"got {tokens_AxW.shape} and {n_A.shape}")
        if ids.shape[0] and n_A.max() > tokens_AxW.shape[1]:
            raise ValueError(f"n_A exceeds W = {tokens_AxW.shape[1]}")
        slots = self._slots.lookup(ids)
        if not index_later:
            self.flush_appends()
            self._append_slots(slots, tokens_AxW, n_A)
            self._appended += int(n_A.sum())
            return
        self._appended += int(n_A.sum())
        self._append_slots(slots, tokens_AxW, n_A, BK.CONTEXT)
        indexed = (self._slots.sid[slots] >= 0) | (self._slots.rsid[slots] >= 0)
        if indexed.any():
            keep = indexed & (n_A > 0)
            self._deferred.append((slots[keep], tokens_AxW[keep], n_A[keep]))
            np.add.at(self._slots.lag, slots[keep], n_A[keep].astype(np.int64))

    def propose_ahead(self, request_ids: np.ndarray, tokens_AxW: np.ndarray, n_A: np.ndarray,
                      max_tokens_A: np.ndarray, guess_A: np.ndarray | None = None) -> int:
        """Drafts now, for each row b, what `propose_batch` will return for request
        request_ids[b] with budget max_tokens_A[b] once tokens_AxW[b, :n_A[b]] are appended to
        it (`append_batch(..., index_later=True)`) and nothing else has changed the tries it
        drafts from. The scheduler calls it while the device computes a step, assuming the
        step accepts a row's draft and samples the token the drafter would draft next; a
        propose takes a draft made ahead only for exactly that context, lag and budget (so its
        drafts are the same with or without this call), else drafts the row itself.
        `begin`, `end` and `flush_appends` void the drafts of the rows whose tries they
        change. Rows with n_A[b] <= 0 or max_tokens_A[b] <= 0 are skipped. Returns the rows
        drafted.

        Args:
          request_ids: int64 [A] active request ids (KeyError for an unknown one).
          tokens_AxW: int32 [A, W]. n_A: int32 [A], each <= W. max_tokens_A: int32 [A].
          guess_A: bool [A] or None: rows whose last assumed token, tokens_AxW[b, n_A[b] - 1],
            is a placeholder for the drafter to guess: the first token of its draft for the
            context ending in the other n_A[b] - 1 (a row with no such draft is skipped).
        """
        ids = np.asarray(request_ids, np.int64).reshape(-1)
        tokens_AxW = np.array(tokens_AxW, np.int32)
        n_A = np.asarray(n_A, np.int32).reshape(-1)
        max_A = np.asarray(max_tokens_A, np.int32).reshape(-1)
        guess_A = (np.zeros(ids.shape, bool) if guess_A is None
                   else np.asarray(guess_A, bool).reshape(-1))
        if (tokens_AxW.ndim != 2 or tokens_AxW.shape[0] != ids.shape[0]
                or n_A.shape != ids.shape or max_A.shape != ids.shape
                or guess_A.shape != ids.shape):
            raise ValueError(f"need tokens_AxW [A, W], n_A [A], max_tokens_A [A] and guess_A "
                             f"[A] for A = {ids.shape[0]} rows, got {tokens_AxW.shape}, "
                             f"{n_A.shape}, {max_A.shape} and {guess_A.shape}")
        if ids.shape[0] and n_A.max() > tokens_AxW.shape[1]:
            raise ValueError(f"n_A exceeds W = {tokens_AxW.shape[1]}")
        sl = self._slots
        slots = sl.lookup(ids)
        # rows whose context has room for the assumed tokens (the next commit writes there)
        keep = (n_A > 0) & (max_A > 0) & (sl.ctx_len[slots] + n_A <= sl.ctx_cap[slots])
        if not keep.any():
            return 0
        slots, tokens_AxW, n_A, max_A = slots[keep], tokens_AxW[keep], n_A[keep], max_A[keep]
        guess_A = guess_A[keep]
        if guess_A.any():
            g = np.flatnonzero(guess_A)
            first = self._draft_assumed(slots[g], tokens_AxW[g], n_A[g] - 1,
                                        np.ones(g.shape[0], np.int32))[0]
            tokens_AxW[g, n_A[g] - 1] = first.tokens_AxK[:, 0] if first.width else 0
            ok = np.ones(slots.shape[0], bool)
            ok[g] = first.lens_A > 0
            slots, tokens_AxW, n_A, max_A = slots[ok], tokens_AxW[ok], n_A[ok], max_A[ok]
            if not slots.shape[0]:
                return 0
        out, source_A, ctx_len, lag = self._draft_assumed(slots, tokens_AxW, n_A, max_A)
        W = tokens_AxW.shape[1]
        self._ahead.store(slots, ctx_len[slots], lag[slots], max_A,
                          np.where(np.arange(W)[None, :] < n_A[:, None], tokens_AxW, 0), n_A,
                          out.tokens_AxK, out.probs_AxK, out.support_AxK, out.lens_A, source_A)
        return slots.shape[0]

    def _draft_assumed(self, slots: np.ndarray, tokens_AxW: np.ndarray, n_A: np.ndarray,
                       max_A: np.ndarray) -> tuple[DraftBatch, np.ndarray, np.ndarray,
                                                   np.ndarray]:
        """Row b's draft (budget max_A[b]) for slot slots[b] with tokens_AxW[b, :n_A[b]]
        assumed appended (written past its context in the pool, which the next commit
        overwrites; counted as unindexed where the slot has a sequence to index). Returns
        (drafts, int8 source_A, the slots' ctx_len and lag as assumed: int64 [S])."""
        sl = self._slots
        A, W = tokens_AxW.shape
        held_AxW = np.arange(W)[None, :] < n_A[:, None]
        at_AxW = (sl.ctx_start[slots] + sl.ctx_len[slots])[:, None] + np.arange(W)[None, :]
        sl.pool[at_AxW[held_AxW]] = tokens_AxW[held_AxW]
        ctx_len, lag = sl.ctx_len.copy(), sl.lag.copy()
        ctx_len[slots] += n_A
        # as `append_batch(..., index_later=True)` counts them: rows with a sequence to index
        lag[slots] += np.where((sl.sid[slots] >= 0) | (sl.rsid[slots] >= 0), n_A, 0)
        out = DraftBatch.empty(A, int(max_A.max(initial=0)))
        source_A = np.full(A, -1, np.int8)
        if out.width:
            self._draft_rows(slots, max_A, (out.tokens_AxK, out.probs_AxK, out.support_AxK,
                                            out.lens_A, source_A), ctx_len, lag)
        return out, source_A, ctx_len, lag

    @property
    def drafted_ahead(self) -> tuple[int, int]:
        """(rows drafted by `propose_ahead`, rows of them a propose took) since the drafter was
        made or loaded."""
        return self._ahead.made, self._ahead.used

    def flush_appends(self, slot: int | None = None, *, request_trie: bool = True) -> None:
        """Indexes the deferred appends (`append_batch(..., index_later=True)`) into the trie,
        in their order: all of them (then also the finished rollouts waiting for the global
        trie, up to `GLOBAL_INDEX_RATE` x the tokens appended since the last full flush, and
        the ended requests' tries are removed), or only slot `slot`'s (with
        `request_trie` false, not into its request trie: `end`, which drops it). Drafts made
        ahead (`propose_ahead`) for the tries it changes are void."""
        sl = self._slots
        if slot is None:
            self._ahead.void()
        else:
            self._ahead.void(sl.live & (sl.root == sl.root[slot]) & (sl.shard == sl.shard[slot]))
        if slot is None and self._ended_tries:
            for k, sid, root in self._ended_tries:
                self.request_forests[k].remove(sid)
                self.request_forests[k].drop_tree(root)
            self._ended_tries = []
        if slot is None:
            if self._global_pending:
                self._index_global(GLOBAL_INDEX_RATE * self._appended)
            self._appended = 0
        if not self._deferred:
            return
        if slot is None:
            for slots, tokens_AxW, n_A in self._deferred:
                self._append_slots(slots, tokens_AxW, n_A, BK.INDEX)
                sl.lag[slots] = 0
            self._deferred = []
            return
        for slots, tokens_AxW, n_A in self._deferred:
            mine = slots == slot
            if mine.any():
                self._append_slots(slots[mine], tokens_AxW[mine], n_A[mine], BK.INDEX,
                                   request_trie)
                n_A[mine] = 0
        sl.lag[slot] = 0

    def end(self, request_id: int) -> None:
        self.flush_appends(self._requests[request_id].slot, request_trie=False)
        req = self._requests.pop(request_id)
        sl, s = self._slots, req.slot
        # its problem's trie takes its last tokens and may drop old rollouts: the siblings'
        # drafts made ahead are void
        self._ahead.void(sl.live & (sl.root == sl.root[s]) & (sl.shard == sl.shard[s]))
        out_len = int(sl.out_len[s])
        self.history.rollout(req.handle).out_len = out_len
        self.history.finish_rollout(req.handle)
        if sl.rsid[s] >= 0:         # un-indexed at the next full flush (while the device runs)
            self._ended_tries.append((int(sl.rshard[s]), int(sl.rsid[s]), int(sl.rroot[s])))
        if self._global_root >= 0 and out_len:
            ctx = sl.context(s)
            start = max(0, ctx.size - out_len - self.history.prompt_tail)
            self._global_pending.append(ctx[start:].copy())
        sl.remove(request_id)

    def advance_epoch(self) -> None:
        self.flush_appends()
        self._index_global()
        self.history.advance_epoch()
        self._sync_slots()
        self._ahead.void()

    def lengths(self, problem_id: Hashable) -> list[int]:
        """Output lengths of the problem's finished rollouts in the window (oldest first)."""
        return self.history.lengths(problem_id)

    def set_policy_version(self, version: int) -> None:
        """Requests begun from now on are sampled by policy `version` (int >= 0; RL: the
        updates their params had seen): their rollouts are tagged with it, and drafts report
        their history's age against it (`DraftBatch.age_A`). ValueError if negative."""
        self.history.set_policy_version(version)

    def context(self, request_id: int) -> np.ndarray:
        """int32 copy of the request's context (prompt + appended tokens); KeyError if unknown."""
        return self._slots.context(self._requests[request_id].slot).copy()

    # ------------------------------------------------------------------ scopes
    def _new_request_trie(self, s: int, tokens: np.ndarray | Sequence[int]) -> None:
        """Slot s's request trie, holding `tokens` (its prompt, or its whole context when
        restored), in its shard's request forest (the scope forest when there is one)."""
        sl = self._slots
        k = int(sl.shard[s]) if len(self.request_forests) > 1 else 0
        f = self.request_forests[k]
        root = f.new_tree()
        sid = f.new_seq(root)
        f.append(sid, np.asarray(tokens, np.int32).reshape(-1))
        sl.rroot[s], sl.rsid[s], sl.rshard[s] = root, sid, k

    def _index_global(self, budget: int | None = None) -> None:
        """Indexes the finished rollouts waiting for the global trie, oldest first, up to
        `budget` tokens (None: all; a rollout cut there goes on from that token next time, a
        live sequence of the trie meanwhile), dropping the oldest beyond `global_rollouts`."""
        f = self.scope_forest
        left = None if budget is None else int(budget)
        while self._global_pending and (left is None or left > 0):
            tokens = self._global_pending[0]
            if self._global_head == 0:
                self._global_seqs.append(f.new_seq(self._global_root))
            sid = self._global_seqs[-1]
            end = len(tokens) if left is None else min(len(tokens), self._global_head + left)
            f.append(sid, tokens[self._global_head:end])
            if left is not None:
                left -= end - self._global_head
            self._global_head = end
            if end == len(tokens):
                f.freeze(sid)
                self._global_pending.pop(0)
                self._global_head = 0
        while len(self._global_seqs) > self.global_rollouts:
            f.remove(self._global_seqs.popleft())

    # ------------------------------------------------------------------ batched kernels
    def _forests(self) -> list[SuffixForest]:
        """The forests of the history's shards (one unsharded)."""
        h = self.history
        return [x.forest for x in h.shards] if isinstance(h, ShardedHistory) else [h.forest]

    def _shard(self, problem_id: Hashable) -> int:
        """The shard of the problem's trie (0 unsharded or unknown). A live request's own
        sequence, when still indexed, is in it too: a problem dropped and visited again may
        land in another shard, but dropping it un-indexed its rollouts."""
        h = self.history
        return h.problem_shard(problem_id) if isinstance(h, ShardedHistory) else 0

    def _pool(self):
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.threads - 1, thread_name_prefix="suffix-drafter")
        return self._executor

    def _run_groups(self, jobs: list) -> None:
        """Runs the callables in `jobs` at once: the first on this thread, the others on the
        pool."""
        if len(jobs) <= 1:
            for job in jobs:
                job()
            return
        futures = [self._pool().submit(job) for job in jobs[1:]]
        jobs[0]()
        for fut in futures:
            fut.result()

    def _propose_slots(self, slots: np.ndarray, max_tokens_A: np.ndarray) -> DraftBatch:
        A = slots.shape[0]
        out = DraftBatch.empty(A, max(0, int(max_tokens_A.max(initial=0))))
        if out.width == 0:
            return out
        sl = self._slots
        source_A = np.full(A, -1, np.int8)
        outs = (out.tokens_AxK, out.probs_AxK, out.support_AxK, out.lens_A, source_A)
        held = (self._ahead.take(slots, max_tokens_A, sl, *outs) if self._ahead.any()
                else None)
        if held is None or not held.any():
            self._draft_rows(slots, max_tokens_A, outs, sl.ctx_len, sl.lag)
        elif not held.all():          # the rows without a draft made ahead
            miss = np.flatnonzero(~held)
            part = DraftBatch.empty(miss.shape[0], out.width)
            parts = (part.tokens_AxK, part.probs_AxK, part.support_AxK, part.lens_A,
                     np.full(miss.shape[0], -1, np.int8))
            self._draft_rows(slots[miss], max_tokens_A[miss], parts, sl.ctx_len, sl.lag)
            for o, p in zip(outs, parts):
                o[miss] = p
        np.greater(out.lens_A, 0, out=out.has_support_A)
        age_A = (self.history.policy_version - sl.mean_version[slots]).astype(np.float32)
        return DraftBatch(out.tokens_AxK, out.probs_AxK, out.support_AxK, out.lens_A,
                          out.has_support_A, age_A, source_A)

    def _draft_rows(self, slots: np.ndarray, max_tokens_A: np.ndarray, outs: tuple,
                    ctx_len: np.ndarray, lag: np.ndarray) -> None:
        """Row b's draft for slot slots[b] (budget max_tokens_A[b]) into outs (tokens_AxK,
        probs_AxK, support_AxK, lens_A, source_A), each slot's context of ctx_len[s] tokens,
        lag[s] of them not yet indexed (int64 arrays over the slots)."""
        A = slots.shape[0]
        cfg, sl, forests = self.config, self._slots, self._forests()
        gf, rfs = self.scope_forest, self.request_forests
        g_root = self._global_root if self._global_seqs else -1

        def run(key, rows_slots, rows_max, lo, hi, outs):
            """Rows lo..hi-1, whose problem tries are in forest key // len(rfs) and request
            tries in request forest key % len(rfs)."""
            f, rf = forests[key // len(rfs)], rfs[key % len(rfs)]
            BK.propose_rows(f.nodes, f.ht, f.seqs, f.toks, f.act, f.meta, rows_slots, rows_max,
                            sl.root, sl.sid, lag, sl.pool, sl.ctx_start, ctx_len,
                            float(cfg.min_token_prob), float(cfg.max_spec_factor),
                            float(cfg.max_spec_offset), int(cfg.min_match_len), lo, hi, *outs,
                            rf.nodes, rf.ht, rf.seqs, rf.toks, rf.act, rf.meta, sl.rroot,
                            sl.rsid, gf.nodes, gf.ht, gf.seqs, gf.toks, gf.act, gf.meta, g_root,
                            float(self.global_below), float(self.request_below))
        if len(forests) == 1 and len(rfs) == 1:
            run(0, slots, max_tokens_A, 0, A, outs)
            return
        # Rows sorted by their forests, then cut into `threads` runs of equal size, one per
        # thread: the propose only reads the forests, so a thread may draft rows of any shard
        # (each maximal run of rows with the same forests in one kernel call).
        key_A = sl.shard[slots] * len(rfs) + sl.rshard[slots]
        order = np.argsort(key_A, kind="stable")
        parts = self.threads if A // self.threads >= _MIN_ROWS_PER_THREAD else 1
        tmp = DraftBatch.empty(A, outs[0].shape[1])
        touts = (tmp.tokens_AxK, tmp.probs_AxK, tmp.support_AxK, tmp.lens_A,
                 np.full(A, -1, np.int8))
        s_sorted, m_sorted, k_sorted = slots[order], max_tokens_A[order], key_A[order]
        cuts = [A * i // parts for i in range(parts + 1)]
        self._run_groups([functools.partial(self._propose_runs, run, s_sorted, m_sorted,
                                            k_sorted, lo, hi, touts)
                          for lo, hi in zip(cuts[:-1], cuts[1:])])
        for o, t in zip(outs, touts):
            o[order] = t

    @staticmethod
    def _propose_runs(run, slots, max_tokens, key, lo, hi, outs) -> None:
        """`run` over rows lo..hi-1, a call per maximal run of rows with the same `key`."""
        b = lo
        while b < hi:
            e = b + 1
            while e < hi and key[e] == key[b]:
                e += 1
            run(int(key[b]), slots, max_tokens, b, e, outs)
            b = e

    def _append_slots(self, slots: np.ndarray, tokens_AxW: np.ndarray, n_A: np.ndarray,
                      mode: int = BK.INDEX | BK.CONTEXT, request_trie: bool = True) -> None:
        """Appends row b's n_A[b] tokens to slot slots[b]: with `mode` CONTEXT to its context,
        with INDEX into its problem trie and (`request_trie`, with the request scope on) its
        request trie."""
        forests, rfs, sl = self._forests(), self.request_forests, self._slots
        scoped = bool(mode & BK.INDEX) and "request" in self.scopes and request_trie
        if len(forests) == 1 and len(rfs) == 1:
            self._append_on(forests[0], slots, tokens_AxW, n_A, mode)
            if scoped:
                self._append_on(rfs[0], slots, tokens_AxW, n_A, BK.INDEX, sl.rsid)
            return
        # Sharded: the contexts first (the slots' shared pool, this thread), then job k
        # indexes the rows of shard k into its problem forest and those whose request trie is
        # in request forest k into that one: a job per thread on a large step, each touching
        # only its own forests.
        if mode & BK.CONTEXT:
            self._append_on(forests[0], slots, tokens_AxW, n_A, BK.CONTEXT)
        if not mode & BK.INDEX:
            return
        shard_A, rshard_A = sl.shard[slots], sl.rshard[slots]
        jobs = []
        for k in range(max(len(forests), len(rfs))):
            parts = []
            if k < len(forests) and (rows := np.flatnonzero(shard_A == k)).size:
                parts.append((forests[k], rows, sl.sid))
            if scoped and k < len(rfs) and (rows := np.flatnonzero(rshard_A == k)).size:
                parts.append((rfs[k], rows, sl.rsid))
            if parts:
                jobs.append(functools.partial(self._append_parts, slots, tokens_AxW, n_A, parts))
        if slots.shape[0] // self.threads >= _MIN_APPEND_ROWS_PER_THREAD:
            self._run_groups(jobs)
        else:
            for job in jobs:
                job()

    def _append_parts(self, slots, tokens_AxW, n_A, parts) -> None:
        """`_append_on` (mode INDEX) of rows `rows` on forest f into sequences sid, for each
        (f, rows, sid) of `parts` in order."""
        for f, rows, sid in parts:
            self._append_on(f, slots[rows], tokens_AxW[rows], n_A[rows], BK.INDEX, sid)

    def _append_on(self, f: SuffixForest, slots: np.ndarray, tokens_AxW: np.ndarray,
                   n_A: np.ndarray, mode: int, sid: np.ndarray | None = None) -> None:
        """`BK.append_rows` of these rows on forest `f` (indexing into the slots' sequences
        `sid`, int64 [S]: default their problem sequences), growing what it asks for."""
        sl = self._slots
        sid = sl.sid if sid is None else sid
        row, off = 0, 0
        while True:
            row, off, rc = BK.append_rows(f.nodes, f.ht, f.seqs, f.toks, f.act, f.meta, slots,
                                          tokens_AxW, n_A, sid, sl.pool, sl.ctx_start,
                                          sl.ctx_len, sl.ctx_cap, sl.out_len, row, off, mode)
            if rc == BK.RC_DONE:
                break
            s = int(slots[row])
            if rc == BK.RC_CONTEXT:
                sl.reserve(s, int(sl.ctx_len[s]) + int(n_A[row]))
            else:
                f.make_room(int(rc), int(sid[s]), min(int(n_A[row]) - int(off), BK.CHUNK))
        if slots.shape[0] and mode & BK.INDEX:
            f.count_indexed(n_A[(n_A > 0) & (sid[slots] >= 0)].sum())

    def _sync_slots(self):
        """Every active request's trie root and own sequence from the history (after the window
        slid or problems were dropped: a live rollout may lose both)."""
        sl = self._slots
        for req in self._requests.values():
            sl.root[req.slot] = self.history.root(req.problem_id)
            sl.sid[req.slot] = self.history.rollout(req.handle).sid
            sl.shard[req.slot] = self._shard(req.problem_id)
            sl.mean_version[req.slot] = self.history.mean_version(req.problem_id)
        self._ahead.void()

    def __getstate__(self):
        self.flush_appends()
        state = self.__dict__.copy()
        state["_executor"] = None       # threads do not pickle; a new pool starts on demand
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("_deferred", [])
        self.__dict__.setdefault("_ended_tries", [])
        self.__dict__.setdefault("request_below", 4.0)    # pickled before it existed
        self.__dict__.setdefault("_ahead", AheadDrafts())
        if "scope_forest" not in state:     # pickled before scopes: the problem scope only
            self.scopes, self.global_rollouts, self.global_below = ("problem",), 1024, 2.0
            self._init_scopes()
        elif "request_forests" not in state:    # before request forests: in the scope forest
            self.request_forests = [self.scope_forest]
        if not hasattr(self._slots, "rshard"):
            self._slots.rshard = np.zeros_like(self._slots.root)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        self.flush_appends()
        self._index_global()
        for req in self._requests.values():        # live output lengths back to the history
            self.history.rollout(req.handle).out_len = int(self._slots.out_len[req.slot])
        sl = self._slots
        # sharded request forests: each request's forest too, and the forests (one forest:
        # the requests' tries are in the scope forest, as before request forests existed)
        sharded = len(self.request_forests) > 1
        state = {"kind": "suffix", "history": self.history.state_dict(),
                 "requests": [[rid, r.problem_id, r.handle, sl.context(r.slot).copy(),
                               int(sl.rroot[r.slot]), int(sl.rsid[r.slot])]
                              + ([int(sl.rshard[r.slot])] if sharded else [])
                              for rid, r in self._requests.items()],
                 "scopes": list(self.scopes), "global_rollouts": self.global_rollouts,
                 "global_below": self.global_below, "request_below": self.request_below,
                 "scope_forest": self.scope_forest.state_dict(),
                 "global_root": self._global_root, "global_seqs": list(self._global_seqs),
                 "global_pending": [t.copy() for t in self._global_pending]}
        if sharded:
            state["request_forests"] = [f.state_dict() for f in self.request_forests]
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "suffix":
            raise ValueError(f"not a suffix drafter state: {state.get('kind')!r}")
        hs = state["history"]
        if ("shards" in hs) != isinstance(self.history, ShardedHistory):   # the state's layout
            self.history = (ShardedHistory(self.config, shards=len(hs["shards"]))
                            if "shards" in hs else ProblemHistory(self.config))
        self.history.load_state_dict(hs)
        self.config = self.history.config
        self._requests, self._slots, self._deferred = {}, RequestSlots(), []
        self._ahead = AheadDrafts()
        # the state's scopes (one saved before scopes existed: the problem scope only)
        self.scopes = tuple(state.get("scopes", ("problem",)))
        self.global_rollouts = int(state.get("global_rollouts", self.global_rollouts))
        self.global_below = float(state.get("global_below", self.global_below))
        self.request_below = float(state.get("request_below", self.request_below))
        self._init_scopes()
        if "scope_forest" in state:
            self.scope_forest.load_state_dict(state["scope_forest"])
            self._global_root = int(state["global_root"])
            self._global_seqs = collections.deque(int(x) for x in state["global_seqs"])
            self._global_pending = [np.asarray(t, np.int32) for t in state["global_pending"]]
            self._global_head = 0
            self.request_forests = [self.scope_forest]
            if "request_forests" in state:
                self.request_forests = [SuffixForest(self.config)
                                        for _ in state["request_forests"]]
                for f, fs in zip(self.request_forests, state["request_forests"]):
                    f.load_state_dict(fs)
        for rid, pid, handle, ctx, *rtrie in state["requests"]:
            s = self._slots.add(rid, ctx)
            self._slots.out_len[s] = self.history.rollout(handle).out_len
            if rtrie:       # (root, sid) in the scope forest, or (root, sid, request forest)
                self._slots.rroot[s], self._slots.rsid[s] = rtrie[:2]
                self._slots.rshard[s] = rtrie[2] if len(rtrie) > 2 else 0
            self._requests[rid] = _Active(pid, handle, s)
        self._sync_slots()


_GLOBAL = "__global__"


class GlobalSuffixDrafter:
    """SuffixDecoding-style baseline: global trie (all problems) + per-request trie.

    Same arguments and errors as `SuffixDrafter`. The per-request trie indexes the full prompt
    and the request's output; the draft with the higher score (sum of path probabilities) wins,
    ties going to the longer match, then to the global trie.
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(), window: int = 16,
                 prompt_tail: int | None = None):
        self.forest = SuffixForest(config)
        self.config = config
        self.history = ProblemHistory(config, window, prompt_tail, forest=self.forest)
        self._requests: dict[int, _Request] = {}

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already active")
        handle = self.history.start_rollout(_GLOBAL, prompt_ids)
        root = self.forest.new_tree()
        sid = self.forest.new_seq(root)
        self.forest.append(sid, prompt_ids)
        self._requests[request_id] = _Request(problem_id, handle, RequestContext(prompt_ids),
                                              root, sid)

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        req = self._requests[request_id]
        ctx = req.context.array
        g = self.history.propose(_GLOBAL, ctx, max_tokens, req.handle)
        loc = self.forest.propose(req.local_root, ctx, max_tokens, req.local_sid)
        if (loc.score, loc.match_len) > (g.score, g.match_len):
            return loc.draft
        return g.draft

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        req = self._requests[request_id]
        arr = np.asarray(token_ids, np.int32).reshape(-1)
        req.context.extend(arr)
        self.history.extend_rollout(req.handle, arr)
        self.forest.append(req.local_sid, arr)

    def end(self, request_id: int) -> None:
        req = self._requests.pop(request_id)
        self.history.finish_rollout(req.handle)
        self.forest.remove(req.local_sid)
        self.forest.drop_tree(req.local_root)

    def advance_epoch(self) -> None:
        self.history.advance_epoch()

    def lengths(self, problem_id: Hashable) -> list[int]:
        """Not tracked per problem by this baseline: always []."""
        return []

    def state_dict(self) -> dict:
        return {"kind": "suffix-global", "history": self.history.state_dict(),
                "requests": [[rid, r.problem_id, r.handle, r.context.array.copy(), r.local_root,
                              r.local_sid] for rid, r in self._requests.items()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "suffix-global":
            raise ValueError(f"not a suffix-global drafter state: {state.get('kind')!r}")
        self.history.load_state_dict(state["history"])     # restores the shared forest
        self._requests = {rid: _Request(pid, h, RequestContext(ctx), root, sid)
                          for rid, pid, h, ctx, root, sid in state["requests"]}
