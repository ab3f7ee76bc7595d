"""Suffix trie vs a brute-force reference: proposals, canonical content, removal, invariants."""
import copy

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from das_jax.drafter.suffix_tree import SuffixForest, SuffixTree, SuffixTreeConfig

try:
    from test_drafter_reference import BruteIndex, as_np, mutated_copies
except ImportError:  # tests/ imported as a package
    from tests.test_drafter_reference import BruteIndex, as_np, mutated_copies


def _assert_same(tree: SuffixTree, ref: BruteIndex, ctx, max_tokens, cfg, own_id=None,
                 own=None):
    got = tree.propose_scored(as_np(ctx), max_tokens, own_id)
    toks, probs, m, score = ref.propose(ctx, max_tokens, cfg.min_token_prob, cfg.max_spec_factor,
                                        cfg.max_spec_offset, cfg.min_match_len, own)
    assert got.draft.tokens.tolist() == toks, (ctx, got, toks)
    np.testing.assert_allclose(got.draft.probs, np.asarray(probs, np.float32), rtol=1e-6)
    assert got.match_len == m
    assert got.draft.tokens.dtype == np.int32 and got.draft.probs.dtype == np.float32
    # Each token's support: the count of the context path it continues (the matched tail plus
    # the draft before it), less the requester's own trailing occurrence.
    ctx_l = [int(x) for x in ctx]
    own_l = None if own is None else [int(x) for x in own]
    want = [ref.count(tuple(ctx_l[len(ctx_l) - m:] + toks[:i]), own_l) for i in range(len(toks))]
    if toks:
        assert got.draft.support is not None and got.draft.support.dtype == np.int32
        assert got.draft.support.tolist() == want, (ctx, got.draft.support, want)
    assert np.all(np.diff(got.draft.probs) <= 0)
    if toks:
        assert got.draft.probs[-1] >= cfg.min_token_prob


def _build(seqs, cfg, chunk_rng=None):
    """Index seqs interleaved token-chunk by token-chunk (as live siblings would be)."""
    tree = SuffixTree(cfg)
    pos = [0] * len(seqs)
    rng = chunk_rng or np.random.default_rng(0)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        i = int(rng.integers(len(seqs)))
        if pos[i] >= len(seqs[i]):
            continue
        n = int(rng.integers(1, 5))
        tree.append(i, seqs[i][pos[i]: pos[i] + n])
        pos[i] += n
    return tree


def _contexts(rng, seqs, vocab, n):
    out = []
    for _ in range(n):
        s = seqs[int(rng.integers(len(seqs)))]
        out.append(list(s[: int(rng.integers(0, len(s) + 1))]))
    out.append(rng.integers(0, vocab, size=7).tolist())
    return out


@pytest.mark.parametrize("vocab,depth", [(3, 6), (4, 8), (5, 24), (49152, 24)])
def test_propose_matches_bruteforce_every_prefix(vocab, depth):
    rng = np.random.default_rng(vocab * 100 + depth)
    cfg = SuffixTreeConfig(max_depth=depth)
    if vocab > 10:
        seqs = mutated_copies(rng, 6, 120, vocab, p_mut=0.08)
    else:
        seqs = [rng.integers(0, vocab, size=int(rng.integers(5, 60))).tolist() for _ in range(6)]
    tree = _build(seqs, cfg, rng)
    ref = BruteIndex(seqs, depth)
    assert tree.dump() == dict(ref.counts)
    tree.check()
    query = mutated_copies(rng, 1, 80, vocab, p_mut=0.1)[0] if vocab > 10 else \
        rng.integers(0, vocab, size=60).tolist()
    for q in (seqs[0], query):
        for i in range(len(q) + 1):
            _assert_same(tree, ref, q[:i], 1 + i % 9, cfg)


@pytest.mark.parametrize("factor,offset,min_prob,min_match",
                         [(0.5, 1.0, 0.3, 1), (2.0, 0.0, 0.0, 2), (1.0, 0.0, 0.6, 3)])
