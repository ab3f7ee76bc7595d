"""The engine's static settings and requests: `EngineConfig`, `Request`, `GenerateError`, and
the KV-memory sizing of the slot count (`size_slots`)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Hashable

import jax

from das_jax.models.config import LAYER_LOOPS, ModelConfig
from das_jax.models.paged_kv_cache import pages_for
from das_jax.models.transformer import KVCache


class GenerateError(ValueError):
    """Bad generation input, raised before anything is compiled (names the request and the fix)."""


#: `EngineConfig.paged_attention` values (`PagedKVCache.kernel` "auto" / "gather").
PAGED_ATTENTION = ("auto", "gather")
#: `rollout.kv_cache` values: "auto" resolves by `kv_cache_for`.
KV_CACHES = ("auto", "dense", "paged")


def kv_cache_for(kind: str, platform: str, devices_per_engine: int) -> str:
    """The KV cache `rollout.kv_cache: kind` runs: "dense" or "paged" as given; "auto" is
    "paged" on GPU and TPU where each engine (rollout replica) has one device (the paged cache
    runs one device per engine), "dense" on CPU (where the two measure the same for the same
    work, docs/results/paged-kv-cache.md) and on a tensor-parallel replica.

    Raises:
      GenerateError: an unknown kind.
    """
    if kind not in KV_CACHES:
        raise GenerateError(f"rollout.kv_cache must be one of {KV_CACHES}, got {kind!r}")
    if kind != "auto":
        return kind
    return "paged" if platform in ("gpu", "cuda", "rocm", "tpu") and devices_per_engine == 1 \
        else "dense"


@dataclasses.dataclass(frozen=True)
class Request:
    """One rollout to generate.

    prompt_ids: token ids of the rendered prompt (non-empty).
    problem_id: the problem it samples (drafters share history per problem; seeds derive from it).
    sample_index: index within the problem's group (GRPO `num_generations`).
    seed: explicit request seed; default `request_seed(run seed, problem_id, sample_index)`.
    """

    prompt_ids: tuple[int, ...]
    problem_id: Hashable = 0
    sample_index: int = 0
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings.

    max_slots: most concurrent rows (largest batch bucket).
    max_cache_len: most positions per row (prompt + completion + draft width); the cache of one
      `generate` call is sized to what its requests need, up to this.
    draft_widths: compiled W values (1 + draft tokens); must contain 1.
    min_prompt_bucket: smallest prompt-length bucket.
    kv_memory_gb / kv_memory_fraction: KV-cache budget per device, in GB or as a fraction of the
      device's free memory when the engine is built (both None: no budget). The engine then runs
      `min(max_slots, rows of max_cache_len that fit)` slots (`Engine.slots`), and refuses to
      start (`GenerateError` naming `rollout.kv_memory_gb`) when not one row fits.
    exact: exact mode: every contraction and reduction feeding the logits is shape-invariant
      (`das_jax.models.contraction`), so rollouts are token-identical with and without
      speculation, whatever the batch bucket, width or attended length (README, "Exact mode").
    precompile: `generate` first compiles every packed verify program the call can reach
      (`Engine.precompile`), so a later call whose steps reach a shape for the first time does
      not compile inside its steps; off by default (tests with tiny models compile only what
      they run).
    share_prompts: with the packed prefill, a request whose prompt a cache row already holds
      (its K/V in positions `[0, len)`: a sibling still running, or a finished row not yet
      overwritten) is admitted by copying that row and sampling its first token from the
      prompt's stored last-position logits (`step.share_prompt_rows`), not by a prefill: GRPO's
      `num_generations` samples of a prompt admitted at different steps compute it once.
      Same first tokens (the same logits, seed and position).
    decode_steps: without a drafter, up to this many plain decode steps run in one device call
      (`step.decode_steps`: rows stop at a stop token or max_new_tokens on the device), so the
      host waits for the device once per k steps, not every step; same tokens and log-probs as
      single steps. A row that stops inside a call leaves its slot empty until the call ends
      (at most k - 1 steps). 1: one step per call.
    kv_cache: "dense" (every row holds `max_cache_len` positions, `KVCache`) or "paged" (a pool
      of `page_size`-position pages and a page table per row, `PagedKVCache`: rows hold the
      pages their tokens fill, a GRPO group's rows share their prompt's pages, finished rows
      free theirs at once; same tokens and log-probs as dense). The pool has the dense cache's
      positions (`slots x ceil(max_cache_len / page_size)` pages), so it never runs out.
    page_size: positions per page of the paged cache.
    paged_attention: how attention reads the paged cache: "auto" (a Pallas kernel over each
      row's own pages on TPU and CUDA outside exact mode, an XLA gather of the pages elsewhere:
      `models.paged_attention`) or "gather" (the XLA gather everywhere: the fallback if a
      platform's kernel misbehaves).
    overlap_host: with a drafter that defers its appends (`SuffixDrafter`: `das`, `suffix`),
      each step's tokens go into the request contexts at once and into the trie while the
      device computes the next step (`StepInput.overlap`), so the trie's indexing, most of the
      host's work per step, is hidden behind the device; drafts come from a trie one step
      behind (the sampled tokens never change). The step's acceptance counts and the
      policy's calibration update (`DASPolicy.observe(..., defer_learning=True)`) run there
      too: a step is planned with the calibration up to the step before. False: every
      append and update completes before the next draft.
    draft_ahead: with `overlap_host` and a drafter that can (`SuffixDrafter.propose_ahead`;
      not with a draft head, nor through the drafter in-process replicas share,
      `LockedDrafter`), the next step's drafts are made there too, after the appends, for the
      rows with a proposed draft: assuming the step accepts the chosen draft and samples the
      drafter's next token (the proposal's next one, or where the whole proposal was chosen,
      the first token the drafter drafts after it). Where it does, the next propose takes
      that draft instead of drafting the row (the same draft; only less host work between
      the steps).
    max_prefill_tokens: the block slots (distinct prompts' batch bucket x longest prompt's
      bucket) of one prefill call: an admission of more is split into several calls
      (`schedule.prefill_chunks`), so the prefill's activations stay a small share of the KV
      cache; a prompt longer than this is prefilled alone. None: one call per admission.
      Same tokens (each row's prefill is independent of the others in its call).
    layer_loop: the programs' loop over the model's layers (`ModelConfig.layer_loop`, which the
      engine sets on its model config): "scan" (one `lax.scan`, compiles fast) or "unroll" (a
      Python loop: each layer's weights and KV cache reach the matmuls without a copy, and
      attention reads a dense layer whole when the attended length is at least a third of it,
      `DenseKVCache.read_len`; compiles 15-30x longer: on an H200 the 7B verify step at 32 x
      16K positions took 16.7 ms unrolled vs 40.8 ms scanned, 49 s vs 1.6 s to compile,
      docs/gpu.md). Same tokens up to float rounding.
    wide_row_buckets: the verify step's split query block: when at most R of its B rows draft
      (R the smallest of these holding them, R < B) and the split computes under half the
      query rows (2 (B + R W) < B W), attention runs as a `[B, 1]` block of the pending tokens
      and an `[R, W]` block of the drafting rows (`models.packed`) instead of one `[B, W]`
      block: a step where a few rows draft pays attention arithmetic for those rows, not for
      all (on a 2-core CPU at 768 cached positions, B = 16, W = 8, one or two rows drafting 7:
      0.76-0.80x the one-block step). Each R is another compiled program per (B, N, W) it applies to, bought
      like any other shape by the DAS policy. Same tokens (exact mode: the same bits). ():
      one block always.
    kv_pages: pages of the paged pool (set by `size_slots` from the KV budget; None: the dense
      cache's positions, `batch x ceil(cache_len / page_size)`, which never run short). With a
      budget the slots stay `max_slots`: requests are admitted by free pages and rows are
      preempted (and resumed, the same tokens) when the pool runs short
      (`paged_executor.PagedExecutor`).
    """

    max_slots: int = 16
    max_cache_len: int = 2048
    draft_widths: tuple[int, ...] = (1, 4, 8)
    min_prompt_bucket: int = 16
    kv_memory_gb: float | None = None
    kv_memory_fraction: float | None = None
    exact: bool = False
    precompile: bool = False
    share_prompts: bool = True
    decode_steps: int = 8
    kv_cache: str = "dense"
    page_size: int = 16
    kv_pages: int | None = None
    max_prefill_tokens: int | None = 4096
    paged_attention: str = "auto"
    overlap_host: bool = True
    draft_ahead: bool = True
    layer_loop: str = "scan"
    wide_row_buckets: tuple[int, ...] = (2, 4, 8)

    def __post_init__(self):
        if self.layer_loop not in LAYER_LOOPS:
            raise GenerateError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got "
                                f"{self.layer_loop!r}")
        if self.paged_attention not in PAGED_ATTENTION:
            raise GenerateError(f"paged_attention must be one of {PAGED_ATTENTION}, got "
                                f"{self.paged_attention!r}")
        if self.max_prefill_tokens is not None and (
                isinstance(self.max_prefill_tokens, bool)
                or int(self.max_prefill_tokens) != self.max_prefill_tokens
                or self.max_prefill_tokens < 1):
            raise GenerateError(f"max_prefill_tokens must be an integer >= 1 or None, got "
                                f"{self.max_prefill_tokens!r}")
        if self.kv_cache not in ("dense", "paged"):
            raise GenerateError(f"kv_cache must be 'dense' or 'paged', got {self.kv_cache!r}")
        if isinstance(self.page_size, bool) or int(self.page_size) != self.page_size \
                or self.page_size < 1:
            raise GenerateError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.kv_pages is not None and (int(self.kv_pages) != self.kv_pages
                                          or self.kv_pages < 1):
            raise GenerateError(f"kv_pages must be an integer >= 1 or None, got "
                                f"{self.kv_pages!r}")
        if self.max_slots < 1:
            raise GenerateError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.decode_steps < 1:
            raise GenerateError(f"decode_steps must be >= 1, got {self.decode_steps}")
        widths = tuple(sorted(set(int(w) for w in self.draft_widths)))
        if not widths or widths[0] != 1:
            raise GenerateError(f"draft_widths must include 1 (plain decoding), got "
                                f"{self.draft_widths}")
        object.__setattr__(self, "draft_widths", widths)
        wide = tuple(self.wide_row_buckets)
        if any(isinstance(r, bool) or int(r) != r or r < 1 for r in wide):
            raise GenerateError(f"wide_row_buckets must be integers >= 1, got "
                                f"{self.wide_row_buckets}")
        object.__setattr__(self, "wide_row_buckets", tuple(sorted(set(int(r) for r in wide))))

    def paging(self, batch: int, cache_len: int) -> tuple:
        """The `pages` of the programs of a call whose first batch is `batch` rows of
        `cache_len` positions: () with the dense cache; (num_pages, page_size, kernel) of the
        paged pool (`batch x ceil(cache_len / page_size)` pages, kept when the call compacts;
        kernel: `PagedKVCache.kernel`, from `paged_attention`)."""
        if self.kv_cache != "paged":
            return ()
        pages = batch * int(pages_for(cache_len, self.page_size))
        return (min(pages, self.kv_pages) if self.kv_pages is not None else pages,
                int(self.page_size), self.paged_attention)

    @functools.cached_property
    def batch_buckets(self) -> tuple[int, ...]:
        """Powers of two below `max_slots`, then `max_slots` (computed once: the scheduler
        reads it every step)."""
        out, b = [], 1
        while b < self.max_slots:
            out.append(b)
            b *= 2
        return tuple(out) + (self.max_slots,)


