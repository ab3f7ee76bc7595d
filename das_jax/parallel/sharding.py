"""Logical-axis sharding rules (MaxText style): one table from the params' logical axes to mesh
axes, used for params, master weights, optimizer state and batches.

Every param leaf has logical axis names (`logical_axes(params)`, from `PARAM_AXES`), e.g. `wq`
`[L, D, H, K]` is `("layers", "embed", "heads", "head_dim")`. A rules table maps each logical
axis to mesh axes (`DEFAULT_RULES`: FSDP shards the `embed` dimension of every matrix over the
`fsdp` axis, tensor parallelism shards heads / MLP / vocabulary over `tensor`, batches are split
over `data` and `fsdp`). `logical_to_spec` turns a leaf's axes into a `PartitionSpec`, skipping
a mesh axis that does not divide the dimension or is already used by another dimension of the
leaf, so one table serves every model size and mesh.

The mesh has axes ("data", "fsdp", "tensor"), all `AxisType.Auto` (in jax 0.10 `jax.make_mesh`
defaults to Explicit axis types, which break the embedding gather).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axes of every param leaf of `das_jax.models.transformer` (its module docstring).
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("norm",),
    "attn_norm": ("layers", "norm"),
    "mlp_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
}

# logical axis -> mesh axes (tried in order; None: replicated).
DEFAULT_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "layers": None,
    "head_dim": None,
    "norm": None,
    "length": None,
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh of Auto axes over `devices` (default: the first
    data * fsdp * tensor devices)."""
    n = data * fsdp * tensor
    devices = list(devices if devices is not None else jax.devices()[:n])
    if len(devices) != n:
        raise ValueError(f"a {data}x{fsdp}x{tensor} mesh needs {n} devices, got {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES,
                axis_types=(AxisType.Auto,) * 3)


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def logical_axes(params) -> Any:
    """The params pytree with each leaf replaced by its tuple of logical axis names.

    Raises:
      KeyError: a leaf whose name is not in `PARAM_AXES` (add it there).
    """
    def axes(path, leaf):
        name = _leaf_name(path)
        if name not in PARAM_AXES:
            raise KeyError(f"no logical axes for param {jax.tree_util.keystr(path)}; add "
                           f"{name!r} to das_jax.parallel.sharding.PARAM_AXES")
        ax = PARAM_AXES[name]
        if len(ax) != len(leaf.shape):
            raise ValueError(f"param {jax.tree_util.keystr(path)} has shape {leaf.shape} but "
                             f"logical axes {ax}")
        return ax
    return jax.tree_util.tree_map_with_path(axes, params)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...] | None] = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec of one array: each dimension gets the mesh axes its logical axis maps to,
    keeping only mesh axes of size > 1 that divide the dimension and are not used yet."""
    used: set[str] = set()
    spec = []
    for ax, dim in zip(axes, shape):
        chosen = []
        size = 1
        for m in (rules.get(ax) or ()) if ax is not None else ():
            n = mesh.shape[m]
            if n > 1 and m not in used and dim % (size * n) == 0:
                chosen.append(m)
                used.add(m)
                size *= n
        spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return PartitionSpec(*spec)


def param_shardings(params, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedSharding per param leaf (params may be arrays or `jax.ShapeDtypeStruct`s)."""
    axes = logical_axes(params)
    return jax.tree_util.tree_map(
        lambda ax, p: NamedSharding(mesh, logical_to_spec(ax, p.shape, mesh, rules)), axes, params,
        is_leaf=lambda x: isinstance(x, tuple))


def like_params_shardings(tree, params, mesh: Mesh, rules=DEFAULT_RULES):
    """Shardings for a pytree holding params-shaped subtrees (optimizer state, gradients): a leaf
    whose path ends with a param's path and has its shape gets that param's sharding; every
    other leaf (step counts, scalars) is replicated."""
    shard = param_shardings(params, mesh, rules)
    by_suffix = {}
    for path, s in jax.tree_util.tree_leaves_with_path(shard):
        by_suffix[jax.tree_util.keystr(path)] = s
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        key = jax.tree_util.keystr(path)
        for suffix, s in by_suffix.items():
            if key.endswith(suffix) and tuple(leaf.shape) == tuple(shapes[suffix]):
                return s
        return replicated
    return jax.tree_util.tree_map_with_path(pick, tree)


