"""`das-jax bench engine`: decode throughput of the engine, against HF transformers and the
memory-bandwidth floor, measured side by side in one process.

1. Memory bandwidth: best of 3 copies of a 1 GB numpy array (bytes read + written per second).
   The floor of a decode step is (bytes of the params) / bandwidth: every step reads every weight.
2. The verify step (`step.verify_packed`, the engine's jitted decode step) timed directly at B in {1, 16},
   W in {1, 8}, with `--prompt-len` (~100) cached positions per row: median of repeats, compile
   excluded. Decode tok/s = B / step time at W = 1; at W = 8 the step verifies 8 tokens per row
   (what it yields depends on acceptance), so its cost is reported as the W8 / W1 ratio.
3. End to end: `Engine.generate` at B = 1 and B = 16 (greedy, no drafter, max_new_tokens
   tokens), tok/s = generated tokens / wall time (compile excluded; one warm-up run first).
   Prompts: the first 16 questions of `--prompts PATH` (a GSM8K-format jsonl, e.g. GSM8K's
   test.jsonl, which the tables in docs/results were measured with), else 16 built-in seeded
   arithmetic problems.
4. HF transformers `generate` on the same model (loaded from the same GGUF, float32,
   `torch.set_num_threads(--threads)`), the same prompts (left-padded at B = 16), greedy, the same
   max_new_tokens; tok/s counts tokens up to and including the first eos per row.

5. A ragged B = 16 step (one row drafting 7 tokens) packed vs padded; the split query block
   against one block at 768 cached positions (`split_block_terms`); and the KV term
   (step time slope per cached position-row between 128 and 1024 attended positions) against
   bytes per position / bandwidth (`packed_and_kv_terms`).
6. With `--paged`: the paged KV cache against the dense one, side by side (`paged_vs_dense`):
   the verify step at B = 16 and `Engine.generate` at B = 16, with the tokens compared.

Targets printed next to the numbers: plain decoding >= 2x HF tok/s at B = 1 and B = 16; the B = 1
W = 1 step within 1.5x of the floor; the W = 8 step at B = 1 <= 1.5x the W = 1 step.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from das_jax.data import DatasetError, load_gsm8k, synthetic_arithmetic
from das_jax.engine import pow2_at_least


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second moved by a large numpy copy (read + write), best of `repeats`."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def prompt_texts(path: str | None, n: int) -> list[str]:
    """The questions of the end-to-end runs: the first `n` of the GSM8K-format jsonl(.gz) file
    `path` (`--prompts`), or `n` of the built-in seeded arithmetic problems
    (`das_jax.data.synthetic_arithmetic`) when `path` is None.

    Raises:
      DatasetError: `path` is missing, unreadable or has too few problems.
    """
    if path is None:
        return [p.prompt for p in synthetic_arithmetic(n, seed=0)]
    problems = load_gsm8k(path, limit=n)
    if len(problems) < n:
        raise DatasetError(f"--prompts {path}: {len(problems)} problems, the benchmark needs {n}; "
                           f"pass a GSM8K-format jsonl with at least {n} lines")
    return [p.prompt for p in problems]


def _prompts(tokenizer, texts: list[str], n: int, target_len: int) -> list[list[int]]:
    """n chat prompts of about target_len tokens, from the question `texts`."""
    out = []
    for t in texts:
        ids = tokenizer.chat_prompt_ids("Solve the problem step by step. " + t)
        if len(ids) < target_len // 2:   # short question: ask it twice to get a realistic length
            ids = tokenizer.chat_prompt_ids("Solve the problem step by step. " + t + "\n" + t)
        out.append(ids)
        if len(out) == n:
            break
    return out


def time_verify(engine, B: int, W: int, prompt_len: int, repeats: int) -> float:
    """Median seconds of one greedy verify step at (B, W) attending to ~prompt_len positions."""

    kv_len = pow2_at_least(prompt_len + W, 128)
    return engine.time_verify_step(B, W, kv_len, kv_len + 16, repeats, (0.0, 0, 1.0))


def packed_and_kv_terms(engine, config, params, bandwidth: float, prompt_len: int,
                        repeats: int) -> dict:
    """Two measurements of the packed verify step and its KV term, printed and returned.

    * Ragged step, packed vs padded: B = 16 with one row drafting 7 tokens and 15 rows none.
      Packed computes a bucket of 16 + 7 = 23 slots (24); padded computes 16 x 8 = 128 rows.
    * The KV term: the B = 16, W = 1 step timed at two attended lengths (128 and 1024 cached
      positions per row); the slope per position-row against `bytes per position / bandwidth`
      (K and V of every layer read once), the floor of an attention that reads the cache once.
    """

    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import time_verify_padded
    from das_jax.models.kv_cache import DenseKVCache

    out = {}
    kv_len = engine_kv_len(prompt_len, 8)
    t_packed = engine.time_verify_step(16, 8, kv_len, kv_len + 16, repeats, (0.0, 0, 1.0),
                                       num_tokens=24)
    t_padded = time_verify_padded(engine, 16, 8, kv_len, kv_len + 16, repeats, (0.0, 0, 1.0))
    out["ragged_step_s"] = {"packed_N24": t_packed, "padded_16x8": t_padded}
    print(f"ragged step B=16 (one row drafts 7): packed N=24 {t_packed * 1e3:.1f} ms, padded "
          f"16x8 {t_padded * 1e3:.1f} ms ({t_padded / t_packed:.2f}x)", flush=True)
    out["split_block_s"] = split_block_terms(engine, repeats)
    lo, hi = 128, 1024
    t_lo = engine.time_verify_step(16, 1, lo, hi + 16, repeats, (0.0, 0, 1.0))
    t_hi = engine.time_verify_step(16, 1, hi, hi + 16, repeats, (0.0, 0, 1.0))
    per_pos = max(t_hi - t_lo, 0.0) / (16 * (hi - lo))
    nbytes = DenseKVCache.bytes_per_position(config, params["embed"].dtype)
    floor = nbytes / bandwidth
    out["kv_term"] = {"step_s_kv128": t_lo, "step_s_kv1024": t_hi, "s_per_position_row": per_pos,
                      "bytes_per_position": nbytes, "floor_s_per_position_row": floor,
                      "ratio_to_floor": per_pos / floor}
    print(f"KV term (B=16 W=1, kv 128 -> 1024): {t_lo * 1e3:.1f} -> {t_hi * 1e3:.1f} ms = "
          f"{per_pos * 1e6:.2f} us per cached position-row; {nbytes / 1e3:.1f} KB / "
          f"{bandwidth / 1e9:.1f} GB/s = {floor * 1e6:.2f} us ({per_pos / floor:.2f}x the floor)",
          flush=True)
    return out


SPLIT_KV = 768      # attended positions of the split query block's measurement (a long context)


def split_block_terms(engine, repeats: int, rounds: int = 3) -> dict:
    """The split query block against one block (`EngineConfig.wide_row_buckets`), printed and
    returned: the B = 16, W = 8 step at `SPLIT_KV` attended positions with one row drafting 7
    (N = 24) and two (N = 32), each as one `[16, 8]` block and split (`[16, 1]` + `[2, 8]`,
    R = 2), beside the step without drafts (N = 16, W = 1); rounds alternate the variants and
    each reports its median round (seconds)."""
    cases = {"plain_N16": (1, 16, 0), "one_block_N24": (8, 24, 0), "split_N24": (8, 24, 2),
             "one_block_N32": (8, 32, 0), "split_N32": (8, 32, 2)}
    runs: dict = {k: [] for k in cases}
    for _ in range(rounds):
        for k, (W, N, R) in cases.items():
            runs[k].append(engine.time_verify_step(16, W, SPLIT_KV, SPLIT_KV + 16, repeats,
                                                   (0.0, 0, 1.0), num_tokens=N, wide_rows=R))
    out = {k: float(np.median(v)) for k, v in runs.items()}
    print(f"split query block (B=16, W=8, {SPLIT_KV} cached positions; no drafts "
          f"{out['plain_N16'] * 1e3:.1f} ms): one row drafts 7: one block "
          f"{out['one_block_N24'] * 1e3:.1f} ms, split {out['split_N24'] * 1e3:.1f} ms "
          f"({out['split_N24'] / out['one_block_N24']:.2f}x); two rows: one block "
          f"{out['one_block_N32'] * 1e3:.1f} ms, split {out['split_N32'] * 1e3:.1f} ms "
          f"({out['split_N32'] / out['one_block_N32']:.2f}x)", flush=True)
    return out


def paged_vs_dense(config, params, eos_ids, prompts, max_new: int, repeats: int,
                   exact: bool = False, page_size: int = 16) -> dict:
    """The paged KV cache against the dense one, side by side (`--paged`), printed and returned.

    * The verify step at B = 16, W in {1, 8}, attending 128 and 1024 positions per row: median
      seconds of each (dense and paged timed alternately, `repeats` calls each) and paged / dense.
    * `Engine.generate` at B = 16 (greedy, plain decoding, `max_new` tokens): tok/s of each
      (median of 3 alternating rounds after a warm-up) and whether the tokens are identical.
    """

    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import Engine, EngineConfig, Request, SamplingParams

    engines = {kind: Engine(config, params, eos_token_ids=eos_ids,
                            engine_config=EngineConfig(max_slots=16, max_cache_len=2048,
                                                       draft_widths=(1, 8), exact=exact,
                                                       kv_cache=kind, page_size=page_size))
               for kind in ("dense", "paged")}
    out: dict = {"page_size": page_size, "step_s": {}, "generate": {}}
    for W in (1, 8):
        for kv in (128, 1024):
            t = {k: [] for k in engines}
            for _ in range(3):
                for k, e in engines.items():
                    t[k].append(e.time_verify_step(16, W, kv, 2048, repeats, (0.0, 0, 1.0)))
            med = {k: float(np.median(v)) for k, v in t.items()}
            out["step_s"][f"W{W}_kv{kv}"] = {**med, "paged_over_dense": med["paged"] /
                                             med["dense"]}
            print(f"verify step B=16 W={W} kv={kv:4d}: dense {med['dense'] * 1e3:6.1f} ms, "
                  f"paged {med['paged'] * 1e3:6.1f} ms ({med['paged'] / med['dense']:.2f}x)",
                  flush=True)
    reqs = [Request(tuple(p), problem_id=i) for i, p in enumerate(prompts[:16])]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    runs: dict = {k: [] for k in engines}
    tokens = {}
    for e in engines.values():
        e.generate(reqs, sampling)                      # warm-up (compiles)
    for _ in range(3):
        for k, e in engines.items():
            outs, st = e.generate(reqs, sampling)
            runs[k].append(st.generated_tokens / st.wall_s)
            tokens[k] = [o.token_ids for o in outs]
    med = {k: float(np.median(v)) for k, v in runs.items()}
    same = tokens["dense"] == tokens["paged"]
    out["generate"] = {"tok_s": med, "rounds_tok_s": runs, "identical_tokens": same,
                       "paged_over_dense": med["paged"] / med["dense"]}
    print(f"Engine.generate B=16: dense {med['dense']:.1f} tok/s, paged {med['paged']:.1f} "
          f"tok/s ({med['paged'] / med['dense']:.2f}x); identical tokens: {same}", flush=True)
    out["same_budget"] = same_budget(config, params, eos_ids, prompts, max_new, exact, page_size)
    return out


def same_budget(config, params, eos_ids, prompts, max_new: int, exact: bool = False,
                page_size: int = 16, rows: int = 4, max_cache_len: int = 1024) -> dict:
    """The dense and the paged cache under one KV budget (`rows` rows of `max_cache_len`
    positions), side by side: `Engine.generate` of the prompts (greedy, `max_new` tokens) with
    the dense cache (`rows` slots: what the budget holds) and the paged one (up to 4x the slots,
    admitted by free pages, preempted when short): mean live rows per step, preemptions, tok/s,
    identical tokens. Printed and returned."""

    # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp

    from das_jax.engine import Engine, EngineConfig, Request, SamplingParams
    from das_jax.models.kv_cache import DenseKVCache

    gb = DenseKVCache.nbytes_for(config, rows, max_cache_len, params["embed"].dtype) / 1e9
    reqs = [Request(tuple(p), problem_id=i) for i, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    out: dict = {"kv_memory_gb": gb, "max_cache_len": max_cache_len}
    tokens = {}
    for kind in ("dense", "paged"):     # dense: the budget lowers the slots to `rows`
        eng = Engine(config, params, eos_token_ids=eos_ids, dtype=jnp.dtype(params["embed"].dtype),
                     engine_config=EngineConfig(max_slots=4 * rows, max_cache_len=max_cache_len,
                                                draft_widths=(1,), exact=exact, kv_cache=kind,
                                                page_size=page_size, kv_memory_gb=gb))
        eng.generate(reqs[:2], SamplingParams(temperature=0.0, max_new_tokens=4))   # warm-up
        outs, st = eng.generate(reqs, sampling)
        live = float(np.mean([s.active for s in st.steps]))
        out[kind] = {"slots": eng.engine_config.max_slots, "mean_live_rows": live,
                     "preemptions": st.preemptions, "tok_s": st.generated_tokens / st.wall_s,
                     "wall_s": st.wall_s, "compile_s": st.compile_s}
        tokens[kind] = [o.token_ids for o in outs]
        print(f"same KV budget ({gb:.3f} GB = {rows} rows of {max_cache_len}), {kind}: "
              f"{out[kind]['slots']} slots, {live:.1f} live rows per step, "
              f"{st.preemptions} preemptions, {out[kind]['tok_s']:.1f} tok/s "
              f"(compile {st.compile_s:.0f} s excluded)", flush=True)
    out["identical_tokens"] = tokens["dense"] == tokens["paged"]
    out["live_rows_ratio"] = out["paged"]["mean_live_rows"] / out["dense"]["mean_live_rows"]
    print(f"paged / dense at the same budget: {out['live_rows_ratio']:.2f}x live rows, "
          f"{out['paged']['tok_s'] / out['dense']['tok_s']:.2f}x tok/s; identical tokens: "
          f"{out['identical_tokens']}", flush=True)
    return out


def engine_kv_len(prompt_len: int, width: int) -> int:
    return pow2_at_least(prompt_len + width, 128)


def hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int, eos_ids) -> tuple:
    # deferred import: torch (not loaded by importing this module)
    import torch
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(eos_ids), pad_token_id=pad_id)
    dt = time.perf_counter() - t0
    gen = out[:, L:].tolist()
    n = 0
    toks = []
    for row in gen:
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        n += cut
        toks.append(row[:cut])
    return n, dt, toks


def _hf_model(args: argparse.Namespace):
    """The transformers model of `args.model` (float32, `args.threads` torch threads) for the HF
    comparison; None (printed) when torch / transformers are not installed."""
    model = None
    try:
        # deferred import: torch, transformers (not loaded by importing this module)
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"HF comparison skipped: {e}", flush=True)
    else:
        # deferred import: jax (not loaded by importing this module)
        from das_jax.models.loading import resolve_source
        kind, path = resolve_source(args.model)
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        if kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        print(f"HF model loaded in {time.perf_counter() - t0:.1f}s "
              f"(torch threads {torch.get_num_threads()})", flush=True)
    return model


def summary_table(res: dict) -> str:
    """The markdown table of a `main` result (its verify steps, end-to-end rates, HF ratios,
    ragged step, KV term and floor); adds the ratios it computes to `res`."""
    steps, e2e, hf = res["step_s"], res["engine_generate"], res.get("hf_generate")
    bw = res["bandwidth_Bps"]
    f1 = steps["B1_W1"] / res["floor_s"]
    w_ratio = steps["B1_W8"] / steps["B1_W1"]
    rows = ["| metric | value | target | met |", "|---|---|---|---|"]
    for B in (1, 16):
        rows.append(f"| verify step B={B} W=1 | {steps[f'B{B}_W1'] * 1e3:.1f} ms "
                    f"({B / steps[f'B{B}_W1']:.1f} tok/s) | | |")
        rows.append(f"| verify step B={B} W=8 | {steps[f'B{B}_W8'] * 1e3:.1f} ms | | |")
    for B in (1, 16):
        rows.append(f"| Engine.generate B={B} | {e2e[B]['tok_s']:.1f} tok/s | | |")
        if hf:
            r = e2e[B]["tok_s"] / hf[B]["tok_s"]
            res[f"ratio_vs_hf_B{B}"] = r
            rows.append(f"| HF generate B={B} | {hf[B]['tok_s']:.1f} tok/s | | |")
            rows.append(f"| das-jax / HF at B={B} | {r:.2f}x | >= 2x | {'yes' if r >= 2 else 'no'} |")
    rs = res["ragged_step_s"]
    rows.append(f"| ragged step B=16 (1 row drafts 7): packed N=24 / padded 16x8 | "
                f"{rs['packed_N24'] * 1e3:.1f} / {rs['padded_16x8'] * 1e3:.1f} ms | | |")
    sb = res["split_block_s"]
    rows.append(f"| split query block B=16 W=8 at {SPLIT_KV} positions, 1 / 2 rows draft 7: "
                f"split / one block | {sb['split_N24'] / sb['one_block_N24']:.2f}x / "
                f"{sb['split_N32'] / sb['one_block_N32']:.2f}x | | |")
    kt = res["kv_term"]
    rows.append(f"| KV term per cached position-row | {kt['s_per_position_row'] * 1e6:.2f} us "
                f"({kt['ratio_to_floor']:.2f}x bytes/bandwidth) | <= 1.5x | "
                f"{'yes' if kt['ratio_to_floor'] <= 1.5 else 'no'} |")
    rows.append(f"| memory bandwidth | {bw / 1e9:.1f} GB/s | | |")
    rows.append(f"| floor = param bytes / bandwidth | {res['floor_s'] * 1e3:.1f} ms | | |")
    rows.append(f"| B=1 W=1 step / floor | {f1:.2f}x | <= 1.5x | {'yes' if f1 <= 1.5 else 'no'} |")
    rows.append(f"| W=8 / W=1 step at B=1 | {w_ratio:.2f}x | <= 1.5x | "
                f"{'yes' if w_ratio <= 1.5 else 'no'} |")
    res["floor_ratio"] = f1
    res["w8_w1_ratio_B1"] = w_ratio
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    # deferred import: jax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    from das_jax.engine import Engine, EngineConfig, Request, SamplingParams
    from das_jax.models import load, params_size

    texts = prompt_texts(args.prompts, 16)      # a bad --prompts fails before the model loads
    quick = args.quick
    max_new = args.max_new_tokens or (16 if quick else 64)
    repeats = 3 if quick else 10
    res: dict = {"model": args.model, "max_new_tokens": max_new, "prompt_len": args.prompt_len,
                 "jax": jax.__version__, "backend": jax.default_backend()}
    t0 = time.perf_counter()
    config, params, tokenizer = load(args.model, dtype=jnp.float32)
    n_params, n_bytes = params_size(params)
    res.update(params=n_params, param_bytes=n_bytes, load_s=time.perf_counter() - t0)
    print(f"{args.model}: {n_params / 1e6:.1f}M params, {n_bytes / 1e6:.0f} MB float32 "
          f"(loaded in {res['load_s']:.1f}s)", flush=True)

    bw = memory_bandwidth(1 << 28 if quick else 1 << 30)
    res["bandwidth_Bps"] = bw
    res["floor_s"] = n_bytes / bw
    print(f"memory bandwidth (numpy copy, read+write): {bw / 1e9:.1f} GB/s -> step floor "
          f"{res['floor_s'] * 1e3:.1f} ms", flush=True)

    engine = Engine(config, params, eos_token_ids=tokenizer.eos_token_ids,
                    engine_config=EngineConfig(max_slots=16, max_cache_len=2048,
                                               draft_widths=(1, 8), exact=args.exact))
    steps = {}
    for B in (1, 16):
        for W in (1, 8):
            s = time_verify(engine, B, W, args.prompt_len, repeats)
            steps[f"B{B}_W{W}"] = s
            print(f"verify step B={B:2d} W={W}: {s * 1e3:7.1f} ms  ({B / s:7.1f} tok/s at W=1 "
                  f"rate, {B * W / s:7.1f} verified tok/s)", flush=True)
    res["step_s"] = steps
    res.update(packed_and_kv_terms(engine, config, params, bw, args.prompt_len, repeats))

    prompts = _prompts(tokenizer, texts, 16, args.prompt_len)
    if getattr(args, "paged", False):
        res["paged_vs_dense"] = paged_vs_dense(config, params, tokenizer.eos_token_ids, prompts,
                                               max_new, repeats, exact=args.exact)
    res["prompt_lens"] = [len(p) for p in prompts]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new)

    def das_generate(B):
        reqs = [Request(tuple(p), problem_id=i) for i, p in enumerate(prompts[:B])]
        outs, st = engine.generate(reqs, sampling)
        return st.generated_tokens, st.wall_s, [o.token_ids for o in outs]

    model = None if args.no_hf else _hf_model(args)
    eos = set(tokenizer.eos_token_ids)

    def hf_run(B):
        return hf_generate(model, prompts[:B], max_new, tokenizer.pad_token_id, eos)

    # Rounds alternate das-jax and HF so that drift in the machine's speed (co-tenants on a
    # shared host) hits both alike; each side reports the median round.
    rounds = 1 if quick else 3
    e2e, hf, outs_das = {}, ({} if model is not None else None), {}
    for B in (1, 16):
        das_generate(B)                                   # warm-up (compiles)
        if model is not None:
            hf_run(min(B, 2))                             # warm-up
        das_runs, hf_runs = [], []
        for _ in range(rounds):
            das_runs.append(das_generate(B))
            if model is not None:
                hf_runs.append(hf_run(B))
        n, dt, toks = sorted(das_runs, key=lambda r: r[0] / r[1])[len(das_runs) // 2]
        e2e[B] = {"tokens": n, "wall_s": dt, "tok_s": n / dt,
                  "rounds_tok_s": [r[0] / r[1] for r in das_runs]}
        outs_das[B] = toks
        print(f"Engine.generate B={B:2d}: {n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s "
              f"(median of {rounds})", flush=True)
        if model is not None:
            n, dt, htoks = sorted(hf_runs, key=lambda r: r[0] / r[1])[len(hf_runs) // 2]
            same = float(np.mean([a == b for a, b in zip(htoks, outs_das[B])]))
            hf[B] = {"tokens": n, "wall_s": dt, "tok_s": n / dt, "same_tokens_rate": same,
                     "rounds_tok_s": [r[0] / r[1] for r in hf_runs]}
            print(f"HF generate B={B:2d}: {n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s "
                  f"(identical greedy outputs: {same:.0%})", flush=True)
    res["engine_generate"] = e2e
    if hf is not None:
        res["hf_generate"] = hf

    table = summary_table(res)
    res["table"] = table
    print()
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0
