"""What a training run tells its user: per-step console lines without a terminal, phase lines,
the summary, samples.jsonl and `das-jax samples`, the plots, and `das-jax compare`.

Two tiny runs through the real CLI (`das-jax train --config configs/tiny.yaml`, drafter none and
das) with a tiny random model and a character tokenizer patched in for the model load.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from das_jax.cli import main
from das_jax.models import ModelConfig, init_params
from das_jax.rl import model_loading
from das_jax.rl import console_log, run_log
from das_jax.rl.compare import acceptance_by_epoch_table, compare_table
from das_jax.rl.plots import plot_run
from das_jax.testing import CharTokenizer

TINY_YAML = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
PLOTS = ("reward.png", "loss_kl.png", "response_length.png", "speculation.png",
         "rollout_time.png")


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()   # not terminals: isatty() is False
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 2-step tiny runs over 2 problems (one step per epoch): drafter none with
    --no-progress, and drafter das without the flag (stderr is not a terminal: no bar either)."""
    tmp = tmp_path_factory.mktemp("runs")
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        # a fresh copy per run: the trainer owns (and donates) the params it is given
        mp.setattr(model_loading, "load_model", lambda config: (
            CFG, jax.tree_util.tree_map(jnp.copy, params), CharTokenizer()))
        try:
            for drafter, flags in (("none", ["--no-progress"]), ("das", [])):
                run_dir = tmp / f"run-{drafter}"
                rc, _, err = _run_cli(
                    ["train", "--config", str(TINY_YAML), *flags,
                     "--set", f"output_dir={run_dir}", "--set", f"drafter={drafter}",
                     "--set", "data.chat=false", "--set", "data.instruction=",
                     "--set", "rollout.max_new_tokens=12", "--set", "rollout.draft_widths=[1,4]",
                     "--set", "data.num_problems=2", "--set", "train.steps=2",
                     "--set", "train.log_samples=3"])
                assert rc == 0, err
                out[drafter] = (run_dir, err)
        finally:
            root = logging.getLogger("das_jax")
            root.removeHandler(console_log._console_handler)
            root.setLevel(logging.NOTSET)
            root.propagate = True
    return out


@pytest.mark.parametrize("drafter", ["none", "das"])
def test_plain_step_lines_and_phases_without_a_terminal(runs, drafter):
    run_dir, err = runs[drafter]
    lines = err.splitlines()
    for step in (1, 2):
        line = next(x for x in lines if f" step {step}/2 " in x)
        for word in ("reward", "acc", "loss", "kl", "rollout", "train", "tok/fwd", "eta"):
            assert f"| {word} " in line, (word, line)
    assert "(epoch 1)" in next(x for x in lines if " step 2/2 " in x)
    assert any("setting up the trainer" in x and "done in" in x for x in lines)
    assert any("compiled" in x and "programs" in x for x in lines)       # step 1's compiles
    if drafter == "das":
        assert any("calibrated the cost model" in x for x in lines)
    assert "| metric" in err and "tokens per forward" in err           # the summary table
    assert "tensorboard --logdir" in err
    assert "\r" not in err                                                # no progress bar
    # the last lines name what the run dir holds, its checkpoints too (most of its size)
    saved = run_log.checkpoint_steps(run_dir)
    assert saved == [2]
    line = next(x for x in lines if f"run dir {run_dir}:" in x)
    assert "checkpoints of step 2 in checkpoints/" in line and "das-jax export" in line


