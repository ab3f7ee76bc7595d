"""Bad input to `compare`, `bench replay`, `bench drafter`, `draft-head fit / replay` and the
shared trace reader: one line on stderr naming the input and the fix, exit code 2, no
traceback, checked before any model load or simulation, nothing half-written left behind.
Tiny files written here; no model is loaded."""
from __future__ import annotations

import json
import os

import pytest

from das_jax.cli import main
from das_jax.errors import UserError, user_error_message

HEADER = {"type": "header", "model": "smollm2-135m-instruct", "max_new_tokens": 16,
          "cost_model": {"c_base": 0.01, "c_tok": 1e-4, "c_kv": 1e-7},
          "engine": {"max_slots": 4, "max_cache_len": 64, "draft_widths": [1, 4]}}
ROLLOUT = {"epoch": 0, "temperature": 0.6, "problem_id": "p", "sample_index": 0,
           "prompt_ids": [1, 2, 3], "token_ids": [4, 5, 6], "finish_reason": "stop"}


def _trace(path, header=HEADER, rollouts=(ROLLOUT,), raw_lines=()):
    lines = ([json.dumps(header)] if header is not None else []) + [
        json.dumps(r) for r in rollouts] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _cli(capsys, *argv):
    """(exit code, stderr, stdout) of `das-jax ARGV` run in this process."""
    try:
        rc = main(list(argv))
    except SystemExit as e:     # argparse errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.err.strip(), out.out


def _one_line_error(rc, err, *names):
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "error:" in err, err
    for n in names:
        assert n in err, (n, err)


# ------------------------------------------------------------------ the shared trace reader

@pytest.mark.parametrize("header,rollouts,raw,needle", [
    (HEADER, (), ["[1, 2]"], ":2: not a rollout trace: the line is a JSON list"),
    ({**HEADER, "model": 123}, (ROLLOUT,), [], "header 'model'"),
    (HEADER, ({**ROLLOUT, "prompt_ids": "abc"},), [], "prompt_ids must be a list of token ids"),
    (HEADER, ({**ROLLOUT, "token_ids": [-5, 4]},), [], "token_ids must be a list of token ids"),
    (HEADER, ({**ROLLOUT, "token_ids": [1.5]},), [], "token_ids"),
    (HEADER, ({**ROLLOUT, "epoch": "0"},), [], "epoch must be an integer >= 0"),
    (HEADER, ({**ROLLOUT, "temperature": "hot"},), [], "temperature"),
    (HEADER, ({k: v for k, v in ROLLOUT.items() if k != "problem_id"},), [],
     "it has no problem_id"),
    ({**HEADER, "cost_model": {"c_base": "x", "c_tok": 1, "c_kv": 0}}, (ROLLOUT,), [],
     "cost_model.c_base must be a finite number >= 0"),
    ({**HEADER, "cost_model": {"c_base": -1, "c_tok": 1, "c_kv": 0}}, (ROLLOUT,), [],
     "cost_model.c_base"),
    ({**HEADER, "cost_model": "h100"}, (ROLLOUT,), [], "'cost_model' is str"),
    ({**HEADER, "engine": {"max_slots": 0}}, (ROLLOUT,), [], "engine.max_slots"),
    ({**HEADER, "engine": {"draft_widths": [4, 8]}}, (ROLLOUT,), [], "engine.draft_widths"),
    ({**HEADER, "max_new_tokens": "16"}, (ROLLOUT,), [], "max_new_tokens"),
    (HEADER, (), [], "holds no rollouts"),
])
def test_trace_reader_checks_every_line(tmp_path, header, rollouts, raw, needle):
    from das_jax.bench import replay as rp
    from das_jax.bench.drafter_trace import load_trace_rollouts
    path = _trace(tmp_path / "t.jsonl", header, rollouts, raw)
    for read in (rp.read_trace, load_trace_rollouts):     # one reader for every command
        with pytest.raises(UserError, match="t.jsonl") as e:
            read(path)
        assert needle in str(e.value)
        assert "\n" not in user_error_message(e.value)


def test_trace_reader_missing_file_and_directory(tmp_path):
    from das_jax.bench import replay as rp
    with pytest.raises(UserError, match="nope.jsonl: no such file; pass a trace"):
        rp.read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="is a directory"):
        rp.read_trace(tmp_path)


def test_drafter_commands_accept_a_trace_without_header_or_sample_index(tmp_path):
    from das_jax.bench.drafter_trace import load_trace_rollouts
    from das_jax.bench import replay as rp
    r = {k: v for k, v in ROLLOUT.items() if k != "sample_index"}
    path = _trace(tmp_path / "t.jsonl", None, (r,))
    header, rolls = load_trace_rollouts(path)
    assert header == {} and rolls[0].prompt_ids == [1, 2, 3]
    with pytest.raises(UserError, match="it has no sample_index"):
        rp.read_trace(path)                 # bench replay needs sample_index and the header
    path = _trace(tmp_path / "t.jsonl", None, (ROLLOUT,))
    with pytest.raises(UserError, match="no header line"):
        rp.read_trace(path)


