"""Every user error of every `das-jax` subcommand ends in one line on stderr and exit code 2.

The sweep runs `das_jax.cli.main(argv)` in-process (capsys); each case fails before any model
is loaded (cases that would otherwise reach a model point `model.source` at a missing path, so
a check that does not fire shows up as the wrong message, not as a slow model load). A few
cases run the real command in a subprocess.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from das_jax.cli import main
from das_jax.config import load_config, save_config
from das_jax.errors import one_line, user_error_message
from das_jax.rl import run_dir as rd

ROOT = Path(__file__).resolve().parents[1]
NO_MODEL = "model.source=/nonexistent/model-dir"


def run_cli(capsys, argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:     # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, fragment, prog):
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: "), lines[0]
    assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def files(tmp_path):
    f = {}
    f["bad_txt"] = tmp_path / "prompts.txt"
    f["bad_txt"].write_bytes(b"first prompt\nsecond \xff\xfe prompt\n")
    f["bad_jsonl"] = tmp_path / "data.jsonl"
    f["bad_jsonl"].write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n\n'
                               b'{"question": "caf\xe9", "answer": "#### 3"}\n')
    f["bad_yaml"] = tmp_path / "c.yaml"
    f["bad_yaml"].write_bytes(b"drafter: das\ndata:\n  instruction: \"caf\xe9\"\n")
    f["bad_trace"] = tmp_path / "trace.jsonl"
    f["bad_trace"].write_bytes(b'{"type": "header"}\n{"epoch": 0, "problem_id": "\xff"}\n')
    f["file"] = tmp_path / "a-file"
    f["file"].write_text("x")
    f["missing"] = tmp_path / "missing"
    return f


def _cases(tmp_path, f):
    """(argv, fragment of the one-line message, prog)."""
    G, E, D, R, P, T = ("das-jax generate", "das-jax bench engine", "das-jax bench drafter",
                        "das-jax bench rollout", "das-jax bench replay", "das-jax train")
    out = tmp_path / "run"
    return [
        # generate
        (["generate", "--prompt", "hi", "--draft-widths", "abc"], "argument --draft-widths: "
         "'abc' is not a comma-separated list of positive ints", G),
        (["generate", "--prompt", "hi", "--draft-widths", "1,0"], "argument --draft-widths", G),
        (["generate", "--prompt", "hi", "--num-samples", "0"], "argument --num-samples", G),
        (["generate", "--prompt", "hi", "--max-new-tokens", "x"], "argument --max-new-tokens", G),
        (["generate", "--prompts-file", f["bad_txt"]],
         f"--prompts-file {f['bad_txt']}:2: invalid UTF-8", G),
        (["generate", "--prompts-file", f["missing"]], "cannot read --prompts-file", G),
        (["generate", "--prompt", "hi", "--model", "nosuch"], "nosuch: no such file", G),
        (["generate"], "one of the arguments --prompt --prompts-file is required", G),
        # models / model-info
        (["models", "extra"], "unrecognized arguments: extra", "das-jax"),
        (["model-info", "nosuch"], "nosuch: no such file", "das-jax model-info"),
        (["model-info"], "the following arguments are required: SOURCE", "das-jax model-info"),
        (["model-info", "x", "--dtype", "float64"], "argument --dtype", "das-jax model-info"),
        # bench engine / drafter / rollout / replay
        (["bench", "engine", "--model", "nosuch", "--no-hf"], "nosuch: no such file", E),
        (["bench", "engine", "--prompt-len", "0"], "argument --prompt-len", E),
        (["bench", "engine", "--prompts", f["missing"], "--no-hf"], "file not found", E),
        (["bench", "engine", "--prompts", f["bad_jsonl"], "--no-hf"],
         f"{f['bad_jsonl']}:3: invalid UTF-8", E),
        (["bench", "drafter", "--drafters", "suffix,bogus"], "argument --drafters: 'bogus'", D),
        (["bench", "drafter", "--traffic", "short"], "argument --traffic: 'short'", D),
        (["bench", "drafter", "--k", "0"], "argument --k", D),
        (["bench", "rollout", "--temperatures", "abc"], "argument --temperatures", R),
        (["bench", "rollout", "--drafters", "das,bogus"], "argument --drafters: 'bogus'", R),
        (["bench", "rollout", "--epochs", "0"], "argument --epochs", R),
        (["bench", "rollout", "--config", f["missing"]], "cannot read config file", R),
        (["bench", "rollout", "--set", "grpo.reward_funcs=[nosuch]"],
         "unknown reward function 'nosuch'", R),
        (["bench", "replay", f["missing"]], "no such file; pass a trace", P),
        (["bench", "replay", f["bad_trace"]], f"{f['bad_trace']}:2: invalid UTF-8", P),
        (["bench", "replay", f["bad_txt"]], f"{f['bad_txt']}:1: not JSON", P),
        (["bench", "replay", f["missing"], "--slots", "x"], "argument --slots", P),
        (["bench", "replay", f["missing"], "--draft-widths", "1,a"], "argument --draft-widths", P),
        (["bench", "replay", f["missing"], "--drafters", "dass"], "argument --drafters", P),
        # train: config
        (["train", "--set", "grpo.reward_funcs=[math_accuracy, nosuch]", "--set", NO_MODEL],
         "grpo.reward_funcs: unknown reward function 'nosuch'", T),
        (["train", "--set", "grpo.reward_funcs=[formt]"], "did you mean 'format'", T),
        (["train", "--set", "data.templates=[bakery]", "--set", "data.max_steps=1", "--set",
          NO_MODEL], "no template among ['bakery'] can make a 1-step problem", T),
        (["train", "--set", "data.templates=[counting]", "--set", "data.min_steps=4", "--set",
          NO_MODEL], "no template among ['counting'] can make a 4-step problem", T),
        (["train", "--set", "grpo.advantage_estimator=grp", "--set", NO_MODEL],
         "grpo.advantage_estimator must be one of", T),
        (["train", "--set", "grpo.advantage_estimator=rloo", "--set", NO_MODEL],
         "grpo.advantage_estimator must be one of", T),
        (["train", "--set", "grpo.num_generation=4"], "did you mean 'grpo.num_generations'", T),
        (["train", "--set", "train.resume=latest"], "train.resume is no longer a config key", T),
        (["train", "--set", "train.log_every=5"], "train.log_every is no longer a config key", T),
        (["train", "--set", "das.enabled=false"], "das.enabled is no longer a config key", T),
        (["train", "--set", "data.kind=gsm8k", "--set", "data.path=x.jsonl", "--set",
          "data.seed=3"], "data.seed=3 applies to data.kind='arithmetic' only", T),
        (["train", "--set", "data.kind=gsm8k"], "set data.path=FILE", T),
        (["train", "--set", "data.path=x.jsonl"], "has no effect with data.kind='arithmetic'", T),
        (["train", "--config", f["missing"]], "cannot read config file", T),
        (["train", "--config", f["bad_yaml"]], f"{f['bad_yaml']}:3: invalid UTF-8", T),
        (["train", "--steps", "-1"], "argument --steps", T),
        # train: run directory and data, before the model
        (["train", "--set", f"output_dir={f['file']}", "--set", NO_MODEL],
         "is an existing file, not a directory", T),
        (["train", "--set", f"output_dir={out}", "--set", "data.kind=gsm8k", "--set",
          f"data.path={f['bad_jsonl']}", "--set", NO_MODEL],
         f"{f['bad_jsonl']}:3: invalid UTF-8", T),
        (["train", "--set", f"output_dir={out}", "--set", "data.kind=gsm8k", "--set",
          f"data.path={f['missing']}", "--set", NO_MODEL], "file not found", T),
        (["train", "--set", f"output_dir={out}", "--set", NO_MODEL],
         "/nonexistent/model-dir: no such file", T),
        (["train", "--resume", f["missing"]], "no config.yaml there", T),
        (["train", "--resume", out, "--overwrite"], "pass only one", T),
        (["train", "--resume", out, "--config", f["file"]], "drop --config", T),
    ]


def test_every_subcommand_error_is_one_line(tmp_path, files, capsys):
    cases = _cases(tmp_path, files)
    covered = {tuple(a[:2]) if a[0] == "bench" else a[0] for a, _, _ in cases}
    assert covered >= {"generate", "models", "model-info", "train", ("bench", "engine"),
                       ("bench", "drafter"), ("bench", "rollout"), ("bench", "replay")}
    for argv, fragment, prog in cases:
        rc, _, err = run_cli(capsys, argv)
        assert_one_line_error(rc, err, fragment, prog)


def _fake_run(run_dir: Path, steps: int, checkpoints=(), source="/nonexistent/model-dir"):
    """A run directory as `das-jax train` leaves it, without any model: config.yaml, one
    metrics line, and empty step directories (the CLI's pre-checks read only their names)."""
    cfg = load_config(None, [f"output_dir={run_dir}", f"train.steps={steps}",
                             f"model.source={source}"])
    save_config(cfg, run_dir / "config.yaml")
    rd.write_manifest(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    for s in checkpoints:
        (run_dir / "checkpoints" / str(s)).mkdir(parents=True)
    return cfg


def test_a_killed_run_without_checkpoint_is_not_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run, steps=4)
    before = {p: p.read_bytes() for p in run.iterdir() if p.name != '.lock'}
    rc, _, err = run_cli(capsys, ["train", "--set", f"output_dir={run}", "--set", NO_MODEL])
    assert_one_line_error(rc, err, "already holds a run (config.yaml, metrics.jsonl); it has no "
                                   "checkpoint, so it cannot be resumed", "das-jax train")
    assert "--overwrite" in err and "another output_dir" in err
    assert {p: p.read_bytes() for p in run.iterdir() if p.name != '.lock'} == before
    rc, _, err = run_cli(capsys, ["train", "--resume", run])
    assert_one_line_error(rc, err, "has no checkpoint to resume from", "das-jax train")
    # --overwrite goes past the check (and then fails at the missing model, one line too)
    rc, _, err = run_cli(capsys, ["train", "--set", f"output_dir={run}", "--set", NO_MODEL,
                                  "--overwrite"])
    assert_one_line_error(rc, err, "/nonexistent/model-dir: no such file", "das-jax train")


def test_a_second_run_on_a_busy_output_dir_is_refused(tmp_path, capsys):
    from test_run_dir import LockHolder
    run = tmp_path / "run"
    holder = LockHolder(run)
    try:
        rc, _, err = run_cli(capsys, ["train", "--set", f"output_dir={run}", "--set", NO_MODEL])
        assert_one_line_error(rc, err, "is in use by another run (pid", "das-jax train")
        rc, _, err = run_cli(capsys, ["train", "--resume", run])
        assert "Traceback" not in err and rc == 2
    finally:
        holder.kill()
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()


def test_resume_of_a_finished_run_says_complete_and_how_to_extend(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run, steps=3, checkpoints=(2, 3))
    rc, _, err = run_cli(capsys, ["train", "--resume", run])
    assert rc == 0 and "Traceback" not in err
    assert err.strip() == (f"run '{run}' is complete: its latest checkpoint is step 3 and "
                           f"train.steps is 3; to train further, pass --resume {run} --set "
                           "train.steps=N with N > 3")
    # the override is applied: past the completion check, the (missing) model is next
    rc, _, err = run_cli(capsys, ["train", "--resume", run, "--set", "train.steps=5"])
    assert_one_line_error(rc, err, "/nonexistent/model-dir: no such file", "das-jax train")


def test_resume_with_another_model_is_refused_before_loading(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run, steps=3, checkpoints=(2,), source="smollm2-135m-instruct")
    rc, _, err = run_cli(capsys, ["train", "--resume", run, "--set",
                                  "model.source=/some/other-model"])
    assert_one_line_error(rc, err, "the run was trained from model.source="
                                   "'smollm2-135m-instruct'", "das-jax train")
    assert "'/some/other-model'" in err


def test_platform_gpu_without_gpu_is_one_line_before_the_model(tmp_path):
    import jax
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if has_gpu:
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-m", "das_jax.cli", "train", "--set", "platform=gpu",
                           "--set", f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("das-jax train: error: platform='gpu': JAX "
                                                   "cannot use a GPU (CUDA or ROCm) on this "
                                                   "machine (JAX says: ")
    assert "set platform: cpu" in lines[0]
    assert not (tmp_path / "run").exists()    # refused before it wrote anything: no run dir


def test_real_command_prints_exactly_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "das_jax.cli", "generate", "--prompt", "hi",
                           "--draft-widths", "abc"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("das-jax generate: error: argument --draft-widths: 'abc' is not a "
                           "comma-separated list of positive ints (e.g. 1,4,8) (see das-jax "
                           "generate --help)\n")


# ----- the handler's classification ------------------------------------------------------------

def test_disk_full_is_named_as_such():
    e = OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl")
    assert user_error_message(e) == ("disk full (No space left on device) while writing "
                                     "/runs/x/metrics.jsonl; free space on that disk or choose an "
                                     "output_dir on another one")
    try:                                    # wrapped by a library: found in the cause chain
        try:
            raise e
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as wrapped:
        assert user_error_message(wrapped).startswith("disk full")


def test_bugs_keep_their_traceback():
    assert user_error_message(KeyError("x")) is None
    assert user_error_message(ValueError("internal")) is None
    assert user_error_message(TypeError("bad")) is None


def test_one_line_joins_lines():
    assert one_line("a:\n  b\n\n  c\n") == "a:; b; c"


def test_debug_env_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.setenv("DAS_JAX_DEBUG", "1")
    from das_jax.models.errors import ModelLoadError
    with pytest.raises(ModelLoadError):
        main(["bench", "engine", "--model", "nosuch", "--no-hf"])


# ----- generate: NaN never reaches JSON ------------------------------------------------------------

def test_json_line_never_writes_nan():
    from das_jax.cli.generate import json_line
    line = json_line({"stats": {"a": float("nan"), "b": [1.0, float("inf")], "c": 2}})
    assert json.loads(line) == {"stats": {"a": None, "b": [1.0, None], "c": 2}}
    assert "NaN" not in line and "Infinity" not in line


def test_nan_logprobs_are_reported_naming_the_model():
    from types import SimpleNamespace

    from das_jax.cli.generate import check_finite_logprobs
    ok = SimpleNamespace(logprobs=[-0.5, -1.0], request=SimpleNamespace(problem_id=0,
                                                                          sample_index=0))
    bad = SimpleNamespace(logprobs=[-0.5, float("nan")], request=SimpleNamespace(problem_id=1,
                                                                                 sample_index=2))
    check_finite_logprobs([ok], "m.gguf", "float32")
    with pytest.raises(ValueError, match=r"model 'm.gguf' produced non-finite log-probs \(nan\) "
                                         r"at token 1 of prompt 1 sample 2.*corrupt"):
        check_finite_logprobs([ok, bad], "m.gguf", "float32")


def test_an_empty_output_dir_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in ("", "'  '"):
        rc, _, err = run_cli(capsys, ["train", "--config", ROOT / "configs" / "tiny.yaml",
                                      "--set", f"output_dir={value}", "--set", NO_MODEL])
        assert_one_line_error(rc, err, f"--set output_dir={value}: output_dir is empty",
                              "das-jax train")
    assert os.listdir(tmp_path) == []


def test_overwrite_never_removes_a_users_own_files(tmp_path, capsys, monkeypatch):
    """The current directory holding the user's config.yaml and plots/my_figure.png is not a
    previous run: refused with and without --overwrite, nothing removed and nothing left (the
    refused run's lock file is gone again)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plots").mkdir()
    (tmp_path / "config.yaml").write_text("mine: true\n")
    (tmp_path / "plots" / "my_figure.png").write_bytes(b"\x89PNG mine")
    for extra in ([], ["--overwrite"]):
        rc, _, err = run_cli(capsys, ["train", "--config", ROOT / "configs" / "tiny.yaml",
                                      "--set", "output_dir=.", "--set", NO_MODEL, *extra])
        assert_one_line_error(rc, err, "output_dir '.' holds config.yaml, which no das-jax run "
                                       "wrote there", "das-jax train")
        assert "--overwrite" not in err
    assert (tmp_path / "config.yaml").read_text() == "mine: true\n"
    assert (tmp_path / "plots" / "my_figure.png").read_bytes() == b"\x89PNG mine"
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "plots"]


def test_a_bad_set_value_is_blamed_on_the_set_not_the_file(tmp_path, capsys):
    tiny = ROOT / "configs" / "tiny.yaml"
    rc, _, err = run_cli(capsys, ["train", "--config", tiny, "--set", "grpo.learning_rate=nan",
                                  "--set", NO_MODEL])
    assert_one_line_error(rc, err, "error: --set grpo.learning_rate=nan: grpo.learning_rate must "
                                   "be >= 0, got nan", "das-jax train")
    assert "tiny.yaml" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  learning_rate: -1\n")
    rc, _, err = run_cli(capsys, ["train", "--config", bad, "--set", "grpo.beta=0.1"])
    assert_one_line_error(rc, err, f"error: {bad}: grpo.learning_rate must be >= 0, got -1.0",
                          "das-jax train")
    # a cross-field check broken by an override names that override
    rc, _, err = run_cli(capsys, ["train", "--config", tiny, "--set", "grpo.beta=0.1",
                                  "--set", "rollout.max_cache_len=8"])
    assert_one_line_error(rc, err, "error: --set rollout.max_cache_len=8: rollout.max_cache_len=8 "
                                   "must exceed rollout.max_new_tokens=16", "das-jax train")


def test_help_shows_no_default_for_flags(capsys):
    """`--no-x` flags do not print "(default: True)" (it would not say which way is on); options
    with a value still show their default."""
    from das_jax.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "rollout", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "skip the HF reference (also under --preset readme) --hf-batches" in out
    assert "(default: True)" not in out
    assert "(default: 0)" in out    # --load-cores N
