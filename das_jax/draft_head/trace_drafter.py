"""The draft head in the trace simulation (`das-jax bench drafter --trace T --head H`).

The head drafts from the policy's features of the committed tokens. On a recorded rollout those
are the features of a teacher-forced forward over its prompt + output (causal: a position's
features depend on its prefix only, so they equal what the verify steps would have returned),
and the head's draft from each position does not depend on how the rollout got there. So
`head_drafts` computes, in one batched call per rollout, the head's k-token draft and its path
probabilities from every position; `HeadDrafter` then serves them in the simulation's protocol,
alone or choosing per row between the head's draft and a history drafter's by their expected
accepted length (the sum of the path probabilities).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from das_jax.draft_head.drafter import BesideHistory
from das_jax.drafter.base import Draft


def head_drafts(model_config, params, head, sequences, steps: int, progress=None,
                dtype: str = "float32"):
    """Per sequence (prompt + output ids), the head's draft from every anchor: (tokens int32
    `[n, steps]`, path probabilities float32 `[n, steps]`); row t is the draft of the tokens
    after position t + 1 (anchor t, the next token x_{t+1} known). dtype: the head's matrices'
    dtype (`head.cast_weights`), as the engine would draft with `draft_head.dtype`."""
    # deferred import: jax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    from das_jax.draft_head.features import sequence_features
    from das_jax.draft_head.head import cast_weights, draft_all_anchors

    hc = dataclasses.replace(head.config, dtype=dtype)
    feats = sequence_features(model_config, params, sequences, hc.feature_layers, 0,
                              progress=progress)
    hp = jax.tree_util.tree_map(jnp.asarray, cast_weights(dict(head.params), dtype))
    embed = jnp.asarray(params["embed"], jnp.float32)
    d2t = jnp.asarray(head.draft_to_target)

    @functools.partial(jax.jit, static_argnums=(3,))
    def run(f, nxt, valid, T):
        return draft_all_anchors(hc, hp, embed, d2t, f, nxt, valid, steps)

    out = []
    for seq, (f,) in zip(sequences, feats):
        n = len(seq)
        T = -(-n // 64) * 64
        fp = np.zeros((1, T, f.shape[-1]), np.float32)
        fp[0, :n] = f
        nxt = np.zeros((1, T), np.int32)
        nxt[0, :n - 1] = seq[1:]
        valid = np.zeros((1, T), bool)
        valid[0, :n - 1] = True
        tok, p = run(jnp.asarray(fp), jnp.asarray(nxt), jnp.asarray(valid), T)
        out.append((np.asarray(tok[0, :n]), np.asarray(p[0, :n])))
    return out


class HeadDrafter(BesideHistory):
    """The `Drafter` protocol over precomputed head drafts (`head_drafts`), for the trace
    simulation. `drafts_of` maps `id(rollout)` to its `head_drafts` entry; the simulation calls
    `bind(request_id, rollout)` before `begin`.

    history: optional history drafter; each `propose` then returns whichever of the two drafts
    has the larger expected accepted length: the sum of its path probabilities, the head's
    (its softmax probabilities) times `head_scale`, the history's its own count-ratio estimate.
    `source_counts` counts the rows each source won. `tree`: the simulation verifies both
    drafts in one step instead (`propose_both`: a two-branch token tree, as
    `engine.step.verify_packed` verifies them)."""

    def __init__(self, drafts_of: dict, history=None, head_scale: float = 2.0,
                 tree: bool = False):
        self.drafts_of = drafts_of
        self.history = history
        self.head_scale = head_scale
        self.tree = tree and history is not None
        self._drafts, self._len = {}, {}
        self.source_counts = {"head": 0, "history": 0, "none": 0}

    def bind(self, request_id, rollout) -> None:
        self._drafts[request_id] = self.drafts_of[id(rollout)]

    def begin(self, request_id, problem_id, prompt_ids) -> None:
        self._len[request_id] = len(prompt_ids)
        super().begin(request_id, problem_id, prompt_ids)

    def _head(self, request_id, max_tokens) -> Draft:
        n = self._len[request_id]
        tok, p = self._drafts[request_id]
        a = n - 2            # anchor: the last position whose features exist
        if 0 <= a < len(tok) and max_tokens > 0:
            k = min(max_tokens, tok.shape[1])
            return Draft(tok[a, :k].astype(np.int32), p[a, :k].astype(np.float32))
        return Draft.empty()

    def propose_both(self, request_id, max_tokens) -> tuple[Draft, Draft]:
        """(the history's draft, the head's draft), each up to `max_tokens` (the head's up to
        its steps); the history's empty without a history drafter."""
        head = self._head(request_id, max_tokens)
        hist = (self.history.propose(request_id, max_tokens) if self.history is not None
                else Draft.empty())
        return hist, head

    def propose(self, request_id, max_tokens) -> Draft:
        head = self._head(request_id, max_tokens)
        if self.history is None:
            self.source_counts["head" if len(head) else "none"] += 1
            return head
        hist = self.history.propose(request_id, max_tokens)
        h_score = float(np.sum(hist.probs)) if len(hist) else 0.0
        d_score = self.head_scale * float(np.sum(head.probs)) if len(head) else 0.0
        if d_score > h_score:
            self.source_counts["head"] += 1
            return head
        self.source_counts["history" if len(hist) else "none"] += 1
        return hist

    def append(self, request_id, token_ids) -> None:
        self._len[request_id] += len(token_ids)
        super().append(request_id, token_ids)

    def end(self, request_id) -> None:
        self._drafts.pop(request_id, None)
        super().end(request_id)
