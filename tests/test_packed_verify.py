"""Packed verification: the packed step gives the padded step's tokens and log-probs
with ragged drafts, a row's output does not depend on the other rows' draft lengths, the engine's
packed and padded paths produce the same rollouts, and the step records / calibration use the
packed shapes. Tiny random models, float32, fixed seeds."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.engine import reference
from das_jax.engine import step as step_lib
from das_jax.engine.specs import VerifyBatch, VerifySpec
from das_jax.speculation.cost_model import CostModel, calibrate, calibration_shapes
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.sampling import SamplingParams
from das_jax.engine.schedule import kv_len_bucket, packed_width, step_shape_fn, token_buckets
from das_jax.models import contraction as cx
from das_jax.testing import (AdversaryDrafter, OracleDrafter, kv_by_position, random_kv_cache,
                             tiny_model_config, tiny_params)

CFG = tiny_model_config()
EXACT_CFG = dataclasses.replace(CFG, contraction=cx.EXACT)
SKEY = (0.8, 0, 1.0)
EOS = 1


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def random_cache(B, S, seed):
    return random_kv_cache(CFG, B, S, seed)


def pack(tokens_BxW, n_draft_B, rows, N, B):
    """Flat slots of `rows` (each row's pending token then its drafts), padded to N."""
    t, r, o = [], [], []
    for b in rows:
        for i in range(int(n_draft_B[b]) + 1):
            t.append(tokens_BxW[b, i])
            r.append(b)
            o.append(i)
    pad = N - len(t)
    assert pad >= 0
    return (np.array(t + [0] * pad, np.int32), np.array(r + [B] * pad, np.int32),
            np.array(o + [0] * pad, np.int32))


def run_padded(config, params, cache, cache_len, tokens_BxW, n_draft_B, seeds, kv_len):
    c = jax.tree_util.tree_map(jnp.copy, cache)
    c, y, lp, ne = reference.verify(config, SKEY, kv_len, params, c, cache_len, tokens_BxW,
                                   n_draft_B, seeds)
    return c, np.asarray(y), np.asarray(lp), np.asarray(ne)


def run_packed(config, params, cache, cache_len, tokens_BxW, n_draft_B, seeds, kv_len, rows, N,
               width, wide_rows=0):
    B = cache_len.shape[0]
    t, r, o = pack(tokens_BxW, n_draft_B, rows, N, B)
    c = jax.tree_util.tree_map(jnp.copy, cache)
    spec = VerifySpec(config, SKEY, B, N, width, cache.max_len, kv_len, str(cache.dtype),
                      wide_rows=wide_rows)
    c, y, lp, ne = step_lib.verify_packed(params, c, VerifyBatch(spec, cache_len, t, r, o,
                                                                 n_draft_B, seeds))
    return c, np.asarray(y), np.asarray(lp), np.asarray(ne)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_step_equals_padded_step_with_ragged_drafts(params, exact, seed):
    config = EXACT_CFG if exact else CFG
    rng = np.random.default_rng(seed)
    B, W, S, kv_len = 6, 8, 256, 128
    cache = random_cache(B, S, seed)
    cache_len = rng.integers(1, 120, size=B).astype(np.int32)
    n_draft = rng.integers(0, W, size=B).astype(np.int32)
    n_draft[0], n_draft[1] = 0, W - 1                     # the extremes in every case
    tokens = rng.integers(0, CFG.vocab_size, size=(B, W)).astype(np.int32)
    seeds = rng.integers(0, 2**31 - 1, size=B).astype(np.int32)
    # Make some drafts right, so acceptance is exercised: draft j+1 := the padded step's y_j.
    _, y_ref, _, _ = run_padded(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len)
    for b in range(B):
        cut = int(rng.integers(0, n_draft[b] + 1))
        tokens[b, 1:1 + cut] = y_ref[b, :cut] if cut else tokens[b, 1:1]
    # Rows 4 and 5 are padding rows of the batch bucket in the packed step (no slots).
    live = [0, 1, 2, 3]
    need = int(sum(n_draft[b] + 1 for b in live))
    N = next(n for n in token_buckets(B * W) if n >= need)
    c1, y1, l1, e1 = run_padded(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len)
    c2, y2, l2, e2 = run_packed(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len,
                                live, N, W)
    accepted_any = False
    for b in live:
        n = int(n_draft[b]) + 1
        np.testing.assert_array_equal(y2[b, :n], y1[b, :n])
        np.testing.assert_allclose(l2[b, :n], l1[b, :n], atol=0 if exact else 1e-5, rtol=0)
        assert e2[b] == e1[b]
        accepted_any |= e1[b] > 1
        written = slice(int(cache_len[b]), int(cache_len[b]) + n)
        for a, c, old in zip(kv_by_position(c1), kv_by_position(c2), kv_by_position(cache)):
            np.testing.assert_allclose(c[:, b, :, written], a[:, b, :, written],
                                       atol=0 if exact else 1e-5, rtol=0)
            np.testing.assert_array_equal(c[:, b, :, :cache_len[b]], old[:, b, :, :cache_len[b]])
    if seed == 0:
        assert accepted_any
    # Padding rows' cache rows are untouched by the packed step.
    for b in (4, 5):
        np.testing.assert_array_equal(np.asarray(c2.k[:, b]), np.asarray(cache.k[:, b]))


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("drafting,wide_rows", [((2,), 1), ((0, 5), 2), ((1, 3), 4), ((), 2)],
                         ids=["one-of-1", "two-of-2", "two-of-4", "none-of-2"])
def test_split_query_block_equals_padded_step(params, exact, drafting, wide_rows):
    """A step whose few drafting rows attend in their own `[R, W]` block (the rest at width 1)
    gives the padded step's tokens, log-probs, emitted counts and cache writes; the drafting
    rows include the first and last cache row, and R above their count."""
    config = EXACT_CFG if exact else CFG
    rng = np.random.default_rng(3)
    B, W, S, kv_len = 6, 8, 256, 128
    cache = random_cache(B, S, 4)
    cache_len = rng.integers(1, 120, size=B).astype(np.int32)
    n_draft = np.zeros(B, np.int32)
    for b in drafting:
        n_draft[b] = W - 1 - b % 3
    tokens = rng.integers(0, CFG.vocab_size, size=(B, W)).astype(np.int32)
    seeds = rng.integers(0, 2**31 - 1, size=B).astype(np.int32)
    _, y_ref, _, _ = run_padded(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len)
    for b in drafting:                  # the first drafts right, so acceptance is exercised
        tokens[b, 1] = y_ref[b, 0]
    live = [0, 1, 3, 5] if not drafting or 2 not in drafting else [0, 2, 4]
    live = sorted(set(live) | set(drafting))
    need = int(sum(n_draft[b] + 1 for b in live))
    N = next(n for n in token_buckets(B * W) if n >= need)
    c1, y1, l1, e1 = run_padded(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len)
    c2, y2, l2, e2 = run_packed(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len,
                                live, N, W, wide_rows=wide_rows)
    tol = 0 if exact else 1e-5
    for b in live:
        n = int(n_draft[b]) + 1
        np.testing.assert_array_equal(y2[b, :n], y1[b, :n])
        np.testing.assert_allclose(l2[b, :n], l1[b, :n], atol=tol, rtol=0)
        assert e2[b] == e1[b]
        written = slice(int(cache_len[b]), int(cache_len[b]) + n)
        for a, c in zip(kv_by_position(c1), kv_by_position(c2)):
            np.testing.assert_allclose(c[:, b, :, written], a[:, b, :, written], atol=tol, rtol=0)
    assert all(e1[b] >= 2 for b in drafting)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_row_output_independent_of_other_rows_draft_lengths(params, exact):
    config = EXACT_CFG if exact else CFG
    B, W, S, kv_len = 4, 8, 256, 128
    cache = random_cache(B, S, 7)
    cache_len = np.array([40, 90, 7, 120], np.int32)
    seeds = np.array([11, 12, 13, 14], np.int32)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, CFG.vocab_size, size=(B, W)).astype(np.int32)
    outs = []
    for others in ([0, 0, 0], [7, 7, 7], [3, 0, 5], [1, 6, 2]):
        n_draft = np.array([3] + others, np.int32)
        need = int((n_draft + 1).sum())
        N = next(n for n in token_buckets(B * W) if n >= need)
        _, y, lp, e = run_packed(config, params, cache, cache_len, tokens, n_draft, seeds, kv_len,
                                 range(B), N, W)
        outs.append((y[0, :4], lp[0, :4], e[0]))
    for y, lp, e in outs[1:]:
        np.testing.assert_array_equal(y, outs[0][0])
        np.testing.assert_allclose(lp, outs[0][1], atol=0 if exact else 1e-5, rtol=0)
        assert e == outs[0][2]


