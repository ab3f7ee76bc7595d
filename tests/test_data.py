"""Tests for das_jax.data: loaders, the synthetic task, the dispatcher and prompt rendering."""

import gzip
import json
import re

import pytest

from das_jax.data import (
    CODE_INSTRUCTION,
    MATH_BOXED_INSTRUCTION,
    MATH_INSTRUCTION,
    DatasetError,
    Problem,
    extract_last_boxed,
    load_dataset_from_config,
    load_gsm8k,
    load_hf_dataset,
    load_humaneval,
    load_math,
    problems_from_config,
    render_prompt,
    reward_kwargs,
    synthetic_arithmetic,
)

GSM8K_TEST = "/work/shared/data/gsm8k/test.jsonl"
HUMANEVAL = "/work/shared/data/humaneval/HumanEval.jsonl.gz"


# ------------------------------------------------------------------------------ GSM8K


def test_gsm8k_real_file():
    probs = load_gsm8k(GSM8K_TEST, limit=20)
    assert len(probs) == 20
    assert probs[0].problem_id == "gsm8k-test-0"
    assert probs[0].answer == "18"  # Janet's ducks
    assert "Janet" in probs[0].prompt and "####" not in probs[0].prompt
    for p in probs:
        float(p.answer)  # parses as a number
        assert "," not in p.answer
    assert len({p.problem_id for p in probs}) == 20


