"""`das-jax bench {engine,drafter,rollout,replay,async-replay,async-train,main-job}`
(registration imports no jax).

  das-jax bench engine --model smollm2-135m-instruct [--quick] [--json PATH]
      decode tok/s of the verify step (B in {1,16}, W in {1,8}) and of Engine.generate, vs HF
      transformers `generate`; memory-bandwidth floor of one step.
  das-jax bench drafter [--quick]
      drafter latency / acceptance / memory on synthetic RL traffic (no model).
  das-jax bench rollout [--config CONFIG] --drafters none,ngram,suffix-global,das,das-unlimited
      --epochs E [--update-policy] [--out DIR]
      rollout time per epoch and drafter on a real model, with identity check and trace replay.
  das-jax bench rollout --preset readme [--out DIR]
      the README benchmark: 16 GSM8K problems x 8 samples x 384 tokens x 4 epochs, five drafters,
      HF transformers `generate` reference, paper-scale replay under cpu / h100-7b / h200-7b.
  das-jax bench replay TRACE.jsonl [--drafters ...] [--scale paper]
      predicted rollout time per drafter from a recorded trace (simulation + cost model).
  das-jax bench async-replay TRACE.jsonl [--gpus 8] [--rollout-gpus 2,4,6] [--async-steps 1]
      GRPO step time of sync and async schedules (rollout GPUs apart), none and das, at paper
      scale: rollouts replayed under the h200-7b cost model, training from a stated FLOP model.
  das-jax bench async-train [--config CONFIG] [--seeds 0,1,2] [--out DIR]
      the main job's GRPO step time, synchronous vs asynchronous, side by side: an lr-0 pair
      (identical work) and each seed's pair of learning runs, with a fit at equal work.
  das-jax bench main-job RUN_DIR [--from-step K] [--steps N]
      a training run's rollout batches after its checkpoint, with its drafter and with none,
      side by side in one process (the main job's das / none rollout time).
"""
from __future__ import annotations

import argparse
import importlib

from das_jax.arg_types import float_list, int_at_least, name_list, positive_int, set_type
from das_jax.bench import (arguments, async_replay, async_train_bench, drafter_bench,
                           main_job_bench, rollout_bench)
from das_jax.rollout import speculation_names


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: engine, drafter, rollout, replay, "
                              "async-replay, async-train, main-job",
                              description="Benchmarks of das-jax: engine, drafter, rollout, "
                              "replay, async-replay, async-train, main-job.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")

    pe = sub.add_parser("engine", help="decode throughput of the engine vs HF transformers")
    arguments.add_engine_arguments(pe)
    pe.set_defaults(func=_run("das_jax.bench.engine_bench"))

    pd = sub.add_parser("drafter", help="drafter latency, acceptance and memory (no model)")
    drafter_bench.add_arguments(pd)
    _check_drafter_arguments(pd)
    pd.set_defaults(func=drafter_bench.main)

    pr = sub.add_parser("rollout", help="rollout time per drafter over RL epochs (real model)")
    rollout_bench.add_arguments(pr)
    _check_rollout_arguments(pr)
    pr.set_defaults(func=_run("das_jax.bench.rollout_bench"))

    pp = sub.add_parser("replay", help="predict rollout time per drafter from a recorded trace")
    arguments.add_replay_arguments(pp)
    set_type(pp, "--drafters", name_list(speculation_names, as_text=True))
    pp.set_defaults(func=_run("das_jax.cli.bench_replay"))

    pa = sub.add_parser("async-replay", help="GRPO step time, sync vs async schedules, with "
                        "and without DAS, at paper scale on one GPU node (a replay)")
    async_replay.add_arguments(pa)
    for flag in ("--gpus", "--async-steps", "--slots", "--paper-problems", "--paper-samples",
                 "--paper-epochs", "--paper-max-tokens"):
        set_type(pa, flag, positive_int)
    set_type(pa, "--drafters", name_list(speculation_names, as_text=True))
    pa.set_defaults(func=_run("das_jax.bench.async_replay"))

    pt = sub.add_parser("async-train", help="the main job's step time, sync vs async GRPO, "
                        "side by side (real training runs, one after the other)")
    async_train_bench.add_arguments(pt)
    pt.set_defaults(func=async_train_bench.main)

    pm = sub.add_parser("main-job", help="a training run's rollouts with its drafter vs none, "
                        "side by side from a checkpoint")
    main_job_bench.add_arguments(pm)
    set_type(pm, "--steps", positive_int)
    set_type(pm, "--from-step", int_at_least(0))
    set_type(pm, "--drafter", name_list(speculation_names, as_text=True))
    pm.set_defaults(func=_run("das_jax.bench.main_job_bench"))

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _check_drafter_arguments(p: argparse.ArgumentParser) -> None:
    """Converters naming the flag for the options `drafter_bench` defines as plain strings/ints."""
    set_type(p, "--drafters", name_list(("suffix", "suffix-global", "das", "ngram"), as_text=True))
    set_type(p, "--traffic", name_list(("gsm8k", "long"), as_text=True))
    for flag in ("--depth", "--window", "--problems", "--epochs", "--rollouts", "--k"):
        set_type(p, flag, positive_int)
    set_type(p, "--head-scale", arguments.finite_float(0.0, strict=True))   # draft_head.scale


def _check_rollout_arguments(p: argparse.ArgumentParser) -> None:
    """Converters naming the flag for the options `rollout_bench` defines as plain strings/ints."""
    def with_head():      # every speculation, also as NAME+head (the draft head beside it)
        names = tuple(speculation_names())
        return (names + tuple(n + rollout_bench.HEAD_SUFFIX for n in names)
                + tuple(n + rollout_bench.TREE_SUFFIX for n in rollout_bench.TREE_SPECULATIONS))
    set_type(p, "--drafters", name_list(with_head, as_text=True))
    set_type(p, "--temperatures", float_list(minimum=0.0, as_text=True))
    for flag in ("--epochs", "--num-problems", "--max-new-tokens", "--hf-batches", "--hf-threads",
                 "--paper-problems", "--paper-samples", "--paper-max-tokens", "--paper-slots"):
        set_type(p, flag, positive_int)
    set_type(p, "--num-generations", int_at_least(2))


def _run(module: str):
    """`module.main(args)`, the module imported when the command runs (it imports jax)."""
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).main(args)
    return run
