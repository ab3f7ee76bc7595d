"""`das-jax train`: GRPO post-training with DAS rollouts.

Everything that can be checked without the model is checked before it loads: the config (keys,
values, reward names), the run directory (not a file, not in use by another run, no previous run
unless --resume / --overwrite, a checkpoint to resume from, the model unchanged on --resume, a
finished run), the platform, and the dataset (read here, before the model).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from das_jax.arg_types import nonnegative_int

DEFAULT_CONFIG = "configs/smollm2-135m-arith.yaml"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="GRPO training with DAS rollouts",
        description="Run GRPO post-training. Rollouts come from the DAS engine; the training "
                    "curve is identical with and without speculation.")
    p.add_argument("--config", help=f"YAML run config (default: built-in defaults, the same job "
                                    f"as {DEFAULT_CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set grpo.beta=0.04 --set drafter=none")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest readable checkpoint (uses "
                        "its config.yaml; --set may still override, e.g. train.steps to extend "
                        "a finished run)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run even if output_dir holds a previous run's files "
                        "(config.yaml, metrics.jsonl, checkpoints/, tb/, plots/), removing them")
    p.add_argument("--steps", type=nonnegative_int, help="shortcut for --set train.steps=N")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def load_run_config(args: argparse.Namespace):
    """The validated config of `args` (the run's own config.yaml on --resume).

    Raises:
      ConfigError: bad flags combination, no run at --resume, invalid config, or an override
        of model.source on --resume.
    """
    from das_jax.config import ConfigError, load_config
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if not args.resume:
        return load_config(args.config, overrides)
    if args.overwrite:
        raise ConfigError("--resume continues a run and --overwrite replaces one; pass only one")
    if args.config:
        raise ConfigError("--resume takes the run's own config.yaml; drop --config "
                          "(use --set to override values)")
    run_dir = Path(args.resume)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"--resume {args.resume}: no config.yaml there; pass the output_dir "
                          "of a run written by 'das-jax train'")
    saved = load_config(cfg_path, [f"output_dir={args.resume}"])
    config = load_config(cfg_path, overrides + [f"output_dir={args.resume}"])
    if config.model.source != saved.model.source:
        raise ConfigError(f"--resume {args.resume}: the run was trained from model.source="
                          f"{saved.model.source!r}, its checkpoints cannot be loaded into "
                          f"{config.model.source!r}; drop that override, or start a new run "
                          "with another output_dir")
    return config


def run(args: argparse.Namespace) -> int:
    from das_jax.config import apply_platform
    from das_jax.rl import run_dir as rd
    config = load_run_config(args)
    with rd.lock_run_dir(config.output_dir):
        steps_on_disk = rd.checkpoint_steps(config.output_dir)
        if args.resume:
            if not steps_on_disk:
                raise rd.RunDirError(
                    f"--resume {args.resume}: the run has no checkpoint to resume from (it was "
                    "stopped before its first save, or train.save_every is 0); start a new run "
                    "with another output_dir, or pass --overwrite instead of --resume to replace "
                    "it")
            if steps_on_disk[-1] >= config.train.steps:
                print(rd.complete_message(args.resume, steps_on_disk[-1], config.train.steps),
                      file=sys.stderr)
                return 0
        elif not args.overwrite:
            rd.check_new_run(config.output_dir, has_checkpoint=bool(steps_on_disk))
        apply_platform(config)
        from das_jax.data import load_dataset_from_config
        d = config.data
        problems = load_dataset_from_config(d.kind, d.path, num_problems=d.num_problems,
                                            limit=d.limit, seed=d.seed)

        from das_jax.rl.trainer import GRPOTrainer
        try:
            trainer = GRPOTrainer(config, problems=problems)
        except ValueError as e:  # engine / sampling settings rejected by their constructors
            from das_jax.errors import one_line
            print(f"das-jax train: error: {one_line(str(e))}", file=sys.stderr)
            return 2
        records = trainer.train(resume=bool(args.resume), progress=not args.no_progress,
                                overwrite=args.overwrite)
    if records:
        last = records[-1]
        print(f"done: step {last['step']}, reward {last['reward_mean']:.3f}, run dir "
              f"{config.output_dir}", file=sys.stderr)
    elif args.resume:
        print(rd.complete_message(args.resume, trainer.step, config.train.steps), file=sys.stderr)
    return 0
