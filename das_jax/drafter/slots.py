"""`RequestSlots`: the active requests of a drafter as rows ("slots") of flat arrays, so that one
kernel call can draft or append for many requests (see `_batch_kernels`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

_ID_TABLE_LIMIT = 1 << 20    # request ids in [0, limit) map to slots through an array


class RequestSlots:
    """Slots of active requests: per slot the trie root it drafts from, its own sequence id in the
    forest, its output length, and its context (prompt + verified tokens) in a shared pool.

    Attributes (length >= slots ever used; rows of free slots are meaningless):
      root: int64 [S], trie root (-1: none). sid: int64 [S], own live sequence (-1: not indexed).
      shard: int64 [S], the history shard (forest) root and sid belong to (0 unsharded).
      rroot: int64 [S], the request's own trie in request forest rshard[s] of the drafter
        (-1: none); rsid: int64 [S], its live sequence there (prompt + verified tokens; -1:
        none); rshard: int64 [S], that forest (0 with one).
      out_len: int64 [S], tokens appended since `add`.
      mean_version: float64 [S], the mean policy version of the rollouts indexed for the slot's
        problem (`ProblemHistory.mean_version`; NaN: none), kept by the drafter.
      pool: int32 [P]; slot s's context is pool[ctx_start[s] : ctx_start[s] + ctx_len[s]]
        (int64 [S] each), with room for ctx_cap[s] tokens.

    Request ids map to slots through an int64 table (ids in [0, 2**20)) or a dict (others).
    Slots and pool room are recycled: `remove` frees them (the pool is repacked when full).
    """

    def __init__(self):
        self._table = np.full(64, -1, np.int64)
        self._far: dict[int, int] = {}
        self._free: list[int] = []
        self._slot_top = 0
        self._top = 0
        self._grow_slots(16)
        self.pool = np.zeros(4096, np.int32)

    def _grow_slots(self, n: int):
        old = getattr(self, "root", np.zeros(0, np.int64)).shape[0]
        if n <= old:
            return
        n = max(n, 2 * old)

        def grow(name, fill, dtype):
            a = np.full(n, fill, dtype)
            if old:
                a[:old] = getattr(self, name)
            setattr(self, name, a)
        grow("root", -1, np.int64)
        grow("sid", -1, np.int64)
        grow("shard", 0, np.int64)
        grow("rroot", -1, np.int64)
        grow("rsid", -1, np.int64)
        grow("rshard", 0, np.int64)
        grow("out_len", 0, np.int64)
        grow("ctx_start", 0, np.int64)
        grow("ctx_len", 0, np.int64)
        grow("ctx_cap", 0, np.int64)
        grow("lag", 0, np.int64)       # context tokens not yet indexed into the own sequence
        grow("mean_version", np.nan, np.float64)
        grow("live", False, bool)

    # ------------------------------------------------------------------ ids
    def __contains__(self, request_id: int) -> bool:
        try:
            self.slot(request_id)
        except KeyError:
            return False
        return True

    def slot(self, request_id: int) -> int:
        """The request's slot; KeyError if it is not active."""
        r = int(request_id)
        if 0 <= r < self._table.shape[0]:
            s = int(self._table[r])
            if s >= 0:
                return s
            raise KeyError(request_id)
        return self._far[r]

    def lookup(self, request_ids: np.ndarray) -> np.ndarray:
        """int64 [A] slots of request_ids (int64 [A]); KeyError naming the first unknown id."""
        ids = request_ids
        t = self._table
        if ids.shape[0] and ids.min() >= 0 and ids.max() < t.shape[0]:
            slots = t[ids]
            if slots.min() >= 0:
                return slots
        elif not ids.shape[0]:
            return np.zeros(0, np.int64)
        return np.array([self.slot(r) for r in ids.tolist()], np.int64)

    # ------------------------------------------------------------------ slots
    def add(self, request_id: int, prompt: Sequence[int] | np.ndarray) -> int:
        """A slot for a new request (ValueError if active) holding `prompt` as its context."""
        r = int(request_id)
        if r in self:
            raise ValueError(f"request {request_id} already active")
        if self._free:
            s = self._free.pop()
        else:
            s = self._slot_top
            self._slot_top += 1
            self._grow_slots(s + 1)
        if 0 <= r < _ID_TABLE_LIMIT:
            if r >= self._table.shape[0]:
                t = np.full(max(2 * self._table.shape[0], r + 1), -1, np.int64)
                t[: self._table.shape[0]] = self._table
                self._table = t
            self._table[r] = s
        else:
            self._far[r] = s
        arr = np.asarray(prompt, np.int32).reshape(-1)
        self.live[s] = True
        self.lag[s] = 0
        self.root[s], self.sid[s], self.out_len[s] = -1, -1, 0
        self.rroot[s], self.rsid[s], self.rshard[s] = -1, -1, 0
        self.shard[s] = 0
        self.mean_version[s] = np.nan
        self.ctx_len[s], self.ctx_cap[s] = 0, 0
        self.reserve(s, max(64, 2 * arr.size))
        self.pool[self.ctx_start[s]: self.ctx_start[s] + arr.size] = arr
        self.ctx_len[s] = arr.size
        return s

    def remove(self, request_id: int) -> int:
        """Free the request's slot (KeyError if not active); returns it."""
        s = self.slot(request_id)
        r = int(request_id)
        if 0 <= r < self._table.shape[0]:
            self._table[r] = -1
        else:
            del self._far[r]
        self.live[s] = False
        self.lag[s] = 0
        self.root[s], self.sid[s], self.out_len[s] = -1, -1, 0
        self.rroot[s], self.rsid[s], self.rshard[s] = -1, -1, 0
        self.ctx_len[s], self.ctx_cap[s] = 0, 0
        self._free.append(s)
        return s

    def context(self, s: int) -> np.ndarray:
        """int32 [n], slot s's context (a view: do not keep across appends)."""
        start = int(self.ctx_start[s])
        return self.pool[start: start + int(self.ctx_len[s])]

    def reserve(self, s: int, need: int) -> None:
        """Room for `need` context tokens in slot s (moves its context if needed)."""
        cap = int(self.ctx_cap[s])
        if need <= cap:
            return
        new_cap = max(2 * cap, need, 64)
        if self._top + new_cap > self.pool.shape[0]:
            self._repack(extra=new_cap)
        start, length = int(self.ctx_start[s]), int(self.ctx_len[s])
        self.pool[self._top: self._top + length] = self.pool[start: start + length]
        self.ctx_start[s] = self._top
        self.ctx_cap[s] = new_cap
        self._top += new_cap

    def _repack(self, extra: int):
        """Pack the live slots' contexts at the pool's start, growing it to >= 2x the room used."""
        live = np.nonzero(self.live[: self._slot_top])[0]
        used = int(self.ctx_cap[live].sum()) + extra
        size = self.pool.shape[0]
        while used * 2 > size:
            size *= 2
        new = np.zeros(size, np.int32)
        top = 0
        for s in live.tolist():
            start, length, cap = (int(self.ctx_start[s]), int(self.ctx_len[s]),
                                  int(self.ctx_cap[s]))
            new[top: top + length] = self.pool[start: start + length]
            self.ctx_start[s] = top
            top += cap
        self.pool = new
        self._top = top
