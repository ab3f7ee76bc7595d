"""Make user reward functions safe to call from the training loop.

A reward function that raises, returns the wrong number of values, or returns None / NaN for a
sample must never crash a run: the error is logged (``logging``, logger
``das_jax.rl.rewards.safety``, naming the function and the exception) and the affected samples
get 0.0. One sample's failure never spills onto the others: when a call on the batch raises,
each sample is scored again on its own and only the samples that fail alone get 0.0.

The one exception that passes through: ``SandboxUnavailableError`` (a code reward that refuses to
run untrusted code on this machine); scoring every sample 0 instead would train on nothing.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Sequence

from das_jax.rl.rewards.sandbox import SandboxUnavailableError

logger = logging.getLogger(__name__)

__all__ = ["RewardFn", "safe_reward", "combine_rewards", "reward_name"]

#: TRL signature: ``fn(prompts, completions, **columns) -> list[float | None]``.
RewardFn = Callable[..., Sequence[Any]]


def reward_name(fn: Any) -> str:
    """A readable name for a reward function (``__name__``, or the wrapped function's)."""
    for obj in (fn, getattr(fn, "func", None)):
        name = getattr(obj, "__name__", None)
        if name:
            return name
    return type(fn).__name__


def _sanitize(name: str, values: Any, n: int) -> list[float]:
    if values is None:
        raise TypeError(f"returned None instead of a list of {n} rewards")
    try:
        vals = list(values)
    except TypeError as e:
        raise TypeError(f"returned {type(values).__name__}, expected a list of {n} rewards") from e
    if len(vals) != n:
        raise ValueError(f"returned {len(vals)} rewards for {n} completions")
    out = []
    bad = 0
    for v in vals:
        if v is None:
            out.append(0.0)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f):
            bad += 1
            f = 0.0
        out.append(f)
    if bad:
        logger.warning("reward function %r returned %d non-finite/non-numeric value(s); using 0.0", name, bad)
    return out


