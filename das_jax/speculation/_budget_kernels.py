"""Numba kernels of the DAS policy's per-step work over all live rows (internal; the API is
`acceptance.calibrated_paths`, `acceptance.update_support_scale`,
`acceptance.update_depth_scale` and `DASPolicy.choose`).

A step's policy work is a few passes over `[A, D]` arrays (A live rows, D <= 15 draft depths);
as numpy it is ~40 small array operations, each paying numpy's call overhead (~1 ms a step
whatever A), which at GPU step times is what the device waits for when a step holds few rows.
Here each is one compiled loop. The arithmetic is the numpy formulation's, in the same order
(cumulative products and sums run left to right as numpy's do), so the choices are the same;
`tests/test_budget_kernels.py` checks them against that formulation on random inputs. Every
kernel is plain Python when numba's JIT is disabled (`NUMBA_DISABLE_JIT=1`).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from das_jax.engine._shape_kernels import shape_columns

_jit = njit(cache=True, nogil=True)


@_jit
def _bucket(support, buckets):
    """floor(log2(max(support, 1))) capped at buckets - 1 (`acceptance.support_bucket`)."""
    s = max(support, 1)
    b = 0
    while s > 1 and b < buckets - 1:
        s >>= 1
        b += 1
    return b


@_jit
def calibrate(probs_AxK, lens_A, support_AxK, has_support_A, depth_RxD, depth_row_A, scale_JxS,
              age_bucket_A):
    """float64 `[A, D]`, D = max(lens_A): q_b,d (`acceptance.calibrated_paths`). probs_AxK
    float64, lens_A int64, support_AxK int64, has_support_A bool, depth_RxD float64 `[R, >= D]`
    (one row of per-depth factors per draft source) and depth_row_A int64 `[A]` (each row's),
    scale_JxS float64 `[table rows, support buckets]` (one factor per history age, or source
    and age, and support bucket), age_bucket_A int64 `[A]` (the row's table row; -1: 0)."""
    A = lens_A.shape[0]
    nb = scale_JxS.shape[1]
    D = 0
    for b in range(A):
        D = max(D, lens_A[b])
    q = np.zeros((A, D))
    for b in range(A):
        n = lens_A[b]
        if has_support_A[b]:
            j = max(age_bucket_A[b], 0)
            prev = 1.0
            acc = 1.0
            for d in range(n):
                p = probs_AxK[b, d]
                r = p / prev if prev > 0 else 0.0
                x = min(max(r * scale_JxS[j, _bucket(support_AxK[b, d], nb)], 0.0), 1.0)
                acc *= x
                q[b, d] = acc
                prev = p
        else:
            run = np.inf
            r = depth_row_A[b]
            for d in range(n):
                x = min(max(probs_AxK[b, d] * depth_RxD[r, d], 0.0), 1.0)
                run = min(run, x)
                q[b, d] = run
    return q


@_jit
def prefix_sums(q_AxD):
    """float64 `[A, D + 1]`: [0, cumsum(q_b)] per row (Q_b(n), the expected accepted tokens of
    a draft of n)."""
    A, D = q_AxD.shape
    cum = np.zeros((A, D + 1))
    for b in range(A):
        s = 0.0
        for d in range(D):
            s += q_AxD[b, d]
            cum[b, d + 1] = s
    return cum


@_jit
def token_values(f_A, c_tok, cum_AxD1, lens_A):
    """(lambda_A float64, n_A int32): `DASPolicy.token_values` (the first n on ties)."""
    A = f_A.shape[0]
    D1 = cum_AxD1.shape[1]
    lam = np.empty(A)
    n_opt = np.zeros(A, np.int32)
    for b in range(A):
        best = np.inf
        arg = 0
        for n in range(min(lens_A[b], D1 - 1) + 1):
            g = (f_A[b] + c_tok * n) / (1.0 + cum_AxD1[b, n])
            if g < best:
                best = g
                arg = n
        lam[b] = best
        n_opt[b] = arg
    return lam, n_opt


@_jit
def _distinct_positives_descending(value_AxD):
    """float64 `[m]`: the distinct positive entries of value_AxD, largest first. A positive
    float64's bits order as an int64 does, so they are sorted by an LSD radix sort (11-bit
    digits, a pass skipped where every key has the same digit): ~3x faster than a comparison
    sort at a step's few thousand values."""
    A, D = value_AxD.shape
    buf = np.empty(A * D)
    m = 0
    for b in range(A):
        for d in range(D):
            x = value_AxD[b, d]
            if x > 0:
                buf[m] = x
                m += 1
    src = buf[:m].view(np.int64)
    tmp = np.empty(m, np.int64)
    count = np.zeros(2048, np.int64)
    for shift in range(0, 64, 11):
        count[:] = 0
        for i in range(m):
            count[(src[i] >> shift) & 2047] += 1
        if m == 0 or count[(src[0] >> shift) & 2047] == m:
            continue
        total = 0
        for digit in range(2047, -1, -1):      # largest digit first: descending, stable
            c = count[digit]
            count[digit] = total
            total += c
        for i in range(m):
            digit = (src[i] >> shift) & 2047
            tmp[count[digit]] = src[i]
            count[digit] += 1
        src, tmp = tmp, src
    out = src.view(np.float64)
    n = 0
    for i in range(m):
        if n == 0 or out[i] != out[n - 1]:
            out[n] = out[i]
            n += 1
    return out[:n]


@_jit
def candidates(lens_A, value_AxD, n_opt_A, max_cuts, with_opt):
    """int32 `[C, A]` (`DASPolicy.candidates`): the depth caps 0..D of all drafts, of n_opt_A
    (1..max n_opt, when with_opt) and up to max_cuts cut-offs of the marginal values
    value_AxD (distinct positive values, largest first, evenly subsampled)."""
    A, D = value_AxD.shape
    top = 0
    if with_opt:
        for b in range(A):
            top = max(top, n_opt_A[b])
    cuts = _distinct_positives_descending(value_AxD)
    if len(cuts) > max_cuts:
        idx = np.rint(np.linspace(0, len(cuts) - 1, max_cuts)).astype(np.int64)
        cuts = cuts[idx]
    C = D + 1 + top + len(cuts)
    out = np.empty((C, A), np.int32)
    for cap in range(D + 1):
        for b in range(A):
            out[cap, b] = min(lens_A[b], cap)
    for cap in range(1, top + 1):
        for b in range(A):
            out[D + cap, b] = min(n_opt_A[b], cap)
    for i in range(len(cuts)):
        for b in range(A):
            k = 0
            for d in range(D):
                if value_AxD[b, d] >= cuts[i]:
                    k += 1
            out[D + 1 + top + i, b] = min(k, lens_A[b])
    return out


@_jit
def expected_savings(n_CxA, lam_A, cum_AxD1):
    """Per choice (row c of n_CxA: a draft length per live row), in one pass: float64 `[C]`
    sum_b lam_b * (1 + Q_b(n_c,b)) (what `DASPolicy.objective` subtracts), and int64 `[C]`
    each: its draft tokens, its longest draft and the rows that draft (what its step shape
    follows from, `schedule.PackedStepShape.of_totals`)."""
    C, A = n_CxA.shape
    saved = np.zeros(C)
    sums = np.zeros(C, np.int64)
    longest = np.zeros(C, np.int64)
    drafting = np.zeros(C, np.int64)
    for c in range(C):
        s = 0.0
        k = 0
        top = 0
        rows = 0
        for b in range(A):
            n = n_CxA[c, b]
            s += lam_A[b] * (1.0 + cum_AxD1[b, n])
            k += n
            if n > 0:
                rows += 1
                top = max(top, n)
        saved[c] = s
        sums[c] = k
        longest[c] = top
        drafting[c] = rows
    return saved, sums, longest, drafting


@_jit
def distinct_rows(cols_KxC):
    """(int64 `[U]` the first index of each distinct column of cols_KxC, in order of first
    occurrence; int64 `[C]` each column's index among them): a step's few distinct shapes
    among its candidate choices (C ~ 50, U ~ 10: a scan, no sort)."""
    K, C = cols_KxC.shape
    first = np.empty(C, np.int64)
    inv = np.empty(C, np.int64)
    n = 0
    for i in range(C):
        j = 0
        while j < n:
            f = first[j]
            same = True
            for r in range(K):
                if cols_KxC[r, f] != cols_KxC[r, i]:
                    same = False
                    break
            if same:
                break
            j += 1
        if j == n:
            first[n] = i
            n += 1
        inv[i] = j
    return first[:n], inv


@_jit
def choice_table(probs_AxK, lens_A, support_AxK, has_support_A, depth_RxD, depth_row_A,
                 scale_JxS, age_bucket_A, f_A, c_tok, max_cuts, buckets, widths, wide_buckets,
                 batch, attended):
    """`DASPolicy.choose`'s arrays in one compiled pass: `calibrate` (the first eight
    arguments), `prefix_sums`, `token_values` (f_A float64 `[A]`, c_tok), `candidates` of the
    values lambda_b * q_b,d (with each row's best length, up to max_cuts cut-offs),
    `expected_savings` and, with buckets (`schedule.PackedStepShape.kernel_args`, the last
    five arguments; empty buckets: skipped), each choice's step shape
    (`_shape_kernels.shape_columns`) and the distinct ones (`distinct_rows`). Returns
    (q float64 `[A, D]`, cum float64 `[A, D + 1]`, lambda float64 `[A]`, n_CxA int32,
    saved_C float64, drafted_C int64, cols int64 `[4, C]` (`[4, 0]` without buckets), first
    int64 `[U]`, inv int64 `[C]`)."""
    q = calibrate(probs_AxK, lens_A, support_AxK, has_support_A, depth_RxD, depth_row_A,
                  scale_JxS, age_bucket_A)
    cum = prefix_sums(q)
    lam, n_opt = token_values(f_A, c_tok, cum, lens_A)
    A, D = q.shape
    value = np.empty((A, D))
    for b in range(A):
        for d in range(D):
            value[b, d] = lam[b] * q[b, d]
    n_CxA = candidates(lens_A, value, n_opt, max_cuts, True)
    saved, drafted, longest, drafting = expected_savings(n_CxA, lam, cum)
    if buckets.shape[0] == 0:
        cols = np.zeros((4, 0), np.int64)
        return q, cum, lam, n_CxA, saved, drafted, cols, np.zeros(0, np.int64), \
            np.zeros(0, np.int64)
    cols = shape_columns(A, drafted, longest, drafting, buckets, widths, wide_buckets, batch,
                         attended)
    first, inv = distinct_rows(cols)
    return q, cum, lam, n_CxA, saved, drafted, cols, first, inv


@_jit
def support_trials(n_A, accepted_A, probs_AxK, support_AxK, rows_A, age_bucket_A, ages, buckets):
    """(expected, accepted) float64 `[ages, buckets]` of one step
    (`acceptance.update_support_scale`): per (history age bucket, support bucket), the
    predicted ratios P_i / P_{i-1} and the accepted ones among the tokens each counted row
    verified after an accepted prefix (age_bucket_A int64 `[A]`; -1: bucket 0)."""
    expected = np.zeros((ages, buckets))
    accepted = np.zeros((ages, buckets))
    for b in range(n_A.shape[0]):
        if not rows_A[b]:
            continue
        j = max(age_bucket_A[b], 0)
        n = n_A[b]
        acc = min(accepted_A[b], n)
        prev = 1.0
        for i in range(min(acc + 1, n)):
            p = probs_AxK[b, i]
            r = p / prev if prev > 0 else 0.0
            prev = p
            k = _bucket(support_AxK[b, i], buckets)
            expected[j, k] += r
            if i < acc:
                accepted[j, k] += 1.0
    return expected, accepted


@_jit
def depth_trials(n_A, accepted_A, probs_AxK, D):
    """(expected, accepted) float64 `[D]` of one step (`acceptance.update_depth_scale`): at
    depth d, the predicted path probabilities summed over rows drafting > d, and the rows whose
    committed accepted tokens (capped at n_A) reach d + 1 (accepted_A int64; empty: not known,
    accepted left 0)."""
    expected = np.zeros(D)
    accepted = np.zeros(D)
    known = accepted_A.shape[0] == n_A.shape[0]
    for b in range(n_A.shape[0]):
        n = n_A[b]
        for d in range(min(n, D)):
            expected[d] += probs_AxK[b, d]
        if known:
            acc = min(accepted_A[b], n)
            for d in range(min(acc, D)):
                accepted[d] += 1.0
    return expected, accepted


@_jit
def row_classes(ids_A, generated_A, class_R, lo, hi, with_thresholds, record):
    """int8 `[A]` (`DASPolicy.current_classes`): each row's class code, class_R[id] for a
    request id in range (unrecorded, -1, and out of range: medium, 1); with thresholds
    (lo, hi: tokens), a row whose generated length classes higher (long above hi, short at or
    below lo when lo < hi, else medium) is promoted, and with `record` a recorded one's
    class_R entry with it (in place)."""
    A = ids_A.shape[0]
    out = np.empty(A, np.int8)
    up = np.zeros(A, np.bool_)
    R = class_R.shape[0]
    for b in range(A):          # every row reads the classes before any is promoted
        r = ids_A[b]
        known = 0 <= r < R
        c = class_R[r] if known else 1
        if c < 0:
            c = 1
        if with_thresholds:
            n = float(generated_A[b])
            grown = 2 if n > hi else (0 if n <= lo and lo < hi else 1)
            if known and grown > c:
                c = grown
                up[b] = True
        out[b] = c
    if record:
        for b in range(A):
            if up[b]:
                class_R[ids_A[b]] = out[b]
    return out