class RaggedOracle(OracleDrafter):
    """The oracle's drafts cut to a seeded random length per call (0 .. max_tokens)."""

    def __init__(self, futures, seed=0):
        super().__init__(futures)
        self.rng = np.random.default_rng(seed)

    def propose(self, request_id, max_tokens):
        d = super().propose(request_id, max_tokens)
        k = int(self.rng.integers(0, len(d.tokens) + 1))
        return dataclasses.replace(d, tokens=d.tokens[:k], probs=d.probs[:k])


def make_requests(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 20)))),
                    problem_id=f"p{i // 2}", sample_index=i % 2) for i in range(n)]


def engine(params, **kw):
    ec = dict(max_slots=4, max_cache_len=256, draft_widths=(1, 4))
    ec.update(kw)
    return Engine(CFG, params, eos_token_ids=[EOS], engine_config=EngineConfig(**ec))


def test_generate_packed_equals_padded_and_plain(params):
    sampling = SamplingParams(temperature=0.8, max_new_tokens=16)
    reqs = make_requests(5)
    base, _ = engine(params).generate(reqs, sampling)
    futures = {i: o.token_ids for i, o in enumerate(base)}
    results = {}
    eng = engine(params)
    for mode in ("packed", "padded"):
        for name, drafter in (("oracle", RaggedOracle(futures, seed=3)),
                              ("adversary", AdversaryDrafter(64, seed=1))):
            if mode == "packed":
                outs, stats = eng.generate(reqs, sampling, drafter=drafter)
            else:   # the padded verify, the oracle (`das_jax.engine.reference`)
                outs, stats = reference.generate(eng, reqs, sampling, drafter=drafter,
                                                 padded_prefill=False)
            results[mode, name] = (outs, stats)
            for o, b in zip(outs, base):
                assert o.token_ids == b.token_ids and o.finish_reason == b.finish_reason
                # plain decoding ran other step shapes (fast mode: ~1e-6 relative)
                np.testing.assert_allclose(o.logprobs, b.logprobs, atol=1e-4)
    # Same drafts (same seeds) in both modes: the same tokens, log-probs within 1e-5, accepted
    # counts and forward passes.
    for name in ("oracle", "adversary"):
        for p, d in zip(results["packed", name][0], results["padded", name][0]):
            assert p.token_ids == d.token_ids
            np.testing.assert_allclose(p.logprobs, d.logprobs, atol=1e-5, rtol=0)
        sp, sd = results["packed", name][1], results["padded", name][1]
        assert sp.forward_passes == sd.forward_passes
        assert sp.accepted_draft_tokens == sd.accepted_draft_tokens
    # Packed steps compute only the live rows' own tokens; padded ones B x W.
    packed_steps = results["packed", "oracle"][1].steps
    padded_steps = results["padded", "oracle"][1].steps
    assert results["packed", "oracle"][1].accepted_draft_tokens > 0
    for s in packed_steps:
        assert s.active + s.drafted <= s.num_tokens <= s.batch * s.width
        assert s.attended_kv == s.batch * s.kv_len
    assert (sum(s.num_tokens for s in packed_steps)
            < sum(s.batch * s.width for s in padded_steps))


