"""`das-jax train`: GRPO post-training with DAS rollouts."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
                   help="continue the run in RUN_DIR from its latest checkpoint (uses its "
                        "config.yaml; --set may still override)")
    p.add_argument("--steps", type=int, help="shortcut for --set train.steps=N")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from das_jax.config import ConfigError, apply_platform, load_config
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    try:
        if args.resume:
            cfg_path = Path(args.resume) / "config.yaml"
            if not cfg_path.exists():
                raise ConfigError(f"--resume {args.resume}: no config.yaml there; is it a run "
                                  "directory written by 'das-jax train'?")
            if args.config:
                raise ConfigError("--resume takes the run's own config.yaml; drop --config "
                                  "(use --set to override values)")
            config = load_config(cfg_path, overrides + [f"output_dir={args.resume}"])
        else:
            config = load_config(args.config, overrides)
        apply_platform(config)
    except (ConfigError, OSError) as e:
        print(f"das-jax train: {e}", file=sys.stderr)
        return 2

    from das_jax.plan import PlanError, check_before_training
    try:
        check_before_training(config)  # before any weights are loaded
    except PlanError as e:
        print(f"das-jax train: {e}", file=sys.stderr)
        return 2

    from das_jax.rl.trainer import GRPOTrainer, TrainError
    try:
        trainer = GRPOTrainer(config)
        records = trainer.train(resume=bool(args.resume), progress=not args.no_progress)
    except (TrainError, ValueError) as e:
        print(f"das-jax train: {e}", file=sys.stderr)
        return 2
    if records:
        last = records[-1]
        print(f"done: step {last['step']}, reward {last['reward_mean']:.3f}, run dir "
              f"{config.output_dir}", file=sys.stderr)
    return 0
