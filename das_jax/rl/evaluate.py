"""Held-out evaluation of the policy: greedy decoding on problems the run never trains on.

The trainer evaluates at step 0 (before any update), every `eval.every` steps, and at the last
step (config section `eval`; `eval.num_problems: 0` disables it). Each evaluation is one record
in `metrics.jsonl`, `{"kind": "eval", "step": s, "eval_accuracy", "eval_reward", ...}`, and one
phase line on the console.

The held-out set (`held_out_problems`) is drawn from the same source as the training problems,
past them: for the synthetic `arithmetic` kind, problems `n .. n + 2M` of the same seed and
difficulty (problem `i` depends only on (seed, i)), for the file kinds the problems after
`data.limit`; any whose id or question text equals a training problem's is dropped, so no
evaluated question was ever trained on.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from das_jax.config import Config
from das_jax.data import Problem, load_dataset_from_config, render_prompt, reward_kwargs
from das_jax.malloc import release_free_memory
from das_jax.models.tokenizer import encode_prompt
from das_jax.rl.run_log import phase

__all__ = ["EvalError", "held_out_problems", "evaluate", "Evaluator", "eval_due"]


class EvalError(ValueError):
    """No held-out problems can be found for the requested evaluation (names the fix)."""


def held_out_problems(config: Config, train_problems: Sequence[Problem],
                      num_problems: int | None = None) -> list[Problem]:
    """`num_problems` (default `config.eval.num_problems`) problems disjoint from `train_problems`.

    Args:
      config: the run config (its `data` section says where problems come from).
      train_problems: the problems the run trains on.
      num_problems: how many held-out problems (>= 1).

    Returns:
      Up to `num_problems` problems, none sharing an id or a question with `train_problems`
      (fewer only when the source runs out; never none).

    Raises:
      EvalError: the source has no problem beyond the training ones (for file kinds, set
        `data.limit` below the file's size, or disable the eval with `eval.num_problems=0`).
    """
    d = config.data
    m = config.eval.num_problems if num_problems is None else num_problems
    n = len(train_problems)
    if d.kind == "arithmetic":
        pool = load_dataset_from_config(d.kind, num_problems=n + 2 * m, seed=d.seed,
                                        **d.task_kwargs())[n:]
    elif d.limit is None:
        raise EvalError(f"eval.num_problems={m} needs problems held out from training, but "
                        f"data.limit is not set, so the run trains on all of {d.kind!r}; set "
                        "data.limit (the eval takes the problems after it) or eval.num_problems=0")
    else:
        pool = load_dataset_from_config(d.kind, d.path, limit=d.limit + 2 * m)[n:]
    ids = {p.problem_id for p in train_problems}
    questions = {p.prompt.strip() for p in train_problems}
    out = [p for p in pool if p.problem_id not in ids and p.prompt.strip() not in questions][:m]
    if not out:
        raise EvalError(f"no held-out problems: every problem of data.kind={d.kind!r} after the "
                        f"{n} training ones is a training question; lower data.num_problems / "
                        "data.limit or set eval.num_problems=0")
    return out


def evaluate(engine, tokenizer, problems: Sequence[Problem], reward_fn: Callable, *,
             max_new_tokens: int, params=None, instruction: str | None = None,
             chat: bool = True, stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Greedy (temperature 0) completions of `problems`, scored by `reward_fn`.

    Args:
      engine: a `das_jax.engine.Engine` (plain decoding, no drafter).
      tokenizer: encodes / decodes, and renders the chat template when `chat`.
      problems: the held-out problems (non-empty).
      reward_fn: a `combine_rewards` function (with `.breakdown`).
      max_new_tokens: the response budget per problem (tokens).
      params: the params to evaluate (default: the engine's).
      instruction, chat: prompt rendering, as for training (`data.instruction`, `data.chat`).
      stop_token_ids: extra stop tokens, as for training.

    Returns:
      `eval_accuracy` (mean of the `math_accuracy*` / `code*` reward part, None without one),
      `eval_reward` (mean total reward), `eval_format` (mean `format*` part, when present),
      `eval_response_length_mean` (tokens), `eval_stopped` (fraction that ended with a stop
      token rather than the budget), `eval_num_problems`, `eval_s` (wall seconds), and
      `eval_samples` (the first two completions, for the console).
    """
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import Request, SamplingParams

    t0 = time.perf_counter()
    texts = [render_prompt(p, tokenizer if chat else None, instruction=instruction, chat=chat)
             for p in problems]
    requests = [Request(tuple(encode_prompt(tokenizer, t, chat=chat)), problem_id=p.problem_id)
                for t, p in zip(texts, problems)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                              stop_token_ids=tuple(stop_token_ids), seed=0)
    outputs, _ = engine.generate(requests, sampling, params=params)
    completions = [tokenizer.decode(o.token_ids) for o in outputs]
    total, parts = reward_fn.breakdown(texts, completions, **reward_kwargs(list(problems)))
    acc = next((v for k, v in parts.items() if k.startswith(("math_accuracy", "code"))), None)
    fmt = next((v for k, v in parts.items() if k.startswith("format")), None)
    return {
        "eval_accuracy": float(np.mean(acc)) if acc is not None else None,
        "eval_reward": float(np.mean(total)),
        **({"eval_format": float(np.mean(fmt))} if fmt is not None else {}),
        "eval_response_length_mean": float(np.mean([len(o.token_ids) for o in outputs])),
        "eval_stopped": float(np.mean([o.finish_reason == "stop" for o in outputs])),
        "eval_num_problems": len(problems),
        "eval_s": time.perf_counter() - t0,
        "eval_samples": [{"problem_id": p.problem_id, "answer": p.answer, "completion": c}
                         for p, c in zip(problems[:2], completions[:2])],
    }


def eval_due(step: int, total_steps: int, every: int) -> bool:
    """Whether the eval runs after `step` optimizer steps: at 0, at `total_steps`, and at
    multiples of `every` (0: only start and end)."""
    return step == 0 or step == total_steps or (every > 0 and step % every == 0)


@dataclasses.dataclass
class Evaluator:
    """The trainer's evaluation: a fixed held-out set, run through the trainer's engine with its
    current params. `for_trainer` builds it (None when `eval.num_problems` is 0)."""

    problems: list[Problem]
    config: Config

    @classmethod
    def for_trainer(cls, trainer) -> "Evaluator | None":
        """The trainer's held-out set: `trainer.eval_problems` when a caller set it (tests),
        else `held_out_problems(trainer.config, trainer.problems)`."""
        c = trainer.config
        if c.eval.num_problems == 0:
            return None
        problems = getattr(trainer, "eval_problems", None)
        if problems is None:
            problems = held_out_problems(c, trainer.problems)
        return cls(list(problems), c)

    def run(self, trainer, step: int) -> dict[str, Any]:
        """Evaluates `trainer.params`; returns the metrics record for `step` (with a phase line
        on the console)."""

        c = self.config
        with phase(f"evaluating at step {step}: {len(self.problems)} held-out problems, "
                   "greedy") as ph:
            m = evaluate(trainer.rollouts.engine, trainer.tokenizer, self.problems,
                         trainer.reward_fn,
                         max_new_tokens=c.eval.max_new_tokens or c.rollout.max_new_tokens,
                         params=trainer.rollout_params(), instruction=c.data.instruction,
                         chat=c.data.chat, stop_token_ids=c.rollout.stop_token_ids)
            acc = m["eval_accuracy"]
            ph.detail = (("" if acc is None else f"accuracy {acc:.3f}, ")
                         + f"reward {m['eval_reward']:.3f}, {m['eval_stopped']:.0%} stopped, "
                         f"mean length {m['eval_response_length_mean']:.1f} tokens")
        m.pop("eval_samples")
        release_free_memory()
        return {"kind": "eval", "step": step, **m}
