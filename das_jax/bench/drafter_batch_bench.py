"""`das-jax bench drafter --batch`: host time per decode step of the "suffix" drafter for A live
rows, per-row `propose` / `append` calls against `propose_batch` / `append_batch` (1..N threads).

State: `--problems` problems, each with `--rollouts` finished rollouts of ~`--length` tokens
(Zipf tokens modulo `--vocab`, mutated copies of a per-problem answer, so the tries branch and
repeat) indexed in one epoch. Then A rows start (row i: problem i mod problems, a fresh mutated
copy of its answer), each appended a random prefix of its rollout, and `--steps` decode steps
run: every row drafts `--k` tokens, a greedy verifier accepts the matching prefix plus one token,
the emitted tokens are appended. Each mode runs on its own copy of the same state, so all modes
draft and accept the same tokens (checked), and the modes take turns step by step (so a drift of
the machine's speed during the run hits them alike). Printed per A and mode: median microseconds per row
per step of propose and of append, and the throughput ratio to one thread.

Also runs as a script (`python das_jax/bench/drafter_batch_bench.py`), e.g. against another
checkout's `das_jax` on PYTHONPATH (modes the drafter lacks are skipped).
"""
from __future__ import annotations

import argparse
import pickle
import time

import numpy as np

from das_jax.arg_types import int_list, positive_int


SCOPES = ("problem", "request", "global")   # the suffix drafter's (`SuffixDrafter.SCOPES`)


