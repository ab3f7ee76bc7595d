"""Config values refused at validation, before any model loads: non-finite floats (every float
key), missing ranges, draft widths without 1, duplicate YAML keys and duplicate list entries; and
`das-jax plan`'s own argument errors (one line, `das-jax plan: error:`, exit code 2)."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from das_jax.config import Config, ConfigError, load_config
from das_jax.config.schema import INFINITE_OK

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def _float_keys(cls=Config, prefix=""):
    """Every float key of the schema (float, Optional[float], list of floats), nested included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            yield from _float_keys(tp, key + ".")
            continue
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if float in args:
            yield key, False
        elif any(typing.get_origin(a) is tuple and typing.get_args(a)[:1] == (float,)
                 for a in args):
            yield key, True


FLOAT_KEYS = sorted(_float_keys())


def test_the_float_keys_are_found():
    keys = {k for k, _ in FLOAT_KEYS}
    assert {"grpo.learning_rate", "rollout.temperature", "das.cost_model.c_base",
            "das.policy.weight_short", "grpo.reward_weights", "train.device_memory_gb"} <= keys


@pytest.mark.parametrize("key, is_list", FLOAT_KEYS)
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
def test_every_float_key_refuses_non_finite_values(key, is_list, bad):
    """inf / nan were accepted (grpo.learning_rate=inf trained to NaN weights)."""
    value = f"[{bad}]" if is_list else bad
    if bad == "inf" and key in INFINITE_OK:
        assert load_config(TINY, [f"{key}={value}"]) is not None
        return
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"{key}={value}"])
    msg = str(e.value)
    assert msg.startswith(f"--set {key}={value}: "), msg
    assert key.rsplit(".", 1)[-1] in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("override, fragment", [
    ("grpo.learning_rate=inf", "grpo.learning_rate must be a finite number, got inf"),
    ("rollout.temperature=inf", "rollout.temperature must be a finite number, got inf"),
    ("grpo.beta=inf", "grpo.beta must be a finite number"),
    ("grpo.epsilon_high=inf", "grpo.epsilon_high must be a finite number"),
    ("grpo.weight_decay=inf", "grpo.weight_decay must be a finite number"),
    ("rollout.kv_memory_gb=inf", "rollout.kv_memory_gb must be a finite number, got inf; set it "
                                 "to a finite number or null"),
    ("draft_head.scale=inf", "draft_head.scale must be a finite number"),
    ("rewards.timeout_s=inf", "rewards.timeout_s must be a finite number"),
    ("train.draft_max_grad_norm=inf", "train.draft_max_grad_norm must be a finite number"),
    ("grpo.importance_sampling_cap=inf", "grpo.importance_sampling_cap must be a finite number"),
    ("das.cost_model.c_base=nan", "das.cost_model.c_base must be a finite number, got nan"),
    ("das.cost_model.c_base=inf", "das.cost_model.c_base must be a finite number, got inf"),
    ("das.cost_model.compile_s=nan", "das.cost_model.compile_s must be a finite number"),
    ("grpo.reward_weights=[nan]", "grpo.reward_weights[0] must be a finite number, got nan"),
    ("das.global_below=nan", "das.global_below must be >= 0"),
    ("das.request_below=nan", "das.request_below must be >= 0"),
    ("das.request_below=-1", "das.request_below must be >= 0"),
    # no range check at all
    ("grpo.adam_beta1=2", "grpo.adam_beta1 must be in [0, 1)"),
    ("grpo.adam_beta1=-1", "grpo.adam_beta1 must be in [0, 1)"),
    ("grpo.adam_beta2=1.5", "grpo.adam_beta2 must be in [0, 1)"),
    ("grpo.adam_beta2=1", "grpo.adam_beta2 must be in [0, 1)"),
    ("grpo.adam_epsilon=-1", "grpo.adam_epsilon must be > 0"),
    ("grpo.adam_epsilon=0", "grpo.adam_epsilon must be > 0"),
    ("train.device_memory_gb=-3", "train.device_memory_gb must be > 0"),
    ("train.device_memory_gb=0", "train.device_memory_gb must be > 0 (one device's memory in GB) "
                                 "or null"),
    ("train.device_memory_gb=nan", "train.device_memory_gb must be > 0"),
    ("train.device_memory_gb=inf", "train.device_memory_gb must be a finite number"),
    # caught only after the model loaded, under the engine's name
    ("rollout.draft_widths=[4,8]", "rollout.draft_widths must include 1 (the plain decoding "
                                   "step every row can fall back to), got [4, 8]; e.g. [1, 4, 8]"),
    # an empty model name
    ("model.source=", "model.source is empty"),
    # duplicate list entries
    ("grpo.reward_funcs=[math_accuracy, math_accuracy]",
     "grpo.reward_funcs lists 'math_accuracy' twice"),
    ("das.scopes=[problem, problem]", "das.scopes lists 'problem' twice"),
    ("data.templates=[shopping, shopping]", "data.templates lists 'shopping' twice"),
    ("rollout.draft_widths=[1,1,1]", "rollout.draft_widths lists 1 twice"),
    ("rollout.wide_row_buckets=[2,2]", "rollout.wide_row_buckets lists 2 twice"),
])
def test_bad_values_are_refused_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    msg = str(e.value)
    assert msg.startswith(f"--set {override}: "), msg
    assert fragment in msg, msg
    assert "\n" not in msg


