"""`das-jax plan`: per-device memory of a run, from abstract shapes (see `das_jax.plan`)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from das_jax.config import ConfigError, load_config
from das_jax.errors import one_line
from das_jax.plan import PlanError, plan
from das_jax.rl import model_loading
from das_jax.rl.run_log import setup_console_logging


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="per-device memory of a run (abstract shapes, no weights loaded)",
        description="Compile the train step and the largest rollout shapes against abstract "
                    "shapes and print per-device bytes (a named model source is fetched first: "
                    "its config is in the file); exit 1 with one line naming what to "
                    "change when it does not fit.")
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--devices", type=int, default=1, help="devices to shard over (FSDP)")
    p.add_argument("--device-memory-gb", type=positive_gb, default=None,
                   help="per-device memory in GB, a number > 0 (default: train.device_memory_gb "
                        "or the local device)")
    p.add_argument("--lengths", default=None, metavar="TRACE",
                   help="with rollout.kv_cache: paged, also the rows the page pool holds at once "
                        "at the rollout lengths of this trace (a `bench rollout` trace.jsonl)")
    p.add_argument("--paper-scale", action="store_true",
                   help="with --lengths (an error without it): stretch the trace's rollouts to "
                        "the DAS paper's long tail up to rollout.max_new_tokens (`bench replay "
                        "--scale paper`)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def positive_gb(text: str) -> float:
    """argparse type of --device-memory-gb: a finite number of GB > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of GB > 0 (one device's memory, e.g. 80)")
    return value


def _error(message: str) -> int:
    """`das-jax plan: error: MESSAGE` (one line, as every command prints), exit code 2."""
    print(f"das-jax plan: error: {one_line(message)}", file=sys.stderr)
    return 2


def trace_lengths(path: str, paper_scale: bool, max_tokens: int) -> tuple[list, list]:
    """(prompt lengths, completion lengths) of the rollouts of a trace (every rollout; with
    `paper_scale` those of the lowest recorded temperature, every epoch), stretched to the paper's long tail up to `max_tokens` with
    `paper_scale`.

    Raises:
      OSError / ValueError: the trace is missing or unreadable (one line).
    """
    # deferred import: jax (the bench's trace reader loads the engine; `das-jax --help` does not)
    from das_jax.bench.replay import paper_workload, read_trace
    trace = read_trace(path)
    if paper_scale:
        rolls = [r for epoch in paper_workload(trace, max_tokens=max_tokens).values()
                 for r in epoch]
    else:
        rolls = list(trace.rollouts)
    return [len(r.prompt_ids) for r in rolls], [len(r.token_ids) for r in rolls]


def run(args) -> int:
    if args.paper_scale and not args.lengths:
        return _error("--paper-scale stretches the rollouts of the --lengths trace and does "
                      "nothing alone; add --lengths TRACE (a `bench rollout` trace.jsonl) or "
                      "drop --paper-scale")
    if args.lengths is not None and not os.path.isfile(args.lengths):
        what = "is a directory" if os.path.isdir(args.lengths) else "no such file"
        return _error(f"--lengths {args.lengths}: {what}; pass a trace written by `das-jax "
                      "bench rollout` (its trace.jsonl)")
    try:
        config = load_config(args.config, args.overrides)
        if args.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {args.devices}")
    except ConfigError as e:
        return _error(str(e))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # analysis only: never grab an accelerator
    setup_console_logging()
    lengths = None
    if args.lengths:
        try:
            lengths = trace_lengths(args.lengths, args.paper_scale,
                                    config.rollout.max_new_tokens)
        except (ValueError, OSError) as e:
            msg = f"{e.strerror or e}" if isinstance(e, OSError) else str(e)
            for name in (f"trace {args.lengths}: ", f"{args.lengths}: "):
                msg = msg.removeprefix(name)       # named once, by the flag
            if "bench rollout" not in msg:         # the reader's message may name the fix
                msg += "; pass a trace written by `das-jax bench rollout` (its trace.jsonl)"
            return _error(f"--lengths {args.lengths}: {msg}")
    model_loading.fetch_named_source(config)   # its config is read from the file: not silently
    try:
        p = plan(config, args.devices, args.device_memory_gb, lengths)
    except (PlanError, ValueError, OSError) as e:
        return _error(str(e))
    print(json.dumps(p.to_json()) if args.json else p.table())
    if not p.fits:
        print(f"das-jax plan: does not fit: {one_line(p.advice(config))}", file=sys.stderr)
        return 1
    return 0
