"""The outside reference of the rollout benchmark: HF transformers `generate` on the same prompts.

`load_hf_model(source)` loads the model the benchmark runs (a GGUF file through transformers'
GGUF loader, or an HF directory) as a float32 torch model on the CPU; `hf_rollout_tok_s` samples
the benchmark's requests with it in batches of the engine's slot count (left-padded, the same
temperature / top-p / top-k and max_new_tokens) and reports generated tokens per second, counting
each row's tokens up to and including its first stop token (what the engine counts).

torch and transformers are imported only here, inside the functions; without them
`HFUnavailable` says so in one line (the benchmark then runs without the reference).
"""
from __future__ import annotations

import os
import time
from typing import Sequence


class HFUnavailable(RuntimeError):
    """torch / transformers are missing or cannot load the model (one-line message)."""


def load_hf_model(source: str, threads: int = 2):
    """(torch model, load seconds) for a named source, GGUF file or HF directory (float32, eval).

    Raises:
      HFUnavailable: torch or transformers is not installed, or transformers cannot read the model.
    """
    os.environ.setdefault("TQDM_DISABLE", "1")   # transformers' GGUF loader uses tqdm directly
    try:
        # deferred import: torch, transformers (not loaded by importing this module)
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise HFUnavailable(f"HF reference skipped: {e} (pip install torch transformers)") from None
    # deferred import: jax, transformers (not loaded by importing this module)
    from transformers.utils import logging as hf_logging

    from das_jax.models.loading import resolve_source

    hf_logging.disable_progress_bar()      # no tqdm bars in the benchmark's log

    kind, path = resolve_source(source)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        if kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unreadable models
        raise HFUnavailable(f"HF reference skipped: transformers cannot load {source!r} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                            ) from None
    model.eval()
    return model, time.perf_counter() - t0


def count_until_stop(rows: Sequence[Sequence[int]], stop_ids) -> list[int]:
    """Per row, the tokens up to and including the first of `stop_ids` (the whole row if none)."""
    stop = set(int(t) for t in stop_ids)
    return [next((j + 1 for j, t in enumerate(row) if int(t) in stop), len(row)) for row in rows]


def hf_rollout_tok_s(model, prompts: Sequence[Sequence[int]], batch: int, max_new_tokens: int,
                     temperature: float, top_p: float, top_k: int, stop_ids, pad_id: int,
                     seed: int = 0, max_batches: int | None = None, log=None) -> dict:
    """Samples `prompts` with HF `generate` in batches of `batch` rows (left-padded).

    Returns {"batch", "batches", "rollouts", "tokens", "wall_s", "tok_s", "per_batch": [...]};
    tokens count each row up to and including its first stop token; wall_s is the sum of the
    `generate` calls (tokenisation-free: the prompts are ids). Greedy when temperature == 0.
    """
    # deferred import: torch (not loaded by importing this module)
    import torch

    torch.manual_seed(seed)
    stop = [int(t) for t in stop_ids]
    chunks = [list(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]
    if max_batches:
        chunks = chunks[:max_batches]
    per_batch = []
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, eos_token_id=stop,
              pad_token_id=pad_id)
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
    for bi, chunk in enumerate(chunks):
        L = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, L - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, L - len(p):] = 1
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
        n = sum(count_until_stop(out[:, L:].tolist(), stop))
        per_batch.append({"rows": len(chunk), "tokens": n, "wall_s": dt})
        if log:
            log(f"  HF generate batch {bi + 1}/{len(chunks)}: {len(chunk)} rows, {n} tokens in "
                f"{dt:.1f}s = {n / dt:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
    tokens = sum(b["tokens"] for b in per_batch)
    wall = sum(b["wall_s"] for b in per_batch)
    return {"batch": batch, "batches": len(chunks), "rollouts": sum(b["rows"] for b in per_batch),
            "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
            "per_batch": per_batch}
