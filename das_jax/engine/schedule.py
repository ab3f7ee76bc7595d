"""Static shapes and row bookkeeping of continuous batching, shared by `Engine.generate` and the
trace-replay simulator (`das_jax.bench.replay`), so both take the same scheduling decisions.

Every shape the engine compiles comes from a bucket: batch buckets (powers of two up to
`max_slots`), prompt-length buckets (powers of two above a floor), attended-length buckets
(quarter octaves), packed slot-count buckets (verify and prefill), and one cache length per
`generate` call. Pure host code (numpy only).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

KV_LEN_FLOOR = 128   # smallest attended-length (and cache-length) bucket


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest of the ascending `buckets` that holds `n` (the largest when none does)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest `floor * 2**k` (k >= 0) that is >= n."""
    b = floor
    while b < n:
        b *= 2
    return b


def cache_len_for(max_cache_len: int, draft_widths: Sequence[int], max_prompt: int,
                  max_new_tokens: int) -> int:
    """Cache positions per row: a power of two >= 128 that holds the longest prompt +
    max_new_tokens + the widest compiled draft width, capped at max_cache_len (never below
    what is needed; `Engine.validate` rejects requests that need more than max_cache_len)."""
    need = max_prompt + max_new_tokens + max(draft_widths)
    return max(min(pow2_at_least(need, KV_LEN_FLOOR), max_cache_len), need)


