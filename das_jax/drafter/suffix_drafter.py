"""Suffix-tree drafters behind the `Drafter` protocol.

- `SuffixDrafter` ("suffix", what DAS uses): one trie per problem over its recent rollouts
  (`ProblemHistory`), so a request drafts from earlier rollouts of the same problem and from
  its live siblings.
- `GlobalSuffixDrafter` ("suffix-global", the SuffixDecoding / vLLM `method="suffix"`
  baseline): one global trie over all problems' rollouts of the last `window` epochs, plus a
  per-request trie over the request's prompt and own output; the better-scoring draft wins.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import numpy as np

from .base import Draft, RequestContext
from .history import ProblemHistory
from .suffix_tree import SuffixForest, SuffixTreeConfig


@dataclasses.dataclass
class _Request:
    problem_id: Hashable
    handle: int
    context: RequestContext
    local_root: int = -1      # GlobalSuffixDrafter only
    local_sid: int = -1


class SuffixDrafter:
    """Per-problem suffix-trie drafter (DAS).

    Args:
      config: trie parameters.
      window: past epochs of rollouts kept per problem.
      prompt_tail: prompt tokens indexed in front of each rollout (default config.max_depth).
      max_problems: optional cap on problems kept (least recently visited dropped).

    Errors: `begin` with a request id already active raises ValueError; other calls with an
    unknown request id raise KeyError.
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(), window: int = 16,
                 prompt_tail: int | None = None, max_problems: int | None = None):
        self.history = ProblemHistory(config, window, prompt_tail, max_problems)
        self.config = self.history.config
        self._requests: dict[int, _Request] = {}

    # ------------------------------------------------------------------ protocol
    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already active")
        handle = self.history.start_rollout(problem_id, prompt_ids)
        self._requests[request_id] = _Request(problem_id, handle, RequestContext(prompt_ids))

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        req = self._requests[request_id]
        return self.history.propose(req.problem_id, req.context.array, max_tokens,
                                    req.handle).draft

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        req = self._requests[request_id]
        arr = np.asarray(token_ids, np.int32).reshape(-1)
        req.context.extend(arr)
        self.history.extend_rollout(req.handle, arr)

    def end(self, request_id: int) -> None:
        req = self._requests.pop(request_id)
        self.history.finish_rollout(req.handle)

    def advance_epoch(self) -> None:
        self.history.advance_epoch()

    def lengths(self, problem_id: Hashable) -> list[int]:
        """Output lengths of the problem's finished rollouts in the window (oldest first)."""
        return self.history.lengths(problem_id)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"kind": "suffix", "history": self.history.state_dict(),
                "requests": [[rid, r.problem_id, r.handle, r.context.array.copy()]
                             for rid, r in self._requests.items()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "suffix":
            raise ValueError(f"not a suffix drafter state: {state.get('kind')!r}")
        self.history.load_state_dict(state["history"])
        self.config = self.history.config
        self._requests = {rid: _Request(pid, h, RequestContext(ctx))
                          for rid, pid, h, ctx in state["requests"]}


_GLOBAL = "__global__"


class GlobalSuffixDrafter:
    """SuffixDecoding-style baseline: global trie (all problems) + per-request trie.

    Same arguments and errors as `SuffixDrafter`. The per-request trie indexes the full prompt
    and the request's output; the draft with the higher score (sum of path probabilities) wins,
    ties going to the longer match, then to the global trie.
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(), window: int = 16,
                 prompt_tail: int | None = None):
        self.forest = SuffixForest(config)
        self.config = config
        self.history = ProblemHistory(config, window, prompt_tail, forest=self.forest)
        self._requests: dict[int, _Request] = {}

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already active")
        handle = self.history.start_rollout(_GLOBAL, prompt_ids)
        root = self.forest.new_tree()
        sid = self.forest.new_seq(root)
        self.forest.append(sid, prompt_ids)
        self._requests[request_id] = _Request(problem_id, handle, RequestContext(prompt_ids),
                                              root, sid)

    def propose(self, request_id: int, max_tokens: int) -> Draft:
        req = self._requests[request_id]
        ctx = req.context.array
        g = self.history.propose(_GLOBAL, ctx, max_tokens, req.handle)
        loc = self.forest.propose(req.local_root, ctx, max_tokens, req.local_sid)
        if (loc.score, loc.match_len) > (g.score, g.match_len):
            return loc.draft
        return g.draft

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        req = self._requests[request_id]
        arr = np.asarray(token_ids, np.int32).reshape(-1)
        req.context.extend(arr)
        self.history.extend_rollout(req.handle, arr)
        self.forest.append(req.local_sid, arr)

    def end(self, request_id: int) -> None:
        req = self._requests.pop(request_id)
        self.history.finish_rollout(req.handle)
        self.forest.remove(req.local_sid)
        self.forest.drop_tree(req.local_root)

    def advance_epoch(self) -> None:
        self.history.advance_epoch()

    def lengths(self, problem_id: Hashable) -> list[int]:
        """Not tracked per problem by this baseline: always []."""
        return []

    def state_dict(self) -> dict:
        return {"kind": "suffix-global", "history": self.history.state_dict(),
                "requests": [[rid, r.problem_id, r.handle, r.context.array.copy(), r.local_root,
                              r.local_sid] for rid, r in self._requests.items()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "suffix-global":
            raise ValueError(f"not a suffix-global drafter state: {state.get('kind')!r}")
        self.history.load_state_dict(state["history"])     # restores the shared forest
        self._requests = {rid: _Request(pid, h, RequestContext(ctx), root, sid)
                          for rid, pid, h, ctx, root, sid in state["requests"]}
