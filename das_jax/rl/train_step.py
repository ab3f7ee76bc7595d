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

Micro-batching: the batch of `N` sequences is split into `ceil(N / micro_batch_size)` micro-batches
processed by one `lax.scan`, so peak activation memory is that of one micro-batch (its logits
`[mb, T, V]` plus the layer activations kept for the backward pass). The loss weights of
`losses.token_loss_weights` are computed from the *full* batch first, so the accumulated gradient
equals the full-batch gradient for every `loss_type`. When `N` is not a multiple of
`micro_batch_size`, the batch is padded with rows whose weights are zero.
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
from das_jax.models.transformer import forward, token_logprobs
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
    position 0 holds the (unused) logits of position 0 itself)."""
    logits_BxTxV, _ = forward(config, params, tokens_BxT, positions_BxT, valid_BxT=valid_BxT)
    # logits at t-1 predict token t: shift right by one along T (position 0 has no predecessor).
    return jnp.concatenate([logits_BxTxV[:, :1], logits_BxTxV[:, :-1]], axis=1)


def _logp_entropy(config, params, tokens_BxT, positions_BxT, valid_BxT, temperature, with_entropy):
    logits_BxTxV = shifted_logits_and_targets(config, params, tokens_BxT, positions_BxT, valid_BxT)
    logp_BxT = token_logprobs(logits_BxTxV, tokens_BxT, temperature)
    first_T = jnp.arange(tokens_BxT.shape[1]) > 0
    logp_BxT = jnp.where(first_T[None] & valid_BxT, logp_BxT, 0.0)
    entropy_BxT = (losses.entropy_from_logits(jax.lax.stop_gradient(logits_BxTxV), temperature)
                   if with_entropy else None)
    return logp_BxT, entropy_BxT


def compute_logprobs(model_config: ModelConfig, params: Params, tokens, positions, valid,
                     temperature: float = 1.0, micro_batch_size: int | None = None) -> jax.Array:
    """Teacher-forced log-probs of every token given its prefix (no KV cache), float32 `[B, T]`.

    `out[b, t] = log_softmax(logits[b, t-1] / temperature)[tokens[b, t]]`; 0 at t = 0 and at
    invalid positions. Used for reference-policy log-probs and tests. Runs in micro-batches of
    `micro_batch_size` rows (default: all rows at once) under one jit.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    B = tokens.shape[0]
    mb = B if not micro_batch_size else min(micro_batch_size, B)
    return _compute_logprobs_jit(model_config, params, tokens, jnp.asarray(positions, jnp.int32),
                                 jnp.asarray(valid, bool), float(temperature), int(mb))


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _compute_logprobs_jit(config, params, tokens, positions, valid, temperature, mb):
    B = tokens.shape[0]
    (tok, pos, val), _ = _split_micro((tokens, positions, valid), mb)

    def body(_, xs):
        t, p, v = xs
        logp, _ = _logp_entropy(config, params, t, p, v, temperature, False)
        return None, logp

    _, logp = jax.lax.scan(body, None, (tok, pos, val))
    return logp.reshape((-1,) + logp.shape[2:])[:B]


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
    schedule = make_lr_schedule(grpo_config, total_steps)
    adamw = optax.adamw(schedule, b1=float(getattr(grpo_config, "adam_beta1", 0.9)),
                        b2=float(getattr(grpo_config, "adam_beta2", 0.999)),
                        eps=float(getattr(grpo_config, "adam_epsilon", 1e-8)),
                        weight_decay=float(grpo_config.weight_decay))
    max_norm = grpo_config.max_grad_norm
    if max_norm is None or max_norm <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(float(max_norm)), adamw)


_SUM_KEYS = ("num_tokens", "kl", "clip_low", "clip_high", "clip_region", "entropy", "abs_log_ratio")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def accumulate_grads(model_config: ModelConfig, temperature: float, epsilon: float,
                     epsilon_high: float, beta: float, params: Params, xs):
    """Loss, float32 gradient and metric sums accumulated over micro-batches (one `lax.scan`).

    The micro-batch kernel, jitted on its own so that it is compiled once per (model, shapes,
    clip/KL constants) whatever the `loss_type` (which only enters through the weights `w`).

    Args:
      xs: tuple of `[n_mb, mb, ...]` arrays (tokens, positions, valid, completion mask, old
        log-probs, ref log-probs, advantages `[n_mb, mb]`, loss weights `w`), see
        `make_loss_and_grad`. The loss is `sum(w * per_token_loss)`.

    Returns:
      (scalar loss, grads pytree in float32, dict of metric sums `losses.metric_sums`).
    """
    def mb_loss(p, x):
        tokens, positions, valid, cmask, old, ref, adv, w = x
        logp, entropy = _logp_entropy(model_config, p, tokens, positions, valid, temperature, True)
        terms = losses.per_token_terms(logp, old, adv, cmask, epsilon=epsilon,
                                       epsilon_high=epsilon_high, beta=beta,
                                       ref_logp_BxT=ref if beta else None)
        return jnp.sum(w * terms.loss_BxT), losses.metric_sums(terms, cmask, entropy)

    grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    sums0 = {k: jnp.zeros((), jnp.float32) for k in _SUM_KEYS}

    def body(carry, x):
        loss_acc, g_acc, s_acc = carry
        (loss, sums), g = grad_fn(params, x)
        g_acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        s_acc = {k: s_acc[k] + sums[k] for k in s_acc}
        return (loss_acc + loss, g_acc, s_acc), None

    (loss, grads, sums), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros, sums0), xs)
    return loss, grads, sums


