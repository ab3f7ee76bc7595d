"""das_jax.rl: GRPO math (advantages, losses, the pure train step), checkpoints, the trainer.

Public surface:

  advantages  group_advantages, group_stats, advantage_metrics, SCALE_REWARDS
  losses      grpo_loss, per_token_terms, token_loss_weights, entropy_from_logits,
              registered_losses
  batches     TrainBatch, make_batch
  log-probs   compute_logprobs
  gradients   accumulate_grads, LossAndGrad, make_loss_and_grad
  optimizer   Optimizer, make_optimizer, make_lr_schedule
  train step  TrainStep, make_train_step
  checkpoint  CheckpointManager, CheckpointError
  trainer     GRPOTrainer, TrainError (the loop behind `das-jax train`)
  load_model  a run config's model, loaded with phase lines on the console
  rewards     the `das_jax.rl.rewards` subpackage (TRL-signature reward functions)

Names are imported lazily (PEP 562), so `das_jax.cli.train` registers its command without
importing jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "SCALE_REWARDS": "advantages", "advantage_metrics": "advantages",
    "group_advantages": "advantages", "group_stats": "advantages",
    "CheckpointError": "checkpoint_errors", "CheckpointManager": "checkpoint",
    "registered_losses": "losses", "entropy_from_logits": "losses", "grpo_loss": "losses",
    "per_token_terms": "losses", "token_loss_weights": "losses",
    "TrainBatch": "batches", "make_batch": "batches", "compute_logprobs": "logprobs",
    "accumulate_grads": "grads", "LossAndGrad": "grads", "make_loss_and_grad": "grads",
    "Optimizer": "optimizer", "make_lr_schedule": "optimizer", "make_optimizer": "optimizer",
    "TrainStep": "train_step", "make_train_step": "train_step",
    "GRPOTrainer": "trainer", "TrainError": "train_error", "load_model": "model_loading",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