class FewRowsOracle(RaggedOracle):
    """The ragged oracle's drafts for every third request only (the rest draft nothing), so a
    step's drafting rows are few: the split query block's case."""

    def propose(self, request_id, max_tokens):
        d = super().propose(request_id, max_tokens)
        return d if request_id % 3 == 0 else dataclasses.replace(d, tokens=d.tokens[:0],
                                                                 probs=d.probs[:0])


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_split_query_block_in_generate_changes_no_token(params, kv_cache):
    """`wide_row_buckets`: steps where a few of 8 rows draft run the split query block (a
    `[B, 1]` and an `[R, W]` attention block); in exact mode the tokens and log-probs are those
    of one `[B, W]` block bit for bit, with the same forward passes and accepted drafts; the
    records carry R and the policy's cost model keys the shape by it."""
    sampling = SamplingParams(temperature=0.9, max_new_tokens=12, seed=4)
    reqs = make_requests(10, seed=2)
    kw = dict(max_slots=8, draft_widths=(1, 8), exact=True, kv_cache=kv_cache)
    config = EXACT_CFG
    base, _ = Engine(config, params, eos_token_ids=[EOS],
                     engine_config=EngineConfig(max_cache_len=256, **kw)).generate(reqs, sampling)
    futures = {i: o.token_ids for i, o in enumerate(base)}
    res = {}
    for wide in ((), (2, 4)):
        eng = Engine(config, params, eos_token_ids=[EOS],
                     engine_config=EngineConfig(max_cache_len=256, wide_row_buckets=wide, **kw))
        res[wide] = eng.generate(reqs, sampling, drafter=FewRowsOracle(futures, seed=1))
    (one, s_one), (split, s_split) = res[()], res[(2, 4)]
    for a, b, c in zip(one, split, base):
        assert a.token_ids == b.token_ids == c.token_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert s_one.forward_passes == s_split.forward_passes
    assert s_one.accepted_draft_tokens == s_split.accepted_draft_tokens > 0
    assert all(s.wide_rows == 0 for s in s_one.steps)
    wide_steps = [s for s in s_split.steps if s.wide_rows]
    assert wide_steps and all(s.wide_rows in (2, 4) and s.width == 8 and s.batch == 8
                              for s in wide_steps)
    assert all(s.wide_rows == 0 for s in s_split.steps if s.width == 1)
    assert s_split.split_steps == len(wide_steps) == s_split.to_dict()["split_steps"]
    assert s_one.split_steps == 0


