"""The draft head inside the engine: its programs and its cache (`HeadRuntime`), an engine
`DraftModel` (`das_jax.engine.step_io`).

The engine's prefill and verify programs return the outputs of the head's three policy blocks
at every position they commit; the executor hands them here, still on the device:

* `admit`: rows filled by an admission commit their prefilled positions (prompt, or prompt
  and earlier tokens for a resumed request) to fresh rows of the head's cache
  (`head_admit`);
* `extend`: after each verify step the live rows commit the positions the step accepted
  (`head_extend`, `head.extend_and_draft`);
* `compact`: the head's cache rows follow the KV cache's (`head_gather`).

Each call drafts `steps` tokens from every touched row's last position in the same jitted
program, so a verify step's head drafts are ready with its outputs (the executor waits for
both at once). The programs belong to the engine's `Programs` (one owner of every compiled
program): their specs are registered there and keyed by shape and device as the policy's are.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.draft_head.head import (WEIGHT_DTYPES, HeadCache, HeadConfig, cast_weights,
                                     extend_and_draft)
from das_jax.engine.programs import register_program
from das_jax.engine.specs import batch_pytree, int32_abstract
from das_jax.errors import UserError


def _f32(shape, sh):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.float32, sharding=sh)


@dataclasses.dataclass(frozen=True)
class _HeadCacheSpec:
    """The head's cache: `batch` rows x `cache_len` positions (`HeadCache`)."""
    head: HeadConfig
    batch: int
    cache_len: int

    def abstract(self, sh=None) -> HeadCache:
        shape = (self.batch, self.cache_len, self.head.num_kv_heads, self.head.head_dim)
        return HeadCache(_f32(shape, sh), _f32(shape, sh), int32_abstract((self.batch,), sh))


class _OnHeadCache:
    """Base of the head's program specs: `cache`, the head cache's spec (`head`, `batch` rows,
    `cache_len` positions)."""

    __slots__ = ()

    @property
    def cache(self) -> _HeadCacheSpec:
        return _HeadCacheSpec(self.head, self.batch, self.cache_len)


@dataclasses.dataclass(frozen=True)
class HeadAdmitSpec(_OnHeadCache):
    """`rows` admitted rows (R, a batch bucket) of a `batch`-row head cache of `cache_len`
    positions, each with up to `width` prefilled positions (T); `steps` draft tokens."""
    head: HeadConfig
    batch: int
    rows: int
    width: int
    cache_len: int
    steps: int
    embed: tuple = ()       # (vocabulary size, dtype name) of the policy's embedding it reads

    def abstract(self, sh=None) -> "HeadAdmitBatch":
        R, T, F = self.rows, self.width, 3 * self.head.hidden_size
        return HeadAdmitBatch(self, int32_abstract((R,), sh), _f32((R, T, F), sh),
                              int32_abstract((R, T), sh), int32_abstract((R,), sh))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class HeadAdmitBatch:
    """rows_R int32 cache row per entry (>= batch: padding, dropped); feats_RxTxFD float32 the
    policy blocks' outputs at each prefilled position; next_RxT int32 the token after each
    position; n_R int32 prefilled positions per entry."""
    spec: HeadAdmitSpec
    rows_R: Any
    feats_RxTxFD: Any
    next_RxT: Any
    n_R: Any


@dataclasses.dataclass(frozen=True)
class HeadExtendSpec(_OnHeadCache):
    """A verify step's commit into a `batch`-row head cache: `width` (W) slots per row; the
    drafts attend to the first `kv_len` positions (>= every row's length after the commit)."""
    head: HeadConfig
    batch: int
    width: int
    cache_len: int
    steps: int
    kv_len: int
    embed: tuple = ()

    def abstract(self, sh=None) -> "HeadExtendBatch":
        B, W, F = self.batch, self.width, 3 * self.head.hidden_size
        return HeadExtendBatch(self, jax.ShapeDtypeStruct((B,), jnp.bool_, sharding=sh),
                               _f32((B, W, F), sh), int32_abstract((B, W), sh),
                               int32_abstract((B,), sh))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class HeadExtendBatch:
    """live_B bool rows that ran in the step; feats_BxWxFD float32 the blocks' outputs at each
    slot; next_BxW int32 the step's sampled tokens (the token after each committed slot);
    n_emit_B int32 slots committed per row."""
    spec: HeadExtendSpec
    live_B: Any
    feats_BxWxFD: Any
    next_BxW: Any
    n_emit_B: Any


