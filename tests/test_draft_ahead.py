"""Drafts made ahead while the device computes a step (`SuffixDrafter.propose_ahead`, the
scheduler's `draft_ahead`): a propose returns exactly the drafts of a drafter that never drafts
ahead, whatever happened between (the assumed tokens committed or not, other budgets, siblings
begun or ended, flushes), and a rollout takes the same decisions with and without it."""
import numpy as np
import pytest

from das_jax.drafter import SuffixDrafter, SuffixTreeConfig, suffix_drafter
from das_jax.drafter.suffix_drafter import SCOPES
from das_jax.engine.policy import DraftPlan, FixedPolicy, RowBatch, ahead_inputs
from das_jax.drafter.base import DraftBatch

CFG = SuffixTreeConfig(max_depth=8)
FIELDS = ("tokens_AxK", "probs_AxK", "support_AxK", "lens_A", "has_support_A", "source_A",
          "age_A")


def _assert_same(a: DraftBatch, b: DraftBatch) -> None:
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def _twins(seed, threads, scopes, steps=60):
    """A drafter that drafts ahead and one that does not, driven as the scheduler drives them:
    propose, flush, (ahead), commit with deferred indexing, ends and begins; each step's drafts
    compared. Returns (rows drafted ahead, rows taken, rows the taken drafts drafted, rows
    drafted ahead on a guessed next token)."""
    rng = np.random.default_rng(seed)
    vocab, problems = 4, 5
    kw = dict(threads=threads, scopes=scopes)
    ahead, plain = (SuffixDrafter(CFG, window=2, **kw) for _ in range(2))
    live, next_id, taken_tokens, guesses = [], 0, 0, 0
    budget_next = {}
    for step in range(steps):
        for _ in range(rng.integers(0, 4) if len(live) < 40 else 0):
            pid = int(rng.integers(problems))
            prompt = rng.integers(0, vocab, size=int(rng.integers(1, 10))).tolist()
            for d in (ahead, plain):
                d.begin(next_id, pid, prompt)
            live.append(next_id)
            next_id += 1
        if not live:
            continue
        ids = np.array(live, np.int64)
        # mostly the budget the step ahead assumed, sometimes another
        max_A = np.array([budget_next.get(r, 6) if rng.random() < 0.85
                          else int(rng.integers(0, 9)) for r in live], np.int32)
        used0 = ahead.drafted_ahead[1]
        a = ahead.propose_batch(ids, max_A)
        b = plain.propose_batch(ids, max_A)
        _assert_same(a, b)
        if ahead.drafted_ahead[1] > used0:
            taken_tokens += int(a.lens_A.sum())
        # the policy's choice: a prefix of each draft
        n_A = np.array([rng.integers(0, k + 1) for k in a.lens_A], np.int32)
        # while the device computes: the deferred appends, then the drafts ahead
        for d in (ahead, plain):
            d.flush_appends()
        # the next token: the proposal's where it goes on, else the drafter's guess
        go = a.lens_A > 0
        guess = a.lens_A == n_A
        commit_A = n_A + 1
        W = int(commit_A.max())
        assumed = np.zeros((len(ids), W), np.int32)
        assumed[:, :a.width] = a.tokens_AxK[:, :W]
        assumed[np.arange(W)[None, :] >= (commit_A - guess)[:, None]] = 0
        nxt = rng.integers(0, 9, size=len(ids)).astype(np.int32)
        budget_next = dict(zip(live, nxt.tolist()))
        ahead.propose_ahead(ids[go], assumed[go], commit_A[go], nxt[go], guess[go])
        held = ahead._slots.lookup(ids)
        ok = np.zeros(int(held.max()) + 1, bool)
        n_ok = min(ok.shape[0], ahead._ahead.ok.shape[0])
        ok[:n_ok] = ahead._ahead.ok[:n_ok]
        guessed = go & guess & ok[held]
        guesses += int(guessed.sum())
        assumed[guessed, commit_A[guessed] - 1] = ahead._ahead.assumed_SxW[
            held[guessed], commit_A[guessed] - 1]
        # the step's outcome: the assumed tokens where the draft was accepted and the next
        # token guessed, otherwise a rejection somewhere and another token
        hit = go & (~guess | guessed) & (rng.random(len(ids)) < 0.6)
        toks = rng.integers(0, vocab, size=(len(ids), W)).astype(np.int32)
        n_commit = np.array([rng.integers(1, c + 1) for c in commit_A], np.int32)
        toks[hit] = assumed[hit]
        n_commit[hit] = commit_A[hit]
        for d in (ahead, plain):
            d.append_batch(ids, toks, n_commit, index_later=True)
        # rows end and siblings begin between the steps (they change their problem's trie)
        for r in list(live):
            if rng.random() < 0.08:
                for d in (ahead, plain):
                    d.end(r)
                live.remove(r)
        if step % 25 == 24:
            for d in (ahead, plain):
                d.advance_epoch()
    made, used = ahead.drafted_ahead
    assert plain.drafted_ahead == (0, 0)
    return made, used, taken_tokens, guesses


