"""The plain-data wire format of the code sandbox (both sides: the solution's ``serve`` process and
the tests' proxies). Standard library only: the sandbox's runner imports this file as the top-level
module ``wire``."""

import json

# ---------------------------------------------------------------------------------------------
# Plain-data wire format (shared by both sides). JSON with tagged objects for the types JSON lacks.
#   None, bool, str: themselves; int: itself, or {"i": "<hex>"} beyond BIG_INT_BITS (the decimal
#   form is capped at 4300 digits by Python's int/str limit, hex is not, and it parses in linear
#   time); float: itself if finite, else {"f": "nan" | "inf" | "-inf"};
#   list: a JSON array; tuple {"t": [...]}; dict {"d": [[k, v], ...]}; set {"s": [...]};
#   frozenset {"fs": [...]}; complex {"c": [re, im]}; bytes {"b": "<hex>"}.
# Subclasses of these types are sent as their base type (their methods never reach the other
# side); anything else cannot be encoded and fails the call.
# ---------------------------------------------------------------------------------------------
MAX_DEPTH = 64
BIG_INT_BITS = 4096  # ~1233 decimal digits: larger ints cross as hex


class WireError(Exception):
    """A value that is not plain data, or a malformed message."""


class WireTooDeep(WireError):
    """A value nested deeper than ``MAX_DEPTH``: reported as a message over the limits."""


def encode(x, depth=0):
    if depth > MAX_DEPTH:
        raise WireTooDeep(f"value nested deeper than {MAX_DEPTH} levels")
    if x is None or x is True or x is False:
        return x
    d = depth + 1
    if isinstance(x, bool):  # pragma: no cover - bool cannot be subclassed
        return bool(x)
    if isinstance(x, int):
        v = int.__index__(x)
        return {"i": hex(v)} if v.bit_length() > BIG_INT_BITS else v
    if isinstance(x, float):
        v = float.__float__(x)
        if v != v:
            return {"f": "nan"}
        if v in (float("inf"), float("-inf")):
            return {"f": "inf" if v > 0 else "-inf"}
        return v
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, list):
        return [encode(v, d) for v in list.__iter__(x)]
    if isinstance(x, tuple):
        return {"t": [encode(v, d) for v in tuple.__iter__(x)]}
    if isinstance(x, dict):
        return {"d": [[encode(k, d), encode(v, d)] for k, v in dict.items(x)]}
    if isinstance(x, frozenset):
        return {"fs": [encode(v, d) for v in frozenset.__iter__(x)]}
    if isinstance(x, set):
        return {"s": [encode(v, d) for v in set.__iter__(x)]}
    if isinstance(x, complex):
        return {"c": [encode(complex.__complex__(x).real, d), encode(complex.__complex__(x).imag, d)]}
    if isinstance(x, (bytes, bytearray)):
        return {"b": bytes(x).hex()}
    raise WireError(f"{type(x).__name__} is not plain data")


_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def decode(x, depth=0):
    """Rebuild a value from :func:`encode`'s output using builtin types only."""
    if depth > MAX_DEPTH:
        raise WireTooDeep(f"value nested deeper than {MAX_DEPTH} levels")
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    d = depth + 1
    if t is list:
        return [decode(v, d) for v in x]
    if t is not dict or len(x) != 1:
        raise WireError("malformed value")
    (tag, v), = x.items()
    if tag == "f" and v in _FLOATS:
        return _FLOATS[v]
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "i" and type(v) is str:
        try:
            return int(v, 16)
        except ValueError:
            raise WireError("malformed int") from None
    if type(v) is not list:
        raise WireError("malformed value")
    if tag == "t":
        return tuple(decode(e, d) for e in v)
    if tag == "s":
        return {decode(e, d) for e in v}
    if tag == "fs":
        return frozenset(decode(e, d) for e in v)
    if tag == "c" and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(v[0], v[1])
    if tag == "d":
        out = {}
        for kv in v:
            if type(kv) is not list or len(kv) != 2:
                raise WireError("malformed dict item")
            out[decode(kv[0], d)] = decode(kv[1], d)
        return out
    raise WireError("malformed value")


def _reject_constant(name):
    raise WireError(f"bare {name} in message")


def loads(line):
    return json.loads(line, parse_constant=_reject_constant)


def dumps(obj):
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))
