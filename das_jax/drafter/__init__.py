"""das_jax.drafter: nonparametric drafters for speculative decoding of RL rollouts.

Public surface:
- `Draft`, `Drafter` (the protocol the engine calls), `DraftBatch` and `propose_batch` /
  `append_batch` (every row in one call), `make_drafter(name, **kwargs)`,
  `DRAFTER_NAMES`.
- `SuffixDrafter` (DAS: per-problem suffix tries over a sliding window of epochs),
  `GlobalSuffixDrafter` (SuffixDecoding baseline), `NgramDrafter` / `NgramConfig` (prompt lookup).
- Building blocks: `SuffixTreeConfig`, `SuffixTree`, `SuffixForest`, `ScoredDraft`,
  `ProblemHistory`, `ShardedHistory` (its problems split over several forests).

Everything here is host-side (numpy + numba); nothing imports jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

# Imported lazily (PEP 562): `das_jax.drafter.base` (the types the engine uses) loads without
# numba.
_EXPORTS = {
    "Draft": "base", "DraftBatch": "base", "DRAFT_SOURCES": "base", "Drafter": "base", "RequestContext": "base",
    "propose_batch": "base", "append_batch": "base", "set_policy_version": "base",
    "DRAFTER_NAMES": "factory", "make_drafter": "factory",
    "ProblemHistory": "history", "ShardedHistory": "history",
    "NgramConfig": "ngram", "NgramDrafter": "ngram",
    "GlobalSuffixDrafter": "suffix_drafter", "SuffixDrafter": "suffix_drafter",
    "ScoredDraft": "suffix_tree", "SuffixForest": "suffix_tree", "SuffixTree": "suffix_tree",
    "SuffixTreeConfig": "suffix_tree",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
