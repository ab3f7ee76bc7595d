"""Data-parallel rollouts over several JAX devices, with length-aware (LPT) request placement.

One `Engine` per device (params replicated with `jax.device_put`), each device's host loop in its
own Python thread (JAX releases the GIL while XLA runs, so the devices overlap), one drafter shared
by all devices behind a lock (`LockedDrafter`: siblings of a problem placed on other devices still
feed the same per-problem history), and one speculation policy per device.

Placement. A synchronous rollout step ends when its slowest device ends, so requests are assigned
by longest-processing-time-first (`assign_lpt`) on their predicted length (the problem's history:
`DASPolicy.predicted_length`, or lengths the caller passes): long requests are interleaved across
devices instead of piling up on one, as a naive contiguous split (`assign_contiguous`) does when a
hard problem's whole group sits next to each other in the batch.

Exactness. A request's seed derives from (run seed, problem id, sample index) only
(`sampling.request_seed`), never from its device, slot or batch position, so placement cannot
change a token (up to float rounding of the logits across batch shapes; see DESIGN.md).

    engines = replicate_engine(engine)                   # one per jax.devices()
    drafter = LockedDrafter(make_drafter("suffix"))      # shared, thread-safe
    policies = [DASPolicy(drafter.lengths) for _ in engines]
    outputs, stats = generate_data_parallel(engines, requests, sampling, drafter, policies)
    stats.makespan_s, stats.makespan_forward_passes
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import heapq
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np

from das_jax.engine.generate import (Engine, GenerateError, GenerateStats, Request,
                                     RequestOutput)
from das_jax.engine.sampling import SamplingParams

__all__ = [
    "LockedDrafter", "DataParallelStats", "assign_lpt", "assign_contiguous", "assignment_loads",
    "predict_lengths", "replicate_engine", "device_policies", "generate_data_parallel",
    "makespan_report",
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


def predict_lengths(requests: Sequence[Request], policy: Any = None,
                    drafter: Any = None) -> np.ndarray:
    """Predicted output length per request (-1 = unknown), from `policy.predicted_length(problem)`
    (e.g. `DASPolicy`) or else the median of `drafter.lengths(problem)` (the problem's history)."""
    cache: dict[Hashable, float] = {}

    def one(pid):
        if hasattr(policy, "predicted_length"):
            return float(policy.predicted_length(pid))
        if hasattr(drafter, "lengths"):
            past = list(drafter.lengths(pid))
            return float(np.median(past)) if past else -1.0
        return -1.0

    return np.array([cache[r.problem_id] if r.problem_id in cache else
                     cache.setdefault(r.problem_id, one(r.problem_id)) for r in requests],
                    np.float64)


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


# ---------------------------------------------------------------------------------- engines
def replicate_engine(engine: Engine, devices: Sequence[jax.Device] | None = None) -> list[Engine]:
    """One `Engine` per device with the template's config, eos ids and engine config; its params
    are copied to each device with `jax.device_put`. Keep the list across calls: compiled
    executables are shared per (shape, device) anyway, params are re-sent only when passed."""
    devices = list(devices) if devices is not None else jax.devices()
    return [Engine(engine.config, engine.params, engine.eos_token_ids, engine.engine_config,
                   device=d) for d in devices]


def device_policies(policy: Any, num_devices: int, drafter: LockedDrafter | None = None) -> list:
    """Per-device copies of a single-device speculation policy (e.g. from `build_speculation`).

    A `DASPolicy` copy reads problem history through `drafter.lengths` (the locked, shared
    drafter) and starts from the template's config, fitted cost model and finished lengths; other
    policies are deep-copied. Keep the list across calls so each policy's state persists.
    """
    from das_jax.engine.das_policy import DASPolicy
    out = []
    for _ in range(num_devices):
        if isinstance(policy, DASPolicy):
            lengths_fn = drafter.lengths if drafter is not None else policy.lengths_fn
            p = DASPolicy(lengths_fn, policy.config, copy.deepcopy(policy.cost_model))
            p.finished_lengths.extend(policy.finished_lengths)
        else:
            p = copy.deepcopy(policy)
        out.append(p)
    return out


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


def _resolve_engines(engines_or_factory, devices) -> list[Engine]:
    if isinstance(engines_or_factory, Engine):
        return replicate_engine(engines_or_factory, devices)
    if callable(engines_or_factory):
        return [engines_or_factory(d) for d in (list(devices) if devices is not None
                                                else jax.devices())]
    engines = list(engines_or_factory)
    if not engines or not all(isinstance(e, Engine) for e in engines):
        raise GenerateError("engines_or_engine_factory must be an Engine (replicated to every "
                            "device), a list of Engines (one per device) or a callable "
                            "device -> Engine")
    if devices is not None and len(list(devices)) != len(engines):
        raise GenerateError(f"{len(engines)} engines but {len(list(devices))} devices given")
    return engines


def _check_partition(assignment: Sequence[Sequence[int]], n: int, num_devices: int):
    if len(assignment) != num_devices:
        raise GenerateError(f"assignment has {len(assignment)} devices, expected {num_devices}")
    flat = sorted(int(i) for dev in assignment for i in dev)
    if flat != list(range(n)):
        raise GenerateError("assignment must place every request index exactly once")


def generate_data_parallel(
    engines_or_engine_factory: Engine | Sequence[Engine] | Callable[[jax.Device], Engine],
    requests: Sequence[Request],
    sampling: SamplingParams,
    drafter: Any = None,
    policy_factory: Callable[[int], Any] | Sequence[Any] | None = None,
    assignment: str | Sequence[Sequence[int]] = "lpt",
    devices: Sequence[jax.Device] | None = None,
    predicted_lengths: Sequence[float] | None = None,
    params: Any = None,
) -> tuple[list[RequestOutput], DataParallelStats]:
    """Generates `requests` data-parallel, one engine and one host thread per device.

    Args:
      engines_or_engine_factory: a list of Engines (one per device, e.g. `replicate_engine`), a
        single Engine (replicated onto `devices`), or a callable device -> Engine.
      requests, sampling: as for `Engine.generate`; outputs come back in request order.
      drafter: None (plain decoding) or a Drafter shared by all devices; it is wrapped in a
        `LockedDrafter` unless it already is one, and each device sees it through a view that
        maps its local request ids to indices into `requests`.
      policy_factory: per-device speculation policies: a callable device_index -> policy, or a
        sequence of policies (one per device, kept by the caller so their state persists; see
        `device_policies`), or None (`FixedPolicy`).
      assignment: "lpt" (on predicted lengths), "contiguous", or explicit per-device index lists.
      devices: the devices (default `jax.devices()`, or the given engines' own).
      predicted_lengths: per request (-1 = unknown); default: from the first policy's
        `predicted_length` (DASPolicy), else the drafter's `lengths` history, else unknown.
      params: params to sample from (default: each engine's own); copied to each device.

    Returns:
      (outputs in request order, `DataParallelStats`).

    Raises:
      GenerateError / SamplingError on bad input, before any thread starts; an exception raised
      on a device is re-raised here once every device has stopped.
    """
    engines = _resolve_engines(engines_or_engine_factory, devices)
    D = len(engines)
    engines[0]._validate(requests, sampling)
    n = len(requests)
    locked = None
    if drafter is not None:
        locked = drafter if isinstance(drafter, LockedDrafter) else LockedDrafter(drafter)
    if policy_factory is None:
        policies = [None] * D
    elif callable(policy_factory):
        policies = [policy_factory(d) for d in range(D)]
    else:
        policies = list(policy_factory)
        if len(policies) != D:
            raise GenerateError(f"{len(policies)} policies for {D} devices")
    if predicted_lengths is None:
        predicted_lengths = predict_lengths(requests, policies[0], locked)
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
        view = locked.view(assign[d]) if locked is not None else None
        return engines[d].generate([requests[i] for i in assign[d]], sampling, drafter=view,
                                   policy=policies[d], params=params)

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
        devices=[str(e.device) for e in engines], assignment=assign,
        predicted_work=assignment_loads(assign, predicted_lengths), per_device=per_device,
        combined=_combine([s for s in per_device if s is not None]), wall_s=wall)
    return outputs, stats  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- benchmark
