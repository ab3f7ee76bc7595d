"""Property tests: the math reward agrees with math-verify's own verdicts (for a gold that is
one number, on answers that state one number).

``math_answer_correct`` = exact numeric fallback OR normalised string match OR math-verify. So it
equals math-verify's verdict on the final-answer region exactly when the two fallbacks never
accept what math-verify rejects. Regions are drawn from a grammar of numbers written the ways
models write them and of non-numbers built from them (products, hedges, lists, intervals, powers,
roots, units, space-separated digits), wrapped as ``#### r`` or ``\\boxed{r}``, sometimes after
an earlier, different final answer (the last one must win).
"""

import re
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from das_jax.rl.rewards.math_reward import extract_answer_region, math_answer_correct, parse_number

_WRAPPED_NUMBER = re.compile(r"^(?:\\text\{(?P<text>[^{}]*)\}|(?P<percent>[^{}%]*)\\%)$")

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _one_number(p) -> bool:
    """math-verify's parse `p` states one number: its text (an equation's right-hand side) is
    one number, a x 10^k, or a sympy number written without an operator."""
    import sympy

    text = str(p[-1]).rsplit("=", 1)[-1]
    if parse_number(text) is not None:
        return True
    e = p[0].rhs if isinstance(p[0], sympy.Eq) else p[0]
    if isinstance(e, sympy.Mul) and len(e.args) == 2 and e.args[0].is_Number:
        b = e.args[1]
        if isinstance(b, sympy.Pow) and b.base == 10 and b.exp.is_Integer:
            return True
    operator = re.search(r"\\(?:div|times|cdot)(?![A-Za-z])|[*:+]|(?<=[\d)}])\s*-"
                         r"|\^(?!\s*\{?\s*\\circ)", text)
    return not operator and bool(getattr(e, "is_Number", False))


def _mv(region: str, gold: str, wrap: bool = True) -> bool:
    """math-verify's verdict on `region` (wrapped in ``$...$``; `wrap` false: a whole
    completion as it is), where a gold that is one number needs an answer that is one number
    (an equation's right-hand side; the reward's step 4: no unevaluated expression).

    One documented exception: a number in ``\\text{}`` or before ``\\%`` is that number.
    math-verify means it to be (``\\text{5}`` and ``25\\%`` pass against 5 and 25) but its
    ``verify`` rejects a decimal so wrapped (``\\text{0.1}``, ``2.5\\%`` against 0.1, 2.5), so
    such a region is compared unwrapped. A lone bare ``$`` (currency: ``-$1``) is escaped so that it
    cannot close the ``$...$`` around the region."""
    from math_verify import parse, verify

    m = _WRAPPED_NUMBER.match(region) if wrap else None
    inner = m and (m["text"] if m["text"] is not None else m["percent"])
    if inner and parse_number(inner) is not None:
        region = inner
    if wrap and len(re.findall(r"(?<!\\)\$", region)) % 2:
        region = re.sub(r"(?<!\\)\$", r"\\$", region)
    g, p = parse(f"${gold}$"), parse(f"${region}$" if wrap else region)
    if not (g and p):
        return False
    if parse_number(gold) is not None and not _one_number(p):
        return False
    return bool(verify(g, p))


values = st.one_of(
    st.integers(-2_000_000, 2_000_000).map(Fraction),
    st.builds(lambda n, k: Fraction(n, 10**k), st.integers(-99_999, 99_999), st.integers(1, 3)),
    st.builds(Fraction, st.integers(-50, 50), st.integers(1, 12)),
)


