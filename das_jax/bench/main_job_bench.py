"""`das-jax bench main-job RUN_DIR`: a training run's rollouts with its drafter and with `none`,
side by side in one process.

Restores a checkpoint of a `das-jax train` run (params, drafter history and DAS policy state,
the newest at or below `--from-step`), then rolls out the batches of the steps that follow it
(the same problems, prompts and sampling seeds the trainer would use) once with the run's
drafter and once with `none`, on the same engine, alternating which goes first; no training.
Per step it prints wall time (compiles included, and apart), forward passes, accepted / drafted
tokens and how many rollouts the two produced identically; at the end, drafter / none over all
steps but the first (which warms both up: the programs they share compile there), with and
without compiles. This measures a run's rollout time with its drafter against plain decoding
without the noise of two runs one after the other on a shared machine, and without
the two runs' training diverging. Nothing is written into the run directory but its lock file
(held while reading, so no training run writes checkpoints meanwhile). It holds the trainer
(params and optimizer state) and the engine, like `das-jax train` (peak RSS 3.9 GiB on the
default main job).

    das-jax bench main-job runs/smollm2-135m-arith --from-step 12 --steps 12
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from das_jax.config import ConfigError, apply_compilation_cache, apply_platform, load_config
from das_jax.data import problems_from_config
from das_jax.rl import run_dir as rd
from das_jax.rl import model_loading


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `das-jax train` run directory "
                   "(its output_dir) with at least one checkpoint")
    p.add_argument("--from-step", type=int, default=None,
                   help="restore the newest checkpoint at or below this step (default: newest)")
    p.add_argument("--steps", type=int, default=None,
                   help="rollout batches to run after the checkpoint (default: one epoch)")
    p.add_argument("--drafter", default=None,
                   help="speculation compared with none (default: the run's `drafter`)")


def main(args: argparse.Namespace) -> int:

    if args.drafter and "," in args.drafter:
        raise ConfigError(f"--drafter takes one speculation name, got {args.drafter!r}")
    run = Path(args.run_dir)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"{args.run_dir}: no config.yaml there; pass the "
                          "output_dir of a run written by 'das-jax train'")
    saved = rd.checkpoint_steps(run)
    steps_on_disk = [s for s in saved if args.from_step is None or s <= args.from_step]
    if not steps_on_disk:
        where = "" if args.from_step is None else f" at or below step {args.from_step}"
        have = f" (it has steps {', '.join(map(str, saved))})" if saved else ""
        raise ConfigError(f"{args.run_dir}: no checkpoint{where}{have}; let the run "
                          "save one (train.save_every) or pass another --from-step")
    with tempfile.TemporaryDirectory(prefix="das-jax-main-job-") as scratch, \
            rd.lock_run_dir(run):
        overrides = [f"output_dir={scratch}"]
        if args.drafter:
            overrides.append(f"drafter={args.drafter}")
        cfg = load_config(cfg_path, overrides)
        if cfg.drafter == "none":
            raise ConfigError(f"{args.run_dir}: the run's drafter is none; pass "
                              "--drafter das (or another speculation) to compare with it")
        return _compare(cfg, run, steps_on_disk[-1], args.steps)


def _compare(cfg, run: Path, step: int, steps: int | None) -> int:
    # deferred import: jax, optax, orbax (not loaded by importing this module)
    from das_jax.engine import Request, request_seed
    from das_jax.rl.checkpoint import CheckpointManager
    from das_jax.rl.trainer import GRPOTrainer
    from das_jax.rollout import Rollout

    apply_platform(cfg)
    apply_compilation_cache(cfg)
    problems = problems_from_config(cfg.data)
    trainer = GRPOTrainer(cfg, model=model_loading.load_model(cfg), problems=problems)
    manager = CheckpointManager(run, max_to_keep=None)
    start = trainer.restore(manager, max_step=step)
    spec = trainer.rollouts
    spec.set_policy_version(start)   # every rollout here samples the restored params (no update)
    plain = Rollout(spec.engine, "none", das=spec.das, sampling=spec.sampling)
    G = cfg.grpo.num_generations
    steps = steps or trainer.steps_per_epoch()
    totals = {n: dict(wall=0.0, compile=0.0, fwd=0, acc=0, drafted=0) for n in (cfg.drafter, "none")}
    same_all = rows_all = 0
    print(f"restored step {start} of {run}; rolling out steps {start + 1}-{start + steps} with "
          f"{cfg.drafter} and none ({len(problems)} problems, {cfg.grpo.prompts_per_step} x {G} "
          "rollouts per step)", flush=True)
    for s in range(start, start + steps):
        problems_s = trainer.problems_for_step(s)
        sampling = dataclasses.replace(
            spec.sampling, seed=request_seed(cfg.train.seed, f"step-{s}", 0))
        requests = [Request(tuple(trainer.prompt_ids[p.problem_id]), problem_id=p.problem_id,
                            sample_index=g) for p in problems_s for g in range(G)]
        params = trainer.rollout_params()
        order = [(cfg.drafter, spec), ("none", plain)]
        if (s - start) % 2:
            order.reverse()
        res = {}
        for name, ro in order:
            t0 = time.perf_counter()
            outs, st = ro.generate(requests, params, sampling)
            res[name] = (time.perf_counter() - t0, st, [tuple(o.token_ids) for o in outs])
        del params
        same = sum(a == b for a, b in zip(res[cfg.drafter][2], res["none"][2]))
        line = f"step {s + 1}: identical {same}/{len(requests)}"
        for name in (cfg.drafter, "none"):
            wall, st, _ = res[name]
            line += (f" | {name} {wall:.2f} s (compile {st.compile_s:.2f}), "
                     f"{st.forward_passes} passes, accepted {st.accepted_draft_tokens}/"
                     f"{st.drafted_tokens}")
            if s > start:
                t = totals[name]
                t["wall"] += wall
                t["compile"] += st.compile_s
                t["fwd"] += st.forward_passes
                t["acc"] += st.accepted_draft_tokens
                t["drafted"] += st.drafted_tokens
        if s > start:
            same_all += same
            rows_all += len(requests)
        print(line, flush=True)
        if (s + 1) % trainer.steps_per_epoch() == 0:
            spec.advance_epoch()
    if steps < 2:
        print("(one step only: it warms both up and is not summarised; pass --steps >= 2)")
        return 0
    d, n = totals[cfg.drafter], totals["none"]
    net = lambda t: t["wall"] - t["compile"]   # noqa: E731
    print(f"steps {start + 2}-{start + steps}: {cfg.drafter} {d['wall']:.1f} s (compiles "
          f"{d['compile']:.1f}), none {n['wall']:.1f} s (compiles {n['compile']:.1f}); "
          f"{cfg.drafter} / none {d['wall'] / n['wall']:.3f}, without compiles "
          f"{net(d) / max(net(n), 1e-9):.3f}; forward passes {d['fwd']} / {n['fwd']} "
          f"({d['fwd'] / max(n['fwd'], 1):.3f}); accepted draft tokens {d['acc']} of "
          f"{d['drafted']}; identical rollouts {same_all}/{rows_all}")
    return 0


if __name__ == "__main__":   # pragma: no cover
    sys.exit(main(argparse.ArgumentParser().parse_args()))
