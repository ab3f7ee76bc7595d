"""Every shipped CPU config loads and validates (a typo in one fails here, not in a user's run)."""
from __future__ import annotations

from pathlib import Path

import pytest

from das_jax.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.output_dir


def test_longtail_demo_has_a_tail_and_short_epochs():
    """The DAS-in-training demo: a 1,024-token budget that the cache holds with the widest
    draft, and epochs of 2 steps, so the drafter sees a problem again from the third step."""
    cfg = load_config(ROOT / "configs" / "smollm2-135m-gsm8k-longtail.yaml")
    assert cfg.rollout.max_new_tokens == cfg.grpo.max_completion_length == 1024
    assert cfg.rollout.max_cache_len >= 110 + 1024 + max(cfg.rollout.draft_widths)
    assert cfg.data.limit // cfg.grpo.prompts_per_step == 2
    assert cfg.drafter == "das" and cfg.train.save_every == cfg.train.steps == 2