def test_schedule_helpers():
    assert token_buckets(128) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert token_buckets(1) == (1,) and token_buckets(5) == (1, 2, 4, 5)
    assert packed_width([0, 0], (1, 4, 8)) == 1
    assert packed_width([3, 0], (1, 4, 8)) == 4 and packed_width([4], (1, 4, 8)) == 8
    # One row drafting 7 among 16: 23 slots -> bucket 24, not 16 x 8 = 128.
    assert step_shape_fn(16, 256, (1, 4, 8))([7] + [0] * 15) == (24, 16 * 256)
    # The split query block: R holds the drafting rows, and computes < half the block's rows.
    from das_jax.engine import wide_rows_for
    assert wide_rows_for([7] + [0] * 15, 16, 8, (2, 4, 8)) == 2
    assert wide_rows_for([7, 3, 1] + [0] * 13, 16, 8, (2, 4, 8)) == 4
    assert wide_rows_for([7] * 5 + [0] * 11, 16, 8, (2, 4, 8)) == 0    # 2 (16 + 64) >= 128
    assert wide_rows_for([3, 3] + [0] * 14, 16, 4, (2, 4, 8)) == 2     # 2 (16 + 8) < 64
    assert wide_rows_for([3] * 3 + [0] * 13, 16, 4, (2, 4, 8)) == 0    # R = 4: 2 (16 + 16) = 64
    assert wide_rows_for([0] * 16, 16, 1, (2, 4, 8)) == 0
    assert wide_rows_for([7] + [0] * 15, 16, 8, ()) == 0
    assert wide_rows_for([7, 0], 2, 8, (2,)) == 0                      # R must be < B
    shape = step_shape_fn(16, 256, (1, 4, 8), wide_buckets=(2, 4, 8))
    n_CxA = np.array([[7] + [0] * 15, [7, 3, 1] + [0] * 13, [7] * 5 + [0] * 11, [0] * 16,
                      [3, 3] + [0] * 14])
    many = shape.many(n_CxA)
    for c, n in enumerate(n_CxA):
        one = shape(n)
        assert (tuple(one), one.width, one.wide_rows) == (
            (many[0][c], many[1][c]), many[2][c], many[3][c])
    assert many[3].tolist() == [2, 4, 0, 0, 2]
    for n in range(1, 5000, 37):
        b = kv_len_bucket(np.array([n, 1]), 1 << 14)
        assert b >= n and b % 128 == 0
        assert b <= max(128, 1.25 * n) or n <= 512 and b - n < 128
    assert kv_len_bucket(np.array([300]), 256) == 256  # capped at the cache length


