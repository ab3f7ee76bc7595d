"""The GRPO loss and its float32 gradient, accumulated over micro-batches.

The batch of `N` sequences is split into micro-batches (`LossAndGrad`: grouped by length and
each cut to its own padded length, or packed one row per shared prompt), fed one at a time to the
jitted `accumulate_grads`, which adds the loss, float32 gradient and metric sums to a donated
accumulator. The loss weights (`Loss.weights` of the registered `loss_type`) are computed from
the *full* batch first, so the accumulated gradient equals the full-batch gradient for every
loss. Memory per micro-batch: per-layer remat, chunked attention and a chunked lm_head +
log-softmax (`ActivationConfig`), never the full `[mb, T, V]` logits. Mixed precision: params
(master) in float32, forward / backward in `compute_dtype`.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.config import ModelConfig
from das_jax.models.transformer import ActivationConfig
from das_jax.parallel import sharding as shard_lib
from das_jax.rl import losses
from das_jax.rl.batches import (HostColumns, PackedMicroBatch, PaddedMicroBatch, TrainBatch,
                                micro_batch_plan, pack_shared_prompts, packed_micro_batches,
                                shared_prompt_groups)
from das_jax.rl.logprobs import cast_params, micro_batch_logprobs, round_up

__all__ = ["zero_carry", "accumulate_grads", "LossAndGrad", "make_loss_and_grad"]

Params = Any


def zero_carry(params: Params):
    """The accumulator `accumulate_grads` starts from: (loss 0, float32 zero grads, zero sums)."""
    return (jnp.zeros((), jnp.float32),
            jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            {k: jnp.zeros((), jnp.float32) for k in losses.METRIC_SUM_KEYS})


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
      xs: a micro-batch kind of `das_jax.rl.batches` with a leading axis of micro-batches
        (`PaddedMicroBatch`; `WindowedMicroBatch` and `PackedMicroBatch` need `activation`).
        The loss is `sum(xs.weights * per_token_loss)`.
      carry: (loss, grads, sums) to add to (donated; `zero_carry(params)` or a previous result),
        None to start from zero.
      activation: `ActivationConfig` (remat, attention kernel, chunked head); None: reference path.
      compute_dtype: dtype name of the forward / backward pass (None: the params' own).

    Returns:
      (scalar loss, grads pytree in float32, dict of metric sums `losses.metric_sums`).
    """
    params_c = cast_params(params, compute_dtype)

    def mb_loss(p, x):
        logp, entropy = micro_batch_logprobs(x, model_config, p, loss_config.temperature,
                                             activation)
        terms = losses.policy_terms(logp, x.old_logprobs, x.advantages, x.completion_mask,
                                    x.ref_logprobs, loss_config)
        return (jnp.sum(x.weights * terms.loss_BxT),
                losses.metric_sums(terms, x.completion_mask, entropy))

    grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
    if carry is None:
        carry = zero_carry(params)

    def body(carry, x):
        loss_acc, g_acc, s_acc = carry
        (loss, sums), g = grad_fn(params_c, x)
        g_acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        # a registered loss may not produce every metric (e.g. no log-ratio): those stay 0
        s_acc = losses.add_metric_sums(s_acc, sums)
        return (loss_acc + loss, g_acc, s_acc), None

    carry, _ = jax.lax.scan(body, carry, xs)
    return carry


@functools.partial(jax.jit, donate_argnums=(0,))
def _add_carries(a, b):
    """An accumulator `(loss, grads, sums)` plus one micro-batch's result, in place (the
    sums by `losses.add_metric_sums`)."""
    return (a[0] + b[0], jax.tree_util.tree_map(jnp.add, a[1], b[1]),
            losses.add_metric_sums(a[2], b[2]))


class _ShardedKernels:
    """`accumulate_grads` and `zero_carry` jitted with explicit shardings on a mesh."""

    def __init__(self, model_config, loss_config, params, mesh, activation, compute_dtype):
        self.shardings = shard_lib.TrainShardings(params, mesh)
        self.row_multiple = self.shardings.row_multiple
        carry_sh = self.shardings.like(jax.eval_shape(zero_carry, params))
        self.zero_carry = jax.jit(zero_carry, out_shardings=carry_sh)
        # the rows of every column on the batch axes
        mat, vec = self.shardings.rows(3, leading=1), self.shardings.rows(2, leading=1)
        self.xs_shardings = PaddedMicroBatch(mat, mat, mat, mat, mat, mat, vec, mat)
        fn = functools.partial(accumulate_grads.__wrapped__, model_config, loss_config,
                               activation=activation, compute_dtype=compute_dtype)
        self.accumulate = jax.jit(lambda p, xs, c: fn(p, xs, c),
                                  in_shardings=(self.shardings.params, self.xs_shardings,
                                                carry_sh),
                                  out_shardings=carry_sh, donate_argnums=(2,))

    def place_rows(self, xs: PaddedMicroBatch) -> PaddedMicroBatch:
        return jax.tree_util.tree_map(shard_lib.global_array, xs, self.xs_shardings)


