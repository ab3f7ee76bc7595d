"""Checks a training run makes before it spends time: registered names before the model
loads, prompts and stop ids before the first rollout (each a one-line `TrainError`)."""
from __future__ import annotations

from das_jax.config import Config
from das_jax.rl import losses
from das_jax.rl.advantages import get_advantage
from das_jax.rl.train_error import TrainError


def check_registered_names(config: Config):
    """(advantage estimator, loss) registered under `grpo.advantage_estimator` and
    `grpo.loss_type` (their registries import jax, so the config schema cannot check them).

    Raises:
      TrainError: either name is not registered (one line naming the key and the valid names).
    """
    g = config.grpo
    try:
        return get_advantage(g.advantage_estimator), losses.get_loss(g.loss_type)
    except ValueError as e:
        raise TrainError(f"grpo.{e}") from None


def check_prompts_and_stop_ids(config: Config, model_config, rollouts,
                               prompt_ids: dict) -> None:
    """What the engine would reject at the first rollout, checked when a trainer is built
    and named by its config key (`prompt_ids`: problem id -> prompt token ids; `rollouts`
    the trainer's `Rollout`).

    Raises:
      TrainError: a rollout.stop_token_ids entry outside the vocabulary, or a prompt that
        does not fit rollout.max_cache_len with rollout.max_new_tokens and the widest draft.
    """
    c, vocab = config, model_config.vocab_size
    bad = [t for t in c.rollout.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise TrainError(f"rollout.stop_token_ids {bad} are outside the model's vocabulary "
                         f"[0, {vocab}); use token ids of the model's tokenizer")
    ec = getattr(rollouts, "engine_config", None)
    limit = ec.max_cache_len if ec is not None else c.rollout.max_cache_len
    width = max(ec.draft_widths if ec is not None else c.rollout.draft_widths)
    pid, ids = max(prompt_ids.items(), key=lambda kv: len(kv[1]))
    need = len(ids) + c.rollout.max_new_tokens + width
    if need > limit:
        raise TrainError(
            f"the longest prompt (problem {pid!r}, {len(ids)} tokens) + rollout.max_new_tokens"
            f"={c.rollout.max_new_tokens} + draft width {width} needs {need} cache positions "
            f"but rollout.max_cache_len={limit}; raise rollout.max_cache_len to at least "
            f"{need}, lower rollout.max_new_tokens, or shorten the prompts (data.instruction, "
            "data.chat)")
