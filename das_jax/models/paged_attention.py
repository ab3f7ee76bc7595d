"""Attention of packed queries over each row's own KV pages: one contract, a kernel per backend.

The cached-prefix half of `decode_attention.attend_cache` on a paged cache
(`das_jax.models.paged_kv_cache`). For every row b and KV head n, the queries `q [M, K]`
(M = G query heads x T new tokens of the row) attend to the row's first `cache_len_B[b]` cached
positions, read page by page through the row's page table. The result is the flash-attention
partial state of that key block (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"; Dao et al. 2022, FlashAttention, Alg. 1):

    m [B, KVH, M]      float32 running max of the scores  (MASK_VALUE where the row has no cache)
    l [B, KVH, M]      float32 sum of exp(score - m)       (0 where the row has no cache)
    o [B, KVH, M, K]   float32 sum of exp(score - m) * v   (unnormalised)

which `attend_cache` merges with the row's own new keys (one max, one denominator over both
blocks), so the full softmax never needs the cached keys and the new ones side by side.

Implementations (same contract, same arguments):

* `prefix_partials_reference`: an XLA gather of the row's first `ceil(kv_len / page)` pages
  into a dense view, then masked einsums. The CPU path and the oracle of the tests.
* `prefix_partials_tpu`: a Pallas TPU (Mosaic) kernel. Grid (row, KV head, page); the layer index,
  page table and lengths are scalar-prefetched, so each grid step's K/V block is the row's page
  `table[b, j]` itself (the pipeline DMAs it from HBM); steps past the row's last page repeat its
  block index (no copy) and skip the compute, so a row reads its own pages, not the bucket.
* `prefix_partials_gpu`: a Pallas GPU (Triton) kernel. Grid (row, KV head, key partition): the
  row's pages are split into partitions (split-K, as in flash decoding) so a few long rows fill
  the SMs; each program walks its partition a block of pages at a time (every page's load of a
  block issued before its scores are used) and the partitions' partial states are merged by one
  log-sum-exp (`merge_partials`). `GpuKernelTuning` is the launch shape. M is padded to a power
  of two >= 16 (Triton's dot).

All three read one layer of the stacked pools `[L, P, ...]` in place, given the layer index
(`PagedKVCache.layers()` hands the layer loop indices, not slices): slicing a layer out of the
pools before a kernel's call is a copy of the whole layer (XLA passes a custom call whole
buffers), which would cost more than the kernel's reads (docs/results/paged-kv-cache.md).

`attend_cache`'s "auto" picks per lowering platform (`jax.lax.platform_dependent`): the TPU
kernel on "tpu", the Triton kernel on "cuda", the gather elsewhere, so an exported program
carries the kernel of the platform it is exported for. Every kernel runs on this CPU with
`interpret=True` (the tests compare them to the reference over random page tables, ragged
lengths, widths, launch shapes and stacked pools).

Tensor names carry shapes: B rows, KVH key/value heads, M queries per (row, KV head), K head
width, P pages in the pool, page positions per page, MP table entries per row.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -1e30  # the score of a masked position (finite: exp(MASK - MASK) is 1, not nan)

#: `PagedKVCache.kernel` values: the platform's choice, or one implementation forced.
KERNELS = ("auto", "gather", "pallas_tpu", "pallas_gpu")


def _check(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B, kv_len: int,
           layer=None):
    B, N, M, K = q_BxNxMxK.shape
    if (k_PxNxKxS.ndim == 5) != (layer is not None):
        raise ValueError(f"paged attention: k pages {k_PxNxKxS.shape} with layer {layer!r}: "
                         "a layer index goes with stacked pools [L, P, KVH, K, page], none "
                         "with one layer's [P, KVH, K, page]")
    P, N2, K2, page = k_PxNxKxS.shape[-4:]
    if (N2, K2) != (N, K) or v_PxNxSxK.shape[-4:] != (P, N, page, K) or \
            v_PxNxSxK.shape[:-4] != k_PxNxKxS.shape[:-4]:
        raise ValueError(f"paged attention: q {q_BxNxMxK.shape}, k pages {k_PxNxKxS.shape} and"
                         f" v pages {v_PxNxSxK.shape} disagree (want k [P, KVH, K, page], "
                         "v [P, KVH, page, K])")
    if table_BxMP.shape[0] != B or cache_len_B.shape != (B,):
        raise ValueError(f"paged attention: table {table_BxMP.shape} and cache_len "
                         f"{cache_len_B.shape} must have q's {B} rows")
    if kv_len > table_BxMP.shape[1] * page:
        raise ValueError(f"paged attention: kv_len {kv_len} is past the table's "
                         f"{table_BxMP.shape[1]} pages of {page}")
    return B, N, M, K, P, page


def _pages_read(kv_len: int, page: int) -> int:
    return -(-kv_len // page)


def prefix_partials_reference(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B,
                              kv_len: int, layer=None):
    """The contract (module docstring) by an XLA gather of each row's pages.

    Args:
      q_BxNxMxK: queries (already scaled by 1/sqrt(K)), any float dtype.
      k_PxNxKxS, v_PxNxSxK: one layer's key and value pages, or (with `layer`) every layer's
        stacked on a leading axis (`[L, P, KVH, K, page]`, `[L, P, KVH, page, K]`).
      table_BxMP: int32 page ids (entries past a row's length may be anything in [0, P]).
      cache_len_B: int32 cached positions per row, each <= kv_len.
      kv_len: static bound on every cache_len (the attended-length bucket).
      layer: int32 scalar (traced or not), the layer of stacked pools to read; None for one
        layer's pages. Every implementation reads the stacked pools in place: a layer's pages
        are never sliced out first (a copy of the whole layer before a kernel's call).

    Returns:
      (o float32 `[B, KVH, M, K]`, m float32 `[B, KVH, M]`, l float32 `[B, KVH, M]`).
    """
    B, N, M, K, P, page = _check(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B,
                                 kv_len, layer)
    k_BxNxKxA, v_BxNxAxK = gather_pages(k_PxNxKxS, v_PxNxSxK, table_BxMP, kv_len, layer)
    dtype = q_BxNxMxK.dtype
    s = jnp.einsum("bnmk,bnka->bnma", q_BxNxMxK, k_BxNxKxA.astype(dtype),
                   preferred_element_type=jnp.float32)
    ok_BxA = jnp.arange(kv_len, dtype=jnp.int32)[None, :] < cache_len_B[:, None]
    s = jnp.where(ok_BxA[:, None, None, :], s, MASK_VALUE)
    m = s.max(-1, initial=MASK_VALUE)
    e = jnp.where(ok_BxA[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum("bnma,bnak->bnmk", e.astype(dtype), v_BxNxAxK.astype(dtype),
                   preferred_element_type=jnp.float32)
    return o, m, e.sum(-1)


def _no_pages(q_BxNxMxK):
    """The contract's partial state of an empty cached block (kv_len 0): o 0, m MASK, l 0."""
    B, N, M, K = q_BxNxMxK.shape
    return (jnp.zeros((B, N, M, K), jnp.float32), jnp.full((B, N, M), MASK_VALUE, jnp.float32),
            jnp.zeros((B, N, M), jnp.float32))


def gather_pages(k_PxNxKxS, v_PxNxSxK, table_BxMP, kv_len: int, layer=None):
    """The first `kv_len` positions of every row gathered from its pages (an XLA gather):
    (k `[B, KVH, K, kv_len]`, v `[B, KVH, kv_len, K]`), the dense cache's view. Unallocated
    entries (P) read page P - 1: finite values, masked by the caller. With `layer`, the pools
    are every layer's stacked and the gather reads layer `layer`'s pages from them."""
    P, KVH, K, page = k_PxNxKxS.shape[-4:]
    B = table_BxMP.shape[0]
    n = _pages_read(kv_len, page)
    if n == 0:
        return (jnp.zeros((B, KVH, K, 0), k_PxNxKxS.dtype),
                jnp.zeros((B, KVH, 0, K), v_PxNxSxK.dtype))
    ids_BxN = jnp.minimum(table_BxMP[:, :n], P - 1)
    if layer is None:
        k_BxNxHxKxS, v_BxNxHxSxK = k_PxNxKxS[ids_BxN], v_PxNxSxK[ids_BxN]
    else:
        k_BxNxHxKxS, v_BxNxHxSxK = k_PxNxKxS[layer, ids_BxN], v_PxNxSxK[layer, ids_BxN]
    k = k_BxNxHxKxS.transpose(0, 2, 3, 1, 4).reshape(B, KVH, K, n * page)
    v = v_BxNxHxSxK.transpose(0, 2, 1, 3, 4).reshape(B, KVH, n * page, K)
    return k[..., :kv_len], v[:, :, :kv_len]


# ---------------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(layer_ref, table_ref, len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, m_s,
                l_s, o_s, *, page: int):
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_s[...] = jnp.full(m_s.shape, MASK_VALUE, jnp.float32)
        l_s[...] = jnp.zeros(l_s.shape, jnp.float32)
        o_s[...] = jnp.zeros(o_s.shape, jnp.float32)

    n = len_ref[b]

    @pl.when(j * page < n)
    def _page():
        q = q_ref[...]
        s_MxS = jnp.dot(q, k_ref[...].astype(q.dtype), preferred_element_type=jnp.float32)
        pos = j * page + jax.lax.broadcasted_iota(jnp.int32, s_MxS.shape, 1)
        s_MxS = jnp.where(pos < n, s_MxS, MASK_VALUE)
        m_prev = m_s[...]
        m_next = jnp.maximum(m_prev, s_MxS.max(-1, keepdims=True))
        p_MxS = jnp.where(pos < n, jnp.exp(s_MxS - m_next), 0.0)
        corr = jnp.exp(m_prev - m_next)
        l_s[...] = corr * l_s[...] + p_MxS.sum(-1, keepdims=True)
        o_s[...] = corr * o_s[...] + jnp.dot(p_MxS.astype(q.dtype), v_ref[...].astype(q.dtype),
                                             preferred_element_type=jnp.float32)
        m_s[...] = m_next

    @pl.when(j == pl.num_programs(2) - 1)
    def _out():
        o_ref[...] = o_s[...]
        m_ref[...] = m_s[...]
        l_ref[...] = l_s[...]


def _stacked(k_PxNxKxS, v_PxNxSxK, layer):
    """(k `[L, P, KVH, K, page]`, v `[L, P, KVH, page, K]`, int32 `[1]` layer): one layer's
    pages get a leading axis of 1 (a reshape, no copy) and layer 0."""
    if layer is None:
        return k_PxNxKxS[None], v_PxNxSxK[None], jnp.zeros((1,), jnp.int32)
    return k_PxNxKxS, v_PxNxSxK, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def prefix_partials_tpu(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B, kv_len: int,
                        layer=None, *, interpret: bool = False):
    """The contract by the Pallas TPU kernel (module docstring); arguments and returns as
    `prefix_partials_reference`. `interpret=True` runs it on any backend. The layer index is
    scalar-prefetched with the table: each grid step's block is (layer, page) of the stacked
    pools, DMA'd in place."""
    B, N, M, K, P, page = _check(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B,
                                 kv_len, layer)
    n = _pages_read(kv_len, page)
    if n == 0:
        return _no_pages(q_BxNxMxK)
    k_pool, v_pool, layer_1 = _stacked(k_PxNxKxS, v_PxNxSxK, layer)

    def page_block(b, h, j, layer_ref, table_ref, len_ref):
        # Past the row's last page: that page again (the pipeline skips a repeated block).
        last = jnp.maximum(pl.cdiv(len_ref[b], page) - 1, 0)
        return (layer_ref[0], jnp.clip(table_ref[b, jnp.minimum(j, last)], 0, P - 1), h, 0, 0)

    row = lambda b, h, j, lr, t, ln: (b, h, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(B, N, n),
        in_specs=[pl.BlockSpec((None, None, M, K), row),
                  pl.BlockSpec((None, None, None, K, page), page_block),
                  pl.BlockSpec((None, None, None, page, K), page_block)],
        out_specs=[pl.BlockSpec((None, None, M, K), row),
                   pl.BlockSpec((None, None, M, 1), row),
                   pl.BlockSpec((None, None, M, 1), row)],
        scratch_shapes=[pltpu.VMEM((M, 1), jnp.float32), pltpu.VMEM((M, 1), jnp.float32),
                        pltpu.VMEM((M, K), jnp.float32)])
    o, m, l = pl.pallas_call(
        functools.partial(_tpu_kernel, page=page), grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, N, M, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, M, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, M, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name="das_paged_prefix_attention",
    )(layer_1, table_BxMP.astype(jnp.int32), cache_len_B.astype(jnp.int32), q_BxNxMxK, k_pool,
      v_pool)
    return o, m[..., 0], l[..., 0]


# ---------------------------------------------------------------------------------- GPU (Triton)
@dataclasses.dataclass(frozen=True)
class GpuKernelTuning:
    """Launch shape of the Triton kernel (`prefix_partials_gpu`).

    pages_per_block: pages each loop iteration loads and scores together (unrolled, so their
      loads are in flight at once); split_pages: the key axis is split into partitions of about
      this many pages, one program each (so a long row at a small batch fills the SMs), merged
      by one log-sum-exp in XLA; max_splits: at most this many partitions per (row, KV head);
      num_warps / num_stages: Triton's.
    """

    pages_per_block: int = 4
    split_pages: int = 64
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def splits(self, pages: int) -> int:
        """Partitions of the key axis for a bound of `pages` pages per row."""
        return max(1, min(self.max_splits, -(-pages // self.split_pages)))


#: The Triton kernel's launch shape where the caller names none (a benchmark may replace it
#: before compiling: `gpu_lease_check`'s paged part sweeps it).
GPU_TUNING = GpuKernelTuning()


def _gpu_kernel(q_ref, k_ref, v_ref, table_ref, len_ref, layer_ref, o_ref, m_ref, l_ref, *,
                page: int, pages_per_split: int, pages_per_block: int, pool: int):
    n = len_ref[0]
    lyr = layer_ref[0]
    q = q_ref[...]
    M, K = q.shape
    first = pl.program_id(2) * pages_per_split
    row_pages = jnp.minimum((n + page - 1) // page - first, pages_per_split)

    def body(j, carry):
        o, m, l = carry
        s, ok = [], []
        for i in range(pages_per_block):   # unrolled: every page's load is issued up front
            idx = first + j * pages_per_block + i
            pid = jnp.minimum(table_ref[idx], pool - 1)
            pos = idx * page + jnp.arange(page, dtype=jnp.int32)[None, :]
            ok.append(pos < n)
            s.append(jnp.where(ok[-1], plgpu.dot(q, k_ref[lyr, pid].astype(q.dtype)),
                               MASK_VALUE))
        m_next = functools.reduce(jnp.maximum, [x.max(-1) for x in s], m)
        corr = jnp.exp(m - m_next)
        o, l = corr[:, None] * o, corr * l
        for i in range(pages_per_block):
            idx = first + j * pages_per_block + i
            pid = jnp.minimum(table_ref[idx], pool - 1)
            p_MxS = jnp.where(ok[i], jnp.exp(s[i] - m_next[:, None]), 0.0)
            o = o + plgpu.dot(p_MxS.astype(q.dtype), v_ref[lyr, pid].astype(q.dtype))
            l = l + p_MxS.sum(-1)
        return o, m_next, l

    init = (jnp.zeros((M, K), jnp.float32), jnp.full((M,), MASK_VALUE, jnp.float32),
            jnp.zeros((M,), jnp.float32))
    steps = (jnp.maximum(row_pages, 0) + pages_per_block - 1) // pages_per_block
    o, m, l = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def merge_partials(o_BxNxSxMxK, m_BxNxSxM, l_BxNxSxM):
    """The partial states of S disjoint key blocks merged into one (axis 2): the max of the
    maxima, each block's sums rescaled to it (the log-sum-exp merge of FlashAttention's
    split-K decoding). Empty blocks (m MASK, l 0, o 0) contribute nothing."""
    m = m_BxNxSxM.max(2)
    w = jnp.exp(m_BxNxSxM - m[:, :, None])
    return ((o_BxNxSxMxK * w[..., None]).sum(2), m, (l_BxNxSxM * w).sum(2))


def prefix_partials_gpu(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B, kv_len: int,
                        layer=None, *, interpret: bool = False,
                        tuning: GpuKernelTuning | None = None):
    """The contract by the Pallas GPU (Triton) kernel (module docstring); arguments and returns
    as `prefix_partials_reference`. `interpret=True` runs it on any backend; `tuning` is the
    launch shape (default `GPU_TUNING`). The table's entries past a row's length are never
    used (an iteration's pages past it are read from a clamped id and masked). The stacked
    pools are the call's operands whole and the kernel indexes (layer, page) in them."""
    B, N, M, K, P, page = _check(q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B,
                                 kv_len, layer)
    n = _pages_read(kv_len, page)
    if n == 0:
        return _no_pages(q_BxNxMxK)
    k_pool, v_pool, layer_1 = _stacked(k_PxNxKxS, v_PxNxSxK, layer)
    L = k_pool.shape[0]
    t = GPU_TUNING if tuning is None else tuning
    S = t.splits(n)
    ppb = min(t.pages_per_block, -(-n // S))
    per_split = -(-(-(-n // S)) // ppb) * ppb    # pages per partition, whole blocks
    Mp = max(16, 1 << (M - 1).bit_length())  # Triton: power-of-two blocks, dot dims >= 16
    q = jnp.pad(q_BxNxMxK, ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
    table = table_BxMP[:, :n].astype(jnp.int32)
    table = jnp.pad(table, ((0, 0), (0, S * per_split - n)))
    kernel = functools.partial(_gpu_kernel, page=page, pages_per_split=per_split,
                               pages_per_block=ppb, pool=P)
    o, m, l = pl.pallas_call(
        kernel, grid=(B, N, S),
        in_specs=[pl.BlockSpec((None, None, Mp, K), lambda b, h, s: (b, h, 0, 0)),
                  pl.BlockSpec((L, P, None, K, page), lambda b, h, s: (0, 0, h, 0, 0)),
                  pl.BlockSpec((L, P, None, page, K), lambda b, h, s: (0, 0, h, 0, 0)),
                  pl.BlockSpec((None, S * per_split), lambda b, h, s: (b, 0)),
                  pl.BlockSpec((1,), lambda b, h, s: (b,)),
                  pl.BlockSpec((1,), lambda b, h, s: (0,))],
        out_specs=[pl.BlockSpec((None, None, None, Mp, K), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, Mp), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, Mp), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, N, S, Mp, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, S, Mp), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, S, Mp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret, name="das_paged_prefix_attention",
    )(q, k_pool, v_pool, table, cache_len_B.astype(jnp.int32), layer_1)
    o, m, l = (o[:, :, 0], m[:, :, 0], l[:, :, 0]) if S == 1 else merge_partials(o, m, l)
    return o[:, :, :M], m[:, :, :M], l[:, :, :M]


# ---------------------------------------------------------------------------------- dispatch
#: The custom-call target of a Triton kernel in a CUDA lowering (an exported program holding
#: one must name it in `jax.export`'s `disabled_checks`: Triton IR has no stability guarantee).
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def prefix_partials(kernel: str, interpret: bool, q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP,
                    cache_len_B, kv_len: int, layer=None):
    """The contract by one implementation: `kernel` "gather" (the reference), "pallas_tpu" or
    "pallas_gpu" (the platform choice of "auto" is made by the caller, `attend_cache`, so the
    CPU keeps its one-softmax path). Arguments and returns as `prefix_partials_reference`.

    Raises:
      ValueError: an unknown `kernel`, or inconsistent shapes.
    """
    args = (q_BxNxMxK, k_PxNxKxS, v_PxNxSxK, table_BxMP, cache_len_B, kv_len, layer)
    if kernel == "gather":
        return prefix_partials_reference(*args)
    if kernel == "pallas_tpu":
        return prefix_partials_tpu(*args, interpret=interpret)
    if kernel == "pallas_gpu":
        return prefix_partials_gpu(*args, interpret=interpret)
    raise ValueError(f"paged attention kernel {kernel!r}: expected one of {KERNELS[1:]}")


@dataclasses.dataclass(frozen=True)
class PagedView:
    """One layer of a paged cache as attention reads it (`PagedKVCache.attended`): the pages,
    the page table, the attended bound and the kernel that reads them.

    k_PxNxKxS / v_PxNxSxK: the layer's key / value pages, or every layer's stacked
    (`[L, P, KVH, K, page]` / `[L, P, KVH, page, K]`) with `layer` the one read (int32 scalar,
    traced in a scanned layer loop): every implementation then reads the stacked pools in
    place; table_BxMP: int32 page ids; kv_len: static bound on every row's cached length;
    kernel: one of `KERNELS`; interpret: run a Pallas kernel in interpret mode (any backend;
    for tests).
    """

    k_PxNxKxS: jax.Array
    v_PxNxSxK: jax.Array
    table_BxMP: jax.Array
    kv_len: int
    kernel: str = "auto"
    interpret: bool = False
    layer: jax.Array | int | None = None

    def dense(self):
        """`gather_pages` of this layer: the dense cache's view (k `[B, KVH, K, kv_len]`,
        v `[B, KVH, kv_len, K]`)."""
        return gather_pages(self.k_PxNxKxS, self.v_PxNxSxK, self.table_BxMP, self.kv_len,
                            self.layer)

    def partials(self, kernel: str, q_BxNxMxK, cache_len_B):
        """`prefix_partials(kernel, ...)` of these pages: (o, m, l) float32."""
        return prefix_partials(kernel, self.interpret, q_BxNxMxK, self.k_PxNxKxS,
                               self.v_PxNxSxK, self.table_BxMP, cache_len_B, self.kv_len,
                               self.layer)
