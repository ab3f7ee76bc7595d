"""The pure GRPO train step: `(params, opt_state, batch) -> (params, opt_state, metrics)`.

Log-probabilities are teacher-forced without a KV cache: the logits at position t-1 score the
token at position t, `logp_t = log_softmax(logits_{t-1} / temperature)[tokens_t]` (TRL
`_get_per_token_logps_and_entropies`, which also divides the logits by the sampling temperature).

Old log-probs. TRL, when `num_iterations == 1`, uses the detached current log-probs as the
"old" policy (the ratio is then exactly 1 in the forward pass and only its gradient matters).
Here the rollout engine returns the log-probs of the sampled tokens under the policy -- the
temperature-scaled full softmax, the distribution scored here, also when top-k / top-p shape the
draw (`engine.sampling.sample`; TRL and verl score the same distribution) -- and we use those
(`grpo.old_logprobs: rollout`): with the same params they equal the detached current log-probs
up to float rounding (the engine computes them with a KV cache and a different matmul width,
~1e-5 relative), so the ratio is 1 up to rounding and the clipped objective behaves as in TRL.
With `num_iterations > 1` the rollout log-probs are the correct PPO "old" policy for every
iteration.

Micro-batching: the batch of `N` sequences is split into `ceil(N / micro_batch_size)`
micro-batches, grouped by length (`micro_batch_plan`) and each cut to its own padded length, fed
one at a time to the jitted `accumulate_grads`, which adds the loss, float32 gradient and metric
sums to a donated accumulator. The loss weights (`Loss.weights` of the registered `loss_type`)
are computed from the *full* batch first, so the accumulated gradient equals the full-batch
gradient for every loss. Memory per micro-batch: per-layer remat, chunked attention and a
chunked lm_head + log-softmax (`ActivationConfig`), never the full `[mb, T, V]` logits. Mixed
precision: params (master) in float32, forward / backward in `compute_dtype`.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from das_jax.models.config import ModelConfig
from das_jax.models.transformer import (ActivationConfig, forward, forward_hidden, lm_head,
                                        token_logprobs)
from das_jax.rl import losses

Params = Any
LR_SCHEDULES = ("constant", "linear", "cosine")


@flax.struct.dataclass
class TrainBatch:
    """One GRPO batch of N = prompts_per_step * num_generations sequences of padded length T.

    tokens_BxT: int32, prompt followed by completion, right-padded.
    positions_BxT: int32 RoPE positions (0..len-1 for a left-aligned prompt; anything for pads).
    valid_BxT: bool, True on real (non-pad) tokens.
    completion_mask_BxT: bool, True on completion tokens, i.e. the targets whose log-prob is
      trained (must be False at t = 0, which has no predecessor; it is forced False there).
    old_logprobs_BxT: float32, old_logprobs[b, t] = log-prob of tokens[b, t] under the sampling
      policy (0 where not completion).
    ref_logprobs_BxT: float32, same alignment, frozen reference policy (read only when beta > 0).
    advantages_B: float32 `[N]`, one advantage per sequence (`advantages.group_advantages`).
    """

    tokens_BxT: jax.Array
    positions_BxT: jax.Array
    valid_BxT: jax.Array
    completion_mask_BxT: jax.Array
    old_logprobs_BxT: jax.Array
    ref_logprobs_BxT: jax.Array
    advantages_B: jax.Array

    @property
    def num_sequences(self) -> int:
        return self.tokens_BxT.shape[0]


def _pad_rows(x, rows: int):
    if rows == 0:
        return x
    pad = [(0, rows)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad)


def _split_micro(tree, micro_batch_size: int):
    """Pads the leading axis to a multiple of mb and reshapes every leaf to `[n_mb, mb, ...]`."""
    n = jax.tree_util.tree_leaves(tree)[0].shape[0]
    n_mb = max(1, math.ceil(n / micro_batch_size))
    pad = n_mb * micro_batch_size - n
    return jax.tree_util.tree_map(
        lambda x: _pad_rows(x, pad).reshape((n_mb, micro_batch_size) + x.shape[1:]), tree), n_mb


def shifted_logits_and_targets(config: ModelConfig, params: Params, tokens_BxT, positions_BxT,
                               valid_BxT):
    """Teacher-forced logits: returns (float32 logits_BxTxV aligned so that row t scores token t,
    position 0 holds the (unused) logits of position 0 itself). The full-logits reference path."""
    logits_BxTxV, _ = forward(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT)
    # logits at t-1 predict token t: shift right by one along T (position 0 has no predecessor).
    return jnp.concatenate([logits_BxTxV[:, :1], logits_BxTxV[:, :-1]], axis=1)


def chunked_head_logprobs(config: ModelConfig, params: Params, hidden_BxTxD, targets_BxT,
                          temperature: float, chunk_tokens: int, with_entropy: bool):
    """`token_logprobs(lm_head(hidden), targets)` (and the entropy) in chunks over positions.

    The positions are cut into chunks of `C = max(1, chunk_tokens // B)`; each chunk's float32
    logits `[B, C, V]` are computed, reduced and dropped, and rematerialised in the backward pass
    (`jax.checkpoint`), so the full `[B, T, V]` logits never exist. Row t of the result scores
    `targets_BxT[:, t]` with `hidden_BxTxD[:, t]`.

    Returns:
      (logp_BxT float32, entropy_BxT float32 (of the stop-gradient logits) or None).
    """
    B, T, D = hidden_BxTxD.shape
    C = min(T, max(1, chunk_tokens // B))
    n = -(-T // C)
    head_key = "embed" if config.tie_word_embeddings else "lm_head"
    w_VxD = params[head_key]
    h = jnp.pad(hidden_BxTxD, ((0, 0), (0, n * C - T), (0, 0)))
    t = jnp.pad(targets_BxT, ((0, 0), (0, n * C - T)))
    h_NxBxCxD = h.reshape(B, n, C, D).swapaxes(0, 1)
    t_NxBxC = t.reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def one(w, h_BxCxD, t_BxC):
        logits_BxCxV = lm_head(config, {head_key: w}, h_BxCxD)
        logp = token_logprobs(logits_BxCxV, t_BxC, temperature)
        ent = (losses.entropy_from_logits(jax.lax.stop_gradient(logits_BxCxV), temperature)
               if with_entropy else jnp.zeros_like(logp))
        return logp, ent

    if n == 1:
        logp, ent = one(w_VxD, h_NxBxCxD[0], t_NxBxC[0])
    else:
        logp, ent = jax.lax.map(lambda xs: one(w_VxD, *xs), (h_NxBxCxD, t_NxBxC))
        logp, ent = (x.swapaxes(0, 1).reshape(B, n * C)[:, :T] for x in (logp, ent))
    return logp, (ent if with_entropy else None)


def _logp_entropy(config, params, tokens_BxT, positions_BxT, valid_BxT, temperature, with_entropy,
                  activation: ActivationConfig | None = None, window_BxW=None):
    """Teacher-forced log-probs (0 at t = 0 and invalid t) and entropies, float32 `[B, T]`.

    activation None: the reference path (full `[B, T, V]` logits, einsum attention, no remat);
    otherwise the memory-bounded path (`ActivationConfig`; chunked head).
    window_BxW: int32 positions (each >= 1, distinct within a row), memory path only: the head
    (lm_head + log-softmax) runs at those positions only, and the results are `[B, W]`, entry
    `[b, j]` scoring `tokens_BxT[b, window_BxW[b, j]]` -- the completion window of
    `completion_window`, a fraction of T when the prompts are long."""
    if window_BxW is not None:
        h_BxTxD, _ = forward_hidden(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT,
                                    activation=activation)
        # the hidden state at t - 1 scores the token at t
        h_BxWxD = jnp.take_along_axis(h_BxTxD, (window_BxW - 1)[..., None], axis=1)
        targets_BxW = jnp.take_along_axis(tokens_BxT, window_BxW, axis=1)
        logp_BxW, entropy_BxW = chunked_head_logprobs(
            config, params, h_BxWxD, targets_BxW, temperature, activation.logits_chunk,
            with_entropy)
        valid_BxW = jnp.take_along_axis(valid_BxT, window_BxW, axis=1) & (window_BxW > 0)
        return jnp.where(valid_BxW, logp_BxW, 0.0), entropy_BxW
    first_T = jnp.arange(tokens_BxT.shape[1]) > 0
    if activation is None:
        logits_BxTxV = shifted_logits_and_targets(config, params, tokens_BxT, positions_BxT,
                                                  valid_BxT)
        logp_BxT = token_logprobs(logits_BxTxV, tokens_BxT, temperature)
        entropy_BxT = (losses.entropy_from_logits(jax.lax.stop_gradient(logits_BxTxV),
                                                  temperature) if with_entropy else None)
    else:
        h_BxTxD, _ = forward_hidden(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT,
                                    activation=activation)
        h_BxTxD = jnp.concatenate([h_BxTxD[:, :1], h_BxTxD[:, :-1]], axis=1)
        logp_BxT, entropy_BxT = chunked_head_logprobs(
            config, params, h_BxTxD, tokens_BxT, temperature, activation.logits_chunk, with_entropy)
    logp_BxT = jnp.where(first_T[None] & valid_BxT, logp_BxT, 0.0)
    return logp_BxT, entropy_BxT


def _packed_logp_entropy(config, params, tokens_GxS, positions_GxS, valid_GxS, segment_GxS,
                         group_R, source_RxW, targets_RxW, cmask_RxW, temperature, activation):
    """Log-probs and entropies `[R, W]` of R completions packed with their shared prompts
    (`pack_shared_prompts`): one forward over the G packed rows (segment-masked attention), then
    the head at the hidden states `source_RxW` of packed row `group_R` scoring `targets_RxW`
    (0 where `cmask_RxW` is False)."""
    h_GxSxD, _ = forward_hidden(config, params, tokens_GxS, positions_GxS, valid_BxT=valid_GxS,
                                activation=activation, segment_BxT=segment_GxS)
    h_RxWxD = h_GxSxD[group_R[:, None], source_RxW]
    logp_RxW, entropy_RxW = chunked_head_logprobs(config, params, h_RxWxD, targets_RxW,
                                                  temperature, activation.logits_chunk, True)
    return jnp.where(cmask_RxW, logp_RxW, 0.0), entropy_RxW


def cast_params(params: Params, dtype) -> Params:
    """Params cast to `dtype` (None: unchanged); leaves already in `dtype` are the same arrays."""
    if dtype is None:
        return params
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda p: p if p.dtype == dtype else p.astype(dtype), params)


def compute_logprobs(model_config: ModelConfig, params: Params, tokens, positions, valid,
                     temperature: float = 1.0, micro_batch_size: int | None = None, *,
                     activation: ActivationConfig | None = ActivationConfig(),
                     compute_dtype: str | None = None, mesh=None) -> jax.Array:
    """Teacher-forced log-probs of every token given its prefix (no KV cache), float32 `[B, T]`.

    `out[b, t] = log_softmax(logits[b, t-1] / temperature)[tokens[b, t]]`; 0 at t = 0 and at
    invalid positions. Used for old / reference-policy log-probs and tests. Runs in micro-batches
    of `micro_batch_size` rows (default: all rows at once) under one jit, with the chunked head
    of `activation` (None: full logits) and params cast to `compute_dtype` (None: as given).
    With a `mesh` (params already placed on it), the rows are split over its batch axes (padded
    to a multiple of the split) and the result is a host `np.ndarray` (every process gets all
    rows).
    """
    if mesh is not None:
        return _compute_logprobs_on_mesh(model_config, params, tokens, positions, valid,
                                         temperature, micro_batch_size, activation,
                                         compute_dtype, mesh)
    tokens = jnp.asarray(tokens, jnp.int32)
    B = tokens.shape[0]
    mb = B if not micro_batch_size else min(micro_batch_size, B)
    return _compute_logprobs_jit(model_config, params, tokens, jnp.asarray(positions, jnp.int32),
                                 jnp.asarray(valid, bool), float(temperature), int(mb),
                                 activation, compute_dtype)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8))
def _compute_logprobs_jit(config, params, tokens, positions, valid, temperature, mb, activation,
                          compute_dtype):
    B = tokens.shape[0]
    params = cast_params(params, compute_dtype)
    (tok, pos, val), _ = _split_micro((tokens, positions, valid), mb)

    def body(_, xs):
        t, p, v = xs
        logp, _ = _logp_entropy(config, params, t, p, v, temperature, False, activation)
        return None, logp

    _, logp = jax.lax.scan(body, None, (tok, pos, val))
    return logp.reshape((-1,) + logp.shape[2:])[:B]


def _round_up(n: int, k: int) -> int:
    return -(-int(n) // k) * k


@functools.lru_cache(maxsize=64)
def _logprobs_kernel_on_mesh(config, temperature, mb, activation, compute_dtype, row_sharding,
                             out_sharding):
    fn = functools.partial(_compute_logprobs_jit.__wrapped__, config, temperature=temperature,
                           mb=mb, activation=activation, compute_dtype=compute_dtype)
    return jax.jit(lambda p, t, pos, v: fn(p, t, pos, v), out_shardings=out_sharding)


def _compute_logprobs_on_mesh(config, params, tokens, positions, valid, temperature,
                              micro_batch_size, activation, compute_dtype, mesh):
    from das_jax.parallel import sharding as shard_lib
    tokens = np.asarray(tokens, np.int32)
    B = tokens.shape[0]
    k = shard_lib.batch_shards(mesh)
    B_pad = _round_up(B, k)
    mb = _round_up(B if not micro_batch_size else min(micro_batch_size, B), k)
    rows = shard_lib.batch_sharding(mesh, 2)
    cols = [np.pad(np.asarray(x, dt), [(0, B_pad - B), (0, 0)])
            for x, dt in ((tokens, np.int32), (positions, np.int32), (valid, bool))]
    kernel = _logprobs_kernel_on_mesh(config, float(temperature), int(mb), activation,
                                      compute_dtype, rows, shard_lib.replicated(mesh))
    out = kernel(params, *(shard_lib.global_array(c, rows) for c in cols))
    return shard_lib.to_host(out)[:B]


def make_lr_schedule(grpo_config, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps` (HF `get_*_schedule_with_warmup` semantics: lr at
    update 0 is 0), then constant, linear decay to 0, or cosine decay to 0 at `total_steps`,
    as chosen by `grpo_config.lr_schedule` (default "constant")."""
    lr = float(grpo_config.learning_rate)
    warmup = int(grpo_config.warmup_steps)
    kind = getattr(grpo_config, "lr_schedule", "constant")
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {kind!r}")
    decay_steps = max(1, int(total_steps) - warmup)
    if kind == "constant":
        after = optax.constant_schedule(lr)
    elif kind == "linear":
        after = optax.linear_schedule(lr, 0.0, decay_steps)
    else:
        after = optax.cosine_decay_schedule(lr, decay_steps)
    if warmup <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def make_optimizer(grpo_config, total_steps: int) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with `make_lr_schedule` and global-norm clipping.

    Reads `learning_rate`, `warmup_steps`, `lr_schedule`, `weight_decay`, `max_grad_norm`
    (None or <= 0 disables clipping) and `adam_beta1/adam_beta2/adam_epsilon` (HF defaults 0.9,
    0.999, 1e-8 when absent) from `grpo_config`.
    """
    clip, adamw = _optimizer_parts(grpo_config, total_steps)
    return adamw if clip is None else optax.chain(clip, adamw)


def _optimizer_parts(grpo_config, total_steps: int):
    """(the global-norm clip or None, the AdamW) that `make_optimizer` chains."""
    schedule = make_lr_schedule(grpo_config, total_steps)
    adamw = optax.adamw(schedule, b1=float(getattr(grpo_config, "adam_beta1", 0.9)),
                        b2=float(getattr(grpo_config, "adam_beta2", 0.999)),
                        eps=float(getattr(grpo_config, "adam_epsilon", 1e-8)),
                        weight_decay=float(grpo_config.weight_decay))
    max_norm = grpo_config.max_grad_norm
    if max_norm is None or max_norm <= 0:
        return None, adamw
    return optax.clip_by_global_norm(float(max_norm)), adamw


def make_leafwise_apply(grpo_config, total_steps: int):
    """The update of `make_optimizer(grpo_config, total_steps)`, applied one param leaf at a time.

    Same math as `optimizer.update` + `optax.apply_updates` on the whole tree (AdamW is
    elementwise per leaf; the global-norm clip runs first over all gradients), but the jitted
    pieces donate their inputs and touch one leaf each, so the update's scratch is a few copies of
    the largest leaf instead of several copies of the whole model (XLA:CPU keeps the clipped
    gradients, the bias-corrected moments and the scaled update of every leaf as separate
    buffers: ~0.7 GB for a 538 MB model). For one device; the caller must not reuse `params`,
    `opt_state` or `grads` afterwards (all three are donated).

    Returns:
      `apply(params, opt_state, grads) -> (params, opt_state, {"grad_norm", "update_norm"})`,
      opt_state in the layout of `make_optimizer(grpo_config, total_steps).init(params)`.
    """
    clip, adamw = _optimizer_parts(grpo_config, total_steps)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def clip_grads(grads):
        norm = optax.tree.norm(grads)
        if clip is not None:
            grads, _ = clip.update(grads, clip.init(None))
        return grads, norm

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def one_leaf(params_sub, state_sub, grads_sub):
        updates, state_sub = adamw.update(grads_sub, state_sub, params_sub)
        return (optax.apply_updates(params_sub, updates), state_sub,
                optax.tree.norm(updates, squared=True))

    def apply(params, opt_state, grads):
        grads, grad_norm = clip_grads(grads)
        head, inner = (None, opt_state) if clip is None else opt_state
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        g_leaves = p_def.flatten_up_to(grads)
        del params, grads
        # which state leaves belong to which param leaf (-1: shared, e.g. the step count)
        owner = jax.tree_util.tree_leaves(optax.tree_utils.tree_map_params(
            adamw, lambda _, i: i, inner, jax.tree_util.tree_unflatten(
                p_def, list(range(len(p_leaves)))), transform_non_params=lambda _: -1))
        s_leaves, s_def = jax.tree_util.tree_flatten(inner)
        del inner, opt_state
        shared = [x for x, o in zip(s_leaves, owner) if o < 0]
        sq = []
        for i in range(len(p_leaves)):
            pick = lambda leaves: jax.tree_util.tree_unflatten(  # noqa: E731
                p_def, [x if j == i else None for j, x in enumerate(leaves)])
            # the shared leaves (counts) are donated too, so each leaf gets its own copy
            state_sub = jax.tree_util.tree_unflatten(s_def, [
                x if o == i else (jnp.copy(x) if o < 0 else None)
                for x, o in zip(s_leaves, owner)])
            p_sub, state_sub, usq = one_leaf(pick(p_leaves), state_sub, pick(g_leaves))
            g_leaves[i] = None  # free this leaf's gradient
            p_leaves[i] = jax.tree_util.tree_leaves(p_sub)[0]
            new = jax.tree_util.tree_flatten(state_sub, is_leaf=lambda x: x is None)[0]
            for k, o in enumerate(owner):
                if o == i:
                    s_leaves[k] = new[k]
            shared = [x for x, o in zip(new, owner) if o < 0]
            sq.append(usq)
        it = iter(shared)
        s_leaves = [next(it) if o < 0 else x for x, o in zip(s_leaves, owner)]
        inner = jax.tree_util.tree_unflatten(s_def, s_leaves)
        opt_state = inner if clip is None else (head, inner)
        return (jax.tree_util.tree_unflatten(p_def, p_leaves), opt_state,
                {"grad_norm": grad_norm, "update_norm": jnp.sqrt(sum(sq))})

    return apply


_SUM_KEYS = losses.METRIC_SUM_KEYS


def zero_carry(params: Params):
    """The accumulator `accumulate_grads` starts from: (loss 0, float32 zero grads, zero sums)."""
    return (jnp.zeros((), jnp.float32),
            jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            {k: jnp.zeros((), jnp.float32) for k in _SUM_KEYS})


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("activation", "compute_dtype"),
                   donate_argnames=("carry",))
def accumulate_grads(model_config: ModelConfig, loss_config: losses.LossConfig, params: Params,
                     xs, carry=None, *, activation: ActivationConfig | None = ActivationConfig(),
                     compute_dtype: str | None = None):
    """Loss, float32 gradient and metric sums accumulated over micro-batches (one `lax.scan`).

    Args:
      model_config: static model config.
      loss_config: the static, hashable `losses.LossConfig` (loss type from the `register_loss`
        registry, clip range, beta, temperature).
      params: the (master) params; the forward runs on them cast to `compute_dtype` (one copy,
        made once), and the gradient is taken with respect to that copy and summed in float32.
      xs: tuple of `[n_mb, mb, ...]` arrays (tokens, positions, valid, completion mask, old
        log-probs, ref log-probs, advantages `[n_mb, mb]`, loss weights `w`), see
        `make_loss_and_grad`. The loss is `sum(w * per_token_loss)`. Optionally a 9th array, the
        `[n_mb, mb, W]` completion window (`completion_window`; needs `activation`): the head
        then runs at those positions only, and the completion mask, old / ref log-probs and
        `w` are given at those positions (`[n_mb, mb, W]`).
      carry: (loss, grads, sums) to add to (donated; `zero_carry(params)` or a previous result),
        None to start from zero.
      activation: `ActivationConfig` (remat, attention kernel, chunked head); None: reference path.
      compute_dtype: dtype name of the forward / backward pass (None: the params' own).

    Returns:
      (scalar loss, grads pytree in float32, dict of metric sums `losses.metric_sums`).
    """
    loss_fn = losses.get_loss(loss_config.loss_type)
    params_c = cast_params(params, compute_dtype)

    def mb_loss(p, x):
        if len(x) == 12:  # shared-prompt packed micro-batch (`pack_shared_prompts`)
            tok, pos, val, seg, grp, src, tgt, cmask, old, ref, adv, w = x
            logp, entropy = _packed_logp_entropy(model_config, p, tok, pos, val, seg, grp, src,
                                                 tgt, cmask, loss_config.temperature, activation)
            terms = loss_fn.per_token(logp, old, adv, cmask, ref, loss_config)
            return jnp.sum(w * terms.loss_BxT), losses.metric_sums(terms, cmask, entropy)
        tokens, positions, valid, cmask, old, ref, adv, w = x[:8]
        window = x[8] if len(x) > 8 else None  # cmask / old / ref / w are then [mb, W]
        logp, entropy = _logp_entropy(model_config, p, tokens, positions, valid,
                                      loss_config.temperature, True, activation, window)
        terms = loss_fn.per_token(logp, old, adv, cmask, ref, loss_config)
        return jnp.sum(w * terms.loss_BxT), losses.metric_sums(terms, cmask, entropy)

    grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
    if carry is None:
        carry = zero_carry(params)

    def body(carry, x):
        loss_acc, g_acc, s_acc = carry
        (loss, sums), g = grad_fn(params_c, x)
        g_acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        # a registered loss may not produce every metric (e.g. no log-ratio): those stay 0
        s_acc = {k: s_acc[k] + sums[k] if k in sums else s_acc[k] for k in s_acc}
        return (loss_acc + loss, g_acc, s_acc), None

    carry, _ = jax.lax.scan(body, carry, xs)
    return carry


@functools.partial(jax.jit, donate_argnums=(0,))
def _add_trees(a, b):
    """`a + b` leaf by leaf (an accumulator plus one micro-batch's result), in place."""
    return jax.tree_util.tree_map(jnp.add, a, b)


def length_bucket(n: int, floor: int = 64) -> int:
    """Padded length for a micro-batch whose longest row has `n` tokens: a multiple of
    `max(floor, 2**(bit_length(n) - 3))` (at most ~4 buckets per doubling, so few compiles)."""
    step = max(floor, 1 << max(0, int(n).bit_length() - 3))
    return max(step, -(-int(n) // step) * step)


def micro_batch_plan(lengths_N, micro_batch_size: int, T: int, group_by_length: bool = True):
    """Rows and padded length of each micro-batch: a list of (row indices, T_mb).

    With `group_by_length`, rows are sorted by length (longest first, stable) so each micro-batch
    holds similar lengths and is cut to `length_bucket` of its longest row (<= T); otherwise rows
    stay in order and every micro-batch has length T. The last micro-batch may hold fewer rows.
    """
    lengths_N = np.asarray(lengths_N)
    N = len(lengths_N)
    order = np.argsort(-lengths_N, kind="stable") if group_by_length else np.arange(N)
    plan = []
    for i in range(0, N, micro_batch_size):
        rows = order[i:i + micro_batch_size]
        T_mb = min(T, length_bucket(int(lengths_N[rows].max()))) if group_by_length else T
        plan.append((rows, T_mb))
    return plan


def completion_window(cmask_BxT: np.ndarray, floor: int = 32) -> np.ndarray:
    """The positions of each row the train step scores: int32 `[B, W]`, row b the W consecutive
    positions `start_b .. start_b + W - 1` that cover every True of `cmask_BxT[b]` (its
    completion tokens), with W = `length_bucket` (multiple of `floor`) of the longest row's
    span, at most T - 1, and 1 <= start_b <= T - W (rows without completion tokens start at 1).

    The lm_head + log-softmax then run on `[B, W]` tokens instead of `[B, T]`: with a long
    prompt and a short completion (the main job: ~80 prompt and <= 32 completion tokens), most
    of the head's work. The loss is unchanged: positions outside the window have zero weight.
    """
    cmask = np.asarray(cmask_BxT, bool)
    B, T = cmask.shape
    has = cmask.any(axis=1)
    first = np.where(has, np.argmax(cmask, axis=1), 1)
    last = np.where(has, T - 1 - np.argmax(cmask[:, ::-1], axis=1), 1)
    span = int((last - first + 1).max()) if B else 1
    W = max(1, min(T - 1, length_bucket(span, floor)))
    start = np.clip(np.minimum(first, T - W), 1, None)
    return (start[:, None] + np.arange(W)[None]).astype(np.int32)


def shared_prompt_groups(tokens_NxT, positions_NxT, valid_NxT, cmask_NxT, rows) -> list | None:
    """`rows` grouped by identical prompt (tokens and positions before the first completion
    token), in order of first appearance; rows without completion tokens are left out (they
    add nothing to the loss). None when a row is not a prompt followed by one contiguous
    completion (valid = prompt + completion), which `pack_shared_prompts` needs."""
    groups: dict = {}
    for r in rows:
        c = np.flatnonzero(cmask_NxT[r])
        if len(c) == 0:
            continue
        P, L = int(c[0]), len(c)
        if c[-1] != P + L - 1 or not valid_NxT[r, :P + L].all() or valid_NxT[r, P + L:].any():
            return None
        key = (tokens_NxT[r, :P].tobytes(), positions_NxT[r, :P].tobytes())
        groups.setdefault(key, []).append(int(r))
    return list(groups.values())


def count_bucket(n: int) -> int:
    """Padded count of packed rows or completions: n up to 2, else the smallest of 2**k and
    3 * 2**(k-1) that is >= n (1, 2, 3, 4, 6, 8, 12, 16, ...: at most 1/3 padding), so a run
    whose batches train on 1..8 groups compiles its update for 6 group counts, not 8."""
    n = max(int(n), 1)
    if n <= 2:
        return n
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if n <= 3 * p // 4 else p


def pack_shared_prompts(groups, cols, *, bucket_counts: bool = True):
    """One micro-batch of shared-prompt packed rows: each group (rows with the same prompt) is
    one row `prompt ++ completion_1 ++ completion_2 ++ ...` (segments 0, 1, 2, ...: a completion
    attends to the prompt and to itself only, at its own positions), so the prompt's forward
    runs once per group instead of once per completion -- the same hidden states, so the same
    loss and gradient up to float rounding. Completion token j of row r is scored by the hidden
    state of its predecessor (the prompt's last token for j = 0).

    Args:
      groups: lists of row indices (`shared_prompt_groups`).
      cols: the host columns (tokens, positions, valid, completion mask, old log-probs, ref
        log-probs, advantages `[N]`, loss weights `w`), `[N, T]` unless noted.

    Returns:
      the kernel's 12 inputs, each with a leading micro-batch axis of 1: packed tokens,
      positions, valid, segments `[1, G, S]`; per completion row the packed row `[1, R]`, source
      and target `[1, R, W]`, completion mask, old / ref log-probs `[1, R, W]`, advantages
      `[1, R]` and weights `[1, R, W]`. S and W are `length_bucket`s (64 / 32 floors); with
      `bucket_counts`, G and R are `count_bucket`s of the group and completion counts (fewer
      compiled shapes): the extra packed rows repeat group 0's row, and the extra completion
      rows read it with an all-False completion mask and zero weight, advantage and log-probs,
      so they add exactly 0 to the loss, the gradient and every metric sum.
    """
    tokens, positions, valid, cmask, old, ref, adv, w = cols
    spans = []  # (prompt length, [(row, completion length)]) per group
    for g in groups:
        P = int(np.argmax(cmask[g[0]]))
        spans.append((P, [(r, int(cmask[r].sum())) for r in g]))
    G, R = len(groups), sum(len(g) for g in groups)
    if bucket_counts:
        G, R = count_bucket(G), count_bucket(R)
    S = length_bucket(max(P + sum(L for _, L in rl) for P, rl in spans))
    W = length_bucket(max(L for _, rl in spans for _, L in rl), 32)
    tok = np.zeros((G, S), np.int32)
    pos = np.zeros((G, S), np.int32)
    val = np.zeros((G, S), bool)
    seg = np.zeros((G, S), np.int32)
    grp = np.zeros((R,), np.int32)
    src = np.zeros((R, W), np.int32)
    tgt = np.zeros((R, W), np.int32)
    cm = np.zeros((R, W), bool)
    o, rf, ww = (np.zeros((R, W), np.float32) for _ in range(3))
    a = np.zeros((R,), np.float32)
    i = 0
    for gi, (P, rl) in enumerate(spans):
        r0 = rl[0][0]
        tok[gi, :P], pos[gi, :P], val[gi, :P] = tokens[r0, :P], positions[r0, :P], True
        off = P
        for si, (r, L) in enumerate(rl, start=1):
            sl = slice(P, P + L)
            tok[gi, off:off + L], pos[gi, off:off + L] = tokens[r, sl], positions[r, sl]
            val[gi, off:off + L], seg[gi, off:off + L] = True, si
            j = np.arange(L)
            grp[i] = gi
            src[i, :L] = np.where(j == 0, P - 1, off + j - 1)
            tgt[i, :L], cm[i, :L] = tokens[r, sl], True
            o[i, :L], rf[i, :L], ww[i, :L], a[i] = old[r, sl], ref[r, sl], w[r, sl], adv[r]
            off += L
            i += 1
    gi = len(spans)
    tok[gi:], pos[gi:], val[gi:], seg[gi:] = tok[0], pos[0], val[0], seg[0]
    return tuple(x[None] for x in (tok, pos, val, seg, grp, src, tgt, cm, o, rf, a, ww))


def make_loss_and_grad(model_config: ModelConfig, grpo_config, *, temperature: float = 1.0,
                       activation: ActivationConfig | None = ActivationConfig(),
                       compute_dtype: str | None = None, group_by_length: bool = True,
                       skip_zero_advantage: bool = False, mesh=None, share_prompts: bool = True
                       ) -> Callable[[Params, TrainBatch], tuple[jax.Array, Params, dict]]:
    """Builds `(params, batch) -> (loss, grads, metrics)` with micro-batched accumulation.

    `skip_zero_advantage` (only for the built-in `grpo` / `dr_grpo` / `dapo` losses with
    beta = 0, else ignored): rows whose advantage is exactly 0 (every row of a group whose
    rewards are all equal) add exactly 0 to that loss and its gradient, so no forward / backward
    pass is run for them; the loss weights still come from the full batch, so loss and gradient
    are the same up to float summation order. The token-mean metrics (entropy, clip fractions,
    logprob_gap, num_completion_tokens) are then over the rows trained on.

    The loss weights (`Loss.weights` of the registered `loss_type`) come from the full batch;
    then the micro-batches (`micro_batch_plan`: grouped by length, each cut to its own padded
    length) go through `accumulate_grads` one at a time (one compile per padded length), which
    sums `w * per_token_loss` and its gradient: the full-batch loss for every `loss_type`.
    Gradients are accumulated in float32 and cast back to each param's dtype. Host-side driver
    (reads the row lengths); the kernels are jitted.

    With `activation` (and no mesh) the head runs at the completion positions only
    (`completion_window`), and with `share_prompts` rows that share a prompt (a GRPO group) are
    packed into one row per group (`pack_shared_prompts`): the prompt's forward and backward run
    once per group, not once per completion. Both give the same loss and gradient up to float
    rounding (tests/test_train_window.py).

    With a `mesh` (`jax.sharding.Mesh`; params placed by `das_jax.parallel.sharding`), the
    kernel is jitted with explicit in/out shardings: params and the float32 gradient accumulator
    sharded by the rules table (FSDP), each micro-batch's rows split over the mesh's batch axes
    (`micro_batch_size` rounded up to a multiple of that split, the extra rows being zero-weight
    padding), the accumulator donated. Every process must call it with the same batch.
    """
    if not temperature > 0:
        raise ValueError(f"training needs temperature > 0 (got {temperature}); log-probs of a "
                         "greedy (temperature 0) sampler are undefined")
    loss_config = losses.LossConfig.from_grpo(grpo_config, temperature)
    loss_fn = losses.get_loss(loss_config.loss_type)
    mb = int(grpo_config.micro_batch_size)
    if mb < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {mb}")
    skip = (skip_zero_advantage and loss_config.beta == 0
            and loss_config.loss_type in ("grpo", "dr_grpo", "dapo"))
    # the head at the completion positions only (`completion_window`); a loss's per-token terms
    # are elementwise (the `losses.Loss` contract), so they are the same on the window
    windowed = activation is not None and mesh is None

    def host_columns(batch: TrainBatch):
        """(host columns, valid, row lengths, rows to train on) of a batch."""
        N, T = batch.tokens_BxT.shape
        valid = np.asarray(batch.valid_BxT).astype(bool)
        cmask = np.asarray(batch.completion_mask_BxT).astype(bool) & valid & (np.arange(T) > 0)
        w = np.asarray(loss_fn.weights(jnp.asarray(cmask), loss_config, num_sequences=N),
                       np.float32)
        cols = (np.asarray(batch.tokens_BxT, np.int32), np.asarray(batch.positions_BxT, np.int32),
                valid, cmask, np.asarray(batch.old_logprobs_BxT, np.float32),
                np.asarray(batch.ref_logprobs_BxT, np.float32),
                np.asarray(batch.advantages_B, np.float32), w)
        lengths = np.where(valid.any(1), T - np.argmax(valid[:, ::-1], axis=1), 1)
        keep = np.arange(N)
        if skip:
            keep = np.flatnonzero(np.asarray(batch.advantages_B) != 0)
        return cols, valid, lengths, keep

    def shared_prompt_micro_batches(cols, valid, keep, size):
        """Whole groups per micro-batch, up to `size` completions each (a larger group alone),
        or None when the rows are not shared-prompt groups."""
        groups = (shared_prompt_groups(cols[0], cols[1], valid, cols[3], keep)
                  if windowed and share_prompts else None)
        if not groups or max(len(g) for g in groups) <= 1:
            return None
        micro, n = [[]], 0
        for g in groups:
            if micro[-1] and n + len(g) > size:
                micro.append([])
                n = 0
            micro[-1].append(g)
            n += len(g)
        return micro

    def single_packed_micro_batch(batch: TrainBatch):
        """The kernel inputs (`pack_shared_prompts`) when the whole batch is one shared-prompt
        packed micro-batch, () when no row is trained on (`skip_zero_advantage` and every
        advantage 0), else None (`make_train_step`'s fused update takes the first two)."""
        if mesh is not None:
            return None
        cols, valid, _, keep = host_columns(batch)
        if len(keep) == 0:
            return ()  # nothing to train on: the update takes a zero gradient
        micro = shared_prompt_micro_batches(cols, valid, keep, min(mb, max(len(keep), 1)))
        if micro is None or len(micro) != 1:
            return None
        return pack_shared_prompts(micro[0], cols)

    def loss_and_grad(params, batch: TrainBatch):
        T = batch.tokens_BxT.shape[1]
        cols, valid, lengths, keep = host_columns(batch)
        size = min(mb, max(len(keep), 1))
        if mesh is None:
            # Each micro-batch's kernel starts from zero inside the jit (no zero accumulator
            # buffer; with one micro-batch its gradient is the only one) and the results are
            # added with a donated add: at most one accumulator and one micro-batch gradient.
            carry = None
            acc = functools.partial(accumulate_grads, model_config, loss_config,
                                    activation=activation, compute_dtype=compute_dtype)

            def kernel(p, xs, c):
                out = acc(p, xs)
                return out if c is None else _add_trees(c, out)
        else:
            sharded = _sharded_kernels(params)
            size = _round_up(size, sharded.row_multiple)
            carry = sharded.zero_carry(params)
            kernel = sharded.accumulate
        plan = [(keep[rows], T_mb) for rows, T_mb in
                micro_batch_plan(lengths[keep], size, T, group_by_length)] if len(keep) else []
        micro = shared_prompt_micro_batches(cols, valid, keep, size)
        if micro is not None:
            plan = []
            for gs in micro:
                carry = kernel(params, pack_shared_prompts(gs, cols), carry)
        for rows, T_mb in plan:
            pad = size - len(rows)
            xs = tuple(np.pad(c[rows][:, :T_mb] if c.ndim == 2 else c[rows],
                              [(0, pad)] + [(0, 0)] * (c.ndim - 1))[None] for c in cols)
            if windowed:
                # cmask, old, ref and w at the completion window's positions only
                win = completion_window(xs[3][0])[None]
                xs = tuple(np.take_along_axis(x, win, axis=2) if i in (3, 4, 5, 7) else x
                           for i, x in enumerate(xs)) + (win,)
            if mesh is not None:
                xs = sharded.place_rows(xs)
            carry = kernel(params, xs, carry)
        if carry is None:
            carry = zero_carry(params)
        loss, grads, sums = carry
        grads = jax.tree_util.tree_map(lambda g, p: g if g.dtype == p.dtype else g.astype(p.dtype),
                                       grads, params)
        metrics = losses.finalize_metrics(sums, loss_config.beta)
        metrics["loss"] = loss
        return loss, grads, metrics

    kernels: dict = {}

    def _sharded_kernels(params):
        key = jax.tree_util.tree_structure(params)
        if key not in kernels:
            kernels[key] = _ShardedKernels(model_config, loss_config, params, mesh, activation,
                                           compute_dtype)
        return kernels[key]

    loss_and_grad.mesh = mesh
    loss_and_grad.single_packed_micro_batch = single_packed_micro_batch
    loss_and_grad.loss_config = loss_config
    return loss_and_grad


class _ShardedKernels:
    """`accumulate_grads` and `zero_carry` jitted with explicit shardings on a mesh."""

    def __init__(self, model_config, loss_config, params, mesh, activation, compute_dtype):
        from das_jax.parallel import sharding as shard_lib
        self.shard_lib = shard_lib
        self.shardings = shard_lib.TrainShardings(params, mesh)
        self.row_multiple = self.shardings.row_multiple
        carry_sh = self.shardings.like(jax.eval_shape(zero_carry, params))
        self.zero_carry = jax.jit(zero_carry, out_shardings=carry_sh)
        # xs: 6 [1, mb, T] columns, the [1, mb] advantages and the [1, mb, T] loss weights, the
        # rows on the batch axes.
        mat, vec = self.shardings.rows(3, leading=1), self.shardings.rows(2, leading=1)
        self.xs_shardings = (mat,) * 6 + (vec, mat)
        fn = functools.partial(accumulate_grads.__wrapped__, model_config, loss_config,
                               activation=activation, compute_dtype=compute_dtype)
        self.accumulate = jax.jit(lambda p, xs, c: fn(p, xs, c),
                                  in_shardings=(self.shardings.params, self.xs_shardings,
                                                carry_sh),
                                  out_shardings=carry_sh, donate_argnums=(2,))

    def place_rows(self, xs):
        return tuple(self.shard_lib.global_array(x, s) for x, s in zip(xs, self.xs_shardings))


def make_train_step(model_config: ModelConfig, grpo_config, optimizer: optax.GradientTransformation,
                    *, temperature: float = 1.0, jit: bool = True, donate: bool = False,
                    activation: ActivationConfig | None = ActivationConfig(),
                    compute_dtype: str | None = None, group_by_length: bool = True,
                    skip_zero_advantage: bool = False, mesh=None,
                    total_steps: int | None = None, fused: bool = False):
    """Builds the GRPO train step `(params, opt_state, batch) -> (params, opt_state, metrics)`.

    Args:
      model_config: static model config.
      grpo_config: `das_jax.config.GRPOSection` (or any object with its attributes: loss_type,
        epsilon, epsilon_high, beta, micro_batch_size, max_completion_length).
      optimizer: e.g. `make_optimizer(grpo_config, total_steps)`.
      temperature: the rollout sampling temperature (logits are divided by it, as in TRL).
      jit: jit the optimizer update (False: op by op; same math). The gradient kernels are
        always jitted.
      donate: donate params / opt_state to the jitted update, so the new
        params and moments reuse their buffers; the caller must not reuse the inputs afterwards.
      activation / compute_dtype / group_by_length / skip_zero_advantage: as
        `make_loss_and_grad`. Mixed precision:
        params (and so the Adam moments) in float32 "master" dtype, `compute_dtype="bfloat16"`.
      mesh: None (one device) or a `jax.sharding.Mesh`: params, opt_state and gradients must be
        placed by `das_jax.parallel.sharding` (`TrainShardings`); the gradient kernel and the
        update are jitted with those in/out shardings (FSDP) and the batch rows are split over
        the mesh's batch axes. Loss and metrics equal the one-device step up to float rounding.
      total_steps: with `jit`, `donate` and one device, the promise that `optimizer` is
        `make_optimizer(grpo_config, total_steps)`: the update then runs one param leaf at a time
        (`make_leafwise_apply`; same math, a fraction of the scratch memory). None: one jitted
        update of the whole tree.
      fused: with `jit`, `donate`, one device, `total_steps` and `activation`: a batch that is
        one shared-prompt packed micro-batch (`pack_shared_prompts`; the whole batch within
        `micro_batch_size`) is trained by `das_jax.rl.fused_update` (AdamW applied layer by
        layer inside the backward pass, two backward passes for the clip: the whole gradient
        never exists; same math). Other batches take the unfused path.

    Metrics (float32 scalars): loss, grad_norm (before clipping), update_norm, num_completion_tokens,
    clip_low, clip_high, clip_region, entropy, logprob_gap (mean |logp - old_logp| over completion
    tokens), and kl when beta > 0.
    """
    loss_and_grad = make_loss_and_grad(model_config, grpo_config, temperature=temperature,
                                       activation=activation, compute_dtype=compute_dtype,
                                       group_by_length=group_by_length,
                                       skip_zero_advantage=skip_zero_advantage, mesh=mesh)

    def apply(params, opt_state, grads):
        metrics = {"grad_norm": optax.tree.norm(grads)}
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics["update_norm"] = optax.tree.norm(updates)
        params = optax.apply_updates(params, updates)
        return params, opt_state, metrics

    plain_apply = apply
    if jit and donate and mesh is None and total_steps is not None:
        apply = make_leafwise_apply(grpo_config, total_steps)
    elif jit:
        apply = jax.jit(apply, donate_argnums=(0, 1) if donate else ())
    sharded_apply: dict = {}

    def apply_on_mesh(params, opt_state, grads):
        key = jax.tree_util.tree_structure((params, opt_state))
        if key not in sharded_apply:
            from das_jax.parallel.sharding import TrainShardings
            sh = TrainShardings(params, mesh)
            o_sh = sh.like(opt_state)
            sharded_apply[key] = jax.jit(
                plain_apply, in_shardings=(sh.params, o_sh, sh.params),
                out_shardings=(sh.params, o_sh, sh.replicated),
                donate_argnums=(0, 1) if donate else ())
        return sharded_apply[key](params, opt_state, grads)

    if mesh is not None:
        apply = apply_on_mesh

    fused_update = None
    if (fused and jit and donate and mesh is None and total_steps is not None
            and activation is not None):
        from das_jax.rl.fused_update import make_fused_update
        _, adamw = _optimizer_parts(grpo_config, total_steps)
        fused_update = make_fused_update(model_config, loss_and_grad.loss_config, adamw,
                                         grpo_config.max_grad_norm, activation, compute_dtype)

    def train_step(params, opt_state, batch: TrainBatch):
        xs = loss_and_grad.single_packed_micro_batch(batch) if fused_update else None
        train_step.fused = xs is not None
        if xs is not None:
            params, opt_state, loss, sums, norms = fused_update(params, opt_state, xs or None)
            metrics = losses.finalize_metrics(sums, loss_and_grad.loss_config.beta)
            metrics["loss"] = loss
            metrics.update(norms)
            return params, opt_state, metrics
        loss, grads, metrics = loss_and_grad(params, batch)
        params, opt_state, m = apply(params, opt_state, grads)
        metrics.update(m)
        return params, opt_state, metrics

    train_step.apply_update = apply
    train_step.fused = False  # whether the last call took the fused update
    return train_step


def make_batch(tokens_BxT, prompt_lens_B, completion_lens_B, *, old_logprobs_BxT=None,
               ref_logprobs_BxT=None, advantages_B=None) -> TrainBatch:
    """Host-side helper: a `TrainBatch` from right-padded token rows where row b holds
    `prompt_lens_B[b]` prompt tokens followed by `completion_lens_B[b]` completion tokens.

    Positions are 0..len-1; missing log-prob arrays are zeros, missing advantages zeros.
    """
    tokens = np.asarray(tokens_BxT, np.int32)
    B, T = tokens.shape
    p = np.asarray(prompt_lens_B)[:, None]
    c = np.asarray(completion_lens_B)[:, None]
    t = np.arange(T)[None]
    if np.any(p < 1):
        raise ValueError("every row needs at least one prompt token")
    valid = t < p + c
    cmask = (t >= p) & valid
    zeros = np.zeros((B, T), np.float32)
    old = zeros if old_logprobs_BxT is None else np.asarray(old_logprobs_BxT, np.float32) * cmask
    ref = zeros if ref_logprobs_BxT is None else np.asarray(ref_logprobs_BxT, np.float32) * cmask
    adv = np.zeros((B,), np.float32) if advantages_B is None else np.asarray(advantages_B, np.float32)
    positions = np.broadcast_to(t, (B, T)).astype(np.int32)
    return TrainBatch(tokens_BxT=jnp.asarray(tokens), positions_BxT=jnp.asarray(positions),
                      valid_BxT=jnp.asarray(valid), completion_mask_BxT=jnp.asarray(cmask),
                      old_logprobs_BxT=jnp.asarray(old), ref_logprobs_BxT=jnp.asarray(ref),
                      advantages_B=jnp.asarray(adv))
