"""The paged KV cache (`rollout.kv_cache: paged`): the page pool's bookkeeping, the cache's
operations against the dense cache's, and whole rollouts equal to the dense cache's (tokens
identical, log-probs within 1e-5, bitwise in exact mode) with drafts, prompt sharing and
compaction. Tiny random models, float32, fixed seeds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.config import ConfigError, config_from_dict
from das_jax.engine.generate import EngineConfig, GenerateError, Request
from das_jax.engine.pages import PagePool, PoolExhausted
from das_jax.engine.paged_executor import PagedExecutor
from das_jax.engine.sampling import SamplingParams
from das_jax.models.kv_cache import DenseKVCache
from das_jax.models.paged_attention import PagedView
from das_jax.models.paged_kv_cache import PagedKVCache
from das_jax.testing import (AdversaryDrafter, OracleDrafter, paged_kv_cache_like,
                             random_kv_cache, random_requests, tiny_engine, tiny_model_config,
                             tiny_params)

EOS = 1


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def engine(params, **kw):
    return tiny_engine(params, eos_token_id=EOS, **kw)


# ---------------------------------------------------------------------- the pool
def test_pool_allocates_shares_and_frees():
    pool = PagePool(num_pages=12, page_size=4, batch=3, max_len=16)
    pool.ensure([0, 1], [5, 4])                  # 2 pages + 1 page
    assert pool.used_pages == 3 and list(pool.held) == [2, 1, 0]
    assert sorted(pool.refs[pool.row_pages(0)]) == [1, 1]
    copy, = pool.share([2], [0], [6])            # one full page shared, a fresh partial one
    assert copy == (int(pool.table[0, 1]), int(pool.table[2, 1]))
    assert pool.table[2, 0] == pool.table[0, 0] and pool.refs[pool.table[0, 0]] == 2
    assert pool.share([1], [0], [4]) == [None]   # ends on a page boundary: nothing to copy
    assert pool.used_pages == 3                  # row 1's own page went back to the pool
    pool.ensure([0], [9])                        # grows by one page; nothing already held moves
    assert pool.held[0] == 3 and pool.used_pages == 4
    v = pool.version
    pool.release([0])
    assert pool.version > v and pool.held[0] == 0
    assert pool.refs[pool.table[2, 0]] == 2      # still held by rows 1 and 2
    assert pool.used_pages == 2
    pool.release([1, 2])
    assert pool.used_pages == 0 and pool.free_pages == 12
    assert (pool.table == 12).all()


def test_pool_compaction_permutes_the_table_and_frees_dropped_rows():
    pool = PagePool(num_pages=8, page_size=2, batch=4, max_len=8)
    pool.ensure([0, 1, 2, 3], [2, 4, 2, 6])
    pages_3 = pool.row_pages(3)
    pool.compact(np.array([3, 1]), 2)
    assert pool.batch == 2
    np.testing.assert_array_equal(pool.row_pages(0), pages_3)
    assert pool.used_pages == 3 + 2


def test_pool_exhaustion_is_an_error_and_allocates_nothing():
    pool = PagePool(num_pages=3, page_size=4, batch=2, max_len=16)
    pool.ensure([0], [8])
    with pytest.raises(PoolExhausted, match="1 free pages of 3, a step needs 2"):
        pool.ensure([0, 1], [12, 4])
    assert pool.used_pages == 2 and pool.held[1] == 0
    # sharing that runs out of pages part way shares nothing
    pool = PagePool(4, 4, 3, 16)
    pool.ensure([0], [6])
    pool.ensure([1], [8])
    with pytest.raises(PoolExhausted, match="sharing needs 1"):
        pool.share([2, 2], [1, 0], [8, 6])
    pool.release([0, 1, 2])
    assert pool.free_pages == 4 and not pool.refs.any()


# ---------------------------------------------------------------------- the cache's operations
def paged_like(dense: DenseKVCache, page: int, seed: int) -> PagedKVCache:
    """A paged cache holding the dense cache's positions on randomly permuted pages (plus spare
    pages of noise, so a wrong page id shows)."""
    return paged_kv_cache_like(dense, page, seed)


def attended_np(cache, kv_len):
    """Every layer's attended keys and values as numpy arrays."""
    views = [cache.attended(jax.tree_util.tree_map(lambda a: a[l], cache.layers()), kv_len)
             for l in range(cache.k.shape[0])]
    return [np.asarray(x) for view in views
            for x in (view.dense() if isinstance(view, PagedView) else view)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_paged_operations_equal_the_dense_ones(jit):
    config = tiny_model_config()
    dense = random_kv_cache(config, batch=3, cache_len=20, seed=0)
    paged = paged_like(dense, page=8, seed=1)
    wrap = jax.jit if jit else (lambda f: f)
    for kv_len in (1, 8, 13, 20):
        for a, b in zip(attended_np(dense, kv_len), attended_np(paged, kv_len)):
            np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(2)
    L, KVH, K = config.num_layers, config.num_kv_heads, config.head_dim
    k_new = jnp.asarray(rng.standard_normal((L, 6, KVH, K)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((L, 6, KVH, K)), jnp.float32)
    rows = jnp.asarray([0, 0, 2, 1, 3, 2], jnp.int32)       # 3: a padding slot (dropped)
    pos = jnp.asarray([7, 8, 19, 0, 5, 16], jnp.int32)
    d2 = wrap(lambda c: c.write_slots(k_new, v_new, rows, pos))(dense)
    p2 = wrap(lambda c: c.write_slots(k_new, v_new, rows, pos))(paged)
    for a, b in zip(attended_np(d2, 20), attended_np(p2, 20)):
        np.testing.assert_array_equal(a, b)
    scratch = random_kv_cache(config, batch=2, cache_len=16, seed=3)
    slots, src = jnp.asarray([2, 0, 3], jnp.int32), jnp.asarray([1, 0, 0], jnp.int32)
    d3 = wrap(lambda c: c.insert_rows(slots, scratch, src))(dense)
    p3 = wrap(lambda c: c.insert_rows(slots, scratch, src))(paged)
    for a, b in zip(attended_np(d3, 20), attended_np(p3, 20)):
        np.testing.assert_array_equal(a, b)
    # compaction: a table permutation
    d4, p4 = dense.gather_rows(jnp.asarray([2, 0])), paged.gather_rows(jnp.asarray([2, 0]))
    for a, b in zip(attended_np(d4, 20), attended_np(p4, 20)):
        np.testing.assert_array_equal(a, b)


def test_unallocated_pages_drop_writes():
    config = tiny_model_config()
    cache = PagedKVCache.zeros(config, batch=2, max_len=16, num_pages=4, page_size=4)
    cache = cache.with_table(jnp.asarray([[2, 4, 4, 4], [4, 4, 4, 4]], jnp.int32))
    L, KVH, K = config.num_layers, config.num_kv_heads, config.head_dim
    ones = jnp.ones((L, 3, KVH, K), jnp.float32)
    out = cache.write_slots(ones, ones, jnp.asarray([0, 0, 1]), jnp.asarray([1, 5, 0]))
    written = np.asarray(out.v).sum(axis=(0, 2, 4))          # [P, page]
    assert written[2, 1] > 0 and written.sum() == written[2, 1]


# ---------------------------------------------------------------------- whole rollouts
def check_same(dense, paged, atol=1e-5, rtol=1e-5):
    """Same tokens and finish reasons; log-probs within 1e-5 + 1e-5 |logp|: the paged
    and dense attention sum the same float32 terms in other orders (on a 2-core Intel Xeon
    whose XLA dots accumulate differently from the AMD machines', 1.05e-5 and 1.17e-5 apart at
    log-probs of -1.73 and -3.48: 3-6e-6 relative; a wrong page is off by far more).
    `atol=0`: bitwise equal (exact mode)."""
    for a, b in zip(dense, paged):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, rtol=rtol if atol else 0.0)


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_paged_rollouts_equal_dense_plain_decoding(params, decode_steps, monkeypatch):
    reqs = random_requests(problems=3, samples=3)        # 9 rollouts in 4 slots: refills
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40)
    dense, _ = engine(params, decode_steps=decode_steps).generate(reqs, sampling)
    shared, compacted = [], []
    real_share, real_compact = PagedExecutor._share, PagedExecutor.compact
    monkeypatch.setattr(PagedExecutor, "_share",
                        lambda self, *a: shared.append(1) or real_share(self, *a))
    monkeypatch.setattr(PagedExecutor, "compact",
                        lambda self, *a: compacted.append(1) or real_compact(self, *a))
    paged, _ = engine(params, decode_steps=decode_steps, kv_cache="paged",
                      page_size=8).generate(reqs, sampling)
    check_same(dense, paged)
    assert shared and compacted      # a later sibling shared pages; the tail was compacted