def test_trace_commands_refuse_a_bad_trace_before_any_model_loads(tmp_path, capsys):
    bad = _trace(tmp_path / "t.jsonl", HEADER, (), ["[1, 2]"])
    out = str(tmp_path / "h.safetensors")
    for argv in (("draft-head", "fit", bad, "--out", out),
                 ("draft-head", "replay", bad, "--head", out),
                 ("bench", "drafter", "--trace", bad),
                 ("bench", "replay", bad)):
        rc, err, _ = _cli(capsys, *argv)
        _one_line_error(rc, err, "t.jsonl:2", "JSON list")


# ------------------------------------------------------------------------- bench replay

@pytest.mark.parametrize("header,extra,names", [
    (HEADER, ["--draft-widths", "4,8"], ["--draft-widths", "must include 1"]),
    (HEADER, ["--scale", "paper", "--paper-sigma", "-1"], ["--paper-sigma"]),
    (HEADER, ["--scale", "paper", "--paper-median", "-5"], ["--paper-median"]),
    (HEADER, ["--scale", "paper", "--paper-median", "nan"], ["--paper-median"]),
    (HEADER, ["--c-base", "-1"], ["--c-base", ">= 0"]),
    (HEADER, ["--c-base", "nan"], ["--c-base"]),
    (HEADER, ["--c-tok", "inf"], ["--c-tok"]),
    (HEADER, ["--c-kv", "x"], ["--c-kv"]),
    (HEADER, ["--temperature", "5"], ["--temperature 5", "holds 0.6", "all"]),
    (HEADER, ["--scale", "paper", "--temperature", "5"], ["--temperature 5", "holds 0.6",
                                                          "the lowest"]),
    (HEADER, ["--paper-problems", "3"], ["--paper-problems", "--scale paper"]),
    ({k: v for k, v in HEADER.items() if k != "cost_model"}, [],
     ["no 'cost_model'", "--cost-model"]),
    ({k: v for k, v in HEADER.items() if k != "max_new_tokens"}, [], ["no 'max_new_tokens'"]),
    ({**HEADER, "cost_model": {"c_base": "x", "c_tok": 1, "c_kv": 0}}, [],
     ["cost_model.c_base", "--cost-model"]),
    ({**HEADER, "engine": {"max_slots": 0}}, [], ["engine.max_slots"]),
    (HEADER, ["--cost-model", "bogus"], ["--cost-model bogus", "valid:"]),
])
def test_bench_replay_bad_input(tmp_path, capsys, header, extra, names):
    trace = _trace(tmp_path / "t.jsonl", header)
    rc, err, out = _cli(capsys, "bench", "replay", trace, "--drafters", "none", *extra)
    _one_line_error(rc, err, *names)
    assert "cost model (" not in out           # refused before the simulation


