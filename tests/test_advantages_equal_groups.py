"""Equal-reward groups get exactly zero advantage.

The kind of fault: a float32 group mean's rounding residue (8 x 0.7 -> +5.96e-4 advantage each)
passing the std guard. For any G and any value, every scale_rewards mode, jitted or not, a group
of equal rewards gets exactly 0 and is counted in ``frac_reward_zero_std``.
"""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from das_jax.rl import advantages as adv_lib

MODES = adv_lib.SCALE_REWARDS


@functools.lru_cache(maxsize=None)
def _jitted(G, mode):
    return jax.jit(functools.partial(adv_lib.group_advantages, num_generations=G, scale_rewards=mode))


def _both(rewards, G, mode):
    eager = np.asarray(adv_lib.group_advantages(np.asarray(rewards, np.float32), G, mode))
    jitted = np.asarray(_jitted(G, mode)(np.asarray(rewards, np.float32)))
    return eager, jitted


@pytest.mark.parametrize("mode", MODES)
def test_group_of_8_all_0p7_is_exactly_zero(mode):
    rewards = [0.7] * 8
    for a in _both(rewards, 8, mode):
        assert np.all(a == 0.0), a
    m = adv_lib.advantage_metrics(rewards, 8)
    assert m["frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("G", [2, 3, 7, 8, 24, 64])
@pytest.mark.parametrize("value", [0.1, 0.7, 1 / 3, -2.3, 1e-30, 3.3e38, 1.401298464e-45])
def test_equal_groups_zero_any_g_value(G, value):
    # the equal group sits next to an ordinary one, so batch std is not zero
    rewards = np.concatenate([np.full(G, value, np.float32), np.linspace(0.0, 1.0, G, dtype=np.float32)])
    for mode in MODES:
        for a in _both(rewards, G, mode):
            assert np.all(a[:G] == 0.0), (mode, G, value, a[:G])
            assert np.all(np.isfinite(a))
    stats = adv_lib.group_stats(rewards, G)
    assert np.all(np.asarray(stats.std_N)[:G] == 0.0) and np.all(np.asarray(stats.is_std_zero_N)[:G])
    assert np.all(np.asarray(stats.mean_N)[:G] == np.float32(value))
    assert adv_lib.advantage_metrics(rewards, G)["frac_reward_zero_std"] == 0.5


group_values = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from([2, 3, 4, 6, 8, 12, 16]), st.lists(st.tuples(st.booleans(), group_values,
       st.lists(st.floats(-10, 10, width=32), min_size=16, max_size=16)), min_size=1, max_size=5),
       st.sampled_from(MODES))
def test_equal_groups_zero_others_match_reference(G, groups, mode):
    """Mixed batches: equal groups exactly 0; other groups match a float64 reference."""
    rows = []
    for equal, v, others in groups:
        rows.append(np.full(G, v, np.float32) if equal else np.asarray(others[:G], np.float32))
    rewards = np.concatenate(rows)
    r64 = rewards.astype(np.float64).reshape(-1, G)
    equal_P = r64.max(1) == r64.min(1)
    centred = np.where(equal_P[:, None], 0.0, r64 - r64.mean(1, keepdims=True))
    if mode == "group":
        std = np.where(equal_P, 0.0, r64.std(1, ddof=1))[:, None]
    elif mode == "batch":
        std = np.full((len(r64), 1), r64.std(ddof=1) if r64.size > 1 else 0.0)
    else:
        std = None
    ref = centred if std is None else centred / (std + adv_lib.STD_EPSILON)
    for a in _both(rewards, G, mode):
        a = a.reshape(-1, G)
        assert np.all(a[equal_P] == 0.0)
        np.testing.assert_allclose(a[~equal_P], ref[~equal_P], rtol=2e-3, atol=2e-3)
    frac = adv_lib.advantage_metrics(rewards, G)["frac_reward_zero_std"]
    assert frac >= equal_P.mean() - 1e-9