def kv_len_bucket(cache_len_live: np.ndarray, cache_len: int) -> int:
    """The attended length of a verify step: the longest live row's cache length, rounded up to
    a quarter octave: multiples of 128 up to 1024, of 256 up to 2048, of 512 up to 4096, ...
    (at most 25% above the longest row beyond 512, 4 compiled lengths per doubling; the floor
    is 128), capped at the cache length."""
    n = max(int(cache_len_live.max()), 1)
    step = max(KV_LEN_FLOOR, pow2_at_least(n, KV_LEN_FLOOR) // 8)
    return min(-(-n // step) * step, cache_len)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The compiled slot counts N of the packed verify step: powers of two up to 16, then
    powers of two and their 1.5x (24, 32, 48, 64, 96, ...: at most 50% padding where a slot
    costs most), up to and including `max_tokens`. Few buckets, since each is compiled per
    (batch bucket, width, attended length)."""
    out, p = [], 1
    while p < max_tokens:
        out.append(p)
        if p >= 16 and p + p // 2 < max_tokens:
            out.append(p + p // 2)
        p *= 2
    return tuple(out) + (max_tokens,)


def verify_token_buckets(batch: int, max_width: int) -> tuple[int, ...]:
    """The compiled slot counts N of the packed verify step at batch bucket B: N = B (every
    step without drafts: the live rows fill more than half of their bucket, so their count is
    never worth a bucket of its own), then the `token_buckets(B * max_width)` above B (steps
    with drafts). Few values per B, since each is a compiled program per (B, attended length)."""
    return (batch,) + tuple(n for n in token_buckets(batch * max_width) if n > batch)


def precompile_token_buckets(batch: int, max_width: int) -> tuple[int, ...]:
    """The slot counts of `verify_token_buckets` that `Engine.precompile` compiles ahead of the
    first step: those up to max(3 * B, max_width), the ones the DAS budget chooses (a larger N
    pays only when most of B rows draft several accepted tokens; such a step compiles on first
    use)."""
    top = max(3 * batch, max_width)
    return tuple(n for n in verify_token_buckets(batch, max_width) if n <= top)


def share_order(dst: Sequence[int], src: Sequence[int]
                ) -> tuple[list[int], list[bool], list[bool], list[int]]:
    """The order in which row copies `src[j] -> dst[j]` (distinct destinations) run in place, so
    that every row is read before it is overwritten, with a one-row stash for cycles.

    Entries whose destination no other pending entry reads run first (in index order); when
    every pending entry is blocked (a cycle, e.g. a swap), the lowest pending entry saves its
    destination row to the stash before writing it (`save`) and the pending entries reading
    that row read the stash instead (`from_stash`). While a stash is still to be read, a
    second cycle cannot use it: one of its entries is left out (`dropped`, to be prefilled).

    Returns:
      (order, save, from_stash, dropped): entry indices in run order; per entry (by original
      index) its two stash flags; the entries left out.
    """
    n = len(dst)
    save, from_stash = [False] * n, [False] * n
    readers: dict[int, int] = {}          # row -> pending entries reading it from the cache

    def reads(j):
        return not from_stash[j] and src[j] != dst[j]
    for j in range(n):
        if reads(j):
            readers[src[j]] = readers.get(src[j], 0) + 1
    pending, order, dropped = list(range(n)), [], []

    def remove(j):
        pending.remove(j)
        if reads(j):
            readers[src[j]] -= 1
    while pending:
        ready = [j for j in pending if readers.get(dst[j], 0) == 0]
        if ready:
            for j in ready:
                remove(j)
                order.append(j)
            continue
        j = pending[0]
        if any(from_stash[k] for k in pending):
            remove(j)
            dropped.append(j)
            continue
        save[j] = True
        for k in pending:
            if k != j and reads(k) and src[k] == dst[j]:
                readers[src[k]] -= 1
                from_stash[k] = True
    return order, save, from_stash, dropped


class Prompt(tuple):
    """A prompt's token ids: a tuple of ints whose hash is computed once (a tuple's is not
    cached, and a row's prompt is looked up at every admission: ~150 ids each)."""

    def __new__(cls, ids):
        self = super().__new__(cls, ids)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self):
        return self._hash


class PromptRows:
    """Host bookkeeping of prompt sharing (`EngineConfig.share_prompts`): which prompt's K/V each
    cache row holds in positions `[0, len)` (written by an admission; a verify step writes only
    past the prompt, so a row keeps its prompt after it finished until it is refilled or
    compacted away). Shared by the engine's executor and the trace replay, so both admit the
    same requests by a row copy.

    `rows[r]` is row r's prompt (a `Prompt`) or None. Equal prompts are one object (interned
    at admission), so a lookup among the rows compares by identity and a cached hash: an
    admission's `split` costs ~0.1 us per row, not a hash of every row's prompt."""

    def __init__(self, batch: int):
        self.rows: list[Prompt | None] = [None] * batch
        self._interned: dict[Prompt, Prompt] = {}

    def key(self, prompt: Sequence[int]) -> Prompt:
        """The interned `Prompt` of `prompt` (token ids): one object per distinct prompt among
        those admitted since the rows last held none of the others."""
        key = Prompt(map(int, prompt))
        found = self._interned.get(key)
        if found is None:
            if len(self._interned) > 2 * len(self.rows):   # keep the held ones only
                self._interned = {p: p for p in self.rows if p is not None}
            found = self._interned[key] = key
        return found

    def split(self, prompts: Sequence[Sequence[int]], rows: Sequence[int]
              ) -> tuple[list[int], list[int], list[int], tuple[list[bool], list[bool]]]:
        """(shared, sources, computed, (save, from_stash)) for the admitted `prompts` going to
        cache rows `rows`: indices of those a row already holds, in the order the row copies
        run (`share_order`), that row for each, the indices of the others (to prefill: prompts
        no row holds, and the rare copy a cycle of rows leaves out), and each shared entry's
        stash flags. A holder that is not among `rows` (not overwritten by this admission) is
        preferred."""
        targets = {int(r) for r in rows}
        holder: dict[Prompt, int] = {}
        for r, p in enumerate(self.rows):
            if p is not None and (p not in holder or (holder[p] in targets
                                                      and r not in targets)):
                holder[p] = r
        keys = [self.key(p) for p in prompts]
        shared = [k for k, p in enumerate(keys) if p in holder]
        computed = [k for k, p in enumerate(keys) if p not in holder]
        order, save, from_stash, dropped = share_order([int(rows[k]) for k in shared],
                                                       [holder[keys[k]] for k in shared])
        computed = sorted(computed + [shared[j] for j in dropped])
        shared = [shared[j] for j in order]
        return (shared, [holder[keys[k]] for k in shared], computed,
                ([save[j] for j in order], [from_stash[j] for j in order]))

    def admit(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        for r, p in zip(rows, prompts):
            self.rows[int(r)] = self.key(p)

    def compact(self, live: Sequence[int], new_batch: int) -> None:
        self.rows = [self.rows[int(r)] for r in live] + [None] * (new_batch - len(live))

    def held(self) -> set:
        return {p for p in self.rows if p is not None}


def prompt_bucket(max_prompt: int, floor: int, cache_len: int) -> int:
    """The prompt-length bucket of a prefill: a power of two `floor * 2**k` >= the longest
    prompt, capped at the cache length."""
    return min(pow2_at_least(max_prompt, floor), cache_len)


def prefill_chunks(prompts: Sequence[Sequence[int]], batch_buckets: Sequence[int],
                   min_prompt_bucket: int, cache_len: int,
                   max_tokens: int | None) -> list[list[int]]:
    """Splits one admission into prefill calls of at most `max_tokens` block slots each.

    A call's attention block is U x T (U: the batch bucket of its distinct prompts, T: the
    prompt bucket of its longest), and its activations and scratch K/V grow with U x T, so
    a call holds the distinct prompts (in first-seen order, every request of a prompt in the
    call that computes it) while U x T <= max_tokens; a prompt whose own bucket exceeds
    `max_tokens` is prefilled alone. The chunked-prefill budget of vLLM's
    `max_num_batched_tokens`, without splitting one prompt.

    Args:
      prompts: the prompt (token ids) of each admitted request, in order.
      batch_buckets, min_prompt_bucket, cache_len: the engine's buckets (`prefill_layout`).
      max_tokens: the block-slot budget of one call (None: one call).

    Returns:
      the request indices of each call (every index once, calls in order).
    """
    groups: dict[tuple, list[int]] = {}
    for k, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(k)
    if max_tokens is None:
        return [list(range(len(prompts)))] if len(prompts) else []
    calls: list[list[int]] = []
    n, longest = 0, 0
    for p, ks in groups.items():
        grown = (bucket(n + 1, batch_buckets)
                 * prompt_bucket(max(longest, len(p)), min_prompt_bucket, cache_len))
        if n and grown > max_tokens:
            n, longest = 0, 0
        if not n:
            calls.append([])
        calls[-1].extend(ks)
        n, longest = n + 1, max(longest, len(p))
    return calls


def prefill_rows(prompt_len: int, rows: int, batch_buckets: Sequence[int],
                 min_prompt_bucket: int, cache_len: int, max_tokens: int | None) -> int:
    """The largest U (a batch bucket <= `rows`, at least 1) of a prefill call whose prompts
    are up to `prompt_len` long under `prefill_chunks`' budget: the block rows a memory plan
    sizes."""
    T = prompt_bucket(prompt_len, min_prompt_bucket, cache_len)
    fits = [b for b in batch_buckets if b <= max(rows, 1)
            and (max_tokens is None or b * T <= max_tokens)]
    return max(fits, default=1)


def pack_prompts(prompts: Sequence[Sequence[int]], src: Sequence[int], rows: Sequence[int],
                 seeds: Sequence[int], batch: int, width: int) -> tuple[int, tuple]:
    """Host arguments of the packed prefill (`step.prefill_packed`).

    Args:
      prompts: the unique prompts (token ids), each non-empty and at most `width` long.
      src: for each admitted request, the index of its prompt in `prompts`.
      rows: for each admitted request, its cache row; seeds: its seed.
      batch: cache rows B (>= len(prompts) and >= len(rows)).
      width: the block width (`prompt_bucket`).

    Returns:
      (N, (tokens_N, row_N, offset_N, slots_B, src_B, last_B, lengths_B, seeds_B)), int32: the
      prompts concatenated into N slots (N = the `token_buckets(batch * width)` bucket of their
      total length; padding slots have row index `batch`), and per entry j < len(rows) its cache
      row, prompt, the prompt's last slot, length and seed (entries past len(rows): row `batch`,
      dropped).
    """
    lens = np.array([len(p) for p in prompts], np.int64)
    total = int(lens.sum())
    N = bucket(total, token_buckets(batch * width))
    tokens_N = np.zeros(N, np.int32)
    row_N = np.full(N, batch, np.int32)
    offset_N = np.zeros(N, np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    for u, p in enumerate(prompts):
        sl = slice(starts[u], starts[u] + lens[u])
        tokens_N[sl] = p
        row_N[sl] = u
        offset_N[sl] = np.arange(lens[u])
    k = len(rows)
    slots_B = np.full(batch, batch, np.int32)
    slots_B[:k] = rows
    src_B = np.zeros(batch, np.int32)
    src_B[:k] = src
    last_B = (starts + lens - 1)[src_B].astype(np.int32)
    lengths_B = lens[src_B].astype(np.int32)
    seeds_B = np.zeros(batch, np.int32)
    seeds_B[:k] = seeds
    return N, (tokens_N, row_N, offset_N, slots_B, src_B, last_B, lengths_B, seeds_B)


def packed_width(n_draft: Sequence[int], widths: Sequence[int]) -> int:
    """The query-block width of a packed step: the smallest compiled width holding the longest
    row (1 + its draft tokens)."""
    need = 1 + int(np.max(n_draft, initial=0))
    return next((w for w in sorted(widths) if w >= need), max(widths))


def wide_rows_for(n_draft: Sequence[int], batch: int, width: int,
                  wide_buckets: Sequence[int]) -> int:
    """R of the split query block (`VerifySpec.wide_rows`) for per-row draft lengths `n_draft`
    at batch bucket B and query-block width W: the smallest of `wide_buckets` holding the rows
    that draft, when that split computes less than half the one block's query rows
    (2 * (B + R * W) < B * W); 0 (one `[B, W]` block) otherwise, at W = 1 or without buckets.
    """
    if width <= 1 or not len(wide_buckets):
        return 0
    n = int(np.count_nonzero(np.asarray(n_draft) > 0))
    R = next((r for r in sorted(wide_buckets) if r >= n), 0)
    return R if R and R < batch and 2 * (batch + R * width) < batch * width else 0


def branch_rows_for(n_alt_A: Sequence[int], batch: int) -> int:
    """R2 of a two-branch token tree's second block (`VerifySpec.branch_rows`) for per-row
    second-draft lengths `n_alt_A` at batch bucket B: the smallest power of two holding the
    rows with one, at most B; 0 when no row has one (one draft per row)."""
    n = int(np.count_nonzero(np.asarray(n_alt_A) > 0))
    return min(pow2_at_least(n, 1), int(batch)) if n else 0


def full_width_rows(batch: int, width: int, num_tokens: int) -> int:
    """Rows that draft `width - 1` tokens in the timing layout of `num_tokens` slots over
    `batch` rows (`specs.VerifySpec.dummy`: those rows first, then one slot per remaining row)."""
    return max(0, min(batch, (num_tokens - batch) // (width - 1))) if width > 1 else 0


def _slot_bucket(n_draft_B: Sequence[int], buckets: Sequence[int]) -> int:
    """The slot bucket of sum_b (1 + n_b)."""
    return bucket(max(len(n_draft_B) + int(np.sum(n_draft_B)), 1), buckets)


class StepShape(tuple):
    """(num_tokens, attended_kv), plus the query-block width W the step runs at as `.width`,
    the cached positions it actually reads as `.read_kv` (attended_kv, but on a paged
    cache read by a kernel: `pages_read_kv`) and the split query block's R as `.wide_rows`
    (`wide_rows_for`; 0: one block) and a two-branch token tree's R2 as `.branch_rows`
    (`branch_rows_for`; 0: one draft per row) (compares and unpacks as the plain pair)."""

    width: int
    read_kv: int
    wide_rows: int
    branch_rows: int

    def __new__(cls, num_tokens: int, attended_kv: int, width: int, read_kv: int | None = None,
                wide_rows: int = 0, branch_rows: int = 0):
        out = super().__new__(cls, (num_tokens, attended_kv))
        out.width = int(width)
        out.read_kv = int(attended_kv if read_kv is None else read_kv)
        out.wide_rows = int(wide_rows)
        out.branch_rows = int(branch_rows)
        return out


def shape_key(num_tokens: int, attended_kv: int, width: int | None, wide_rows: int = 0,
              branch_rows: int = 0) -> tuple:
    """The compiled program of a step shape, as the cost model's tables key it: (num_tokens,
    attended_kv, width), R appended for a split query block, and (R, R2) for a two-branch
    token tree."""
    key = (int(num_tokens), int(attended_kv), None if width is None else int(width))
    if branch_rows:
        return key + (int(wide_rows), int(branch_rows))
    return key + (int(wide_rows),) if wide_rows else key


def pages_read_kv(cache_len_A, page_size: int) -> int:
    """Cached positions a paged attention kernel reads for rows holding `cache_len_A` cached
    tokens: the positions of every page that holds one, `page * sum_a ceil(len_a / page)`
    (each row reads its own pages, not the longest row's bucket)."""
    n = np.asarray(cache_len_A, np.int64)
    return int(page_size * ((n + page_size - 1) // page_size).sum())


class PackedStepShape:
    """`step_shape(n_draft_A) -> StepShape` of the packed verify step (`step_shape_fn`), plus
    `many(n_CxA)`: the shapes of C choices at once (arrays), for a policy that prices many."""

    def __init__(self, batch: int, kv_len: int, widths: Sequence[int],
                 read_kv: int | None = None, wide_buckets: Sequence[int] = ()):
        self.batch = int(batch)
        self.wide_buckets = np.array(sorted(int(r) for r in wide_buckets if 0 < r < batch),
                                     np.int64)
        self.widths = np.array(sorted(int(w) for w in widths), np.int64)
        # once: the policy prices many choices
        self.buckets = np.array(verify_token_buckets(batch, int(self.widths[-1])), np.int64)
        self.attended = batch * kv_len
        # the cached positions the step reads, whatever the drafts (`StepShape.read_kv`)
        self.read_kv = int(self.attended if read_kv is None else read_kv)

    def __call__(self, n_draft_A) -> "StepShape":
        W = int(packed_width(n_draft_A, self.widths))
        return StepShape(int(_slot_bucket(n_draft_A, self.buckets)), int(self.attended), W,
                         self.read_kv, wide_rows_for(n_draft_A, self.batch, W,
                                                     self.wide_buckets))

    def tree(self, n_draft_A, n_alt_A) -> "StepShape":
        """The step shape of a two-branch token tree: each live row's pending token, its first
        draft (`n_draft_A` tokens) and its second (`n_alt_A`), in one slot bucket; W the
        smallest compiled width holding the deeper branch; R2 `branch_rows_for`; one query
        block (no split)."""
        a, b = np.asarray(n_draft_A, np.int64), np.asarray(n_alt_A, np.int64)
        W = int(packed_width(np.maximum(a, b), self.widths))
        return StepShape(int(_slot_bucket(a + b, self.buckets)), int(self.attended), W,
                         self.read_kv, 0, branch_rows_for(b, self.batch))

    def many(self, n_CxA: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """int64 `[C]` each (num_tokens, attended_kv, width, wide_rows) of choices `n_CxA`
        (row c: one draft length per live row), equal to calling the shape function on each
        row."""
        n_CxA = np.asarray(n_CxA, np.int64)
        return self.of_totals(n_CxA.shape[1], n_CxA.sum(axis=1), n_CxA.max(axis=1, initial=0),
                              np.count_nonzero(n_CxA > 0, axis=1))

    def of_totals(self, rows: int, drafted_C: np.ndarray, longest_C: np.ndarray,
                  drafting_C: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`many` of C choices of `rows` live rows given by what their shapes follow from,
        int64 `[C]` each: the draft tokens, the longest draft and the rows that draft."""
        from das_jax.engine import _shape_kernels as _sk    # deferred import: numba
        return tuple(_sk.shape_columns(int(rows), np.asarray(drafted_C, np.int64),
                                       np.asarray(longest_C, np.int64),
                                       np.asarray(drafting_C, np.int64), *self.kernel_args()))

    def kernel_args(self) -> tuple:
        """(buckets, widths, wide_buckets: int64 ascending; batch, attended_kv) as
        `_shape_kernels.shape_columns` takes them after the per-choice columns."""
        return self.buckets, self.widths, self.wide_buckets, self.batch, int(self.attended)


def step_shape_fn(batch: int, kv_len: int, widths: Sequence[int],
                  read_kv: int | None = None, wide_buckets: Sequence[int] = ()
                  ) -> PackedStepShape:
    """`step_shape(n_draft_B) -> StepShape (num_tokens, attended_kv; .width W, .read_kv)` of
    the packed verify step at batch bucket `batch` and attended length `kv_len`, for per-row
    draft lengths of the live rows: num_tokens is the slot bucket of sum_b (1 + n_b)
    (`verify_token_buckets`: B, then slot buckets up to batch x the widest width), attended_kv
    = `batch * kv_len` (every cache row of the batch bucket attends the step's `kv_len`: the
    compiled program), W is `packed_width` (the smallest compiled width holding the longest
    row), read_kv the cached positions the step reads (`read_kv`; default attended_kv; a paged
    cache read by a kernel: `pages_read_kv`), and wide_rows the split query block's R
    (`wide_rows_for` over `wide_buckets`, `EngineConfig.wide_row_buckets`). Shared by the
    engine and the trace replay, so both price a choice of drafts the same way
    (`PackedStepShape.many` prices many choices at once)."""
    return PackedStepShape(batch, kv_len, widths, read_kv, wide_buckets)


def tail_bucket(num_live: int, batch: int, batch_buckets: Sequence[int],
                queue_empty: bool) -> int | None:
    """The smaller batch bucket the live rows are compacted into (once no request is queued and
    they fit one), or None to keep the current batch."""
    if not queue_empty:
        return None
    nb = bucket(num_live, batch_buckets)
    return nb if nb < batch else None


def compact_rows(live, nb: int, *arrays_and_fills):
    """Row state of the live rows packed into a bucket of `nb` rows (padding rows get the fill).

    `arrays_and_fills` alternates host arrays `[B, ...]` and their padding value; returns the
    new arrays in order.
    """
    out = []
    for arr, fill in zip(arrays_and_fills[::2], arrays_and_fills[1::2]):
        out.append(np.concatenate([arr[live], np.full((nb - len(live),) + arr.shape[1:], fill,
                                                      arr.dtype)]))
    return out
