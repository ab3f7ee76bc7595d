"""Training a draft head online, during GRPO (`train.draft_loss_weight`).

NeMo-RL's system-integrated speculative decoding trains its EAGLE-3 head during RL with the
objective `L_policy + lambda * L_draft`, the draft loss reading the policy's hidden states
detached from the trunk, so no draft gradient reaches the policy. Here the head is a separate
parameter set with its own AdamW and gradient clip, and its loss is computed in its own jitted
programs from a teacher-forced forward of the params that sampled the step's rollouts (the
same features and teacher as the offline fit, `das_jax.draft_head.fit`): the policy's loss,
gradient and update are the programs of a run without a head, untouched. Since the two
parameter sets share nothing, `lambda` only scales the head's gradient before its clip (AdamW
is invariant to a constant factor on the gradient otherwise).

Each step: the batch's rows (prompt + completion), in micro-batches of up to
`micro_batch_size` rows padded to the batch's longest (a multiple of 64), give the policy's three block features and its
top-M next-token distribution over the head's draft vocabulary (`features.block_features`);
the head's gradient of `lambda * head.draft_loss` (EAGLE-3's training-time test over the
completion positions) is accumulated over the micro-batches weighted by their completion
tokens; one clipped AdamW update follows. The new params go to the rollout's head before the
next rollout (`Rollout.set_draft_head_params`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from das_jax.draft_head.features import block_features, sequence_features
from das_jax.draft_head.head import HeadConfig, draft_loss
from das_jax.draft_head.store import DraftHead

__all__ = ["OnlineConfig", "OnlineHeadTrainer", "prequential_replay"]


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
    """weight: lambda, the draft loss's factor (> 0); learning_rate: the head's AdamW rate
    (constant); max_grad_norm: its global-norm clip; steps: draft steps of the training-time
    test; top_m: teacher tokens kept per position; micro_batch_size: rows per forward."""
    weight: float = 1.0
    learning_rate: float = 3e-4
    max_grad_norm: float = 1.0
    steps: int = 3
    top_m: int = 16
    micro_batch_size: int = 8


def _optimizer(cfg: OnlineConfig):
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(cfg.learning_rate, weight_decay=0.0))


def _head_grad(hc: HeadConfig, steps: int, head_params, embed_VxD, feats_BxTx3D, tokens_BxT,
               valid_BxT, target_BxT, teacher_idx_BxTxM, teacher_p_BxTxM, weight):
    def loss_fn(hp):
        loss, m = draft_loss(hc, hp, embed_VxD, feats_BxTx3D, tokens_BxT, valid_BxT, target_BxT,
                             teacher_idx_BxTxM, teacher_p_BxTxM, steps)
        return weight * loss, m

    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(head_params)
    return loss, g, m


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def micro_batch_grad(model_config, hc: HeadConfig, steps: int, top_m: int, policy_params,
                     head_params, d2t, tokens_BxT, valid_BxT, target_BxT, weight):
    """(weight * draft loss, its gradient w.r.t. the head, per-step top-1 agreement) of one
    micro-batch, in one program: the policy's teacher-forced forward (features and top-`top_m`
    teacher over the draft vocabulary `d2t`, `features.block_features`) sits outside the
    differentiated function.

    Args: tokens_BxT int32 prompt + completion; valid_BxT bool real positions; target_BxT bool
    the positions whose next token is trained (the completion's); weight float32 lambda."""
    feats, tid, tp = block_features(model_config, policy_params, tokens_BxT, valid_BxT,
                                    hc.feature_layers, top_m, vocab_ids=d2t)
    feats, tid, tp = jax.lax.stop_gradient((feats, tid, tp))
    embed = jax.lax.stop_gradient(policy_params["embed"].astype(jnp.float32))
    return _head_grad(hc, steps, head_params, embed, feats, tokens_BxT, valid_BxT, target_BxT,
                      tid, tp, weight)


# the same gradient from features computed beforehand (`features.sequence_features`)
features_grad = jax.jit(_head_grad, static_argnums=(0, 1))


# the params are not donated: the rollout's head may still draft with them (an asynchronous run)
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _apply(cfg: OnlineConfig, head_params, opt_state, grads):
    opt = _optimizer(cfg)
    norm = optax.tree.norm(grads)
    up, opt_state = opt.update(grads, opt_state, head_params)
    return optax.apply_updates(head_params, up), opt_state, norm


def _bucket(n: int, multiple: int = 64) -> int:
    return max(multiple, -(-n // multiple) * multiple)


class OnlineHeadTrainer:
    """A draft head trained during GRPO (module docstring).

    Args:
      head: the `store.DraftHead` to start from (its draft vocabulary stays fixed).
      model_config: the policy's `ModelConfig` (the head's features come from its blocks).
      cfg: `OnlineConfig`.
      device: where the head's params and optimizer state live (None: JAX's default device);
        the policy params passed to `update` must be on it too.

    Attributes:
      params: the head's current params (float32 device arrays, `head` module layout).
      opt_state: its AdamW state. updates: updates applied so far.
    """

    def __init__(self, head: DraftHead, model_config, cfg: OnlineConfig, device=None):
        if not cfg.weight > 0:
            raise ValueError(f"draft loss weight must be > 0, got {cfg.weight}")
        self.head, self.model_config, self.cfg = head, model_config, cfg
        put = (lambda x: jax.device_put(jnp.asarray(x, jnp.float32), device))
        self.params = jax.tree_util.tree_map(put, dict(head.params))
        self.d2t = jax.device_put(jnp.asarray(head.draft_to_target, jnp.int32), device)
        self.opt_state = _optimizer(cfg).init(self.params)
        self.updates = 0

    def update(self, policy_params, prompt_ids: Sequence[Sequence[int]],
               completion_ids: Sequence[Sequence[int]]) -> dict[str, float]:
        """One clipped AdamW step of the head on a batch of rollouts, its features and teacher
        read from `policy_params` (detached).

        Args:
          policy_params: the current policy params (compute dtype).
          prompt_ids / completion_ids: each row's prompt and completion token ids.

        Returns:
          {"draft_loss": lambda x the draft loss, "draft_top1": the head's top-1 agreement
          with the policy's argmax at draft step 1 (both before the update: on rollouts the
          head has not trained on), "draft_grad_norm": the head's gradient norm before the
          clip}, averaged over the completion tokens; {} when the batch has no completion
          token to train on (no update is made).
        """
        cfg, hc = self.cfg, self.head.config

        def grad(idx, tok, valid, target):
            return micro_batch_grad(self.model_config, hc, cfg.steps, cfg.top_m, policy_params,
                                    self.params, self.d2t, tok, valid, target,
                                    jnp.float32(cfg.weight))
        return self._step(prompt_ids, completion_ids, grad)

    def update_from_features(self, embed_VxD, features: Sequence[tuple], prompt_ids,
                             completion_ids) -> dict[str, float]:
        """`update` with the policy's features and teacher computed beforehand: `features[i]`
        is row i's (feats float32 `[n, 3D]`, teacher ids int32 `[n, M]` into the draft
        vocabulary, probs float32 `[n, M]`) over its n = prompt + completion positions, as
        `features.sequence_features(..., top_m=M, vocab_ids=head.draft_to_target)` returns;
        `embed_VxD` the policy's input embedding (float32). A replay of online training over
        a trace computes each rollout's features once (`prequential_replay`)."""
        cfg, hc = self.cfg, self.head.config
        D3, M = features[0][0].shape[-1], features[0][1].shape[-1]

        def grad(idx, tok, valid, target):
            B, T = tok.shape
            feats = np.zeros((B, T, D3), np.float32)
            tid = np.full((B, T, M), -1, np.int32)
            tp = np.zeros((B, T, M), np.float32)
            for r, i in enumerate(idx):
                f, ids, p = features[i]
                feats[r, :len(f)], tid[r, :len(f)], tp[r, :len(f)] = f, ids, p
            for r in range(len(idx), B):   # the padding rows (copies of row 0)
                feats[r], tid[r], tp[r] = feats[0], tid[0], tp[0]
            return features_grad(hc, cfg.steps, self.params, embed_VxD, feats, tok, valid,
                                 target, tid, tp, jnp.float32(cfg.weight))
        return self._step(prompt_ids, completion_ids, grad)

    def _step(self, prompt_ids, completion_ids, grad) -> dict[str, float]:
        """The micro-batch loop of `update`: `grad(rows, tokens, valid, target)` gives each
        micro-batch's (loss, gradient, metrics); the gradients are averaged weighted by
        completion tokens; one AdamW step."""
        cfg = self.cfg
        seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        n_targets = np.array([max(len(c) - 1, 0) for c in completion_ids], np.float64)
        total = float(n_targets.sum())
        if total == 0:
            return {}
        order = sorted((i for i in range(len(seqs)) if n_targets[i] > 0),
                       key=lambda i: len(seqs[i]))
        mb = max(1, int(cfg.micro_batch_size))
        # one padded length for the step's micro-batches (as the policy's batch): one compiled
        # program per step length, not one per micro-batch length
        T = _bucket(max(len(seqs[i]) for i in order))
        grads, loss, top1 = None, 0.0, 0.0
        for s in range(0, len(order), mb):
            idx = order[s:s + mb]
            tok = np.zeros((mb, T), np.int32)
            valid = np.zeros((mb, T), bool)
            target = np.zeros((mb, T), bool)
            for r, i in enumerate(idx):
                n, P = len(seqs[i]), len(prompt_ids[i])
                tok[r, :n], valid[r, :n] = seqs[i], True
                target[r, max(P - 1, 0): n - 1] = True
            # rows past the micro-batch's last repeat its first one with nothing to train on (a
            # row with no valid position would attend to nothing)
            tok[len(idx):], valid[len(idx):] = tok[0], valid[0]
            w = float(n_targets[idx].sum()) / total
            l, g, m = grad(idx, tok, valid, target)
            g = jax.tree_util.tree_map(lambda x: x * w, g)
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
            loss = loss + w * l                  # device scalars: no wait per micro-batch
            top1 = top1 + w * m["top1_step1"]
        self.params, self.opt_state, norm = _apply(cfg, self.params, self.opt_state, grads)
        self.updates += 1
        return {"draft_loss": float(loss), "draft_top1": float(top1),
                "draft_grad_norm": float(norm)}

    def draft_head(self, meta: dict | None = None) -> DraftHead:
        """The head as it is now, as a `store.DraftHead` (numpy params; `meta` merged into the
        starting head's, with `online_updates`)."""
        info = dict(self.head.meta)
        info.update(meta or {})
        info["online_updates"] = self.updates
        return DraftHead(self.head.config, jax.tree_util.tree_map(np.asarray, self.params),
                         np.asarray(self.head.draft_to_target, np.int32), info)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the params, the optimizer state's leaves (numpy) and `updates`."""
        leaves = jax.tree_util.tree_leaves(self.opt_state)
        return {"params": {k: np.asarray(v) for k, v in self.params.items()},
                "opt_state": [np.asarray(x) for x in leaves], "updates": int(self.updates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict()`'s output.

        Raises:
          ValueError: a state of another head (other params or shapes, other optimizer)."""
        params = state["params"]
        if set(params) != set(self.params) or any(
                tuple(np.shape(params[k])) != tuple(self.params[k].shape) for k in params):
            raise ValueError("the checkpoint's draft head has other params or shapes than "
                             "draft_head.path's")
        treedef = jax.tree_util.tree_structure(self.opt_state)
        like = jax.tree_util.tree_leaves(self.opt_state)
        leaves = list(state["opt_state"])
        if len(leaves) != len(like) or any(np.shape(a) != np.shape(b)
                                           for a, b in zip(leaves, like)):
            raise ValueError("the checkpoint's draft head optimizer state does not fit this "
                             "head's AdamW state")
        dev = lambda a, b: jax.device_put(jnp.asarray(a, b.dtype), b.sharding)  # noqa: E731
        self.params = {k: dev(params[k], self.params[k]) for k in self.params}
        self.opt_state = jax.tree_util.tree_unflatten(
            treedef, [dev(a, b) for a, b in zip(leaves, like)])
        self.updates = int(state.get("updates", 0))


def prequential_replay(model_config, params, head: DraftHead, rollouts,
                       learning_rates: Sequence[float], batch: int = 32, micro_batch: int = 8,
                       steps: int = 3, top_m: int = 16, weight: float = 1.0,
                       progress=None) -> dict[float, list[dict]]:
    """Online training replayed over recorded rollouts (`TraceRollout`s, in their order: as
    the steps of a GRPO run would see them, `batch` rollouts per step), for each learning rate
    from the same starting head. Each batch is scored by the head as it is, then trained on
    (prequential evaluation: the scores are on rollouts the head has not trained on); learning
    rate 0 is the frozen head. Each rollout's features are computed once, from `params`.

    `progress(n)` is called with the rollouts whose features are done, then with each batch.

    Returns:
      {learning rate: per epoch of the rollouts, {"epoch", "loss" (weight x draft loss),
      "top1" (agreement with the policy's argmax at draft step 1), "batches"}, token-weighted
      over its batches}.
    """
    seqs = [list(r.prompt_ids) + list(r.token_ids) for r in rollouts]
    feats = sequence_features(model_config, params, seqs, head.config.feature_layers, top_m,
                              progress=progress, vocab_ids=head.draft_to_target)
    embed = jnp.asarray(params["embed"], jnp.float32)
    batches = [list(range(s, min(s + batch, len(rollouts)))) for s in range(0, len(rollouts),
                                                                          batch)]
    out = {}
    for lr in learning_rates:
        trainer = OnlineHeadTrainer(head, model_config, OnlineConfig(
            weight=weight, learning_rate=float(lr), steps=steps, top_m=top_m,
            micro_batch_size=micro_batch))
        sums: dict[int, list[float]] = {}
        for idx in batches:
            prompts = [rollouts[i].prompt_ids for i in idx]
            outs = [rollouts[i].token_ids for i in idx]
            m = trainer.update_from_features(embed, [feats[i] for i in idx], prompts, outs)
            if progress is not None:
                progress(len(idx))
            if not m:
                continue
            n = float(sum(max(len(o) - 1, 0) for o in outs))
            acc = sums.setdefault(int(rollouts[idx[0]].epoch), [0.0, 0.0, 0.0, 0])
            acc[0] += n * m["draft_loss"]
            acc[1] += n * m["draft_top1"]
            acc[2] += n
            acc[3] += 1
        out[float(lr)] = [{"epoch": e, "loss": a[0] / a[2], "top1": a[1] / a[2], "batches": a[3]}
                          for e, a in sorted(sums.items())]
    return out
