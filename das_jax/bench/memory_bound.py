"""The fastest plain decoding any KV cache of a given memory allows, under a step-cost model.

A lower bound on the device time of plain decoding (`none`: one token per live row per step)
of a set of rollouts, for every schedule, slot count, page size and prompt sharing on a KV
cache that holds at most `pool_positions` positions, under the linear step cost
t = c_base + c_tok*N + c_kv*K (`CostModel.predict_step`; N token slots, K attended positions).

Rollout i has a prompt of P_i tokens and L_i generated tokens; its first token comes from
prefill (not priced here, as in the paper-scale replay), so it takes d_i = L_i - 1 decode steps.
At its k-th decode step (k = 1..d_i) the row attends P_i + k positions and holds k positions of
its own (its generated tokens: never shared, whatever happens to the prompt's pages). Then, over
the S steps of any schedule:

* N >= sum_i d_i and K >= sum_i (P_i d_i + d_i (d_i + 1) / 2): every decode step of every row
  runs once at least (padding, page rounding and recomputation only add);
* S >= max_i d_i;
* memory: at step s a row holds at most min(s, d_i) own positions (it has run at most s steps),
  and all rows together at most `pool_positions`; so with G(s) = sum_i min(s, d_i) the S steps
  hold at most sum_{s <= S} min(pool, G(s)) positions in total, which must reach the
  H = sum_i d_i (d_i + 1) / 2 the rollouts hold over their lifetimes. S_min is the smallest S
  meeting both.

Hence device time >= S_min c_base + N_min c_tok + K_min c_kv. The bound assumes a pool that is
full at every step once G(s) exceeds it (perfect packing, no preemption), so a real scheduler
lands above it; the gap is what scheduling can still win, and a target above the bound cannot
be met by any cache of that memory under that cost model.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def none_memory_bound(prompt_lens: Sequence[int], gen_lens: Sequence[int], pool_positions: int,
                      coef: dict) -> dict:
    """The lower bound above for one epoch's rollouts.

    Args:
      prompt_lens: P_i, prompt tokens per rollout (ints >= 0).
      gen_lens: L_i, generated tokens per rollout (ints >= 1; the first comes from prefill).
      pool_positions: KV positions the cache holds (> 0), e.g. pages x page size.
      coef: {"c_base" s, "c_tok" s per token slot, "c_kv" s per attended position}.

    Returns:
      {"passes": S_min, "token_slots": N_min, "attended": K_min, "base_s", "tok_s", "kv_s",
       "device_s"} (seconds under `coef`).

    Raises:
      ValueError: mismatched lengths, a rollout without tokens, or a pool of no positions.
    """
    p = np.asarray(prompt_lens, np.int64)
    d = np.asarray(gen_lens, np.int64) - 1
    if p.shape != d.shape or p.ndim != 1:
        raise ValueError(f"prompt_lens and gen_lens need one entry per rollout, got "
                         f"{p.shape} and {d.shape}")
    if len(d) and d.min() < 0:
        raise ValueError("every rollout needs at least one generated token")
    if pool_positions <= 0:
        raise ValueError(f"pool_positions must be > 0, got {pool_positions}")
    n_min = int(d.sum())
    held = int((d * (d + 1) // 2).sum())
    k_min = int((p * d).sum()) + held
    passes = int(d.max()) if len(d) else 0
    if held:
        # max d steps hold at most sum_{s <= max d} min(pool, G(s)), G(s) = sum_i min(s, d_i);
        # past max d every row is done (G = sum d_i > pool if the pool ever capped), so each
        # further step adds the pool
        d_sorted = np.sort(d)
        s = np.arange(1, passes + 1, dtype=np.int64)
        done = np.searchsorted(d_sorted, s, side="left")          # rows with d_i < s
        below = np.concatenate([[0], np.cumsum(d_sorted)])[done]  # their sum
        g = below + s * (len(d) - done)
        short = held - int(np.minimum(g, int(pool_positions)).sum())
        if short > 0:
            passes += -(-short // int(pool_positions))
    c_base, c_tok, c_kv = (float(coef["c_base"]), float(coef["c_tok"]),
                           float(coef.get("c_kv", 0.0)))
    out = {"passes": passes, "token_slots": n_min, "attended": k_min,
           "base_s": passes * c_base, "tok_s": n_min * c_tok, "kv_s": k_min * c_kv}
    out["device_s"] = out["base_s"] + out["tok_s"] + out["kv_s"]
    return out


def epoch_bounds(epochs: dict, pool_positions: int, coef: dict) -> list[dict]:
    """`none_memory_bound` of every epoch of `epochs` (epoch -> rollouts with `prompt_ids`
    and `token_ids`, e.g. `replay.TraceRollout`), each with its "epoch" added."""
    out = []
    for e, rolls in epochs.items():
        b = none_memory_bound([len(r.prompt_ids) for r in rolls],
                              [len(r.token_ids) for r in rolls], pool_positions, coef)
        b["epoch"] = e
        out.append(b)
    return out