@pytest.mark.parametrize("make_drafter", ["oracle", "adversary"])
def test_paged_rollouts_equal_dense_with_drafts(params, make_drafter):
    reqs = random_requests(problems=3, samples=3, seed=1)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40)
    dense, _ = engine(params).generate(reqs, sampling)
    drafter = (OracleDrafter({i: o.token_ids for i, o in enumerate(dense)})
               if make_drafter == "oracle" else AdversaryDrafter(64, seed=0))
    paged, stats = engine(params, kv_cache="paged", page_size=4).generate(
        reqs, sampling, drafter=drafter)
    check_same(dense, paged)
    assert stats.drafted_tokens > 0
    if make_drafter == "oracle":
        assert stats.acceptance_length > 2


def test_paged_rollouts_are_bitwise_dense_in_exact_mode(params):
    reqs = random_requests(problems=2, samples=2, seed=2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20)
    dense, _ = engine(params, exact=True).generate(reqs, sampling)
    paged, _ = engine(params, exact=True, kv_cache="paged", page_size=8).generate(
        reqs, sampling, drafter=OracleDrafter({i: o.token_ids for i, o in enumerate(dense)}))
    check_same(dense, paged, atol=0)


def test_a_group_holds_its_prompt_pages_once(params, monkeypatch):
    """16 siblings of one 1,000-token prompt: the prompt's 62 full pages are held once (16
    references each), plus each row's own partial last page; all freed at the end."""
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(2, 64, size=1000))
    reqs = [Request(prompt, problem_id="p", sample_index=g) for g in range(16)]
    seen = []
    real = PagedExecutor.decode

    def decode(self, st, *a):
        if not seen:
            seen.append((self.pool.used_pages, self.pool.refs.copy(), self.pool.table.copy()))
        out = real(self, st, *a)
        seen.append(self)
        return out
    monkeypatch.setattr(PagedExecutor, "decode", decode)
    outs, _ = engine(params, kv_cache="paged", page_size=16, max_slots=16,
                     max_cache_len=1040).generate(
        reqs, SamplingParams(temperature=1.0, max_new_tokens=8))
    used, refs, table = seen[0]
    full = 1000 // 16
    assert used == full + 16
    np.testing.assert_array_equal(refs[table[0, :full]], 16)
    assert len({int(table[b, full]) for b in range(16)}) == 16     # own partial pages
    # every finished row freed its completion's pages; the prompt's stay (for later siblings)
    assert seen[-1].pool.used_pages == full + 16
    assert all(len(o.token_ids) >= 1 for o in outs)


