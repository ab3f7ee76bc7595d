"""The train step's completion window (`completion_window`): the lm_head + log-softmax run at the
completion positions only, with the same loss, metrics and gradient as the full-T reference."""
import numpy as np
import pytest

from das_jax.models.transformer import ActivationConfig
from das_jax.rl import compute_logprobs, make_batch, make_loss_and_grad
from das_jax.rl.batches import (HostColumns, completion_window, count_bucket,
                                pack_shared_prompts, packed_micro_batches,
                                shared_prompt_groups)

from test_grpo_train_step import CFG, TEMP, _grpo, _tree_rel_err, tiny_params

ACT = ActivationConfig(remat="full", attention="xla", attention_chunk=16, logits_chunk=16)


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG, seed=3)


def test_completion_window_covers_every_completion_token():
    rng = np.random.default_rng(0)
    for _ in range(50):
        B, T = int(rng.integers(1, 6)), int(rng.integers(2, 90))
        cmask = np.zeros((B, T), bool)
        for b in range(B):
            if rng.random() < 0.8:
                s = int(rng.integers(1, T))
                cmask[b, s:int(rng.integers(s, T)) + 1] = True
        floor = int(rng.choice([1, 4, 32]))
        win = completion_window(cmask, floor)
        W = win.shape[1]
        assert win.dtype == np.int32 and win.shape[0] == B and 1 <= W <= max(1, T - 1)
        assert W == T - 1 or W % floor == 0
        assert (win >= 1).all() and (win <= T - 1).all()
        assert (np.diff(win, axis=1) == 1).all()  # consecutive, so distinct
        for b in range(B):
            assert set(np.flatnonzero(cmask[b])) <= set(win[b].tolist())


def test_completion_window_is_short_for_long_prompts():
    cmask = np.zeros((3, 200), bool)
    cmask[0, 150:170] = cmask[1, 100:130] = True
    win = completion_window(cmask, 32)
    assert win.shape == (3, 32)
    assert win[0, 0] == 150 and win[1, 0] == 100 and win[2, 0] == 1


def _long_prompt_batch(params, seed):
    """Prompts of 30-45 tokens, completions of 0-9: the window (32) is half of T (64)."""
    rng = np.random.default_rng(seed)
    B, T = 6, 64
    prompt = rng.integers(30, 46, size=B)
    comp = rng.integers(0, 10, size=B)
    comp[0] = 9
    tokens = rng.integers(0, CFG.vocab_size, size=(B, T))
    base = make_batch(tokens, prompt, comp)
    cur = np.asarray(compute_logprobs(CFG, params, base.tokens_BxT, base.positions_BxT,
                                      base.valid_BxT, TEMP, activation=None))
    return make_batch(tokens, prompt, comp,
                      old_logprobs_BxT=cur + rng.normal(0, 0.35, size=cur.shape),
                      ref_logprobs_BxT=cur + rng.normal(0, 0.2, size=cur.shape),
                      advantages_B=rng.normal(0, 1, size=B))


def _assert_matches_full_reference(params, b, loss_type, beta, mb):
    """The train step's loss, metrics and gradients on batch `b` equal (1e-5) those of the
    reference: full-sequence logits, no windowing, no prompt sharing, no length grouping."""
    cfg = _grpo(loss_type=loss_type, beta=beta, micro_batch_size=mb)
    ref = make_loss_and_grad(CFG, cfg, temperature=TEMP, activation=None, group_by_length=False)
    new = make_loss_and_grad(CFG, cfg, temperature=TEMP, activation=ACT, group_by_length=True)
    (l0, g0, m0), (l1, g1, m1) = ref(params, b), new(params, b)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7)
    for k in ("entropy", "clip_low", "clip_high", "clip_region", "num_completion_tokens",
              "logprob_gap") + (("kl",) if beta else ()):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    assert _tree_rel_err(g1, g0) <= 1e-5, _tree_rel_err(g1, g0)


@pytest.mark.parametrize("loss_type,beta,mb", [("dapo", 0.0, 6), ("grpo", 0.04, 4),
                                               ("dr_grpo", 0.04, 2)])
def test_windowed_head_matches_full_reference(params, loss_type, beta, mb):
    b = _long_prompt_batch(params, seed=5)
    _assert_matches_full_reference(params, b, loss_type, beta, mb)


