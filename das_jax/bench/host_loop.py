"""Host time per live row of the trace replay's host loop (scheduler, drafter, policy), measured
so that any version of das-jax can be compared side by side: the wall time of `replay.simulate`
less the time spent inside the `TraceExecutor`'s calls (timers patched around them), per live row
per step. Epoch 0 of a paper-scale workload fills the drafter's history; epoch 1 is measured.

    python -m das_jax.bench.host_loop das 256 --problems 32

prints one JSON line: host / draft / policy microseconds per live row, forward passes, accepted
draft tokens (equal across versions that take the same decisions) and mean live rows. host is
all of the host work; overlap the part run while the device computes a step (the drafter's
deferred appends, `EngineConfig.overlap_host`; `--no-overlap`: none); exposed the part the
device waits for (the work between steps, and overlapped work past the step's predicted time).

The replay plans with a frozen cost model; an engine refits its coefficients from every
step it observes, between two steps. `refit_us_per_step` is that work, timed apart: a live
`CostModel` observing the measured epoch's steps in order (shape, predicted seconds).
"""
from __future__ import annotations

import argparse
import json
import time

from das_jax.bench import replay as rp
from das_jax.engine import EngineConfig
from das_jax.rollout import build_speculation
from das_jax.speculation import CostModel, resolve_cost_model


def _timed(fn, spent: list):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    return timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="speculation name (none, das, ...)")
    p.add_argument("slots", type=int, help="max_slots of the simulated engine")
    p.add_argument("--problems", type=int, default=32, help="paper-scale problems (x16 samples)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--median", type=float, default=800.0)
    p.add_argument("--cost-model", default="h200-7b")
    p.add_argument("--trace", default="docs/traces/gsm8k-smollm2-135m.jsonl.gz")
    p.add_argument("--no-overlap", action="store_true",
                   help="complete every append before the next draft (overlap_host: false)")
    p.add_argument("--no-draft-ahead", action="store_true",
                   help="draft every row between the steps (draft_ahead: false)")
    args = p.parse_args(argv)
    spent = [0.0]
    for name in ("verify", "prefill", "compact", "start", "decode"):
        if hasattr(rp.TraceExecutor, name):
            setattr(rp.TraceExecutor, name, _timed(getattr(rp.TraceExecutor, name), spent))
    trace = rp.read_trace(args.trace)
    epochs = rp.paper_workload(trace, problems=args.problems, samples=16,
                               max_tokens=args.max_tokens, epochs=2, median_len=args.median)
    ec = EngineConfig(max_slots=args.slots, max_cache_len=2 * args.max_tokens,
                      draft_widths=(1, 4, 8, 16), overlap_host=not args.no_overlap,
                      draft_ahead=not args.no_draft_ahead)
    cm = rp.FrozenCostModel.of(resolve_cost_model(args.cost_model))
    drafter, policy = build_speculation(args.drafter, rp.das_from_header(trace.header), cm)
    first, second = list(epochs)[:2]
    rp.simulate(epochs[first], ec, args.max_tokens, cm, drafter, policy)
    if drafter is not None:
        drafter.advance_epoch()
    spent[0] = 0.0
    before = getattr(drafter, "drafted_ahead", (0, 0))
    t0 = time.perf_counter()
    st = rp.simulate(epochs[second], ec, args.max_tokens, cm, drafter, policy)
    wall = time.perf_counter() - t0
    ahead = [a - b for a, b in zip(getattr(drafter, "drafted_ahead", (0, 0)), before)]
    rows = max(sum(s.active for s in st.steps), 1)
    for warm in (True, False):      # the first pass imports the fit's solver (scipy)
        live = CostModel(**resolve_cost_model(args.cost_model))
        t0 = time.perf_counter()
        for r in st.steps[:8] if warm else st.steps:
            live.observe_step(*r.step_shape(), r.seconds, width=r.width, read_kv=r.read_kv,
                              wide_rows=r.wide_rows)
        refit_s = time.perf_counter() - t0
    between = wall - spent[0]   # the flush runs inside verify: in spent, not here
    print(json.dumps({"drafter": args.drafter, "slots": args.slots,
                      "overlap": not args.no_overlap,
                      "host_us_per_row": 1e6 * (between + st.overlap_s) / rows,
                      "overlap_us_per_row": 1e6 * st.overlap_s / rows,
                      "exposed_us_per_row": 1e6 * (between + st.exposed_overlap_s) / rows,
                      "draft_us_per_row": 1e6 * st.draft_s / rows,
                      "policy_us_per_row": 1e6 * st.policy_s / rows,
                      "refit_us_per_step": 1e6 * refit_s / max(len(st.steps), 1),
                      "drafted_ahead_rows": ahead[0],
                      "drafted_ahead_used": ahead[1],
                      "forward_passes": st.forward_passes,
                      "accepted_draft_tokens": st.accepted_draft_tokens,
                      "mean_live_rows": rows / max(st.forward_passes, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
