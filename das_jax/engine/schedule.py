"""Static shapes and row bookkeeping of continuous batching, shared by `Engine.generate` and the
trace-replay simulator (`das_jax.bench.replay`), so both take the same scheduling decisions.

Every shape the engine compiles comes from a bucket: batch buckets (powers of two up to
`max_slots`), prompt-length and attended-length buckets (powers of two above a floor), and one
cache length per `generate` call. Pure host code (numpy only).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

KV_LEN_FLOOR = 128   # smallest attended-length (and cache-length) bucket


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest of the ascending `buckets` that holds `n` (the largest when none does)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest `floor * 2**k` (k >= 0) that is >= n."""
    b = floor
    while b < n:
        b *= 2
    return b


def cache_len_for(max_cache_len: int, draft_widths: Sequence[int], max_prompt: int,
                  max_new_tokens: int) -> int:
    """Cache positions per row: a power of two >= 128 that holds the longest prompt +
    max_new_tokens + the widest compiled draft width, capped at max_cache_len (never below
    what is needed; `Engine.validate` rejects requests that need more than max_cache_len)."""
    need = max_prompt + max_new_tokens + max(draft_widths)
    return max(min(pow2_at_least(need, KV_LEN_FLOOR), max_cache_len), need)


def kv_len_bucket(cache_len_live: np.ndarray, cache_len: int) -> int:
    """The attended length of a verify step: the longest live row's cache length, bucketed."""
    return min(pow2_at_least(int(cache_len_live.max()), KV_LEN_FLOOR), cache_len)


def tail_bucket(num_live: int, batch: int, batch_buckets: Sequence[int],
                queue_empty: bool) -> int | None:
    """The smaller batch bucket the live rows are compacted into (once no request is queued and
    they fit one), or None to keep the current batch."""
    if not queue_empty:
        return None
    nb = bucket(num_live, batch_buckets)
    return nb if nb < batch else None


def compact_rows(live, nb: int, *arrays_and_fills):
    """Row state of the live rows packed into a bucket of `nb` rows (padding rows get the fill).

    `arrays_and_fills` alternates host arrays `[B]` and their padding value; returns the new
    arrays in order.
    """
    out = []
    for arr, fill in zip(arrays_and_fills[::2], arrays_and_fills[1::2]):
        out.append(np.concatenate([arr[live], np.full(nb - len(live), fill, arr.dtype)]))
    return out
