"""The two-branch token tree of the packed verify step: a row verifies a second draft beside its
first; the step emits what a step verifying the winning draft alone emits (tokens, log-probs,
counts, cache writes; exact mode: the same bits), never writes the losing branch, and leaves
rows without a second draft as a one-branch step leaves them. Tiny random models, float32,
fixed seeds."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.drafter.base import DraftBatch, pick_rows
from das_jax.engine import reference
from das_jax.engine import step as step_lib
from das_jax.engine.schedule import token_buckets
from das_jax.engine.specs import VerifyBatch, VerifySpec
from das_jax.models import contraction as cx
from das_jax.testing import (AdversaryDrafter, OracleDrafter, kv_by_position, random_kv_cache,
                             tiny_model_config, tiny_params)

CFG = tiny_model_config()
EXACT_CFG = dataclasses.replace(CFG, contraction=cx.EXACT)
SKEY = (0.8, 0, 1.0)
B, W, S, KV_LEN = 7, 8, 256, 128


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def padded(config, params, cache, cache_len, drafts, seeds):
    """The padded reference step with one draft per row (`drafts[b]`: a list of tokens after
    the pending token at column 0 of `pending`)."""
    tokens = np.zeros((B, W), np.int32)
    n = np.zeros(B, np.int32)
    for b, d in enumerate(drafts):
        tokens[b, 0] = PENDING[b]
        tokens[b, 1:1 + len(d)] = d
        n[b] = len(d)
    c = jax.tree_util.tree_map(jnp.copy, cache)
    c, y, lp, ne = reference.verify(config, SKEY, KV_LEN, params, c, cache_len, tokens, n, seeds)
    return c, np.asarray(y), np.asarray(lp), np.asarray(ne)


PENDING = np.array([5, 9, 17, 3, 11, 21, 7], np.int32)


def tree_step(config, params, cache, cache_len, live, a_drafts, b_drafts, seeds, branch_rows,
              width=W):
    n_a = np.array([len(d) for d in a_drafts], np.int32)
    n_b = np.array([len(d) for d in b_drafts], np.int32)
    K = max(1, int(n_a.max()), int(n_b.max()))
    a_AxK = np.zeros((len(live), K), np.int32)
    b_AxK = np.zeros((len(live), K), np.int32)
    for j, b in enumerate(live):
        a_AxK[j, :n_a[b]] = a_drafts[b]
        b_AxK[j, :n_b[b]] = b_drafts[b]
    need = int(sum(1 + n_a[b] + n_b[b] for b in live))
    N = next(n for n in token_buckets(B * width) if n >= need)
    spec = VerifySpec(config, SKEY, B, N, width, cache.max_len, KV_LEN, str(cache.dtype),
                      branch_rows=branch_rows)
    batch = VerifyBatch.pack(spec, cache_len, PENDING, seeds, np.asarray(live), a_AxK, n_a,
                             b_AxK, n_b)
    c = jax.tree_util.tree_map(jnp.copy, cache)
    c, y, lp, ne, feats, won = step_lib.verify_packed(params, c, batch)
    assert feats is None
    return c, np.asarray(y), np.asarray(lp), np.asarray(ne), np.asarray(won)


def make_right(config, params, cache, cache_len, drafts, seeds, first: dict):
    """Sets the first `first[row]` draft tokens of each named row to its targets, in order."""
    for i in range(max(first.values())):
        _, y, _, _ = padded(config, params, cache, cache_len, drafts, seeds)
        for r, k in first.items():
            if i < k:
                drafts[r][i] = y[r, i]


def accepted(draft, y):
    n = 0
    while n < len(draft) and draft[n] == y[n]:
        n += 1
    return n


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_tree_step_emits_what_the_winning_draft_alone_emits(params, exact):
    config = EXACT_CFG if exact else CFG
    rng = np.random.default_rng(0)
    cache = random_kv_cache(CFG, B, S, 1)
    cache_len = rng.integers(1, 120, size=B).astype(np.int32)
    seeds = rng.integers(0, 2**31 - 1, size=B).astype(np.int32)
    V = CFG.vocab_size
    a = [list(rng.integers(0, V, size=k)) for k in (4, 3, 5, 2, 0, 6, 3)]
    b = [list(rng.integers(0, V, size=k)) for k in (3, 5, 2, 0, 4, 2, 0)]
    # Drafts made right where the case needs them (token by token: a target depends on the
    # drafts before it), then each branch's targets alone.
    make_right(config, params, cache, cache_len, a, seeds, {0: 2, 3: 2, 5: 2})
    make_right(config, params, cache, cache_len, b, seeds, {1: 3, 4: 4, 5: 1})
    _, ya, _, _ = padded(config, params, cache, cache_len, a, seeds)
    _, yb, _, _ = padded(config, params, cache, cache_len, b, seeds)
    b[0][0] = (ya[0, 0] + 1) % V          # row 0: A right for 2 tokens, B wrong at once
    a[1][0] = (yb[1, 0] + 1) % V          # row 1: B right for 3 tokens, A wrong
    a[2][0] = (ya[2, 0] + 1) % V          # row 2: both wrong at their first token
    b[2][0] = (yb[2, 0] + 1) % V          # row 3: no branch B; row 4: no branch A
    b[5][1] = (yb[5, 1] + 1) % V          # row 5: both share the first right token, A goes on
    _, ya, _, _ = padded(config, params, cache, cache_len, a, seeds)
    _, yb, _, _ = padded(config, params, cache, cache_len, b, seeds)
    win_b = [accepted(b[r], yb[r]) > accepted(a[r], ya[r]) for r in range(B)]
    assert win_b == [False, True, False, False, True, False, False]
    live = [0, 1, 2, 3, 4, 5]             # row 6: a padding row of the bucket
    winner = [b[r] if win_b[r] else a[r] for r in range(B)]
    c1, y1, l1, e1 = padded(config, params, cache, cache_len, winner, seeds)
    c2, y2, l2, e2, won = tree_step(config, params, cache, cache_len, live, a, b, seeds,
                                    branch_rows=4)
    tol = 0 if exact else 5e-5        # fast mode: the second branch's block sums in another order
    assert [int(e) for e in e1[live]] == [3, 4, 1, 3, 5, 3]
    for r in live:
        assert bool(won[r]) == win_b[r]
        n = int(e1[r])
        assert e2[r] == n
        np.testing.assert_array_equal(y2[r, :n], y1[r, :n])
        np.testing.assert_allclose(l2[r, :n], l1[r, :n], atol=tol, rtol=0)
        lo = int(cache_len[r])
        wrote = slice(lo, lo + 1 + len(winner[r]))           # the root and the winning branch
        loser = len(a[r] if win_b[r] else b[r])
        untouched = slice(lo + 1 + len(winner[r]), lo + 1 + max(loser, len(winner[r])))
        for ref, got, old in zip(kv_by_position(c1), kv_by_position(c2), kv_by_position(cache)):
            np.testing.assert_allclose(got[:, r, :, wrote], ref[:, r, :, wrote], atol=tol, rtol=0)
            np.testing.assert_array_equal(got[:, r, :, untouched], old[:, r, :, untouched])
            np.testing.assert_array_equal(got[:, r, :, :lo], old[:, r, :, :lo])
    for got, old in zip(kv_by_position(c2), kv_by_position(cache)):   # the padding row
        np.testing.assert_array_equal(got[:, 6], old[:, 6])


def test_tree_step_without_second_drafts_is_the_one_branch_step(params):
    """No row with a branch B: the tree program gives the one-branch program's outputs."""
    rng = np.random.default_rng(4)
    cache = random_kv_cache(CFG, B, S, 2)
    cache_len = rng.integers(1, 120, size=B).astype(np.int32)
    seeds = rng.integers(0, 2**31 - 1, size=B).astype(np.int32)
    a = [list(rng.integers(0, CFG.vocab_size, size=k)) for k in (0, 7, 2, 5, 1, 3, 4)]
    _, ya, _, _ = padded(CFG, params, cache, cache_len, a, seeds)
    for r in range(B):
        a[r][:len(a[r]) // 2] = ya[r, :len(a[r]) // 2]
    live = list(range(B))
    c1, y1, l1, e1 = padded(CFG, params, cache, cache_len, a, seeds)
    c2, y2, l2, e2, won = tree_step(CFG, params, cache, cache_len, live, a, [[]] * B, seeds,
                                    branch_rows=2)
    assert not won.any()
    np.testing.assert_array_equal(e2, e1)
    for r in live:
        n = int(e1[r])
        np.testing.assert_array_equal(y2[r, :n], y1[r, :n])
        np.testing.assert_allclose(l2[r, :n], l1[r, :n], atol=1e-5, rtol=0)


def test_tree_spec_dummy_and_abstract_carry_the_second_drafts():
    spec = VerifySpec(CFG, SKEY, 4, 24, 8, 256, 128, "float32", branch_rows=2)
    d = spec.dummy()
    assert d.n_alt_B is not None and d.n_alt_B.shape == (4,)
    assert int(d.n_alt_B.sum()) > 0 and (d.n_alt_B[2:] == 0).all()
    # Every row's slots: 1 + both branches, as the layout placed them.
    rows = np.asarray(d.row_N)
    counts = np.bincount(rows[rows < 4], minlength=4)
    np.testing.assert_array_equal(counts, 1 + d.n_draft_B + d.n_alt_B)
    ab = spec.abstract()
    assert ab.n_alt_B.shape == (4,)
    assert VerifySpec(CFG, SKEY, 4, 24, 8, 256, 128, "float32").abstract().n_alt_B is None


class TwoSourceDrafter:
    """Offers every row two drafts: the recorded continuation (right) and seeded random tokens
    (wrong); the right one is the row's own draft on one step in four (by request and step),
    its `alternative` otherwise; each at most `max_len` tokens; the right one claims path
    probability `right_prob` per token (the wrong one 0.9)."""

    def __init__(self, futures, vocab, seed=0, max_len=None, right_prob=1.0):
        self.oracle = OracleDrafter(futures)
        self.adversary = AdversaryDrafter(vocab, seed)
        self.calls = 0
        self.max_len = max_len
        self.right_prob = right_prob

    def begin(self, request_id, problem_id, prompt_ids):
        self.oracle.begin(request_id, problem_id, prompt_ids)

    def append(self, request_id, token_ids):
        self.oracle.append(request_id, token_ids)

    def end(self, request_id):
        self.oracle.end(request_id)

    def advance_epoch(self):
        pass

    def propose_batch(self, request_ids, max_tokens_A):
        self.calls += 1
        if self.max_len is not None:
            max_tokens_A = np.minimum(max_tokens_A, self.max_len)
        K = int(np.max(max_tokens_A, initial=0))
        right = DraftBatch.from_drafts([self.oracle.propose(int(r), int(k)) if k else None
                                        for r, k in zip(request_ids, max_tokens_A)], K)
        right.probs_AxK[:] = np.where(right.probs_AxK > 0,
                                      self.right_prob ** np.arange(1, K + 1), 0)
        wrong = DraftBatch.from_drafts([self.adversary.propose(int(r), int(k)) if k else None
                                        for r, k in zip(request_ids, max_tokens_A)], K)
        flip = (np.asarray(request_ids) + self.calls) % 4 != 0
        own = pick_rows(right, wrong, flip)
        return dataclasses.replace(own, alternative=pick_rows(wrong, right, flip))


def _exact_runs(params, n, seed, sampling_seed, kv_cache="dense"):
    """(run(**generate kwargs), the plain rollouts, their tokens by request index) of `n`
    random requests on an exact-mode engine of 4 slots, widths 1 / 4 / 8."""
    from das_jax.engine import Engine, EngineConfig, Request, SamplingParams
    rng = np.random.default_rng(seed)
    reqs = [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 20)))),
                    problem_id=f"p{i // 2}", sample_index=i % 2) for i in range(n)]
    sampling = SamplingParams(temperature=0.9, max_new_tokens=24, seed=sampling_seed)

    def run(**kw):
        eng = Engine(EXACT_CFG, params, eos_token_ids=[1], engine_config=EngineConfig(
            max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8), exact=True,
            kv_cache=kv_cache))
        return eng.generate(reqs, sampling, **kw)

    base, _ = run()
    return run, base, {i: o.token_ids for i, o in enumerate(base)}


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_generate_with_a_token_tree_changes_no_token(params, kv_cache):
    """Rollouts that verify a second draft per row (`FixedPolicy(tree=True)`) are the plain
    rollouts token for token and bit for bit (exact mode); the tree accepts the right draft
    whichever branch holds it, so it takes fewer passes than verifying the own draft only."""
    from das_jax.engine import FixedPolicy
    run, base, futures = _exact_runs(params, 8, seed=2, sampling_seed=4, kv_cache=kv_cache)
    tree, s_tree = run(drafter=TwoSourceDrafter(futures, CFG.vocab_size),
                       policy=FixedPolicy(tree=True))
    single, s_single = run(drafter=TwoSourceDrafter(futures, CFG.vocab_size),
                           policy=FixedPolicy())
    for a, b, c in zip(tree, single, base):
        assert a.token_ids == b.token_ids == c.token_ids
        np.testing.assert_array_equal(a.logprobs, c.logprobs)
    # Verifying only the own draft accepts only the rows whose own draft is the right one.
    assert s_tree.tree_steps > 0 and s_tree.second_branch_wins > 0
    assert s_tree.forward_passes < s_single.forward_passes
    assert s_tree.accepted_draft_tokens > s_single.accepted_draft_tokens
    assert s_single.tree_steps == 0 and s_single.second_branch_wins == 0
    tree_steps = [s for s in s_tree.steps if s.branch_rows]
    assert all(s.alt_per_row is not None and len(s.won_per_row) == s.active
               for s in tree_steps)
    assert all(s.drafted >= sum(s.alt_per_row) for s in tree_steps)
    assert s_tree.to_dict()["tree_steps"] == s_tree.tree_steps


