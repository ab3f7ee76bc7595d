"""Numba kernels of the compact suffix trie (internal; the API is `suffix_tree.SuffixForest`).

Data layout (all numpy arrays owned by `SuffixForest`, grown by it before each kernel call):

- `nodes` int32 [node_cap, NF]: one row per trie node, fields PARENT, DEPTH (path length from the
  root to the node's lower end), COUNT (occurrences of every path that ends inside the node's
  edge), REF_SEQ/REF_END (an occurrence of the node's full path: it ends, exclusive, at position
  REF_END of sequence REF_SEQ; edge tokens are read from there), FIRST/NEXT/PREV (child list),
  TOK0 (the first token of its edge, by which its parent's children are told apart: kept in
  the row so that finding or ranking a child reads no token storage; -1 on a root).
  Free rows are chained through NEXT and have COUNT = -1.
- `ht` int32 [hcap, 3]: open-addressing hash (linear probing, backward-shift deletion) from
  (parent, first edge token) to child node, rows (parent, token, child); empty rows have
  parent -1. Only the children of nodes with two or more children are in it (a single child
  is found through FIRST).
- `seqs` int64 [seq_cap, SF]: per indexed sequence START/LEN/CAP in `toks`, ROOT of its trie,
  NREF (nodes whose reference points into it), STATE, SLOT (row of `act` while live), JP
  (windows j < JP are private: their path occurs once, so they sit in lazy leaves).
- `toks` int32 [tok_cap]: token storage of all sequences.
- `act` int32 [slots, max_depth]: for a live sequence, the node at the lower end of each of its
  open windows (window j lives in column j % max_depth).
- `meta` int64 [5]: FREE (free-list head), HIGH (rows ever used), LIVE (live nodes), HCOUNT,
  MAXD (max_depth).

Lazy leaves: a leaf with count 1 owned by window j of sequence s stores DEPTH = -1 and
REF_END = j; its depth is min(max_depth, len(s) - j), so it grows with s at no cost. It becomes
explicit as soon as another window reaches its end.

Path compression: a node is a maximal run of trie depths with one count and no branching; a
live window always sits exactly at a node end (its path's count strictly exceeds every child's),
so splits and merges never move a live window. Every kernel is plain Python when numba's JIT is
disabled (`NUMBA_DISABLE_JIT=1`).
"""
from __future__ import annotations

import numpy as np
from numba import njit

PARENT, DEPTH, COUNT, REF_SEQ, REF_END, FIRST, NEXT, PREV, TOK0 = range(9)
NF = 9
S_START, S_LEN, S_CAP, S_ROOT, S_NREF, S_STATE, S_SLOT, S_JP = range(8)
SF = 8
ST_FREE, ST_LIVE, ST_FROZEN, ST_DEAD = 0, 1, 2, 3
M_FREE, M_HIGH, M_LIVE, M_HCOUNT, M_MAXD = range(5)

_HMUL = np.uint64(0x9E3779B97F4A7C15)
_HSHIFT = np.uint64(32)

_jit = njit(cache=True, nogil=True)
_jit_inline = njit(cache=True, nogil=True, inline="always")   # small helpers of hot loops


# ----------------------------------------------------------------------------- hash table
@_jit_inline
def _hslot(p, t, mask):
    key = (np.uint64(p) << np.uint64(32)) ^ np.uint64(t)
    h = (key ^ (key >> np.uint64(29))) * _HMUL
    return np.int64(h ^ (h >> _HSHIFT)) & mask


@_jit_inline
def h_find(ht, p, t):
    mask = ht.shape[0] - 1
    i = _hslot(p, t, mask)
    while True:
        hp = ht[i, 0]
        if hp == p and ht[i, 1] == t:
            return np.int64(ht[i, 2])
        if hp == -1:
            return np.int64(-1)
        i = (i + 1) & mask


@_jit
def h_insert(ht, meta, p, t, val):
    mask = ht.shape[0] - 1
    i = _hslot(p, t, mask)
    while ht[i, 0] != -1:
        i = (i + 1) & mask
    ht[i, 0] = p
    ht[i, 1] = t
    ht[i, 2] = val
    meta[M_HCOUNT] += 1


