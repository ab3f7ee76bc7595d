"""The run directory's JSON-lines files: `metrics.jsonl` (one record per step) and
`samples.jsonl` (each step's first completions): the rows written (`sample_rows`), how a sample
prints (`format_sample`), tolerant reading (`read_jsonl`, `read_metrics`) and the truncation a
resumed run applies (`truncate_jsonl`)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from das_jax.errors import UserError

log = logging.getLogger("das_jax.train")

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def sample_rows(rb, step: int, count: int, prompt_text: dict[str, str] | None = None) -> list[dict]:
    """The first `count` rollouts of a step as JSON-able dicts (question, rendered prompt,
    completion, answer, reward and its parts, length, finish reason).

    Args:
      rb: the step's `RolloutBatch` (das_jax.rl.trainer).
      step: the 1-based step number the rows are logged under.
      count: how many rows (0 = none).
      prompt_text: problem_id -> the rendered prompt the model saw (default: the question).
    """
    rows = []
    for i in range(min(count, len(rb.outputs))):
        p, o = rb.problems[i], rb.outputs[i]
        rows.append({
            "step": step, "index": i, "problem_id": p.problem_id,
            "sample_index": o.request.sample_index,
            "question": p.prompt,
            "prompt": (prompt_text or {}).get(p.problem_id, p.prompt),
            "completion": rb.completions[i],
            "answer": p.answer if isinstance(p.answer, str) and len(p.answer) < 500 else None,
            "reward": float(rb.rewards[i]),
            "rewards": {k: float(v[i]) for k, v in rb.reward_parts.items()},
            "length": len(o.token_ids), "finish_reason": o.finish_reason,
        })
    return rows


def format_sample(s: dict, width: int = 100) -> str:
    """A sample (a `sample_rows` dict) as a readable block of text."""
    rewards = s.get("rewards")
    parts = ", ".join(f"{k} {v:.3g}" if isinstance(v, (int, float)) else f"{k} {v}"
                      for k, v in (rewards.items() if isinstance(rewards, dict) else ()))
    head = (f"── step {s['step']} · sample {s.get('index', '?')} · "
            f"problem {s.get('problem_id', '?')} "
            f"(#{s.get('sample_index', '?')}) · reward {s['reward']:.3f}"
            + (f" ({parts})" if parts else "")
            + f" · {s.get('length', '?')} tokens, {s.get('finish_reason', '?')}")
    lines = [head, f"question: {s.get('question', s.get('prompt', ''))}"]
    if s.get("answer") is not None:
        lines.append(f"expected: {s['answer']}")
    lines.append("completion:")
    lines += ["  " + line for line in (s.get("completion") or "(empty)").splitlines()]
    return "\n".join(lines)


def clip_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


class RunFileError(UserError):
    """A run's JSON-lines log that cannot be read (not UTF-8 before its last line)."""


_STEP_RE = re.compile(rb'"step":\s*(\d+)')


def read_jsonl(path: str | Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; [] if the file does not exist.

    A line that is not a JSON object is skipped and reported (never silently): a torn last line
    (a run killed while writing it) or a damaged line, with the file, the line number and the
    step it held when that can be read. Reports go to `problems` when given (one string each),
    else to the log as warnings.

    Raises:
      RunFileError: a line before the last one is not valid UTF-8 (names the file and line).
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    out = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        torn = n == len(lines)           # the last line, with no newline after it
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            if not torn:
                raise RunFileError(f"{path}:{n}: invalid UTF-8 (byte {e.start + 1} of the line); "
                                   "the file is damaged or was not written by das-jax") from None
            rec = None
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
            continue
        m = _STEP_RE.search(raw)
        what = ("torn last line (the run was killed while writing it)" if torn
                else "line that is not a JSON record")
        msg = f"{path}:{n}: skipped a {what}" + (f"; it held step {int(m.group(1))}" if m else "")
        if problems is not None:
            problems.append(msg)
        else:
            log.warning("%s", msg)
    return out


def read_metrics(path: str | Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (skipped lines reported as by `read_jsonl`)."""
    return read_jsonl(path, problems)


def truncate_jsonl(path: Path, start_step: int, *, check_steps: bool = False) -> None:
    """Keeps the records of steps <= `start_step` (a resumed run logs the later ones again);
    reports skipped lines and, with `check_steps`, the steps up to `start_step` that have no
    record (lost when a killed run tore its line)."""
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= start_step]
    if check_steps and start_step > 0 and path.exists():
        have = {r.get("step") for r in kept if r.get("kind") != "eval"}
        lost = [s for s in range(1, start_step + 1) if s not in have]
        if lost:
            log.warning("%s has no record of step %s (lost when the run was killed while "
                        "writing it); the run resumes after step %d, so those steps stay "
                        "missing from its metrics and plots", path,
                        ", ".join(map(str, lost)), start_step)
    with open(path, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
