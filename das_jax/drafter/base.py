"""The Drafter protocol the engine calls, and the `Draft` it returns.

The engine talks to every drafter through five calls per rollout (`begin`, `propose`, `append`,
`end`) plus `advance_epoch` at each policy update. Drafters are host-side (CPU) components: they
never touch device arrays.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Draft:
    """Draft tokens for one request.

    Attributes:
      tokens: int32 [k], the proposed continuation of the request's context; k may be 0.
      probs: float32 [k]; probs[i] is the drafter's estimate of the probability that
        tokens[:i+1] are all accepted (a path probability, so non-increasing in i).
      support: optional int32 [k]; support[i] is how many past occurrences the estimate of
        token i rests on (a suffix trie: the count of the context path it continues). None:
        unknown (e.g. prompt lookup). The DAS policy calibrates acceptance by it.
    """

    tokens: np.ndarray
    probs: np.ndarray
    support: np.ndarray | None = None

    def __post_init__(self):
        if self.tokens.shape != self.probs.shape or self.tokens.ndim != 1:
            raise ValueError(
                f"Draft tokens and probs must be 1-D of equal length, got {self.tokens.shape} "
                f"and {self.probs.shape}")
        if self.support is not None and self.support.shape != self.tokens.shape:
            raise ValueError(
                f"Draft support must match its tokens' shape {self.tokens.shape}, got "
                f"{self.support.shape}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> "Draft":
        """A draft of length 0."""
        return Draft(np.zeros(0, np.int32), np.zeros(0, np.float32))


# Where a draft comes from (`DraftBatch.source_A` indexes this): the suffix drafter's scopes
# (`SuffixDrafter`: the problem's trie, the request's own, the global one), a draft head
# (`das_jax.draft_head`), and "other" for drafters that do not say.
DRAFT_SOURCES = ("problem", "request", "global", "head", "other")
OTHER_SOURCE = DRAFT_SOURCES.index("other")


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """Drafts for A rows at once (what `propose_batch` returns; row b is the `Draft` of the b-th
    request asked for).

    Attributes:
      tokens_AxK: int32 [A, K]; row b's draft is tokens_AxK[b, :lens_A[b]] (0 past it).
      probs_AxK: float32 [A, K]; path probabilities as in `Draft.probs` (0 past a row's draft).
      support_AxK: int32 [A, K]; supports as in `Draft.support` (0 past a row's draft, and for
        rows whose drafter gives none).
      lens_A: int32 [A], each <= K.
      has_support_A: bool [A]; whether row b's draft comes with a support (`Draft.support` not
        None).
      age_A: float32 [A] or None; the age, in policy versions, of the history row b drafts
        from (`ProblemHistory.age`: the drafter's current policy version less the mean version
        of the rollouts indexed for the row's problem; NaN where unknown). None: the drafter
        does not track versions. The DAS policy calibrates acceptance per age.
      source_A: int8 [A] or None; where row b's draft comes from, an index into
        `DRAFT_SOURCES` (-1: no draft). None: the drafter does not say ("other"). The engine
        counts drafted and accepted tokens per source (`GenerateStats.drafted_by_source`).
      alternative: a `DraftBatch` of the same A rows or None: each row's draft from another
        source (a draft head's, where the history's is the row's draft, and the other way
        round; an empty row where there is none). A policy with `pick_sources` prices the two
        per row (`engine.policy.plan_step`); other policies verify the row's own draft.
    """

    tokens_AxK: np.ndarray
    probs_AxK: np.ndarray
    support_AxK: np.ndarray
    lens_A: np.ndarray
    has_support_A: np.ndarray
    age_A: np.ndarray | None = None
    source_A: np.ndarray | None = None
    alternative: "DraftBatch | None" = None

    @staticmethod
    def empty(rows: int, width: int = 0) -> "DraftBatch":
        """`rows` empty drafts, K = width."""
        return DraftBatch(np.zeros((rows, width), np.int32), np.zeros((rows, width), np.float32),
                          np.zeros((rows, width), np.int32), np.zeros(rows, np.int32),
                          np.zeros(rows, bool))

    @staticmethod
    def from_drafts(drafts: Sequence["Draft | None"], width: int | None = None) -> "DraftBatch":
        """Packs per-row drafts (None: empty) into K = width (default: the longest) columns;
        longer drafts are cut to K."""
        lens = np.array([0 if d is None else len(d) for d in drafts], np.int32)
        K = int(lens.max(initial=0)) if width is None else int(width)
        out = DraftBatch.empty(len(drafts), K)
        for b, d in enumerate(drafts):
            if d is None or not len(d):
                continue
            k = min(len(d), K)
            out.tokens_AxK[b, :k] = d.tokens[:k]
            out.probs_AxK[b, :k] = d.probs[:k]
            if d.support is not None:
                out.support_AxK[b, :k] = d.support[:k]
                out.has_support_A[b] = True
        np.minimum(lens, K, out=lens)
        return DraftBatch(out.tokens_AxK, out.probs_AxK, out.support_AxK, lens,
                          out.has_support_A)

    def __len__(self) -> int:
        return int(self.lens_A.shape[0])

    @property
    def width(self) -> int:
        """K, the columns."""
        return int(self.tokens_AxK.shape[1])

    def row(self, b: int) -> Draft:
        """Row b as a `Draft` (copies)."""
        k = int(self.lens_A[b])
        return Draft(self.tokens_AxK[b, :k].copy(), self.probs_AxK[b, :k].copy(),
                     self.support_AxK[b, :k].copy() if self.has_support_A[b] else None)

    def cut(self, n_A: np.ndarray) -> "DraftBatch":
        """The drafts cut to n_A[b] <= lens_A[b] tokens each (columns past max(n_A) dropped)."""
        alternative = None if self.alternative is None else self.alternative.cut(n_A)
        n_A = np.minimum(np.asarray(n_A, np.int32), self.lens_A)
        K = int(n_A.max(initial=0))
        if K == self.width and (n_A == self.lens_A).all():
            # nothing to cut (the drafter kept to its budgets)
            return (self if alternative is self.alternative
                    else dataclasses.replace(self, alternative=alternative))
        keep_AxK = np.arange(K)[None, :] < n_A[:, None]
        return DraftBatch(np.where(keep_AxK, self.tokens_AxK[:, :K], 0).astype(np.int32),
                          np.where(keep_AxK, self.probs_AxK[:, :K], 0).astype(np.float32),
                          np.where(keep_AxK, self.support_AxK[:, :K], 0).astype(np.int32),
                          n_A, self.has_support_A & (n_A > 0), self.age_A, self.source_A,
                          alternative)

    def sources(self) -> np.ndarray:
        """int8 `[A]`: `source_A`, or where the drafter does not say, "other" for rows with a
        draft and -1 for rows without."""
        if self.source_A is not None:
            return self.source_A
        return np.where(self.lens_A > 0, OTHER_SOURCE, -1).astype(np.int8)


def pick_rows(a: DraftBatch, b: DraftBatch, use_b_A: np.ndarray) -> DraftBatch:
    """Row by row, `b`'s draft where use_b_A (bool `[A]`) holds, else `a`'s: one `DraftBatch` of
    K = the wider of the two (ages NaN and sources "other" where a batch gives none; no
    `alternative`)."""
    use = np.asarray(use_b_A, bool)
    K = max(a.width, b.width)

    def both(x, y):
        out_x = np.zeros((len(use), K), x.dtype)
        out_x[:, :x.shape[1]] = x
        out_y = np.zeros((len(use), K), x.dtype)
        out_y[:, :y.shape[1]] = y
        return np.where(use[:, None], out_y, out_x)

    def ages(d):
        return (np.full(len(use), np.nan, np.float32) if d.age_A is None
                else np.asarray(d.age_A, np.float32))
    age = None if a.age_A is None and b.age_A is None else np.where(use, ages(b), ages(a))
    return DraftBatch(both(a.tokens_AxK, b.tokens_AxK),
                      both(a.probs_AxK, b.probs_AxK.astype(a.probs_AxK.dtype)),
                      both(a.support_AxK, b.support_AxK.astype(a.support_AxK.dtype)),
                      np.where(use, b.lens_A, a.lens_A).astype(np.int32),
                      np.where(use, b.has_support_A, a.has_support_A),
                      age, np.where(use, b.sources(), a.sources()).astype(np.int8))


def propose_batch(drafter, request_ids: np.ndarray, max_tokens_A: np.ndarray) -> DraftBatch:
    """Drafts for every row at once: `drafter.propose_batch` when the drafter has it, else one
    `propose` per row with max_tokens_A[b] > 0. K = max(max_tokens_A) (0 for no rows).

    Args:
      request_ids: int [A]; max_tokens_A: int [A] (>= 0).
    """
    fn = getattr(drafter, "propose_batch", None)
    if fn is not None:
        return fn(np.asarray(request_ids, np.int64), np.asarray(max_tokens_A, np.int32))
    K = int(np.max(max_tokens_A, initial=0))
    drafts = [drafter.propose(int(r), int(k)) if k > 0 else None
              for r, k in zip(request_ids, max_tokens_A)]
    return DraftBatch.from_drafts(drafts, K)


def append_batch(drafter, request_ids: np.ndarray, tokens_AxW: np.ndarray,
                 n_A: np.ndarray, index_later: bool = False) -> None:
    """Appends tokens_AxW[b, :n_A[b]] to request request_ids[b], for every row with n_A[b] > 0
    (`drafter.append_batch` when the drafter has it, else one `append` per such row).

    Args:
      request_ids: int [A]; tokens_AxW: int32 [A, W]; n_A: int [A], each <= W.
      index_later: a drafter with `flush_appends` may defer the expensive part of the append
        (`SuffixDrafter`: indexing into the trie) until `flush_appends(drafter)`; others
        append at once.
    """
    fn = getattr(drafter, "append_batch", None)
    if fn is not None:
        args = (np.asarray(request_ids, np.int64), np.asarray(tokens_AxW, np.int32),
                np.asarray(n_A, np.int32))
        if index_later and hasattr(drafter, "flush_appends"):
            fn(*args, index_later=True)
        else:
            fn(*args)
        return
    for r, toks, n in zip(request_ids, tokens_AxW, n_A):
        if n > 0:
            drafter.append(int(r), toks[:int(n)])


def flush_appends(drafter) -> None:
    """Completes the appends `append_batch(..., index_later=True)` deferred (a no-op for a
    drafter that defers nothing)."""
    fn = getattr(drafter, "flush_appends", None)
    if fn is not None:
        fn()


def set_policy_version(drafter, version: int) -> None:
    """Tells `drafter` that the requests it begins from now on are sampled by policy `version`
    (int >= 0, the updates their params had seen; `SuffixDrafter.set_policy_version`); a no-op
    for a drafter that does not track versions."""
    fn = getattr(drafter, "set_policy_version", None)
    if fn is not None:
        fn(int(version))


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter (see docs/design.md, "Drafter contract")."""

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """A rollout starts; the drafter keeps its context (prompt + tokens appended so far)."""

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        """Up to `max_tokens` (>= 0) draft tokens continuing the request's current context."""

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        """Tokens the target model emitted (verified) for this request, in order."""

    # Optional, for speed (`propose_batch` / `append_batch` below fall back to the per-row
    # calls): propose_batch(request_ids int64 [A], max_tokens_A int32 [A]) -> DraftBatch, and
    # append_batch(request_ids, tokens_AxW int32 [A, W], n_A int32 [A]), each equal to the
    # per-row calls in row order.

    def end(self, request_id: int) -> None:
        """The rollout finished; its tokens stay in the problem's current-epoch set."""

    def advance_epoch(self) -> None:
        """Epoch boundary: the current epoch becomes history; the window drops the oldest."""

    def state_dict(self) -> dict:
        """Plain data for checkpoints: dicts, lists, tuples, str/int/float/bool/None and numpy
        arrays (saved as JSON + npz; see das_jax.rl.checkpoint.encode_state)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


class RequestContext:
    """A growing int32 token buffer: a request's prompt followed by its verified tokens."""

    __slots__ = ("_buf", "_len")

    def __init__(self, tokens: Sequence[int] = ()):
        arr = np.asarray(tokens, dtype=np.int32).reshape(-1)
        self._buf = np.empty(max(64, 2 * arr.size), np.int32)
        self._buf[: arr.size] = arr
        self._len = arr.size

    def extend(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = self._len + arr.size
        if n > self._buf.size:
            buf = np.empty(max(2 * self._buf.size, n), np.int32)
            buf[: self._len] = self._buf[: self._len]
            self._buf = buf
        self._buf[self._len: n] = arr
        self._len = n

    @property
    def array(self) -> np.ndarray:
        """int32 [len], a view (do not keep across `extend`)."""
        return self._buf[: self._len]

    def __len__(self) -> int:
        return self._len