def _group_batch(params, seed, prompt_lens=(30, 41, 12), G=3):
    """Groups of G rows sharing a prompt (as GRPO samples them), completions of 0-12 tokens."""
    rng = np.random.default_rng(seed)
    T = 64
    rows, prompt, comp = [], [], []
    for P in prompt_lens:
        p_tokens = rng.integers(0, CFG.vocab_size, size=P)
        for _ in range(G):
            L = int(rng.integers(0, 13))
            row = np.zeros(T, np.int64)
            row[:P] = p_tokens
            row[P:P + L] = rng.integers(0, CFG.vocab_size, size=L)
            rows.append(row)
            prompt.append(P)
            comp.append(L)
    comp[0] = 12
    tokens = np.stack(rows)
    base = make_batch(tokens, prompt, comp)
    cur = np.asarray(compute_logprobs(CFG, params, base.tokens_BxT, base.positions_BxT,
                                      base.valid_BxT, TEMP, activation=None))
    B = len(rows)
    return make_batch(tokens, prompt, comp,
                      old_logprobs_BxT=cur + rng.normal(0, 0.35, size=cur.shape),
                      ref_logprobs_BxT=cur + rng.normal(0, 0.2, size=cur.shape),
                      advantages_B=rng.normal(0, 1, size=B))


def test_count_bucket_steps_by_at_most_a_third():
    assert [count_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12,
                                                      16]
    assert count_bucket(32) == 32 and count_bucket(33) == 48 and count_bucket(49) == 64


def test_shared_prompt_groups_and_packing():
    tokens = np.array([[5, 6, 7, 1, 0], [5, 6, 8, 2, 3], [5, 6, 7, 9, 0], [4, 6, 7, 0, 0]])
    positions = np.tile(np.arange(5), (4, 1))
    valid = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
    cmask = np.array([[0, 0, 0, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]], bool)
    groups = shared_prompt_groups(tokens, positions, valid, cmask, range(4))
    assert groups == [[0, 2], [1]]  # row 3 has no completion token
    f = np.arange(20, dtype=np.float32).reshape(4, 5)
    cols = HostColumns(tokens, positions, valid, cmask, f, -f, np.arange(4.0), f / 10)
    packed = pack_shared_prompts(groups, cols).first()
    tok, pos, val, seg, src, tgt = (packed.tokens, packed.positions, packed.valid,
                                    packed.segments, packed.source, packed.targets)
    grp, cm, o, rf = (packed.row_group, packed.completion_mask, packed.old_logprobs,
                      packed.ref_logprobs)
    a, ww = packed.advantages, packed.weights
    assert tok.shape == (2, 64) and src.shape == (3, 32)
    assert tok[0, :5].tolist() == [5, 6, 7, 1, 9] and seg[0, :5].tolist() == [0, 0, 0, 1, 2]
    assert pos[0, :5].tolist() == [0, 1, 2, 3, 3] and val[0].sum() == 5
    assert tok[1, :5].tolist() == [5, 6, 8, 2, 3] and seg[1, :5].tolist() == [0, 0, 1, 1, 1]
    assert grp.tolist() == [0, 0, 1]
    assert src[0, 0] == 2 and src[1, 0] == 2 and src[2, :3].tolist() == [1, 2, 3]
    assert tgt[2, :3].tolist() == [8, 2, 3] and cm.sum() == 5 and a.tolist() == [0, 2, 1]
    assert o[2, :3].tolist() == [7, 8, 9] and rf[1, 0] == -13 and np.isclose(ww[0, 0], 0.3)
    # five groups of five completions pad to six and six: the extra packed row repeats group
    # 0's, the extra completion row reads it and adds nothing (no mask, weight, advantage)
    five = [[0], [1], [2], [0], [1]]
    p5 = pack_shared_prompts(five, cols).first()
    tok5, val5, grp5, cm5, o5, rf5, a5, ww5 = (
        p5.tokens, p5.valid, p5.row_group, p5.completion_mask, p5.old_logprobs,
        p5.ref_logprobs, p5.advantages, p5.weights)
    assert tok5.shape == (6, 64) and (tok5[5] == tok5[0]).all() and (val5[5] == val5[0]).all()
    assert grp5.tolist() == [0, 1, 2, 3, 4, 0] and cm5.shape == (6, 32) and a5[5] == 0
    assert not (cm5[5].any() or ww5[5].any() or o5[5].any() or rf5[5].any())
    unpadded = pack_shared_prompts(five, cols, bucket_counts=False)
    assert unpadded.tokens.shape == (1, 5, 64) and unpadded.source.shape == (1, 5, 32)
    valid[0, 4] = True  # a valid token after the completion: not prompt + completion
    assert shared_prompt_groups(tokens, positions, valid, cmask, range(4)) is None