def device_free_bytes(device: jax.Device | None = None) -> int | None:
    """Free memory of `device` (default: the first device) in bytes: `bytes_limit - bytes_in_use`
    of its allocator, or the host's available memory for a CPU device; None when unknown."""
    device = device or jax.devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator stats
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def size_slots(config: ModelConfig, ec: "EngineConfig", dtype, device=None,
               kv_shards: int = 1) -> "EngineConfig":
    """`ec` with `max_slots` lowered to the rows of `max_cache_len` positions that fit the KV
    budget (`EngineConfig.kv_memory_gb`, else `kv_memory_fraction` of the free device memory);
    with the paged cache, `kv_pages` set to the pages that fit (the slots stay).
    `kv_shards`: devices one row's KV is split over (tensor parallelism over KV heads), so a
    row takes 1/kv_shards of its bytes on each device.

    Raises:
      GenerateError: not one row fits; names `rollout.kv_memory_gb` / `rollout.max_cache_len`.
    """
    if ec.kv_memory_gb is not None:
        budget, source = int(ec.kv_memory_gb * 1e9), f"rollout.kv_memory_gb={ec.kv_memory_gb}"
    elif ec.kv_memory_fraction is not None:
        free = device_free_bytes(device)
        if free is None:
            return ec
        budget = int(ec.kv_memory_fraction * free)
        source = (f"rollout.kv_memory_fraction={ec.kv_memory_fraction} of {free / 1e9:.2f} GB "
                  "free device memory")
    else:
        return ec
    if ec.kv_cache == "paged":
        per_page = -(-KVCache.nbytes_for(config, 1, ec.page_size, dtype) // kv_shards)
        pages, row = budget // per_page, int(pages_for(ec.max_cache_len, ec.page_size))
        if pages < row:
            raise GenerateError(
                f"the paged KV cache needs {row} pages ({row * per_page / 1e9:.3f} GB) for one "
                f"row of max_cache_len={ec.max_cache_len} positions but the budget is "
                f"{budget / 1e9:.3f} GB ({source}); raise rollout.kv_memory_gb or lower "
                "rollout.max_cache_len")
        return dataclasses.replace(ec, kv_pages=int(pages))
    per_row = -(-KVCache.nbytes_for(config, 1, ec.max_cache_len, dtype) // kv_shards)
    rows = budget // per_row
    if rows < 1:
        raise GenerateError(
            f"the KV cache needs {per_row / 1e9:.3f} GB per row (max_cache_len={ec.max_cache_len}"
            f" positions) but the budget is {budget / 1e9:.3f} GB ({source}); raise "
            "rollout.kv_memory_gb or lower rollout.max_cache_len")
    if rows >= ec.max_slots:
        return ec
    return dataclasses.replace(ec, max_slots=int(rows))
