"""Numba kernels that draft and append for many requests in one call (internal; the API is
`SuffixDrafter.propose_batch` / `append_batch`).

Per-request state lives in per-slot arrays owned by `slots.RequestSlots` (a slot per active
request): `slot_root` int64 [S] (the trie the request drafts from, -1: none), `slot_sid` int64
[S] (its own live sequence in that trie, -1: not indexed), and its context (prompt + verified
tokens) at ctx_pool[ctx_start[s] : ctx_start[s] + ctx_len[s]] (int32 pool, int64 [S] starts,
lengths and capacities). The trie arrays are `SuffixForest`'s (see `_kernels`).

Row kernels loop over rows b in a range and read row b's slot slots_A[b]. `propose_rows` only
reads the forest, so disjoint row ranges may run on several threads at once (each call has its
own scratch); `append_rows` mutates it and must run alone.
"""
from __future__ import annotations

import numpy as np

from ._kernels import (COUNT, DEPTH, M_MAXD, S_LEN, S_SLOT, S_STATE, ST_LIVE, _jit,
                       _jit_inline, _match, _match_from, _self_count, _walk, append_tokens)

CHUNK = 256   # tokens per append_tokens call (as SuffixForest.append; bounds the room reserved)

# append_rows return codes (besides append_tokens' 1: nodes, 2: sequence tokens, 3: not live)
RC_DONE = 0
RC_CONTEXT = 4

# append_rows modes: bits of what it does (both: an append; CONTEXT then INDEX: the same, split)
INDEX = 1      # index the tokens into the request's live sequence (the trie)
CONTEXT = 2    # add them to its context and out_len


@_jit
def propose_rows(nodes, ht, seqs, toks, act, meta, slots_A, max_tokens_A, slot_root, slot_sid,
                 slot_lag, ctx_pool, ctx_start, ctx_len, min_prob, spec_factor, spec_offset,
                 min_match, lo, hi, tokens_AxK, probs_AxK, support_AxK, lens_A, source_A,
                 s_nodes, s_ht, s_seqs, s_toks, s_act, s_meta, slot_rroot, slot_rsid, g_nodes,
                 g_ht, g_seqs, g_toks, g_act, g_meta, g_root, g_below, r_below):
    """Drafts rows lo..hi-1: row b drafts up to max_tokens_A[b] tokens for the request in slot
    slots_A[b] from up to three tries, the best-scoring draft winning (ties: the earlier one):

    1. its problem's trie slot_root[s] in the forest (nodes, ...), its own sequence slot_sid[s]
       (`_kernels.propose` on the last max_depth - 1 tokens of its context, its own sequence's
       trailing occurrences left out; slot_lag[s]: context tokens not yet indexed into its own
       sequences, `append_rows` mode CONTEXT);
    2. its request trie slot_rroot[s] (-1: none) in the request forest (s_nodes, ...), own
       sequence slot_rsid[s] (the same lag), only for rows whose problem draft scores below
       r_below;
    3. the global trie g_root (-1: none) of the global forest (g_nodes, ...; it may be the
       request forest), no own sequence, only for rows whose best draft so far scores below
       g_below (a fallback).

    Writes tokens_AxK[b, :k] (int32), probs_AxK[b, :k] (float32), support_AxK[b, :k] (int32),
    lens_A[b] = k (int32) and source_A[b] (int8: 0, 1, 2 the scope above, -1 when k = 0);
    entries past k are left as they are (zeros from the caller).
    Rows with max_tokens <= 0 or an empty context get k = 0, and so does a scope without a
    trie. K >= max_tokens_A[b] for every row.
    """
    md = meta[M_MAXD]
    match_nodes = np.zeros(md + 1, np.int64)
    out_t = np.zeros(md, np.int32)
    out_p = np.zeros(md, np.float32)
    out_c = np.zeros(md, np.int32)
    tmp_t = np.zeros(md, np.int32)
    tmp_p = np.zeros(md, np.float32)
    tmp_c = np.zeros(md, np.int32)
    for b in range(lo, hi):
        lens_A[b] = 0
        source_A[b] = -1
        kmax = max_tokens_A[b]
        s = slots_A[b]
        n = ctx_len[s]
        if kmax <= 0 or n <= 0:
            continue
        tail = n
        if tail > md - 1:
            tail = md - 1
        end = ctx_start[s] + n
        ctx = ctx_pool[end - tail: end]
        k = 0
        best = 0.0
        src = -1
        if slot_root[s] >= 0:
            k, best = propose_tail(nodes, ht, seqs, toks, act, meta, slot_root[s], ctx,
                                   slot_sid[s], slot_lag[s], kmax, min_prob, spec_factor,
                                   spec_offset, min_match, 0.0, match_nodes, out_t, out_p,
                                   out_c, tmp_t, tmp_p, tmp_c)
            src = 0
        if slot_rroot[s] >= 0 and best < r_below:
            k2, sc = propose_tail(s_nodes, s_ht, s_seqs, s_toks, s_act, s_meta, slot_rroot[s],
                                  ctx, slot_rsid[s], slot_lag[s], kmax, min_prob, spec_factor,
                                  spec_offset, min_match, best, match_nodes, out_t, out_p,
                                  out_c, tmp_t, tmp_p, tmp_c)
            if k2 > 0:
                k, best, src = k2, sc, 1
        if g_root >= 0 and best < g_below:
            k2, sc = propose_tail(g_nodes, g_ht, g_seqs, g_toks, g_act, g_meta, g_root, ctx,
                                  -1, 0, kmax, min_prob, spec_factor, spec_offset, min_match,
                                  best, match_nodes, out_t, out_p, out_c, tmp_t, tmp_p, tmp_c)
            if k2 > 0:
                k, best, src = k2, sc, 2
        for i in range(k):
            tokens_AxK[b, i] = out_t[i]
            probs_AxK[b, i] = out_p[i]
            support_AxK[b, i] = out_c[i]
        lens_A[b] = k
        if k > 0:
            source_A[b] = src


