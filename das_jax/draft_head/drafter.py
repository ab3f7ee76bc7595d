"""`HeadDrafts`: the draft head as a rollout drafter, alone or beside a history drafter.

The head itself runs on the device (`runtime.HeadRuntime`, the engine's `DraftModel`): after
each prefill and verify step it has drafted `steps` tokens for every row. The engine's
scheduler hands those drafts over before each step's plan (`set_model_drafts`); `propose_batch`
then gives each row the head's draft or the history drafter's, whichever has the larger
expected accepted length: c_s x the sum of the draft's path probabilities, with a calibration
factor c_s per source (the head's softmax probabilities and the history's count ratios
under- or over-estimate acceptance by different amounts).

Calibration without selection bias: only the chosen draft is verified, so scoring each source
on its own verified drafts would never test the one that lost. Instead, after each step both
proposals of every row are scored against the tokens the step emitted (`append_batch`): the
leading tokens of a draft that equal the emitted ones are what it would have had accepted, and
the prediction it is compared with is the sum of its path probabilities over as many positions
as the step emitted (the same censoring for both: beyond the emitted tokens the true
continuation is unknown). c_s = (prior_s + matched_s) / (prior + predicted_s), the sums over
the drafter's life; the priors are `head_scale` and 1 tokens per predicted token over
`prior_tokens` tokens. The speculation policy then sizes each row's chosen draft from its
probabilities: a head draft's times c_head (capped at 1), a history draft's as the history
drafter gave them (the DAS policy calibrates those itself).

Drafts only propose: the verify step samples every token with the position-keyed rule, so
rollouts are token-identical to decoding without drafts whichever source wins.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from das_jax.drafter.base import (DRAFT_SOURCES, DraftBatch, append_batch, flush_appends,
                                  pick_rows, propose_batch)

HEAD_SOURCE = DRAFT_SOURCES.index("head")


class BesideHistory:
    """The Drafter protocol's bookkeeping handed on to an optional history drafter
    (`self.history`, None: nothing to hand on); the head drafters build on it."""

    history = None

    def begin(self, request_id, problem_id, prompt_ids) -> None:
        if self.history is not None:
            self.history.begin(request_id, problem_id, prompt_ids)

    def append(self, request_id, token_ids) -> None:
        if self.history is not None:
            self.history.append(request_id, token_ids)

    def end(self, request_id) -> None:
        if self.history is not None:
            self.history.end(request_id)

    def advance_epoch(self) -> None:
        if self.history is not None:
            self.history.advance_epoch()

    def state_dict(self) -> dict:
        return {} if self.history is None else self.history.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.history is not None:
            self.history.load_state_dict(state)


class HeadDrafts(BesideHistory):
    """The `Drafter` protocol over a draft head's device-side drafts (module docstring).

    Args:
      runtime: the `HeadRuntime` (the engine runs it as `draft_model`).
      history: optional history drafter (`SuffixDrafter`, ...); every other attribute of this
        object is the history drafter's.
      head_scale: the prior of the head's calibration factor c_head (> 0; worth
        `prior_tokens` predicted tokens, then learned from the emitted tokens).
      prior_tokens: the weight of the priors, in predicted tokens.

    Attributes:
      source_counts: rows each source won in the drafter's own comparison, over its life
        ("head", "history", "none"; a policy with `pick_sources` may verify the other).
    """

    def __init__(self, runtime, history=None, head_scale: float = 2.0,
                 prior_tokens: float = 64.0):
        if not head_scale > 0:
            raise ValueError(f"head_scale={head_scale} must be > 0")
        self.draft_model = runtime
        self.history = history
        self.head_scale = float(head_scale)
        self.source_counts = {"head": 0, "history": 0, "none": 0}
        self._req = np.zeros(0, np.int64)
        self._tok = np.zeros((0, runtime.steps), np.int32)
        self._probs = np.zeros((0, runtime.steps), np.float32)
        # censored calibration (module docstring): [head, history] matched / predicted tokens
        self.prior = np.array([head_scale, 1.0]) * prior_tokens, float(prior_tokens)
        self.matched = np.zeros(2)
        self.predicted = np.zeros(2)
        self._proposed = None     # the last propose_batch's two proposals per request

    @property
    def calibration(self) -> np.ndarray:
        """float64 `[2]`: c_head, c_history (expected accepted tokens per predicted token)."""
        prior_matched, prior_predicted = self.prior
        return (prior_matched + self.matched) / (prior_predicted + self.predicted)

    def __getattr__(self, name):
        history = self.__dict__.get("history")
        if history is None:
            raise AttributeError(name)
        return getattr(history, name)

    # ---------------------------------------------------------------- the head's drafts
    def set_model_drafts(self, request_ids_A, tokens_AxJ, probs_AxJ) -> None:
        """The head's latest drafts of requests `request_ids_A` (int `[A]`): tokens int32
        `[A, J]`, path probabilities float32 `[A, J]` (0: no draft)."""
        req = np.asarray(request_ids_A, np.int64)
        order = np.argsort(req, kind="stable")
        self._req = req[order]
        self._tok = np.asarray(tokens_AxJ, np.int32)[order]
        self._probs = np.asarray(probs_AxJ, np.float32)[order]

    def _head_of(self, request_ids: np.ndarray):
        """(tokens, probs) `[A, J]` of these requests (probabilities 0 where none is held)."""
        A, J = len(request_ids), self._tok.shape[1]
        tok = np.zeros((A, J), np.int32)
        probs = np.zeros((A, J), np.float32)
        if len(self._req):
            at = np.minimum(np.searchsorted(self._req, request_ids), len(self._req) - 1)
            hit = self._req[at] == request_ids
            tok[hit], probs[hit] = self._tok[at[hit]], self._probs[at[hit]]
        return tok, probs

    def propose_batch(self, request_ids, max_tokens_A) -> DraftBatch:
        """Per row the head's draft (up to max_tokens_A[b] tokens) or the history drafter's,
        whichever has the larger expected accepted length (module docstring), with the other
        as the row's `alternative` (a policy with `pick_sources`, the DAS policy, prices the
        two under its cost model and may take it instead)."""
        request_ids = np.asarray(request_ids, np.int64)
        max_tokens_A = np.asarray(max_tokens_A, np.int32)
        A = len(request_ids)
        tok, probs = self._head_of(request_ids)
        J = tok.shape[1]
        k_A = np.minimum(max_tokens_A, J)
        cols = np.arange(J)[None, :]
        raw_p = np.where(cols < k_A[:, None], probs, 0.0)
        head_len = np.where(raw_p[:, 0] > 0, k_A, 0).astype(np.int32)
        if self.history is not None:
            hist = propose_batch(self.history, request_ids, max_tokens_A)
        else:
            hist = DraftBatch.empty(A, 0)
        c_head, c_hist = self.calibration
        head_p = np.minimum(1.0, c_head * raw_p)
        head_score = head_p.sum(axis=1)
        # both capped at 1 per position: a draft accepts at most one token per position
        hist_score = (np.minimum(1.0, c_hist * hist.probs_AxK).sum(axis=1)
                      if hist.probs_AxK.size else np.zeros(A))
        self._proposed = (request_ids.copy(), tok, raw_p, hist.tokens_AxK.copy(),
                          hist.probs_AxK.astype(np.float64))
        use = (head_score > hist_score) & (head_len > 0)
        K_head = int(head_len.max(initial=0))
        head = DraftBatch(np.where(cols < head_len[:, None], tok, 0)[:, :K_head],
                          head_p.astype(np.float32)[:, :K_head], np.zeros((A, K_head), np.int32),
                          head_len, np.zeros(A, bool), source_A=np.where(
                              head_len > 0, HEAD_SOURCE, -1).astype(np.int8))
        hist = dataclasses.replace(hist, alternative=None)
        won_head = int(use.sum())
        won_hist = int(((~use) & (hist.lens_A > 0)).sum())
        self.source_counts["head"] += won_head
        self.source_counts["history"] += won_hist
        self.source_counts["none"] += A - won_head - won_hist
        return dataclasses.replace(pick_rows(hist, head, use),
                                   alternative=pick_rows(head, hist, use))

    def propose(self, request_id, max_tokens):
        """One row's draft (`propose_batch` of one request)."""
        return self.propose_batch([request_id], [max_tokens]).row(0)

    # ---------------------------------------------------------------- calibration
    def append_batch(self, request_ids, tokens_AxW, n_A, index_later: bool = False) -> None:
        """Scores both of each row's last proposals against the tokens its step emitted
        (module docstring), then appends them to the history drafter."""
        request_ids = np.asarray(request_ids, np.int64)
        tokens_AxW = np.asarray(tokens_AxW, np.int32)
        n_A = np.asarray(n_A, np.int32)
        self._score(request_ids, tokens_AxW, n_A)
        if self.history is not None:
            append_batch(self.history, request_ids, tokens_AxW, n_A, index_later)

    def _score(self, request_ids, tokens_AxW, n_A) -> None:
        if self._proposed is None or not len(request_ids):
            return
        req, head_tok, head_p, hist_tok, hist_p = self._proposed
        if not len(req):
            return
        order = np.argsort(req, kind="stable")
        at = np.minimum(np.searchsorted(req[order], request_ids), len(req) - 1)
        hit = req[order][at] == request_ids
        if not hit.any():
            return
        rows = order[at[hit]]
        emitted, n = tokens_AxW[hit], n_A[hit]
        W = emitted.shape[1]
        for s, (tok, p) in enumerate(((head_tok, head_p), (hist_tok, hist_p))):
            K = min(tok.shape[1], W)
            if K == 0:
                continue
            t, pr = tok[rows, :K], p[rows, :K]
            seen = np.arange(K)[None, :] < n[:, None]          # censored at the emitted count
            drafted = pr > 0
            match = np.cumprod((t == emitted[:, :K]) & seen & drafted, axis=1)
            self.matched[s] += float(match.sum())
            self.predicted[s] += float(np.where(seen, pr, 0.0).sum())
        self._proposed = None

    def flush_appends(self) -> None:
        """The history drafter's deferred appends (`append_batch(..., index_later=True)`)."""
        if self.history is not None:
            flush_appends(self.history)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The history drafter's state and the calibration (matched / predicted tokens per
        source, rows each source won), so a resumed run chooses as the uninterrupted one.
        The head's latest drafts are not kept: a resumed rollout starts with a prefill."""
        return {"kind": "head", "history": BesideHistory.state_dict(self),
                "matched": self.matched.copy(), "predicted": self.predicted.copy(),
                "source_counts": dict(self.source_counts)}

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()` output; a state without "kind": "head" is the history
        drafter's alone (checkpoints written before the calibration was kept)."""
        if state.get("kind") != "head":
            BesideHistory.load_state_dict(self, state)
            return
        BesideHistory.load_state_dict(self, state["history"])
        self.matched = np.asarray(state["matched"], np.float64).reshape(2).copy()
        self.predicted = np.asarray(state["predicted"], np.float64).reshape(2).copy()
        self.source_counts = {k: int(v) for k, v in state["source_counts"].items()}
