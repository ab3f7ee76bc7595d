"""`PagePool`: the host side of the paged KV cache (`das_jax.models.paged_kv_cache`).

It owns which page holds which row's positions: a free list of the pool's P pages, a reference
count per page, and the page table `[B, MP]` the device programs read (P marks an unallocated
entry). Everything is numpy over arrays of rows (vLLM's block manager, in arrays):

* `ensure(rows, lengths)`: rows get pages for positions `[0, length)` (before a step writes
  them);
* `share(dst, src, lengths)`: rows `dst` point at rows `src`'s full pages of positions
  `[0, length)` (reference counts up) and get a fresh page for the partial last one, which the
  caller fills (a copy, or the prefill's write): a GRPO group holds its prompt once;
* `truncate(rows, lengths)` / `release(rows)`: a row's references past a length / all of them
  are dropped; pages at zero return to the free list at once;
* `compact(live, new_batch)`: the table's rows permuted (the device copies nothing).

`version` changes whenever the table does, so the executor uploads it only then.
"""
from __future__ import annotations

import numpy as np

from das_jax.models.paged_kv_cache import pages_for


class PoolExhausted(RuntimeError):
    """The page pool has fewer free pages than a step needs."""


class PagePool:
    """Free list, reference counts and page table of a paged KV cache (module docstring).

    Args:
      num_pages: P, pages in the pool.
      page_size: positions per page.
      batch: B, rows of the table.
      max_len: positions per row (the table has `ceil(max_len / page_size)` entries per row).
    """

    def __init__(self, num_pages: int, page_size: int, batch: int, max_len: int):
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.max_pages = int(pages_for(max_len, page_size))
        self.table = np.full((batch, self.max_pages), self.num_pages, np.int32)
        self.held = np.zeros(batch, np.int64)            # table entries in use per row
        self.refs = np.zeros(self.num_pages, np.int32)
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)  # a stack
        self._top = self.num_pages
        self.version = 0
        self.peak_used = 0

    # ------------------------------------------------------------------ counts
    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._top

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    def _take(self, n: int) -> np.ndarray:
        if n > self._top:
            raise PoolExhausted(f"the KV page pool has {self._top} free pages of "
                                f"{self.num_pages}, a step needs {n}")
        ids = self._free[self._top - n:self._top][::-1].copy()
        self._top -= n
        self.refs[ids] = 1
        self.peak_used = max(self.peak_used, self.used_pages)
        return ids

    def _drop(self, ids: np.ndarray) -> None:
        """Drops one reference to each page of `ids` (no repeats); frees those at zero."""
        if not len(ids):
            return
        self.refs[ids] -= 1
        freed = ids[self.refs[ids] == 0]
        self._free[self._top:self._top + len(freed)] = freed
        self._top += len(freed)

    # ------------------------------------------------------------------ row operations
    def ensure(self, rows, lengths) -> None:
        """Rows `rows` (int `[R]`, distinct) hold pages for positions `[0, lengths[j])`.

        Raises:
          PoolExhausted: not enough free pages (nothing is allocated then).
          ValueError: a length past the table (`max_len`).
        """
        rows = np.asarray(rows, np.int64)
        need_R = np.maximum(pages_for(np.asarray(lengths, np.int64), self.page_size)
                            - self.held[rows], 0)
        total = int(need_R.sum())
        if not total:
            return
        if int((self.held[rows] + need_R).max()) > self.max_pages:
            raise ValueError(f"a row needs more than {self.max_pages} pages "
                             f"({self.max_pages * self.page_size} positions)")
        ids = self._take(total)
        rows_T = np.repeat(rows, need_R)
        starts = np.cumsum(need_R) - need_R
        idx_T = self.held[rows_T] + np.arange(total) - np.repeat(starts, need_R)
        self.table[rows_T, idx_T] = ids
        self.held[rows] += need_R
        self.version += 1

    def share(self, dst, src, lengths) -> list[tuple[int, int] | None]:
        """Rows `dst[j]` take the pages of rows `src[j]` for positions `[0, lengths[j])`: the
        full pages shared (one more reference each), a fresh page for a partial last one; the
        pages `dst[j]` held before are released after every source was read, so a row may be
        both a destination and (for an earlier or later entry) a source. Returns per entry
        (source page, fresh page) of the partial last page, which the caller copies or writes
        before allocating again, or None when the length ends on a page boundary.

        Raises:
          PoolExhausted: fewer free pages than partial last pages (nothing changes then).
        """
        dst = [int(r) for r in np.asarray(dst).reshape(-1)]
        src = [int(r) for r in np.asarray(src).reshape(-1)]
        lengths = [int(n) for n in np.asarray(lengths).reshape(-1)]
        partial = sum(n % self.page_size > 0 for n in lengths)
        if partial > self._top:      # checked first: nothing is shared or allocated then
            raise PoolExhausted(f"the KV page pool has {self._top} free pages of "
                                f"{self.num_pages}, sharing needs {partial}")
        rows, copies = [], []
        for d, s_, n in zip(dst, src, lengths):
            full, partial = divmod(n, self.page_size)
            ids = self.table[s_, :full].copy()
            self.refs[ids] += 1
            if partial:
                new = int(self._take(1)[0])
                copies.append((int(self.table[s_, full]), new))
                ids = np.append(ids, new).astype(np.int32)
            else:
                copies.append(None)
            rows.append(ids)
        self.release(dst)
        for d, ids in zip(dst, rows):
            self.table[d, :len(ids)] = ids
            self.held[d] = len(ids)
        self.version += 1
        return copies

    def truncate(self, rows, lengths) -> None:
        """Rows `rows` keep only the pages of positions `[0, lengths[j])` (the others' references
        dropped)."""
        for r, n in zip(np.asarray(rows, np.int64).reshape(-1),
                        np.asarray(lengths, np.int64).reshape(-1)):
            keep, held = int(pages_for(int(n), self.page_size)), int(self.held[r])
            if held > keep:
                self._drop(self.table[r, keep:held].copy())
                self.table[r, keep:held] = self.num_pages
                self.held[r] = keep
                self.version += 1

    def release(self, rows) -> None:
        """Drops every page reference of rows `rows` (pages no other row holds are freed)."""
        for r in np.asarray(rows, np.int64).reshape(-1):
            n = int(self.held[r])
            if n:
                self._drop(self.table[r, :n].copy())
                self.table[r, :n] = self.num_pages
                self.held[r] = 0
                self.version += 1

    def compact(self, live, new_batch: int) -> None:
        """Rows `live` (in order) become rows 0..len(live)-1 of a `new_batch`-row table; the
        other rows' pages are released."""
        live = np.asarray(live, np.int64)
        self.release(np.setdiff1d(np.arange(self.batch), live))
        table = np.full((new_batch, self.max_pages), self.num_pages, np.int32)
        held = np.zeros(new_batch, np.int64)
        table[:len(live)] = self.table[live]
        held[:len(live)] = self.held[live]
        self.table, self.held = table, held
        self.version += 1

    def row_pages(self, row: int) -> np.ndarray:
        """The page ids row `row` holds, in position order."""
        return self.table[row, :int(self.held[row])].copy()


def expected_rows(num_pages: int, page_size: int, prompt_lens, completion_lens,
                  group: int = 1) -> float:
    """Rows a pool of `num_pages` pages holds at once, in expectation, under continuous batching
    of rollouts with these lengths (int arrays `[R]`, tokens): a row sampled at a random step is
    length-biased (a rollout of L tokens is live L steps) and holds its prompt's pages (the full
    ones shared by the `group` rows of a GRPO group, its own partial last page) plus the pages of
    a uniformly random share of its completion:

        E[pages per live row] = sum_r L_r * (prompt_r + L_r / 2) / sum_r L_r   (in pages)

    Returns num_pages / that (a float; the dense cache's rows are `num_pages / pages of
    max_cache_len`)."""
    p = np.asarray(prompt_lens, np.float64)
    L = np.maximum(np.asarray(completion_lens, np.float64), 1.0)
    prompt_pages = np.floor(p / page_size) / max(int(group), 1) + (p % page_size > 0)
    held = prompt_pages + (L / 2.0) / page_size + 0.5      # + half a page of rounding
    return float(num_pages / (np.sum(L * held) / np.sum(L)))