@pytest.mark.parametrize("seed,threads,scopes", [(0, 1, ("problem",)), (1, 1, SCOPES),
                                                 (2, 2, SCOPES), (3, 1, SCOPES)])
def test_drafts_made_ahead_equal_drafts_made_after(monkeypatch, seed, threads, scopes):
    monkeypatch.setattr(suffix_drafter, "_MIN_ROWS_PER_THREAD", 2)
    made, used, taken_tokens, guesses = _twins(seed, threads, scopes)
    assert made > 300 and used > 100 and used < made, (made, used)
    assert taken_tokens > 100 and guesses > 50


def _sibling_changes(change: str, ahead: bool) -> tuple[DraftBatch, int]:
    """Rows 0 (problem p) and 2 (problem q) drafted ahead (with `ahead`) for one assumed
    token, that token committed, then a sibling of p begun or ended; the next propose of both
    rows and the rows it took from the ahead."""
    d = SuffixDrafter(CFG, window=2, prompt_tail=4)
    d.begin(0, "p", [1, 2, 3])
    d.begin(1, "p", [1, 2, 3])
    d.begin(2, "q", [1, 2, 3])
    d.append_batch(np.array([0, 1, 2]), np.array([[1, 2, 3, 1], [0, 0, 0, 0], [1, 2, 3, 1]],
                                                 np.int32), np.array([4, 1, 4], np.int32))
    d.flush_appends()
    rows = np.array([0, 2])
    assumed = np.array([[2], [2]], np.int32)
    if ahead:
        assert d.propose_ahead(rows, assumed, np.array([1, 1], np.int32),
                               np.array([4, 4], np.int32)) == 2
    d.append_batch(rows, assumed, np.array([1, 1], np.int32), index_later=True)
    if change == "begin":
        d.begin(3, "p", [7, 1, 2, 3, 1, 2])
    else:
        d.append_batch(np.array([1]), np.array([[1, 2, 3, 1, 2, 3]], np.int32),
                       np.array([6], np.int32), index_later=True)
        d.end(1)
    return d.propose_batch(rows, np.array([4, 4], np.int32)), d.drafted_ahead[1]


@pytest.mark.parametrize("change", ["begin", "end"])
def test_a_change_to_the_problem_trie_voids_the_drafts_ahead(change):
    """A sibling's `begin` (its prompt tail joins the problem's trie) or `end` (its last tokens
    do) between the ahead and the propose: the rows of that problem draft again, rows of other
    problems take theirs; the drafts equal a drafter's that never drafted ahead."""
    got, used = _sibling_changes(change, ahead=True)
    want, _ = _sibling_changes(change, ahead=False)
    assert used == 1            # row 2 (problem q) only
    _assert_same(got, want)
    assert got.lens_A[0] > 0


