"""What `generate` returns: a `RequestOutput` per request and the call's `GenerateStats`
(re-exported by `scheduler`, which fills them)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from das_jax.drafter.base import DRAFT_SOURCES, OTHER_SOURCE
from das_jax.engine.policy import StepRecord, acceptance_length


@dataclasses.dataclass
class RequestOutput:
    """token_ids / logprobs: generated tokens and their log-probs under the policy (the
    temperature-scaled full softmax, also with top-k / top-p on; see `sampling.sample`);
    finish_reason: "stop" (a stop token, included) or "length" (max_new_tokens).
    request: the `Request` (a `TraceRollout` in the replay, which keeps no tokens)."""

    request: Any
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    forward_passes: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclasses.dataclass
class GenerateStats:
    """Counters and timers of one `generate` call (seconds of wall time; compile time excluded
    from the phase timers and reported as `compile_s`). accepted_draft_tokens counts accepted
    draft tokens that were committed (not those past a stop token or max_new_tokens);
    prefill_tokens: token slots the prefill calls computed (padding included), over
    prefill_calls admissions. In the replay, decode_s is the cost model's prediction.
    host_s: the host work between the executor's calls (scheduler bookkeeping, drafter and
    policy; draft_s and policy_s are part of it): `run_schedule`'s wall time less the wall
    time of its executor calls (the device steps, or the replay's recorded ones).
    draft_model_s: a draft model's device calls outside the steps (a draft head committing
    admitted rows' prefilled positions, `head_admit`); its drafting after each prefill and
    verify step runs inside those steps' seconds.
    preemptions: rows taken off the device when the paged KV cache ran short of pages (each
    resumed later by a prefill of its prompt and tokens, `StepExecutor.make_room`).
    overlap_s: host work run while the device computed a step (the drafter's deferred
    appends, the acceptance counts and the policy's calibration update,
    `EngineConfig.overlap_host`): inside the executor's calls, so not in host_s.
    exposed_overlap_s: the part of it the device waited for (the replay: each step's overlap
    beyond its predicted time; the engine's step seconds include it).
    drafted_by_position / accepted_by_position: per draft position i (0-based), the rows whose
    verified draft had more than i tokens / of which more than i were accepted (committed);
    their ratio is the acceptance rate at position i, their sums drafted_tokens /
    accepted_draft_tokens. drafted_by_source / accepted_by_source: draft tokens verified /
    accepted per source (`das_jax.drafter.DRAFT_SOURCES`: the suffix drafter's problem,
    request and global tries; "other" for drafters that do not say)."""

    forward_passes: int = 0
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    policy_s: float = 0.0
    host_s: float = 0.0
    wall_s: float = 0.0
    compile_s: float = 0.0
    draft_model_s: float = 0.0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    preemptions: int = 0
    overlap_s: float = 0.0
    exposed_overlap_s: float = 0.0
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    drafted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    accepted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    def count_acceptance(self, n_draft_A: np.ndarray, accepted_A: np.ndarray,
                         source_A: np.ndarray | None = None) -> None:
        """Adds one verify step's rows to the per-position and per-source counts.

        Args:
          n_draft_A: int [A] draft tokens each row verified; accepted_A: int [A] of them
            accepted and committed (<= n_draft_A); source_A: int8 [A] or None, each row's
            draft source (`DraftBatch.source_A`; -1 or None: "other").
        """
        n = np.asarray(n_draft_A, np.int64)
        K = int(n.max(initial=0))
        if K == 0:
            return
        a = np.minimum(np.asarray(accepted_A, np.int64), n)
        add_counts(self.drafted_by_position, np.cumsum(np.bincount(n, minlength=K + 1)[::-1])
                   [::-1][1:])
        add_counts(self.accepted_by_position, np.cumsum(np.bincount(a, minlength=K + 1)[::-1])
                   [::-1][1:])
        src = (np.full(n.shape, OTHER_SOURCE, np.int64) if source_A is None
               else np.where(np.asarray(source_A) < 0, OTHER_SOURCE, source_A).astype(np.int64))
        d_S = np.bincount(src, weights=n, minlength=len(DRAFT_SOURCES))
        a_S = np.bincount(src, weights=a, minlength=len(DRAFT_SOURCES))
        for i in np.flatnonzero(d_S):
            name = DRAFT_SOURCES[i]
            self.drafted_by_source[name] = self.drafted_by_source.get(name, 0) + int(d_S[i])
            self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + int(a_S[i])

    def merge_acceptance(self, other: "GenerateStats") -> None:
        """Adds `other`'s per-position and per-source counts to this one's."""
        add_counts(self.drafted_by_position, other.drafted_by_position)
        add_counts(self.accepted_by_position, other.accepted_by_position)
        for mine, theirs in ((self.drafted_by_source, other.drafted_by_source),
                             (self.accepted_by_source, other.accepted_by_source)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + int(v)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step per row (1.0 without speculation)."""
        return acceptance_length(self.steps)

    def acceptance_by_position(self) -> list[float]:
        """Acceptance rate at each draft position (accepted / drafted rows; [] without
        drafts)."""
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def acceptance_by_source(self) -> dict[str, float]:
        """Accepted / drafted tokens per draft source that drafted."""
        return {k: self.accepted_by_source.get(k, 0) / d
                for k, d in self.drafted_by_source.items() if d}

    @property
    def split_steps(self) -> int:
        """Verify steps that ran the split query block (`StepRecord.wide_rows` > 0: a `[B, 1]`
        and an `[R, W]` attention block, `EngineConfig.wide_row_buckets`)."""
        return sum(1 for s in self.steps if getattr(s, "wide_rows", 0))

    @property
    def tree_steps(self) -> int:
        """Verify steps that verified second drafts (a two-branch token tree:
        `StepRecord.branch_rows` > 0)."""
        return sum(1 for s in self.steps if getattr(s, "branch_rows", 0))

    @property
    def second_branch_wins(self) -> int:
        """Rows of tree steps that emitted their second draft's tokens
        (`StepRecord.won_per_row`)."""
        return sum(sum(getattr(s, "won_per_row", None) or ()) for s in self.steps)

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "steps"}
        d["acceptance_length"] = self.acceptance_length
        d["split_steps"] = self.split_steps
        d["tree_steps"] = self.tree_steps
        d["second_branch_wins"] = self.second_branch_wins
        if with_steps:
            d["steps"] = [dataclasses.asdict(s) for s in self.steps]
        return d


def add_counts(into: list[int], counts) -> None:
    """into[i] += counts[i] for every i, growing `into` with zeros as needed (in place)."""
    counts = [int(c) for c in counts]
    if len(into) < len(counts):
        into.extend([0] * (len(counts) - len(into)))
    for i, c in enumerate(counts):
        into[i] += c