def batch_sharding(mesh: Mesh, ndim: int, rules=DEFAULT_RULES, leading: int = 0) -> NamedSharding:
    """Sharding of a batch array: dimension `leading` (the rows) split over the `batch` rule's
    mesh axes, every other dimension replicated."""
    axes = [None] * ndim
    axes[leading] = "batch"
    spec = [None] * ndim
    rows = [m for m in (rules.get("batch") or ()) if mesh.shape[m] > 1]
    spec[leading] = tuple(rows) if len(rows) > 1 else (rows[0] if rows else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


# ----- meshes from the config ---------------------------------------------------------------------

class MeshError(ValueError):
    """A `mesh:` config that does not fit the devices (one line: the sizes, the count, the fix)."""


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """The axis sizes of `sizes` (axis name -> size, -1 for at most one axis: the remaining
    devices) resolved for `num_devices` devices, in `MESH_AXES` order (missing axes: 1).

    Raises:
      MeshError: an unknown axis name, a size < 1 other than -1, two -1 axes, or sizes whose
        product is not `num_devices`.
    """
    unknown = [k for k in sizes if k not in MESH_AXES]
    if unknown:
        raise MeshError(f"mesh: unknown axis {unknown[0]!r}; the axes are {', '.join(MESH_AXES)}")
    shape = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    rest = [a for a, n in shape.items() if n == -1]
    bad = [a for a, n in shape.items() if n < 1 and n != -1]
    if bad or len(rest) > 1:
        raise MeshError(f"mesh: axis sizes must be >= 1 with at most one -1 (the remaining "
                        f"devices), got {_fmt(shape)}")
    fixed = int(np.prod([n for n in shape.values() if n != -1]))
    if rest:
        if num_devices % fixed:
            raise MeshError(f"mesh {_fmt(shape)}: the fixed axes ({fixed} devices) do not divide "
                            f"the {num_devices} devices of this run; pick sizes whose product "
                            f"divides {num_devices}")
        shape[rest[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(f"mesh {_fmt(shape)} has {fixed} devices but this run has {num_devices}; "
                        f"make the sizes multiply to {num_devices} (or set one axis to -1)")
    return shape


def _fmt(shape: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in shape.items()) + "}"


def mesh_from_config(mesh_section, devices=None) -> Mesh:
    """The training mesh of a `config.MeshSection` (or a mapping of axis sizes) over `devices`
    (default: every device of every process, `jax.devices()`).

    Raises:
      MeshError: see `resolve_mesh_shape`.
    """
    sizes = (dict(mesh_section) if isinstance(mesh_section, Mapping)
             else {a: getattr(mesh_section, a) for a in MESH_AXES})
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_mesh_shape(sizes, len(devices))
    return make_mesh(**shape, devices=devices)


def shardings_for(params, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedSharding per param leaf by the rules table (alias of `param_shardings`)."""
    return param_shardings(params, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def batch_shards(mesh: Mesh, rules=DEFAULT_RULES) -> int:
    """Into how many pieces a batch's rows are split (the product of the `batch` rule's axes)."""
    return int(np.prod([mesh.shape[m] for m in (rules.get("batch") or ())]))


def global_array(x, sharding: NamedSharding) -> jax.Array:
    """A global `jax.Array` with `sharding` from a host value `x` that every process holds in
    full (numpy or a jax array); each process places only the shards its devices own, so it also
    works when the mesh spans several processes."""
    x = np.asarray(x) if not isinstance(x, jax.Array) else x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def place(tree, shardings):
    """`global_array` over a pytree (leaves and shardings matched by structure)."""
    return jax.tree_util.tree_map(global_array, tree, shardings)


def to_host(x) -> np.ndarray:
    """A host copy of a fully replicated (or fully addressable) array, also when the array spans
    devices of other processes (each process reads its own replica)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise ValueError("to_host needs a fully replicated array when it spans processes")
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


class TrainShardings:
    """The shardings of the training state for one params tree on `mesh`: `params` (FSDP /
    tensor by the rules), `like(tree)` for params-shaped trees (optimizer state, float32 grads:
    `like_params_shardings`), `rows(ndim, leading)` for batch arrays, `replicated` for scalars."""

    def __init__(self, params, mesh: Mesh, rules=DEFAULT_RULES):
        self.mesh = mesh
        self.rules = rules
        self._params_like = jax.tree_util.tree_map(
            lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        self.params = param_shardings(self._params_like, mesh, rules)
        self.replicated = replicated(mesh)

    def like(self, tree):
        return like_params_shardings(tree, self._params_like, self.mesh, self.rules)

    def rows(self, ndim: int, leading: int = 0) -> NamedSharding:
        return batch_sharding(self.mesh, ndim, self.rules, leading)

    @property
    def row_multiple(self) -> int:
        return batch_shards(self.mesh, self.rules)
