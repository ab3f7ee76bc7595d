"""`RolloutBatch`: what one GRPO step's rollouts produced, host-side."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from das_jax.data import Problem
from das_jax.engine import RequestOutput


@dataclasses.dataclass
class RolloutBatch:
    """What one step's rollouts produced (host-side): N rows, one per completion."""

    problems: list[Problem]            # one per row (each problem repeated num_generations times)
    prompt_ids: list[list[int]]
    outputs: list[RequestOutput]
    completions: list[str]
    rewards: np.ndarray                # float32 [N]
    reward_parts: dict[str, list[float]]
    stats: Any                         # GenerateStats
