"""One host scheduler (`das_jax.engine.scheduler.run_schedule`) drives both the engine (device
executor) and the trace replay (trace executor): with a frozen cost model as the clock, a replay of
an engine run's trace makes the same calls on its executor (admissions, compactions, every verify
step's batch, rows, per-row drafts, width, shape) and returns the same step records and counters."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from das_jax.bench import replay as rp
from das_jax.config import DASSection
from das_jax.engine import scheduler
from das_jax.speculation.das_policy import DASConfig
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.sampling import SamplingParams
from das_jax.rollout import build_speculation
from das_jax.testing import random_requests, tiny_model_config, tiny_params

CFG = tiny_model_config()
EOS = 1
COEF = {"c_base": 0.01, "c_tok": 0.002, "c_kv": 1e-5}
MAX_NEW = 40


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


class Recorder:
    """A `StepExecutor` around another one that logs every call the scheduler makes (and what
    it commits to), and, given a cost model, reports its step time instead of the inner one's."""

    def __init__(self, inner, cost_model=None):
        self.inner, self.cost_model, self.calls = inner, cost_model, []

    def start(self, batch, cache_len):
        self.calls.append(("start", batch, cache_len))
        self.inner.start(batch, cache_len)

    def prefill(self, request_ids, rows, batch):
        out = self.inner.prefill(request_ids, rows, batch)
        self.calls.append(("prefill", list(request_ids), [int(r) for r in rows], batch,
                           out.tokens, [int(t) for t in out.first_tokens]))
        return out

    def compact(self, live, new_batch):
        self.calls.append(("compact", [int(r) for r in live], new_batch))
        self.inner.compact(live, new_batch)

    def verify(self, st):
        out = self.inner.verify(st)
        self.calls.append((
            "verify", st.batch, [int(r) for r in st.live], list(st.request_ids),
            list(st.generated), [int(st.cache_len_B[r]) for r in st.live], st.kv_len, st.width,
            [st.draft(j).tolist() for j in range(len(st.live))], [int(n) for n in st.n_draft_B],
            st.num_tokens, st.attended_kv, st.predicted_seconds))
        if self.cost_model is not None:
            out = dataclasses.replace(
                out, seconds=float(self.cost_model.predict_step(st.num_tokens, st.attended_kv)))
        return out


def _counters(st):
    return (st.forward_passes, st.generated_tokens, st.drafted_tokens, st.accepted_draft_tokens,
            st.prefill_tokens, st.prefill_calls)


