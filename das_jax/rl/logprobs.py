"""Teacher-forced log-probabilities of a policy, without a KV cache.

The logits at position t-1 score the token at position t,
`logp_t = log_softmax(logits_{t-1} / temperature)[tokens_t]` (TRL
`_get_per_token_logps_and_entropies`, which also divides the logits by the sampling temperature).
Two paths: the reference one (full `[B, T, V]` logits, no remat) when `activation` is None, and
the memory-bounded one (`ActivationConfig`: per-layer remat, chunked attention, the lm_head +
log-softmax in chunks of positions, `chunked_head_logprobs`).

`micro_batch_logprobs` scores each micro-batch kind of `das_jax.rl.batches` (dispatched on its
type); `compute_logprobs` scores whole rows for old / reference-policy log-probs.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.config import ModelConfig
from das_jax.models.transformer import (ActivationConfig, forward, forward_hidden, lm_head,
                                        token_logprobs)
from das_jax.parallel import sharding as shard_lib
from das_jax.rl import losses
from das_jax.rl.batches import PackedMicroBatch, PaddedMicroBatch, WindowedMicroBatch

__all__ = ["cast_params", "shifted_logits_and_targets", "chunked_head_logprobs",
           "row_logprobs", "micro_batch_logprobs", "compute_logprobs"]

Params = Any


def cast_params(params: Params, dtype) -> Params:
    """Params cast to `dtype` (None: unchanged); leaves already in `dtype` are the same arrays."""
    if dtype is None:
        return params
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda p: p if p.dtype == dtype else p.astype(dtype), params)


def shifted_logits_and_targets(config: ModelConfig, params: Params, tokens_BxT, positions_BxT,
                               valid_BxT):
    """Teacher-forced logits: returns (float32 logits_BxTxV aligned so that row t scores token t,
    position 0 holds the (unused) logits of position 0 itself). The full-logits reference path."""
    logits_BxTxV, _ = forward(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT)
    # logits at t-1 predict token t: shift right by one along T (position 0 has no predecessor).
    return jnp.concatenate([logits_BxTxV[:, :1], logits_BxTxV[:, :-1]], axis=1)


def chunked_head_logprobs(config: ModelConfig, params: Params, hidden_BxTxD, targets_BxT,
                          temperature: float, chunk_tokens: int, with_entropy: bool):
    """`token_logprobs(lm_head(hidden), targets)` (and the entropy) in chunks over positions.

    The positions are cut into chunks of `C = max(1, chunk_tokens // B)`; each chunk's float32
    logits `[B, C, V]` are computed, reduced and dropped, and rematerialised in the backward pass
    (`jax.checkpoint`), so the full `[B, T, V]` logits never exist. Row t of the result scores
    `targets_BxT[:, t]` with `hidden_BxTxD[:, t]`. `params` needs only the head's weights.

    Returns:
      (logp_BxT float32, entropy_BxT float32 (of the stop-gradient logits) or None).
    """
    B, T, D = hidden_BxTxD.shape
    C = min(T, max(1, chunk_tokens // B))
    n = -(-T // C)
    head_key = "embed" if config.tie_word_embeddings else "lm_head"
    w_VxD = params[head_key]
    h = jnp.pad(hidden_BxTxD, ((0, 0), (0, n * C - T), (0, 0)))
    t = jnp.pad(targets_BxT, ((0, 0), (0, n * C - T)))
    h_NxBxCxD = h.reshape(B, n, C, D).swapaxes(0, 1)
    t_NxBxC = t.reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def one(w, h_BxCxD, t_BxC):
        logits_BxCxV = lm_head(config, {head_key: w}, h_BxCxD)
        logp = token_logprobs(logits_BxCxV, t_BxC, temperature)
        ent = (losses.entropy_from_logits(jax.lax.stop_gradient(logits_BxCxV), temperature)
               if with_entropy else jnp.zeros_like(logp))
        return logp, ent

    if n == 1:
        logp, ent = one(w_VxD, h_NxBxCxD[0], t_NxBxC[0])
    else:
        logp, ent = jax.lax.map(lambda xs: one(w_VxD, *xs), (h_NxBxCxD, t_NxBxC))
        logp, ent = (x.swapaxes(0, 1).reshape(B, n * C)[:, :T] for x in (logp, ent))
    return logp, (ent if with_entropy else None)


def row_logprobs(config, params, tokens_BxT, positions_BxT, valid_BxT, temperature,
                 with_entropy, activation: ActivationConfig | None = None, window_BxW=None):
    """Teacher-forced log-probs (0 at t = 0 and invalid t) and entropies, float32 `[B, T]`.

    activation None: the reference path (full `[B, T, V]` logits, einsum attention, no remat);
    otherwise the memory-bounded path (`ActivationConfig`; chunked head).
    window_BxW: int32 positions (each >= 1, distinct within a row), memory path only: the head
    (lm_head + log-softmax) runs at those positions only, and the results are `[B, W]`, entry
    `[b, j]` scoring `tokens_BxT[b, window_BxW[b, j]]` -- the completion window of
    `completion_window`, a fraction of T when the prompts are long."""
    if window_BxW is not None:
        h_BxTxD, _ = forward_hidden(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT,
                                    activation=activation)
        # the hidden state at t - 1 scores the token at t
        h_BxWxD = jnp.take_along_axis(h_BxTxD, (window_BxW - 1)[..., None], axis=1)
        targets_BxW = jnp.take_along_axis(tokens_BxT, window_BxW, axis=1)
        logp_BxW, entropy_BxW = chunked_head_logprobs(
            config, params, h_BxWxD, targets_BxW, temperature, activation.logits_chunk,
            with_entropy)
        valid_BxW = jnp.take_along_axis(valid_BxT, window_BxW, axis=1) & (window_BxW > 0)
        return jnp.where(valid_BxW, logp_BxW, 0.0), entropy_BxW
    first_T = jnp.arange(tokens_BxT.shape[1]) > 0
    if activation is None:
        logits_BxTxV = shifted_logits_and_targets(config, params, tokens_BxT, positions_BxT,
                                                  valid_BxT)
        logp_BxT = token_logprobs(logits_BxTxV, tokens_BxT, temperature)
        entropy_BxT = (losses.entropy_from_logits(jax.lax.stop_gradient(logits_BxTxV),
                                                  temperature) if with_entropy else None)
    else:
        h_BxTxD, _ = forward_hidden(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT,
                                    activation=activation)
        h_BxTxD = jnp.concatenate([h_BxTxD[:, :1], h_BxTxD[:, :-1]], axis=1)
        logp_BxT, entropy_BxT = chunked_head_logprobs(
            config, params, h_BxTxD, tokens_BxT, temperature, activation.logits_chunk, with_entropy)
    logp_BxT = jnp.where(first_T[None] & valid_BxT, logp_BxT, 0.0)
    return logp_BxT, entropy_BxT


@functools.singledispatch
def micro_batch_logprobs(x, config: ModelConfig, params: Params, temperature: float,
                         activation: ActivationConfig | None):
    """(log-probs, entropies) float32, aligned with `x.completion_mask`, of one micro-batch
    (no leading axis) of a kind of `das_jax.rl.batches`; dispatched on the type of `x`.

    Raises:
      TypeError: `x` is not a micro-batch kind.
    """
    raise TypeError(f"not a micro-batch: {type(x).__name__} (expected one of PaddedMicroBatch, "
                    "WindowedMicroBatch, PackedMicroBatch)")


@micro_batch_logprobs.register
def _(x: PaddedMicroBatch, config, params, temperature, activation):
    return row_logprobs(config, params, x.tokens, x.positions, x.valid, temperature, True,
                        activation)


@micro_batch_logprobs.register
def _(x: WindowedMicroBatch, config, params, temperature, activation):
    return row_logprobs(config, params, x.tokens, x.positions, x.valid, temperature, True,
                        activation, x.window)


@micro_batch_logprobs.register
def _(x: PackedMicroBatch, config, params, temperature, activation):
    """One forward over the G packed rows (segment-masked attention), then the head at the
    hidden states `x.source` of packed row `x.row_group` scoring `x.targets`."""
    h_GxSxD, _ = forward_hidden(config, params, x.tokens, x.positions, valid_BxT=x.valid,
                                activation=activation, segment_BxT=x.segments)
    h_RxWxD = h_GxSxD[x.row_group[:, None], x.source]
    logp_RxW, entropy_RxW = chunked_head_logprobs(config, params, h_RxWxD, x.targets,
                                                  temperature, activation.logits_chunk, True)
    return jnp.where(x.completion_mask, logp_RxW, 0.0), entropy_RxW


def compute_logprobs(model_config: ModelConfig, params: Params, tokens, positions, valid,
                     temperature: float = 1.0, micro_batch_size: int | None = None, *,
                     activation: ActivationConfig | None = ActivationConfig(),
                     compute_dtype: str | None = None, mesh=None) -> jax.Array:
    """Teacher-forced log-probs of every token given its prefix (no KV cache), float32 `[B, T]`.

    `out[b, t] = log_softmax(logits[b, t-1] / temperature)[tokens[b, t]]`; 0 at t = 0 and at
    invalid positions. Used for old / reference-policy log-probs and tests. Runs in micro-batches
    of `micro_batch_size` rows (default: all rows at once) under one jit, with the chunked head
    of `activation` (None: full logits) and params cast to `compute_dtype` (None: as given).
    With a `mesh` (params already placed on it), the rows are split over its batch axes (padded
    to a multiple of the split) and the result is a host `np.ndarray` (every process gets all
    rows).
    """
    if mesh is not None:
        return _compute_logprobs_on_mesh(model_config, params, tokens, positions, valid,
                                         temperature, micro_batch_size, activation,
                                         compute_dtype, mesh)
    tokens = jnp.asarray(tokens, jnp.int32)
    B = tokens.shape[0]
    mb = B if not micro_batch_size else min(micro_batch_size, B)
    return _compute_logprobs_jit(model_config, params, tokens, jnp.asarray(positions, jnp.int32),
                                 jnp.asarray(valid, bool), float(temperature), int(mb),
                                 activation, compute_dtype)


def _split_micro(tree, micro_batch_size: int):
    """Pads the leading axis to a multiple of mb and reshapes every leaf to `[n_mb, mb, ...]`."""
    n = jax.tree_util.tree_leaves(tree)[0].shape[0]
    n_mb = max(1, -(-n // micro_batch_size))
    pad = n_mb * micro_batch_size - n

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
        return x.reshape((n_mb, micro_batch_size) + x.shape[1:])
    return jax.tree_util.tree_map(split, tree), n_mb


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8))
def _compute_logprobs_jit(config, params, tokens, positions, valid, temperature, mb, activation,
                          compute_dtype):
    B = tokens.shape[0]
    params = cast_params(params, compute_dtype)
    (tok, pos, val), _ = _split_micro((tokens, positions, valid), mb)

    def body(_, xs):
        t, p, v = xs
        logp, _ = row_logprobs(config, params, t, p, v, temperature, False, activation)
        return None, logp

    _, logp = jax.lax.scan(body, None, (tok, pos, val))
    return logp.reshape((-1,) + logp.shape[2:])[:B]


def round_up(n: int, k: int) -> int:
    """`n` rounded up to a multiple of `k`."""
    return -(-int(n) // k) * k


@functools.lru_cache(maxsize=64)
def _logprobs_kernel_on_mesh(config, temperature, mb, activation, compute_dtype, row_sharding,
                             out_sharding):
    fn = functools.partial(_compute_logprobs_jit.__wrapped__, config, temperature=temperature,
                           mb=mb, activation=activation, compute_dtype=compute_dtype)
    return jax.jit(lambda p, t, pos, v: fn(p, t, pos, v), out_shardings=out_sharding)


def _compute_logprobs_on_mesh(config, params, tokens, positions, valid, temperature,
                              micro_batch_size, activation, compute_dtype, mesh):
    tokens = np.asarray(tokens, np.int32)
    B = tokens.shape[0]
    k = shard_lib.batch_shards(mesh)
    B_pad = round_up(B, k)
    mb = round_up(B if not micro_batch_size else min(micro_batch_size, B), k)
    rows = shard_lib.batch_sharding(mesh, 2)
    cols = [np.pad(np.asarray(x, dt), [(0, B_pad - B), (0, 0)])
            for x, dt in ((tokens, np.int32), (positions, np.int32), (valid, bool))]
    kernel = _logprobs_kernel_on_mesh(config, float(temperature), int(mb), activation,
                                      compute_dtype, rows, shard_lib.replicated(mesh))
    out = kernel(params, *(shard_lib.global_array(c, rows) for c in cols))
    return shard_lib.to_host(out)[:B]