def test_documented_values_stay_accepted():
    cfg = load_config(TINY, ["das.global_below=inf", "das.request_below=inf",
                             "grpo.adam_beta1=0", "grpo.adam_beta2=0.95",
                             "train.device_memory_gb=80", "rollout.draft_widths=[1]",
                             "grpo.reward_funcs=[math_accuracy, format]",
                             "grpo.reward_weights=[1, -0.5]", "das.scopes=[problem]"])
    assert cfg.das.global_below == float("inf") and cfg.train.device_memory_gb == 80.0
    assert cfg.das.request_below == float("inf")
    assert load_config(TINY, ["train.device_memory_gb=null"]).train.device_memory_gb is None


# ----- duplicate YAML keys ------------------------------------------------------------------------

def test_a_duplicate_section_is_refused_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("grpo:\n  learning_rate: 1.0e-3\ngrpo:\n  beta: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: duplicate section 'grpo' (first on line 1"), msg
    assert "merge the two sections" in msg and "\n" not in msg


def test_a_duplicate_key_inside_a_section_is_refused(tmp_path):
    # the tester's dup.yaml: the key twice, then the section twice; the first duplicate wins
    path = tmp_path / "dup.yaml"
    path.write_text("grpo:\n  learning_rate: 1.0e-3\n  learning_rate: 5.0\ngrpo:\n  beta: 0.1\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:3: duplicate key 'grpo.learning_rate' "
                                          r"\(first on line 2"):
        load_config(path)
    deep = tmp_path / "deep.yaml"
    deep.write_text("das:\n  policy:\n    weight_short: 1\n    weight_short: 2\n")
    with pytest.raises(ConfigError, match="deep.yaml:4: duplicate key 'das.policy.weight_short'"):
        load_config(deep)


def test_a_duplicate_key_in_a_set_value_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["grpo={beta: 1, beta: 2}"])
    assert "duplicate key 'grpo.beta'" in str(e.value) and "override" in str(e.value)


def test_yaml_without_duplicates_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("grpo: {beta: 0.1}\nrollout:\n  draft_widths: [1, 4]\n")
    cfg = load_config(path)
    assert cfg.grpo.beta == 0.1 and cfg.rollout.draft_widths == (1, 4)
    # the same key in different mappings (list items, aliases of one node) is no duplicate
    from das_jax.config.loader import _load_yaml
    assert _load_yaml("a: &x {k: 1}\nb: *x\nc: [{k: 1}, {k: 2}]\n", "t.yaml") == {
        "a": {"k": 1}, "b": {"k": 1}, "c": [{"k": 1}, {"k": 2}]}
    with pytest.raises(ConfigError, match=r"t.yaml:2: duplicate key 'c\[1\].k'"):
        _load_yaml("c: [{k: 1}, {k: 2,\n k: 3}]\n", "t.yaml")


