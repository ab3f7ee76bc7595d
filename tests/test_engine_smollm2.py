"""The engine on the real SmolLM2-135M-Instruct: `das-jax generate --temperature 0` reproduces
transformers' greedy continuation (the one the parity test uses), with and without a drafter."""
from __future__ import annotations

import json

import pytest

from das_jax.cli import main
from conftest import SMOLLM2_MAX_NEW_TOKENS, SMOLLM2_PROMPTS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("drafter", ["none", "das"])
def test_generate_cli_greedy_matches_transformers(smollm2_greedy_reference, capsys, drafter):
    argv = ["generate", "--model", "smollm2-135m-instruct", "--chat", "--temperature", "0",
            "--max-new-tokens", str(SMOLLM2_MAX_NEW_TOKENS), "--drafter", drafter, "--json"]
    for prompt in SMOLLM2_PROMPTS:
        argv += ["--prompt", prompt]
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    samples, stats = lines[:-1], lines[-1]["stats"]
    assert len(samples) == len(SMOLLM2_PROMPTS)
    for sample, (prompt_ids, continuation) in zip(samples, smollm2_greedy_reference):
        assert sample["token_ids"] == list(continuation)
        assert sample["finish_reason"] in ("stop", "length")
        assert set(sample) >= {"prompt_index", "sample_index", "text", "logprobs"}
    assert stats["generated_tokens"] == sum(len(c) for _, c in smollm2_greedy_reference)
    assert stats["forward_passes"] > 0 and stats["wall_s"] > 0 and "compile_s" in stats
