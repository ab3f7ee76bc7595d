"""Calibrated acceptance of drafts, over all rows of a step at once (the DAS policy's item 4).

A suffix-trie draft says for each token its path probability P_i (the chance that its first
i + 1 tokens are all accepted, from count ratios) and its support (past occurrences the estimate
rests on, `das_jax.drafter.Draft.support`). A count ratio of a token seen once is 1 whatever
the model does next, so raw path probabilities are overconfident at small supports. The
calibrated chance q_b,d that row b's first d + 1 draft tokens are accepted is

* with support: prod_{i <= d} clip(P_i / P_{i-1} * g[age_b, bucket(support_i)], 0, 1), g one factor
  per support bucket (1, 2-3, 4-7, 8-15, 16-31, 32+; starting at c / (c + 1), `support_prior`)
  and per age bucket of the history the row drafts from (`age_bucket`: under 1, 1, 2-3, 4-7,
  8-15, 16+ policy versions; a row without an age counts as fresh, bucket 0);
* without: clip(P_d * s_d, 0, 1) made nonincreasing along d, s_d one factor per depth.

Both factor sets are exponential moving averages of accepted over predicted tokens
(`update_support_scale`, `update_depth_scale`). Calibrating per age is what weighs a history by
its age: in RL the policy moves with every update, so the continuations its older rollouts hold
grow less likely and their drafts are accepted less; the factors of an older bucket learn that
from its own trials, starting from the nearest younger bucket's factors when first seen
(`DASPolicy`). Every function takes `[A, K]` arrays of the A live rows (`DraftBatch` layout);
the per-row loops are compiled (`_budget_kernels`).
"""
from __future__ import annotations

import numpy as np


SUPPORT_BUCKETS = 6         # support buckets 1, 2-3, 4-7, 8-15, 16-31, 32+ occurrences
SCALE_RANGE = (0.02, 4.0)   # bounds of every calibration factor
AGE_BUCKETS = 6             # history ages < 1, 1, 2-3, 4-7, 8-15, 16+ policy versions
AGE_BUCKET_LABELS = ("<1", "1", "2-3", "4-7", "8-15", "16+")


def age_bucket(age) -> np.ndarray:
    """int64 `[...]`: the calibration bucket of each history age (float, policy versions;
    `DraftBatch.age_A`): 0 below 1 (negative ages included), else floor(log2(age)) + 1 capped
    at AGE_BUCKETS - 1; -1 for NaN (no age known)."""
    a = np.asarray(age, np.float64)
    known = ~np.isnan(a)
    safe = np.where(known & (a >= 1.0), a, 1.0)
    b = np.where(a >= 1.0, np.frexp(safe)[1].astype(np.int64), 0)   # frexp: floor(log2) + 1
    return np.where(known, np.minimum(b, AGE_BUCKETS - 1), -1).astype(np.int64)


def age_buckets_of(age_A, rows: int) -> np.ndarray:
    """int64 `[rows]`: `age_bucket` of a `DraftBatch.age_A` (None: -1 for every row)."""
    if age_A is None:
        return np.full(rows, -1, np.int64)
    return age_bucket(age_A)


def support_bucket(support) -> np.ndarray:
    """int64 `[...]`: the calibration bucket of each token's support (past occurrences):
    floor(log2(support)) capped at SUPPORT_BUCKETS - 1 (support < 1 counts as 1)."""
    s = np.maximum(np.asarray(support, np.int64), 1)
    # floor(log2(s)) exactly for integers: the bit length less one
    return np.minimum(np.frexp(s.astype(np.float64))[1].astype(np.int64) - 1,
                      SUPPORT_BUCKETS - 1)


def support_prior() -> np.ndarray:
    """float64 `[SUPPORT_BUCKETS]`: the starting calibration factors, c / (c + 1) at each
    bucket's smallest support c (1/2 for a continuation seen once; Witten-Bell's escape estimate
    for a context with one continuation seen c times). Online calibration moves them."""
    c = 2.0 ** np.arange(SUPPORT_BUCKETS)
    return c / (c + 1.0)


def step_ratios(probs: np.ndarray) -> np.ndarray:
    """float64, the shape of `probs` (`[k]` or `[A, k]`): a path probability's per-token
    factors P_i / P_{i-1} along the last axis (P_{-1} = 1; a zero prefix gives 0)."""
    p = np.asarray(probs, np.float64)
    prev = np.concatenate([np.ones(p.shape[:-1] + (1,)), p[..., :-1]], axis=-1)
    return np.divide(p, prev, out=np.zeros_like(p), where=prev > 0)


def grow_depth_scale(depth_scale: np.ndarray, depth: int) -> np.ndarray:
    """The per-depth factors extended to `depth` entries (new depths start at the deepest
    known factor, 1.0 before any)."""
    if len(depth_scale) >= depth:
        return depth_scale
    fill = depth_scale[-1] if len(depth_scale) else 1.0
    return np.concatenate([depth_scale, np.full(depth - len(depth_scale), fill)])


def _as_table(support_scale: np.ndarray) -> np.ndarray:
    """`support_scale` as float64 `[age buckets, SUPPORT_BUCKETS]` (a 1-D `[SUPPORT_BUCKETS]`
    is one row: every age alike). A view where possible, so updates land in place."""
    g = np.asarray(support_scale, np.float64)
    return g.reshape(1, -1) if g.ndim == 1 else g


def _age_rows(age_bucket_A, rows: int, table: np.ndarray) -> np.ndarray:
    """int64 `[rows]` the row of `table` each draft row uses: its age bucket (None or -1: 0),
    0 for every row of a one-row table."""
    if age_bucket_A is None or table.shape[0] == 1:
        return np.zeros(rows, np.int64)
    return np.maximum(np.asarray(age_bucket_A, np.int64), 0)