@pytest.mark.parametrize("name,temperature", [("das", 1.0), ("suffix", 1.0)])
def test_replay_takes_the_engine_decisions_by_construction(params, name, temperature):
    ec = EngineConfig(max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8))
    eng = Engine(CFG, params, eos_token_ids=[EOS], engine_config=ec)
    reqs = random_requests()
    das = DASSection(policy=DASConfig(short_threshold=5, long_threshold=20))
    cm = rp.FrozenCostModel.of(COEF)
    # The engine's own executor and scheduler, timed by the frozen cost model.
    e_drafter, e_policy = build_speculation(name, das, cm)
    # Engine.generate itself, with its real clock (the frozen cost model ignores it).
    g_drafter, g_policy = build_speculation(name, das, cm)
    # The replay of the engine's trace.
    r_drafter, r_policy = build_speculation(name, das, cm)
    kinds, batches = set(), set()
    for epoch in range(2):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW, seed=epoch)
        eng_exec = Recorder(eng.step_executor(reqs, sampling), cost_model=cm)
        outs, st = scheduler.run_schedule(reqs, eng_exec, ec, eng.limits(sampling), e_drafter,
                                          e_policy)
        g_outs, g_st = eng.generate(reqs, sampling, drafter=g_drafter, policy=g_policy)
        trace = [rp.TraceRollout(epoch, o.request.problem_id, o.request.sample_index,
                                 o.request.prompt_ids, tuple(o.token_ids), o.finish_reason,
                                 temperature) for o in outs]
        rep_exec = Recorder(rp.TraceExecutor(trace, ec, cm))
        r_outs, r_st = scheduler.run_schedule(trace, rep_exec, ec, scheduler.Limits(MAX_NEW),
                                              r_drafter, r_policy, keep_tokens=False,
                                              stats=rp.SimStats())
        sim = rp.simulate(trace, ec, MAX_NEW, cm, *build_speculation(name, das, cm)) \
            if epoch == 0 else None
        for d in (e_drafter, g_drafter, r_drafter):
            if d is not None:
                d.advance_epoch()

        # The scheduler ran Engine.generate's run: same tokens and decisions.
        assert [o.token_ids for o in g_outs] == [o.token_ids for o in outs]
        assert ([dataclasses.replace(s, seconds=0.0) for s in g_st.steps]
                == [dataclasses.replace(s, seconds=0.0) for s in st.steps])
        assert _counters(g_st) == _counters(st)
        # The replay made the same executor calls, in order: admissions (rows, batch, prefill
        # tokens, first tokens), compactions, every step's rows, drafts, width and shape.
        assert rep_exec.calls == eng_exec.calls
        kinds |= {c[0] for c in eng_exec.calls}
        batches |= {c[1] for c in eng_exec.calls if c[0] == "verify"}
        # ... and returned the same records (seconds included: both use the cost model) and
        # counters, per request and in total.
        assert r_st.steps == st.steps
        assert _counters(r_st) == _counters(st)
        assert r_st.decode_s == pytest.approx(st.decode_s)
        assert ([(o.finish_reason, o.forward_passes, o.drafted_tokens, o.accepted_draft_tokens)
                 for o in r_outs]
                == [(o.finish_reason, o.forward_passes, o.drafted_tokens, o.accepted_draft_tokens)
                    for o in outs])
        if sim is not None:   # the public `simulate` is that same run
            assert sim.steps == st.steps and _counters(sim) == _counters(st)
        # The bookkeeping deferred into each next step's overlap (overlap_host, the default)
        # ran for every step, the last included: acceptance counts for every verified draft
        # token, and no calibration update left behind.
        for stats in (st, g_st, r_st):
            assert sum(stats.drafted_by_source.values()) == stats.drafted_tokens
            assert sum(stats.accepted_by_source.values()) == stats.accepted_draft_tokens
            assert sum(stats.drafted_by_position) == stats.drafted_tokens
        assert not getattr(e_policy, "_unlearned", [])
    assert st.drafted_tokens > 0 and st.accepted_draft_tokens > 0
    assert {"start", "prefill", "compact", "verify"} <= kinds, kinds
    assert len(batches) > 1   # the tail ran smaller batch buckets


class _ScriptExecutor:
    """A model-free executor: each row commits 1 + its draft length tokens of value 7 (no stop
    token), so only max_new_tokens ends a request; step time 1 s."""

    def start(self, batch, cache_len):
        pass

    def prefill(self, request_ids, rows, batch):
        return scheduler.Prefilled([7] * len(request_ids), [0.0] * len(request_ids), 0.5,
                                   3 * len(request_ids))

    def compact(self, live, new_batch):
        pass

    def verify(self, st):
        toks = [[7] * (1 + len(st.draft(j))) for j in range(len(st.live))]
        return scheduler.StepOutput.from_rows(toks, [[0.0] * len(t) for t in toks], 1.0)


class _ConstDrafter:
    def begin(self, rid, pid, prompt):
        pass

    def propose(self, rid, k):
        from das_jax.drafter import Draft
        return Draft(np.full(k, 7, np.int32), np.ones(k, np.float32))

    def append(self, rid, toks):
        pass

    def end(self, rid):
        pass


def test_scheduler_cuts_at_max_new_tokens_and_counts_committed_only():
    ec = EngineConfig(max_slots=2, max_cache_len=256, draft_widths=(1, 4))
    reqs = [Request((2, 3), problem_id=i) for i in range(3)]
    outs, st = scheduler.run_schedule(reqs, _ScriptExecutor(), ec, scheduler.Limits(6),
                                      _ConstDrafter())
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert all(o.finish_reason == "length" for o in outs)
    # 1 prefill token, then 1 + 3 drafts (the widest width), then 1 (remaining 1: no drafts).
    assert [o.forward_passes for o in outs] == [2, 2, 2]
    assert st.generated_tokens == 18 and st.accepted_draft_tokens == sum(
        o.accepted_draft_tokens for o in outs) == 9
    assert st.prefill_calls == 2 and st.prefill_tokens == 9 and st.prefill_s == 1.0
    assert st.decode_s == st.forward_passes == 4


def test_trace_executor_rejects_an_empty_rollout():
    ec = EngineConfig(max_slots=2, max_cache_len=256)
    bad = [rp.TraceRollout(0, "p", 0, (2, 3), ())]
    with pytest.raises(ValueError, match="trace rollout 0 .*has no tokens"):
        rp.simulate(bad, ec, 8, rp.FrozenCostModel.of(COEF))
