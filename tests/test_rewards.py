"""Tests for math/format rewards, safe_reward/combine_rewards and the registry."""

import logging
import math
import threading

import pytest

from das_jax.rl.rewards import (
    code_reward,
    combine_rewards,
    extract_final_number,
    format_reward,
    get_reward_fn,
    math_accuracy_reward,
    math_answer_correct,
    register_reward_fn,
    safe_reward,
)
from das_jax.rl.rewards.math_reward import extract_answer_region


def _acc(completions, answers, **kw):
    return math_accuracy_reward([""] * len(completions), completions, answer=answers, **kw)


# ------------------------------------------------------------------------------ math accuracy


def test_math_correct_incorrect():
    assert _acc(["She makes 9 * 2 = 18 dollars.\n#### 18", "#### 17"], ["18", "18"]) == [1.0, 0.0]


def test_math_hash_comma_and_formats():
    assert _acc(["#### 1,234", "#### $1,234.00", "#### 1234.0", "#### -7"], ["1234", "1234", "1234", "-7"]) == [1.0] * 4
    # the answer after #### wins over numbers elsewhere
    assert _acc(["9 * 2 = 18, so #### 20"], ["18"]) == [0.0]


def test_math_boxed_fraction_vs_decimal():
    # 1/2 == 0.5 mathematically: must be accepted in both directions
    assert _acc(["The answer is \\boxed{\\frac{1}{2}}"], ["0.5"]) == [1.0]
    assert _acc(["The answer is \\boxed{0.5}"], ["\\frac{1}{2}"]) == [1.0]
    assert _acc(["The answer is \\boxed{\\frac{1}{3}}"], ["\\frac{1}{2}"]) == [0.0]
    assert _acc(["so $\\boxed{\\frac{\\sqrt{2}}{2}}$"], ["\\frac{\\sqrt 2}{2}"]) == [1.0]


def test_math_unmarked_completion_goes_to_math_verify_only():
    # no #### / \boxed: math-verify's own extraction decides; no number is pulled out by us
    assert _acc(["First 3 apples, then 4, so the total is 7."], ["7"]) == [1.0]
    assert _acc(["First 3 apples, then 4, so the total is 7. Oh wait 8"], ["7"]) == [0.0]
    assert _acc(["no numbers here"], ["7"]) == [0.0]
    assert _acc(["First 3 apples, then 4, so the total is 7."], ["7"], use_math_verify=False) == [0.0]
    assert _acc(["7"], ["7"], use_math_verify=False) == [1.0]  # the whole completion is a number
    assert extract_final_number("costs $1,234.50 in total.") is None
    assert extract_final_number("#### $1,234.50") == "1234.5"
    assert extract_final_number("#### 42\nThe end 7") == "42"
    assert extract_final_number("\\boxed{\\frac{1}{3}}") == "1/3"
    assert extract_final_number("#### 3 or 4") is None
    assert extract_final_number("nothing") is None


# ------------------------------------------- an expression equal to a number states no answer

UNEVALUATED = [
    ("Sam has 3 - 1.", "2"),                      # the main job's policy learned to write these
    ("Noah has 5 - 4 of the books are gone.", "1"),
    ("Ava has 15 + 1.", "16"), ("Olga has 19 + 14.", "33"),
    # other inputs of the same kind
    ("#### 3 + 4", "7"), ("\\boxed{3^{2}}", "9"), ("\\boxed{2 \\cdot 9}", "18"),
    ("#### 10 - 3", "7"), ("\\boxed{\\frac{14}{2} + 0}", "7"), ("So the total is 12/3 + 1.", "5"),
    ("#### x = 3 + 4", "7"), ("\\boxed{2^{10}}", "1024"), ("\\boxed{\\sqrt{4}}", "2"),
    ("#### 12 \\div 4", "3"), ("\\boxed{12 : 4}", "3"), ("Liam has 7 * 3.", "21"),
    ("She has (2 + 3) apples.", "5"), ("\\boxed{12 \\times 10}", "120"),
    ("Let me think.\n#### -$1 \\cdot -1", "-1"),  # the lone $ once closed math mode after "-"
    # operators the rule does not list by name: sympy leaves them unevaluated
    ("#### 3 \\ast 4", "12"), ("#### 4 x 3", "12"), ("#### 12 \\bmod 5", "2"),
    ("\\boxed{(3)(4)}", "12"), ("#### 3(4)", "12"), ("#### 10 \\pm 2", "12"),
]


