"""Decoder-only transformer family (Llama, Qwen2, Qwen3, SmolLM2) and its loaders.

Public surface:
  load(source, dtype=jnp.float32) -> (ModelConfig, params, Tokenizer)
  Tokenizer; ModelConfig; forward / forward_hidden / lm_head / token_logprobs; KVCache; init_params
  errors: ModelLoadError (base of loader errors), WeightsError (a ModelLoadError), ModelConfigError
  LOAD_ERRORS: the tuple of all three, for `except LOAD_ERRORS`.

Names are imported lazily (PEP 562), so importing a submodule such as `das_jax.models.sources` or
`das_jax.models.config` does not import jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "config", "ModelConfigError": "config", "RopeScaling": "config",
    "WeightsError": "convert", "params_from_hf_tensors": "convert",
    "ModelLoadError": "errors",
    "load": "loading", "params_size": "loading",
    "SOURCES": "sources", "NamedSource": "sources",
    "Tokenizer": "tokenizer",
    "KVCache": "transformer", "forward": "transformer", "forward_hidden": "transformer",
    "init_params": "transformer", "lm_head": "transformer", "token_logprobs": "transformer",
}

_getattr, __dir__, _names = lazy_exports(__name__, _EXPORTS)
__all__ = _names + ["LOAD_ERRORS"]


def __getattr__(name: str):
    if name == "LOAD_ERRORS":
        return (_getattr("ModelLoadError"), _getattr("WeightsError"), _getattr("ModelConfigError"))
    return _getattr(name)