def make_loss_and_grad(model_config: ModelConfig, grpo_config, *, temperature: float = 1.0
                       ) -> Callable[[Params, TrainBatch], tuple[jax.Array, Params, dict]]:
    """Builds `(params, batch) -> (loss, grads, metrics)` with micro-batched accumulation.

    The loss weights (`losses.token_loss_weights`) come from the full batch, then
    `accumulate_grads` sums `w * per_token_loss` and its gradient over micro-batches, which is
    the full-batch loss for every `loss_type`. Gradients are accumulated in float32 and cast back
    to each param's dtype. Pure and traceable; the train step jits it.
    """
    loss_type = grpo_config.loss_type
    if loss_type not in losses.LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {losses.LOSS_TYPES}, got {loss_type!r}")
    if not temperature > 0:
        raise ValueError(f"training needs temperature > 0 (got {temperature}); log-probs of a "
                         "greedy (temperature 0) sampler are undefined")
    epsilon = float(grpo_config.epsilon)
    epsilon_high = grpo_config.epsilon_high
    epsilon_high = epsilon if epsilon_high is None else float(epsilon_high)
    beta = float(grpo_config.beta)
    mb = int(grpo_config.micro_batch_size)
    max_len = grpo_config.max_completion_length
    if mb < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {mb}")
    temperature = float(temperature)

    def loss_and_grad(params, batch: TrainBatch):
        N, T = batch.tokens_BxT.shape
        first_T = jnp.arange(T) > 0
        cmask = batch.completion_mask_BxT.astype(bool) & batch.valid_BxT.astype(bool) & first_T
        w = losses.token_loss_weights(cmask, loss_type, max_len, num_sequences=N)
        xs = (batch.tokens_BxT.astype(jnp.int32), batch.positions_BxT.astype(jnp.int32),
              batch.valid_BxT.astype(bool), cmask, batch.old_logprobs_BxT.astype(jnp.float32),
              batch.ref_logprobs_BxT.astype(jnp.float32), batch.advantages_B.astype(jnp.float32),
              w)
        xs, _ = _split_micro(xs, min(mb, N))
        loss, grads, sums = accumulate_grads(model_config, temperature, epsilon, epsilon_high,
                                             beta, params, xs)
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
        metrics = losses.finalize_metrics(sums, beta)
        metrics["loss"] = loss
        return loss, grads, metrics

    return loss_and_grad


def make_train_step(model_config: ModelConfig, grpo_config, optimizer: optax.GradientTransformation,
                    *, temperature: float = 1.0, jit: bool = True, donate: bool = False):
    """Builds the pure GRPO train step `(params, opt_state, batch) -> (params, opt_state, metrics)`.

    Args:
      model_config: static model config.
      grpo_config: `das_jax.config.GRPOSection` (or any object with its attributes: loss_type,
        epsilon, epsilon_high, beta, micro_batch_size, max_completion_length).
      optimizer: e.g. `make_optimizer(grpo_config, total_steps)`.
      temperature: the rollout sampling temperature (logits are divided by it, as in TRL).
      jit: wrap the whole step in `jax.jit` (False: the optimizer update runs op by op around
        the jitted `accumulate_grads` kernel; same math).
      donate: donate params/opt_state buffers to the jitted step (saves one copy of the weights;
        the caller must not reuse the inputs afterwards).

    Metrics (float32 scalars): loss, grad_norm (before clipping), update_norm, num_completion_tokens,
    clip_low, clip_high, clip_region, entropy, logprob_gap (mean |logp - old_logp| over completion
    tokens), and kl when beta > 0.
    """
    loss_and_grad = make_loss_and_grad(model_config, grpo_config, temperature=temperature)

    def train_step(params, opt_state, batch: TrainBatch):
        loss, grads, metrics = loss_and_grad(params, batch)
        metrics["grad_norm"] = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics["update_norm"] = optax.tree.norm(updates)
        params = optax.apply_updates(params, updates)
        return params, opt_state, metrics

    if not jit:
        return train_step
    return jax.jit(train_step, donate_argnums=(0, 1) if donate else ())


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