def scope_list(text: str) -> str:
    """argparse `type=` of --scopes: comma-separated names of SCOPES that include 'problem'
    (checked, returned as the text)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or "problem" not in names or any(n not in SCOPES for n in names):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {', '.join(SCOPES)} that includes "
            "problem (e.g. problem,request,global)")
    return ",".join(names)


def add_batch_arguments(parser: argparse.ArgumentParser, standalone: bool = False) -> None:
    """The --batch options (`standalone`: also those `drafter_bench` shares with them); each
    checked by its argparse type, so a bad value is one line naming the flag before any trie is
    built."""
    if standalone:
        parser.add_argument("--depth", type=positive_int, default=24, help="suffix trie max_depth")
        parser.add_argument("--window", type=positive_int, default=16,
                            help="epochs kept per problem")
        parser.add_argument("--problems", type=positive_int, default=128, help="problems")
        parser.add_argument("--rollouts", type=positive_int, default=16,
                            help="rollouts per problem")
        parser.add_argument("--k", type=positive_int, default=8, help="draft budget per propose")
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scopes", type=scope_list, default=None,
                        help="--batch: the suffix drafter's scopes, comma-separated (default: "
                        "its default, problem,request,global)")
    parser.add_argument("--rows", type=int_list(example="32,128", as_text=True),
                        default="32,128,256,512", help="--batch: live rows A")
    parser.add_argument("--threads", type=int_list(example="1,2", as_text=True), default="1,2",
                        help="--batch: propose_batch thread counts")
    parser.add_argument("--length", type=positive_int, default=1000,
                        help="--batch: tokens per rollout")
    parser.add_argument("--vocab", type=positive_int, default=200, help="--batch: vocabulary")
    parser.add_argument("--steps", type=positive_int, default=30,
                        help="--batch: timed decode steps")


def _mutate(rng, base, p, vocab):
    """int32 copy of `base` with a fraction p of tokens substituted, doubled (a random token
    inserted after) or deleted, a third each."""
    r = rng.random(base.size)
    out = base.copy()
    sub = r < p / 3
    out[sub] = _tokens(rng, int(sub.sum()), vocab)
    reps = np.where(r < 2 * p / 3, np.where(sub, 1, 2), np.where(r < p, 0, 1))
    out = np.repeat(out, reps)
    ins = np.cumsum(reps)[reps == 2] - 1
    out[ins] = _tokens(rng, ins.size, vocab)
    return out


def _tokens(rng, n, vocab):
    return (rng.zipf(1.2, size=n) % vocab).astype(np.int32)


def _build(args, threads: int = 1):
    """(drafter on `threads` threads with problems x rollouts finished rollouts indexed,
    answers, prompts): the same rollouts whatever `threads` (more than one shards the
    history: `SuffixDrafter`'s `threads`)."""
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import SuffixDrafter, SuffixTreeConfig

    rng = np.random.default_rng(args.seed)
    scopes = getattr(args, "scopes", None)
    kw = {"scopes": scopes.split(",")} if scopes else {}
    try:
        d = SuffixDrafter(SuffixTreeConfig(max_depth=args.depth), window=args.window,
                          threads=threads, **kw)
    except TypeError:    # another checkout's drafter without threads or scopes
        d = SuffixDrafter(SuffixTreeConfig(max_depth=args.depth), window=args.window)
    answers = [_tokens(rng, args.length, args.vocab) for _ in range(args.problems)]
    prompts = [_tokens(rng, 48, args.vocab) for _ in range(args.problems)]
    rid = 0
    for pid in range(args.problems):
        for _ in range(args.rollouts):
            out = _mutate(rng, answers[pid], 0.04, args.vocab)
            d.begin(rid, pid, prompts[pid])
            d.append(rid, out[: int(out.size * rng.uniform(0.7, 1.0))])
            d.end(rid)
            rid += 1
    d.advance_epoch()
    return d, answers, prompts


def _start(base, rows, answers, prompts, args, threads):
    """A copy of `base` with `rows` live rows (row i: problem i mod problems, a fresh mutated
    copy of its answer appended up to a random position); the same rows for every call.
    Returns (drafter, truths, positions int64 [rows])."""
    d = pickle.loads(pickle.dumps(base))
    if threads is not None and getattr(d, "threads", threads) != threads:
        d.threads = threads     # a drafter that sets its threads after construction
    rng = np.random.default_rng(args.seed + 1)
    W = args.k + 1
    truths, pos = [], np.zeros(rows, np.int64)
    for i in range(rows):
        pid = i % len(answers)
        truth = _mutate(rng, answers[pid], 0.04, args.vocab)
        truths.append(truth)
        d.begin(i, pid, prompts[pid])
        pos[i] = rng.integers(0, max(1, truth.size - (args.steps + 1) * W))
        d.append(i, truth[: pos[i]])
    return d, truths, pos


def _step(d, truths, pos, rows, k, threads):
    """One decode step of every row: propose, greedy verification against the truths, append.
    Returns (propose seconds, append seconds, tokens emitted); advances pos."""
    ids = np.arange(rows, dtype=np.int64)
    t0 = time.perf_counter()
    if threads is None:
        drafts = [d.propose(int(r), k).tokens for r in ids]
    else:
        batch = d.propose_batch(ids, np.full(rows, k, np.int32))
        drafts = [batch.tokens_AxK[b, : batch.lens_A[b]] for b in range(rows)]
    t1 = time.perf_counter()
    toks_AxW = np.zeros((rows, k + 1), np.int32)
    n_A = np.zeros(rows, np.int32)
    for b in range(rows):
        dt, truth, p = drafts[b], truths[b], int(pos[b])
        n = 0
        while n < len(dt) and p + n < truth.size and dt[n] == truth[p + n]:
            n += 1
        emit = truth[p: p + n + 1]
        toks_AxW[b, : emit.size] = emit
        n_A[b] = emit.size
    pos += n_A
    t2 = time.perf_counter()
    if threads is None:
        for b in range(rows):
            d.append(int(ids[b]), toks_AxW[b, : n_A[b]])
    else:
        d.append_batch(ids, toks_AxW, n_A)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, int(n_A.sum())


def _run(bases, rows, answers, prompts, args, modes):
    """Times `args.steps` steps of `rows` rows in every mode (name, threads; threads None:
    per-row calls), each on its own copy of its base (`bases[threads or 1]`). The modes take
    turns step by step, the order reversed every step, so that the machine's speed drifting
    during the run hits them alike. Returns {name: (propose seconds per step [S], append
    seconds per step [S], tokens emitted)}."""
    runs = {name: _start(bases[threads or 1], rows, answers, prompts, args, threads)
            for name, threads in modes}
    out = {name: ([], [], 0) for name, _ in modes}
    for step in range(args.steps + 1):      # step 0: warm-up, not timed
        for name, threads in (modes if step % 2 else modes[::-1]):
            tp, ta, emitted = _step(*runs[name], rows, args.k, threads)
            if step:
                p, a, e = out[name]
                p.append(tp)
                a.append(ta)
                out[name] = (p, a, e + emitted)
    return {name: (np.array(p), np.array(a), e) for name, (p, a, e) in out.items()}


def batch_main(args: argparse.Namespace) -> int:
    from das_jax.drafter import SuffixDrafter  # deferred import: numba

    rows_list = [int(x) for x in str(args.rows).split(",")]
    thread_list = [int(x) for x in str(args.threads).split(",")]
    t0 = time.perf_counter()
    base, answers, prompts = _build(args)
    bases = {1: base}
    forest = base.history.forest
    print(f"drafter batch bench: {args.problems} problems x {args.rollouts} rollouts x "
          f"~{args.length} tokens (vocab {args.vocab}) indexed: {forest.indexed_tokens} tokens, "
          f"{forest.num_nodes} nodes, built in {time.perf_counter() - t0:.1f} s; depth="
          f"{args.depth} k={args.k} steps={args.steps} scopes="
          f"{','.join(getattr(base, 'scopes', ('problem',)))}")
    batched = hasattr(SuffixDrafter, "propose_batch")
    modes = [("per-row", None)] + ([(f"batch t={t}", t) for t in thread_list] if batched else [])
    _run(bases, 4, answers, prompts, argparse.Namespace(**{**vars(args), "steps": 1}),
         [("per-row", None)])
    header = (f"{'A':>4} {'mode':12} {'propose us/row':>14} {'append us/row':>13} "
              f"{'total us/row':>12} {'step ms':>8} {'x 1 thread (prop / total)':>26} "
              f"{'tok/row/step':>12}")
    print(header)
    print("-" * len(header))
    for t in thread_list:
        if t not in bases:
            bases[t] = _build(args, t)[0]
    for rows in rows_list:
        res = _run(bases, rows, answers, prompts, args, modes)
        one, emitted0 = None, None
        for name, threads in modes:
            tp, ta, emitted = res[name]
            p, a = np.median(tp) / rows * 1e6, np.median(ta) / rows * 1e6
            if emitted0 is None:
                emitted0 = emitted
            elif emitted != emitted0:
                raise RuntimeError(f"{name} emitted {emitted} tokens, per-row {emitted0}")
            if threads == 1:
                one = (p, p + a)
            ratio = (f"{one[0] / p:11.2f} / {one[1] / (p + a):5.2f}"
                     if one is not None and threads is not None else "")
            print(f"{rows:4d} {name:12} {p:14.2f} {a:13.2f} {p + a:12.2f} "
                  f"{(p + a) * rows / 1e3:8.3f} {ratio:>26} {emitted / rows / args.steps:12.2f}",
                  flush=True)
    print("us/row = median over steps of the step's call time / A; x 1 thread = throughput "
          "relative to propose_batch / append_batch on one thread")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(ap, standalone=True)
    raise SystemExit(batch_main(ap.parse_args()))
