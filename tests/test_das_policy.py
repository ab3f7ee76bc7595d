"""The DAS policy: classes, budgets, the fitted cost model, width choice, token identity."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.drafter.base import Draft
from das_jax.speculation.cost_model import CostModel
from das_jax.speculation.das_policy import LONG, MEDIUM, SHORT, DASConfig, DASPolicy, _quantile
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.policy import (FixedPolicy, RowView, StepRecord, packed_step_shape,
                                   padded_step_shape, width_for)
from das_jax.engine.sampling import SamplingParams
from das_jax.rollout import build_speculation
from das_jax.testing import OracleDrafter, tiny_model_config, tiny_params

CFG = tiny_model_config()


def policy_with_history(history: dict, **cfg) -> DASPolicy:
    pol = DASPolicy(lambda pid: history.get(pid, []), DASConfig(**cfg))
    for lens in history.values():
        for n in lens:
            pol.end(-1, n)
    return pol


def test_classes_follow_history_and_promote():
    history = {"short": [10, 12, 11, 200], "mid": [50, 55, 60], "long": [200, 220, 20, 210]}
    # The class-caps ablation: short 0, medium 3, long the widest.
    pol = policy_with_history(history, budget_short=0, budget_medium=3)
    lo, hi = pol.thresholds()
    assert 12 <= lo < 50 and 60 <= hi <= 200
    assert pol.initial_class("short") == SHORT
    assert pol.initial_class("mid") == MEDIUM
    assert pol.initial_class("long") == LONG
    assert pol.initial_class("unseen") == MEDIUM
    pol.begin(7, "short", 5)
    rows = [RowView(7, "short", generated=5, remaining=500)]
    assert pol.draft_budgets(rows, 1, 8).tolist() == [0]
    # Outgrowing its class promotes it, first to medium, then to long.
    assert pol.draft_budgets([RowView(7, "short", int(lo) + 1, 400)], 1, 8).tolist() == [3]
    assert pol.draft_budgets([RowView(7, "short", int(hi) + 1, 300)], 1, 8).tolist() == [7]
    assert pol.step_classes([RowView(7, "short", 0, 1)]) == {SHORT: 0, MEDIUM: 0, LONG: 1}
    # Class weights: a long row weighs weight_long, an unseen (medium) one weight_medium.
    pol.begin(8, "unseen", 5)
    assert pol.row_weights([RowView(7, "short", 0, 1), RowView(8, "unseen", 0, 9)]).tolist() == [
        2.0, 1.0]
    # Without caps (the default) every row may draft up to the widest width.
    assert policy_with_history(history).draft_budgets([RowView(9, "short", 0, 50)], 1, 8).tolist() \
        == [7]
    # Admission: predicted-long first.
    assert pol.admission_order(["short", "mid", "long", "unseen"]) == [2, 1, 0, 3]


def test_too_little_history_means_medium():
    pol = policy_with_history({"a": [10, 500]})
    assert pol.thresholds() is None
    assert pol.initial_class("a") == MEDIUM


def test_cost_model_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    cm = CostModel(c_base=1.0, c_tok=1.0, c_kv=1.0)
    true = dict(c_base=0.040, c_tok=0.0021, c_kv=3e-6)
    for _ in range(200):
        B, W, S = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 4, 8]), rng.choice([128, 256, 512])
        t = true["c_base"] + true["c_tok"] * B * W + true["c_kv"] * B * S
        cm.observe(int(B), int(W), int(S), t * (1 + 0.01 * rng.standard_normal()), refit=False)
    cm.fit()
    assert cm.c_base == pytest.approx(true["c_base"], rel=0.05)
    assert cm.c_tok == pytest.approx(true["c_tok"], rel=0.05)
    assert cm.c_kv == pytest.approx(true["c_kv"], rel=0.15)
    assert cm.predict(16, 8, 512) == pytest.approx(0.040 + 0.0021 * 128 + 3e-6 * 16 * 512, rel=0.03)


def test_width_grows_as_batch_shrinks():
    # Truthful drafts with calibrated confidence 0.8 per token; cost t = 0.05 + 0.003 * B * W.
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0),
                    cost_model=CostModel(c_base=0.05, c_tok=0.003))
    probs = 0.8 ** np.arange(1, 16)
    chosen = {}
    for B in (32, 16, 8, 4, 2, 1):
        rows = [RowView(i, "p", 100, 1000) for i in range(B)]
        assert (pol.draft_budgets(rows, B, 16) == 15).all()
        n_draft, t = pol.choose(rows, [probs] * B, padded_step_shape(B, (1, 2, 4, 8, 16), 0))
        W = width_for(n_draft, (1, 2, 4, 8, 16))
        chosen[B] = W
        assert (n_draft == W - 1).all() and t == pytest.approx(0.05 + 0.003 * B * W)
    widths = [chosen[B] for B in (32, 16, 8, 4, 2, 1)]
    assert widths == sorted(widths) and widths[0] < widths[-1], chosen


def test_unlimited_drafts_everyone():
    pol = policy_with_history({"s": [1, 1, 1], "l": [100, 100, 100, 1, 2]}, unlimited=True)
    pol.begin(0, "s", 3)
    assert pol.draft_budgets([RowView(0, "s", 0, 50)], 1, 8).tolist() == [7]
    n, _ = pol.choose([RowView(0, "s", 0, 50)], [np.ones(5)], padded_step_shape(1, (1, 4, 8), 0))
    assert n.tolist() == [5]


class CountingDrafter(OracleDrafter):
    def __init__(self, futures):
        super().__init__(futures)
        self.asked: dict[int, int] = {}

    def propose(self, request_id, max_tokens):
        self.asked[request_id] = self.asked.get(request_id, 0) + 1
        d = super().propose(request_id, max_tokens)
        return Draft(d.tokens, (0.9 ** np.arange(1, len(d) + 1)).astype(np.float32))


def test_short_requests_are_never_drafted_and_tokens_unchanged():
    params = tiny_params(CFG)
    eng = Engine(CFG, params, eos_token_ids=[1],
                 engine_config=EngineConfig(max_slots=4, max_cache_len=256))
    rng = np.random.default_rng(0)
    reqs = [Request(tuple(int(t) for t in rng.integers(2, 64, 6)), problem_id=f"p{i % 3}",
                    sample_index=i // 3) for i in range(6)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    base, base_stats = eng.generate(reqs, sampling)
    history = {"p0": [2, 2, 3], "p1": [24, 24, 23], "p2": [12, 12, 12]}
    pol = DASPolicy(lambda pid: history[pid], DASConfig(short_threshold=5, long_threshold=20),
                    CostModel(c_base=0.05, c_tok=0.0001))
    drafter = CountingDrafter({i: o.token_ids for i, o in enumerate(base)})
    out, stats = eng.generate(reqs, sampling, drafter=drafter, policy=pol)
    assert [o.token_ids for o in out] == [o.token_ids for o in base]
    short_ids = [i for i, r in enumerate(reqs) if r.problem_id == "p0"]
    for i in short_ids:
        # A p0 request may be promoted once it outgrows the short class, never before.
        if len(base[i].token_ids) <= 5:
            assert drafter.asked.get(i, 0) == 0
    assert any(drafter.asked.get(i, 0) > 0 for i, r in enumerate(reqs) if r.problem_id == "p1")
    assert stats.forward_passes < base_stats.forward_passes
    assert all(s.classes is not None and sum(s.classes.values()) == s.active for s in stats.steps)
    assert all(s.predicted_seconds is not None for s in stats.steps if s.drafted)


@pytest.mark.parametrize("name", ["das", "das-unlimited", "suffix", "suffix-global", "ngram"])
def test_full_speculation_stack_is_lossless_over_epochs(name):
    params = tiny_params(CFG, seed=2)
    eng = Engine(CFG, params, eos_token_ids=[1],
                 engine_config=EngineConfig(max_slots=4, max_cache_len=256))
    rng = np.random.default_rng(1)
    reqs = [Request(tuple(int(t) for t in rng.integers(2, 64, 5)), problem_id=f"p{i // 4}",
                    sample_index=i % 4) for i in range(8)]
    drafter, policy = build_speculation(name)
    accepted = 0
    for epoch in range(3):
        sampling = SamplingParams(temperature=0.7, max_new_tokens=24, seed=epoch % 2)
        base, _ = eng.generate(reqs, sampling)
        out, stats = eng.generate(reqs, sampling, drafter=drafter, policy=policy)
        assert [o.token_ids for o in out] == [o.token_ids for o in base]
        accepted += stats.accepted_draft_tokens
        drafter.advance_epoch()
    if name != "ngram":
        assert accepted > 0  # epoch 2 repeats epoch 0's seeds: history drafts them


def test_unknown_speculation_name():
    with pytest.raises(ValueError, match="valid"):
        build_speculation("eagle")


def test_short_drafts_can_use_a_wider_compiled_width():
    # A 2-token draft fits only in W=4 of (1, 4, 8): it must be a candidate.
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0),
                    cost_model=CostModel(c_base=0.05, c_tok=0.0001))
    rows = [RowView(0, "p", 10, 100)]
    n, _ = pol.choose(rows, [np.array([0.95, 0.9])], padded_step_shape(1, (1, 4, 8), 0))
    assert n.tolist() == [2]


def test_acceptance_calibration_learns_overconfident_drafts():
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, explore_every=4),
                    cost_model=CostModel(c_base=0.05, c_tok=0.004))
    rows = [RowView(i, "p", 10, 100) for i in range(4)]
    overconfident = [np.full(7, 0.9)] * 4
    widths = []
    for _ in range(60):
        n, t = pol.choose(rows, overconfident, padded_step_shape(4, (1, 4, 8), 0))
        W = width_for(n, (1, 4, 8))
        widths.append(W)
        # Verification accepts nothing: the drafter claims 90% but is always wrong.
        pol.observe(StepRecord(batch=4, active=4, width=W, kv_len=0, drafted=int(n.sum()),
                               accepted=0, emitted=4, seconds=t, accepted_per_row=(0,) * 4))
    assert widths[0] == 8                      # trusts the drafter at first
    assert pol.depth_scale[:3].max() < 0.1     # learns it is overconfident (at the depths it
    assert pol.acceptance_scale < 0.5          # keeps exploring; deeper ones less often)
    assert widths[-8:].count(1) >= 6           # then mostly stops speculating ...
    assert any(w > 1 for w in widths[-8:])     # ... but keeps exploring


def test_cost_model_follows_drift_within_its_window():
    # A machine whose speed doubles mid-run: once the window holds only new steps, the fit is
    # the new machine's.
    rng = np.random.default_rng(1)
    cm = CostModel(history=64)
    old = dict(c_base=0.040, c_tok=0.002, c_kv=4e-6)
    new = {k: v / 2 for k, v in old.items()}
    shapes = [(n, k) for n in (16, 64, 128) for k in (2048, 8192)]

    def run(true, steps):
        for i in range(steps):
            n, k = shapes[int(rng.integers(len(shapes)))]
            cm.observe_step(n, k, true["c_base"] + true["c_tok"] * n + true["c_kv"] * k)
    run(old, 200)
    assert cm.predict_step(64, 4096) == pytest.approx(0.040 + 0.128 + 0.016384, rel=1e-6)
    run(new, 64)
    assert len(cm.observations) == 64
    for k in ("c_base", "c_tok", "c_kv"):
        assert getattr(cm, k) == pytest.approx(new[k], rel=1e-6)
    # The padded spelling is the same model.
    assert cm.predict(4, 8, 512) == cm.predict_step(32, 2048)


def test_per_depth_calibration_learns_where_drafts_break():
    # The drafter claims 0.9 at every depth; verification accepts the first 2 tokens, never more.
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, acceptance_ema=0.3),
                    cost_model=CostModel(c_base=0.05, c_tok=2e-3))
    rows = [RowView(i, "p", 10, 100) for i in range(4)]
    chosen = []
    for _ in range(40):
        n, t = pol.choose(rows, [np.full(7, 0.9)] * 4, packed_step_shape(np.full(4, 64)))
        chosen.append(n.copy())
        acc = tuple(int(min(k, 2)) for k in n)
        pol.observe(StepRecord(batch=4, active=4, width=8, kv_len=64, drafted=int(n.sum()),
                               accepted=sum(acc), emitted=4 + sum(acc), seconds=t,
                               accepted_per_row=acc))
    scale = pol.depth_scale
    assert scale[0] == pytest.approx(1 / 0.9, rel=0.05) and scale[1] == pytest.approx(1 / 0.9,
                                                                                      rel=0.05)
    assert scale[2:].max() < 0.5       # lowered until speculating there stops paying
    # Speculates on the whole draft at first, then only as deep as drafts are accepted.
    assert chosen[0].tolist() == [7] * 4 and chosen[-1].tolist() == [2] * 4



def test_deferred_learning_learns_what_observe_learns_one_step_later():
    # observe(..., defer_learning=True) keeps the calibration update for learn_deferred (the
    # scheduler runs it while the device computes the next step): nothing is learned before
    # it, and the same factors after it as learning at once (run before the next choose, as
    # here); a checkpoint taken in between carries the update, and an observe without
    # deferral, of a step with drafts or without, runs what was kept.
    def make():
        return DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0,
                                          acceptance_ema=0.3),
                         cost_model=CostModel(c_base=0.05, c_tok=2e-3))
    now, later = make(), make()
    rows = [RowView(i, "p", 10, 100) for i in range(4)]
    support = [np.full(7, 1, np.int32), np.full(7, 40, np.int32), None, None]
    for step in range(6):
        for pol in (now, later):
            n, t = pol.choose(rows, [np.full(7, 0.9)] * 4, packed_step_shape(np.full(4, 64)),
                              draft_support=support)
            acc = tuple(int(min(k, 2)) for k in n)
            record = StepRecord(batch=4, active=4, width=8, kv_len=64, drafted=int(n.sum()),
                                accepted=sum(acc), emitted=4 + sum(acc), seconds=t,
                                accepted_per_row=acc)
            if pol is now:
                pol.observe(record)
            else:
                before = (pol.depth_scale.copy(), pol.support_scale.copy())
                pol.observe(record, defer_learning=True)
                np.testing.assert_array_equal(pol.depth_scale, before[0])
                np.testing.assert_array_equal(pol.support_scale, before[1])
                if step == 5:       # a checkpoint runs what is kept
                    np.testing.assert_allclose(pol.state_dict()["acceptance_by_depth"],
                                               now.depth_scale)
                pol.learn_deferred()
        np.testing.assert_allclose(later.depth_scale, now.depth_scale)
        np.testing.assert_allclose(later.support_scale, now.support_scale)
    from das_jax.speculation.das_policy import support_prior
    assert now.depth_scale[2:].max() < 0.9                 # both kinds of factors moved
    assert not np.allclose(now.support_scale, support_prior())
    for pol in (now, later):
        n, t = pol.choose(rows, [np.full(7, 0.9)] * 4, packed_step_shape(np.full(4, 64)),
                          draft_support=support)
        acc = tuple(int(min(k, 1)) for k in n)
        pol.observe(StepRecord(batch=4, active=4, width=8, kv_len=64, drafted=int(n.sum()),
                               accepted=sum(acc), emitted=4 + sum(acc), seconds=t,
                               accepted_per_row=acc), defer_learning=pol is later)
    pol.observe(StepRecord(batch=4, active=4, width=1, kv_len=64, drafted=0, accepted=0,
                           emitted=4, seconds=t))               # no drafts: later's kept update
    np.testing.assert_allclose(later.depth_scale, now.depth_scale)
    assert not later._unlearned

def _net_time(cm, n, lam, q, step_shape):
    """F(n) = t(step) - sum_b lambda_b * (1 + Q_b(n_b)), written out independently."""
    t = cm.predict_step(*step_shape(n))
    return t - sum(lam[b] * (1 + q[b, :n[b]].sum()) for b in range(len(n)))


def _token_values(cm, f, q, lens):
    """lambda_b = min over n <= lens[b] of (f_b + c_tok * n) / (1 + Q_b(n)), by brute force."""
    return np.array([min((f[b] + cm.c_tok * k) / (1 + q[b, :k].sum()) for k in range(lens[b] + 1))
                     for b in range(len(f))])


@pytest.mark.parametrize("engine", ["padded", "packed"])
def test_budget_never_worse_than_no_drafts_or_all_drafts(engine):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(
        c_base=st.floats(1e-4, 0.1), c_tok=st.floats(0.0, 5e-3), c_kv=st.floats(0.0, 1e-5),
        seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 12))
    def check(c_base, c_tok, c_kv, seed, batch):
        rng = np.random.default_rng(seed)
        cm = CostModel(c_base=c_base, c_tok=c_tok, c_kv=c_kv)
        history = {"s": [5] * 4, "m": [50] * 4, "l": [500] * 4}
        pol = DASPolicy(lambda pid: history.get(pid, []), DASConfig(explore_every=0), cm)
        for lens in history.values():
            for n in lens:
                pol.end(-1, n)
        rows = []
        for i in range(batch):
            pid = ["s", "m", "l"][int(rng.integers(3))]
            pol.begin(i, pid, 4)
            rows.append(RowView(i, pid, int(rng.integers(0, 600)), 1000))
        pol.depth_scale = rng.uniform(0.3, 1.5, size=int(rng.integers(1, 16)))
        probs = [np.sort(rng.uniform(0, 1, int(rng.integers(0, 16))))[::-1].astype(np.float32)
                 for _ in range(batch)]
        kv = rng.integers(16, 4096, batch)
        shape = (padded_step_shape(batch, (1, 2, 4, 8, 16), int(kv.max())) if engine == "padded"
                 else packed_step_shape(kv, (8, 16, 32, 64, 128, 256)))
        n, t = pol.choose(rows, probs, shape)
        lens = np.array([len(p) for p in probs], np.int32)
        assert n.dtype == np.int32 and (0 <= n).all() and (n <= lens).all()
        assert t == pytest.approx(cm.predict_step(*shape(n)))
        q = pol.calibrated(probs)
        share = pol.base_shares(rows, pol.row_weights(rows))
        assert share.sum() == pytest.approx(1.0)
        f = c_tok + share * (c_base + c_kv * shape(np.zeros_like(lens))[1])
        lam = _token_values(cm, f, q, lens)
        F = _net_time(cm, n, lam, q, shape)
        tol = 1e-9 * (1 + abs(F))
        assert F <= _net_time(cm, np.zeros_like(lens), lam, q, shape) + tol
        assert F <= _net_time(cm, lens, lam, q, shape) + tol
    check()


def test_fixed_policy_verifies_whole_drafts_and_plan_sets_the_width():
    n, t = FixedPolicy().choose([RowView(0, 0, 0, 9)] * 2, [np.ones(2), np.ones(5)],
                                padded_step_shape(2, (1, 4, 8), 128))
    assert n.tolist() == [2, 5] and t is None
    assert padded_step_shape(2, (1, 4, 8), 128)(n) == (16, 256)
    assert packed_step_shape(np.array([100, 28]), (4, 16))(n) == (16, 128)
    assert packed_step_shape(np.array([100, 28]))(n) == (9, 128)


def test_packed_budget_is_each_rows_own_optimum():
    # On a packed step linear in the token slots, F separates by row: each row verifies the
    # draft length minimising its expected cost per emitted token, (f_b + c_tok n) / (1 + Q_b(n)),
    # i.e. adds its d-th draft token exactly when lambda_b * q_b,d >= c_tok.
    rng = np.random.default_rng(3)
    for trial in range(40):
        cm = CostModel(c_base=float(rng.uniform(1e-3, 0.05)), c_tok=float(rng.uniform(1e-5, 2e-3)),
                       c_kv=float(rng.uniform(0, 2e-7)))
        pol = DASPolicy(config=DASConfig(explore_every=0), cost_model=cm)
        B = int(rng.integers(1, 40))
        pol.admission_order(["p"] * B)
        rows = []
        for i in range(B):
            pol.begin(i, "p", 8)
            rows.append(RowView(i, "p", int(rng.integers(0, 500)), 1000))
        probs = [np.sort(rng.uniform(0, 1, int(rng.integers(0, 16))))[::-1] for _ in range(B)]
        kv = rng.integers(16, 8192, B)
        n, _ = pol.choose(rows, probs, packed_step_shape(kv))
        q = pol.calibrated(probs)
        f = cm.c_tok + (cm.c_base + cm.c_kv * kv.sum()) / B   # none waits, all medium: 1/B each
        for b in range(B):
            g = [(f + cm.c_tok * k) / (1 + q[b, :k].sum()) for k in range(len(probs[b]) + 1)]
            assert n[b] == int(np.argmin(g)), (trial, b, g)


def test_per_step_cost_share_follows_queue_and_classes():
    history = {"s": [5] * 4, "l": [500] * 4}
    pol = policy_with_history(history, short_threshold=10, long_threshold=100)
    pol.admission_order(["s", "l", "l"])
    pol.begin(0, "s", 4)
    pol.begin(1, "l", 4)
    rows = [RowView(0, "s", 0, 100), RowView(1, "l", 0, 100)]
    # A request still waits: a row finishing early is replaced, so the rows share equally.
    assert pol.base_shares(rows, pol.row_weights(rows)).tolist() == [0.5, 0.5]
    pol.begin(2, "l", 4)
    rows.append(RowView(2, "l", 0, 100))
    # None waits: by class weight (short 0.5, long 2), the long rows decide the step's end.
    assert pol.base_shares(rows, pol.row_weights(rows)) == pytest.approx([0.5 / 4.5, 2 / 4.5,
                                                                          2 / 4.5])
    # A long row bears more of the step's fixed cost, so it values its tokens more and drafts
    # deeper on the same draft.
    cm = pol.cost_model = CostModel(c_base=0.02, c_tok=2e-4, c_kv=0.0)
    probs = [0.6 ** np.arange(1, 8)] * 3
    n, _ = pol.choose(rows, probs, packed_step_shape(np.full(3, 64)))
    assert n[0] < n[1] == n[2], n
    f = cm.c_tok + 0.02 * np.array([0.5, 2, 2]) / 4.5
    q = pol.calibrated(probs)
    for b in range(3):
        g = [(f[b] + cm.c_tok * k) / (1 + q[b, :k].sum()) for k in range(8)]
        assert n[b] == int(np.argmin(g))


# ------------------------------------------------------------------------- support buckets
def test_support_buckets_and_step_ratios():
    from das_jax.speculation.das_policy import step_ratios, support_bucket, support_prior
    assert support_bucket(np.array([0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 1000])).tolist() == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    np.testing.assert_allclose(step_ratios(np.array([1.0, 0.5, 0.25, 0.0, 0.0])),
                               [1.0, 0.5, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(support_prior(), [1 / 2, 2 / 3, 4 / 5, 8 / 9, 16 / 17, 32 / 33])


def test_calibration_by_support_learns_that_once_seen_tokens_are_coin_flips():
    # A suffix-trie token continuing a path seen once has count ratio 1, and the old
    # per-depth calibration could not tell it from a token seen 40 times. Rows 0-1 draft tokens
    # seen once, rows 2-3 tokens seen 40 times, all with drafter ratio 1; verification accepts
    # 1 of rows 0-1's 4 tokens and all of rows 2-3's.
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, acceptance_ema=1.0),
                    cost_model=CostModel(c_base=1.0, c_tok=1e-6))
    rows = [RowView(i, "p", 10, 100) for i in range(4)]
    probs = [np.ones(4, np.float32)] * 4
    support = [np.full(4, 1, np.int32)] * 2 + [np.full(4, 40, np.int32)] * 2
    n, t = pol.choose(rows, probs, packed_step_shape(np.full(4, 64)), draft_support=support)
    assert n.tolist() == [4] * 4
    pol.observe(StepRecord(batch=4, active=4, width=8, kv_len=64, drafted=16, accepted=10,
                           emitted=14, seconds=t, accepted_per_row=(1, 1, 4, 4)))
    # Bucket 0 (support 1): 2 tokens verified per row after an accepted prefix, 1 accepted.
    # Bucket 5 (support 32+): 4 verified, 4 accepted. Others keep their prior.
    from das_jax.speculation.das_policy import support_prior
    want = support_prior()
    want[0], want[5] = 0.5, 1.0
    np.testing.assert_allclose(pol.support_scale, want)
    assert (pol.depth_scale == 1.0).all()      # drafts with support leave the depth factors
    q = pol.calibrated([np.ones(3), np.ones(3), np.array([1.0, 0.5, 0.5])],
                       [np.ones(3, np.int32), np.full(3, 40, np.int32),
                        np.array([40, 40, 3], np.int32)])
    np.testing.assert_allclose(q[0], [0.5, 0.25, 0.125])
    np.testing.assert_allclose(q[1], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(q[2], [1.0, 0.5, 0.5 * 2 / 3])
    # Where drafts cost something, the budget now drafts deep for the well-supported rows only.
    pol.cost_model = CostModel(c_base=0.03, c_tok=0.004)
    n, _ = pol.choose(rows, probs, packed_step_shape(np.full(4, 64)), draft_support=support)
    assert n[2] == n[3] == 4 and n[0] == n[1] < 2
    # The learned factors are state: a checkpoint and a fork carry them.
    other = DASPolicy(config=pol.config)
    other.load_state_dict(pol.state_dict())
    np.testing.assert_allclose(other.support_scale, pol.support_scale)
    np.testing.assert_allclose(pol.fork().support_scale, pol.support_scale)
    other.load_state_dict({"finished_lengths": []})       # an older checkpoint: the prior
    np.testing.assert_allclose(other.support_scale, support_prior())


def test_plan_step_hands_the_drafts_support_to_the_policy():
    from das_jax.engine.policy import plan_step

    class Supported:
        def propose(self, request_id, max_tokens):
            k = min(max_tokens, 3)
            return Draft(np.arange(k, dtype=np.int32), np.ones(k, np.float32),
                         np.full(k, 7 + request_id, np.int32))

    seen = {}

    class Recorder(FixedPolicy):
        def choose(self, rows, drafts, step_shape):
            seen["drafts"] = drafts
            return super().choose(rows, drafts, step_shape)

    rows = [RowView(i, "p", 10, 100) for i in range(2)]
    plan = plan_step(Supported(), Recorder(), rows, 2, (1, 4), 64)
    assert seen["drafts"].support_AxK.tolist() == [[7, 7, 7], [8, 8, 8]]
    assert seen["drafts"].has_support_A.tolist() == [True, True]
    assert [plan.drafts.row(j).tokens.tolist() for j in range(2)] == [[0, 1, 2]] * 2


def test_draft_support_must_match_its_tokens():
    with pytest.raises(ValueError, match="support"):
        Draft(np.zeros(3, np.int32), np.ones(3, np.float32), np.ones(2, np.int32))


def _two_sources():
    """Row 0: a long draft of middling path probabilities (the larger expected accepted
    length: the drafter's pick) with a short confident alternative; row 1: no alternative;
    row 2: no draft but an alternative."""
    from das_jax.drafter.base import DraftBatch
    long_p = [0.45, 0.4, 0.38, 0.36, 0.35, 0.34, 0.33]
    primary = DraftBatch.empty(3, 7)
    primary.tokens_AxK[0] = np.arange(11, 18)
    primary.probs_AxK[0] = long_p
    primary.tokens_AxK[1, :2] = [5, 6]
    primary.probs_AxK[1, :2] = [0.9, 0.8]
    primary.lens_A[:] = [7, 2, 0]
    alt = DraftBatch.empty(3, 2)
    alt.tokens_AxK[0] = [21, 22]
    alt.probs_AxK[0] = [0.97, 0.9]
    alt.tokens_AxK[2] = [31, 32]
    alt.probs_AxK[2] = [0.6, 0.5]
    alt.lens_A[:] = [2, 0, 2]
    import dataclasses
    return dataclasses.replace(primary, source_A=np.array([3, 0, -1], np.int8),
                               alternative=dataclasses.replace(
                                   alt, source_A=np.array([0, -1, 3], np.int8)))


@pytest.mark.parametrize("c_tok, row0", [(0.02, "alternative"), (1e-4, "primary")])
def test_pick_sources_prices_each_row_with_the_cost_model(c_tok, row0):
    """The source verified per row is the one with the smaller expected seconds per emitted
    token under the step's cost model: with verify slots dear, row 0's short confident draft
    beats its long middling one (whose expected accepted length is larger); with slots cheap
    the long one wins. A row with no alternative keeps its draft; a row with no draft takes
    its alternative; das-unlimited keeps the drafter's pick."""
    db = _two_sources()
    rows = [RowView(i, "p", 10, 100) for i in range(3)]
    shape = padded_step_shape(3, (1, 4, 8), 0)
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0),
                    cost_model=CostModel(c_base=0.05, c_tok=c_tok))
    out = pol.pick_sources(rows, db, shape)
    want0 = [21, 22] if row0 == "alternative" else list(range(11, 18))
    other0 = list(range(11, 18)) if row0 == "alternative" else [21, 22]
    assert out.tokens_AxK[0, :out.lens_A[0]].tolist() == want0
    # each row's other draft rides along as the alternative (a token tree's second branch)
    o = out.alternative
    assert o.tokens_AxK[0, :o.lens_A[0]].tolist() == other0 and o.lens_A.tolist()[1:] == [0, 0]
    assert out.source_A.tolist() == [0 if row0 == "alternative" else 3, 0, 3]
    assert out.lens_A.tolist() == [len(want0), 2, 2]
    assert out.tokens_AxK[1, :2].tolist() == [5, 6] and out.tokens_AxK[2, :2].tolist() == [31, 32]
    n, _ = pol.choose(rows, out, shape)               # the picked drafts are sized as usual
    assert (n <= out.lens_A).all()
    unlimited = DASPolicy(config=DASConfig(unlimited=True),
                          cost_model=CostModel(c_base=0.05, c_tok=c_tok))
    kept = unlimited.pick_sources(rows, db, shape)
    assert kept.lens_A.tolist() == [7, 2, 0] and kept.alternative is None


