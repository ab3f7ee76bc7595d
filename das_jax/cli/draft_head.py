"""`das-jax draft-head fit`: an EAGLE-3 draft head fitted offline to recorded rollouts;
`das-jax draft-head replay`: its online training (`train.draft_loss_weight`) replayed over them."""
from __future__ import annotations

import argparse
import math
import os
import sys

from das_jax.arg_types import check_output_file, positive_int
from das_jax.bench.drafter_trace import load_trace_rollouts
from das_jax.errors import UserError


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return v


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "draft-head", help="fit an EAGLE-3 draft head to a policy's recorded rollouts, or "
                           "replay its online training over them",
        description="Draft heads (EAGLE-3): one decoder layer fed by three of the policy's "
                    "blocks, drafting over a reduced vocabulary.")
    sub = p.add_subparsers(dest="draft_head_command", metavar="SUBCOMMAND", required=True)
    f = sub.add_parser(
        "fit", help="fit a head to the rollouts of a trace",
        description="Runs the trace's rollouts through its policy once (the features of three "
                    "blocks and the policy's next-token distribution at every position), then "
                    "fits a head with EAGLE-3's training-time test (soft cross-entropy against "
                    "the policy, 3 draft steps) on the output positions.",
        epilog="e.g. das-jax draft-head fit docs/traces/gsm8k-smollm2-135m.jsonl.gz --out "
               "head.safetensors --holdout 0.5 ; then das-jax bench drafter --trace "
               "docs/traces/gsm8k-smollm2-135m.jsonl.gz --head head.safetensors")
    f.add_argument("trace", metavar="TRACE", help="a rollout trace (`das-jax bench rollout` "
                   "writes DIR/trace.jsonl; one ships as docs/traces/gsm8k-smollm2-135m.jsonl.gz)")
    f.add_argument("--out", required=True, help="the head file to write (.safetensors)")
    f.add_argument("--model", default=None,
                   help="the policy (model source); default: the trace's model")
    f.add_argument("--holdout", type=_fraction, default=0.0,
                   help="fraction of the trace's problems (the last ones) never fitted on; the "
                        "benchmark measures the head on them")
    f.add_argument("--epochs", type=positive_int, default=4)
    f.add_argument("--batch", type=positive_int, default=8, help="rollouts per step")
    f.add_argument("--lr", type=_positive_float, default=2e-3, help="peak AdamW learning rate")
    f.add_argument("--draft-vocab", type=positive_int, default=4096,
                   help="draft vocabulary: at most this many of the rollouts' tokens")
    f.add_argument("--steps", type=positive_int, default=3,
                   help="draft steps of the training-time test")
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(func=run_fit)
    register_replay(sub)


def run_fit(args: argparse.Namespace) -> int:
    # deferred import: jax
    from das_jax.draft_head.fit import FitConfig, check_fit_size, split_problems

    check_output_file(args.out, "--out", "head.safetensors")
    header, rollouts = load_trace_rollouts(args.trace)   # every line checked
    model = args.model or header.get("model")
    if not model:
        raise UserError(f"trace {args.trace}: its header names no model; pass --model SOURCE")
    fit_ids, hold_ids = split_problems([r.problem_id for r in rollouts], args.holdout)
    if not fit_ids:
        raise UserError(f"--holdout {args.holdout} leaves no problem of {args.trace} to fit on")
    cfg = FitConfig(epochs=args.epochs, batch=args.batch, lr=args.lr,
                    draft_vocab=args.draft_vocab, steps=args.steps, seed=args.seed)
    check_fit_size(rollouts, hold_ids, cfg, f"trace {args.trace}")   # before the model loads

    from tqdm import tqdm  # deferred import: tqdm (slow to import; not for --help)

    from das_jax.draft_head import fit_head, save_head
    from das_jax.models import load

    model_config, params, _ = load(model)
    top = max(max(r.token_ids + r.prompt_ids, default=0) for r in rollouts)
    if top >= model_config.vocab_size:
        raise UserError(f"trace {args.trace}: token id {top} is outside {model}'s vocabulary of "
                        f"{model_config.vocab_size}; the trace was recorded with another "
                        "tokenizer: pass the trace's --model")

    def bar(total, desc):
        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)

    head, _ = fit_head(model_config, params, model, rollouts, cfg, hold_ids, bar=bar,
                       log=lambda line: tqdm.write(line, file=sys.stderr),
                       meta={"trace": os.path.abspath(args.trace)})
    try:
        save_head(args.out, head)
    finally:   # a failed write leaves no half-written head beside --out
        if os.path.exists(f"{args.out}.tmp") and not os.path.isdir(f"{args.out}.tmp"):
            os.remove(f"{args.out}.tmp")
    print(f"wrote {args.out}: draft head for {model} ({head.config.draft_vocab_size} draft "
          f"tokens, blocks {list(head.config.feature_layers)}), fitted on "
          f"{len(fit_ids)} problems" + (f", {len(hold_ids)} held out" if hold_ids else ""))
    return 0


