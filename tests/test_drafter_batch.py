"""SuffixDrafter.propose_batch / append_batch: equal, row by row, to the per-row calls of a
reference drafter (per-problem history + full per-request contexts, driven one row at a time);
LockedDrafter forwarding; edge cases."""
import pickle

import numpy as np
import pytest

from das_jax.drafter import (DraftBatch, NgramDrafter, ProblemHistory, RequestContext,
                             ShardedHistory, SuffixDrafter, SuffixTreeConfig, append_batch,
                             propose_batch)
from das_jax.drafter import suffix_drafter
from das_jax.drafter.suffix_drafter import GLOBAL_INDEX_RATE, SCOPES
from das_jax.drafter.suffix_tree import SuffixForest
from das_jax.rollout.multi_device import LockedDrafter

CFG = SuffixTreeConfig(max_depth=8)


class RowDrafter:
    """The per-row reference: a ProblemHistory plus each request's full context, and with the
    request / global scopes a per-request SuffixTree-like trie and a global trie of finished
    rollouts in one scope forest; the best-scoring draft wins, ties to the earlier scope."""

    def __init__(self, config, window, prompt_tail=None, max_problems=None,
                 scopes=("problem",), global_rollouts=1024, global_below=2.0,
                 request_below=4.0):
        self.history = ProblemHistory(config, window, prompt_tail, max_problems)
        self.requests = {}       # rid -> [pid, handle, context, prompt_len, rroot, rsid]
        self.pending = []        # (rid, tokens) in the context, not yet in the history
        self.scopes, self.global_rollouts = tuple(scopes), global_rollouts
        self.global_below, self.request_below = global_below, request_below
        self.scope = SuffixForest(config)
        self.groot = self.scope.new_tree() if "global" in self.scopes else -1
        self.gseqs, self.gpending = [], []
        self.ghead = 0           # tokens of gpending[0] in the global trie (its sid: gseqs[-1])
        self.appended = 0        # tokens appended since the last full flush
        self.ended = []          # (rsid, rroot) of ended requests, removed at the next full flush

    def append_context(self, rid, toks):
        """`append_batch(..., index_later=True)`: the context now, the history at `flush`."""
        self.requests[rid][2].extend(np.asarray(toks, np.int32))
        self.pending.append((rid, np.asarray(toks, np.int32)))
        self.appended += len(toks)

    def _index(self, rid, toks, request_trie=True):
        req = self.requests[rid]
        self.history.extend_rollout(req[1], toks)
        if req[5] >= 0 and request_trie:
            self.scope.append(req[5], toks)

    def index_global(self, budget=None):
        """Finished rollouts into the global trie, token by token in order, up to `budget`
        tokens (None: all)."""
        while self.gpending and (budget is None or budget > 0):
            toks = self.gpending[0]
            if self.ghead == 0:
                self.gseqs.append(self.scope.new_seq(self.groot))
            take = len(toks) - self.ghead if budget is None else min(len(toks) - self.ghead,
                                                                     budget)
            self.scope.append(self.gseqs[-1], toks[self.ghead:self.ghead + take])
            self.ghead += take
            budget = None if budget is None else budget - take
            if self.ghead == len(toks):
                self.scope.freeze(self.gseqs[-1])
                self.gpending.pop(0)
                self.ghead = 0
        while len(self.gseqs) > self.global_rollouts:
            self.scope.remove(self.gseqs.pop(0))

    def flush(self, rid=None, request_trie=True):
        if rid is None:
            for rsid, rroot in self.ended:
                self.scope.remove(rsid)
                self.scope.drop_tree(rroot)
            self.ended = []
            # at most GLOBAL_INDEX_RATE x the tokens appended since the last full flush
            if self.gpending:
                self.index_global(GLOBAL_INDEX_RATE * self.appended)
            self.appended = 0
        keep = []
        for r, toks in self.pending:
            if rid is None or r == rid:
                self._index(r, toks, request_trie)
            else:
                keep.append((r, toks))
        self.pending = keep

    def begin(self, rid, pid, prompt):
        if rid in self.requests:
            raise ValueError(rid)
        rroot = rsid = -1
        if "request" in self.scopes:
            rroot = self.scope.new_tree()
            rsid = self.scope.new_seq(rroot)
            self.scope.append(rsid, np.asarray(prompt, np.int32))
        self.requests[rid] = [pid, self.history.start_rollout(pid, prompt),
                              RequestContext(prompt), len(prompt), rroot, rsid]

    def propose(self, rid, k):
        pid, handle, ctx, _, rroot, rsid = self.requests[rid]
        best = self.history.propose(pid, ctx.array, k, handle)
        for root, own, below in ((rroot, rsid, self.request_below),
                                 (self.groot if self.gseqs else -1, -1, self.global_below)):
            if best.score >= below:
                continue            # searched only for rows whose draft so far scores below
            if root >= 0:
                x = self.scope.propose(root, ctx.array, k, own)
                if len(x.draft) and x.score > best.score:
                    best = x
        return best.draft

    def append(self, rid, toks, flush=True):
        """`SuffixDrafter.append` (a full flush first; `flush` False: one row of a batched
        `append_batch`, which flushes once before its rows)."""
        if flush:
            self.flush()
        arr = np.asarray(toks, np.int32)
        if not len(arr):
            return
        self.requests[rid][2].extend(arr)
        self._index(rid, arr)
        self.appended += len(arr)

    def end(self, rid):
        self.flush(rid, request_trie=False)     # its request trie is dropped: not indexed
        pid, handle, ctx, prompt_len, rroot, rsid = self.requests.pop(rid)
        self.history.finish_rollout(handle)
        if rsid >= 0:
            self.ended.append((rsid, rroot))
        out_len = len(ctx.array) - prompt_len
        if self.groot >= 0 and out_len:
            start = max(0, prompt_len - self.history.prompt_tail)
            self.gpending.append(ctx.array[start:].copy())

    def advance_epoch(self):
        self.flush()
        self.index_global()
        self.history.advance_epoch()

    def state_dict(self):
        self.flush()
        self.index_global()
        return {"kind": "suffix", "history": self.history.state_dict(),
                "requests": [[rid, pid, h, ctx.array.copy(), rroot, rsid]
                             for rid, (pid, h, ctx, _, rroot, rsid) in self.requests.items()],
                "scopes": list(self.scopes), "global_rollouts": self.global_rollouts,
                "global_below": self.global_below, "request_below": self.request_below,
                "scope_forest": self.scope.state_dict(), "global_root": self.groot,
                "global_seqs": list(self.gseqs), "global_pending": list(self.gpending)}

    def load_state_dict(self, state):
        self.history.load_state_dict(state["history"])
        self.requests = {}
        for rid, pid, h, ctx, rroot, rsid in state["requests"]:
            out_len = self.history.rollout(h).out_len
            self.requests[rid] = [pid, h, RequestContext(ctx), len(ctx) - out_len, rroot, rsid]
        self.scope.load_state_dict(state["scope_forest"])
        self.groot, self.gseqs = state["global_root"], list(state["global_seqs"])
        self.gpending = list(state["global_pending"])
        self.ghead = self.appended = 0


