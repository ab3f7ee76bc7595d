"""The cost-model file: the three coefficients of `CostModel` (`das_jax.speculation.cost_model`)
and free-form provenance, as JSON. Read by named-model resolution (`gpu_cost.resolve_cost_model`)
and written by the GPU check."""
from __future__ import annotations

import json
import math

from das_jax.json_values import is_number

__all__ = ["COST_MODEL_FORMAT", "COST_KEYS", "save_cost_model", "load_cost_model",
           "cost_coefficients", "is_seconds"]

COST_KEYS = ("c_base", "c_tok", "c_kv")

COST_MODEL_FORMAT = "das-jax-cost-model/1"
"""A cost-model file is one JSON object:

    {"format": "das-jax-cost-model/1",
     "c_base": seconds per step, "c_tok": seconds per computed token slot,
     "c_kv": seconds per attended cached position per row,
     "device": "...", "model": "...", "source": "how it was obtained", ...any other notes}

Only format, c_base, c_tok and c_kv are read; the rest is free-form provenance (a derivation, or
the measured shapes of a GPU check)."""


def is_seconds(v) -> bool:
    """A finite number >= 0: a valid step-cost coefficient (seconds)."""
    return is_number(v) and math.isfinite(v) and v >= 0


def cost_coefficients(obj, where: str, fix: str, default_c_kv: float | None = 0.0,
                      prefix: str = "") -> dict:
    """{"c_base", "c_tok", "c_kv"} as floats from `obj` (a cost-model file's object, or a
    trace header's "cost_model"), each a finite number >= 0 (`is_seconds`; the replay's
    --c-base / --c-tok / --c-kv flags are checked the same way); a missing c_kv is
    `default_c_kv` (None: required); `prefix` goes before a coefficient's name in a message.

    Raises:
      ValueError: "<where>: <what is wrong>; <fix>"."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: 'cost_model' is {type(obj).__name__}, not an object "
                         f"{{\"c_base\": s, \"c_tok\": s, \"c_kv\": s}}; {fix}")
    out = {}
    for k in COST_KEYS:
        v = obj.get(k, default_c_kv if k == "c_kv" else None)
        if not is_seconds(v):
            raise ValueError(f"{where}: {prefix}{k} must be a finite number >= 0 (seconds), got "
                             f"{v!r}; {fix}")
        out[k] = float(v)
    return out


def save_cost_model(path, coef: dict, **provenance) -> None:
    """Writes `coef` (c_base, c_tok, c_kv in seconds) and free-form provenance as a cost-model
    file (`COST_MODEL_FORMAT`)."""
    obj = {"format": COST_MODEL_FORMAT, **{k: float(coef[k]) for k in ("c_base", "c_tok", "c_kv")},
           **provenance}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")


def load_cost_model(path) -> dict:
    """{"c_base", "c_tok", "c_kv"} (seconds) from a cost-model file.

    Raises:
      ValueError: one line naming the file and what is wrong (missing, not JSON, wrong format,
        a coefficient missing, negative or not a number).
    """
    hint = ("expected a JSON object {\"format\": \"%s\", \"c_base\": s, \"c_tok\": s, "
            "\"c_kv\": s}" % COST_MODEL_FORMAT)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"cost model file {path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cost model file {path}: not JSON ({e}); {hint}") from None
    if not isinstance(obj, dict) or obj.get("format") != COST_MODEL_FORMAT:
        got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"cost model file {path}: format is {got!r}; {hint}")
    return cost_coefficients(obj, f"cost model file {path}", hint, default_c_kv=None)
