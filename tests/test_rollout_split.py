"""Rollouts split across processes: the group assignment (longest first, sticky owners within a
load cap), its replicated state, the gather's row order, and JAX's cluster detection."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.parallel import distributed as dist
from das_jax.parallel.rollout_split import GroupSplit, assign_groups, gather_rows


def test_groups_go_longest_first_to_the_least_loaded_process():
    # no owners: LPT. 10 -> p0, 9 -> p1, 5 -> p1 (9 + 5 = 14 > 10 + 0? p1 load 9 < p0 10),
    # 4 -> p0, 1 -> p0 or p1 (p0: 14, p1: 14 -> lowest index)
    out = assign_groups(np.array([4.0, 10, 1, 9, 5]), np.full(5, -1), 2)
    assert out.tolist() == [0, 0, 0, 1, 1]
    loads = np.bincount(out, weights=[4.0, 10, 1, 9, 5], minlength=2)
    assert loads.tolist() == [15.0, 14.0]


def test_owners_keep_their_groups_within_the_load_cap():
    predicted = np.array([5.0, 5, 5, 5])
    # every group's history is on process 1: it keeps them while its load stays <= 1.1 x mean
    out = assign_groups(predicted, np.array([1, 1, 1, 1]), 2, slack=0.1)
    assert out.tolist() == [1, 1, 0, 0]
    # with a slack of 1 (cap: 2 x the mean load) all stay
    assert assign_groups(predicted, np.array([1, 1, 1, 1]), 2, slack=1.0).tolist() == [1] * 4
    # an owner outside the process range (fewer processes now) is ignored: groups 0, 1 go to
    # the least loaded (p0, then p1), group 2 stays with its owner p0, group 3 would put p0
    # over the cap (15 > 11) and goes to p1
    assert assign_groups(predicted, np.array([3, 3, 0, 0]), 2).tolist() == [0, 1, 0, 1]
    assert assign_groups(predicted, np.full(4, -1), 1).tolist() == [0] * 4


def test_group_split_state_is_replicated_and_round_trips():
    a, b = GroupSplit(2), GroupSplit(2)
    pids = ["p0", "p1", "p2"]
    for s in (a, b):
        first = s.assign(pids, 4)
        s.observe(pids, first, np.array([[10, 12, 8, 10], [100, 90, 110, 100], [50] * 4]))
    assert a.assign(pids, 4).tolist() == b.assign(pids, 4).tolist()
    # the long problem is placed first, alone on one process
    second = a.assign(pids, 4)
    assert second[1] != second[0] and second[1] != second[2]
    assert a.predicted("p1", 0.0) == 100.0 and a.predicted("new", 7.0) == 7.0
    c = GroupSplit(2)
    c.load_state_dict(a.state_dict())
    assert c.owner == a.owner and c.predicted("p1", 0) == 100.0
    d = GroupSplit(4)                 # another process count: lengths kept, owners dropped
    d.load_state_dict(a.state_dict())
    assert d.owner == {} and d.predicted("p2", 0) == 50.0


def test_gather_puts_rows_back_in_request_order():
    rows_of = [np.array([2, 0])]
    out = gather_rows({"x": np.array([[1, 2], [3, 4]]), "n": np.array([7, 8])}, rows_of, 3)
    assert out["x"].tolist() == [[3, 4], [0, 0], [1, 2]]
    assert out["n"].tolist() == [8, 0, 7]


def test_cluster_detection_without_a_cluster_is_one_line(monkeypatch):
    import jax
    from das_jax.config import config_from_dict
    calls = []

    def fake_initialize(*args, **kwargs):
        calls.append(args)
        raise ValueError("coordinator_address should be defined.")
    monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    for k in (dist.ENV_COORDINATOR, dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID):
        monkeypatch.delenv(k, raising=False)
    section = config_from_dict({"distributed": {"cluster_detection": True}}).distributed
    with pytest.raises(dist.DistributedError, match="cluster_detection.*no cluster"):
        dist.initialize_from_config(section)
    assert calls == [()]           # JAX's own detection: no coordinator, count or id given
    assert dist.initialize_from_config(
        config_from_dict({}).distributed) is None    # off by default: single process
