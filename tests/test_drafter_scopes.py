"""SuffixDrafter scopes (CFG drafts at most as many tokens as the match is long): the request trie (own full prompt + output), the global trie (finished
rollouts of every problem, a fallback for low-scoring rows), the best-scoring draft winning;
settings, errors, states; and the drafting figure on the shipped GSM8K trace."""
import pathlib
import pickle

import numpy as np
import pytest

from das_jax.bench.drafter_trace import load_trace_rollouts, simulate_drafts
from das_jax.drafter import DRAFT_SOURCES, SuffixDrafter, SuffixTreeConfig, make_drafter
from das_jax.errors import UserError

CFG = SuffixTreeConfig(max_depth=8)
TRACE = pathlib.Path(__file__).resolve().parents[1] / "docs/traces/gsm8k-smollm2-135m.jsonl.gz"


def _finish(d, rid, pid, prompt, out):
    d.begin(rid, pid, prompt)
    d.append(rid, out)
    d.end(rid)


def test_request_scope_drafts_from_the_prompt_beyond_the_indexed_tail():
    """The problem trie holds only the prompt's last max_depth tokens; the request trie holds it
    all, so a phrase from the prompt's start that the output copies is drafted."""
    phrase = [50, 51, 52, 53, 54, 55]
    prompt = phrase + list(range(100, 140))          # the phrase is 46 tokens from the end
    for scopes, want in ((("problem",), []), (("problem", "request"), [52, 53])):
        d = SuffixDrafter(CFG, scopes=scopes)
        d.begin(0, "p", prompt)
        d.append(0, [7, 50, 51])
        assert d.propose(0, 4).tokens.tolist() == want, scopes
        assert d.propose_batch([0], [4]).source_A.tolist() == ([1] if want else [-1])


def test_an_ended_requests_trie_is_removed_at_the_next_full_flush():
    """`end` leaves un-indexing the request trie to the next full `flush_appends` (the
    scheduler runs it while the device computes): the scope forest keeps its nodes until then,
    and a state taken meanwhile (it flushes) holds no trace of them."""
    d = SuffixDrafter(CFG, scopes=("problem", "request"))
    empty = d.scope_forest.num_nodes
    d.begin(0, "p", [1, 2, 3, 4, 5, 6])
    d.append(0, [7, 8, 9])
    indexed = d.scope_forest.num_nodes
    assert indexed > empty
    d.end(0)
    assert d.scope_forest.num_nodes == indexed
    state = d.state_dict()
    assert d.scope_forest.num_nodes == empty
    fresh = SuffixDrafter(CFG, scopes=("problem", "request"))
    fresh.load_state_dict(state)
    assert fresh.scope_forest.num_nodes == empty
    d.begin(1, "p", [1, 2, 3])
    d.end(1)
    d.flush_appends()
    assert d.scope_forest.num_nodes == empty


def test_global_scope_drafts_for_a_new_problem_after_the_next_flush():
    """Epoch 0: problem q has no history; another problem's finished rollout is indexed into the
    global trie at the next full `flush_appends`, and q's rows draft from it; rows whose own
    draft scores at least `global_below` do not search it."""
    out = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    d = SuffixDrafter(CFG, scopes=("problem", "global"))
    d.begin(1, "q", [80])
    _finish(d, 0, "p", [90, 91], out)
    d.append_batch([1], np.array([[2, 3, 4]], np.int32), [3], index_later=True)
    assert len(d.propose(1, 4)) == 0          # the finished rollout waits for the flush
    d.flush_appends()
    assert d.propose(1, 4).tokens.tolist() == [5, 6, 7]
    assert d.propose_batch([1], [4]).source_A.tolist() == [DRAFT_SOURCES.index("global")]
    # global_below 0: never searched
    d0 = SuffixDrafter(CFG, scopes=("problem", "global"), global_below=0.0)
    _finish(d0, 0, "p", [90, 91], out)
    d0.begin(1, "q", [80])
    d0.append(1, [3, 4])
    assert len(d0.propose(1, 4)) == 0


def test_best_score_wins_and_ties_go_to_the_problem_trie():
    """Two siblings continued 7 after [1, 2]: the problem trie drafts [7, 7] with
    probability 1; the request trie (whose prompt continues [1, 2] with 9) drafts [9, 9], the
    same score, so the problem's draft wins the tie."""
    d = SuffixDrafter(CFG, scopes=("problem", "request"), prompt_tail=0)
    _finish(d, 0, "p", [], [1, 2, 7, 7, 7])
    _finish(d, 1, "p", [], [1, 2, 7, 7, 7])
    d.begin(2, "p", [1, 2, 9, 9, 9, 5])
    d.append(2, [1, 2])
    assert d.propose(2, 3).tokens.tolist() == [7, 7]
    assert d.propose_batch([2], [3]).source_A.tolist() == [DRAFT_SOURCES.index("problem")]
    _finish(d, 3, "p", [], [1, 2, 8, 8, 8])    # the problem's 7 now has 2/3: score 4/3 < 2
    d.begin(4, "p", [1, 2, 9, 9, 9, 5])
    d.append(4, [1, 2])
    assert d.propose(4, 3).tokens.tolist() == [9, 9]
    batch = d.propose_batch([2, 4], [3, 3])
    assert batch.source_A.tolist() == [1, 1]        # row 2 too: its problem draft fell to 4/3
    assert batch.cut(np.array([1, 0])).source_A.tolist() == [1, 1]     # cut keeps sources
    assert SuffixDrafter(CFG, scopes=("problem",)).propose_batch([], []).lens_A.size == 0