def test_bench_replay_checks_json_path_before_simulating(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    rc, err, out = _cli(capsys, "bench", "replay", trace, "--drafters", "none", "--json",
                        str(tmp_path / "nodir" / "x.json"))
    _one_line_error(rc, err, "--json", "nodir", "does not exist")
    assert "cost model (" not in out
    rc, err, out = _cli(capsys, "bench", "replay", trace, "--drafters", "none", "--json",
                        str(tmp_path))
    _one_line_error(rc, err, "--json", "is a directory")
    assert "cost model (" not in out


def test_bench_replay_good_trace_writes_json_atomically(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    out_json = tmp_path / "r.json"
    rc, err, out = _cli(capsys, "bench", "replay", trace, "--drafters", "none", "--json",
                        str(out_json))
    assert rc == 0, err
    assert json.loads(out_json.read_text())["results"][0]["temperature"] == 0.6
    assert sorted(os.listdir(tmp_path)) == ["r.json", "t.jsonl"]     # no temporary left
    # At paper scale the workload is built from the rollouts at --temperature (it was ignored),
    # by default from the lowest; the results say which.
    paper = ["--scale", "paper", "--paper-problems", "2", "--paper-samples", "2",
             "--paper-max-tokens", "64", "--paper-median", "32", "--paper-epochs", "1"]
    for extra in ([], ["--temperature", "0.6"]):
        rc, err, out = _cli(capsys, "bench", "replay", trace, "--drafters", "none", "--json",
                            str(out_json), *paper, *extra)
        assert rc == 0, err
        assert json.loads(out_json.read_text())["results"][0]["temperature"] == 0.6


# ------------------------------------------------------------------------- bench drafter

@pytest.mark.parametrize("argv,flag", [
    (["--batch", "--rows", "0", "--steps", "1"], "--rows"),
    (["--batch", "--threads", "0", "--steps", "1"], "--threads"),
    (["--batch", "--steps", "0"], "--steps"),
    (["--batch", "--scopes", "bogus", "--steps", "1"], "--scopes"),
    (["--batch", "--scopes", "request", "--steps", "1"], "--scopes"),
    (["--batch", "--vocab", "0", "--steps", "1"], "--vocab"),
    (["--batch", "--length", "0", "--steps", "1"], "--length"),
    (["--head-scale", "-1"], "--head-scale"),
    (["--head-scale", "nan"], "--head-scale"),
])
def test_bench_drafter_arguments_checked_by_the_parser(capsys, argv, flag):
    rc, err, _ = _cli(capsys, "bench", "drafter", *argv)
    _one_line_error(rc, err, f"argument {flag}")


# ---------------------------------------------------------------------------- draft-head

def test_draft_head_fit_too_small_a_trace(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    rc, err, _ = _cli(capsys, "draft-head", "fit", trace, "--out", str(tmp_path / "h.safetensors"),
                      "--epochs", "1")
    _one_line_error(rc, err, "t.jsonl", "1 optimizer step", "--epochs", "--batch")


def test_fit_steps_counts_the_schedule():
    from das_jax.draft_head.fit import fit_steps
    assert fit_steps([3], batch=8, epochs=1) == 1
    assert fit_steps([3, 3, 100], batch=1, epochs=2) == 6
    assert fit_steps([3, 3, 100], batch=8, epochs=2) == 4    # two output buckets


def test_draft_head_fit_out_is_a_directory(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    adir = tmp_path / "adir"
    adir.mkdir()
    rc, err, _ = _cli(capsys, "draft-head", "fit", trace, "--out", str(adir))
    _one_line_error(rc, err, "--out", "is a directory")
    assert not (tmp_path / "adir.tmp").exists()


@pytest.mark.parametrize("argv,flag", [
    (["replay", "T", "--head", "H", "--learning-rates", "inf"], "--learning-rates"),
    (["replay", "T", "--head", "H", "--learning-rates", "0,nan"], "--learning-rates"),
    (["fit", "T", "--out", "H", "--lr", "inf"], "--lr"),
])
def test_draft_head_rates_must_be_finite(capsys, argv, flag):
    rc, err, _ = _cli(capsys, "draft-head", *argv)
    _one_line_error(rc, err, f"argument {flag}")


# ------------------------------------------------------------------------------- compare

def _run(path, *records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


GOOD = {"step": 1, "reward_mean": 0.5, "rollout_s": 2.0, "forward_passes": 10,
        "generated_tokens": 20}


@pytest.mark.parametrize("bad,names", [
    ({"foo": 1}, ["record 1", "no integer 'step'"]),
    ({"step": "1"}, ["record 1", "no integer 'step'"]),
    ({"step": 1, "rollout_s": "slow"}, ["'rollout_s' must be a number"]),
    ({"step": 1, "drafted_by_source": [1]}, ["'drafted_by_source'"]),
    ({"step": 5, "reward_mean": 0.1}, ["no step in common", "steps 5-5", "steps 1-1"]),
])
def test_compare_bad_metrics(tmp_path, capsys, monkeypatch, bad, names):
    monkeypatch.chdir(tmp_path)
    a = _run(tmp_path / "a", bad)
    b = _run(tmp_path / "b", GOOD)
    rc, err, _ = _cli(capsys, "compare", a, b)
    _one_line_error(rc, err, *names)
    assert not list(tmp_path.glob("*.png"))            # nothing plotted before the error


@pytest.mark.parametrize("out,names", [
    ("x.txt", ["--out x.txt", ".png", ".pdf", ".svg"]),
    ("noext", ["--out noext", "no file extension"]),
    ("adir", ["--out adir", "is a directory"]),
])
def test_compare_out_path(tmp_path, capsys, monkeypatch, out, names):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    a = _run(tmp_path / "a", GOOD)
    b = _run(tmp_path / "b", GOOD)
    rc, err, _ = _cli(capsys, "compare", a, b, "--out", out)
    _one_line_error(rc, err, *names)
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "x.txt").exists()


def test_compare_good_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = _run(tmp_path / "a", GOOD)
    b = _run(tmp_path / "b", GOOD)
    rc, err, out = _cli(capsys, "compare", a, b, "--out", "c.png")
    assert rc == 0, err
    assert "plot: c.png" in out and (tmp_path / "c.png").exists()
