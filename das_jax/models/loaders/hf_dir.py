"""Loader for a local HF model directory: `config.json` + safetensors (+ tokenizer files).

Weights are read with the `safetensors` library (numpy framework), one tensor at a time, from a
single `model.safetensors` or from the shards listed in `model.safetensors.index.json`. bfloat16
tensors (which numpy cannot represent) are read from the raw bytes and widened to float32.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Callable

import numpy as np

from das_jax.models.config import ModelConfig
from das_jax.models.errors import ModelLoadError
from das_jax.models.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_REDOWNLOAD = "re-download or re-convert the checkpoint"


def read_hf_config(path: str) -> ModelConfig:
    """`ModelConfig` from `<path>/config.json`.

    Raises:
      ModelLoadError: no or unreadable config.json.
      ModelConfigError: unsupported architecture / inconsistent sizes (names the file).
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json; an HF model directory needs config.json, "
                             "*.safetensors and tokenizer files")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e}); re-download it") from None
    return ModelConfig.from_hf_dict(hf, source=cfg_path)


def safetensors_files(path: str) -> dict[str, str]:
    """Map tensor name -> shard file for the safetensors checkpoint in directory `path`.

    Raises:
      ModelLoadError: no safetensors weights (e.g. only `pytorch_model.bin`), or a broken index.
    """
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e!r}); {_REDOWNLOAD}") from None
        out = {}
        for name, shard in weight_map.items():
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise ModelLoadError(f"{index}: lists shard {shard!r}, which is missing; "
                                     f"{_REDOWNLOAD}")
            out[name] = shard_path
        return out
    files = [os.path.join(path, _SINGLE)] if os.path.isfile(os.path.join(path, _SINGLE)) else sorted(
        glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin"))
                        + glob.glob(os.path.join(path, "*.pt")) + glob.glob(os.path.join(path, "*.gguf")))
        hint = (f" (found {', '.join(others)}: convert to safetensors, or pass a .gguf file directly)"
                if others else "")
        raise ModelLoadError(f"{path}: no weights: no model.safetensors, {_INDEX} or *.safetensors "
                             f"file{hint}")
    out = {}
    for file in files:
        for name in _open(file).keys():
            out[name] = file
    return out


def _open(file: str):
    # deferred import: safetensors (not loaded by importing this module)
    from safetensors import safe_open
    try:
        return safe_open(file, framework="np")
    except Exception as e:  # SafetensorError, OSError
        raise ModelLoadError(f"{file}: cannot read safetensors file ({e}); the file is truncated or "
                             f"corrupt: {_REDOWNLOAD}") from None


def _read_bf16(file: str, name: str) -> np.ndarray:
    """A bfloat16 tensor from the raw safetensors layout, widened to float32."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        info = header[name]
        start, end = info["data_offsets"]
        f.seek(8 + header_len + start)
        raw = f.read(end - start)
    if len(raw) != end - start:
        raise ModelLoadError(f"{file}: tensor {name!r} is truncated; {_REDOWNLOAD}")
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(info["shape"])


def tensor_getter(files: dict[str, str]) -> Callable[[str], np.ndarray]:
    """A `get(name) -> np.ndarray` over the checkpoint (float arrays; bf16 widened to float32).

    Raises (from `get`):
      KeyError: unknown tensor name.
      ModelLoadError: the tensor's bytes cannot be read (truncated file).
    """
    handles: dict[str, object] = {}

    def get(name: str) -> np.ndarray:
        file = files[name]
        if file not in handles:
            handles[file] = _open(file)
        handle = handles[file]
        try:
            if handle.get_slice(name).get_dtype() == "BF16":
                return _read_bf16(file, name)
            return handle.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({e}); {_REDOWNLOAD}") from None

    return get


def load_hf_dir(path: str, dtype):
    """Loads `(ModelConfig, params, Tokenizer)` from a local HF directory.

    Args:
      path: directory with config.json, safetensors weights and tokenizer files.
      dtype: parameter dtype (jnp.float32 or jnp.bfloat16).

    Raises:
      ModelLoadError / WeightsError / ModelConfigError, each naming the offending file.
    """
    # deferred import: jax (not loaded by importing this module)
    from das_jax.models.convert import params_from_hf_tensors

    config = read_hf_config(path)
    files = safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    source = os.path.join(path, _INDEX) if os.path.isfile(os.path.join(path, _INDEX)) else \
        (sorted(set(files.values()))[0] if len(set(files.values())) == 1 else path)
    params = params_from_hf_tensors(config, tensor_getter(files), dtype=dtype, source=source)
    return config, params, tokenizer