def test_request_below_searches_the_request_trie_only_for_low_scoring_rows():
    """The problem trie drafts [7, 7] with score 4/3, the request trie [9, 9] with score 2:
    with request_below above 4/3 the request's draft wins; at or below it the request trie is
    not searched and the problem's draft stands (0: never searched)."""
    def drafter(request_below):
        d = SuffixDrafter(CFG, scopes=("problem", "request"), prompt_tail=0,
                          request_below=request_below)
        for rid, out in enumerate(([1, 2, 7, 7, 7], [1, 2, 7, 7, 7], [1, 2, 8, 8, 8])):
            _finish(d, rid, "p", [], out)
        d.begin(9, "p", [1, 2, 9, 9, 9, 5])
        d.append(9, [1, 2])
        return d

    problem, request = DRAFT_SOURCES.index("problem"), DRAFT_SOURCES.index("request")
    for request_below, want, source in ((float("inf"), [9, 9], request), (1.5, [9, 9], request),
                                        (4 / 3, [7, 7], problem), (1.0, [7, 7], problem),
                                        (0.0, [7, 7], problem)):
        d = drafter(request_below)
        assert d.propose(9, 3).tokens.tolist() == want, request_below
        assert d.propose_batch([9], [3]).source_A.tolist() == [source], request_below
        restored = SuffixDrafter(CFG, scopes=("problem", "request"))
        restored.load_state_dict(d.state_dict())     # the setting travels with the state
        assert restored.request_below == request_below
        assert restored.propose(9, 3).tokens.tolist() == want, request_below
    with pytest.raises(ValueError, match="request_below must be >= 0"):
        SuffixDrafter(CFG, request_below=-0.5)
    with pytest.raises(ValueError, match="request_below must be >= 0"):
        SuffixDrafter(CFG, request_below=float("nan"))


