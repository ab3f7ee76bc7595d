"""The GRPO update with the optimizer fused into a layer-by-layer backward pass.

`make_train_step`'s default update computes the whole gradient (one float32 copy of the model),
then applies AdamW leaf by leaf: at the end of the backward pass the process holds params, both
Adam moments *and* the gradient (4x the model; 2.15 GB of the CPU main job's 3.4 GB peak for a
538 MB model). `make_fused_update` never holds the whole gradient. It runs the backward pass
by hand, one decoder layer at a time (a reverse `lax.scan` over the stacked layers calling
`jax.vjp` of one layer on its saved input), and updates each layer's slice of the params and
Adam moments as soon as that layer's gradient exists; only one layer's gradient is alive at a
time.

The tail (final norm, lm_head, loss) is differentiated by hand too (`head_logprobs`: the head in
vocabulary slices with a written-out backward pass), so that the norm pass never holds the
head's `[V, D]` gradient: it takes that gradient's square and its rows at the batch's tokens
slice by slice, and the embedding's norm follows from them (`embed_cross_norm`). The last
program (`finish`) recomputes the tail's gradient once and adds the embedded tokens' scatter;
AdamW then runs on the embedding in row blocks of ~16 MB, each taken, updated and written back
in place (`adamw_in_row_blocks`). With this, the CPU main job's
update holds at most ~0.33 GB beyond params and moments (`forward_and_norm` at 8 groups x 256
tokens: the layer inputs and one layer's backward scratch); it was ~0.5 GB with the tail's
gradient kept, and ~0.6 GB more with the whole gradient.

Global-norm clipping needs the norm of the whole gradient before any weight moves, so the
backward pass runs twice (LOMO: Lv et al. 2023, "Full Parameter Fine-tuning for Large Language
Models with Limited Resources", arXiv:2306.09782, Sec. 3.3): the first pass sums the squared
gradient layer by layer and throws each layer's gradient away; the second recomputes them,
clips with that norm and applies AdamW. Without clipping (`max_grad_norm` unset) one pass
suffices. The forward runs once: its layer inputs are kept (`[L, G, S, D]`, what per-layer
remat keeps anyway) and both backward passes start from them.

Same math as `make_loss_and_grad` + `make_leafwise_apply` (the same layer function, head,
loss, `optax.clip_by_global_norm` formula and `optax.adamw` update on each slice); the numbers
differ only by float summation order (tests/test_fused_update.py checks params, moments, loss
and metrics against the unfused step to 1e-5). Cost: one more backward pass (per-layer
recompute + vjp) than the unfused step with remat, and one more head forward + backward.

Scope: one device, the shared-prompt packed micro-batch of `pack_shared_prompts` (the whole
batch in one micro-batch), `activation` set. `make_train_step` falls back to the unfused step
for anything else (several micro-batches, a mesh, unpacked rows).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from das_jax.models.config import ModelConfig
from das_jax.models.transformer import ActivationConfig, decoder_layer, rms_norm
from das_jax.rl import losses
from das_jax.rl.head_logprobs import (vocab_chunk_width, vocab_chunked_forward,
                                      vocab_chunked_grad_stats, vocab_chunked_logprobs)

__all__ = ["make_fused_update"]


def _state_owners(adamw, inner, params):
    """For each leaf of the AdamW state `inner`: the index of the param leaf it belongs to
    (its moments), or -1 for a leaf shared by all params (the step counts)."""
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    marks = jax.tree_util.tree_unflatten(p_def, list(range(len(p_leaves))))
    return jax.tree_util.tree_leaves(optax.tree_utils.tree_map_params(
        adamw, lambda _, i: i, inner, marks, transform_non_params=lambda _: -1))


_BLOCK_BYTES = 16 * 2**20  # AdamW's row blocks of a large non-layer leaf


def _row_blocks(a) -> list[tuple[int, int]]:
    """(first row, rows) of the blocks of ~`_BLOCK_BYTES` that cover `a`'s leading axis: equal
    blocks and one shorter last block (two compiled block shapes at most). One block for a
    leaf of rank < 2 or under two blocks' worth of rows."""
    rows = a.shape[0] if a.ndim else 1
    per = max(1, _BLOCK_BYTES // max(1, a.nbytes // rows))
    if a.ndim < 2 or rows < 2 * per:
        return [(0, rows)]
    return [(r, min(per, rows - r)) for r in range(0, rows, per)]


@dataclasses.dataclass(frozen=True)
class _Like:
    """The static facts about the params that the per-layer programs need."""
    embed_shape: tuple
    layers_def: object

    def __getitem__(self, key):  # helpers() reads params["embed"].shape
        assert key == "embed"
        return jax.ShapeDtypeStruct(self.embed_shape, jnp.float32)


def make_fused_update(model_config: ModelConfig, loss_config: losses.LossConfig, adamw,
                      max_grad_norm: float | None, activation: ActivationConfig,
                      compute_dtype: str | None = None):
    """Builds `update(params, opt_state, xs) -> (params, opt_state, loss, sums, norms)`.

    Args:
      model_config: static model config (params layout of `das_jax.models.transformer`).
      loss_config: `losses.LossConfig` (loss type, clip range, beta, temperature).
      adamw: the `optax.adamw` transform of `_optimizer_parts` (the second part of
        `make_optimizer`'s chain).
      max_grad_norm: the global-norm clip (`optax.clip_by_global_norm`), or None for no clip;
        `opt_state` is then AdamW's state alone, else `(clip state, AdamW state)` as
        `make_optimizer` lays it out.
      activation: `ActivationConfig` of the forward (attention kernel, head chunking); the
        layer inputs are always kept and each layer recomputed in the backward pass.
      compute_dtype: dtype name of the forward / backward pass (None: the params' own); params
        and moments stay in their own (master) dtype, the gradient is taken in float32.

    The returned function is jitted with params and opt_state donated (the caller must not reuse
    them). `xs` is the 12-tuple of `pack_shared_prompts` (leading micro-batch axis of 1).
    Returns the new params and opt_state, the scalar loss `sum(w * per_token_loss)`, the
    `losses.metric_sums` dict, and `{"grad_norm", "update_norm"}` (float32 scalars; grad_norm
    before clipping).
    """
    loss_fn = losses.get_loss(loss_config.loss_type)
    config = model_config
    clip = max_grad_norm is not None and max_grad_norm > 0
    max_norm = float(max_grad_norm) if clip else None
    head_key = "embed" if config.tie_word_embeddings else "lm_head"
    cdtype = None if compute_dtype is None else jnp.dtype(compute_dtype)

    def cast(x):
        return x if cdtype is None or x.dtype == cdtype else x.astype(cdtype)

    def helpers(params, xs):
        """The pieces the programs use: the layer function, its gradient, the tail. `params`
        may be a `_Like` (the embedding's shape is all that is read)."""
        from das_jax.rl.train_step import chunked_head_logprobs
        tok, pos, val, seg, grp, src, tgt, cmask, old, ref, adv, w = (x[0] for x in xs)
        inv_freq = config.rope_inv_freq()

        def layer(x, lp):
            return decoder_layer(config, inv_freq, x, lp, pos, None, val, activation,
                                 segment_BxT=seg)[0]

        def layer_grad(dx, x, lp_master):
            """(dx into the layer, float32 gradient leaves of its params)."""
            _, vjp = jax.vjp(layer, x, jax.tree_util.tree_map(cast, lp_master))
            dx, dlp = vjp(dx)
            return dx, [g.astype(jnp.float32) for g in jax.tree_util.tree_leaves(dlp)]

        def pre_head(x_GxSxD, final_norm):
            """The completion positions' final hidden states `[R, W, D]`."""
            h = rms_norm(x_GxSxD, final_norm, config.rms_norm_eps, config.contraction)
            return h[grp[:, None], src]

        def post_head(logp, ent):
            """(the loss, the metric sums) from the target log-probs `[R, W]`."""
            logp = jnp.where(cmask, logp, 0.0)
            terms = loss_fn.per_token(logp, old, adv, cmask, ref, loss_config)
            return jnp.sum(w * terms.loss_BxT), losses.metric_sums(terms, cmask, ent)

        def chunk_width(h_RxWxD):
            R, W, _ = h_RxWxD.shape
            return vocab_chunk_width(config.vocab_size, R * W, activation.logits_chunk)

        def tail(x_GxSxD, tp):
            h_RxWxD = pre_head(x_GxSxD, tp["final_norm"])
            if config.contraction.exact:
                logp, ent = chunked_head_logprobs(config, tp, h_RxWxD, tgt,
                                                  loss_config.temperature,
                                                  activation.logits_chunk, True)
            else:  # one [V, D] gradient buffer, not two (head_logprobs)
                R, W, D = h_RxWxD.shape
                logp, ent = (x.reshape(R, W) for x in vocab_chunked_logprobs(
                    tp[head_key], h_RxWxD.reshape(R * W, D), tgt.reshape(R * W),
                    loss_config.temperature, chunk_width(h_RxWxD)))
            return post_head(logp, ent)

        def tail_backward(x_GxSxD, tp):
            """The tail's value and backward pass for the norm: (loss, sums, dx, the float32
            squared norm of the tail params' gradient, the tied head's gradient at the rows of
            the batch's tokens `[G, S, D]` or None). Outside exact mode the head's `[V, D]`
            gradient is reduced one vocabulary slice at a time and never exists whole."""
            if config.contraction.exact:
                loss, vjp, sums = jax.vjp(tail, x_GxSxD, tp, has_aux=True)
                dx, dtail = vjp(jnp.ones_like(loss))
                e_rows = dtail["embed"].astype(jnp.float32)[tok] if "embed" in dtail else None
                return loss, sums, dx, sq(v.astype(jnp.float32) for v in dtail.values()), e_rows
            h_RxWxD, pre_vjp = jax.vjp(pre_head, x_GxSxD, tp["final_norm"])
            R, W, D = h_RxWxD.shape
            C = chunk_width(h_RxWxD)
            h_NxD, t_N, w_VxD = h_RxWxD.reshape(R * W, D), tgt.reshape(R * W), tp[head_key]
            logp, ent, lse = vocab_chunked_forward(w_VxD, h_NxD, t_N, loss_config.temperature, C)
            loss, post_vjp, sums = jax.vjp(
                lambda lp: post_head(lp.reshape(R, W), ent.reshape(R, W)), logp, has_aux=True)
            g_logp = post_vjp(jnp.ones_like(loss))[0]
            dh, head_sq, e_rows = vocab_chunked_grad_stats(
                w_VxD, h_NxD, t_N, lse, g_logp, loss_config.temperature, C,
                rows_M=tok if head_key == "embed" else None)
            dx, d_norm = pre_vjp(dh.reshape(R, W, D))
            return loss, sums, dx, head_sq + sq([d_norm.astype(jnp.float32)]), e_rows

        def tail_grads(dtail, dx0):
            """float32 gradients of the non-layer params: the tail's, and the embedding's
            (the tied head's plus the scatter-add of the embedded tokens' gradient)."""
            g = {k: v.astype(jnp.float32) for k, v in dtail.items()}
            emb = g.get("embed", jnp.zeros(params["embed"].shape, jnp.float32))
            g["embed"] = emb.at[tok].add(dx0.astype(jnp.float32))
            return g

        return layer, layer_grad, tail, tail_grads, tail_backward

    def sq(leaves):
        return sum(jnp.sum(jnp.square(g)) for g in leaves)

    def layer_params(params, p_st, i):
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params["layers"]),
                                            [a[i] for a in p_st])

    L = config.num_layers

    def tail_params(pairs):
        """The tail's params (final norm, head) in the compute dtype, from (name, value) pairs."""
        return {k: cast(v) for k, v in pairs if k in ("final_norm", head_key)}

    def embed_cross_norm(tok, e_rows, dx0):
        """The part of the squared gradient norm that the embedding's two gradients add besides
        their own squares: the tied head's gradient `E` (`[V, D]`) and the scatter-add `S` of
        the token rows' gradients `dx0` (`S[v] = sum_{i: tok_i = v} dx0_i`) sum to the
        embedding's gradient, and `|E + S|^2 = |E|^2 + 2 <E, S> + |S|^2` with
        `<E, S> = sum_i <E[tok_i], dx0_i>` (`e_rows` = `E[tok]`, gathered before the backward
        pass so that `E` need not stay alive through it) and `|S|^2` the squared sum of `dx0`
        over equal tokens (a segment sum over the batch's distinct tokens, `[G * S, D]`, never
        `[V, D]`). Returns `2 <E, S> + |S|^2` (float32 scalar)."""
        d = dx0.astype(jnp.float32).reshape(-1, dx0.shape[-1])
        flat = tok.reshape(-1)
        _, inv = jnp.unique(flat, return_inverse=True, size=flat.shape[0])
        seg = jax.ops.segment_sum(d, inv.reshape(-1), num_segments=flat.shape[0])
        cross = 0.0 if e_rows is None else jnp.sum(e_rows.reshape(d.shape) * d)
        return 2.0 * cross + jnp.sum(jnp.square(seg))

    @jax.jit
    def forward_and_norm(params, xs):
        """Program 1: the forward (keeping each layer's input and the last hidden state), and
        with the clip the tail's vjp and the first backward pass (the global gradient norm, one
        layer's gradient at a time). The tail's own gradient (the `[V, D]` head) is never
        whole here: only its square and its rows at the batch's tokens are taken
        (`tail_backward`), and `finish` recomputes it (one more head vjp per step; the CPU main
        job's update peaks ~0.2 GB lower than with the gradient kept)."""
        layer, layer_grad, _, _, tail_backward = helpers(params, xs)
        tok = xs[0][0]
        x0 = cast(params["embed"])[tok]
        xL, x_in_L = jax.lax.scan(lambda x, lp: (layer(x, lp), x), x0,
                                  jax.tree_util.tree_map(cast, params["layers"]))
        loss, sums, dxL, tail_sq, e_rows = tail_backward(xL, tail_params(params.items()))
        if not clip:
            return loss, sums, x_in_L, dxL, xL, None
        p_layers = jax.tree_util.tree_leaves(params["layers"])

        def body(carry, inp):
            dx, total = carry
            x, i = inp
            dx, g = layer_grad(dx, x, layer_params(params, p_layers, i))
            return (dx, total + sq(g)), None
        (dx0, layers_sq), _ = jax.lax.scan(body, (dxL, jnp.zeros((), jnp.float32)),
                                           (x_in_L, jnp.arange(L)), reverse=True)
        total = layers_sq + tail_sq + embed_cross_norm(tok, e_rows, dx0)
        return loss, sums, x_in_L, dxL, xL, jnp.sqrt(total)

    def adamw_on(idx, p_vals, g_vals, s_vals, s_def, owner, shared, p_def, n):
        """optax.adamw on the param leaves `idx` (values by param index in `p_vals` /
        `g_vals`, their state by state index in `s_vals`, the shared step counts by state index
        in `shared`); returns (new param values by index, new state values by index, squared
        update norm)."""
        p_tree = jax.tree_util.tree_unflatten(p_def, [p_vals.get(i) for i in range(n)])
        g_tree = jax.tree_util.tree_unflatten(p_def, [g_vals.get(i) for i in range(n)])
        st = jax.tree_util.tree_unflatten(s_def, [
            s_vals[k] if o in idx else (shared[k] if o < 0 else None)
            for k, o in enumerate(owner)])
        upd, st = adamw.update(g_tree, st, p_tree)
        new_p = jax.tree_util.tree_flatten(optax.apply_updates(p_tree, upd),
                                           is_leaf=lambda x: x is None)[0]
        new_s = jax.tree_util.tree_flatten(st, is_leaf=lambda x: x is None)[0]
        return ({i: new_p[i] for i in idx}, {k: new_s[k] for k, o in enumerate(owner)
                                             if o in idx or o < 0},
                optax.tree.norm(upd, squared=True))

    def clipped(g, norm):
        if not clip:
            return g
        # optax.clip_by_global_norm's formula
        return jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def layer_update(meta, params_like, xs, dx, x, p_i, s_i, shared, norm):
        """Program 2, one layer: its gradient (vjp at its saved input), clipped, and AdamW on
        its slices `p_i` / `s_i`; returns (dx into the layer below, new slices, |g|^2, |u|^2)."""
        layer_idx, s_layer, s_def, owner, p_def, n = meta
        if xs is None:  # nothing to train on this step: a zero gradient (AdamW still moves)
            g = [jnp.zeros(a.shape, jnp.float32) for a in p_i]
        else:
            _, layer_grad, _, _, _ = helpers(params_like, xs)
            dx, g = layer_grad(dx, x, jax.tree_util.tree_unflatten(params_like.layers_def, p_i))
        new_p, new_s, u = adamw_on(set(layer_idx), dict(zip(layer_idx, p_i)),
                                   {li: clipped(gi, norm) for li, gi in zip(layer_idx, g)},
                                   dict(zip(s_layer, s_i)), s_def, owner, shared, p_def, n)
        return (dx, [new_p[i] for i in layer_idx], [new_s[k] for k in s_layer], sq(g), u)

    @jax.jit
    def take_slices(stacks, i):
        return jax.tree_util.tree_map(lambda a: a[i], stacks)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def put_slices(stacks, i, values):
        """Writes slice i of each stacked buffer, in place (the buffers are donated and only
        written here, so XLA does not copy them)."""
        return jax.tree_util.tree_map(lambda a, v: a.at[i].set(v), stacks, values)

    @functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(7, 8))
    def finish(meta, params_like, xs, xL, dx0, norm, layers_gsq, p_o, s_o, shared, p_big):
        """The non-layer params' gradient (the tail's vjp at the kept last hidden state `xL`,
        plus the embedded tokens' scatter-add of `dx0`) and AdamW on the small ones (final
        norm), which also advances the shared step counts; the gradient / update norms. The
        large ones (`p_big`, not donated: the embedding, an untied head) get only their
        gradient, returned for `adamw_in_row_blocks`."""
        other_idx, big_idx, s_other, s_def, owner, p_def, n, names = meta
        names = dict(names)
        small_idx = [i for i in other_idx if i not in big_idx]
        p_vals = {**dict(zip(small_idx, p_o)), **dict(zip(big_idx, p_big))}
        if xs is None:
            g_tail = {names[i]: jnp.zeros(a.shape, jnp.float32) for i, a in p_vals.items()}
            norm = jnp.zeros((), jnp.float32)
        else:
            _, _, tail, tail_grads, _ = helpers(params_like, xs)
            tp = tail_params((names[i], p) for i, p in p_vals.items())
            loss, tail_vjp, _ = jax.vjp(lambda t: tail(xL, t), tp, has_aux=True)
            g_tail = tail_grads(tail_vjp(jnp.ones_like(loss))[0], dx0)
            if not clip:
                norm = jnp.sqrt(layers_gsq + sq(g_tail.values()))
        new_p, new_s, u = adamw_on(set(small_idx), {i: p_vals[i] for i in small_idx},
                                   {i: clipped(g_tail[names[i]], norm) for i in small_idx},
                                   dict(zip([k for k in s_other if owner[k] not in big_idx],
                                            s_o)), s_def, owner, shared, p_def, n)
        return new_p, new_s, u, norm, [g_tail[names[i]] for i in big_idx]

    @functools.partial(jax.jit, static_argnums=(2,))
    def take_rows(stacks, r0, size):
        return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, r0, size, 0),
                                      stacks)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def put_rows(stacks, r0, values):
        """Writes rows [r0, r0 + len) of each donated buffer, in place."""
        return jax.tree_util.tree_map(
            lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, r0, 0), stacks, values)

    @functools.partial(jax.jit, static_argnums=(0,))
    def block_adamw(meta, p_b, g_b, s_b, shared, norm):
        """AdamW (clipped gradient) on a block of rows of one leaf: (new p, new moments, |u|^2)."""
        i, keys, s_def, owner, p_def, n = meta
        new_p, new_s, u = adamw_on({i}, {i: p_b}, {i: clipped(g_b, norm)},
                                   dict(zip(keys, s_b)), s_def, owner, shared, p_def, n)
        return new_p[i], [new_s[k] for k in keys], u

    def adamw_in_row_blocks(meta, p, g, s, shared, norm):
        """AdamW on a large leaf `p` (its moments `s`, gradient `g`) in blocks of rows of ~16 MB:
        each block taken, updated and written back in place (`put_rows` donates the buffers),
        so the moments' and the update's temporaries are a block each, not a leaf each (~3 x
        113 MB for the CPU main job's embedding; AdamW is elementwise: same values). Returns
        (new p, new moments, |u|^2)."""
        u = jnp.zeros((), jnp.float32)
        for r0, size in _row_blocks(p):
            p_b, g_b, s_b = take_rows((p, g, s), r0, size)
            new_p, new_s, u_b = block_adamw(meta, p_b, g_b, s_b, shared, norm)
            del p_b, s_b
            p, s = put_rows((p, s), r0, (new_p, new_s))
            u = u + u_b
        return p, s, u

    def update(params, opt_state, xs):
        """One GRPO step: (params, opt_state, loss, metric sums, norms); params and opt_state
        are consumed (their buffers reused). `xs` None: no row to train on (every advantage 0
        under `skip_zero_advantage`): the AdamW step with a zero gradient, as the unfused
        path takes it, without allocating that gradient."""
        if xs is None:
            zero = jnp.zeros((), jnp.float32)
            loss, sums = zero, {k: zero for k in losses.METRIC_SUM_KEYS}
            x_in_L, dx, xL, norm = [None] * L, None, None, zero
        else:
            loss, sums, x_in_L, dx, xL, norm = forward_and_norm(params, xs)
        inner = opt_state[1] if clip else opt_state
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        paths = [jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(params)[0]]
        in_layers = [p.startswith("['layers']") for p in paths]
        owner = tuple(_state_owners(adamw, inner, params))
        s_leaves, s_def = jax.tree_util.tree_flatten(inner)
        n = len(p_leaves)
        layer_idx = tuple(i for i in range(n) if in_layers[i])
        other_idx = tuple(i for i in range(n) if not in_layers[i])
        s_layer = tuple(k for k, o in enumerate(owner) if o >= 0 and in_layers[o])
        s_other = tuple(k for k, o in enumerate(owner) if o >= 0 and not in_layers[o])
        shared = {k: s_leaves[k] for k, o in enumerate(owner) if o < 0}
        shapes = _Like(tuple(params["embed"].shape),
                       jax.tree_util.tree_structure(params["layers"]))
        clip_state = opt_state[0] if clip else None
        zero = jnp.zeros((), jnp.float32)
        if norm is None:
            norm = zero  # unused without the clip
        # pass 2, a layer at a time from the top: gradient, AdamW, written back in place
        p_st = [p_leaves[i] for i in layer_idx]
        s_st = [s_leaves[k] for k in s_layer]
        del params, opt_state, inner
        meta = (layer_idx, s_layer, s_def, owner, p_def, n)
        gsq, usq = zero, zero
        for i in reversed(range(L)):
            p_i, s_i = take_slices((p_st, s_st), i)
            dx, new_p, new_s, g2, u = layer_update(meta, shapes, xs, dx, x_in_L[i], p_i, s_i,
                                                   shared, norm)
            p_st, s_st = put_slices((p_st, s_st), i, (new_p, new_s))
            gsq, usq = gsq + g2, usq + u
        del x_in_L
        names = {i: paths[i][2:-2] for i in other_idx}  # "['embed']" -> "embed"
        big_idx = tuple(i for i in other_idx if len(_row_blocks(p_leaves[i])) > 1)
        small_idx = [i for i in other_idx if i not in big_idx]
        new_p, new_s, u, norm, g_big = finish(
            (other_idx, big_idx, s_other, s_def, owner, p_def, n,
             tuple(sorted(names.items()))), shapes, xs, xL, dx, norm, gsq,
            [p_leaves[i] for i in small_idx],
            [s_leaves[k] for k in s_other if owner[k] not in big_idx], shared,
            [p_leaves[i] for i in big_idx])
        for i, g in zip(big_idx, g_big):
            keys = tuple(k for k in s_other if owner[k] == i)
            p_i, s_i, u_i = adamw_in_row_blocks((i, keys, s_def, owner, p_def, n),
                                                p_leaves[i], g, [s_leaves[k] for k in keys],
                                                shared, norm)
            new_p[i] = p_i
            new_s.update(zip(keys, s_i))
            u = u + u_i
        del g_big
        out_p = list(p_leaves)
        for i, a in zip(layer_idx, p_st):
            out_p[i] = a
        out_p = [new_p.get(i, a) for i, a in enumerate(out_p)]
        out_s = list(s_leaves)
        for k, a in zip(s_layer, s_st):
            out_s[k] = a
        out_s = [new_s.get(k, a) for k, a in enumerate(out_s)]
        new_inner = jax.tree_util.tree_unflatten(s_def, out_s)
        new_state = (clip_state, new_inner) if clip else new_inner
        return (jax.tree_util.tree_unflatten(p_def, out_p), new_state, loss, sums,
                {"grad_norm": norm, "update_norm": jnp.sqrt(usq + u)})

    update.programs = (forward_and_norm, layer_update, finish, block_adamw)
    return update
