"""Paged attention kernels (`das_jax.models.paged_attention`): the Pallas TPU and GPU kernels in
interpret mode against the gather reference over random page tables (unallocated entries,
shared pages), ragged lengths (0, page boundaries, the bound) and query widths (G x T, T in
{1, 3, 5}); `attend_cache` with each kernel forced against the dense view; a model's cached
forward on a paged cache read by each kernel against the dense cache. Float32, fixed seeds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.models import paged_attention as pa
from das_jax.models.decode_attention import attend_cache
from das_jax.models.transformer import forward_hidden
from das_jax.testing import (paged_case, paged_kv_cache_like, random_kv_cache,
                             tiny_model_config, tiny_params)

KERNELS = {"pallas_tpu": pa.prefix_partials_tpu, "pallas_gpu": pa.prefix_partials_gpu}


def assert_partials_close(got, want, lens, atol):
    o, m, l = (np.asarray(x, np.float64) for x in got)
    o_w, m_w, l_w = (np.asarray(x, np.float64) for x in want)
    has = np.asarray(lens) > 0
    # A row with no cached positions contributes nothing: l == 0 and o == 0 (m is irrelevant).
    np.testing.assert_array_equal(l[~has], 0)
    np.testing.assert_array_equal(o[~has], 0)
    # The normalised block output and the log-denominator are what the merge uses.
    np.testing.assert_allclose(m[has], m_w[has], atol=atol, rtol=0)
    np.testing.assert_allclose(np.log(l[has]) + m[has], np.log(l_w[has]) + m_w[has], atol=atol,
                               rtol=0)
    np.testing.assert_allclose(o[has] / l[has][..., None], o_w[has] / l_w[has][..., None],
                               atol=atol, rtol=0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("B,KVH,G,T,K,page,kv_len", [
    (4, 2, 2, 1, 8, 4, 13),      # decode: M = 2, lengths cross page boundaries
    (3, 2, 2, 3, 16, 8, 16),     # a draft of 2: M = 6, kv_len on a page boundary
    (5, 1, 4, 5, 8, 4, 9),       # a draft of 4: M = 20 (padded to 32 on the GPU kernel)
    (2, 2, 1, 1, 8, 16, 5),      # one partial page
])
def test_kernels_equal_the_reference(kernel, B, KVH, G, T, K, page, kv_len):
    q, k, v, table, lens = paged_case(B * 31 + T, B, KVH, G * T, K, page, kv_len)
    want = pa.prefix_partials_reference(q, k, v, table, lens, kv_len)
    got = jax.jit(lambda *a: KERNELS[kernel](*a, kv_len, interpret=True))(q, k, v, table, lens)
    assert [x.shape for x in got] == [x.shape for x in want]
    assert all(x.dtype == jnp.float32 for x in got)
    assert_partials_close(got, want, lens, atol=1e-5)


@pytest.mark.parametrize("tuning", [
    pa.GpuKernelTuning(pages_per_block=1, split_pages=1 << 20),   # one program walks a row
    pa.GpuKernelTuning(pages_per_block=3, split_pages=4),   # blocks past the row, 3 splits
    pa.GpuKernelTuning(pages_per_block=2, split_pages=3, max_splits=2),
])
@pytest.mark.parametrize("T,kv_len", [(1, 37), (3, 16)])
def test_gpu_kernel_splits_and_page_blocks_equal_the_reference(tuning, T, kv_len):
    """The Triton kernel's launch shapes (pages per loop iteration, key-axis partitions merged
    by log-sum-exp) change no value: ragged lengths, rows shorter than a partition, empty
    rows, unallocated table entries past a row's length."""
    q, k, v, table, lens = paged_case(11 * T + kv_len, 4, 2, 2 * T, 8, 4, kv_len)
    want = pa.prefix_partials_reference(q, k, v, table, lens, kv_len)
    got = jax.jit(lambda *a: pa.prefix_partials_gpu(*a, kv_len, interpret=True,
                                                    tuning=tuning))(q, k, v, table, lens)
    assert [x.shape for x in got] == [x.shape for x in want]
    assert_partials_close(got, want, lens, atol=1e-5)


@pytest.mark.parametrize("kernel", ["gather", "pallas_tpu", "pallas_gpu"])
def test_kernels_read_a_layer_of_stacked_pools(kernel):
    """Stacked pools `[L, P, ...]` and a traced layer index (as a scanned layer loop passes
    them) read exactly that layer's pages: equal to the kernel on the layer's own pages."""
    q, k, v, table, lens = paged_case(21, 3, 2, 4, 8, 4, 14)
    _, k0, v0, _, _ = paged_case(22, 3, 2, 4, 8, 4, 14)
    k_L, v_L = jnp.stack([k0, k, -k0]), jnp.stack([v0, v, -v0])
    want = pa.prefix_partials(kernel, True, q, k, v, table, lens, 14)
    got = jax.jit(lambda l: pa.prefix_partials(kernel, True, q, k_L, v_L, table, lens, 14,
                                               l))(jnp.int32(1))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="layer index goes with stacked pools"):
        pa.prefix_partials(kernel, True, q, k_L, v_L, table, lens, 14)


