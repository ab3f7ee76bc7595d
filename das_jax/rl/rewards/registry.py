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
    """The reward function registered under ``name`` (``REWARDS``).

    Raises:
        KeyError: unknown name (the message lists the valid names).
    """
    if name not in REWARDS:
        raise KeyError(f"unknown reward function {name!r}; valid names: "
                       f"{', '.join(sorted(REWARDS.names()))}")
    return REWARDS.get(name)


def register_reward_fn(name: str, fn: RewardFn, *, overwrite: bool = False) -> None:
    """Register a reward function under ``name`` (``REWARDS.register``).

    Raises:
        ValueError: ``name`` is empty, or taken and ``overwrite`` is False.
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"reward function {name!r} is not callable")
    REWARDS.register(name, fn, replace=overwrite)


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


def self_test_rewards(reward_fns: Sequence[RewardFn]) -> None:
    """Runs the start-up self-test of every reward function that has one (the code reward:
    one right and one wrong solution through its sandbox; remembered per process).

    Raises:
        SandboxUnavailableError: a sandbox cannot run here or judged its self-test wrongly.
    """
    for fn in reward_fns:
        if callable(getattr(fn, "self_test", None)):
            fn.self_test()