@_jit
def h_set(ht, p, t, val):
    mask = ht.shape[0] - 1
    i = _hslot(p, t, mask)
    while not (ht[i, 0] == p and ht[i, 1] == t):
        i = (i + 1) & mask
    ht[i, 2] = val


@_jit
def h_delete(ht, meta, p, t):
    mask = ht.shape[0] - 1
    i = _hslot(p, t, mask)
    while not (ht[i, 0] == p and ht[i, 1] == t):
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if ht[j, 0] == -1:
            break
        home = _hslot(ht[j, 0], ht[j, 1], mask)
        # keep entry j where it is if its home lies cyclically in (i, j]
        if i <= j:
            keep = i < home <= j
        else:
            keep = home > i or home <= j
        if not keep:
            ht[i, 0] = ht[j, 0]
            ht[i, 1] = ht[j, 1]
            ht[i, 2] = ht[j, 2]
            i = j
    ht[i, 0] = -1
    meta[M_HCOUNT] -= 1


@_jit
def h_rehash(ht, nht):
    mask = nht.shape[0] - 1
    for i in range(ht.shape[0]):
        if ht[i, 0] != -1:
            j = _hslot(ht[i, 0], ht[i, 1], mask)
            while nht[j, 0] != -1:
                j = (j + 1) & mask
            nht[j, 0] = ht[i, 0]
            nht[j, 1] = ht[i, 1]
            nht[j, 2] = ht[i, 2]


# ----------------------------------------------------------------------------- nodes
@_jit_inline
def depth_of(nodes, seqs, meta, n):
    """Path length at node n's lower end (resolves lazy leaves)."""
    d = nodes[n, DEPTH]
    if d >= 0:
        return np.int64(d)
    d = seqs[nodes[n, REF_SEQ], S_LEN] - nodes[n, REF_END]
    md = meta[M_MAXD]
    return np.int64(d if d < md else md)


@_jit_inline
def path_start(nodes, n):
    """Position in sequence REF_SEQ[n] where an occurrence of n's path begins."""
    d = nodes[n, DEPTH]
    if d >= 0:
        return np.int64(nodes[n, REF_END] - d)
    return np.int64(nodes[n, REF_END])


@_jit_inline
def edge_tok(nodes, seqs, toks, n, i):
    """Token at 0-based path index i (< depth) of node n's path."""
    return toks[seqs[nodes[n, REF_SEQ], S_START] + path_start(nodes, n) + i]


@_jit_inline
def set_ref(nodes, seqs, n, s, end):
    old = nodes[n, REF_SEQ]
    if old != s:
        if old >= 0:
            seqs[old, S_NREF] -= 1
        seqs[s, S_NREF] += 1
        nodes[n, REF_SEQ] = s
    nodes[n, REF_END] = end


@_jit_inline
def _make_lazy(nodes, seqs, n, s, j):
    """n becomes the private leaf of window j of live sequence s: its depth follows s's length."""
    set_ref(nodes, seqs, n, s, j)
    nodes[n, DEPTH] = -1


@_jit_inline
def _materialize(nodes, seqs, meta, n):
    """A lazy leaf gets an explicit depth; its owner window is no longer private."""
    if nodes[n, DEPTH] < 0:
        d = depth_of(nodes, seqs, meta, n)
        j = nodes[n, REF_END]
        nodes[n, DEPTH] = d
        nodes[n, REF_END] = j + d
        s = nodes[n, REF_SEQ]
        if seqs[s, S_JP] > j:
            seqs[s, S_JP] = j


@_jit
def alloc_node(nodes, meta):
    f = meta[M_FREE]
    if f >= 0:
        meta[M_FREE] = nodes[f, NEXT]
    else:
        f = meta[M_HIGH]
        meta[M_HIGH] = f + 1
    nodes[f, PARENT] = -1
    nodes[f, DEPTH] = 0
    nodes[f, COUNT] = 0
    nodes[f, REF_SEQ] = -1
    nodes[f, REF_END] = 0
    nodes[f, FIRST] = -1
    nodes[f, NEXT] = -1
    nodes[f, PREV] = -1
    nodes[f, TOK0] = -1
    meta[M_LIVE] += 1
    return f


