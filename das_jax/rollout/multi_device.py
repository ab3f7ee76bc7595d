"""Data-parallel rollouts over several JAX devices, with length-aware (LPT) request placement.

One `Rollout` fork per device (`Rollout.forks`: an engine there with the params replicated by
`jax.device_put`, its own speculation policy), each device's host loop in its own Python thread
(JAX releases the GIL while XLA runs, so the devices overlap), and one drafter shared by all
devices behind a lock (`LockedDrafter`: siblings of a problem placed on other devices still feed
the same per-problem history).

Placement. A synchronous rollout step ends when its slowest device ends, so requests are assigned
by longest-processing-time-first (`assign_lpt`) on their predicted length (the problem's history:
`Rollout.predicted_lengths`, or lengths the caller passes): long requests are interleaved across
devices instead of piling up on one, as a naive contiguous split (`assign_contiguous`) does when a
hard problem's whole group sits next to each other in the batch.

Exactness. A request's seed derives from (run seed, problem id, sample index) only
(`sampling.request_seed`), never from its device, slot or batch position, so placement cannot
change a token (up to float rounding of the logits across batch shapes; see docs/design.md).

    forks = Rollout.from_config(config, model_config, params, eos_ids).forks()  # one per device
    outputs, stats = generate_data_parallel(forks, requests, params)
    stats.makespan_s, stats.makespan_forward_passes

The benchmark of LPT against contiguous placement is `das_jax.bench.multi_device_bench`.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from das_jax.engine import GenerateError, GenerateStats, Request, RequestOutput

__all__ = [
    "LockedDrafter", "DataParallelStats", "assign_lpt", "assign_contiguous", "assignment_loads",
    "generate_data_parallel",
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


# ---------------------------------------------------------------------------------- drafter
class LockedDrafter:
    """A thread-safe view of a drafter shared by several devices (the Drafter protocol).

    Every call takes one re-entrant lock shared by all views of the same drafter. `view(ids)`
    gives a view whose request ids are local indices `k` mapped to `ids[k]`: each device's engine
    numbers its requests 0..n_d-1, and the view maps them back to indices into the full request
    list, so request ids never collide across devices and mean the same as on one device.
    `lengths(problem_id)` is passed through (under the lock) when the drafter has it.
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

    def view(self, request_ids: Sequence[int]) -> "LockedDrafter":
        """A view (same drafter, same lock) whose request id k means `request_ids[k]`."""
        return LockedDrafter(self, request_ids=request_ids)

    def _id(self, request_id: int) -> int:
        return int(request_id) if self._ids is None else self._ids[request_id]

    def begin(self, request_id: int, problem_id: Hashable, prompt_ids: Sequence[int]) -> None:
        with self.lock:
            self.drafter.begin(self._id(request_id), problem_id, prompt_ids)

    def propose(self, request_id: int, max_tokens: int):
        with self.lock:
            return self.drafter.propose(self._id(request_id), max_tokens)

    def append(self, request_id: int, token_ids: Sequence[int]) -> None:
        with self.lock:
            self.drafter.append(self._id(request_id), token_ids)

    def end(self, request_id: int) -> None:
        with self.lock:
            self.drafter.end(self._id(request_id))

    def advance_epoch(self) -> None:
        with self.lock:
            self.drafter.advance_epoch()

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


# ---------------------------------------------------------------------------------- placement
@dataclasses.dataclass
class DataParallelStats:
    """What one `generate_data_parallel` call did.

    devices: device names; assignment: request indices per device (admission order);
    predicted_work: predicted tokens per device (sum of predicted lengths);
    per_device: each device's `GenerateStats` (None for a device that got no request);
    combined: counters summed over devices, `wall_s` = the makespan (max device wall time,
      compile excluded), `compile_s` = max over devices, `steps` = all devices' steps;
    wall_s: wall time of the whole call (threads, compiles and all).
    """

    devices: list[str]
    assignment: list[list[int]]
    predicted_work: list[float]
    per_device: list[GenerateStats | None]
    combined: GenerateStats
    wall_s: float

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
        """Max over devices of the measured wall time (compile excluded)."""
        return max(self.device_wall_s)

    @property
    def makespan_forward_passes(self) -> int:
        """Max over devices of forward passes (hardware-independent makespan)."""
        return max(self.device_forward_passes)

    @property
    def makespan_tokens(self) -> int:
        """Max over devices of generated tokens (the work LPT balances)."""
        return max(self.device_tokens)

    @property
    def predicted_makespan(self) -> float:
        return max(self.predicted_work)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "assignment": self.assignment,
            "predicted_work": self.predicted_work, "predicted_makespan": self.predicted_makespan,
            "device_wall_s": self.device_wall_s, "device_forward_passes": self.device_forward_passes,
            "device_tokens": self.device_tokens, "makespan_s": self.makespan_s,
            "makespan_forward_passes": self.makespan_forward_passes,
            "makespan_tokens": self.makespan_tokens, "wall_s": self.wall_s,
            "combined": self.combined.to_dict(),
        }


