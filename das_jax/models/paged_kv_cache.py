"""The paged KV cache: a pool of fixed-size pages and a page table per row.

`PagedKVCache` has the owner-of-layout surface of `DenseKVCache` (`das_jax.models.kv_cache`), so
the packed steps run on either unchanged; only where a row's positions live differs:

    k: [L, P, KVH, K, page]   post-RoPE keys of P pages (head-major within a page, as the dense
                              cache: attention contracts `q [M, K] @ k [K, page]`)
    v: [L, P, KVH, page, K]   values
    table: int32 [B, MP]      page id of each row's positions [j*page, (j+1)*page); an entry
                              equal to P (`num_pages`) is unallocated

Position t of row b is page `table[b, t // page]`, offset `t % page`. The host owns the table
(`das_jax.engine.pages.PagePool`: free list, reference counts, sharing) and replaces the `table`
leaf between programs; the programs only read it. So memory follows the pages rows hold, not
`B * max_len`; a GRPO group's rows point at the same prompt pages; a compaction is a permutation
of the table's rows, not a copy of the cache.

Reads (`attended`) hand attention a `PagedView` (`das_jax.models.paged_attention`), read by
the cache's `kernel`: "auto" is a Pallas kernel over each row's own pages when the program is
lowered for TPU, and elsewhere (CPU, CUDA: the Triton kernel was slower there, run it by name,
"pallas_gpu") the gather of a row's first `ceil(kv_len / page)` pages into the dense attended
view, after which attention runs exactly as on the dense cache:
a paged step gives the dense step's tokens and log-probs (bitwise in exact mode, which always
gathers: a page boundary is not a reduction boundary, the view's valid positions hold the same
values, and positions at or past a row's length are masked as in the dense cache). Unallocated
entries read page `P - 1` (finite values, never attended); writes to them are dropped.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from das_jax.models.config import ModelConfig
from das_jax.models.kv_cache import DenseKVCache
from das_jax.models.paged_attention import PagedView

# Logical axes of each leaf (the sharding rules' names, `das_jax.parallel`): pages are not
# split (a row's pages may be anywhere in the pool); KV heads follow the dense cache's rule.
K_AXES = ("layers", None, "kv_heads", "head_dim", None)
V_AXES = ("layers", None, "kv_heads", None, "head_dim")
TABLE_AXES = (None, None)


def pages_for(length, page_size: int):
    """Pages holding positions `[0, length)` (int or int array)."""
    return -(-length // page_size)


@flax.struct.dataclass
class PagedKVCache:
    """Paged key/value cache (module docstring): `k: [L, P, KVH, K, page]`,
    `v: [L, P, KVH, page, K]`, `table: int32 [B, MP]` (P = unallocated)."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    # Static (part of a program's compile key): which implementation reads the pages
    # (`paged_attention.KERNELS`; "auto": the lowering platform's kernel) and whether a Pallas
    # kernel runs in interpret mode (tests on CPU).
    kernel: str = flax.struct.field(pytree_node=False, default="auto")
    interpret: bool = flax.struct.field(pytree_node=False, default=False)

    # ------------------------------------------------------------------ construction and size
    @staticmethod
    def shapes(config: ModelConfig, batch: int, max_len: int, num_pages: int, page_size: int
               ) -> tuple[tuple, tuple, tuple]:
        """(k, v, table) shapes: `num_pages` pages of `page_size` positions; `batch` rows of
        `ceil(max_len / page_size)` table entries."""
        L, KVH, K = config.num_layers, config.num_kv_heads, config.head_dim
        return ((L, num_pages, KVH, K, page_size), (L, num_pages, KVH, page_size, K),
                (batch, pages_for(max_len, page_size)))

    @staticmethod
    def logical_axes() -> dict[str, tuple]:
        """Logical axis names of each leaf, by field (`das_jax.engine.placement`)."""
        return {"k": K_AXES, "v": V_AXES, "table": TABLE_AXES}

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, num_pages: int,
              page_size: int, dtype=jnp.float32, kernel: str = "auto") -> "PagedKVCache":
        """An empty pool with every table entry unallocated, read by `kernel`."""
        ks, vs, ts = cls.shapes(config, batch, max_len, num_pages, page_size)
        return cls(k=jnp.zeros(ks, dtype), v=jnp.zeros(vs, dtype),
                   table=jnp.full(ts, num_pages, jnp.int32), kernel=kernel)

    @classmethod
    def abstract(cls, config: ModelConfig, batch: int, max_len: int, num_pages: int,
                 page_size: int, dtype=jnp.float32, kernel: str = "auto") -> "PagedKVCache":
        """`jax.ShapeDtypeStruct` leaves of the same layout (for lowering without allocating)."""
        ks, vs, ts = cls.shapes(config, batch, max_len, num_pages, page_size)
        return cls(k=jax.ShapeDtypeStruct(ks, jnp.dtype(dtype)),
                   v=jax.ShapeDtypeStruct(vs, jnp.dtype(dtype)),
                   table=jax.ShapeDtypeStruct(ts, jnp.int32), kernel=kernel)

    # Bytes of K and V for one position, all layers: the dense cache's.
    bytes_per_position = staticmethod(DenseKVCache.bytes_per_position)

    @classmethod
    def nbytes_for(cls, config: ModelConfig, num_pages: int, page_size: int, dtype) -> int:
        """Bytes of a pool of `num_pages` pages (the table excluded: 4 bytes per entry)."""
        return num_pages * page_size * cls.bytes_per_position(config, dtype)

    # ------------------------------------------------------------------ shape
    @property
    def page_size(self) -> int:
        return self.k.shape[-1]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * self.page_size

    @property
    def dtype(self):
        return self.k.dtype

    # ------------------------------------------------------------------ reads
    def layers(self):
        """The per-layer pytree run with the layer params: the layer indices, int32 `[L]`.
        Attention reads layer l's pages from the stacked pools in place (`attended`): a scan
        or an unrolled loop slicing the pools per layer would copy each layer's whole pool
        before a kernel's call (XLA passes a custom call whole buffers)."""
        return jnp.arange(self.k.shape[0], dtype=jnp.int32)

    def read_len(self, kv_len: int, in_place: bool) -> int:
        """The positions attention reads: `kv_len` (the pages are gathered or read by a
        kernel, never sliced; `DenseKVCache.read_len`)."""
        return kv_len

    def attended(self, layer, kv_len: int) -> PagedView:
        """Layer `layer`'s pages (its entry of `layers()`) as attention reads them
        (`das_jax.models.paged_attention`): a `PagedView` of the stacked pools and the layer
        index, the table, `kv_len` and this cache's kernel; its `dense()` is the dense cache's
        view `(k [B, KVH, K, kv_len], v [B, KVH, kv_len, K])`."""
        return PagedView(self.k, self.v, self.table, kv_len, self.kernel, self.interpret,
                         layer)

    def page_at(self, rows_N, positions_N):
        """int32 `[N]` page id holding (row, position); P (dropped on write) for a row >= B, a
        position past the table or an unallocated entry."""
        B, MP, page = self.batch, self.table.shape[1], self.page_size
        rows_N, positions_N = jnp.asarray(rows_N), jnp.asarray(positions_N)
        ids = self.table[jnp.minimum(rows_N, B - 1),
                         jnp.clip(positions_N // page, 0, MP - 1)]
        ok = (rows_N < B) & (positions_N >= 0) & (positions_N < MP * page)
        return jnp.where(ok, ids, self.num_pages).astype(jnp.int32)

    # ------------------------------------------------------------------ writes
    def write_slots(self, k_new_LxNxKVHxK, v_new_LxNxKVHxK, rows_N, positions_N
                    ) -> "PagedKVCache":
        """Stores packed token slot i at row `rows_N[i]`, position `positions_N[i]` in every
        layer (one scatter per leaf); padding slots (row >= B), positions past the table and
        unallocated pages are dropped."""
        page_N = self.page_at(rows_N, positions_N)
        off_N = jnp.asarray(positions_N) % self.page_size
        # Separated advanced indices: the indexed block is `[N, L, KVH, K]` in both leaves.
        return self.replace(
            k=self.k.at[:, page_N, :, :, off_N].set(
                k_new_LxNxKVHxK.transpose(1, 0, 2, 3).astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, page_N, :, off_N].set(
                v_new_LxNxKVHxK.transpose(1, 0, 2, 3).astype(self.v.dtype), mode="drop"))

    def write(self, k_new_LxBxTxKVHxK, v_new_LxBxTxKVHxK, cache_len_B) -> "PagedKVCache":
        """Stores token t of row b at position `cache_len_B[b] + t` in every layer."""
        L, B, T = k_new_LxBxTxKVHxK.shape[:3]
        rows = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
        pos = (cache_len_B[:, None] + jnp.arange(T)[None, :]).reshape(-1)
        flat = (lambda a: a.reshape(L, B * T, *a.shape[3:]))
        return self.write_slots(flat(k_new_LxBxTxKVHxK), flat(v_new_LxBxTxKVHxK), rows, pos)

    def insert_rows(self, slots_R, src, src_R) -> "PagedKVCache":
        """Writes positions `[0, src.max_len)` of rows `src_R` of a dense (prefill scratch) cache
        into rows `slots_R` through their pages; a slot >= B is dropped (padding), as are
        positions on unallocated pages. Entry by entry: the scratch is one row of `src`, never
        the R rows gathered."""
        L, _, KVH, K, T = src.k.shape
        pos = jnp.arange(T, dtype=jnp.int32)

        def body(j, cache):
            k = jax.lax.dynamic_index_in_dim(src.k, src_R[j], 1, keepdims=False)
            v = jax.lax.dynamic_index_in_dim(src.v, src_R[j], 1, keepdims=False)
            rows = jnp.full((T,), slots_R[j], jnp.int32)
            return cache.write_slots(k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3), rows, pos)

        return jax.lax.fori_loop(0, slots_R.shape[0], body, self)

    def copy_pages(self, dst_R, src_R) -> "PagedKVCache":
        """Copies page `src_R[j]` onto page `dst_R[j]` (all layers; a destination >= P is
        dropped). The copy-on-write of a shared prompt's partial last page."""
        return self.replace(k=self.k.at[:, dst_R].set(self.k[:, src_R], mode="drop"),
                            v=self.v.at[:, dst_R].set(self.v[:, src_R], mode="drop"))

    def gather_rows(self, rows_B) -> "PagedKVCache":
        """A cache of `len(rows_B)` rows taken from this one: the same pool, the table's rows
        permuted (no K/V is copied; repeated rows share pages, read-only padding)."""
        return self.replace(table=self.table[jnp.asarray(rows_B, jnp.int32)])

    def with_table(self, table) -> "PagedKVCache":
        """This pool with `table` as its page table (int32 `[B', MP]`)."""
        return self.replace(table=table)
