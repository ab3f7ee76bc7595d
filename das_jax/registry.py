"""Every name a config or a command line may choose, in one module: `Registry` and its instances.

    SPECULATION  speculation names (`drafter:`, `--drafter`): `das_jax.speculation.names`
    DRAFTERS     drafter constructors by name (`make_drafter`): `das_jax.drafter.factory`
    DATASETS     dataset kinds (`data.kind`): `das_jax.data.registry`
    REWARDS      reward functions (`grpo.reward_funcs`): `das_jax.rl.rewards.registry`
    LOSSES       policy losses (`grpo.loss_type`): `das_jax.rl.losses`
    ADVANTAGES   advantage estimators (`grpo.advantage_estimator`): `das_jax.rl.advantages`

Built-in entries register in their own modules (named above). A registry imports that module the
first time it is read or written, so a name is valid wherever the registry is read (the config's
choices, a command's flags) without the reader importing the code behind it, and a user's entry
registered before the first read cannot silently shadow a built-in. This module is the ground
floor: it imports nothing from das_jax.
"""
from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, TypeVar

__all__ = ["Registry", "SPECULATION", "DRAFTERS", "DATASETS", "REWARDS", "LOSSES", "ADVANTAGES"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries (builders, functions, specs), in registration order (built-ins first).

    Args:
      kind: what the names are, for messages ("speculation", "reward function", ...).
      builtins: the module whose import registers the built-in entries (imported on first use).
    """

    def __init__(self, kind: str, builtins: str | None = None):
        self.kind = kind
        self._builtins = builtins
        self._entries: dict[str, T] = {}

    def _load(self) -> None:
        if self._builtins is not None:
            module, self._builtins = self._builtins, None   # before the import: it registers here
            importlib.import_module(module)

    @property
    def entries(self) -> dict[str, T]:
        """The name -> entry dict itself (built-ins loaded); writes to it register / remove."""
        self._load()
        return self._entries

    def register(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Registers `entry` under `name`; returns `entry`.

        Raises:
          ValueError: `name` is not a non-empty string, or is taken and `replace` is False.
        """
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        self._load()
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to "
                             "override it")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """`@registry.decorator("name")`: registers the decorated object under `name`."""
        def register(entry: T) -> T:
            return self.register(name, entry, replace=replace)
        return register

    def unregister(self, name: str) -> None:
        """Removes `name`. Raises KeyError for an unknown name."""
        self.get(name)
        del self._entries[name]

    def get(self, name: str) -> T:
        """The entry of `name`. Raises KeyError for an unknown name (the message lists the
        registered names)."""
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise KeyError(f"unknown {self.kind} {name!r}; valid: "
                           f"{', '.join(self._entries)}") from None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (built-ins first)."""
        self._load()
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


SPECULATION: Registry = Registry("speculation", "das_jax.speculation.names")
DRAFTERS: Registry = Registry("drafter", "das_jax.drafter.factory")
DATASETS: Registry = Registry("dataset kind", "das_jax.data.registry")
REWARDS: Registry = Registry("reward function", "das_jax.rl.rewards.registry")
LOSSES: Registry = Registry("loss", "das_jax.rl.losses")
ADVANTAGES: Registry = Registry("advantage estimator", "das_jax.rl.advantages")