@_jit
def free_node(nodes, seqs, meta, n):
    rs = nodes[n, REF_SEQ]
    if rs >= 0:
        seqs[rs, S_NREF] -= 1
    nodes[n, REF_SEQ] = -1
    nodes[n, COUNT] = -1
    nodes[n, TOK0] = -1
    nodes[n, NEXT] = meta[M_FREE]
    meta[M_FREE] = n
    meta[M_LIVE] -= 1


@_jit_inline
def child(nodes, ht, seqs, toks, p, t):
    """Child of p (not lazy) whose edge starts with token t, or -1.

    Only nodes with two or more children index them in the hash table.
    """
    f = nodes[p, FIRST]
    if f < 0:
        return np.int64(-1)
    if nodes[f, NEXT] < 0:
        if nodes[f, TOK0] == t:
            return np.int64(f)
        return np.int64(-1)
    return h_find(ht, p, t)


@_jit
def _link_child(nodes, ht, seqs, toks, meta, p, c, t):
    nodes[c, PARENT] = p
    nodes[c, TOK0] = t
    f = nodes[p, FIRST]
    if f >= 0:
        if nodes[f, NEXT] < 0:          # 1 -> 2 children: start indexing them
            h_insert(ht, meta, p, nodes[f, TOK0], f)
        h_insert(ht, meta, p, t, c)
        nodes[f, PREV] = c
    nodes[c, NEXT] = f
    nodes[c, PREV] = -1
    nodes[p, FIRST] = c


@_jit
def _unlink_child(nodes, ht, seqs, toks, meta, c, t):
    p = nodes[c, PARENT]
    pr = nodes[c, PREV]
    nx = nodes[c, NEXT]
    multi = pr >= 0 or nx >= 0
    if pr >= 0:
        nodes[pr, NEXT] = nx
    else:
        nodes[p, FIRST] = nx
    if nx >= 0:
        nodes[nx, PREV] = pr
    if multi:
        h_delete(ht, meta, p, t)
        f = nodes[p, FIRST]
        if nodes[f, NEXT] < 0:          # 2 -> 1 children: stop indexing
            h_delete(ht, meta, p, nodes[f, TOK0])


@_jit
def _replace_child(nodes, ht, old, new, t):
    """`new` takes `old`'s place (child list slot, hash entry, first token t) under its parent."""
    p = nodes[old, PARENT]
    nodes[new, PARENT] = p
    nodes[new, TOK0] = t
    pr = nodes[old, PREV]
    nx = nodes[old, NEXT]
    nodes[new, PREV] = pr
    nodes[new, NEXT] = nx
    if pr >= 0:
        nodes[pr, NEXT] = new
    else:
        nodes[p, FIRST] = new
    if nx >= 0:
        nodes[nx, PREV] = new
    if pr >= 0 or nx >= 0:
        h_set(ht, p, t, new)


@_jit_inline
def _single_child(nodes, n):
    f = nodes[n, FIRST]
    return f >= 0 and nodes[f, NEXT] < 0


@_jit
def _split(nodes, ht, seqs, toks, meta, c, d):
    """Cut node c at depth d (DEPTH[parent] < d < depth(c)); returns the new upper node."""
    t1 = nodes[c, TOK0]
    t2 = edge_tok(nodes, seqs, toks, c, d)
    u = alloc_node(nodes, meta)
    nodes[u, DEPTH] = d
    nodes[u, COUNT] = nodes[c, COUNT]
    set_ref(nodes, seqs, u, nodes[c, REF_SEQ], path_start(nodes, c) + d)
    _replace_child(nodes, ht, c, u, t1)
    _link_child(nodes, ht, seqs, toks, meta, u, c, t2)
    return u


@_jit
def _merge_into_child(nodes, ht, seqs, toks, meta, p, c):
    """Remove p (not a root; c its only child, same count): c's edge grows upward."""
    _replace_child(nodes, ht, p, c, nodes[p, TOK0])
    free_node(nodes, seqs, meta, p)


@_jit
def fill_tok0(nodes, seqs, toks, high):
    """Sets TOK0 of rows 0..high-1 from their paths (a state saved before the field existed):
    a live non-root node's first edge token, else -1."""
    for n in range(high):
        p = nodes[n, PARENT]
        if nodes[n, COUNT] < 0 or p < 0:
            nodes[n, TOK0] = -1
        else:
            nodes[n, TOK0] = edge_tok(nodes, seqs, toks, n, nodes[p, DEPTH])


