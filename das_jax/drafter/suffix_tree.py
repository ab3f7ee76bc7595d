"""Depth-bounded suffix trie with counts, path-compressed, for nonparametric drafting.

Algorithm: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; the `suffix` method of vLLM /
ArcticInference) as used per problem by DAS (arXiv 2511.13841).

What is indexed: for every indexed sequence s and every start position j, the window
s[j : j + max_depth] (shorter at the end of s). The count of a path P (|P| <= max_depth) is the
number of occurrences of P as a substring of the indexed sequences. Appending a token to a live
sequence extends its open windows by one (O(max_depth) work per token); removing a sequence
un-indexes all its windows.

Draft rule (`propose`), identical to ArcticInference's: for every tail length m of the context
(1 <= m <= max_depth - 1, m >= min_match_len) whose path occurs in the trie, walk greedily from
that path, each step taking the continuation with the highest count (ties: the smallest token
id), multiplying count(child) / count(parent) into the path probability; stop when it would fall
below `min_token_prob`, when the draft has min(max_tokens, ceil(m * max_spec_factor +
max_spec_offset), max_depth - m) tokens, or when nothing continues. The draft with the highest
score (sum of its path probabilities = expected accepted length) wins; ties go to the longer
match. So the longest match is preferred unless a shorter one promises a longer accepted draft
(a depth-bounded trie leaves a match of length m at most max_depth - m tokens), and a match
without continuation falls back to shorter ones. A step whose count ratio is 1 leaves the
probability unchanged. When the requester's own live sequence is indexed in the trie, its
occurrences that end at its current end (paths equal to a tail of the context; they have no
continuation yet) are subtracted from the counts.

Storage: nodes are maximal runs of trie depths with one count and no branching (path
compression); a node stores a reference (sequence, end position) to one occurrence of its path
instead of its tokens. Several tries (one per problem, per request...) share one
`SuffixForest` pool.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from . import _kernels as K
from .base import Draft


@dataclasses.dataclass(frozen=True)
class SuffixTreeConfig:
    """Suffix-trie drafting parameters (names follow ArcticInference / vLLM `suffix`).

    Attributes:
      max_depth: longest indexed window (24-64 typical); a match plus its draft fit in it.
      min_token_prob: stop drafting once the path probability would fall below this.
      max_spec_factor: draft at most ceil(match_len * max_spec_factor + max_spec_offset) tokens.
      max_spec_offset: see max_spec_factor.
      min_match_len: shortest context tail used as a match.
    """

    max_depth: int = 32
    min_token_prob: float = 0.1
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_match_len: int = 1

    def __post_init__(self):
        if not 2 <= self.max_depth <= 1024:
            raise ValueError(f"max_depth must be in [2, 1024], got {self.max_depth}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if self.min_match_len < 1:
            raise ValueError(f"min_match_len must be >= 1, got {self.min_match_len}")


@dataclasses.dataclass(frozen=True)
class ScoredDraft:
    """A draft plus how it was found: `match_len` context tokens matched, `score` = sum(probs)."""

    draft: Draft
    match_len: int
    score: float


_EMPTY = ScoredDraft(Draft.empty(), 0, 0.0)
_CHUNK = 256   # tokens per append kernel call (bounds the capacity reserved ahead)


class SuffixForest:
    """A pool of suffix tries sharing node, hash and token storage.

    Tries are identified by their root node id (`new_tree`), sequences by an int id (`new_seq`).
    A sequence is live (appendable) from `new_seq` until `freeze` or `remove`.
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig()):
        self.config = config
        d = config.max_depth
        self.nodes = np.zeros((256, K.NF), np.int32)
        self.ht = np.full((512, 3), -1, np.int32)
        self.seqs = np.zeros((16, K.SF), np.int64)
        self.toks = np.zeros(4096, np.int32)
        self.act = np.zeros((4, d), np.int32)
        self.meta = np.zeros(5, np.int64)
        self.meta[K.M_FREE] = -1
        self.meta[K.M_MAXD] = d
        self._tok_top = 0
        self._seq_top = 0
        self._free_seqs: list[int] = []
        self._dead: set[int] = set()
        self._slot_top = 0
        self._free_slots: list[int] = []
        self._indexed = 0                     # tokens of live + frozen sequences
        self._scratch()

    def _scratch(self):
        d = self.config.max_depth
        self._match_nodes = np.zeros(d + 1, np.int64)
        self._out_t = np.zeros(d, np.int32)
        self._out_p = np.zeros(d, np.float32)
        self._tmp_t = np.zeros(d, np.int32)
        self._tmp_p = np.zeros(d, np.float32)
        self._out_c = np.zeros(d, np.int32)
        self._tmp_c = np.zeros(d, np.int32)
        self._stack = np.zeros(d + 1, np.int64)

    # ------------------------------------------------------------------ capacity
    def _reserve_nodes(self, n_new: int):
        meta = self.meta
        free = int(meta[K.M_HIGH] - meta[K.M_LIVE])
        need = int(meta[K.M_HIGH]) + max(0, n_new - free)
        cap = self.nodes.shape[0]
        if need > cap:
            new = np.zeros((max(2 * cap, need), K.NF), np.int32)
            new[:cap] = self.nodes
            self.nodes = new
        hneed = int(meta[K.M_HCOUNT]) + n_new
        if hneed * 10 > self.ht.shape[0] * 7:
            size = self.ht.shape[0]
            while hneed * 10 > size * 7:
                size *= 2
            nht = np.full((size, 3), -1, np.int32)
            K.h_rehash(self.ht, nht)
            self.ht = nht

    def _reserve_tokens(self, sid: int, n_new: int):
        row = self.seqs[sid]
        length, cap = int(row[K.S_LEN]), int(row[K.S_CAP])
        if length + n_new <= cap:
            return
        new_cap = max(2 * cap, length + n_new, 64)
        if self._tok_top + new_cap > self.toks.shape[0]:
            self._compact_tokens(extra=new_cap)
        start = int(row[K.S_START])
        self.toks[self._tok_top: self._tok_top + length] = self.toks[start: start + length]
        row[K.S_START] = self._tok_top
        row[K.S_CAP] = new_cap
        self._tok_top += new_cap

    def _compact_tokens(self, extra: int):
        """Repack all sequences' tokens (frozen ones to their exact length), growing if needed."""
        seqs = self.seqs
        alive = [s for s in range(self._seq_top) if seqs[s, K.S_STATE] != K.ST_FREE]
        caps = {s: int(seqs[s, K.S_CAP]) if seqs[s, K.S_STATE] == K.ST_LIVE
                else int(seqs[s, K.S_LEN]) for s in alive}
        used = sum(caps.values()) + extra
        size = self.toks.shape[0]
        while used * 2 > size:
            size *= 2
        new = np.zeros(size, np.int32)
        top = 0
        for s in alive:
            start, length = int(seqs[s, K.S_START]), int(seqs[s, K.S_LEN])
            new[top: top + length] = self.toks[start: start + length]
            seqs[s, K.S_START] = top
            seqs[s, K.S_CAP] = caps[s]
            top += caps[s]
        self.toks = new
        self._tok_top = top

    # ------------------------------------------------------------------ trees and sequences
    def new_tree(self) -> int:
        """Create an empty trie; returns its root id."""
        self._reserve_nodes(1)
        return int(K.alloc_node(self.nodes, self.meta))

    def drop_tree(self, root: int) -> None:
        """Free an empty trie's root. Raises ValueError if the trie still indexes something."""
        if self.nodes[root, K.FIRST] >= 0:
            raise ValueError(f"tree {root} is not empty")
        K.free_node(self.nodes, self.seqs, self.meta, root)

    def new_seq(self, root: int) -> int:
        """Start a live (appendable) sequence indexed into trie `root`; returns its id."""
        if self._free_seqs:
            sid = self._free_seqs.pop()
        else:
            sid = self._seq_top
            self._seq_top += 1
            if sid >= self.seqs.shape[0]:
                new = np.zeros((2 * self.seqs.shape[0], K.SF), np.int64)
                new[: self.seqs.shape[0]] = self.seqs
                self.seqs = new
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._slot_top
            self._slot_top += 1
            if slot >= self.act.shape[0]:
                new = np.zeros((2 * self.act.shape[0], self.config.max_depth), np.int32)
                new[: self.act.shape[0]] = self.act
                self.act = new
        self.seqs[sid] = (self._tok_top, 0, 0, root, 0, K.ST_LIVE, slot, 0)
        return sid

    def append(self, sid: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Append tokens (ints in [0, 2**31)) to live sequence `sid` and index them.

        Raises ValueError if `sid` is not live.
        """
        arr = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = arr.size
        if n == 0:
            return
        for lo in range(0, n, _CHUNK):
            chunk = arr[lo: lo + _CHUNK] if n > _CHUNK else arr
            while True:
                rc = K.append_tokens(self.nodes, self.ht, self.seqs, self.toks, self.act,
                                     self.meta, sid, chunk)
                if rc == 0:
                    break
                self.make_room(rc, sid, chunk.size)
        self._indexed += n

    def make_room(self, rc: int, sid: int, n_tokens: int) -> None:
        """Grow what `_kernels.append_tokens` returned `rc` for (1: nodes and hash slots for
        n_tokens more tokens, 2: sequence sid's token storage for n_tokens more); ValueError
        for 3 (sid is not live) and anything else."""
        if rc == 1:
            self._reserve_nodes(n_tokens * self.config.max_depth)
        elif rc == 2:
            self._reserve_tokens(sid, n_tokens)
        else:
            raise ValueError(f"sequence {sid} is not live")

    def count_indexed(self, n_tokens: int) -> None:
        """Record n_tokens appended by a kernel outside `append` (see `indexed_tokens`)."""
        self._indexed += int(n_tokens)

    def freeze(self, sid: int) -> None:
        """End appends to `sid`; it stays indexed."""
        row = self.seqs[sid]
        if row[K.S_STATE] == K.ST_LIVE:
            self._free_slots.append(int(row[K.S_SLOT]))
            row[K.S_SLOT] = -1
            row[K.S_STATE] = K.ST_FROZEN

    def remove(self, sid: int) -> None:
        """Un-index sequence `sid` (live or frozen); its id becomes reusable."""
        self.freeze(sid)
        if self.seqs[sid, K.S_STATE] != K.ST_FROZEN:
            raise ValueError(f"sequence {sid} is not indexed")
        rc = K.remove_sequence(self.nodes, self.ht, self.seqs, self.toks, self.meta, sid,
                               self._stack)
        if rc != 0:
            raise RuntimeError(f"suffix trie invariant broken while removing sequence {sid}")
        self._indexed -= int(self.seqs[sid, K.S_LEN])
        self.seqs[sid, K.S_STATE] = K.ST_DEAD
        self._dead.add(sid)
        self._sweep()

    def _sweep(self):
        """Recycle removed sequences no node refers to any more."""
        for sid in [s for s in self._dead if self.seqs[s, K.S_NREF] == 0]:
            self._dead.discard(sid)
            self.seqs[sid] = 0
            self._free_seqs.append(sid)

    def seq_len(self, sid: int) -> int:
        return int(self.seqs[sid, K.S_LEN])

    def seq_tokens(self, sid: int) -> np.ndarray:
        """int32 copy of sequence `sid`'s tokens."""
        start, length = int(self.seqs[sid, K.S_START]), int(self.seqs[sid, K.S_LEN])
        return self.toks[start: start + length].copy()

    # ------------------------------------------------------------------ drafting
    def propose(self, root: int, context: np.ndarray, max_tokens: int,
                own_seq: int = -1) -> ScoredDraft:
        """Draft from trie `root` for `context` (int32 [n]); see the module docstring.

        `own_seq`: the requester's live sequence in this trie, whose tokens are the tail of
        `context` (-1 if none); its occurrences ending at its end (which have no continuation
        yet) are left out of the counts. Returns a ScoredDraft whose draft has at most
        max(0, max_tokens) tokens.
        """
        if max_tokens <= 0 or context.shape[0] == 0:
            return _EMPTY
        cfg = self.config
        k, m, score = K.propose(self.nodes, self.ht, self.seqs, self.toks, self.act, self.meta,
                                root, context, own_seq, max_tokens, cfg.min_token_prob,
                                cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_match_len,
                                self._match_nodes, self._out_t, self._out_p, self._out_c,
                                self._tmp_t, self._tmp_p, self._tmp_c)
        if k == 0:
            return _EMPTY
        return ScoredDraft(Draft(self._out_t[:k].copy(), self._out_p[:k].copy(),
                                 self._out_c[:k].copy()), int(m),
                           float(score))

    # ------------------------------------------------------------------ introspection
    @property
    def num_nodes(self) -> int:
        """Live nodes, roots included."""
        return int(self.meta[K.M_LIVE])

    @property
    def indexed_tokens(self) -> int:
        """Tokens of all indexed (live or frozen) sequences."""
        return self._indexed

    def nbytes(self) -> int:
        """Bytes held by the pool's arrays (allocated capacity, not just the used part)."""
        return sum(a.nbytes for a in (self.nodes, self.ht, self.seqs, self.toks,
                                      self.act, self.meta))

    def used_bytes(self) -> int:
        """Bytes of the used part: live nodes, occupied hash slots, stored tokens, sequences."""
        seqs = self.seqs[: self._seq_top]
        alive = seqs[seqs[:, K.S_STATE] != K.ST_FREE]
        return int(self.num_nodes * K.NF * 4 + self.meta[K.M_HCOUNT] * 12
                   + alive[:, K.S_LEN].sum() * 4 + len(alive) * K.SF * 8)

    def dump(self, root: int) -> dict[tuple[int, ...], int]:
        """Canonical content of trie `root`: {path (token tuple): count} for every path.

        Independent of how nodes are compressed; for tests (Python loops, slow).
        """
        out: dict[tuple[int, ...], int] = {}
        nodes = self.nodes
        stack = [root]
        while stack:
            n = stack.pop()
            c = int(nodes[n, K.FIRST])
            while c >= 0:
                depth = int(K.depth_of(nodes, self.seqs, self.meta, c))
                start = int(self.seqs[nodes[c, K.REF_SEQ], K.S_START] + K.path_start(nodes, c))
                path = tuple(int(x) for x in self.toks[start: start + depth])
                for dd in range(int(nodes[n, K.DEPTH]) + 1, depth + 1):
                    out[path[:dd]] = int(nodes[c, K.COUNT])
                stack.append(c)
                c = int(nodes[c, K.NEXT])
        return out

    def check(self, root: int) -> int:
        """Verify structural invariants of trie `root`; returns its node count (root excluded).

        Raises AssertionError on: depth not increasing or above max_depth, a child count above
        its parent's, a missing/incorrect hash entry, or a non-canonical-looking dead node.
        """
        nodes, n_nodes, stack = self.nodes, 0, [root]
        while stack:
            n = stack.pop()
            c = int(nodes[n, K.FIRST])
            total = 0
            while c >= 0:
                n_nodes += 1
                assert nodes[c, K.PARENT] == n
                depth = K.depth_of(nodes, self.seqs, self.meta, c)
                assert nodes[n, K.DEPTH] >= 0, "a lazy leaf has children"
                assert nodes[n, K.DEPTH] < depth <= self.config.max_depth
                assert nodes[c, K.COUNT] >= 1
                if nodes[c, K.DEPTH] < 0:
                    assert nodes[c, K.COUNT] == 1 and nodes[c, K.FIRST] < 0
                tok = K.edge_tok(nodes, self.seqs, self.toks, c, int(nodes[n, K.DEPTH]))
                assert nodes[c, K.TOK0] == tok, "a stale first edge token"
                assert K.child(nodes, self.ht, self.seqs, self.toks, n, tok) == c
                assert self.seqs[nodes[c, K.REF_SEQ], K.S_STATE] != K.ST_FREE
                total += int(nodes[c, K.COUNT])
                stack.append(c)
                c = int(nodes[c, K.NEXT])
            if n != root:
                assert total <= nodes[n, K.COUNT]
        return n_nodes

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Plain-python / numpy state (plain data: see das_jax.rl.checkpoint.encode_state)."""
        high = int(self.meta[K.M_HIGH])
        return {
            "config": dataclasses.asdict(self.config),
            "nodes": self.nodes[:high].copy(), "ht": self.ht.copy(),
            "seqs": self.seqs[: self._seq_top].copy(), "toks": self.toks[: self._tok_top].copy(),
            "act": self.act[: self._slot_top].copy(), "meta": self.meta.copy(),
            "free_seqs": list(self._free_seqs), "dead": sorted(self._dead),
            "free_slots": list(self._free_slots), "indexed": self._indexed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output. Raises ValueError on a config mismatch."""
        cfg = SuffixTreeConfig(**state["config"])
        if cfg != self.config:
            raise ValueError(f"checkpoint config {cfg} != forest config {self.config}")
        d = cfg.max_depth
        saved = np.asarray(state["nodes"], np.int32)
        if saved.ndim != 2:
            saved = saved.reshape(-1, K.NF)
        self.nodes = np.zeros((max(256, 2 * len(saved)), K.NF), np.int32)
        self.nodes[: len(saved), : saved.shape[1]] = saved
        self.ht = np.array(state["ht"], np.int32)
        self._seq_top = len(state["seqs"])
        self.seqs = np.zeros((max(16, 2 * self._seq_top), K.SF), np.int64)
        self.seqs[: self._seq_top] = state["seqs"]
        self._tok_top = len(state["toks"])
        self.toks = np.zeros(max(4096, 2 * self._tok_top), np.int32)
        self.toks[: self._tok_top] = state["toks"]
        self._slot_top = len(state["act"])
        self.act = np.zeros((max(4, 2 * self._slot_top), d), np.int32)
        self.act[: self._slot_top] = state["act"]
        self.meta = np.array(state["meta"], np.int64)
        if saved.shape[1] < K.NF:       # saved before TOK0: read it off the paths
            K.fill_tok0(self.nodes, self.seqs, self.toks, len(saved))
        self._free_seqs = list(state["free_seqs"])
        self._dead = set(state["dead"])
        self._free_slots = list(state["free_slots"])
        self._indexed = int(state["indexed"])
        self._scratch()


class SuffixTree:
    """One suffix trie over sequences named by caller-chosen int ids (a `SuffixForest` view).

    Example:
      tree = SuffixTree(SuffixTreeConfig(max_depth=24))
      tree.append(0, [5, 6, 7, 5, 6])
      tree.propose(np.array([1, 5, 6], np.int32), max_tokens=4)   # Draft([7, 5, 6], ...)
    """

    def __init__(self, config: SuffixTreeConfig = SuffixTreeConfig(),
                 forest: SuffixForest | None = None):
        self.forest = forest if forest is not None else SuffixForest(config)
        self.config = self.forest.config
        self.root = self.forest.new_tree()
        self._sids: dict[int, int] = {}

    def append(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Append tokens to sequence `seq_id` (created on first use). ValueError if frozen."""
        sid = self._sids.get(seq_id)
        if sid is None:
            sid = self._sids[seq_id] = self.forest.new_seq(self.root)
        self.forest.append(sid, tokens)

    def freeze(self, seq_id: int) -> None:
        """No more appends to `seq_id`; it stays indexed. KeyError if unknown."""
        self.forest.freeze(self._sids[seq_id])

    def remove(self, seq_id: int) -> None:
        """Un-index sequence `seq_id`. KeyError if unknown."""
        self.forest.remove(self._sids.pop(seq_id))

    def propose(self, context: Sequence[int] | np.ndarray, max_tokens: int,
                own_seq: int | None = None) -> Draft:
        """Draft (int32 [k], float32 [k], k <= max_tokens) continuing `context`.

        `own_seq`: id of a live sequence of this tree whose tokens end `context` (the
        requester's own rollout); its trailing occurrences are not counted. KeyError if unknown.
        """
        return self.propose_scored(context, max_tokens, own_seq).draft

    def propose_scored(self, context, max_tokens: int, own_seq: int | None = None) -> ScoredDraft:
        ctx = np.ascontiguousarray(context, dtype=np.int32).reshape(-1)
        own = -1 if own_seq is None else self._sids[own_seq]
        return self.forest.propose(self.root, ctx, max_tokens, own)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._sids)

    @property
    def num_nodes(self) -> int:
        """Nodes of this trie (root excluded)."""
        return self.forest.check(self.root)

    def dump(self) -> dict[tuple[int, ...], int]:
        return self.forest.dump(self.root)

    def check(self) -> int:
        return self.forest.check(self.root)


def draft_limit(match_len: int, max_tokens: int, config: SuffixTreeConfig) -> int:
    """Most draft tokens a match of `match_len` allows (the rule `propose` applies)."""
    return min(max_tokens, math.ceil(match_len * config.max_spec_factor + config.max_spec_offset),
               config.max_depth - match_len)