@dataclasses.dataclass(frozen=True)
class HeadGatherSpec(_OnHeadCache):
    """The head cache's compaction from `batch` to `new_batch` rows."""
    head: HeadConfig
    batch: int
    new_batch: int
    cache_len: int
    embed: tuple = ()

    def abstract(self, sh=None) -> "HeadGatherBatch":
        return HeadGatherBatch(self, int32_abstract((self.new_batch,), sh))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class HeadGatherBatch:
    """rows int32 `[new_batch]`: the old row of each new row."""
    spec: HeadGatherSpec
    rows: Any


def _bundle_parts(bundle):
    return bundle["head"], bundle["embed"], bundle["draft_to_target"]


@functools.partial(jax.jit, donate_argnames=("cache",))
def head_admit(bundle, cache: HeadCache, batch: HeadAdmitBatch):
    """Resets rows `rows_R` of the head cache and commits their prefilled positions; drafts
    `spec.steps` tokens from each entry's last position.

    Returns:
      (cache, draft tokens int32 `[R, J]`, path probabilities float32 `[R, J]`).
    """
    spec = batch.spec
    hp, embed, d2t = _bundle_parts(bundle)
    R, S = spec.rows, spec.cache_len
    fresh = HeadCache.zeros(spec.head, R, S)
    fresh, tok, p = extend_and_draft(spec.head, hp, embed, d2t, fresh, batch.feats_RxTxFD,
                                     batch.next_RxT, batch.n_R, spec.steps, spec.width)
    rows = batch.rows_R
    new = HeadCache(cache.k.at[rows].set(fresh.k, mode="drop"),
                    cache.v.at[rows].set(fresh.v, mode="drop"),
                    cache.length_B.at[rows].set(fresh.length_B, mode="drop"))
    return new, tok, p


@functools.partial(jax.jit, donate_argnames=("cache",))
def head_extend(bundle, cache: HeadCache, batch: HeadExtendBatch):
    """Commits each live row's `n_emit_B` verified positions and drafts `spec.steps` tokens from
    its last one (`head.extend_and_draft`); rows not live keep their cache.

    Returns:
      (cache, draft tokens int32 `[B, J]`, path probabilities float32 `[B, J]`; rows not live:
      garbage with probability 0).
    """
    spec = batch.spec
    hp, embed, d2t = _bundle_parts(bundle)
    n_B = jnp.where(batch.live_B, batch.n_emit_B, 0)
    return extend_and_draft(spec.head, hp, embed, d2t, cache, batch.feats_BxWxFD,
                            batch.next_BxW, n_B, spec.steps, spec.kv_len)


@jax.jit
def head_gather(bundle, cache: HeadCache, batch: HeadGatherBatch) -> HeadCache:
    """The rows `batch.rows` of the head cache (compaction; not donated: the output is
    smaller, XLA could not write it over the input). `bundle` is not read."""
    del bundle
    r = batch.rows
    return HeadCache(cache.k[r], cache.v[r], cache.length_B[r])


register_program(HeadAdmitSpec, head_admit)
register_program(HeadExtendSpec, head_extend)
register_program(HeadGatherSpec, head_gather)


