"""`das-jax generate`: sample completions from a model with the DAS engine."""
from __future__ import annotations

import argparse
import json
import math
import sys

from das_jax.arg_types import int_list, nonnegative_int, positive_int
from das_jax.config import DASSection
from das_jax.errors import one_line
from das_jax.rollout import speculation_names
from das_jax.speculation import CostModelConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate completions (optionally with speculative decoding)",
        description="Generate completions with the DAS engine. Speculation never changes the "
                    "sampled tokens, only the number of forward passes.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help="a text file with one prompt per line, or a .jsonl "
                                            "file with a 'prompt' (or 'question') field per line")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="named source, local HF directory, GGUF file or HF hub id "
                        "(default: smollm2-135m-instruct)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    p.add_argument("--num-samples", type=positive_int, default=1, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=nonnegative_int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", default="none", choices=speculation_names(),
                   help="speculation name (default none)")
    p.add_argument("--draft-widths", type=int_list(), default="1,4,8",
                   help="compiled verify widths W = 1 + draft tokens, comma separated")
    p.add_argument("--max-slots", type=positive_int, default=16, help="most concurrent sequences")
    p.add_argument("--max-cache-len", type=positive_int, default=4096)
    p.add_argument("--kv-cache", default="dense", choices=("dense", "paged"),
                   help="KV cache layout (rollout.kv_cache): paged holds each row's tokens in "
                        "pages of --page-size positions, a prompt's samples share its pages")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--layer-loop", default="scan", choices=("scan", "unroll"),
                   help="the programs' loop over layers (rollout.layer_loop): unroll = faster "
                        "GPU steps, much longer compiles")
    p.add_argument("--exact", action="store_true",
                   help="exact mode: shape-invariant contractions, so the tokens are identical "
                        "with and without speculation (slower; see README 'Exact mode')")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per sample, then one with the stats")
    p.set_defaults(func=run)


def read_prompts(args) -> list[str]:
    """The prompts of --prompt, or of --prompts-file (one per non-empty line; .jsonl: the
    'prompt' or 'question' field of each line).

    Raises:
      ValueError: an unreadable file, invalid UTF-8 or a bad JSON line (naming file and line).
    """
    if args.prompt:
        return list(args.prompt)
    path = args.prompts_file
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        raise ValueError(f"cannot read --prompts-file {path!r}: {e.strerror}") from None
    lines = []  # (1-based line number, text)
    for i, raw in enumerate(raw_lines, start=1):
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts-file {path}:{i}: invalid UTF-8 at byte {e.start} of the "
                             "line; save the file as UTF-8") from None
        if text.strip():
            lines.append((i, text))
    if path.endswith(".jsonl"):
        prompts = []
        for i, line in lines:
            try:
                obj = json.loads(line)
                prompts.append(obj.get("prompt", obj.get("question")))
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"--prompts-file {path}:{i}: not a JSON object") from None
            if not isinstance(prompts[-1], str):
                raise ValueError(f"--prompts-file {path}:{i}: no 'prompt' or 'question' string")
        return prompts
    return [text for _, text in lines]


def json_line(obj) -> str:
    """`json.dumps(obj)` with non-finite floats (NaN, inf) written as null: never invalid JSON."""
    return json.dumps(_finite_or_none(obj), allow_nan=False)


def _finite_or_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


def check_finite_logprobs(outputs, model: str, dtype: str) -> None:
    """Raises ValueError naming the first sample whose log-probs are NaN or infinite (a model
    whose logits are NaN: corrupt weights, or an overflow in `dtype`)."""
    for o in outputs:
        bad = [j for j, x in enumerate(o.logprobs) if not math.isfinite(x)]
        if bad:
            raise ValueError(
                f"model {model!r} produced non-finite log-probs ({o.logprobs[bad[0]]}) at token "
                f"{bad[0]} of prompt {o.request.problem_id} sample {o.request.sample_index}: its "
                f"logits are NaN/inf, so its weights are corrupt or overflow in --dtype {dtype}; "
                "re-fetch or re-convert the model files (or try --dtype float32)")


