"""The GRPO update with the optimizer fused into a layer-by-layer backward pass.

The train step's default update computes the whole gradient (one float32 copy of the model), then
applies AdamW leaf by leaf: at the end of the backward pass the process holds params, both Adam
moments *and* the gradient (4x the model). `fused_update` never holds the whole gradient. It
runs the backward pass by hand, one decoder layer at a time (a reverse loop over the stacked
layers calling `jax.vjp` of one layer on its saved input), and updates each layer's slice of the
params and Adam moments as soon as that layer's gradient exists; only one layer's gradient is
alive at a time.

The tail (final norm, lm_head, loss) is differentiated by hand too (`head_logprobs`: the head in
vocabulary slices with a written-out backward pass), so that the norm pass never holds the
head's `[V, D]` gradient: it takes that gradient's square and its rows at the batch's tokens
slice by slice, and the embedding's norm follows from them (`_embed_cross_norm`). The last
program (`finish_update`) recomputes the tail's gradient once and adds the embedded tokens'
scatter; AdamW then runs on the embedding in row blocks of ~16 MB, each taken, updated and
written back in place (`_adamw_in_row_blocks`).

Global-norm clipping needs the norm of the whole gradient before any weight moves, so the
backward pass runs twice (LOMO: Lv et al. 2023, "Full Parameter Fine-tuning for Large Language
Models with Limited Resources", arXiv:2306.09782, Sec. 3.3): the first pass sums the squared
gradient layer by layer and throws each layer's gradient away; the second recomputes them,
clips with that norm and applies AdamW. Without clipping (`max_grad_norm` unset) one pass
suffices. The forward runs once: its layer inputs are kept (`[L, G, S, D]`, what per-layer
remat keeps anyway) and both backward passes start from them.

Same math as `LossAndGrad` + `Optimizer.apply_leafwise` (the same layer function, head, loss,
`optax.clip_by_global_norm` formula and `optax.adamw` update on each slice); the numbers differ
only by float summation order (tests/test_fused_update.py checks params, moments, loss and
metrics against the unfused step). Cost: one more backward pass (per-layer recompute + vjp) than
the unfused step with remat, and one more head forward + backward.

The programs are module-level jits whose static arguments are a `FusedSpec` (model, loss,
activation, compute dtype, optimizer) and a `Layout` (the params / AdamW state tree layout).
Scope: one device, the shared-prompt packed micro-batch of `pack_shared_prompts` (the whole
batch in one micro-batch), `activation` set. The train step falls back to the unfused update
for anything else (several micro-batches, a mesh, unpacked rows).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax

from das_jax.models.config import ModelConfig
from das_jax.models.transformer import ActivationConfig, decoder_layer, rms_norm
from das_jax.rl import losses
from das_jax.rl.batches import PackedMicroBatch
from das_jax.rl.head_logprobs import (vocab_chunk_width, vocab_chunked_forward,
                                      vocab_chunked_grad_stats, vocab_chunked_logprobs)
from das_jax.rl.logprobs import chunked_head_logprobs
from das_jax.rl.optimizer import Optimizer

__all__ = ["FusedSpec", "fused_update"]

_BLOCK_BYTES = 16 * 2**20  # AdamW's row blocks of a large non-layer leaf


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """The static facts of a fused update (hashable: the static argument of its programs).

    model_config: the model (params layout of `das_jax.models.transformer`).
    loss_config: `losses.LossConfig` (loss type, clip range, beta, temperature).
    activation: `ActivationConfig` of the forward (attention kernel, head chunking); the layer
      inputs are always kept and each layer recomputed in the backward pass.
    compute_dtype: dtype name of the forward / backward pass (None: the params' own); params
      and moments stay in their own (master) dtype, the gradient is taken in float32.
    optimizer: the run's `Optimizer` (its AdamW and global-norm clip).
    """

    model_config: ModelConfig
    loss_config: losses.LossConfig
    activation: ActivationConfig
    compute_dtype: str | None
    optimizer: Optimizer

    @property
    def clip(self) -> bool:
        return self.optimizer.max_grad_norm is not None

    @property
    def head_key(self) -> str:
        return "embed" if self.model_config.tie_word_embeddings else "lm_head"

    def cast(self, x):
        """`x` in the compute dtype."""
        if self.compute_dtype is None:
            return x
        dt = jnp.dtype(self.compute_dtype)
        return x if x.dtype == dt else x.astype(dt)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The params and AdamW state trees as the programs see them (hashable, static).

    p_def / s_def: tree definitions of the params and of AdamW's state; owner: for each state
    leaf the param leaf it belongs to (-1: shared, the step counts); layer_idx / other_idx: the
    param leaves in and outside `params["layers"]`; s_layer / s_other: their state leaves;
    big_idx: the non-layer leaves updated in row blocks; names: (index, key) of the non-layer
    leaves; layers_def: the tree definition of `params["layers"]`; embed_shape.
    """

    p_def: object
    s_def: object
    owner: tuple
    layer_idx: tuple
    other_idx: tuple
    s_layer: tuple
    s_other: tuple
    big_idx: tuple
    names: tuple
    layers_def: object
    embed_shape: tuple

    @property
    def n(self) -> int:
        return len(self.layer_idx) + len(self.other_idx)

    @property
    def small_idx(self) -> tuple:
        return tuple(i for i in self.other_idx if i not in self.big_idx)

    @classmethod
    def of(cls, optimizer: Optimizer, params, adamw_state) -> "Layout":
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        paths = [jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(params)[0]]
        in_layers = [p.startswith("['layers']") for p in paths]
        owner = optimizer.state_owners(adamw_state, params)
        n = len(p_leaves)
        other_idx = tuple(i for i in range(n) if not in_layers[i])
        return cls(
            p_def=p_def, s_def=jax.tree_util.tree_structure(adamw_state), owner=owner,
            layer_idx=tuple(i for i in range(n) if in_layers[i]), other_idx=other_idx,
            s_layer=tuple(k for k, o in enumerate(owner) if o >= 0 and in_layers[o]),
            s_other=tuple(k for k, o in enumerate(owner) if o >= 0 and not in_layers[o]),
            big_idx=tuple(i for i in other_idx if len(_row_blocks(p_leaves[i])) > 1),
            names=tuple((i, paths[i][2:-2]) for i in other_idx),  # "['embed']" -> "embed"
            layers_def=jax.tree_util.tree_structure(params["layers"]),
            embed_shape=tuple(params["embed"].shape))


def _row_blocks(a) -> list[tuple[int, int]]:
    """(first row, rows) of the blocks of ~`_BLOCK_BYTES` that cover `a`'s leading axis: equal
    blocks and one shorter last block (two compiled block shapes at most). One block for a
    leaf of rank < 2 or under two blocks' worth of rows. `a`: an array or its
    `jax.ShapeDtypeStruct`."""
    rows = a.shape[0] if len(a.shape) else 1
    nbytes = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
    per = max(1, _BLOCK_BYTES // max(1, nbytes // rows))
    if len(a.shape) < 2 or rows < 2 * per:
        return [(0, rows)]
    return [(r, min(per, rows - r)) for r in range(0, rows, per)]


def _sq(leaves):
    return sum(jnp.sum(jnp.square(g)) for g in leaves)


# ---------------------------------------------------------------- the model's pieces (traced)
def _layer(spec: FusedSpec, mb: PackedMicroBatch, x, lp):
    c = spec.model_config
    return decoder_layer(c, c.rope_inv_freq(), x, lp, mb.positions, None, mb.valid,
                         spec.activation, segment_BxT=mb.segments)[0]


def _layer_grad(spec: FusedSpec, mb: PackedMicroBatch, dx, x, lp_master):
    """(dx into the layer, float32 gradient leaves of its params)."""
    _, vjp = jax.vjp(functools.partial(_layer, spec, mb), x,
                     jax.tree_util.tree_map(spec.cast, lp_master))
    dx, dlp = vjp(dx)
    return dx, [g.astype(jnp.float32) for g in jax.tree_util.tree_leaves(dlp)]


def _pre_head(spec: FusedSpec, mb: PackedMicroBatch, x_GxSxD, final_norm):
    """The completion positions' final hidden states `[R, W, D]`."""
    c = spec.model_config
    h = rms_norm(x_GxSxD, final_norm, c.rms_norm_eps, c.contraction)
    return h[mb.row_group[:, None], mb.source]


def _post_head(spec: FusedSpec, mb: PackedMicroBatch, logp, ent):
    """(the loss, the metric sums) from the target log-probs `[R, W]`."""
    logp = jnp.where(mb.completion_mask, logp, 0.0)
    terms = losses.policy_terms(logp, mb.old_logprobs, mb.advantages, mb.completion_mask,
                                mb.ref_logprobs, spec.loss_config)
    return jnp.sum(mb.weights * terms.loss_BxT), losses.metric_sums(terms, mb.completion_mask, ent)


def _chunk_width(spec: FusedSpec, h_RxWxD) -> int:
    R, W, _ = h_RxWxD.shape
    return vocab_chunk_width(spec.model_config.vocab_size, R * W, spec.activation.logits_chunk)


def _tail(spec: FusedSpec, mb: PackedMicroBatch, x_GxSxD, tp):
    """(the loss, the metric sums) from the last hidden states; `tp` the tail's params."""
    h_RxWxD = _pre_head(spec, mb, x_GxSxD, tp["final_norm"])
    temperature = spec.loss_config.temperature
    if spec.model_config.contraction.exact:
        logp, ent = chunked_head_logprobs(spec.model_config, tp, h_RxWxD, mb.targets,
                                          temperature, spec.activation.logits_chunk, True)
    else:  # one [V, D] gradient buffer, not two (head_logprobs)
        R, W, D = h_RxWxD.shape
        logp, ent = (x.reshape(R, W) for x in vocab_chunked_logprobs(
            tp[spec.head_key], h_RxWxD.reshape(R * W, D), mb.targets.reshape(R * W),
            temperature, _chunk_width(spec, h_RxWxD)))
    return _post_head(spec, mb, logp, ent)


def _tail_backward(spec: FusedSpec, mb: PackedMicroBatch, x_GxSxD, tp):
    """The tail's value and backward pass for the norm: (loss, sums, dx, the float32 squared
    norm of the tail params' gradient, the tied head's gradient at the rows of the batch's
    tokens `[G, S, D]` or None). Outside exact mode the head's `[V, D]` gradient is reduced one
    vocabulary slice at a time and never exists whole."""
    if spec.model_config.contraction.exact:
        loss, vjp, sums = jax.vjp(functools.partial(_tail, spec, mb), x_GxSxD, tp, has_aux=True)
        dx, dtail = vjp(jnp.ones_like(loss))
        e_rows = dtail["embed"].astype(jnp.float32)[mb.tokens] if "embed" in dtail else None
        return loss, sums, dx, _sq(v.astype(jnp.float32) for v in dtail.values()), e_rows
    h_RxWxD, pre_vjp = jax.vjp(functools.partial(_pre_head, spec, mb), x_GxSxD, tp["final_norm"])
    R, W, D = h_RxWxD.shape
    C, temperature = _chunk_width(spec, h_RxWxD), spec.loss_config.temperature
    h_NxD, t_N, w_VxD = h_RxWxD.reshape(R * W, D), mb.targets.reshape(R * W), tp[spec.head_key]
    logp, ent, lse = vocab_chunked_forward(w_VxD, h_NxD, t_N, temperature, C)
    loss, post_vjp, sums = jax.vjp(
        lambda lp: _post_head(spec, mb, lp.reshape(R, W), ent.reshape(R, W)), logp, has_aux=True)
    g_logp = post_vjp(jnp.ones_like(loss))[0]
    dh, head_sq, e_rows = vocab_chunked_grad_stats(
        w_VxD, h_NxD, t_N, lse, g_logp, temperature, C,
        rows_M=mb.tokens if spec.head_key == "embed" else None)
    dx, d_norm = pre_vjp(dh.reshape(R, W, D))
    return loss, sums, dx, head_sq + _sq([d_norm.astype(jnp.float32)]), e_rows


def _tail_params(spec: FusedSpec, pairs) -> dict:
    """The tail's params (final norm, head) in the compute dtype, from (name, value) pairs."""
    return {k: spec.cast(v) for k, v in pairs if k in ("final_norm", spec.head_key)}


def _embed_cross_norm(tok, e_rows, dx0):
    """The part of the squared gradient norm that the embedding's two gradients add besides
    their own squares: the tied head's gradient `E` (`[V, D]`) and the scatter-add `S` of the
    token rows' gradients `dx0` (`S[v] = sum_{i: tok_i = v} dx0_i`) sum to the embedding's
    gradient, and `|E + S|^2 = |E|^2 + 2 <E, S> + |S|^2` with `<E, S> = sum_i <E[tok_i], dx0_i>`
    (`e_rows` = `E[tok]`, gathered before the backward pass so that `E` need not stay alive
    through it) and `|S|^2` the squared sum of `dx0` over equal tokens (a segment sum over the
    batch's distinct tokens, `[G * S, D]`, never `[V, D]`). Returns `2 <E, S> + |S|^2` (float32
    scalar)."""
    d = dx0.astype(jnp.float32).reshape(-1, dx0.shape[-1])
    flat = tok.reshape(-1)
    _, inv = jnp.unique(flat, return_inverse=True, size=flat.shape[0])
    seg = jax.ops.segment_sum(d, inv.reshape(-1), num_segments=flat.shape[0])
    cross = 0.0 if e_rows is None else jnp.sum(e_rows.reshape(d.shape) * d)
    return 2.0 * cross + jnp.sum(jnp.square(seg))


def _layer_params(layout: Layout, p_st, i):
    return jax.tree_util.tree_unflatten(layout.layers_def, [a[i] for a in p_st])


def _adamw_on(spec: FusedSpec, layout: Layout, idx, p_vals, g_vals, s_vals, shared):
    """optax.adamw on the param leaves `idx` (values by param index in `p_vals` / `g_vals`, their
    state by state index in `s_vals`, the shared step counts by state index in `shared`);
    returns (new param values by index, new state values by index, squared update norm)."""
    n, owner = layout.n, layout.owner
    p_tree = jax.tree_util.tree_unflatten(layout.p_def, [p_vals.get(i) for i in range(n)])
    g_tree = jax.tree_util.tree_unflatten(layout.p_def, [g_vals.get(i) for i in range(n)])
    st = jax.tree_util.tree_unflatten(layout.s_def, [
        s_vals[k] if o in idx else (shared[k] if o < 0 else None) for k, o in enumerate(owner)])
    upd, st = spec.optimizer.adamw.update(g_tree, st, p_tree)
    new_p = jax.tree_util.tree_flatten(optax.apply_updates(p_tree, upd),
                                       is_leaf=lambda x: x is None)[0]
    new_s = jax.tree_util.tree_flatten(st, is_leaf=lambda x: x is None)[0]
    return ({i: new_p[i] for i in idx},
            {k: new_s[k] for k, o in enumerate(owner) if o in idx or o < 0},
            optax.tree.norm(upd, squared=True))


def _clipped(spec: FusedSpec, g, norm):
    if not spec.clip:
        return g
    max_norm = spec.optimizer.max_grad_norm  # optax.clip_by_global_norm's formula
    return jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


# ---------------------------------------------------------------- the programs
@functools.partial(jax.jit, static_argnums=(0, 1))
def forward_and_norm(spec: FusedSpec, layout: Layout, params, xs: PackedMicroBatch):
    """Program 1: the forward (keeping each layer's input and the last hidden state), and with
    the clip the tail's vjp and the first backward pass (the global gradient norm, one layer's
    gradient at a time). The tail's own gradient (the `[V, D]` head) is never whole here: only
    its square and its rows at the batch's tokens are taken (`_tail_backward`), and
    `finish_update` recomputes it (one more head vjp per step)."""
    mb = xs.first()
    x0 = spec.cast(params["embed"])[mb.tokens]
    xL, x_in_L = jax.lax.scan(lambda x, lp: (_layer(spec, mb, x, lp), x), x0,
                              jax.tree_util.tree_map(spec.cast, params["layers"]))
    loss, sums, dxL, tail_sq, e_rows = _tail_backward(spec, mb, xL,
                                                      _tail_params(spec, params.items()))
    if not spec.clip:
        return loss, sums, x_in_L, dxL, xL, None
    p_layers = jax.tree_util.tree_leaves(params["layers"])

    def body(carry, inp):
        dx, total = carry
        x, i = inp
        dx, g = _layer_grad(spec, mb, dx, x, _layer_params(layout, p_layers, i))
        return (dx, total + _sq(g)), None
    (dx0, layers_sq), _ = jax.lax.scan(body, (dxL, jnp.zeros((), jnp.float32)),
                                       (x_in_L, jnp.arange(spec.model_config.num_layers)),
                                       reverse=True)
    total = layers_sq + tail_sq + _embed_cross_norm(mb.tokens, e_rows, dx0)
    return loss, sums, x_in_L, dxL, xL, jnp.sqrt(total)


@functools.partial(jax.jit, static_argnums=(0, 1))
def layer_update(spec: FusedSpec, layout: Layout, xs, dx, x, p_i, s_i, shared, norm):
    """Program 2, one layer: its gradient (vjp at its saved input), clipped, and AdamW on its
    slices `p_i` / `s_i`; returns (dx into the layer below, new slices, |g|^2, |u|^2). `xs`
    None: nothing to train on this step, a zero gradient (AdamW still moves)."""
    if xs is None:
        g = [jnp.zeros(a.shape, jnp.float32) for a in p_i]
    else:
        dx, g = _layer_grad(spec, xs.first(), dx, x,
                            jax.tree_util.tree_unflatten(layout.layers_def, p_i))
    idx = layout.layer_idx
    new_p, new_s, u = _adamw_on(spec, layout, set(idx), dict(zip(idx, p_i)),
                                {li: _clipped(spec, gi, norm) for li, gi in zip(idx, g)},
                                dict(zip(layout.s_layer, s_i)), shared)
    return dx, [new_p[i] for i in idx], [new_s[k] for k in layout.s_layer], _sq(g), u


@jax.jit
def take_slices(stacks, i):
    return jax.tree_util.tree_map(lambda a: a[i], stacks)


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_slices(stacks, i, values):
    """Writes slice i of each stacked buffer, in place (the buffers are donated and only written
    here, so XLA does not copy them)."""
    return jax.tree_util.tree_map(lambda a, v: a.at[i].set(v), stacks, values)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(7, 8))
def finish_update(spec: FusedSpec, layout: Layout, xs, xL, dx0, norm, layers_gsq, p_o, s_o,
                  shared, p_big):
    """The non-layer params' gradient (the tail's vjp at the kept last hidden state `xL`, plus
    the embedded tokens' scatter-add of `dx0`) and AdamW on the small ones (final norm), which
    also advances the shared step counts; the gradient / update norms. The large ones (`p_big`,
    not donated: the embedding, an untied head) get only their gradient, returned for
    `_adamw_in_row_blocks`."""
    names, small_idx, big_idx = dict(layout.names), layout.small_idx, layout.big_idx
    p_vals = {**dict(zip(small_idx, p_o)), **dict(zip(big_idx, p_big))}
    if xs is None:
        g_tail = {names[i]: jnp.zeros(a.shape, jnp.float32) for i, a in p_vals.items()}
        norm = jnp.zeros((), jnp.float32)
    else:
        mb = xs.first()
        tp = _tail_params(spec, ((names[i], p) for i, p in p_vals.items()))
        loss, tail_vjp, _ = jax.vjp(lambda t: _tail(spec, mb, xL, t), tp, has_aux=True)
        # the tail's gradient, and the embedding's: the tied head's plus the scatter-add of the
        # embedded tokens' gradient
        g_tail = {k: v.astype(jnp.float32) for k, v in tail_vjp(jnp.ones_like(loss))[0].items()}
        emb = g_tail.get("embed", jnp.zeros(layout.embed_shape, jnp.float32))
        g_tail["embed"] = emb.at[mb.tokens].add(dx0.astype(jnp.float32))
        if not spec.clip:
            norm = jnp.sqrt(layers_gsq + _sq(g_tail.values()))
    s_small = [k for k in layout.s_other if layout.owner[k] not in big_idx]
    new_p, new_s, u = _adamw_on(spec, layout, set(small_idx), {i: p_vals[i] for i in small_idx},
                                {i: _clipped(spec, g_tail[names[i]], norm) for i in small_idx},
                                dict(zip(s_small, s_o)), shared)
    return new_p, new_s, u, norm, [g_tail[names[i]] for i in big_idx]


@functools.partial(jax.jit, static_argnums=(2,))
def _take_rows(stacks, r0, size):
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, r0, size, 0), stacks)


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_rows(stacks, r0, values):
    """Writes rows [r0, r0 + len) of each donated buffer, in place."""
    return jax.tree_util.tree_map(
        lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, r0, 0), stacks, values)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _block_adamw(spec: FusedSpec, layout: Layout, i: int, keys: tuple, p_b, g_b, s_b, shared,
                 norm):
    """AdamW (clipped gradient) on a block of rows of leaf `i` (its state leaves `keys`):
    (new p, new moments, |u|^2)."""
    new_p, new_s, u = _adamw_on(spec, layout, {i}, {i: p_b}, {i: _clipped(spec, g_b, norm)},
                                dict(zip(keys, s_b)), shared)
    return new_p[i], [new_s[k] for k in keys], u