# ----------------------------------------------------------------------------- append
@_jit
def _extend(nodes, ht, seqs, toks, meta, root, p, t, s, j, end):
    """Extend window j of live sequence s (sitting at the end of explicit node p) by token t,
    which sits at position end - 1 of s. Returns the window's new node (lazy if now private)."""
    c = child(nodes, ht, seqs, toks, p, t)
    dp = nodes[p, DEPTH]
    if c < 0:
        if p != root and nodes[p, FIRST] < 0 and nodes[p, COUNT] == 1:
            _make_lazy(nodes, seqs, p, s, j)
            return p
        u = alloc_node(nodes, meta)
        nodes[u, COUNT] = 1
        _make_lazy(nodes, seqs, u, s, j)
        _link_child(nodes, ht, seqs, toks, meta, p, u, t)
        return u
    if depth_of(nodes, seqs, meta, c) == dp + 1:
        _materialize(nodes, seqs, meta, c)
        nodes[c, COUNT] += 1
        set_ref(nodes, seqs, c, s, end)
        if p != root and nodes[p, COUNT] == nodes[c, COUNT] and _single_child(nodes, p):
            _merge_into_child(nodes, ht, seqs, toks, meta, p, c)
        return c
    if p != root and nodes[p, COUNT] == nodes[c, COUNT] + 1 and _single_child(nodes, p):
        nodes[p, DEPTH] = dp + 1        # p absorbs the first token of c's edge
        set_ref(nodes, seqs, p, s, end)
        nodes[c, TOK0] = edge_tok(nodes, seqs, toks, c, dp + 1)
        return p
    u = _split(nodes, ht, seqs, toks, meta, c, dp + 1)
    nodes[u, COUNT] += 1
    set_ref(nodes, seqs, u, s, end)
    return u


@_jit
def append_tokens(nodes, ht, seqs, toks, act, meta, s, new_toks):
    """Append new_toks to live sequence s, indexing every window of length <= max_depth.

    Windows j < seqs[s, S_JP] are private (their path occurs once): they sit in lazy leaves
    whose depth follows the sequence length, so they cost nothing per token.
    Returns 0 when done; without touching anything, 1 if the pool needs room for
    len(new_toks) * max_depth more nodes / hash entries, 2 if s's token storage is too small,
    3 if s is not live.
    """
    md = meta[M_MAXD]
    need = new_toks.shape[0] * md
    free = meta[M_HIGH] - meta[M_LIVE]
    if meta[M_HIGH] + max(0, need - free) > nodes.shape[0]:
        return 1
    if (meta[M_HCOUNT] + need) * 10 > ht.shape[0] * 7:
        return 1
    if seqs[s, S_STATE] != ST_LIVE:
        return 3
    if seqs[s, S_LEN] + new_toks.shape[0] > seqs[s, S_CAP]:
        return 2
    root = seqs[s, S_ROOT]
    slot = seqs[s, S_SLOT]
    start = seqs[s, S_START]
    L = seqs[s, S_LEN]
    for i in range(new_toks.shape[0]):
        t = new_toks[i]
        toks[start + L] = t
        seqs[s, S_LEN] = L + 1
        act[slot, L % md] = root
        j0 = L - md + 1
        if j0 < seqs[s, S_JP]:
            j0 = seqs[s, S_JP]
        for j in range(j0, L + 1):
            k = j % md
            n = _extend(nodes, ht, seqs, toks, meta, root, act[slot, k], t, s, j, L + 1)
            act[slot, k] = n
            if nodes[n, DEPTH] < 0:
                seqs[s, S_JP] = j + 1
        L += 1
    return 0


