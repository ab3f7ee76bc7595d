"""`das-jax bench async-replay TRACE`: GRPO step time of a synchronous and an asynchronous
schedule at paper scale, with and without DAS, on one GPU node.

Each paper-scale epoch (`replay.paper_workload`: `--paper-problems` problems x `--paper-samples`
samples, long-tailed lengths) is one GRPO step's batch. Rollout time comes from the trace
replay (`replay.replay_epochs`: the engine's scheduler, drafter and DAS policy, steps priced by
the `--cost-model`, measured host time included), train time from a stated model:

    train_s(tokens, n GPUs) = 8 * P * tokens / (n * peak * MFU)

P the model's matmul parameters (`gpu_cost.QWEN2_7B` for h100-7b / h200-7b), 8 P FLOPs per
trained token (forward + backward 6 P, and the forward that recomputes the old log-probs 2 P;
attention FLOPs and the optimizer step left out, ~10% at 4K tokens), peak the GPU's dense bf16
rate (`gpu_cost`), MFU `--train-mfu` (0.40). A disaggregated rollout side receives the params
over NVLink after each update: 2 P bytes / `--sync-gbps` (400 GB/s) added to each rollout.

Schedules on `--gpus` GPUs (8):
* sync: every GPU generates the step's rollouts (groups split over engines by problem, one
  engine per GPU; the step's rollout time is the slowest engine's), then every GPU trains.
* async k, r GPUs: `r` GPUs only generate and the other `gpus - r` only train
  (`mesh.rollout_devices: r`, `train.async_steps: k`). Step s samples from version
  max(s - k, 0), so its rollout starts when the previous rollout is done and update s - k - 1
  is (`AsyncRollouts`' schedule); update s starts when rollout s and update s - 1 are done.
Colocated async (both sides on every GPU) is not priced: on a GPU the device, not the host, is
the bottleneck, and how two programs share it is not something this model knows.

The DAS drafter's history is the same under both schedules (rollouts of the steps before a
step's rollout are in it either way: the rollout side runs steps in order), so only the
timeline differs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

import numpy as np

from das_jax.speculation import gpu_cost, resolve_cost_model

__all__ = ["train_seconds", "sync_timeline", "async_timeline", "split_by_problem", "main"]

TRAIN_MFU = 0.40
SYNC_BYTES_PER_S = 400e9


def train_seconds(tokens: int, gpus: int, matmul_params: float, peak_flops: float,
                  mfu: float = TRAIN_MFU) -> float:
    """Seconds to train on `tokens` tokens on `gpus` GPUs: 8 * P * tokens / (gpus * peak * mfu)
    (module docstring).

    Raises:
      ValueError: gpus < 1 or mfu not in (0, 1].
    """
    if gpus < 1 or not 0 < mfu <= 1:
        raise ValueError(f"train_seconds needs gpus >= 1 and mfu in (0, 1], got {gpus}, {mfu}")
    return 8.0 * matmul_params * tokens / (gpus * peak_flops * mfu)


def sync_timeline(rollout_s: Sequence[float], train_s: Sequence[float]) -> list[float]:
    """End time of each step (seconds): rollout then update, one after the other."""
    out, t = [], 0.0
    for r, u in zip(rollout_s, train_s):
        t += r + u
        out.append(t)
    return out


def async_timeline(rollout_s: Sequence[float], train_s: Sequence[float], k: int,
                   sync_s: float = 0.0) -> list[float]:
    """End time of each step's update (seconds) when the rollouts run on devices of their own,
    `k` steps ahead: rollout s starts after rollout s - 1 and after update s - k - 1 (the params
    of version max(s - k, 0)), plus `sync_s` to receive them; update s starts after rollout s
    and update s - 1.

    Raises:
      ValueError: k < 1.
    """
    if k < 1:
        raise ValueError(f"async_timeline needs k >= 1, got {k}")
    n = len(rollout_s)
    r_end, u_end = [0.0] * n, [0.0] * n
    for s in range(n):
        ready = u_end[s - k - 1] if s - k - 1 >= 0 else 0.0
        start = max(r_end[s - 1] if s else 0.0, ready + (sync_s if s - k - 1 >= 0 else 0.0))
        r_end[s] = start + rollout_s[s]
        u_end[s] = max(r_end[s], u_end[s - 1] if s else 0.0) + train_s[s]
    return u_end


def split_by_problem(rollouts, parts: int) -> list[list]:
    """`rollouts` split over `parts` engines, whole groups: problem i of the step (in first-seen
    order) goes to engine i mod parts, every step (so each problem's history stays in one
    engine's drafter)."""
    order = {pid: i for i, pid in enumerate(dict.fromkeys(r.problem_id for r in rollouts))}
    out = [[] for _ in range(parts)]
    for r in rollouts:
        out[order[r.problem_id] % parts].append(r)
    return out


def rollout_times(epochs: dict, names: Sequence[str], engines: int, engine_config,
                  max_new: int, coef: dict, das=None, log=None) -> dict[str, list[float]]:
    """name -> per-step rollout seconds on `engines` GPUs: the slowest engine's predicted time
    (device + exposed host) for its share of the step's groups."""
    from das_jax.bench import replay as rp   # deferred import: jax

    per_engine = [{e: split_by_problem(rolls, engines)[i] for e, rolls in epochs.items()}
                  for i in range(engines)]
    out = {n: [0.0] * len(epochs) for n in names}
    for i, part in enumerate(per_engine):
        pred = rp.replay_epochs(part, names, engine_config, max_new, coef, das)
        for n in names:
            for j, row in enumerate(pred[n]):
                out[n][j] = max(out[n][j], float(row["total_s"]))
        if log:
            log(f"  {engines} engine(s): engine {i} replayed")
    return out


def _steady(end_s: Sequence[float]) -> float:
    """Mean seconds per step after the first (whose rollout nothing overlaps in either
    schedule): the pipeline's steady state."""
    return (end_s[-1] - end_s[0]) / max(len(end_s) - 1, 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace .jsonl(.gz) written by `bench rollout`")
    p.add_argument("--drafters", default="none,das", help="comma-separated speculation names")
    p.add_argument("--cost-model", default="h200-7b", choices=("h100-7b", "h200-7b"))
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the node")
    p.add_argument("--rollout-gpus", default="2,4,6",
                   help="comma-separated GPUs given to the rollouts in the async schedule")
    p.add_argument("--async-steps", type=int, default=1, help="k of the async schedule")
    p.add_argument("--slots", type=int, default=256, help="max_slots of each engine")
    p.add_argument("--train-mfu", type=float, default=TRAIN_MFU)
    p.add_argument("--sync-gbps", type=float, default=SYNC_BYTES_PER_S / 1e9,
                   help="GB/s of the params' device-to-device copy to the rollout GPUs")
    p.add_argument("--paper-problems", type=int, default=32)
    p.add_argument("--paper-samples", type=int, default=16)
    p.add_argument("--paper-epochs", type=int, default=4, help="steps (one epoch each)")
    p.add_argument("--paper-max-tokens", type=int, default=4096)
    p.add_argument("--paper-median", type=float, default=1500.0)
    p.add_argument("--paper-sigma", type=float, default=0.8)
    p.add_argument("--json", default=None, help="also write the numbers here")


def main(args: argparse.Namespace) -> int:
    from das_jax.bench import replay as rp   # deferred import: jax
    from das_jax.engine import EngineConfig, cache_len_for

    try:
        trace = rp.read_trace(args.trace)
        splits = [int(x) for x in str(args.rollout_gpus).split(",") if x.strip()]
    except (OSError, ValueError) as e:
        print(f"das-jax bench async-replay: {e}", file=sys.stderr)
        return 2
    bad = [r for r in splits if not 1 <= r < args.gpus]
    if bad or args.gpus < 2 or args.async_steps < 1:
        print(f"das-jax bench async-replay: --rollout-gpus must each be in [1, --gpus) and "
              f"--async-steps >= 1 (got {args.rollout_gpus}, --gpus {args.gpus}, "
              f"--async-steps {args.async_steps})", file=sys.stderr)
        return 2
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    coef = resolve_cost_model(args.cost_model)
    gpu = gpu_cost.H200 if args.cost_model == "h200-7b" else gpu_cost.H100_SXM
    P = float(gpu_cost.QWEN2_7B.matmul_params())
    sync_s = 2 * P / (args.sync_gbps * 1e9)
    epochs = rp.paper_workload(trace, problems=args.paper_problems, samples=args.paper_samples,
                               max_tokens=args.paper_max_tokens, epochs=args.paper_epochs,
                               median_len=args.paper_median, sigma=args.paper_sigma)
    widths = (1, 4, 8, 16)
    prompt = max(len(r.prompt_ids) for rs in epochs.values() for r in rs)
    ec = EngineConfig(max_slots=args.slots, draft_widths=widths,
                      max_cache_len=cache_len_for(EngineConfig().max_cache_len, widths, prompt,
                                                  args.paper_max_tokens))
    das = rp.das_from_header(trace.header)
    tokens = [sum(len(r.prompt_ids) + len(r.token_ids) for r in rolls)
              for rolls in epochs.values()]
    lens = [len(r.token_ids) for rs in epochs.values() for r in rs]
    print(f"paper-scale: {len(epochs)} steps x {len(next(iter(epochs.values())))} rollouts; "
          f"length mean {np.mean(lens):.0f}, p50 {np.median(lens):.0f}, p90 "
          f"{np.percentile(lens, 90):.0f}, max {max(lens)}; {args.cost_model}, {args.gpus} GPUs, "
          f"{args.slots} slots per engine; train model 8 P tokens / (n x "
          f"{gpu.bf16_dense_flops / 1e12:.0f} TFLOP/s x MFU {args.train_mfu}), P = {P / 1e9:.2f}B; "
          f"params to the rollout GPUs {sync_s * 1e3:.0f} ms", flush=True)
    t0 = time.perf_counter()
    rollout = {g: rollout_times(epochs, names, g, ec, args.paper_max_tokens, coef, das,
                                log=lambda s: print(s, flush=True))
               for g in sorted({args.gpus, *splits})}
    rows = []
    for name in names:
        train_all = [train_seconds(t, args.gpus, P, gpu.bf16_dense_flops, args.train_mfu)
                     for t in tokens]
        end = sync_timeline(rollout[args.gpus][name], train_all)
        rows.append({"drafter": name, "schedule": f"sync, {args.gpus} GPUs",
                     "rollout_s": rollout[args.gpus][name], "train_s": train_all, "end_s": end})
        for r in splits:
            train_r = [train_seconds(t, args.gpus - r, P, gpu.bf16_dense_flops, args.train_mfu)
                       for t in tokens]
            end = async_timeline(rollout[r][name], train_r, args.async_steps, sync_s)
            rows.append({"drafter": name,
                         "schedule": f"async k={args.async_steps}, {r} rollout + "
                                     f"{args.gpus - r} train GPUs",
                         "rollout_s": rollout[r][name], "train_s": train_r, "end_s": end})
    base = rows[0]["end_s"][-1]   # sync with the first drafter (none)
    print(f"\n(replayed in {time.perf_counter() - t0:.0f} s)\n")
    base_steady = _steady(rows[0]["end_s"])
    print("| drafter | schedule | rollout s per step | train s per step | step s, steps >= 2 | "
          f"speed-up, steps >= 2 | {len(epochs)} steps s | speed-up vs sync {names[0]} |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        total, steady = row["end_s"][-1], _steady(row["end_s"])
        print(f"| {row['drafter']} | {row['schedule']} | {np.mean(row['rollout_s']):.1f} | "
              f"{np.mean(row['train_s']):.1f} | {steady:.1f} | {base_steady / steady:.2f}x | "
              f"{total:.1f} | {base / total:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "args": vars(args), "rows": rows,
                       "tokens_per_step": tokens}, f, indent=1, default=str)
    return 0
