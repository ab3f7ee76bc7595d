"""Engine settings for a GPU node: prefill calls under a block-slot budget
(`rollout.max_prefill_tokens`: the split of one admission, `schedule.prefill_chunks`, the plan's
block rows, `schedule.prefill_rows`, rollouts the same bit for bit whatever the budget, dense
and paged), `rollout.kv_cache: auto` and `rollout.paged_attention`."""
from __future__ import annotations

import pytest

from das_jax.engine import programs as programs_lib
from das_jax.engine.engine_config import kv_cache_for
from das_jax.engine.generate import Request
from das_jax.engine.sampling import SamplingParams
from das_jax.engine.schedule import bucket, prefill_chunks, prefill_rows, prompt_bucket
from das_jax.engine.specs import PrefillSpec
from das_jax.testing import tiny_engine, tiny_params

BUCKETS = (1, 2, 4, 8)


def _product(prompts, ks):
    distinct = {tuple(prompts[k]) for k in ks}
    return (bucket(len(distinct), BUCKETS)
            * prompt_bucket(max(len(p) for p in distinct), 16, 256))


def test_chunks_keep_a_prompts_requests_together_under_the_budget():
    a, b, c, d, e = ((2,) * 5, (3,) * 12, (4,) * 20, (5,) * 3, (6,) * 70)
    prompts = [a, b, a, c, d, b, e, d]
    calls = prefill_chunks(prompts, BUCKETS, 16, 256, 64)
    # a, b (2 x 16 = 32), then c (bucket 32) would make 4 x 32 = 128 > 64: a new call; c, d
    # (2 x 32); e (bucket 128 > 64) alone
    assert calls == [[0, 2, 1, 5], [3, 4, 7], [6]]
    assert sorted(k for ks in calls for k in ks) == list(range(len(prompts)))
    for ks in calls:
        assert _product(prompts, ks) <= 64 or len({tuple(prompts[k]) for k in ks}) == 1
    assert prefill_chunks(prompts, BUCKETS, 16, 256, None) == [list(range(8))]
    assert prefill_chunks(prompts, BUCKETS, 16, 256, 1) == [[0, 2], [1, 5], [3], [4, 7], [6]]
    assert prefill_chunks([], BUCKETS, 16, 256, 64) == []


def test_prefill_rows_is_the_largest_bucket_under_the_budget():
    assert prefill_rows(1000, 32, (1, 2, 4, 8, 16, 32), 16, 17408, 8192) == 8   # 8 x 1024
    assert prefill_rows(1000, 4, (1, 2, 4, 8, 16, 32), 16, 17408, 8192) == 4
    assert prefill_rows(9000, 32, (1, 2, 4, 8, 16, 32), 16, 17408, 8192) == 1   # alone
    assert prefill_rows(1000, 32, (1, 2, 4, 8, 16, 32), 16, 17408, None) == 32


@pytest.fixture(scope="module")
def params():
    return tiny_params()


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_chunked_prefill_changes_no_bit(params, kv_cache, monkeypatch):
    """6 distinct prompts (4-30 tokens) x 2 samples into 8 slots: a budget of 32 block slots
    prefills the first admission in several calls, none over the budget unless one prompt's
    bucket is; tokens and log-probs equal one call's bit for bit (exact mode)."""
    lens = (4, 9, 30, 15, 22, 6)
    reqs = [Request(tuple(2 + (7 * i + j) % 60 for j in n), problem_id=f"p{i}",
                    sample_index=g) for i, n in enumerate(map(range, lens)) for g in range(2)]
    sampling = SamplingParams(temperature=0.9, max_new_tokens=6, seed=3)
    seen = []
    run = programs_lib.Programs.run

    def spy(self, params, cache, batch):
        if isinstance(batch.spec, PrefillSpec):
            seen[-1].append(batch.spec)
        return run(self, params, cache, batch)

    monkeypatch.setattr(programs_lib.Programs, "run", spy)
    outs = {}
    for budget in (None, 32):
        seen.append([])
        outs[budget], _ = tiny_engine(params, max_slots=8, exact=True, kv_cache=kv_cache,
                                      max_prefill_tokens=budget).generate(reqs, sampling)
    one, chunked = seen
    assert len(chunked) > len(one) >= 1
    assert all(s.rows * s.width <= 32 or s.rows == 1 for s in chunked)
    assert max(s.rows * s.width for s in one) > 32
    for a, b in zip(outs[None], outs[32]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("kind, platform, per_engine, want", [
    ("auto", "gpu", 1, "paged"), ("auto", "tpu", 1, "paged"), ("auto", "cpu", 1, "dense"),
    ("auto", "gpu", 2, "dense"), ("dense", "gpu", 1, "dense"), ("paged", "cpu", 1, "paged")])
def test_kv_cache_auto_is_paged_on_one_gpu_or_tpu_device(kind, platform, per_engine, want):
    assert kv_cache_for(kind, platform, per_engine) == want


def test_paged_attention_gather_reaches_the_cache(params):
    """`paged_attention: gather` is the paged cache's kernel (in the programs' pages and the
    cache the engine builds), the scheduler prices no page reads, and rollouts are those of
    `auto` (on this CPU both gather)."""
    from das_jax.engine import EngineConfig, GenerateError
    from das_jax.engine.paged_executor import PagedExecutor
    ec = EngineConfig(kv_cache="paged", page_size=8, paged_attention="gather")
    assert ec.paging(2, 64) == (16, 8, "gather")
    with pytest.raises(GenerateError, match="paged_attention"):
        EngineConfig(paged_attention="triton")
    reqs = [Request(tuple(range(2, 2 + n)), problem_id=f"p{n}") for n in (5, 11)]
    sampling = SamplingParams(temperature=0.9, max_new_tokens=5, seed=1)
    seen = []
    start = PagedExecutor.start

    def spy(self, batch, cache_len):
        start(self, batch, cache_len)
        seen.append((self.cache.kernel, self.kv_read_page))

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PagedExecutor, "start", spy)
        for kernel in ("auto", "gather"):
            out[kernel], _ = tiny_engine(params, kv_cache="paged", page_size=8,
                                         paged_attention=kernel).generate(reqs, sampling)
    assert seen == [("auto", None), ("gather", None)]
    assert [o.token_ids for o in out["auto"]] == [o.token_ids for o in out["gather"]]