def _rows_and_drafts():
    """Three live rows: row 0's two drafts differ at their first token, both confident; row 1's
    second draft starts with its first's token; row 2 has no first draft and a confident
    second one."""
    first = DraftBatch.empty(3, 3)
    first.tokens_AxK[0] = [11, 12, 13]
    first.tokens_AxK[1] = [5, 6, 7]
    first.probs_AxK[:2] = [0.9, 0.85, 0.8]
    first.lens_A[:] = [3, 3, 0]
    other = DraftBatch.empty(3, 4)
    other.tokens_AxK[0] = [21, 22, 23, 24]
    other.tokens_AxK[1] = [5, 9, 9, 9]
    other.tokens_AxK[2] = [31, 32, 33, 34]
    other.probs_AxK[:] = [0.8, 0.7, 0.6, 0.5]
    other.lens_A[:] = [4, 4, 4]
    return first, other


@pytest.mark.parametrize("c_tok, wants", [(1e-4, True), (0.2, False)])
def test_das_second_branch_adds_the_drafts_that_pay(c_tok, wants):
    """`DASPolicy.second_branch` (das.policy.tree) verifies a row's other draft beside its own
    where the two differ at their first token, within the slots the widest width leaves, and
    only where its expected tokens pay for the tree step; off without `tree`."""
    from das_jax.engine import RowView
    from das_jax.engine.schedule import step_shape_fn
    from das_jax.speculation import CostModel, DASConfig, DASPolicy
    rows = [RowView(i, "p", 10, 100) for i in range(3)]
    shape = step_shape_fn(4, 128, (1, 4, 8))
    cm = CostModel(c_base=0.05, c_tok=c_tok, compile_s=0.0)
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, tree=True),
                    cost_model=cm)
    first, other = _rows_and_drafts()
    out = pol.second_branch(rows, first, other, shape)
    if not wants:
        assert out is None
        return
    n_first, second = out
    assert list(n_first) == [3, 3, 0]
    assert second.lens_A[1] == 0                       # starts with the first draft's token
    assert 0 < second.lens_A[0] <= 4 and 0 < second.lens_A[2] <= 4   # 7 slots: 3 + 4 fit
    assert second.tokens_AxK[0, 0] == 21 and second.tokens_AxK[2, 0] == 31
    off = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0), cost_model=cm)
    assert off.second_branch(rows, first, other, shape) is None


