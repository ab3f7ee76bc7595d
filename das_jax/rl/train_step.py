"""The GRPO train step: `TrainStep(...)(params, opt_state, batch) -> (params, opt_state, metrics)`.

Old log-probs. TRL, when `num_iterations == 1`, uses the detached current log-probs as the
"old" policy (the ratio is then exactly 1 in the forward pass and only its gradient matters).
Here the rollout engine returns the log-probs of the sampled tokens under the policy -- the
temperature-scaled full softmax, the distribution scored here, also when top-k / top-p shape the
draw (`engine.sampling.sample`; TRL and verl score the same distribution) -- and we use those
(`grpo.old_logprobs: rollout`): with the same params they equal the detached current log-probs
up to float rounding (the engine computes them with a KV cache and a different matmul width),
so the ratio is 1 up to rounding and the clipped objective behaves as in TRL. With
`num_iterations > 1` the rollout log-probs are the correct PPO "old" policy for every iteration.

A step is the loss and gradient (`das_jax.rl.grads.LossAndGrad`: micro-batched, exact for
every registered loss) followed by the optimizer's update (`das_jax.rl.optimizer.Optimizer`),
or, for a batch that is one shared-prompt packed micro-batch, the fused update
(`das_jax.rl.fused_update`: AdamW inside the backward pass; same math).
"""
from __future__ import annotations

import functools
from typing import Any

import jax

from das_jax.models.config import ModelConfig
from das_jax.models.transformer import ActivationConfig
from das_jax.parallel.sharding import TrainShardings
from das_jax.rl import losses
from das_jax.rl.batches import TrainBatch
from das_jax.rl.fused_update import FusedSpec, fused_update
from das_jax.rl.grads import LossAndGrad
from das_jax.rl.optimizer import Optimizer, apply_updates

__all__ = ["TrainStep", "make_train_step"]

Params = Any