def _das_epochs(params, drafter, overlap: bool, reqs, sampling, policy=None, **ec) -> list:
    """Two epochs of `reqs` drafted by `drafter` (advanced after each) on a tiny exact engine
    with `overlap_host` (and `ec`): [(outputs, stats)] per epoch; `policy` default
    `FixedPolicy(max_draft=3)`."""
    from das_jax.engine.policy import FixedPolicy
    eng = tiny_engine(params, exact=True, overlap_host=overlap, **ec)
    out = []
    for _ in range(2):
        out.append(eng.generate(reqs, sampling, drafter=drafter,
                                policy=policy or FixedPolicy(max_draft=3)))
        drafter.advance_epoch()
    return out


def test_drafter_threads_draft_what_one_thread_drafts(params, monkeypatch):
    """`das.drafter_threads` 2: the history sharded over two forests, a step's rows drafted
    and their appends indexed on two threads (split even at this batch size), overlapped with
    the device; the same drafts as one thread, so the same forward passes, accepted drafts,
    tokens and log-probs, over two epochs."""
    from das_jax.drafter import SuffixDrafter, SuffixTreeConfig, suffix_drafter
    from das_jax.testing import random_requests
    monkeypatch.setattr(suffix_drafter, "_MIN_ROWS_PER_THREAD", 1)
    reqs = random_requests(problems=4, samples=2, seed=4)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24, seed=6)
    res = {t: _das_epochs(params, SuffixDrafter(SuffixTreeConfig(max_depth=8), window=2,
                                                threads=t), True, reqs, sampling)
           for t in (1, 2)}
    for (a, sa), (b, sb) in zip(res[1], res[2]):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.logprobs for o in a] == [o.logprobs for o in b]
        assert (sa.forward_passes, sa.accepted_draft_tokens) == \
            (sb.forward_passes, sb.accepted_draft_tokens)
    assert res[2][1][1].accepted_draft_tokens > 0


def test_overlapped_appends_change_no_token(params):
    """`overlap_host`: the das drafter's trie indexing runs while the device computes the next
    step (`StepInput.overlap`, in `overlap_s`, not in `host_s`); the tokens and log-probs are
    those of appends completed before every draft (exact mode, bit for bit), over two epochs
    so the second drafts from the first's history."""
    from das_jax.drafter import SuffixDrafter, SuffixTreeConfig
    from das_jax.testing import random_requests
    reqs = random_requests(problems=2, samples=4, seed=3)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24, seed=5)
    res = {overlap: _das_epochs(params, SuffixDrafter(SuffixTreeConfig(max_depth=8), window=2),
                                overlap, reqs, sampling) for overlap in (True, False)}
    for (a, sa), (b, sb) in zip(res[True], res[False]):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.logprobs for o in a] == [o.logprobs for o in b]
        assert sa.overlap_s > 0 and sb.overlap_s == 0
    assert res[True][1][1].accepted_draft_tokens > 0


def test_drafts_made_ahead_change_no_decision(params):
    """`draft_ahead`: while the device computes a step, the DAS policy's rows whose proposal
    goes on past the chosen draft get their next draft made (`SuffixDrafter.propose_ahead`);
    the next propose takes it where the step did as assumed. Every step's drafts, so every
    decision, token and log-prob, equal a run without it (a frozen cost model: the plans
    depend on nothing measured); some drafts were taken."""
    from das_jax.bench.replay import FrozenCostModel
    from das_jax.drafter import SuffixDrafter, SuffixTreeConfig
    from das_jax.speculation import DASConfig, DASPolicy
    from das_jax.testing import random_requests
    reqs = random_requests(problems=2, samples=4, seed=3)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=40, seed=5)
    res, drafters = {}, {}
    for ahead in (True, False):
        d = drafters[ahead] = SuffixDrafter(SuffixTreeConfig(max_depth=8), window=2)
        pol = DASPolicy(d.lengths, DASConfig(), FrozenCostModel(c_base=0.01, c_tok=2e-3))
        res[ahead] = _das_epochs(params, d, True, reqs, sampling, policy=pol,
                                 draft_ahead=ahead, max_slots=8)
    for (a, sa), (b, sb) in zip(res[True], res[False]):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.logprobs for o in a] == [o.logprobs for o in b]
        assert [(r.drafted, r.accepted, r.accepted_per_row) for r in sa.steps] == \
            [(r.drafted, r.accepted, r.accepted_per_row) for r in sb.steps]
    made, used = drafters[True].drafted_ahead
    assert drafters[False].drafted_ahead == (0, 0)
    assert used > 0 and made >= used, (made, used)