def test_ahead_inputs_assume_the_chosen_draft_and_the_next_token():
    """Rows with a proposal: its chosen tokens plus the next one (the proposal's where it goes
    on, else a placeholder the drafter guesses), budgets of the rows after those tokens; rows
    that would end there (a known stop token, no tokens left) and rows without a proposal are
    left out."""
    proposed = DraftBatch(np.array([[5, 6, 7], [8, 9, 0], [4, 1, 3], [5, 6, 7], [0, 0, 0]],
                                   np.int32), np.full((5, 3), 0.5, np.float32),
                          np.ones((5, 3), np.int32), np.array([3, 2, 3, 3, 0], np.int32),
                          np.ones(5, bool))
    chosen = proposed.cut(np.array([1, 2, 1, 0, 0], np.int32))
    plan = DraftPlan(4, chosen, None, proposed=proposed)
    rows = RowBatch(np.array([10, 11, 12, 13, 14]), np.array([0, 5, 0, 7, 0]),
                    np.array([9, 9, 9, 1, 9]))
    out = ahead_inputs(plan, rows, FixedPolicy(max_draft=5), 4, (1, 4, 8), np.array([1]))
    ids, tok_AxW, n_A, budgets, guess_A = out
    # row 11: its whole proposal chosen (the next token guessed); row 12: its next token 1 is
    # a stop; row 13: 1 token left; row 14: no proposal
    assert ids.tolist() == [10, 11]
    assert tok_AxW.tolist() == [[5, 6, 0], [8, 9, 0]] and n_A.tolist() == [2, 3]
    assert guess_A.tolist() == [False, True]
    assert budgets.tolist() == [5, 5]         # min(max_draft, remaining - 1, widest - 1)
    assert ahead_inputs(plan, rows, FixedPolicy(), 4, (1, 4), np.zeros(0, np.int64))[0] \
        .tolist() == [10, 11, 12]
    # a stop token among the known tokens ends the row; a guessed one is the drafter's
    stop9 = ahead_inputs(plan, rows, FixedPolicy(), 4, (1, 4), np.array([9]))
    assert stop9[0].tolist() == [10, 12]
    assert ahead_inputs(DraftPlan(4, chosen, None), rows, FixedPolicy(), 4, (1, 4),
                        np.zeros(0, np.int64)) is None


def test_a_guessed_next_token_is_the_first_token_of_the_draft_after_the_chosen_one():
    """`propose_ahead` with `guess_A`: the placeholder becomes the first token the drafter
    drafts for the context ending in the chosen draft; the draft held is the one for the
    context ending in both, taken once those tokens are committed."""
    d = SuffixDrafter(CFG, window=2, prompt_tail=4)
    for r in range(2):
        d.begin(r, "p", [1, 2])
    d.append_batch(np.array([0]), np.array([[3, 4, 5, 6, 7]], np.int32),
                   np.array([5], np.int32))
    d.append_batch(np.array([1]), np.array([[3]], np.int32), np.array([1], np.int32))
    d.flush_appends()
    first = d.propose_batch(np.array([1]), np.array([2], np.int32))
    assert first.tokens_AxK[0].tolist() == [4, 5]
    # the policy chose both tokens; the step would accept them and sample 6 (guessed)
    assert d.propose_ahead(np.array([1]), np.array([[4, 5, 0]], np.int32),
                           np.array([3], np.int32), np.array([1], np.int32),
                           np.array([True])) == 1
    assert d._ahead.assumed_SxW[d._slots.lookup(np.array([1]))[0], :3].tolist() == [4, 5, 6]
    d.append_batch(np.array([1]), np.array([[4, 5, 6]], np.int32), np.array([3], np.int32),
                   index_later=True)
    got = d.propose_batch(np.array([1]), np.array([1], np.int32))
    assert d.drafted_ahead == (1, 1) and got.tokens_AxK[0].tolist() == [7]
    # no draft to guess from: the row is not drafted ahead
    d.append_batch(np.array([1]), np.array([[9]], np.int32), np.array([1], np.int32))
    assert d.propose_ahead(np.array([1]), np.array([[0]], np.int32), np.array([1], np.int32),
                           np.array([3], np.int32), np.array([True])) == 0


def test_das_budgets_for_rows_ahead_record_nothing():
    """`DASPolicy.draft_budgets(..., record=False)`: the budgets of rows as they will be, with
    the class promotion they would get, but no promotion kept."""
    from das_jax.speculation import DASConfig, DASPolicy
    pol = DASPolicy(config=DASConfig(short_threshold=4, long_threshold=10, budget_short=0,
                                     budget_medium=3))
    for r in range(3):
        pol.begin(r, "p", 5)
    rows = RowBatch(np.arange(3), np.array([0, 3, 20]), np.array([30, 30, 30]))
    before = pol._class_R.copy()
    peek = pol.draft_budgets(rows, 4, 16, record=False)
    np.testing.assert_array_equal(pol._class_R, before)
    np.testing.assert_array_equal(peek, pol.draft_budgets(rows, 4, 16))
    assert peek.tolist() == [3, 3, 15]                   # medium, medium, long (promoted)
    assert not np.array_equal(pol._class_R, before)     # the recorded call kept it
