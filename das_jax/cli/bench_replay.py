"""`das-jax bench replay TRACE.jsonl`: predicted rollout time per drafter (see `replay.py`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from das_jax.bench import replay as rp
from das_jax.arg_types import check_output_file
from das_jax.bench.arguments import paper_defaults
from das_jax.bench.memory_bound import epoch_bounds
from das_jax.config import ConfigError
from das_jax.engine import EngineConfig, cache_len_for
from das_jax.engine.engine_config import GenerateError
from das_jax.errors import UserError, one_line
from das_jax.speculation import resolve_cost_model

# Paper-scale defaults: a 7B bf16 model on one H100 SXM (`das_jax.speculation.gpu_cost`), 256 slots.
PAPER_COST_MODEL = "h100-7b"
PAPER_SLOTS = 256
PAPER_WIDTHS = (1, 4, 8, 16)


def main(args: argparse.Namespace) -> int:
    """Checks every input (flags, the trace, the cost model, the --json path) before the
    simulation; a bad one is one line `das-jax bench replay: error: ...` and exit code 2."""
    try:
        trace, das, coef, widths = check_inputs(args)
    except (UserError, ConfigError) as e:
        print(f"das-jax bench replay: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    paper = args.scale == "paper"
    h = trace.header
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if "none" not in names:
        names = ["none"] + names
    eng = h.get("engine", {})
    if args.slots:
        slots = [int(s) for s in args.slots.split(",")]
    elif args.batch:
        slots = [args.batch]
    else:
        slots = [PAPER_SLOTS if paper else int(eng.get("max_slots", 16))]
    # The trace's overheads (prefill per token, the executor's host time per step) were
    # measured on the trace's machine and model; a paper-scale replay leaves them out. The
    # scheduler's, drafter's and policy's host time is measured at every scale.
    overheads = None if (args.no_overheads or paper) else h.get("overheads")

    if paper:
        t0 = time.perf_counter()
        temp = trace.temperature(args.temperature)      # checked by check_inputs
        groups = {temp: paper_groups(trace, args, temp)}
        max_new = args.paper_max_tokens
        print(f"paper-scale workload built in {time.perf_counter() - t0:.1f}s "
              f"({args.paper_problems} problems x {args.paper_samples} samples, max "
              f"{max_new} tokens)", flush=True)
    else:
        groups = trace.groups()
        if args.temperature is not None:
            groups = {t: groups[t] for t in [trace.temperature(args.temperature)]}
        max_new = int(h["max_new_tokens"])
    if getattr(args, "admit_longest_first", False):
        groups = {t: {e: sorted(rs, key=lambda r: -len(r.token_ids)) for e, rs in g.items()}
                  for t, g in groups.items()}
    print(f"cost model ({args.cost_model or (PAPER_COST_MODEL if paper else 'trace')}): "
          f"c_base={coef['c_base'] * 1e3:.3f} ms, c_tok={coef['c_tok'] * 1e6:.3f} us/token slot, "
          f"c_kv={coef['c_kv'] * 1e9:.3f} ns/attended position; widths {widths}", flush=True)
    results = []
    for temp, epochs in groups.items():
        lens = [len(r.token_ids) for rs in epochs.values() for r in rs]
        print(f"\n{'paper-scale' if paper else f'T={temp}'}: {len(epochs)} epochs x "
              f"{len(next(iter(epochs.values())))} rollouts; length mean {np.mean(lens):.0f}, "
              f"p50 {np.median(lens):.0f}, p90 {np.percentile(lens, 90):.0f}, max {max(lens)}",
              flush=True)
        for ms in slots:
            ec = engine_config(args, ms, widths, max(
                int(eng.get("max_cache_len", 2048)),
                cache_len_for(EngineConfig().max_cache_len, widths, max(
                    len(r.prompt_ids) for rs in epochs.values() for r in rs), max_new)))
            t0 = time.perf_counter()
            pred = rp.replay_epochs(epochs, names, ec, max_new, coef, das, overheads,
                                    log=lambda s: print(s, flush=True),
                                    realtime=getattr(args, "realtime", False))
            sim_s = time.perf_counter() - t0
            pool = pool_positions(ec)
            bounds = epoch_bounds(epochs, pool, coef)
            results.append({"temperature": temp, "max_slots": ms, "widths": list(widths),
                            "kv_cache": ec.kv_cache, "kv_pages": ec.kv_pages,
                            "page_size": ec.page_size, "overlap_host": ec.overlap_host,
                            "draft_ahead": ec.draft_ahead,
                            "realtime": bool(getattr(args, "realtime", False)),
                            "cost_model": coef, "predicted": pred, "sim_s": sim_s,
                            "pool_positions": pool, "none_memory_bound": bounds})
            print(table(pred, temp, ms))
            print(bound_table(pred, bounds, pool, coef))
            print(f"(simulated in {sim_s:.1f}s)", flush=True)
    if args.json:
        write_json(args.json, {"trace": args.trace, "scale": args.scale, "results": results})
    return 0


def check_inputs(args: argparse.Namespace):
    """(trace, das settings, cost coefficients, draft widths) after checking every input the
    replay reads, before any simulation.

    Raises:
      UserError / ConfigError: one line naming the input (flag, file, header key) and the fix."""
    paper_defaults(args)                       # --paper-* only with --scale paper
    paper = args.scale == "paper"
    if args.json:
        check_output_file(args.json, "--json", "replay.json")
    if args.draft_widths:
        widths = tuple(int(w) for w in args.draft_widths.split(","))
        if 1 not in widths:
            raise UserError(f"--draft-widths {args.draft_widths} must include 1 (plain "
                            f"decoding), e.g. 1,{args.draft_widths}")
    trace = rp.read_trace(args.trace)          # every line checked (UserError naming it)
    h = trace.header
    das = rp.das_from_header(h, args.overrides)
    spec = args.cost_model or (PAPER_COST_MODEL if paper else None)
    if spec:
        try:
            coef = resolve_cost_model(spec)
        except ValueError as e:
            raise UserError(f"--cost-model {spec}: {e}") from None
    elif "cost_model" in h:
        coef = dict(h["cost_model"])            # checked by read_trace
    else:
        raise UserError(f"trace {args.trace}: its header has no 'cost_model'; pass --cost-model "
                        "cpu|h100-7b|h200-7b|PATH.json")
    for k in ("c_base", "c_tok", "c_kv"):       # checked by their argparse type (`seconds`)
        v = getattr(args, k)
        if v is not None:
            coef[k] = v
    eng = h.get("engine", {})
    if not args.draft_widths:
        widths = PAPER_WIDTHS if paper else tuple(eng.get("draft_widths", (1, 4, 8)))
    if not paper:
        if "max_new_tokens" not in h:
            raise UserError(f"trace {args.trace}: its header has no 'max_new_tokens'; record "
                            "the trace again with `das-jax bench rollout`, or replay it with "
                            "--scale paper")
    if args.temperature is not None:
        try:
            trace.temperature(args.temperature)
        except ValueError as e:
            raise UserError(f"--temperature {args.temperature:g}: trace {args.trace}: {e} (or "
                            "leave --temperature out: " + ("the lowest" if paper else "all")
                            + ")") from None
    try:                                       # the engine settings the flags make
        engine_config(args, 1, widths, 1 << 20)
    except GenerateError as e:
        raise UserError(f"the replay's engine settings (--draft-widths, --kv-cache, "
                        f"--page-size, --kv-rows or the trace's engine): {e}") from None
    return trace, das, coef, widths


def write_json(path: str, obj) -> None:
    """Writes `obj` to `path` atomically (a temporary file beside it, then renamed): a failed
    write leaves no half-written file and the old one, if any, intact."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, default=str)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def engine_config(args, max_slots: int, widths, max_cache_len: int) -> EngineConfig:
    """The simulated engine: `max_slots` rows of `max_cache_len`; with `--kv-cache paged` a
    pool of `--page-size` pages with the memory of `--kv-rows` dense rows (default: one per
    slot, which never runs short)."""
    overlap = not getattr(args, "no_overlap", False)
    ahead = not getattr(args, "no_draft_ahead", False)
    if args.kv_cache != "paged":
        return EngineConfig(max_slots=max_slots, max_cache_len=max_cache_len,
                            draft_widths=widths, overlap_host=overlap, draft_ahead=ahead)
    per_row = -(-max_cache_len // args.page_size)
    return EngineConfig(max_slots=max_slots, max_cache_len=max_cache_len, draft_widths=widths,
                        kv_cache="paged", page_size=args.page_size,
                        kv_pages=None if args.kv_rows is None else args.kv_rows * per_row,
                        overlap_host=overlap, draft_ahead=ahead)


def pool_positions(ec: EngineConfig) -> int:
    """KV positions the simulated cache holds: the paged pool's pages x page size (one row's
    pages per slot when `kv_pages` is unset), else slots x `max_cache_len`."""
    if ec.kv_cache == "paged":
        pages, page, _ = ec.paging(ec.max_slots, ec.max_cache_len)
        return int(pages) * int(page)
    return int(ec.max_slots) * int(ec.max_cache_len)


def bound_table(pred: dict, bounds: list[dict], pool: int, coef: dict) -> str:
    """Per epoch: `none`'s device time, the same with its token slots priced at the live rows
    only (no batch-bucket padding), and the fastest plain decoding any cache of `pool`
    positions allows under the cost model (`memory_bound.none_memory_bound`)."""
    lines = [f"\nmemory bound for none (any schedule on a cache of {pool:,} positions):",
             "| epoch | none device s | none without padding s | bound device s "
             "(base + tok + kv) | bound passes | none passes | none / bound |",
             "|---|---|---|---|---|---|---|"]
    for r, b in zip(pred["none"], bounds):
        unpadded = r["device_s"] - float(coef["c_tok"]) * (r["token_slots"]
                                                            - r["live_token_slots"])
        lines.append(f"| {b['epoch']} | {r['device_s']:.2f} | {unpadded:.2f} | "
                     f"{b['device_s']:.2f} "
                     f"({b['base_s']:.1f} + {b['tok_s']:.1f} + {b['kv_s']:.1f}) | "
                     f"{b['passes']} | {r['forward_passes']} | "
                     f"{r['device_s'] / max(b['device_s'], 1e-12):.3f} |")
    return "\n".join(lines)


def paper_groups(trace, args, temperature: float | None = None):
    """The paper-scale workload of the flags, from the trace's rollouts at `temperature`
    (None: its lowest)."""
    return rp.paper_workload(trace, problems=args.paper_problems, samples=args.paper_samples,
                             max_tokens=args.paper_max_tokens, epochs=args.paper_epochs,
                             median_len=args.paper_median, sigma=args.paper_sigma,
                             temperature=temperature)


def table(pred: dict, temp, slots) -> str:
    """Per drafter and epoch: total = device (cost model) + exposed host time (measured: the
    host work between steps, and the work overlapped with a step past its predicted time), all
    the host work and its time per step per live row; then the totals and speed-ups vs
    `none`."""
    lines = ["\n| T | slots | drafter | epoch | total s | device s | host s | exposed host s | "
             "host us/row | passes | live rows | accept len | speed-up vs none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in pred.items():
        for r, n in zip(rows, pred["none"]):
            lines.append(f"| {temp} | {slots} | {name} | {r['epoch']} | {r['total_s']:.2f} | "
                         f"{r['device_s']:.2f} | {r['host_s']:.2f} | "
                         f"{r['exposed_host_s']:.2f} | {r['host_us_per_row']:.1f} | {r['forward_passes']} | "
                         f"{r['mean_live_rows']:.1f} | {r['acceptance_length']:.2f} | "
                         f"{n['total_s'] / max(r['total_s'], 1e-9):.2f}x |")
    lines.append("")
    tot_none = sum(r["total_s"] for r in pred["none"])
    later_none = sum(r["total_s"] for r in pred["none"][1:])
    lines.append("| drafter | total s (device + host) | speed-up (all epochs) | "
                 "speed-up (epochs >= 1) | speed-up, device time only |")
    lines.append("|---|---|---|---|---|")
    dev_none = sum(r["device_s"] for r in pred["none"])
    for name, rows in pred.items():
        tot = sum(r["total_s"] for r in rows)
        later = sum(r["total_s"] for r in rows[1:])
        dev = sum(r["device_s"] for r in rows)
        lines.append(f"| {name} | {tot:.2f} | {tot_none / max(tot, 1e-9):.2f}x | "
                     f"{(later_none / later) if later else float('nan'):.2f}x | "
                     f"{dev_none / max(dev, 1e-9):.2f}x |")
    return "\n".join(lines)