@pytest.mark.parametrize("completion,gold", UNEVALUATED)
def test_an_unevaluated_expression_earns_nothing_for_a_number(completion, gold):
    assert _acc([completion], [gold]) == [0.0]


@pytest.mark.parametrize("completion,gold", [
    ("Sam has 3 - 1 = 2 books left.", "2"), ("Sam has 2 left, since 3 - 1 = 2.", "2"),
    ("#### x = 42", "42"), ("#### 6 \\times 7 = 42", "42"),
    ("First 3 apples, then 4, so the total is 7.", "7"), ("\\boxed{\\frac{14}{2}}", "7"),
    # notations of one number
    ("\\boxed{18^\\circ}", "18"), ("\\boxed{3\\frac{1}{2}}", "3.5"), ("#### 50%", "50"),
    ("\\boxed{1.5 \\times 10^{3}}", "1500"), ("The answer is $-\\frac{7}{2}$.", "-3.5"),
    ("\\boxed{x + 1}", "x+1"),              # a gold that is an expression: compared as one
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    # math-verify alone rejects a decimal in these wrappers; the exact fallback reads them
    ("#### \\text{0.1}", "0.1"), ("#### 2.5\\%", "2.5"), ("\\boxed{\\text{12.25}}", "12.25"),
])
def test_a_stated_answer_is_graded(completion, gold):
    assert _acc([completion], [gold]) == [1.0]


# -------------------------------------------------- no wrong answer accepted

WRONG_ANSWERS = [
    ("\\boxed{4\\sqrt{2}}", "2"),          # a number pulled out of an expression
    ("#### 3 \\cdot 7", "3"),                # ... out of a product
    ("#### 3 or 4", "3"),                     # ... out of a hedge
    # other inputs of the same kind
    ("#### 3, 4", "3"), ("#### [3, 4]", "3"), ("\\boxed{(3, 4)}", "3"), ("#### 3 to 4", "3"),
    ("#### 3 \\pm 1", "3"), ("\\boxed{3^{2}}", "3"), ("#### 2/3", "2"), ("\\boxed{3x}", "3"),
    ("#### 1 2", "12"), ("#### 1,00", "100"), ("#### 12,34", "1234"), ("#### 3 + 4", "3"),
    ("\\boxed{\\frac{1}{3}}", "3"), ("#### 3 \\text{ or } 4", "3"), ("#### -3", "3"),
    ("#### 3%", "3.5"), ("\\boxed{7\\pi}", "7"), ("#### **3 or 4**", "3"),
    # integer golds compare exactly: no relative tolerance
    ("#### 17.9999", "18"), ("#### 1000001", "1000000"), ("#### 0.3333", "\\frac{1}{3}"),
    # the last final answer wins
    ("#### 5\nWait, that is wrong. \\boxed{3}", "5"), ("\\boxed{5} hmm, no. #### 3", "5"),
]


@pytest.mark.parametrize("completion,gold", WRONG_ANSWERS)
def test_wrong_answers_score_zero(completion, gold):
    assert _acc([completion], [gold]) == [0.0]
    assert _acc([completion], [gold], use_math_verify=False) == [0.0]