def _rates(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(not (v >= 0 and math.isfinite(v)) for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite learning rates >= 0 "
                                         f"(e.g. 0,1e-4,3e-4), got {text!r}")
    return vals


def register_replay(sub) -> None:
    r = sub.add_parser(
        "replay", help="replay online training of a head over a trace, per learning rate",
        description="Replays `train.draft_loss_weight` online training over a trace's "
                    "rollouts in their order, BATCH rollouts per step (as GRPO steps would "
                    "see them), from the same head for each learning rate (0: the head "
                    "frozen): each batch is scored by the head before it trains on it, so the "
                    "printed loss and top-1 agreement per epoch are on rollouts it has not "
                    "seen. Chooses train.draft_learning_rate without a training run.",
        epilog="e.g. das-jax draft-head replay docs/traces/gsm8k-smollm2-135m.jsonl.gz --head "
               "head.safetensors --problems holdout --learning-rates 0,1e-4,3e-4,1e-3")
    r.add_argument("trace", metavar="TRACE", help="a rollout trace of the head's policy")
    r.add_argument("--head", required=True, help="the head to start from (.safetensors)")
    r.add_argument("--learning-rates", type=_rates, default=[0.0, 1e-4, 3e-4, 1e-3],
                   help="comma-separated AdamW learning rates (0: frozen)")
    r.add_argument("--problems", choices=("holdout", "fit", "all"), default="holdout",
                   help="the trace's rollouts replayed: of the problems the head was not "
                        "fitted on (its holdout), of those it was, or all")
    r.add_argument("--batch", type=positive_int, default=32, help="rollouts per step")
    r.add_argument("--micro-batch", type=positive_int, default=8, help="rows per forward")
    r.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    # deferred import: jax, safetensors (not for --help)
    from das_jax.draft_head.store import check_head_for_policy, load_head

    header, rollouts = load_trace_rollouts(args.trace)   # every line checked
    head = load_head(args.head)
    model = head.meta.get("model") or header.get("model")
    hold = set(head.meta.get("holdout_problems") or ())
    if args.problems != "all":
        rollouts = [r for r in rollouts if (r.problem_id in hold) == (args.problems == "holdout")]
    if not rollouts:
        raise UserError(f"--problems {args.problems}: trace {args.trace} has no rollouts of the "
                        f"head's {'held-out' if args.problems == 'holdout' else 'fitted'} "
                        "problems; pass --problems all")

    from tqdm import tqdm  # deferred import: tqdm (slow to import; not for --help)

    # deferred import: jax, optax (the model and the replay's programs; not for --help)
    from das_jax.draft_head.online import prequential_replay
    from das_jax.models import load

    model_config, params, _ = load(model)
    check_head_for_policy(head, args.head, model, model_config)
    n_batches = -(-len(rollouts) // args.batch)
    bar = tqdm(total=len(rollouts) + n_batches * len(args.learning_rates), file=sys.stderr,
               desc="features, then the replays", dynamic_ncols=True)
    res = prequential_replay(model_config, params, head, rollouts, args.learning_rates,
                             batch=args.batch, micro_batch=args.micro_batch,
                             progress=bar.update)
    bar.close()
    epochs = sorted({row["epoch"] for rows in res.values() for row in rows})
    print(f"{len(rollouts)} rollouts of {len({r.problem_id for r in rollouts})} problems "
          f"({args.problems}), {n_batches} steps of {args.batch}; draft loss / top-1 agreement "
          "with the policy at draft step 1, each step scored before the head trains on it")
    print("| learning rate | " + " | ".join(f"epoch {e}" for e in epochs) + " |")
    print("|---|" + "---|" * len(epochs))
    for lr, rows in res.items():
        by = {row["epoch"]: row for row in rows}
        cells = [f"{by[e]['loss']:.3f} / {by[e]['top1']:.3f}" if e in by else "-"
                 for e in epochs]
        print(f"| {lr:g}{' (frozen)' if lr == 0 else ''} | " + " | ".join(cells) + " |")
    return 0
