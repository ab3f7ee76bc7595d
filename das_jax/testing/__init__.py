"""das_jax.testing: what tests (ours and a user's) share, in the spirit of `gemma.gm.testing`.

Public surface:
  tiny_model_config(**overrides) -> ModelConfig   the tiny random-model config of the tests
  tiny_params(config=None, seed=0, scale=0.5)      its random params (`init_params`)
  random_kv_cache(config, batch, cache_len, seed)  a float32 KV cache of random history
  paged_kv_cache_like(dense, page, seed)  the same positions on randomly permuted pages
  paged_case(seed, B, KVH, M, K, page, kv_len)     paged attention's random inputs
  kv_by_position(cache)                           its (k, v) as numpy `[L, B, KVH, S, K]`
  random_requests(problems, samples, seed)         random prompts, each sampled `samples` times
  tiny_engine(params, config=None, eos_token_id=1, **engine_config)
                                                   an `Engine` of the tiny model (4 slots)
  OracleDrafter, AdversaryDrafter                   drafters that test verification (drafters.py)
  CharTokenizer                                     a 62-character tokenizer (tokenizers.py)

Names are imported lazily (PEP 562): the drafters need numpy only, the model helpers import jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "tiny_model_config": "models", "tiny_params": "models", "random_kv_cache": "models",
    "paged_kv_cache_like": "models", "paged_case": "models",
    "kv_by_position": "models",
    "random_requests": "models", "tiny_engine": "models",
    "OracleDrafter": "drafters", "AdversaryDrafter": "drafters",
    "CharTokenizer": "tokenizers",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
