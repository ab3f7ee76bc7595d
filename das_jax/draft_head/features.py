"""The policy's features for the draft head: the outputs of three decoder blocks at every
position of a teacher-forced forward, and the policy's own next-token distribution (its top-M
tokens), the head's training target."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.layer_loop import run_layers
from das_jax.models.packed import feature_hits
from das_jax.models.transformer import (ActivationConfig, decoder_layer, lm_head, rms_norm)


def block_features(config, params, tokens_BxT, valid_BxT, feature_layers, top_m: int = 0,
                   vocab_ids=None):
    """Teacher-forced policy forward (causal, positions 0..T-1).

    Args:
      config: the policy's `ModelConfig`; params: its params.
      tokens_BxT: int32 ids; valid_BxT: bool real positions (a prefix of each row).
      feature_layers: three 0-based block indices whose outputs are returned.
      top_m: with M > 0 also the policy's top-M next-token ids and probabilities (temperature 1).
      vocab_ids: optional int32 `[Vd]` policy ids (a draft vocabulary): the distribution is then
        the policy's conditioned on those tokens (softmax over their logits only, so the
        lm_head reads Vd rows, not V), and the ids returned are indices into `vocab_ids`.

    Returns:
      feats float32 `[B, T, 3D]` ([h_low; h_mid; h_high]), and with top_m (ids int32 `[B, T, M]`,
      probs float32 `[B, T, M]`, sorted by probability, highest first).
    """
    B, T = tokens_BxT.shape
    hit_Lx3 = feature_hits(config.num_layers, feature_layers)  # block l fills slot i
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = params["embed"][tokens_BxT]
    feats0 = jnp.zeros((3,) + x.shape, jnp.float32)
    act = ActivationConfig(attention="xla")
    inv_freq = config.rope_inv_freq()

    def body(carry, inputs):
        x, feats = carry
        lp, hit_3 = inputs
        x, _, _ = decoder_layer(config, inv_freq, x, lp, pos, None, valid_BxT, act)
        return (x, jnp.where(hit_3[:, None, None, None], x.astype(jnp.float32)[None], feats)), None

    (x, feats), _ = run_layers(body, (x, feats0), params["layers"], hit_Lx3,
                               config.layer_loop)
    feats_BxTx3D = jnp.concatenate([feats[0], feats[1], feats[2]], axis=-1)
    if not top_m:
        return feats_BxTx3D
    h = rms_norm(x, params["final_norm"], config.rms_norm_eps, config.contraction)
    if vocab_ids is None:
        logits = lm_head(config, params, h)
    else:
        w_VxD = params["embed"] if config.tie_word_embeddings else params["lm_head"]
        logits = jnp.einsum("btd,vd->btv", h, w_VxD[vocab_ids],
                            preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    p, ids = jax.lax.top_k(probs, top_m)
    return feats_BxTx3D, ids.astype(jnp.int32), p


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _jit_features(config, params, tokens, valid, feature_layers, top_m, vocab_ids):
    return block_features(config, params, tokens, valid, feature_layers, top_m, vocab_ids)


def sequence_features(config, params, sequences, feature_layers, top_m: int = 0,
                      batch: int = 8, bucket: int = 64, progress=None, vocab_ids=None):
    """`block_features` of each int sequence (lists of ids), batched by length: a list, per
    sequence in input order, of numpy arrays (feats `[n, 3D]` float32 and, with top_m, ids
    `[n, M]` int32 and probs `[n, M]` float32; `vocab_ids` as there). `progress(n)` is called
    with the sequences done."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = [None] * len(sequences)
    for s in range(0, len(order), batch):
        idx = order[s: s + batch]
        T = -(-max(len(sequences[i]) for i in idx) // bucket) * bucket
        tok = np.zeros((batch, T), np.int32)
        valid = np.zeros((batch, T), bool)
        for r, i in enumerate(idx):
            tok[r, :len(sequences[i])] = sequences[i]
            valid[r, :len(sequences[i])] = True
        res = _jit_features(config, params, jnp.asarray(tok), jnp.asarray(valid),
                            tuple(feature_layers), int(top_m),
                            None if vocab_ids is None else jnp.asarray(vocab_ids, jnp.int32))
        res = jax.tree_util.tree_map(np.asarray, res if top_m else (res,))
        for r, i in enumerate(idx):
            n = len(sequences[i])
            out[i] = tuple(a[r, :n] for a in res)
        if progress is not None:
            progress(len(idx))
    return out
