"""`das-jax generate`: prompts and draft widths are checked before the model loads (the model
is pointed at a missing path, so a check that does not fire shows up as the wrong message),
and plain decoding reserves no cache for draft widths it never runs."""
from __future__ import annotations

import pytest

from test_cli_errors import assert_one_line_error, run_cli

G = "das-jax generate"
NO_MODEL = ["--model", "/nonexistent/model-dir"]


@pytest.mark.parametrize("argv,fragment", [
    (["--prompts-file", "EMPTY"], "--prompts-file EMPTY: holds no prompts (one per non-blank "
                                  "line"),
    (["--prompts-file", "BLANK"], "--prompts-file BLANK: holds no prompts"),
    (["--prompt", ""], "--prompt: prompt 0 is empty; give every prompt some text"),
    (["--prompt", "hi", "--prompt", ""], "--prompt: prompt 1 is empty"),
    (["--prompts-file", "EMPTY_JSONL"], "--prompts-file EMPTY_JSONL: prompt 1 is empty"),
    (["--prompt", "hi", "--draft-widths", "4,8"], "--draft-widths 4,8: must include 1"),
    (["--prompt", "hi", "--drafter", "das", "--draft-widths", "8"],
     "--draft-widths 8: must include 1"),
])
def test_prompt_and_width_errors_come_before_the_model(tmp_path, capsys, argv, fragment):
    files = {"EMPTY": "", "BLANK": "\n  \n\n", "EMPTY_JSONL": '{"prompt": "a"}\n{"prompt": ""}\n'}
    for name, text in files.items():
        path = tmp_path / (name.lower() + (".jsonl" if "JSONL" in name else ".txt"))
        path.write_text(text)
        argv = [str(path) if a == name else a for a in argv]
        fragment = fragment.replace(name + ":", f"{path}:")
    rc, _, err = run_cli(capsys, ["generate", *argv, *NO_MODEL])
    assert_one_line_error(rc, err, fragment, G)


def test_an_empty_prompt_with_the_chat_template_reaches_the_model(capsys):
    """With --chat an empty message still has the template's tokens: not refused up front."""
    rc, _, err = run_cli(capsys, ["generate", "--prompt", "", "--chat", *NO_MODEL])
    assert_one_line_error(rc, err, "/nonexistent/model-dir: no such file", G)


def test_plain_decoding_needs_no_cache_for_draft_widths():
    """The cache-length check of `--drafter none` counts width 1 only; with a drafter the
    widest width counts, and the message names draft_widths among the fixes."""
    from das_jax.engine import Engine, EngineConfig, GenerateError, Request, SamplingParams
    from das_jax.testing import tiny_model_config, tiny_params
    cfg = tiny_model_config()
    params = tiny_params(cfg)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    req = [Request((3, 4), problem_id=0, sample_index=0)]
    Engine(cfg, params, eos_token_ids=[1], engine_config=EngineConfig(
        max_slots=1, max_cache_len=8, draft_widths=(1,))).validate(req, sampling)
    wide = Engine(cfg, params, eos_token_ids=[1], engine_config=EngineConfig(
        max_slots=1, max_cache_len=8, draft_widths=(1, 4, 8)))
    with pytest.raises(GenerateError, match=r"draft width 8 needs 14 cache positions but "
                                            r"max_cache_len=8; .*or drop the widest draft "
                                            r"width from draft_widths"):
        wide.validate(req, sampling)