@_jit
def propose_tail(nodes, ht, seqs, toks, act, meta, root, ctx, own, own_lag, max_tokens,
                 min_prob, spec_factor, spec_offset, min_match, bound, match_nodes, out_t, out_p,
                 out_c, tmp_t, tmp_p, tmp_c):
    """`_kernels.propose` (same arguments and draft), faster; only a draft scoring above
    `bound` (0.0: any) is written. Returns (k, score): k = 0 (out_* untouched) when none does.

    - Matches: the longest matched tail by binary search (a tail occurs only if every shorter
      one does); other tails are looked up only when walked. A tail of length m <= len(own) of
      the context is the path of the own live sequence's window that ends at its end, and
      that window sits at a node end, which is act[slot(own), (len(own) - m) % max_depth];
      only longer tails are looked up from the root. When `own_lag` > 0 (the context's last
      own_lag tokens are not indexed yet), a tail of length m in (own_lag, own_lag + len(own)]
      is the own window of length m - own_lag followed by those tokens: the lookup starts at
      that window's node and descends own_lag tokens (shorter and longer tails from the root;
      the own sequence's trailing occurrences, which have no continuation, are still left
      out).
    - Walks that cannot win are skipped or cut: a walk's score is a sum of at most `limit`
      path probabilities, each <= the current one, and must exceed the best score so far (no
      lookup at all when no match length's limit exceeds `bound`).
    """
    md = meta[M_MAXD]
    lc = ctx.shape[0]
    mmax = lc
    if mmax > md - 1:
        mmax = md - 1
    lo = min_match
    if lo < 1:
        lo = 1
    if bound > 0.0:          # no lookups when no match length's limit exceeds the bound
        top = 0
        for m in range(lo, mmax + 1):
            top = max(top, _limit(m, spec_factor, spec_offset, max_tokens, md))
        if top <= bound:
            return 0, bound
    own_len = 0
    slot = 0
    if own >= 0:
        own_len = seqs[own, S_LEN]
        slot = seqs[own, S_SLOT]
    lag_len = 0              # own windows the lagging tails resume from (0: none)
    if own_lag > 0:
        if own >= 0 and seqs[own, S_STATE] == ST_LIVE:
            lag_len = own_len
        own_len = 0          # the own sequence does not end where the context does
    # The longest matched tail, by binary search: a tail of length m occurs (less the own
    # trailing occurrence) only if every shorter one does. match_nodes[m]: tail m's node once
    # looked up (-2: not yet; every m <= big_m has one).
    for m in range(mmax + 1):
        match_nodes[m] = -2
    lo_m = 0                 # occurs (0: the empty tail)
    hi_m = mmax + 1          # does not occur
    while hi_m - lo_m > 1:
        m = (lo_m + hi_m) // 2
        n = _tail_node(nodes, ht, seqs, toks, act, meta, root, ctx, own, slot, own_len,
                       own_lag, lag_len, m)
        if n >= 0:
            match_nodes[m] = n
            lo_m = m
        else:
            hi_m = m
    big_m = lo_m
    best_k = 0
    best_score = bound
    for m in range(big_m, lo - 1, -1):
        limit = _limit(m, spec_factor, spec_offset, max_tokens, md)
        if limit <= 0 or limit <= best_score:
            continue
        n = match_nodes[m]
        if n < 0:
            n = _tail_node(nodes, ht, seqs, toks, act, meta, root, ctx, own, slot, own_len,
                           own_lag, lag_len, m)
        k, score = _walk(nodes, seqs, toks, act, meta, own, n, m, limit, min_prob,
                         best_score, tmp_t, tmp_p, tmp_c)
        if k > 0 and score > best_score:
            best_score = score
            best_k = k
            for i in range(k):
                out_t[i] = tmp_t[i]
                out_p[i] = tmp_p[i]
                out_c[i] = tmp_c[i]
    return best_k, best_score


@_jit_inline
def _limit(m, spec_factor, spec_offset, max_tokens, md):
    """Most tokens a match of length m may draft (SuffixDecoding's ceil(m * factor + offset),
    at most max_tokens and the depth left below max_depth)."""
    limit = np.int64(np.ceil(m * spec_factor + spec_offset))
    if limit > max_tokens:
        limit = max_tokens
    if limit > md - m:
        limit = md - m
    return limit