def _skewed_requests(engine: Engine, num_devices: int, long_per_device: int,
                     short_per_device: int, max_new_tokens: int, short_max: int, seed: int):
    """Picks requests from a pool by their (deterministic) single-device lengths: a skewed set of
    `long_per_device * D` requests that hit max_new_tokens and `short_per_device * D` short ones,
    listed longest first (the order a contiguous split piles onto device 0)."""
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    need_long, need_short = long_per_device * num_devices, short_per_device * num_devices
    longs: list = []
    shorts: list = []
    pool_round = 0
    while (len(longs) < need_long or len(shorts) < need_short) and pool_round < 20:
        pool = [Request(tuple(int(t) for t in rng.integers(2, vocab, size=int(rng.integers(4, 12)))),
                        problem_id=f"q{pool_round}_{i}", sample_index=0) for i in range(64)]
        outs, _ = engine.generate(pool, sampling)
        for r, o in zip(pool, outs):
            if o.finish_reason == "length" and len(longs) < need_long:
                longs.append((r, len(o.token_ids)))
            elif len(o.token_ids) <= short_max and len(shorts) < need_short:
                shorts.append((r, len(o.token_ids)))
        pool_round += 1
    if len(longs) < need_long or len(shorts) < need_short:
        raise RuntimeError("could not find enough long/short requests; change the model or seed")
    chosen = sorted(longs + shorts, key=lambda x: -x[1])
    return [r for r, _ in chosen], np.array([n for _, n in chosen], np.float64), sampling


