"""`load(source)`: one call for every kind of model source.

A source is, in this order:
  1. a named source from `sources.SOURCES` (e.g. "smollm2-135m-instruct"), fetched once into the
     cache and then loaded as a GGUF file;
  2. an existing directory: an HF model folder (config.json + safetensors + tokenizer files);
  3. an existing file: a GGUF file;
  4. an HF hub id "org/name" that is not an existing path: downloaded with huggingface_hub, then
     loaded as in 2.
Anything else raises `ModelLoadError`.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from das_jax.models import sources
from das_jax.models.config import ModelConfig, ModelConfigError
from das_jax.models.errors import ModelLoadError
from das_jax.models.loaders import hub
from das_jax.models.loaders import gguf_file
from das_jax.models.loaders.gguf_file import load_gguf
from das_jax.models.loaders.hf_dir import load_hf_dir, read_hf_config
from das_jax.models.tokenizer import Tokenizer
from das_jax.models.transformer import Params

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype) -> jnp.dtype:
    """jnp.float32 / jnp.bfloat16 (or their names) as a numpy dtype; anything else is an error.

    Raises:
      ModelLoadError: an unsupported dtype.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32 or bfloat16")
        dtype = _DTYPES[dtype]
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ModelLoadError(f"unsupported dtype {d}; use float32 or bfloat16")
    return d


def resolve_source(source: str) -> tuple[str, str]:
    """`(kind, local_path)` for a source string; kind is "hf_dir" or "gguf". May download.

    Raises:
      ModelLoadError: a missing path, an unknown name, or a failed download.
    """

    source = os.fspath(source)
    if source in sources.SOURCES:
        return "gguf", sources.fetch(source)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return "hf_dir", path
    if os.path.isfile(path):
        return "gguf", path
    if hub.looks_like_hub_id(source):
        return "hf_dir", hub.snapshot(source)
    raise ModelLoadError(
        f"{source}: no such file or directory, and not a named source "
        f"({', '.join(sorted(sources.SOURCES))}) or an HF hub id 'org/name'; pass a local HF model "
        "directory, a .gguf file, a named source or a hub id")


def load(source: str, dtype=jnp.float32) -> tuple[ModelConfig, Params, Tokenizer]:
    """Loads a model and its tokenizer.

    Args:
      source: a named source, a local HF directory, a GGUF file, or an HF hub id (module docstring).
      dtype: parameter dtype, jnp.float32 (default) or jnp.bfloat16 (or "float32"/"bfloat16").
        Quantized GGUF tensors are dequantized to float32 first, then cast.

    Returns:
      (config, params, tokenizer): params in the layout of `das_jax.models.transformer`, every leaf
      a `jax.Array` of `dtype`.

    Raises:
      ModelLoadError: missing path, unknown name, failed download, unreadable / truncated file,
        unsupported GGUF architecture, no weights or no tokenizer.
      WeightsError (a ModelLoadError): a tensor missing or of the wrong shape.
      ModelConfigError: unsupported architecture or inconsistent sizes in config.json.
    """
    d = resolve_dtype(dtype)
    kind, path = resolve_source(source)
    if kind == "hf_dir":
        return load_hf_dir(path, d)
    return load_gguf(path, d)


def load_spec(source: str) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer of a model source, without reading its weights (what an export
    of trained params needs from the source). May download, as `load` does.

    Raises:
      ModelLoadError / ModelConfigError: as `load`, for the source, its config or its tokenizer.
    """
    kind, path = resolve_source(source)
    if kind == "hf_dir":
        return read_hf_config(path), Tokenizer.from_hf_dir(path)
    reader = gguf_file.open_gguf(path)
    meta = gguf_file.read_metadata(reader)
    try:
        config = gguf_file.config_from_gguf_metadata(meta, {t.name for t in reader.tensors}, path)
    except ModelConfigError as e:
        raise ModelConfigError(f"{path}: {e}") from None
    return config, Tokenizer.from_gguf(path, gguf_file.eos_ids_from_metadata(meta),
                                       reader=reader)


def params_size(params: Params) -> tuple[int, int]:
    """(number of parameters, bytes) over all leaves of `params`."""
    leaves = jax.tree_util.tree_leaves(params)
    return sum(int(x.size) for x in leaves), sum(int(x.size) * x.dtype.itemsize for x in leaves)
