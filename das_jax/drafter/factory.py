"""`make_drafter(name, **kwargs)`: drafters by name (`das_jax.registry.DRAFTERS`, whose built-ins
register here)."""
from __future__ import annotations

from das_jax.registry import DRAFTERS

from .base import Drafter
from .ngram import NgramConfig, NgramDrafter
from .suffix_drafter import GlobalSuffixDrafter, SuffixDrafter
from .suffix_tree import SuffixTreeConfig

_TREE_KEYS = {f.name for f in SuffixTreeConfig.__dataclass_fields__.values()}
_NGRAM_KEYS = {f.name for f in NgramConfig.__dataclass_fields__.values()}


def _none(name, kwargs):
    return None


def _ngram(name, kwargs):
    config = kwargs.pop("config", None) or NgramConfig(**_pick(kwargs, _NGRAM_KEYS))
    _no_more(name, kwargs)
    return NgramDrafter(config)


def _suffix(cls):
    def build(name, kwargs):
        config = kwargs.pop("config", None) or SuffixTreeConfig(**_pick(kwargs, _TREE_KEYS))
        try:
            return cls(config, **kwargs)
        except TypeError as e:
            raise TypeError(f"make_drafter({name!r}): {e}") from None
    return build


DRAFTERS.register("none", _none)
DRAFTERS.register("ngram", _ngram)
DRAFTERS.register("suffix", _suffix(SuffixDrafter))
DRAFTERS.register("suffix-global", _suffix(GlobalSuffixDrafter))
DRAFTERS.register("das", _suffix(SuffixDrafter))
DRAFTER_NAMES = DRAFTERS.names()  # the built-in names


def make_drafter(name: str, **kwargs) -> Drafter | None:
    """Build a drafter.

    Names: "none" -> None; "ngram" (kwargs: NgramConfig fields); "suffix" and "das" (the
    per-problem `SuffixDrafter`; kwargs: SuffixTreeConfig fields, window, prompt_tail,
    max_problems, threads); "suffix-global" (`GlobalSuffixDrafter`; SuffixTreeConfig fields, window,
    prompt_tail). A `config=` object may replace the config fields. A builder registered in
    `das_jax.registry.DRAFTERS` as `build(name, kwargs) -> Drafter | None` adds a name.

    Raises ValueError for an unknown name, TypeError for an unknown keyword.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; valid names: {', '.join(DRAFTERS.names())}")
    return DRAFTERS.get(name)(name, kwargs)


def _pick(kwargs: dict, keys: set) -> dict:
    return {k: kwargs.pop(k) for k in list(kwargs) if k in keys}


def _no_more(name, kwargs):
    if kwargs:
        raise TypeError(f"make_drafter({name!r}): unexpected arguments {sorted(kwargs)}")
