"""`das-jax generate`: sample completions from a model with the DAS engine."""
from __future__ import annotations

import argparse
import json
import sys

DRAFTER_CHOICES = ("none", "ngram", "suffix", "suffix-global", "das", "das-unlimited")


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
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", default="none", choices=DRAFTER_CHOICES)
    p.add_argument("--draft-widths", default="1,4,8",
                   help="compiled verify widths W = 1 + draft tokens, comma separated")
    p.add_argument("--max-slots", type=int, default=16, help="most concurrent sequences")
    p.add_argument("--max-cache-len", type=int, default=4096)
    p.add_argument("--exact", action="store_true",
                   help="exact mode: shape-invariant contractions, so the tokens are identical "
                        "with and without speculation (slower; see README 'Exact mode')")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per sample, then one with the stats")
    p.set_defaults(func=run)


def read_prompts(args) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"cannot read --prompts-file {args.prompts_file!r}: {e.strerror}") from None
    if args.prompts_file.endswith(".jsonl"):
        prompts = []
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line)
                prompts.append(obj.get("prompt", obj.get("question")))
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"{args.prompts_file}:{i + 1}: not a JSON object") from None
            if not isinstance(prompts[-1], str):
                raise ValueError(f"{args.prompts_file}:{i + 1}: no 'prompt' or 'question' string")
        return prompts
    return lines


def run(args: argparse.Namespace) -> int:
    from das_jax.engine.sampling import SamplingParams
    try:
        if args.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  max_new_tokens=args.max_new_tokens, seed=args.seed)
        widths = tuple(int(w) for w in args.draft_widths.split(","))
        prompts = read_prompts(args)
        if not prompts:
            raise ValueError("no prompts given")
    except ValueError as e:
        print(f"das-jax generate: {e}", file=sys.stderr)
        return 2

    import jax.numpy as jnp
    from tqdm import tqdm

    from das_jax.engine.generate import Engine, EngineConfig, Request
    from das_jax.models import load
    from das_jax.speculation import build_speculation

    try:
        config, params, tokenizer = load(args.model, dtype=getattr(jnp, args.dtype))
        engine = Engine(config, params, eos_token_ids=tokenizer.eos_token_ids,
                        engine_config=EngineConfig(max_slots=args.max_slots,
                                                   max_cache_len=args.max_cache_len,
                                                   draft_widths=widths, exact=args.exact))
        prompt_ids = [tokenizer.chat_prompt_ids(p) if args.chat else tokenizer.encode(p)
                      for p in prompts]
        requests = [Request(tuple(ids), problem_id=i, sample_index=g)
                    for i, ids in enumerate(prompt_ids) for g in range(args.num_samples)]
        drafter, policy = build_speculation(args.drafter)
        bar = None if args.json else tqdm(total=len(requests), desc="generate", file=sys.stderr)

        def progress(done, total):
            if bar is not None:
                bar.n = done
                bar.refresh()

        outputs, stats = engine.generate(requests, sampling, drafter=drafter, policy=policy,
                                         progress=progress)
        if bar is not None:
            bar.close()
    except ValueError as e:
        print(f"das-jax generate: {e}", file=sys.stderr)
        return 2

    if args.json:
        for o in outputs:
            print(json.dumps({
                "prompt_index": o.request.problem_id, "sample_index": o.request.sample_index,
                "text": tokenizer.decode(o.token_ids), "token_ids": o.token_ids,
                "logprobs": [round(x, 6) for x in o.logprobs], "finish_reason": o.finish_reason,
            }))
        print(json.dumps({"stats": stats.to_dict()}))
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