def test_das_second_branch_buys_an_unmeasured_tree_shape_by_ski_rental():
    """An unmeasured tree shape is verified only once the time it would have saved reaches
    the cost model's compile time."""
    from das_jax.engine import RowView
    from das_jax.engine.schedule import step_shape_fn
    from das_jax.speculation import CostModel, DASConfig, DASPolicy
    rows = [RowView(i, "p", 10, 100) for i in range(3)]
    shape = step_shape_fn(4, 128, (1, 4, 8))
    cm = CostModel(c_base=0.05, c_tok=1e-4, compile_s=1.0)
    cm.observe_step(4, 512, 0.05, width=1)             # something measured: shapes are priced
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, tree=True),
                    cost_model=cm)
    first, other = _rows_and_drafts()
    calls = 0
    while pol.second_branch(rows, first, other, shape) is None:
        calls += 1
        assert calls < 1000
    assert calls > 0                                    # rented first, then bought
    n_first, second = pol.second_branch(rows, first, other, shape) or (None, None)
    assert n_first is None or second.lens_A.any()


def test_generate_with_das_tree_changes_no_token(params):
    """The DAS policy with `tree` on a drafter with two sources: the plain rollouts token for
    token (exact mode), tree steps taken and won by the second draft, measured as their own
    shapes."""
    from das_jax.speculation import CostModel, DASConfig, DASPolicy
    run, base, futures = _exact_runs(params, 6, seed=3, sampling_seed=5)

    class FreeCompiles(CostModel):      # new shapes are bought at once (no ski rental here)
        def observe_compile(self, seconds):
            pass

    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, tree=True),
                    cost_model=FreeCompiles(c_base=0.05, c_tok=1e-4, compile_s=0.0))
    # the wrong draft claims more: the policy verifies it first, the right one beside it
    out, stats = run(drafter=TwoSourceDrafter(futures, CFG.vocab_size, max_len=3,
                                              right_prob=0.8), policy=pol)
    for a, c in zip(out, base):
        assert a.token_ids == c.token_ids
        np.testing.assert_array_equal(a.logprobs, c.logprobs)
    assert stats.tree_steps > 0 and stats.second_branch_wins > 0
    assert any(len(k) == 5 for k in pol.cost_model.table)      # tree shapes measured apart
