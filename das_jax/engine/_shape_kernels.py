"""Numba kernel of the packed verify step's shapes for many choices of drafts at once
(internal; the API is `schedule.PackedStepShape.of_totals`). The DAS policy's compiled choice
(`das_jax.speculation._budget_kernels.choice_table`) calls it inside its own pass. Plain Python
when numba's JIT is disabled (`NUMBA_DISABLE_JIT=1`)."""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _first_at_least(sorted_x, v):
    """The index of the first entry of ascending `sorted_x` >= v (len(sorted_x) if none):
    `np.searchsorted(sorted_x, v)`."""
    lo, hi = 0, sorted_x.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_x[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def shape_columns(rows, drafted_C, longest_C, drafting_C, buckets, widths, wide_buckets, batch,
                  attended):
    """int64 `[4, C]`: (num_tokens, attended_kv, width, wide_rows) of C choices of `rows` live
    rows, given per choice (int64 `[C]` each) its draft tokens, its longest draft and the rows
    that draft; buckets, widths, wide_buckets: int64, ascending (`PackedStepShape`'s)."""
    C = drafted_C.shape[0]
    out = np.zeros((4, C), np.int64)
    nb, nw, nr = buckets.shape[0], widths.shape[0], wide_buckets.shape[0]
    for c in range(C):
        out[0, c] = buckets[min(_first_at_least(buckets, max(rows + drafted_C[c], 1)), nb - 1)]
        out[1, c] = attended
        w = widths[min(_first_at_least(widths, 1 + longest_C[c]), nw - 1)]
        out[2, c] = w
        if nr:
            j = _first_at_least(wide_buckets, drafting_C[c])
            r = wide_buckets[min(j, nr - 1)]
            if j < nr and w > 1 and 2 * (batch + r * w) < batch * w:
                out[3, c] = r
    return out
