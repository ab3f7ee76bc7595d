"""Paper-scale replay of a recorded trace under several step-cost models, in one pass.

The trace's rollouts are stretched into a long-tailed paper-scale workload
(`replay.paper_workload`), then every drafter is replayed over all epochs (`replay.simulate`, the
engine's scheduler without a model) under each cost model (`das_jax.engine.resolve_cost_model`:
cpu, h100-7b, h200-7b or a cost-model file).

A speculation whose registry entry does not use the cost model (`uses_cost_model=False`: none,
ngram, suffix, suffix-global) takes the same decisions under every cost model, so it is
simulated once and its recorded step shapes (token slots N, attended positions K per step) are
re-priced under each model: t = c_base + c_tok*N + c_kv*K (`CostModel.predict_step`); the test
`test_reprice_equals_simulation` checks that this equals a simulation under that model.
Speculations that plan with the cost model (das, das-unlimited) are simulated per model.

Per model the result gives per-epoch decode time (the cost model's step times) and the total
with the measured host time of the scheduler, drafter and policy (on this machine), the speed-ups
(`rollout_report.speedup_summary` on decode time), and the regime: the share of c_base, c_tok*N
and c_kv*K in the decode time of `none` (plain decoding) and of `das-unlimited` (every row
verifies its whole draft) -- "compute-bound" for das-unlimited means verification of long drafts
at this batch is compute-bound, where the target is das >= 1.1x the best baseline.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from das_jax.bench import rollout_report as rr
from das_jax.rollout import build_speculation, get_speculation


def _summary(st, steps_nk, coef) -> dict:
    decode = sum(float(coef["c_base"]) + float(coef["c_tok"]) * n + float(coef.get("c_kv", 0.0)) * k
                 for n, k in steps_nk)
    return {"decode_s": decode, "predicted_s": decode + st.host_s, "host_s": st.host_s,
            "draft_s": st.draft_s, "policy_s": st.policy_s, "forward_passes": st.forward_passes,
            "generated_tokens": st.generated_tokens, "acceptance_length": st.acceptance_length}


def step_shapes(stats) -> list[tuple[int, int]]:
    """(N token slots, K cached positions read) of every step of a `SimStats`: K is the pages
    the rows held on a paged cache (`read_kv`), else the attended positions (padded defaults
    when a record leaves them None: batch*width and batch*kv_len)."""
    out = []
    for s in stats.steps:
        n, k = s.step_shape()
        out.append((n, int(s.read_kv) if s.read_kv is not None else k))
    return out


def replay_models(epochs: dict, names: Sequence[str], engine_config, max_new_tokens: int,
                  models: dict[str, dict], das=None, log: Callable | None = None) -> dict:
    """Replays `epochs` (epoch -> rollouts) for every name under every cost model.

    models: name -> {"c_base", "c_tok", "c_kv"}. Returns
    {model: {"cost_model": coef, "drafters": {name: [per-epoch summary]},
             "shares": {name: step_term_shares over all epochs}}}.
    """
    # deferred import: jax (not loaded by importing this module)
    from das_jax.bench import replay as rp

    out = {m: {"cost_model": dict(c), "drafters": {}, "shares": {}} for m, c in models.items()}
    first = next(iter(models))
    for name in names:
        per_model = [first] if not get_speculation(name).uses_cost_model else list(models)
        for m in per_model:
            cm = rp.FrozenCostModel.of(models[m])
            drafter, policy = build_speculation(name, das, cm)
            t0 = time.perf_counter()
            runs = []
            for e, rolls in epochs.items():
                st = rp.simulate(rolls, engine_config, max_new_tokens, cm, drafter, policy)
                if drafter is not None:
                    drafter.advance_epoch()
                runs.append((e, st, step_shapes(st)))
            targets = list(models) if len(per_model) == 1 else [m]
            for tm in targets:
                rows = []
                for e, st, nk in runs:
                    s = _summary(st, nk, models[tm])
                    s["epoch"] = e
                    rows.append(s)
                out[tm]["drafters"][name] = rows
                out[tm]["shares"][name] = rr.step_term_shares(
                    [x for _, _, nk in runs for x in nk], models[tm])
            if log:
                which = "all cost models (re-priced)" if len(targets) > 1 else m
                log(f"  paper replay {name:14} [{which}]: simulated {len(runs)} epochs in "
                    f"{time.perf_counter() - t0:.1f}s; passes "
                    f"{'/'.join(str(st.forward_passes) for _, st, _ in runs)}")
    return out


def summarize(replayed: dict) -> dict:
    """Adds to every model's entry: "summary" (`speedup_summary` of decode times), "regime" (of
    das-unlimited, else none), "regime_none", "compute_bound" (das-unlimited compute-bound)."""
    for m, r in replayed.items():
        times = {name: [row["decode_s"] for row in rows] for name, rows in r["drafters"].items()}
        r["summary"] = rr.speedup_summary(times)
        sh = r["shares"]
        r["regime_none"] = rr.regime(sh["none"]) if "none" in sh else None
        key = "das-unlimited" if "das-unlimited" in sh else "none"
        r["regime"] = (f"none: {r['regime_none']}; {key}: {rr.regime(sh[key])}"
                       if key in sh else "n/a")
        r["compute_bound"] = key in sh and rr.regime(sh[key]) == rr.REGIMES["tok"]
    return replayed


def markdown(replayed: dict) -> str:
    """Per model and epoch: decode seconds and speed-up over none per drafter; das / best."""
    lines = []
    for m, r in replayed.items():
        c = r["cost_model"]
        lines.append(f"\n**{m}** (t = {c['c_base'] * 1e3:.3f} ms + {c['c_tok'] * 1e6:.2f} us*N + "
                     f"{c.get('c_kv', 0.0) * 1e9:.2f} ns*K); regime: {r.get('regime', 'n/a')}")
        sh = r["shares"]
        lines.append("decode-time shares c_base / c_tok*N / c_kv*K: " + "; ".join(
            f"{n} {s['base']:.0%} / {s['tok']:.0%} / {s['kv']:.0%}" for n, s in sh.items()))
        names = list(r["drafters"])
        lines.append("")
        lines.append("| epoch | " + " | ".join(f"{n} decode s (x none)" for n in names)
                     + " | das / best baseline |")
        lines.append("|---|" + "---|" * (len(names) + 1))
        s = r["summary"]
        n_ep = len(r["drafters"]["none"])
        for e in range(n_ep):
            cells = [f"{r['drafters'][n][e]['decode_s']:.1f} ({s['per_epoch'][n][e]:.2f}x)"
                     for n in names]
            vb = s["subject_vs_best"][e]
            best = "n/a" if vb is None else f"{vb:.2f}x ({s['best_baseline'][e]})"
            lines.append(f"| {r['drafters']['none'][e]['epoch']} | " + " | ".join(cells)
                         + f" | {best} |")
        tb = s.get("total_subject_vs_best")
        lines.append("| all | " + " | ".join(f"{s['total'][n]:.2f}x" for n in names) + " | "
                     + ("n/a" if tb is None else f"{tb:.2f}x ({s['total_best_baseline']})")
                     + " |")
    return "\n".join(lines)