def test_invalid_yaml_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2:1: invalid YAML: ") and "\n" not in msg, msg
    with pytest.raises(ConfigError) as e:
        load_config(None, ["grpo.beta=[1"])
    assert "override 'grpo.beta=[1': value: invalid YAML" in str(e.value)
    assert "\n" not in str(e.value)


# ----- das-jax plan -------------------------------------------------------------------------------

def _plan(capsys, *argv):
    from das_jax.cli import main
    try:
        rc = main(["plan", *map(str, argv)])
    except SystemExit as e:     # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_plan_error(rc, err, fragment):
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("das-jax plan: error: "), lines[0]
    assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
def test_plan_device_memory_gb_must_be_positive(capsys, value):
    rc, _, err = _plan(capsys, "--config", TINY, "--device-memory-gb", value)
    _assert_plan_error(rc, err, f"argument --device-memory-gb: '{value}' is not a number of GB > 0")


def test_plan_device_memory_gb_from_the_config(capsys):
    rc, _, err = _plan(capsys, "--config", TINY, "--set", "train.device_memory_gb=0")
    _assert_plan_error(rc, err, "--set train.device_memory_gb=0: train.device_memory_gb must be "
                                "> 0")


def test_plan_device_memory_bytes_refuses_non_positive_memory():
    from das_jax.plan import PlanError, device_memory_bytes
    cfg = load_config(TINY)
    for gb in (0.0, -1.0, float("nan")):
        with pytest.raises(PlanError, match="--device-memory-gb must be a number of GB > 0"):
            device_memory_bytes(cfg, gb)
    with pytest.raises(PlanError, match="leaves no usable bytes"):
        device_memory_bytes(cfg, 1e-12)


def test_plan_errors_are_one_line_with_the_error_prefix(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1\n")
    rc, _, err = _plan(capsys, "--config", bad)
    _assert_plan_error(rc, err, f"{bad}:2:1: invalid YAML")
    rc, _, err = _plan(capsys, "--config", TINY, "--set", "grpo.beta=[1")
    _assert_plan_error(rc, err, "override 'grpo.beta=[1': value: invalid YAML")
    rc, _, err = _plan(capsys, "--config", TINY, "--set", "model.source=")
    _assert_plan_error(rc, err, "--set model.source=: model.source is empty")
    dup = tmp_path / "dup.yaml"
    dup.write_text("grpo:\n  beta: 0.1\ngrpo:\n  beta: 0.2\n")
    rc, _, err = _plan(capsys, "--config", dup)
    _assert_plan_error(rc, err, "duplicate section 'grpo'")


def test_plan_lengths_names_the_flag(capsys, tmp_path):
    rc, _, err = _plan(capsys, "--config", TINY, "--lengths", tmp_path / "nonexist.jsonl")
    _assert_plan_error(rc, err, f"--lengths {tmp_path / 'nonexist.jsonl'}: no such file; pass a "
                                "trace written by `das-jax bench rollout`")
    rc, _, err = _plan(capsys, "--config", TINY, "--lengths", tmp_path)
    _assert_plan_error(rc, err, f"--lengths {tmp_path}: is a directory")


def test_plan_lengths_not_a_trace_names_the_flag_and_the_fix(capsys, tmp_path):
    empty = tmp_path / "afile"
    empty.write_text("")
    rc, _, err = _plan(capsys, "--config", TINY, "--lengths", empty)
    _assert_plan_error(rc, err, f"--lengths {empty}: no header line")
    assert "das-jax bench rollout" in err


def test_plan_paper_scale_needs_lengths(capsys):
    rc, _, err = _plan(capsys, "--config", TINY, "--paper-scale")
    _assert_plan_error(rc, err, "--paper-scale stretches the rollouts of the --lengths trace")


@pytest.mark.parametrize("override", ["train.seed=-1", "data.seed=-5", "train.seed=4294967296"])
def test_seeds_are_in_numpys_range(override):
    """A negative train.seed failed with numpy's traceback after the model loaded; data.seed the
    same rule (a seed is an integer in [0, 2**32))."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key} must be an integer in \[0, 2\*\*32\)"):
        load_config(TINY, [override])
    assert load_config(TINY, ["train.seed=4294967295", "data.seed=0"]).train.seed == 2**32 - 1

