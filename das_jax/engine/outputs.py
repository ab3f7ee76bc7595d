"""What `generate` returns: a `RequestOutput` per request and the call's `GenerateStats`
(re-exported by `scheduler`, which fills them)."""
from __future__ import annotations

import dataclasses
from typing import Any

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
    preemptions: rows taken off the device when the paged KV cache ran short of pages (each
    resumed later by a prefill of its prompt and tokens, `StepExecutor.make_room`).
    overlap_s: host work run while the device computed a step (the drafter's deferred
    appends, `EngineConfig.overlap_host`): inside the executor's calls, so not in host_s.
    exposed_overlap_s: the part of it the device waited for (the replay: each step's overlap
    beyond its predicted time; the engine's step seconds include it)."""

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
    prefill_tokens: int = 0
    prefill_calls: int = 0
    preemptions: int = 0
    overlap_s: float = 0.0
    exposed_overlap_s: float = 0.0
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step per row (1.0 without speculation)."""
        return acceptance_length(self.steps)

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "steps"}
        d["acceptance_length"] = self.acceptance_length
        if with_steps:
            d["steps"] = [dataclasses.asdict(s) for s in self.steps]
        return d