def assert_same_state(a, b, where="state"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
        assert a.dtype == np.asarray(b).dtype, where
    else:
        assert a == b, where


def assert_batch_matches(batch, ref, ids, max_tokens_A):
    K = int(max(max_tokens_A, default=0))
    assert batch.tokens_AxK.shape == batch.probs_AxK.shape == batch.support_AxK.shape \
        == (len(ids), K)
    assert (batch.tokens_AxK.dtype, batch.probs_AxK.dtype, batch.support_AxK.dtype,
            batch.lens_A.dtype, batch.has_support_A.dtype) == (
        np.int32, np.float32, np.int32, np.int32, np.bool_)
    for b, (rid, k) in enumerate(zip(ids, max_tokens_A)):
        d = ref.propose(int(rid), int(k))
        n = len(d)
        assert batch.lens_A[b] == n, (b, rid)
        np.testing.assert_array_equal(batch.tokens_AxK[b, :n], d.tokens)
        np.testing.assert_array_equal(batch.probs_AxK[b, :n], d.probs)
        assert batch.has_support_A[b] == (d.support is not None and n > 0)
        if d.support is not None:
            np.testing.assert_array_equal(batch.support_AxK[b, :n], d.support)
        assert not batch.tokens_AxK[b, n:].any() and not batch.probs_AxK[b, n:].any()
        assert not batch.support_AxK[b, n:].any()


def _scenario(seed, threads, window, max_problems=None, steps=120, reload_at=60, cfg=CFG,
              prompt_tail=None, deferred=False, scopes=("problem",), global_rollouts=1024,
              global_below=2.0, request_below=4.0):
    """Random begin / propose / append / end / advance_epoch traffic on a batched drafter and
    the per-row reference; every step's drafts and periodic states are compared. `deferred`:
    batched appends mostly index their tokens later (`index_later`, flushed at random points,
    as the scheduler does while the device computes), the reference's history lagging the
    same way."""
    rng = np.random.default_rng(seed)
    vocab, problems = 5, 6
    kw = dict(scopes=scopes, global_rollouts=global_rollouts, global_below=global_below,
              request_below=request_below)
    d = SuffixDrafter(cfg, window=window, prompt_tail=prompt_tail, max_problems=max_problems,
                      threads=threads, **kw)
    ref = RowDrafter(cfg, window, prompt_tail, max_problems=max_problems, **kw)
    live, next_id = [], 0
    stats = {"drafted": 0, "unindexed": 0, "lagging": 0}
    for step in range(steps):
        if deferred and rng.random() < 0.5:
            d.flush_appends()
            ref.flush()
        for _ in range(rng.integers(0, 4) if len(live) < 48 else 0):
            rid = next_id if rng.random() < 0.8 else 10**9 + next_id   # outside the id table
            next_id += 1
            pid = int(rng.integers(problems))
            prompt = rng.integers(0, vocab, size=int(rng.integers(0, 12))).tolist()
            d.begin(rid, pid, prompt)
            ref.begin(rid, pid, prompt)
            live.append(rid)
        if live:
            ids = rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]
            max_tokens_A = rng.integers(0, 10, size=len(ids)).astype(np.int32)
            batch = d.propose_batch(ids, max_tokens_A)
            assert_batch_matches(batch, ref, ids, max_tokens_A)
            stats["lagging"] += sum(r in {p for p, _ in ref.pending} for r in ids.tolist())
            stats["drafted"] += int(batch.lens_A.sum())
            stats["unindexed"] += sum(ref.history.rollout(ref.requests[int(r)][1]).sid < 0
                                      for r in ids)
            rid = int(rng.choice(live))
            a, r = d.propose(rid, 6), ref.propose(rid, 6)
            assert a.tokens.tolist() == r.tokens.tolist()
            np.testing.assert_array_equal(a.probs, r.probs)
            assert (a.support is None) == (r.support is None)
            # appends: batched (duplicate rows now and then, a long row past the chunk size)
            ids = rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]
            if rng.random() < 0.2:
                ids = np.concatenate([ids, ids[:2]])
            W = 300 if rng.random() < 0.05 else int(rng.integers(1, 6))
            toks = rng.integers(0, vocab, size=(len(ids), W)).astype(np.int32)
            n_A = rng.integers(0, W + 1, size=len(ids)).astype(np.int32)
            if deferred and rng.random() < 0.8:
                d.append_batch(ids, toks, n_A, index_later=True)
                for rid, row, n in zip(ids, toks, n_A):
                    if n:
                        ref.append_context(int(rid), row[:n])
            elif rng.random() < 0.8:
                d.append_batch(ids, toks, n_A)
                ref.flush()
                for rid, row, n in zip(ids, toks, n_A):
                    ref.append(int(rid), row[:n], flush=False)
            else:
                for rid, row, n in zip(ids, toks, n_A):
                    d.append(int(rid), row[:n])
                    ref.append(int(rid), row[:n])
        for rid in list(live):
            if rng.random() < 0.08:
                d.end(rid)
                ref.end(rid)
                live.remove(rid)
        if rng.random() < 0.1:
            d.advance_epoch()
            ref.advance_epoch()
        if (step % 20 == 0 or step == steps - 1) and threads == 1:   # sharded: other layout
            assert_same_state(d.state_dict(), ref.state_dict())
            for pid in range(problems):
                assert d.lengths(pid) == ref.history.lengths(pid)
        if step == reload_at:
            d2 = SuffixDrafter(cfg, window=window, prompt_tail=prompt_tail,
                               max_problems=max_problems, threads=threads, **kw)
            d2.load_state_dict(pickle.loads(pickle.dumps(d.state_dict())))
            ref2 = RowDrafter(cfg, window, prompt_tail, max_problems=max_problems, **kw)
            ref2.load_state_dict(pickle.loads(pickle.dumps(ref.state_dict())))
            d, ref = d2, ref2       # (a loaded forest lays out its storage anew: reload both)
    return stats