RIGHT_ANSWERS = [
    ("#### 3 ... \\boxed{5}", "5"),          # the last final answer wins
    ("\\boxed{3} oh wait #### 5", "5"),
    ("#### \\boxed{5}", "5"),
    ("#### 1,000", "1000"), ("#### 1,234,567", "1234567"), ("#### 1{,}000", "1000"),
    ("#### -3", "-3"), ("#### \u22123", "-3"), ("#### +3", "3"), ("#### $18", "18"),
    ("#### \\$18.", "18"), ("#### -$3", "-3"), ("#### 25%", "25"), ("#### 25\\%", "25"),
    ("#### 18.", "18"), ("#### 18.00", "18"), ("#### .5", "0.5"), ("#### 007", "7"),
    ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{-7/2}", "-3.5"),
    ("\\boxed{\\dfrac{7}{2}}", "3.5"), ("$\\boxed{18}$.", "18"), ("\\boxed{\\text{18}}", "18"),
    ("#### $18$", "18"), ("#### \\(18\\)", "18"), ("\\boxed{x + 1}", "x+1"),
    ("#### 12", "She has 5 + 7 = <<5+7=12>>12.\n#### 12"),
    ("#### **18**", "18"), ("#### *-3*", "-3"),
]


@pytest.mark.parametrize("completion,gold", RIGHT_ANSWERS)
def test_right_answers_score_one_without_math_verify(completion, gold):
    # the exact fallback alone (what runs off the main thread) accepts them, and so does the full path
    assert _acc([completion], [gold], use_math_verify=False) == [1.0]
    assert _acc([completion], [gold]) == [1.0]


def test_units_and_text_go_to_math_verify():
    # a unit is not a number: the fallback refuses, math-verify decides (it strips \text{} units)
    assert _acc(["\\boxed{18 \\text{ dollars}}"], ["18"], use_math_verify=False) == [0.0]
    assert _acc(["\\boxed{18 \\text{ dollars}}"], ["18"]) == [1.0]
    assert _acc(["#### 18 dollars"], ["18"]) == [0.0]  # math-verify says False too


# ------------------------------------------------ an answer marker counts only when it holds an answer

# Text after the answer that looks like a marker but holds no answer: it must not overwrite it.
NOT_AN_ANSWER_AFTER = [
    # the three reported inputs
    "So the total is \\boxed{42}.\n\n#### Verification\n6*7 = 42, correct.",
    "So the total is \\boxed{42}\n####",
    "So the total is \\boxed{42}. I put the final answer in \\boxed{} as asked.",
    # other markdown headings after the answer
    "#### 42\n\n#### Step 2\nCheck: 6*7 = 42.",
    "\\boxed{42}\n\n#### 1. Double-check\n6*7 = 42.",
    "\\boxed{42}\n#### **Verification**\nok",
    "\\boxed{42}\n##### Notes\nnone",
    "\\boxed{42}\n#### Final Answer",
    "\\boxed{42}\n#### ---\n",
    "\\boxed{42}\n#### ...",
    # echoed instructions and placeholders after the answer
    "\\boxed{42}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "\\boxed{42}. The answer goes in \\boxed{answer}.",
    "\\boxed{42} (written as \\boxed{your final answer}, as asked)",
    "\\boxed{42} as \\boxed{\\text{Your Answer}} asked",
    "\\boxed{42}\nFormat: #### <number>",
    "\\boxed{42}\nEnd with #### followed by the number.",
    "#### 42\nI wrote it as \\boxed{ } would be wrong.",
    "#### 42\n\\boxed{\\,}",
    "#### 42\n\\boxed{...}",
    "#### 42\n\\boxed{\\frac{}{}}",
    "#### 42\n\\boxed{\\sqrt{ }}",
    "#### 42\n\\boxed \\boxed{}",
    "#### 42\n#### \\boxed{}",
    "#### 42\n\\boxed{} \\fbox{}",
    "#### 42\nI did not use \\boxed as asked",
    "\\boxed{42}\n#### Q: why does this work?\nBecause 6*7 = 42.",
    "\\boxed{42}\n#### I. Check\nok",
    "\\boxed{42}\n#### (a) Check 6*7\nok",
    "\\boxed{42}\n#### \u2705 Verified",
    "\\boxed{42}\n#### \u00dcberpr\u00fcfung",
    "\\boxed{42}\n#### Answer key\nsee above",
    "\\boxed{42}\n#### [Step 3]",
    # a code block after the answer; markers in code are code
    "#### 42\n```python\n#### compute it again\nprint(6 * 7)\n```",
    "\\boxed{42}\n```python\nx = 6 * 7\nprint(f\"\\\\boxed{{{x - 1}}}\")\nprint(\"#### \" + str(x - 1))\n```",
    "#### 42\n~~~\n\\boxed{41}\n~~~",
    "#### 42\n```\n#### 41\n",                                      # an unclosed fence
    # a heading before a boxed answer, labels before a #### answer
    "#### Answer\n\\boxed{42}\n",
    "#### Final Answer\nThe result is:\n$$\\boxed{42}$$\nDone.",
    "#### **Answer:** 42",
    "#### The answer is 42\n\n#### Check\nok",
    "#### Answer: $42$",
    # a truncated (unbalanced) box after the answer
    "\\boxed{42} and again \\boxed{4",
]