class HeadRuntime:
    """A fitted draft head as the engine's `DraftModel` (module docstring).

    Args:
      head: a `store.DraftHead` (its config, float32 params and draft vocabulary).
      steps: J, draft tokens per call (the engine drafts up to max(draft_widths) - 1).
      dtype: the dtype of its matrices on the device ("float32" or "bfloat16", `head.
        cast_weights`; None: the head file's, float32). The head keeps its float32 weights
        (online updates replace them); each placement casts.

    Raises:
      UserError: steps < 1, or a dtype the head cannot draft in.
    """

    def __init__(self, head, steps: int, dtype: str | None = None):
        if int(steps) < 1:
            raise UserError(f"draft_head.steps={steps} must be >= 1 (the head's draft tokens "
                            "per verify step)")
        if dtype is not None and dtype not in WEIGHT_DTYPES:
            raise UserError(f"draft_head.dtype={dtype!r}: the head drafts in one of "
                            f"{', '.join(WEIGHT_DTYPES)}")
        self.head = head
        self.config: HeadConfig = (head.config if dtype is None
                                   else dataclasses.replace(head.config, dtype=dtype))
        self.feature_layers = tuple(int(x) for x in head.config.feature_layers)
        self.steps = int(steps)
        self._device_params: dict = {}

    def set_params(self, params) -> None:
        """New weights for the head (same names and shapes: an online update,
        `das_jax.draft_head.online`); the next `start` places them. A generate call already
        running keeps the weights it started with.

        Raises:
          ValueError: other names or shapes than the head's."""
        old = self.head.params
        if set(params) != set(old) or any(tuple(np.shape(params[k])) != tuple(np.shape(old[k]))
                                          for k in old):
            raise ValueError("the draft head's new params have other names or shapes")
        self.head = dataclasses.replace(self.head, params=dict(params))

    def start(self, programs, batch: int, cache_len: int, policy_params) -> None:
        """A fresh head cache of `batch` rows x `cache_len` positions on the engine's device;
        the policy's embedding (`policy_params["embed"]`, read where it lies) feeds the head.

        Raises:
          UserError: an engine on a mesh (the head runs on single-device engines)."""
        if programs.placement is not None:
            raise UserError("draft_head runs on a single-device rollout engine (one per "
                            "process); drop the tensor-parallel rollout mesh (rollout.replicas "
                            "= the device count, one process per device) or draft_head")
        self.programs = programs
        key = programs.device          # the head's weights, placed once per device and head
        head = self.head               # (set_params may swap it from another thread)
        placed = self._device_params.get(key)
        if placed is None or placed[0] is not head:
            placed = (head, {
                "head": jax.tree_util.tree_map(
                    programs.put, cast_weights(dict(head.params), self.config.dtype)),
                "draft_to_target": programs.put(np.asarray(head.draft_to_target, np.int32))})
            self._device_params[key] = placed
        embed = policy_params["embed"]
        self.embed_key = (int(embed.shape[0]), jnp.dtype(embed.dtype).name)
        self.bundle = dict(placed[1], embed=embed)
        shape = (batch, cache_len, self.config.num_kv_heads, self.config.head_dim)
        with (jax.default_device(key) if key is not None else contextlib.nullcontext()):
            self.cache = HeadCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                                   jnp.zeros((batch,), jnp.int32))
        self.batch, self.cache_len = batch, cache_len

    def stop(self) -> None:
        """`DraftModel.stop`: drops the cache and the policy's embedding (nothing of the
        generate call stays alive, e.g. across a training update)."""
        self.cache = self.bundle = None

    def admit(self, rows_R, feats_RxTxFD, next_RxT, n_R):
        """`DraftModel.admit`; returns the entries' drafts (device arrays `[R, J]`)."""
        R, T = next_RxT.shape
        spec = HeadAdmitSpec(self.config, self.batch, R, T, self.cache_len, self.steps,
                             self.embed_key)
        b = HeadAdmitBatch(spec, np.asarray(rows_R, np.int32), feats_RxTxFD,
                           np.asarray(next_RxT, np.int32), np.asarray(n_R, np.int32))
        self.cache, tok, p = self.programs.run(self.bundle, self.cache, b)
        return tok, p

    def extend(self, live_B, feats_BxWxFD, next_BxW, n_emit_B, kv_len: int | None = None):
        """`DraftModel.extend`; returns every row's drafts (device arrays `[B, J]`). `kv_len`:
        a bound on every live row's length after the step (None: the cache's size); the
        drafts attend to that many positions."""
        W = int(next_BxW.shape[1])
        kv = self.cache_len if kv_len is None else min(int(kv_len), self.cache_len)
        spec = HeadExtendSpec(self.config, self.batch, W, self.cache_len, self.steps, kv,
                              self.embed_key)
        b = HeadExtendBatch(spec, np.asarray(live_B, bool), feats_BxWxFD, next_BxW, n_emit_B)
        self.cache, tok, p = self.programs.run(self.bundle, self.cache, b)
        return tok, p

    def compact(self, live: np.ndarray, new_batch: int) -> None:
        """`DraftModel.compact`."""
        rows = np.zeros(new_batch, np.int32)
        rows[:len(live)] = live
        spec = HeadGatherSpec(self.config, self.batch, new_batch, self.cache_len,
                              self.embed_key)
        self.cache = self.programs.run(self.bundle, self.cache, HeadGatherBatch(spec, rows))
        self.batch = new_batch
