"""PNG plots of a training run (from its metrics.jsonl records) and of two runs side by side.

`plot_run` writes, under `out_dir`, one titled figure per question a GRPO user asks, with the
epoch boundaries marked as dotted vertical lines:

  reward.png           mean reward (with its std across the batch), accuracy, each reward part
  loss_kl.png          loss, and KL to the reference policy
  response_length.png  mean and max response length, and the cap (rollout.max_new_tokens)
  speculation.png      acceptance length (tokens per verify step per row), generated tokens
                       per forward pass, forward passes
  rollout_time.png     rollout seconds split into prefill / decode / drafter / policy / compile /
                       other (rewards, host work), with the update (train step) seconds beside

`plot_compare` overlays several runs (e.g. drafter das vs none) in one 2x2 figure.
Records written before a metric existed simply leave that curve out.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from das_jax.errors import UserError

Records = Sequence[dict[str, Any]]

_TIME_SPLIT = (("prefill_s", "prefill"), ("decode_s", "decode (verify steps)"),
               ("draft_s", "drafter"), ("draft_model_s", "draft head (admissions)"),
               ("policy_s", "speculation policy"),
               ("compile_s", "engine compile"))


def _plt():
    # deferred import: matplotlib (not loaded by importing this module)
    import matplotlib
    matplotlib.use("Agg")
    # deferred import: matplotlib (not loaded by importing this module)
    import matplotlib.pyplot as plt
    return plt


def _series(records: Records, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _has(records: Records, key: str) -> bool:
    return any(r.get(key) is not None for r in records)


def _mark_epochs(ax, records: Records) -> None:
    """Dotted vertical lines between the last step of an epoch and the first of the next."""
    prev = None
    for r in records:
        e = r.get("epoch")
        if prev is not None and e is not None and e != prev:
            ax.axvline(r["step"] - 0.5, color="0.6", linestyle=":", linewidth=1)
            ax.text(r["step"] - 0.5, 1.0, f" epoch {e}", transform=ax.get_xaxis_transform(),
                    fontsize=7, color="0.4", va="top", ha="left")
        prev = e


def _finish(fig, ax_list, records: Records, out: Path, title: str) -> Path:
    for ax in ax_list:
        _mark_epochs(ax, records)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:   # outside the axes, so it never hides a curve
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax_list[-1].set_xlabel("training step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    _plt().close(fig)
    return out


def plot_run(records: Records, out_dir: str | Path, *,
             max_new_tokens: int | None = None) -> list[Path]:
    """Writes the run's PNGs (module docstring) into `out_dir`; returns their paths ([] when
    there are no records)."""
    if not records:
        return []
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    # Reward, accuracy and the reward parts.
    fig, ax = plt.subplots(figsize=(9.5, 4))
    x, y = _series(records, "reward_mean")
    ax.plot(x, y, marker="o", label="reward (mean over the batch)")
    if _has(records, "reward_std"):
        std = [r.get("reward_std") or 0.0 for r in records if r.get("reward_mean") is not None]
        ax.fill_between(x, [a - s for a, s in zip(y, std)], [a + s for a, s in zip(y, std)],
                        alpha=0.15, label="reward ± std")
    if _has(records, "accuracy"):
        # dashed, hollow markers: the reward line stays visible where the two are equal
        ax.plot(*_series(records, "accuracy"), marker="s", markerfacecolor="none",
                linestyle="--", label="accuracy")
    for k in sorted({k for r in records for k in r if k.startswith("reward/")}):
        if _series(records, k) == _series(records, "accuracy"):
            continue   # the accuracy reward, already drawn as accuracy
        ax.plot(*_series(records, k), linestyle="--", marker=".", label=k.split("/", 1)[1])
    if _has(records, "eval_accuracy"):   # the held-out evals (das_jax.rl.evaluate)
        ax.plot(*_series(records, "eval_accuracy"), marker="*", markersize=11, linestyle=":",
                color="k", label="held-out accuracy (greedy eval)")
    ax.set_ylabel("reward / accuracy")
    written.append(_finish(fig, [ax], records, out_dir / "reward.png",
                           "Reward and accuracy per step"))

    # Loss and KL.
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9.5, 5), sharex=True)
    ax1.plot(*_series(records, "loss"), marker="o", color="C0", label="GRPO loss")
    ax1.set_ylabel("loss")
    if _has(records, "kl"):
        ax2.plot(*_series(records, "kl"), marker="o", color="C3", label="KL to reference")
    else:
        ax2.text(0.5, 0.5, "no KL term (grpo.beta = 0)", transform=ax2.transAxes, ha="center")
    ax2.set_ylabel("KL")
    written.append(_finish(fig, [ax1, ax2], records, out_dir / "loss_kl.png",
                           "Loss and KL per step"))

    # Response length against the cap.
    fig, ax = plt.subplots(figsize=(9.5, 4))
    ax.plot(*_series(records, "response_length_mean"), marker="o", label="mean length")
    ax.plot(*_series(records, "response_length_max"), marker="^", label="max length")
    if max_new_tokens:
        ax.axhline(max_new_tokens, color="C3", linestyle="--",
                   label=f"cap (rollout.max_new_tokens = {max_new_tokens})")
    ax.set_ylabel("response length (tokens)")
    ax.set_ylim(0, max(max_new_tokens or 0, max(_series(records, "response_length_max")[1] or [1]))
                * 1.1)
    written.append(_finish(fig, [ax], records, out_dir / "response_length.png",
                           "Response length per step"))

    # Speculation: acceptance length, tokens per forward pass, forward passes.
    fig, axes = plt.subplots(3, 1, figsize=(9.5, 6.5), sharex=True)
    axes[0].plot(*_series(records, "acceptance_length"), marker="o",
                 label="acceptance length\n(tokens per verify step per row)")
    axes[0].set_ylabel("tokens per row")
    axes[1].plot(*_series(records, "tokens_per_forward"), marker="o", color="C1",
                 label="generated tokens per forward\npass (the whole batch)")
    axes[1].set_ylabel("tokens per forward")
    axes[2].plot(*_series(records, "forward_passes"), marker="o", color="C2",
                 label="forward passes\n(verify steps; prefill not counted)")
    axes[2].set_ylabel("forward passes")
    written.append(_finish(fig, list(axes), records, out_dir / "speculation.png",
                           "Speculation per step"))

    # Rollout time split, with the update beside it.
    fig, ax = plt.subplots(figsize=(9.5, 4))
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for key, label in _TIME_SPLIT:
        if not any(r.get(key) for r in records):     # absent, or 0 throughout (no head)
            continue
        vals = [r.get(key) or 0.0 for r in records]
        ax.bar(steps, vals, bottom=bottom, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if _has(records, "rollout_s"):
        other = [max((r.get("rollout_s") or 0.0) - b, 0.0) for r, b in zip(records, bottom)]
        ax.bar(steps, other, bottom=bottom, width=0.8, color="0.75",
               label="other (calibration, rewards, host)")
    if _has(records, "train_s"):
        ax.plot(*_series(records, "train_s"), color="k", marker="x", linestyle="--",
                label="update (train step), for comparison")
    ax.set_ylabel("seconds")
    written.append(_finish(fig, [ax], records, out_dir / "rollout_time.png",
                           "Rollout time per step, by phase"))
    return written


def common_steps(runs: Sequence[Records], names: Sequence[str] | None = None
                 ) -> list[list[dict[str, Any]]]:
    """Each run's records restricted to the steps every run has (`compare` tabulates those;
    `plot_compare` checks there are some before it draws).

    Raises:
      UserError: the runs have no step in common (naming each run's steps)."""
    steps = [{r["step"] for r in recs} for recs in runs]
    shared = set.intersection(*steps)
    if not shared:
        names = names or [f"run {i + 1}" for i in range(len(runs))]
        spans = ", ".join(f"{n} logged steps {min(s)}-{max(s)}" if s else f"{n} logged none"
                          for n, s in zip(names, steps))
        raise UserError(f"the runs have no step in common ({spans}); compare runs that "
                        "logged the same steps (e.g. both from step 1)")
    return [[r for r in recs if r["step"] in shared] for recs in runs]


def check_plot_path(out: Path, flag: str) -> None:
    """Refuses, before anything is drawn, a plot path matplotlib would not write where it says:
    an existing directory, no extension (matplotlib would append .png), or an extension of no
    image format it writes.

    Raises:
      UserError: naming `flag` and the supported extensions."""
    from matplotlib.backend_bases import FigureCanvasBase  # deferred import: matplotlib
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    use = f"use a .png, .pdf or .svg file (supported: {', '.join('.' + f for f in formats)})"
    if out.is_dir():
        raise UserError(f"{flag} {out} is a directory; give a file name, e.g. "
                        f"{out / 'compare.png'}")
    ext = out.suffix.lower().lstrip(".")
    if not ext:
        raise UserError(f"{flag} {out}: no file extension; {use}")
    if ext not in formats:
        raise UserError(f"{flag} {out}: .{ext} is not an image format matplotlib writes; {use}")


def plot_compare(runs: Sequence[tuple[str, Records]], out: str | Path) -> Path:
    """One PNG overlaying `runs` ((name, records) pairs): reward, rollout seconds (generation,
    compile excluded), forward passes and acceptance length per step."""
    plt = _plt()
    out = Path(out)
    check_plot_path(out, "--out")
    common_steps([r for _, r in runs], [n for n, _ in runs])   # RunDirError: none in common
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = (("reward_mean", "mean reward"), ("generation_s", "rollout seconds (no compile)"),
              ("forward_passes", "forward passes"), ("acceptance_length", "acceptance length"))
    for ax, (key, label) in zip(axes.flat, panels):
        for i, (name, records) in enumerate(runs):
            ax.plot(*_series(records, key), marker="o", markersize=3, color=f"C{i}", label=name)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if runs:
            _mark_epochs(ax, runs[0][1])
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    fig.suptitle(" vs ".join(name for name, _ in runs))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