def test_packed_rows_hold_at_most_the_padded_length_and_micro_batch_size():
    """A packed row never holds more than T tokens (prompt + its completions) and a micro-batch
    never more than `size` completions: a long or large group is split, repeating its prompt."""
    T = 20
    spans = {0: (8, 6), 1: (8, 5), 2: (8, 4), 3: (8, 7), 4: (3, 2), 5: (3, 2)}
    cmask = np.zeros((6, T), bool)
    for r, (P, L) in spans.items():
        cmask[r, P:P + L] = True
    groups = [[0, 1, 2, 3], [4, 5]]
    # 8 + 6 + 5 = 19 <= 20 < 19 + 4: group 0 splits in two rows of two; micro-batches of 4
    assert packed_micro_batches(groups, cmask, 4) == [[[0, 1], [2, 3]], [[4, 5]]]
    assert packed_micro_batches(groups, cmask, 3) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert packed_micro_batches(groups, cmask, 16) == [[[0, 1], [2, 3], [4, 5]]]
    assert packed_micro_batches(groups, cmask, 1) == [[[r]] for r in range(6)]
    # a group of 16 short completions and micro-batches of 4: rows of 4, not one row of 16
    many = np.zeros((16, 64), bool)
    many[:, 10:13] = True
    micro = packed_micro_batches([list(range(16))], many, 4)
    assert micro == [[list(range(i, i + 4))] for i in range(0, 16, 4)]
    for m in packed_micro_batches(groups, cmask, 4):
        assert sum(len(row) for row in m) <= 4
        for row in m:
            assert spans[row[0]][0] + sum(spans[r][1] for r in row) <= T


def test_long_groups_split_into_bounded_rows_match_full_reference(params):
    """Groups of six whose packed rows would exceed T (41 + 6 x up to 12 > 64) train as several
    packed rows per group, with the loss, metrics and gradients of the full reference."""
    b = _group_batch(params, seed=5, prompt_lens=(41, 30), G=6)
    _assert_matches_full_reference(params, b, "dapo", 0.0, 6)


@pytest.mark.parametrize("loss_type,beta,mb", [("dapo", 0.0, 9), ("grpo", 0.04, 3),
                                               ("dr_grpo", 0.04, 4)])
def test_shared_prompt_packing_matches_full_reference(params, loss_type, beta, mb):
    b = _group_batch(params, seed=7)
    _assert_matches_full_reference(params, b, loss_type, beta, mb)


def test_padded_group_and_completion_counts_match_full_reference(params):
    """Five groups (padded to six packed rows) in one micro-batch: the padding adds nothing to
    the loss, gradient or metrics."""
    b = _group_batch(params, seed=11, prompt_lens=(30, 41, 12, 20, 9))
    _assert_matches_full_reference(params, b, "dapo", 0.0, 15)


def test_micro_batch_kinds_are_typed_and_dispatched_by_type():
    """A batch's rows become a `PaddedMicroBatch` (leading axis 1, zero padding rows), whose
    `windowed()` holds the loss inputs at the completion window; the log-probs are chosen by
    the micro-batch's type, and anything else is refused."""
    from das_jax.rl.batches import PaddedMicroBatch, WindowedMicroBatch
    from das_jax.rl.logprobs import micro_batch_logprobs
    tokens = np.arange(12).reshape(2, 6) % 5
    valid = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    cmask = np.array([[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]], bool)
    f = np.arange(12, dtype=np.float32).reshape(2, 6)
    cols = HostColumns(tokens, np.tile(np.arange(6), (2, 1)), valid, cmask, f, -f,
                       np.array([1.0, 2.0], np.float32), f / 10)
    assert cols.row_lengths().tolist() == [4, 6]
    xs = cols.padded(np.array([1]), 6, 2)
    assert isinstance(xs, PaddedMicroBatch) and xs.tokens.shape == (1, 2, 6)
    assert xs.advantages.tolist() == [[2.0, 0.0]] and not xs.completion_mask[0, 1].any()
    win = xs.windowed()
    assert isinstance(win, WindowedMicroBatch) and win.window.shape == (1, 2, 5)
    assert win.old_logprobs[0, 0].tolist() == [7, 8, 9, 10, 11]  # positions 1..5 of row 1
    abstract = PaddedMicroBatch.abstract(1, 2, 6)
    assert abstract.advantages.shape == (1, 2) and abstract.valid.dtype == np.bool_
    with pytest.raises(TypeError, match="not a micro-batch: tuple"):
        micro_batch_logprobs(tuple(xs.__dict__.values()), CFG, None, TEMP, ACT)