def test_gsm8k_commas_and_split(tmp_path):
    f = tmp_path / "mini.jsonl"
    rows = [
        {"question": "Q1?", "answer": "a lot\n#### 1,234"},
        {"question": "Q2?", "answer": "x\n#### -5"},
        {"question": "Q3?", "answer": "x\n#### 2.50"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    probs = load_gsm8k(f, split="dev")
    assert [p.answer for p in probs] == ["1234", "-5", "2.5"]
    assert [p.problem_id for p in probs] == ["gsm8k-dev-0", "gsm8k-dev-1", "gsm8k-dev-2"]
    assert load_gsm8k(f)[0].problem_id == "gsm8k-mini-0"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DatasetError, match="####"):
        load_gsm8k(bad)


# ------------------------------------------------------------------------------ MATH


def test_math_loader_nested_boxed(tmp_path):
    f = tmp_path / "math.jsonl"
    rows = [
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
         "type": "Algebra"},
        {"problem": "Two boxes", "solution": "first \\boxed{3} then \\boxed{\\sqrt{\\frac{a}{b}}}"},
        {"problem": "Given answer", "solution": "no box", "answer": "7"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    probs = load_math(f)
    assert [p.answer for p in probs] == ["\\frac{1}{2}", "\\sqrt{\\frac{a}{b}}", "7"]
    assert probs[0].problem_id == "math-0" and probs[0].metadata["level"] == "Level 1"
    assert len(load_math(f, limit=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p", "solution": "no box"}))
    with pytest.raises(DatasetError, match="boxed"):
        load_math(bad)


def test_extract_last_boxed():
    assert extract_last_boxed("\\boxed{a{b}c} and \\boxed{x}") == "x"
    assert extract_last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_last_boxed("\\boxed 5$") == "5"
    assert extract_last_boxed("\\boxed{unbalanced") is None
    assert extract_last_boxed("nothing") is None


# ------------------------------------------------------------------------------ HumanEval


def test_humaneval_real_file():
    probs = load_humaneval(HUMANEVAL)
    assert len(probs) == 164
    p = probs[0]
    assert p.problem_id == "HumanEval/0"
    assert p.metadata["entry_point"] == "has_close_elements"
    assert p.prompt.startswith("from typing import List") and p.prompt == p.metadata["prompt"]
    assert p.answer.rstrip().endswith("check(has_close_elements)")
    assert "def check(candidate)" in p.metadata["test"]
    assert len(load_humaneval(HUMANEVAL, limit=3)) == 3


def test_humaneval_plain_jsonl(tmp_path):
    with gzip.open(HUMANEVAL, "rt") as f:
        lines = [next(f) for _ in range(2)]
    plain = tmp_path / "he.jsonl"
    plain.write_text("".join(lines))
    assert [p.problem_id for p in load_humaneval(plain)] == ["HumanEval/0", "HumanEval/1"]


# ------------------------------------------------------------------------------ synthetic


def _check_solution(p: Problem) -> None:
    """Recompute every step of the reference solution and the final answer."""
    lines = p.metadata["solution"].split("\n")
    assert lines[-1] == f"#### {p.answer}"
    steps = lines[:-1]
    assert len(steps) == p.metadata["num_steps"]
    for line in steps:
        m = re.search(r"(\d+(?: [-+*/] \d+)+) = (\d+)", line)
        assert m, line
        lhs, rhs = m.group(1), int(m.group(2))
        val = eval(lhs.replace("/", "//"))  # noqa: S307 - digits and operators only
        if "/" in lhs:
            a, b = map(int, lhs.split(" / "))
            assert a % b == 0, line
        assert val == rhs, line
    last_rhs = int(re.findall(r"= (\d+)", steps[-1])[-1])
    assert last_rhs == int(p.answer)


def test_synthetic_deterministic_and_correct():
    a = synthetic_arithmetic(200, seed=3)
    b = synthetic_arithmetic(200, seed=3)
    c = synthetic_arithmetic(200, seed=4)
    assert [(p.prompt, p.answer) for p in a] == [(p.prompt, p.answer) for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert synthetic_arithmetic(50, seed=3) == a[:50]  # prefix-stable
    assert len({p.problem_id for p in a}) == 200 and a[7].problem_id == "arith-3-7"
    for p in a:
        assert int(p.answer) >= 0 and str(int(p.answer)) == p.answer
        _check_solution(p)
    steps = {p.metadata["num_steps"] for p in a}
    assert steps == {1, 2, 3, 4, 5}
    assert {p.metadata["template"] for p in a} == {"shopping", "travel", "sharing", "bakery", "multi_step"}
    sol_len = [len(p.metadata["solution"]) for p in a]
    assert max(sol_len) > 3 * min(sol_len)  # short and long problems


def test_synthetic_options():
    short = synthetic_arithmetic(30, seed=0, min_steps=1, max_steps=1)
    assert all(p.metadata["num_steps"] == 1 for p in short)
    only = synthetic_arithmetic(30, seed=0, templates=["travel"])
    assert all(p.metadata["template"] == "travel" for p in only)
    for p in only:
        _check_solution(p)
    assert synthetic_arithmetic(0, seed=0) == []
    with pytest.raises(ValueError, match="valid"):
        synthetic_arithmetic(3, seed=0, templates=["nope"])
    with pytest.raises(ValueError):
        synthetic_arithmetic(3, seed=0, min_steps=0)


def test_synthetic_large_counts_stay_valid():
    # seed 0's problem 3106 used to buy more $1 comics than the money left: answer -1
    ps = synthetic_arithmetic(3200, seed=0)
    assert ps[3106].metadata["template"] == "multi_step" and ps[3106].answer == "0"
    for seed in (0, 1, 2):
        for p in synthetic_arithmetic(6000, seed=seed, templates=["multi_step"]):
            assert int(p.answer) >= 0, (p.problem_id, p.prompt)
            _check_solution(p)
    for p in ps:
        _check_solution(p)


def test_synthetic_invalid_answer_raises_even_without_asserts(monkeypatch):
    from das_jax.data import synthetic
    monkeypatch.setitem(synthetic.ARITHMETIC_TEMPLATES, "shopping",
                        lambda rng, steps: ("q?", -1, ["x"] * steps))
    with pytest.raises(RuntimeError, match="problem 0 of seed 0 .*answer -1"):
        synthetic_arithmetic(1, seed=0, templates=["shopping"])


# ------------------------------------------------------------------------------ dispatcher
def test_problems_from_config_applies_the_difficulty_keys():
    # The CLI once dropped data.templates / min_steps / max_steps: the main job trained on the
    # multi-step templates while its eval drew `counting` problems. Both go through here now.
    from das_jax.config import config_from_dict
    cfg = config_from_dict({"data": {"kind": "arithmetic", "num_problems": 12, "seed": 3,
                                     "templates": ["counting"], "min_steps": 1, "max_steps": 1}})
    got = problems_from_config(cfg.data)
    assert got == synthetic_arithmetic(12, 3, min_steps=1, max_steps=1, templates=["counting"])
    assert {p.metadata["template"] for p in got} == {"counting"}
    plain = problems_from_config(config_from_dict({"data": {"num_problems": 12, "seed": 3}}).data)
    assert plain == synthetic_arithmetic(12, 3)




def test_load_dataset_from_config():
    assert len(load_dataset_from_config("arithmetic", num_problems=5, seed=1)) == 5
    assert len(load_dataset_from_config("gsm8k", GSM8K_TEST, limit=4)) == 4
    assert len(load_dataset_from_config("humaneval", HUMANEVAL, limit=2)) == 2


def test_dispatcher_errors(tmp_path):
    with pytest.raises(DatasetError, match="arithmetic, gsm8k, math, humaneval, hf"):
        load_dataset_from_config("mmlu", None)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=re.escape(str(missing))):
        load_dataset_from_config("gsm8k", str(missing))
    with pytest.raises(DatasetError, match="file not found"):
        load_gsm8k(missing)
    with pytest.raises(DatasetError, match="path"):
        load_dataset_from_config("math", None)


def test_hf_without_datasets_gives_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(DatasetError, match="path="):
        load_hf_dataset("openai/gsm8k", config="main")
    with pytest.raises(DatasetError, match="jsonl"):
        load_dataset_from_config("hf", "openai/gsm8k")


# ------------------------------------------------------------------------------ reward columns


def test_reward_kwargs():
    he = load_humaneval(HUMANEVAL, limit=2)
    kw = reward_kwargs(he)
    assert kw["problem_id"] == ["HumanEval/0", "HumanEval/1"]
    assert kw["entry_point"][0] == "has_close_elements"
    assert kw["code_prompt"][0] == he[0].prompt and "prompt" not in kw
    kw2 = reward_kwargs(synthetic_arithmetic(3, seed=0))
    assert set(kw2) >= {"problem_id", "answer", "num_steps"}


# ------------------------------------------------------------------------------ templates


class FakeTok:
    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        self.calls.append((messages, tokenize, add_generation_prompt))
        s = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


def test_render_prompt_fake_tokenizer():
    p = synthetic_arithmetic(1, seed=0)[0]
    tok = FakeTok()
    out = render_prompt(p, tok)
    assert out.startswith("<user>" + MATH_INSTRUCTION + "\n\n" + p.prompt)
    assert out.endswith("<assistant>")
    assert tok.calls[0][1] is False and tok.calls[0][2] is True
    out2 = render_prompt(p, tok, instruction=MATH_BOXED_INSTRUCTION, system="Be brief.")
    assert out2.startswith("<system>Be brief.</system><user>" + MATH_BOXED_INSTRUCTION)
    assert render_prompt(p, None, instruction="", chat=False) == p.prompt + "\n"
    assert render_prompt(p, lambda msgs: msgs[-1]["content"].upper()) == (MATH_INSTRUCTION + "\n\n" + p.prompt).upper()
    with pytest.raises(TypeError, match="apply_chat_template"):
        render_prompt(p, object())


def test_render_prompt_code_and_real_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    he = load_humaneval(HUMANEVAL, limit=1)[0]
    out = render_prompt(he, tok)
    assert out.startswith("<|im_start|>user\n" + CODE_INSTRUCTION + "\n\n```python\nfrom typing import List")
    assert out.endswith("<|im_start|>assistant\n")


def test_dispatcher_shared_config_keys():
    kw = dict(num_problems=8, limit=5, seed=2)
    assert len(load_dataset_from_config("arithmetic", **kw)) == 5
    assert len(load_dataset_from_config("gsm8k", GSM8K_TEST, **kw)) == 5
    with pytest.raises(TypeError):
        load_dataset_from_config("gsm8k", GSM8K_TEST, bogus=1)
