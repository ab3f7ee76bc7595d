"""The EAGLE-3 draft head: its masks (drafting = training-time test, no peeking ahead), the
policy features it reads, fitting, its file and the trace simulation."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.bench.drafter_trace import TraceRollout, simulate_drafts
from das_jax.draft_head.features import block_features, sequence_features
from das_jax.draft_head.fit import FitConfig, draft_vocabulary, fit_head, split_problems
from das_jax.draft_head.head import HeadConfig, draft_all_anchors, init_head, run_levels
from das_jax.draft_head.store import (DraftHead, check_head_for_policy, load_head,
                                      policy_fingerprint, save_head)
from das_jax.draft_head.trace_drafter import HeadDrafter, head_drafts
from das_jax.errors import UserError
from das_jax.models.transformer import forward_hidden, lm_head
from das_jax.testing.models import tiny_model_config, tiny_params

CFG = tiny_model_config(num_layers=4)
VD = 48


def _head(seed=0):
    hc = HeadConfig.for_policy(CFG, VD)
    return hc, init_head(hc, jax.random.PRNGKey(seed), scale=0.3)


def _seq(n, seed):
    return np.random.default_rng(seed).integers(2, CFG.vocab_size, n).astype(np.int32)


def test_default_blocks_are_low_middle_high():
    def blocks(L):
        return HeadConfig.for_policy(tiny_model_config(num_layers=L), 100).feature_layers
    assert blocks(30) == (2, 15, 27)
    assert blocks(8) == (2, 4, 5)
    assert blocks(4) == (2, 2, 2)       # small policies: low <= middle <= high, all in range
    assert blocks(1) == (0, 0, 0)


@pytest.mark.parametrize("use_jit", [False, True])
def test_a_draft_reads_no_position_after_its_anchor(use_jit):
    """The draft from anchor t equals the one computed from the sequence cut after x_{t+1}:
    the head never attends to later positions (what the engine will have when it drafts)."""
    hc, hp = _head()
    embed = jnp.asarray(tiny_params(CFG)["embed"])
    d2t = jnp.arange(VD, dtype=jnp.int32) + 3
    T = 12
    feats = jax.random.normal(jax.random.PRNGKey(1), (1, T, 3 * CFG.hidden_size))
    nxt = jnp.asarray(_seq(T, 2))[None]
    fn = draft_all_anchors
    if use_jit:
        fn = jax.jit(draft_all_anchors, static_argnums=(0, 7))
    tok, p = fn(hc, hp, embed, d2t, feats, nxt, jnp.ones((1, T), bool), 3)
    for t in (0, 4, T - 1):
        valid = jnp.arange(T)[None] <= t
        cut_tok, cut_p = fn(hc, hp, embed, d2t, jnp.where(valid[..., None], feats, 7.0),
                            jnp.where(valid, nxt, 5), valid, 3)
        np.testing.assert_array_equal(cut_tok[0, t], tok[0, t])
        np.testing.assert_allclose(cut_p[0, t], p[0, t], rtol=1e-5)


def test_training_time_test_is_the_drafting_computation():
    """Fed its own argmax as teacher tokens, the training forward gives the drafting logits:
    the loss trains exactly the computation that drafts."""
    hc, hp = _head(3)
    embed = jnp.asarray(tiny_params(CFG)["embed"])
    d2t = jnp.asarray(np.random.default_rng(0).permutation(CFG.vocab_size)[:VD].astype(np.int32))
    T = 10
    feats = jax.random.normal(jax.random.PRNGKey(4), (2, T, 3 * CFG.hidden_size))
    nxt = jnp.asarray(np.stack([_seq(T, 5), _seq(T, 6)]))
    valid = jnp.ones((2, T), bool)
    drafted = run_levels(hc, hp, embed, feats, nxt, valid, 3, draft_to_target=d2t)
    own = jnp.stack([nxt] + [d2t[jnp.argmax(lg, -1)] for lg in drafted[:-1]], axis=-1)
    taught = run_levels(hc, hp, embed, feats, nxt, valid, 3, teacher_tokens_BxTxJ=own)
    for a, b in zip(drafted, taught):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_draft_loss_scores_each_step_against_the_right_position():
    """The loss, recomputed by hand from the step logits: step j of anchor t is scored against
    the teacher at position t + j, only where that position is a target and both exist."""
    from das_jax.draft_head.head import draft_loss
    hc, hp = _head(11)
    embed = jnp.asarray(tiny_params(CFG)["embed"])
    B, T, M, J = 2, 9, 2, 3
    rng = np.random.default_rng(3)
    feats = jnp.asarray(rng.normal(size=(B, T, 3 * CFG.hidden_size)).astype(np.float32))
    tok = np.stack([_seq(T, 12), _seq(T, 13)])
    valid = np.arange(T)[None] < np.array([[9], [7]])
    target = np.zeros((B, T), bool)
    target[:, 3:] = True
    tid = rng.integers(0, VD, (B, T, M)).astype(np.int32)
    tid[0, 5, 1] = -1
    tp = rng.dirichlet(np.ones(M), (B, T)).astype(np.float32)
    loss, _ = draft_loss(hc, hp, embed, feats, jnp.asarray(tok), jnp.asarray(valid),
                         jnp.asarray(target), jnp.asarray(tid), jnp.asarray(tp), J)
    nxt = np.concatenate([tok[:, 1:], np.zeros((B, 1), np.int32)], 1)
    teach = np.stack([np.concatenate([tok[:, j:], np.zeros((B, j), np.int32)], 1)
                      for j in range(1, J + 1)], -1)
    ok_anchor = valid & np.concatenate([valid[:, 1:], np.zeros((B, 1), bool)], 1)
    outs = run_levels(hc, hp, embed, feats, jnp.asarray(nxt), jnp.asarray(ok_anchor), J,
                      teacher_tokens_BxTxJ=jnp.asarray(teach))
    want = 0.0
    for j, lg in enumerate(outs, start=1):
        logp = np.asarray(jax.nn.log_softmax(lg, -1))
        terms = [-sum(tp[b, t + j, m] * logp[b, t, tid[b, t + j, m]] for m in range(M)
                      if tid[b, t + j, m] >= 0)
                 for b in range(B) for t in range(T)
                 if t + j < T and ok_anchor[b, t] and valid[b, t + j] and target[b, t + j]]
        want += 0.8 ** (j - 1) * np.mean(terms)
    want /= sum(0.8 ** (j - 1) for j in range(1, J + 1))
    np.testing.assert_allclose(loss, want, rtol=1e-5)


@pytest.mark.parametrize("use_jit", [False, True])
def test_draft_loss_over_output_anchors_equals_the_whole_sequence(use_jit):
    """Prompts left-padded to end at one column and only the anchors from P - 1 - steps on
    drafted (`first_anchor`, what the fit does): the loss and the head's gradient equal those of
    the right-padded rows drafted from every anchor, for prompts of different lengths."""
    from das_jax.draft_head.head import draft_loss
    hc, hp = _head(21)
    embed = jnp.asarray(tiny_params(CFG)["embed"])
    J, M = 3, 3
    prompts, outputs = (4, 7, 2), (6, 3, 9)        # row lengths differ on both sides
    B, P_pad = len(prompts), max(prompts)
    T_right = max(p + o for p, o in zip(prompts, outputs))
    T_left = P_pad + max(outputs)
    D3 = 3 * CFG.hidden_size

    def layout(T, left):
        arr = {"feats": np.zeros((B, T, D3), np.float32), "tok": np.zeros((B, T), np.int32),
               "valid": np.zeros((B, T), bool), "target": np.zeros((B, T), bool),
               "tid": np.full((B, T, M), -1, np.int32), "tp": np.zeros((B, T, M), np.float32),
               "pos": np.zeros((B, T), np.int32)}
        for b, (P, n_out) in enumerate(zip(prompts, outputs)):
            r = np.random.default_rng(100 + b)
            n = P + n_out
            c = P_pad - P if left else 0
            arr["feats"][b, c:c + n] = r.normal(size=(n, D3))
            arr["tok"][b, c:c + n] = _seq(n, 200 + b)
            arr["valid"][b, c:c + n] = True
            arr["target"][b, c + P - 1:c + n - 1] = True
            arr["tid"][b, c:c + n] = r.integers(0, VD, (n, M))
            arr["tp"][b, c:c + n] = r.dirichlet(np.ones(M), n)
            arr["pos"][b] = np.arange(T) - c
        return {k: jnp.asarray(v) for k, v in arr.items()}

    def loss_fn(params, a, first):
        return draft_loss(hc, params, embed, a["feats"], a["tok"], a["valid"], a["target"],
                          a["tid"], a["tp"], J, pos_BxT=a["pos"], first_anchor=first)

    grad = jax.value_and_grad(loss_fn, has_aux=True)
    if use_jit:
        grad = jax.jit(grad, static_argnums=2)
    (full, m_full), g_full = grad(hp, layout(T_right, False), 0)
    (part, m_part), g_part = grad(hp, layout(T_left, True), P_pad - 1 - J)
    assert float(full) > 0
    np.testing.assert_allclose(part, full, rtol=1e-5)
    for k in m_full:
        np.testing.assert_allclose(m_part[k], m_full[k], rtol=1e-6)
    for k in g_full:
        np.testing.assert_allclose(g_part[k], g_full[k], rtol=2e-4, atol=1e-6, err_msg=k)
    with pytest.raises(ValueError, match="first_anchor"):
        loss_fn(hp, layout(T_left, True), T_left)


def test_cast_weights_casts_the_matrices_and_bfloat16_drafts_stay_close():
    from das_jax.draft_head.head import MATRICES, cast_weights
    hc, hp = _head(5)
    embed = jnp.asarray(tiny_params(CFG)["embed"])
    d2t = jnp.arange(VD, dtype=jnp.int32) + 3
    T = 16
    feats = jax.random.normal(jax.random.PRNGKey(2), (2, T, 3 * CFG.hidden_size))
    nxt = jnp.asarray(np.stack([_seq(T, 7), _seq(T, 8)]))
    valid = jnp.ones((2, T), bool)
    f32 = cast_weights(hp, "float32")
    bf16 = cast_weights(hp, "bfloat16")
    assert {k for k, v in bf16.items() if v.dtype == jnp.bfloat16} == set(MATRICES)
    assert all(bf16[k].dtype == jnp.float32 for k in hp if k not in MATRICES)
    tok, p = draft_all_anchors(hc, hp, embed, d2t, feats, nxt, valid, 3)
    tok32, p32 = draft_all_anchors(hc, f32, embed, d2t, feats, nxt, valid, 3)
    np.testing.assert_array_equal(tok32, tok)          # float32: the same computation
    np.testing.assert_array_equal(p32, p)
    hb = HeadConfig(**{**hc.to_dict(), "feature_layers": hc.feature_layers,
                       "dtype": "bfloat16"})
    tokb, pb = draft_all_anchors(hb, bf16, embed, d2t, feats, nxt, valid, 3)
    assert pb.dtype == jnp.float32
    assert float(jnp.mean(tokb[..., 0] == tok[..., 0])) >= 0.9
    np.testing.assert_allclose(pb[..., 0], p[..., 0], atol=0.05)
    with pytest.raises(ValueError, match="dtype"):
        cast_weights(hp, "float16")
    with pytest.raises(ValueError, match="dtype"):
        HeadConfig(**{**hc.to_dict(), "feature_layers": hc.feature_layers, "dtype": "int8"})
    # a head file of before the field reads as float32
    d = hc.to_dict()
    del d["dtype"]
    assert HeadConfig.from_dict(d).dtype == "float32"


def test_block_features_are_the_policy_forward():
    params = tiny_params(CFG)
    tok = jnp.asarray(np.stack([_seq(9, 1), _seq(9, 2)]))
    valid = jnp.asarray(np.arange(9)[None] < np.array([[9], [6]]))
    feats, ids, probs = block_features(CFG, params, tok, valid, (0, 1, 3), top_m=4)
    h, _ = forward_hidden(CFG, params, tok, jnp.broadcast_to(jnp.arange(9), (2, 9)),
                          valid_BxT=valid)
    logits = lm_head(CFG, params, h)
    D = CFG.hidden_size
    from das_jax.models.transformer import rms_norm
    np.testing.assert_allclose(rms_norm(feats[..., 2 * D:], params["final_norm"], 1e-5), h,
                               rtol=1e-4, atol=1e-4)
    # slots 0 and 1: the outputs of blocks 0 and 1 (a policy cut after that block, renormed)
    for slot, block in ((0, 0), (1, 1)):
        cut = tiny_model_config(num_layers=block + 1)
        cut_params = dict(params, layers=jax.tree_util.tree_map(lambda a: a[:block + 1],
                                                                params["layers"]))
        h_cut, _ = forward_hidden(cut, cut_params, tok, jnp.broadcast_to(jnp.arange(9), (2, 9)),
                                  valid_BxT=valid)
        got = rms_norm(feats[..., slot * D:(slot + 1) * D], params["final_norm"], 1e-5)
        np.testing.assert_allclose(got, h_cut, rtol=1e-4, atol=1e-4)
    # a block named twice fills both its slots
    twice = block_features(CFG, params, tok, valid, (1, 1, 3))
    np.testing.assert_array_equal(twice[..., :D], feats[..., D:2 * D])
    np.testing.assert_array_equal(twice[..., D:2 * D], feats[..., D:2 * D])
    with pytest.raises(ValueError, match="block 4 is outside the model's 4 blocks"):
        block_features(CFG, params, tok, valid, (0, 1, 4))
    np.testing.assert_array_equal(ids[..., 0], jnp.argmax(logits, -1))
    np.testing.assert_allclose(probs[..., 0], jnp.max(jax.nn.softmax(logits, -1), -1),
                               rtol=1e-5)
    # given a draft vocabulary: the policy's distribution conditioned on it, ids into it
    vocab = jnp.asarray([5, 9, 2, 30, 41, 7], jnp.int32)
    _, vid, vp = block_features(CFG, params, tok, valid, (0, 1, 3), top_m=6, vocab_ids=vocab)
    want = jax.nn.softmax(logits[..., vocab], -1)
    np.testing.assert_allclose(vp, -jnp.sort(-want, axis=-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(vid[..., 0], jnp.argmax(want, -1))
    # the batched helper returns each sequence's own rows, in input order
    seqs = [list(_seq(9, 1)), list(_seq(6, 2))[:6]]
    got = sequence_features(CFG, params, seqs, (0, 1, 3), batch=2, bucket=4)
    np.testing.assert_allclose(got[1][0], feats[1, :6], rtol=1e-5, atol=1e-5)


def test_draft_vocabulary_and_problem_split():
    np.testing.assert_array_equal(draft_vocabulary([[5, 5, 7, 9], [7, 5, 9, 2]], 3), [5, 7, 9])
    assert split_problems(["a", "b", "a", "c", "d"], 0.5) == (["a", "b"], ["c", "d"])
    assert split_problems(["a", "b"], 0.0) == (["a", "b"], [])


def _rollouts(epochs=2, problems=4, per=2):
    rng = np.random.default_rng(0)
    motif = {p: list(rng.integers(2, CFG.vocab_size, 5)) for p in range(problems)}
    return [TraceRollout(e, f"p{p}", list(rng.integers(2, CFG.vocab_size, 4)), motif[p] * 5)
            for e in range(epochs) for p in range(problems) for _ in range(per)]


@pytest.fixture(scope="module")
def fitted():
    params = tiny_params(CFG)
    head, history = fit_head(CFG, params, "tiny", _rollouts(),
                             FitConfig(epochs=30, batch=4, lr=1e-2, draft_vocab=VD),
                             holdout_problems=["p3"], log=lambda s: None)
    return params, head, history


def test_fitting_learns_the_policy_and_skips_the_holdout(fitted):
    _, head, history = fitted
    assert history[-1]["loss"] < history[0]["loss"] - 0.1
    assert history[-1]["top1_step1"] > history[0]["top1_step1"]
    assert head.meta["fit_problems"] == ["p0", "p1", "p2"]
    assert head.meta["holdout_problems"] == ["p3"]


def test_head_file_round_trip_and_its_errors(fitted, tmp_path):
    params, head, _ = fitted
    path = str(tmp_path / "h.safetensors")
    save_head(path, head)
    back = load_head(path)
    assert back.config == head.config and back.meta == head.meta
    np.testing.assert_array_equal(back.draft_to_target, head.draft_to_target)
    for k in head.params:
        np.testing.assert_array_equal(back.params[k], head.params[k])
    check_head_for_policy(back, path, "tiny", CFG)
    with pytest.raises(UserError, match="fitted to another model.*num_layers 4 != 30"):
        check_head_for_policy(back, path, "tiny", tiny_model_config(num_layers=30))
    with pytest.raises(UserError, match="fitted to another model.*model 'tiny' != 'other'"):
        check_head_for_policy(back, path, "other", CFG)
    bad = DraftHead(head.config, head.params, head.draft_to_target + CFG.vocab_size,
                    dict(head.meta))
    with pytest.raises(UserError, match="outside tiny's vocabulary of 64"):
        check_head_for_policy(bad, path, "tiny", CFG)
    with pytest.raises(UserError, match="no such file.*draft-head fit"):
        load_head(str(tmp_path / "missing.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(UserError, match="not a das-jax draft head"):
        load_head(str(tmp_path / "junk.safetensors"))


def test_trace_simulation_with_the_head(fitted):
    """The head's drafts are served at the right anchor: an oracle head (drafts = the recorded
    continuation) emits k + 1 tokens per step; the fitted head and the per-row choice run."""
    params, head, _ = fitted
    rs = _rollouts()
    oracle = {}
    for r in rs:
        seq = r.prompt_ids + r.token_ids
        n, k = len(seq), 3
        tok = np.array([[seq[t + 2 + j] if t + 2 + j < n else 0 for j in range(k)]
                        for t in range(n)], np.int32)
        oracle[id(r)] = (tok, np.full((n, k), 0.9, np.float32).cumprod(-1))
    res = simulate_drafts(HeadDrafter(oracle), rs, 3)
    assert res.overall() == pytest.approx(sum(len(r.token_ids) for r in rs) / sum(
        -(-len(r.token_ids) // 4) for r in rs))
    drafts = head_drafts(CFG, params, head, [r.prompt_ids + r.token_ids for r in rs], 3)
    assert all(d[0].shape == (len(r.prompt_ids) + len(r.token_ids), 3)
               for r, d in zip(rs, drafts))
    from das_jax.drafter import make_drafter
    both = HeadDrafter({id(r): d for r, d in zip(rs, drafts)}, make_drafter("das"))
    res = simulate_drafts(both, rs, 16)
    assert sum(both.source_counts.values()) == sum(res.steps.values())


def test_trace_simulation_verifies_both_drafts_as_a_tree():
    """`HeadDrafter(tree=True)`: each step verifies the history's and the head's drafts and
    emits the longer accepted one, so with an oracle head it emits the head's k + 1 tokens
    whatever the history drafts, and it never takes more steps than the per-row choice."""
    rs = _rollouts()
    oracle, half = {}, {}
    for r in rs:
        seq = r.prompt_ids + r.token_ids
        n, k = len(seq), 3
        tok = np.array([[seq[t + 2 + j] if t + 2 + j < n else 0 for j in range(k)]
                        for t in range(n)], np.int32)
        oracle[id(r)] = (tok, np.full((n, k), 0.1, np.float32).cumprod(-1))   # unconfident
        bad = tok.copy()
        bad[::2] = (bad[::2] + 1) % CFG.vocab_size          # every other anchor wrong
        half[id(r)] = (bad, np.full((n, k), 0.9, np.float32).cumprod(-1))
    from das_jax.drafter import make_drafter
    tree = simulate_drafts(HeadDrafter(oracle, make_drafter("das"), tree=True), rs, 3)
    assert tree.overall() == pytest.approx(sum(len(r.token_ids) for r in rs) / sum(
        -(-len(r.token_ids) // 4) for r in rs))
    assert all(tree.drafted[e] >= 3 * tree.steps[e] for e in tree.epochs)   # the head: 3 each
    pick = simulate_drafts(HeadDrafter(oracle, make_drafter("das")), rs, 3)
    assert pick.overall() < tree.overall()          # the unconfident oracle loses the choice
    t2 = simulate_drafts(HeadDrafter(half, make_drafter("das"), tree=True), rs, 3)
    p2 = simulate_drafts(HeadDrafter(half, make_drafter("das")), rs, 3)
    assert sum(t2.steps.values()) <= sum(p2.steps.values())


def test_fit_cli_one_line_errors(tmp_path):
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "das_jax.cli", "draft-head", "fit", *argv],
                              capture_output=True, text=True)
    out = run(str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "h.safetensors"))
    assert out.returncode == 2 and "no such file" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run(str(tmp_path / "nope.jsonl"), "--out", "x.safetensors", "--holdout", "1.5")
    assert out.returncode == 2 and "--holdout" in out.stderr
    out = run(str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "no" / "h.safetensors"))
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert policy_fingerprint("m", CFG)["num_layers"] == 4


@pytest.mark.parametrize("use_jit", [False, True])
def test_the_cached_step_drafts_as_the_whole_sequence_does(use_jit):
    """Committing a sequence's anchors chunk by chunk (as verify steps accept them) and
    drafting after each chunk gives the drafts of `draft_all_anchors` at each chunk's last
    anchor: the rollout's cached step is the computation the head was trained on."""
    from das_jax.draft_head.head import HeadCache, extend_and_draft
    hc, hp = _head(5)
    embed = jnp.asarray(tiny_params(CFG)["embed"])
    d2t = jnp.arange(VD, dtype=jnp.int32) + 2
    T, W = 14, 4
    feats = jax.random.normal(jax.random.PRNGKey(7), (2, T, 3 * CFG.hidden_size))
    nxt = jnp.asarray(np.stack([_seq(T, 8), _seq(T, 9)]))
    want_tok, want_p = draft_all_anchors(hc, hp, embed, d2t, feats, nxt, jnp.ones((2, T), bool), 3)
    step = extend_and_draft
    if use_jit:
        step = jax.jit(extend_and_draft, static_argnums=(0, 8))
    cache = HeadCache.zeros(hc, 2, 32)
    chunks = [(1, 3), (4, 2), (2, 4), (3, 0), (4, 4)]   # anchors committed per row per step
    done = np.zeros(2, int)
    for n0, n1 in chunks:
        n = np.array([n0, n1])
        f = np.zeros((2, W, feats.shape[-1]), np.float32)
        x = np.zeros((2, W), np.int32)
        for b in range(2):
            f[b, :n[b]] = feats[b, done[b]:done[b] + n[b]]
            x[b, :n[b]] = nxt[b, done[b]:done[b] + n[b]]
        cache, tok, p = step(hc, hp, embed, d2t, cache, jnp.asarray(f), jnp.asarray(x),
                             jnp.asarray(n, jnp.int32), 3)
        done += n
        np.testing.assert_array_equal(cache.length_B, done)
        for b in range(2):
            if n[b]:
                np.testing.assert_array_equal(tok[b], want_tok[b, done[b] - 1])
                np.testing.assert_allclose(p[b], want_p[b, done[b] - 1], rtol=1e-4, atol=1e-6)
            else:   # a row that committed nothing has nothing to draft from
                np.testing.assert_array_equal(p[b], 0.0)


def test_bench_head_errors_name_the_input(fitted, tmp_path):
    """`bench drafter --head` without a trace, and with a head of another model than the
    trace's, stop with one line before any model loads."""
    import json
    _, head, _ = fitted
    path = str(tmp_path / "h.safetensors")
    save_head(path, head)
    trace = tmp_path / "trace.jsonl"
    rows = [{"type": "header", "model": "smollm2-135m-instruct"}] + [
        {"epoch": r.epoch, "problem_id": r.problem_id, "prompt_ids": r.prompt_ids,
         "token_ids": r.token_ids} for r in _rollouts()]
    trace.write_text("\n".join(json.dumps(r, default=int) for r in rows) + "\n")

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "das_jax.cli", "bench", "drafter", *argv],
                              capture_output=True, text=True)
    out = run("--head", path)
    assert out.returncode == 2 and "add --trace TRACE" in out.stderr
    out = run("--trace", str(trace), "--head", path, "--drafters", "ngram")
    assert out.returncode == 2, out.stderr
    assert "fitted to 'tiny', the trace was recorded with 'smollm2-135m-instruct'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
