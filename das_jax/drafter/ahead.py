"""`AheadDrafts`: drafts made while the device computes a step, for the context a row will have if
the step commits what was assumed (`SuffixDrafter.propose_ahead`), held per drafter slot until
the next propose takes them or a change to the tries they read voids them.

A draft is a deterministic function of the tries, the row's context, its unindexed tail (lag)
and its budget; a held draft is taken only where all of these are what it was made for, so a
propose returns the same drafts with or without it."""
from __future__ import annotations

import numpy as np

from . import _batch_kernels as BK
from .slots import RequestSlots


class AheadDrafts:
    """Held drafts, one per slot (arrays over the slots of a `RequestSlots`, grown on demand).

    Attributes:
      ok: bool [S], a draft is held for the slot.
      ctx_len, lag: int64 [S], the context length and its unindexed tokens it was made for.
      max_tokens: int32 [S], its budget. n: int32 [S], the assumed tokens: the last n of that
        context, assumed_SxW[s, :n].
      tokens_SxK (int32), probs_SxK (float32), support_SxK (int32), lens_S (int32), source_S
        (int8): the draft, as `DraftBatch`'s rows (zeros past lens_S).
      made, used: rows drafted ahead, and of them rows a propose took (counters).
    """

    def __init__(self):
        self.made = 0
        self.used = 0
        self._alloc(0, 1, 1)

    def _alloc(self, S: int, K: int, W: int) -> None:
        old = self.__dict__.get("ok")
        keep = 0 if old is None else min(old.shape[0], S)

        def grow(name, shape, dtype, fill=0):
            a = np.full(shape, fill, dtype)
            if keep:
                prev = getattr(self, name)
                if a.ndim == 1:
                    a[:keep] = prev[:keep]
                else:
                    c = min(prev.shape[1], a.shape[1])
                    a[:keep, :c] = prev[:keep, :c]
            setattr(self, name, a)
        grow("ok", S, bool, False)
        grow("ctx_len", S, np.int64, -1)
        grow("lag", S, np.int64)
        grow("max_tokens", S, np.int32)
        grow("n", S, np.int32)
        grow("assumed_SxW", (S, W), np.int32)
        grow("tokens_SxK", (S, K), np.int32)
        grow("probs_SxK", (S, K), np.float32)
        grow("support_SxK", (S, K), np.int32)
        grow("lens_S", S, np.int32)
        grow("source_S", S, np.int8, -1)

    def reserve(self, S: int, K: int, W: int) -> None:
        """Room for S slots, drafts of K tokens and W assumed tokens."""
        S0, K0 = self.tokens_SxK.shape
        W0 = self.assumed_SxW.shape[1]
        if S <= S0 and K <= K0 and W <= W0:
            return
        self._alloc(max(S, S0, 2 * S0 if S > S0 else 0), max(K, K0), max(W, W0))

    def any(self) -> bool:
        """Whether a draft is held for any slot."""
        return bool(self.ok.any())

    def void(self, mask: np.ndarray | None = None) -> None:
        """Drops the held drafts of the slots in `mask` (bool over slots; None: all)."""
        if mask is None:
            self.ok[:] = False
        else:
            n = min(mask.shape[0], self.ok.shape[0])
            self.ok[:n] &= ~mask[:n]

    def store(self, slots: np.ndarray, ctx_len_A: np.ndarray, lag_A: np.ndarray,
              max_tokens_A: np.ndarray, assumed_AxW: np.ndarray, n_A: np.ndarray,
              tokens_AxK: np.ndarray, probs_AxK: np.ndarray, support_AxK: np.ndarray,
              lens_A: np.ndarray, source_A: np.ndarray) -> None:
        """Holds row b's draft (tokens_AxK[b], ...) for slot slots[b], made for a context of
        ctx_len_A[b] tokens (lag_A[b] unindexed) ending in assumed_AxW[b, :n_A[b]], budget
        max_tokens_A[b]."""
        if not slots.shape[0]:
            return
        K, W = tokens_AxK.shape[1], assumed_AxW.shape[1]
        self.reserve(int(slots.max()) + 1, K, W)
        self.ok[slots] = True
        self.ctx_len[slots] = ctx_len_A
        self.lag[slots] = lag_A
        self.max_tokens[slots] = max_tokens_A
        self.n[slots] = n_A
        for name, x in (("assumed_SxW", assumed_AxW), ("tokens_SxK", tokens_AxK),
                        ("probs_SxK", probs_AxK), ("support_SxK", support_AxK)):
            a = getattr(self, name)
            a[slots] = 0
            a[slots, :x.shape[1]] = x
        self.lens_S[slots] = lens_A
        self.source_S[slots] = source_A
        self.made += int(slots.shape[0])

    def take(self, slots: np.ndarray, max_tokens_A: np.ndarray, sl: RequestSlots,
             tokens_AxK: np.ndarray, probs_AxK: np.ndarray, support_AxK: np.ndarray,
             lens_A: np.ndarray, source_A: np.ndarray) -> np.ndarray:
        """Writes into row b of the outputs the draft held for slot slots[b] where it was made
        for the slot's context now (length, lag, its last n tokens) and budget max_tokens_A[b];
        every held draft of `slots` is dropped (a context moves on after a propose). Returns
        bool [A]: the rows written. K (the outputs' width) >= max_tokens_A[b] of those rows."""
        if not slots.shape[0]:
            return np.zeros(0, bool)
        self.reserve(int(slots.max()) + 1, 1, 1)
        hit = np.zeros(slots.shape[0], bool)
        self.used += BK.take_ahead(slots, max_tokens_A, self.ok, self.ctx_len, self.lag,
                                   self.max_tokens, self.n, self.assumed_SxW, self.tokens_SxK,
                                   self.probs_SxK, self.support_SxK, self.lens_S, self.source_S,
                                   sl.ctx_len, sl.lag, sl.ctx_start, sl.pool, tokens_AxK,
                                   probs_AxK, support_AxK, lens_A, source_A, hit)
        return hit
