"""The decoder-only transformer (Llama / Qwen2 / Qwen3) as pure functions over a params pytree.

Params layout (layers stacked on a leading L axis so the layer loop is one `lax.scan`):

    embed            [V, D]
    final_norm       [D]
    lm_head          [V, D]            (absent when tie_word_embeddings; HF's layout)
    layers:
      attn_norm      [L, D]
      wq             [L, D, H, K]      bq [L, H, K]     (biases only when attention_bias)
      wk             [L, D, KVH, K]    bk [L, KVH, K]
      wv             [L, D, KVH, K]    bv [L, KVH, K]
      q_norm, k_norm [L, K]            (only when qk_norm)
      wo             [L, H, K, D]
      mlp_norm       [L, D]
      w_gate, w_up   [L, D, F]
      w_down         [L, F, D]

Tensor names carry their shapes: B batch, T new tokens, S cache length, D model width, H query
heads, KVH key/value heads, G = H / KVH, K head width, F MLP width, V vocabulary, L layers.
Reference: Llama (Touvron et al. 2023), RoPE (Su et al. 2021, HF "rotate_half" layout), GQA
(Ainslie et al. 2023), Qwen2/Qwen3 technical reports for q/k/v bias and q/k RMSNorm.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models import contraction as cx
from das_jax.models.config import ModelConfig

Params = dict[str, Any]
_MASK_VALUE = -1e30


@flax.struct.dataclass
class KVCache:
    """Key/value cache, post-RoPE keys.

    k, v: `[L, B, S, KVH, K]` in the parameter dtype. Row b holds `cache_len[b]` valid positions
    (tracked by the caller); positions at or past `cache_len` are garbage and are never attended,
    so rejected draft tokens are rolled back simply by not advancing `cache_len`.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random normal(0, scale) params (norm weights 1) with the layout in the module docstring."""
    c = config
    L, D, H, KVH, K, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                             c.intermediate_size, c.vocab_size)
    shapes = {
        "wq": (L, D, H, K), "wk": (L, D, KVH, K), "wv": (L, D, KVH, K), "wo": (L, H, K, D),
        "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
    }
    if c.attention_bias:
        shapes.update(bq=(L, H, K), bk=(L, KVH, K), bv=(L, KVH, K))
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {name: (scale * jax.random.normal(k, s)).astype(dtype)
              for k, (name, s) in zip(keys[2:], sorted(shapes.items()))}
    layers["attn_norm"] = jnp.ones((L, D), dtype)
    layers["mlp_norm"] = jnp.ones((L, D), dtype)
    if c.qk_norm:
        layers["q_norm"] = jnp.ones((L, K), dtype)
        layers["k_norm"] = jnp.ones((L, K), dtype)
    params = {
        "embed": (scale * jax.random.normal(keys[0], (V, D))).astype(dtype),
        "final_norm": jnp.ones((D,), dtype),
        "layers": layers,
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = (scale * jax.random.normal(keys[1], (V, D))).astype(dtype)
    return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, policy=cx.FAST) -> jax.Array:
    """RMSNorm computed in float32, cast back to x's dtype before the weight (HF Llama order)."""
    x32 = x.astype(jnp.float32)
    ms = cx.row_sum(policy, x32 * x32, keepdims=True) / x32.shape[-1]
    x32 = x32 * jax.lax.rsqrt(ms + eps)
    return weight * x32.astype(x.dtype)


