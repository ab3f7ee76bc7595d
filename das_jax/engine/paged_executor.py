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

import jax
import numpy as np

from das_jax.engine import scheduler
from das_jax.engine.executor import DeviceExecutor
from das_jax.engine.paged_rows import PagedRows
from das_jax.engine.schedule import compact_rows
from das_jax.engine.specs import SharePagesBatch, SharePagesSpec


class PagedExecutor(PagedRows, DeviceExecutor):
    """`DeviceExecutor` on the paged KV cache (module docstring). `pool` is the `PagePool`;
    admission, placement, preemption and release are `PagedRows`'."""

    def start(self, batch: int, cache_len: int) -> None:
        self.pages = self.engine_config.paging(batch, cache_len)
        self.start_pool(self.pages, batch, cache_len)
        self._uploaded = -1
        self.kv_read_page = self.pages[1] if self._kernel_reads_pages() else None
        super().start(batch, cache_len)

    def _kernel_reads_pages(self) -> bool:
        """Whether attention reads each row's own pages (the Pallas kernel of "auto": programs
        lowered for TPU or CUDA, not in exact mode, `models.paged_attention`), so the scheduler
        prices a step by the pages its rows hold (`kv_read_page`); not where the pages are
        gathered into the bucket's dense view (CPU, exact mode, `paged_attention: gather`)."""
        if self.engine_config.paged_attention == "gather":
            return False
        device = self.programs.device or jax.devices()[0]
        return device.platform in ("tpu", "gpu", "cuda") and not self.config.contraction.exact

    def _sync(self) -> None:
        """Uploads the page table when the pool changed it."""
        if self._uploaded != self.pool.version:
            self.cache = self.cache.with_table(self.programs.put(self.pool.table))
            self._uploaded = self.pool.version

    def request_prompt(self, request_id: int) -> tuple[int, ...]:
        return DeviceExecutor.prompt_of(self, request_id)

    def shares_prompts(self) -> bool:
        return bool(self.engine_config.share_prompts and self.share_prompts_supported)

    # ------------------------------------------------------------------ admission
    def prefill(self, request_ids, rows: np.ndarray, batch: int,
                resumed: dict | None = None) -> scheduler.Prefilled:
        """`DeviceExecutor.prefill`; a request in `resumed` (request id -> the int tokens it
        had committed before it was preempted) prefills its prompt and those tokens but the
        last, which becomes its pending token (its sampled first token is dropped: the
        scheduler commits nothing for it)."""
        rows = np.asarray(rows)
        self.begin_admission(rows, resumed)
        try:
            out = super().prefill(request_ids, rows, batch)
        finally:
            self.end_admission(request_ids, rows, resumed)
        for ri, row in zip(request_ids, rows):
            if ri in (resumed or {}):
                self.pending[row] = int(resumed[ri][-1])
        return out

    def _share(self, batch, take, rows, src_rows, prompts, first, first_logp, where,
               flags) -> None:
        """Admits requests `take` into `rows` on the pages of rows `src_rows` (which hold their
        prompts): full pages shared, each partial last page copied; first tokens sampled from
        the stored logits (`step.share_prompt_pages`). `flags` (the dense row copies' stash
        order) is not needed: `PagePool.share` reads every source before it frees a page."""
        del flags
        copies = self.share_prompts(rows, src_rows, prompts)
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
        self.place_prompts(rows, [self.prompt_of(ri) for ri in take])
        self._sync()
        return super()._compute(batch, take, rows, first, first_logp, where, with_logits)

    # ------------------------------------------------------------------ steps
    def compact(self, live: np.ndarray, new_batch: int) -> None:
        self._compact_model(live, new_batch)
        self.compact_pool(live, new_batch)
        self.pending, self.row_seed = compact_rows(live, new_batch, self.pending, 0,
                                                   self.row_seed, 0)
        self.prompt_rows.compact(live, new_batch)

    def verify(self, st: scheduler.StepInput) -> scheduler.StepOutput:
        deepest = st.n_draft_B[st.live]          # a tree's branches share positions
        if st.n_alt_B is not None:
            deepest = np.maximum(deepest, st.n_alt_B[st.live])
        self.pool.ensure(st.live, st.cache_len_B[st.live] + 1 + deepest)
        self._sync()
        return super().verify(st)

    def decode(self, st: scheduler.StepInput, steps: int, budget_A: np.ndarray,
               stop_ids: np.ndarray) -> scheduler.StepOutput:
        self.pool.ensure(st.live, st.cache_len_B[st.live] + np.minimum(int(steps), budget_A))
        self._sync()
        return super().decode(st, steps, budget_A, stop_ids)
