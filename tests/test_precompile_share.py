"""Fewer engine programs, compiled before the first step (what the main job's rollout time
with das vs none turns on), and prompt sharing at admission: `Engine.precompile` compiles every packed
verify program a `generate` call reaches (so none compiles inside its steps), the packed verify
runs on N = B without drafts (slot buckets above B with drafts), and a request whose
prompt a cache row holds is admitted by a row copy (`step.share_prompt_rows`) with the same
rollouts. Tiny random models, float32, fixed seeds."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.engine import programs as programs_lib
from das_jax.engine import step as step_lib
from das_jax.engine.schedule import share_order
from das_jax.engine.specs import DecodeSpec, PrefillSpec, ShareBatch, ShareSpec, VerifySpec
from das_jax.speculation.cost_model import (calibration_shapes,
                                           calibration_wide_rows)
from das_jax.engine.generate import Engine, EngineConfig
from das_jax.engine.policy import FixedPolicy
from das_jax.engine.sampling import SamplingParams, sample
from das_jax.engine.schedule import precompile_token_buckets, step_shape_fn, verify_token_buckets
from das_jax.testing import AdversaryDrafter, random_kv_cache, random_requests, tiny_model_config
from das_jax.testing import tiny_params

CFG = tiny_model_config()
EOS = 1


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def engine(params, **kw):
    ec = dict(max_slots=4, max_cache_len=256, draft_widths=(1, 4))
    ec.update(kw)
    return Engine(CFG, params, eos_token_ids=[EOS], engine_config=EngineConfig(**ec))


def verify_keys():
    """The compiled step programs: packed verify, and multi-step decode (plain decoding)."""
    return {k for k in programs_lib.COMPILED if isinstance(k[0], (VerifySpec, DecodeSpec))}


def test_verify_buckets():
    assert verify_token_buckets(16, 8) == (16, 24, 32, 48, 64, 96, 128)
    assert verify_token_buckets(16, 1) == (16,)
    assert precompile_token_buckets(16, 8) == (16, 24, 32, 48)
    assert precompile_token_buckets(4, 8) == (4, 8)
    assert precompile_token_buckets(1, 8) == (1, 2, 4, 8)
    shape = step_shape_fn(16, 128, (1, 4, 8))
    assert shape(np.zeros(9, np.int32)) == (16, 16 * 128)      # 9 live rows, no drafts: N = B
    assert shape(np.array([7] + [0] * 15)) == (24, 16 * 128)
    assert shape(np.full(16, 7)) == (128, 16 * 128)            # every draft fits


def test_calibration_shapes_are_precompiled(params):
    eng = engine(params, max_slots=16, draft_widths=(1, 4, 8))
    reqs = random_requests(problems=8, samples=4, seed=0)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=16)
    shapes = set(eng.verify_shapes(reqs, sampling, drafting=True))
    kv = sorted({s[3] for s in shapes})
    assert kv == [128] and {s[0] for s in shapes} == {1, 2, 4, 8, 16}
    assert {s[2] for s in shapes} == {1, 4, 8}
    assert all(N <= B * W for B, N, W, _, _ in shapes)
    calibrated = [(B, N, W, S, calibration_wide_rows(eng, B, W, N))
                  for B, W, N, S in calibration_shapes(eng, (1, 16), (1, 4, 8), kv)]
    assert (16, 24, 8, 128, 2) in calibrated and (16, 24, 4, 128, 2) in calibrated
    assert all(c in shapes for c in calibrated)
    # split query blocks (wide_row_buckets 2, 4, 8): R where 2 (B + R W) < B W, with the slot
    # buckets B < N <= bucket(B + R (W - 1))
    split = {(B, W, R): sorted(N for b, N, w, _, r in shapes if (b, w, r) == (B, W, R))
             for B, _, W, _, R in shapes if R}
    assert set(split) == {(16, 4, 2), (16, 8, 2), (16, 8, 4), (8, 8, 2)}
    assert split[(16, 8, 2)] == [24, 32] and split[(16, 8, 4)] == [24, 32, 48]
    plain = eng.verify_shapes(reqs, sampling, drafting=False)
    assert plain == [(B, B, 1, 128, 0) for B in (16, 8, 4, 2, 1)]


@pytest.mark.parametrize("drafting", [True, False])
def test_precompile_covers_generate(params, drafting):
    """After `precompile`, a generate call compiles no verify program (drafts of one token per
    row keep N <= 2B, within the precompiled slot buckets)."""
    eng = engine(params, precompile=True, draft_widths=(1, 3))
    reqs = random_requests(problems=3, samples=3, seed=5)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=10, seed=3)
    n = eng.precompile(reqs, sampling, drafting=drafting)
    assert n <= (len(eng.verify_shapes(reqs, sampling, drafting))
                 + len(eng.refill_prefill_shapes(reqs, sampling)))
    assert eng.precompile(reqs, sampling, drafting=drafting) == 0      # all compiled now
    refills = eng.refill_prefill_shapes(reqs, sampling)     # 9 requests through 4 slots
    assert refills and all(B == 4 for B, _, _ in refills)
    prefills = {(s.batch, s.cache_len, s.num_tokens, s.rows, s.width)
                for s, *_ in programs_lib.COMPILED if isinstance(s, PrefillSpec)}
    S = eng.cache_len_for(reqs, sampling)
    assert all((B, S, N, 1, T) in prefills for B, N, T in refills)
    before = verify_keys()
    drafter = AdversaryDrafter(CFG.vocab_size, seed=2) if drafting else None
    outs, stats = eng.generate(reqs, sampling, drafter=drafter,
                               policy=FixedPolicy(max_draft=1) if drafting else None)
    assert verify_keys() == before
    if drafting:
        assert stats.drafted_tokens > 0
    # precompile=True changes no token
    ref, _ = engine(params, draft_widths=(1, 3)).generate(
        reqs, sampling, drafter=AdversaryDrafter(CFG.vocab_size, seed=2) if drafting else None,
        policy=FixedPolicy(max_draft=1) if drafting else None)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize("exact", [True])
def test_share_prompts_same_rollouts(params, exact):
    """3 prompts x 4 samples through 4 slots: siblings admitted after their group's first
    are copied, not prefilled; tokens are the same (log-probs too: exact mode bit for bit)."""
    reqs = random_requests(problems=3, samples=4, seed=7)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=8, seed=11)
    res = {}
    for share in (True, False):
        eng = engine(params, share_prompts=share, exact=exact)
        res[share] = eng.generate(reqs, sampling, drafter=AdversaryDrafter(CFG.vocab_size, 3))
    (so, ss), (no, ns) = res[True], res[False]
    assert ss.prefill_tokens < ns.prefill_tokens
    for a, b in zip(so, no):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        if exact:
            assert a.logprobs == b.logprobs
        else:
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)


def test_share_prompt_rows_copies_and_samples():
    """A swap of rows works (one row through the stash), padding entries are dropped, only
    the prompt positions [0, width) are copied, and the first tokens are `sample` of the given
    logits at the given positions."""
    B, S, V, width = 4, 16, CFG.vocab_size, 8
    cache = random_kv_cache(CFG, B, S, seed=0)
    k0, v0 = np.asarray(cache.k), np.asarray(cache.v)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    seeds = np.array([5, 6], np.int32)
    lengths = np.array([3, 8], np.int32)
    dst, src = [0, 1], [1, 0]                   # swap rows 0 and 1; two padding entries
    order, save, from_stash, dropped = share_order(dst, src)
    assert (order, save, from_stash, dropped) == ([0, 1], [True, False], [False, True], [])
    skey = (0.8, 0, 1.0)
    spec = ShareSpec(CFG, skey, B, width, S, str(cache.dtype))
    new, tok, logp = step_lib.share_prompt_rows(
        None, cache, ShareBatch.pack(spec, dst, src, list(logits[:2]), seeds, lengths, save,
                                     from_stash))
    k, v = np.asarray(new.k), np.asarray(new.v)
    np.testing.assert_array_equal(k[:, 0, ..., :width], k0[:, 1, ..., :width])
    np.testing.assert_array_equal(k[:, 1, ..., :width], k0[:, 0, ..., :width])
    np.testing.assert_array_equal(v[:, 0, :, :width], v0[:, 1, :, :width])
    np.testing.assert_array_equal(v[:, 1, :, :width], v0[:, 0, :, :width])
    np.testing.assert_array_equal(k[..., width:], k0[..., width:])   # past the prompt: kept
    np.testing.assert_array_equal(v[:, :, :, width:], v0[:, :, :, width:])
    np.testing.assert_array_equal(k[:, 2:], k0[:, 2:])
    ref_tok, ref_logp = sample(np.concatenate([logits[:2], np.zeros((2, V), np.float32)]),
                               np.array([5, 6, 0, 0], np.int32), np.array([3, 8, 1, 1], np.int32),
                               skey, CFG.contraction)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(ref_logp))


@pytest.mark.parametrize("dst,src", [
    ([0, 1, 2], [1, 2, 0]),                   # a 3-cycle
    ([0, 1, 2, 3], [1, 0, 3, 2]),             # two swaps: the stash is used twice
    ([0, 1, 2], [3, 3, 0]),                   # a chain: readers of row 0 run before its writer
    ([2, 3], [0, 0]),                         # siblings copying one holder
])
def test_share_order_copies_equal_a_read_before_write_copy(dst, src):
    """Running the copies in `share_order`'s order with its stash flags gives the cache a
    copy reading every row before any write gives; left-out copies are the only difference."""
    B, S, width = 4, 8, 8
    cache = random_kv_cache(CFG, B, S, seed=1)
    k0 = np.asarray(cache.k)
    order, save, from_stash, dropped = share_order(dst, src)
    assert sorted(order + dropped) == list(range(len(dst)))
    assert dropped == []   # cycles unroll once their stashed row is written
    d = [dst[j] for j in order]
    new = cache.copy_prefix(jnp.asarray(d + [B] * (B - len(d)), jnp.int32),
                            jnp.asarray([src[j] for j in order] + [0] * (B - len(d)), jnp.int32),
                            jnp.asarray([save[j] for j in order] + [False] * (B - len(d))),
                            jnp.asarray([from_stash[j] for j in order] + [False] * (B - len(d))),
                            width)
    want = k0.copy()
    for j in order:
        want[:, dst[j]] = k0[:, src[j]]
    np.testing.assert_array_equal(np.asarray(new.k), want)


def _split_reference(rows, prompts, targets_rows):
    """`PromptRows.split` by a plain scan over the rows' prompts as tuples (its definition)."""
    targets = {int(r) for r in targets_rows}
    holder = {}
    for r, p in enumerate(rows):
        if p is not None and (p not in holder or (holder[p] in targets and r not in targets)):
            holder[p] = r
    keys = [tuple(int(t) for t in p) for p in prompts]
    shared = [k for k, p in enumerate(keys) if p in holder]
    computed = [k for k, p in enumerate(keys) if p not in holder]
    order, save, from_stash, dropped = share_order([int(targets_rows[k]) for k in shared],
                                                   [holder[keys[k]] for k in shared])
    computed = sorted(computed + [shared[j] for j in dropped])
    shared = [shared[j] for j in order]
    return (shared, [holder[keys[k]] for k in shared], computed,
            ([save[j] for j in order], [from_stash[j] for j in order]))


