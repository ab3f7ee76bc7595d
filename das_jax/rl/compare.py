"""Two (or more) training runs side by side: per-run totals and means as a markdown table.

Runs are compared over the steps they all logged (a shorter or unfinished run limits the
others), so totals are like for like. The last column is the ratio of the second run to the
first (e.g. with RUN_A = drafter none and RUN_B = das, a rollout-time ratio below 1 means DAS
was faster).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from das_jax.errors import UserError
from das_jax.json_values import is_int, is_number
from das_jax.rl.plots import common_steps
from das_jax.rl.run_log import METRICS_FILE, read_metrics

Records = Sequence[dict[str, Any]]


class RunDirError(UserError):
    """A path that is not a training run directory with logged steps, or runs that cannot be
    compared (a user error: one line, exit code 2)."""


def load_run(run_dir: str | Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """The per-step metrics records of `run_dir` (held-out eval records left out); skipped
    lines (a torn last line) are reported to `problems` as by `read_jsonl`.

    Raises:
      RunDirError: no metrics.jsonl there, or it holds no steps.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise RunDirError(f"{run_dir}: no {METRICS_FILE} there; pass a run directory written by "
                          "'das-jax train' (its output_dir)")
    records = []
    for i, r in enumerate(read_metrics(path, problems), 1):
        if r.get("kind") == "eval":     # steps only
            continue
        check_record(r, f"{path}: record {i}")
        records.append(r)
    if not records:
        raise RunDirError(f"{path} holds no steps yet; let the run finish a step first")
    return records


def check_record(r: dict, where: str) -> None:
    """Checks the fields of a step record that the table and the plot read: an integer 'step',
    numbers (or null) for the metrics, objects of counts for the per-source counts.

    Raises:
      RunDirError: "<file>: record N: <key> ...; <fix>"."""
    fix = "is it a metrics.jsonl written by 'das-jax train'? fix or remove that line"
    if not is_int(r.get("step")):
        raise RunDirError(f"{where} has no integer 'step' (got {r.get('step')!r}); {fix}")
    for key in METRIC_KEYS:
        v = r.get(key)
        if v is not None and not is_number(v):
            raise RunDirError(f"{where}: {key!r} must be a number, got {v!r}; {fix}")
    for key in ("drafted_by_source", "accepted_by_source"):
        v = r.get(key)
        if v is not None and not (isinstance(v, dict) and all(
                is_number(n) for n in v.values())):
            raise RunDirError(f"{where}: {key!r} must be an object of counts, got {v!r}; {fix}")


# (label, key, "sum" | "mean", format)
_ROWS = (
    ("steps compared", "step", "count", "{:d}"),
    ("rollout time, total s", "rollout_s", "sum", "{:.1f}"),
    ("generation time (no compile), total s", "generation_s", "sum", "{:.1f}"),
    ("forward passes, total", "forward_passes", "sum", "{:d}"),
    ("generated tokens, total", "generated_tokens", "sum", "{:d}"),
    ("tokens per forward", None, "ratio", "{:.2f}"),
    ("acceptance length, mean", "acceptance_length", "mean", "{:.2f}"),
    ("reward, mean", "reward_mean", "mean", "{:.3f}"),
    ("accuracy, mean", "accuracy", "mean", "{:.3f}"),
    ("update time, total s", "train_s", "sum", "{:.1f}"),
)

# every numeric metric the table and the plot (`plots.plot_compare`) read
METRIC_KEYS = tuple(sorted({k for _, k, _, _ in _ROWS if k and k != "step"}
                           | {"reward_mean", "generation_s", "forward_passes",
                              "acceptance_length", "draft_loss", "epoch"}))


def _value(records: Records, key: str | None, how: str):
    if how == "count":
        return len(records)
    if how == "ratio":
        fp = sum(r.get("forward_passes") or 0 for r in records)
        return sum(r.get("generated_tokens") or 0 for r in records) / fp if fp else None
    vals = [r[key] for r in records if r.get(key) is not None]
    if not vals:
        return None
    return sum(vals) if how == "sum" else sum(vals) / len(vals)


def compare_table(runs: Sequence[tuple[str, Records]]) -> str:
    """A markdown table: one row per metric, one column per run, and `B / A` (second run over
    the first) when there are two runs."""
    names = [n for n, _ in runs]
    recs = common_steps([r for _, r in runs], names)
    header = ["metric", *names] + ([f"{names[1]} / {names[0]}"] if len(runs) == 2 else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for label, key, how, fmt in _ROWS:
        vals = [_value(r, key, how) for r in recs]
        cells = ["-" if v is None else fmt.format(int(v) if fmt == "{:d}" else v) for v in vals]
        if len(runs) == 2:
            a, b = vals
            cells.append(f"{b / a:.2f}x" if a and b is not None and how != "count" else "")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def acceptance_by_epoch_table(runs: Sequence[tuple[str, Records]]) -> str | None:
    """A markdown table of each draft source's acceptance per epoch (accepted / drafted tokens
    over the epoch's steps, the drafted count beside it), one column per run and source, and
    the online draft head's mean loss per epoch where a run trained one
    (`train.draft_loss_weight`): e.g. a frozen head against one trained online. None when no
    run logged drafts by source."""
    names = [n for n, _ in runs]
    recs = common_steps([r for _, r in runs], names)
    sources = sorted({s for rs in recs for r in rs
                      for s, n in (r.get("drafted_by_source") or {}).items() if n})
    if not sources:
        return None
    losses = [any(r.get("draft_loss") is not None for r in rs) for rs in recs]
    header = ["epoch", *(f"{n}: {s} accepted / drafted" for n in names for s in sources),
              *(f"{n}: draft loss" for n, has in zip(names, losses) if has)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    epochs = sorted({r.get("epoch", 0) for rs in recs for r in rs})
    for e in epochs:
        cells = [str(e)]
        by_run = [[r for r in rs if r.get("epoch", 0) == e] for rs in recs]
        for rs in by_run:
            for s in sources:
                d = sum((r.get("drafted_by_source") or {}).get(s, 0) for r in rs)
                a = sum((r.get("accepted_by_source") or {}).get(s, 0) for r in rs)
                cells.append(f"{a / d:.3f} ({d})" if d else "-")
        for rs, has in zip(by_run, losses):
            if has:
                vals = [r["draft_loss"] for r in rs if r.get("draft_loss") is not None]
                cells.append(f"{sum(vals) / len(vals):.3f}" if vals else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
