"""Makespan of LPT against contiguous request placement over data-parallel rollout replicas
(tiny random model).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python -m das_jax.bench.multi_device_bench [hidden_size num_layers [replicas]]

Lengths are controlled by selection: requests are drawn from a pool and kept by their exact
single-device output length (deterministic given the seeds), so the skewed set has
`long_per_device * D` rollouts of `max_new_tokens` tokens and `short_per_device * D` of at most
`short_max`, listed longest first (the order a contiguous split piles onto device 0); those exact
lengths are the predicted lengths (an oracle history). The replicas are a
`das_jax.rollout.ShardedRollout` (default one per device; fewer replicas run tensor-parallel over
their devices); placement is `das_jax.rollout.multi_device`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from das_jax.testing import tiny_model_config, tiny_params


def _skewed_requests(rollout, num_devices: int, long_per_device: int, short_per_device: int,
                     max_new_tokens: int, short_max: int, seed: int):
    """A skewed request set picked from pools by single-device output length (longest first),
    their lengths, and the sampling used."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import Request, SamplingParams

    rng = np.random.default_rng(seed)
    vocab = rollout.engine.config.vocab_size
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    need_long, need_short = long_per_device * num_devices, short_per_device * num_devices
    longs: list = []
    shorts: list = []
    pool_round = 0
    while (len(longs) < need_long or len(shorts) < need_short) and pool_round < 20:
        pool = [Request(tuple(int(t) for t in rng.integers(2, vocab, size=int(rng.integers(4, 12)))),
                        problem_id=f"q{pool_round}_{i}", sample_index=0) for i in range(64)]
        outs, _ = rollout.generate(pool, sampling=sampling)
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
                    replicas: int | None = None, print_fn=print) -> dict:
    """Makespan of LPT vs contiguous placement on a skewed length distribution.

    `replicas`: data-parallel replicas over the devices (default: one per device); the
    `long_per_device` / `short_per_device` counts are per replica.

    `hidden_size` / `num_layers` size the random model (larger: device time dominates the
    Python host loop). Besides the concurrent run, each device's share is also timed alone
    ("solo": what it would take on hardware of its own). Each assignment is run once to compile,
    then once measured. Prints and returns, per assignment, the predicted work, tokens, forward
    passes and wall seconds per device and their max (the makespan). Forward passes and tokens
    are hardware-independent; wall seconds of forced host devices sharing a few CPU cores are
    only indicative.
    """
    # deferred import: jax (not loaded by importing this module)
    import jax

    from das_jax.engine import Engine, EngineConfig
    from das_jax.rollout import Rollout, ShardedRollout

    devices = jax.devices()[:num_devices] if num_devices else jax.devices()
    D = len(devices) if replicas is None else int(replicas)
    cfg = tiny_model_config(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_layers=num_layers, head_dim=hidden_size // 4,
                            rope_theta=100000.0)
    params = tiny_params(cfg, seed=seed)
    pool = Rollout(Engine(cfg, params, eos_token_ids=[1],
                          engine_config=EngineConfig(max_slots=16, max_cache_len=256)))
    requests, lengths, sampling = _skewed_requests(pool, D, long_per_device, short_per_device,
                                                   max_new_tokens, short_max, seed)
    rollout = ShardedRollout.from_rollout(Rollout(Engine(
        cfg, None, eos_token_ids=[1], engine_config=EngineConfig(max_slots=max_slots,
                                                                 max_cache_len=256),
        dtype="float32"), sampling=sampling), devices, D)
    report: dict[str, Any] = {"devices": len(devices), "replicas": D,
                              "tensor_parallel": rollout.tensor_parallel,
                              "requests": len(requests), "hidden_size": hidden_size,
                              "num_layers": num_layers,
                              "lengths": lengths.astype(int).tolist(), "max_slots": max_slots}
    outs_by = {}
    for name in ("contiguous", "lpt"):
        rollout.generate(requests, params, assignment=name,
                         predicted_lengths=lengths)  # compile
        outs, st = rollout.generate(requests, params, assignment=name,
                                    predicted_lengths=lengths)
        outs_by[name] = [o.token_ids for o in outs]
        # Each replica's share alone (the others idle): the wall time it would take on hardware
        # of its own, which forced host devices sharing the same CPU cores do not give.
        solo = []
        for d, idx in enumerate(st.assignment):
            solo.append(rollout.replicas[d].generate([requests[i] for i in idx], params,
                                                     request_ids=idx)[1].wall_s
                        if idx else 0.0)
        report[name] = {
            "predicted_work": [int(x) for x in st.predicted_work],
            "tokens": st.device_tokens, "forward_passes": st.device_forward_passes,
            "wall_s": [round(x, 4) for x in st.device_wall_s],
            "makespan_tokens": st.makespan_tokens,
            "makespan_forward_passes": st.makespan_forward_passes,
            "makespan_s": round(st.makespan_s, 4), "call_wall_s": round(st.call_wall_s, 4),
            "solo_wall_s": [round(x, 4) for x in solo], "makespan_solo_s": round(max(solo), 4)}
    report["identical_outputs"] = outs_by["lpt"] == outs_by["contiguous"]
    print_fn(f"makespan report: {len(devices)} devices as {D} replicas x "
             f"{rollout.tensor_parallel} (tensor-parallel), {len(requests)} requests, "
             f"max_slots={max_slots}, "
             f"model d={hidden_size} L={num_layers}, lengths={report['lengths']}")
    for name in ("contiguous", "lpt"):
        r = report[name]
        print_fn(f"  {name:10s} predicted work/replica {r['predicted_work']}  "
                 f"tokens {r['tokens']}  forward passes {r['forward_passes']}  "
                 f"wall s {r['wall_s']}  solo wall s {r['solo_wall_s']}")
        print_fn(f"  {'':10s} makespan: {r['makespan_tokens']} tokens, "
                 f"{r['makespan_forward_passes']} forward passes, {r['makespan_s']:.3f} s "
                 f"concurrent (whole call {r['call_wall_s']:.3f} s), "
                 f"{r['makespan_solo_s']:.3f} s solo")
    print_fn(f"  outputs identical across assignments: {report['identical_outputs']}")
    return report


if __name__ == "__main__":
    import sys
    makespan_report(hidden_size=int(sys.argv[1]) if len(sys.argv) > 1 else 64,
                    num_layers=int(sys.argv[2]) if len(sys.argv) > 2 else 2,
                    replicas=int(sys.argv[3]) if len(sys.argv) > 3 else None)
