"""Config dataclasses, YAML loading, overrides and validation errors."""
import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from das_jax.config import (Config, ConfigError, GRPOSection, apply_platform, config_from_dict,
                            config_to_dict, load_config, save_config)


def _write(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_defaults_resolve_max_completion_length():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.grpo.max_completion_length == cfg.rollout.max_new_tokens == 256
    assert cfg.drafter == "das" and cfg.rollout.draft_widths == (1, 4, 8)
    assert cfg.grpo.batch_size == 32


def test_yaml_round_trip(tmp_path):
    path = _write(tmp_path, {
        "output_dir": "runs/x", "drafter": "suffix", "platform": "cpu",
        "model": {"dtype": "bfloat16"},
        "rollout": {"max_new_tokens": 64, "draft_widths": [1, 16], "stop_token_ids": [2, 7],
                    "temperature": 0.6},
        "grpo": {"loss_type": "dr_grpo", "learning_rate": 1e-6,
                 "reward_funcs": ["math_accuracy", "format"], "reward_weights": [1, 0.5]},
        "train": {"keep_checkpoints": 5},
    })
    cfg = load_config(path)
    assert cfg.rollout.draft_widths == (1, 16) and cfg.rollout.stop_token_ids == (2, 7)
    assert cfg.grpo.reward_weights == (1.0, 0.5) and isinstance(cfg.grpo.reward_weights[0], float)
    assert cfg.grpo.learning_rate == 1e-6  # "1e-6" is a string in YAML 1.1: accepted for floats
    assert cfg.grpo.max_completion_length == 64
    out = tmp_path / "out" / "resolved.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert config_to_dict(cfg)["rollout"]["draft_widths"] == [1, 16]


def test_overrides_nested_lists_and_top_level(tmp_path):
    path = _write(tmp_path, {"grpo": {"beta": 0.0}})
    cfg = load_config(path, ["grpo.beta=0.04", "drafter=none", "output_dir=runs/x",
                             "rollout.draft_widths=[1,8]", "data.kind=gsm8k",
                             "data.path=/tmp/d.jsonl",
                             "train.seed=3", "grpo.reward_funcs=[math_accuracy, format]"])
    assert cfg.grpo.beta == 0.04 and cfg.drafter == "none" and cfg.output_dir == "runs/x"
    assert cfg.rollout.draft_widths == (1, 8) and cfg.data.path == "/tmp/d.jsonl"
    assert cfg.train.seed == 3 and cfg.grpo.reward_funcs == ("math_accuracy", "format")
    # the later override wins
    assert load_config(None, ["grpo.beta=0.1", "grpo.beta=0.2"]).grpo.beta == 0.2


def test_unknown_key_lists_valid_keys_and_suggests(tmp_path):
    path = _write(tmp_path, {"grpo": {"num_generation": 4}})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "grpo.num_generation" in msg
    assert "did you mean 'grpo.num_generations'" in msg and "epsilon_high" in msg
    with pytest.raises(ConfigError, match="valid keys in the top level: output_dir, drafter"):
        load_config(None, ["lr=1"])
    with pytest.raises(ConfigError, match="did you mean 'rollout.temperature'"):
        load_config(None, ["rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["grpo.beta"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["drafter.x=1"])


@pytest.mark.parametrize("override, fragment", [
    ("grpo.num_generations=2.5", "grpo.num_generations: expected int"),
    ("grpo.num_generations=true", "grpo.num_generations: expected int"),
    ("grpo.beta=abc", "grpo.beta: expected float"),
    ("data.chat=yes please", "data.chat: expected bool"),
    ("rollout.draft_widths=4", "rollout.draft_widths: expected list of int"),
    ("rollout.draft_widths=[1, x]", "rollout.draft_widths[1]: expected int"),
    ("model.source=null", "model.source: expected str"),
    ("grpo=3", "grpo: expected a mapping"),
])
def test_type_errors_name_key_and_type(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


@pytest.mark.parametrize("override, fragment", [
    ("grpo.loss_type=bnpo", "choices: grpo, dr_grpo, dapo"),
    ("grpo.scale_rewards=std", "choices: group, batch, none"),
    ("drafter=suffix_global", "did you mean 'suffix-global'"),
    ("model.dtype=fp32", "choices: float32, bfloat16"),
    ("model.dtype=float16", "choices: float32, bfloat16"),   # the loaders support no float16
    ("data.kind=gsm9k", "did you mean 'gsm8k'"),
    ("drafter=eagle", "choices: none, ngram, suffix, suffix-global, das, das-unlimited"),
    ("platform=cuda", "choices: cpu, gpu, tpu"),
])
def test_enum_errors(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, fragment", [
    (["grpo.epsilon_high=0.1"], "epsilon_high=0.1 must be >= grpo.epsilon"),
    (["rollout.temperature=-1"], "temperature must be > 0"),
    (["rollout.temperature=0"], "temperature must be > 0 for training"),
    (["das.policy.long_quantile=0.2"], "das.policy: DAS quantiles"),
    (["das.cost_model.c_tok=-1"], "das.cost_model: c_tok must be >= 0"),
    (["rollout.top_p=0"], "top_p must be in"),
    (["rollout.top_p=1.5"], "top_p must be in"),
    (["grpo.num_generations=1"], "num_generations must be >= 2"),
    (["grpo.micro_batch_size=0"], "micro_batch_size must be >= 1"),
    (["grpo.micro_batch_size=64"], "exceeds the batch"),
    (["grpo.max_completion_length=10"], "differs from rollout.max_new_tokens"),
    (["grpo.reward_weights=[1, 2]"], "reward_weights has 2 entries"),
    (["rollout.max_cache_len=100"], "max_cache_len=100 must exceed"),
    (["rollout.max_prefill_tokens=0"], "rollout.max_prefill_tokens must be >= 1"),
])
def test_cross_field_validation(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)


def test_micro_batch_not_dividing_batch_is_allowed():
    cfg = load_config(None, ["grpo.micro_batch_size=5"])  # 32 sequences: padded last micro-batch
    assert cfg.grpo.micro_batch_size == 5


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_write(tmp_path, "grpo: [1, 2"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))
    assert load_config(_write(tmp_path, "")) == load_config(None)  # empty file: defaults


def test_frozen_and_hashable():
    cfg = load_config(None)
    with pytest.raises(Exception):
        cfg.grpo.beta = 1.0  # type: ignore[misc]
    hash(cfg.grpo)
    assert GRPOSection().epsilon_high == 0.28


def test_apply_platform(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    apply_platform(load_config(None))  # platform None: untouched
    assert "JAX_PLATFORMS" not in os.environ
    # JAX is already initialised on CPU in this test session: asking for cpu is fine...
    import jax
    jax.devices()
    apply_platform(load_config(None, ["platform=cpu"]))
    # ...asking for tpu is a clear error rather than a silent no-op.
    with pytest.raises(ConfigError, match="already initialised"):
        apply_platform(load_config(None, ["platform=tpu"]))


def test_every_das_setting_is_reachable_from_yaml(tmp_path):
    path = _write(tmp_path, """
das:
  window: 8
  policy: {budget_medium: 5, budget_long: null, short_threshold: 10, long_threshold: 100,
           explore_every: 0}
  cost_model: {c_base: 0.02, c_tok: 1.0e-4, calibrate: false, calibrate_kv_lens: [64, 256]}
""")
    cfg = load_config(path, ["das.policy.acceptance_ema=0.2"])
    p, c = cfg.das.policy, cfg.das.cost_model
    assert cfg.das.window == 8 and p.budget_medium == 5 and p.short_threshold == 10
    assert p.explore_every == 0 and p.acceptance_ema == 0.2 and p.budget_long is None
    assert c.c_base == 0.02 and not c.calibrate and c.calibrate_kv_lens == (64, 256)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="unknown key 'das.policy.budget'"):
        load_config(None, ["das.policy.budget=3"])
    # Every field of the policy and cost-model settings is a key of the das: section.
    from das_jax.speculation import CostModelConfig, DASConfig
    plain = config_to_dict(load_config(None))["das"]
    assert set(plain["policy"]) == {f.name for f in dataclasses.fields(DASConfig)}
    assert set(plain["cost_model"]) == {f.name for f in dataclasses.fields(CostModelConfig)}


def test_registered_speculation_name_becomes_a_valid_drafter():
    from das_jax.rollout import register_speculation, unregister_speculation

    with pytest.raises(ConfigError, match="invalid value 'toy-config'"):
        load_config(None, ["drafter=toy-config"])
    register_speculation("toy-config")(lambda das, cost_model: (None, None))
    try:
        assert load_config(None, ["drafter=toy-config"]).drafter == "toy-config"
    finally:
        unregister_speculation("toy-config")


def test_compilation_cache_default_path_null_and_environment(tmp_path, monkeypatch):
    from das_jax.config import compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("DAS_JAX_CACHE", str(tmp_path / "c"))
    assert compilation_cache_dir(config_from_dict({})) == str(tmp_path / "c" / "jax-compilation-cache")
    assert compilation_cache_dir(config_from_dict({"compilation_cache": None})) is None
    assert compilation_cache_dir(config_from_dict({"compilation_cache": str(tmp_path / "x")})) \
        == str(tmp_path / "x")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compilation_cache_dir(config_from_dict({"compilation_cache": None})) == str(tmp_path / "env")


def test_compilation_cache_stores_programs_and_a_second_process_reads_them(tmp_path):
    """A process with the default config writes its compiled program into the das-jax cache; a
    second process finds it there (a persistent-cache hit), and `compilation_cache: null` writes
    nothing."""
    import subprocess
    import sys
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from das_jax.config import config_from_dict, apply_compilation_cache\n"
        "cfg = config_from_dict({} if sys.argv[1] == 'on' else {'compilation_cache': None})\n"
        "print(apply_compilation_cache(cfg))\n"
        "from jax._src import monitoring\n"
        "hits = []\n"
        "monitoring.register_event_listener(lambda e, **k: hits.append(e) if 'cache_hits' in e else None)\n"
        "jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(7)).block_until_ready()\n"
        "print('HITS', len(hits))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(DAS_JAX_CACHE=str(tmp_path / "c"), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = lambda mode: subprocess.run([sys.executable, "-c", code, mode], env=env,  # noqa: E731
                                      capture_output=True, text=True, timeout=300)
    off = run("off")
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / "c" / "jax-compilation-cache").exists()
    first, second = run("on"), run("on")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-2000:]
    cache = tmp_path / "c" / "jax-compilation-cache"
    assert any(cache.iterdir())
    assert "HITS 0" in first.stdout and "HITS 0" not in second.stdout
