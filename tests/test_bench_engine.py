"""`das-jax bench engine`'s prompts: a GSM8K-format file given with `--prompts`, else the built-in
seeded arithmetic problems (no machine path is searched); its split query block measurement."""
from __future__ import annotations

import json

import pytest

from das_jax.bench.engine_bench import prompt_texts
from das_jax.data import DatasetError, synthetic_arithmetic


def test_default_prompts_are_the_seeded_arithmetic_problems():
    texts = prompt_texts(None, 16)
    assert texts == [p.prompt for p in synthetic_arithmetic(16, seed=0)]
    assert len(set(texts)) == 16


def test_prompts_file_gives_its_first_questions(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"question": f"Q{i}: 2 + {i}?", "answer": f"#### {2 + i}"})
                            + "\n" for i in range(20)))
    assert prompt_texts(str(path), 16) == [f"Q{i}: 2 + {i}?" for i in range(16)]
    short = tmp_path / "short.jsonl"
    short.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))
    with pytest.raises(DatasetError, match="2 problems, the benchmark needs 3"):
        prompt_texts(str(short), 3)


def test_split_block_terms_times_each_variant_on_a_tiny_engine(capsys):
    """`bench engine`'s split query block measurement: every variant timed (positive seconds,
    the median of its rounds) and one printed line with both ratios."""
    from das_jax.bench.engine_bench import split_block_terms
    from das_jax.engine import Engine, EngineConfig
    from das_jax.testing import tiny_model_config, tiny_params
    cfg = tiny_model_config()
    eng = Engine(cfg, tiny_params(cfg), eos_token_ids=[1],
                 engine_config=EngineConfig(max_slots=16, max_cache_len=1024,
                                            draft_widths=(1, 8)))
    out = split_block_terms(eng, repeats=1, rounds=1)
    assert set(out) == {"plain_N16", "one_block_N24", "split_N24", "one_block_N32",
                        "split_N32"}
    assert all(t > 0 for t in out.values())
    line = capsys.readouterr().out
    assert "split query block" in line and line.count("x)") == 2
