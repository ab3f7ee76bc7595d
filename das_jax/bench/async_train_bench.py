"""`das-jax bench async-train`: the main job's GRPO step time, synchronous vs asynchronous,
side by side in one invocation.

Runs `das-jax train` on one config under each schedule, one run after the other, each in its
own process (a fresh JAX, its own peak RSS), into `--out`:

* **same work** (`--same-work`, on by default): `grpo.learning_rate=0` at the first seed, sync
  then async (then async taking turns with `--turns`). With no update every policy version is
  the same params, so both loops sample the same rollouts and train the same groups: the
  per-step ratio async / sync compares the schedules at identical work.
* **learning** (`--seeds`, 0,1,2): each seed sync and async, alternating which goes first (so
  a drift of the machine's speed over the invocation favours neither). These runs train, so
  the async run (sampling one version back) trains other batches: different token counts, and
  a different number of groups with a reward spread (the only groups the update trains; an
  all-equal group has zero advantage and is skipped). The step time is therefore also fitted
  by least squares over every step of these runs,

      step_s = a + b * groups + c * tokens / 100 + d * [async]

  so `d` (with its standard error) is the async schedule's cost per step at equal work.

Step time is the trainer's `step_s` (rollout, rewards, update, and for async the wait for the
rollout), steps 2..N: step 1 compiles every program and is left out. The reward curve is
printed in blocks of 4 steps, and in blocks of 4 of the policy versions that sampled the
batches (an async step s samples from version s - 1 - k, a sync one from s - 1: the by-version
curve compares learning per update), with the synchronous seeds' range beside the asynchronous
seeds' mean.
Nothing is shared between runs but the machine: run it on a quiet one (two cores cannot run
both sides of a colocated async step at full speed, so the gain of the overlap itself is the
replay's, `das-jax bench async-replay`).

    das-jax bench async-train --config configs/smollm2-135m-arith.yaml --out runs/async-bench

Each main-job run takes ~4 min on 2 cores; the defaults (2 same-work runs + 3 seeds x 2) take
~35 min. Writes `--out`/summary.json (every number printed) and keeps each run's directory and
log there, less its checkpoints (`--keep-checkpoints` keeps them). When a run fails, the runs
before it are reported before the error.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from das_jax.arg_types import int_list, positive_int
from das_jax.config import MAIN_JOB_CONFIG as DEFAULT_CONFIG
from das_jax.config import main_job_config
from das_jax.config import ConfigError, load_config
from das_jax.errors import UserError
from das_jax.rl.run_files import read_metrics

BLOCK = 4                                             # steps per reward-curve block


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help=f"the training config (default: the main job, {DEFAULT_CONFIG} of the "
                        "working directory or of the checkout das_jax runs from)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value in every run (as `das-jax train --set`)")
    p.add_argument("--seeds", type=int_list(minimum=0, example="0,1,2"), default="0,1,2",
                   help="train.seed of the learning runs, each run sync and async (default 0,1,2)")
    p.add_argument("--same-work", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the learning-rate-0 pair (identical work; default: on)")
    p.add_argument("--turns", action="store_true",
                   help="also run the same-work async run with train.async_overlap=false "
                        "(rollout and update take turns)")
    p.add_argument("--async-steps", type=positive_int, default=1,
                   help="train.async_steps of the asynchronous runs (default 1)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoints (default: removed once the run is "
                        "summarised; each holds the params and optimizer state, ~1.5 GB for "
                        "the main job)")
    p.add_argument("--out", default=None,
                   help="directory for the runs, their logs and summary.json; must be new or "
                        "empty (default: a temporary directory, removed at the end)")


@dataclass
class RunPlan:
    """One `das-jax train` run of the bench: its label, schedule, seed and extra overrides."""
    label: str
    schedule: str            # "sync" | "async" | "async-turns"
    seed: int
    same_work: bool
    overrides: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    """What one run measured (steps 2..N). `step_s`, `groups`, `tokens` are per step."""
    label: str
    schedule: str
    seed: int
    same_work: bool
    step_s: list[float]
    groups: list[int]
    tokens: list[int]
    reward_blocks: list[float]
    version_blocks: list[float]
    eval_accuracy: float | None
    max_version_lag: int
    dropped_groups: int
    wall_s: float
    peak_rss_gib: float

    @property
    def mean_step_s(self) -> float:
        return float(np.mean(self.step_s))


def plan_runs(seeds, *, same_work: bool, turns: bool, async_steps: int) -> list[RunPlan]:
    """The runs in the order they run: the same-work pair (and turns) first, then each seed's
    sync and async, sync first for even positions and async first for odd ones."""
    sync = ["train.async_steps=0"]
    asyn = [f"train.async_steps={async_steps}", "train.async_overlap=true"]
    runs = []
    if same_work:
        s = seeds[0]
        lr0 = ["grpo.learning_rate=0"]
        runs += [RunPlan(f"same-sync-s{s}", "sync", s, True, lr0 + sync),
                 RunPlan(f"same-async-s{s}", "async", s, True, lr0 + asyn)]
        if turns:
            runs.append(RunPlan(f"same-turns-s{s}", "async-turns", s, True,
                                lr0 + asyn[:1] + ["train.async_overlap=false"]))
    for i, s in enumerate(seeds):
        pair = [RunPlan(f"sync-s{s}", "sync", s, False, list(sync)),
                RunPlan(f"async-s{s}", "async", s, False, list(asyn))]
        runs += pair[::-1] if i % 2 else pair
    return runs


def summarise_run(plan: RunPlan, records: list[dict], prompts_per_step: int, *,
                  wall_s: float, peak_rss_gib: float) -> RunResult:
    """A RunResult from a run's metrics.jsonl records.

    Raises:
      ValueError: fewer than 2 step records (step 1 is left out, so nothing would be left).
    """
    steps = sorted((r for r in records if r.get("kind") != "eval" and "step_s" in r),
                   key=lambda r: r["step"])
    if len(steps) < 2:
        raise ValueError(f"{plan.label}: {len(steps)} step records; the bench needs >= 2 "
                         "(pass train.steps >= 2)")
    kept = steps[1:]
    rewards = [r["reward_mean"] for r in steps]
    blocks = [float(np.mean(rewards[i:i + BLOCK])) for i in range(0, len(rewards), BLOCK)]
    by_version: dict[int, list[float]] = {}   # a sync step s samples from version s - 1
    for r in steps:
        v = r.get("policy_version")
        by_version.setdefault(r["step"] - 1 if v is None else int(v), []).append(r["reward_mean"])
    per_v = [float(np.mean(by_version[v])) for v in sorted(by_version)]
    v_blocks = [float(np.mean(per_v[i:i + BLOCK])) for i in range(0, len(per_v), BLOCK)]
    evals = [r for r in records if r.get("kind") == "eval" and "eval_accuracy" in r]
    return RunResult(
        plan.label, plan.schedule, plan.seed, plan.same_work,
        step_s=[float(r["step_s"]) for r in kept],
        groups=[round(prompts_per_step * (1.0 - r["frac_reward_zero_std"])) for r in kept],
        tokens=[int(r["generated_tokens"]) for r in kept],
        reward_blocks=blocks, version_blocks=v_blocks,
        eval_accuracy=float(evals[-1]["eval_accuracy"]) if evals else None,
        max_version_lag=max(int(r.get("version_lag") or 0) for r in steps),
        dropped_groups=sum(int(r.get("dropped_groups") or 0) for r in steps),
        wall_s=wall_s, peak_rss_gib=peak_rss_gib)


def equal_work_fit(results: list[RunResult]) -> dict | None:
    """Least squares over every step of the learning runs: step_s = a + b groups +
    c tokens/100 + d [async]. Returns the coefficients and their standard errors (ordinary
    least squares, s.e. from sigma^2 (X^T X)^-1), or None when there are too few steps or the
    design is rank-deficient (e.g. only one schedule)."""
    rows = [(1.0, g, t / 100.0, 1.0 if r.schedule != "sync" else 0.0, s)
            for r in results if not r.same_work
            for g, t, s in zip(r.groups, r.tokens, r.step_s)]
    if len(rows) < 6:
        return None
    A = np.array(rows, np.float64)
    X, y = A[:, :4], A[:, 4]
    if np.linalg.matrix_rank(X) < 4:
        return None
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    sigma2 = float(resid @ resid) / (len(y) - 4)
    se = np.sqrt(np.diag(sigma2 * np.linalg.inv(X.T @ X)))
    names = ("a", "b_per_group", "c_per_100_tokens", "d_async")
    return {"steps": len(y), **{n: float(v) for n, v in zip(names, beta)},
            **{f"{n}_se": float(v) for n, v in zip(names, se)}}


def report(results: list[RunResult]) -> tuple[list[str], dict]:
    """The printed lines and the summary (ratios, fit, reward spread) of all runs."""
    lines = [f"{'run':18s} {'step s':>7s} {'groups':>6s} {'tokens':>7s} {'lag':>3s} "
             f"{'held-out':>8s} {'peak GiB':>8s}  reward by {BLOCK} steps"]
    for r in results:
        acc = "-" if r.eval_accuracy is None else f"{r.eval_accuracy:.3f}"
        lines.append(f"{r.label:18s} {r.mean_step_s:7.2f} {sum(r.groups):6d} {sum(r.tokens):7d} "
                     f"{r.max_version_lag:3d} {acc:>8s} {r.peak_rss_gib:8.2f}  "
                     + " ".join(f"{b:.2f}" for b in r.reward_blocks))
    summary: dict = {"runs": [asdict(r) | {"mean_step_s": r.mean_step_s} for r in results]}
    by = lambda same, sched: [r for r in results if r.same_work == same and r.schedule == sched]  # noqa: E731
    same_sync, same_async, same_turns = by(True, "sync"), by(True, "async"), by(True, "async-turns")
    if same_sync and same_async:
        ratio = same_async[0].mean_step_s / same_sync[0].mean_step_s
        summary["same_work_ratio"] = ratio
        lines.append(f"same work (learning rate 0): async / sync per step {ratio:.3f} "
                     f"({same_async[0].mean_step_s:.2f} vs {same_sync[0].mean_step_s:.2f} s; "
                     f"tokens {sum(same_async[0].tokens)} vs {sum(same_sync[0].tokens)}, groups "
                     f"{sum(same_async[0].groups)} vs {sum(same_sync[0].groups)}); "
                     f"never slower: {'yes' if ratio <= 1.0 else 'NO'}")
        if same_turns:
            t = same_turns[0].mean_step_s / same_sync[0].mean_step_s
            summary["same_work_turns_ratio"] = t
            lines.append(f"same work, async taking turns (async_overlap false) / sync: {t:.3f}")
    sync, asyn = by(False, "sync"), by(False, "async")
    if sync and asyn:
        ms, ma = np.mean([r.mean_step_s for r in sync]), np.mean([r.mean_step_s for r in asyn])
        gs, ga = np.mean([sum(r.groups) for r in sync]), np.mean([sum(r.groups) for r in asyn])
        summary["learning_ratio"] = float(ma / ms)
        lines.append(f"learning ({len(sync)} + {len(asyn)} runs): async / sync per step "
                     f"{ma / ms:.3f} ({ma:.2f} vs {ms:.2f} s), groups trained per run "
                     f"{ga:.1f} vs {gs:.1f}")
        fit = equal_work_fit(results)
        summary["equal_work_fit"] = fit
        if fit is not None:
            lines.append(
                f"fit over {fit['steps']} steps, step_s = a + b groups + c tokens/100 + d async: "
                f"b {fit['b_per_group']:.3f} s, c {fit['c_per_100_tokens']:.3f} s, "
                f"d {fit['d_async']:+.3f} s (s.e. {fit['d_async_se']:.3f}): async at equal work "
                + ("not slower" if fit['d_async'] <= 2 * fit['d_async_se'] else "SLOWER"))
        else:
            lines.append("fit at equal work: n/a (too few steps, or groups / tokens that do "
                         "not vary between steps)")
        summary["reward"] = _reward_spread(sync, asyn, lines)
    return lines, summary


def _reward_spread(sync: list[RunResult], asyn: list[RunResult], lines: list[str]) -> dict:
    """Per block of steps, and per block of the versions that sampled the batches: the sync
    seeds' range and the async seeds' mean; appends their lines."""
    out = {}
    for key, what in (("reward_blocks", f"reward by {BLOCK} steps"),
                      ("version_blocks", f"reward by {BLOCK} sampling versions")):
        n = min(len(getattr(r, key)) for r in sync + asyn)
        lo = [min(getattr(r, key)[i] for r in sync) for i in range(n)]
        hi = [max(getattr(r, key)[i] for r in sync) for i in range(n)]
        mean_a = [float(np.mean([getattr(r, key)[i] for r in asyn])) for i in range(n)]
        inside = sum(lo[i] <= mean_a[i] <= hi[i] for i in range(n))
        lines.append(f"{what}, sync range | async mean: " + "  ".join(
            f"{lo[i]:.2f}-{hi[i]:.2f}|{mean_a[i]:.2f}" for i in range(n))
            + f"; async mean inside the sync range in {inside}/{n} blocks")
        out[key] = {"sync_low": lo, "sync_high": hi, "async_mean": mean_a,
                    "blocks_inside": inside, "blocks": n}
    acc_s = [r.eval_accuracy for r in sync if r.eval_accuracy is not None]
    acc_a = [r.eval_accuracy for r in asyn if r.eval_accuracy is not None]
    if acc_s and acc_a:
        lines.append(f"held-out accuracy at the end: sync {min(acc_s):.3f}-{max(acc_s):.3f}, "
                     f"async {min(acc_a):.3f}-{max(acc_a):.3f}")
    return out


def _run_one(plan: RunPlan, config: str, overrides: list[str], out: Path) -> tuple[float, float, int]:
    """Runs `das-jax train` for `plan` into out/<label> (log out/<label>.log). Returns
    (wall s, peak RSS GiB, exit code)."""
    cmd = [sys.executable, "-m", "das_jax.cli", "train", "--config", config, "--no-progress",
           "--set", f"output_dir={out / plan.label}", "--set", f"train.seed={plan.seed}"]
    for o in overrides + plan.overrides:
        cmd += ["--set", o]
    log = out / f"{plan.label}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20, proc.returncode


def main(args: argparse.Namespace) -> int:
    seeds = args.seeds
    args.config = args.config or main_job_config()
    if not Path(args.config).is_file():
        raise ConfigError(f"--config {args.config}: no such file; pass a training config "
                          f"(the main job is {DEFAULT_CONFIG}, run from the repository root)")
    runs = plan_runs(seeds, same_work=args.same_work, turns=args.turns,
                     async_steps=args.async_steps)
    for r in runs:   # every run's config checked before the first one starts
        cfg = load_config(args.config, list(args.overrides) + r.overrides
                          + [f"train.seed={r.seed}"])
    if cfg.train.steps < 2:
        raise ConfigError(f"train.steps is {cfg.train.steps}; the bench leaves step 1 out "
                          "(it compiles), so pass train.steps >= 2")
    prompts = cfg.grpo.prompts_per_step
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"--out {args.out} is not empty; pass a new directory")
        out.mkdir(parents=True, exist_ok=True)
        cleanup = None
    else:
        out = Path(tempfile.mkdtemp(prefix="das-jax-async-train-"))
        cleanup = out
    try:
        print(f"{len(runs)} runs of {args.config} ({cfg.train.steps} steps each), one after the "
              f"other, into {out}", flush=True)
        results = []
        for r in runs:
            wall, rss, rc = _run_one(r, args.config, list(args.overrides), out)
            if rc != 0:
                tail = (out / f"{r.label}.log").read_text().strip().splitlines()[-1:]
                what = f"run {r.label}: das-jax train exited {rc}: {' '.join(tail)}"
                if results:   # what the finished runs measured is not lost
                    print(f"{r.label} failed; the {len(results)} runs before it:", flush=True)
                    _write_report(results, args, seeds, out, cleanup is None)
                if rc == 2:   # the run's own one-line user error: the same input fails here
                    raise UserError(what)
                print(f"{what} (log {out / r.label}.log)", file=sys.stderr)
                return rc if rc > 0 else 1
            res = summarise_run(r, read_metrics(out / r.label / "metrics.jsonl"), prompts,
                                wall_s=wall, peak_rss_gib=rss)
            results.append(res)
            if not args.keep_checkpoints:
                shutil.rmtree(out / r.label / "checkpoints", ignore_errors=True)
            print(f"{r.label}: {res.mean_step_s:.2f} s per step (steps 2-{len(res.step_s) + 1}), "
                  f"wall {wall:.0f} s, peak RSS {rss:.2f} GiB", flush=True)
        _write_report(results, args, seeds, out, cleanup is None)
        return 0
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


def _write_report(results: list[RunResult], args, seeds, out: Path, kept: bool) -> None:
    """Prints the report of `results` and writes it to out/summary.json."""
    lines, summary = report(results)
    print("\n".join(lines), flush=True)
    summary["command"] = " ".join(["das-jax bench async-train", "--config", args.config]
                                  + [f"--set {o}" for o in args.overrides]
                                  + [f"--seeds {','.join(map(str, seeds))}"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if kept:
        print(f"runs, logs and summary.json in {out}", flush=True)


if __name__ == "__main__":   # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
