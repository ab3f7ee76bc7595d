"""`das-jax models` (list named sources) and `das-jax model-info SOURCE` (load and describe).

`register` only adds parsers; jax is imported inside `cmd_model_info`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from das_jax.errors import one_line
from das_jax.models.config import ModelConfigError
from das_jax.models.errors import ModelLoadError
from das_jax.models.sources import SOURCES, cache_dir, cached_path


def register(subparsers) -> None:
    """Adds the `models` and `model-info` subcommands to an argparse subparsers object."""
    p = subparsers.add_parser("models", help="list the named model sources",
                              description="List the named model sources that `load` / --model accept.")
    p.set_defaults(func=cmd_models)

    p = subparsers.add_parser(
        "model-info", help="load a model and print its config, parameter count and size",
        description="Load SOURCE (named source, local HF directory, .gguf file or HF hub id) and "
                    "print the resolved config, the parameter count and the bytes of the params.")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_model_info)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def cmd_models(args: argparse.Namespace) -> int:
    print(f"{'NAME':<24} {'FORMAT':<6} {'SIZE':>9}  CACHED  DESCRIPTION")
    for s in SOURCES.values():
        cached = "yes" if os.path.isfile(cached_path(s.name)) else "no"
        print(f"{s.name:<24} {s.format:<6} {_human(s.size_bytes):>9}  {cached:<6}  {s.description}")
    print(f"(cache: {cache_dir()}; set DAS_JAX_CACHE to change)")
    return 0


def cmd_model_info(args: argparse.Namespace) -> int:
    try:
        from das_jax.models.loading import load, params_size  # deferred import: jax, flax
        config, params, tokenizer = load(args.source, dtype=args.dtype)
    except (ModelLoadError, ModelConfigError) as e:
        print(f"das-jax model-info: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    n, nbytes = params_size(params)
    info = {
        "source": args.source,
        "dtype": args.dtype,
        "config": config.to_dict(),
        "num_params": n,
        "params_bytes": nbytes,
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "eos_token_ids": list(tokenizer.eos_token_ids),
                      "pad_token_id": tokenizer.pad_token_id,
                      "chat_template": bool(tokenizer.chat_template)},
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"source: {args.source}")
    for k, v in info["config"].items():
        print(f"  {k}: {v}")
    print(f"parameters: {n:,} ({_human(nbytes)} as {args.dtype})")
    t = info["tokenizer"]
    print(f"tokenizer: vocab {t['vocab_size']}, eos {t['eos_token_ids']}, pad {t['pad_token_id']}, "
          f"chat template: {'yes' if t['chat_template'] else 'no'}")
    return 0
