"""Run logging: `metrics.jsonl`, TensorBoard events, a progress bar, and PNG plots."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

_BAR_KEYS = (("reward_mean", "reward", "{:.3f}"), ("loss", "loss", "{:.4f}"),
             ("rollout_s", "rollout_s", "{:.1f}"), ("acceptance_length", "acc_len", "{:.2f}"))


class RunLogger:
    """Appends one JSON record per step to `<run_dir>/metrics.jsonl` (records of steps after
    `start_step` left by a killed run are dropped first, so a resumed run's log has each step
    once), mirrors numeric values to TensorBoard under `<run_dir>/tb`, shows a progress bar, and
    writes `plots/reward.png` and `plots/rollout_time.png` on close."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0,
                 progress: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
        with open(self.path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        self._file = open(self.path, "a")
        try:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            self._tb = None
        self._bar = None
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" \
                        and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.set_postfix({name: fmt.format(record[k]) for k, name, fmt in _BAR_KEYS
                                   if record.get(k) is not None})
            self._bar.update(1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        plot_metrics(read_metrics(self.path), self.run_dir / "plots")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_metrics(records: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """PNGs of reward and rollout time per step; returns the written paths."""
    if not records:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []
    for key, ylabel, name in (("reward_mean", "mean reward", "reward.png"),
                              ("rollout_s", "rollout seconds", "rollout_time.png")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, [r.get(key) for r in records], marker="o")
        if key == "rollout_s" and any("generation_s" in r for r in records):
            ax.plot(steps, [r.get("generation_s") for r in records], marker=".",
                    label="generation (excl. compile)")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    return written
