"""Engine: token identity under speculation, exact sampling distribution, batch invariance,
log-probs, bad input. Tiny random models, float32, fixed seeds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.engine import sampling as sampling_lib
from das_jax.engine import reference
from das_jax.engine.generate import Engine, EngineConfig, GenerateError, Request
from das_jax.engine.sampling import SamplingError, SamplingParams
from das_jax.models import KVCache, ModelConfig, forward, init_params
from das_jax.testing import AdversaryDrafter, OracleDrafter, tiny_model_config, tiny_params

CFG = tiny_model_config()
EOS = 1


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def make_requests(n=7, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 20)))),
                    problem_id=f"p{i // 3}", sample_index=i % 3) for i in range(n)]


def engine(params, **kw):
    ec = dict(max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8))
    ec.update(kw)
    return Engine(CFG, params, eos_token_ids=[EOS], engine_config=EngineConfig(**ec))


SAMPLINGS = [
    SamplingParams(temperature=0.0, max_new_tokens=32),
    SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=32),
    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=32),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.6", "t1.0"])
def test_speculation_never_changes_tokens(params, sampling):
    eng = engine(params)
    reqs = make_requests()
    base, base_stats = eng.generate(reqs, sampling)
    assert base_stats.forward_passes > 0 and base_stats.accepted_draft_tokens == 0
    assert {o.finish_reason for o in base} <= {"stop", "length"}
    futures = {i: o.token_ids for i, o in enumerate(base)}
    for widths in [(1, 2), (1, 4, 8)]:
        eng_w = engine(params, draft_widths=widths)
        oracle, o_stats = eng_w.generate(reqs, sampling, drafter=OracleDrafter(futures))
        adversary, a_stats = eng_w.generate(reqs, sampling, drafter=AdversaryDrafter(64, seed=1))
        for b, o, a in zip(base, oracle, adversary):
            assert o.token_ids == b.token_ids and a.token_ids == b.token_ids
            assert o.finish_reason == b.finish_reason == a.finish_reason
            np.testing.assert_allclose(o.logprobs, b.logprobs, atol=1e-4)
        # The oracle's drafts are always right: far fewer forward passes.
        assert o_stats.forward_passes < base_stats.forward_passes / (max(widths) / 2)
        assert o_stats.accepted_draft_tokens > 0
        assert a_stats.drafted_tokens > 0


def test_stop_tokens_and_length(params):
    eng = engine(params)
    reqs = make_requests(3)
    out, _ = eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=5))
    for o in out:
        assert len(o.token_ids) <= 5
        assert o.finish_reason == ("stop" if o.token_ids[-1] == EOS else "length")
        assert EOS not in o.token_ids[:-1]
    # A user stop token ends the rollout right after it is emitted.
    first = out[0].token_ids[0]
    out2, _ = eng.generate(reqs[:1], SamplingParams(temperature=1.0, max_new_tokens=5,
                                                     stop_token_ids=(first,)))
    assert out2[0].token_ids == [first] and out2[0].finish_reason == "stop"


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.6"])
def test_batch_invariance(params, sampling):
    reqs = make_requests(9, seed=3)
    ref, _ = engine(params, max_slots=8).generate(reqs, sampling)
    alone = [engine(params, max_slots=1).generate([r], sampling)[0][0] for r in reqs[:4]]
    for a, r in zip(alone, ref):
        assert a.token_ids == r.token_ids
    # Different neighbours, order and slot count.
    mixed, _ = engine(params, max_slots=2).generate(reqs[::-1] + make_requests(3, seed=9), sampling)
    for m, r in zip(mixed[:9][::-1], ref):
        assert m.token_ids == r.token_ids


def test_logprobs_match_teacher_forced_forward(params):
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16)
    reqs = make_requests(3)
    out, _ = engine(params).generate(reqs, sampling, drafter=AdversaryDrafter(64))
    for o in out:
        seq = list(o.request.prompt_ids) + o.token_ids
        toks = jnp.asarray([seq], jnp.int32)
        logits, _ = forward(CFG, params, toks, jnp.arange(len(seq))[None])
        P = len(o.request.prompt_ids)
        # reported log-probs are the policy's (temperature-scaled full softmax, what the trainer
        # scores), while every token lies in the top-k / top-p support it was drawn from
        logp = jax.nn.log_softmax(logits[0, P - 1:-1] / 0.7, axis=-1)
        expected = np.take_along_axis(np.asarray(logp), np.asarray(o.token_ids)[:, None], 1)[:, 0]
        np.testing.assert_allclose(o.logprobs, expected, atol=1e-4)
        support = sampling_lib.processed_logprobs(logits[0, P - 1:-1], 0.7, 20, 0.9)
        assert np.all(np.isfinite(np.take_along_axis(np.asarray(support), np.asarray(o.token_ids)[:, None], 1)))


CHI2_CRIT_DF15_P001 = 37.697  # chi-square critical value, 15 degrees of freedom, p = 0.001


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


def test_sampling_distribution_is_exact_plain_and_speculative():
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)
    params = init_params(cfg, jax.random.PRNGKey(1), scale=0.1)
    prompt = np.array([[3, 5, 7, 2]], np.int32)
    logits, _ = forward(cfg, params, jnp.asarray(prompt), jnp.arange(4)[None])
    probs_first = np.asarray(jax.nn.softmax(logits[0, -1]))
    assert probs_first.min() > 0.01  # every cell has a healthy expected count
    N = 4000
    seeds = np.arange(N, dtype=np.int32)
    # Plain path: the first token, sampled after prefill.
    cache = KVCache.zeros(cfg, N, 16)
    cache, first, _ = reference.prefill_insert(
        cfg, (1.0, 0, 1.0), params, cache, jnp.asarray(prompt), jnp.array([4], jnp.int32),
        jnp.arange(N, dtype=jnp.int32), jnp.zeros(N, jnp.int32), jnp.asarray(seeds))
    counts = np.bincount(np.asarray(first), minlength=16)
    assert _chi2(counts, probs_first) < CHI2_CRIT_DF15_P001
    # Speculative path: feed a fixed pending token plus 3 draft tokens; y_0 must follow the
    # model's distribution at that position whatever the draft.
    pending = 9
    ctx = np.array([[3, 5, 7, 2, pending]], np.int32)
    logits2, _ = forward(cfg, params, jnp.asarray(ctx), jnp.arange(5)[None])
    probs_next = np.asarray(jax.nn.softmax(logits2[0, -1]))
    toks = np.tile(np.array([[pending, 4, 4, 4]], np.int32), (N, 1))
    cache, y, _, n_emit = reference.verify(
        cfg, (1.0, 0, 1.0), 16, params, cache, jnp.full((N,), 4, jnp.int32), jnp.asarray(toks),
        jnp.full((N,), 3, jnp.int32), jnp.asarray(seeds))
    y0 = np.asarray(y)[:, 0]
    counts2 = np.bincount(y0, minlength=16)
    assert _chi2(counts2, probs_next) < CHI2_CRIT_DF15_P001
    # Acceptance of draft token 4 happens exactly when it was sampled.
    np.testing.assert_array_equal(np.asarray(n_emit) > 1, y0 == 4)


def test_top_p_threshold_is_exact():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(50, 0.3), size=8).astype(np.float32)
    for top_p in (0.3, 0.6, 0.9):
        tau = np.asarray(sampling_lib._top_p_threshold(jnp.asarray(probs), top_p))[:, 0]
        for row, t in zip(probs, tau):
            assert t in row  # the threshold is one of the row's probabilities
            assert row[row >= t].sum() >= top_p  # the nucleus reaches top_p ...
            assert row[row > t].sum() < top_p  # ... and no smaller nucleus does


def test_request_seed_is_stable_and_position_keyed():
    assert sampling_lib.request_seed(0, "p1", 2) == sampling_lib.request_seed(0, "p1", 2)
    assert sampling_lib.request_seed(0, "p1", 2) != sampling_lib.request_seed(0, "p1", 3)
    assert sampling_lib.request_seed(1, "p1", 2) != sampling_lib.request_seed(0, "p1", 2)
    u1 = sampling_lib.uniforms(jnp.array([5, 5, 6]), jnp.array([10, 11, 10]))
    u2 = sampling_lib.uniforms(jnp.array([5]), jnp.array([10]))
    assert float(u1[0]) == float(u2[0]) and len(set(np.asarray(u1).tolist())) == 3


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_sampling_params(bad, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**bad)


def test_bad_requests_fail_before_compiling(params):
    eng = engine(params)
    sp = SamplingParams(max_new_tokens=8)
    with pytest.raises(GenerateError, match="empty prompt"):
        eng.generate([Request(())], sp)
    with pytest.raises(GenerateError, match="max_cache_len"):
        eng.generate([Request(tuple([2] * 300))], sp)
    with pytest.raises(GenerateError, match="no requests"):
        eng.generate([], sp)
    with pytest.raises(GenerateError, match="vocabulary"):
        eng.generate([Request((2, 999))], sp)
    with pytest.raises(SamplingError, match="stop token"):
        eng.generate([Request((2, 3))], SamplingParams(stop_token_ids=(5000,)))
    assert eng.programs.compile_s == 0.0
