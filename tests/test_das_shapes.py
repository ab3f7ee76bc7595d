"""The DAS budget on measured step shapes: the cost model's per-shape table (N, K, W), the step
shape's width, the policy's preference for measured (compiled) shapes."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.engine.cost_model import CostModel
from das_jax.engine.das_policy import DASConfig, DASPolicy
from das_jax.engine.policy import RowView, StepRecord
from das_jax.engine.schedule import StepShape, packed_width, step_shape_fn


def test_step_shape_carries_the_width_and_compares_as_a_pair():
    shape = step_shape_fn("packed", 16, 128, (1, 4, 8))
    s = shape(np.array([3] + [0] * 15))
    assert s == (24, 2048) and s.width == 4 and isinstance(s, StepShape)
    assert shape(np.zeros(16, np.int32)).width == 1
    assert shape(np.array([7, 1])).width == 8 == packed_width([7, 1], (1, 4, 8))
    n, k = shape(np.array([5, 0]))
    assert (n, k) == (16, 2048)
    padded = step_shape_fn("padded", 4, 64, (1, 4, 8))(np.array([2, 0, 0, 0]))
    assert padded == (16, 256) and padded.width == 4


def test_cost_model_prices_measured_shapes_by_their_times():
    cm = CostModel(c_base=0.05, c_tok=0.003, c_kv=0.0, table_min=2, table_window=4)
    linear = cm.predict_step(24, 2048)
    assert not cm.seen(24, 2048, 4)
    cm.observe_step(24, 2048, 0.30, width=4)
    assert cm.seen(24, 2048, 4) and not cm.seen(24, 2048, 8)
    # One observation is not enough (table_min = 2): still the linear fit.
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(cm.predict_step(24, 2048))
    for t in (0.31, 0.29, 0.50):
        cm.observe_step(24, 2048, t, width=4)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(np.median([0.31, 0.29, 0.50,
                                                                          0.30]))
    # The window keeps the most recent table_window times: the machine got slower.
    for t in (0.6, 0.6, 0.6):
        cm.observe_step(24, 2048, t, width=4)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(0.6)
    # Without a width, or at another width, the linear fit prices the shape.
    assert cm.predict_step(24, 2048) == pytest.approx(cm.c_base + cm.c_tok * 24)
    assert cm.predict_step(24, 2048, width=8) == cm.predict_step(24, 2048)
    assert linear != cm.predict_step(24, 2048, width=4)


def _policy(cm, explore_every=0):
    return DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0,
                                      explore_every=explore_every), cost_model=cm)


def test_budget_follows_measured_cost_not_the_fit():
    # The fit says a draft slot is nearly free; the step with drafts was measured 40% dearer.
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    shape = step_shape_fn("packed", 4, 128, (1, 4, 8))
    probs = [np.array([0.5])] * 4        # +2 expected tokens for 4 rows: pays only if < 50%
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0)
    assert _policy(cm).choose(rows, probs, shape)[0].tolist() == [1] * 4
    for _ in range(2):
        cm.observe_step(4, 512, 0.050, width=1)
        cm.observe_step(8, 512, 0.080, width=4)
    n, t = _policy(cm).choose(rows, probs, shape)
    assert n.tolist() == [0] * 4 and t == pytest.approx(0.050)
    # Measured cheap: it drafts, and predicts the measured time.
    cm2 = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0)
    for _ in range(2):
        cm2.observe_step(4, 512, 0.050, width=1)
        cm2.observe_step(8, 512, 0.055, width=4)
    n, t = _policy(cm2).choose(rows, probs, shape)
    assert n.tolist() == [1] * 4 and t == pytest.approx(0.055)


def test_unmeasured_drafting_shapes_wait_for_an_exploration_step():
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    shape = step_shape_fn("packed", 4, 128, (1, 4, 8))
    probs = [np.full(7, 0.95)] * 4       # the fit says drafting all of it pays
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0)
    for _ in range(2):
        cm.observe_step(4, 512, 0.050, width=1)    # only the plain step was measured
    pol = _policy(cm, explore_every=4)
    chosen = []
    for _ in range(8):
        n, t = pol.choose(rows, probs, shape)
        chosen.append(int(n.sum()))
        w = packed_width(n, (1, 4, 8))
        pol.observe(StepRecord(batch=4, active=4, width=w, kv_len=128, drafted=int(n.sum()),
                               accepted=0, emitted=4, seconds=0.05, num_tokens=shape(n)[0],
                               attended_kv=512, accepted_per_row=(0,) * 4))
    # Steps 1-3: only measured shapes (no drafts); step 4 explores the unmeasured one, whose
    # time (as cheap as the plain step) is now measured, so later steps may draft.
    assert chosen[:3] == [0, 0, 0] and chosen[3] > 0
    assert cm.seen(shape(np.full(4, 7))[0], 512, 8)
    # Without any measured shape (a fresh or frozen model), every shape is priced alike.
    fresh = _policy(CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0))
    assert fresh.choose(rows, probs, shape)[0].sum() > 0


def test_unmeasured_shapes_are_explored_at_most_once_per_unseen_every_explorations():
    from das_jax.engine.das_policy import UNSEEN_EVERY
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    shape = step_shape_fn("packed", 4, 128, (1, 4, 8))
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0)
    for _ in range(2):
        cm.observe_step(4, 512, 0.050, width=1)
    pol = _policy(cm, explore_every=2)
    chosen = []
    for step in range(1, 2 * UNSEEN_EVERY + 5):
        probs = [np.full(7, 0.95)] * 4 if step <= 2 else [np.array([0.9])] * 4
        n, _ = pol.choose(rows, probs, shape)
        chosen.append(int(n.sum()))
        s = shape(n)
        # The first explored shape (every row's whole draft) turns out slow.
        pol.observe(StepRecord(batch=4, active=4, width=s.width, kv_len=128,
                               drafted=int(n.sum()), accepted=0, emitted=4,
                               seconds=0.2 if n.sum() else 0.05, num_tokens=s[0],
                               attended_kv=512, accepted_per_row=(0,) * 4))
    # Step 2 explored an unmeasured shape; the next unmeasured one (one draft token per row,
    # predicted well better by the fit) waits UNSEEN_EVERY * explore_every steps.
    assert chosen[1] == 28
    first_again = 2 + UNSEEN_EVERY * 2
    assert chosen[2:first_again - 1] == [0] * (first_again - 3)
    assert chosen[first_again - 1] == 4
