"""The typed inputs of the engine's jitted programs: a frozen, hashable spec and its batch.

Every program (`das_jax.engine.step`) is `fn(params, cache, batch) -> outputs`. The batch is a
registered dataclass pytree whose only static field is its spec: the spec holds everything that
shapes the compiled code (model config, sampling key, cache rows and length, dtype, slot
counts), the batch holds the small int32 arrays. So one spec is one compiled program: the spec
is the compile key (`das_jax.engine.programs.Programs`), and `spec.abstract()` gives the batch
as `jax.ShapeDtypeStruct`s for ahead-of-time lowering (`jax.jit(fn).lower(...)`).

* `VerifySpec` / `VerifyBatch`: the packed speculative decode step (`step.verify_packed`).
* `DecodeSpec` / `DecodeBatch`: up to k plain decode steps in one call (`step.decode_steps`).
* `PrefillSpec` / `PrefillBatch`: the packed prefill and insert (`step.prefill_packed`).
* `ShareSpec` / `ShareBatch`: admission by a cache-row copy (`step.share_prompt_rows`).
* `SharePagesSpec` / `SharePagesBatch`: admission by shared prompt pages, the paged cache's
  `ShareSpec` (`step.share_prompt_pages`).
* `GatherSpec` / `GatherBatch`: compaction into a smaller batch bucket (`step.gather_rows`).

The host constructors (`VerifyBatch.pack`, `DecodeBatch.pack`, `PrefillBatch.pack`,
`ShareBatch.pack`, `VerifySpec.dummy`) build the arrays from the scheduler's plan; numpy only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.engine.schedule import full_width_rows, pack_prompts
from das_jax.models.config import ModelConfig
from das_jax.models.paged_kv_cache import PagedKVCache
from das_jax.models.transformer import KVCache


def batch_pytree(cls):
    """Registers a batch dataclass as a pytree: `spec` static (part of the tree structure, so
    of jit's cache key), every other field a leaf."""
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(
        cls, data_fields=[f for f in fields if f != "spec"], meta_fields=["spec"])


def int32_abstract(shape, sharding=None) -> jax.ShapeDtypeStruct:
    """An int32 `jax.ShapeDtypeStruct` of `shape` (on `sharding`)."""
    return jax.ShapeDtypeStruct(tuple(shape), jnp.int32, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The KV cache a program reads and writes: `batch` rows of `cache_len` positions of
    `dtype` (a dtype name), for `config`; `pages`: () for the dense cache, or (num_pages,
    page_size) for the paged one (`PagedKVCache`)."""

    config: ModelConfig
    batch: int
    cache_len: int
    dtype: str
    pages: tuple = ()

    def abstract(self, sharding=None):
        """The cache as `jax.ShapeDtypeStruct` leaves (on `sharding` when given)."""
        dtype = jnp.dtype(self.dtype)
        cache = (PagedKVCache.abstract(self.config, self.batch, self.cache_len,
                                       *self.pages[:2], dtype, *self.pages[2:]) if self.pages else
                 KVCache.abstract(self.config, self.batch, self.cache_len, dtype))
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), cache)


class OnCache:
    """Base of the program specs: `cache`, the `CacheSpec` of the KV cache the program runs on
    (the spec's `config`, `batch` rows of `cache_len` positions, `dtype`, and `pages`: () for
    the dense cache, (num_pages, page_size) for the paged one)."""

    __slots__ = ()
    pages = ()      # the dense cache, for specs without a `pages` field

    @property
    def cache(self) -> CacheSpec:
        return CacheSpec(self.config, self.batch, self.cache_len, self.dtype, self.pages)


@dataclasses.dataclass(frozen=True)
class VerifySpec(OnCache):
    """Static shape of one packed verify step: `batch` cache rows (B) of `cache_len` positions,
    `num_tokens` flat token slots (N), query-block `width` (W: 1 + the longest row's drafts,
    a compiled draft width), attended length `kv_len`; sampling key
    (`SamplingParams.static_key()`), model config and param/cache dtype name.
    `feature_layers`: blocks whose outputs the step also returns (a draft head's features;
    () for none). `wide_rows`: R, the step's attention split into a `[B, 1]` block and an
    `[R, W]` block of the (at most R) rows that draft (`models.packed`); 0: one `[B, W]`
    block. `branch_rows`: R2 > 0: a row may verify a second draft beside its first (a
    two-branch token tree; at most R2 rows have one: `models.packed`, `step.verify_packed`);
    0: one draft per row."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    num_tokens: int
    width: int
    cache_len: int
    kv_len: int
    dtype: str
    pages: tuple = ()
    feature_layers: tuple = ()
    wide_rows: int = 0
    branch_rows: int = 0

    def abstract(self, sharding=None) -> "VerifyBatch":
        B, N = self.batch, self.num_tokens
        sizes = (B, N, N, N, B, B) + ((B,) if self.branch_rows else ())
        return VerifyBatch(self, *(int32_abstract((n,), sharding) for n in sizes))

    def dummy(self) -> "VerifyBatch":
        """A timing batch: `num_tokens` slots, full-width rows first, then one slot per
        remaining row, then padding; every row attends `kv_len` positions; token 7."""
        B, W, N = self.batch, self.width, self.num_tokens
        rows, offs = [], []
        full = full_width_rows(B, W, N)
        if self.wide_rows:
            full = min(full, self.wide_rows)
        for b in range(B):
            for o in range(W if b < full else 1):
                if len(rows) < N:
                    rows.append(b)
                    offs.append(o)
        rows += [B] * (N - len(rows))
        offs += [0] * (N - len(offs))
        row_N, offset_N = np.asarray(rows, np.int32), np.asarray(offs, np.int32)
        n_draft_B = np.maximum(np.bincount(row_N[row_N < B], minlength=B) - 1, 0)
        n_alt_B = None
        if self.branch_rows:     # the first R2 full-width rows split their drafts in two
            n_alt_B = np.where(np.arange(B) < min(full, self.branch_rows), n_draft_B // 2, 0)
            n_draft_B = n_draft_B - n_alt_B
            n_alt_B = n_alt_B.astype(np.int32)
        return VerifyBatch(self, np.full((B,), self.kv_len, np.int32), np.full((N,), 7, np.int32),
                           row_N, offset_N, n_draft_B.astype(np.int32),
                           np.arange(B, dtype=np.int32), n_alt_B)


@batch_pytree
@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """The arrays of a packed verify step (int32): cache_len_B `[B]` tokens in each row's
    cache; tokens_N / row_N / offset_N `[N]` slot token, cache row (>= B: padding) and offset
    in the row; n_draft_B `[B]` drafts per row (with a tree: branch A's); seeds_B `[B]`
    request seeds; n_alt_B `[B]` branch B's drafts per row (a spec with `branch_rows`; else
    None), its slots after branch A's."""

    spec: VerifySpec
    cache_len_B: Any
    tokens_N: Any
    row_N: Any
    offset_N: Any
    n_draft_B: Any
    seeds_B: Any
    n_alt_B: Any = None

    @classmethod
    def pack(cls, spec: VerifySpec, cache_len_B, pending_B, seeds_B, live: np.ndarray,
             drafts_AxK: np.ndarray, n_draft_B, alt_AxK: np.ndarray | None = None,
             n_alt_B=None) -> "VerifyBatch":
        """Each live row's pending token then its drafts (drafts_AxK[j, :n_draft_B[live[j]]])
        and, with a spec's `branch_rows`, its second draft (alt_AxK[j, :n_alt_B[live[j]]]), as
        consecutive slots; the rest of the N slots are padding (row index B)."""
        N, B = spec.num_tokens, spec.batch
        live = np.asarray(live, np.int64)
        n_a_A = np.asarray(n_draft_B, np.int64)[live]
        n_b_A = (np.asarray(n_alt_B, np.int64)[live] if n_alt_B is not None
                 else np.zeros(len(live), np.int64))
        c_A = 1 + n_a_A + n_b_A                                    # slots per live row
        T = int(c_A.sum())
        j_T = np.repeat(np.arange(len(live)), c_A)
        off_T = np.arange(T) - np.repeat(np.cumsum(c_A) - c_A, c_A)
        drafts_AxK = np.asarray(drafts_AxK, np.int32)
        draft_T = (drafts_AxK[j_T, np.clip(off_T - 1, 0, drafts_AxK.shape[1] - 1)]
                   if drafts_AxK.shape[1] else np.zeros(T, np.int32))
        if n_alt_B is not None and alt_AxK is not None and np.asarray(alt_AxK).shape[1]:
            alt_AxK = np.asarray(alt_AxK, np.int32)
            d_T = off_T - n_a_A[j_T]                               # depth on branch B
            alt_T = alt_AxK[j_T, np.clip(d_T - 1, 0, alt_AxK.shape[1] - 1)]
            draft_T = np.where(d_T >= 1, alt_T, draft_T)
        tokens_N = np.zeros(N, np.int32)
        row_N = np.full(N, B, np.int32)
        offset_N = np.zeros(N, np.int32)
        tokens_N[:T] = np.where(off_T == 0, np.asarray(pending_B)[live][j_T], draft_T)
        row_N[:T] = live[j_T]
        offset_N[:T] = off_T
        if spec.branch_rows:
            n_alt_B = np.zeros(B, np.int32) if n_alt_B is None else n_alt_B
        else:
            n_alt_B = None
        return cls(spec, cache_len_B, tokens_N, row_N, offset_N, n_draft_B, seeds_B, n_alt_B)


@dataclasses.dataclass(frozen=True)
class DecodeSpec(OnCache):
    """Static shape of a multi-step decode call (`step.decode_steps`): up to `steps` plain
    decode steps (no drafts) of the live rows, one token slot per row in `num_tokens` slots
    (N, a slot bucket of the live rows), on `batch` cache rows (B) of `cache_len` positions,
    each step attending `kv_len` positions (>= every live row's cache length + steps - 1);
    `stop_ids`: the token ids that end a row (sorted); sampling key, model config, dtype."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    num_tokens: int
    steps: int
    cache_len: int
    kv_len: int
    stop_ids: tuple
    dtype: str
    pages: tuple = ()

    def abstract(self, sharding=None) -> "DecodeBatch":
        B, N = self.batch, self.num_tokens
        return DecodeBatch(self, *(int32_abstract((n,), sharding) for n in (B, N, N, B, B)))

    def dummy(self) -> "DecodeBatch":
        """A timing batch: every row live (up to N), attending `kv_len - steps` positions,
        token 7, a budget of `steps` tokens (no early stop unless a stop id is sampled)."""
        B, N = self.batch, self.num_tokens
        row_N = np.full(N, B, np.int32)
        row_N[:min(B, N)] = np.arange(min(B, N))
        return DecodeBatch(self, np.full((B,), max(self.kv_len - self.steps, 0), np.int32),
                           np.full((N,), 7, np.int32), row_N, np.arange(B, dtype=np.int32),
                           np.full((B,), self.steps, np.int32))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The arrays of a multi-step decode call (int32): cache_len_B `[B]` tokens in each row's
    cache; tokens_N / row_N `[N]` each live row's pending token and its cache row (>= B:
    padding); seeds_B `[B]` request seeds; budget_B `[B]` tokens each row may still emit
    (max_new_tokens left; 0 for rows without a slot)."""

    spec: DecodeSpec
    cache_len_B: Any
    tokens_N: Any
    row_N: Any
    seeds_B: Any
    budget_B: Any

    @classmethod
    def pack(cls, spec: DecodeSpec, cache_len_B, pending_B, seeds_B, live: np.ndarray,
             budget_A: np.ndarray) -> "DecodeBatch":
        """Live row j (cache row live[j]) in slot j; the rest of the N slots are padding."""
        N, B = spec.num_tokens, spec.batch
        live = np.asarray(live, np.int64)
        tokens_N = np.zeros(N, np.int32)
        row_N = np.full(N, B, np.int32)
        tokens_N[:len(live)] = np.asarray(pending_B)[live]
        row_N[:len(live)] = live
        budget_B = np.zeros(B, np.int32)
        budget_B[live] = np.minimum(budget_A, np.iinfo(np.int32).max)
        return cls(spec, np.asarray(cache_len_B, np.int32), tokens_N, row_N,
                   np.asarray(seeds_B, np.int32), budget_B)


@dataclasses.dataclass(frozen=True)
class PrefillSpec(OnCache):
    """Static shape of one packed prefill: `batch` cache rows (B) of `cache_len` positions,
    `num_tokens` flat prompt slots (N), an attention block of `rows` prompts (U, a batch
    bucket) x `width` tokens (T, a prompt-length bucket); `with_logits`: also return each
    entry's last-position logits (for prompt sharing); `feature_layers`: blocks whose outputs
    at every prompt position it also returns (a draft head's features; () for none)."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    num_tokens: int
    rows: int
    width: int
    cache_len: int
    dtype: str
    with_logits: bool = False
    pages: tuple = ()
    feature_layers: tuple = ()

    def abstract(self, sharding=None) -> "PrefillBatch":
        B, N = self.batch, self.num_tokens
        return PrefillBatch(self, *(int32_abstract((N,), sharding) for _ in range(3)),
                            *(int32_abstract((B,), sharding) for _ in range(5)))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """The arrays of a packed prefill (int32, `schedule.pack_prompts`): tokens_N / row_N /
    offset_N `[N]` slot token, prompt index (>= U: padding) and position in the prompt;
    slots_B / src_B / last_B / lengths_B / seeds_B `[B]` per admitted entry its cache row
    (>= B: padding), prompt, the prompt's last slot, length and seed."""

    spec: PrefillSpec
    tokens_N: Any
    row_N: Any
    offset_N: Any
    slots_B: Any
    src_B: Any
    last_B: Any
    lengths_B: Any
    seeds_B: Any

    @classmethod
    def pack(cls, config: ModelConfig, sampling_key: tuple, cache_len: int, dtype: str,
             rows: int, width: int, prompts, src, cache_rows, seeds, batch: int,
             with_logits: bool = False, pages: tuple = (),
             feature_layers: tuple = ()) -> "PrefillBatch":
        """The batch (and its spec) admitting `prompts[src[k]]` into cache row `cache_rows[k]`
        with seed `seeds[k]`; N is the slot bucket of the prompts' total length."""
        N, arrays = pack_prompts(prompts, src, cache_rows, seeds, batch, width)
        spec = PrefillSpec(config, sampling_key, batch, N, rows, width, cache_len, dtype,
                           with_logits, pages, tuple(feature_layers))
        return cls(spec, *arrays)


@dataclasses.dataclass(frozen=True)
class ShareSpec(OnCache):
    """Static shape of admission by row copy: `batch` cache rows of `cache_len` positions, of
    which the first `width` (a prompt-length bucket >= every copied prompt) are copied."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    width: int
    cache_len: int
    dtype: str
    pages: tuple = ()

    def abstract(self, sharding=None) -> "ShareBatch":
        B, V = self.batch, self.config.vocab_size
        return ShareBatch(self, int32_abstract((B,), sharding), int32_abstract((B,), sharding),
                          jax.ShapeDtypeStruct((B,), jnp.bool_, sharding=sharding),
                          jax.ShapeDtypeStruct((B,), jnp.bool_, sharding=sharding),
                          jax.ShapeDtypeStruct((B, V), jnp.float32, sharding=sharding),
                          int32_abstract((B,), sharding), int32_abstract((B,), sharding))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class ShareBatch:
    """dst_B / src_B `[B]` int32 destination row (>= B: padding) and source row, in the order
    the copies run; save_B / from_stash_B `[B]` bool the stash flags of each copy
    (`schedule.share_order`); logits_BxV float32 each entry's prompt's last-position logits;
    seeds_B / lengths_B `[B]` int32."""

    spec: ShareSpec
    dst_B: Any
    src_B: Any
    save_B: Any
    from_stash_B: Any
    logits_BxV: Any
    seeds_B: Any
    lengths_B: Any

    @classmethod
    def pack(cls, spec: ShareSpec, dst_rows, src_rows, logits: Sequence[np.ndarray], seeds,
             lengths, save=None, from_stash=None) -> "ShareBatch":
        """Entries j < len(dst_rows) copy row src_rows[j] into dst_rows[j] (in this order,
        with the stash flags `save` / `from_stash`, default none) and sample from logits[j] at
        absolute index lengths[j]; the rest are padding (destination B)."""
        B, k = spec.batch, len(dst_rows)
        dst_B = np.full(B, B, np.int32)
        src_B = np.zeros(B, np.int32)
        save_B = np.zeros(B, bool)
        from_stash_B = np.zeros(B, bool)
        logits_BxV = np.zeros((B, spec.config.vocab_size), np.float32)
        seeds_B = np.zeros(B, np.int32)
        lengths_B = np.ones(B, np.int32)
        dst_B[:k], src_B[:k], seeds_B[:k], lengths_B[:k] = dst_rows, src_rows, seeds, lengths
        if save is not None:
            save_B[:k] = save
        if from_stash is not None:
            from_stash_B[:k] = from_stash
        for j, v in enumerate(logits):
            logits_BxV[j] = v
        return cls(spec, dst_B, src_B, save_B, from_stash_B, logits_BxV, seeds_B, lengths_B)


@dataclasses.dataclass(frozen=True)
class SharePagesSpec(OnCache):
    """Static shape of admission by shared pages (the paged cache): `batch` entries (B, the
    cache rows) on a pool of `pages` = (num_pages, page_size) for rows of `cache_len`
    positions. The host has pointed each admitted row at its source row's full prompt pages
    (`pages.PagePool.share`); the program copies each partial last page and samples."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    cache_len: int
    dtype: str
    pages: tuple

    def abstract(self, sharding=None) -> "SharePagesBatch":
        B, V = self.batch, self.config.vocab_size
        return SharePagesBatch(self, int32_abstract((B,), sharding),
                               int32_abstract((B,), sharding),
                               jax.ShapeDtypeStruct((B, V), jnp.float32, sharding=sharding),
                               int32_abstract((B,), sharding), int32_abstract((B,), sharding))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class SharePagesBatch:
    """dst_pages_B / src_pages_B `[B]` int32 page copies (destination >= num_pages: none);
    logits_BxV float32 each entry's prompt's last-position logits; seeds_B / lengths_B `[B]`
    int32 (entries past the admitted ones are padding)."""

    spec: SharePagesSpec
    dst_pages_B: Any
    src_pages_B: Any
    logits_BxV: Any
    seeds_B: Any
    lengths_B: Any

    @classmethod
    def pack(cls, spec: SharePagesSpec, copies: Sequence[tuple[int, int] | None],
             logits: Sequence[np.ndarray], seeds, lengths) -> "SharePagesBatch":
        """Entry j copies page copies[j] = (src, dst) (None: nothing to copy) and samples from
        logits[j] at absolute index lengths[j] with seeds[j]."""
        B, k, P = spec.batch, len(logits), spec.pages[0]
        dst = np.full(B, P, np.int32)
        src = np.zeros(B, np.int32)
        for j, c in enumerate(copies):
            if c is not None:
                src[j], dst[j] = c
        logits_BxV = np.zeros((B, spec.config.vocab_size), np.float32)
        for j, v in enumerate(logits):
            logits_BxV[j] = v
        seeds_B = np.zeros(B, np.int32)
        lengths_B = np.ones(B, np.int32)
        seeds_B[:k], lengths_B[:k] = seeds, lengths
        return cls(spec, dst, src, logits_BxV, seeds_B, lengths_B)


@dataclasses.dataclass(frozen=True)
class GatherSpec(OnCache):
    """Static shape of compaction: `batch` cache rows gathered into `new_batch` rows."""

    config: ModelConfig
    batch: int
    new_batch: int
    cache_len: int
    dtype: str
    pages: tuple = ()

    def abstract(self, sharding=None) -> "GatherBatch":
        return GatherBatch(self, int32_abstract((self.new_batch,), sharding))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class GatherBatch:
    """rows `[new_batch]` int32: the source row of each new row (may repeat: padding)."""

    spec: GatherSpec
    rows: Any


Spec = VerifySpec | DecodeSpec | PrefillSpec | ShareSpec | SharePagesSpec | GatherSpec
