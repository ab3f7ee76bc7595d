"""Brute-force reference for the suffix-trie drafter (imported by the other drafter tests; no tests).

Counts every substring of length <= max_depth of the indexed sequences by enumeration and
applies the documented draft rule of `das_jax.drafter.suffix_tree` literally.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np


class BruteIndex:
    def __init__(self, seqs, max_depth):
        self.max_depth = max_depth
        self.counts: dict[tuple, int] = defaultdict(int)
        for s in seqs:
            s = [int(x) for x in s]
            for j in range(len(s)):
                for d in range(1, min(max_depth, len(s) - j) + 1):
                    self.counts[tuple(s[j: j + d])] += 1
        self.children: dict[tuple, list] = defaultdict(list)
        for path, c in self.counts.items():
            self.children[path[:-1]].append((path[-1], c))

    def count(self, path, own):
        """count(path), minus the occurrence ending at the end of `own` (the requester's live
        sequence, indexed too) when path is a tail of it."""
        c = self.counts.get(path, 0)
        if own is not None and 0 < len(path) <= len(own) and len(path) < self.max_depth \
                and tuple(own[len(own) - len(path):]) == path:
            c -= 1
        return c

    def propose(self, ctx, max_tokens, min_token_prob=0.1, max_spec_factor=1.0,
                max_spec_offset=0.0, min_match_len=1, own=None):
        """(tokens list, probs list, match_len, score) by the documented rule."""
        ctx = [int(x) for x in ctx]
        own = None if own is None else [int(x) for x in own]
        D = self.max_depth
        if max_tokens <= 0 or not ctx:
            return [], [], 0, 0.0
        big_m = 0
        for m in range(1, min(len(ctx), D - 1) + 1):
            if self.count(tuple(ctx[len(ctx) - m:]), own) <= 0:
                break
            big_m = m
        best = ([], [], 0, 0.0)
        for m in range(big_m, max(min_match_len, 1) - 1, -1):
            limit = min(max_tokens, math.ceil(m * max_spec_factor + max_spec_offset), D - m)
            if limit <= 0:
                continue
            path = tuple(ctx[len(ctx) - m:])
            prob, score, toks, probs = 1.0, 0.0, [], []
            while len(toks) < limit:
                kids = self.children.get(path)
                if not kids:
                    break
                t, c = min(kids, key=lambda tc: (-tc[1], tc[0]))   # highest count, then smallest id
                cp = self.count(path, own)
                if c != cp:
                    prob = prob * c / cp
                if prob < min_token_prob:
                    break
                toks.append(t)
                probs.append(prob)
                score += prob
                path = path + (t,)
            if toks and score > best[3]:
                best = (toks, probs, m, score)
        return best


def mutated_copies(rng, n_seqs, length, vocab, p_mut=0.05):
    """Sequences sharing long spans: copies of a base with substitutions/insertions/deletions."""
    base = rng.integers(0, vocab, size=length).tolist()
    out = []
    for _ in range(n_seqs):
        s = []
        for t in base:
            r = rng.random()
            if r < p_mut / 3:
                s.append(int(rng.integers(0, vocab)))
            elif r < 2 * p_mut / 3:
                s.extend([t, int(rng.integers(0, vocab))])
            elif r < p_mut:
                continue
            else:
                s.append(t)
        out.append(s)
    return out


def as_np(x):
    return np.asarray(x, dtype=np.int32)
