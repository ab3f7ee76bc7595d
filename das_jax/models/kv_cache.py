"""The rollout KV cache: a type that owns its layout, so a paged cache can sit beside the dense one.

Every user of the cache goes through these operations (and never indexes `k` / `v` directly):

    zeros(config, batch, max_len, dtype)     an empty cache of `batch` rows x `max_len` positions
    nbytes_for(config, batch, max_len, dtype) bytes it would take (sizing from a memory budget)
    layers()                                 the per-layer pytree `forward_hidden` scans over
    read_len(kv_len, in_place)               positions attention reads for an attended length
    attended(layer, kv_len)                  that layer's attended view: keys `[B, KVH, K, kv_len]`,
                                             values `[B, KVH, kv_len, K]`
    write(k_new, v_new, cache_len_B)         store new tokens' K/V at positions cache_len[b] + t
    write_slots(k_new, v_new, rows, pos)     store packed token slots' K/V at (row, position)
    insert_rows(slots_R, src, src_R)         copy rows of a (prefill scratch) cache into slots
    copy_prefix(dst_R, src_R, save_R, from_stash_R, width)
                                             copy positions [0, width) between rows, in place
    gather_rows(rows_B)                      a cache of the given rows (tail compaction)

`DenseKVCache` (alias `KVCache`) stores post-RoPE keys `k: [L, B, KVH, K, S]` and values
`v: [L, B, KVH, S, K]`, head-major: each (row, KV head) holds its keys as one contiguous `[K, S]`
block and its values as one `[S, K]` block, so the attention's two contractions,
`q [M, K] @ k [K, S]` and `p [M, S] @ v [S, K]`, are plain batched matrix products over
(row, head) with no transposed operand and no transpose of the attended cache (keys stored
`[S, K]`, contracted on their last axis, are slower on XLA CPU; the comparison is in
docs/results/engine.md). Row b holds `cache_len[b]` valid positions (tracked by
the caller); positions at or past `cache_len` are garbage and are never attended, so rejected
draft tokens are rolled back by not advancing `cache_len`. Its memory is `B * S` positions
whether rows are short or long, which is what makes
long-tail RL rollouts (a few 16K-token rows among many short ones) expensive:
`2 * L * KVH * K * bytes` per position (Qwen2-7B bf16: 57 KB; 256 rows x 17,408: 256 GB).

The paged cache (`das_jax.models.paged_kv_cache.PagedKVCache`, `rollout.kv_cache: paged`) has the
same operations over a pool of pages and a page table per row; the host side (free list,
reference counts, shared prompt pages) is `das_jax.engine.pages.PagePool`.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.config import ModelConfig


# Logical axes of each leaf (the sharding rules' names, `das_jax.parallel`).
K_AXES = ("layers", "batch", "kv_heads", "head_dim", "length")
V_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


#: `DenseKVCache.read_len` reads the whole layer when the attended length is at least 1 / this
#: of the cache (a sliced read costs ~3 passes over the slice: copy in, copy out, read).
FULL_READ_RATIO = 3

@flax.struct.dataclass
class DenseKVCache:
    """Dense key/value cache: keys `k: [L, B, KVH, K, S]`, values `v: [L, B, KVH, S, K]`
    (module docstring)."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def shapes(config: ModelConfig, batch: int, max_len: int) -> tuple[tuple, tuple]:
        """(k shape, v shape) of a cache of `batch` rows x `max_len` positions."""
        L, KVH, K = config.num_layers, config.num_kv_heads, config.head_dim
        return (L, batch, KVH, K, max_len), (L, batch, KVH, max_len, K)

    @staticmethod
    def logical_axes() -> dict[str, tuple[str, ...]]:
        """Logical axis names of each leaf, by field (`das_jax.engine.placement`)."""
        return {"k": K_AXES, "v": V_AXES}

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32
              ) -> "DenseKVCache":
        ks, vs = cls.shapes(config, batch, max_len)
        return cls(k=jnp.zeros(ks, dtype), v=jnp.zeros(vs, dtype))

    @classmethod
    def abstract(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32
                 ) -> "DenseKVCache":
        """`jax.ShapeDtypeStruct` leaves of the same layout (for lowering without allocating)."""
        ks, vs = cls.shapes(config, batch, max_len)
        return cls(k=jax.ShapeDtypeStruct(ks, jnp.dtype(dtype)),
                   v=jax.ShapeDtypeStruct(vs, jnp.dtype(dtype)))

    @staticmethod
    def bytes_per_position(config: ModelConfig, dtype) -> int:
        """Bytes of K and V for one position of one row, all layers."""
        return (2 * config.num_layers * config.num_kv_heads * config.head_dim
                * np.dtype(jnp.dtype(dtype)).itemsize)

    @classmethod
    def nbytes_for(cls, config: ModelConfig, batch: int, max_len: int, dtype) -> int:
        """Bytes of a `zeros(config, batch, max_len, dtype)` cache."""
        return batch * max_len * cls.bytes_per_position(config, dtype)

    @property
    def max_len(self) -> int:
        return self.v.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def dtype(self):
        return self.k.dtype

    def layers(self):
        """The per-layer pytree scanned with the layer params: (k_l `[B, KVH, K, S]`,
        v_l `[B, KVH, S, K]`)."""
        return (self.k, self.v)

    def read_len(self, kv_len: int, in_place: bool) -> int:
        """The positions attention reads for an attended length `kv_len`: kv_len, or S (the
        whole layer, masked past each row's length) when `in_place` (the layer loop hands each
        layer's cache over without a copy: unrolled, `models.layer_loop`) and
        `FULL_READ_RATIO * kv_len >= S`. A slice of the position axis is not a view: XLA
        copies it before the attention's matmuls, moving ~3 x kv_len positions (read, write,
        read) where the whole layer moves S."""
        S = self.max_len
        return S if in_place and 0 < kv_len and FULL_READ_RATIO * kv_len >= S else kv_len

    @staticmethod
    def attended(layer, kv_len: int):
        """The first `kv_len` positions of one layer: (k `[B, KVH, K, kv_len]`,
        v `[B, KVH, kv_len, K]`). Slicing per layer inside the scan (not the stacked cache up
        front, which would copy every layer)."""
        k_l, v_l = layer
        return k_l[..., :kv_len], v_l[:, :, :kv_len]

    def write(self, k_new_LxBxTxKVHxK, v_new_LxBxTxKVHxK, cache_len_B) -> "DenseKVCache":
        """Stores token t of row b at position `cache_len_B[b] + t` in every layer (one scatter);
        writes past S are dropped."""
        B, T = k_new_LxBxTxKVHxK.shape[1:3]
        rows_Bx1 = jnp.arange(B)[:, None]
        cols_BxT = cache_len_B[:, None] + jnp.arange(T)[None, :]
        # The two index arrays are split by other axes, so the indexed block is
        # `[B, T, L, KVH, K]` in both leaves (NumPy's rule for separated advanced indices).
        return DenseKVCache(
            k=self.k.at[:, rows_Bx1, :, :, cols_BxT].set(
                k_new_LxBxTxKVHxK.transpose(1, 2, 0, 3, 4).astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, rows_Bx1, :, cols_BxT].set(
                v_new_LxBxTxKVHxK.transpose(1, 2, 0, 3, 4).astype(self.v.dtype), mode="drop"))

    def write_slots(self, k_new_LxNxKVHxK, v_new_LxNxKVHxK, rows_N, positions_N
                    ) -> "DenseKVCache":
        """Stores packed token slot i at row `rows_N[i]`, position `positions_N[i]` in every layer
        (one scatter; the packed verify step). A row index >= B (a padding slot) or a position
        >= S is dropped."""
        # Indexed block `[N, L, KVH, K]` (separated advanced indices, as in `write`).
        return DenseKVCache(
            k=self.k.at[:, rows_N, :, :, positions_N].set(
                k_new_LxNxKVHxK.transpose(1, 0, 2, 3).astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, rows_N, :, positions_N].set(
                v_new_LxNxKVHxK.transpose(1, 0, 2, 3).astype(self.v.dtype), mode="drop"))

    def insert_rows(self, slots_R, src: "DenseKVCache", src_R) -> "DenseKVCache":
        """Copies rows `src_R` of `src` (positions `[0, src.max_len)`) into rows `slots_R`; a slot
        index >= B is dropped (padding of the R bucket). Entry by entry, in place: the scratch
        is one row of `src`, never the R rows gathered (`[L, R, KVH, K, T]`: R x T positions,
        a quarter of the cache at the 7B config's prefill)."""
        L, B, KVH, K, _ = self.k.shape
        T = src.max_len
        ks, vs = (L, 1, KVH, K, T), (L, 1, KVH, T, K)

        def body(j, kv):
            k, v = kv
            ok = slots_R[j] < B
            d = jnp.where(ok, slots_R[j], 0)   # padding: row 0's prefix onto itself
            new_k = jax.lax.dynamic_slice(src.k, (0, src_R[j], 0, 0, 0), ks).astype(k.dtype)
            new_v = jax.lax.dynamic_slice(src.v, (0, src_R[j], 0, 0, 0), vs).astype(v.dtype)
            k = jax.lax.dynamic_update_slice(
                k, jnp.where(ok, new_k, jax.lax.dynamic_slice(k, (0, d, 0, 0, 0), ks)),
                (0, d, 0, 0, 0))
            v = jax.lax.dynamic_update_slice(
                v, jnp.where(ok, new_v, jax.lax.dynamic_slice(v, (0, d, 0, 0, 0), vs)),
                (0, d, 0, 0, 0))
            return k, v

        k, v = jax.lax.fori_loop(0, slots_R.shape[0], body, (self.k, self.v))
        return DenseKVCache(k=k, v=v)

    def copy_prefix(self, dst_R, src_R, save_R, from_stash_R, width: int) -> "DenseKVCache":
        """Copies positions `[0, width)` of row `src_R[j]` into row `dst_R[j]`, entry by entry in
        order (entry j reads the cache as entries < j left it), in place: the scratch is one
        row's `width` positions and a one-row stash, never a second cache. `save_R[j]`: first
        save row `dst_R[j]` to the stash; `from_stash_R[j]`: copy from the stash instead of
        `src_R[j]` (cycles of rows, `schedule.share_order`). A destination >= B is a padding
        entry (no write). All int32 / bool `[R]`; `width` static, <= max_len."""
        L, B, KVH, K, _ = self.k.shape
        ks, vs = (L, 1, KVH, K, width), (L, 1, KVH, width, K)

        def row(a, r, size):
            return jax.lax.dynamic_slice(a, (0, r, 0, 0, 0), size)

        def body(j, carry):
            k, v, stash_k, stash_v = carry
            d = jnp.where(dst_R[j] < B, dst_R[j], src_R[j])   # padding: a row onto itself
            keep = (dst_R[j] < B) & save_R[j]
            stash_k = jnp.where(keep, row(k, d, ks), stash_k)
            stash_v = jnp.where(keep, row(v, d, vs), stash_v)
            from_stash = (dst_R[j] < B) & from_stash_R[j]
            k = jax.lax.dynamic_update_slice(
                k, jnp.where(from_stash, stash_k, row(k, src_R[j], ks)), (0, d, 0, 0, 0))
            v = jax.lax.dynamic_update_slice(
                v, jnp.where(from_stash, stash_v, row(v, src_R[j], vs)), (0, d, 0, 0, 0))
            return k, v, stash_k, stash_v

        k, v, _, _ = jax.lax.fori_loop(
            0, dst_R.shape[0], body,
            (self.k, self.v, jnp.zeros(ks, self.k.dtype), jnp.zeros(vs, self.v.dtype)))
        return DenseKVCache(k=k, v=v)

    def gather_rows(self, rows_B) -> "DenseKVCache":
        """A cache of `len(rows_B)` rows taken from this one (rows may repeat: padding).

        Row by row into the new buffers (a loop of row copies): XLA's gather of the whole
        `[:, rows_B]` keeps one of its two outputs in a temporary as large as that output; this
        loop keeps nothing beside the two caches."""
        rows_B = jnp.asarray(rows_B, jnp.int32)

        def take(a):
            out = jnp.zeros((a.shape[0], rows_B.shape[0], *a.shape[2:]), a.dtype)
            return jax.lax.fori_loop(0, rows_B.shape[0], lambda j, o: (
                jax.lax.dynamic_update_slice_in_dim(
                    o, jax.lax.dynamic_slice_in_dim(a, rows_B[j], 1, 1), j, 1)), out)
        return DenseKVCache(k=take(self.k), v=take(self.v))


KVCache = DenseKVCache