def test_prompt_rows_split_equals_a_scan_of_the_rows():
    """Admissions, releases (a paged row gives its prompt back), compactions and prompts as
    lists, tuples and int arrays: `split` gives what a scan of the rows' prompts as tuples
    gives, equal prompts are one object, and the interned prompts stay bounded (many distinct
    prompts through 8 rows)."""
    from das_jax.engine.schedule import Prompt, PromptRows
    rng = np.random.default_rng(0)
    B = 8
    pool = [tuple(int(t) for t in rng.integers(0, 50, size=int(rng.integers(1, 6))))
            for _ in range(40)]
    pr = PromptRows(B)
    for it in range(300):
        n = int(rng.integers(1, 4))
        rows = [int(r) for r in rng.choice(len(pr.rows), size=min(n, len(pr.rows)),
                                           replace=False)]
        chosen = [pool[int(i)] for i in rng.integers(0, 6 if it < 150 else 40, size=len(rows))]
        prompts = [list(p) if k % 3 == 0 else np.array(p, np.int64) if k % 3 == 1 else p
                   for k, p in enumerate(chosen)]
        want = _split_reference([None if p is None else tuple(p) for p in pr.rows], prompts,
                                rows)
        assert pr.split(prompts, rows) == want
        pr.admit(rows, prompts)
        assert [pr.rows[r] for r in rows] == chosen
        assert all(isinstance(pr.rows[r], Prompt) for r in rows)
        held = [p for p in pr.rows if p is not None]
        for p in held:   # one object per distinct prompt
            assert all(q is p for q in held if q == p)
        assert len(pr._interned) <= 2 * len(pr.rows) + 3
        if it % 17 == 5:
            pr.rows[int(rng.integers(0, len(pr.rows)))] = None
        if it % 50 == 49:
            live = sorted(int(r) for r in rng.choice(B, size=5, replace=False))
            pr.compact(live, 8)
    assert hash(Prompt((3, 4))) == hash((3, 4)) and Prompt((3, 4)) == (3, 4)
