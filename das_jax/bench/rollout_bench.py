"""`das-jax bench rollout`: rollout time per drafter over RL epochs, side by side in one process.

The same problems are rolled out for E epochs (as in RL, where every problem recurs once per
epoch), for every drafter, with the same requests and seeds (`SamplingParams(seed=epoch)`: each
epoch samples fresh rollouts). Each drafter is one `Rollout` (`das_jax.rollout`) on the same
engine, kept across epochs (`advance_epoch()` after each), so its history accumulates. Drafters
are interleaved within an epoch (all drafters for epoch e, then e+1) so that slow drift of the
machine hits all of them.

Per epoch and drafter: rollout wall time (`GenerateStats.wall_s`, compile excluded), forward
passes, generated tokens, mean acceptance length (emitted tokens per row-step), drafter time,
speed-up vs `none`, the identity rate of the tokens against `none`, and the trace-replay
prediction of the same run (`replay.py`, cost model fitted once at start by
`Rollout.calibrate`).

Outputs (under --out): `rollout.json`, `rollout.md`, `trace.jsonl` (the `none` rollouts,
replayable with `das-jax bench replay`), `rollout_time.png`, `batch_width.png`, `speedup.png`;
after every epoch `progress.json` and `trace.partial.jsonl`; a markdown table on stdout.

The README benchmark is `--preset readme` (configs/bench-readme.yaml: 16
GSM8K train problems x 8 samples x 384 tokens, T=0.6, 4 epochs, all five drafters on the packed
step). It adds, in the same run and output:

* the outside reference (`--hf-reference`, `hf_reference.py`): HF transformers `generate` on the
  same prompts at the engine's batch (max_slots), right after `none` of epoch 0; `none`
  tokens/s of epoch 0 against HF tokens/s;
* per-epoch ratios (`rollout_report.speedup_summary`): every drafter vs `none`, `das` vs the best
  of ngram / suffix-global / das-unlimited, and over epochs 1-3; the share of rollouts identical
  to `none` and first divergences per 1,000 compared tokens (`rollout_report.divergence_stats`);
* the paper-scale replay of this run's trace (`--paper-replay cpu,h100-7b,h200-7b`,
  `paper_replay.py`): per cost model and epoch, das vs none and vs the best baseline on the
  predicted decode time, with the regime (which cost term dominates);
* `rollout.md` (targets table + paper-scale tables + per-epoch table) and `speedup.png`.

`--preset longtail` is the same benchmark in the paper's regime (configs/bench-longtail.yaml:
8 GSM8K train problems x 8 samples up to 1,024 tokens, 3 epochs): most rollouts end on their
own and a few run long, so the batch thins to stragglers. Every run logs, per epoch, the
lengths of `none`'s rollouts (median, p90, max, share at the cap: `rollout_report.length_stats`;
every drafter's in `rollout.json`). `--load-cores N` runs a deterministic co-tenant (N
processes spinning one core each, `co_tenant.CoTenant`) for the whole run and records it.

A drafter named `X+head` (e.g. `das+head`, with `--set draft_head.path=HEAD.safetensors`) is
speculation X with the EAGLE-3 draft head beside it (`Rollout.attach_draft_head`); it is
measured like the others and left out of the replays (a trace holds no policy features).
`das+head+tree` is `das+head` with `das.policy.tree` on: a row may verify the head's and the
history's drafts in one step (a two-branch token tree), side by side with `das+head`.

`--update-policy` runs one GRPO update (`GRPOTrainer.score` + `GRPOTrainer.update`) on the `none`
rollouts of each epoch (all of them as one batch) before the next epoch, so the policy drifts as
in training; every drafter then samples from the same updated params.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from das_jax.bench import rollout_report as rr
from das_jax.bench import paper_replay as pr
from das_jax.bench import hf_reference as hr
from das_jax.bench.co_tenant import CoTenant
from das_jax.config import (ConfigError, DASSection, apply_compilation_cache, apply_platform,
                            load_config)
from das_jax.data import load_dataset_from_config, render_prompt
from das_jax.errors import UserError
from das_jax.models.tokenizer import encode_prompt
from das_jax.rollout import speculation_names
from das_jax.speculation import resolve_cost_model

DEFAULT_DRAFTERS = "none,ngram,suffix-global,das,das-unlimited"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML run config (model/data/rollout/grpo/das sections); default: "
                        "configs/bench-gsm8k-rollout.yaml")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                   help=f"comma-separated speculation names (default {DEFAULT_DRAFTERS}); "
                        "'none' is always run (the reference)")
    p.add_argument("--epochs", type=int, default=None,
                   help="RL epochs over the problems (default 4; --preset longtail: 3)")
    p.add_argument("--num-problems", type=int, default=None, help="override data.limit")
    p.add_argument("--num-generations", type=int, default=None,
                   help="samples per problem (override grpo.num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="override rollout.max_new_tokens")
    p.add_argument("--temperatures", default=None,
                   help="comma-separated temperatures (default: rollout.temperature)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set rollout.max_slots=16 (repeatable)")
    p.add_argument("--update-policy", action="store_true",
                   help="run a GRPO update between epochs (the policy drifts as in training)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip cost-model calibration (DAS plans with the default prior)")
    p.add_argument("--cost-model", default=None, metavar="cpu|h100-7b|h200-7b|PATH.json",
                   help="plan DAS (and time the replay prediction) with this step-cost model "
                        "instead of calibrating one on this machine (das.cost_model.source)")
    p.add_argument("--exact", action="store_true",
                   help="exact mode (rollout.exact=true): rollouts must be 100%% identical")
    p.add_argument("--preset", choices=("readme", "longtail"), default=None,
                   help="readme: the README benchmark -- config "
                        "configs/bench-readme.yaml (16 GSM8K problems x 8 samples x 384 tokens, "
                        "T=0.6), 4 epochs, all five drafters, the HF transformers reference and "
                        "the paper-scale replay under cpu, h100-7b and h200-7b; longtail: the "
                        "same in the paper's regime -- configs/bench-longtail.yaml (8 problems x "
                        "8 samples up to 1,024 tokens, a long tail of lengths), 3 epochs; "
                        "explicit flags override either. The report's targets table uses the "
                        "preset's targets (without one: readme's)")
    p.add_argument("--load-cores", type=int, default=0, metavar="N",
                   help="a deterministic co-tenant: N processes each spinning one core for the "
                        "run's duration (a reproducible 'under load' measurement; 0: none)")
    p.add_argument("--hf-reference", action="store_true", default=None,
                   help="also sample the same prompts with HF transformers `generate` (torch, "
                        "CPU) at the engine's batch, right after `none` of epoch 0: the outside "
                        "reference")
    p.add_argument("--no-hf-reference", dest="hf_reference", action="store_false",
                   help="skip the HF reference (also under --preset readme)")
    p.add_argument("--hf-batches", type=int, default=None,
                   help="HF reference: only the first N batches of max_slots requests "
                        "(default: all; a preset: 1)")
    p.add_argument("--hf-threads", type=int, default=2, help="torch threads of the HF reference")
    p.add_argument("--paper-replay", default=None, metavar="MODELS",
                   help="comma-separated cost models (cpu,h100-7b,h200-7b or cost-model .json "
                        "files): replay this run's trace at paper scale under each, at the end")
    p.add_argument("--paper-problems", type=int, default=16,
                   help="paper-scale replay: synthetic problems (default 16)")
    p.add_argument("--paper-samples", type=int, default=8,
                   help="paper-scale replay: samples per problem (default 8)")
    p.add_argument("--paper-max-tokens", type=int, default=16384,
                   help="paper-scale replay: max tokens per rollout (default 16384)")
    p.add_argument("--paper-slots", type=int, default=128,
                   help="paper-scale replay: max_slots of the simulated engine (default 128)")
    p.add_argument("--out", default="bench_out/rollout", help="output directory")


# ----------------------------------------------------------------------------- core

@dataclasses.dataclass
class BenchSetup:
    """Everything the core needs, independent of how the model and problems were obtained."""

    rollout: Any                                 # das_jax.rollout.Rollout (any speculation)
    prompts: list[tuple[Any, tuple[int, ...]]]   # (problem_id, prompt ids) per problem
    drafters: list[str]
    epochs: int
    temperatures: list[float]
    num_generations: int
    max_new_tokens: int
    top_p: float = 1.0
    top_k: int = 0
    das: Any = None                              # das_jax.config.DASSection (None: defaults)
    model_name: str = ""
    calibrate: bool = True
    update_fn: Callable | None = None            # (outputs, params) -> params, between epochs
    # The outside reference, run once after epoch 0 of the first temperature:
    # (requests, SamplingParams, batch) -> `hf_reference.hf_rollout_tok_s` dict (None: skipped).
    reference_fn: Callable | None = None
    paper: "PaperSpec | None" = None             # paper-scale replay of this run's trace
    load_cores: int = 0                          # cores a co-tenant spins (`co_tenant`)
    targets: str = "readme"                      # the report's targets: `rollout_report.TARGETS`
    # (DraftHead, steps, scale, dtype) for the drafters named "X+head": X with the head beside
    # it (`Rollout.attach_draft_head`); None: no such drafter.
    head: tuple | None = None


HEAD_SUFFIX = "+head"
TREE_SUFFIX = "+head+tree"
TREE_SPECULATIONS = ("das",)     # the DAS policy's `tree` setting: a speculation planned by it


def head_variant(name: str) -> tuple[str, bool, bool]:
    """(speculation, with the draft head beside it, as a token tree) of a drafter name of the
    benchmark: X, X+head or X+head+tree."""
    if name.endswith(TREE_SUFFIX):
        return name[:-len(TREE_SUFFIX)], True, True
    if name.endswith(HEAD_SUFFIX):
        return name[:-len(HEAD_SUFFIX)], True, False
    return name, False, False


def _bench_rollout(base, name: str, das, head):
    """The rollout of drafter `name` on `base`'s engine: a speculation, "X+head" (X with the
    draft head `head` = (DraftHead, steps, scale, dtype) beside it) or "X+head+tree" (that,
    with `das.policy.tree` on)."""
    spec, with_head, tree = head_variant(name)
    if not with_head:
        return base.with_speculation(name, das)
    if tree:
        das = dataclasses.replace(das, policy=dataclasses.replace(das.policy, tree=True))
    rollout = base.with_speculation(spec, das)
    rollout.attach_draft_head(*head)
    return rollout


@dataclasses.dataclass
class PaperSpec:
    """The paper-scale replay run at the end of the benchmark on its own trace (first
    temperature): `replay.paper_workload` settings, the simulated engine, the cost models."""

    cost_models: tuple[str, ...] = ("cpu", "h100-7b", "h200-7b")
    problems: int = 16
    samples: int = 8
    max_tokens: int = 16384
    median: float = 4000.0
    sigma: float = 0.8
    epochs: int | None = None     # the trace's first epochs to replay (None: all)
    slots: int = 128
    widths: tuple[int, ...] = (1, 4, 8, 16)


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_bench(setup: BenchSetup, out_dir: str | None = None, log: Callable = print) -> dict:
    """Runs the benchmark; returns the result dict (also written to out_dir, with trace + PNGs)."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.bench import replay as rp
    from das_jax.engine import Request, SamplingParams

    base = setup.rollout.with_speculation("none")
    das = setup.das if setup.das is not None else DASSection()
    names = ["none"] + [d for d in setup.drafters if d != "none"]
    ec = base.engine_config
    requests = [Request(tuple(ids), problem_id=pid, sample_index=g)
                for pid, ids in setup.prompts for g in range(setup.num_generations)]
    result: dict[str, Any] = {
        "model": setup.model_name, "drafters": names, "epochs": setup.epochs,
        "num_problems": len(setup.prompts), "num_generations": setup.num_generations,
        "targets": setup.targets,
        "max_new_tokens": setup.max_new_tokens, "temperatures": setup.temperatures,
        "engine": {"max_slots": ec.max_slots, "max_cache_len": ec.max_cache_len,
                   "draft_widths": list(ec.draft_widths), "exact": ec.exact,
                   "verify": "packed"},
        "das": dataclasses.asdict(das), "update_policy": setup.update_fn is not None,
        "load_cores": setup.load_cores,
        "runs": [],
    }
    trace_rollouts: list = []
    base_cm = base.cost_model
    if setup.calibrate:
        t0 = time.perf_counter()
        s0 = SamplingParams(temperature=setup.temperatures[0], top_p=setup.top_p,
                            top_k=setup.top_k, max_new_tokens=setup.max_new_tokens)
        base.calibrate(requests, s0)
        result["calibrate_s"] = time.perf_counter() - t0
        log(f"cost model calibrated in {result['calibrate_s']:.1f}s: c_base={base_cm.c_base * 1e3:.2f} ms"
            f", c_tok={base_cm.c_tok * 1e3:.3f} ms/token-row, c_kv={base_cm.c_kv * 1e6:.3f} us/pos-row")
    coef = base_cm.to_dict()
    result["cost_model"] = coef
    # Every drafter plans with the coefficients fitted once above (no calibration of its own).
    das_fitted = dataclasses.replace(das, cost_model=dataclasses.replace(
        das.cost_model, calibrate=False, **coef))
    step_traces: dict = {}

    for temp in setup.temperatures:
        rollouts = {name: _bench_rollout(base, name, das_fitted, setup.head) for name in names}
        params = base.params
        measured: dict[str, list] = {n: [] for n in names}
        none_epochs: dict[int, list] = {}
        for epoch in range(setup.epochs):
            sampling = SamplingParams(temperature=temp, top_p=setup.top_p, top_k=setup.top_k,
                                      max_new_tokens=setup.max_new_tokens, seed=epoch)
            ref = None
            for name in names:
                outputs, stats = rollouts[name].generate(requests, params, sampling)
                rollouts[name].advance_epoch()
                if name == "none":
                    ref = outputs
                    none_epochs[epoch] = [
                        rp.TraceRollout(epoch, o.request.problem_id, o.request.sample_index,
                                        o.request.prompt_ids, tuple(o.token_ids), o.finish_reason,
                                        float(temp)) for o in outputs]
                same = [o.token_ids == r.token_ids for o, r in zip(outputs, ref)]
                div = rr.divergence_stats([o.token_ids for o in outputs],
                                          [r.token_ids for r in ref])
                diffs = [{"request": i, "problem_id": outputs[i].request.problem_id,
                          "sample_index": outputs[i].request.sample_index,
                          "first_diff": _first_diff(outputs[i].token_ids, ref[i].token_ids),
                          "len": len(outputs[i].token_ids), "len_none": len(ref[i].token_ids)}
                         for i, s in enumerate(same) if not s]
                lengths = rr.length_stats([len(o.token_ids) for o in outputs],
                                          setup.max_new_tokens)
                row = {"temperature": temp, "epoch": epoch, "drafter": name,
                       **stats.to_dict(), "identity_rate": float(np.mean(same)),
                       "lengths": lengths,
                       "divergence": div, "identity_diffs": diffs[:20],
                       "loadavg_1m": os.getloadavg()[0]}
                if epoch == setup.epochs - 1 or epoch == 0:
                    step_traces[(temp, epoch, name)] = [
                        (s.active, s.batch, s.width, s.seconds) for s in stats.steps]
                measured[name].append(row)
                log(f"T={temp} epoch {epoch} {name:14} wall {stats.wall_s:7.2f}s  passes "
                    f"{stats.forward_passes:5d}  tokens {stats.generated_tokens:6d}  accept len "
                    f"{stats.acceptance_length:.2f}  draft {stats.draft_s:.2f}s"
                    + (f"  split {stats.split_steps}" if stats.split_steps else "")
                    + (f" (+ head admissions {stats.draft_model_s:.2f}s)"
                       if stats.draft_model_s else "") + "  identity "
                    f"{row['identity_rate']:.1%} ({div['divergences_per_1k']:.2f} div/1k tok)  "
                    f"(compile {stats.compile_s:.1f}s; load {row['loadavg_1m']:.1f})")
                if name == "none":
                    log(f"    lengths: median {lengths['median']:.0f}, p90 {lengths['p90']}, "
                        f"max {lengths['max']} ({lengths['max_over_median']:.1f}x the median),"
                        f" {lengths['at_cap_share']:.0%} at the {setup.max_new_tokens}-token cap")
                for d in diffs[:5]:
                    log(f"    differs: request {d['request']} (problem {d['problem_id']}, sample "
                        f"{d['sample_index']}) at token {d['first_diff']}")
                if (name == "none" and setup.reference_fn is not None and epoch == 0
                        and temp == setup.temperatures[0] and "hf_reference" not in result):
                    # Right after `none` of epoch 0: the two measurements sit side by side in time.
                    _hf_reference(setup, requests, sampling, ec.max_slots, row, result, log)
            log(epoch_line(temp, epoch, {n: [r["wall_s"] for r in measured[n]] for n in names}))
            if out_dir:
                _checkpoint(out_dir, result, measured, none_epochs, trace_rollouts, coef, das,
                            setup, temp)
            if setup.update_fn is not None and epoch < setup.epochs - 1:
                t0 = time.perf_counter()
                params = setup.update_fn(ref, params)
                log(f"T={temp} epoch {epoch}: GRPO update in {time.perf_counter() - t0:.1f}s")
        _add_replay(result, measured, none_epochs, names, ec, setup, coef, das, temp)
        for e in sorted(none_epochs):
            trace_rollouts.extend(none_epochs[e])

    result["step_traces"] = {f"T={t}|epoch={e}|{n}": v for (t, e, n), v in step_traces.items()}
    result["table"] = markdown_table(result)
    summarize_measured(result)
    if setup.paper is not None:
        header = {"cost_model": coef, "das": dataclasses.asdict(das)}
        result["paper"] = run_paper(rp.Trace(header, trace_rollouts),
                                    [n for n in names if not head_variant(n)[1]],
                                    setup.max_new_tokens, das, setup.paper, log)
    result["report"] = report_markdown(result)
    if out_dir:
        _write_outputs(out_dir, result, setup, coef, das, trace_rollouts)
    return result


