"""Run logging: `metrics.jsonl`, `samples.jsonl`, TensorBoard, the console, PNG plots.

The console gets, through the `logging` logger "das_jax" (the CLI installs a handler with
`setup_console_logging`; a library user configures logging as they like):

* phase lines with timings (`phase(...)`: fetching / loading the model, calibrating the cost
  model, evaluating), what each step compiled (`CompileWatch`), and a "still running" line
  when a step has been quiet for 30 s;
* one plain line per step (step, reward, accuracy, loss, kl, rollout s, train s, tokens per
  forward, ETA) when there is no terminal or progress is off; on a terminal, a tqdm bar instead;
* at the end, a summary table and where to find the samples, plots and TensorBoard events.

The ETA excludes one-off costs: each step's wall time minus the JAX compile time spent in it
(the engine's step shapes, the cost-model calibration's shapes, the train step), averaged over
the steps run so far, times the steps left.

The console handler and `phase` live in `das_jax.rl.console_log`, compile counting in
`das_jax.rl.compile_watch`, the JSON-lines files in `das_jax.rl.run_files`; their public names
are importable from here too.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from das_jax.engine import add_counts
from das_jax.json_values import is_number
from das_jax.rl.compile_watch import CompileWatch, describe_compiles
from das_jax.rl.console_log import (Phase, fmt_seconds, phase,  # noqa: F401 - re-exported
                                    setup_console_logging)
from das_jax.rl.plots import plot_run
from das_jax.rl.run_dir import checkpoint_steps
from das_jax.rl.run_files import (METRICS_FILE, SAMPLES_FILE, RunFileError,  # noqa: F401
                                  clip_line, format_sample, read_jsonl, read_metrics,
                                  sample_rows, truncate_jsonl)

log = logging.getLogger("das_jax.train")

# A step whose drafts were all rejected is warned about (a drafter whose drafts never reach
# the verifier, or match another policy) only when it drafted at least this many tokens: at
# a first-token acceptance of one half, a step with a few drafting rows has none accepted by
# chance (2 rows: 1 in 4), while 64 draft tokens span enough rows that it does not.
ZERO_ACCEPTANCE_MIN_DRAFTED = 64

_clock = time.perf_counter   # the step clock (a test replaces it)

_BAR_KEYS = (("reward_mean", "reward", "{:.3f}"), ("accuracy", "acc", "{:.2f}"),
             ("loss", "loss", "{:.4f}"), ("rollout_s", "rollout_s", "{:.1f}"),
             ("train_s", "train_s", "{:.1f}"), ("tokens_per_forward", "tok/fwd", "{:.2f}"))


class _Heartbeat:
    """A daemon thread that logs "step k still running ..." when a step has been quiet for
    `every_s` seconds (so a long first step, compiling, never looks hung)."""

    def __init__(self, run_logger: "RunLogger", every_s: float):
        self.rl, self.every_s = run_logger, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="das-jax-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s / 3):
            self.rl.report_if_quiet(self.every_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _summary_writer_class():
    """`tensorboardX.SummaryWriter`, imported without torch: tensorboardX's writer imports torch
    whenever it is installed (only to accept torch tensors, which das-jax never passes), which
    costs the training process ~0.2-0.3 GB of memory. When torch is not loaded yet, its import
    is blocked while tensorboardX loads (tensorboardX then takes numpy arrays only)."""
    if "torch" in sys.modules:
        # deferred import: tensorboardX (not loaded by importing this module)
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        # deferred import: tensorboardX (not loaded by importing this module)
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class RunLogger:
    """Appends one JSON record per step to `<run_dir>/metrics.jsonl` and the step's first
    completions to `<run_dir>/samples.jsonl` (records of steps after `start_step` left by a
    killed run are dropped first, so a resumed run's logs hold each step once), mirrors numeric
    values and samples to TensorBoard under `<run_dir>/tb`, reports each step on the console
    (module docstring), and on close writes the plots of `das_jax.rl.plots` under
    `<run_dir>/plots` and logs a summary table.

    Args:
      run_dir: the run directory (exists).
      total_steps: the run's last step; start_step: steps already done (resume).
      progress: a tqdm bar when stderr is a terminal; otherwise (or False) one line per step.
      max_new_tokens: the response-length cap drawn on the length plot.
      steps_per_epoch: for the console's epoch column (None: not shown).
      heartbeat_s: a "still running" line after this many quiet seconds in a step (0: never).
    """

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0,
                 progress: bool = True, *, max_new_tokens: int | None = None,
                 steps_per_epoch: int | None = None, heartbeat_s: float = 30.0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        self.total_steps = total_steps
        self.start_step = start_step
        self.max_new_tokens = max_new_tokens
        self.steps_per_epoch = steps_per_epoch
        truncate_jsonl(self.path, start_step, check_steps=True)
        truncate_jsonl(self.samples_path, start_step)
        self._file = open(self.path, "a")
        self._samples_file = open(self.samples_path, "a")
        try:
            self._tb = _summary_writer_class()(str(self.run_dir / "tb"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            self._tb = None
        self._watch = CompileWatch()
        self._watch.take()   # compiles before the loop (model init) are not the steps'
        self._t_last = self._t_start = _clock()
        self._steady: list[float] = []
        self._oneoff_s = 0.0
        self.records: list[dict[str, Any]] = []
        self._bar = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm  # deferred import: tqdm (slow to import)
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             file=sys.stderr,
                             bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}")
        first = start_step + 1
        if first <= total_steps:
            log.info("training steps %d-%d into %s; step %d also compiles the engine's and the "
                     "train step's shapes (one-off, excluded from the ETA)",
                     first, total_steps, self.run_dir, first)
        self._last_output = self._step_started = time.perf_counter()
        self._between_steps = False
        self.eval_records: list[dict[str, Any]] = []
        self._heartbeat = _Heartbeat(self, heartbeat_s) if heartbeat_s > 0 else None

    def report_if_quiet(self, every_s: float) -> None:
        """Logs "step k still running ..." when nothing was printed for `every_s` seconds (called
        by the heartbeat thread)."""
        now = time.perf_counter()
        if self._between_steps or now - self._last_output < every_s:
            return
        self._last_output = now
        seconds, programs = self._watch.so_far()
        extra = (f"; so far {describe_compiles(seconds, programs)}" if programs else "")
        log.info("step %d still running: %s%s", self._next_step(),
                 fmt_seconds(now - self._step_started), extra)

    def _next_step(self) -> int:
        return self.start_step + len(self.records) + 1

    # -------------------------------------------------------------- per step
    def eta_s(self) -> float | None:
        """Seconds left: the mean step time without compiles, times the steps left."""
        if not self._steady:
            return None
        done = self.start_step + len(self._steady)
        return sum(self._steady) / len(self._steady) * max(self.total_steps - done, 0)

    def log(self, record: dict[str, Any], samples: Sequence[dict] | None = None) -> None:
        """Writes one step's record (adding `step_s`, `jit_compile_s`, `jit_compiles`) and its
        samples, and reports the step."""
        now = _clock()
        compile_s, programs = self._watch.take()
        step_s = now - self._t_last
        self._t_last = now
        record["step_s"] = step_s
        record["jit_compile_s"] = compile_s
        record["jit_compiles"] = sum(programs.values())
        self._steady.append(max(step_s - compile_s, 0.0))
        self._oneoff_s += min(compile_s, step_s)
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        for s in samples or ():
            self._samples_file.write(json.dumps(s) + "\n")
        self._samples_file.flush()
        if self._tb is not None:
            self._tb_scalars(record, step)
            if samples:
                self._tb.add_text("samples", "\n\n".join(
                    "```\n" + format_sample(s) + "\n```" for s in samples), step)
            self._tb.flush()
        self._last_output = self._step_started = time.perf_counter()
        if compile_s >= 1.0:
            log.info("step %d: %s", step, describe_compiles(compile_s, programs))
        if (record.get("drafted_tokens") or 0) >= ZERO_ACCEPTANCE_MIN_DRAFTED and \
                record.get("accepted_draft_tokens") == 0:
            log.warning("step %d: the drafter drafted %d tokens and not one was accepted "
                        "(acceptance 0 for the whole step): its drafts do not reach the "
                        "verifier or do not match the policy; compare with drafter: none",
                        step, record["drafted_tokens"])
        epoch_line = self.epoch_acceptance_line(record)
        eta = self.eta_s()
        if self._bar is not None:
            post = {name: fmt.format(record[k]) for k, name, fmt in _BAR_KEYS
                    if record.get(k) is not None}
            post["eta"] = fmt_seconds(eta)
            self._bar.set_postfix(post)
            self._bar.update(1)
        else:
            log.info("%s", self.step_line(record, eta))
            if samples:
                s = samples[0]
                log.info("  sample (reward %.2f, %d tokens): %s", s["reward"],
                         s.get("length", 0), clip_line(s["completion"], 100))
        if epoch_line:
            log.info("%s", epoch_line)

    def epoch_acceptance_line(self, record: dict[str, Any]) -> str | None:
        """At the last step of an epoch (or of the run): the epoch's acceptance rate per draft
        position and per draft source, from this run's records of that epoch (and the online
        draft head's mean loss and top-1 agreement, when it trains one); None otherwise or
        without drafts."""
        spe, step = self.steps_per_epoch, record["step"]
        if not spe or (step % spe and step != self.total_steps) or "epoch" not in record:
            return None
        rows = [r for r in self.records if r.get("epoch") == record["epoch"]]
        d_pos, a_pos, d_src, a_src = [], [], {}, {}
        for r in rows:
            for into, key in ((d_pos, "drafted_by_position"), (a_pos, "accepted_by_position")):
                add_counts(into, r.get(key) or [])
            for into, key in ((d_src, "drafted_by_source"), (a_src, "accepted_by_source")):
                for k, v in (r.get(key) or {}).items():
                    into[k] = into.get(k, 0) + v
        if not d_pos or not d_pos[0]:
            return None
        shown = [a / d for a, d in zip(a_pos, d_pos) if d][:8]
        sources = ", ".join(f"{k} {a_src.get(k, 0) / d:.2f} of {d:,}"
                            for k, d in sorted(d_src.items(), key=lambda kv: -kv[1]) if d)
        head = [r for r in rows if r.get("draft_loss") is not None]   # trained online
        online = (f"; online draft head: loss {sum(r['draft_loss'] for r in head) / len(head):.3f}"
                  f", top-1 {sum(r['draft_top1'] for r in head) / len(head):.2f}" if head else "")
        return (f"epoch {record['epoch']} acceptance by draft position "
                f"{' '.join(f'{x:.2f}' for x in shown)} (positions 1-{len(shown)}); by source "
                f"(accepted / drafted tokens): {sources}{online}")

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Work between training steps (an evaluation): its wall time and compiles do not count
        in the next step's `step_s` / ETA, and the heartbeat stays quiet meanwhile."""
        t0 = _clock()
        self._between_steps = True
        try:
            yield
        finally:
            self._t_last += _clock() - t0
            self._watch.take()
            self._last_output = self._step_started = time.perf_counter()
            self._between_steps = False

    def _tb_scalars(self, record: dict, step: int) -> None:
        """Every finite number of `record` (except `step`) as a TensorBoard scalar at `step`."""
        for k, v in record.items():
            if is_number(v) and k != "step" and math.isfinite(v):
                self._tb.add_scalar(k, v, step)

    def log_eval(self, record: dict[str, Any]) -> None:
        """Writes an evaluation record (`{"kind": "eval", "step", "eval_*"...}`, from
        das_jax.rl.evaluate) to metrics.jsonl and its numbers to TensorBoard."""
        self.eval_records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb_scalars(record, record["step"])
            self._tb.flush()

    def step_line(self, r: dict[str, Any], eta: float | None) -> str:
        """`step 3/16 | reward 0.150 | acc 0.25 | loss 0.0123 | kl 0.0000 | rollout 12.3 s | ...`"""
        def f(key, fmt):
            v = r.get(key)
            return "-" if v is None else fmt.format(v)
        epoch = f" (epoch {r['epoch']})" if "epoch" in r else ""
        return (f"step {r['step']}/{self.total_steps}{epoch} | reward {f('reward_mean', '{:.3f}')}"
                f" | acc {f('accuracy', '{:.2f}')} | loss {f('loss', '{:.4f}')}"
                f" | kl {f('kl', '{:.4f}')} | rollout {f('rollout_s', '{:.1f}')} s"
                # asynchronous GRPO: how long the update waited for it, and its policy lag
                + (f" (waited {f('rollout_wait_s', '{:.1f}')} s, lag {r['version_lag']})"
                   if "version_lag" in r else "")
                + f" | train {f('train_s', '{:.1f}')} s | tok/fwd {f('tokens_per_forward', '{:.2f}')}"
                f" | eta {fmt_seconds(eta)}")

    # -------------------------------------------------------------- end
    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        self._file.close()
        self._samples_file.close()
        self._watch.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        written = plot_run(read_metrics(self.path), self.run_dir / "plots",
                           max_new_tokens=self.max_new_tokens)
        if self.records:
            log.info("summary of this run:\n%s", summary_table(
                self.records, wall_s=_clock() - self._t_start,
                oneoff_s=self._oneoff_s, eval_records=self.eval_records))
        steps = checkpoint_steps(self.run_dir)
        saved = (f"checkpoints of step{'s' if len(steps) > 1 else ''} "
                 f"{', '.join(map(str, steps))} in checkpoints/ (das-jax export {self.run_dir} "
                 f"OUT_DIR: a Hugging Face model dir), " if steps else "")
        log.info("run dir %s: %s, %s (das-jax samples %s), %s%d plots in plots/; TensorBoard: "
                 "pip install tensorboard && tensorboard --logdir %s",
                 self.run_dir, METRICS_FILE, SAMPLES_FILE, self.run_dir, saved, len(written),
                 self.run_dir / "tb")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summary_table(records: Sequence[dict[str, Any]], wall_s: float | None = None,
                  oneoff_s: float | None = None,
                  eval_records: Sequence[dict[str, Any]] = ()) -> str:
    """A markdown table summarising a run's records (time split, reward and accuracy at the
    start and end, held-out eval accuracy at the first and last eval, forward passes, tokens
    per forward, peak memory)."""
    first, last = records[:4], records[-4:]
    tot = lambda k: sum(r.get(k) or 0 for r in records)  # noqa: E731
    fp, gen = tot("forward_passes"), tot("generated_tokens")

    def span(key, fmt="{:.3f}"):
        a, b = _mean(r.get(key) for r in first), _mean(r.get(key) for r in last)
        return "-" if a is None else f"{fmt.format(a)} -> {fmt.format(b)}"

    rows = [("steps", f"{records[0]['step']}-{records[-1]['step']}"),
            ("wall time", fmt_seconds(wall_s) if wall_s is not None else "-"),
            ("one-off compile", fmt_seconds(oneoff_s) if oneoff_s is not None else "-"),
            ("rollout, total (mean per step)",
             f"{fmt_seconds(tot('rollout_s'))} ({tot('rollout_s') / len(records):.1f} s)"),
            *([("rollout waited for, total (asynchronous GRPO)",
                f"{fmt_seconds(tot('rollout_wait_s'))} "
                f"({tot('rollout_wait_s') / len(records):.1f} s)")]
              if any("rollout_wait_s" in r for r in records) else []),
            ("update, total (mean per step)",
             f"{fmt_seconds(tot('train_s'))} ({tot('train_s') / len(records):.1f} s)"),
            ("reward, first 4 -> last 4 steps", span("reward_mean")),
            ("accuracy, first 4 -> last 4 steps", span("accuracy", "{:.2f}")),
            ("response length, first 4 -> last 4", span("response_length_mean", "{:.1f}")),
            *([(f"eval accuracy (greedy, held out), step {eval_records[0]['step']} -> "
                 f"{eval_records[-1]['step']}", "{:.3f} -> {:.3f}".format(
                     eval_records[0]["eval_accuracy"], eval_records[-1]["eval_accuracy"]))]
              if eval_records and eval_records[0].get("eval_accuracy") is not None
              and eval_records[-1].get("eval_accuracy") is not None else []),
            ("forward passes (generated tokens)", f"{fp} ({gen})"),
            ("tokens per forward", f"{gen / fp:.2f}" if fp else "-"),
            ("peak RSS (this process)",
             f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f} GiB")]
    w = max(len(k) for k, _ in rows)
    out = [f"| {'metric'.ljust(w)} | value |", f"|{'-' * (w + 2)}|-------|"]
    out += [f"| {k.ljust(w)} | {v} |" for k, v in rows]
    return "\n".join(out)
