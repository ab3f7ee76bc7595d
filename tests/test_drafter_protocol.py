"""Drafter protocol behaviour: siblings, epochs and window, checkpoints, baselines, factory."""
import pickle

import numpy as np
import pytest

from das_jax.drafter import (Draft, Drafter, GlobalSuffixDrafter, NgramDrafter, ProblemHistory,
                             SuffixDrafter, SuffixTreeConfig, make_drafter)

try:
    from test_drafter_reference import BruteIndex, mutated_copies
except ImportError:  # tests/ imported as a package
    from tests.test_drafter_reference import BruteIndex, mutated_copies

CFG = SuffixTreeConfig(max_depth=16)
PROMPT = [900, 901, 902, 903]


def _rollout(drafter, rid, pid, prompt, out, step=3):
    drafter.begin(rid, pid, prompt)
    for i in range(0, len(out), step):
        drafter.append(rid, out[i: i + step])
    drafter.end(rid)


def _accepted(drafter, rid, out, k=8):
    """Replay `out` greedily: tokens accepted from drafts (as a verifier would count)."""
    acc, i = 0, 0
    while i < len(out):
        d = drafter.propose(rid, k)
        n = 0
        while n < len(d) and i + n < len(out) and d.tokens[n] == out[i + n]:
            n += 1
        acc += n
        emit = out[i: i + n + 1]
        drafter.append(rid, emit)
        i += len(emit)
    return acc


def test_siblings_draft_from_each_other_within_an_epoch():
    rng = np.random.default_rng(0)
    a, b = mutated_copies(rng, 2, 200, 49152, p_mut=0.02)
    d = SuffixDrafter(CFG)
    d.begin(0, "p", PROMPT)
    d.begin(1, "p", PROMPT)
    d.append(0, a)                           # sibling 0 is ahead (still live)
    assert _accepted(d, 1, b) > len(b) // 2
    # a different problem does not see them
    d.begin(2, "q", PROMPT)
    assert len(d.propose(2, 8)) == 0
    d.append(2, b[:20])
    assert len(d.propose(2, 8)) == 0 or _accepted(d, 2, b[20:]) <= 10


def test_prompt_tail_drafts_the_first_tokens():
    d = SuffixDrafter(CFG)
    _rollout(d, 0, "p", PROMPT, [7, 8, 9, 10])
    d.begin(1, "p", PROMPT)
    draft = d.propose(1, 4)
    assert draft.tokens.tolist() == [7, 8, 9, 10]
    assert draft.tokens.dtype == np.int32 and draft.probs.dtype == np.float32
    assert len(d.propose(1, 0)) == 0


def test_window_slides_and_lengths():
    d = SuffixDrafter(CFG, window=2)
    outs = {e: [100 + e] * 3 + [5, 6, 7, e] for e in range(4)}
    for e in range(4):
        _rollout(d, e, "p", PROMPT, outs[e] + [0] * e)
        d.advance_epoch()
    h = d.history
    assert h.num_rollouts("p") == 2
    assert d.lengths("p") == [len(outs[2]) + 2, len(outs[3]) + 3]
    assert d.lengths("unknown") == []
    # content equals a trie built from the retained rollouts only
    tail = PROMPT[-CFG.max_depth:]
    ref = BruteIndex([tail + outs[e] + [0] * e for e in (2, 3)], CFG.max_depth)
    assert h.forest.dump(h._problems["p"].root) == dict(ref.counts)
    # a problem not visited keeps its history; an unvisited epoch does not slide it
    _rollout(d, 9, "q", PROMPT, [1, 2, 3])
    d.advance_epoch()
    assert d.history.num_rollouts("p") == 2 and d.history.num_rollouts("q") == 1


def test_window_zero_keeps_current_epoch_only_and_memory_is_bounded():
    rng = np.random.default_rng(1)
    d = SuffixDrafter(CFG, window=1)
    sizes = []
    for e in range(6):
        for i, out in enumerate(mutated_copies(rng, 4, 100, 49152)):
            _rollout(d, i, "p", PROMPT, out)
        d.advance_epoch()
        sizes.append(d.history.forest.num_nodes)
    assert max(sizes[2:]) <= 1.5 * min(sizes[2:])
    d0 = SuffixDrafter(CFG, window=0)
    _rollout(d0, 0, "p", PROMPT, [1, 2, 3])
    d0.begin(1, "p", PROMPT)
    assert len(d0.propose(1, 3)) == 3          # current epoch visible
    d0.end(1)
    d0.advance_epoch()
    assert d0.history.problems() == []          # nothing kept, tree dropped
    assert d0.history.forest.num_nodes == 0


def test_live_rollout_evicted_by_window_keeps_working():
    d = SuffixDrafter(CFG, window=0)
    d.begin(0, "p", PROMPT)
    d.append(0, [1, 2, 3])
    d.advance_epoch()                          # its epoch is evicted while it is live
    d.append(0, [4, 5])
    d.propose(0, 4)
    d.end(0)
    assert d.lengths("p") == []


