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


def test_math_last_number_fallback():
    assert _acc(["First 3 apples, then 4, so the total is 7."], ["7"]) == [1.0]
    assert _acc(["First 3 apples, then 4, so the total is 7. Oh wait 8"], ["7"]) == [0.0]
    assert _acc(["no numbers here"], ["7"]) == [0.0]
    assert extract_final_number("costs $1,234.50 in total.") == "1234.5"
    assert extract_final_number("#### 42\nThe end 7") == "42"
    assert extract_final_number("nothing") is None


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