def test_paged_precompile_compiles_the_programs_generate_runs(params):
    reqs = random_requests(problems=2, samples=2, seed=3)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    eng = engine(params, kv_cache="paged", page_size=8, decode_steps=1)
    eng.precompile(reqs, sampling, drafting=False)
    before = eng.programs.compiled_count()
    _, stats = eng.generate(reqs, sampling)
    assert sum(s.compile_s for s in stats.steps) == 0.0
    assert eng.programs.compiled_count() >= before


def test_kv_cache_settings_are_checked():
    with pytest.raises(GenerateError, match="kv_cache must be 'dense' or 'paged'"):
        EngineConfig(kv_cache="pages")
    with pytest.raises(GenerateError, match="page_size must be an integer >= 1"):
        EngineConfig(page_size=0)
    with pytest.raises(GenerateError, match="page_size must be an integer >= 1"):
        EngineConfig(page_size=2.5)
    for bad in (0, -3):
        with pytest.raises(GenerateError, match="kv_pages must be an integer >= 1"):
            EngineConfig(kv_cache="paged", kv_pages=bad)
    with pytest.raises(ConfigError, match=r"rollout.kv_cache: invalid value 'ragged' \(did you "
                       r"mean 'paged'\?\); choices: auto, dense, paged"):
        config_from_dict({"rollout": {"kv_cache": "ragged"}})
    with pytest.raises(ConfigError, match="rollout.paged_attention: invalid value 'triton'"):
        config_from_dict({"rollout": {"paged_attention": "triton"}})
    assert config_from_dict({}).rollout.kv_cache == "auto"
    with pytest.raises(ConfigError, match="rollout.page_size must be >= 1"):
        config_from_dict({"rollout": {"page_size": 0}})
    assert config_from_dict({"rollout": {"kv_cache": "paged"}}).rollout.kv_cache == "paged"