@pytest.mark.parametrize("completion", NOT_AN_ANSWER_AFTER)
def test_text_after_the_answer_that_holds_no_answer_does_not_overwrite_it(completion):
    assert _acc([completion], ["42"]) == [1.0]
    assert _acc([completion], ["42"], use_math_verify=False) == [1.0]
    assert _acc([completion], ["41"]) == [0.0]
    assert format_reward([""], [completion]) == [1.0]


@pytest.mark.parametrize("completion,region", [
    ("#### 41\nNo wait.\n#### 42", ("hash", "42")),                  # the last real answer wins
    ("\\boxed{41}\n#### Verification\n\\boxed{42}\n#### Step 3", ("boxed", "42")),
    ("#### 42\n\\boxed{41}\n\\boxed{}", ("boxed", "41")),
    ("\\boxed{42}\n#### sqrt(2)", ("hash", "sqrt(2)")),                 # math names are not prose
    ("\\boxed{42}\n#### x = 3", ("hash", "x = 3")),
    ("\\boxed{42}\n#### \\text{Evelyn}", ("hash", "\\text{Evelyn}")),
    ("\\boxed{42}\n#### (C)", ("hash", "(C)")),
    ("\\boxed{42}\n\\boxed{\\text{(A)}}", ("boxed", "\\text{(A)}")),
    ("\\boxed{42}\n\\boxed{x}", ("boxed", "x")),
    ("\\boxed{42}\n\\boxed 7", ("boxed", "7")),
    ("\\boxed{42}\n\\boxed{\\infty}", ("boxed", "\\infty")),
    ("\\boxed{42}\n\\boxed{\\emptyset}", ("boxed", "\\emptyset")),
    ("\\boxed{42}\n\\boxed{\\frac{\\pi}{2}}", ("boxed", "\\frac{\\pi}{2}")),
    ("\\boxed{\\boxed{5}}", ("boxed", "5")),
    ("```\n#### 42\n```", ("hash", "42")),                              # only answers in code: they count
    ("So:\n```\n\\boxed{42}\n```\nDone.", ("boxed", "42")),
    ("```\n\\boxed{41}\n```\n#### 42", ("hash", "42")),
    ("\\boxed{0}\n#### Final answer 42", ("hash", "42")),
    ("\\boxed{0}\n#### x = 3 meters", ("hash", "x = 3 meters")),
    ("\\boxed{42}\n#### Answer: yes", ("hash", "yes")),                # a labelled word is an answer
    ("\\boxed{42}\n#### The answer is **Evelyn**", ("hash", "Evelyn")),
    ("\\boxed{42}\n#### yes", ("boxed", "42")),                        # an unlabelled word is a heading
    ("#### 42\nEnd with '#### <number>'.", ("hash", "42")),
    ("#### `42`", ("hash", "42")),
    ("#### Verification\nI put it in \\boxed{} as asked.", ("all", "#### Verification\nI put it in \\boxed{} as asked.")),
])
def test_last_marker_holding_an_answer_is_the_region(completion, region):
    assert extract_answer_region(completion) == region