def test_propose_config_knobs(factor, offset, min_prob, min_match):
    rng = np.random.default_rng(7)
    cfg = SuffixTreeConfig(max_depth=10, min_token_prob=min_prob, max_spec_factor=factor,
                           max_spec_offset=offset, min_match_len=min_match)
    seqs = [rng.integers(0, 4, size=40).tolist() for _ in range(4)]
    tree = _build(seqs, cfg, rng)
    ref = BruteIndex(seqs, 10)
    for ctx in _contexts(rng, seqs, 4, 60):
        _assert_same(tree, ref, ctx, 8, cfg)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1,
                     max_size=5),
       depth=st.integers(2, 9), remove=st.lists(st.integers(0, 4), max_size=5),
       ctx=st.lists(st.integers(0, 3), max_size=12), max_tokens=st.integers(0, 8))
def test_hypothesis_remove_equals_rebuild(seqs, depth, remove, ctx, max_tokens):
    cfg = SuffixTreeConfig(max_depth=depth)
    tree = SuffixTree(cfg)
    for i, s in enumerate(seqs):
        tree.append(i, s)
    kept = set(range(len(seqs)))
    for r in remove:
        if r in kept:
            tree.remove(r)
            kept.discard(r)
    retained = [seqs[i] for i in sorted(kept)]
    fresh = SuffixTree(cfg)
    for i, s in enumerate(retained):
        fresh.append(i, s)
    assert tree.dump() == fresh.dump() == dict(BruteIndex(retained, depth).counts)
    tree.check()
    _assert_same(tree, BruteIndex(retained, depth), ctx, max_tokens, cfg)


def test_sliding_window_equals_rebuild_large_vocab():
    """Interleaved live appends, then removal of the oldest 'epochs' (window of 2)."""
    rng = np.random.default_rng(3)
    cfg = SuffixTreeConfig(max_depth=24)
    forest = SuffixForest(cfg)
    tree = SuffixTree(cfg, forest)
    epochs = []
    for e in range(5):
        seqs = mutated_copies(rng, 4, 150, 49152, p_mut=0.06)
        ids = [e * 10 + i for i in range(4)]
        pos = [0] * 4
        while any(p < len(s) for p, s in zip(pos, seqs)):
            i = int(rng.integers(4))
            n = int(rng.integers(1, 6))
            if pos[i] < len(seqs[i]):
                tree.append(ids[i], seqs[i][pos[i]: pos[i] + n])
                pos[i] += n
        for i in ids:
            tree.freeze(i)
        epochs.append((ids, seqs))
        if len(epochs) > 2:
            for i in epochs.pop(0)[0]:
                tree.remove(i)
        retained = [s for _, ss in epochs for s in ss]
        fresh = SuffixTree(cfg)
        for i, s in enumerate(retained):
            fresh.append(i, s)
        assert tree.dump() == fresh.dump()
        assert tree.check() == fresh.check()   # same compressed node count as a fresh build
        ref = BruteIndex(retained, 24)
        q = retained[-1]
        for i in range(0, len(q), 7):
            _assert_same(tree, ref, q[:i], 12, cfg)


def test_remove_everything_leaves_no_nodes():
    rng = np.random.default_rng(11)
    cfg = SuffixTreeConfig(max_depth=16)
    forest = SuffixForest(cfg)
    trees = [SuffixTree(cfg, forest) for _ in range(3)]
    base_nodes = forest.num_nodes            # the three roots
    assert base_nodes == 3
    for k, tree in enumerate(trees):
        for i, s in enumerate(mutated_copies(rng, 5, 200, 50 if k else 3)):
            tree.append(i, s)
    assert forest.num_nodes > 3 and forest.indexed_tokens > 0
    for tree in trees:
        for i in tree.seq_ids:
            tree.remove(i)
        assert tree.dump() == {}
    assert forest.num_nodes == 3
    assert forest.meta[3] == 0                 # hash entries
    assert forest.indexed_tokens == 0
    assert not forest._dead                    # no removed sequence kept for references
    for tree in trees:
        forest.drop_tree(tree.root)
    assert forest.num_nodes == 0


def test_drop_nonempty_tree_raises_and_frozen_append_raises():
    tree = SuffixTree(SuffixTreeConfig(max_depth=4))
    tree.append(0, [1, 2, 3])
    with pytest.raises(ValueError):
        tree.forest.drop_tree(tree.root)
    tree.freeze(0)
    with pytest.raises(ValueError):
        tree.append(0, [4])
    with pytest.raises(ValueError):
        SuffixTreeConfig(max_depth=1)


