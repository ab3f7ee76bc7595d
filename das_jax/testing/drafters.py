"""Two drafters that test the engine's verification: an oracle and an adversary.

* `OracleDrafter` proposes the true future of each request, taken from a previous run with the
  same requests and seeds: every draft token is accepted, so forward passes drop to about
  `tokens / W` while the output is unchanged.
* `AdversaryDrafter` proposes random tokens (claiming high confidence): nearly every draft is
  rejected, and the output must still be unchanged.
Both implement the `das_jax.drafter.Drafter` protocol (they live in `das_jax.testing`: tools for
tests, not drafters to run).
"""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import numpy as np

from das_jax.drafter.base import Draft


class OracleDrafter:
    """Proposes `futures[request_id][n : n + k]`, n = tokens generated so far, with probability 1.

    Args:
      futures: request index -> the token ids that request generated in a previous run.
    """

    def __init__(self, futures: Mapping[int, Sequence[int]]):
        self.futures = {int(k): np.asarray(v, np.int32) for k, v in futures.items()}
        self._generated: dict[int, int] = {}

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        self._generated[request_id] = 0

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        n = self._generated[request_id]
        toks = self.futures.get(request_id, np.zeros(0, np.int32))[n:n + max_tokens]
        return Draft(toks.astype(np.int32), np.ones(len(toks), np.float32))

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        self._generated[request_id] += len(token_ids)

    def end(self, request_id: int) -> None:
        self._generated.pop(request_id, None)

    def advance_epoch(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"futures": {k: v.tolist() for k, v in self.futures.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.futures = {int(k): np.asarray(v, np.int32) for k, v in state["futures"].items()}


class AdversaryDrafter:
    """Proposes `max_tokens` uniformly random token ids (seeded), claiming probability 0.9 each."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def begin(self, request_id, problem_id, prompt_ids) -> None:
        pass

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        toks = self.rng.integers(0, self.vocab_size, size=max_tokens).astype(np.int32)
        return Draft(toks, np.full(max_tokens, 0.9, np.float32) ** np.arange(1, max_tokens + 1))

    def append(self, request_id, token_ids) -> None:
        pass

    def end(self, request_id) -> None:
        pass

    def advance_epoch(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
