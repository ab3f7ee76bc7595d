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

Outputs (under --out): `rollout.json`, `trace.jsonl` (the `none` rollouts, replayable with
`das-jax bench replay`), `rollout_time.png`, `batch_width.png`; a markdown table on stdout.

`--update-policy` runs one GRPO update (`GRPOTrainer.score` + `GRPOTrainer.update`) on the `none`
rollouts of each epoch (all of them as one batch) before the next epoch, so the policy drifts as
in training; every drafter then samples from the same updated params.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

DEFAULT_DRAFTERS = "none,ngram,suffix-global,das,das-unlimited"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML run config (model/data/rollout/grpo/das sections); default: "
                        "configs/bench-gsm8k-rollout.yaml")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                   help=f"comma-separated speculation names (default {DEFAULT_DRAFTERS}); "
                        "'none' is always run (the reference)")
    p.add_argument("--epochs", type=int, default=4)
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


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_bench(setup: BenchSetup, out_dir: str | None = None, log: Callable = print) -> dict:
    """Runs the benchmark; returns the result dict (also written to out_dir, with trace + PNGs)."""
    from das_jax.bench import replay as rp
    from das_jax.config import DASSection
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
        "max_new_tokens": setup.max_new_tokens, "temperatures": setup.temperatures,
        "engine": {"max_slots": ec.max_slots, "max_cache_len": ec.max_cache_len,
                   "draft_widths": list(ec.draft_widths), "exact": ec.exact},
        "das": dataclasses.asdict(das), "update_policy": setup.update_fn is not None,
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
        rollouts = {name: base.with_speculation(name, das_fitted) for name in names}
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
                diffs = [{"request": i, "problem_id": outputs[i].request.problem_id,
                          "sample_index": outputs[i].request.sample_index,
                          "first_diff": _first_diff(outputs[i].token_ids, ref[i].token_ids),
                          "len": len(outputs[i].token_ids), "len_none": len(ref[i].token_ids)}
                         for i, s in enumerate(same) if not s]
                row = {"temperature": temp, "epoch": epoch, "drafter": name,
                       **stats.to_dict(), "identity_rate": float(np.mean(same)),
                       "identity_diffs": diffs[:20]}
                if epoch == setup.epochs - 1 or epoch == 0:
                    step_traces[(temp, epoch, name)] = [
                        (s.active, s.batch, s.width, s.seconds) for s in stats.steps]
                measured[name].append(row)
                log(f"T={temp} epoch {epoch} {name:14} wall {stats.wall_s:7.2f}s  passes "
                    f"{stats.forward_passes:5d}  tokens {stats.generated_tokens:6d}  accept len "
                    f"{stats.acceptance_length:.2f}  draft {stats.draft_s:.2f}s  identity "
                    f"{row['identity_rate']:.1%}  (compile {stats.compile_s:.1f}s)")
                for d in diffs[:5]:
                    log(f"    differs: request {d['request']} (problem {d['problem_id']}, sample "
                        f"{d['sample_index']}) at token {d['first_diff']}")
            if setup.update_fn is not None and epoch < setup.epochs - 1:
                t0 = time.perf_counter()
                params = setup.update_fn(ref, params)
                log(f"T={temp} epoch {epoch}: GRPO update in {time.perf_counter() - t0:.1f}s")
        # ---- overheads (from the measured none run of epoch 0) and replay predictions ----
        sim0 = rp.simulate(none_epochs[0], ec, setup.max_new_tokens, rp.FrozenCostModel.of(coef))
        m0 = measured["none"][0]
        overheads = {
            "prefill_s_per_token": m0["prefill_s"] / max(sim0.prefill_tokens, 1),
            "host_s_per_step": max(0.0, (m0["wall_s"] - m0["decode_s"] - m0["prefill_s"]
                                         - m0["draft_s"] - m0["policy_s"])
                                   / max(m0["forward_passes"], 1)),
        }
        predicted = rp.replay_epochs(none_epochs, names, ec, setup.max_new_tokens, coef,
                                     das, overheads)
        for name in names:
            for row, pred in zip(measured[name], predicted[name]):
                row["replay"] = pred
                row["replay_ratio"] = pred["predicted_s"] / max(row["wall_s"], 1e-9)
                row["replay_decode_ratio"] = pred["decode_s"] / max(row["decode_s"], 1e-9)
                row["replay_passes_match"] = pred["forward_passes"] == row["forward_passes"]
                none_row = measured["none"][row["epoch"]]
                row["speedup"] = none_row["wall_s"] / max(row["wall_s"], 1e-9)
                row["predicted_speedup"] = (predicted["none"][row["epoch"]]["predicted_s"]
                                            / max(pred["predicted_s"], 1e-9))
                result["runs"].append(row)
        result.setdefault("overheads", {})[str(temp)] = overheads
        for e in sorted(none_epochs):
            trace_rollouts.extend(none_epochs[e])

    result["step_traces"] = {f"T={t}|epoch={e}|{n}": v for (t, e, n), v in step_traces.items()}
    result["table"] = markdown_table(result)
    if out_dir:
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
            f.write(result["table"] + "\n")
    return result


