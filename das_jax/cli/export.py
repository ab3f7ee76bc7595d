"""`das-jax export`: a training run's checkpoint as a Hugging Face model directory."""
from __future__ import annotations

import argparse
import os

from das_jax.arg_types import nonnegative_int
from das_jax.rl.export import export_run
from das_jax.rl.run_log import setup_console_logging


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model directory",
        description="Write one checkpoint of a 'das-jax train' run as a Hugging Face model "
                    "directory (safetensors, config.json in the source model's architecture, "
                    "generation_config.json, tokenizer files with the chat template) that "
                    "transformers, vLLM and lm-eval load as they are.",
        epilog="e.g. das-jax export runs/smollm2-135m-arith exported/ ; then "
               "AutoModelForCausalLM.from_pretrained('exported/'), vllm serve exported/, or "
               "lm_eval --model hf --model_args pretrained=exported/")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a 'das-jax train' run directory (its "
                   "output_dir) with at least one checkpoint")
    p.add_argument("out", metavar="OUT", help="directory to write (must be new or empty)")
    p.add_argument("--step", type=nonnegative_int, default=None,
                   help="checkpoint step to export (default: the newest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights' dtype (default: the run's model.dtype)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a model exported to OUT before (only its files are removed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # host arrays only: never grab an accelerator (a run may be training on it)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    setup_console_logging()
    result = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                        overwrite=args.overwrite)
    print(f"exported step {result.step} of {args.run_dir} to {result.out}: "
          f"{result.architecture}, {result.num_params / 1e6:.1f}M parameters, {result.dtype}, "
          f"{len(result.files)} files; load it with "
          f"AutoModelForCausalLM.from_pretrained({result.out!r})")
    return 0
