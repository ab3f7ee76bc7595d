"""`das-jax bench drafter`: drafter latency, acceptance and memory on synthetic RL traffic.

Traffic (no model needed): per problem a base answer of Zipf-distributed tokens (vocab 49152)
that drifts a little every epoch (the policy changes slowly); each epoch a GRPO group of
`rollouts` siblings = mutated copies of it (substitutions, insertions, deletions, length
jitter), decoded concurrently so that siblings see each other's verified tokens.
- "gsm8k": `problems` problems x 16 rollouts of ~300 tokens, `epochs` epochs.
- "long": 1 problem x 16 rollouts of 16K tokens, 2 epochs.

The replay is the engine's loop: every live request asks for a draft of `k` tokens, a greedy
verifier accepts the matching prefix against the true rollout and emits one more token, the
drafter is told the emitted tokens. Printed: median / p99 microseconds per `propose` call and
per appended token (append call time / tokens in it; also the amortized mean), acceptance
(accepted tokens per propose, fraction of tokens that came from drafts), and memory per
indexed token (allocated array bytes of the drafter's pool, and the used part).

`--batch`: host time of one decode step for A live rows of the "suffix" drafter (A in
`--rows`): per-row `propose` / `append` calls against `propose_batch` / `append_batch` with 1..N
threads (`--threads`), on `--problems` problems x `--rollouts` rollouts of `--length` tokens
(vocab `--vocab`) indexed, each row a new rollout of one of them partway through. Printed:
median microseconds per row and step for propose and append, and the speedup of each thread
count over one thread.

`--trace TRACE`: tokens per verify step of each drafter, per epoch, on recorded rollouts
(`drafter_trace`).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from das_jax.arg_types import positive_int
from das_jax.bench import drafter_batch_bench, drafter_trace
from das_jax.errors import UserError

VOCAB = 49152


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafters", default="suffix,suffix-global,ngram",
                        help="comma-separated drafter names (see das_jax.drafter.make_drafter)")
    parser.add_argument("--traffic", default="gsm8k,long", help="comma-separated: gsm8k, long")
    parser.add_argument("--depth", type=int, default=None,
                        help="suffix trie max_depth (default 24; --trace: the trace's)")
    parser.add_argument("--window", type=int, default=16, help="epochs kept per problem")
    parser.add_argument("--problems", type=int, default=32, help="gsm8k problems")
    parser.add_argument("--epochs", type=int, default=6, help="gsm8k epochs")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per problem and epoch")
    parser.add_argument("--k", type=int, default=None,
                        help="draft budget per propose (default 8; --trace: 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small traffic, finishes in < 30 s")
    parser.add_argument("--batch", action="store_true",
                        help="time per-row vs batched propose/append per decode step instead")
    parser.add_argument("--trace", default=None, metavar="TRACE",
                        help="tokens per verify step per drafter and epoch on a recorded "
                        "rollout trace instead (e.g. docs/traces/gsm8k-smollm2-135m.jsonl.gz; "
                        "'das' prints its scope ablations too)")
    parser.add_argument("--head", default=None, metavar="HEAD",
                        help="with --trace: also a draft head (`das-jax draft-head fit`) alone "
                        "and chosen per row against das; a head fitted with --holdout is "
                        "measured on its held-out problems only")
    parser.add_argument("--head-steps", type=positive_int, default=3,
                        help="with --head: draft tokens per head draft")
    parser.add_argument("--head-scale", type=float, default=2.0,
                        help="with --head: the per-row choice takes the head's draft when its "
                        "expected accepted length times this beats the history draft's")
    parser.add_argument("--head-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="with --head: the head's matrices' dtype in the simulation "
                        "(`draft_head.dtype`; the timing line prints both)")
    drafter_batch_bench.add_batch_arguments(parser)


def _zipf_tokens(rng, n):
    return (rng.zipf(1.2, size=n) % VOCAB).astype(np.int32)


def _mutate(rng, base, p):
    out = []
    for t in base:
        r = rng.random()
        if r < p / 3:
            out.append(int(_zipf_tokens(rng, 1)[0]))
        elif r < 2 * p / 3:
            out.extend((int(t), int(_zipf_tokens(rng, 1)[0])))
        elif r >= p:
            out.append(int(t))
    return out


def _traffic(rng, problems, epochs, rollouts, length, p_drift=0.01, p_mut=0.04):
    """[epoch][problem] -> list of rollouts (int lists)."""
    bases = [_zipf_tokens(rng, length).tolist() for _ in range(problems)]
    out = []
    for _ in range(epochs):
        bases = [_mutate(rng, b, p_drift) for b in bases]
        ep = []
        for b in bases:
            group = []
            for _ in range(rollouts):
                r = _mutate(rng, b, p_mut)
                cut = int(len(r) * rng.uniform(0.7, 1.0)) if rng.random() < 0.5 else len(r)
                group.append(r[:cut])
            ep.append(group)
        out.append(ep)
    return out


def _replay(drafter, traffic, k, prompt_len=48, seed=0):
    rng = np.random.default_rng(seed)
    prompts = {}
    t_prop, t_app, app_tokens, accepted, proposals, total = [], [], 0, 0, 0, 0
    rid = 0
    for ep in traffic:
        for pid, group in enumerate(ep):
            prompt = prompts.setdefault(pid, _zipf_tokens(rng, prompt_len).tolist())
            live = {}
            for out in group:
                drafter.begin(rid, pid, prompt)
                live[rid] = (out, 0)
                rid += 1
            while live:
                for r in list(live):
                    out, pos = live[r]
                    t0 = time.perf_counter_ns()
                    d = drafter.propose(r, k)
                    t1 = time.perf_counter_ns()
                    n = 0
                    toks = d.tokens
                    while n < len(toks) and pos + n < len(out) and toks[n] == out[pos + n]:
                        n += 1
                    emit = out[pos: pos + n + 1]
                    t2 = time.perf_counter_ns()
                    drafter.append(r, emit)
                    t3 = time.perf_counter_ns()
                    t_prop.append(t1 - t0)
                    t_app.append((t3 - t2) / max(1, len(emit)))
                    app_tokens += len(emit)
                    accepted += n
                    proposals += 1
                    total += len(emit)
                    pos += len(emit)
                    if pos >= len(out):
                        drafter.end(r)
                        del live[r]
                    else:
                        live[r] = (out, pos)
        drafter.advance_epoch()
    t_prop, t_app = np.asarray(t_prop) / 1e3, np.asarray(t_app) / 1e3
    return {
        "propose_us_med": float(np.median(t_prop)), "propose_us_p99": float(np.percentile(t_prop, 99)),
        "append_us_tok_med": float(np.median(t_app)),
        "append_us_tok_p99": float(np.percentile(t_app, 99)),
        "append_us_tok_mean": float(np.mean(t_app)),
        "accepted_per_propose": accepted / max(1, proposals),
        "drafted_fraction": accepted / max(1, total), "tokens": total,
    }


def _memory(drafter):
    forest = getattr(getattr(drafter, "history", None), "forest", None)
    if forest is None or forest.indexed_tokens == 0:
        return None
    n = forest.indexed_tokens
    return forest.nbytes() / n, forest.used_bytes() / n, forest.num_nodes / n, n


def _warmup(make):
    d = make()
    d.begin(0, 0, [1, 2, 3, 1, 2])
    d.append(0, [3, 1])
    d.propose(0, 4)
    d.end(0)
    d.advance_epoch()


def main(args: argparse.Namespace) -> int:
    if getattr(args, "head", None) and not getattr(args, "trace", None):
        raise UserError("--head measures a draft head on a trace: add --trace TRACE (e.g. "
                        "docs/traces/gsm8k-smollm2-135m.jsonl.gz)")
    if getattr(args, "trace", None):
        return drafter_trace.trace_main(args)
    args.depth, args.k = args.depth or 24, args.k or 8
    if getattr(args, "batch", False):
        return drafter_batch_bench.batch_main(args)
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import make_drafter

    rng = np.random.default_rng(args.seed)
    quick = getattr(args, "quick", False)
    traffics = {}
    for name in args.traffic.split(","):
        if name == "gsm8k":
            p, e = (6, 3) if quick else (args.problems, args.epochs)
            traffics[name] = _traffic(rng, p, e, args.rollouts, 300)
        elif name == "long":
            r, length = (4, 4000) if quick else (args.rollouts, 16000)
            traffics[name] = _traffic(rng, 1, 2, r, length)
        else:
            raise SystemExit(f"unknown traffic {name!r} (gsm8k, long)")
    print(f"drafter bench: depth={args.depth} window={args.window} k={args.k}"
          f"{' (quick)' if quick else ''}")
    header = (f"{'traffic':8} {'drafter':14} {'prop med':>9} {'prop p99':>9} {'app/tok med':>11} "
              f"{'p99':>7} {'mean':>7} {'acc/prop':>8} {'drafted':>7} {'B/tok':>7} "
              f"{'used':>6} {'nodes/tok':>9}")
    print(header)
    print("-" * len(header))
    for tname, traffic in traffics.items():
        for dname in args.drafters.split(","):
            if dname == "ngram":
                def make():
                    return make_drafter("ngram")
            else:
                def make(dname=dname):
                    return make_drafter(dname, max_depth=args.depth, window=args.window)
            _warmup(make)
            drafter = make()
            res = _replay(drafter, traffic, args.k, seed=args.seed)
            mem = _memory(drafter)
            mem_s = (f"{mem[0]:7.1f} {mem[1]:6.1f} {mem[2]:9.2f}" if mem else
                     f"{'-':>7} {'-':>6} {'-':>9}")
            print(f"{tname:8} {dname:14} {res['propose_us_med']:9.2f} {res['propose_us_p99']:9.2f} "
                  f"{res['append_us_tok_med']:11.2f} {res['append_us_tok_p99']:7.2f} "
                  f"{res['append_us_tok_mean']:7.2f} {res['accepted_per_propose']:8.2f} "
                  f"{res['drafted_fraction']:7.1%} {mem_s}", flush=True)
    print("us = microseconds per call (propose) or per appended token (append call time / "
          "tokens); B/tok = allocated pool bytes per indexed token, used = bytes in use")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