def test_samples_file_and_the_samples_command(runs):
    run_dir, _ = runs["das"]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    first = samples[0]
    assert first["question"] and first["answer"] is not None
    assert set(first["rewards"]) == {"math_accuracy_reward"}
    assert first["finish_reason"] in ("stop", "length") and 0 <= first["length"] <= 12
    rc, out, _ = _run_cli(["samples", str(run_dir), "--step", "1"])
    assert rc == 0
    assert out.count("── step 1 · sample") == 3 and "completion:" in out
    assert "question: " + samples[0]["question"] in out and "step 2" not in out
    rc, out, _ = _run_cli(["samples", str(run_dir)])                     # default: last step
    assert rc == 0 and out.count("── step 2 · sample") == 3 and "step 1" not in out
    rc, _, err = _run_cli(["samples", str(run_dir), "--step", "9"])
    assert rc == 2 and "logged steps: 1-2" in err
    rc, _, err = _run_cli(["samples", str(run_dir / "nope")])
    assert rc == 2 and "does not exist" in err


def test_metrics_carry_the_rollout_time_split_and_plots_are_written(runs):
    run_dir, _ = runs["das"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        for key in ("prefill_s", "decode_s", "draft_s", "policy_s", "tokens_per_forward",
                    "step_s", "jit_compile_s", "jit_compiles"):
            assert r[key] is not None and r[key] >= 0, key
        assert r["tokens_per_forward"] == pytest.approx(
            r["generated_tokens"] / r["forward_passes"])
        # acceptance per draft position and per source add up to the step's totals
        assert sum(r["drafted_by_position"]) == r["drafted_tokens"]
        assert sum(r["accepted_by_position"]) == r["accepted_draft_tokens"]
        assert sum(r["drafted_by_source"].values()) == r["drafted_tokens"]
        assert set(r["drafted_by_source"]) <= {"problem", "request", "global"}
        assert len(r["acceptance_by_position"]) == len(r["drafted_by_position"])
    assert sum(r["drafted_tokens"] for r in records) > 0
    assert records[0]["jit_compiles"] > 0 and records[0]["jit_compile_s"] > 0
    for name in PLOTS:
        assert (run_dir / "plots" / name).stat().st_size > 1000, name


def test_compare_prints_a_table_and_writes_one_png(runs, tmp_path):
    (a, _), (b, _) = runs["none"], runs["das"]
    png = tmp_path / "cmp.png"
    rc, out, err = _run_cli(["compare", str(a), str(b), "--out", str(png)])
    assert rc == 0, err
    assert png.stat().st_size > 1000
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ")}
    assert rows["metric"] == ["run-none", "run-das", "run-das / run-none"]
    none_fp, das_fp, ratio = rows["forward passes, total"]
    assert ratio == f"{int(das_fp) / int(none_fp):.2f}x"
    assert rows["steps compared"][:2] == ["2", "2"]
    assert {"rollout time, total s", "reward, mean"} <= set(rows)
    rc, _, err = _run_cli(["compare", str(a), str(tmp_path / "missing")])
    assert rc == 2 and "no metrics.jsonl" in err


# ---------------------------------------------------------------- without a model
def _rec(step, epoch, **kw):
    return {"step": step, "epoch": epoch, "reward_mean": 0.1 * step, "forward_passes": 10,
            "generated_tokens": 20, "rollout_s": 2.0, **kw}


def test_compare_table_uses_the_common_steps_and_ratios():
    a = [_rec(1, 0), _rec(2, 0), _rec(3, 1)]
    b = [_rec(1, 0, forward_passes=5), _rec(2, 0, forward_passes=5)]     # shorter run
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in compare_table([("a", a), ("b", b)]).splitlines()}
    assert rows["steps compared"] == ["2", "2", ""]
    assert rows["forward passes, total"] == ["20", "10", "0.50x"]
    assert rows["tokens per forward"] == ["2.00", "4.00", "2.00x"]
    assert rows["accuracy, mean"] == ["-", "-", ""]                     # never logged