def markdown_table(result: dict) -> str:
    lines = ["| T | epoch | drafter | wall s | passes | tokens | accept len | draft s | speed-up "
             "| identity | replay s (ratio) | replay speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(
            f"| {r['temperature']} | {r['epoch']} | {r['drafter']} | {r['wall_s']:.2f} | "
            f"{r['forward_passes']} | {r['generated_tokens']} | {r['acceptance_length']:.2f} | "
            f"{r['draft_s']:.2f} | {r['speedup']:.2f}x | {r['identity_rate']:.1%} | "
            f"{r['replay']['predicted_s']:.2f} ({r['replay_ratio']:.2f}) | "
            f"{r['predicted_speedup']:.2f}x |")
    # totals per drafter and temperature
    lines += ["", "| T | drafter | total wall s | speed-up vs none | total replay s | identity |",
              "|---|---|---|---|---|---|"]
    for t in result["temperatures"]:
        none_total = sum(r["wall_s"] for r in result["runs"]
                         if r["temperature"] == t and r["drafter"] == "none")
        for name in result["drafters"]:
            rs = [r for r in result["runs"] if r["temperature"] == t and r["drafter"] == name]
            tot = sum(r["wall_s"] for r in rs)
            rep = sum(r["replay"]["predicted_s"] for r in rs)
            ident = np.mean([r["identity_rate"] for r in rs])
            lines.append(f"| {t} | {name} | {tot:.2f} | {none_total / max(tot, 1e-9):.2f}x | "
                         f"{rep:.2f} | {ident:.1%} |")
    return "\n".join(lines)


def plot_rollout(result: dict, out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    p = os.path.join(out_dir, "rollout_time.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

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
    p = os.path.join(out_dir, "batch_width.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ----------------------------------------------------------------------------- CLI

def default_config_path() -> str:
    """configs/bench-gsm8k-rollout.yaml of the checkout this package runs from."""
    return os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                        "bench-gsm8k-rollout.yaml")


def _make_update_fn(cfg, model, problems_by_id):
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


def main(args: argparse.Namespace) -> int:
    from das_jax.config import ConfigError, apply_platform, load_config

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
    temps = ([float(t) for t in args.temperatures.split(",")] if args.temperatures
             else [cfg.rollout.temperature])
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    from das_jax.rollout import speculation_names
    bad = [d for d in drafters if d not in speculation_names()]
    if bad:
        print(f"das-jax bench rollout: unknown drafter(s) {bad}; valid: "
              f"{', '.join(speculation_names())}", file=sys.stderr)
        return 2

    import jax.numpy as jnp
    from das_jax.data import load_dataset_from_config, render_prompt
    from das_jax.models import load
    from das_jax.rollout import Rollout
    from das_jax.models.tokenizer import encode_prompt

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
    rollout = Rollout.from_config(cfg, model_config, params, tokenizer.eos_token_ids,
                                  speculation="none")
    print(f"loaded {cfg.model.source} and {len(problems)} problems in "
          f"{time.perf_counter() - t0:.1f}s; prompts {min(len(p) for _, p in prompts)}-"
          f"{max(len(p) for _, p in prompts)} tokens", flush=True)
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
        calibrate=not args.no_calibrate and args.cost_model is None, update_fn=update_fn)
    result = run_bench(setup, args.out, log=lambda s: print(s, flush=True))
    print()
    print(result["table"])
    print(f"\nwrote {args.out}/rollout.json, trace.jsonl, rollout_time.png, batch_width.png")
    return 0