def test_state_dict_round_trip_gives_identical_proposals():
    rng = np.random.default_rng(2)
    seqs = mutated_copies(rng, 6, 120, 49152, p_mut=0.05)
    for name in ("suffix", "suffix-global", "ngram"):
        d = make_drafter(name, max_depth=16) if name != "ngram" else make_drafter(name)
        for i, s in enumerate(seqs[:4]):
            _rollout(d, i, i % 2, PROMPT, s)
        d.advance_epoch()
        d.begin(10, 0, PROMPT)
        d.append(10, seqs[4][:30])
        state = pickle.loads(pickle.dumps(d.state_dict()))
        d2 = make_drafter(name, max_depth=16) if name != "ngram" else make_drafter(name)
        d2.load_state_dict(state)
        q = seqs[5]
        for drafter in (d, d2):
            drafter.begin(11, 0, PROMPT)
        for i in range(0, 100, 5):
            a, b = d.propose(11, 8), d2.propose(11, 8)
            assert a.tokens.tolist() == b.tokens.tolist(), name
            np.testing.assert_array_equal(a.probs, b.probs)
            a, b = d.propose(10, 8), d2.propose(10, 8)
            assert a.tokens.tolist() == b.tokens.tolist(), name
            for drafter in (d, d2):
                drafter.append(11, q[i: i + 5])
                drafter.append(10, q[i: i + 2])
        if name == "suffix":
            assert d.lengths(0) == d2.lengths(0) == [len(seqs[0]), len(seqs[2])]


def test_suffix_drafter_propose_matches_bruteforce():
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 4, size=50).tolist() for _ in range(5)]
    d = SuffixDrafter(CFG, prompt_tail=0, scopes=("problem",))    # the problem's trie alone
    for i, s in enumerate(seqs):
        _rollout(d, i, "p", [], s)
    ref = BruteIndex(seqs, CFG.max_depth)
    q = rng.integers(0, 4, size=40).tolist()
    d.begin(99, "p", [])
    for t in q:
        ctx = list(d.context(99))
        toks, probs, _, _ = ref.propose(ctx, 6, own=ctx)
        got = d.propose(99, 6)
        assert got.tokens.tolist() == toks
        np.testing.assert_allclose(got.probs, probs, rtol=1e-6)
        d.append(99, [t])
        ref = BruteIndex(seqs + [list(d.context(99))], CFG.max_depth)


def test_global_drafter_uses_own_prompt_and_other_problems():
    d = GlobalSuffixDrafter(CFG)
    prompt = [1, 2, 3, 4, 5, 6, 40, 41, 42]
    d.begin(0, "p", prompt)
    d.append(0, [1, 2, 3])
    assert d.propose(0, 3).tokens.tolist() == [4, 5, 6]     # per-request trie (own prompt)
    d.end(0)
    d.begin(1, "other", [50, 51])
    d.append(1, [41])
    assert d.propose(1, 8).tokens.tolist()[:1] == [42]      # global trie (another problem)
    d.end(1)
    assert d.lengths("p") == []


def test_ngram_repeated_pattern():
    d = NgramDrafter()
    d.begin(0, "p", [9, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    draft = d.propose(0, 3)
    assert draft.tokens.tolist() == [3, 4, 1]
    assert np.all(np.diff(draft.probs) < 0) and draft.probs.dtype == np.float32
    assert len(d.propose(0, 0)) == 0
    d.append(0, [7])
    assert len(d.propose(0, 3)) == 0         # 7 never seen before
    d.end(0)
    with pytest.raises(KeyError):
        d.propose(0, 3)


def test_make_drafter_names_and_errors():
    assert make_drafter("none") is None
    assert isinstance(make_drafter("ngram", prompt_lookup_max=3), NgramDrafter)
    assert isinstance(make_drafter("suffix", max_depth=24, window=4), SuffixDrafter)
    assert isinstance(make_drafter("das"), SuffixDrafter)
    assert isinstance(make_drafter("suffix-global"), GlobalSuffixDrafter)
    for name in ("ngram", "suffix", "suffix-global"):
        assert isinstance(make_drafter(name), Drafter)
    assert make_drafter("suffix", max_depth=24).config.max_depth == 24
    with pytest.raises(ValueError, match="suffix-global"):
        make_drafter("eagle")
    with pytest.raises(TypeError):
        make_drafter("suffix", bogus=1)
    d = make_drafter("suffix")
    d.begin(0, "p", [1])
    with pytest.raises(ValueError):
        d.begin(0, "p", [1])
    with pytest.raises(KeyError):
        d.append(5, [1])


def test_draft_validation():
    with pytest.raises(ValueError):
        Draft(np.zeros(2, np.int32), np.zeros(3, np.float32))
    assert len(Draft.empty()) == 0


def test_problem_history_max_problems():
    h = ProblemHistory(CFG, window=4, max_problems=2)
    for e, pid in enumerate(["a", "b", "c"]):
        hd = h.start_rollout(pid, PROMPT)
        h.extend_rollout(hd, [e, e + 1])
        h.finish_rollout(hd)
        h.advance_epoch()
    assert sorted(h.problems()) == ["b", "c"]