def test_acceptance_by_epoch_table_per_source_and_the_online_heads_loss():
    def rec(step, epoch, drafted, accepted, **kw):
        return _rec(step, epoch, drafted_by_source=drafted, accepted_by_source=accepted, **kw)
    frozen = [rec(1, 0, {"head": 10, "problem": 4}, {"head": 5, "problem": 1}),
              rec(2, 0, {"head": 10}, {"head": 1}),
              rec(3, 1, {"head": 8, "problem": 0}, {"head": 2, "problem": 0})]
    online = [rec(1, 0, {"head": 10}, {"head": 6}, draft_loss=2.0),
              rec(2, 0, {"head": 10}, {"head": 4}, draft_loss=1.0),
              rec(3, 1, {"head": 5}, {"head": 5}, draft_loss=0.5)]
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in acceptance_by_epoch_table([("frozen", frozen),
                                                   ("online", online)]).splitlines()]
    assert rows[0] == ["epoch", "frozen: head accepted / drafted",
                       "frozen: problem accepted / drafted", "online: head accepted / drafted",
                       "online: problem accepted / drafted", "online: draft loss"]
    assert rows[2] == ["0", "0.300 (20)", "0.250 (4)", "0.500 (20)", "-", "1.500"]
    assert rows[3] == ["1", "0.250 (8)", "-", "1.000 (5)", "-", "0.500"]
    assert acceptance_by_epoch_table([("a", [_rec(1, 0)]), ("b", [_rec(1, 0)])]) is None


def test_plots_of_old_records_without_the_new_metrics(tmp_path):
    written = plot_run([_rec(1, 0), _rec(2, 1)], tmp_path, max_new_tokens=None)
    assert sorted(p.name for p in written) == sorted(PLOTS)


def test_eta_leaves_out_compile_time(tmp_path, monkeypatch):
    clock = iter([0.0, 100.0, 110.0])
    monkeypatch.setattr(run_log, "_clock", lambda: next(clock))
    logger = run_log.RunLogger(tmp_path, total_steps=10, progress=False, heartbeat_s=0)
    compiles = iter([(90.0, {"verify": 3}), (0.0, {})])
    monkeypatch.setattr(logger._watch, "take", lambda: next(compiles))
    logger.log(_rec(1, 0))              # 100 s, of which 90 s compiling
    assert logger.eta_s() == pytest.approx(10.0 * 9)
    logger.log(_rec(2, 0))              # 10 s
    assert logger.eta_s() == pytest.approx(10.0 * 8)
    logger._watch.close()
    logger._file.close()
    logger._samples_file.close()


def test_bench_main_job_compares_the_runs_drafter_with_none_from_its_checkpoint(
        runs, monkeypatch, tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    monkeypatch.setattr(model_loading, "load_model", lambda config: (
        CFG, jax.tree_util.tree_map(jnp.copy, params), CharTokenizer()))
    run_dir = runs["das"][0]
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    rc, out, err = _run_cli(["bench", "main-job", str(run_dir), "--steps", "2"])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"restored step 2 of {run_dir}; rolling out steps 3-4 with das "
                               "and none")
    for step in (3, 4):
        line = next(x for x in lines if x.startswith(f"step {step}: "))
        # tiny float32 model: speculation is token-exact
        assert "identical 8/8" in line and "| das " in line and "| none " in line, line
    summary = lines[-1]
    assert summary.startswith("steps 4-4: das ") and "das / none " in summary, summary
    assert "identical rollouts 8/8" in summary and "target" not in summary
    # Nothing was written into the run directory (but its lock file, which is not new).
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    # Bad input: one line, exit 2.
    for argv, message in (
            ([str(run_dir), "--from-step", "1"],
             "no checkpoint at or below step 1 (it has steps 2)"),
            ([str(tmp_path)], "no config.yaml there"),
            ([str(runs["none"][0])], "the run's drafter is none; pass --drafter das"),
            ([str(run_dir), "--drafter", "das,none"], "--drafter takes one speculation name")):
        rc, _, err = _run_cli(["bench", "main-job", *argv])
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


