"""Reward functions by name (for configs): the built-ins ``math_accuracy``, ``format``, ``code``
registered in ``das_jax.registry.REWARDS``; ``REWARD_FUNCTIONS`` is that registry's dict."""

from __future__ import annotations

from typing import Any, Sequence

from das_jax.registry import REWARDS
from das_jax.rl.rewards.code_reward import code_reward, make_code_reward
from das_jax.rl.rewards.math_reward import format_reward, math_accuracy_reward
from das_jax.rl.rewards.safety import RewardFn

__all__ = ["REWARD_FUNCTIONS", "get_reward_fn", "register_reward_fn", "reward_fns_from_config"]

REWARDS.register("math_accuracy", math_accuracy_reward)
REWARDS.register("format", format_reward)
REWARDS.register("code", code_reward)
REWARD_FUNCTIONS: dict[str, RewardFn] = REWARDS.entries


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered under ``name``.

    Raises:
        KeyError: unknown name (the message lists the valid names).
    """
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FUNCTIONS))}") from None


def register_reward_fn(name: str, fn: RewardFn, *, overwrite: bool = False) -> None:
    """Register a reward function under ``name``.

    Raises:
        ValueError: ``name`` is taken and ``overwrite`` is False.
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"reward function {name!r} is not callable")
    if name in REWARD_FUNCTIONS and not overwrite:
        raise ValueError(f"reward function {name!r} is already registered (pass overwrite=True)")
    REWARD_FUNCTIONS[name] = fn




def reward_fns_from_config(names: Sequence[str], rewards: Any = None) -> list[RewardFn]:
    """The reward functions ``names`` (``grpo.reward_funcs``), the built-in ``code`` reward built
    with the ``rewards:`` config section (``sandbox``, ``workers``, ``timeout_s``, ``memory_mb``;
    None: the defaults). Other names come from the registry as they are.

    Raises:
        KeyError: an unknown name.
    """
    out = []
    for name in names:
        fn = get_reward_fn(name)
        if fn is code_reward and rewards is not None:
            fn = make_code_reward(timeout_s=rewards.timeout_s, memory_mb=rewards.memory_mb,
                                  num_workers=rewards.workers, sandbox=rewards.sandbox)
        out.append(fn)
    return out
