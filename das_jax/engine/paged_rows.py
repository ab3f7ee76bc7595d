"""`PagedRows`: the host side of an executor on a page pool, shared by the engine's
`PagedExecutor` and the trace replay's paged executor, so both admit, place, preempt and free
by the same rules (vLLM's scheduler: admission by free pages, recompute preemption of the row
admitted last).

What it owns: the `pages.PagePool` (`pool`), which rows run a request (`row_live`), and the
requests being resumed after a preemption (`resumed`: request id -> the tokens it prefills). It
uses the executor's `prompt_rows` (`schedule.PromptRows`: which prompt each row holds) and asks
the executor two things: `request_prompt(ri)` (a request's prompt ids) and `shares_prompts()`
(whether admissions share a held prompt). Everything here is numpy bookkeeping; the device
side (uploading the table, the programs) stays in the executor.
"""
from __future__ import annotations

import numpy as np

from das_jax.engine.pages import PagePool, PoolExhausted
from das_jax.models.paged_kv_cache import pages_for


class PagedRows:
    """Mixin: page-pool admission, placement, preemption and release (module docstring)."""

    pool: PagePool

    def start_pool(self, pages: tuple, batch: int, cache_len: int) -> None:
        """A pool of `pages` = (num_pages, page_size[, kernel]) for `batch` rows of
        `cache_len`."""
        self.pool = PagePool(*pages[:2], batch, cache_len)
        self.resumed: dict[int, tuple] = {}     # resumed request -> the tokens it prefills
        self.row_live = np.zeros(batch, bool)   # rows with a running request

    def request_prompt(self, request_id: int) -> tuple[int, ...]:
        raise NotImplementedError

    def shares_prompts(self) -> bool:
        raise NotImplementedError

    def prompt_of(self, request_id: int) -> tuple[int, ...]:
        """The prompt, or for a resumed request its prompt and the tokens it had committed
        but the last."""
        return self.resumed.get(request_id) or self.request_prompt(request_id)

    def _idle_rows(self, keep=()) -> np.ndarray:
        """Rows without a running request that hold pages (finished rows' prompts), but
        `keep`."""
        idle = np.flatnonzero((self.pool.held > 0) & ~self.row_live)
        return idle[~np.isin(idle, np.asarray(keep, np.int64))]

    def _reclaim(self, need: int, keep=()) -> None:
        """When fewer than `need` pages are free, rows without a running request (but `keep`)
        give back their prompts' pages."""
        if self.pool.free_pages < need:
            idle = self._idle_rows(keep)
            self.pool.release(idle)
            for r in idle:
                self.prompt_rows.rows[int(r)] = None

    def release(self, rows: np.ndarray) -> None:
        """Rows whose requests finished free their completion's pages at once; with prompt
        sharing they keep their prompt's pages (a later sibling shares them) until the row is
        refilled or compacted away, or the pool needs them, as a dense row keeps its prompt."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        self.row_live[rows] = False
        if self.shares_prompts():
            self.pool.truncate(rows, [len(self.prompt_rows.rows[r] or ()) for r in rows])
        else:
            self.pool.release(rows)

    def admissible(self, request_ids, lengths, live: int) -> int:
        """How many of the queued requests `request_ids` (front first; an admission writes
        `lengths[j]` positions) fit the free pages now, keeping one page per live and admitted
        row for its next step; a prompt a row holds (or an earlier one of these) costs only its
        partial last page."""
        idle = self._idle_rows()
        ids = np.concatenate([self.pool.row_pages(r) for r in idle] or [np.zeros(0, np.int32)])
        u, c = np.unique(ids, return_counts=True)
        budget = self.pool.free_pages + int((self.pool.refs[u] == c).sum()) - live
        held = {p for r, p in enumerate(self.prompt_rows.rows) if p is not None
                and self.row_live[r]}
        seen: set = set()
        for k, (ri, n) in enumerate(zip(request_ids, lengths)):
            p = self.request_prompt(ri)
            fresh = int(n) == len(p)      # not a resumed request (that prefills more than p)
            shared = fresh and (p in held or p in seen)
            budget -= (1 if shared else int(pages_for(int(n), self.pool.page_size))) + 1
            if budget < 0:
                return k
            if fresh:
                seen.add(p)
        return len(request_ids)

    def make_room(self, live: np.ndarray, lengths_A: np.ndarray, order_A: np.ndarray
                  ) -> np.ndarray:
        """Pages for positions `[0, lengths_A[j])` of every live row; when the pool is short,
        first the rows without a running request give back their prompts' pages, then the live
        rows admitted last (largest `order_A`) are preempted (their pages freed) until the
        others fit. Returns the preempted rows.

        Raises:
          PoolExhausted: one row alone does not fit the pool (names `rollout.kv_memory_gb`).
        """
        live = np.asarray(live, np.int64)
        lengths_A = np.asarray(lengths_A, np.int64)
        keep = np.ones(len(live), bool)
        page = self.pool.page_size

        def need() -> int:
            return int(np.maximum(pages_for(lengths_A, page) - self.pool.held[live], 0)[keep]
                       .sum())

        self._reclaim(need())
        victims: list[int] = []
        for j in np.argsort(-np.asarray(order_A), kind="stable"):
            if need() <= self.pool.free_pages or keep.sum() <= 1:
                break
            keep[j] = False
            victims.append(int(live[j]))
            self.pool.release([live[j]])
            self.row_live[live[j]] = False
            self.prompt_rows.rows[int(live[j])] = None
        if need() > self.pool.free_pages:
            raise PoolExhausted(
                f"the KV page pool ({self.pool.num_pages} pages of {page} positions) cannot hold "
                f"one row of {int(lengths_A[keep].max())} positions; raise rollout.kv_memory_gb")
        self.pool.ensure(live[keep], lengths_A[keep])
        return np.asarray(victims, np.int64)

    def begin_admission(self, rows, resumed: dict | None) -> None:
        """Before an admission into `rows`: the resumed requests' prefilled tokens (request id
        -> the int tokens it had committed; all but the last are prefilled), and the rows
        marked running (their old pages are released as they are refilled)."""
        self.resumed = {ri: self.request_prompt(ri) + tuple(int(t) for t in toks[:-1])
                        for ri, toks in (resumed or {}).items()}
        self.row_live[np.asarray(rows)] = True

    def end_admission(self, request_ids, rows, resumed: dict | None) -> None:
        """After an admission: a resumed request's row holds more than a prompt (no sibling
        shares it), and nothing is being resumed any more."""
        for ri, row in zip(request_ids, rows):
            if ri in (resumed or {}):
                self.prompt_rows.rows[int(row)] = None
        self.resumed = {}

    def place_prompts(self, rows, prompts) -> None:
        """Pages for the prompts prefilled into `rows` (what the rows held before is released):
        each prompt held once, by its first row, whose pages the others share."""
        self.pool.release(rows)
        self._reclaim(sum(int(pages_for(len(p), self.pool.page_size)) for p in prompts))
        owner: dict[tuple, int] = {}
        for p, r in zip(prompts, rows):
            if p in owner:
                self.pool.share([int(r)], [owner[p]], [len(p)])
            else:
                owner[p] = int(r)
                self.pool.ensure([int(r)], [len(p)])

    def share_prompts(self, rows, src_rows, prompts) -> list:
        """Rows `rows` point at the pages of rows `src_rows` (which hold `prompts`): full
        pages shared, each partial last page to copy (`PagePool.share`'s copies)."""
        self._reclaim(len(rows), keep=list(src_rows))
        return self.pool.share(rows, src_rows, [len(p) for p in prompts])

    def compact_pool(self, live: np.ndarray, new_batch: int) -> None:
        """The pool's table and `row_live` compacted to the rows `live` (in order)."""
        self.pool.compact(live, new_batch)
        self.row_live = np.concatenate([self.row_live[np.asarray(live, np.int64)],
                                        np.zeros(new_batch - len(live), bool)])
