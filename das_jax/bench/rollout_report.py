"""Pure summaries of the rollout benchmark: ratios side by side, token identity,
the regime of a cost model. No jax, no I/O; every function works on plain numbers and lists.

* `divergence_stats`: share of rollouts identical to the reference and first divergences per
  1,000 compared tokens.
* `speedup_summary`: per-epoch speed-up of every drafter over `none`, of `das` over the best of
  the baselines (ngram / suffix-global / das-unlimited), and the same over epochs 1-3 and over
  all epochs (sums of times).
* `step_term_shares`, `regime`: which term of the cost model `t = c_base + c_tok*N + c_kv*K`
  dominates the decode time of a (simulated) run.
* `Targets`, `TARGETS`, `targets_rows`, `targets_markdown`: a preset's targets next to the
  measured values.
* `length_stats`: the shape of a batch's rollout lengths (median, p90, max, share at the cap).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

BASELINES = ("ngram", "suffix-global", "das-unlimited")
REGIMES = {"base": "memory-bound (weights, c_base)", "tok": "compute-bound (token slots, c_tok*N)",
           "kv": "KV-bound (attention reads, c_kv*K)"}


def length_stats(lengths: Sequence[int], cap: int) -> dict:
    """The shape of one batch's completion lengths (tokens): median, p90 (nearest rank), max,
    max / median and the share of rollouts that stopped at the cap `cap` (max_new_tokens).
    A long tail shows as max / median well above 1 with p90 below the cap; a capped batch as a
    large share at the cap. Empty input: zeros."""
    xs = sorted(int(n) for n in lengths)
    if not xs:
        return {"median": 0.0, "p90": 0, "max": 0, "max_over_median": 0.0, "at_cap_share": 0.0}
    n = len(xs)
    median = (xs[(n - 1) // 2] + xs[n // 2]) / 2
    p90 = xs[min(n - 1, max(0, -(-9 * n // 10) - 1))]
    return {"median": float(median), "p90": p90, "max": xs[-1],
            "max_over_median": xs[-1] / median if median else 0.0,
            "at_cap_share": sum(x >= cap for x in xs) / n}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts at the
    shorter length); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    if len(a) == len(b):
        return None
    return min(len(a), len(b))


def divergence_stats(outputs: Sequence[Sequence[int]], refs: Sequence[Sequence[int]]) -> dict:
    """Token identity of `outputs` against `refs` (same order, one token list per rollout).

    A rollout that differs from its reference diverges once: after the first differing token the
    two continue from different histories, so later tokens are not comparable. The rate is
    therefore first divergences per 1,000 *compared* tokens: an identical rollout contributes its
    length, a diverging one its tokens up to and including the first difference.

    Returns {"rollouts", "identical", "identical_share" (0..1), "divergences",
    "compared_tokens", "divergences_per_1k"}.
    Raises ValueError when the two lists have different lengths.
    """
    if len(outputs) != len(refs):
        raise ValueError(f"divergence_stats: {len(outputs)} outputs against {len(refs)} "
                         "references; pass one reference per rollout")
    identical = compared = 0
    for out, ref in zip(outputs, refs):
        d = first_divergence(out, ref)
        if d is None:
            identical += 1
            compared += len(ref)
        else:
            compared += d + 1
    n = len(outputs)
    div = n - identical
    return {"rollouts": n, "identical": identical,
            "identical_share": identical / n if n else 1.0, "divergences": div,
            "compared_tokens": compared,
            "divergences_per_1k": 1000.0 * div / compared if compared else 0.0}


def merge_divergence_stats(stats: Iterable[Mapping]) -> dict:
    """Sums `divergence_stats` results (e.g. over epochs) into one of the same form."""
    n = ident = comp = 0
    for s in stats:
        n += s["rollouts"]
        ident += s["identical"]
        comp += s["compared_tokens"]
    div = n - ident
    return {"rollouts": n, "identical": ident, "identical_share": ident / n if n else 1.0,
            "divergences": div, "compared_tokens": comp,
            "divergences_per_1k": 1000.0 * div / comp if comp else 0.0}


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def speedup_summary(times: Mapping[str, Sequence[float]], subject: str = "das",
                    reference: str = "none", baselines: Sequence[str] = BASELINES,
                    later_epochs: tuple[int, int] = (1, 3)) -> dict:
    """Speed-ups from per-epoch times (seconds; `times[name][e]` = epoch e of drafter `name`).

    Returns
      {"per_epoch": {name: [t_ref / t_name per epoch]},
       "subject_vs_best": [per epoch: min over present baselines of t_b / t_subject],
       "best_baseline": [per epoch: the name of that fastest baseline],
       "later": {name: sum t_ref / sum t_name over epochs later_epochs[0]..later_epochs[1]}
                (inclusive, 0-indexed; absent when the run has no such epoch),
       "later_subject_vs_best", "later_best_baseline": the same on those sums,
       "total": {name: ratio of sums over all epochs}, "total_subject_vs_best",
       "total_best_baseline"}.
    Ratios > 1 mean faster than the reference (or than the best baseline). Missing subject or
    baselines give None entries.
    Raises ValueError when `reference` is absent or the epoch counts differ.
    """
    if reference not in times:
        raise ValueError(f"speedup_summary: no times for the reference {reference!r}")
    n = len(times[reference])
    for name, ts in times.items():
        if len(ts) != n:
            raise ValueError(f"speedup_summary: {name!r} has {len(ts)} epochs, "
                             f"{reference!r} has {n}")
    ref = times[reference]
    present = [b for b in baselines if b in times]
    lo, hi = later_epochs
    later = [e for e in range(n) if lo <= e <= hi]

    def vs_best(tsub: float, tb: Mapping[str, float]):
        if subject not in times or not present:
            return None, None
        best = min(present, key=lambda b: tb[b])
        return _ratio(tb[best], tsub), best

    out: dict = {"per_epoch": {name: [_ratio(ref[e], ts[e]) for e in range(n)]
                               for name, ts in times.items()},
                 "subject": subject, "reference": reference, "later_epochs": list(later)}
    sub_best, best_names = [], []
    for e in range(n):
        r, b = vs_best(times[subject][e] if subject in times else 0.0,
                       {name: times[name][e] for name in present})
        sub_best.append(r)
        best_names.append(b)
    out["subject_vs_best"] = sub_best
    out["best_baseline"] = best_names

    def sums(epochs: list[int]) -> dict[str, float]:
        return {name: float(sum(ts[e] for e in epochs)) for name, ts in times.items()}

    for key, epochs in (("later", later), ("total", list(range(n)))):
        if not epochs:
            continue
        s = sums(epochs)
        out[key] = {name: _ratio(s[reference], s[name]) for name in times}
        r, b = vs_best(s.get(subject, 0.0), s)
        out[f"{key}_subject_vs_best"] = r
        out[f"{key}_best_baseline"] = b
    return out


def step_term_shares(steps: Iterable[tuple[float, float]], coef: Mapping[str, float]) -> dict:
    """Shares of the decode time t = c_base + c_tok*N + c_kv*K summed over steps.

    steps: (N token slots, K attended positions) per step. Returns {"base", "tok", "kv"} (each
    0..1, summing to 1; all 0 for no steps) and "seconds" (the total).
    """
    base = tok = kv = 0.0
    for n_tok, k_kv in steps:
        base += float(coef["c_base"])
        tok += float(coef["c_tok"]) * n_tok
        kv += float(coef.get("c_kv", 0.0)) * k_kv
    tot = base + tok + kv
    if tot <= 0:
        return {"base": 0.0, "tok": 0.0, "kv": 0.0, "seconds": 0.0}
    return {"base": base / tot, "tok": tok / tot, "kv": kv / tot, "seconds": tot}


def regime(shares: Mapping[str, float]) -> str:
    """The dominant term of `step_term_shares` as words (`REGIMES`), e.g.
    "compute-bound (token slots, c_tok*N)"."""
    key = max(("base", "tok", "kv"), key=lambda k: shares.get(k, 0.0))
    return REGIMES[key]


def _fmt(x, spec=".2f", suffix="x") -> str:
    if x is None or x != x:          # None or nan
        return "n/a"
    return f"{x:{spec}}{suffix}"


def _met(x, target) -> str:
    if x is None or x != x:
        return "n/a"
    return "yes" if x >= target else "no"


@dataclasses.dataclass(frozen=True)
class Targets:
    """The speed ratios a rollout benchmark preset is measured against (each a lower bound on a
    ratio > 1 = faster; None: the value is reported without a target).

    every_epoch: das / none in each epoch; with_history: das / none over the epochs with
    history (`speedup_summary`'s `later_epochs`); with_history_vs_best: das / the best of
    ngram, suffix-global, das-unlimited over those epochs; total_vs_best: the same over all
    epochs; hf: `none` / HF transformers `generate` tokens per second; paper_vs_none: das / none
    of the paper-scale replay in every epoch; paper_vs_best, paper_vs_best_compute_bound: das /
    the best baseline of that replay in every epoch, under a cost model where speculation is
    memory-bound / compute-bound."""

    every_epoch: float | None = 1.0
    with_history: float | None = 1.3
    with_history_vs_best: float | None = None
    total_vs_best: float | None = 1.3
    hf: float | None = 2.5
    paper_vs_none: float | None = 2.0
    paper_vs_best: float | None = 1.0
    paper_vs_best_compute_bound: float | None = 1.1


#: `bench rollout --preset` name -> its targets (docs/results/rollouts.md states them with the
#: results). A run without a preset is reported against the README benchmark's.
TARGETS = {
    "readme": Targets(),
    # The paper's regime (1,024-token rollouts, a long tail): speculation pays in the tail.
    "longtail": Targets(with_history=1.5, with_history_vs_best=1.2, total_vs_best=None, hf=None),
}


def _target_row(what: str, value, shown: str, target: float | None,
                every: bool = False) -> tuple[str, str, str, str]:
    """(what, shown value, ">= Tx" or "", "yes" / "no" / "") for one ratio, or for a list of
    ratios that must all meet the target (`every`)."""
    if target is None:
        return what, shown, "", ""
    text = f">= {target:.1f}x" + (" every epoch" if every else "")
    if every:
        met = "yes" if all(x is not None and x >= target for x in value) else "no"
        return what, shown, text, met
    return what, shown, text, _met(value, target)


def targets_rows(measured: Mapping, hf: Mapping | None = None,
                 identity: Mapping[str, Mapping] | None = None,
                 paper: Mapping[str, Mapping] | None = None,
                 targets: Targets = TARGETS["readme"]) -> list[tuple[str, str, str, str]]:
    """(what, value, target, met) rows of the rollout benchmark against `targets`.

    measured: `speedup_summary` of the measured wall times; hf: {"none_tok_s", "hf_tok_s",
    "batch"} (None: no HF reference); identity: drafter -> merged `divergence_stats`; paper: cost
    model name -> {"summary": `speedup_summary` of the replayed decode times, "regime": words}.
    """
    rows = []
    pe = measured["per_epoch"].get(measured["subject"])
    ep = measured.get("later_epochs") or []
    span = f"epochs {ep[0]}-{ep[-1]}" if ep else "epochs 1-3"
    if pe is not None:
        rows.append(_target_row("das / none per epoch", pe, " / ".join(_fmt(x) for x in pe),
                                targets.every_epoch, every=True))
        lat = measured.get("later", {}).get(measured["subject"])
        rows.append(_target_row(f"das / none over {span}", lat, _fmt(lat), targets.with_history))
        rows.append(("das / none over all epochs", _fmt(measured.get("total", {}).get(
            measured["subject"])), "", ""))
    if measured.get("subject_vs_best") and measured["subject_vs_best"][0] is not None:
        rows.append(("das / best of ngram, suffix-global, das-unlimited per epoch",
                     " / ".join(f"{_fmt(x)} ({b})" for x, b in
                                zip(measured["subject_vs_best"], measured["best_baseline"])),
                     "", ""))
        lb = measured.get("later_subject_vs_best")
        if lb is not None:
            rows.append(_target_row(
                f"das / best baseline over {span} ({measured.get('later_best_baseline')})",
                lb, _fmt(lb), targets.with_history_vs_best))
        tb = measured.get("total_subject_vs_best")
        rows.append(_target_row(
            f"das / best baseline over all epochs ({measured.get('total_best_baseline')})",
            tb, _fmt(tb), targets.total_vs_best))
    if hf:
        r = _ratio(hf["none_tok_s"], hf["hf_tok_s"])
        rows.append(_target_row(f"`none` / HF transformers `generate` tok/s at B={hf['batch']}",
                                r, f"{_fmt(r)} ({hf['none_tok_s']:.1f} / {hf['hf_tok_s']:.1f} "
                                   "tok/s)", targets.hf))
    for name, s in (identity or {}).items():
        rows.append((f"identity {name} vs none",
                     f"{s['identical_share']:.1%} identical; {s['divergences_per_1k']:.2f} "
                     f"divergences / 1k tokens", "", ""))
    for model, p in (paper or {}).items():
        s = p["summary"]
        pe = s["per_epoch"].get(s["subject"])
        if pe is None:
            continue
        rows.append(_target_row(f"paper replay {model}: das / none per epoch [{p['regime']}]",
                                pe, " / ".join(_fmt(x) for x in pe), targets.paper_vs_none,
                                every=True))
        vb = s.get("subject_vs_best") or []
        if vb and vb[0] is not None:
            need = (targets.paper_vs_best_compute_bound if p.get("compute_bound")
                    else targets.paper_vs_best)
            rows.append(_target_row(
                f"paper replay {model}: das / best baseline per epoch", vb,
                " / ".join(f"{_fmt(x)} ({b})" for x, b in zip(vb, s["best_baseline"])),
                need, every=True))
    return rows


def targets_markdown(rows: Sequence[tuple[str, str, str, str]]) -> str:
    lines = ["| measure | value | target | met |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)
