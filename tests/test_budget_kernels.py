"""The DAS policy's compiled per-step kernels (`das_jax.speculation._budget_kernels`) against the
numpy formulation of the same arithmetic, written out here, on random drafts: calibration,
token values, candidates, savings, the one-pass `choice_table` and the calibration updates,
compiled and as plain Python (`py_func`)."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.speculation import _budget_kernels as bk
from das_jax.speculation.acceptance import (AGE_BUCKETS, SCALE_RANGE, calibrated_paths,
                                            support_bucket, support_prior, update_depth_scale,
                                            update_support_scale)
from das_jax.speculation.das_policy import MAX_VALUE_CUTS, DASPolicy


def _ratios(P):
    prev = np.concatenate([np.ones(P.shape[:-1] + (1,)), P[..., :-1]], axis=-1)
    return np.divide(P, prev, out=np.zeros_like(P), where=prev > 0)


def _ref_calibrated(probs, lens, support, has_support, depth_scale, scale_JxS, age_buckets):
    D = int(lens.max(initial=0))
    if D == 0:
        return np.zeros((len(lens), 0))
    valid = np.arange(D)[None, :] < lens[:, None]
    P = np.where(valid, probs.astype(np.float64)[:, :D], 0.0)
    q = np.minimum.accumulate(np.clip(P * depth_scale[None, :D], 0.0, 1.0), axis=1)
    sup = scale_JxS[np.maximum(age_buckets, 0)[:, None], support_bucket(support[:, :D])]
    q_sup = np.cumprod(np.clip(_ratios(P) * sup, 0.0, 1.0), axis=1)
    q = np.where(has_support[:, None], q_sup, q)
    return np.where(valid, q, 0.0)


def _ref_token_values(f, c_tok, cum, lens):
    n = np.arange(cum.shape[1])
    g = (f[:, None] + c_tok * n[None, :]) / (1.0 + cum)
    g = np.where(n[None, :] <= lens[:, None], g, np.inf)
    best = np.argmin(g, axis=1)
    return g[np.arange(len(f)), best], best


def _ref_candidates(lens, value, n_opt):
    D = value.shape[1]
    caps = np.arange(0, D + 1)[:, None]
    out = [np.minimum(lens[None, :], caps)]
    top = int(n_opt.max(initial=0))
    out.append(np.minimum(n_opt[None, :], caps[1:top + 1]))
    pos = value[value > 0]
    if pos.size:
        cuts = np.unique(pos)[::-1]
        if len(cuts) > MAX_VALUE_CUTS:
            cuts = cuts[np.linspace(0, len(cuts) - 1, MAX_VALUE_CUTS).round().astype(int)]
        ge = (value[None, :, :] >= cuts[:, None, None]).sum(axis=2)
        out.append(np.minimum(ge, lens[None, :]))
    return np.concatenate(out)


def _ref_support_update(g_JxS, n, acc, probs, support, rows, ema, age_buckets):
    acc = np.minimum(acc, n)
    K = int(n.max(initial=0))
    col = np.arange(K)[None, :]
    tried = (col < np.minimum(acc + 1, n)[:, None]) & rows[:, None]
    J, S = g_JxS.shape
    if not tried.any():
        return np.zeros(J, bool)
    cell = (np.maximum(age_buckets, 0)[:, None] * S + support_bucket(support[:, :K]))[tried]
    ratio = _ratios(probs.astype(np.float64)[:, :K])[tried]
    hit = np.broadcast_to(col < acc[:, None], tried.shape)[tried]
    expected = np.bincount(cell, weights=ratio, minlength=J * S).reshape(J, S)
    accepted = np.bincount(cell, weights=hit.astype(np.float64), minlength=J * S).reshape(J, S)
    seen = expected > 0
    g_JxS[seen] = (1 - ema) * g_JxS[seen] + ema * accepted[seen] / expected[seen]
    np.clip(g_JxS, *SCALE_RANGE, out=g_JxS)
    return seen.any(axis=1)


def _random_drafts(rng, A, K):
    lens = rng.integers(0, K + 1, A)
    probs = np.zeros((A, K), np.float32)
    support = np.zeros((A, K), np.int32)
    for b in range(A):
        p = np.cumprod(rng.choice([1.0, 0.9, 0.5, 0.25, 0.0], lens[b], p=[.4, .2, .2, .15, .05]))
        probs[b, :lens[b]] = p
        support[b, :lens[b]] = rng.integers(0, 80, lens[b])
    has = rng.random(A) < 0.6
    return probs, lens, support, has


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "python"])
@pytest.mark.parametrize("seed", range(6))
def test_kernels_equal_the_numpy_formulation(seed, jit):
    rng = np.random.default_rng(seed)
    A, K = int(rng.integers(1, 40)), int(rng.integers(1, 16))
    probs, lens, support, has = _random_drafts(rng, A, K)
    depth_RxK = rng.uniform(0.3, 1.6, (3, K))       # per-depth factors of 3 draft sources
    depth_rows = rng.integers(0, 3, A)
    scale_JxS = rng.uniform(0.3, 1.6, (AGE_BUCKETS, 6))
    age_buckets = rng.integers(-1, AGE_BUCKETS, A)
    call = (lambda k: k) if jit else (lambda k: k.py_func)

    q = call(bk.calibrate)(probs.astype(np.float64), lens.astype(np.int64),
                           support.astype(np.int64), has, depth_RxK, depth_rows, scale_JxS,
                           np.maximum(age_buckets, 0))
    q_ref = np.zeros_like(q)
    for r in range(3):    # each row calibrated by its own source's depth factors
        q_r = _ref_calibrated(probs, lens, support, has, depth_RxK[r], scale_JxS, age_buckets)
        q_ref[depth_rows == r] = q_r[depth_rows == r]
    np.testing.assert_array_equal(q, calibrated_paths(probs, lens, support, has, list(depth_RxK),
                                                      scale_JxS, age_buckets, depth_rows))
    np.testing.assert_array_equal(q, q_ref)
    one = calibrated_paths(probs, lens, support, has, depth_RxK[1], scale_JxS, age_buckets)
    np.testing.assert_array_equal(one, _ref_calibrated(probs, lens, support, has, depth_RxK[1],
                                                       scale_JxS, age_buckets))
    assert np.all(np.diff(q, axis=1) <= 0)

    cum = call(bk.prefix_sums)(q)
    np.testing.assert_array_equal(cum, np.concatenate([np.zeros((A, 1)), np.cumsum(q, 1)], 1))
    f = rng.uniform(1e-4, 1e-2, A)
    lam, n_opt = call(bk.token_values)(f, 3e-5, cum, lens.astype(np.int64))
    lam_ref, n_ref = _ref_token_values(f, 3e-5, cum, lens)
    np.testing.assert_array_equal(lam, lam_ref)
    np.testing.assert_array_equal(n_opt, n_ref)

    value = lam[:, None] * q
    n_CxA = call(bk.candidates)(lens.astype(np.int64), value, n_opt, MAX_VALUE_CUTS, True)
    np.testing.assert_array_equal(n_CxA, _ref_candidates(lens, value, n_opt))
    assert np.all(n_CxA <= lens[None, :])

    saved, sums, longest, drafting = call(bk.expected_savings)(n_CxA, lam, cum)
    saved_ref = (lam[None, :] * (1.0 + cum[np.arange(A)[None, :], n_CxA])).sum(axis=1)
    np.testing.assert_allclose(saved, saved_ref, rtol=1e-13)
    np.testing.assert_array_equal(sums, n_CxA.sum(axis=1))
    np.testing.assert_array_equal(longest, n_CxA.max(axis=1, initial=0))
    np.testing.assert_array_equal(drafting, np.count_nonzero(n_CxA > 0, axis=1))

    cols = rng.integers(0, 3, (4, int(rng.integers(1, 60))))     # shape columns, few distinct
    first, inv = call(bk.distinct_rows)(cols)
    index: dict = {}
    inv_ref = [index.setdefault(tuple(c), len(index)) for c in cols.T.tolist()]
    np.testing.assert_array_equal(inv, inv_ref)
    np.testing.assert_array_equal(cols[:, first].T, np.array(list(index)))

    # the policy's one-pass kernel: the same values, plus each choice's step shape (the packed
    # step's, `PackedStepShape.many`) and the distinct shapes among them; without shape
    # arguments, no shapes
    from das_jax.engine import step_shape_fn
    step_shape = step_shape_fn(64, 512, (1, 4, 8, 16), wide_buckets=(2, 4, 8, 16))
    args = (probs.astype(np.float64), lens.astype(np.int64), support.astype(np.int64), has,
            depth_RxK, depth_rows, scale_JxS, np.maximum(age_buckets, 0), f, 3e-5,
            MAX_VALUE_CUTS)
    none = (np.zeros(0, np.int64),) * 3 + (0, 0)
    for shape_args in (step_shape.kernel_args(), none):
        q2, cum2, lam2, n2, saved2, sums2, cols2, first2, inv2 = call(bk.choice_table)(
            *args, *shape_args)
        for a, b in ((q2, q), (cum2, cum), (lam2, lam), (n2, n_CxA), (saved2, saved),
                     (sums2, sums)):
            np.testing.assert_array_equal(a, b)
        if shape_args is none:
            assert cols2.shape == (4, 0) and first2.size == inv2.size == 0
            continue
        np.testing.assert_array_equal(cols2, np.stack(step_shape.many(n_CxA)))
        for c, n_A in enumerate(n_CxA):         # equal to the shape function of each choice
            one = step_shape(n_A)
            assert (one[0], one[1], one.width, one.wide_rows) == tuple(cols2[:, c])
        f_ref, i_ref = bk.distinct_rows(cols2)
        np.testing.assert_array_equal(first2, f_ref)
        np.testing.assert_array_equal(inv2, i_ref)


@pytest.mark.parametrize("seed", range(6))
def test_calibration_updates_equal_the_numpy_formulation(seed):
    rng = np.random.default_rng(seed)
    A, K = int(rng.integers(1, 40)), int(rng.integers(1, 16))
    probs, lens, support, has = _random_drafts(rng, A, K)
    n = np.minimum(lens, rng.integers(0, K + 1, A))
    acc = rng.integers(0, K + 2, A)
    rows = has & (n > 0)

    g, g_ref = support_prior(), support_prior()
    update_support_scale(g, n, acc, probs, support, rows, 0.1)
    _ref_support_update(g_ref[None], n.astype(np.int64), acc.astype(np.int64), probs, support,
                        rows, 0.1, np.full(A, -1))
    np.testing.assert_array_equal(g, g_ref)
    # per (history age, support) bucket
    ages = rng.integers(-1, AGE_BUCKETS, A)
    g2 = rng.uniform(0.5, 1.5, (AGE_BUCKETS, 6))
    g2_ref = g2.copy()
    had = update_support_scale(g2, n, acc, probs, support, rows, 0.1, ages)
    had_ref = _ref_support_update(g2_ref, n.astype(np.int64), acc.astype(np.int64), probs,
                                  support, rows, 0.1, ages)
    np.testing.assert_array_equal(g2, g2_ref)
    np.testing.assert_array_equal(had, had_ref)

    D = int(n.max(initial=0))
    s = update_depth_scale(np.ones(2), n, acc, int(acc.sum()), probs, 0.1)
    if D:
        drafted = np.arange(D)[None, :] < n[:, None]
        expected = np.where(drafted, probs.astype(np.float64)[:, :D], 0.0).sum(axis=0)
        accepted = (np.minimum(acc, n)[:, None] >= np.arange(1, D + 1)[None, :]).sum(axis=0)
        ref = np.ones(max(D, 2))
        seen = expected > 0
        ref[:D][seen] = 0.9 + 0.1 * accepted[seen] / expected[seen]
        np.testing.assert_allclose(s, np.clip(ref, *SCALE_RANGE), rtol=1e-15)
    # the step's total only (no per-row counts): every depth moves toward it
    s_tot = update_depth_scale(np.ones(1), n, None, 3, probs, 0.5)
    if D:
        tot = np.where(np.arange(D)[None, :] < n[:, None], probs[:, :D], 0.0).sum()
        np.testing.assert_allclose(s_tot, np.clip(0.5 + 0.5 * 3 / max(tot, 1e-12),
                                                  *SCALE_RANGE), rtol=1e-6)


def test_public_methods_are_the_kernels():
    """`DASPolicy.token_values` / `candidates` / `calibrated` give the numpy formulation's
    values on a hand-made batch (and `calibrated_paths` of no draft is `[A, 0]`)."""
    pol = DASPolicy()
    probs = [np.array([1.0, 0.5, 0.5]), np.array([0.9]), np.zeros(0)]
    q = pol.calibrated(probs)
    np.testing.assert_allclose(q, [[1.0, 0.5, 0.5], [0.9, 0, 0], [0, 0, 0]])
    cum = np.concatenate([np.zeros((3, 1)), np.cumsum(q, 1)], 1)
    lam, n = DASPolicy.token_values(np.array([1.0, 1.0, 1.0]), 0.25, cum, np.array([3, 1, 0]))
    # row 0: g = 1, 1.25/2, 1.5/2.5, 1.75/3 -> n = 3; row 1: 1, 1.25/1.9 -> 1; row 2: 1
    np.testing.assert_allclose(lam, [1.75 / 3, 1.25 / 1.9, 1.0])
    assert n.tolist() == [3, 1, 0]
    cand = pol.candidates(np.array([3, 1, 0]), lam[:, None] * q, n)
    np.testing.assert_array_equal(cand, _ref_candidates(np.array([3, 1, 0]), lam[:, None] * q, n))
    assert calibrated_paths(np.zeros((2, 4)), np.zeros(2, np.int64), np.zeros((2, 4)),
                            np.zeros(2, bool), np.ones(1), support_prior()).shape == (2, 0)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "python"])
@pytest.mark.parametrize("seed", range(4))
def test_row_classes_equal_the_numpy_formulation(seed, jit):
    """`row_classes` (`DASPolicy.current_classes`): recorded classes, unrecorded and unknown
    ids as medium, promotion by generated length (recorded in place, or with `record` false
    not), short only when the thresholds differ."""
    rng = np.random.default_rng(seed)
    class_R = rng.integers(-1, 3, 30).astype(np.int8)
    ids = rng.integers(-2, 34, 25)
    gen = rng.integers(0, 400, 25)
    th = [(100.0, 250.0), (150.0, 150.0), None][seed % 3]
    ref_R = class_R.copy()
    known = (ids >= 0) & (ids < len(ref_R))
    cls = np.full(len(ids), 1, np.int8)
    cls[known] = ref_R[ids[known]]
    cls[cls == -1] = 1
    if th is not None:
        grown = DASPolicy.classify_lengths(gen, th)
        up = known & (grown > cls)
        cls = np.where(up, grown, cls).astype(np.int8)
        ref_R[ids[up]] = cls[up]
    kernel = bk.row_classes if jit else bk.row_classes.py_func
    lo, hi = th if th is not None else (0.0, 0.0)
    before = class_R.copy()
    peek = kernel(ids.astype(np.int64), gen.astype(np.int64), class_R, lo, hi, th is not None,
                  False)
    np.testing.assert_array_equal(peek, cls)
    np.testing.assert_array_equal(class_R, before)
    out = kernel(ids.astype(np.int64), gen.astype(np.int64), class_R, lo, hi, th is not None,
                 True)
    np.testing.assert_array_equal(out, cls)
    np.testing.assert_array_equal(class_R, ref_R)