class LossAndGrad:
    """`(params, batch) -> (loss, grads, metrics)` with micro-batched accumulation.

    `skip_zero_advantage` (for a loss whose `Loss.skips_zero_advantage` holds, e.g. the built-in
    ones with beta = 0; else ignored): rows whose advantage is exactly 0 (every row of a group
    whose rewards are all equal) add exactly 0 to the loss and its gradient, so no forward /
    backward pass is run for them; the loss weights still come from the full batch, so loss and
    gradient are the same up to float summation order. The token-mean metrics (entropy, clip
    fractions, logprob_gap, num_completion_tokens) are then over the rows trained on.

    The loss weights (`Loss.weights` of the registered `loss_type`) come from the full batch;
    then the micro-batches (`micro_batch_plan`: grouped by length, each cut to its own padded
    length) go through `accumulate_grads` one at a time (one compile per padded length), which
    sums `w * per_token_loss` and its gradient: the full-batch loss for every `loss_type`.
    Gradients are accumulated in float32 and cast back to each param's dtype. Host-side driver
    (reads the row lengths); the kernels are jitted.

    With `activation` (and no mesh) the head runs at the completion positions only
    (`WindowedMicroBatch`), and with `share_prompts` rows that share a prompt (a GRPO group) are
    packed into one row per group (`PackedMicroBatch`): the prompt's forward and backward run
    once per group, not once per completion (a row holds at most T tokens and a micro-batch at
    most `micro_batch_size` completions, so larger groups take several rows:
    `batches.packed_micro_batches`). Both give the same loss and gradient up to float
    rounding.

    With a `mesh` (`jax.sharding.Mesh`; params placed by `das_jax.parallel.sharding`), the
    kernel is jitted with explicit in/out shardings: params and the float32 gradient accumulator
    sharded by the rules table (FSDP), each micro-batch's rows split over the mesh's batch axes
    (`micro_batch_size` rounded up to a multiple of that split, the extra rows being zero-weight
    padding), the accumulator donated. Every process must call it with the same batch.

    `decoupled_is_cap` (None: the registered loss as it is): the decoupled objective of
    `das_jax.rl.losses` (`policy_terms`), the batch's old log-probs being the behaviour policy's.

    Raises:
      ValueError: temperature <= 0, an unregistered `loss_type`, or micro_batch_size < 1.
    """

    def __init__(self, model_config: ModelConfig, grpo_config, *, temperature: float = 1.0,
                 activation: ActivationConfig | None = ActivationConfig(),
                 compute_dtype: str | None = None, group_by_length: bool = True,
                 skip_zero_advantage: bool = False, mesh=None, share_prompts: bool = True,
                 decoupled_is_cap: float | None = None):
        if not temperature > 0:
            raise ValueError(f"training needs temperature > 0 (got {temperature}); log-probs of "
                             "a greedy (temperature 0) sampler are undefined")
        self.model_config = model_config
        self.loss_config = losses.LossConfig.from_grpo(grpo_config, temperature,
                                                       decoupled_is_cap)
        self.loss_fn = losses.get_loss(self.loss_config.loss_type)
        self.micro_batch_size = int(grpo_config.micro_batch_size)
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        self.activation, self.compute_dtype, self.mesh = activation, compute_dtype, mesh
        self.group_by_length = group_by_length
        self.skip = skip_zero_advantage and self.loss_fn.skips_zero_advantage(self.loss_config)
        # the head at the completion positions only; a loss's per-token terms are elementwise
        # (the `losses.Loss` contract), so they are the same on the window
        self.windowed = activation is not None and mesh is None
        self.share_prompts = share_prompts and self.windowed
        self._sharded: dict = {}  # params tree structure -> _ShardedKernels

    def host_columns(self, batch: TrainBatch) -> tuple[HostColumns, np.ndarray]:
        """(the batch's `HostColumns`, the indices of the rows to train on)."""
        N, T = batch.tokens_BxT.shape
        valid = np.asarray(batch.valid_BxT).astype(bool)
        cmask = np.asarray(batch.completion_mask_BxT).astype(bool) & valid & (np.arange(T) > 0)
        w = np.asarray(self.loss_fn.weights(jnp.asarray(cmask), self.loss_config,
                                            num_sequences=N), np.float32)
        if batch.is_weights_BxT is not None:   # asynchronous GRPO's truncated IS weights
            w = w * np.asarray(batch.is_weights_BxT, np.float32)
        cols = HostColumns(np.asarray(batch.tokens_BxT, np.int32),
                           np.asarray(batch.positions_BxT, np.int32), valid, cmask,
                           np.asarray(batch.old_logprobs_BxT, np.float32),
                           np.asarray(batch.ref_logprobs_BxT, np.float32),
                           np.asarray(batch.advantages_B, np.float32), w)
        keep = np.arange(N)
        if self.skip:
            keep = np.flatnonzero(np.asarray(batch.advantages_B) != 0)
        return cols, keep

    def _packed_groups(self, cols: HostColumns, keep, size: int):
        """The shared-prompt packed micro-batches of the rows `keep` (`packed_micro_batches`:
        rows of at most T tokens, up to `size` completions each), or None when the rows are not
        shared-prompt groups, packing is off, or no packed row would share its prompt."""
        groups = (shared_prompt_groups(cols.tokens, cols.positions, cols.valid,
                                       cols.completion_mask, keep)
                  if self.share_prompts else None)
        if not groups or max(len(g) for g in groups) <= 1:
            return None
        micro = packed_micro_batches(groups, cols.completion_mask, size)
        if max(len(row) for m in micro for row in m) <= 1:
            return None
        return micro

    def single_packed(self, batch: TrainBatch) -> tuple[bool, PackedMicroBatch | None]:
        """Whether the whole batch trains as one shared-prompt `PackedMicroBatch` (the fused
        update's input), and that micro-batch: (True, the micro-batch); (True, None) when no
        row is trained on (`skip_zero_advantage` and every advantage 0); (False, None)
        otherwise (a mesh, several micro-batches, rows that share no prompt)."""
        if self.mesh is not None:
            return False, None
        cols, keep = self.host_columns(batch)
        if len(keep) == 0:
            return True, None  # nothing to train on: the update takes a zero gradient
        micro = self._packed_groups(cols, keep, min(self.micro_batch_size, max(len(keep), 1)))
        if micro is None or len(micro) != 1:
            return False, None
        return True, pack_shared_prompts(micro[0], cols)

    def micro_batches(self, cols: HostColumns, keep, size: int) -> Iterator:
        """The micro-batches of the rows `keep`, `size` rows each (packed: up to `size`
        completions), each with a leading axis of 1."""
        micro = self._packed_groups(cols, keep, size)
        if micro is not None:
            for groups in micro:
                yield pack_shared_prompts(groups, cols)
            return
        if not len(keep):
            return
        T = cols.tokens.shape[1]
        for rows, T_mb in micro_batch_plan(cols.row_lengths()[keep], size, T,
                                           self.group_by_length):
            xs = cols.padded(keep[rows], T_mb, size)
            yield xs.windowed() if self.windowed else xs

    def _one_device(self, params, xs, carry):
        # Each micro-batch's kernel starts from zero inside the jit (no zero accumulator buffer;
        # with one micro-batch its gradient is the only one) and the results are added with a
        # donated add: at most one accumulator and one micro-batch gradient.
        out = accumulate_grads(self.model_config, self.loss_config, params, xs,
                               activation=self.activation, compute_dtype=self.compute_dtype)
        return out if carry is None else _add_carries(carry, out)

    def _sharded_kernels(self, params) -> _ShardedKernels:
        key = jax.tree_util.tree_structure(params)
        if key not in self._sharded:
            self._sharded[key] = _ShardedKernels(self.model_config, self.loss_config, params,
                                                 self.mesh, self.activation, self.compute_dtype)
        return self._sharded[key]

    def __call__(self, params: Params, batch: TrainBatch):
        """(scalar loss, grads in the params' dtypes, metrics `losses.finalize_metrics` + loss)."""
        cols, keep = self.host_columns(batch)
        size = min(self.micro_batch_size, max(len(keep), 1))
        carry, kernel, sharded = None, self._one_device, None
        if self.mesh is not None:
            sharded = self._sharded_kernels(params)
            size = round_up(size, sharded.row_multiple)
            carry, kernel = sharded.zero_carry(params), sharded.accumulate
        for xs in self.micro_batches(cols, keep, size):
            carry = kernel(params, xs if sharded is None else sharded.place_rows(xs), carry)
        if carry is None:
            carry = zero_carry(params)
        loss, grads, sums = carry
        grads = jax.tree_util.tree_map(lambda g, p: g if g.dtype == p.dtype else g.astype(p.dtype),
                                       grads, params)
        metrics = losses.finalize_metrics(sums, self.loss_config.beta,
                                          self.loss_config.decoupled_is_cap is not None)
        metrics["loss"] = loss
        return loss, grads, metrics


def make_loss_and_grad(model_config: ModelConfig, grpo_config, **kwargs) -> LossAndGrad:
    """`LossAndGrad(model_config, grpo_config, **kwargs)`."""
    return LossAndGrad(model_config, grpo_config, **kwargs)
