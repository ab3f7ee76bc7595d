"""`das-jax bench async-replay`: the step timelines of the synchronous and asynchronous
schedules, the train-time model, the split of groups over engines, and one small replay."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from das_jax.bench import async_replay as ar
from das_jax.bench.replay import TraceRollout

TRACE = Path(__file__).parents[1] / "docs/traces/gsm8k-smollm2-135m.jsonl.gz"


def test_sync_timeline_adds_rollout_and_update():
    assert ar.sync_timeline([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == [4.0, 6.0, 9.0]


def test_async_timeline_overlaps_by_the_version_schedule():
    # k = 1: rollout s waits for update s - 2 (its params are version s - 1)
    r, u = [3.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]
    # rollouts back to back (0-3, 3-6, 6-9, 9-12); updates after each: 5, 8, 11, 14
    assert ar.async_timeline(r, u, 1) == [5.0, 8.0, 11.0, 14.0]
    # updates longer than rollouts: rollout 2 waits for update 0 (ends 6), rollout 3 for
    # update 1 (ends 11) plus the params' copy
    assert ar.async_timeline([1.0] * 4, [5.0] * 4, 1, sync_s=0.5) == [6.0, 11.0, 16.0, 21.0]
    # k = 2 lets rollout 2 start before any update ends
    assert ar.async_timeline([1.0] * 3, [5.0] * 3, 2) == [6.0, 11.0, 16.0]
    with pytest.raises(ValueError, match="k >= 1"):
        ar.async_timeline([1.0], [1.0], 0)


def test_async_timeline_with_k_ahead_never_beats_the_slower_side():
    r, u = [2.0, 4.0, 1.0, 3.0, 2.0], [3.0, 1.0, 2.0, 2.0, 4.0]
    for k in (1, 2, 3):
        end = ar.async_timeline(r, u, k)
        assert end[-1] >= max(sum(r), sum(u))
        assert end[-1] <= ar.sync_timeline(r, u)[-1]


def test_train_seconds_is_the_stated_flop_model():
    # 8 * P * tokens / (n * peak * mfu)
    assert ar.train_seconds(1000, 2, 7e9, 1e15, 0.5) == pytest.approx(8 * 7e9 * 1000 / 1e15)
    with pytest.raises(ValueError):
        ar.train_seconds(1000, 0, 7e9, 1e15)


def test_split_by_problem_keeps_groups_whole():
    rolls = [TraceRollout(0, f"p{q}", s, (1,), (2,), "stop", 0.6) for q in range(5)
             for s in range(3)]
    parts = ar.split_by_problem(rolls, 2)
    assert [sorted({r.problem_id for r in p}) for p in parts] == [["p0", "p2", "p4"],
                                                                  ["p1", "p3"]]
    assert sum(len(p) for p in parts) == 15


def test_a_small_async_replay_prints_its_table(tmp_path, capsys):
    p = argparse.ArgumentParser()
    ar.add_arguments(p)
    args = p.parse_args([str(TRACE), "--paper-problems", "4", "--paper-samples", "2",
                         "--paper-epochs", "2", "--paper-max-tokens", "128", "--paper-median",
                         "64", "--gpus", "4", "--rollout-gpus", "2", "--slots", "8",
                         "--json", str(tmp_path / "out.json")])
    assert ar.main(args) == 0
    out = capsys.readouterr().out
    assert "| das | async k=1, 2 rollout + 2 train GPUs |" in out
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [(r["drafter"], r["schedule"]) for r in rows] == [
        ("none", "sync, 4 GPUs"), ("none", "async k=1, 2 rollout + 2 train GPUs"),
        ("das", "sync, 4 GPUs"), ("das", "async k=1, 2 rollout + 2 train GPUs")]
    for r in rows:   # each row's timeline is its schedule of its own step times
        if r["schedule"].startswith("sync"):
            assert r["end_s"] == pytest.approx(ar.sync_timeline(r["rollout_s"], r["train_s"]))
        else:
            assert r["end_s"][-1] <= sum(r["rollout_s"]) + sum(r["train_s"]) + 1.0


def test_bad_rollout_gpus_are_a_one_line_error(capsys):
    p = argparse.ArgumentParser()
    ar.add_arguments(p)
    assert ar.main(p.parse_args([str(TRACE), "--gpus", "4", "--rollout-gpus", "4"])) == 2
    assert "--rollout-gpus must each be in [1, --gpus)" in capsys.readouterr().err