class _RunsCode:
    """Unpickling this touches a marker file (what a hostile checkpoint would do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_in_a_run_dir_is_never_executed(runs, monkeypatch, tmp_path):
    """A checkpoint whose drafter state is a (crafted) pickle: `train --resume` and `bench
    main-job` refuse it in one line, exit 2, and never unpickle it."""
    import pickle
    import shutil
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    monkeypatch.setattr(model_loading, "load_model", lambda config: (
        CFG, jax.tree_util.tree_map(jnp.copy, params), CharTokenizer()))
    run_dir = tmp_path / "run"
    shutil.copytree(runs["das"][0], run_dir)
    marker = tmp_path / "pwned"
    for d in (run_dir / "checkpoints").glob("*/drafter"):
        for f in d.glob("drafter_state.*"):
            f.unlink()
        (d / "drafter_state.pkl").write_bytes(pickle.dumps(_RunsCode(marker)))
        (d.parent / "checksums.json").unlink()   # as the older versions that pickled saved it
    for argv in (["train", "--resume", str(run_dir), "--set", "train.steps=3"],
                 ["bench", "main-job", str(run_dir), "--steps", "1"]):
        rc, _, err = _run_cli(argv)
        lines = [x for x in err.strip().splitlines() if ": error: " in x or "Traceback" in x]
        assert rc == 2 and "Traceback" not in err, err
        assert len(lines) == 1 and "drafter state as a pickle (drafter_state.pkl)" in lines[0], err
        assert not marker.exists()


def test_plot_files_are_the_ones_overwrite_may_remove():
    from das_jax.rl import run_dir as rd
    assert sorted(rd.PLOT_FILES) == sorted(PLOTS)


TORN = b'{"step": 1, "reward_mean": 0.1}\n{"step": 2, "reward_mean": 0.2}\n{"step": 3, "rew'


def test_a_torn_metrics_line_is_reported_and_its_step_named_on_resume(tmp_path, caplog):
    problems = []
    (tmp_path / "metrics.jsonl").write_bytes(TORN)
    recs = run_log.read_jsonl(tmp_path / "metrics.jsonl", problems)
    assert [r["step"] for r in recs] == [1, 2]
    assert problems == [f"{tmp_path / 'metrics.jsonl'}:3: skipped a torn last line (the run was "
                        "killed while writing it); it held step 3"]
    # a resume from step 3's checkpoint: the torn line and the missing step are both named
    with caplog.at_level(logging.WARNING, logger="das_jax"):
        logger = run_log.RunLogger(tmp_path, total_steps=5, start_step=3, progress=False,
                                   heartbeat_s=0)
    logger._watch.close()
    logger._file.close()
    logger._samples_file.close()
    text = caplog.text
    assert "metrics.jsonl:3: skipped a torn last line" in text and "it held step 3" in text
    assert "metrics.jsonl has no record of step 3 (lost when the run was killed" in text
    assert [r["step"] for r in run_log.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_samples_and_compare_report_torn_lines_and_bad_utf8(runs, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(runs["das"][0], run)
    good = (run / "samples.jsonl").read_bytes()
    (run / "samples.jsonl").write_bytes(good + b'{"step": 3, "index": 0, "compl')
    torn_line = good.count(b"\n") + 1
    rc, out, err = _run_cli(["samples", str(run), "--step", "2"])
    assert rc == 0 and out
    assert err.strip() == (f"das-jax samples: warning: {run / 'samples.jsonl'}:"
                           f"{torn_line}: skipped a torn last line (the run was "
                           "killed while writing it); it held step 3")
    (run / "samples.jsonl").write_bytes(b'{"step": 1, "q": "caf\xe9"}\n' + good)
    rc, out, err = _run_cli(["samples", str(run)])
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"das-jax samples: error: {run / 'samples.jsonl'}:1: invalid UTF-8")
    metrics = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(metrics + b'{"step": 3, "reward_m')
    rc, out, err = _run_cli(["compare", str(runs["none"][0]), str(run),
                             "--out", str(tmp_path / "c.png")])
    assert rc == 0 and "| metric" in out
    assert f"das-jax compare: warning: {run / 'metrics.jsonl'}:" in err
    assert "skipped a torn last line (the run was killed while writing it); it held step 3" in err


def _train_argv(run_dir, *extra):
    return ["train", "--config", str(TINY_YAML), "--no-progress",
            "--set", f"output_dir={run_dir}", "--set", "data.chat=false",
            "--set", "data.instruction=", "--set", "rollout.max_new_tokens=12",
            "--set", "rollout.draft_widths=[1,4]", "--set", "data.num_problems=2", *extra]


def _error_lines(err):
    return [x for x in err.strip().splitlines() if ": error: " in x or "Traceback" in x]


def test_train_errors_found_with_the_model_are_one_line_naming_the_key(runs, monkeypatch,
                                                                       tmp_path):
    import shutil
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    monkeypatch.setattr(model_loading, "load_model", lambda config: (
        CFG, jax.tree_util.tree_map(jnp.copy, params), CharTokenizer()))
    cases = [
        (_train_argv(tmp_path / "a", "--set", "rollout.stop_token_ids=[100000]"),
         "rollout.stop_token_ids [100000] are outside the model's vocabulary [0, 64)"),
        (_train_argv(tmp_path / "b", "--set", "rollout.max_cache_len=40"),
         "rollout.max_cache_len=40; raise rollout.max_cache_len to at least"),
    ]
    run = tmp_path / "run"
    shutil.copytree(runs["das"][0], run)
    cases.append((["train", "--resume", str(run), "--set", "drafter=ngram",
                   "--set", "train.steps=3"],
                  "drafter / DAS policy state does not fit drafter=ngram and this run's das "
                  "settings (the run was trained with drafter=das)"))
    for argv, fragment in cases:
        rc, _, err = _run_cli(argv)
        lines = _error_lines(err)
        assert rc == 2 and "Traceback" not in err, err
        assert len(lines) == 1 and fragment in lines[0], err
    assert steps_of(run) == [1, 2]


def steps_of(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_samples_with_records_that_are_not_samples_are_named_not_a_traceback(tmp_path):
    """A record without an integer step, or with a non-numeric reward, is skipped with a warning
    naming it; the others print."""
    (tmp_path / "samples.jsonl").write_text(
        '{"step": 1, "reward": 0.5, "completion": "hi"}\n{"reward": 1.0}\n'
        '{"step": 2, "reward": "x"}\n', encoding="utf-8")
    rc, out, err = _run_cli(["samples", str(tmp_path), "--all"])
    assert rc == 0 and "reward 0.500" in out and "Traceback" not in err
    assert [line.split("record ")[1].split(" ")[0] for line in err.splitlines()] == ["2", "3"]
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "reward": "x"}\n', encoding="utf-8")
    rc, out, err = _run_cli(["samples", str(tmp_path)])
    assert rc == 2 and err.splitlines()[-1].startswith("das-jax samples: error:")


def test_samples_refuses_a_samples_path_that_is_a_directory_and_step_with_all(tmp_path):
    """`samples.jsonl` that is a directory, and `--step` with `--all` (one would be ignored):
    one-line errors, exit code 2."""
    (tmp_path / "samples.jsonl").mkdir()
    rc, out, err = _run_cli(["samples", str(tmp_path)])
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (f"das-jax samples: error: {tmp_path / 'samples.jsonl'} is "
                                    "not a file (das-jax writes its samples there); pass a run "
                                    "directory written by 'das-jax train'")
    with pytest.raises(SystemExit) as e:
        _run_cli(["samples", str(tmp_path), "--step", "1", "--all"])
    assert e.value.code == 2


def test_zero_acceptance_warns_and_each_epoch_reports_acceptance_by_position_and_source(
        tmp_path, caplog):
    logger = run_log.RunLogger(tmp_path, total_steps=3, progress=False, steps_per_epoch=2)
    base = {"reward_mean": 0.5, "loss": 0.1, "rollout_s": 1.0, "train_s": 1.0}
    records = [
        dict(base, step=1, epoch=0, drafted_tokens=6, accepted_draft_tokens=3,
             drafted_by_position=[3, 2, 1], accepted_by_position=[2, 1, 0],
             drafted_by_source={"problem": 4, "global": 2},
             accepted_by_source={"problem": 3, "global": 0}),
        dict(base, step=2, epoch=0, drafted_tokens=70, accepted_draft_tokens=0,
             drafted_by_position=[40, 30], accepted_by_position=[0, 0],
             drafted_by_source={"request": 70}, accepted_by_source={"request": 0}),
        dict(base, step=3, epoch=1, drafted_tokens=0, accepted_draft_tokens=0,
             drafted_by_position=[], accepted_by_position=[], drafted_by_source={},
             accepted_by_source={}),
    ]
    with caplog.at_level(logging.INFO, logger="das_jax"):
        for r in records:
            logger.log(r)
        logger.close()
    text = [r.getMessage() for r in caplog.records]
    warns = [t for t in text if "not one was accepted" in t]
    assert len(warns) == 1 and warns[0].startswith("step 2: the drafter drafted 70 tokens")
    epoch = [t for t in text if "acceptance by draft position" in t]
    assert epoch == ["epoch 0 acceptance by draft position 0.05 0.03 0.00 (positions 1-3); by "
                     "source (accepted / drafted tokens): request 0.00 of 70, problem 0.75 of "
                     "4, global 0.00 of 2"]       # epoch 1 drafted nothing: no line
    saved = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert saved[0]["drafted_by_source"] == {"problem": 4, "global": 2}


def test_a_step_with_few_draft_tokens_none_accepted_is_no_warning(tmp_path, caplog):
    """Two draft tokens both rejected happens by chance (the main job's first step): no
    warning below `ZERO_ACCEPTANCE_MIN_DRAFTED` draft tokens; at it, one."""
    logger = run_log.RunLogger(tmp_path, total_steps=2, progress=False)
    base = {"reward_mean": 0.5, "loss": 0.1, "rollout_s": 1.0, "train_s": 1.0, "epoch": 0,
            "accepted_draft_tokens": 0}
    with caplog.at_level(logging.INFO, logger="das_jax"):
        logger.log(dict(base, step=1, drafted_tokens=2))
        logger.log(dict(base, step=2, drafted_tokens=run_log.ZERO_ACCEPTANCE_MIN_DRAFTED))
        logger.close()
    warns = [r.getMessage() for r in caplog.records if "not one was accepted" in r.getMessage()]
    assert len(warns) == 1 and warns[0].startswith("step 2: the drafter drafted 64 tokens")


def test_a_named_model_is_fetched_with_one_phase_line_per_process(tmp_path, monkeypatch):
    """`das-jax train` fetches a named source before its memory plan and again in
    `load_model`: the second call returns the path without a second "fetching" line."""
    import logging

    from das_jax.config import config_from_dict
    from das_jax.models import loading
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x")
    calls = []
    monkeypatch.setattr(loading, "resolve_source",
                        lambda src: calls.append(src) or ("gguf", str(gguf)))
    monkeypatch.setattr(model_loading, "_FETCHED", {})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("das_jax.train")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cfg = config_from_dict({"model": {"source": "smollm2-135m-instruct"}})
        assert model_loading.fetch_named_source(cfg) == str(gguf)
        assert model_loading.fetch_named_source(cfg) == str(gguf)
        assert model_loading._fetch(cfg) == str(gguf)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    fetching = [r.getMessage() for r in records if "fetching the model" in r.getMessage()]
    assert len(fetching) == 2 and "done in" in fetching[1], fetching   # its start and end
    assert calls == ["smollm2-135m-instruct"]
    gguf.unlink()       # the file is gone since: fetched again
    monkeypatch.setattr(model_loading, "_FETCHED", {"smollm2-135m-instruct": str(gguf)})
    model_loading.fetch_named_source(cfg)
    assert calls == ["smollm2-135m-instruct"] * 2