@_jit_inline
def _tail_node(nodes, ht, seqs, toks, act, meta, root, ctx, own, slot, own_len, own_lag,
               lag_len, m):
    """`propose_tail`'s lookup of the context's tail of length m: its node, or -1 when the tail
    does not occur less the own trailing occurrence. own_len: the own sequence's length when
    its end is the context's (else 0); lag_len: its length when the context's last own_lag
    tokens are not indexed yet (else 0)."""
    md = meta[M_MAXD]
    lc = ctx.shape[0]
    if m <= own_len:
        n = np.int64(act[slot, (own_len - m) % md])
    else:
        w = m - own_lag
        n0 = np.int64(-1)
        if 0 < w <= lag_len:
            n0 = np.int64(act[slot, (lag_len - w) % md])
        if n0 >= 0 and nodes[n0, DEPTH] == w:    # explicit, at the window's end (lazy: -1)
            n = _match_from(nodes, ht, seqs, toks, meta, n0, w, ctx, lc - m, m)
        else:
            n = _match(nodes, ht, seqs, toks, meta, root, ctx, lc - m, m)
        if n < 0:
            return np.int64(-1)
    if nodes[n, COUNT] - _self_count(nodes, seqs, act, meta, own, n, m) <= 0:
        return np.int64(-1)
    return n


@_jit
def append_rows(nodes, ht, seqs, toks, act, meta, slots_A, tokens_AxW, n_A, slot_sid,
                ctx_pool, ctx_start, ctx_len, ctx_cap, out_len, row0, off0, mode):
    """Appends tokens_AxW[b, :n_A[b]] to the request in slot slots_A[b], for rows b = row0, ...
    in order (rows with n_A[b] <= 0 skipped): with mode bit INDEX, indexes them into its live
    sequence slot_sid[s] (none when -1) in chunks of CHUNK tokens; with bit CONTEXT, adds them
    to its context and to out_len[s].

    Resumes row row0 at token offset off0 (a previous call stopped there). Returns (row, offset,
    rc): rc RC_DONE when every row is done; else nothing of row `row` from `offset` on was done
    and rc says what the caller must grow before calling again with (row, offset): 1 the
    forest's nodes / hash (for CHUNK-bounded min(n - offset, CHUNK) tokens), 2 the sequence's
    token storage, 3 the sequence is not live (an error), RC_CONTEXT the slot's context
    capacity (to ctx_len + n).
    """
    A = n_A.shape[0]
    for b in range(row0, A):
        n = n_A[b]
        if n <= 0:
            continue
        s = slots_A[b]
        off = off0 if b == row0 else 0
        if (mode & CONTEXT) and off == 0 and ctx_len[s] + n > ctx_cap[s]:
            return b, 0, RC_CONTEXT
        sid = slot_sid[s]
        if (mode & INDEX) and sid >= 0:
            while off < n:
                hi = min(off + CHUNK, n)
                rc = append_tokens(nodes, ht, seqs, toks, act, meta, sid, tokens_AxW[b, off:hi])
                if rc != 0:
                    return b, off, rc
                off = hi
        if not mode & CONTEXT:
            continue
        base = ctx_start[s] + ctx_len[s]
        for i in range(n):
            ctx_pool[base + i] = tokens_AxW[b, i]
        ctx_len[s] += n
        out_len[s] += n
    return A, 0, RC_DONE


@_jit
def take_ahead(slots_A, max_tokens_A, ok, a_ctx_len, a_lag, a_max, a_n, a_assumed, a_tokens,
               a_probs, a_support, a_lens, a_source, ctx_len, lag, ctx_start, pool, tokens_AxK,
               probs_AxK, support_AxK, lens_A, source_A, hit_A):
    """`ahead.AheadDrafts.take`'s loop: row b takes the draft held for slot s = slots_A[b]
    (a_*[s]) where one is held (ok[s]) for the slot's context now (ctx_len[s], lag[s], its
    last a_n[s] tokens in pool equal to a_assumed[s]) and budget max_tokens_A[b], writing it
    into row b of the outputs and hit_A[b] = True; every ok[s] of the rows is cleared.
    Returns the rows taken."""
    K = min(tokens_AxK.shape[1], a_tokens.shape[1])
    used = 0
    for b in range(slots_A.shape[0]):
        s = slots_A[b]
        h = (ok[s] and a_ctx_len[s] == ctx_len[s] and a_lag[s] == lag[s]
             and a_max[s] == max_tokens_A[b])
        if h:
            n = a_n[s]
            base = ctx_start[s] + ctx_len[s] - n
            for j in range(n):
                if pool[base + j] != a_assumed[s, j]:
                    h = False
                    break
        ok[s] = False
        hit_A[b] = h
        if h:
            for i in range(K):
                tokens_AxK[b, i] = a_tokens[s, i]
                probs_AxK[b, i] = a_probs[s, i]
                support_AxK[b, i] = a_support[s, i]
            lens_A[b] = a_lens[s]
            source_A[b] = a_source[s]
            used += 1
    return used
