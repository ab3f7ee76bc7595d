"""Predicates over values parsed from JSON or YAML (trace lines, run logs, cost files): a bool
is an int in Python but never a count or a number in these files. No jax import."""
from __future__ import annotations


def is_int(v) -> bool:
    """A JSON/Python int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A JSON/Python int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
