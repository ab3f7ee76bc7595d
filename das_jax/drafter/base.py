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


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter (see docs/design.md, "Drafter contract")."""

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """A rollout starts; the drafter keeps its context (prompt + tokens appended so far)."""

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        """Up to `max_tokens` (>= 0) draft tokens continuing the request's current context."""

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        """Tokens the target model emitted (verified) for this request, in order."""

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