def makespan_report(num_devices: int | None = None, long_per_device: int = 2,
                    short_per_device: int = 6, max_new_tokens: int = 96, short_max: int = 12,
                    max_slots: int = 2, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                    print_fn=print) -> dict:
    """Makespan of LPT vs contiguous placement on a skewed length distribution (tiny random model).

    Lengths are controlled by selection: requests are drawn from a pool and kept by their exact
    single-device output length (deterministic given the seeds), so the skewed set has
    `long_per_device * D` rollouts of `max_new_tokens` tokens and `short_per_device * D` of at most
    `short_max`, listed longest first; those exact lengths are the predicted lengths (an oracle
    history). `hidden_size` / `num_layers` size the random model (larger: device time dominates
    the Python host loop). Besides the concurrent run, each device's share is also timed alone
    ("solo": what it would take on hardware of its own). Each assignment is run once to compile, then once measured. Prints and returns, per
    assignment, the predicted work, tokens, forward passes and wall seconds per device and their
    max (the makespan). Forward passes and tokens are hardware-independent; wall seconds of forced
    host devices sharing a few CPU cores are only indicative.
    """
    from das_jax.engine.generate import EngineConfig
    from das_jax.models import ModelConfig, init_params

    devices = jax.devices()[:num_devices] if num_devices else jax.devices()
    D = len(devices)
    cfg = ModelConfig(vocab_size=64, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2,
                      head_dim=hidden_size // 4)
    params = init_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    pool_engine = Engine(cfg, params, eos_token_ids=[1],
                         engine_config=EngineConfig(max_slots=16, max_cache_len=256))
    requests, lengths, sampling = _skewed_requests(pool_engine, D, long_per_device,
                                                   short_per_device, max_new_tokens, short_max,
                                                   seed)
    engines = replicate_engine(Engine(cfg, params, eos_token_ids=[1], engine_config=EngineConfig(
        max_slots=max_slots, max_cache_len=256)), devices)
    report: dict[str, Any] = {"devices": D, "requests": len(requests), "hidden_size": hidden_size,
                              "num_layers": num_layers,
                              "lengths": lengths.astype(int).tolist(), "max_slots": max_slots}
    outs_by = {}
    for name in ("contiguous", "lpt"):
        generate_data_parallel(engines, requests, sampling, assignment=name,
                               predicted_lengths=lengths)  # compile
        outs, st = generate_data_parallel(engines, requests, sampling, assignment=name,
                                          predicted_lengths=lengths)
        outs_by[name] = [o.token_ids for o in outs]
        # Each device's share alone (the others idle): the wall time it would take on hardware
        # of its own, which forced host devices sharing the same CPU cores do not give.
        solo = []
        for d, idx in enumerate(st.assignment):
            solo.append(engines[d].generate([requests[i] for i in idx], sampling)[1].wall_s
                        if idx else 0.0)
        report[name] = {
            "predicted_work": [int(x) for x in st.predicted_work],
            "tokens": st.device_tokens, "forward_passes": st.device_forward_passes,
            "wall_s": [round(x, 4) for x in st.device_wall_s],
            "makespan_tokens": st.makespan_tokens,
            "makespan_forward_passes": st.makespan_forward_passes,
            "makespan_s": round(st.makespan_s, 4), "call_wall_s": round(st.wall_s, 4),
            "solo_wall_s": [round(x, 4) for x in solo], "makespan_solo_s": round(max(solo), 4)}
    report["identical_outputs"] = outs_by["lpt"] == outs_by["contiguous"]
    print_fn(f"makespan report: {D} devices, {len(requests)} requests, max_slots={max_slots}, "
             f"model d={hidden_size} L={num_layers}, lengths={report['lengths']}")
    for name in ("contiguous", "lpt"):
        r = report[name]
        print_fn(f"  {name:10s} predicted work/device {r['predicted_work']}  "
                 f"tokens {r['tokens']}  forward passes {r['forward_passes']}  "
                 f"wall s {r['wall_s']}  solo wall s {r['solo_wall_s']}")
        print_fn(f"  {'':10s} makespan: {r['makespan_tokens']} tokens, "
                 f"{r['makespan_forward_passes']} forward passes, {r['makespan_s']:.3f} s "
                 f"concurrent (whole call {r['call_wall_s']:.3f} s), "
                 f"{r['makespan_solo_s']:.3f} s solo")
    print_fn(f"  outputs identical across assignments: {report['identical_outputs']}")
    return report


if __name__ == "__main__":
    # XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
    #   python -m das_jax.engine.multi_device [hidden_size num_layers]
    import sys
    makespan_report(hidden_size=int(sys.argv[1]) if len(sys.argv) > 1 else 64,
                    num_layers=int(sys.argv[2]) if len(sys.argv) > 2 else 2)