def test_finished_rollouts_enter_the_global_trie_at_a_bounded_rate():
    """A full flush indexes finished rollouts into the global trie up to GLOBAL_INDEX_RATE (4)
    times the tokens appended since the previous full flush, oldest first; a rollout cut there
    goes on at the next flush (the part indexed drafts meanwhile); `advance_epoch` and
    `state_dict` index all of them."""
    from das_jax.drafter.suffix_drafter import GLOBAL_INDEX_RATE
    assert GLOBAL_INDEX_RATE == 4
    a, b = list(range(100, 140)), list(range(200, 240))
    d = SuffixDrafter(CFG, scopes=("problem", "global"), global_below=1e9)
    for rid in (0, 1, 2):
        d.begin(rid, "pq"[rid // 2], [])
    d.append_batch([0, 1], np.array([a, b], np.int32), [40, 40], index_later=True)
    d.flush_appends()                    # nothing finished yet: the 80 tokens buy nothing
    d.end(0)
    d.end(1)

    def indexed():
        f = d.scope_forest
        return [f.seq_len(s) for s in d._global_seqs], len(d._global_pending)

    d.append_batch([2], np.array([[11, 12, 13]], np.int32), [3], index_later=True)
    d.flush_appends()
    assert indexed() == ([12], 2)        # 4 x 3 tokens of the first rollout
    assert d.propose(2, 3).tokens.tolist() == []     # 13 is in no rollout
    d.begin(3, "z", [])
    d.append(3, [104, 105])              # a full flush first: nothing appended since the last
    assert indexed() == ([12], 2)
    assert d.propose(3, 4).tokens.tolist() == [106, 107]    # CFG: no longer than the match
    d.append_batch([2, 3], np.array([[1] * 10, [106] * 10], np.int32), [10, 1],
                   index_later=True)
    d.flush_appends()                    # 4 x (2 + 11): the first rollout's last 28, 24 more
    assert indexed() == ([40, 24], 1)
    state = d.state_dict()               # indexes the rest
    assert indexed() == ([40, 40], 0) and state["global_pending"] == []
    d2 = SuffixDrafter(CFG, scopes=("problem", "global"), global_below=1e9)
    d2.load_state_dict(pickle.loads(pickle.dumps(state)))
    d2.append(3, [236, 237])
    assert d2.propose(3, 2).tokens.tolist() == [238, 239]
    d.end(2)
    d.advance_epoch()                    # every finished rollout
    assert indexed()[1] == 0 and len(indexed()[0]) == 3


def test_global_rollouts_keeps_the_most_recent_finished_rollouts():
    d = SuffixDrafter(CFG, scopes=("problem", "global"), global_rollouts=2, global_below=1e9)
    for i, pid in enumerate("abc"):
        _finish(d, i, pid, [], [10 * i + t for t in range(1, 8)])
    d.flush_appends()
    assert len(d._global_seqs) == 2
    d.begin(9, "z", [])
    d.append(9, [1, 2])          # only in the first rollout: dropped
    assert len(d.propose(9, 3)) == 0
    d.append(9, [21, 22])        # the third: kept
    assert d.propose(9, 3).tokens.tolist() == [23, 24]


def test_scope_settings_errors_and_factory():
    with pytest.raises(ValueError, match="scopes must hold 'problem'"):
        SuffixDrafter(CFG, scopes=("request",))
    with pytest.raises(ValueError, match="scopes must hold 'problem'"):
        SuffixDrafter(CFG, scopes=("problem", "requests"))
    with pytest.raises(ValueError, match="global_rollouts must be >= 1"):
        SuffixDrafter(CFG, global_rollouts=0)
    with pytest.raises(ValueError, match="global_below must be >= 0"):
        SuffixDrafter(CFG, global_below=-1.0)
    d = make_drafter("das", max_depth=8, scopes=["global", "problem"], global_rollouts=5)
    assert d.scopes == ("problem", "global") and d.global_rollouts == 5
    assert SuffixDrafter(CFG).scopes == ("problem", "request", "global")


def test_states_round_trip_with_scopes_and_old_states_load_as_problem_only():
    rng = np.random.default_rng(0)
    d = SuffixDrafter(CFG, window=2)
    for rid in range(6):
        _finish(d, rid, rid % 2, [5, 6], rng.integers(0, 5, 30).tolist())
    d.begin(10, 0, [5, 6, 1, 2])
    d.append(10, [1, 2, 3])
    d.begin(11, "new", [5])
    d.append(11, [0, 1])
    ids, k = np.array([10, 11]), np.array([6, 6], np.int32)
    want = d.propose_batch(ids, k)
    assert want.lens_A.all()
    state = pickle.loads(pickle.dumps(d.state_dict()))
    for src in (state, None):
        d2 = SuffixDrafter(CFG, window=2, scopes=("problem",)) if src else pickle.loads(
            pickle.dumps(d))
        if src:
            d2.load_state_dict(src)            # the state's scopes win
        assert d2.scopes == d.scopes
        got = d2.propose_batch(ids, k)
        np.testing.assert_array_equal(got.tokens_AxK, want.tokens_AxK)
        np.testing.assert_array_equal(got.lens_A, want.lens_A)
    old = {key: state[key] for key in ("kind", "history")}     # a state saved before scopes
    old["requests"] = [r[:4] for r in state["requests"]]
    d3 = SuffixDrafter(CFG, window=2)
    d3.load_state_dict(old)
    assert d3.scopes == ("problem",)
    ref = SuffixDrafter(CFG, window=2, scopes=("problem",))
    ref.load_state_dict(old)
    np.testing.assert_array_equal(d3.propose_batch(ids, k).tokens_AxK,
                                  ref.propose_batch(ids, k).tokens_AxK)


def test_shipped_trace_tokens_per_step_per_epoch():
    """The shipped GSM8K trace (16 problems x 8 rollouts x 4 epochs), drafts of up to 16
    tokens, siblings round robin: tokens per verify step of das with its scopes, per epoch, and
    of its problem trie alone. ArcticInference's SuffixDecoding measured under the same protocol
    on this trace: 2.22 / 2.44 / 2.48 / 2.64 (path speculation, one global tree) and 2.25 /
    2.49 / 2.54 / 2.70 (tree speculation); das with its scopes is at least both in every
    epoch."""
    _, rollouts = load_trace_rollouts(str(TRACE))
    got = {}
    for scopes in (("problem", "request", "global"), ("problem",)):
        res = simulate_drafts(make_drafter("das", max_depth=32, window=16, scopes=scopes),
                              rollouts, k=16)
        got[scopes] = [round(res.tokens_per_step(e), 2) for e in res.epochs]
    assert got[("problem", "request", "global")] == [2.27, 2.50, 2.57, 2.72]
    assert got[("problem",)] == [1.96, 2.24, 2.41, 2.59]
    for arctic in ([2.22, 2.44, 2.48, 2.64], [2.25, 2.49, 2.54, 2.70]):
        assert all(a >= b for a, b in zip(got[("problem", "request", "global")], arctic))


def test_trace_loader_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_trace_rollouts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(UserError, match="not a rollout trace"):
        load_trace_rollouts(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"type": "header"}\n')
    with pytest.raises(UserError, match="holds no rollouts"):
        load_trace_rollouts(str(empty))
