"""das_jax.rl: GRPO math (advantages, losses, the pure train step) and checkpoints.

Public surface (rewards live in `das_jax.rl.rewards` and the trainer loop in
`das_jax.rl.trainer`; neither is imported here so this package imports without them):

  advantages  group_advantages, group_stats, advantage_metrics, SCALE_REWARDS
  losses      grpo_loss, per_token_terms, token_loss_weights, entropy_from_logits, LOSS_TYPES
  train step  TrainBatch, make_batch, accumulate_grads, make_train_step, make_loss_and_grad,
              make_optimizer, make_lr_schedule, compute_logprobs
  checkpoint  CheckpointManager, CheckpointError
"""
from das_jax.rl.advantages import SCALE_REWARDS, advantage_metrics, group_advantages, group_stats
from das_jax.rl.checkpoint import CheckpointError, CheckpointManager
from das_jax.rl.losses import (LOSS_TYPES, entropy_from_logits, grpo_loss, per_token_terms,
                               token_loss_weights)
from das_jax.rl.train_step import (TrainBatch, accumulate_grads, compute_logprobs, make_batch,
                                   make_loss_and_grad, make_lr_schedule, make_optimizer,
                                   make_train_step)

__all__ = [
    "SCALE_REWARDS", "advantage_metrics", "group_advantages", "group_stats",
    "CheckpointError", "CheckpointManager",
    "LOSS_TYPES", "entropy_from_logits", "grpo_loss", "per_token_terms", "token_loss_weights",
    "TrainBatch", "accumulate_grads", "compute_logprobs", "make_batch", "make_loss_and_grad",
    "make_lr_schedule", "make_optimizer", "make_train_step",
]