def test_real_answers_after_the_answer_still_win():
    # a correction is a real answer: it overwrites (graded 0 against the first answer)
    assert _acc(["\\boxed{42}\nOops, it is\n#### 41"], ["42"]) == [0.0]
    assert _acc(["#### 42\nActually \\boxed{41}."], ["42"]) == [0.0]
    assert _acc(["\\boxed{42}\n#### 18 dollars"], ["42"]) == [0.0]  # a number with a unit is an answer
    # no marker holds an answer: math-verify reads the whole completion
    assert _acc(["So it is 42.\n#### Verification\nI put it in \\boxed{} as asked."], ["42"],
                use_math_verify=False) == [0.0]


# ------------------------------------------------ normalisation matches whole commands only

@pytest.mark.parametrize("completion,gold", [
    ("\\boxed{x \\leftarrow 1}", "x \\rightarrow 1"),     # the reported input
    ("\\boxed{x \\rightarrow 1}", "x \\leftarrow 1"),
    ("\\boxed{\\leftharpoonup}", "\\rightharpoonup"),
    ("\\boxed{A \\leftrightarrow B}", "A \\rightarrow B"),
    ("\\boxed{\\tfrac{a}{b}}", "\\frac ab"),              # different spellings stay different strings
    ("\\boxed{1\\!000}", "1"),
])
def test_normalisation_does_not_merge_distinct_commands(completion, gold):
    assert _acc([completion], [gold], use_math_verify=False) == [0.0]
    assert _acc([completion], [gold]) == [0.0]


@pytest.mark.parametrize("completion,gold", [
    ("\\boxed{x \\leftarrow 1}", "x \\leftarrow 1"),
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)"),
    ("\\boxed{\\left[ 0, 1 \\right)}", "[0,1)"),
    ("\\boxed{\\dfrac{a}{b}}", "\\frac{a}{b}"),
    ("\\boxed{\\tfrac{a}{b}}", "\\frac{a}{b}"),
    ("\\boxed{x \\, y}", "x y"),
    ("\\boxed{\\text{(C)}}", "(C)"),
])
def test_normalisation_keeps_equal_spellings_equal(completion, gold):
    assert _acc([completion], [gold], use_math_verify=False) == [1.0]


def test_norm_expr_reads_line_break_before_thin_space():
    from das_jax.rl.rewards.math_reward import _norm_expr

    assert _norm_expr("a\\\\,b") == "a\\\\,b"                # "\\" then ",", not "\" then "\,"
    assert _norm_expr("\\leftarrow") == "\\leftarrow"
    assert _norm_expr("\\dfracx") == "\\dfracx"


def test_huge_number_scores_only_its_own_sample():
    big = "9" * 400
    comps = ["#### 18", "The answer is " + big, "#### " + big, "\\boxed{" + big + "}", "#### 7"]
    golds = ["18", "5", big, "5", "7"]
    assert _acc(comps, golds) == [1.0, 0.0, 1.0, 0.0, 1.0]
    comb = combine_rewards([math_accuracy_reward, format_reward], weights=[1.0, 0.5])
    assert comb([""] * 5, comps, answer=golds) == [1.5, 0.0, 1.5, 0.5, 1.5]
    # beyond Python's int-string limit: still only that sample
    huge = "9" * 6000
    assert _acc(["#### 18", "#### " + huge], ["18", "18"]) == [1.0, 0.0]