# ---------------------------------------------------------------------- admission and preemption
PAGE_BYTES = 4 * 256          # the tiny model: 256 bytes per position (f32), pages of 4


@pytest.mark.parametrize("exact,decode_steps,drafts", [(False, 1, True), (True, 8, False)],
                         ids=["fast-drafts", "exact-decode8"])
def test_preempted_rows_resume_with_the_same_tokens(params, exact, decode_steps, drafts):
    """A pool of 24 pages for 4 slots of up to ~60 positions: requests are admitted by free
    pages, rows are preempted when it runs short and resumed by a prefill of their tokens; the
    rollouts equal the dense cache's (bitwise in exact mode)."""
    reqs = random_requests(problems=3, samples=3)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40)
    common = dict(decode_steps=decode_steps, max_cache_len=64, exact=exact)
    dense, _ = engine(params, **common).generate(reqs, sampling)
    eng = engine(params, kv_cache="paged", page_size=4, kv_memory_gb=24 * PAGE_BYTES / 1e9,
                 **common)
    assert eng.engine_config.kv_pages == 24 and eng.engine_config.max_slots == 4
    drafter = AdversaryDrafter(64, seed=0) if drafts else None
    paged, stats = eng.generate(reqs, sampling, drafter=drafter)
    assert stats.preemptions > 0
    check_same(dense, paged, atol=0 if exact else 1e-4)


def test_paged_budget_sizes_the_pool_not_the_slots(params):
    eng = engine(params, kv_cache="paged", page_size=16, max_slots=64,
                 kv_memory_gb=1000 * 16 * 256 / 1e9)
    assert eng.engine_config.max_slots == 64 and eng.engine_config.kv_pages == 1000
    dense = engine(params, max_slots=64, kv_memory_gb=1000 * 16 * 256 / 1e9)
    assert dense.engine_config.max_slots == 1000 * 16 // 256        # rows of 256 positions
    with pytest.raises(GenerateError, match=r"needs 16 pages .* one row of max_cache_len=256"):
        engine(params, kv_cache="paged", page_size=16, kv_memory_gb=15 * 16 * 256 / 1e9)