class TrainStep:
    """The GRPO train step `(params, opt_state, batch) -> (params, opt_state, metrics)`; it owns
    its loss-and-gradient driver and its jitted update programs.

    Args:
      model_config: static model config.
      grpo_config: `das_jax.config.GRPOSection` (or any object with its attributes: loss_type,
        epsilon, epsilon_high, beta, micro_batch_size, max_completion_length).
      optimizer: the run's `Optimizer` (`make_optimizer(grpo_config, total_steps)`), or any
        optax-like transform (`init` / `update`: then the whole-tree update only).
      temperature: the rollout sampling temperature (logits are divided by it, as in TRL).
      jit: jit the optimizer update (False: op by op; same math). The gradient kernels are
        always jitted.
      donate: donate params / opt_state to the jitted update, so the new params and moments
        reuse their buffers; the caller must not reuse the inputs afterwards.
      activation / compute_dtype / group_by_length / skip_zero_advantage: as `LossAndGrad`.
        Mixed precision: params (and so the Adam moments) in float32 "master" dtype,
        `compute_dtype="bfloat16"`.
      mesh: None (one device) or a `jax.sharding.Mesh`: params, opt_state and gradients must be
        placed by `das_jax.parallel.sharding` (`TrainShardings`); the gradient kernel and the
        update are jitted with those in/out shardings (FSDP) and the batch rows are split over
        the mesh's batch axes. Loss and metrics equal the one-device step up to float rounding.
      leafwise: with `jit`, `donate`, one device and an `Optimizer`: the update runs one param
        leaf at a time (`Optimizer.apply_leafwise`; same math, a fraction of the scratch
        memory). False: one jitted update of the whole tree.
      fused: with `jit`, `donate`, one device, an `Optimizer` and `activation`: a batch that is
        one shared-prompt packed micro-batch (the whole batch within `micro_batch_size`) is
        trained by `das_jax.rl.fused_update` (AdamW applied layer by layer inside the backward
        pass, two backward passes for the clip: the whole gradient never exists; same math).
        Other batches take the unfused path.
      decoupled_is_cap: None, or the decoupled objective's truncation cap
        (`das_jax.rl.losses`: the batch's old log-probs are then the behaviour policy's, the
        ratio's proximal policy the params being trained; for one update per batch sampled by
        older params, an asynchronous run's `grpo.old_logprobs: rollout`).

    Metrics (float32 scalars): loss, grad_norm (before clipping), update_norm,
    num_completion_tokens, clip_low, clip_high, clip_region, entropy, logprob_gap (mean
    |logp - old_logp| over completion tokens), kl when beta > 0, and with `decoupled_is_cap`
    is_weight_mean, is_weight_max, is_truncated_fraction.

    Attributes:
      loss_and_grad: the `LossAndGrad` of the unfused path.
      fused: whether the last call took the fused update.

    Raises:
      ValueError: as `LossAndGrad` (temperature, loss_type, micro_batch_size).
    """

    def __init__(self, model_config: ModelConfig, grpo_config, optimizer, *,
                 temperature: float = 1.0, jit: bool = True, donate: bool = False,
                 activation: ActivationConfig | None = ActivationConfig(),
                 compute_dtype: str | None = None, group_by_length: bool = True,
                 skip_zero_advantage: bool = False, mesh=None, leafwise: bool = False,
                 fused: bool = False, decoupled_is_cap: float | None = None):
        self.loss_and_grad = LossAndGrad(model_config, grpo_config, temperature=temperature,
                                         activation=activation, compute_dtype=compute_dtype,
                                         group_by_length=group_by_length,
                                         skip_zero_advantage=skip_zero_advantage, mesh=mesh,
                                         decoupled_is_cap=decoupled_is_cap)
        self.optimizer, self.mesh, self.donate = optimizer, mesh, donate
        own = isinstance(optimizer, Optimizer) and jit and donate and mesh is None
        self._whole_tree = functools.partial(apply_updates, optimizer)
        if mesh is not None:
            self._apply = self._apply_on_mesh
        elif own and leafwise:
            self._apply = optimizer.apply_leafwise
        elif jit:
            self._apply = jax.jit(self._whole_tree, donate_argnums=(0, 1) if donate else ())
        else:
            self._apply = self._whole_tree
        self._on_mesh: dict = {}  # (params, opt_state) tree structure -> jitted update
        self._fused_spec = (FusedSpec(model_config, self.loss_and_grad.loss_config, activation,
                                      compute_dtype, optimizer)
                            if fused and own and activation is not None else None)
        self.fused = False

    def apply_update(self, params: Params, opt_state, grads):
        """The optimizer's update: (params, opt_state, {"grad_norm", "update_norm"})."""
        return self._apply(params, opt_state, grads)

    def _apply_on_mesh(self, params, opt_state, grads):
        key = jax.tree_util.tree_structure((params, opt_state))
        if key not in self._on_mesh:
            sh = TrainShardings(params, self.mesh)
            o_sh = sh.like(opt_state)
            self._on_mesh[key] = jax.jit(
                self._whole_tree, in_shardings=(sh.params, o_sh, sh.params),
                out_shardings=(sh.params, o_sh, sh.replicated),
                donate_argnums=(0, 1) if self.donate else ())
        return self._on_mesh[key](params, opt_state, grads)

    def __call__(self, params: Params, opt_state, batch: TrainBatch):
        fusable, xs = (self.loss_and_grad.single_packed(batch) if self._fused_spec is not None
                       else (False, None))
        self.fused = fusable
        if fusable:
            params, opt_state, loss, sums, norms = fused_update(self._fused_spec, params,
                                                                opt_state, xs)
            lc = self.loss_and_grad.loss_config
            metrics = losses.finalize_metrics(sums, lc.beta, lc.decoupled_is_cap is not None)
            metrics["loss"] = loss
            metrics.update(norms)
            return params, opt_state, metrics
        _, grads, metrics = self.loss_and_grad(params, batch)
        params, opt_state, m = self._apply(params, opt_state, grads)
        metrics.update(m)
        return params, opt_state, metrics


def make_train_step(model_config: ModelConfig, grpo_config, optimizer, **kwargs) -> TrainStep:
    """`TrainStep(model_config, grpo_config, optimizer, **kwargs)`."""
    return TrainStep(model_config, grpo_config, optimizer, **kwargs)
