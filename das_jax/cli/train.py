"""`das-jax train` (GRPO post-training with DAS rollouts), `das-jax samples` (a run's logged
completions) and `das-jax compare` (two runs side by side).

Everything `train` can check without the model is checked before it loads: the config (keys,
values, reward names), the run directory (not a file, not in use by another run, no previous run
unless --resume / --overwrite, a checkpoint to resume from, the model unchanged on --resume, a
finished run), the platform, and the dataset (read here, before the model).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from das_jax.arg_types import nonnegative_int
from das_jax.config import (MAIN_JOB_CONFIG, ConfigError, apply_compilation_cache,
                            apply_platform, load_config)
from das_jax.data import problems_from_config
from das_jax.errors import one_line
from das_jax.malloc import configure_allocator
from das_jax.parallel import distributed as dist
from das_jax.plan import check_before_training
from das_jax.rl import run_dir as rd
from das_jax.rl.compare import RunDirError, acceptance_by_epoch_table, compare_table, load_run
from das_jax.rl import model_loading
from das_jax.rl.rewards import reward_fns_from_config, self_test_rewards
from das_jax.rl.plots import plot_compare
from das_jax.rl.run_log import (SAMPLES_FILE, format_sample, phase, read_jsonl,
                                setup_console_logging)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="GRPO training with DAS rollouts",
        description="Run GRPO post-training. Rollouts come from the DAS engine. Speculation "
                    "leaves the rollouts' distribution unchanged, so training curves with and "
                    "without it are identical in distribution; they are token-identical only "
                    "while the logits are bitwise equal across step shapes (on a CPU, float32 "
                    "rounding differs between a width-1 and a width-W step, so runs can diverge "
                    "after a rare rounding flip; see the README's caveats).",
        epilog="Config values not set by --config or --set take the defaults in "
               "das_jax/config/schema.py; the resolved config is saved as RUN_DIR/config.yaml. A run "
               "dir gets das-jax-run.json (the mark of a das-jax run), metrics.jsonl, "
               "samples.jsonl, plots/*.png, tb/ (TensorBoard) and checkpoints/.")
    p.add_argument("--config", help="YAML run config (default: the built-in defaults of "
                                    f"das_jax/config/schema.py; the main job is {MAIN_JOB_CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set grpo.beta=0.04 --set drafter=none")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest readable checkpoint (uses "
                        "its config.yaml; --set may still override, e.g. train.steps to extend "
                        "a finished run)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run even if output_dir holds a previous run's files, "
                        "removing only what das-jax wrote there (config.yaml, metrics.jsonl, "
                        "samples.jsonl, checkpoint steps, TensorBoard events, its plots)")
    p.add_argument("--steps", type=nonnegative_int, help="shortcut for --set train.steps=N")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one plain line per step (also the behaviour when "
                        "stderr is not a terminal)")
    p.set_defaults(func=run)

    s = subparsers.add_parser(
        "samples", help="print the completions a training run logged",
        description="Print the completions (with question, expected answer and rewards) that "
                    "'das-jax train' logged to RUN_DIR/samples.jsonl (train.log_samples per step).")
    s.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--step", type=int,
                       help="the step to show (default: the last logged step)")
    which.add_argument("--all", action="store_true", help="show every logged step")
    s.set_defaults(func=run_samples)

    c = subparsers.add_parser(
        "compare", help="overlay two training runs and tabulate their rollout cost and reward",
        description="Compare two runs (e.g. --set drafter=none against drafter=das): writes one "
                    "PNG overlaying reward, rollout time, forward passes and acceptance length "
                    "per step, and prints a markdown table of per-run totals / means over the "
                    "steps both runs logged, with the ratio RUN_B / RUN_A.")
    c.add_argument("run_a", metavar="RUN_A", help="the baseline run directory")
    c.add_argument("run_b", metavar="RUN_B", help="the run compared to it")
    c.add_argument("--out", help="PNG to write (default: compare_<A>_vs_<B>.png in the current "
                                 "directory)")
    c.set_defaults(func=run_compare)


def load_run_config(args: argparse.Namespace):
    """The validated config of `args` (the run's own config.yaml on --resume).

    Raises:
      ConfigError: bad flags combination, no run at --resume, invalid config, or an override
        of model.source on --resume.
    """
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
    configure_allocator()  # before XLA's threads start: freed buffers go back to the OS

    config = load_run_config(args)
    # A multi-process run connects its processes first (before JAX touches a device); process
    # 0 holds the run directory's lock, the others share it.
    spec = dist.resolve(config.distributed)
    primary = spec is None or spec.process_id == 0
    with rd.lock_run_dir(config.output_dir) if primary else contextlib.nullcontext():
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
        else:
            rd.check_new_run(config.output_dir, has_checkpoint=bool(steps_on_disk),
                             overwrite=args.overwrite)
        dist.initialize_from_config(config.distributed)
        apply_platform(config)
        apply_compilation_cache(config)
        problems = problems_from_config(config.data)

        setup_console_logging()
        if config.train.memory_check:   # the plan reads the model's config: fetch it first
            model_loading.fetch_named_source(config)
        memory_plan = check_before_training(config)  # before any weights are loaded
        if memory_plan is not None:
            print(memory_plan.table(), file=sys.stderr)
        # deferred import: jax (after configure_allocator)
        from das_jax.rl.run_checks import check_registered_names
        from das_jax.rl.trainer import GRPOTrainer
        check_registered_names(config)   # before any weights are loaded
        reward_fns = reward_fns_from_config(config.grpo.reward_funcs, config.rewards)
        self_test_rewards(reward_fns)   # the code sandbox's, before any weights are loaded
        model = model_loading.load_model(config)
        try:
            with phase("setting up the trainer (engine, optimizer, prompts)"):
                trainer = GRPOTrainer(config, model=model, problems=problems, reward_fns=reward_fns)
        except ValueError as e:  # engine / sampling settings rejected by their constructors
            print(f"das-jax train: error: {one_line(str(e))}", file=sys.stderr)
            return 2
        records = trainer.train(resume=bool(args.resume), progress=not args.no_progress,
                                overwrite=args.overwrite)
    if records:
        last = records[-1]
        print(f"done: step {last['step']} (that step's reward {last['reward_mean']:.3f}; the "
              f"summary above gives means), run dir {config.output_dir}", file=sys.stderr)
    elif args.resume:
        print(rd.complete_message(args.resume, trainer.step, config.train.steps), file=sys.stderr)
    return 0


def run_samples(args: argparse.Namespace) -> int:
    path = Path(args.run_dir) / SAMPLES_FILE
    if not path.exists():
        print(f"das-jax samples: error: {path} does not exist; pass a run directory written by "
              "'das-jax train' with train.log_samples > 0", file=sys.stderr)
        return 2
    if not path.is_file():
        print(f"das-jax samples: error: {path} is not a file (das-jax writes its samples "
              "there); pass a run directory written by 'das-jax train'", file=sys.stderr)
        return 2
    problems: list[str] = []
    samples = read_jsonl(path, problems)
    samples, skipped = _valid_samples(samples)
    problems += [f"{path}: record {k} is not a das-jax sample (needs an integer 'step' and a "
                 f"numeric 'reward'); skipped" for k in skipped]
    for msg in problems:
        print(f"das-jax samples: warning: {msg}", file=sys.stderr)
    steps = sorted({s["step"] for s in samples})
    if not steps:
        print(f"das-jax samples: error: {path} holds no samples yet", file=sys.stderr)
        return 2
    if args.all:
        shown = samples
    else:
        step = steps[-1] if args.step is None else args.step
        shown = [s for s in samples if s["step"] == step]
        if not shown:
            print(f"das-jax samples: error: no samples for --step {step}; logged steps: "
                  f"{_ranges(steps)}", file=sys.stderr)
            return 2
    for i, s in enumerate(shown):
        print(("\n" if i else "") + format_sample(s))
    return 0


def _valid_samples(records: list) -> tuple[list[dict], list[int]]:
    """(the records `format_sample` can show, the 1-based numbers of the others): a sample is a
    JSON object with an integer `step` and a numeric `reward`."""
    good, bad = [], []
    for k, r in enumerate(records, 1):
        ok = (isinstance(r, dict) and type(r.get("step")) is int
              and isinstance(r.get("reward"), (int, float)) and not isinstance(r["reward"], bool))
        (good.append(r) if ok else bad.append(k))
    return good, bad


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    out, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)


def run_compare(args: argparse.Namespace) -> int:
    problems: list[str] = []
    try:
        runs = [load_run(args.run_a, problems), load_run(args.run_b, problems)]
    except RunDirError as e:
        print(f"das-jax compare: error: {e}", file=sys.stderr)
        return 2
    for msg in problems:
        print(f"das-jax compare: warning: {msg}", file=sys.stderr)
    names = [Path(args.run_a).resolve().name, Path(args.run_b).resolve().name]
    if names[0] == names[1]:
        names = [str(args.run_a), str(args.run_b)]
    out = Path(args.out or f"compare_{names[0]}_vs_{names[1]}.png".replace("/", "_"))
    pairs = list(zip(names, runs))
    plot_compare(pairs, out)
    print(compare_table(pairs))
    by_epoch = acceptance_by_epoch_table(pairs)
    if by_epoch is not None:
        print("\nacceptance per draft source and epoch:\n" + by_epoch)
    print(f"\nplot: {out}")
    return 0
