"""das_jax.drafter: nonparametric drafters for speculative decoding of RL rollouts.

Public surface:
- `Draft`, `Drafter` (the protocol the engine calls), `DraftBatch` and `propose_batch` /
  `append_batch` (every row in one call), `make_drafter(name, **kwargs)`,
  `DRAFTER_NAMES`.
- `SuffixDrafter` (DAS: per-problem suffix tries over a sliding window of epochs),
  `GlobalSuffixDrafter` (SuffixDecoding baseline), `NgramDrafter` / `NgramConfig` (prompt lookup).
- Building blocks: `SuffixTreeConfig`, `SuffixTree`, `SuffixForest`, `ScoredDraft`,
  `ProblemHistory`.

Everything here is host-side (numpy + numba); nothing imports jax.
"""
from .base import Draft, DraftBatch, Drafter, RequestContext, append_batch, propose_batch
from .factory import DRAFTER_NAMES, make_drafter
from .history import ProblemHistory
from .ngram import NgramConfig, NgramDrafter
from .suffix_drafter import GlobalSuffixDrafter, SuffixDrafter
from .suffix_tree import ScoredDraft, SuffixForest, SuffixTree, SuffixTreeConfig

__all__ = [
    "Draft", "DraftBatch", "Drafter", "propose_batch", "append_batch", "RequestContext",
    "DRAFTER_NAMES", "make_drafter", "ProblemHistory",
    "NgramConfig", "NgramDrafter", "GlobalSuffixDrafter", "SuffixDrafter", "ScoredDraft",
    "SuffixForest", "SuffixTree", "SuffixTreeConfig",
]
