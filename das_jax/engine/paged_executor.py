"""`PagedExecutor`: the engine's executor on the paged KV cache (`EngineConfig.kv_cache: paged`).

The same programs as `DeviceExecutor` on a `PagedKVCache`, with the host's `pages.PagePool`
deciding where each row's positions live:

* before a step, each live row gets pages for the positions the step writes (its cache length
  + 1 + its drafts; + k for k decode steps), and the page table is uploaded when it changed;
* an admission prefills each unique prompt once into its first row's pages; the prompt's other
  rows point at those pages (a fresh page for the partial last one, which the prefill's write
  fills); a later sibling of a running row is admitted by `step.share_prompt_pages` (the
  partial last page copied, no forward pass);
* a finished row's completion pages are freed at once (`release`, called by the scheduler),
  so memory follows the live tokens (its prompt pages stay for later siblings until the row
  is refilled or compacted away); a compaction permutes the table (no device copy).

The pool holds the dense cache's positions (`batch x ceil(cache_len / page_size)` pages), so a
step never runs short of pages.
"""
from __future__ import annotations

import numpy as np

from das_jax.engine import scheduler
from das_jax.engine.executor import DeviceExecutor
from das_jax.engine.pages import PagePool
from das_jax.engine.schedule import compact_rows
from das_jax.engine.specs import SharePagesBatch, SharePagesSpec


class PagedExecutor(DeviceExecutor):
    """`DeviceExecutor` on the paged KV cache (module docstring). `pool` is the `PagePool`."""

    def start(self, batch: int, cache_len: int) -> None:
        self.pages = self.engine_config.paging(batch, cache_len)
        self.pool = PagePool(*self.pages, batch, cache_len)
        self._uploaded = -1
        super().start(batch, cache_len)

    def _sync(self) -> None:
        """Uploads the page table when the pool changed it."""
        if self._uploaded != self.pool.version:
            self.cache = self.cache.with_table(self.programs.put(self.pool.table))
            self._uploaded = self.pool.version

    def release(self, rows: np.ndarray) -> None:
        """Rows whose requests finished free their completion's pages at once; with prompt
        sharing they keep their prompt's pages (a later sibling shares them) until the row is
        refilled or compacted away, as a dense row keeps its prompt."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if self.engine_config.share_prompts and self.share_prompts_supported:
            self.pool.truncate(rows, [len(self.prompt_rows.rows[r] or ()) for r in rows])
        else:
            self.pool.release(rows)

    # ------------------------------------------------------------------ admission
    def _share(self, batch, take, rows, src_rows, prompts, first, first_logp, where,
               flags) -> None:
        """Admits requests `take` into `rows` on the pages of rows `src_rows` (which hold their
        prompts): full pages shared, each partial last page copied; first tokens sampled from
        the stored logits (`step.share_prompt_pages`). `flags` (the dense row copies' stash
        order) is not needed: `PagePool.share` reads every source before it frees a page."""
        del flags
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
        owner: dict[tuple, int] = {}
        for ri, r in zip(take, rows):
            p = tuple(int(t) for t in self.requests[ri].prompt_ids)
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
        self.pending, self.row_seed = compact_rows(live, new_batch, self.pending, 0,
                                                   self.row_seed, 0)
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

