"""The registry of speculation names: what the `drafter:` config key and `--drafter` select.

A speculation name stands for a (drafter, policy) pair: the drafter proposes tokens (the
`das_jax.drafter.Drafter` protocol), the policy decides how many the engine verifies
(`das_jax.engine.SpeculationPolicy`). The registry owns their construction and the settings
they read (the config's `das:` section, `DASSection`, defined here), so adding one is one
module:

    from das_jax.speculation import register_speculation

    @register_speculation("my-drafter", description="...", uses_cost_model=False)
    def build(das, cost_model):             # das: DASSection; cost_model: CostModel
        return MyDrafter(...), FixedPolicy()

Once that module is imported, the name is valid in configs, `das-jax generate --drafter` and
the benchmarks. Built-in names:

| name            | drafter                                    | policy                        |
|-----------------|--------------------------------------------|-------------------------------|
| none            | -                                          | - (plain decoding)            |
| ngram           | prompt lookup (vLLM `ngram`)               | fixed: widest width           |
| suffix          | per-problem suffix trees (the DAS drafter) | fixed: widest width           |
| suffix-global   | global + per-request tree (SuffixDecoding) | fixed: widest width           |
| das             | per-problem suffix trees                   | DAS: per-row draft lengths    |
|                 |                                            | minimising the expected time  |
|                 |                                            | per token (ablations          |
|                 |                                            | in `das.policy`)              |
| das-unlimited   | per-problem suffix trees                   | ablation: every row verifies  |
|                 |                                            | its whole draft               |

The names live in `das_jax.registry.SPECULATION` (this module registers the built-ins). The
builders import the drafters (numba) when called, so listing the names costs no numba import.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from das_jax.engine import FixedPolicy
from das_jax.registry import SPECULATION
from das_jax.speculation.cost_model import CostModel, CostModelConfig
from das_jax.speculation.das_policy import DASConfig, DASPolicy

__all__ = ["DASSection", "SpeculationSpec", "register_speculation", "unregister_speculation",
           "speculation_names", "get_speculation", "build_speculation", "SpeculationError"]


class SpeculationError(ValueError):
    """An unknown or already registered speculation name (the message lists the valid ones)."""


Builder = Callable[[Any, Any], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class DASSection:
    """Speculation settings (the speculation itself is chosen by the top-level `drafter` key).

    window: epochs of rollout history kept per problem (suffix drafters).
    max_depth: suffix-tree depth (longest match + draft), in tokens.
    min_token_prob: a suffix draft stops when its path probability drops below this.
    drafter_threads: threads the per-problem suffix drafter drafts and indexes a step's rows
      on (1: the rollout's own thread; more: the problems' tries, and the requests' own
      tries, are split over that many forests, `drafter.ShardedHistory`; a step's drafts are
      split over the threads from 32 rows per thread, its appends a forest per thread from
      16, the numba kernels releasing the GIL; the same drafts as one thread).
    scopes: the tries the per-problem suffix drafters (suffix, das, das-unlimited) draft from:
      `problem` (required: the problem's recent rollouts and live siblings), `request` (the
      request's own full prompt and output), `global` (the last `global_rollouts` finished
      rollouts of every problem, searched for rows whose draft scores below `global_below`
      expected tokens); the best-scoring draft wins (`drafter.SuffixDrafter`).
    global_rollouts: finished rollouts the global trie keeps.
    global_below: score below which a row also searches the global trie (0: never).
    request_below: score of its problem draft below which a row also searches its request
      trie (0: never, inf: always; 4.0 drafts as well as always on the shipped GSM8K trace and
      takes 12-18% off the propose at 256 slots).
    policy: the DAS length-aware policy (`das_jax.speculation.DASConfig`): short_quantile,
      long_quantile, short_threshold, long_threshold (length classes), weight_short,
      weight_medium, weight_long (class weights sharing the per-step cost), budget_short,
      budget_medium, budget_long (optional per-class caps), min_history, length_history,
      acceptance_ema, explore_every, unlimited, age_calibration, source_calibration, tree
      (verify a row's other-source draft beside its own as a two-branch token tree where it
      pays).
    cost_model: the step-cost model the policy plans with (`das_jax.speculation.CostModelConfig`):
      c_base, c_tok, c_kv, source (cpu | h100-7b | h200-7b | PATH.json instead of the three
      coefficients), history, calibrate, calibrate_kv_lens, calibrate_repeats, compile_s
      (prior seconds per new verify-step compile, until one is measured).
    """

    window: int = 16
    max_depth: int = 32
    min_token_prob: float = 0.1
    drafter_threads: int = 1
    scopes: tuple[str, ...] = ("problem", "request", "global")
    global_rollouts: int = 1024
    global_below: float = 2.0
    request_below: float = 4.0
    policy: DASConfig = dataclasses.field(default_factory=DASConfig)
    cost_model: CostModelConfig = dataclasses.field(default_factory=CostModelConfig)


@dataclasses.dataclass(frozen=True)
class SpeculationSpec:
    """A registered speculation name.

    build: (das: DASSection, cost_model: CostModel) -> (drafter or None, policy or None).
    description: one line for listings.
    uses_cost_model: the policy plans with the cost model, so a rollout calibrates it (times
      the verify step) before its first `generate` when `das.cost_model.calibrate` is true.
    """

    name: str
    build: Builder
    description: str = ""
    uses_cost_model: bool = False


def register_speculation(name: str, *, description: str = "", uses_cost_model: bool = False,
                         replace: bool = False) -> Callable[[Builder], Builder]:
    """Decorator registering `build(das, cost_model) -> (drafter, policy)` under `name`.

    Raises:
      SpeculationError: `name` is empty or already registered (pass `replace=True` to override).
    """
    if not name or not isinstance(name, str):
        raise SpeculationError(f"a speculation name must be a non-empty string, got {name!r}")

    def decorator(build: Builder) -> Builder:
        if name in SPECULATION and not replace:
            raise SpeculationError(f"speculation {name!r} is already registered; pass "
                                   "replace=True to override it")
        SPECULATION.register(name, SpeculationSpec(name, build, description, uses_cost_model),
                             replace=True)
        return build
    return decorator


def unregister_speculation(name: str) -> None:
    """Removes `name` from the registry (e.g. a test's toy entry). Raises SpeculationError for an
    unknown name."""
    get_speculation(name)
    SPECULATION.unregister(name)


def speculation_names() -> tuple[str, ...]:
    """The registered names, in registration order (built-ins first)."""
    return SPECULATION.names()


def get_speculation(name: str) -> SpeculationSpec:
    """The spec of `name`. Raises SpeculationError for an unknown name (listing the valid ones)."""
    try:
        return SPECULATION.get(name)
    except KeyError:
        raise SpeculationError(f"unknown drafter {name!r}; valid: "
                               f"{', '.join(speculation_names())}") from None


def build_speculation(name: str, das: Any = None, cost_model: Any = None) -> tuple[Any, Any]:
    """(drafter or None, policy or None) for `name`.

    Args:
      das: the `das:` settings (`DASSection`; default: its defaults).
      cost_model: the `CostModel` a DAS policy plans with (default: one from `das.cost_model`).

    Raises:
      SpeculationError: unknown name.
    """
    spec = get_speculation(name)
    if das is None:
        das = DASSection()
    if cost_model is None:
        cost_model = CostModel.from_config(das.cost_model)
    return spec.build(das, cost_model)


# ----------------------------------------------------------------------------- built-ins

# The builders import the drafters (numba) when a rollout builds them.

def _suffix_config(das):
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import SuffixTreeConfig
    return SuffixTreeConfig(max_depth=das.max_depth, min_token_prob=das.min_token_prob)


def _suffix_kwargs(das):
    return dict(window=das.window, threads=das.drafter_threads, scopes=das.scopes,
                global_rollouts=das.global_rollouts, global_below=das.global_below,
                request_below=das.request_below)


@register_speculation("none", description="plain decoding")
def _none(das, cost_model):
    return None, None


@register_speculation("ngram", description="prompt lookup (vLLM ngram), fixed widest width")
def _ngram(das, cost_model):
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import NgramDrafter
    return NgramDrafter(), FixedPolicy()


@register_speculation("suffix", description="per-problem suffix trees, fixed widest width")
def _suffix(das, cost_model):
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import SuffixDrafter
    return (SuffixDrafter(_suffix_config(das), **_suffix_kwargs(das)),
            FixedPolicy())


@register_speculation("suffix-global",
                      description="global + per-request suffix tree (SuffixDecoding), fixed width")
def _suffix_global(das, cost_model):
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import GlobalSuffixDrafter
    return GlobalSuffixDrafter(_suffix_config(das), window=das.window), FixedPolicy()


def _das(das, cost_model, unlimited: bool):
    # deferred import: numba (not loaded by importing this module)
    from das_jax.drafter import SuffixDrafter
    drafter = SuffixDrafter(_suffix_config(das), **_suffix_kwargs(das))
    config = dataclasses.replace(das.policy, unlimited=True) if unlimited else das.policy
    return drafter, DASPolicy(drafter.lengths, config, cost_model)


@register_speculation("das", description="per-problem suffix trees, DAS budget (per-row draft "
                      "lengths minimising the expected decoding time per token)",
                      uses_cost_model=True)
def _das_policy(das, cost_model):
    return _das(das, cost_model, unlimited=False)


@register_speculation("das-unlimited",
                      description="ablation: per-problem suffix trees, every row verifies its "
                      "whole draft",
                      uses_cost_model=True)
def _das_unlimited(das, cost_model):
    return _das(das, cost_model, unlimited=True)
