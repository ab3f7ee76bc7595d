"""A built-in, seeded synthetic arithmetic word-problem task (works on a fresh machine, no files).

Problems come from a few themed templates (shopping, travel, sharing, bakery, multi-step
running totals, and an easy opt-in one: small counts). Each problem needs 1 to 5 arithmetic steps, so reference solutions (and the
completions a policy writes) vary in length: short one-liners and long multi-step answers, the
long tail that DAS targets. Every answer is a non-negative integer.

Problem ``i`` of seed ``s`` depends only on ``(s, i)`` and the step range, so
``synthetic_arithmetic(10, s)[:5] == synthetic_arithmetic(5, s)``.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from das_jax.data.problems import Problem

__all__ = ["synthetic_arithmetic", "ARITHMETIC_TEMPLATES", "DEFAULT_TEMPLATES"]

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas",
          "Kira", "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
_ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"),
          ("sandwich", "sandwiches"), ("ticket", "tickets"), ("book", "books"),
          ("toy car", "toy cars"), ("mango", "mangoes"), ("candle", "candles"), ("scarf", "scarves")]
_VEHICLES = ["car", "bus", "train", "cyclist", "truck", "boat"]
_SHARE_ITEMS = ["marbles", "stickers", "cookies", "stamps", "crayons", "shells", "cards"]

def _hours(n: int) -> str:
    return "1 hour" if n == 1 else f"{n} hours"


def _plural(n: int, item: tuple[str, str]) -> str:
    return f"{n} {item[0] if n == 1 else item[1]}"


# -------------------------------------------------------------------------------- templates
# Each template takes (rng, steps) and returns (question, answer, solution_steps) with
# len(solution_steps) == steps, or None when it cannot make that many steps.


def _shopping(rng: random.Random, steps: int):
    # steps = k products + (1 sum if k > 1) + (1 change if paying with a bill)
    options = [(k, ch) for k in (1, 2, 3) for ch in (False, True) if k + (k > 1) + ch == steps]
    if not options:
        return None
    k, change = rng.choice(options)
    name = rng.choice(_NAMES)
    items = rng.sample(_ITEMS, k)
    qty = [rng.randint(1, 9) for _ in range(k)]
    price = [rng.randint(1, 25) for _ in range(k)]
    parts = [f"{_plural(q, it)} at ${p} each" for q, it, p in zip(qty, items, price)]
    listing = parts[0] if k == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    sol, costs = [], []
    for q, it, p in zip(qty, items, price):
        costs.append(q * p)
        sol.append(f"{it[1].capitalize()} cost {q} * {p} = {q * p} dollars.")
    total = sum(costs)
    if k > 1:
        sol.append(f"In total {' + '.join(map(str, costs))} = {total} dollars.")
    if change:
        bill = next((b for b in (20, 50, 100, 200, 500, 1000) if b >= total), 1000)
        if bill == total:
            bill *= 2
        sol.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        q = f"{name} buys {listing}. {name} pays with a ${bill} bill. How much change, in dollars, does {name} get back?"
        return q, bill - total, sol
    q = f"{name} buys {listing}. How many dollars does {name} spend in total?"
    return q, total, sol


def _travel(rng: random.Random, steps: int):
    # steps = legs + (1 sum if legs > 1) + (1 if asking for the remaining distance)
    options = [(n, rem) for n in (1, 2, 3) for rem in (False, True) if n + (n > 1) + rem == steps]
    if not options:
        return None
    legs, remaining = rng.choice(options)
    veh = rng.choice(_VEHICLES)
    speeds = [rng.choice(range(10, 95, 5)) for _ in range(legs)]
    hours = [rng.randint(1, 6) for _ in range(legs)]
    words = ["first", "then", "finally"] if legs == 3 else ["first", "then"]
    if legs == 1:
        desc = f"A {veh} travels at {speeds[0]} km per hour for {_hours(hours[0])}."
    else:
        bits = [f"{w} travels at {s} km per hour for {_hours(h)}" for w, s, h in zip(words, speeds, hours)]
        desc = f"A {veh} " + ", ".join(bits[:-1]) + ", and " + bits[-1] + "."
    sol, dists = [], []
    for i, (s, h) in enumerate(zip(speeds, hours)):
        dists.append(s * h)
        sol.append(f"Leg {i + 1}: {s} * {h} = {s * h} km.")
    total = sum(dists)
    if legs > 1:
        sol.append(f"Total distance: {' + '.join(map(str, dists))} = {total} km.")
    if remaining:
        trip = total + rng.choice(range(10, 400, 10))
        sol.append(f"Remaining: {trip} - {total} = {trip - total} km.")
        q = f"{desc} The whole trip is {trip} km long. How many kilometers are left to travel?"
        return q, trip - total, sol
    return f"{desc} How many kilometers does it travel in total?", total, sol


def _sharing(rng: random.Random, steps: int):
    # steps = (1 if items come in boxes) + (1 if some are given away) + 1 split
    options = [(b, g) for b in (False, True) for g in (False, True) if b + g + 1 == steps]
    if not options:
        return None
    boxes, give = rng.choice(options)
    name, item = rng.choice(_NAMES), rng.choice(_SHARE_ITEMS)
    friends = rng.randint(2, 8)
    each = rng.randint(2, 15)
    rest = friends * each
    given = rng.randint(1, 20) if give else 0
    total = rest + given
    sol = []
    if boxes:
        # make total divisible into boxes: adjust `given` so total = nb * per_box
        per_box = rng.choice([d for d in range(2, 13) if total % d == 0] or [1])
        nb = total // per_box
        if per_box == 1:
            per_box, nb = total, 1
        have = f"{name} has {nb} boxes with {per_box} {item} in each box."
        sol.append(f"{name} has {nb} * {per_box} = {total} {item}.")
    else:
        have = f"{name} has {total} {item}."
    give_txt = ""
    if give:
        give_txt = f" {name} gives {given} of them to a neighbour."
        sol.append(f"After giving some away: {total} - {given} = {rest} {item}.")
    sol.append(f"Each friend gets {rest} / {friends} = {each} {item}.")
    what = "the rest" if give else "them"
    q = f"{have}{give_txt} {name} shares {what} equally among {friends} friends. How many {item} does each friend get?"
    return q, each, sol


def _bakery(rng: random.Random, steps: int):
    # trays*per_tray, [- burnt], / per_box, [* price], [+ tips]  -> 2..5 steps
    if not 2 <= steps <= 5:
        return None
    extra = steps - 2
    flags = rng.choice([f for f in ((1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1), (0, 0, 0))
                        if sum(f) == extra and (not f[2] or f[1])])
    burnt_on, price_on, tip_on = map(bool, flags)
    name = rng.choice(_NAMES)
    per_box = rng.randint(2, 12)
    n_boxes = rng.randint(2, 15)
    burnt = rng.randint(1, 9) if burnt_on else 0
    good = per_box * n_boxes
    baked = good + burnt
    per_tray = rng.choice([d for d in range(4, 25) if baked % d == 0 and baked // d >= 2] or [baked])
    trays = baked // per_tray
    sol = [f"{name} bakes {trays} * {per_tray} = {baked} cookies."]
    q = f"{name} bakes {trays} tray{'s' if trays != 1 else ''} of cookies with {per_tray} cookies on each tray."
    if burnt_on:
        q += f" {burnt} cookies get burnt and are thrown away."
        sol.append(f"Good cookies: {baked} - {burnt} = {good}.")
    q += f" The rest are packed in boxes of {per_box}." if burnt_on else f" All of them are packed in boxes of {per_box}."
    sol.append(f"Boxes: {good} / {per_box} = {n_boxes}.")
    ans = n_boxes
    ask = " How many boxes does " + name + " fill?"
    if price_on:
        price = rng.randint(2, 15)
        q += f" Each box sells for ${price}."
        ans = n_boxes * price
        sol.append(f"Money from boxes: {n_boxes} * {price} = {ans} dollars.")
        ask = f" How many dollars does {name} earn?"
        if tip_on:
            tips = rng.randint(1, 30)
            q += f" Customers also leave ${tips} in tips."
            sol.append(f"With tips: {ans} + {tips} = {ans + tips} dollars.")
            ans += tips
    return q + ask, ans, sol


def _running_total(rng: random.Random, steps: int):
    # a sequence of `steps` operations on a running amount of money
    name = rng.choice(_NAMES)
    v = rng.randint(10, 60)
    q = [f"{name} starts the week with ${v}."]
    sol = []
    days = ["On Monday", "On Tuesday", "On Wednesday", "On Thursday", "On Friday"]
    for d in days[:steps]:
        ops = ["earn", "spend", "double", "half", "buy"]
        if v < 4:
            ops = ["earn", "double"]
        if v % 2 or v > 400:
            ops = [o for o in ops if o not in ("half", "double")] or ["earn"]
        op = rng.choice(ops)
        if op == "earn":
            a = rng.randint(5, 50)
            q.append(f"{d}, {name} earns ${a} more.")
            sol.append(f"{v} + {a} = {v + a}.")
            v += a
        elif op == "spend":
            a = rng.randint(1, v - 1)
            q.append(f"{d}, {name} spends ${a} on lunch.")
            sol.append(f"{v} - {a} = {v - a}.")
            v -= a
        elif op == "double":
            q.append(f"{d}, {name}'s grandmother doubles the money {name} has.")
            sol.append(f"{v} * 2 = {2 * v}.")
            v *= 2
        elif op == "half":
            q.append(f"{d}, {name} puts half of the money into a savings jar.")
            sol.append(f"{v} / 2 = {v // 2}.")
            v //= 2
        else:  # buy n things at p each: one step "v - n*p" shown as one line
            # at most v comics at $1 or more each: the money never goes below 0
            n = min(rng.randint(2, 5), v)
            p = rng.randint(1, max(1, (v - 1) // n))
            q.append(f"{d}, {name} buys {n} comics at ${p} each.")
            sol.append(f"{v} - {n} * {p} = {v - n * p}.")
            v -= n * p
    q.append(f"How many dollars does {name} have now?")
    return " ".join(q), v, sol


def _counting(rng: random.Random, steps: int):
    # the easy template: a count of things changed by `steps` (1 or 2) small additions or
    # removals; every number is at most 20 and every intermediate count is positive
    if not 1 <= steps <= 2:
        return None
    name, (one, many) = rng.choice(_NAMES), rng.choice(_ITEMS)
    v = rng.randint(2, 20)
    q, sol = [f"{name} has {_plural(v, (one, many))}."], []
    for _ in range(steps):
        if v > 2 and rng.random() < 0.5:
            a = rng.randint(1, min(v - 1, 20))
            q.append(f"{name} gives {a} of them away.")
            sol.append(f"{v} - {a} = {v - a}.")
            v -= a
        else:
            a = rng.randint(1, 20)
            q.append(f"{name} gets {a} more.")
            sol.append(f"{v} + {a} = {v + a}.")
            v += a
    q.append(f"How many {many} does {name} have now?")
    return " ".join(q), v, sol


ARITHMETIC_TEMPLATES: dict[str, Callable] = {
    "shopping": _shopping,
    "travel": _travel,
    "sharing": _sharing,
    "bakery": _bakery,
    "multi_step": _running_total,
    "counting": _counting,
}
#: The templates used when none are named (``counting``, the easy one, only when asked for, so
#: that the default problems of a seed stay what they were).
DEFAULT_TEMPLATES: tuple[str, ...] = ("shopping", "travel", "sharing", "bakery", "multi_step")


def synthetic_arithmetic(
    num_problems: int,
    seed: int = 0,
    *,
    min_steps: int = 1,
    max_steps: int = 5,
    templates: Sequence[str] | None = None,
    id_prefix: str = "arith",
) -> list[Problem]:
    """Generate ``num_problems`` seeded arithmetic word problems with integer answers.

    Args:
        num_problems: how many problems (>= 0).
        seed: the generator seed; problem ``i`` is a pure function of ``(seed, i)`` and the
            options below.
        min_steps, max_steps: the number of arithmetic steps of each problem is drawn uniformly
            from ``[min_steps, max_steps]`` (1 <= min_steps <= max_steps <= 5).
        templates: subset of ``ARITHMETIC_TEMPLATES`` (``shopping``, ``travel``, ``sharing``,
            ``bakery``, ``multi_step``, and the easy ``counting``: small counts, 1-2 additions
            or removals, numbers <= 20); default ``DEFAULT_TEMPLATES`` (all but ``counting``).
        id_prefix: ids are ``f"{id_prefix}-{seed}-{i}"``.

    Returns:
        Problems with ``answer`` = the integer answer as a string and ``metadata`` =
        ``{"template", "num_steps", "solution"}`` (``solution``: the step-by-step reference
        ending in ``#### <answer>``).

    Raises:
        ValueError: bad counts / step range / unknown template names, or no chosen template
            can make a problem with the requested number of steps.
    """
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    if not 1 <= min_steps <= max_steps <= 5:
        raise ValueError(f"need 1 <= min_steps <= max_steps <= 5, got {min_steps}, {max_steps}")
    names = list(DEFAULT_TEMPLATES) if templates is None else list(templates)
    bad = [t for t in names if t not in ARITHMETIC_TEMPLATES]
    if bad or not names:
        raise ValueError(f"unknown template(s) {bad}; valid: {sorted(ARITHMETIC_TEMPLATES)}")
    out = []
    for i in range(num_problems):
        rng = random.Random(f"das-jax-arith:{seed}:{i}")
        steps = rng.randint(min_steps, max_steps)
        order = names[:]
        rng.shuffle(order)
        res = None
        for t in order:
            res = ARITHMETIC_TEMPLATES[t](rng, steps)
            if res is not None:
                break
        if res is None:
            raise ValueError(f"no template among {names} can make a {steps}-step problem")
        question, answer, sol = res
        if len(sol) != steps or not isinstance(answer, int) or answer < 0:
            # a template bug, never a user error: stop rather than train on a wrong answer
            raise RuntimeError(f"synthetic problem {i} of seed {seed} (template {t!r}) came out "
                               f"invalid: answer {answer!r}, {len(sol)} solution steps for "
                               f"{steps}; this is a bug in das_jax.data.synthetic")
        out.append(
            Problem(
                problem_id=f"{id_prefix}-{seed}-{i}",
                prompt=question,
                answer=str(answer),
                metadata={"template": t, "num_steps": steps, "solution": "\n".join(sol) + f"\n#### {answer}"},
            )
        )
    return out
