"""The GRPO optimizer, built once: AdamW (Loshchilov & Hutter 2019) with a warm-up schedule and
global-norm clipping (`Optimizer`), and its update applied to the whole params tree or one param
leaf at a time (`Optimizer.apply_leafwise`: same math, a fraction of the scratch memory). The
fused update (`das_jax.rl.fused_update`) reads the same object's parts."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["LR_SCHEDULES", "make_lr_schedule", "Optimizer", "make_optimizer", "apply_updates"]

Params = Any
LR_SCHEDULES = ("constant", "linear", "cosine")


def make_lr_schedule(grpo_config, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps` (HF `get_*_schedule_with_warmup` semantics: lr at
    update 0 is 0), then constant, linear decay to 0, or cosine decay to 0 at `total_steps`,
    as chosen by `grpo_config.lr_schedule` (default "constant").

    Raises:
      ValueError: an unknown `lr_schedule`.
    """
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


def apply_updates(optimizer, params: Params, opt_state, grads):
    """One update of the whole tree by any optax-like `optimizer` (`init` / `update`):
    `(params, opt_state, {"grad_norm" (before clipping), "update_norm"})`. Traceable."""
    metrics = {"grad_norm": optax.tree.norm(grads)}
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics["update_norm"] = optax.tree.norm(updates)
    return optax.apply_updates(params, updates), opt_state, metrics


class Optimizer:
    """AdamW with `make_lr_schedule` and global-norm clipping, as one optax transform.

    Reads `learning_rate`, `warmup_steps`, `lr_schedule`, `weight_decay`, `max_grad_norm`
    (None or <= 0 disables clipping) and `adam_beta1/adam_beta2/adam_epsilon` (HF defaults 0.9,
    0.999, 1e-8 when absent) from `grpo_config`.

    Attributes:
      schedule: the learning-rate schedule (`optax.Schedule`).
      adamw: the `optax.adamw` transform.
      max_grad_norm: the clip's global norm (float), or None without clipping.
      clip: `optax.clip_by_global_norm(max_grad_norm)`, or None.
      transform: `chain(clip, adamw)` (adamw alone without the clip); its state is the
        optimizer state (`init`).

    Hashable by identity: the jitted update programs take it as a static argument.
    """

    def __init__(self, grpo_config, total_steps: int):
        self.total_steps = int(total_steps)
        self.schedule = make_lr_schedule(grpo_config, total_steps)
        self.adamw = optax.adamw(self.schedule,
                                 b1=float(getattr(grpo_config, "adam_beta1", 0.9)),
                                 b2=float(getattr(grpo_config, "adam_beta2", 0.999)),
                                 eps=float(getattr(grpo_config, "adam_epsilon", 1e-8)),
                                 weight_decay=float(grpo_config.weight_decay))
        max_norm = grpo_config.max_grad_norm
        if max_norm is None or max_norm <= 0:
            self.max_grad_norm, self.clip, self.transform = None, None, self.adamw
        else:
            self.max_grad_norm = float(max_norm)
            self.clip = optax.clip_by_global_norm(self.max_grad_norm)
            self.transform = optax.chain(self.clip, self.adamw)

    def init(self, params: Params):
        """The optimizer state of `params`: AdamW's, or `(clip state, AdamW state)`."""
        return self.transform.init(params)

    def update(self, grads, state, params: Params | None = None):
        """optax's `update`: (updates, new state)."""
        return self.transform.update(grads, state, params)

    def apply(self, params: Params, opt_state, grads):
        """The whole-tree update: `apply_updates(self, ...)`. Traceable."""
        return apply_updates(self, params, opt_state, grads)

    def split_state(self, opt_state):
        """(the clip's state or None, AdamW's state) of an optimizer state."""
        return (None, opt_state) if self.clip is None else opt_state

    def join_state(self, clip_state, adamw_state):
        """The optimizer state of `split_state`'s parts."""
        return adamw_state if self.clip is None else (clip_state, adamw_state)

    def state_owners(self, adamw_state, params: Params) -> tuple[int, ...]:
        """For each leaf of the AdamW state: the index of the param leaf it belongs to (its
        moments), or -1 for a leaf shared by all params (the step counts)."""
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        marks = jax.tree_util.tree_unflatten(p_def, list(range(len(p_leaves))))
        return tuple(jax.tree_util.tree_leaves(optax.tree_utils.tree_map_params(
            self.adamw, lambda _, i: i, adamw_state, marks, transform_non_params=lambda _: -1)))

    def apply_leafwise(self, params: Params, opt_state, grads):
        """`apply`, one param leaf at a time.

        Same math as the whole-tree update (AdamW is elementwise per leaf; the global-norm clip
        runs first over all gradients), but the jitted pieces donate their inputs and touch one
        leaf each, so the update's scratch is a few copies of the largest leaf instead of several
        copies of the whole model (XLA:CPU keeps the clipped gradients, the bias-corrected
        moments and the scaled update of every leaf as separate buffers). For one device; the
        caller must not reuse `params`, `opt_state` or `grads` afterwards (all three are donated).

        Returns:
          (params, opt_state, {"grad_norm", "update_norm"}), opt_state in `init`'s layout.
        """
        grads, grad_norm = _clip_grads(self, grads)
        head, inner = self.split_state(opt_state)
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        g_leaves = p_def.flatten_up_to(grads)
        del params, grads
        owner = self.state_owners(inner, jax.tree_util.tree_unflatten(p_def, p_leaves))
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
            p_sub, state_sub, usq = _one_leaf(self, pick(p_leaves), state_sub, pick(g_leaves))
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
        opt_state = self.join_state(head, jax.tree_util.tree_unflatten(s_def, s_leaves))
        return (jax.tree_util.tree_unflatten(p_def, p_leaves), opt_state,
                {"grad_norm": grad_norm, "update_norm": jnp.sqrt(sum(sq))})


def make_optimizer(grpo_config, total_steps: int) -> Optimizer:
    """The `Optimizer` of `grpo_config` for a run of `total_steps` updates."""
    return Optimizer(grpo_config, total_steps)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _clip_grads(optimizer: Optimizer, grads):
    """(the clipped gradients, the global norm before clipping)."""
    norm = optax.tree.norm(grads)
    if optimizer.clip is not None:
        grads, _ = optimizer.clip.update(grads, optimizer.clip.init(None))
    return grads, norm


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1, 2))
def _one_leaf(optimizer: Optimizer, params_sub, state_sub, grads_sub):
    """AdamW on the params (and state) of one leaf: (params, state, squared update norm)."""
    updates, state_sub = optimizer.adamw.update(grads_sub, state_sub, params_sub)
    return (optax.apply_updates(params_sub, updates), state_sub,
            optax.tree.norm(updates, squared=True))
