"""`PagedExecutor`: the engine's executor on the paged KV cache (`EngineConfig.kv_cache: paged`).

The same programs as `DeviceExecutor` on a `PagedKVCache`, with the host's `pages.PagePool`
deciding where each row's positions live:

* before a call, each live row gets pages for every position the call may write (its cache
  length + the widest draft width, or + k for k decode steps: `make_room`), and the page table
  is uploaded when it changed;
* an admission prefills each unique prompt once into its first row's pages; the prompt's other
  rows point at those pages (a fresh page for the partial last one, which the prefill's write
  fills); a later sibling of a running row is admitted by `step.share_prompt_pages` (the
  partial last page copied, no forward pass);
* a finished row's completion pages are freed at once (`release`, called by the scheduler), so
  memory follows the live tokens; its prompt's pages stay for later siblings until the row is
  refilled, compacted away, or the pool needs them;
* a compaction permutes the table (no device copy).

Admission by free pages (`admissible`), as vLLM's scheduler does: a queued request is admitted
when its prompt's pages (only the partial last page for a prompt a row holds) plus one page per
live row fit. When the pool runs short mid-rollout, the row admitted last is preempted
(`make_room`): its pages are freed and its request goes back to the front of the queue; when it
is admitted again, its prompt and the tokens it had committed are prefilled (recompute, vLLM's
default) and it continues from its pending token, so its tokens are those of a run without
preemption (the sampling rule is keyed by position, not by the step).

The pool has `EngineConfig.kv_pages` pages (sized from `rollout.kv_memory_gb`), else the dense
cache's positions (`batch x ceil(cache_len / page_size)`), which never run short.
"""
from __future__ import annotations

import numpy as np

from das_jax.engine import scheduler
from das_jax.engine.executor import DeviceExecutor
from das_jax.engine.pages import PagePool, PoolExhausted
from das_jax.engine.schedule import compact_rows
from das_jax.engine.specs import SharePagesBatch, SharePagesSpec
from das_jax.models.paged_kv_cache import pages_for


class PagedExecutor(DeviceExecutor):
    """`DeviceExecutor` on the paged KV cache (module docstring). `pool` is the `PagePool`."""

    def start(self, batch: int, cache_len: int) -> None:
        self.pages = self.engine_config.paging(batch, cache_len)
        self.pool = PagePool(*self.pages, batch, cache_len)
        self._uploaded = -1
        self.resumed: dict[int, tuple] = {}     # resumed request -> the tokens it prefills
        self.row_live = np.zeros(batch, bool)   # rows with a running request
        super().start(batch, cache_len)

    def _sync(self) -> None:
        """Uploads the page table when the pool changed it."""
        if self._uploaded != self.pool.version:
            self.cache = self.cache.with_table(self.programs.put(self.pool.table))
            self._uploaded = self.pool.version

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
        if self.engine_config.share_prompts and self.share_prompts_supported:
            self.pool.truncate(rows, [len(self.prompt_rows.rows[r] or ()) for r in rows])
        else:
            self.pool.release(rows)

    # ------------------------------------------------------------------ admission
    def prompt_of(self, request_id: int) -> tuple[int, ...]:
        """The prompt, or for a resumed request its prompt and the tokens it had committed
        but the last."""
        return self.resumed.get(request_id) or super().prompt_of(request_id)

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
            p = super().prompt_of(ri)
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

    def prefill(self, request_ids, rows: np.ndarray, batch: int,
                resumed: dict | None = None) -> scheduler.Prefilled:
        """`DeviceExecutor.prefill`; a request in `resumed` (request id -> the int tokens it
        had committed before it was preempted) prefills its prompt and those tokens but the
        last, which becomes its pending token (its sampled first token is dropped: the
        scheduler commits nothing for it)."""
        resumed = resumed or {}
        self.resumed = {ri: super(PagedExecutor, self).prompt_of(ri)
                        + tuple(int(t) for t in toks[:-1]) for ri, toks in resumed.items()}
        rows = np.asarray(rows)
        self.row_live[rows] = True         # their old pages are released as they are refilled
        try:
            out = super().prefill(request_ids, rows, batch)
        finally:
            self.resumed = {}
        for ri, row in zip(request_ids, rows):
            if ri in resumed:
                self.pending[row] = int(resumed[ri][-1])
                self.prompt_rows.rows[int(row)] = None    # holds more than a prompt
        return out

    def _share(self, batch, take, rows, src_rows, prompts, first, first_logp, where,
               flags) -> None:
        """Admits requests `take` into `rows` on the pages of rows `src_rows` (which hold their
        prompts): full pages shared, each partial last page copied; first tokens sampled from
        the stored logits (`step.share_prompt_pages`). `flags` (the dense row copies' stash
        order) is not needed: `PagePool.share` reads every source before it frees a page."""
        del flags
        self._reclaim(len(rows), keep=list(src_rows))
        copies = self.pool.share(rows, src_rows, [len(p) for p in prompts])
        self._sync()
        spec = SharePagesSpec(self.config, self.skey, batch, self.S, self.dtype, self.pages)
        sb = SharePagesBatch.pack(spec, copies, [self.prompt_logits[p] for p in prompts],
                                  self.seeds[take], [len(p) for p in prompts])
        self.cache, tok_B, logp_B = self.programs.run(self.params, self.cache, sb)
        first[where] = np.asarray(tok_B)[:len(take)]
        first_logp[where] = np.asarray(logp_B)[:len(take)]

    def _compute(self, batch, take, rows, first, first_logp, where, with_logits) -> int:
        """Pages for the prompts, each held once per prompt (its first row's pages, shared by
        the others), then the packed prefill (`DeviceExecutor._compute`)."""
        self.pool.release(rows)          # what the rows held before (their last prompt)
        prompts = [self.prompt_of(ri) for ri in take]
        self._reclaim(sum(int(pages_for(len(p), self.pool.page_size)) for p in prompts))
        owner: dict[tuple, int] = {}
        for p, r in zip(prompts, rows):
            if p in owner:
                self.pool.share([int(r)], [owner[p]], [len(p)])
            else:
                owner[p] = int(r)
                self.pool.ensure([int(r)], [len(p)])
        self._sync()
        return super()._compute(batch, take, rows, first, first_logp, where, with_logits)

    # ------------------------------------------------------------------ steps
    def compact(self, live: np.ndarray, new_batch: int) -> None:
        self.pool.compact(live, new_batch)
        self.pending, self.row_seed, self.row_live = compact_rows(
            live, new_batch, self.pending, 0, self.row_seed, 0, self.row_live, False)
        self.prompt_rows.compact(live, new_batch)

    def verify(self, st: scheduler.StepInput) -> scheduler.StepOutput:
        self.pool.ensure(st.live, st.cache_len_B[st.live] + 1 + st.n_draft_B[st.live])
        self._sync()
        return super().verify(st)

    def decode(self, st: scheduler.StepInput, steps: int, budget_A: np.ndarray,
               stop_ids: np.ndarray) -> scheduler.StepOutput:
        self.pool.ensure(st.live, st.cache_len_B[st.live] + np.minimum(int(steps), budget_A))
        self._sync()
        return super().decode(st, steps, budget_A, stop_ids)
