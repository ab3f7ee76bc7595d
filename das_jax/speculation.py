"""Drafter + speculation policy by name: what `--drafter` / the `drafter:` config key select.

| name            | drafter                                  | policy                           |
|-----------------|------------------------------------------|----------------------------------|
| none            | -                                        | - (plain decoding)               |
| ngram           | prompt lookup (vLLM `ngram`)             | fixed: widest width              |
| suffix          | per-problem suffix trees (DAS drafter)   | fixed: widest width              |
| suffix-global   | global + per-request tree (SuffixDecoding)| fixed: widest width             |
| das             | per-problem suffix trees                 | DAS length-aware policy          |
| das-unlimited   | per-problem suffix trees                 | every request, widest budget     |
"""
from __future__ import annotations

from das_jax.drafter import make_drafter
from das_jax.engine.cost_model import CostModel
from das_jax.engine.das_policy import DASConfig, DASPolicy
from das_jax.engine.policy import FixedPolicy

SPECULATION_NAMES = ("none", "ngram", "suffix", "suffix-global", "das", "das-unlimited")


def build_speculation(name: str, das_config: DASConfig | None = None,
                      cost_model: CostModel | None = None, **drafter_kwargs):
    """Returns (drafter or None, policy or None) for a speculation name.

    drafter_kwargs go to `das_jax.drafter.make_drafter` (e.g. window, max_depth, min_token_prob).

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if name not in SPECULATION_NAMES:
        raise ValueError(f"unknown drafter {name!r}; valid: {', '.join(SPECULATION_NAMES)}")
    if name == "none":
        return None, None
    if name in ("das", "das-unlimited"):
        drafter = make_drafter("suffix", **drafter_kwargs)
        cfg = das_config or DASConfig()
        if name == "das-unlimited":
            import dataclasses
            cfg = dataclasses.replace(cfg, unlimited=True)
        return drafter, DASPolicy(drafter.lengths, cfg, cost_model)
    return make_drafter(name, **drafter_kwargs), FixedPolicy()