def run(args: argparse.Namespace) -> int:
    from das_jax.engine import SamplingParams  # deferred import: jax (not for --help)
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  max_new_tokens=args.max_new_tokens, seed=args.seed)
        widths = tuple(args.draft_widths)
        if 1 not in widths:
            raise ValueError(f"--draft-widths {','.join(map(str, widths))}: must include 1 "
                             "(the width of a step without drafts), e.g. 1,4,8")
        if args.drafter == "none":
            widths = (1,)    # plain decoding compiles and reserves no wider step
        prompts = read_prompts(args)
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file}: holds no prompts (one per "
                             "non-blank line; .jsonl: an object with a 'prompt' per line)")
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty and not args.chat:
            where = (f"--prompts-file {args.prompts_file}" if args.prompts_file else "--prompt")
            raise ValueError(f"{where}: prompt {empty[0]} is empty; give every prompt some "
                             "text (or pass --chat: the chat template adds tokens)")
    except ValueError as e:
        print(f"das-jax generate: error: {one_line(str(e))}", file=sys.stderr)
        return 2

    import jax.numpy as jnp  # deferred import: jax (imported when the command runs, not for --help)
    from tqdm import tqdm  # deferred import: tqdm (slow to import; not for --help)

    from das_jax.engine import Engine, EngineConfig, Request
    from das_jax.models import load
    from das_jax.rollout import Rollout

    try:
        config, params, tokenizer = load(args.model, dtype=getattr(jnp, args.dtype))
        engine = Engine(config, params, eos_token_ids=tokenizer.eos_token_ids,
                        engine_config=EngineConfig(max_slots=args.max_slots,
                                                   max_cache_len=args.max_cache_len,
                                                   draft_widths=widths, exact=args.exact,
                                                   kv_cache=args.kv_cache,
                                                   page_size=args.page_size,
                                                   layer_loop=args.layer_loop))
        prompt_ids = [tokenizer.chat_prompt_ids(p) if args.chat else tokenizer.encode_prompt(p)
                      for p in prompts]
        requests = [Request(tuple(ids), problem_id=i, sample_index=g)
                    for i, ids in enumerate(prompt_ids) for g in range(args.num_samples)]
        # Plans with the cost model's prior, refined online (no calibration run up front).
        das = DASSection(cost_model=CostModelConfig(calibrate=False))
        rollout = Rollout(engine, args.drafter, das, sampling)
        bar = None if args.json else tqdm(total=len(requests), desc="generate", file=sys.stderr)

        def progress(done, total):
            if bar is not None:
                bar.n = done
                bar.refresh()

        try:
            outputs, stats = rollout.generate(requests, progress=progress)
        finally:
            if bar is not None:
                bar.close()    # an error's line starts on a line of its own
        check_finite_logprobs(outputs, args.model, args.dtype)
    except ValueError as e:
        print(f"das-jax generate: error: {one_line(str(e))}", file=sys.stderr)
        return 2

    if args.json:
        for o in outputs:
            print(json_line({
                "prompt_index": o.request.problem_id, "sample_index": o.request.sample_index,
                "text": tokenizer.decode(o.token_ids), "token_ids": o.token_ids,
                "logprobs": [round(x, 6) for x in o.logprobs], "finish_reason": o.finish_reason,
            }))
        print(json_line({"stats": stats.to_dict()}))
    else:
        for o in outputs:
            print(f"=== prompt {o.request.problem_id} sample {o.request.sample_index} "
                  f"({len(o.token_ids)} tokens, {o.finish_reason})")
            print(tokenizer.decode(o.token_ids))
        print(f"--- {stats.generated_tokens} tokens in {stats.wall_s:.2f}s "
              f"({stats.generated_tokens / max(stats.wall_s, 1e-9):.1f} tok/s), "
              f"{stats.forward_passes} forward passes, {stats.accepted_draft_tokens} accepted draft "
              f"tokens, compile {stats.compile_s:.1f}s", file=sys.stderr)
    return 0