def test_merged_partials_equal_one_block():
    """Split-K's merge: two halves of a key block merged equal the whole block's partials."""
    q, k, v, table, lens = paged_case(5, 2, 1, 3, 8, 4, 16)
    lens = jnp.full_like(lens, 16)
    whole = pa.prefix_partials_reference(q, k, v, table, lens, 16)
    halves = [pa.prefix_partials_reference(q, k, v, table[:, h * 2:], jnp.full_like(lens, 8), 8)
              for h in range(2)]
    merged = pa.merge_partials(*(jnp.stack(x, 2) for x in zip(*halves)))
    assert_partials_close(merged, whole, lens, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_read_only_the_rows_pages(kernel):
    """Noise on every page a row does not hold (and past its length on its last page) changes
    nothing."""
    q, k, v, table, lens = paged_case(7, 3, 2, 4, 8, 4, 11, spare=4)
    base = KERNELS[kernel](q, k, v, table, lens, 11, interpret=True)
    held = set()
    k2, v2 = np.array(k), np.array(v)
    for b, n in enumerate(np.asarray(lens)):
        for j in range(-(-int(n) // 4)):
            held.add(int(table[b, j]))
    for p in range(k.shape[0]):
        if p not in held:
            k2[p], v2[p] = 1e4, -1e4
    got = KERNELS[kernel](q, jnp.asarray(k2), jnp.asarray(v2), table, lens, 11, interpret=True)
    for a, b in zip(base, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_in_bfloat16(kernel):
    q, k, v, table, lens = paged_case(3, 3, 2, 6, 16, 8, 24)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    want = pa.prefix_partials_reference(q, k, v, table, lens, 24)
    got = KERNELS[kernel](q, k, v, table, lens, 24, interpret=True)
    assert_partials_close(got, want, lens, atol=2e-2)


def test_bad_shapes_and_kernels_are_errors():
    q, k, v, table, lens = paged_case(0, 2, 2, 2, 8, 4, 8)
    with pytest.raises(ValueError, match="disagree"):
        pa.prefix_partials_reference(q, k, v[..., :4], table, lens, 8)
    with pytest.raises(ValueError, match="past the table"):
        pa.prefix_partials_reference(q, k, v, table, lens, 4 * table.shape[1] + 1)
    with pytest.raises(ValueError, match="expected one of"):
        pa.prefix_partials("flash", False, q, k, v, table, lens, 8)


# ---------------------------------------------------------------------- attend_cache
CFG = tiny_model_config()   # H=4 over KVH=2 (G=2), K=8


def dense_and_paged(seed, B, S, page):
    """A random dense cache and a paged one holding the same positions on permuted pages."""
    dense = random_kv_cache(CFG, batch=B, cache_len=S, seed=seed)
    return dense, paged_kv_cache_like(dense, page, seed + 1)


@pytest.mark.parametrize("kernel", ["gather", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("T", [1, 3, 5])
def test_attend_cache_by_each_kernel_equals_the_dense_view(kernel, T):
    B, S, page, kv_len = 4, 20, 8, 17
    dense, paged = dense_and_paged(T, B, S, page)
    paged = paged.replace(kernel=kernel, interpret=True)
    rng = np.random.default_rng(T)
    H, KVH, K = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((B, T, KVH, K)), jnp.float32)
                    for _ in range(2))
    cache_len = jnp.asarray([0, 8, 17, 5], jnp.int32)
    valid = jnp.asarray(rng.random((B, T)) < 0.8).at[:, 0].set(True)

    @jax.jit
    def both(q, k_new, v_new):
        want = attend_cache(CFG, q, k_new, v_new, dense.attended((dense.k[0], dense.v[0]),
                                                                 kv_len), cache_len, valid,
                            kv_len)
        got = attend_cache(CFG, q, k_new, v_new, paged.attended(0, kv_len), cache_len,
                           valid, kv_len)
        return want, got
    want, got = both(q, k_new, v_new)
    ok = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[ok], np.asarray(want)[ok], atol=1e-5, rtol=0)


def test_auto_reads_the_gathered_view_on_this_cpu():
    """"auto" lowers the default (gather) branch off TPU/CUDA: the same numbers as "gather"."""
    dense, paged = dense_and_paged(9, 3, 16, 4)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 2, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((3, 2, 2, 8)), jnp.float32)
    lens, valid = jnp.asarray([3, 16, 0], jnp.int32), jnp.ones((3, 2), bool)

    def run(cache):
        return np.asarray(jax.jit(lambda q: attend_cache(
            CFG, q, kv, kv, cache.attended(1, 16), lens, valid, 16))(q))
    np.testing.assert_array_equal(run(paged), run(paged.replace(kernel="gather")))


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu"])
def test_cached_forward_on_pages_equals_the_dense_cache(kernel):
    """A packed verify-shaped forward (ragged new tokens per row) through the model's layers:
    hidden states within 1e-5 of the dense cache's, and the same keys and values written."""
    params = tiny_params()
    B, S, page, T, kv_len = 3, 24, 4, 4, 22
    dense, paged = dense_and_paged(11, B, S, page)
    paged = paged.replace(kernel=kernel, interpret=True)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    cache_len = jnp.asarray([0, 9, 18], jnp.int32)
    positions = cache_len[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    valid = jnp.asarray([[True] * 4, [True, True, False, False], [True, True, True, False]])

    def run(cache):
        h, new = jax.jit(lambda c: forward_hidden(CFG, params, tokens, positions, c, cache_len,
                                                  valid_BxT=valid, kv_len=kv_len))(cache)
        return np.asarray(h), new
    h_d, new_d = run(dense)
    h_p, new_p = run(paged)
    ok = np.asarray(valid)
    np.testing.assert_allclose(h_p[ok], h_d[ok], atol=1e-5, rtol=0)
    assert new_p.kernel == kernel
    for layer in range(CFG.num_layers):
        want = new_d.attended((new_d.k[layer], new_d.v[layer]), S)
        got = new_p.attended(layer, S).dense()
        for a, b in zip(want, got):   # layer 0's new keys are the embeddings' (bitwise)
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 if layer else 0,
                                       rtol=0)
