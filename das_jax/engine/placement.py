"""Where one engine's arrays live on a device mesh: params, KV cache and the jitted steps' in/outs.

An engine given a `jax.sharding.Mesh` (`Engine(mesh=...)`) runs tensor-parallel over the mesh's
`tensor` axis (one rollout replica; data parallelism is several engines, one per replica mesh,
`das_jax.rollout.sharded`):

* params: `ROLLOUT_RULES`, the training table of `das_jax.parallel.sharding` restricted to the
  head-parallel axes: attention heads / KV heads and the MLP hidden dimension split over
  `tensor` (Megatron-style), embedding, vocabulary and norms replicated (a vocabulary-parallel
  head would need a sampler that reads sharded logits);
* KV cache (keys `[L, B, KVH, K, S]`, values `[L, B, KVH, S, K]`): split on KV heads
  (`KVCache.logical_axes`), so each device holds and
  attends to its own heads' keys and values; replicated when `tensor` does not divide KVH;
* the jitted programs (`das_jax.engine.step`, unchanged; compiled by `programs.Programs`): compiled
  with these shardings at the jit boundary (`MeshPlacement.compile`: every cache in or out on the
  cache sharding, params on the param shardings, every other in/out, the typed batch included,
  replicated), the cache donated as the program donates it.
  The model functions partition unchanged (XLA's SPMD partitioner inserts the collectives).

Exactness: the sampled token is a pure function of the logits and the position-keyed draw, so
placement changes a token only through float rounding: the head- and MLP-parallel contractions
sum partial products in another order (logits within ~1e-6 of one device in float32), the same
order of effect as a change of batch bucket (docs/design.md, "Exactness").
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from das_jax.models.transformer import KVCache
from das_jax.parallel.sharding import DEFAULT_RULES, logical_axes, logical_to_spec

# The rollout's rules: the training table, with only the head-parallel axes kept on the mesh.
ROLLOUT_RULES: dict[str, tuple[str, ...] | None] = {
    k: (v if k in ("heads", "kv_heads", "mlp") else None) for k, v in DEFAULT_RULES.items()}



def _is_cache(x) -> bool:
    return isinstance(x, KVCache)


class MeshPlacement:
    """Shardings of one engine's arrays on `mesh` (module docstring).

    Args:
      mesh: a mesh with a `tensor` axis (`das_jax.parallel.sharding.make_mesh`); every other
        axis of size 1 (a replica is one tensor-parallel group).
      rules: logical axis -> mesh axes (default `ROLLOUT_RULES`).

    Raises:
      ValueError: a mesh without a `tensor` axis or with another axis of size > 1.
    """

    def __init__(self, mesh: Mesh, rules=ROLLOUT_RULES):
        if "tensor" not in mesh.shape:
            raise ValueError(f"a rollout mesh needs a 'tensor' axis, got axes {mesh.axis_names}; "
                             "build it with das_jax.parallel.sharding.make_mesh")
        other = {a: n for a, n in mesh.shape.items() if a != "tensor" and n > 1}
        if other:
            raise ValueError(f"a rollout replica's mesh splits only 'tensor'; axes {other} have "
                             "size > 1 (use one replica per data-parallel group)")
        self.mesh = mesh
        self.rules = rules
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._param_shardings: dict[Any, Any] = {}
        self._zeros: dict[tuple, Any] = {}

    @property
    def devices(self) -> list[jax.Device]:
        return list(self.mesh.devices.flat)

    @property
    def tensor(self) -> int:
        """Devices of the tensor-parallel group."""
        return int(self.mesh.shape["tensor"])

    def kv_shards(self, config) -> int:
        """Devices one cache row is split over: `tensor` when it divides the KV heads, else 1."""
        return self.tensor if config.num_kv_heads % self.tensor == 0 else 1

    @property
    def key(self) -> tuple:
        """What compiled executables are keyed by: the devices (platform, id) in mesh order."""
        return tuple((d.platform, d.id) for d in self.devices) + (("tensor", self.tensor),)

    def __repr__(self) -> str:
        return f"MeshPlacement(tensor={self.tensor}, devices={[d.id for d in self.devices]})"

    # ------------------------------------------------------------------ shardings
    def param_shardings(self, params):
        """NamedSharding per param leaf (`ROLLOUT_RULES` over the leaf's logical axes), cached by
        the params' structure and shapes."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        key = (treedef, tuple(tuple(x.shape) for x in leaves))
        sh = self._param_shardings.get(key)
        if sh is None:
            axes = logical_axes(params)
            sh = jax.tree_util.tree_map(
                lambda ax, p: NamedSharding(self.mesh, logical_to_spec(ax, p.shape, self.mesh,
                                                                       self.rules)),
                axes, params, is_leaf=lambda x: isinstance(x, tuple))
            self._param_shardings[key] = sh
        return sh

    def cache_shardings(self, cache):
        """The cache pytree with each leaf's NamedSharding from its logical axes
        (`KVCache.logical_axes`: KV heads split over `tensor` when it divides them)."""
        axes = type(cache).logical_axes()
        return type(cache)(**{
            name: NamedSharding(self.mesh, logical_to_spec(ax, getattr(cache, name).shape,
                                                           self.mesh, self.rules))
            for name, ax in axes.items()})

    def put_params(self, params):
        """`params` on this mesh's param shardings (`jax.device_put`: device-to-device for arrays
        already on devices, whatever their sharding; no copy for a leaf already placed)."""
        return jax.device_put(params, self.param_shardings(params))

    def zeros_cache(self, config, batch: int, max_len: int, dtype):
        """An empty `KVCache` created directly in its sharding (never whole on one device)."""
        key = (config, batch, max_len, str(dtype))
        fn = self._zeros.get(key)
        if fn is None:
            abstract = KVCache.abstract(config, batch, max_len, dtype)
            fn = self._zeros[key] = jax.jit(
                lambda: KVCache.zeros(config, batch, max_len, dtype),
                out_shardings=self.cache_shardings(abstract))
        return fn()

    def _in_sharding(self, arg):
        if _is_cache(arg):
            return self.cache_shardings(arg)
        if isinstance(arg, dict):   # the params pytree
            return self.param_shardings(arg)
        return self.replicated

    # ------------------------------------------------------------------ the jit boundary
    def compile(self, fn, args: Sequence[Any], **static_kwargs):
        """`fn` (a `jax.jit` function whose static positional arguments lead `args`; keyword
        arguments are static) compiled for this mesh.

        The static arguments are bound; the executable takes the dynamic positional ones (as
        `fn`'s own compiled executable does), with in/out shardings from this placement and
        `fn`'s own donation. Returns the `jax.stages.Compiled`.
        """
        dyn_info = fn.trace(*args, **static_kwargs).args_info[0]   # dynamic positional args
        n_static = len(args) - len(dyn_info)
        static, dyn = tuple(args[:n_static]), tuple(args[n_static:])
        donate = tuple(i for i, info in enumerate(dyn_info)
                       if any(getattr(a, "donated", False)
                              for a in jax.tree_util.tree_leaves(info)))

        def call(*dynamic):
            return fn(*static, *dynamic, **static_kwargs)

        out = jax.eval_shape(call, *dyn)
        out_sh = jax.tree_util.tree_map(
            lambda x: self.cache_shardings(x) if _is_cache(x) else self.replicated, out,
            is_leaf=_is_cache)
        in_sh = tuple(self._in_sharding(a) for a in dyn)
        return jax.jit(call, in_shardings=in_sh, out_shardings=out_sh,
                       donate_argnums=donate).lower(*dyn).compile()
