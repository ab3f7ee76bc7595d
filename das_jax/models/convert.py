"""Conversion from HF-named weight tensors to the das-jax params layout (see `transformer.py`).

HF Linear weights are stored `[out, in]`; das-jax stores einsum-ready `[in, ...out]` tensors with
layers stacked on a leading axis.
"""
from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from das_jax.models.config import ModelConfig
from das_jax.models.errors import ModelLoadError
from das_jax.models.transformer import Params


class WeightsError(ModelLoadError):
    """Weights missing or of the wrong shape (names the tensor, the file and the fix)."""


def params_from_hf_tensors(
    config: ModelConfig,
    get: Callable[[str], np.ndarray] | Mapping[str, np.ndarray],
    dtype=jnp.float32,
    source: str = "weights",
) -> Params:
    """Builds das-jax params from tensors named as in HF `LlamaForCausalLM` / Qwen2 / Qwen3.

    Args:
      config: the model config.
      get: mapping or callable from an HF tensor name (e.g. "model.layers.0.self_attn.q_proj.weight")
        to a numpy array; it may raise KeyError for a missing name.
      dtype: parameter dtype (float32 or bfloat16).
      source: file or folder named in error messages.

    Raises:
      WeightsError: a tensor is missing or has an unexpected shape.
    """
    lookup = get.__getitem__ if isinstance(get, Mapping) else get
    c = config
    D, H, KVH, K, F, V = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                          c.intermediate_size, c.vocab_size)

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            arr = np.asarray(lookup(name))
        except KeyError:
            raise WeightsError(f"{source}: tensor {name!r} is missing; the file does not hold a "
                               f"complete {c.architecture} checkpoint") from None
        if tuple(arr.shape) != shape:
            raise WeightsError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                               f"{shape} from the config; config and weights do not match")
        return arr.astype(np.float32)

    per_layer: dict[str, list[np.ndarray]] = {}

    def add(key: str, value: np.ndarray):
        per_layer.setdefault(key, []).append(value)

    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        add("attn_norm", fetch(p + "input_layernorm.weight", (D,)))
        add("mlp_norm", fetch(p + "post_attention_layernorm.weight", (D,)))
        add("wq", fetch(p + "self_attn.q_proj.weight", (H * K, D)).T.reshape(D, H, K))
        add("wk", fetch(p + "self_attn.k_proj.weight", (KVH * K, D)).T.reshape(D, KVH, K))
        add("wv", fetch(p + "self_attn.v_proj.weight", (KVH * K, D)).T.reshape(D, KVH, K))
        add("wo", fetch(p + "self_attn.o_proj.weight", (D, H * K)).T.reshape(H, K, D))
        if c.attention_bias:
            add("bq", fetch(p + "self_attn.q_proj.bias", (H * K,)).reshape(H, K))
            add("bk", fetch(p + "self_attn.k_proj.bias", (KVH * K,)).reshape(KVH, K))
            add("bv", fetch(p + "self_attn.v_proj.bias", (KVH * K,)).reshape(KVH, K))
        if c.qk_norm:
            add("q_norm", fetch(p + "self_attn.q_norm.weight", (K,)))
            add("k_norm", fetch(p + "self_attn.k_norm.weight", (K,)))
        add("w_gate", fetch(p + "mlp.gate_proj.weight", (F, D)).T)
        add("w_up", fetch(p + "mlp.up_proj.weight", (F, D)).T)
        add("w_down", fetch(p + "mlp.down_proj.weight", (D, F)).T)

    params: Params = {
        "embed": jnp.asarray(fetch("model.embed_tokens.weight", (V, D)), dtype),
        "final_norm": jnp.asarray(fetch("model.norm.weight", (D,)), dtype),
        "layers": {k: jnp.asarray(np.stack(v), dtype) for k, v in per_layer.items()},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(fetch("lm_head.weight", (V, D)), dtype)
    return params
