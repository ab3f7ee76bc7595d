"""EAGLE-3 draft heads: drafts from the policy's own hidden states.

Public surface:
  HeadConfig, init_head, run_levels, draft_all_anchors, draft_loss, HeadCache,
  extend_and_draft   (head: the pure functions; the rollout-side cached draft step)
  block_features, sequence_features   (features: the policy's block outputs and teacher)
  DraftHead, save_head, load_head, check_head_for_policy   (store: the head on disk)
  FitConfig, fit_head, draft_vocabulary, split_problems   (fit: offline fitting)
  HeadDrafter, head_drafts   (trace_drafter: the head in the trace simulation)
  head_vs_verify   (timing: the head's draft call against the policy's verify step)
  HeadRuntime   (runtime: the head in the engine, its programs and cache: a `DraftModel`)
  HeadDrafts   (drafter: the head's drafts or a history drafter's, per row, calibrated)

Names are imported lazily (PEP 562): importing the package does not import jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_EXPORTS = {
    "HeadConfig": "head", "init_head": "head", "run_levels": "head",
    "draft_all_anchors": "head", "draft_loss": "head",
    "block_features": "features", "sequence_features": "features",
    "DraftHead": "store", "save_head": "store", "load_head": "store",
    "check_head_for_policy": "store",
    "FitConfig": "fit", "fit_head": "fit", "draft_vocabulary": "fit", "split_problems": "fit",
    "HeadDrafter": "trace_drafter", "head_drafts": "trace_drafter",
    "head_vs_verify": "timing", "HeadCache": "head", "extend_and_draft": "head",
    "HeadRuntime": "runtime", "HeadDrafts": "drafter",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
