"""Device memory of the fused update (`das_jax.rl.fused_update`) at a run's largest shapes, from
its programs compiled ahead of time on abstract arrays (no weights): what `das_jax.plan` counts
for a run whose update is fused.

The fused update runs several programs one after another, each beside buffers it does not take
as arguments, so its peak is the largest of (bytes alive while a program runs):

    forward    params + optimizer state + batch + the forward's temporaries and outputs (the
               layer inputs `[L, G, S, D]`, the last hidden state and its gradient)
    layer      params + optimizer state + batch + layer inputs + the top gradient + one layer's
               program (its slices of params and moments, temporaries, outputs)
    finish     params + optimizer state + batch + last hidden state + the embedding's input
               gradient + the finish program's temporaries and outputs (the gradients of the
               large non-layer leaves, e.g. the embedding in float32)

(AdamW on those large leaves then runs in ~16 MB row blocks beside their gradients: below the
finish phase.)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from das_jax.engine import compiled_memory
from das_jax.rl.batches import PackedMicroBatch
from das_jax.rl.fused_update import (FusedSpec, Layout, finish_update, forward_and_norm,
                                     layer_update, take_slices)

__all__ = ["packed_abstract", "fused_update_memory"]


def packed_abstract(groups: int, length: int, completions: int, window: int) -> PackedMicroBatch:
    """The abstract `PackedMicroBatch` (leading axis 1) of `groups` packed rows of `length`
    tokens and `completions` completions scored on `window` positions each."""
    i32, f32 = jnp.int32, jnp.float32

    def a(shape, dtype):
        return jax.ShapeDtypeStruct((1, *shape), dtype)
    GS, RW = (groups, length), (completions, window)
    return PackedMicroBatch(
        tokens=a(GS, i32), positions=a(GS, i32), valid=a(GS, jnp.bool_), segments=a(GS, i32),
        row_group=a((completions,), i32), source=a(RW, i32), targets=a(RW, i32),
        completion_mask=a(RW, jnp.bool_), old_logprobs=a(RW, f32), ref_logprobs=a(RW, f32),
        advantages=a((completions,), f32), weights=a(RW, f32))


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def _mem(lowered) -> dict[str, int]:
    return compiled_memory(lowered.compile())


def fused_update_memory(spec: FusedSpec, params, opt_state, xs: PackedMicroBatch
                        ) -> tuple[dict[str, dict[str, int]], int]:
    """Memory of the fused update's programs and its peak, compiled on abstract arrays.

    Args:
      spec: the run's `FusedSpec`.
      params, opt_state: `jax.ShapeDtypeStruct` trees (or arrays) of the master params and of
        `spec.optimizer.init(params)`.
      xs: the largest packed micro-batch of the run (`packed_abstract`).

    Returns:
      ({"fused_forward" | "fused_layer" | "fused_finish": {"argument", "output", "alias",
      "temp"} bytes of that program}, the peak bytes alive on the device during the update:
      the largest phase of the module docstring).
    """
    _, inner = spec.optimizer.split_state(opt_state)
    layout = Layout.of(spec.optimizer, params, inner)
    forward = functools.partial(forward_and_norm, spec, layout)
    _, _, x_in_L, dxL, xL, norm = jax.eval_shape(forward, params, xs)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    norm = scalar if norm is None else norm
    p_leaves, s_leaves = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(inner)
    stacks = ([p_leaves[i] for i in layout.layer_idx], [s_leaves[k] for k in layout.s_layer])
    p_i, s_i = jax.eval_shape(take_slices, stacks, 0)
    x = jax.ShapeDtypeStruct(x_in_L.shape[1:], x_in_L.dtype)
    shared = {k: s_leaves[k] for k, o in enumerate(layout.owner) if o < 0}
    small = [s_leaves[k] for k in layout.s_other if layout.owner[k] not in layout.big_idx]
    programs = {
        "fused_forward": _mem(forward_and_norm.lower(spec, layout, params, xs)),
        "fused_layer": _mem(layer_update.lower(spec, layout, xs, dxL, x, p_i, s_i, shared,
                                               norm)),
        "fused_finish": _mem(finish_update.lower(
            spec, layout, xs, xL, dxL, norm, scalar, [p_leaves[i] for i in layout.small_idx],
            small, shared, [p_leaves[i] for i in layout.big_idx])),
    }
    base = _bytes(params) + _bytes(opt_state) + _bytes(xs)

    def phase(name, *alive):
        m = programs[name]
        return base + sum(map(_bytes, alive)) + m["temp"] + m["output"] - m["alias"]
    peak = max(phase("fused_forward"),
               phase("fused_layer", x_in_L, dxL, p_i, s_i),
               phase("fused_finish", xL, dxL))
    return programs, peak
