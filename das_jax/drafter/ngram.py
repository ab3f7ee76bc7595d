"""N-gram prompt-lookup drafter (the vLLM `ngram` baseline) over a request's own context."""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import numpy as np

from . import _kernels as K
from .base import Draft, RequestContext


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """prompt_lookup_max/min: n-gram sizes tried, longest first. decay: probs[i] = decay**(i+1),
    a fixed heuristic (prompt lookup has no counts to estimate acceptance from)."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    decay: float = 0.8

    def __post_init__(self):
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class NgramDrafter:
    """For n = prompt_lookup_max..prompt_lookup_min, find the most recent earlier occurrence of
    the context's last n tokens and propose the tokens that followed it (up to max_tokens).

    Errors: `begin` with an active request id raises ValueError; unknown ids raise KeyError.
    """

    def __init__(self, config: NgramConfig = NgramConfig()):
        self.config = config
        self._contexts: dict[int, RequestContext] = {}

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if request_id in self._contexts:
            raise ValueError(f"request {request_id} already active")
        self._contexts[request_id] = RequestContext(prompt_ids)

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        ctx = self._contexts[request_id].array
        if max_tokens <= 0:
            return Draft.empty()
        cfg = self.config
        start, n = K.ngram_lookup(ctx, cfg.prompt_lookup_min, cfg.prompt_lookup_max, max_tokens)
        if n == 0:
            return Draft.empty()
        probs = (cfg.decay ** np.arange(1, n + 1)).astype(np.float32)
        return Draft(ctx[start: start + n].copy(), probs)

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        self._contexts[request_id].extend(token_ids)

    def end(self, request_id: int) -> None:
        del self._contexts[request_id]

    def advance_epoch(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": "ngram", "contexts": [[rid, c.array.copy()]
                                              for rid, c in self._contexts.items()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "ngram":
            raise ValueError(f"not an ngram drafter state: {state.get('kind')!r}")
        self._contexts = {rid: RequestContext(ctx) for rid, ctx in state["contexts"]}