class RecordingCostModel:
    """Records `observe_step` calls (the shared cost-model contract)."""

    c_base = c_tok = c_kv = 0.0

    def __init__(self):
        self.steps = []

    def observe_step(self, num_tokens, attended_kv, seconds, width=None):
        self.steps.append((num_tokens, attended_kv, seconds))

    def fit(self):
        pass


def test_calibrate_times_packed_shapes(params):
    eng = engine(params, max_slots=4, draft_widths=(1, 4))
    shapes = calibration_shapes(eng, (4,), (1, 4), (128,))
    # plain (N = B, W = 1), then per width W the first drafting slot bucket above B (one of
    # the shapes `Engine.precompile` compiles).
    assert shapes == [(4, 1, 4, 128), (4, 4, 8, 128)]
    assert calibration_shapes(eng, (16,), (1, 8), (128,)) == [
        (16, 1, 16, 128), (16, 8, 24, 128)]
    assert calibration_shapes(eng, (2,), (1, 4, 8), (128,)) == [
        (2, 1, 2, 128), (2, 4, 4, 128), (2, 8, 4, 128)]
    rec = calibrate(eng, RecordingCostModel(), cache_len=256, batches=(4,), kv_lens=(128,),
                    repeats=1)
    assert len(rec.steps) == len(shapes)
    assert {(n, a) for n, a, _ in rec.steps} == {(n, b * s) for b, _, n, s in shapes}
    assert all(t > 0 for _, _, t in rec.steps)
    # The current CostModel (no observe_step yet) is fitted on the same step terms.
    cm = calibrate(eng, CostModel(), cache_len=256, batches=(4,), kv_lens=(128,), repeats=1)
    assert len(cm.observations) == len(shapes)
    assert cm.c_base >= 0 and cm.c_tok >= 0 and cm.c_kv >= 0
    # Each shape compiled by the calibration is a measured compile time (a cache length no
    # other test uses, so every shape is new); a second calibration compiles nothing.
    fresh = calibrate(eng, CostModel(compile_s=99.0), cache_len=232, batches=(4,),
                      kv_lens=(128,), repeats=1)
    assert fresh.compile_count == len(shapes) and 0 < fresh.compile_s < 99.0
    again = calibrate(eng, CostModel(compile_s=99.0), cache_len=232, batches=(4,),
                      kv_lens=(128,), repeats=1)
    assert again.compile_count == 0 and again.compile_s == 99.0


def test_padded_verify_is_not_an_engine_mode():
    """The padded verify is the tests' oracle (`engine.reference`), not a setting."""
    from das_jax.config import ConfigError, config_from_dict
    with pytest.raises(ConfigError, match="unknown key 'rollout.verify'"):
        config_from_dict({}, ["rollout.verify=padded"])
    with pytest.raises(TypeError):
        EngineConfig(verify="padded")
