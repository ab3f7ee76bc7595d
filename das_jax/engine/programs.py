"""`Programs`: the one owner of every compiled program of an engine.

A program is a jitted `fn(params, cache, batch)` (`das_jax.engine.step`) and a spec type
(`das_jax.engine.specs`); `PROGRAMS` maps each spec type to its function, so a batch is run by
its type. From a spec, `Programs` derives everything the engine, the cost-model calibration and
the memory plan need:

* the compile key: the spec itself (it holds the model config, the sampling key, the dtype and
  every static shape, never param values), plus the device or mesh an engine runs on (an
  executable accepts arguments only on the devices it was compiled for);
* the abstract arguments of ahead-of-time compilation (`jax.jit(fn).lower(...).compile()`);
* compilation, counted in `compile_s`; precompilation of a list of specs from abstract
  arguments (nothing allocated);
* timing of one program on dummy inputs (`time`), and its memory analysis (`memory`).

Executables are shared by every `Programs` of the process (`COMPILED`); on a mesh
(`placement.MeshPlacement`) they are compiled with the mesh's shardings at the jit boundary.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.engine import step
from das_jax.engine.specs import (DecodeSpec, GatherSpec, PrefillSpec, SharePagesSpec, ShareSpec,
                                  VerifySpec)
from das_jax.models.config import ModelConfig
from das_jax.models.paged_kv_cache import PagedKVCache
from das_jax.models.transformer import KVCache, Params

# Spec type -> its jitted program `fn(params, cache, batch)`.
PROGRAMS: dict[type, Callable] = {
    VerifySpec: step.verify_packed,
    DecodeSpec: step.decode_steps,
    PrefillSpec: step.prefill_packed,
    ShareSpec: step.share_prompt_rows,
    SharePagesSpec: step.share_prompt_pages,
    GatherSpec: step.gather_rows,
}

# Compiled executables of the process, by `Programs.key`.
COMPILED: dict[tuple, Any] = {}


def compiled_memory(compiled) -> dict[str, int]:
    """Bytes of a compiled program (`jax.stages.Compiled`) from XLA's memory analysis:
    argument, output, alias (outputs written in place of donated arguments) and temp (scratch);
    0 where the backend reports none."""
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias", "temp")}


def register_program(spec_type: type, fn: Callable) -> None:
    """Adds a program: batches whose spec is a `spec_type` run `fn(params, cache, batch)` (a
    `jax.jit` function). Used by `das_jax.engine.reference` for the padded oracle steps."""
    PROGRAMS[spec_type] = fn


class Programs:
    """Compiles, runs, times and analyses the programs of one engine (module docstring).

    Args:
      config: the model config (the KV cache layout).
      device: the `jax.Device` the engine runs on (None: JAX's default placement).
      placement: a `placement.MeshPlacement` (instead of `device`).

    Attributes:
      compile_s: seconds spent compiling through this object (a cache hit adds nothing).
    """

    def __init__(self, config: ModelConfig, device: jax.Device | None = None, placement=None):
        self.config = config
        self.device = device
        self.placement = placement
        self._device_key = (placement.key if placement is not None else
                            None if device is None else (device.platform, device.id))
        self.compile_s = 0.0

    # ------------------------------------------------------------------ keys and arguments
    def key(self, spec) -> tuple:
        """The compile key of `spec` on this engine's devices."""
        return (spec,) if self._device_key is None else (spec, self._device_key)

    def compiled(self, spec) -> bool:
        """Whether `spec`'s program is compiled for this engine's devices."""
        return self.key(spec) in COMPILED

    def swap(self, spec, executable=None):
        """Replaces `spec`'s compiled program for these devices by `executable` (None: drops it,
        so the next use compiles again); returns the one it held (or None). Programs are keyed
        by spec, not by the params' tree: a caller running one spec on params of another
        layout (e.g. per-layer weights, `models.layer_loop.unstack`) swaps its own in and out."""
        key = self.key(spec)
        held = COMPILED.pop(key, None)
        if executable is not None:
            COMPILED[key] = executable
        return held

    def compiled_count(self) -> int:
        """Executables compiled in this process (every engine)."""
        return len(COMPILED)

    @property
    def sharding(self):
        """The sharding of abstract arguments (single-device engines; None: default)."""
        return (jax.sharding.SingleDeviceSharding(self.device) if self.device is not None
                else None)

    def abstract(self, spec, params: Params) -> tuple:
        """(params, cache, batch) of `spec`'s program as `jax.ShapeDtypeStruct`s."""
        sh = self.sharding

        def leaf(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return x
            return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sh)
        return (jax.tree_util.tree_map(leaf, params), spec.cache.abstract(sh),
                spec.abstract(sh))

    def zeros_cache(self, batch: int, cache_len: int, dtype, pages: tuple = ()):
        """An empty KV cache where this engine computes: dense (`KVCache`), or with `pages` =
        (num_pages, page_size) a paged pool (`PagedKVCache`, every table entry unallocated).

        Raises:
          ValueError: a paged cache on a mesh (not supported yet: `rollout.kv_cache: dense`).
        """
        if self.placement is not None:
            if pages:
                raise ValueError("rollout.kv_cache: paged runs on one device per engine; use "
                                 "rollout.kv_cache: dense with a tensor-parallel mesh")
            return self.placement.zeros_cache(self.config, batch, cache_len, dtype)
        with (jax.default_device(self.device) if self.device is not None
              else contextlib.nullcontext()):
            if pages:
                return PagedKVCache.zeros(self.config, batch, cache_len, *pages[:2], dtype,
                                          *pages[2:])
            return KVCache.zeros(self.config, batch, cache_len, dtype)

    def put(self, x: np.ndarray) -> jax.Array:
        """A host array placed where this engine's single-device programs read it (the paged
        cache's page table)."""
        return jax.device_put(x, self.device) if self.device is not None else jnp.asarray(x)

    # ------------------------------------------------------------------ compile and run
    def executable(self, spec, params, cache, batch):
        """The compiled program of `spec` (compiled on first use from these arguments, concrete
        or abstract, then shared)."""
        key = self.key(spec)
        exe = COMPILED.get(key)
        if exe is None:
            fn = PROGRAMS[type(spec)]
            t0 = time.perf_counter()
            if self.placement is not None:
                exe = self.placement.compile(fn, (params, cache, batch))
            else:
                exe = fn.lower(params, cache, batch).compile()
            self.compile_s += time.perf_counter() - t0
            COMPILED[key] = exe
        return exe

    def run(self, params: Params, cache: KVCache, batch):
        """Runs `batch`'s program (by the type of its spec) on (params, cache): its outputs."""
        return self.executable(batch.spec, params, cache, batch)(params, cache, batch)

    def precompile(self, specs: Iterable, params: Params) -> int:
        """Compiles (without running) the programs of `specs` from abstract arguments (nothing
        is allocated); returns how many were compiled now. Does nothing on a mesh (returns 0)."""
        if self.placement is not None:
            return 0
        before = len(COMPILED)
        for spec in specs:
            if not self.compiled(spec):
                self.executable(spec, *self.abstract(spec, params))
        return len(COMPILED) - before

    # ------------------------------------------------------------------ timing and memory
    def time(self, spec, params: Params, repeats: int = 3, after=None) -> float:
        """Median seconds of `spec`'s program on its dummy batch (`spec.dummy()`) and an empty
        cache, over `repeats` calls after one discarded call; compiled first (not timed).
        `after(*outputs)`: optional work dispatched on each call's outputs (past the cache) and
        timed with it (a draft model's drafting after a verify step); what it returns is waited
        for."""
        cache = self.zeros_cache(spec.batch, spec.cache_len, spec.dtype, spec.pages)
        if spec.pages:   # every row on its own pages (while the pool has them)
            P, mp = spec.pages[0], cache.table.shape[1]
            cache = cache.with_table(self.put(np.minimum(
                np.arange(spec.batch * mp, dtype=np.int32).reshape(spec.batch, mp), P)))
        batch = spec.dummy()
        exe = self.executable(spec, params, cache, batch)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            cache, y, *rest = exe(params, cache, batch)
            extra = after(y, *rest) if after is not None else None
            np.asarray(y)
            jax.block_until_ready(extra)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def memory(self, spec, params: Params) -> dict[str, int]:
        """Bytes of `spec`'s compiled program from XLA's memory analysis: argument, output,
        alias (outputs written in place of donated arguments) and temp (scratch)."""
        params_abs, cache_abs, batch_abs = self.abstract(spec, params)
        return compiled_memory(self.executable(spec, params_abs, cache_abs, batch_abs))