def calibrated_paths(probs_AxK: np.ndarray, lens_A: np.ndarray, support_AxK: np.ndarray,
                     has_support_A: np.ndarray, depth_scale, support_scale: np.ndarray,
                     age_bucket_A: np.ndarray | None = None,
                     depth_row_A: np.ndarray | None = None) -> np.ndarray:
    """float64 `[A, D]` (D = max(lens_A)): q_b,d, the calibrated chance that row b's first
    d + 1 draft tokens are accepted (module docstring; 0 past a row's draft, nonincreasing
    along d). depth_scale: float64 `[>= 1]` (every row's), or a sequence of R such vectors (one
    per draft source) with depth_row_A int64 `[A]` naming each row's; support_scale: float64
    `[SUPPORT_BUCKETS]` or `[table rows, SUPPORT_BUCKETS]` (one per age bucket, or per source
    and age); age_bucket_A: int64 `[A]` each row's table row (`age_bucket`; None or -1: row 0).
    One compiled pass over the rows (`_budget_kernels.calibrate`)."""
    from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
    return _bk.calibrate(*calibration_args(probs_AxK, lens_A, support_AxK, has_support_A,
                                           depth_scale, support_scale, age_bucket_A,
                                           depth_row_A))


def calibration_args(probs_AxK: np.ndarray, lens_A: np.ndarray, support_AxK: np.ndarray,
                     has_support_A: np.ndarray, depth_scale, support_scale: np.ndarray,
                     age_bucket_A: np.ndarray | None = None,
                     depth_row_A: np.ndarray | None = None) -> tuple:
    """`calibrated_paths`'s arguments as its kernel takes them (`_budget_kernels.calibrate`,
    and the policy's compiled choice, `_budget_kernels.choice_table`, which starts with it)."""
    lens_A = np.asarray(lens_A, np.int64)
    table = _as_table(support_scale)
    D = max(int(lens_A.max(initial=0)), 1)
    if depth_row_A is None:
        depth_scale, depth_row_A = [depth_scale], np.zeros(lens_A.shape[0], np.int64)
    depth_RxD = np.stack([grow_depth_scale(np.asarray(d, np.float64), D)[:D]
                          for d in depth_scale])
    return (np.asarray(probs_AxK, np.float64), lens_A, np.asarray(support_AxK, np.int64),
            np.asarray(has_support_A, bool), depth_RxD, np.asarray(depth_row_A, np.int64),
            table, _age_rows(age_bucket_A, lens_A.shape[0], table))


def update_support_scale(support_scale: np.ndarray, n_A: np.ndarray, accepted_A: np.ndarray,
                         probs_AxK: np.ndarray, support_AxK: np.ndarray, rows_A: np.ndarray,
                         ema: float, age_bucket_A: np.ndarray | None = None) -> np.ndarray:
    """Moves the support-bucket factors (in place) toward what one step measured.

    Each token a row verified after an accepted prefix (the first min(accepted + 1, n) of its
    n drafted tokens) is one trial of its own ratio P_i / P_{i-1}: per (age, support) bucket,
    the factor's EMA (weight `ema`) moves toward accepted trials / predicted ones. rows_A: bool
    `[A]`, the rows that count (drafted, with support); accepted_A: committed accepted draft
    tokens per row; support_scale and age_bucket_A as in `calibrated_paths`. Returns bool
    `[age buckets]`: the age rows that had trials."""
    from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
    g = _as_table(support_scale)
    n_A = np.asarray(n_A, np.int64)
    expected, accepted = _bk.support_trials(
        n_A, np.asarray(accepted_A, np.int64),
        np.asarray(probs_AxK, np.float64), np.asarray(support_AxK, np.int64),
        np.asarray(rows_A, bool), _age_rows(age_bucket_A, n_A.shape[0], g), g.shape[0],
        g.shape[1])
    seen = expected > 0
    if seen.any():
        g[seen] = (1 - ema) * g[seen] + ema * accepted[seen] / expected[seen]
        np.clip(g, *SCALE_RANGE, out=g)
    return seen.any(axis=1)


def update_depth_scale(depth_scale: np.ndarray, n_A: np.ndarray,
                       accepted_A: np.ndarray | None, step_accepted: int,
                       probs_AxK: np.ndarray, ema: float) -> np.ndarray:
    """The per-depth factors after one step (drafts without support; rows with n_A[b] = 0 do
    not count): at depth d, the EMA moves toward rows that accepted >= d + 1 tokens over the
    predicted chance summed over rows drafting >= d + 1 (accepted_A: committed accepted draft
    tokens per row); with only the step's total `step_accepted` known (accepted_A None), every
    depth moves toward it over the total predicted. Returns the (grown) factors."""
    from das_jax.speculation import _budget_kernels as _bk   # deferred import: numba
    n_A = np.asarray(n_A, np.int64)
    D = int(n_A.max(initial=0))
    if D == 0:
        return depth_scale
    scale = grow_depth_scale(depth_scale, D)
    acc_A = (np.zeros(0, np.int64) if accepted_A is None
             else np.asarray(accepted_A, np.int64))
    expected, accepted = _bk.depth_trials(n_A, acc_A, np.asarray(probs_AxK, np.float64), D)
    part = scale[:D]
    if accepted_A is not None:
        seen = expected > 0
        ratio = np.where(seen, accepted / np.maximum(expected, 1e-12), 1.0)
        part[seen] = (1 - ema) * part[seen] + ema * ratio[seen]
    else:
        ratio = step_accepted / max(float(expected.sum()), 1e-12)
        part[:] = (1 - ema) * part + ema * ratio
    np.clip(part, *SCALE_RANGE, out=part)
    return scale
