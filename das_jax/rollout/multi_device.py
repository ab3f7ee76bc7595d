"""Placement of rollouts over data-parallel replicas: LPT assignment of whole GRPO groups, the
shared locked drafter, and per-replica stats. The replicas themselves (engines on device meshes,
params resharded on device, one host thread per replica) are `das_jax.rollout.sharded`.

Placement. A synchronous rollout step ends when its slowest replica ends, so work is assigned by
longest-processing-time-first (`assign_lpt`) on predicted lengths (the problem's history:
`Rollout.predicted_lengths`, or lengths the caller passes): long requests are interleaved across
replicas instead of piling up on one, as a naive contiguous split (`assign_contiguous`) does when
a hard problem's whole group sits next to each other in the batch. `assign_groups_lpt` does it
for whole groups (all requests of one problem: GRPO's `num_generations` samples), so a group
never spans replicas and its siblings feed one drafter history in one order.

Drafter. All replicas share one drafter behind one lock (`LockedDrafter`); each replica's view
maps its local request ids to indices into the full request list. One shared history (rather
than one drafter per replica) because LPT moves a problem between replicas from step to step,
and the problem's history (drafts and predicted lengths) must follow it; since a group stays on
one replica within a step, the per-problem trees see the same appends in the same order as on
one device, so drafts stay deterministic.

Exactness. A request's seed derives from (run seed, problem id, sample index) only
(`sampling.request_seed`), never from its replica, slot or batch position, so placement cannot
change a token (up to float rounding of the logits across batch shapes; see docs/design.md).

The benchmark of LPT against contiguous placement is `das_jax.bench.multi_device_bench`.
"""
from __future__ import annotations

import dataclasses
import heapq
import threading
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from das_jax.drafter.base import append_batch, flush_appends, propose_batch, set_policy_version
from das_jax.engine import GenerateError, GenerateStats

__all__ = [
    "LockedDrafter", "DataParallelStats", "assign_lpt", "assign_contiguous", "assignment_loads",
    "group_indices", "assign_groups", "check_partition",
]


# ---------------------------------------------------------------------------------- assignment
def _fill_unknown(predicted_lengths: Sequence[float], default_length: float) -> np.ndarray:
    w = np.asarray(predicted_lengths, np.float64).reshape(-1)
    known = w >= 0
    fill = float(w[known].mean()) if known.any() else float(default_length)
    return np.where(known, w, fill)