def test_compression_keeps_nodes_per_token_small():
    """A unique sequence needs O(1) nodes per token, not O(max_depth)."""
    rng = np.random.default_rng(5)
    tree = SuffixTree(SuffixTreeConfig(max_depth=32))
    tree.append(0, rng.integers(0, 49152, size=5000))
    assert tree.num_nodes <= 2 * 5000


def test_propose_simple_example():
    tree = SuffixTree(SuffixTreeConfig(max_depth=8))
    tree.append(0, [5, 6, 7, 5, 6, 8])
    tree.append(1, [5, 6, 7, 5, 6, 9])
    d = tree.propose([1, 5, 6, 7], 8)
    # "5 6 7" occurs twice, always followed by "5 6", then 8 or 9 (tie -> smaller id 8, p=0.5)
    assert d.tokens.tolist() == [5, 6, 8]
    np.testing.assert_allclose(d.probs, [1.0, 1.0, 0.5])
    # Every step rests on the two occurrences of "5 6 7", "5 6 7 5" and "5 6 7 5 6".
    assert d.support.tolist() == [2, 2, 2]
    assert len(tree.propose([1, 5, 6, 7], 0)) == 0
    assert len(tree.propose([], 4)) == 0
    assert len(tree.propose([42], 4)) == 0


@pytest.mark.parametrize("vocab,depth", [(2, 6), (3, 12), (49152, 24)])
def test_propose_excludes_own_live_sequence(vocab, depth):
    """Drafting for a live sequence: its own trailing occurrences are not counted."""
    rng = np.random.default_rng(depth)
    cfg = SuffixTreeConfig(max_depth=depth)
    if vocab > 10:
        seqs = mutated_copies(rng, 4, 100, vocab, p_mut=0.08)
    else:
        seqs = [rng.integers(0, vocab, size=40).tolist() for _ in range(4)]
    tree = _build(seqs[:3], cfg, rng)
    me = seqs[3]
    prompt = rng.integers(0, vocab, size=5).tolist()
    for i in range(len(me) + 1):
        if i:
            tree.append(99, me[i - 1: i])
        own = me[:i]
        ref = BruteIndex(seqs[:3] + [own], depth)
        ctx = prompt + own
        if i:
            _assert_same(tree, ref, ctx, 1 + i % 7, cfg, 99, own)
        else:
            _assert_same(tree, ref, ctx, 5, cfg)


def test_state_saved_before_the_first_token_field_loads_and_keeps_drafting():
    """A forest state whose node rows lack TOK0 (the first edge token, added to the row later)
    loads with the field read off the paths: the invariants hold (`check` compares TOK0 with
    each child's path), drafts equal those of the current state's load, appends go on."""
    rng = np.random.default_rng(7)
    cfg = SuffixTreeConfig(max_depth=12)
    tree = SuffixTree(cfg)
    seqs = mutated_copies(rng, 6, 120, 9, p_mut=0.1)
    for i, s in enumerate(seqs):
        tree.append(i, s[:80])
    for i in (0, 3):               # removals leave free rows behind
        tree.remove(i)
    state = tree.forest.state_dict()
    assert state["nodes"].shape[1] == 9
    old = copy.deepcopy(state)
    old["nodes"] = old["nodes"][:, :8]
    loaded = {}
    for name, st in (("current", state), ("old", old)):
        t = SuffixTree(cfg, SuffixForest(cfg))
        t.forest.load_state_dict(st)
        t.root, t._sids = tree.root, dict(tree._sids)
        t.check()
        loaded[name] = t
    np.testing.assert_array_equal(loaded["old"].forest.nodes, loaded["current"].forest.nodes)
    for ctx in _contexts(rng, seqs, 9, 20):
        a = loaded["old"].propose_scored(as_np(ctx), 8)
        b = tree.propose_scored(as_np(ctx), 8)
        assert a.draft.tokens.tolist() == b.draft.tokens.tolist()
    t = loaded["old"]
    for i in (1, 2, 4, 5):
        t.append(i, seqs[i][80:])
    t.check()
    fresh = SuffixTree(cfg)
    for i in (1, 2, 4, 5):
        fresh.append(i, seqs[i])
    assert t.dump() == fresh.dump()
