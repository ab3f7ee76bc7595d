"""GRPO policy losses: clipped surrogate, clip-higher, k3 KL, and the three aggregations.

All definitions follow TRL's `GRPOTrainer._compute_loss` (trl >= 0.22), token-level importance
sampling:

  ratio_t     = exp(logp_t - old_logp_t)                               (PPO, Schulman et al. 2017)
  clipped_t   = clip(ratio_t, 1 - epsilon, 1 + epsilon_high)           (clip-higher: DAPO, Yu et
                                                                         al. 2025, eq. 10)
  loss_t      = -min(ratio_t * A, clipped_t * A) + beta * kl_t         (GRPO, Shao et al. 2024,
                                                                         eq. 3)
  kl_t        = exp(ref_t - logp_t) - (ref_t - logp_t) - 1             (k3 estimator, Schulman
                                                                         2020 "Approximating KL
                                                                         divergence"; GRPO eq. 4)

and the per-token losses of the completion tokens (mask m) are aggregated by `loss_type`:

  "grpo":     mean_b [ sum_t m_bt loss_bt / max(1, sum_t m_bt) ]       (GRPO eq. 3: 1/G sum_i
                                                                         1/|o_i| sum_t)
  "dr_grpo":  sum_bt m_bt loss_bt / (B * max_completion_length)        (Dr. GRPO, Liu et al. 2025,
                                                                         eq. 2: constant normaliser)
  "dapo":     sum_bt m_bt loss_bt / max(1, sum_bt m_bt)                 (DAPO eq. 8, token-level:
                                                                         TRL normalises by
                                                                         `num_items_in_batch`, all
                                                                         completion tokens of the
                                                                         generation batch)

Every aggregation is linear in the per-token loss, `loss = sum_bt w_bt * loss_bt`, with weights
that depend only on the completion mask of the *whole* batch (`token_loss_weights`). Computing
the weights once from the full batch and summing `w * loss` over micro-batches therefore gives the
full-batch loss (and gradient) exactly, whatever the micro-batch split.

Each aggregation is a `Loss` registered by name (`@register_loss("dapo")`); a new loss subclasses
`Loss` (per-token terms and weights) and is selected by `LossConfig.loss_type`, the one hashable
static loss argument of the train-step kernels.

Decoupled objective (`LossConfig.decoupled_is_cap`; Hilton et al. 2021, "Batch
size-invariance for policy optimization", eq. 4; AReaL's decoupled PPO loss, Fu et al. 2025):
when the batch was sampled by an older behaviour policy than the params being trained (an
asynchronous run) and the batch takes one update, the proximal ("old") policy of the ratio is
the current params detached, so the ratio is 1 in value and only its gradient acts, and each
token's whole term is weighted by the truncated importance weight of the proximal policy over
the behaviour policy (truncated importance sampling, Yao et al. 2025):

  w_t       = min(exp(sg(logp_t) - behaviour_t), cap)
  loss_t    = w_t * [-min(r_t A, clip(r_t) A) + beta * kl_t],   r_t = exp(logp_t - sg(logp_t))

`old_logp` then carries the behaviour log-probs. The value and gradient equal those of the
plain loss with `old_logp` recomputed from the current params and weights `w` (no extra forward
pass: the proximal log-probs are the train step's own). Metrics add is_weight_mean (truncated),
is_weight_max (before truncation) and is_truncated_fraction; logprob_gap is then mean
|sg(logp) - behaviour|.

Clip metrics follow TRL: a token is "low clipped" when `ratio < 1 - epsilon` and `A < 0`, "high
clipped" when `ratio > 1 + epsilon_high` and `A > 0` (the cases where the clipped branch is the
active one and the gradient is zero); "region" is their union. Metrics are token means over the
completion tokens of the batch.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from das_jax.registry import LOSSES


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Every loss hyper-parameter, hashable: the one static loss argument of the jitted kernels.

    loss_type: a registered loss name (`register_loss`; built in: grpo, dr_grpo, dapo).
    epsilon / epsilon_high: clip range [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon).
    beta: KL coefficient (0 disables the KL term and the reference log-probs).
    max_completion_length: the Dr. GRPO normaliser (tokens).
    temperature: the sampling temperature the logits are divided by (> 0).
    decoupled_is_cap: None (the plain loss), or the truncation cap (>= 1) of the decoupled
      objective (module docstring; `policy_terms`): `old_logp` is then the behaviour policy's.
    """

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_completion_length: int | None = None
    temperature: float = 1.0
    decoupled_is_cap: float | None = None

    @property
    def epsilon_hi(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_grpo(cls, grpo_config, temperature: float = 1.0,
                  decoupled_is_cap: float | None = None) -> "LossConfig":
        """From a `config.GRPOSection` (or any object with its attribute names)."""
        eh = grpo_config.epsilon_high
        return cls(loss_type=str(grpo_config.loss_type), epsilon=float(grpo_config.epsilon),
                   epsilon_high=None if eh is None else float(eh), beta=float(grpo_config.beta),
                   max_completion_length=grpo_config.max_completion_length,
                   temperature=float(temperature),
                   decoupled_is_cap=None if decoupled_is_cap is None else float(decoupled_is_cap))


class Loss:
    """A registered policy loss: per-token terms and the aggregation weights.

    Subclass, override what differs and register with `@register_loss("name")`:

      * `per_token(logp, old_logp, advantages, mask, ref_logp, cfg) -> PerTokenTerms`: the default
        is the clipped surrogate + k3 KL of `per_token_terms`. It must be elementwise over tokens
        (the train step calls it on chunks of tokens, `[B, C]` at a time, never the whole `[B, T]`).
      * `weights(mask, cfg, num_sequences) -> w_BxT`: the loss is `sum(w * loss_BxT)`, with
        weights computed once from the whole batch's completion mask (so micro-batching is exact).
      * `skips_zero_advantage(cfg) -> bool`: whether rows with advantage 0 add exactly nothing
        (the train step may then leave them out); the default holds for the default `per_token`
        at beta = 0.
    """

    name = "?"

    def per_token(self, logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT, ref_logp_BxT,
                  cfg: LossConfig) -> "PerTokenTerms":
        return per_token_terms(logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT,
                               epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_hi, beta=cfg.beta,
                               ref_logp_BxT=ref_logp_BxT if cfg.beta else None)

    def weights(self, completion_mask_BxT, cfg: LossConfig, num_sequences: int | None = None):
        raise NotImplementedError

    def skips_zero_advantage(self, cfg: LossConfig) -> bool:
        """Whether a row whose advantage is exactly 0 adds exactly 0 to the loss and to its
        gradient, so the train step may leave it out (`skip_zero_advantage`): true for the
        clipped surrogate of `per_token_terms` without the KL term (beta = 0). A subclass that
        overrides `per_token` skips nothing unless it overrides this too."""
        return cfg.beta == 0 and type(self).per_token is Loss.per_token


def register_loss(name: str):
    """Class decorator: registers an instance of a `Loss` subclass under `name` (replacing any
    earlier one) and returns the class. `get_loss(name)` then finds it; the train step reads
    `LossConfig.loss_type`. The names live in `das_jax.registry.LOSSES`."""
    def deco(cls):
        inst = cls()
        inst.name = name
        LOSSES.register(name, inst, replace=True)
        return cls
    return deco


def get_loss(name: str) -> Loss:
    """The registered loss `name`; ValueError naming the registered ones otherwise."""
    if name not in LOSSES:
        raise ValueError(f"loss_type must be one of {LOSSES.names()}, got {name!r}")
    return LOSSES.get(name)


def registered_losses() -> tuple[str, ...]:
    return LOSSES.names()


@register_loss("grpo")
class GRPOLoss(Loss):
    """mean over sequences of the per-sequence token mean (GRPO eq. 3)."""

    def weights(self, completion_mask_BxT, cfg, num_sequences=None):
        m = jnp.asarray(completion_mask_BxT).astype(jnp.float32)
        B = m.shape[0] if num_sequences is None else num_sequences
        per_seq_B1 = jnp.maximum(m.sum(axis=1, keepdims=True), 1.0)
        return m / (per_seq_B1 * B)


@register_loss("dr_grpo")
class DrGRPOLoss(Loss):
    """sum over tokens / (B * max_completion_length) (Dr. GRPO eq. 2)."""

    def weights(self, completion_mask_BxT, cfg, num_sequences=None):
        L = cfg.max_completion_length
        if L is None or L <= 0:
            raise ValueError("loss_type='dr_grpo' needs a positive max_completion_length "
                             f"(got {L!r})")
        m = jnp.asarray(completion_mask_BxT).astype(jnp.float32)
        B = m.shape[0] if num_sequences is None else num_sequences
        return m / float(B * L)


@register_loss("dapo")
class DAPOLoss(Loss):
    """token mean over the whole batch (DAPO eq. 8)."""

    def weights(self, completion_mask_BxT, cfg, num_sequences=None):
        m = jnp.asarray(completion_mask_BxT).astype(jnp.float32)
        return m / jnp.maximum(m.sum(), 1.0)


class PerTokenTerms(NamedTuple):
    """Per-token quantities, all float32 `[B, T]` (zero where the completion mask is False)."""

    loss_BxT: jax.Array        # -min(r A, clip(r) A) + beta * kl
    kl_BxT: jax.Array          # k3 estimate of KL(pi || pi_ref); zeros when beta == 0
    low_clip_BxT: jax.Array    # 1.0 where low-clipped
    high_clip_BxT: jax.Array   # 1.0 where high-clipped
    ratio_BxT: jax.Array       # importance ratio (1 off the mask)
    log_ratio_BxT: jax.Array | None = None  # logp - old_logp (0 off the mask)
    # the decoupled objective only (`policy_terms`): truncated / raw importance weights
    is_weight_BxT: jax.Array | None = None
    is_weight_raw_BxT: jax.Array | None = None


def token_loss_weights(completion_mask_BxT, loss_type: str, max_completion_length: int | None = None,
                       num_sequences: int | None = None) -> jax.Array:
    """Weights `w_BxT` such that the batch loss is `sum(w_BxT * per_token_loss_BxT)`.

    Args:
      completion_mask_BxT: bool/float `[B, T]`, 1 on trained completion tokens.
      loss_type: a registered loss ("grpo", "dr_grpo", "dapo": module docstring).
      max_completion_length: the constant of Dr. GRPO (required for "dr_grpo").
      num_sequences: number of real sequences to average over (defaults to B); pass it when the
        batch carries padding rows (all-False mask) that must not count in "grpo"/"dr_grpo".

    Returns:
      float32 `[B, T]`, zero off the mask.
    """
    cfg = LossConfig(loss_type=loss_type, max_completion_length=max_completion_length)
    return get_loss(loss_type).weights(completion_mask_BxT, cfg, num_sequences)


def per_token_terms(logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT, *, epsilon: float,
                    epsilon_high: float | None = None, beta: float = 0.0,
                    ref_logp_BxT=None) -> PerTokenTerms:
    """Clipped-surrogate + KL loss per token (TRL `_compute_loss`, token-level sampling).

    Args:
      logp_BxT: float32 log-probs of the completion tokens under the current policy (carries the
        gradient).
      old_logp_BxT: float32 log-probs under the policy that sampled them (the rollout engine's).
      advantages_B: float32 `[B]`, one advantage per sequence (broadcast over tokens).
      completion_mask_BxT: bool `[B, T]`; everything off the mask is zeroed *before* `exp`, so
        garbage log-probs at pad positions cannot produce inf/NaN values or gradients.
      epsilon: lower clip, ratio >= 1 - epsilon.
      epsilon_high: upper clip, ratio <= 1 + epsilon_high (defaults to epsilon; DAPO clip-higher
        when larger).
      beta: KL coefficient; 0 disables the KL term (ref_logp_BxT is then ignored).
      ref_logp_BxT: float32 log-probs under the frozen reference policy (needed when beta > 0).
    """
    if epsilon_high is None:
        epsilon_high = epsilon
    mask = jnp.asarray(completion_mask_BxT).astype(bool)
    maskf = mask.astype(jnp.float32)
    logp_BxT = logp_BxT.astype(jnp.float32)
    log_ratio_BxT = jnp.where(mask, logp_BxT - old_logp_BxT.astype(jnp.float32), 0.0)
    ratio_BxT = jnp.exp(log_ratio_BxT)
    clipped_BxT = jnp.clip(ratio_BxT, 1.0 - epsilon, 1.0 + epsilon_high)
    adv_Bx1 = jnp.asarray(advantages_B, jnp.float32)[:, None]
    loss_BxT = -jnp.minimum(ratio_BxT * adv_Bx1, clipped_BxT * adv_Bx1)
    if beta != 0.0:
        if ref_logp_BxT is None:
            raise ValueError("beta > 0 needs ref_logp_BxT (log-probs of the reference policy)")
        delta_BxT = jnp.where(mask, ref_logp_BxT.astype(jnp.float32) - logp_BxT, 0.0)
        kl_BxT = jnp.exp(delta_BxT) - delta_BxT - 1.0
        loss_BxT = loss_BxT + beta * kl_BxT
    else:
        kl_BxT = jnp.zeros_like(loss_BxT)
    ratio_ng = jax.lax.stop_gradient(ratio_BxT)
    low_BxT = ((ratio_ng < 1.0 - epsilon) & (adv_Bx1 < 0) & mask).astype(jnp.float32)
    high_BxT = ((ratio_ng > 1.0 + epsilon_high) & (adv_Bx1 > 0) & mask).astype(jnp.float32)
    return PerTokenTerms(loss_BxT * maskf, kl_BxT * maskf, low_BxT, high_BxT, ratio_BxT,
                         jax.lax.stop_gradient(log_ratio_BxT))


def policy_terms(logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT, ref_logp_BxT,
                 cfg: LossConfig) -> PerTokenTerms:
    """The per-token terms the train step sums: the registered loss's `per_token`, or with
    `cfg.decoupled_is_cap` the decoupled objective (module docstring), `old_logp_BxT` then being
    the behaviour policy's log-probs. Shapes and dtypes as `per_token_terms`; elementwise over
    tokens."""
    loss_fn = get_loss(cfg.loss_type)
    cap = cfg.decoupled_is_cap
    if cap is None:
        return loss_fn.per_token(logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT,
                                 ref_logp_BxT, cfg)
    mask = jnp.asarray(completion_mask_BxT).astype(bool)
    prox_BxT = jax.lax.stop_gradient(logp_BxT.astype(jnp.float32))
    terms = loss_fn.per_token(logp_BxT, prox_BxT, advantages_B, completion_mask_BxT,
                              ref_logp_BxT, cfg)
    log_w_BxT = jnp.where(mask, prox_BxT - old_logp_BxT.astype(jnp.float32), 0.0)
    raw_BxT = jnp.exp(log_w_BxT)
    w_BxT = jnp.where(mask, jnp.minimum(raw_BxT, cap), 0.0)
    return terms._replace(loss_BxT=terms.loss_BxT * w_BxT, log_ratio_BxT=log_w_BxT,
                          is_weight_BxT=w_BxT, is_weight_raw_BxT=raw_BxT)


def entropy_from_logits(logits_BxTxV, temperature: float = 1.0) -> jax.Array:
    """Entropy (nats) of softmax(logits / temperature) per position: float32 `[B, T]`."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# every key `metric_sums` can produce (a registered loss may leave some out: they sum to 0);
# the keys of METRIC_MAX_KEYS combine by max, not sum (`add_metric_sums`)
METRIC_SUM_KEYS = ("num_tokens", "kl", "clip_low", "clip_high", "clip_region", "entropy",
                   "abs_log_ratio", "is_weight", "is_truncated", "is_weight_max")
METRIC_MAX_KEYS = ("is_weight_max",)


def add_metric_sums(a: dict, b: dict) -> dict:
    """`a` combined with `b` (two micro-batches' `metric_sums`): sums, max for METRIC_MAX_KEYS;
    a key missing from `b` keeps `a`'s value."""
    return {k: a[k] if k not in b else
            (jnp.maximum(a[k], b[k]) if k in METRIC_MAX_KEYS else a[k] + b[k]) for k in a}


def metric_sums(terms: PerTokenTerms, completion_mask_BxT, entropy_BxT=None) -> dict[str, jax.Array]:
    """Un-normalised metric sums over completion tokens (add across micro-batches, then call
    `finalize_metrics`)."""
    m = jnp.asarray(completion_mask_BxT).astype(jnp.float32)
    sums = {
        "num_tokens": m.sum(),
        "kl": jnp.sum(jax.lax.stop_gradient(terms.kl_BxT) * m),
        "clip_low": jnp.sum(terms.low_clip_BxT),
        "clip_high": jnp.sum(terms.high_clip_BxT),
        "clip_region": jnp.sum(jnp.maximum(terms.low_clip_BxT, terms.high_clip_BxT)),
    }
    if entropy_BxT is not None:
        sums["entropy"] = jnp.sum(jax.lax.stop_gradient(entropy_BxT) * m)
    if terms.log_ratio_BxT is not None:  # |logp - old_logp|: the sampler/trainer log-prob gap
        sums["abs_log_ratio"] = jnp.sum(jnp.abs(terms.log_ratio_BxT) * m)
    if terms.is_weight_BxT is not None:   # the decoupled objective's importance weights
        raw = jax.lax.stop_gradient(terms.is_weight_raw_BxT)
        sums["is_weight"] = jnp.sum(jax.lax.stop_gradient(terms.is_weight_BxT) * m)
        sums["is_truncated"] = jnp.sum((raw > jax.lax.stop_gradient(terms.is_weight_BxT)) * m)
        sums["is_weight_max"] = jnp.max(jnp.where(m > 0, raw, 0.0), initial=0.0)
    return sums


def finalize_metrics(sums: dict[str, jax.Array], beta: float,
                     importance_weights: bool = False) -> dict[str, jax.Array]:
    """Token means from `metric_sums` (TRL `masked_batch_mean`); "kl" only when beta != 0;
    `importance_weights` (the decoupled objective): is_weight_mean, is_weight_max and
    is_truncated_fraction too (1, 1 and 0 without completion tokens)."""
    denom = jnp.maximum(sums["num_tokens"], 1.0)
    out = {"num_completion_tokens": sums["num_tokens"]}
    for name in ("clip_low", "clip_high", "clip_region", "entropy") + (("kl",) if beta else ()):
        if name in sums:
            out[name] = sums[name] / denom
    if "abs_log_ratio" in sums:  # mean |logp - old_logp| over completion tokens
        out["logprob_gap"] = sums["abs_log_ratio"] / denom
    if importance_weights:
        some = sums["num_tokens"] > 0
        out["is_weight_mean"] = jnp.where(some, sums["is_weight"] / denom, 1.0)
        out["is_weight_max"] = jnp.where(some, sums["is_weight_max"], 1.0)
        out["is_truncated_fraction"] = sums["is_truncated"] / denom
    return out


def grpo_loss(logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT, *, loss_type: str = "dapo",
              epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logp_BxT=None, max_completion_length: int | None = None,
              entropy_BxT=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Full-batch GRPO loss (module docstring) and its metrics.

    Args: as `per_token_terms` plus `loss_type`, `max_completion_length` (for "dr_grpo") and an
    optional `entropy_BxT` (float32 `[B, T]`, e.g. from `entropy_from_logits`) for the metric.

    Returns:
      (scalar float32 loss, metrics dict: "loss", "num_completion_tokens", "clip_low",
      "clip_high", "clip_region", "kl" when beta != 0, "entropy" when given).
    """
    terms = per_token_terms(logp_BxT, old_logp_BxT, advantages_B, completion_mask_BxT,
                            epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                            ref_logp_BxT=ref_logp_BxT)
    w_BxT = token_loss_weights(completion_mask_BxT, loss_type, max_completion_length)
    loss = jnp.sum(w_BxT * terms.loss_BxT)
    metrics = finalize_metrics(metric_sums(terms, completion_mask_BxT, entropy_BxT), beta)
    metrics["loss"] = loss
    return loss, metrics
