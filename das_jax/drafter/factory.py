"""`make_drafter(name, **kwargs)`: drafters by name."""
from __future__ import annotations

from .base import Drafter
from .ngram import NgramConfig, NgramDrafter
from .suffix_drafter import GlobalSuffixDrafter, SuffixDrafter
from .suffix_tree import SuffixTreeConfig

DRAFTER_NAMES = ("none", "ngram", "suffix", "suffix-global", "das")

_TREE_KEYS = {f.name for f in SuffixTreeConfig.__dataclass_fields__.values()}
_NGRAM_KEYS = {f.name for f in NgramConfig.__dataclass_fields__.values()}


def make_drafter(name: str, **kwargs) -> Drafter | None:
    """Build a drafter.

    Names: "none" -> None; "ngram" (kwargs: NgramConfig fields); "suffix" and "das" (the
    per-problem `SuffixDrafter`; kwargs: SuffixTreeConfig fields, window, prompt_tail,
    max_problems); "suffix-global" (`GlobalSuffixDrafter`; SuffixTreeConfig fields, window,
    prompt_tail). A `config=` object may replace the config fields.

    Raises ValueError for an unknown name, TypeError for an unknown keyword.
    """
    if name == "none":
        return None
    if name == "ngram":
        config = kwargs.pop("config", None) or NgramConfig(**_pick(kwargs, _NGRAM_KEYS))
        _no_more(name, kwargs)
        return NgramDrafter(config)
    if name in ("suffix", "das", "suffix-global"):
        config = kwargs.pop("config", None) or SuffixTreeConfig(**_pick(kwargs, _TREE_KEYS))
        cls = GlobalSuffixDrafter if name == "suffix-global" else SuffixDrafter
        try:
            return cls(config, **kwargs)
        except TypeError as e:
            raise TypeError(f"make_drafter({name!r}): {e}") from None
    raise ValueError(f"unknown drafter {name!r}; valid names: {', '.join(DRAFTER_NAMES)}")


def _pick(kwargs: dict, keys: set) -> dict:
    return {k: kwargs.pop(k) for k in list(kwargs) if k in keys}


def _no_more(name, kwargs):
    if kwargs:
        raise TypeError(f"make_drafter({name!r}): unexpected arguments {sorted(kwargs)}")
