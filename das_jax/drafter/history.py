"""Per-problem rollout history: one suffix trie per problem over a sliding window of epochs.

What is indexed per rollout: the last `prompt_tail` prompt tokens (default max_depth) followed by
the generated tokens. The prompt tail lets the first output tokens be drafted from how earlier
rollouts of the problem began, without storing the full prompt once per rollout.

Window: an epoch is one visit of the problem (all rollouts it got between two `advance_epoch`
calls). The trie holds the problem's last `window` visited epochs plus the rollouts of the
current epoch, live ones included (their verified tokens are indexed as they are generated, so
siblings of a GRPO group draft from each other within a step). A problem not visited in an
epoch keeps its history, so with a finite problem set memory is bounded by
problems x window x rollouts; `max_problems` additionally evicts the least recently visited
problems for unbounded problem streams.

Policy versions: every rollout is tagged with the version of the policy that sampled it
(`set_policy_version`; in an RL run, the number of updates the sampling params had seen, so a
synchronous run's step and an asynchronous run's step less its lag). The age of a problem's
history (`age`) is the current version less the mean version of the problem's indexed rollouts,
live ones included: how many updates ago, on average, the rollouts a draft is found in were
sampled. The DAS policy calibrates acceptance per age (`das_jax.speculation.acceptance`), so
drafts from an older policy are trusted less.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Hashable, Sequence

import numpy as np

from .base import Draft
from .suffix_tree import ScoredDraft, SuffixForest, SuffixTreeConfig


@dataclasses.dataclass
class _Rollout:
    sid: int              # sequence id in the forest, -1 once un-indexed
    prefix_len: int       # prompt-tail tokens indexed before the output
    out_len: int = 0      # generated tokens so far
    live: bool = True
    version: int = 0      # policy version that sampled it


@dataclasses.dataclass
class _Problem:
    root: int
    history: collections.deque          # of list[_Rollout], oldest first
    current: list
    last_epoch: int
    version_sum: int = 0        # sum of the versions of its indexed rollouts (sid >= 0)
    indexed: int = 0            # its indexed rollouts


class ProblemHistory:
    """Suffix tries of recent rollouts, one per problem id.

    Args:
      config: trie parameters (max_depth, draft rule).
      window: past epochs kept per problem (>= 0; 0 keeps only the current epoch).
      prompt_tail: prompt tokens indexed in front of each output (default config.max_depth).
      max_problems: keep at most this many problems (least recently visited dropped at
        `advance_epoch`); None = unbounded.
      forest: share an existing node pool (its config wins).
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(), window: int = 16,
                 prompt_tail: int | None = None, max_problems: int | None = None,
                 forest: SuffixForest | None = None):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.forest = forest if forest is not None else SuffixForest(config)
        self.config = self.forest.config
        self.window = window
        self.prompt_tail = self.config.max_depth if prompt_tail is None else prompt_tail
        self.max_problems = max_problems
        self.epoch = 0
        self.policy_version = 0
        self._problems: dict[Hashable, _Problem] = {}
        self._rollouts: dict[int, tuple[Hashable, _Rollout]] = {}   # live, by handle
        self._next_handle = 0

    # ------------------------------------------------------------------ rollouts
    def start_rollout(self, problem_id: Hashable, prompt_ids: Sequence[int]) -> int:
        """A rollout of `problem_id` begins; returns a handle for extend/finish."""
        prob = self._problems.get(problem_id)
        if prob is None:
            prob = _Problem(self.forest.new_tree(), collections.deque(), [], self.epoch)
            self._problems[problem_id] = prob
        prob.last_epoch = self.epoch
        prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
        tail = prompt[max(0, prompt.size - self.prompt_tail):] if self.prompt_tail else prompt[:0]
        sid = self.forest.new_seq(prob.root)
        self.forest.append(sid, tail)
        ro = _Rollout(sid, int(tail.size), version=self.policy_version)
        prob.current.append(ro)
        prob.version_sum += ro.version
        prob.indexed += 1
        handle = self._next_handle
        self._next_handle += 1
        self._rollouts[handle] = (problem_id, ro)
        return handle

    def extend_rollout(self, handle: int, token_ids: Sequence[int]) -> None:
        """Index verified tokens of a live rollout. KeyError for an unknown/finished handle."""
        _, ro = self._rollouts[handle]
        n = len(token_ids)
        ro.out_len += n
        if ro.sid >= 0 and n:
            self.forest.append(ro.sid, token_ids)

    def finish_rollout(self, handle: int) -> None:
        """The rollout ended; it stays indexed in its epoch. KeyError for an unknown handle."""
        _, ro = self._rollouts.pop(handle)
        ro.live = False
        if ro.sid >= 0:
            self.forest.freeze(ro.sid)

    # ------------------------------------------------------------------ epochs
    def advance_epoch(self) -> None:
        """Close the current epoch: visited problems push it into their window and slide it."""
        self.epoch += 1
        for pid in list(self._problems):
            prob = self._problems[pid]
            if prob.current:
                prob.history.append(prob.current)
                prob.current = []
                while len(prob.history) > self.window:
                    for ro in prob.history.popleft():
                        self._unindex(ro, prob)
            if not prob.history and not prob.current:
                self._drop(pid)
        if self.max_problems is not None and len(self._problems) > self.max_problems:
            order = sorted(self._problems, key=lambda p: self._problems[p].last_epoch)
            for pid in order[: len(self._problems) - self.max_problems]:
                self.evict(pid)

    def evict(self, problem_id: Hashable) -> None:
        """Un-indexes every rollout of the problem and drops its trie (KeyError if unknown);
        its live rollouts keep drafting, un-indexed, until they finish."""
        prob = self._problems[problem_id]
        for ep in list(prob.history) + [prob.current]:
            for ro in ep:
                self._unindex(ro, prob)
        self._drop(problem_id)

    def last_epoch(self, problem_id: Hashable) -> int:
        """The epoch the problem was last visited in (KeyError if unknown)."""
        return self._problems[problem_id].last_epoch

    def _unindex(self, ro: _Rollout, prob: _Problem):
        if ro.sid >= 0:
            self.forest.remove(ro.sid)     # a still-live rollout keeps drafting, unindexed
            ro.sid = -1
            prob.version_sum -= ro.version
            prob.indexed -= 1

    def _drop(self, pid):
        prob = self._problems.pop(pid)
        self.forest.drop_tree(prob.root)

    # ------------------------------------------------------------------ policy versions
    def set_policy_version(self, version: int) -> None:
        """Rollouts started from now on were sampled by policy `version` (int >= 0: the
        updates the sampling params had seen). ValueError for a negative version."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        self.policy_version = int(version)

    def mean_version(self, problem_id: Hashable) -> float:
        """Mean policy version of the problem's indexed rollouts (live ones included); NaN for
        an unknown problem or one with nothing indexed."""
        prob = self._problems.get(problem_id)
        if prob is None or prob.indexed <= 0:
            return float("nan")
        return prob.version_sum / prob.indexed

    def versions(self, problem_id: Hashable) -> list[int]:
        """Policy versions of the problem's indexed rollouts (window + current epoch, live ones
        included), oldest epoch first; [] for an unknown problem."""
        prob = self._problems.get(problem_id)
        if prob is None:
            return []
        return [ro.version for ep in list(prob.history) + [prob.current] for ro in ep
                if ro.sid >= 0]

    def age(self, problem_id: Hashable) -> float:
        """Age of the problem's history in policy versions: `policy_version` less
        `mean_version` (NaN when nothing is indexed)."""
        return self.policy_version - self.mean_version(problem_id)

    # ------------------------------------------------------------------ queries
    def propose(self, problem_id: Hashable, context: np.ndarray, max_tokens: int,
                handle: int | None = None) -> ScoredDraft:
        """Draft for `context` (int32 [n]) from `problem_id`'s trie (empty for unknown ids).

        `handle`: the live rollout whose context this is; its own trailing occurrences are not
        counted (KeyError if unknown).
        """
        prob = self._problems.get(problem_id)
        if prob is None:
            return ScoredDraft(Draft.empty(), 0, 0.0)
        own = -1 if handle is None else self._rollouts[handle][1].sid
        return self.forest.propose(prob.root, context, max_tokens, own)

    def root(self, problem_id: Hashable) -> int:
        """Root of the problem's trie in `forest`, -1 for an unknown problem."""
        prob = self._problems.get(problem_id)
        return -1 if prob is None else prob.root

    def rollout(self, handle: int) -> _Rollout:
        """The live rollout's record (sid: its forest sequence, -1 once un-indexed; out_len);
        KeyError for an unknown/finished handle. Callers that batch appends keep out_len
        themselves and write it back (`lengths` and `state_dict` read it)."""
        return self._rollouts[handle][1]

    def lengths(self, problem_id: Hashable) -> list[int]:
        """Output lengths (generated tokens) of the problem's finished rollouts in the window,
        oldest epoch first."""
        prob = self._problems.get(problem_id)
        if prob is None:
            return []
        return [ro.out_len for ep in list(prob.history) + [prob.current] for ro in ep
                if not ro.live]

    def problems(self) -> list:
        return list(self._problems)

    def num_rollouts(self, problem_id: Hashable) -> int:
        """Rollouts of the problem currently indexed (window + current epoch)."""
        prob = self._problems.get(problem_id)
        if prob is None:
            return 0
        return sum(ro.sid >= 0 for ep in list(prob.history) + [prob.current] for ro in ep)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        def ro_state(ro):
            return [ro.sid, ro.prefix_len, ro.out_len, ro.live, ro.version]
        live = {id(ro): h for h, (_, ro) in self._rollouts.items()}
        kept = {id(ro) for p in self._problems.values()
                for ep in list(p.history) + [p.current] for ro in ep}
        return {
            # live rollouts no epoch keeps any more (the window slid past them, or their
            # problem was dropped): they keep drafting, un-indexed, until they finish
            "detached": [[h, pid] + ro_state(ro) for h, (pid, ro) in self._rollouts.items()
                         if id(ro) not in kept],
            "forest": self.forest.state_dict(), "window": self.window,
            "prompt_tail": self.prompt_tail, "max_problems": self.max_problems,
            "epoch": self.epoch, "next_handle": self._next_handle,
            "policy_version": self.policy_version,
            "problems": [
                [pid, p.root, p.last_epoch,
                 [[ro_state(ro) + [live.get(id(ro), -1)] for ro in ep]
                  for ep in list(p.history) + [p.current]]]
                for pid, p in self._problems.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.forest.load_state_dict(state["forest"])
        self.window, self.prompt_tail = state["window"], state["prompt_tail"]
        self.max_problems, self.epoch = state["max_problems"], state["epoch"]
        self._next_handle = state["next_handle"]
        # states written before versions were tagged: every rollout version 0
        self.policy_version = int(state.get("policy_version", 0))
        self._problems, self._rollouts = {}, {}
        for pid, root, last_epoch, epochs in state["problems"]:
            eps = []
            for ep in epochs:
                rows = []
                for sid, prefix_len, out_len, live, *rest in ep:
                    version, handle = (rest[0], rest[1]) if len(rest) == 2 else (0, rest[0])
                    ro = _Rollout(sid, prefix_len, out_len, live, int(version))
                    rows.append(ro)
                    if handle >= 0:
                        self._rollouts[handle] = (pid, ro)
                eps.append(rows)
            prob = _Problem(root, collections.deque(eps[:-1]), eps[-1], last_epoch)
            for ro in (ro for ep in eps for ro in ep if ro.sid >= 0):
                prob.version_sum += ro.version
                prob.indexed += 1
            self._problems[pid] = prob
        for handle, pid, sid, prefix_len, out_len, live, *version in state.get("detached", []):
            self._rollouts[handle] = (pid, _Rollout(sid, prefix_len, out_len, live,
                                                    int(version[0]) if version else 0))


class ShardedHistory:
    """`ProblemHistory`'s interface over `shards` histories, each with its own forest (node
    pool and hash table): a problem lives in one shard (round-robin in order of first visit),
    so appends to different shards' tries touch disjoint arrays and may run on several threads
    at once (`SuffixDrafter` with `threads` > 1). A problem's trie is built from the same
    rollouts in the same order as in one history, so its drafts are the same.

    Handles: a shard's handle h is `h * shards + shard`. `max_problems` caps the problems of
    all shards together, evicting as one history would (least recently visited first, ties in
    order of first visit).

    Args:
      config, window, prompt_tail, max_problems: as `ProblemHistory`.
      shards: number of shards (>= 1).
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(), window: int = 16,
                 prompt_tail: int | None = None, max_problems: int | None = None,
                 shards: int = 2):
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shards = [ProblemHistory(config, window, prompt_tail) for _ in range(shards)]
        self.config = self.shards[0].config
        self.max_problems = max_problems
        self._shard_of: dict[Hashable, int] = {}
        self._next = 0

    # ------------------------------------------------------------------ routing
    def shard_of(self, problem_id: Hashable) -> int:
        """The problem's shard (assigned on its first visit: round-robin)."""
        k = self._shard_of.get(problem_id)
        if k is None:
            k = self._shard_of[problem_id] = self._next % len(self.shards)
            self._next += 1
        return k

    def _of_handle(self, handle: int) -> tuple[ProblemHistory, int]:
        n = len(self.shards)
        return self.shards[handle % n], handle // n

    @property
    def window(self) -> int:
        return self.shards[0].window

    @property
    def prompt_tail(self) -> int:
        return self.shards[0].prompt_tail

    @property
    def epoch(self) -> int:
        return self.shards[0].epoch

    @property
    def policy_version(self) -> int:
        return self.shards[0].policy_version

    # ------------------------------------------------------------------ rollouts
    def start_rollout(self, problem_id: Hashable, prompt_ids: Sequence[int]) -> int:
        """As `ProblemHistory.start_rollout`, in the problem's shard."""
        k = self.shard_of(problem_id)
        return self.shards[k].start_rollout(problem_id, prompt_ids) * len(self.shards) + k

    def extend_rollout(self, handle: int, token_ids: Sequence[int]) -> None:
        h, local = self._of_handle(handle)
        h.extend_rollout(local, token_ids)

    def finish_rollout(self, handle: int) -> None:
        h, local = self._of_handle(handle)
        h.finish_rollout(local)

    def rollout(self, handle: int) -> _Rollout:
        h, local = self._of_handle(handle)
        return h.rollout(local)

    def problem_shard(self, problem_id: Hashable) -> int:
        """The shard holding the problem's trie (0 for an unknown problem)."""
        return self._shard_of.get(problem_id, 0)

    # ------------------------------------------------------------------ epochs and versions
    def advance_epoch(self) -> None:
        for h in self.shards:
            h.advance_epoch()
        live = {p for h in self.shards for p in h.problems()}
        # problems in order of first visit (as one history's dict keeps them)
        self._shard_of = {p: k for p, k in self._shard_of.items() if p in live}
        if self.max_problems is not None and len(self._shard_of) > self.max_problems:
            order = sorted(self._shard_of,
                           key=lambda p: self.shards[self._shard_of[p]].last_epoch(p))
            for pid in order[: len(self._shard_of) - self.max_problems]:
                self.shards[self._shard_of.pop(pid)].evict(pid)

    def set_policy_version(self, version: int) -> None:
        for h in self.shards:
            h.set_policy_version(version)

    def _get(self, problem_id: Hashable) -> ProblemHistory | None:
        k = self._shard_of.get(problem_id)
        return None if k is None else self.shards[k]

    def mean_version(self, problem_id: Hashable) -> float:
        h = self._get(problem_id)
        return float("nan") if h is None else h.mean_version(problem_id)

    def versions(self, problem_id: Hashable) -> list[int]:
        h = self._get(problem_id)
        return [] if h is None else h.versions(problem_id)

    def age(self, problem_id: Hashable) -> float:
        return self.policy_version - self.mean_version(problem_id)

    # ------------------------------------------------------------------ queries
    def forest_of(self, problem_id: Hashable) -> SuffixForest | None:
        """The forest holding the problem's trie (None for an unknown problem)."""
        h = self._get(problem_id)
        return None if h is None else h.forest

    def propose(self, problem_id: Hashable, context: np.ndarray, max_tokens: int,
                handle: int | None = None) -> ScoredDraft:
        h = self._get(problem_id)
        if h is None:
            return ScoredDraft(Draft.empty(), 0, 0.0)
        return h.propose(problem_id, context, max_tokens,
                         None if handle is None else self._of_handle(handle)[1])

    def root(self, problem_id: Hashable) -> int:
        """Root of the problem's trie in its shard's forest, -1 for an unknown problem."""
        h = self._get(problem_id)
        return -1 if h is None else h.root(problem_id)

    def lengths(self, problem_id: Hashable) -> list[int]:
        h = self._get(problem_id)
        return [] if h is None else h.lengths(problem_id)

    def problems(self) -> list:
        return [p for h in self.shards for p in h.problems()]

    def num_rollouts(self, problem_id: Hashable) -> int:
        h = self._get(problem_id)
        return 0 if h is None else h.num_rollouts(problem_id)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"shards": [h.state_dict() for h in self.shards],
                "shard_of": [[p, k] for p, k in self._shard_of.items()], "next": self._next,
                "max_problems": self.max_problems}

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()` output (its shard count wins)."""
        cfg, n = self.config, len(state["shards"])
        w = state["shards"][0]["window"]
        self.shards = [ProblemHistory(cfg, w) for _ in range(n)]
        for h, s in zip(self.shards, state["shards"]):
            h.load_state_dict(s)
        self._shard_of = {p: k for p, k in state["shard_of"]}
        self._next = state["next"]
        self.max_problems = state["max_problems"]
