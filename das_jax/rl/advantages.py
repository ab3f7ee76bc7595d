"""Group-relative advantages for GRPO.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3 and the outcome-supervision paragraph of sec. 4.1.2)
replaces a learned value baseline by the statistics of a *group* of `G` completions sampled for the
same prompt: `A_i = (r_i - mean(r_group)) / std(r_group)`, the same value broadcast over every
token of completion i. Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1)
shows the std division biases the update towards easy/hard prompts and drops it.

Semantics follow TRL's `GRPOTrainer._generate_and_score_completions` (trl >= 0.22):
  * the mean is always the *group* mean;
  * `scale_rewards="group"`  divides by the group std (unbiased, ddof=1, torch's `.std()`),
    `scale_rewards="batch"`  divides by the std of all rewards of the batch (ddof=1),
    `scale_rewards="none"`   does not divide (Dr. GRPO);
  * the denominator is `std + 1e-4`. With a single element (G == 1 or a batch of 1) the std is
    defined as 0.
A degenerate group (all G rewards bit-for-bit equal) gets advantage exactly 0 and std exactly 0
for any G and value, in every mode, jitted or not: it is detected by `max == min` over the group
(not by a float32 mean, whose rounding residue -- e.g. 8 x 0.7 -> +5.96e-4 advantages -- would
otherwise pass the std guard), and it is counted in `frac_reward_zero_std`.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from das_jax.registry import ADVANTAGES

SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's constant in `advantages / (std_rewards + 1e-4)`


class GroupStats(NamedTuple):
    """Per-sample statistics broadcast back to the `[N]` layout (N = num_prompts * G), float32."""

    mean_N: jnp.ndarray        # group mean of the rewards (exactly the common value if all equal)
    std_N: jnp.ndarray         # group std (ddof=1), logged even when not used for scaling; exactly
                               # 0 for an all-equal group
    is_std_zero_N: jnp.ndarray  # bool, all rewards of the group equal, or std ~ 0 (TRL's isclose):
                               # a degenerate group, no learning signal


def _std_ddof1(x, axis=None):
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return jnp.zeros_like(jnp.mean(x, axis=axis))
    return jnp.std(x, axis=axis, ddof=1)


def group_stats(rewards_N, num_generations: int) -> GroupStats:
    """Mean and std of each contiguous group of `num_generations` rewards.

    Args:
      rewards_N: float `[N]`, N = num_prompts * num_generations, grouped contiguously
        (samples `[p*G, (p+1)*G)` belong to prompt p).
      num_generations: G.
    """
    rewards_N = jnp.asarray(rewards_N, jnp.float32)
    N = rewards_N.shape[0]
    if num_generations < 1 or N % num_generations:
        raise ValueError(f"{N} rewards cannot be split into groups of num_generations="
                         f"{num_generations}")
    rewards_PxG = rewards_N.reshape(-1, num_generations)
    equal_P = jnp.max(rewards_PxG, axis=1) == jnp.min(rewards_PxG, axis=1)
    mean_P = jnp.where(equal_P, rewards_PxG[:, 0], jnp.mean(rewards_PxG, axis=1))
    std_P = jnp.where(equal_P, 0.0, _std_ddof1(rewards_PxG, axis=1))
    equal_N = jnp.repeat(equal_P, num_generations)
    std_N = jnp.repeat(std_P, num_generations)
    return GroupStats(jnp.repeat(mean_P, num_generations), std_N, equal_N | jnp.isclose(std_N, 0.0))


def _equal_groups_N(rewards_N, num_generations: int):
    rewards_PxG = rewards_N.reshape(-1, num_generations)
    equal_P = jnp.max(rewards_PxG, axis=1) == jnp.min(rewards_PxG, axis=1)
    return jnp.repeat(equal_P, num_generations)


def group_advantages(rewards_N, num_generations: int, scale_rewards: str = "group") -> jnp.ndarray:
    """GRPO / Dr. GRPO advantages, one scalar per completion.

    `A_i = (r_i - mean_group(r)) / (std + 1e-4)` with std chosen by `scale_rewards` (module
    docstring); `scale_rewards="none"` gives `A_i = r_i - mean_group(r)` (Dr. GRPO, Liu et al.
    2025, eq. 2 with the std term removed).

    Args:
      rewards_N: float `[N]` total reward of each completion (already weighted and summed over
        reward functions), grouped contiguously by prompt.
      num_generations: G, completions per prompt.
      scale_rewards: "group", "batch" or "none".

    Returns:
      float32 `[N]` advantages; exactly 0 for every member of a group whose rewards are all equal
      (any G, any value, every `scale_rewards`, under `jax.jit` too with `num_generations` and
      `scale_rewards` static).

    Raises:
      ValueError: unknown `scale_rewards`, or N not a multiple of `num_generations`.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards_N = jnp.asarray(rewards_N, jnp.float32)
    stats = group_stats(rewards_N, num_generations)
    centred_N = jnp.where(_equal_groups_N(rewards_N, num_generations), 0.0, rewards_N - stats.mean_N)
    if scale_rewards == "none":
        return centred_N
    if scale_rewards == "group":
        std_N = stats.std_N
    else:
        std_N = jnp.broadcast_to(_std_ddof1(rewards_N), rewards_N.shape)
    return centred_N / (std_N + STD_EPSILON)


def advantage_metrics(rewards_N, num_generations: int) -> dict[str, float]:
    """Host-side logging helpers (TRL names): reward mean/std, mean group std, frac_reward_zero_std."""
    rewards_N = np.asarray(rewards_N, np.float32)
    stats = group_stats(rewards_N, num_generations)
    return {
        "reward": float(rewards_N.astype(np.float64).mean()),
        "reward_std": float(np.asarray(stats.std_N).mean()),
        "frac_reward_zero_std": float(np.asarray(stats.is_std_zero_N).mean()),
    }


# ----- advantage-estimator registry ---------------------------------------------------------------

def register_advantage(name: str):
    """Function decorator: registers `fn(rewards_N, grpo_config) -> float32 [N] advantages` under
    `name` (replacing any earlier one); `grpo.advantage_estimator` selects it. `grpo_config` is the
    `config.GRPOSection` (num_generations, scale_rewards, ...). The names live in
    `das_jax.registry.ADVANTAGES`."""
    def deco(fn):
        return ADVANTAGES.register(name, fn, replace=True)
    return deco


def get_advantage(name: str):
    """The registered estimator `name`; ValueError naming the registered ones otherwise."""
    if name not in ADVANTAGES:
        raise ValueError(f"advantage_estimator must be one of {ADVANTAGES.names()}, "
                         f"got {name!r}")
    return ADVANTAGES.get(name)


@register_advantage("grpo")
def grpo_advantages(rewards_N, grpo_config) -> jnp.ndarray:
    """`group_advantages` with the config's num_generations and scale_rewards."""
    return group_advantages(rewards_N, grpo_config.num_generations, grpo_config.scale_rewards)
