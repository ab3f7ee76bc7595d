"""Argument definitions of `bench engine` and `bench replay` (no jax import here). The replay's
--c-base / --c-tok / --c-kv take `seconds` (a finite number >= 0), the rule a cost-model file
and a trace header's "cost_model" are checked by (`speculation.cost_file.cost_coefficients`)."""
from __future__ import annotations

import argparse
import math
from typing import Callable

from das_jax.arg_types import int_list, positive_int
from das_jax.errors import UserError


def finite_float(minimum: float = 0.0, *, strict: bool = False, unit: str = ""
                 ) -> Callable[[str], float]:
    """argparse `type=`: a finite float >= `minimum` (> `minimum` with `strict`); argparse puts
    the flag in front of the message (`argument --c-base: 'nan' is not a finite number >= 0`)."""
    what = f"a finite number {'>' if strict else '>='} {minimum:g}{unit}"

    def convert(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(v) or v < minimum or (strict and v == minimum):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    convert.__name__ = "number"
    return convert


seconds = finite_float(0.0, unit=" (seconds)")   # a cost-model coefficient given as a flag


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="named source, HF directory or GGUF file (default smollm2-135m-instruct)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and tokens (a smoke run)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens per sequence of the end-to-end runs (default 64, quick 16)")
    p.add_argument("--prompt-len", type=positive_int, default=100,
                   help="approximate prompt length (the verify step attends to this many cached "
                        "positions)")
    p.add_argument("--prompts", default=None, metavar="PATH",
                   help="GSM8K-format jsonl(.gz) whose first 16 questions are the end-to-end "
                        "prompts (default: 16 built-in seeded arithmetic problems)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--exact", action="store_true",
                   help="exact mode: shape-invariant contractions (README 'Exact mode')")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads for the HF run")
    p.add_argument("--paged", action="store_true",
                   help="also compare the paged KV cache with the dense one, side by side: the "
                        "verify step and Engine.generate at B=16 (rollout.kv_cache)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace .jsonl written by `bench rollout` (DIR/trace.jsonl)")
    p.add_argument("--drafters", default="none,ngram,suffix-global,das,das-unlimited",
                   help="comma-separated speculation names")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="das.KEY=VALUE",
                   help="override a das setting the trace was recorded with (repeatable), e.g. "
                   "das.policy.source_calibration=false")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="max_slots of the simulated engine (default: the trace's engine)")
    p.add_argument("--slots", type=int_list(example="16,64", as_text=True), default=None,
                   help="comma-separated max_slots values to sweep (overrides --batch)")
    p.add_argument("--draft-widths", type=int_list(as_text=True), default=None,
                   help="compiled widths, e.g. 1,4,8,16")
    p.add_argument("--cost-model", default=None, metavar="cpu|h100-7b|h200-7b|PATH.json",
                   help="the step-cost model the replay times steps with and DAS plans with: a "
                        "named model (das_jax.speculation.gpu_cost: cpu = SmolLM2-135M measured on a "
                        "2-core CPU; h100-7b / h200-7b = a 7B bf16 model derived from datasheet "
                        "figures) or a cost-model JSON file; default: the trace's fitted model "
                        "(--scale trace) or h100-7b (--scale paper)")
    p.add_argument("--c-base", type=seconds, default=None, help="cost model: seconds per step")
    p.add_argument("--c-tok", type=seconds, default=None,
                   help="cost model: seconds per verified token row")
    p.add_argument("--c-kv", type=seconds, default=None,
                   help="cost model: seconds per cached position per row")
    p.add_argument("--no-overheads", action="store_true",
                   help="leave out the trace's prefill and executor overheads (the measured "
                        "host time of the scheduler, drafter and policy stays in)")
    p.add_argument("--scale", choices=("trace", "paper"), default="trace",
                   help="trace: replay the recorded rollouts; paper: a resampled paper-scale "
                        "workload (128 problems x 16 samples, 16K tokens, long tail)")
    # --paper-* default to None so that giving one without --scale paper is refused
    # (`paper_defaults` fills in the values below).
    p.add_argument("--paper-problems", type=positive_int, default=None,
                   help="--scale paper: problems (default 128)")
    p.add_argument("--paper-samples", type=positive_int, default=None,
                   help="--scale paper: samples per problem (default 16)")
    p.add_argument("--paper-max-tokens", type=positive_int, default=None,
                   help="--scale paper: max tokens per rollout (default 16384)")
    p.add_argument("--paper-median", type=finite_float(0.0, strict=True), default=None,
                   help="--scale paper: median rollout length of the workload (tokens; default "
                        "4000)")
    p.add_argument("--paper-sigma", type=finite_float(0.0), default=None,
                   help="--scale paper: log-normal sigma of per-problem lengths (the long tail; "
                        "default 0.8)")
    p.add_argument("--paper-epochs", type=positive_int, default=None,
                   help="--scale paper: epochs of the workload (default: the trace's)")
    p.add_argument("--temperature", type=finite_float(0.0), default=None,
                   help="which recorded temperature to replay (default: all; with --scale "
                        "paper, the rollouts the workload is built from, default the lowest)")
    p.add_argument("--kv-cache", choices=("dense", "paged"), default="dense",
                   help="the simulated engine's KV cache: dense (every slot holds max_cache_len "
                        "positions) or paged (a page pool: admission by free pages, prompt pages "
                        "shared by a group, preemption when it runs short; steps priced by the "
                        "pages their rows read, as the GPU/TPU kernels read them)")
    p.add_argument("--page-size", type=positive_int, default=16,
                   help="positions per page of the paged cache")
    p.add_argument("--kv-rows", type=positive_int, default=None,
                   help="paged: a pool with the memory of this many dense rows (each "
                        "max_cache_len positions); default: one per slot (never runs short)")
    p.add_argument("--admit-longest-first", action="store_true",
                   help="a what-if: admit each epoch's requests in the order of their recorded "
                        "lengths, longest first (a clairvoyant length-aware admission; the "
                        "engine admits in the policy's order)")
    p.add_argument("--realtime", action="store_true",
                   help="sleep each device step's predicted time on another thread while the "
                        "host runs the work it overlaps, so the exposed host time is measured "
                        "(the replay then takes the predicted wall time)")
    p.add_argument("--no-overlap", action="store_true",
                   help="complete the drafter's appends before every draft (rollout.overlap_host:"
                        " false); default: index them while the device computes the next step")
    p.add_argument("--no-draft-ahead", action="store_true",
                   help="draft every row between two steps (rollout.draft_ahead: false); "
                        "default: the rows whose draft would go on are drafted while the "
                        "device computes, for the step's likely outcome")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


PAPER_DEFAULTS = {"paper_problems": 128, "paper_samples": 16, "paper_max_tokens": 16384,
                  "paper_median": 4000.0, "paper_sigma": 0.8, "paper_epochs": None}


def paper_defaults(args: argparse.Namespace) -> None:
    """Checks the --paper-* flags of `bench replay`: with --scale paper, fills in the defaults of
    those not given; without it, any given one is an error (it would be silently ignored).

    Raises:
      UserError: naming the flag and --scale paper."""
    paper = getattr(args, "scale", "trace") == "paper"
    for key, default in PAPER_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, default)
        elif not paper:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"{flag} shapes the paper-scale workload and has no effect on a "
                            f"trace replay; add --scale paper or drop {flag}")
