"""The memory bound of plain decoding: hand-computed values, and no simulated schedule of the
engine's own scheduler (dense or paged, any pool, with preemption) beats it."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.bench import replay as rp
from das_jax.bench.memory_bound import epoch_bounds, none_memory_bound
from das_jax.engine import EngineConfig

COEF = {"c_base": 0.01, "c_tok": 0.002, "c_kv": 1e-5}


def test_bound_by_hand():
    # d = L - 1 = (4, 2, 0); held = 10 + 3 + 0 = 13; K = 3*4 + 5*2 + 0 + 13 = 35; N = 6
    b = none_memory_bound([3, 5, 7], [5, 3, 1], 10**6, COEF)
    assert (b["passes"], b["token_slots"], b["attended"]) == (4, 6, 35)
    assert b["device_s"] == pytest.approx(4 * 0.01 + 6 * 0.002 + 35 * 1e-5)
    # pool of 3 positions: G(s) = 2, 4, 5, 6 -> min(3, G) = 2, 3, 3, 3; cum 2, 5, 8, 11 < 13,
    # then 3 per step: 13 needs one more step
    assert none_memory_bound([3, 5, 7], [5, 3, 1], 3, COEF)["passes"] == 5
    # pool of 4: min(4, G) = 2, 4, 4, 4 -> cum 14 >= 13 at step 4 = max d
    assert none_memory_bound([3, 5, 7], [5, 3, 1], 4, COEF)["passes"] == 4
    # 100 rows of d = 50 decode steps on a pool of 490 positions: they hold
    # 100 * 50 * 51 / 2 = 127,500 positions over their lives; G(s) = 100 s, so the first 50
    # steps hold at most 100 + 200 + 300 + 400 + 46 * 490 = 23,540, and every later step 490:
    # 50 + ceil(103,960 / 490) = 50 + 213 steps
    assert none_memory_bound([10] * 100, [51] * 100, 490, COEF)["passes"] == 263
    with pytest.raises(ValueError, match="at least one generated token"):
        none_memory_bound([1], [0], 10, COEF)
    with pytest.raises(ValueError, match="pool_positions"):
        none_memory_bound([1], [2], 0, COEF)
    with pytest.raises(ValueError, match="one entry per rollout"):
        none_memory_bound([1, 2], [2], 10, COEF)


def _rollouts(n=24, seed=0, max_len=120):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        g, s = divmod(i, 4)
        prompt = tuple(int(t) for t in rng.integers(2, 50, size=5 + 3 * g))
        length = int(np.clip(rng.lognormal(np.log(40), 0.8), 2, max_len))
        toks = tuple(int(t) for t in rng.integers(2, 50, size=length - 1)) + (1,)
        out.append(rp.TraceRollout(0, f"p{g}", s, prompt, toks, "stop", 1.0))
    return out


@pytest.mark.parametrize("kind,slots,pages", [("dense", 4, None), ("dense", 16, None),
                                              ("paged", 8, 40), ("paged", 16, 24),
                                              ("paged", 32, 64)])
def test_no_schedule_beats_the_bound(kind, slots, pages):
    rolls = _rollouts()
    ec = (EngineConfig(max_slots=slots, max_cache_len=256, draft_widths=(1, 4, 8))
          if kind == "dense" else
          EngineConfig(max_slots=slots, max_cache_len=256, draft_widths=(1, 4, 8),
                       kv_cache="paged", page_size=8, kv_pages=pages))
    st = rp.simulate(rolls, ec, 256, rp.FrozenCostModel.of(COEF))
    pool = slots * 256 if kind == "dense" else pages * 8
    (b,) = epoch_bounds({0: rolls}, pool, COEF)
    assert b["epoch"] == 0
    assert st.forward_passes >= b["passes"]
    n = sum(s.num_tokens if s.num_tokens is not None else s.batch * s.width for s in st.steps)
    k = sum(s.read_kv if s.read_kv is not None else s.attended_kv for s in st.steps)
    assert n >= b["token_slots"] and k >= b["attended"]
    assert st.decode_s >= b["device_s"] * (1 - 1e-12)
    if kind == "paged":
        assert st.preemptions > 0 or pages == 64


def test_one_row_on_a_large_cache_meets_the_bound_in_passes():
    rolls = _rollouts(n=1)
    ec = EngineConfig(max_slots=1, max_cache_len=256, draft_widths=(1, 4, 8))
    st = rp.simulate(rolls, ec, 256, rp.FrozenCostModel.of(COEF))
    (b,) = epoch_bounds({0: rolls}, 256, COEF)
    assert st.forward_passes == b["passes"] == len(rolls[0].token_ids) - 1
    assert sum(s.num_tokens for s in st.steps) == b["token_slots"]