def test_math_one_sample_raising_does_not_zero_the_batch(monkeypatch):
    from das_jax.rl.rewards import math_reward

    real = math_reward.math_answer_correct

    def flaky(completion, answer, **kw):
        if "BOOM" in completion:
            raise OverflowError("boom")
        return real(completion, answer, **kw)

    monkeypatch.setattr(math_reward, "math_answer_correct", flaky)
    assert _acc(["#### 3", "#### BOOM", "#### 4"], ["3", "3", "4"]) == [1.0, 0.0, 1.0]


def test_gsm8k_golds_score_one_and_neighbours_zero():
    """Every GSM8K test gold, written as a model would, scores 1; gold +- 1 scores 0."""
    from das_jax.data import load_gsm8k

    probs = load_gsm8k("/work/shared/data/gsm8k/test.jsonl")
    assert len(probs) > 1000
    for p in probs:
        g = p.answer
        v = int(g) if g.lstrip("-").isdigit() else None
        forms = [f"So the answer is:\n#### {g}", f"\\boxed{{{g}}}", f"#### {g}."]
        if v is not None:
            forms += [f"#### ${v:,}", f"#### {v:,}.00"]
        for c in forms:
            assert math_answer_correct(c, g, use_math_verify=False), (c, g)
            assert math_answer_correct(c, f"... #### {g}", use_math_verify=False), (c, g)
        if v is not None:
            assert not math_answer_correct(f"#### {v + 1}", g, use_math_verify=False)
            assert not math_answer_correct(f"#### {g} or {v + 1}", g, use_math_verify=False)
    for p in probs[:25]:  # and through math-verify too (slower)
        assert math_answer_correct(f"#### {p.answer}", p.answer)
        assert not math_answer_correct(f"#### {p.answer} \\cdot 2", p.answer)


def test_math_gold_formats_and_conversational():
    # gold given as a full GSM8K solution / MATH solution
    assert math_answer_correct("#### 18", "9*2=18\n#### 18")
    assert math_answer_correct("\\boxed{3}", "so $\\boxed{3}$")
    assert _acc([[{"role": "assistant", "content": "#### 5"}]], ["5"]) == [1.0]
    assert not math_answer_correct(None, "5") and not math_answer_correct("5", None)


def test_math_off_main_thread_degrades_gracefully():
    out = []
    comps = ["\\boxed{\\frac{1}{2}}", "#### 1,234", "#### 3", "\\boxed{x+1}"]
    t = threading.Thread(target=lambda: out.append(_acc(comps, ["0.5", "1234", "4", "x + 1"])))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert out == [[1.0, 1.0, 0.0, 1.0]]  # fallback match (numeric / normalised string)


def test_math_missing_column():
    with pytest.raises(ValueError, match="answer"):
        math_accuracy_reward([""], ["#### 1"])
    with pytest.raises(ValueError, match="1 values for 2"):
        math_accuracy_reward(["", ""], ["#### 1", "#### 2"], answer=["1"])


# ------------------------------------------------------------------------------ format


def test_format_reward():
    comps = ["blah\n#### 12", "#### 1,234.5", "\\boxed{x^2}", "\\boxed{}", "the answer is 3", "#### abc"]
    assert format_reward([""] * len(comps), comps) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # markers that hold no answer earn no format credit
    comps = ["#### 1. Setup\nwork", "#### Step 2", "I put the final answer in \\boxed{} as asked.",
             "\\boxed{answer}", "#### <number>", "\\boxed{\\frac{1}{2}}", "#### $-3", "#### Answer: 7"]
    assert format_reward([""] * len(comps), comps) == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------ safety


def _boom(prompts, completions, **kw):
    raise RuntimeError("kaboom")


def _const(prompts, completions, **kw):
    return [1.0] * len(completions)