SCOPE_CASES = [pytest.param(("problem",), 1024, 2.0, 4.0, id="problem"),
               pytest.param(SCOPES, 1024, 2.0, 4.0, id="all-scopes"),
               pytest.param(SCOPES, 1024, 0.0, float("inf"), id="request-always"),
               pytest.param(SCOPES, 1024, float("inf"), 0.5, id="request-below-0.5"),
               pytest.param(("problem", "global"), 3, float("inf"), 4.0, id="global-3")]
# (global-3: FIFO drops)


@pytest.mark.parametrize("scopes,global_rollouts,global_below,request_below", SCOPE_CASES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed,window,max_problems", [(0, 1, None), (1, 0, None), (2, 2, 3)])
def test_batch_equals_per_row_reference(monkeypatch, seed, threads, window, max_problems,
                                        scopes, global_rollouts, global_below,
                                        request_below):
    monkeypatch.setattr(suffix_drafter, "_MIN_ROWS_PER_THREAD", 2)   # split even small batches
    stats = _scenario(seed, threads, window, max_problems, scopes=scopes,
                      global_rollouts=global_rollouts, global_below=global_below,
                      request_below=request_below)
    assert stats["drafted"] > 500 and stats["unindexed"] > 50, stats


@pytest.mark.parametrize("scopes,global_rollouts,global_below,request_below", SCOPE_CASES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed,window,max_problems", [(4, 1, None), (5, 2, 3)])
def test_deferred_appends_draft_from_the_trie_one_flush_behind(monkeypatch, seed, threads,
                                                               window, max_problems, scopes,
                                                               global_rollouts, global_below,
                                                               request_below):
    """`append_batch(..., index_later=True)`: contexts take the tokens at once, the trie at
    `flush_appends` (or at any call that needs it: `end` its request's, `append`,
    `advance_epoch`, `state_dict`; not a new problem's `begin`); drafts meanwhile equal the
    reference's from its full context on a history without the deferred tokens; states equal
    after each flush."""
    monkeypatch.setattr(suffix_drafter, "_MIN_ROWS_PER_THREAD", 2)
    stats = _scenario(seed, threads, window, max_problems, deferred=True, scopes=scopes,
                      global_rollouts=global_rollouts, global_below=global_below,
                      request_below=request_below)
    assert stats["drafted"] > 500 and stats["lagging"] > 50, stats


@pytest.mark.parametrize("cfg,prompt_tail", [
    (SuffixTreeConfig(max_depth=12, min_token_prob=0.0, max_spec_factor=2.0), 2),
    (SuffixTreeConfig(max_depth=6, min_token_prob=0.3, max_spec_offset=1.5, min_match_len=2), 0),
    (SuffixTreeConfig(max_depth=10, max_spec_factor=0.5, max_spec_offset=2.0), 20)])
def test_batch_equals_per_row_reference_other_configs(cfg, prompt_tail):
    """Draft limits, probability cut-offs and prompt tails shorter than a match (tails longer
    than the own sequence are looked up from the root)."""
    stats = _scenario(3, 1, 1, cfg=cfg, prompt_tail=prompt_tail, steps=80, reload_at=40,
                      scopes=SCOPES)
    assert stats["drafted"] > 200, stats


def test_threads_draft_and_append_like_one_thread_on_many_rows():
    """Steps of 200 live rows on 2 and 3 threads (the rows' drafts split over the threads, their
    appends a job per shard: its problem forest and its request forest): drafts equal one
    thread's at every step, appends indexed now or deferred, requests ending between steps."""
    rng = np.random.default_rng(5)
    drafters = [SuffixDrafter(CFG, window=2, threads=t) for t in (1, 2, 3)]
    n = 210         # 200 live rows: a share on each of 3 threads (`_MIN_ROWS_PER_THREAD`)
    for rid in range(n):
        prompt = rng.integers(0, 6, size=5).tolist()
        out = rng.integers(0, 6, size=40).astype(np.int32)
        for d in drafters:
            d.begin(rid, rid % 7, prompt)
            d.append(rid, out)
    for d in drafters:              # finished rollouts for the global trie
        for rid in range(n - 10, n):
            d.end(rid)
        d.flush_appends()
    live = np.arange(n - 10)
    drafted = 0
    for step in range(4):
        ids = rng.permutation(live)
        max_tokens_A = rng.integers(0, 8, size=ids.size).astype(np.int32)
        a, b, c = (d.propose_batch(ids, max_tokens_A) for d in drafters)
        drafted += int(a.lens_A.sum())
        for x in (b, c):
            for f in ("tokens_AxK", "probs_AxK", "support_AxK", "lens_A", "has_support_A",
                      "source_A"):
                np.testing.assert_array_equal(getattr(a, f), getattr(x, f))
        toks = rng.integers(0, 6, size=(ids.size, 5)).astype(np.int32)
        n_A = rng.integers(0, 6, size=ids.size).astype(np.int32)
        for d in drafters:
            d.append_batch(ids, toks, n_A, index_later=step % 2 == 1)
            if step == 2:
                d.end(int(live[0]))
            d.flush_appends()
        live = live[1:] if step == 2 else live
    assert drafted > 1000
    assert all(d._executor is not None for d in drafters[1:])    # the threads did run
    two = drafters[1]
    assert len(two.request_forests) == 2
    assert all(f is not two.scope_forest for f in two.request_forests)
    assert all(f.num_nodes > 1000 for f in two.request_forests)     # both shards' requests
    assert drafters[0].request_forests == [drafters[0].scope_forest]
    d = pickle.loads(pickle.dumps(two))      # the worker pool does not travel
    ids = rng.permutation(live)
    max_tokens_A = np.full(ids.size, 6, np.int32)
    np.testing.assert_array_equal(d.propose_batch(ids, max_tokens_A).tokens_AxK,
                                  drafters[0].propose_batch(ids, max_tokens_A).tokens_AxK)


def test_edge_cases():
    d = SuffixDrafter(CFG, window=0, scopes=("problem",))
    empty = d.propose_batch(np.zeros(0, np.int64), np.zeros(0, np.int32))
    assert empty.tokens_AxK.shape == (0, 0) and empty.lens_A.shape == (0,)
    d.append_batch(np.zeros(0, np.int64), np.zeros((0, 0), np.int32), np.zeros(0, np.int32))
    d.begin(3, "p", [1, 2, 1, 2])
    d.begin(4, "p", [1, 2, 1, 2])
    with pytest.raises(ValueError):
        d.begin(3, "p", [1])
    d.append_batch([3, 4], np.array([[1, 2, 0], [1, 2, 1]], np.int32), [2, 3])
    zero = d.propose_batch([3, 4], [0, 0])
    assert zero.tokens_AxK.shape == (2, 0) and not zero.lens_A.any()
    assert not zero.has_support_A.any()
    got = d.propose_batch([3, 4], [4, 0])
    assert got.width == 4 and got.lens_A[0] > 0 and got.lens_A[1] == 0
    assert got.has_support_A.tolist() == [True, False]
    with pytest.raises(KeyError):
        d.propose_batch([3, 5], [1, 1])
    with pytest.raises(KeyError):
        d.append_batch([5], np.ones((1, 1), np.int32), [1])
    with pytest.raises(KeyError):
        d.propose(5, 2)
    d.advance_epoch()                       # window 0: the problem is dropped while 3, 4 live
    assert d.history.root("p") < 0
    got = d.propose_batch([3, 4], [4, 4])   # unknown problem: empty drafts
    assert not got.lens_A.any() and got.width == 4
    d.append_batch([3], np.array([[1, 2]], np.int32), [2])
    d.begin(6, "p", [1, 2, 1, 2, 1])        # the problem comes back: 3 drafts from it again
    d.append(6, [2, 1, 2, 1, 2])
    assert d.propose_batch([3], [3]).lens_A[0] > 0
    assert d.context(3).tolist() == [1, 2, 1, 2, 1, 2, 1, 2]


def test_locked_drafter_forwards_batches_with_id_mapping():
    d = SuffixDrafter(CFG, window=1)
    ref = RowDrafter(CFG, 1, scopes=SCOPES)
    view = LockedDrafter(d).view([5, 7, 9])
    for local, rid in enumerate((5, 7, 9)):
        view.begin(local, "p", [1, 2, 3])
        ref.begin(rid, "p", [1, 2, 3])
    toks = np.array([[1, 2, 3, 1], [2, 3, 1, 2], [3, 1, 2, 3]], np.int32)
    view.append_batch(np.array([2, 0, 1]), toks, np.array([4, 3, 0], np.int32))
    ref.append(9, toks[0])
    ref.append(5, toks[1, :3])
    assert_same_state(d.state_dict(), ref.state_dict())
    got = propose_batch(view, [1, 2, 0], [3, 2, 4])
    assert_batch_matches(got, ref, [7, 9, 5], [3, 2, 4])
    assert got.lens_A.sum() > 0

    ng = NgramDrafter()                     # no batch calls: the per-row fallback under the lock
    nview = LockedDrafter(ng).view([10, 11])
    nview.begin(0, "p", [1, 2, 3, 1, 2])
    nview.begin(1, "p", [4, 5])
    append_batch(nview, [0, 1], np.array([[3, 0], [4, 5]], np.int32), [1, 2])
    assert ng._contexts[10].array.tolist() == [1, 2, 3, 1, 2, 3]
    got = nview.propose_batch([0, 1], [2, 2])
    assert isinstance(got, DraftBatch)
    assert got.row(0).tokens.tolist() == ng.propose(10, 2).tokens.tolist()
    assert got.row(1).tokens.tolist() == ng.propose(11, 2).tokens.tolist()


def test_threads_shard_the_history_by_problem_and_states_load_across_layouts():
    """`threads` > 1 shards the history: each problem's trie in one shard's forest (round-robin
    in order of first visit), appends of different shards on different threads; drafts equal
    the unsharded drafter's, and a state loads into a drafter of either layout."""
    rng = np.random.default_rng(9)
    one, two = SuffixDrafter(CFG, window=2), SuffixDrafter(CFG, window=2, threads=2)
    for rid in range(12):
        prompt = rng.integers(0, 6, size=5).tolist()
        out = rng.integers(0, 6, size=30).astype(np.int32)
        for d in (one, two):
            d.begin(rid, rid % 6, prompt)
            d.append_batch([rid], out[None], [30])
    shards = two.history.shards
    assert [sorted(h.problems()) for h in shards] == [[0, 2, 4], [1, 3, 5]]
    assert all(h.forest is not shards[0].forest for h in shards[1:])
    ids, k = np.arange(12), np.full(12, 6, np.int32)
    want = one.propose_batch(ids, k)
    assert want.lens_A.sum() > 20
    for d in (two, pickle.loads(pickle.dumps(two))):
        np.testing.assert_array_equal(d.propose_batch(ids, k).tokens_AxK, want.tokens_AxK)
    for src, dst in ((two, SuffixDrafter(CFG, window=2)),
                     (one, SuffixDrafter(CFG, window=2, threads=2))):
        dst.load_state_dict(pickle.loads(pickle.dumps(src.state_dict())))
        np.testing.assert_array_equal(dst.propose_batch(ids, k).tokens_AxK, want.tokens_AxK)
    with pytest.raises(ValueError, match="shards must be >= 1"):
        ShardedHistory(CFG, shards=0)