def _terminates(v: Fraction) -> bool:
    d = v.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _plain(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    if not _terminates(v):
        return f"\\frac{{{v.numerator}}}{{{v.denominator}}}"
    return f"{float(v):.6f}".rstrip("0")


@st.composite
def rendering(draw, v: Fraction) -> str:
    """``v`` written one of the ways a model writes one number."""
    if not _terminates(v):
        n, d = abs(v.numerator), v.denominator
        sign = "-" if v < 0 else ""
        return draw(st.sampled_from([f"{sign}\\frac{{{n}}}{{{d}}}", f"{sign}\\dfrac{{{n}}}{{{d}}}", f"{sign}{n}/{d}"]))
    base = _plain(v)
    forms = [base, f"{base}.", f"${base}$", f"\\text{{{base}}}"]
    if v >= 0:
        forms += [f"${base}", f"\\${base}", f"{base}\\%", f"+{base}"]
    else:
        forms += [f"-${base[1:]}", f"\u2212{base[1:]}"]
    if v.denominator == 1:
        forms += [f"{v.numerator:,}", f"{base}.00"]
        if abs(v) >= 1000:
            forms.append(f"{v.numerator:,}".replace(",", "{,}"))
    else:
        forms.append(f"\\frac{{{v.numerator}}}{{{v.denominator}}}")
    return draw(st.sampled_from(forms))


@st.composite
def region_and_gold(draw):
    gv = draw(values)
    gold = _plain(gv)
    # mostly the gold's own value, sometimes a neighbour or an unrelated value
    near = draw(st.sampled_from([gv, gv, gv, gv + 1, -gv, gv * 10, draw(values)]))
    a = draw(rendering(near))
    b = draw(rendering(draw(st.sampled_from([gv, near, draw(values)]))))
    ai, bi = (_plain(near), _plain(gv))
    region = draw(st.sampled_from([
        a, a, a,
        f"{a} \\cdot {b}", f"{ai}\\sqrt{{{bi}}}", f"{a} or {b}", f"{a}, {b}", f"[{ai}, {bi}]",
        f"({ai}, {bi})", f"{a} + {b}", f"{ai}^{{2}}", f"{a} \\text{{ or }} {b}", f"{a} to {b}",
        f"x = {a}", f"{ai} \\pm {bi}", f"{ai} {bi}", f"{a} \\text{{ dollars}}", f"{ai}x",
        f"\\{{{ai}, {bi}\\}}", f"{ai} \\le x \\le {bi}",
    ]))
    return region, gold


def _wrap(region: str, style: int, other: str) -> str:
    return [
        f"Let me think.\n#### {region}",
        f"The answer is $\\boxed{{{region}}}$.",
        f"#### {other}\nWait, I made a mistake. The answer is \\boxed{{{region}}}",
        f"\\boxed{{{other}}} is wrong, so\n#### {region}\nDone.",
        f"#### **{region}**",
    ][style]


@SETTINGS
@given(region_and_gold(), st.integers(0, 4), values)
def test_math_reward_agrees_with_math_verify(rg, style, other_v):
    region, gold = rg
    completion = _wrap(region, style, _plain(other_v))
    # graded on the region the reward extracts (tested in test_rewards.py): a drawn region that
    # holds no answer ("#### 0. to 0" reads as a numbered heading) leaves an earlier marker's, or
    # with none the whole completion
    kind, graded = extract_answer_region(completion)
    expected = _mv(graded, gold) if kind != "all" else _mv(completion, gold, wrap=False)
    assert math_answer_correct(completion, gold) == expected, (completion, gold)
    # the fallback alone (off the main thread) never accepts what math-verify rejects
    if not expected:
        assert not math_answer_correct(completion, gold, use_math_verify=False), (completion, gold)


@SETTINGS
@given(values, st.data(), st.integers(0, 4), values)
def test_right_number_scores_one_without_math_verify(v, data, style, other_v):
    """Any rendering of the gold's value scores 1 from the exact fallback alone."""
    region = data.draw(rendering(v))
    completion = _wrap(region, style, _plain(other_v))
    assert parse_number(region) == v, region
    assert math_answer_correct(completion, _plain(v), use_math_verify=False), (completion, v)
    assert math_answer_correct(completion, _plain(v)), (completion, v)


# ------------------------------- completions built from parts around exactly one real answer
#
# Prose, markdown headings, code blocks and echoed instructions (none of which holds an answer)
# before and after one real answer. The reward must be math-verify's verdict on that answer: no
# heading, empty marker or echoed ``\boxed{}`` may overwrite it, and the numbers in the
# surrounding prose and code must not be graded.

HEADINGS = [
    "#### Step 1: Understand the problem", "### Step 2", "#### Step 3", "#### Verification",
    "#### **Check**", "####", "#### 2. Compute the total", "## Solution", "#### Final Answer",
    "##### Notes", "#### ---", "#### Answer", "#### *Why this works*", "#### 3) Double-check",
]
ECHOED = [
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "I put the final answer in \\boxed{} as asked.",
    "Write the answer as \\boxed{answer}.",
    "End your response with '#### <number>'.",
    "Answer format: \\boxed{your final answer}",
    "(The answer goes in \\boxed{ }, after ####.)",
    "Final answer: \\boxed{...}",
    "Put the number after #### on its own line.",
]
CODE = [
    "```python\nx = 6 * 7\nprint(x)  # {o}\n```",
    "```\n#### compute the total\ntotal = {o} + 1\n```",
    "```latex\n\\boxed{{}}\n```",
    "```python\n# The answer is printed below\nprint({o})\n```",
    "```python\nx = {o}\nprint(f\"\\\\boxed{{{x}}}\")\nprint(\"#### \" + str(x))\n```",
    "~~~\n#### {o}\n~~~",
]
PROSE = [
    "Let me compute {o} + 1 step by step.",
    "So 3 + 4 = 7, and 7 * 2 = 14.",
    "Hope this helps!",
    "Double-check: {o} / 1 = {o}, correct.",
    "Note that {o} is not the answer.",
    "**Verification:** plugging back in gives {o}.",
]


@st.composite
def distractor(draw, other: str) -> str:
    kind = draw(st.sampled_from(["heading", "echo", "code", "prose", "heading+prose"]))
    if kind == "heading":
        return draw(st.sampled_from(HEADINGS))
    if kind == "echo":
        return draw(st.sampled_from(ECHOED))
    if kind == "code":
        return draw(st.sampled_from(CODE)).replace("{o}", other).replace("{{}}", "{}")
    text = draw(st.sampled_from(PROSE)).replace("{o}", other)
    return f"{draw(st.sampled_from(HEADINGS))}\n{text}" if kind == "heading+prose" else text


ANSWER_FORMS = [
    "#### {r}", "\\boxed{{{r}}}", "So the answer is $\\boxed{{{r}}}$.", "#### Answer\n\\boxed{{{r}}}",
    "#### **Answer:** {r}", "#### The answer is {r}", "#### Final Answer\n$$\\boxed{{{r}}}$$",
    "The result is \\fbox{{{r}}}.",
]


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(region_and_gold(), st.sampled_from(ANSWER_FORMS), values, st.data())
def test_completion_with_one_answer_agrees_with_math_verify(rg, form, other_v, data):
    from das_jax.rl.rewards.math_reward import extract_answer_region

    region, gold = rg
    other = _plain(other_v)
    before = data.draw(st.lists(distractor(other), max_size=3))
    after = data.draw(st.lists(distractor(other), max_size=3))
    completion = "\n\n".join([*before, form.format(r=region), *after])
    assert extract_answer_region(completion)[1] == region, completion
    expected = _mv(region, gold)
    assert math_answer_correct(completion, gold) == expected, (completion, gold)
    if not expected:  # the fallback alone never accepts what math-verify rejects
        assert not math_answer_correct(completion, gold, use_math_verify=False), (completion, gold)
    elif parse_number(region) is not None and parse_number(gold) is not None:
        assert math_answer_correct(completion, gold, use_math_verify=False), (completion, gold)