def test_plan_step_verifies_the_drafters_pick_without_pick_sources():
    """A policy without `pick_sources` (FixedPolicy) verifies each row's own draft; the DAS
    policy's pick goes through `plan_step` to the step."""
    from das_jax.engine.policy import RowBatch, plan_step

    class Drafter:
        def propose_batch(self, ids, k_A):
            return _two_sources()
    rows = RowBatch.of([RowView(i, "p", 10, 100) for i in range(3)])
    fixed = plan_step(Drafter(), FixedPolicy(), rows, 3, (1, 4, 8), 0)
    assert fixed.drafts.lens_A.tolist() == [7, 2, 0] and fixed.drafts.alternative is None
    das = plan_step(Drafter(), DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0),
                                         cost_model=CostModel(c_base=0.05, c_tok=0.02)),
                    rows, 3, (1, 4, 8), 0)
    assert das.drafts.source_A.tolist() == [0, 0, 3]
    k = int(das.drafts.lens_A[0])              # sized by `choose` (0 until shapes are measured)
    assert das.drafts.tokens_AxK[0, :k].tolist() == [21, 22][:k]


def test_length_thresholds_follow_the_window_without_re_sorting():
    """The class thresholds are `np.quantile` of the finished lengths in the window, from a
    sorted copy `end` keeps (the oldest length leaving it once the window is full), and
    rebuilt after the window is replaced (a checkpoint)."""
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 100):
        xs = np.sort(rng.integers(0, 5000, n)).tolist()
        for q in (1 / 3, 2 / 3, 0.5, float(rng.random())):
            assert _quantile(xs, q) == np.quantile(np.asarray(xs, np.float64), q)
    pol = DASPolicy(config=DASConfig(length_history=50, min_history=8))
    for i in range(400):
        pol.end(i, int(rng.integers(1, 3000)))
        if i >= 7:
            lens = np.asarray(pol.finished_lengths, np.float64)
            assert pol.thresholds() == (float(np.quantile(lens, 1 / 3)),
                                        float(np.quantile(lens, 2 / 3)))
    pol.load_state_dict({"finished_lengths": [5, 10, 20, 40, 80, 160, 320, 640, 1280]})
    lens = np.asarray(pol.finished_lengths, np.float64)
    assert pol.thresholds() == (float(np.quantile(lens, 1 / 3)), float(np.quantile(lens, 2 / 3)))
