"""`das-jax bench async-train`: the run plan, the per-run summary, the equal-work fit, the
report's verdicts, its one-line errors, and (slow) an end-to-end invocation on a tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from das_jax.bench import async_train_bench as atb
from das_jax.cli import main
from das_jax.config import MAIN_JOB_CONFIG, main_job_config

from test_cli_errors import assert_one_line_error, run_cli

PROG = "das-jax bench async-train"


def test_plan_runs_same_work_first_then_seeds_in_alternating_order():
    runs = atb.plan_runs((3, 4, 5), same_work=True, turns=True, async_steps=2)
    assert [r.label for r in runs] == [
        "same-sync-s3", "same-async-s3", "same-turns-s3",
        "sync-s3", "async-s3", "async-s4", "sync-s4", "sync-s5", "async-s5"]
    by = {r.label: r for r in runs}
    assert by["same-sync-s3"].overrides == ["grpo.learning_rate=0", "train.async_steps=0"]
    assert by["same-async-s3"].overrides == ["grpo.learning_rate=0", "train.async_steps=2",
                                             "train.async_overlap=true"]
    assert by["same-turns-s3"].overrides == ["grpo.learning_rate=0", "train.async_steps=2",
                                             "train.async_overlap=false"]
    assert by["async-s4"].overrides == ["train.async_steps=2", "train.async_overlap=true"]
    assert [r.same_work for r in runs] == [True] * 3 + [False] * 6
    assert [r.label for r in atb.plan_runs((0,), same_work=False, turns=True,
                                           async_steps=1)] == ["sync-s0", "async-s0"]


def _records(step_s, frac_zero, tokens, rewards, lag=0, eval_acc=None):
    recs = [{"kind": "eval", "step": 0, "eval_accuracy": 0.1}]
    for i, (s, f, t, rw) in enumerate(zip(step_s, frac_zero, tokens, rewards)):
        recs.append({"step": i + 1, "step_s": s, "frac_reward_zero_std": f,
                     "generated_tokens": t, "reward_mean": rw,
                     "version_lag": 0 if i == 0 else lag, "dropped_groups": 0})
        if lag:   # an async run logs the version that sampled the batch
            recs[-1]["policy_version"] = max(i - lag, 0)
    if eval_acc is not None:
        recs.append({"kind": "eval", "step": len(step_s), "eval_accuracy": eval_acc})
    return recs


def test_summarise_run_leaves_step_one_out_and_counts_groups_with_a_reward_spread():
    plan = atb.RunPlan("async-s0", "async", 0, False)
    recs = _records([30.0, 2.0, 4.0, 6.0, 8.0], [1.0, 0.5, 0.25, 0.0, 1.0],
                    [100, 200, 300, 400, 500], [0.0, 0.5, 1.0, 0.5, 1.0], lag=1, eval_acc=0.75)
    r = atb.summarise_run(plan, recs, 8, wall_s=12.0, peak_rss_gib=1.5)
    assert r.step_s == [2.0, 4.0, 6.0, 8.0] and r.mean_step_s == 5.0
    assert r.groups == [4, 6, 8, 0]
    assert r.tokens == [200, 300, 400, 500]
    assert r.reward_blocks == [0.5, 1.0]           # steps 1-4, step 5
    # versions 0 (steps 1, 2), 1, 2, 3 (steps 3-5): the per-version means, in blocks of 4
    assert r.version_blocks == [np.mean([0.25, 1.0, 0.5, 1.0])]
    sync = atb.summarise_run(atb.RunPlan("sync-s0", "sync", 0, False),
                             _records([3.0] * 5, [0.0] * 5, [1] * 5, [0.0, 0.5, 1.0, 0.5, 1.0]),
                             8, wall_s=0, peak_rss_gib=0)
    assert sync.version_blocks == sync.reward_blocks  # step s samples from version s - 1
    assert r.eval_accuracy == 0.75 and r.max_version_lag == 1
    with pytest.raises(ValueError, match="needs >= 2"):
        atb.summarise_run(plan, recs[:2], 8, wall_s=0, peak_rss_gib=0)


def _result(label, schedule, step_s, groups, tokens, same=False, rewards=(0.5,), acc=None):
    return atb.RunResult(label, schedule, 0, same, list(step_s), list(groups), list(tokens),
                         list(rewards), list(rewards), acc, int(schedule != "sync"), 0, 1.0,
                         1.0)


def _fit_runs(d_true, seed=0, noise=0.01):
    rng = np.random.default_rng(seed)
    runs = []
    for k, sched in enumerate(["sync", "async"] * 3):
        g = rng.integers(0, 9, 23)
        t = rng.integers(300, 900, 23)
        s = 1.0 + 1.9 * g + 0.9 * t / 100 + (d_true if sched == "async" else 0.0) \
            + noise * rng.standard_normal(23)
        runs.append(_result(f"{sched}-{k}", sched, s, g, t))
    return runs


@pytest.mark.parametrize("d_true", [-0.3, 0.0, 0.5])
def test_equal_work_fit_recovers_the_async_cost_per_step(d_true):
    fit = atb.equal_work_fit(_fit_runs(d_true))
    assert fit["steps"] == 6 * 23
    assert fit["d_async"] == pytest.approx(d_true, abs=0.01)
    assert fit["b_per_group"] == pytest.approx(1.9, abs=0.01)
    assert fit["c_per_100_tokens"] == pytest.approx(0.9, abs=0.01)
    assert 0 < fit["d_async_se"] < 0.01


def test_equal_work_fit_is_none_without_both_schedules_or_variation():
    runs = _fit_runs(0.0)
    assert atb.equal_work_fit([r for r in runs if r.schedule == "sync"]) is None
    flat = [_result(f"{s}{k}", s, [2.0] * 5, [0] * 5, [100] * 5) for k in range(2)
            for s in ("sync", "async")]
    assert atb.equal_work_fit(flat) is None
    # the same-work runs never enter the fit
    assert atb.equal_work_fit([_result("x", "sync", [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                                       same=True)] * 3) is None


def test_report_says_whether_async_is_slower_at_the_same_work():
    same = [_result("same-sync", "sync", [10.0, 10.0], [4, 4], [500, 500], same=True),
            _result("same-async", "async", [9.0, 9.2], [4, 4], [500, 500], same=True),
            _result("same-turns", "async-turns", [10.4, 10.6], [4, 4], [500, 500], same=True)]
    lines, summary = atb.report(same)
    text = "\n".join(lines)
    assert summary["same_work_ratio"] == pytest.approx(0.91)
    assert summary["same_work_turns_ratio"] == pytest.approx(1.05)
    assert "async / sync per step 0.910" in text and "never slower: yes" in text
    slower = [same[0], _result("same-async", "async", [10.5, 10.5], [4, 4], [500, 500], same=True)]
    assert "never slower: NO" in "\n".join(atb.report(slower)[0])


def test_report_of_learning_runs_gives_ratio_fit_and_reward_spread():
    runs = _fit_runs(0.4, noise=0.02)
    for r, rw in zip(runs, [(0.2, 0.5), (0.3, 0.6), (0.1, 0.4), (0.2, 0.9), (0.3, 0.7),
                            (0.25, 0.45)]):
        r.reward_blocks = list(rw)
        r.version_blocks = [x + 0.1 for x in rw]
    lines, summary = atb.report(runs)
    text = "\n".join(lines)
    sync = [r.mean_step_s for r in runs if r.schedule == "sync"]
    asyn = [r.mean_step_s for r in runs if r.schedule == "async"]
    assert summary["learning_ratio"] == pytest.approx(np.mean(asyn) / np.mean(sync))
    assert "SLOWER" in text                         # d = +0.4 s, s.e. ~0.005
    rw = summary["reward"]["reward_blocks"]
    assert rw["sync_low"] == [0.1, 0.4] and rw["sync_high"] == [0.3, 0.7]
    assert rw["async_mean"] == pytest.approx([0.25, 0.65])
    assert rw["blocks_inside"] == 2
    rv = summary["reward"]["version_blocks"]
    assert rv["sync_low"] == pytest.approx([0.2, 0.5])
    assert rv["async_mean"] == pytest.approx([0.35, 0.75]) and rv["blocks_inside"] == 2
    assert "async mean inside the sync range in 2/2 blocks" in text
    assert "not slower" in "\n".join(atb.report(_fit_runs(-0.2))[0])


@pytest.mark.parametrize("argv, fragment", [
    (["--config", "nosuch.yaml"], "--config nosuch.yaml: no such file"),
    (["--set", "train.step=3"], "did you mean 'train.steps'"),
    (["--set", "train.steps=1"], "pass train.steps >= 2"),
    (["--seeds", "0,x"], "--seeds"),
    (["--async-steps", "0"], "--async-steps"),
])
def test_bad_input_is_a_one_line_error_before_any_run(capsys, tmp_path, argv, fragment):
    rc, out, err = run_cli(capsys, ["bench", "async-train", "--config", atb_tiny_yaml(),
                                    "--out", tmp_path / "out", *argv])
    assert_one_line_error(rc, err, fragment, PROG)
    assert not (tmp_path / "out").exists()           # nothing ran


def test_the_default_config_is_the_main_job_from_any_directory(capsys, tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    assert main_job_config() == MAIN_JOB_CONFIG
    monkeypatch.chdir(tmp_path)                      # not the checkout: its file all the same
    assert Path(main_job_config()) == repo / MAIN_JOB_CONFIG
    # the bench without --config reads it (so a typo in --set is the error, not a missing file)
    rc, out, err = run_cli(capsys, ["bench", "async-train", "--out", tmp_path / "out",
                                    "--set", "train.step=3"])
    assert_one_line_error(rc, err, "did you mean 'train.steps'", PROG)


def test_a_non_empty_out_dir_is_refused(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    rc, out, err = run_cli(capsys, ["bench", "async-train", "--config", atb_tiny_yaml(),
                                    "--out", tmp_path])
    assert_one_line_error(rc, err, "is not empty; pass a new directory", PROG)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_a_run_that_fails_with_a_user_error_is_reported_in_one_line(capsys, tmp_path):
    rc, out, err = run_cli(capsys, ["bench", "async-train", "--config", atb_tiny_yaml(),
                                    "--seeds", "0", "--no-same-work", "--out", tmp_path / "o",
                                    "--set", "model.source=/nonexistent/model-dir"])
    assert_one_line_error(rc, err, "run sync-s0: das-jax train exited 2:", PROG)
    assert "/nonexistent/model-dir" in err
    assert (tmp_path / "o" / "sync-s0.log").is_file()


def test_a_failed_run_reports_the_runs_before_it(capsys, tmp_path, monkeypatch):
    """The first run (faked: it writes its metrics) is summarised and reported, its checkpoints
    removed; the second fails with a user error, which ends the bench in one line."""
    def fake_run(plan, config, overrides, out):
        if plan.label == "async-s0":
            (out / f"{plan.label}.log").write_text("das-jax train: error: disk full\n")
            return 1.0, 0.5, 2
        run = out / plan.label
        (run / "checkpoints" / "2").mkdir(parents=True)
        recs = _records([9.0, 2.0, 4.0], [0.5] * 3, [100] * 3, [0.25] * 3)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return 30.0, 2.5, 0
    monkeypatch.setattr(atb, "_run_one", fake_run)
    rc, out, err = run_cli(capsys, ["bench", "async-train", "--config", atb_tiny_yaml(),
                                    "--seeds", "0", "--no-same-work", "--out", tmp_path])
    assert_one_line_error(rc, err, "run async-s0: das-jax train exited 2: das-jax train: "
                          "error: disk full", PROG)
    assert "sync-s0: 3.00 s per step (steps 2-3)" in out
    assert "async-s0 failed; the 1 runs before it:" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["sync-s0"]
    assert summary["runs"][0]["groups"] == [1, 1]           # tiny.yaml: 2 prompts per step
    assert not (tmp_path / "sync-s0" / "checkpoints").exists()


def atb_tiny_yaml() -> str:
    return str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def test_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """Six real `das-jax train` runs of a tiny random model: the lr-0 pair samples the same
    tokens under both schedules; async runs lag one version, sync runs none."""
    from test_export import LLAMA, TOK, random_params
    from das_jax.models import export as hf_export
    model = tmp_path / "model"
    hf_export.save_hf_model(model, LLAMA, random_params(LLAMA), TOK, "float32")
    rc = main(["bench", "async-train", "--config", atb_tiny_yaml(), "--seeds", "0,1",
               "--out", str(tmp_path / "out"), "--set", f"model.source={model}",
               "--set", "train.steps=3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    assert list(runs) == ["same-sync-s0", "same-async-s0", "sync-s0", "async-s0", "async-s1",
                          "sync-s1"]
    assert runs["same-sync-s0"]["tokens"] == runs["same-async-s0"]["tokens"]
    assert all(len(r["step_s"]) == 2 for r in runs.values())
    assert {k: r["max_version_lag"] for k, r in runs.items()} == {
        k: int("async" in k) for k in runs}
    assert summary["same_work_ratio"] == pytest.approx(
        runs["same-async-s0"]["mean_step_s"] / runs["same-sync-s0"]["mean_step_s"])
    assert "same work (learning rate 0): async / sync per step" in out
    assert (tmp_path / "out" / "async-s1" / "metrics.jsonl").is_file()
    assert not list((tmp_path / "out").glob("*/checkpoints"))   # removed after each run
