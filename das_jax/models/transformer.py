"""The decoder-only transformer (Llama / Qwen2 / Qwen3) as pure functions over a params pytree.

Params layout (layers stacked on a leading L axis; the layer loop is `layer_loop.run_layers`:
one `lax.scan`, or unrolled with `ModelConfig.layer_loop`):

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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models import contraction as cx
from das_jax.models.config import ModelConfig
from das_jax.models.decode_attention import attend_cache
from das_jax.models.kv_cache import DenseKVCache, KVCache  # noqa: F401  (re-exported)
from das_jax.models.layer_loop import run_layers, unrolled

Params = dict[str, Any]
_MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    """How the teacher-forced (training) forward spends activation memory. Hashable (static).

    remat: "none" keeps every layer's activations for the backward pass; "full" keeps only each
      layer's input and recomputes the layer in the backward pass (`jax.checkpoint` with
      `nothing_saveable`); "dots" also keeps the matmul outputs without batch dimensions
      (`dots_with_no_batch_dims_saveable`: less recompute, more memory).
    attention: "xla" (`jax.nn.dot_product_attention(implementation="xla")` over query chunks of
      `attention_chunk` rows, each chunk rematerialised, so the f32 scores are
      `[B, H, chunk, T]`, never `[B, H, T, T]`), "cudnn" (cuDNN flash attention: causal with
      per-row lengths; needs bf16/f16 and right-padded rows, i.e. `valid` a prefix of each row)
      or "auto" (cudnn on a GPU backend with a 16-bit dtype, else xla).
    attention_chunk: query rows per chunk of the xla attention.
    logits_chunk: tokens (rows x positions) per chunk of the lm_head + log-softmax + loss in the
      train step: the f32 logits are `[mb, logits_chunk // mb, V]`, never `[mb, T, V]`.
    """

    remat: str = "none"
    attention: str = "auto"
    attention_chunk: int = 1024
    logits_chunk: int = 1024

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.attention not in ("auto", "xla", "cudnn"):
            raise ValueError(f"attention must be auto, xla or cudnn, got {self.attention!r}")
        if self.attention_chunk < 1 or self.logits_chunk < 1:
            raise ValueError("attention_chunk and logits_chunk must be >= 1")


REMAT_POLICIES = ("none", "full", "dots")


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


def _train_attention(q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, valid_BxT, act: ActivationConfig,
                     segment_BxT=None):
    """Causal self-attention of the teacher-forced forward through `jax.nn.dot_product_attention`
    (keys at invalid positions never attended). See `ActivationConfig.attention`.

    segment_BxT: optional int32 segments of a packed row (a shared prompt, segment 0, followed by
    several completions of it, segments 1, 2, ...): a token attends to earlier tokens of its own
    segment and of segment 0 only. Always through the xla implementation."""
    impl = act.attention
    if impl == "auto":
        impl = ("cudnn" if jax.default_backend() == "gpu"
                and q_BxTxHxK.dtype in (jnp.bfloat16, jnp.float16) else "xla")
    if segment_BxT is not None:
        impl = "xla"
    B, T = valid_BxT.shape
    if impl == "cudnn":
        lengths_B = jnp.sum(valid_BxT, axis=1).astype(jnp.int32)
        return jax.nn.dot_product_attention(
            q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, is_causal=True, query_seq_lengths=lengths_B,
            key_value_seq_lengths=lengths_B, implementation="cudnn")
    C = min(act.attention_chunk, T)
    n = -(-T // C)

    def chunk(q_BxCxHxK, start):
        rows_C = start + jnp.arange(C)
        mask_BxCxT = (jnp.arange(T)[None, :] <= rows_C[:, None])[None] & valid_BxT[:, None, :]
        if segment_BxT is not None:
            seg_q_BxC = jnp.take(segment_BxT, jnp.minimum(rows_C, T - 1), axis=1)
            mask_BxCxT &= ((segment_BxT[:, None, :] == 0)
                           | (segment_BxT[:, None, :] == seg_q_BxC[:, :, None]))
        return jax.nn.dot_product_attention(q_BxCxHxK, k_BxTxKVHxK, v_BxTxKVHxK,
                                            mask=mask_BxCxT[:, None], implementation="xla")

    if n == 1:
        return chunk(q_BxTxHxK, 0)
    q_pad = jnp.pad(q_BxTxHxK, ((0, 0), (0, n * C - T), (0, 0), (0, 0)))
    q_NxBxCxHxK = q_pad.reshape(B, n, C, *q_pad.shape[2:]).swapaxes(0, 1)
    # Each chunk rematerialised: the backward pass keeps [B, H, C, T] scores of one chunk at a time.
    out_N = jax.lax.map(lambda xs: jax.checkpoint(chunk)(*xs),
                        (q_NxBxCxHxK, jnp.arange(n, dtype=jnp.int32) * C))
    return out_N.swapaxes(0, 1).reshape(B, n * C, *q_pad.shape[2:])[:, :T]


def decoder_layer(config: ModelConfig, inv_freq, x_BxTxD, lp, positions_BxT, mask_BxTxS=None,
                  valid_BxT=None, act: "ActivationConfig | None" = None, attend=None,
                  segment_BxT=None):
    """One pre-norm block. Returns the new residual and this block's new (k, v) `[B, T, KVH, K]`.

    `attend(q, k, v) -> [B, T, H, K]`, when given, is the attention (decode / verify / packed:
    `decode_attention.attend_cache` over the KV cache); else with `act`, `_train_attention`
    (teacher-forced, causal; `segment_BxT` as there); else the einsum attention over
    `mask_BxTxS` (the reference). The
    contractions go through `config.contraction` (`das_jax.models.contraction`: fast, or exact
    mode)."""
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
    if attend is not None:
        attn = attend(q, k, v)
    elif act is not None:
        attn = _train_attention(q, k, v, valid_BxT, act, segment_BxT)
    else:
        attn = _attention(config, q, k, v, mask_BxTxS)
    x_BxTxD = x_BxTxD + cx.einsum(cp, "bthk,hkd->btd", attn, lp["wo"], rows="bt")
    h = rms_norm(x_BxTxD, lp["mlp_norm"], config.rms_norm_eps, cp)
    gate = jax.nn.silu(cx.einsum(cp, "btd,df->btf", h, lp["w_gate"], rows="bt"))
    up = cx.einsum(cp, "btd,df->btf", h, lp["w_up"], rows="bt")
    x_BxTxD = x_BxTxD + cx.einsum(cp, "btf,fd->btd", gate * up, lp["w_down"], rows="bt")
    return x_BxTxD, k, v


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    saveable = {"full": jax.checkpoint_policies.nothing_saveable,
                "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
    return jax.checkpoint(fn, policy=saveable)


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
    activation: ActivationConfig | None = None,
    segment_BxT: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Runs the decoder stack; returns final-normed hidden states and the updated cache.

    Args:
      config: static model config.
      params: params pytree (module docstring).
      tokens_BxT: int32 token ids.
      positions_BxT: int32 RoPE positions (absolute token index of each token).
      kv_cache: optional KV cache (`das_jax.models.kv_cache`). When given, token t of row b
        is written at cache index `cache_len_B[b] + t` and attends to cache indices
        `< cache_len_B[b]` plus new tokens `<= t`. Writes past S are dropped.
      cache_len_B: int32 `[B]`, valid cache entries per row (required with `kv_cache`).
      valid_BxT: optional bool mask of real (non-padding) new tokens; padding keys are never
        attended. Defaults to all valid.
      kv_len: static number of leading cache positions to attend (<= S, defaults to S). Callers
        that know every row's `cache_len` is at most kv_len use it to read less of the cache.
      activation: without a cache only: `ActivationConfig` (remat policy, attention kernel and
        chunking of the teacher-forced forward). None: plain einsum attention over the full
        `[B, H, T, T]` scores and no remat (the reference path).
      segment_BxT: with `activation` only: int32 segments of packed rows (a shared prompt as
        segment 0, then completions of it as segments 1, 2, ...; see `_train_attention`).

    Returns:
      (hidden_BxTxD in the param dtype, updated KV cache or None).
    """
    B, T = tokens_BxT.shape
    if valid_BxT is None:
        valid_BxT = jnp.ones((B, T), bool)
    x_BxTxD = params["embed"][tokens_BxT]
    inv_freq = config.rope_inv_freq()
    layers = params["layers"]

    if kv_cache is None:
        if activation is not None:
            mask = None
        else:
            mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BxT[:, None, :]

        def body(x, inputs):
            x, k, v = decoder_layer(config, inv_freq, x, inputs[0], positions_BxT, mask,
                                    valid_BxT, activation, segment_BxT=segment_BxT)
            return x, None
        body = _remat(body, activation.remat if activation is not None else "none")
        x_BxTxD, _ = run_layers(body, x_BxTxD, layers, loop=config.layer_loop)
        new_cache = None
    else:
        if cache_len_B is None:
            raise ValueError("forward with a kv_cache needs cache_len_B")
        A = kv_cache.max_len if kv_len is None else min(kv_len, kv_cache.max_len)
        A = kv_cache.read_len(A, in_place=unrolled(layers, config.layer_loop))

        def body(x, inputs):
            lp, layer = inputs
            view = kv_cache.attended(layer, A)

            def attend(q, k, v):
                return attend_cache(config, q, k, v, view, cache_len_B, valid_BxT, A)
            x, k, v = decoder_layer(config, inv_freq, x, lp, positions_BxT, attend=attend)
            return x, (k, v)
        x_BxTxD, (k_new, v_new) = run_layers(body, x_BxTxD, layers, kv_cache.layers(),
                                              config.layer_loop)
        new_cache = kv_cache.write(k_new, v_new, cache_len_B)
    h = rms_norm(x_BxTxD, params["final_norm"], config.rms_norm_eps, config.contraction)
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
    activation: ActivationConfig | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """`forward_hidden` followed by `lm_head`: returns (float32 logits_BxTxV, updated cache)."""
    h, cache = forward_hidden(config, params, tokens_BxT, positions_BxT, kv_cache, cache_len_B,
                              valid_BxT=valid_BxT, kv_len=kv_len, activation=activation)
    return lm_head(config, params, h), cache


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array, temperature: float = 1.0):
    """log softmax(logits / temperature) gathered at targets: float32 `[B, T]`."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