def _adamw_in_row_blocks(spec, layout, i, keys, p, g, s, shared, norm):
    """AdamW on a large leaf `p` (index `i`, its moments `s` at state indices `keys`, gradient
    `g`) in blocks of rows of ~16 MB: each block taken, updated and written back in place
    (`_put_rows` donates the buffers), so the moments' and the update's temporaries are a block
    each, not a leaf each (AdamW is elementwise: same values). Returns (new p, new moments,
    |u|^2)."""
    u = jnp.zeros((), jnp.float32)
    for r0, size in _row_blocks(p):
        p_b, g_b, s_b = _take_rows((p, g, s), r0, size)
        new_p, new_s, u_b = _block_adamw(spec, layout, i, keys, p_b, g_b, s_b, shared, norm)
        del p_b, s_b
        p, s = _put_rows((p, s), r0, (new_p, new_s))
        u = u + u_b
    return p, s, u


# ---------------------------------------------------------------- the driver
def fused_update(spec: FusedSpec, params, opt_state, xs: PackedMicroBatch | None):
    """One GRPO step with AdamW fused into the backward pass.

    Args:
      spec: the `FusedSpec`.
      params: the (master) params; consumed (their buffers reused): the caller must not reuse
        them.
      opt_state: `spec.optimizer.init(params)`'s layout; consumed too.
      xs: the whole batch as one `PackedMicroBatch` (leading axis 1), or None when no row is
        trained on (every advantage 0 under `skip_zero_advantage`): the AdamW step with a zero
        gradient, as the unfused path takes it, without allocating that gradient.

    Returns:
      (new params, new opt_state, scalar loss `sum(w * per_token_loss)`, the
      `losses.metric_sums` dict, `{"grad_norm", "update_norm"}`), float32 scalars; grad_norm
      before clipping.
    """
    L = spec.model_config.num_layers
    clip_state, inner = spec.optimizer.split_state(opt_state)
    layout = Layout.of(spec.optimizer, params, inner)
    zero = jnp.zeros((), jnp.float32)
    if xs is None:
        loss, sums = zero, {k: zero for k in losses.METRIC_SUM_KEYS}
        x_in_L, dx, xL, norm = [None] * L, None, None, zero
    else:
        loss, sums, x_in_L, dx, xL, norm = forward_and_norm(spec, layout, params, xs)
    if norm is None:
        norm = zero  # unused without the clip
    p_leaves = jax.tree_util.tree_leaves(params)
    s_leaves = jax.tree_util.tree_leaves(inner)
    shared = {k: s_leaves[k] for k, o in enumerate(layout.owner) if o < 0}
    del params, opt_state, inner
    # pass 2, a layer at a time from the top: gradient, AdamW, written back in place
    p_st = [p_leaves[i] for i in layout.layer_idx]
    s_st = [s_leaves[k] for k in layout.s_layer]
    gsq, usq = zero, zero
    for i in reversed(range(L)):
        p_i, s_i = take_slices((p_st, s_st), i)
        dx, new_p, new_s, g2, u = layer_update(spec, layout, xs, dx, x_in_L[i], p_i, s_i,
                                                shared, norm)
        p_st, s_st = _put_slices((p_st, s_st), i, (new_p, new_s))
        gsq, usq = gsq + g2, usq + u
    del x_in_L
    new_p, new_s, u, norm, g_big = finish_update(
        spec, layout, xs, xL, dx, norm, gsq, [p_leaves[i] for i in layout.small_idx],
        [s_leaves[k] for k in layout.s_other if layout.owner[k] not in layout.big_idx], shared,
        [p_leaves[i] for i in layout.big_idx])
    for i, g in zip(layout.big_idx, g_big):
        keys = tuple(k for k in layout.s_other if layout.owner[k] == i)
        new_p[i], s_i, u_i = _adamw_in_row_blocks(spec, layout, i, keys, p_leaves[i], g,
                                                  [s_leaves[k] for k in keys], shared, norm)
        new_s.update(zip(keys, s_i))
        u = u + u_i
    del g_big
    p_leaves = [new_p.get(i, a) for i, a in enumerate(_put_back(p_leaves, layout.layer_idx, p_st))]
    s_leaves = [new_s.get(k, a) for k, a in enumerate(_put_back(s_leaves, layout.s_layer, s_st))]
    new_state = spec.optimizer.join_state(clip_state,
                                          jax.tree_util.tree_unflatten(layout.s_def, s_leaves))
    return (jax.tree_util.tree_unflatten(layout.p_def, p_leaves), new_state, loss, sums,
            {"grad_norm": norm, "update_norm": jnp.sqrt(usq + u)})


def _put_back(leaves, idx, values) -> list:
    """`leaves` with entry `idx[j]` replaced by `values[j]`."""
    out = list(leaves)
    for i, a in zip(idx, values):
        out[i] = a
    return out