def test_safe_reward_exception_logged(caplog):
    fn = safe_reward(_boom)
    with caplog.at_level(logging.ERROR):
        assert fn(["a", "b"], ["x", "y"]) == [0.0, 0.0]
    rec = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec and "_boom" in rec[0].getMessage() and "kaboom" in rec[0].getMessage()


def test_safe_reward_none_nan_and_wrong_length(caplog):
    assert safe_reward(lambda p, c, **k: [None, 0.5, math.nan])(["", "", ""], ["a", "b", "c"]) == [0.0, 0.5, 0.0]
    with caplog.at_level(logging.ERROR):
        short = safe_reward(lambda p, c, **k: [1.0], name="short")
        assert short(["", ""], ["a", "b"]) == [0.0, 0.0]
        assert safe_reward(lambda p, c, **k: None, name="none")([""], ["a"]) == [0.0]
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "'short'" in msgs and "1 rewards for 2 completions" in msgs and "'none'" in msgs


def test_safe_reward_failure_stays_with_its_sample(caplog):
    def picky(prompts, completions, answer, scale=1.0):
        out = []
        for c, a in zip(completions, answer):
            if c == "bad":
                raise ValueError("cannot grade 'bad'")
            out.append(scale * float(c == a))
        return out

    fn = safe_reward(picky)
    with caplog.at_level(logging.ERROR):
        assert fn(["p"] * 4, ["x", "bad", "y", "z"], answer=("x", "x", "y", "q"), scale=2.0) == [2.0, 0.0, 2.0, 0.0]
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "'picky'" in msg and "1 of 4" in msg and "[1]" in msg
    comb = combine_rewards([picky, _const])
    assert comb([""] * 3, ["bad", "x", "bad"], answer=["x", "x", "x"]) == [1.0, 2.0, 1.0]


def test_combine_rewards_others_still_count(caplog):
    comb = combine_rewards([_const, _boom, math_accuracy_reward], weights=[0.5, 1.0, 2.0])
    with caplog.at_level(logging.ERROR):
        total = comb(["", ""], ["#### 3", "#### 4"], answer=["3", "3"])
    assert total == [2.5, 0.5]
    assert any("_boom" in r.getMessage() for r in caplog.records)
    total2, parts = comb.breakdown(["", ""], ["#### 3", "#### 4"], answer=["3", "3"])
    assert total2 == total and parts["_boom"] == [0.0, 0.0] and parts["math_accuracy_reward"] == [1.0, 0.0]
    with pytest.raises(ValueError):
        combine_rewards([_const], weights=[1.0, 2.0])


# ------------------------------------------------------------------------------ registry


def test_registry():
    assert get_reward_fn("math_accuracy") is math_accuracy_reward
    assert get_reward_fn("format") is format_reward
    assert get_reward_fn("code") is code_reward
    with pytest.raises(KeyError, match="code, format, math_accuracy"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="already"):
        register_reward_fn("format", _const)


@pytest.mark.parametrize("completion", [
    "So \\boxed{42}\n#### The answer is above",
    "\\boxed{42}\n#### Answer: see above",
    "\\boxed{42}\n#### **Answer:** see above",
    "\\boxed{42}\n#### Final answer: shown above.",
    "\\boxed{42}\n#### Answer = the boxed value",
    "\\boxed{42}\n#### Answer is boxed",
    "\\boxed{42}\n#### Answer: as computed in the box",
    "\\boxed{42}\n#### 3 Verification steps",
    "\\boxed{42}\n#### 1/2 way check",
])
def test_labelled_prose_and_numbered_headings_do_not_overwrite_the_answer(completion):
    assert math_accuracy_reward([""], [completion], answer=["42"]) == [1.0]


@pytest.mark.parametrize("completion, answer", [
    ("#### Answer: yes", "yes"), ("#### Answer: 6 x 7 = 42", "42"), ("#### 42", "42")])
def test_labelled_and_plain_answers_still_count(completion, answer):
    assert math_accuracy_reward([""], [completion], answer=[answer]) == [1.0]