# ----------------------------------------------------------------------------- remove
@_jit
def remove_sequence(nodes, ht, seqs, toks, meta, s, stack):
    """Un-index every window of (non-live) sequence s. Returns 0, or -1 on a broken invariant."""
    md = meta[M_MAXD]
    root = seqs[s, S_ROOT]
    L = seqs[s, S_LEN]
    start = seqs[s, S_START]
    for j in range(L):
        ln = L - j
        if ln > md:
            ln = md
        n = root
        k = 0
        d = 0
        while d < ln:
            c = child(nodes, ht, seqs, toks, n, toks[start + j + d])
            if c < 0:
                return -1
            d = depth_of(nodes, seqs, meta, c)
            if d > ln:
                return -1
            stack[k] = c
            k += 1
            n = c
        for i in range(k):
            nodes[stack[i], COUNT] -= 1
        for i in range(k - 1, -1, -1):
            c = stack[i]
            if nodes[c, COUNT] == 0:
                _unlink_child(nodes, ht, seqs, toks, meta, c, nodes[c, TOK0])
                free_node(nodes, seqs, meta, c)
            elif _single_child(nodes, c) and nodes[nodes[c, FIRST], COUNT] == nodes[c, COUNT]:
                _merge_into_child(nodes, ht, seqs, toks, meta, c, nodes[c, FIRST])
    return 0


# ----------------------------------------------------------------------------- propose
@_jit
def _match(nodes, ht, seqs, toks, meta, root, ctx, lo, m):
    """Node whose edge contains depth m of path ctx[lo:lo+m], or -1 if that path is absent."""
    return _match_from(nodes, ht, seqs, toks, meta, root, 0, ctx, lo, m)


@_jit_inline
def _match_from(nodes, ht, seqs, toks, meta, n, d, ctx, lo, m):
    """`_match` resumed at explicit node n, whose path ctx[lo:lo+d] ends exactly at its lower
    end (d = its depth): the node whose edge contains depth m of ctx[lo:lo+m], or -1."""
    while d < m:
        c = child(nodes, ht, seqs, toks, n, ctx[lo + d])
        if c < 0:
            return np.int64(-1)
        dc = depth_of(nodes, seqs, meta, c)
        if dc > m:
            dc = m
        base = seqs[nodes[c, REF_SEQ], S_START] + path_start(nodes, c)
        for i in range(d + 1, dc):
            if toks[base + i] != ctx[lo + i]:
                return np.int64(-1)
        d = dc
        n = c
    return np.int64(n)


@_jit_inline
def _self_count(nodes, seqs, act, meta, own, n, d):
    """1 if the live sequence `own` has a window of length d ending at its end at node n's end
    (that occurrence has no continuation yet and is not counted when drafting for it)."""
    if own < 0 or d <= 0 or d >= meta[M_MAXD]:
        return 0
    L = seqs[own, S_LEN]
    if d > L or seqs[own, S_STATE] != ST_LIVE:
        return 0
    if act[seqs[own, S_SLOT], (L - d) % meta[M_MAXD]] == n:
        return 1
    return 0


@_jit
def _walk(nodes, seqs, toks, act, meta, own, n, d, limit, min_prob, bound, out_t, out_p,
                  out_c):
    """Greedy highest-count walk from depth d inside node n. Returns (n_tokens, score).

    out_c[k]: the support of token k, the count of the context path it continues (less the
    requester's own trailing occurrence). Stops early (returning a score <= bound) once its
    score cannot exceed `bound`: the tokens still allowed each add at most the current path
    probability (bound 0: never)."""
    prob = 1.0
    score = 0.0
    k = 0
    nd = depth_of(nodes, seqs, meta, n)
    while k < limit:
        if score + prob * (limit - k) < bound - 1e-9:
            return k, score
        if d < nd:
            t = edge_tok(nodes, seqs, toks, n, d)     # inside an edge: ratio 1
            cn = nodes[n, COUNT] - _self_count(nodes, seqs, act, meta, own, n, d)
        else:
            best = -1
            bc = -1
            bt = 0
            c = nodes[n, FIRST]
            while c >= 0:
                cc = nodes[c, COUNT]
                ct = nodes[c, TOK0]
                if cc > bc or (cc == bc and ct < bt):
                    best = c
                    bc = cc
                    bt = ct
                c = nodes[c, NEXT]
            if best < 0:
                break
            cn = nodes[n, COUNT] - _self_count(nodes, seqs, act, meta, own, n, d)
            if bc != cn:
                prob = prob * bc / cn
            if prob < min_prob:
                break
            t = bt
            n = best
            nd = depth_of(nodes, seqs, meta, n)
        out_t[k] = t
        out_p[k] = prob
        out_c[k] = cn
        score += prob
        k += 1
        d += 1
    return k, score