def rope(x_BxTxNxK: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, HF "rotate_half" layout (first half / second half of K are paired)."""
    freqs_BxTxK2 = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(freqs_BxTxK2)[:, :, None, :]
    sin = jnp.sin(freqs_BxTxK2)[:, :, None, :]
    x = x_BxTxNxK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxK.dtype)


def _attention(config: ModelConfig, q_BxTxHxK, k_BxSxKVHxK, v_BxSxKVHxK, mask_BxTxS):
    B, T, H, K = q_BxTxHxK.shape
    G = config.num_groups
    q_BxTxKVHxGxK = q_BxTxHxK.reshape(B, T, config.num_kv_heads, G, K)
    scores = jnp.einsum("btngk,bsnk->bngts", q_BxTxKVHxGxK, k_BxSxKVHxK,
                        preferred_element_type=jnp.float32) * (K ** -0.5)
    scores = jnp.where(mask_BxTxS[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKVHxK.dtype)
    out = jnp.einsum("bngts,bsnk->btngk", probs, v_BxSxKVHxK)
    return out.reshape(B, T, H, K)


def _layer(config: ModelConfig, inv_freq, x_BxTxD, lp, positions_BxT, cache_k, cache_v, mask_BxTxS):
    """One pre-norm block. Returns the new residual and this block's new (k, v) `[B, T, KVH, K]`."""
    cp = config.contraction
    h = rms_norm(x_BxTxD, lp["attn_norm"], config.rms_norm_eps, cp)
    q = cx.einsum(cp, "btd,dhk->bthk", h, lp["wq"], rows="bt")
    k = cx.einsum(cp, "btd,dhk->bthk", h, lp["wk"], rows="bt")
    v = cx.einsum(cp, "btd,dhk->bthk", h, lp["wv"], rows="bt")
    if config.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"], config.rms_norm_eps, cp)
        k = rms_norm(k, lp["k_norm"], config.rms_norm_eps, cp)
    q, k = rope(q, positions_BxT, inv_freq), rope(k, positions_BxT, inv_freq)
    if cp.exact:  # shape-invariant attention (keys at absolute positions, fixed blocks)
        attn = cx.cached_attention(cp, q, k, v, cache_k, cache_v, mask_BxTxS)
    else:
        if cache_k is not None:
            keys, values = jnp.concatenate([cache_k, k], axis=1), jnp.concatenate([cache_v, v], axis=1)
        else:
            keys, values = k, v
        attn = _attention(config, q, keys, values, mask_BxTxS)
    x_BxTxD = x_BxTxD + cx.einsum(cp, "bthk,hkd->btd", attn, lp["wo"], rows="bt")
    h = rms_norm(x_BxTxD, lp["mlp_norm"], config.rms_norm_eps, cp)
    gate = jax.nn.silu(cx.einsum(cp, "btd,df->btf", h, lp["w_gate"], rows="bt"))
    up = cx.einsum(cp, "btd,df->btf", h, lp["w_up"], rows="bt")
    x_BxTxD = x_BxTxD + cx.einsum(cp, "btf,fd->btd", gate * up, lp["w_down"], rows="bt")
    return x_BxTxD, k, v


def forward_hidden(
    config: ModelConfig,
    params: Params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    kv_cache: KVCache | None = None,
    cache_len_B: jax.Array | None = None,
    *,
    valid_BxT: jax.Array | None = None,
    kv_len: int | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Runs the decoder stack; returns final-normed hidden states and the updated cache.

    Args:
      config: static model config.
      params: params pytree (module docstring).
      tokens_BxT: int32 token ids.
      positions_BxT: int32 RoPE positions (absolute token index of each token).
      kv_cache: optional `KVCache` with `[L, B, S, KVH, K]` arrays. When given, token t of row b
        is written at cache index `cache_len_B[b] + t` and attends to cache indices
        `< cache_len_B[b]` plus new tokens `<= t`. Writes past S are dropped.
      cache_len_B: int32 `[B]`, valid cache entries per row (required with `kv_cache`).
      valid_BxT: optional bool mask of real (non-padding) new tokens; padding keys are never
        attended. Defaults to all valid.
      kv_len: static number of leading cache positions to attend (<= S, defaults to S). Callers
        that know every row's `cache_len` is at most kv_len use it to read less of the cache.

    Returns:
      (hidden_BxTxD in the param dtype, updated KVCache or None).
    """
    B, T = tokens_BxT.shape
    if valid_BxT is None:
        valid_BxT = jnp.ones((B, T), bool)
    causal_TxT = jnp.tril(jnp.ones((T, T), bool))
    new_mask_BxTxT = causal_TxT[None] & valid_BxT[:, None, :]
    x_BxTxD = params["embed"][tokens_BxT]
    inv_freq = config.rope_inv_freq()
    layers = params["layers"]

    if kv_cache is None:
        def body(x, lp):
            x, k, v = _layer(config, inv_freq, x, lp, positions_BxT, None, None, new_mask_BxTxT)
            return x, None
        x_BxTxD, _ = jax.lax.scan(body, x_BxTxD, layers)
        new_cache = None
    else:
        if cache_len_B is None:
            raise ValueError("forward with a kv_cache needs cache_len_B")
        S = kv_cache.max_len if kv_len is None else min(kv_len, kv_cache.max_len)
        old_mask_BxS = jnp.arange(S)[None, :] < cache_len_B[:, None]
        mask_BxTxS = jnp.concatenate(
            [jnp.broadcast_to(old_mask_BxS[:, None, :], (B, T, S)), new_mask_BxTxT], axis=-1)
        def body(x, inputs):
            lp, k_l, v_l = inputs
            # Slice the attended prefix per layer (slicing the stacked cache up front would copy
            # every layer's cache each step).
            x, k, v = _layer(config, inv_freq, x, lp, positions_BxT, k_l[:, :S], v_l[:, :S],
                             mask_BxTxS)
            return x, (k, v)
        x_BxTxD, (k_new, v_new) = jax.lax.scan(body, x_BxTxD, (layers, kv_cache.k, kv_cache.v))
        # One scatter for all layers: rows b, cache positions cache_len[b] + t.
        rows_Bx1 = jnp.arange(B)[:, None]
        cols_BxT = cache_len_B[:, None] + jnp.arange(T)[None, :]
        new_cache = KVCache(
            k=kv_cache.k.at[:, rows_Bx1, cols_BxT].set(k_new.astype(kv_cache.k.dtype), mode="drop"),
            v=kv_cache.v.at[:, rows_Bx1, cols_BxT].set(v_new.astype(kv_cache.v.dtype), mode="drop"),
        )
    h = rms_norm(x_BxTxD, params["final_norm"], config.rms_norm_eps,
                 config.contraction)
    return h, new_cache


def lm_head(config: ModelConfig, params: Params, hidden_BxTxD: jax.Array) -> jax.Array:
    """Float32 logits `[B, T, V]` from final hidden states.

    Computed as `(W_VxD @ h^T)^T` with the vocabulary as the long matmul dimension: XLA's CPU
    GEMM is several times faster in that orientation than with B*T (a handful of rows) as M.
    """
    B, T, D = hidden_BxTxD.shape
    w_VxD = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    logits_VxN = cx.einsum(config.contraction, "vd,nd->vn", w_VxD, hidden_BxTxD.reshape(B * T, D),
                           rows="n", preferred_element_type=jnp.float32)
    return logits_VxN.T.reshape(B, T, -1)


def forward(
    config: ModelConfig,
    params: Params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    kv_cache: KVCache | None = None,
    cache_len_B: jax.Array | None = None,
    *,
    valid_BxT: jax.Array | None = None,
    kv_len: int | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """`forward_hidden` followed by `lm_head`: returns (float32 logits_BxTxV, updated cache)."""
    h, cache = forward_hidden(config, params, tokens_BxT, positions_BxT, kv_cache, cache_len_B,
                              valid_BxT=valid_BxT, kv_len=kv_len)
    return lm_head(config, params, h), cache


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array, temperature: float = 1.0):
    """log softmax(logits / temperature) gathered at targets: float32 `[B, T]`."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
