"""The loop over a decoder's layers: `lax.scan` or a Python loop, one contract.

`run_layers(body, x, layers, per_layer, loop)` applies `body(x, (layer_params, layer_extra)) ->
(x, y)` to each of the L layers in order and returns `(x, ys)` with the per-layer outputs `ys`
stacked on a leading L axis (None when every `y` is None), as `lax.scan(body, x, (layers,
per_layer))` does.

* "scan": one `lax.scan`. The program holds the layer once and compiles in the same time for
  any L; each iteration reads its layer's weights as a dynamic slice of the stacked arrays.
* "unroll": a Python loop over static layer indices (the program holds L copies of the layer,
  compile time grows with L). Each layer's weights are a static slice. On backends whose matmul
  kernels take their operands as whole buffers (cuBLAS on GPU), XLA may copy a dynamic slice of
  the stacked weights into a temporary before every matmul: a scan then moves every weight
  twice per step, while static slices can alias the stacked buffer. Which is faster is measured
  per backend (`das_jax.bench.gpu_lease_check`'s `layers` part).

`layers` may also be a tuple of per-layer params pytrees (weights held unstacked, one buffer
per layer); the loop is then a Python loop whatever `loop` says.

Both loops compute the same operations per layer; the outputs match to float rounding (XLA may
fuse the unrolled program differently).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from das_jax.models.config import LAYER_LOOPS


def num_layers(layers) -> int:
    """L of stacked params (the leading axis of every leaf) or of a tuple of per-layer params."""
    if isinstance(layers, (list, tuple)):
        return len(layers)
    return jax.tree_util.tree_leaves(layers)[0].shape[0]


def layer(layers, i: int):
    """Layer i's params: a static slice of every stacked leaf, or the i-th per-layer pytree."""
    if isinstance(layers, (list, tuple)):
        return layers[i]
    return jax.tree_util.tree_map(lambda a: a[i], layers)


def unrolled(layers, loop: str) -> bool:
    """Whether `run_layers` runs a Python loop (`loop` "unroll", or per-layer params): each
    layer's arrays then reach its ops as static slices or whole buffers, not as a scan's
    dynamic slices (`DenseKVCache.read_len` reads a whole layer only then)."""
    return loop == "unroll" or isinstance(layers, (list, tuple))


def run_layers(body: Callable[[jax.Array, Any], tuple[jax.Array, Any]], x: jax.Array, layers,
               per_layer=None, loop: str = "scan") -> tuple[jax.Array, Any]:
    """Runs `body` over the layers (module docstring).

    Args:
      body: `(x, (layer_params, layer_extra)) -> (x, y)`; `layer_extra` is the layer's slice of
        `per_layer` (None without it).
      x: the carried activations.
      layers: stacked params (every leaf `[L, ...]`) or a tuple of L per-layer pytrees.
      per_layer: optional pytree with leaves `[L, ...]` sliced alongside (e.g. the KV cache's
        layers).
      loop: one of `LAYER_LOOPS`.

    Returns:
      (x after the last layer, the `y`s stacked on a leading L axis, or None).

    Raises:
      ValueError: an unknown `loop`.
    """
    if loop not in LAYER_LOOPS:
        raise ValueError(f"layer loop must be one of {', '.join(LAYER_LOOPS)}, got {loop!r}")
    if loop == "scan" and not isinstance(layers, (list, tuple)):
        return jax.lax.scan(body, x, (layers, per_layer))
    ys = []
    for i in range(num_layers(layers)):
        extra = None if per_layer is None else jax.tree_util.tree_map(lambda a: a[i], per_layer)
        x, y = body(x, (layer(layers, i), extra))
        ys.append(y)
    if all(y is None for y in ys):
        return x, None
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)


def unstack(layers) -> tuple:
    """Stacked layer params -> a tuple of L per-layer pytrees (copies: one buffer per layer)."""
    return tuple(layer(layers, i) for i in range(num_layers(layers)))
