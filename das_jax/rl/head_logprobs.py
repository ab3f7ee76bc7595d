"""Target log-probs of the lm_head, computed and differentiated in chunks over the vocabulary.

`logprobs.chunked_head_logprobs` cuts the *tokens* into chunks and lets `jax.vjp` differentiate
the loop: the head's gradient `[V, D]` is then accumulated over the chunks, and each chunk's
contribution is a whole `[V, D]` product added to the running sum -- two `[V, D]` float32
buffers at once (226 MB for SmolLM2's tied 49152 x 576 embedding, the largest temporaries of
the CPU main job's update). Here the chunks run over the *vocabulary* instead, with a hand-written
backward pass (`jax.custom_vjp`):

* forward: for each vocabulary slice `W_c` (`[C, D]`), the logits `z_c = h W_c^T / tau`
  (`[N, C]`, float32) update an online log-sum-exp (the running max `m`, `s = sum exp(z - m)`),
  the sum `t = sum exp(z - m) z` for the entropy (`H = lse - t / s`) and the target's logit;
  `logp = z_target - lse` (Milakov & Gimelshein 2018, "Online normalizer calculation for
  softmax", arXiv:1805.02867).
* backward, given `g = dL/dlogp` (`[N]`): `dL/dz = g (onehot(target) - softmax(z))`, so for each
  slice `dW_c = (dL/dz_c)^T h / tau` is *final* -- written once into its rows of the gradient
  (one `[V, D]` buffer, no accumulation) -- and `dh += (dL/dz_c) W_c / tau`.

The entropy is a metric of the stop-gradient logits (as in `chunked_head_logprobs`): it gets no
gradient. A vocabulary that the slice width does not divide ends with a slice that overlaps the
one before it; the overlapped columns are left out of its sums (and its rows of `dW` rewritten
with the same values), so every column counts once.

The values equal `token_logprobs(lm_head(h), targets, tau)` and its gradients up to float
summation order (tests/test_head_logprobs.py: 1e-5).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["vocab_chunk_width", "vocab_chunked_forward", "vocab_chunked_grad_stats",
           "vocab_chunked_logprobs"]


def vocab_chunk_width(vocab_size: int, num_tokens: int, chunk_tokens: int) -> int:
    """The vocabulary slice width `C` whose float32 logits `[num_tokens, C]` hold as many values as
    `chunk_tokens` full rows of logits (`chunk_tokens * V`, the budget of
    `train.logits_chunk`); at least 128 columns, at most V."""
    return int(min(vocab_size, max(128, chunk_tokens * vocab_size // max(1, num_tokens))))


def _slices(V: int, C: int):
    """(start of each slice, first column each slice counts): the last slice starts at V - C and
    counts only the columns past the slice before it."""
    n = -(-V // C)
    firsts = jnp.arange(n, dtype=jnp.int32) * C
    return jnp.minimum(firsts, V - C), firsts


def _chunk_logits(w_VxD, h_NxD, start, C, temperature):
    w_CxD = jax.lax.dynamic_slice_in_dim(w_VxD, start, C, axis=0)
    # the vocabulary as the long matmul dimension, as `transformer.lm_head` computes it
    z_CxN = jnp.einsum("cd,nd->cn", w_CxD, h_NxD, preferred_element_type=jnp.float32)
    return w_CxD, z_CxN.T / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def vocab_chunked_logprobs(w_VxD, h_NxD, targets_N, temperature: float, chunk: int):
    """log softmax(h W^T / temperature)[target] and the entropy, one vocabulary slice at a time.

    Args:
      w_VxD: the head's weights `[V, D]` (the tied embedding or `lm_head`), any float dtype.
      h_NxD: final hidden states `[N, D]`, same dtype as `w_VxD`.
      targets_N: int32 `[N]` target token ids in [0, V).
      temperature: the sampling temperature (> 0).
      chunk: the slice width C (`vocab_chunk_width`); static.

    Returns:
      (logp_N float32, entropy_N float32 in nats, of the stop-gradient logits).
    """
    return _forward(w_VxD, h_NxD, targets_N, temperature, chunk)[0]


def _forward(w_VxD, h_NxD, targets_N, temperature, chunk):
    V = w_VxD.shape[0]
    N = h_NxD.shape[0]
    C = min(int(chunk), V)
    starts, firsts = _slices(V, C)

    def body(carry, inp):
        m, s, t, zt = carry
        start, first = inp
        _, z_NxC = _chunk_logits(w_VxD, h_NxD, start, C, temperature)
        col_C = start + jnp.arange(C, dtype=jnp.int32)
        keep_C = col_C >= first
        z_masked = jnp.where(keep_C[None], z_NxC, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z_masked, axis=-1))
        e = jnp.where(keep_C[None], jnp.exp(z_masked - m_new[:, None]), 0.0)
        scale = jnp.exp(m - m_new)
        s = s * scale + jnp.sum(e, axis=-1)
        t = t * scale + jnp.sum(e * jnp.where(keep_C[None], z_NxC, 0.0), axis=-1)
        hit = (col_C[None] == targets_N[:, None]) & keep_C[None]
        zt = zt + jnp.sum(jnp.where(hit, z_NxC, 0.0), axis=-1)
        return (m_new, s, t, zt), None

    zero = jnp.zeros((N,), jnp.float32)
    (m, s, t, zt), _ = jax.lax.scan(body, (jnp.full((N,), -jnp.inf), zero, zero, zero),
                                    (starts, firsts))
    lse = m + jnp.log(s)
    return (zt - lse, lse - t / s), lse


def _fwd(w_VxD, h_NxD, targets_N, temperature, chunk):
    out, lse = _forward(w_VxD, h_NxD, targets_N, temperature, chunk)
    return out, (w_VxD, h_NxD, targets_N, lse)


def _bwd(temperature, chunk, res, cotangents):
    w_VxD, h_NxD, targets_N, lse_N = res
    g_logp, _ = cotangents  # the entropy is a metric: no gradient
    dw, dh = _backward(w_VxD, h_NxD, targets_N, lse_N, g_logp, temperature, chunk)
    return dw, dh, None


vocab_chunked_logprobs.defvjp(_fwd, _bwd)


def vocab_chunked_forward(w_VxD, h_NxD, targets_N, temperature: float, chunk: int):
    """`vocab_chunked_logprobs`'s values and the log-sum-exp its backward pass needs: (logp_N,
    entropy_N, lse_N), float32 `[N]` each, the logits scaled by 1 / temperature."""
    (logp, ent), lse = _forward(w_VxD, h_NxD, targets_N, temperature, chunk)
    return logp, ent, lse


def vocab_chunked_grad_stats(w_VxD, h_NxD, targets_N, lse_N, g_logp_N, temperature: float,
                             chunk: int, rows_M=None):
    """The backward pass of `vocab_chunked_logprobs` at cotangent `g_logp_N`, without the head's
    gradient `dW` (`[V, D]`) ever existing whole: each slice's rows are reduced and dropped.

    Args:
      w_VxD, h_NxD, targets_N, temperature, chunk: as for `vocab_chunked_logprobs`.
      lse_N: `vocab_chunked_forward`'s log-sum-exp.
      g_logp_N: float32 `[N]`, dL/dlogp.
      rows_M: int32 indices into [0, V) (any shape), or None.

    Returns:
      (dh_NxD in h's dtype, the float32 sum of dW's squares, float32 `dW[rows_M]` (shape
      `rows_M.shape + (D,)`) or None).
    """
    return _backward(w_VxD, h_NxD, targets_N, lse_N, g_logp_N, temperature, chunk,
                     stats=True, rows_M=rows_M)


def _backward(w_VxD, h_NxD, targets_N, lse_N, g_logp, temperature, chunk, stats=False,
              rows_M=None):
    """(dW, dh); with `stats`: (dh, |dW|^2, dW[rows_M] or None)."""
    V, D = w_VxD.shape
    C = min(int(chunk), V)
    starts, firsts = _slices(V, C)
    coef_N = g_logp.astype(jnp.float32) / temperature
    h32 = h_NxD.astype(jnp.float32)
    rows = None if rows_M is None else rows_M.reshape(-1)

    def body(carry, inp):
        acc, dh_NxD = carry
        start, first = inp
        w_CxD, z_NxC = _chunk_logits(w_VxD, h_NxD, start, C, temperature)
        col_C = start + jnp.arange(C, dtype=jnp.int32)
        keep_C = col_C >= first  # overlapped columns (the last slice) count once
        onehot = col_C[None] == targets_N[:, None]
        dz_NxC = coef_N[:, None] * (onehot.astype(jnp.float32) - jnp.exp(z_NxC - lse_N[:, None]))
        dw_CxD = jnp.einsum("nc,nd->cd", dz_NxC, h32)
        if stats:
            w_sq, got = acc
            w_sq = w_sq + jnp.sum(jnp.where(keep_C[:, None], jnp.square(dw_CxD), 0.0))
            if rows is not None:
                mine = (rows >= first) & (rows >= start) & (rows < start + C)
                picked = dw_CxD[jnp.clip(rows - start, 0, C - 1)]
                got = got + jnp.where(mine[:, None], picked, 0.0)
            acc = (w_sq, got)
        else:  # each slice's rows are final: written once, in place
            acc = jax.lax.dynamic_update_slice_in_dim(acc, dw_CxD.astype(acc.dtype), start, 0)
        dz_NxC = jnp.where(keep_C[None], dz_NxC, 0.0)
        dh_NxD = dh_NxD + jnp.einsum("nc,cd->nd", dz_NxC, w_CxD.astype(jnp.float32))
        return (acc, dh_NxD), None

    if stats:
        acc0 = (jnp.zeros((), jnp.float32),
                None if rows is None else jnp.zeros((rows.shape[0], D), jnp.float32))
    else:
        acc0 = jnp.zeros((V, D), w_VxD.dtype)
    (acc, dh), _ = jax.lax.scan(body, (acc0, jnp.zeros(h_NxD.shape, jnp.float32)),
                                (starts, firsts))
    dh = dh.astype(h_NxD.dtype)
    if not stats:
        return acc, dh
    w_sq, got = acc
    return dh, w_sq, (None if got is None else got.reshape(rows_M.shape + (D,)))
