"""The model's contractions under a `ContractionPolicy`: fast (plain einsum) or exact.

Exact mode makes every contraction that feeds a token's logits *shape-invariant*: a row's result
is bitwise the same whatever the batch bucket, draft width, attended-length bucket or prefill
bucket of the step that computes it. With the position-keyed sampling rule (`engine/sampling.py`)
this makes rollouts token-identical with and without speculation (docs/design.md, "Sampling
rule").

How (found on XLA CPU, float32; docs/design.md, "Exact mode: how", and
docs/results/exact-mode.md):

* Row classes. For `x[M, ...] . w` a row's result depends only on which *class* its row count M
  falls in (e.g. {1}, {2..32}, {33+} for K=576), never on its position or on the other rows at a
  fixed M. `einsum` with `rows=` flattens the varying row axes to M, pads M to a power of two
  inside the probed invariant range [min_rows, chunk_rows], and runs larger M as independent
  fixed chunks of `chunk_rows` rows. Each chunk's contraction sits between optimization
  barriers so that XLA cannot fuse neighbouring ops into it (without them a tiny model's prefill
  logits changed). The classes are not hard-coded: `row_classes` probes each contraction
  signature once per process on the running backend (powers of two 1..max_probe_rows; row
  position, neighbours, batch size and run-to-run determinism varied) and picks the longest run
  of powers of two in one class. No usable row count raises `ExactModeUnavailable`.
* Masked positions of the attention have probability exactly 0 (see below), so a longer
  attended-length bucket only appends exact zeros to fixed-order sums.
* Reductions (`row_sum`, `row_max`): fixed halving trees of elementwise ops. XLA CPU's reduce
  depends on the number of rows reduced together, and for some shapes it hands a reduce and its
  elementwise consumers to a YNNPACK fusion whose exp rounds differently from XLA's own.
* Attention (`cached_attention`). New keys are written at their absolute cache positions (not
  appended after the attended prefix), the attended length is padded to whole `kv_block`s, and
  scores / values are contracted per block with a fixed block shape (the block index is a batch
  axis). Masked positions have probability exactly 0 (exp(-1e30 - max) underflows to 0.0), so
  the extra blocks of a longer attended-length bucket add exact zeros: x + 0.0 == x, and the max
  is order-free, so the bucket cannot change the result. The tests check this bitwise.

RMSNorm and the sampling normalisers use `row_sum` / `log_softmax` from here; RoPE, SiLU and the
other elementwise ops were measured shape-invariant as they are. tests/test_exact_mode.py checks
the whole step bitwise.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.config import ContractionPolicy

_MASK_VALUE = -1e30
_MAX_UNROLLED_CHUNKS = 8
FAST = ContractionPolicy()
EXACT = ContractionPolicy(mode="exact")


class ExactModeUnavailable(RuntimeError):
    """The running backend offers no shape-invariant way to compute a contraction."""


# ---------------------------------------------------------------------------- probing
_PROBE_CACHE: dict[tuple, "RowClasses"] = {}
_PROBE_LOCK = threading.Lock()


class RowClasses(tuple):
    """(min_rows, chunk_rows, classes): the invariant power-of-two run of one contraction
    signature, and the probed classes as a tuple of tuples of row counts."""

    __slots__ = ()

    def __new__(cls, min_rows: int, chunk_rows: int, classes: tuple):
        return super().__new__(cls, (min_rows, chunk_rows, classes))

    min_rows = property(lambda self: self[0])
    chunk_rows = property(lambda self: self[1])
    classes = property(lambda self: self[2])


def probe_report() -> dict[str, dict[str, Any]]:
    """The probe results of this process: signature -> {min_rows, chunk_rows, classes}."""
    return {repr(k): {"min_rows": v.min_rows, "chunk_rows": v.chunk_rows,
                      "classes": [list(c) for c in v.classes]}
            for k, v in _PROBE_CACHE.items()}


def _pow2s(n: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(n)) + 1)]


def row_classes(chunk_spec: str, act_index: int, act_shape: tuple, other_shape: tuple,
                row_axis: int, dtypes: tuple, preferred_element_type, max_rows: int) -> RowClasses:
    """Probes (once per process) the row classes of `einsum(chunk_spec)`.

    The activation operand (`act_index`) has layout [batch..., M rows, rest...] with its
    `row_axis` leading axes shared with the other operand and the output (batch axes); the row
    letter may sit anywhere in the output. For every power of two M in 1..max_rows, row r's result is
    computed twice with r at position 0, once at position M-1 (different neighbours), and with
    every batch axis at size 3 and at size 1. M is *usable* when all of these agree; usable M are grouped by
    the bits of row r. Returns the longest run of consecutive powers of two in one class (ties:
    the larger rows). Batch and row sizes are not part of the cached signature.

    Raises:
      ExactModeUnavailable: no M is usable (a row's result depends on its neighbours, its position,
        the batch size or the run on this backend), so no chunking makes it invariant.
    """
    ins = chunk_spec.split("->")[0].split(",")
    s_act, s_oth = ins[act_index], ins[1 - act_index]
    batch_letters = s_act[:row_axis]
    act_shape = tuple(0 if i <= row_axis else n for i, n in enumerate(act_shape))
    other_shape = tuple(0 if c in batch_letters else n for c, n in zip(s_oth, other_shape))
    key = (jax.default_backend(), chunk_spec, act_index, act_shape, other_shape, row_axis,
           tuple(str(d) for d in dtypes), str(preferred_element_type), max_rows)
    with _PROBE_LOCK:
        if key not in _PROBE_CACHE:
            with jax.ensure_compile_time_eval():
                _PROBE_CACHE[key] = _probe(chunk_spec, act_index, act_shape, other_shape,
                                           row_axis, dtypes, preferred_element_type, max_rows)
        return _PROBE_CACHE[key]


def _probe(chunk_spec, act_index, act_shape, other_shape, row_axis, dtypes, pet, max_rows):
    rng = np.random.default_rng(0)
    act_dtype, other_dtype = dtypes
    ins, s_out = chunk_spec.split("->")
    ins = ins.split(",")
    s_act, s_oth = ins[act_index], ins[1 - act_index]
    batch_letters = s_act[:row_axis]
    out_axis = s_out.index(s_act[row_axis])
    out_first_b = tuple(slice(0, 1) if c in batch_letters else slice(None)
                        for c in s_out if c != s_act[row_axis])

    def fn(a, o):
        ops = (a, o) if act_index == 0 else (o, a)
        return jnp.einsum(chunk_spec, *ops, preferred_element_type=pet)

    jfn = jax.jit(fn)
    NB = 3
    other = rng.standard_normal(tuple(NB if c in batch_letters else n
                                      for c, n in zip(s_oth, other_shape))).astype(other_dtype)
    other1 = other[tuple(slice(0, 1) if c in batch_letters else slice(None) for c in s_oth)]
    first_b = (slice(0, 1),) * row_axis
    row_sel = (slice(None),) * row_axis
    row = rng.standard_normal(tuple(NB if i < row_axis else n for i, n in enumerate(act_shape)
                                    if i != row_axis)).astype(act_dtype)
    bits: dict[int, np.ndarray] = {}
    for M in _pow2s(max_rows):
        shape = tuple(NB if i < row_axis else (M if i == row_axis else n)
                      for i, n in enumerate(act_shape))
        a = rng.standard_normal(shape).astype(act_dtype)
        b = rng.standard_normal(shape).astype(act_dtype)
        a[row_sel + (0,)] = row
        b[row_sel + (M - 1,)] = row
        out_a = np.take(np.asarray(jfn(a, other)), 0, axis=out_axis)
        again = np.take(np.asarray(jfn(a, other)), 0, axis=out_axis)  # run-to-run determinism
        out_b = np.take(np.asarray(jfn(b, other)), M - 1, axis=out_axis)
        out_1 = np.take(np.asarray(jfn(a[first_b], other1)), 0, axis=out_axis)
        if (np.array_equal(out_a, again) and np.array_equal(out_a, out_b)
                and np.array_equal(out_a[out_first_b], out_1)):
            bits[M] = out_a
    classes: list[list[int]] = []
    for M, r in bits.items():
        for c in classes:
            if np.array_equal(bits[c[0]], r):
                c.append(M)
                break
        else:
            classes.append([M])
    if not classes:
        raise ExactModeUnavailable(
            f"exact mode: on backend {jax.default_backend()!r} the contraction {chunk_spec!r} "
            f"gives a row a result that depends on its position, its neighbours, the batch size or "
            f"the run at every row count 1..{max_rows}; no chunking makes it shape-invariant. Use the "
            f"fast mode (rollout.exact: false)")
    best = None
    for c in classes:
        run_start = None
        for M in _pow2s(max_rows):
            if M not in c:
                run_start = None
                continue
            run_start = M if run_start is None else run_start
            if best is None or (M // run_start, M) > (best[1] // best[0], best[1]):
                best = (run_start, M)
    return RowClasses(best[0], best[1], tuple(tuple(c) for c in classes))


# ---------------------------------------------------------------------------- einsum
def einsum(policy: ContractionPolicy, spec: str, a: jax.Array, b: jax.Array, *, rows: str,
           preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, a, b)` under `policy`.

    Args:
      policy: `ContractionPolicy`; fast mode is exactly `jnp.einsum`.
      spec: a two-operand einsum spec with an explicit output ("btd,dhk->bthk").
      rows: the letters of the axes whose sizes vary with the step shape (batch bucket, width,
        prefill length: "bt"); they must all belong to one operand (the activation) and appear in
        the output. The other operand's non-shared axes must be fixed by the model.
      preferred_element_type: as in `jnp.einsum`.

    Returns:
      The einsum result; in exact mode each row's values do not depend on the row count, the
      row's position or the other rows (to the probed classes, `row_classes`).

    Raises:
      ValueError: a malformed spec or `rows`; ExactModeUnavailable (exact mode only).
    """
    if not policy.exact:
        return jnp.einsum(spec, a, b, preferred_element_type=preferred_element_type)
    ins, out = spec.replace(" ", "").split("->")
    s_a, s_b = ins.split(",")
    if rows and all(r in s_a for r in rows):
        act_index, s_act, s_oth, act, other = 0, s_a, s_b, a, b
    elif rows and all(r in s_b for r in rows):
        act_index, s_act, s_oth, act, other = 1, s_b, s_a, b, a
    else:
        raise ValueError(f"einsum {spec!r}: rows={rows!r} must name axes of one operand")
    if any(r in s_oth or r not in out for r in rows):
        raise ValueError(f"einsum {spec!r}: row axes {rows!r} must be free axes of one operand")
    batch = [c for c in s_act if c in s_oth and c in out]
    rest = [c for c in s_act if c not in rows and c not in batch]
    perm = [s_act.index(c) for c in batch + list(rows) + rest]
    act_t = jnp.transpose(act, perm)
    nb = len(batch)
    batch_shape = act_t.shape[:nb]
    row_shape = act_t.shape[nb:nb + len(rows)]
    M = int(np.prod(row_shape))
    x = act_t.reshape(batch_shape + (M,) + act_t.shape[nb + len(rows):])
    m = next(c for c in "mrzyxwuqpojil" if c not in spec)
    out_rest = "".join(c for c in out if c not in rows and c not in batch)
    s_chunk = "".join(batch) + m + "".join(rest)
    # The row axis keeps its place in the output (the lm_head's "vd,nd->vn" orientation is
    # several times faster than "nd,vd->nv" on XLA CPU) when the row letters are contiguous there.
    s_out = out.replace(rows, m) if rows in out else "".join(batch) + m + out_rest
    pos = s_out.index(m)
    chunk_spec = (f"{s_chunk},{s_oth}->{s_out}" if act_index == 0
                  else f"{s_oth},{s_chunk}->{s_out}")
    cls = row_classes(chunk_spec, act_index, x.shape, other.shape, nb, (x.dtype, other.dtype),
                      preferred_element_type, policy.max_probe_rows)

    def chunk(xc):
        # The barrier keeps XLA from fusing neighbouring ops (pads, transposes, the producers
        # of the rows) into the contraction, which can pick a different kernel than the probed
        # one (measured: the tiny model's prefill differs without it).
        ops = jax.lax.optimization_barrier((xc, other) if act_index == 0 else (other, xc))
        out = jnp.einsum(chunk_spec, *ops, preferred_element_type=preferred_element_type)
        return jax.lax.optimization_barrier(out)

    def pad_rows(x, to):
        return jnp.pad(x, [(0, 0)] * nb + [(0, to - M)] + [(0, 0)] * (x.ndim - nb - 1))

    if M <= cls.chunk_rows:
        Mp = max(1 << (M - 1).bit_length(), cls.min_rows)
        y = chunk(pad_rows(x, Mp))
    else:
        C = cls.chunk_rows
        n = -(-M // C)
        xs = pad_rows(x, n * C)
        if n <= _MAX_UNROLLED_CHUNKS:  # decode steps: independent chunks XLA may run in parallel
            y = jnp.concatenate([chunk(jax.lax.slice_in_dim(xs, i * C, (i + 1) * C, axis=nb))
                                 for i in range(n)], axis=pos)
        else:  # prefill: a loop over the same chunk keeps the program (and compile time) small
            xs = jnp.moveaxis(xs.reshape(batch_shape + (n, C) + x.shape[nb + 1:]), nb, 0)
            ys = jnp.moveaxis(jax.lax.map(chunk, xs), 0, pos)
            y = ys.reshape(ys.shape[:pos] + (n * C,) + ys.shape[pos + 2:])
    y = jax.lax.slice_in_dim(y, 0, M, axis=pos)
    y = y.reshape(y.shape[:pos] + row_shape + y.shape[pos + 1:])
    cur = s_out.replace(m, rows)
    return y if cur == out else jnp.transpose(y, [cur.index(c) for c in out])


# ---------------------------------------------------------------------------- reductions
def _tree(x: jax.Array, axis: int, keepdims: bool, op, fill) -> jax.Array:
    """Reduces `axis` with a fixed halving tree of elementwise `op` (padded with `fill` to a
    power of two): no reduce op, so no backend reduction kernel is chosen by shape."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)], constant_values=fill)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = op(x[..., :h], x[..., h:])
    return jnp.moveaxis(x, -1, axis) if keepdims else x[..., 0]


def row_max(policy: ContractionPolicy, x: jax.Array, axis: int = -1,
            keepdims: bool = False) -> jax.Array:
    """`jnp.max(x, axis)` under `policy`. The max is exact in any order, but on XLA CPU a reduce
    may be handed with its elementwise consumers (e.g. the softmax's exp) to a library fusion
    (YNNPACK) for some shapes and not others, and that library's exp rounds differently; exact
    mode therefore uses an elementwise halving tree, which keeps those consumers in XLA's own
    loop code at every shape."""
    if not policy.exact:
        return jnp.max(x, axis=axis, keepdims=keepdims)
    return _tree(x, axis, keepdims, jnp.maximum, -jnp.inf)


def row_sum(policy: ContractionPolicy, x: jax.Array, axis: int = -1,
            keepdims: bool = False) -> jax.Array:
    """`jnp.sum(x, axis)` under `policy`.

    Exact mode sums along `axis` with a fixed halving tree of elementwise adds (zero-padded to a
    power of two; step i adds the upper half onto the lower half), so each sum is a fixed
    sequence of IEEE additions that cannot depend on how many rows are reduced together (XLA's
    CPU reduce emitter does depend on it: RMSNorm over D=32 differs between 64 and 128 rows).
    Zero padding past the data cannot change the sum either: the first halving steps then add
    exact zeros, so a longer (power-of-two) padded length gives the same bits.
    """
    if not policy.exact:
        return jnp.sum(x, axis=axis, keepdims=keepdims)
    return _tree(x, axis, keepdims, jnp.add, 0)


def log_softmax(policy: ContractionPolicy, x: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax(x, axis=-1)` with the normaliser summed by `row_sum`."""
    if not policy.exact:
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jax.lax.stop_gradient(row_max(policy, x, keepdims=True))
    return shifted - jnp.log(row_sum(policy, jnp.exp(shifted), keepdims=True))


# ---------------------------------------------------------------------------- attention
def cached_attention(policy: ContractionPolicy, q_BxTxHxK: jax.Array, k_BxTxKVHxK: jax.Array,
                     v_BxTxKVHxK: jax.Array, cache_k_BxSxKVHxK: jax.Array | None,
                     cache_v_BxSxKVHxK: jax.Array | None, mask_BxTxA: jax.Array) -> jax.Array:
    """Exact-mode attention of T new queries over a cached prefix and the new keys.

    Inputs follow `transformer.decoder_layer`: the cache slice holds S positions, row b's first
    `cache_len[b]` valid; `mask_BxTxA` (A = S + T) is the fast path's mask over the
    concatenation [cache, new] (cache part `s < cache_len[b]`, new part causal and valid), from
    which cache_len and the valid new keys are read back. The new keys are placed at their
    absolute positions `cache_len[b] + t` in a copy of the cache padded to whole
    `policy.kv_block` blocks, so a key's block and offset never depend on the step shape; masked
    positions get probability exactly 0.

    Returns:
      `[B, T, H, K]` attention output in v's dtype (pre output projection).
    """
    B, T, H, K = q_BxTxHxK.shape
    KVH = k_BxTxKVHxK.shape[2]
    G = H // KVH
    Sb = policy.kv_block
    S = 0 if cache_k_BxSxKVHxK is None else cache_k_BxSxKVHxK.shape[1]
    n_blk = -(-(S + T) // Sb)
    S_att = n_blk * Sb
    cache_len_B = jnp.sum(mask_BxTxA[:, 0, :S], axis=-1).astype(jnp.int32)
    new_valid_BxT = mask_BxTxA[:, T - 1, S:]
    rows_Bx1 = jnp.arange(B)[:, None]
    cols_BxT = cache_len_B[:, None] + jnp.arange(T)[None, :]

    def place(cache, new):
        pad = jnp.zeros((B, S_att - S) + new.shape[2:], new.dtype)
        full = pad if cache is None else jnp.concatenate([cache.astype(new.dtype), pad], axis=1)
        return full.at[rows_Bx1, cols_BxT].set(new)

    keys_BxAxKVHxK = place(cache_k_BxSxKVHxK, k_BxTxKVHxK)
    values_BxAxKVHxK = place(cache_v_BxSxKVHxK, v_BxTxKVHxK)
    key_ok_BxA = jnp.concatenate([jnp.arange(S)[None, :] < cache_len_B[:, None],
                                  jnp.zeros((B, S_att - S), bool)], axis=1)
    key_ok_BxA = key_ok_BxA.at[rows_Bx1, cols_BxT].set(new_valid_BxT)
    qpos_BxT = cols_BxT
    mask_BxTxA2 = key_ok_BxA[:, None, :] & (jnp.arange(S_att)[None, None, :] <= qpos_BxT[..., None])

    # Blocks: [B, KVH, nblk, Sb, K]; queries broadcast over blocks: [B, KVH, nblk, G, T, K].
    kb = keys_BxAxKVHxK.reshape(B, n_blk, Sb, KVH, K).transpose(0, 3, 1, 2, 4)
    vb = values_BxAxKVHxK.reshape(B, n_blk, Sb, KVH, K).transpose(0, 3, 1, 2, 4)
    q6 = q_BxTxHxK.reshape(B, T, KVH, G, K).transpose(0, 2, 3, 1, 4)[:, :, None]
    q6 = jnp.broadcast_to(q6, (B, KVH, n_blk, G, T, K))
    scores = einsum(policy, "bncgtk,bncsk->bncgts", q6, kb, rows="gt",
                    preferred_element_type=jnp.float32) * (K ** -0.5)
    mask6 = mask_BxTxA2.reshape(B, T, n_blk, Sb).transpose(0, 2, 1, 3)[:, None, :, None]
    scores = jnp.where(mask6, scores, _MASK_VALUE)
    m = row_max(policy, row_max(policy, scores, axis=5, keepdims=True), axis=2, keepdims=True)
    e = jnp.exp(scores - m)
    denom = row_sum(policy, row_sum(policy, e, axis=5, keepdims=True), axis=2, keepdims=True)
    # Unnormalised weights through the value contraction, one division at the end.
    out_blk = einsum(policy, "bncgts,bncsk->bncgtk", e.astype(v_BxTxKVHxK.dtype), vb, rows="gt",
                     preferred_element_type=jnp.float32)
    out_BxKVHxGxTxK = (row_sum(policy, out_blk, axis=2) / denom[:, :, 0]).astype(
        v_BxTxKVHxK.dtype)
    return out_BxKVHxGxTxK.transpose(0, 3, 1, 2, 4).reshape(B, T, H, K)