def _combine(stats: Sequence[GenerateStats]) -> GenerateStats:
    out = GenerateStats()
    for f in ("forward_passes", "generated_tokens", "drafted_tokens", "accepted_draft_tokens",
              "prefill_s", "decode_s", "draft_s", "policy_s"):
        setattr(out, f, sum(getattr(s, f) for s in stats))
    out.wall_s = max((s.wall_s for s in stats), default=0.0)
    out.compile_s = max((s.compile_s for s in stats), default=0.0)
    out.steps = [r for s in stats for r in s.steps]
    return out


def _check_partition(assignment: Sequence[Sequence[int]], n: int, num_devices: int):
    if len(assignment) != num_devices:
        raise GenerateError(f"assignment has {len(assignment)} devices, expected {num_devices}")
    flat = sorted(int(i) for dev in assignment for i in dev)
    if flat != list(range(n)):
        raise GenerateError("assignment must place every request index exactly once")


def generate_data_parallel(
    rollouts: Sequence[Any],
    requests: Sequence[Request],
    params: Any = None,
    sampling: Any = None,
    assignment: str | Sequence[Sequence[int]] = "lpt",
    predicted_lengths: Sequence[float] | None = None,
) -> tuple[list[RequestOutput], DataParallelStats]:
    """Generates `requests` data-parallel, one `Rollout` fork and one host thread per device.

    Args:
      rollouts: one `das_jax.rollout.Rollout` per device, from `Rollout.forks` (they share one
        locked drafter; each device's drafter view maps its local request ids to indices into
        `requests`). Keep the list across calls so each fork's policy state persists.
      requests: outputs come back in request order.
      params: params to sample from (default: each engine's own); copied to each device.
      sampling: `SamplingParams` (default: the first rollout's).
      assignment: "lpt" (on predicted lengths), "contiguous", or explicit per-device index lists.
      predicted_lengths: per request (-1 = unknown); default: `rollouts[0].predicted_lengths`
        (the problems' history).

    Returns:
      (outputs in request order, `DataParallelStats`).

    Raises:
      GenerateError / SamplingError on bad input, before any thread starts; an exception raised
      on a device is re-raised here once every device has stopped.
    """
    rollouts = list(rollouts)
    if not rollouts:
        raise GenerateError("generate_data_parallel needs at least one rollout (one per device; "
                            "see Rollout.forks)")
    D = len(rollouts)
    sampling = sampling if sampling is not None else rollouts[0].sampling
    rollouts[0].engine.validate(requests, sampling)
    n = len(requests)
    if predicted_lengths is None:
        predicted_lengths = rollouts[0].predicted_lengths(requests)
    predicted_lengths = np.asarray(predicted_lengths, np.float64)
    if predicted_lengths.shape != (n,):
        raise GenerateError(f"predicted_lengths needs one entry per request ({n}), got "
                            f"shape {predicted_lengths.shape}")
    if isinstance(assignment, str):
        if assignment == "lpt":
            assign = assign_lpt(predicted_lengths, D)
        elif assignment == "contiguous":
            assign = assign_contiguous(n, D)
        else:
            raise GenerateError(f"unknown assignment {assignment!r}; valid: lpt, contiguous")
    else:
        assign = [list(map(int, dev)) for dev in assignment]
    _check_partition(assign, n, D)

    def run(d: int):
        if not assign[d]:
            return None, None
        return rollouts[d].generate([requests[i] for i in assign[d]], params, sampling,
                                    request_ids=assign[d])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=D,
                                               thread_name_prefix="das-device") as pool:
        futures = [pool.submit(run, d) for d in range(D)]
        concurrent.futures.wait(futures)
    wall = time.perf_counter() - t0
    results = [f.result() for f in futures]  # re-raises a device's exception

    outputs: list[RequestOutput | None] = [None] * n
    per_device: list[GenerateStats | None] = []
    for d, (outs, st) in enumerate(results):
        per_device.append(st)
        for i, o in zip(assign[d], outs or ()):
            outputs[i] = o
    stats = DataParallelStats(
        devices=[str(r.engine.device) for r in rollouts], assignment=assign,
        predicted_work=assignment_loads(assign, predicted_lengths), per_device=per_device,
        combined=_combine([s for s in per_device if s is not None]), wall_s=wall)
    return outputs, stats  # type: ignore[return-value]
