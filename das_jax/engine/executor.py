"""`DeviceExecutor`: the engine's `scheduler.StepExecutor`, jitted programs on a donated KV cache.

It keeps the device side of every cache row: the KV cache `[B, S]`, the pending token (sampled,
not yet fed) and the request seed per row, and turns each of the scheduler's calls into one
typed batch (`das_jax.engine.specs`) run by the engine's `Programs`:

* admission (`prefill`): `PrefillBatch` (the admitted unique prompts concatenated in N slots,
  `step.prefill_packed`), and with `EngineConfig.share_prompts`, `ShareBatch` for requests whose
  prompt a cache row already holds (`step.share_prompt_rows`, no forward pass);
* `verify`: `VerifyBatch` (each live row's pending token and drafts, `step.verify_packed`);
* `decode`: `DecodeBatch` (up to k plain decode steps in one call, `step.decode_steps`);
* `compact`: `GatherBatch` (`step.gather_rows`).

Steps are timed with the real clock; compilation is excluded (`Programs.compile_s` counts it).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from das_jax.engine import scheduler
from das_jax.engine.engine_config import Request
from das_jax.engine.sampling import SamplingParams, request_seed
from das_jax.engine.schedule import (PromptRows, bucket, compact_rows, prefill_chunks,
                                     prompt_bucket)
from das_jax.engine.specs import (DecodeBatch, DecodeSpec, GatherBatch, GatherSpec, PrefillBatch,
                                  ShareBatch, ShareSpec, VerifyBatch, VerifySpec)
from das_jax.models.transformer import Params


class DeviceExecutor:
    """The engine's `scheduler.StepExecutor` (module docstring).

    Args:
      engine: the `Engine` (its model config, `engine_config` and `programs`).
      requests: the call's requests (request ids index them).
      sampling: the call's `SamplingParams`.
      params: params placed where the engine computes.
      draft_model: optional `step_io.DraftModel` (a draft head): the prefill and verify
        programs then also return its features, it drafts on device after each of them, and
        `model_drafts` gives its latest drafts per row.
    """

    share_prompts_supported = True

    def __init__(self, engine: Any, requests: Sequence[Request],
                 sampling: SamplingParams, params: Params, draft_model=None):
        self.draft_model = draft_model
        self.feature_layers = tuple(draft_model.feature_layers) if draft_model else ()
        self.config = engine.config
        self.engine_config = engine.engine_config
        self.programs = engine.programs
        self.requests = requests
        self.params = params
        self.skey = sampling.static_key()
        self.dtype = jnp.dtype(params["embed"].dtype).name
        self.seeds = np.array([r.seed if r.seed is not None else
                               request_seed(sampling.seed, r.problem_id, r.sample_index)
                               for r in requests], np.int64).astype(np.int32)

    pages: tuple = ()   # the dense cache (`PagedExecutor`: (num_pages, page_size))
    # seconds of the draft model's calls outside the steps (its admissions; compiles excluded)
    draft_model_s: float = 0.0

    def start(self, batch: int, cache_len: int) -> None:
        self.S = cache_len
        self.cache = self.programs.zeros_cache(batch, cache_len, self.dtype, self.pages)
        self.pending = np.zeros(batch, np.int32)       # sampled, not yet fed token per row
        self.row_seed = np.zeros(batch, np.int32)
        # Prompt sharing (EngineConfig.share_prompts): the prompt whose K/V each row holds in
        # positions [0, len), and each such prompt's last-position logits.
        self.prompt_rows = PromptRows(batch)
        self.prompt_logits: dict[tuple, np.ndarray] = {}
        if self.draft_model is not None:
            self.draft_model.start(self.programs, batch, cache_len, self.params)
            J = self.draft_model.steps
            self.model_tok = np.zeros((batch, J), np.int32)    # latest drafts per row
            self.model_probs = np.zeros((batch, J), np.float32)
            # admitted rows whose prefilled positions the draft model has not seen yet (row ->
            # the tokens prefilled), and each prefilled sequence's features (device [n, F*D],
            # kept while a row holds the prompt)
            self.model_pending: dict[int, tuple] = {}
            self.prompt_feats: dict[tuple, Any] = {}

    def prefill(self, request_ids: Sequence[int], rows: np.ndarray,
                batch: int) -> scheduler.Prefilled:
        t0, compiled_before = time.perf_counter(), self.programs.compile_s
        take, rows = list(request_ids), np.asarray(rows)
        prompts = [self.prompt_of(i) for i in take]
        first = np.zeros(len(take), np.int32)
        first_logp = np.zeros(len(take), np.float32)
        share = self.engine_config.share_prompts and self.share_prompts_supported
        shared, sources, computed, flags = (self.prompt_rows.split(prompts, rows) if share
                                            else ([], [], list(range(len(take))), None))
        if shared:   # before the prefill: it may overwrite a source row
            self._share(batch, [take[k] for k in shared], rows[shared], sources,
                        [prompts[k] for k in shared], first, first_logp, shared, flags)
        tokens = 0
        if computed:
            tokens = self._compute(batch, [take[k] for k in computed], rows[computed], first,
                                   first_logp, computed, share)
        for k, (ri, row) in enumerate(zip(take, rows)):
            self.pending[row] = first[k]
            self.row_seed[row] = self.seeds[ri]
        if self.draft_model is not None:
            for row, p in zip(rows, prompts):
                self.model_pending[int(row)] = p
        if share:
            self.prompt_rows.admit(rows, prompts)
            held = self.prompt_rows.held()
            self.prompt_logits = {p: v for p, v in self.prompt_logits.items() if p in held}
        # compile time excluded, as from the verify step's seconds (it counts in compile_s)
        seconds = time.perf_counter() - t0 - (self.programs.compile_s - compiled_before)
        return scheduler.Prefilled(first, first_logp, seconds, tokens)

    def prompt_of(self, request_id: int) -> tuple[int, ...]:
        """The token ids an admission of `request_id` prefills (its prompt)."""
        return tuple(int(t) for t in self.requests[request_id].prompt_ids)

    def _layout(self, take, batch: int, packed: bool) -> scheduler.PrefillLayout:
        ec = self.engine_config
        return scheduler.prefill_layout([self.prompt_of(i) for i in take],
                                        ec.batch_buckets, ec.min_prompt_bucket, self.S,
                                        packed_batch=batch if packed else None)

    def _compute(self, batch, take, rows, first, first_logp, where, with_logits) -> int:
        """Prefills requests `take` into `rows` (`step.prefill_packed`, one call per chunk of
        `schedule.prefill_chunks` under `EngineConfig.max_prefill_tokens`); writes their first
        tokens / log-probs at `where`; returns the token slots computed."""
        ec = self.engine_config
        calls = prefill_chunks([self.prompt_of(i) for i in take], ec.batch_buckets,
                               ec.min_prompt_bucket, self.S, ec.max_prefill_tokens)
        where = np.asarray(where)
        return sum(self._compute_call(batch, [take[k] for k in ks], rows[ks], first,
                                      first_logp, where[ks], with_logits) for ks in calls)

    def _compute_call(self, batch, take, rows, first, first_logp, where, with_logits) -> int:
        """One packed prefill call of `_compute`."""
        lay = self._layout(take, batch, packed=True)
        pb = PrefillBatch.pack(self.config, self.skey, self.S, self.dtype, lay.U, lay.T,
                               lay.prompts, lay.src, rows, self.seeds[take], batch, with_logits,
                               self.pages, self.feature_layers)
        out = self.programs.run(self.params, self.cache, pb)
        self.cache, first_R, first_logp_R = out[:3]
        if self.feature_layers:    # device array [U, T, F*D]: prompt u in block row u
            for u, p in enumerate(lay.prompts):
                self.prompt_feats[p] = out[-1][u, :len(p)]
        first[where] = np.asarray(first_R)[:len(take)]
        first_logp[where] = np.asarray(first_logp_R)[:len(take)]
        if with_logits:
            logits = np.asarray(out[3])
            for k, u in enumerate(lay.src):
                self.prompt_logits.setdefault(lay.prompts[u], logits[k])
        return lay.tokens

    def _share(self, batch, take, rows, src_rows, prompts, first, first_logp, where,
               flags) -> None:
        """Admits requests `take` into `rows` by copying the prompt positions of cache rows
        `src_rows` (which hold their prompts; in this order, with the stash `flags` of
        `PromptRows.split`) and sampling from the stored logits (`step.share_prompt_rows`)."""
        width = prompt_bucket(max(len(p) for p in prompts),
                              self.engine_config.min_prompt_bucket, self.S)
        spec = ShareSpec(self.config, self.skey, batch, width, self.S, self.dtype)
        sb = ShareBatch.pack(spec, rows, src_rows, [self.prompt_logits[p] for p in prompts],
                             self.seeds[take], [len(p) for p in prompts], *flags)
        self.cache, tok_B, logp_B = self.programs.run(self.params, self.cache, sb)
        first[where] = np.asarray(tok_B)[:len(take)]
        first_logp[where] = np.asarray(logp_B)[:len(take)]

    # ------------------------------------------------------------------ draft model
    def model_drafts(self, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`StepExecutor.model_drafts`: the draft model's latest drafts of cache rows `live`
        (admissions it has not seen yet are committed to it first)."""
        self._admit_to_model()
        return self.model_tok[live], self.model_probs[live]

    def _admit_to_model(self) -> None:
        """Commits the admitted rows' prefilled positions to the draft model (one call for
        every row admitted since the last), with the token after each position: the next
        prefilled token, then the row's pending token."""
        if self.draft_model is None or not self.model_pending:
            return
        t0, compiled_at_t0 = time.perf_counter(), self.programs.compile_s
        rows = list(self.model_pending)
        seqs = [self.model_pending[r] for r in rows]
        ec = self.engine_config
        T = prompt_bucket(max(len(q) for q in seqs), ec.min_prompt_bucket, self.S)
        R = bucket(len(rows), ec.batch_buckets)
        parts = [jnp.pad(self.prompt_feats[q], ((0, T - len(q)), (0, 0))) for q in seqs]
        FD = parts[0].shape[-1]
        parts += [self.programs.put(np.zeros((T, FD), np.float32))] * (R - len(rows))
        feats_RxTxFD = jnp.stack(parts)
        rows_R = np.full(R, self.model_tok.shape[0], np.int32)
        rows_R[:len(rows)] = rows
        next_RxT = np.zeros((R, T), np.int32)
        n_R = np.zeros(R, np.int32)
        for i, (row, q) in enumerate(zip(rows, seqs)):
            next_RxT[i, :len(q)] = q[1:] + (int(self.pending[row]),)
            n_R[i] = len(q)
        tok, p = self.draft_model.admit(rows_R, feats_RxTxFD, next_RxT, n_R)
        self.model_tok[rows_R[:len(rows)]] = np.asarray(tok)[:len(rows)]
        self.model_probs[rows_R[:len(rows)]] = np.asarray(p)[:len(rows)]
        self.model_pending = {}
        held = self.prompt_rows.held() if self.engine_config.share_prompts else set()
        self.prompt_feats = {p: v for p, v in self.prompt_feats.items() if p in held}
        self.draft_model_s += (time.perf_counter() - t0
                               - (self.programs.compile_s - compiled_at_t0))

    def _compact_model(self, live: np.ndarray, new_batch: int) -> None:
        """The draft model's rows follow a compaction."""
        if self.draft_model is None:
            return
        self._admit_to_model()
        self.draft_model.compact(live, new_batch)
        self.model_tok, self.model_probs = compact_rows(live, new_batch, self.model_tok, 0,
                                                        self.model_probs, 0)

    def compact(self, live: np.ndarray, new_batch: int) -> None:
        self._compact_model(live, new_batch)
        nb = new_batch
        rows_nb = np.zeros(nb, np.int32)
        rows_nb[:len(live)] = live
        spec = GatherSpec(self.config, len(self.pending), nb, self.S, self.dtype)
        self.cache = self.programs.run(self.params, self.cache, GatherBatch(spec, rows_nb))
        self.pending, self.row_seed = compact_rows(live, nb, self.pending, 0, self.row_seed, 0)
        self.prompt_rows.compact(live, nb)

    def _verify_batch(self, st: scheduler.StepInput):
        """The typed batch of the step `st` plans (`VerifyBatch`)."""
        spec = VerifySpec(self.config, self.skey, st.batch, st.num_tokens, st.width, self.S,
                          st.kv_len, self.dtype, self.pages, self.feature_layers,
                          st.wide_rows, st.branch_rows)
        return VerifyBatch.pack(spec, st.cache_len_B, self.pending, self.row_seed, st.live,
                                st.drafts_AxK, st.n_draft_B, st.alt_AxK, st.n_alt_B)

    def verify(self, st: scheduler.StepInput) -> scheduler.StepOutput:
        self._admit_to_model()
        # the step's compile: its verify program's and the draft model's drafting after it (an
        # admission's compile above is not the step shape's price)
        compiled_before = self.programs.compile_s
        batch = self._verify_batch(st)
        exe = self.programs.executable(batch.spec, self.params, self.cache, batch)
        compiled_at_t0 = self.programs.compile_s
        t0 = time.perf_counter()
        self.cache, y_BxW, logp_BxW, n_emit_B, *feats = exe(self.params, self.cache, batch)
        won_B = feats.pop() if st.branch_rows else None     # a tree: (features or None, won)
        drafts = None
        if self.draft_model is not None:   # dispatched after the step, not waited for
            live_B = np.zeros(st.batch, bool)
            live_B[st.live] = True
            drafts = self.draft_model.extend(live_B, feats[0], y_BxW, n_emit_B,
                                             st.kv_len + st.width)
        if st.overlap is not None:      # dispatched: host work while the device computes
            st.overlap()
        y_BxW, logp_BxW, n_emit_B = np.asarray(y_BxW), np.asarray(logp_BxW), np.asarray(n_emit_B)
        if drafts is not None:
            self.model_tok[st.live] = np.asarray(drafts[0])[st.live]
            self.model_probs[st.live] = np.asarray(drafts[1])[st.live]
        # the step's seconds, the draft model's first compile (inside them) excluded
        seconds = time.perf_counter() - t0 - (self.programs.compile_s - compiled_at_t0)
        n_A = n_emit_B[st.live]
        self.pending[st.live] = y_BxW[st.live, n_A - 1]
        return scheduler.StepOutput(y_BxW[st.live], logp_BxW[st.live], n_A, seconds,
                                    compile_s=self.programs.compile_s - compiled_before,
                                    won_A=None if won_B is None else np.asarray(won_B)[st.live])

    def decode(self, st: scheduler.StepInput, steps: int, budget_A: np.ndarray,
               stop_ids: np.ndarray) -> scheduler.StepOutput:
        compiled_before = self.programs.compile_s
        spec = DecodeSpec(self.config, self.skey, st.batch, st.num_tokens, int(steps), self.S,
                          st.kv_len, tuple(int(t) for t in stop_ids), self.dtype, self.pages)
        batch = DecodeBatch.pack(spec, st.cache_len_B, self.pending, self.row_seed, st.live,
                                 budget_A)
        exe = self.programs.executable(spec, self.params, self.cache, batch)
        t0 = time.perf_counter()
        self.cache, y_BxK, logp_BxK, n_emit_B = exe(self.params, self.cache, batch)
        y_BxK, logp_BxK, n_emit_B = (np.asarray(y_BxK), np.asarray(logp_BxK),
                                     np.asarray(n_emit_B))
        seconds = time.perf_counter() - t0
        n_A = n_emit_B[st.live]
        self.pending[st.live] = y_BxK[st.live, np.maximum(n_A - 1, 0)]
        return scheduler.StepOutput(y_BxK[st.live], logp_BxK[st.live], n_A, seconds,
                                    compile_s=self.programs.compile_s - compiled_before)
