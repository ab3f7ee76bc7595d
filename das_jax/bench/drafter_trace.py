"""`das-jax bench drafter --trace TRACE`: tokens per verify step of each drafter on recorded
rollouts (no model, no cost model).

Protocol (the one SuffixDecoding / ArcticInference results are quoted in): the trace's epochs
in order; within an epoch its problems one after another in trace order, each problem's
rollouts (its GRPO group) begun together and decoded round robin, one verify step per rollout
per turn: the drafter proposes up to `k` tokens, the target accepts the longest prefix that
matches the recorded continuation and adds one token of its own (the recorded next token), and
the drafter is told the tokens emitted. A rollout ends at its recorded end. Tokens per verify
step = tokens emitted / verify steps (1.0: nothing drafted ever accepted); its upper bound is
k + 1.

Speculation never changes the sampled tokens, so the recorded continuation is exactly what the
target would emit; what this leaves out is the DAS budget (every row drafts up to `k`) and
time: drafts are scored by acceptance alone.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import numpy as np

from das_jax.draft_head import HeadDrafter, head_drafts, head_vs_verify
from das_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class TraceRollout:
    """One recorded rollout: prompt_ids / token_ids int lists, its problem and epoch."""
    epoch: int
    problem_id: str
    prompt_ids: list
    token_ids: list


def load_trace_rollouts(path: str) -> tuple[dict, list[TraceRollout]]:
    """(header dict, rollouts in file order) of a trace, read and checked line by line by the
    one trace reader (`das_jax.bench.replay.read_trace`; .gz read as gzip); a header line is
    optional here. Raises UserError naming the file (and line) when it is missing or not a
    trace, before any model loads."""
    from das_jax.bench.replay import read_trace   # deferred import: jax (the engine)
    trace = read_trace(path, need_header=False)
    return dict(trace.header), [
        TraceRollout(r.epoch, str(r.problem_id), list(r.prompt_ids), list(r.token_ids))
        for r in trace.rollouts]


@dataclasses.dataclass
class TraceDraftResult:
    """Per epoch (sorted): tokens emitted, verify steps, tokens accepted from drafts, draft
    tokens verified; drafting time. `tokens_per_step(e)` / `overall()` give the acceptance
    figure."""
    epochs: list
    tokens: dict
    steps: dict
    accepted: dict
    propose_s: float = 0.0
    append_s: float = 0.0
    drafted: dict = dataclasses.field(default_factory=dict)

    def tokens_per_step(self, epoch: int) -> float:
        return self.tokens[epoch] / max(1, self.steps[epoch])

    def overall(self) -> float:
        return sum(self.tokens.values()) / max(1, sum(self.steps.values()))


def _accepted(draft, out, pos: int) -> int:
    """Leading draft tokens equal to the recorded continuation out[pos:]."""
    n = 0
    while n < len(draft) and pos + n < len(out) and draft[n] == out[pos + n]:
        n += 1
    return n


def simulate_drafts(drafter, rollouts: Iterable[TraceRollout], k: int = 16) -> TraceDraftResult:
    """Runs the protocol of the module docstring with `drafter` (the `Drafter` protocol) over
    `rollouts`; `advance_epoch` between epochs. k >= 0 draft tokens per verify step. A drafter
    with a true `tree` attribute has both of its drafts verified in each step
    (`propose_both`: a two-branch token tree, `engine.step.verify_packed`): the step emits the
    longer accepted one."""
    by_epoch: dict[int, dict[str, list[TraceRollout]]] = {}
    for r in rollouts:
        by_epoch.setdefault(r.epoch, {}).setdefault(r.problem_id, []).append(r)
    epochs = sorted(by_epoch)
    res = TraceDraftResult(epochs, {e: 0 for e in epochs}, {e: 0 for e in epochs},
                           {e: 0 for e in epochs}, drafted={e: 0 for e in epochs})
    rid = 0
    clock = time.perf_counter
    bind = getattr(drafter, "bind", None)   # drafters that need the recorded rollout (the head)
    tree = bool(getattr(drafter, "tree", False))   # both drafts verified in one step
    for e in epochs:
        for pid, group in by_epoch[e].items():
            live = {}
            for r in group:
                if bind is not None:
                    bind(rid, r)
                drafter.begin(rid, pid, r.prompt_ids)
                live[rid] = [r.token_ids, 0]
                rid += 1
            while live:
                for q in list(live):
                    out, pos = live[q]
                    t0 = clock()
                    drafts = ([d.tokens for d in drafter.propose_both(q, k)] if tree
                              else [drafter.propose(q, k).tokens])
                    t1 = clock()
                    n = max(_accepted(d, out, pos) for d in drafts)
                    res.drafted[e] += sum(len(d) for d in drafts)
                    emit = out[pos: pos + n + 1]
                    drafter.append(q, emit)
                    res.propose_s += t1 - t0
                    res.append_s += clock() - t1
                    res.steps[e] += 1
                    res.tokens[e] += len(emit)
                    res.accepted[e] += n
                    pos += len(emit)
                    if pos >= len(out):
                        drafter.end(q)
                        del live[q]
                    else:
                        live[q][1] = pos
        drafter.advance_epoch()
    return res


# das with each subset of its scopes: the ablation rows printed for "das"
DAS_SCOPE_ROWS = (("das", ("problem", "request", "global")),
                  ("das (problem)", ("problem",)),
                  ("das (problem+request)", ("problem", "request")),
                  ("das (problem+global)", ("problem", "global")))


def _makers(names, depth, window) -> list[tuple[str, Callable]]:
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import make_drafter
    rows = []
    for name in names:
        if name == "das":
            rows += [(label, lambda sc=sc: make_drafter("das", max_depth=depth, window=window,
                                                        scopes=sc))
                     for label, sc in DAS_SCOPE_ROWS]
        elif name == "ngram":
            rows.append((name, lambda: make_drafter("ngram")))
        else:
            rows.append((name, lambda n=name: make_drafter(n, max_depth=depth, window=window)))
    return rows


def _head_rows(args, header, rollouts, depth, window):
    """(rollouts to measure, the head's table rows) for `--head`: the trace's policy runs over
    the rollouts once (features of every position), then the head's drafts from every anchor."""
    # deferred import: jax (the head's file module holds its config)
    from das_jax.draft_head import check_head_for_policy, load_head
    head = load_head(args.head)
    model = header.get("model")
    if not model:
        raise UserError(f"trace {args.trace}: its header names no model, so the head's policy "
                        "is unknown")
    if head.meta.get("model") != model:
        raise UserError(f"draft head {args.head}: fitted to {head.meta.get('model')!r}, the "
                        f"trace was recorded with {model!r}; fit a head on this trace with "
                        "`das-jax draft-head fit`")
    hold = set(head.meta.get("holdout_problems") or ())
    if hold:
        rollouts = [r for r in rollouts if r.problem_id in hold]
        if not rollouts:
            raise UserError(f"draft head {args.head}: none of its held-out problems is in "
                            f"{args.trace}; pass the trace it was fitted on")
    # deferred import: numba, jax
    from das_jax.drafter import make_drafter
    from das_jax.models import load
    config, params, _ = load(model)
    check_head_for_policy(head, args.head, model, config)
    t0 = time.perf_counter()
    drafts = head_drafts(config, params, head, [r.prompt_ids + r.token_ids for r in rollouts],
                         args.head_steps, dtype=args.head_dtype)
    print(f"draft head {args.head}: {head.config.draft_vocab_size} draft tokens, "
          f"{args.head_steps} steps, {args.head_dtype} weights; measured on "
          + (f"its {len(hold)} held-out problems" if hold else "every problem (none held out "
             "when it was fitted)") + f"; policy features + drafts {time.perf_counter() - t0:.0f} s")
    t = head_vs_verify(config, params, head, steps=args.head_steps,
                       dtypes=("float32", "bfloat16"))
    print(f"head draft call (B={t['batch']}, {t['width']} anchors committed per row, "
          f"{t['steps']} draft steps, {t['cached']} cached) against the verify step at the same "
          f"B and width ({params['embed'].dtype} policy) {t['verify_s'] * 1e3:.2f} ms: "
          + "; ".join(f"{dt} head {s * 1e3:.2f} ms, {t['ratio'][dt]:.1%}"
                      for dt, s in t["head_s"].items()) + " (target <= 5%)")
    by_id = {id(r): d for r, d in zip(rollouts, drafts)}
    rows = [("head", lambda: HeadDrafter(by_id)),
            ("das+head", lambda: HeadDrafter(by_id, make_drafter(
                "das", max_depth=depth, window=window), head_scale=args.head_scale)),
            ("das+head (tree)", lambda: HeadDrafter(by_id, make_drafter(
                "das", max_depth=depth, window=window), tree=True))]
    return rollouts, rows


def trace_main(args) -> int:
    """`bench drafter --trace`: the table of tokens per verify step per drafter and epoch."""
    header, rollouts = load_trace_rollouts(args.trace)
    extra = []
    if getattr(args, "head", None):
        rollouts, extra = _head_rows(args, header, rollouts, args.depth or int(
            header.get("das", {}).get("max_depth", 32)), args.window)
    das = header.get("das", {})
    depth = args.depth or int(das.get("max_depth", 32))
    window = args.window
    k = args.k or 16
    names = args.drafters.split(",")
    epochs = sorted({r.epoch for r in rollouts})
    lengths = np.array([len(r.token_ids) for r in rollouts])
    print(f"drafter trace replay: {args.trace}: {len(rollouts)} rollouts, "
          f"{len({r.problem_id for r in rollouts})} problems, epochs {epochs[0]}-{epochs[-1]}, "
          f"output tokens median {int(np.median(lengths))} max {int(lengths.max())}; "
          f"drafts of up to k={k}, max_depth={depth}, window={window}; siblings round robin")
    cols = "".join(f"{'epoch ' + str(e):>9}" for e in epochs)
    head = (f"{'drafter':24}{cols}{'all':>8}{'drafted':>9}{'slots':>7}{'prop us':>9}"
            f"{'app us':>8}")
    print(head)
    print("-" * len(head))
    for label, make in _makers(names, depth, window) + extra:
        drafter = make()
        res = simulate_drafts(drafter, rollouts, k)
        steps, tokens = sum(res.steps.values()), sum(res.tokens.values())
        per = "".join(f"{res.tokens_per_step(e):9.2f}" for e in epochs)
        print(f"{label:24}{per}{res.overall():8.2f}{sum(res.accepted.values()) / tokens:9.1%}"
              f"{sum(res.drafted.values()) / steps:7.1f}"
              f"{res.propose_s / steps * 1e6:9.1f}{res.append_s / steps * 1e6:8.1f}", flush=True)
        won = getattr(drafter, "source_counts", None)
        if won is not None and drafter.history is not None and not drafter.tree:
            print(f"{'':24}rows drafted from: head {won['head']}, history {won['history']}, "
                  f"none {won['none']}")
    print("tokens per verify step (tokens emitted / verify steps); drafted = share of emitted "
          "tokens accepted from drafts; slots = draft tokens verified per step (a tree: both "
          "drafts); prop / app us = microseconds per propose / append call (per-row calls)")
    return 0