# ---------------------------------------------------------------------- sizing and the plan
def test_expected_rows_counts_held_pages_length_biased():
    from das_jax.engine.pages import expected_rows
    # every rollout: a 16-token prompt (one full page) and 64 tokens (2 pages held on average),
    # + half a page of rounding: 3.5 pages per row; a group of 4 shares the prompt page
    assert expected_rows(700, 16, [16] * 8, [64] * 8) == pytest.approx(200.0)
    assert expected_rows(700, 16, [16] * 8, [64] * 8, group=4) == pytest.approx(700 / 2.75)
    # a long tail (the DAS paper's shape: median 4K, up to 16K) against dense rows of 17,408
    rng = np.random.default_rng(0)
    L = np.clip(np.exp(rng.normal(np.log(4000), 0.85, size=4096)), 32, 16384).astype(int)
    pages = 30 * 17408 // 16
    assert expected_rows(pages, 16, [200] * len(L), L, group=16) >= 3 * 30


def test_plan_reports_the_paged_pool():
    from das_jax.config import config_from_dict
    from das_jax.plan import plan_in_process, with_rows_expected
    config = config_from_dict({
        "rollout": {"max_new_tokens": 16, "max_slots": 8, "max_cache_len": 64,
                    "draft_widths": [1, 4], "kv_cache": "paged", "page_size": 8,
                    "kv_memory_gb": 40 * 8 * 256 / 1e9},
        "grpo": {"num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 2}})
    cfg = tiny_model_config()
    p = plan_in_process(config, 1, int(1e9), model_config=cfg)
    assert p.shapes["kv_cache"] == "paged" and p.shapes["slots"] == 8
    assert p.shapes["kv_pages"] == 40 and p.rows["kv_cache"] == 40 * 8 * 256
    assert p.shapes["rows_worst_case"] == 5              # 40 pages / 8 pages per row of 64
    assert "share_prompt_pages" in p.programs and "gather_rows" not in p.programs
    p = with_rows_expected(p, config, ([8] * 4, [16] * 4))
    # 1/2 shared prompt page + 1 page of completion + 1/2 of rounding = 2 pages per row
    assert p.shapes["rows_expected"] == pytest.approx(20.0)
    assert p.shapes["dense_rows_same_memory"] == 5


def test_odd_pages_without_sharing_under_a_tight_budget(params):
    """Pages of 3 positions (not a power of two, smaller than every bucket), prompt sharing off,
    a pool of 1.5 rows: admissions wait for pages, rows are preempted, and every rollout is the
    dense cache's, bitwise (exact mode)."""
    reqs = random_requests(problems=4, samples=2, seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30)
    common = dict(decode_steps=4, max_slots=4, max_cache_len=48, share_prompts=False, exact=True)
    dense, _ = engine(params, **common).generate(reqs, sampling)
    eng = engine(params, kv_cache="paged", page_size=3, kv_memory_gb=24 * 3 * 256 / 1e9, **common)
    paged, stats = eng.generate(reqs, sampling)
    assert stats.preemptions > 0
    check_same(dense, paged, atol=0)


@pytest.mark.parametrize("page_size,budget", [(1, 64), (4, 17)])
def test_a_resumed_request_and_its_fresh_sibling_are_admitted_by_their_real_pages(
        params, page_size, budget):
    """A preempted request (prompt + its tokens) and a fresh sibling of the same prompt queued
    together: the sibling cannot share the resumed row's pages (they hold more than the
    prompt), so admission counts its own prompt pages; no pool overcommit, the dense tokens."""
    A, B = tuple(range(2, 6)), tuple(range(10, 40))
    reqs = [Request(A, problem_id="a", sample_index=0), Request(B, problem_id="b"),
            Request(B, problem_id="b", sample_index=1)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30)
    common = dict(max_slots=2, max_cache_len=64, decode_steps=1, exact=True)
    dense, _ = engine(params, **common).generate(reqs, sampling)
    paged, stats = engine(params, kv_cache="paged", page_size=page_size,
                          kv_memory_gb=budget * page_size * 256 / 1e9,
                          **common).generate(reqs, sampling)
    assert stats.preemptions > 0
    check_same(dense, paged, atol=0)