def assign_lpt(predicted_lengths: Sequence[float], num_devices: int,
               default_length: float = 1.0) -> list[list[int]]:
    """Longest-processing-time-first: requests sorted by predicted length (descending, ties by
    index), each put on the device with the least predicted work so far (ties: fewer requests,
    then lower device index).

    A negative length (-1) means unknown and counts as the mean of the known ones, or
    `default_length` when none is known (then LPT is a round-robin, balancing counts).
    Returns per-device lists of request indices, each in admission order (longest first).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    w = _fill_unknown(predicted_lengths, default_length)
    order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    heap = [(0.0, 0, d) for d in range(num_devices)]
    out: list[list[int]] = [[] for _ in range(num_devices)]
    for i in order:
        load, count, d = heapq.heappop(heap)
        out[d].append(i)
        heapq.heappush(heap, (load + float(w[i]), count + 1, d))
    return out


def assign_contiguous(n: int, num_devices: int) -> list[list[int]]:
    """The naive split: contiguous chunks of the request list, sizes differing by at most one
    (the first `n % num_devices` devices get one more)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    base, extra = divmod(n, num_devices)
    out, start = [], 0
    for d in range(num_devices):
        size = base + (d < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def assignment_loads(assignment: Sequence[Sequence[int]], predicted_lengths: Sequence[float],
                     default_length: float = 1.0) -> list[float]:
    """Predicted work (sum of predicted lengths, unknown = mean of known) per device; the
    predicted makespan is the max."""
    w = _fill_unknown(predicted_lengths, default_length)
    return [float(sum(w[i] for i in dev)) for dev in assignment]


def group_indices(problem_ids: Sequence[Hashable]) -> list[list[int]]:
    """Request indices grouped by problem id, groups in order of first appearance, members in
    request order (a GRPO group: the `num_generations` samples of one problem)."""
    groups: dict[Hashable, list[int]] = {}
    for i, pid in enumerate(problem_ids):
        groups.setdefault(pid, []).append(i)
    return list(groups.values())


def assign_groups(problem_ids: Sequence[Hashable], predicted_lengths: Sequence[float],
                  num_replicas: int, how: str = "lpt",
                  default_length: float = 1.0) -> list[list[int]]:
    """Whole groups (`group_indices`) placed on replicas: "lpt" on each group's predicted work
    (the sum of its requests' predicted lengths, unknown = mean of the known ones), or
    "contiguous" (groups in order, counts differing by at most one). Returns per-replica lists
    of request indices: groups in placement order (longest first under LPT), members in request
    order. With one request per problem this is `assign_lpt` / `assign_contiguous` itself.

    Raises:
      ValueError: num_replicas < 1, or an unknown `how`.
    """
    groups = group_indices(problem_ids)
    w = _fill_unknown(predicted_lengths, default_length) if len(problem_ids) else np.zeros(0)
    if how == "lpt":
        placed = assign_lpt([float(sum(w[i] for i in g)) for g in groups], num_replicas,
                            default_length)
    elif how == "contiguous":
        placed = assign_contiguous(len(groups), num_replicas)
    else:
        raise ValueError(f"unknown assignment {how!r}; valid: lpt, contiguous")
    return [[i for gi in rep for i in groups[gi]] for rep in placed]


def check_partition(assignment: Sequence[Sequence[int]], n: int, num_replicas: int) -> None:
    """Raises GenerateError unless `assignment` has `num_replicas` lists placing every index in
    [0, n) exactly once."""
    if len(assignment) != num_replicas:
        raise GenerateError(f"assignment has {len(assignment)} replicas, expected {num_replicas}")
    flat = sorted(int(i) for dev in assignment for i in dev)
    if flat != list(range(n)):
        raise GenerateError("assignment must place every request index exactly once")


# ---------------------------------------------------------------------------------- drafter
class LockedDrafter:
    """A thread-safe view of a drafter shared by several devices (the Drafter protocol).

    Every call takes one re-entrant lock shared by all views of the same drafter. `view(ids)`
    gives a view whose request ids are local indices `k` mapped to `ids[k]`: each device's engine
    numbers its requests 0..n_d-1, and the view maps them back to indices into the full request
    list, so request ids never collide across devices and mean the same as on one device.
    `lengths(problem_id)` is passed through (under the lock) when the drafter has it.
    `propose_batch` / `append_batch` map all ids in one gather and take the lock once (the
    drafter's own batch calls when it has them, else its per-row calls).
    """

    def __init__(self, drafter: Any, lock: threading.RLock | None = None,
                 request_ids: Sequence[int] | None = None):
        if isinstance(drafter, LockedDrafter):
            lock = lock or drafter.lock
            if drafter._ids is not None:
                request_ids = (list(drafter._ids) if request_ids is None
                               else [drafter._ids[i] for i in request_ids])
            drafter = drafter.drafter
        self.drafter = drafter
        self.lock = lock or threading.RLock()
        self._ids = None if request_ids is None else [int(i) for i in request_ids]
        self._ids_A = None          # self._ids as int64 [n], made on first batch call

    def view(self, request_ids: Sequence[int]) -> "LockedDrafter":
        """A view (same drafter, same lock) whose request id k means `request_ids[k]`."""
        return LockedDrafter(self, request_ids=request_ids)

    def _id(self, request_id: int) -> int:
        return int(request_id) if self._ids is None else self._ids[request_id]

    def _ids_of(self, request_ids) -> np.ndarray:
        """int64 [A] global ids of view-local request_ids [A]."""
        ids = np.asarray(request_ids, np.int64).reshape(-1)
        if self._ids is None:
            return ids
        if self._ids_A is None:
            self._ids_A = np.asarray(self._ids, np.int64)
        return self._ids_A[ids]

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        with self.lock:
            self.drafter.begin(self._id(request_id), problem_id, prompt_ids)

    def propose(self, request_id: int, max_tokens: int):
        with self.lock:
            return self.drafter.propose(self._id(request_id), max_tokens)

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        with self.lock:
            self.drafter.append(self._id(request_id), token_ids)

    def propose_batch(self, request_ids, max_tokens_A):
        """`drafter.propose_batch` (or its per-row fallback) on the mapped ids, one lock;
        returns a `DraftBatch`."""
        ids = self._ids_of(request_ids)
        with self.lock:
            return propose_batch(self.drafter, ids, max_tokens_A)

    def append_batch(self, request_ids, tokens_AxW, n_A, index_later: bool = False) -> None:
        """`drafter.append_batch` (or its per-row fallback) on the mapped ids, one lock."""
        ids = self._ids_of(request_ids)
        with self.lock:
            append_batch(self.drafter, ids, tokens_AxW, n_A, index_later)

    def flush_appends(self) -> None:
        """`drafter.flush_appends` (every replica's deferred appends), one lock."""
        with self.lock:
            flush_appends(self.drafter)

    def end(self, request_id: int) -> None:
        with self.lock:
            self.drafter.end(self._id(request_id))

    def advance_epoch(self) -> None:
        with self.lock:
            self.drafter.advance_epoch()

    def set_policy_version(self, version: int) -> None:
        """`drafter.set_policy_version` under the lock (a no-op for a drafter without it)."""
        with self.lock:
            set_policy_version(self.drafter, version)

    def state_dict(self) -> dict:
        with self.lock:
            return self.drafter.state_dict()

    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            self.drafter.load_state_dict(state)

    @property
    def lengths(self) -> Callable[[Hashable], list[int]]:
        """`drafter.lengths` under the lock (AttributeError when the drafter has none)."""
        inner = self.drafter.lengths

        def lengths(problem_id: Hashable) -> list[int]:
            with self.lock:
                return list(inner(problem_id))
        return lengths


# ---------------------------------------------------------------------------------- stats
@dataclasses.dataclass
class DataParallelStats(GenerateStats):
    """What one data-parallel `generate` did: the counters of `GenerateStats` summed over
    replicas (`wall_s` = the makespan: max replica wall time, compile excluded; `compile_s` =
    max over replicas; `steps` = every replica's steps), plus per replica:

    devices: each replica's device names; assignment: request indices per replica (admission
    order); predicted_work: predicted tokens per replica (sum of predicted lengths);
    per_device: each replica's `GenerateStats` (None for a replica that got no request);
    call_wall_s: wall time of the whole call (resharding, threads, compiles and all).
    """

    devices: list[list[str]] = dataclasses.field(default_factory=list)
    assignment: list[list[int]] = dataclasses.field(default_factory=list)
    predicted_work: list[float] = dataclasses.field(default_factory=list)
    per_device: list[GenerateStats | None] = dataclasses.field(default_factory=list)
    call_wall_s: float = 0.0

    @classmethod
    def combine(cls, per_device: Sequence[GenerateStats | None], **fields) -> "DataParallelStats":
        out = cls(per_device=list(per_device), **fields)
        stats = [s for s in per_device if s is not None]
        for f in ("forward_passes", "generated_tokens", "drafted_tokens",
                  "accepted_draft_tokens", "prefill_s", "decode_s", "draft_s", "policy_s",
                  "host_s", "overlap_s", "draft_model_s", "prefill_tokens", "prefill_calls"):
            setattr(out, f, sum(getattr(s, f) for s in stats))
        out.wall_s = max((s.wall_s for s in stats), default=0.0)
        out.compile_s = max((s.compile_s for s in stats), default=0.0)
        out.steps = [r for s in stats for r in s.steps]
        for s in stats:
            out.merge_acceptance(s)
        return out

    def _per(self, attr: str) -> list:
        return [getattr(s, attr) if s is not None else 0 for s in self.per_device]

    @property
    def device_wall_s(self) -> list[float]:
        return self._per("wall_s")

    @property
    def device_forward_passes(self) -> list[int]:
        return self._per("forward_passes")

    @property
    def device_tokens(self) -> list[int]:
        return self._per("generated_tokens")

    @property
    def makespan_s(self) -> float:
        """Max over replicas of the measured wall time (compile excluded)."""
        return max(self.device_wall_s, default=0.0)

    @property
    def makespan_forward_passes(self) -> int:
        """Max over replicas of forward passes (hardware-independent makespan)."""
        return max(self.device_forward_passes, default=0)

    @property
    def makespan_tokens(self) -> int:
        """Max over replicas of generated tokens (the work LPT balances)."""
        return max(self.device_tokens, default=0)

    @property
    def predicted_makespan(self) -> float:
        return max(self.predicted_work, default=0.0)

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = GenerateStats.to_dict(self, with_steps)
        for k in ("devices", "assignment", "predicted_work", "per_device"):
            d.pop(k, None)
        d.update({
            "devices": self.devices, "assignment": self.assignment,
            "predicted_work": self.predicted_work, "predicted_makespan": self.predicted_makespan,
            "device_wall_s": self.device_wall_s,
            "device_forward_passes": self.device_forward_passes,
            "device_tokens": self.device_tokens, "makespan_s": self.makespan_s,
            "makespan_forward_passes": self.makespan_forward_passes,
            "makespan_tokens": self.makespan_tokens,
        })
        return d