def safe_reward(fn: RewardFn, name: str | None = None) -> Callable[..., list[float]]:
    """Wrap a reward function so that it never raises.

    The wrapper calls ``fn(prompts, completions, **kwargs)`` and returns ``list[float]`` of
    length ``len(completions)``:
      * ``None`` for a sample -> 0.0 (TRL's "not applicable"); NaN/inf/non-numeric -> 0.0 with
        a warning;
      * an exception on the batch -> each sample is scored on its own (``fn`` called with one
        prompt, one completion and that sample's slice of every per-sample column, i.e. every
        list / tuple / array kwarg of length ``len(completions)``; other kwargs passed as they
        are); samples that fail alone get 0.0, and an ERROR log record names the function, the
        exception (with traceback) and how many samples it cost;
      * a non-list result or a result of the wrong length -> all 0.0, and an ERROR log record;
      * ``SandboxUnavailableError`` is raised, not scored.

    Args:
        fn: the reward function.
        name: name used in logs (default: ``fn.__name__``).
    """
    fname = name or reward_name(fn)

    @functools.wraps(fn)
    def wrapper(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        n = len(completions)
        try:
            values = fn(prompts, completions, **kwargs)
        except SandboxUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - the whole point
            if n <= 1:
                logger.error("reward function %r failed (%s: %s); giving 0.0 to %d sample(s)",
                             fname, type(e).__name__, e, n, exc_info=True)
                return [0.0] * n
            return _per_sample(fname, fn, prompts, completions, kwargs, e)
        try:
            return _sanitize(fname, values, n)
        except (TypeError, ValueError) as e:
            logger.error("reward function %r failed (%s: %s); giving 0.0 to %d sample(s)",
                         fname, type(e).__name__, e, n)
            return [0.0] * n

    wrapper.__name__ = fname
    wrapper.__das_safe__ = True  # type: ignore[attr-defined]
    return wrapper


def _slice_columns(kwargs: dict, n: int, i: int) -> dict:
    """Sample ``i``'s view of the kwargs: per-sample columns (list / tuple / array of length
    ``n``) sliced to ``[i : i + 1]``, everything else unchanged."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, (list, tuple)) and len(v) == n:
            out[k] = list(v[i : i + 1])
        elif hasattr(v, "shape") and getattr(v, "ndim", 0) >= 1 and len(v) == n:
            out[k] = v[i : i + 1]
        else:
            out[k] = v
    return out


def _per_sample(fname: str, fn: RewardFn, prompts: Sequence[str], completions: Sequence[Any],
                kwargs: dict, batch_error: Exception) -> list[float]:
    """Score each sample alone after the batch call raised; failures give that sample 0.0."""
    n = len(completions)
    prompts = list(prompts) if len(prompts) == n else [prompts[0] if prompts else ""] * n
    out, failed = [], []
    for i in range(n):
        try:
            v = _sanitize(fname, fn(prompts[i : i + 1], list(completions[i : i + 1]),
                                    **_slice_columns(kwargs, n, i)), 1)[0]
        except Exception:  # noqa: BLE001 - the whole point
            v = 0.0
            failed.append(i)
        out.append(v)
    logger.error("reward function %r failed on the batch (%s: %s); scored each sample alone: "
                 "%d of %d sample(s) failed and got 0.0 (indices %s)", fname, type(batch_error).__name__,
                 batch_error, len(failed), n, failed[:20], exc_info=batch_error)
    return out


def combine_rewards(
    fns: Sequence[RewardFn], weights: Sequence[float] | None = None, *, names: Sequence[str] | None = None
) -> Callable[..., list[float]]:
    """Weighted sum of several reward functions, each wrapped with :func:`safe_reward`.

    Args:
        fns: reward functions (TRL signature).
        weights: one weight per function (default all 1.0).
        names: names for logs (default the functions' names).

    Each component is scored per sample (see :func:`safe_reward`): a sample that makes one
    function fail gets 0.0 from that function only, and no other sample is affected.

    Returns:
        ``fn(prompts, completions, **kwargs) -> list[float]``; it also has
        ``.breakdown(prompts, completions, **kwargs) -> (total, {name: per-sample rewards})``
        for logging each component.

    Raises:
        ValueError: empty ``fns`` or mismatched ``weights``/``names`` lengths.
    """
    fns = list(fns)
    if not fns:
        raise ValueError("combine_rewards needs at least one reward function")
    w = [1.0] * len(fns) if weights is None else [float(x) for x in weights]
    if len(w) != len(fns):
        raise ValueError(f"combine_rewards: {len(w)} weights for {len(fns)} reward functions")
    nm = [reward_name(f) for f in fns] if names is None else list(names)
    if len(nm) != len(fns):
        raise ValueError(f"combine_rewards: {len(nm)} names for {len(fns)} reward functions")
    # disambiguate duplicate names: format, format_1, ...
    seen: dict[str, int] = {}
    uniq = []
    for x in nm:
        k = seen.get(x, 0)
        seen[x] = k + 1
        uniq.append(x if k == 0 else f"{x}_{k}")
    safe = [safe_reward(f, n) for f, n in zip(fns, uniq)]

    def breakdown(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any):
        parts = {n: f(prompts, completions, **kwargs) for n, f in zip(uniq, safe)}
        total = [0.0] * len(completions)
        for wi, n in zip(w, uniq):
            for j, v in enumerate(parts[n]):
                total[j] += wi * v
        return total, parts

    def combined(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return breakdown(prompts, completions, **kwargs)[0]

    combined.__name__ = "combined(" + ",".join(uniq) + ")"
    combined.breakdown = breakdown  # type: ignore[attr-defined]
    combined.names = tuple(uniq)  # type: ignore[attr-defined]
    combined.weights = tuple(w)  # type: ignore[attr-defined]
    return combined