@_jit
def propose(nodes, ht, seqs, toks, act, meta, root, ctx, own, max_tokens, min_prob,
            spec_factor, spec_offset, min_match, match_nodes, out_t, out_p, out_c, tmp_t, tmp_p,
            tmp_c):
    """Best-scoring greedy draft over all matched tail lengths. Returns (k, match_len, score).

    `own`: the requesting live sequence indexed in this trie whose tail is the context's tail
    (or -1); its own trailing occurrences are not counted. Writes the draft to out_t[:k]
    (int32) / out_p[:k] (float32) / out_c[:k] (int32 supports, see `_walk`). Scratch arrays
    have length >= max_depth (+1 for match_nodes).
    """
    md = meta[M_MAXD]
    lc = ctx.shape[0]
    mmax = lc
    if mmax > md - 1:
        mmax = md - 1
    # The longest matched tail: a tail of length m occurs (less the requester's own trailing
    # occurrence) only if every shorter one does, so binary search finds it.
    lo_m = 0                    # occurs (0: the empty tail)
    hi_m = mmax + 1             # does not occur
    while hi_m - lo_m > 1:
        m = (lo_m + hi_m) // 2
        n = _match(nodes, ht, seqs, toks, meta, root, ctx, lc - m, m)
        if n >= 0 and nodes[n, COUNT] - _self_count(nodes, seqs, act, meta, own, n, m) > 0:
            lo_m = m
        else:
            hi_m = m
    big_m = lo_m
    lo = min_match
    if lo < 1:
        lo = 1
    # Every match length m in [lo, big_m] can draft at most limit(m) tokens, each with a path
    # probability <= 1, so its score is <= limit(m). The winner is the highest score, ties going
    # to the longer match: walking the lengths by decreasing limit (longer first on equal
    # limits), a length whose limit is below the best score, or equal to it with a shorter
    # match, cannot win and is not walked (branch and bound; the same draft as walking all).
    best_k = 0
    best_m = 0
    best_score = 0.0
    nm = big_m - lo + 1
    if nm <= 0:
        return best_k, best_m, best_score
    for i in range(nm):
        m = big_m - i
        limit = np.int64(np.ceil(m * spec_factor + spec_offset))
        if limit > max_tokens:
            limit = max_tokens
        if limit > md - m:
            limit = md - m
        match_nodes[m] = limit      # scratch: the limit of each length
    done = 0
    while done < nm:
        # the unwalked length with the largest limit (the longest on ties)
        m_sel = -1
        l_sel = -1
        for i in range(nm):
            m = big_m - i
            if match_nodes[m] >= 0 and match_nodes[m] > l_sel:
                m_sel = m
                l_sel = match_nodes[m]
        if m_sel < 0 or l_sel <= 0:
            break
        match_nodes[m_sel] = -1
        done += 1
        if l_sel < best_score or (l_sel == best_score and m_sel < best_m):
            break               # no later length can win either: limits only decrease
        n = _match(nodes, ht, seqs, toks, meta, root, ctx, lc - m_sel, m_sel)
        k, score = _walk(nodes, seqs, toks, act, meta, own, n, m_sel, l_sel, min_prob, 0.0,
                         tmp_t, tmp_p, tmp_c)
        if k > 0 and (score > best_score or (score == best_score and m_sel > best_m)):
            best_score = score
            best_k = k
            best_m = m_sel
            for i in range(k):
                out_t[i] = tmp_t[i]
                out_p[i] = tmp_p[i]
                out_c[i] = tmp_c[i]
    return best_k, best_m, best_score


# ----------------------------------------------------------------------------- n-gram lookup
@_jit
def ngram_lookup(ctx, n_min, n_max, max_tokens):
    """vLLM-style prompt lookup: for n = n_max..n_min, the most recent earlier occurrence of the
    last n tokens; returns (start, count) of the tokens that follow it, or (0, 0)."""
    lc = ctx.shape[0]
    for n in range(n_max, n_min - 1, -1):
        if n >= lc or n <= 0:
            continue
        for i in range(lc - n - 1, -1, -1):
            ok = True
            for q in range(n):
                if ctx[i + q] != ctx[lc - n + q]:
                    ok = False
                    break
            if ok:
                start = i + n
                cnt = lc - start
                if cnt > max_tokens:
                    cnt = max_tokens
                return start, cnt
    return 0, 0