def _hf_reference(setup: BenchSetup, requests, sampling, batch: int, none_row: dict,
                  result: dict, log: Callable) -> None:
    """Runs `setup.reference_fn` (HF transformers generate) on the requests at `batch` (the
    engine's slots); stores it in `result["hf_reference"]` beside `none`'s tokens per second."""
    temp = sampling.temperature
    log(f"T={temp}: HF transformers generate on the same prompts (batch {batch}), the outside "
        "reference")
    hf = setup.reference_fn(requests, sampling, batch)
    if hf is None:
        return
    hf["none_tok_s"] = none_row["generated_tokens"] / max(none_row["wall_s"], 1e-9)
    hf["hf_tok_s"] = hf["tok_s"]
    hf["temperature"] = temp
    result["hf_reference"] = hf
    log(f"T={temp}: none {hf['none_tok_s']:.1f} tok/s vs HF generate {hf['hf_tok_s']:.1f} tok/s"
        f" at batch {hf['batch']} ({hf['none_tok_s'] / max(hf['hf_tok_s'], 1e-9):.2f}x)")


def _add_replay(result: dict, measured: dict, none_epochs: dict, names: list[str], ec,
                setup: BenchSetup, coef: dict, das, temp: float) -> None:
    """Adds temperature `temp`'s rows to `result["runs"]` with the replay's predictions beside
    the measurements (speedups, prediction ratios), and the overheads (prefill per token, host
    time per step outside the scheduler, drafter and policy, whose host time the replay
    measures itself) measured from the `none` run of epoch 0 that the replay charges."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.bench import replay as rp

    sim0 = rp.simulate(none_epochs[0], ec, setup.max_new_tokens, rp.FrozenCostModel.of(coef))
    m0 = measured["none"][0]
    overheads = {
        "prefill_s_per_token": m0["prefill_s"] / max(sim0.prefill_tokens, 1),
        "host_s_per_step": max(0.0, (m0["wall_s"] - m0["decode_s"] - m0["prefill_s"]
                                     - m0["host_s"]) / max(m0["forward_passes"], 1)),
    }
    # the replay runs history drafters on the recorded tokens; a draft head needs the
    # policy's features, which a trace does not hold, so "X+head" rows are measured only
    replayed = [n for n in names if not head_variant(n)[1]]
    predicted = rp.replay_epochs(none_epochs, replayed, ec, setup.max_new_tokens, coef, das,
                                 overheads)
    for name in names:
        for row in measured[name]:
            none_row = measured["none"][row["epoch"]]
            row["speedup"] = none_row["wall_s"] / max(row["wall_s"], 1e-9)
            if name in predicted:
                pred = predicted[name][row["epoch"]]
                row["replay"] = pred
                row["replay_ratio"] = pred["predicted_s"] / max(row["wall_s"], 1e-9)
                row["replay_decode_ratio"] = pred["decode_s"] / max(row["decode_s"], 1e-9)
                row["replay_passes_match"] = pred["forward_passes"] == row["forward_passes"]
                row["predicted_speedup"] = (predicted["none"][row["epoch"]]["predicted_s"]
                                            / max(pred["predicted_s"], 1e-9))
            result["runs"].append(row)
    result.setdefault("overheads", {})[str(temp)] = overheads


def _write_outputs(out_dir: str, result: dict, setup: BenchSetup, coef: dict, das,
                   trace_rollouts: list) -> None:
    """Writes `trace.jsonl`, `rollout.json`, the PNG plots and `rollout.md` under `out_dir`."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.bench import replay as rp

    os.makedirs(out_dir, exist_ok=True)
    header = {"model": setup.model_name, "cost_model": coef,
              "engine": result["engine"], "max_new_tokens": setup.max_new_tokens,
              "das": dataclasses.asdict(das),
              "overheads": result["overheads"][str(setup.temperatures[0])],
              "overheads_by_temperature": result["overheads"],
              "num_generations": setup.num_generations}
    rp.write_trace(os.path.join(out_dir, "trace.jsonl"), header, trace_rollouts)
    with open(os.path.join(out_dir, "rollout.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    plot_rollout(result, out_dir)
    with open(os.path.join(out_dir, "rollout.md"), "w") as f:
        f.write(result["report"] + "\n\n" + result["table"] + "\n")


def _checkpoint(out_dir: str, result: dict, measured: dict, none_epochs: dict,
                trace_rollouts: list, coef: dict, das, setup: BenchSetup, temp) -> None:
    """After every epoch: `progress.json` (the measured rows so far, the HF reference) and
    `trace.partial.jsonl` (the `none` rollouts so far, replayable with `bench replay`), so that a
    run stopped early still leaves its numbers."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.bench import replay as rp
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "progress.json"), "w") as f:
        json.dump({"temperature": temp, "measured": measured,
                   "hf_reference": result.get("hf_reference"), "cost_model": coef}, f, indent=1,
                  default=str)
    header = {"model": setup.model_name, "cost_model": coef, "engine": result["engine"],
              "max_new_tokens": setup.max_new_tokens, "das": dataclasses.asdict(das),
              "num_generations": setup.num_generations}
    rolls = list(trace_rollouts) + [r for e in sorted(none_epochs) for r in none_epochs[e]]
    rp.write_trace(os.path.join(out_dir, "trace.partial.jsonl"), header, rolls)


def markdown_table(result: dict) -> str:
    lines = ["| T | epoch | drafter | wall s | passes | tokens | accept len | draft s | speed-up "
             "| identity | replay s (ratio) | replay speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(
            f"| {r['temperature']} | {r['epoch']} | {r['drafter']} | {r['wall_s']:.2f} | "
            f"{r['forward_passes']} | {r['generated_tokens']} | {r['acceptance_length']:.2f} | "
            f"{r['draft_s']:.2f} | {r['speedup']:.2f}x | {r['identity_rate']:.1%} | "
            + (f"{r['replay']['predicted_s']:.2f} ({r['replay_ratio']:.2f}) | "
               f"{r['predicted_speedup']:.2f}x |" if "replay" in r else "- | - |"))
    # totals per drafter and temperature
    lines += ["", "| T | drafter | total wall s | speed-up vs none | total replay s | identity |",
              "|---|---|---|---|---|---|"]
    for t in result["temperatures"]:
        none_total = sum(r["wall_s"] for r in result["runs"]
                         if r["temperature"] == t and r["drafter"] == "none")
        for name in result["drafters"]:
            rs = [r for r in result["runs"] if r["temperature"] == t and r["drafter"] == name]
            tot = sum(r["wall_s"] for r in rs)
            rep = (f"{sum(r['replay']['predicted_s'] for r in rs):.2f}"
                   if all("replay" in r for r in rs) else "-")
            ident = np.mean([r["identity_rate"] for r in rs])
            lines.append(f"| {t} | {name} | {tot:.2f} | {none_total / max(tot, 1e-9):.2f}x | "
                         f"{rep} | {ident:.1%} |")
    return "\n".join(lines)


def epoch_line(temp, epoch: int, walls: dict[str, list[float]]) -> str:
    """One log line after an epoch: every drafter's speed-up over none in it, and das over the
    best baseline (ngram / suffix-global / das-unlimited) in it."""
    s = rr.speedup_summary({n: [w[epoch]] for n, w in walls.items()}, later_epochs=(0, 0))
    parts = [f"{n} {s['per_epoch'][n][0]:.2f}x" for n in walls if n != "none"]
    line = f"T={temp} epoch {epoch} vs none: " + ", ".join(parts)
    if s["subject_vs_best"][0] is not None:
        line += f"; das / best baseline ({s['best_baseline'][0]}) {s['subject_vs_best'][0]:.2f}x"
    return line


def summarize_measured(result: dict) -> dict:
    """Adds result["summary"][T] = {"speedups": `speedup_summary` of wall times, "identity":
    drafter -> merged `divergence_stats` over epochs} and result["targets"] (first temperature)."""
    result["summary"] = {}
    for t in result["temperatures"]:
        times, ident = {}, {}
        for name in result["drafters"]:
            rs = sorted((r for r in result["runs"] if r["temperature"] == t
                         and r["drafter"] == name), key=lambda r: r["epoch"])
            times[name] = [r["wall_s"] for r in rs]
            if name != "none":
                ident[name] = rr.merge_divergence_stats(r["divergence"] for r in rs)
        result["summary"][str(t)] = {"speedups": rr.speedup_summary(times), "identity": ident}
    return result


def run_paper(trace, names, max_new_tokens: int, das, spec: "PaperSpec", log=print) -> dict:
    """The paper-scale replay of `trace` (`replay.paper_workload`) under every model of
    `spec.cost_models` (`paper_replay.replay_models`); returns {"settings", "models"}."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.bench import replay as rp
    from das_jax.engine import EngineConfig, cache_len_for

    t0 = time.perf_counter()
    epochs = rp.paper_workload(trace, problems=spec.problems, samples=spec.samples,
                               max_tokens=spec.max_tokens, median_len=spec.median,
                               sigma=spec.sigma, epochs=spec.epochs)
    lens = [len(r.token_ids) for rs in epochs.values() for r in rs]
    max_prompt = max(len(r.prompt_ids) for rs in epochs.values() for r in rs)
    ec = EngineConfig(max_slots=spec.slots, draft_widths=tuple(spec.widths),
                      max_cache_len=cache_len_for(EngineConfig().max_cache_len, spec.widths,
                                                  max_prompt, spec.max_tokens))
    models = {m: resolve_cost_model(m) for m in spec.cost_models}
    log(f"paper-scale replay: {len(epochs)} epochs x {spec.problems} problems x {spec.samples} "
        f"samples, length mean {np.mean(lens):.0f} / p90 {np.percentile(lens, 90):.0f} / max "
        f"{max(lens)} tokens, {spec.slots} slots, widths {list(spec.widths)}, packed step; "
        f"cost models {', '.join(models)}")
    replayed = pr.summarize(pr.replay_models(epochs, names, ec, spec.max_tokens, models, das,
                                             log=log))
    for m, r in replayed.items():
        s = r["summary"]
        log(f"paper replay {m} [{r['regime']}]: das / none per epoch "
            + " / ".join(f"{x:.2f}x" for x in s["per_epoch"].get("das", []))
            + "; das / best baseline per epoch "
            + " / ".join("n/a" if x is None else f"{x:.2f}x ({b})"
                         for x, b in zip(s["subject_vs_best"], s["best_baseline"])))
    return {"settings": dataclasses.asdict(spec), "workload": {
                "rollouts_per_epoch": len(next(iter(epochs.values()))),
                "length_mean": float(np.mean(lens)), "length_p90": float(np.percentile(lens, 90)),
                "length_max": int(max(lens))},
            "sim_s": time.perf_counter() - t0, "models": replayed}


def report_markdown(result: dict) -> str:
    """The benchmark's report: the targets table (first temperature; the targets of the preset
    the run used, `rollout_report.TARGETS[result["targets"]]`), identity per drafter, the HF
    reference and the paper-scale replay per cost model."""
    t = str(result["temperatures"][0])
    summ = result["summary"][t]
    hf = result.get("hf_reference")
    paper = result.get("paper", {}).get("models")
    preset = result.get("targets", "readme")
    rows = rr.targets_rows(summ["speedups"], hf, summ["identity"], paper, rr.TARGETS[preset])
    out = [f"### Targets of `--preset {preset}` (T={t}, {result['num_problems']} problems x "
           f"{result['num_generations']} samples x {result['max_new_tokens']} tokens x "
           f"{result['epochs']} epochs)", "",
           rr.targets_markdown(rows)]
    if paper:
        w = result["paper"]["workload"]
        st = result["paper"]["settings"]
        out += ["", f"### Paper-scale replay of this run's trace ({w['rollouts_per_epoch']} "
                f"rollouts per epoch, length mean {w['length_mean']:.0f} / p90 "
                f"{w['length_p90']:.0f} / max {w['length_max']}, {st['slots']} slots, widths "
                f"{st['widths']}; decode time under each cost model)", pr.markdown(paper)]
    return "\n".join(out)


def _save_figure(fig, out_dir: str, name: str) -> str:
    """Saves `fig` as out_dir/name (110 dpi), closes it and returns the path."""
    # deferred import: matplotlib (not loaded by importing this module)
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rollout(result: dict, out_dir: str) -> list[str]:
    # deferred import: matplotlib (not loaded by importing this module)
    import matplotlib
    matplotlib.use("Agg")
    # deferred import: matplotlib (not loaded by importing this module)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    temps = result["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for name in result["drafters"]:
            rs = [r for r in result["runs"] if r["temperature"] == t and r["drafter"] == name]
            ax.plot([r["epoch"] for r in rs], [r["wall_s"] for r in rs], marker="o", label=name)
        ax.set_xlabel("epoch")
        ax.set_ylabel("rollout wall time (s)")
        ax.set_title(f"rollout time per epoch, T={t}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(_save_figure(fig, out_dir, "rollout_time.png"))

    # batch size and draft width over one rollout (last epoch, first temperature)
    t, e = temps[0], result["epochs"] - 1
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in result["drafters"]:
        st = result["step_traces"].get(f"T={t}|epoch={e}|{name}")
        if not st:
            continue
        arr = np.asarray(st, np.float64)
        x = np.cumsum(arr[:, 3])
        a1.step(x, arr[:, 0], where="post", label=name)
        a2.step(x, arr[:, 2], where="post", label=name)
    a1.set_ylabel("active rows")
    a1.set_title(f"batch and draft width over one rollout (T={t}, epoch {e}); the tail is the "
                 "right end")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.set_ylabel("step width W")
    a2.set_xlabel("decode time (s)")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(_save_figure(fig, out_dir, "batch_width.png"))

    # speed-up over none per epoch: measured (first temperature) and each paper-scale model
    panels = []
    if result.get("summary"):
        panels.append((f"measured, T={temps[0]}",
                       result["summary"][str(temps[0])]["speedups"]["per_epoch"]))
    for m, r in (result.get("paper") or {}).get("models", {}).items():
        panels.append((f"paper replay, {m}", r["summary"]["per_epoch"]))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (title, per_epoch) in zip(axes[0], panels):
            for name, ys in per_epoch.items():
                ax.plot(range(len(ys)), ys, marker="o", label=name)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("epoch")
            ax.set_ylabel("speed-up over none")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save_figure(fig, out_dir, "speedup.png"))
    return paths


# ----------------------------------------------------------------------------- CLI

def default_config_path() -> str:
    """configs/bench-gsm8k-rollout.yaml of the checkout this package runs from."""
    return os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                        "bench-gsm8k-rollout.yaml")


def _make_update_fn(cfg, model, problems_by_id):
    # deferred import: jax, optax, orbax (not loaded by importing this module)
    from das_jax.rl.trainer import GRPOTrainer

    problems = list(problems_by_id.values())
    trainer = GRPOTrainer(cfg, model=model, problems=problems)

    def update(outputs, params):
        trainer.params = params
        rb = trainer.score([problems_by_id[o.request.problem_id] for o in outputs], outputs)
        metrics = trainer.update(rb)
        print(f"  GRPO update: reward mean {float(np.mean(rb.rewards)):.3f}, "
              f"loss {metrics.get('loss')}", flush=True)
        return trainer.params

    return update


#: `--preset` name -> (config file under configs/, epochs).
PRESETS = {"readme": ("bench-readme.yaml", 4), "longtail": ("bench-longtail.yaml", 3)}


def readme_config_path(preset: str = "readme") -> str:
    """The preset's config (configs/bench-readme.yaml, ...) of the checkout this package runs
    from."""
    return os.path.join(os.path.dirname(__file__), "..", "..", "configs", PRESETS[preset][0])


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the options `--preset` implies where the command line left them unset (every
    preset: its config and epochs, the HF reference on one batch, the paper-scale replay under
    cpu, h100-7b and h200-7b)."""
    if args.epochs is None:
        args.epochs = PRESETS[args.preset][1] if args.preset else 4
    if args.preset in PRESETS:
        if args.config is None:
            args.config = readme_config_path(args.preset)
        if args.hf_reference is None:
            args.hf_reference = True
        if args.hf_batches is None:
            args.hf_batches = 1
        if args.paper_replay is None:
            args.paper_replay = "cpu,h100-7b,h200-7b"
    return args


def _make_reference_fn(model_source: str, tokenizer, batches: int | None, threads: int, log):
    """The HF reference as a `BenchSetup.reference_fn`; None (with a one-line message) when
    torch / transformers are missing or cannot load the model."""

    def run(requests, sampling, batch):
        try:
            model, load_s = hr.load_hf_model(model_source, threads)
        except hr.HFUnavailable as e:
            log(str(e))
            return None
        log(f"  HF model loaded in {load_s:.1f}s")
        res = hr.hf_rollout_tok_s(model, [r.prompt_ids for r in requests], batch,
                                  sampling.max_new_tokens, sampling.temperature, sampling.top_p,
                                  sampling.top_k, tokenizer.eos_token_ids,
                                  tokenizer.pad_token_id, seed=0, max_batches=batches, log=log)
        del model
        gc.collect()
        return res

    return run


def main(args: argparse.Namespace) -> int:

    args = apply_preset(args)
    if args.load_cores < 0:
        print(f"das-jax bench rollout: --load-cores must be >= 0, got {args.load_cores}",
              file=sys.stderr)
        return 2
    paper = None
    if args.paper_replay:
        models = tuple(m.strip() for m in args.paper_replay.split(",") if m.strip())
        try:
            for m in models:
                resolve_cost_model(m)
        except (OSError, ValueError) as e:
            print(f"das-jax bench rollout: --paper-replay: {e}", file=sys.stderr)
            return 2
        paper = PaperSpec(cost_models=models, problems=args.paper_problems,
                          samples=args.paper_samples, max_tokens=args.paper_max_tokens,
                          slots=args.paper_slots)
    overrides = list(args.overrides)
    if args.num_problems is not None:
        overrides.append(f"data.limit={args.num_problems}")
    if args.num_generations is not None:
        overrides.append(f"grpo.num_generations={args.num_generations}")
    if args.max_new_tokens is not None:
        overrides += [f"rollout.max_new_tokens={args.max_new_tokens}",
                      f"grpo.max_completion_length={args.max_new_tokens}"]
    if args.cost_model is not None:
        overrides += [f"das.cost_model.source={args.cost_model}",
                      "das.cost_model.calibrate=false"]
    try:
        cfg = load_config(args.config or default_config_path(), overrides)
    except ConfigError as e:
        print(f"das-jax bench rollout: {e}", file=sys.stderr)
        return 2
    apply_platform(cfg)
    apply_compilation_cache(cfg)
    temps = ([float(t) for t in args.temperatures.split(",")] if args.temperatures
             else [cfg.rollout.temperature])
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    bad = [d for d in drafters if head_variant(d)[0] not in speculation_names()
           or head_variant(d)[2] and head_variant(d)[0] not in TREE_SPECULATIONS]
    if bad:
        print(f"das-jax bench rollout: unknown drafter(s) {bad}; valid: "
              f"{', '.join(speculation_names())}, each also as NAME{HEAD_SUFFIX} (with "
              "--set draft_head.path=HEAD.safetensors), and "
              + ", ".join(n + TREE_SUFFIX for n in TREE_SPECULATIONS), file=sys.stderr)
        return 2
    head_cfg = cfg.draft_head
    with_head = [d for d in drafters if head_variant(d)[1]]
    if with_head and head_cfg.path is None:
        print(f"das-jax bench rollout: drafter(s) {with_head} need a draft head; add --set "
              "draft_head.path=HEAD.safetensors (`das-jax draft-head fit`)", file=sys.stderr)
        return 2
    # the base rollouts run without the head; the "X+head" drafters attach it
    cfg = dataclasses.replace(cfg, draft_head=dataclasses.replace(head_cfg, path=None))
    fitted = None
    if with_head:   # read before the model loads: a corrupt file fails fast
        # deferred import: draft_head.store (jax, through the head's config; the CLI's
        # registration imports this module without jax), only when a head is asked for
        from das_jax.draft_head.store import check_head_for_policy, load_head
        try:
            fitted = load_head(head_cfg.path)
        except UserError as e:
            print(f"das-jax bench rollout: {e}", file=sys.stderr)
            return 2

    # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp
    from das_jax.models import load
    from das_jax.rollout import rollout_from_config

    t0 = time.perf_counter()
    model_config, params, tokenizer = load(cfg.model.source, dtype=getattr(jnp, cfg.model.dtype))
    d = cfg.data
    problems = load_dataset_from_config(d.kind, d.path, num_problems=d.num_problems,
                                        limit=d.limit, seed=d.seed)
    prompts = []
    for p in problems:
        text = render_prompt(p, tokenizer if d.chat else None, instruction=d.instruction,
                             chat=d.chat)
        prompts.append((p.problem_id, tuple(encode_prompt(tokenizer, text, chat=d.chat))))
    r = cfg.rollout
    if args.exact and not cfg.rollout.exact:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, exact=True))
    rollout = rollout_from_config(cfg, model_config, params, tokenizer.eos_token_ids,
                                  speculation="none")
    print(f"loaded {cfg.model.source} and {len(problems)} problems in "
          f"{time.perf_counter() - t0:.1f}s; prompts {min(len(p) for _, p in prompts)}-"
          f"{max(len(p) for _, p in prompts)} tokens", flush=True)
    head = None
    if fitted is not None:
        try:
            check_head_for_policy(fitted, head_cfg.path, cfg.model.source, model_config)
        except UserError as e:
            print(f"das-jax bench rollout: {e}", file=sys.stderr)
            return 2
        head = (fitted, head_cfg.steps, head_cfg.scale, head_cfg.dtype or cfg.model.dtype)
    update_fn = None
    if args.update_policy:
        update_fn = _make_update_fn(cfg, (model_config, params, tokenizer),
                                    {p.problem_id: p for p in problems})
    setup = BenchSetup(
        rollout=rollout, prompts=prompts, drafters=drafters, epochs=args.epochs,
        temperatures=temps, num_generations=cfg.grpo.num_generations,
        max_new_tokens=r.max_new_tokens, top_p=r.top_p, top_k=r.top_k,
        das=cfg.das,
        model_name=cfg.model.source,
        calibrate=not args.no_calibrate and args.cost_model is None, update_fn=update_fn,
        paper=paper, load_cores=args.load_cores, head=head, targets=args.preset or "readme")
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.hf_reference:
        setup.reference_fn = _make_reference_fn(cfg.model.source, tokenizer, args.hf_batches,
                                                args.hf_threads, log)
    if args.load_cores:
        log(f"co-tenant: {args.load_cores} process(es) spinning one core each for the run")
    with CoTenant(args.load_cores):
        result = run_bench(setup, args.out, log=log)
    print()
    print(result["table"])
    print()
    print(result["report"])
    print(f"\nwrote {args.out}/rollout.json, rollout.md, trace.jsonl, rollout_time.png, "
          "batch_width.png, speedup.png")
    return 0
