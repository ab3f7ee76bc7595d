"""Train batches and micro-batches: the `TrainBatch` a step trains on, its host columns, and the
three micro-batch kinds the gradient kernel takes, each a registered dataclass pytree:

    PaddedMicroBatch    whole rows `[n, mb, T]` (the reference path and the mesh path)
    WindowedMicroBatch  whole rows, the head scored on a completion window `[n, mb, W]`
    PackedMicroBatch    GRPO groups packed one row per prompt, rows of at most T tokens
                        (`packed_micro_batches`, `pack_shared_prompts`)

Every micro-batch has a leading axis of `n` micro-batches (the kernel scans over it) and the
loss inputs `completion_mask`, `old_logprobs`, `ref_logprobs`, `weights` (`[n, rows, W]`) and
`advantages` (`[n, rows]`); `das_jax.rl.logprobs.micro_batch_logprobs` scores each kind by its
type. Host-side planning (`micro_batch_plan`, `completion_window`, `shared_prompt_groups`,
`pack_shared_prompts`) is numpy.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TrainBatch", "make_batch", "HostColumns", "PaddedMicroBatch", "WindowedMicroBatch",
           "PackedMicroBatch", "length_bucket", "count_bucket", "micro_batch_plan",
           "completion_window", "shared_prompt_groups", "packed_micro_batches", "pack_shared_prompts"]


@flax.struct.dataclass
class TrainBatch:
    """One GRPO batch of N = prompts_per_step * num_generations sequences of padded length T.

    tokens_BxT: int32, prompt followed by completion, right-padded.
    positions_BxT: int32 RoPE positions (0..len-1 for a left-aligned prompt; anything for pads).
    valid_BxT: bool, True on real (non-pad) tokens.
    completion_mask_BxT: bool, True on completion tokens, i.e. the targets whose log-prob is
      trained (must be False at t = 0, which has no predecessor; it is forced False there).
    old_logprobs_BxT: float32, old_logprobs[b, t] = log-prob of tokens[b, t] under the sampling
      policy (0 where not completion).
    ref_logprobs_BxT: float32, same alignment, frozen reference policy (read only when beta > 0).
    advantages_B: float32 `[N]`, one advantage per sequence (`advantages.group_advantages`).
    is_weights_BxT: optional float32, a per-token factor on the loss (None: 1 everywhere): the
      truncated importance weights of asynchronous GRPO (`das_jax.rl.async_rollouts`).
    """

    tokens_BxT: jax.Array
    positions_BxT: jax.Array
    valid_BxT: jax.Array
    completion_mask_BxT: jax.Array
    old_logprobs_BxT: jax.Array
    ref_logprobs_BxT: jax.Array
    advantages_B: jax.Array
    is_weights_BxT: jax.Array | None = None

    @property
    def num_sequences(self) -> int:
        return self.tokens_BxT.shape[0]


def make_batch(tokens_BxT, prompt_lens_B, completion_lens_B, *, old_logprobs_BxT=None,
               ref_logprobs_BxT=None, advantages_B=None, is_weights_BxT=None) -> TrainBatch:
    """Host-side helper: a `TrainBatch` from right-padded token rows where row b holds
    `prompt_lens_B[b]` prompt tokens followed by `completion_lens_B[b]` completion tokens.

    Positions are 0..len-1; missing log-prob arrays are zeros, missing advantages zeros,
    missing importance weights None (a factor of 1).

    Raises:
      ValueError: a row has no prompt token.
    """
    tokens = np.asarray(tokens_BxT, np.int32)
    B, T = tokens.shape
    p = np.asarray(prompt_lens_B)[:, None]
    c = np.asarray(completion_lens_B)[:, None]
    t = np.arange(T)[None]
    if np.any(p < 1):
        raise ValueError("every row needs at least one prompt token")
    valid = t < p + c
    cmask = (t >= p) & valid
    zeros = np.zeros((B, T), np.float32)
    old = zeros if old_logprobs_BxT is None else np.asarray(old_logprobs_BxT, np.float32) * cmask
    ref = zeros if ref_logprobs_BxT is None else np.asarray(ref_logprobs_BxT, np.float32) * cmask
    adv = np.zeros((B,), np.float32) if advantages_B is None else np.asarray(advantages_B, np.float32)
    positions = np.broadcast_to(t, (B, T)).astype(np.int32)
    return TrainBatch(tokens_BxT=jnp.asarray(tokens), positions_BxT=jnp.asarray(positions),
                      valid_BxT=jnp.asarray(valid), completion_mask_BxT=jnp.asarray(cmask),
                      old_logprobs_BxT=jnp.asarray(old), ref_logprobs_BxT=jnp.asarray(ref),
                      advantages_B=jnp.asarray(adv),
                      is_weights_BxT=(None if is_weights_BxT is None else
                                      jnp.asarray(np.asarray(is_weights_BxT, np.float32) * cmask)))


@dataclasses.dataclass(frozen=True)
class HostColumns:
    """A batch's columns on the host (numpy), `[N, T]` unless noted: tokens (int32), positions
    (int32), valid (bool), completion_mask (bool: completion tokens that are valid and not at
    t = 0), old_logprobs / ref_logprobs (float32), advantages (float32 `[N]`) and the loss
    weights of the whole batch (float32: the loss is `sum(weights * per_token_loss)`)."""

    tokens: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    completion_mask: np.ndarray
    old_logprobs: np.ndarray
    ref_logprobs: np.ndarray
    advantages: np.ndarray
    weights: np.ndarray

    def row_lengths(self) -> np.ndarray:
        """Each row's length up to its last valid token (1 for a row with none)."""
        T = self.valid.shape[1]
        return np.where(self.valid.any(1), T - np.argmax(self.valid[:, ::-1], axis=1), 1)

    def padded(self, rows, T_mb: int, size: int) -> "PaddedMicroBatch":
        """Rows `rows` cut to length `T_mb` and padded with zero rows to `size` rows: one
        `PaddedMicroBatch` (leading axis 1). Zero rows add nothing (all-False mask, 0 weight)."""
        pad = size - len(rows)

        def take(c):
            x = c[rows][:, :T_mb] if c.ndim == 2 else c[rows]
            return np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))[None]
        return PaddedMicroBatch(*(take(getattr(self, f.name)) for f in dataclasses.fields(self)))


def _abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@flax.struct.dataclass
class PaddedMicroBatch:
    """`n` micro-batches of `mb` whole rows of length T: tokens, positions (int32), valid,
    completion_mask (bool), old_logprobs, ref_logprobs, weights (float32) `[n, mb, T]`,
    advantages (float32 `[n, mb]`). Padding rows are all zero (no mask, no weight)."""

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    completion_mask: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    advantages: jax.Array
    weights: jax.Array

    @classmethod
    def abstract(cls, n: int, mb: int, T: int, rows_sharding=None,
                 vector_sharding=None) -> "PaddedMicroBatch":
        """`jax.ShapeDtypeStruct`s of `n` micro-batches of `mb` rows of length T (for AOT
        lowering; `rows_sharding` on the `[n, mb, T]` leaves, `vector_sharding` on the
        advantages)."""
        mat = lambda dt: _abstract((n, mb, T), dt, rows_sharding)  # noqa: E731
        return cls(mat(jnp.int32), mat(jnp.int32), mat(jnp.bool_), mat(jnp.bool_),
                   mat(jnp.float32), mat(jnp.float32),
                   _abstract((n, mb), jnp.float32, vector_sharding), mat(jnp.float32))

    def windowed(self) -> "WindowedMicroBatch":
        """The same rows with the loss inputs at their completion window (`completion_window`)
        only: the head then runs on `[mb, W]` positions, not `[mb, T]`. Host arrays, n = 1."""
        win = completion_window(np.asarray(self.completion_mask)[0])[None]
        at = lambda x: np.take_along_axis(np.asarray(x), win, axis=2)  # noqa: E731
        return WindowedMicroBatch(
            tokens=self.tokens, positions=self.positions, valid=self.valid, window=win,
            completion_mask=at(self.completion_mask), old_logprobs=at(self.old_logprobs),
            ref_logprobs=at(self.ref_logprobs), advantages=self.advantages,
            weights=at(self.weights))


@flax.struct.dataclass
class WindowedMicroBatch:
    """Whole rows whose head is scored at a window of positions: tokens, positions, valid
    `[n, mb, T]`; window (int32 `[n, mb, W]`, each >= 1, distinct in a row, entry `[b, j]`
    scoring `tokens[b, window[b, j]]`); completion_mask, old_logprobs, ref_logprobs, weights
    at the window's positions `[n, mb, W]`; advantages `[n, mb]`."""

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    window: jax.Array
    completion_mask: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    advantages: jax.Array
    weights: jax.Array


@flax.struct.dataclass
class PackedMicroBatch:
    """R completions packed with their shared prompts into G rows (`pack_shared_prompts`).

    tokens, positions (int32), valid (bool), segments (int32: 0 the prompt, k the k-th
    completion) `[n, G, S]`; row_group (int32 `[n, R]`: the packed row of each completion);
    source (int32 `[n, R, W]`: the packed position whose hidden state scores each target) and
    targets (int32 `[n, R, W]`); completion_mask (bool), old_logprobs, ref_logprobs, weights
    (float32) `[n, R, W]`; advantages (float32 `[n, R]`).
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    segments: jax.Array
    row_group: jax.Array
    source: jax.Array
    targets: jax.Array
    completion_mask: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    advantages: jax.Array
    weights: jax.Array

    def first(self) -> "PackedMicroBatch":
        """The first micro-batch, without the leading axis."""
        return jax.tree_util.tree_map(lambda x: x[0], self)


def length_bucket(n: int, floor: int = 64) -> int:
    """Padded length for a micro-batch whose longest row has `n` tokens: a multiple of
    `max(floor, 2**(bit_length(n) - 3))` (at most ~4 buckets per doubling, so few compiles)."""
    step = max(floor, 1 << max(0, int(n).bit_length() - 3))
    return max(step, -(-int(n) // step) * step)


def count_bucket(n: int) -> int:
    """Padded count of packed rows or completions: n up to 2, else the smallest of 2**k and
    3 * 2**(k-1) that is >= n (1, 2, 3, 4, 6, 8, 12, 16, ...: at most 1/3 padding), so a run
    whose batches train on 1..8 groups compiles its update for 6 group counts, not 8."""
    n = max(int(n), 1)
    if n <= 2:
        return n
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if n <= 3 * p // 4 else p


def micro_batch_plan(lengths_N, micro_batch_size: int, T: int, group_by_length: bool = True):
    """Rows and padded length of each micro-batch: a list of (row indices, T_mb).

    With `group_by_length`, rows are sorted by length (longest first, stable) so each micro-batch
    holds similar lengths and is cut to `length_bucket` of its longest row (<= T); otherwise rows
    stay in order and every micro-batch has length T. The last micro-batch may hold fewer rows.
    """
    lengths_N = np.asarray(lengths_N)
    N = len(lengths_N)
    order = np.argsort(-lengths_N, kind="stable") if group_by_length else np.arange(N)
    plan = []
    for i in range(0, N, micro_batch_size):
        rows = order[i:i + micro_batch_size]
        T_mb = min(T, length_bucket(int(lengths_N[rows].max()))) if group_by_length else T
        plan.append((rows, T_mb))
    return plan


def completion_window(cmask_BxT: np.ndarray, floor: int = 32) -> np.ndarray:
    """The positions of each row the train step scores: int32 `[B, W]`, row b the W consecutive
    positions `start_b .. start_b + W - 1` that cover every True of `cmask_BxT[b]` (its
    completion tokens), with W = `length_bucket` (multiple of `floor`) of the longest row's
    span, at most T - 1, and 1 <= start_b <= T - W (rows without completion tokens start at 1).

    The lm_head + log-softmax then run on `[B, W]` tokens instead of `[B, T]`: with a long
    prompt and a short completion, most of the head's work. The loss is unchanged: positions
    outside the window have zero weight.
    """
    cmask = np.asarray(cmask_BxT, bool)
    B, T = cmask.shape
    has = cmask.any(axis=1)
    first = np.where(has, np.argmax(cmask, axis=1), 1)
    last = np.where(has, T - 1 - np.argmax(cmask[:, ::-1], axis=1), 1)
    span = int((last - first + 1).max()) if B else 1
    W = max(1, min(T - 1, length_bucket(span, floor)))
    start = np.clip(np.minimum(first, T - W), 1, None)
    return (start[:, None] + np.arange(W)[None]).astype(np.int32)


def shared_prompt_groups(tokens_NxT, positions_NxT, valid_NxT, cmask_NxT, rows) -> list | None:
    """`rows` grouped by identical prompt (tokens and positions before the first completion
    token), in order of first appearance; rows without completion tokens are left out (they
    add nothing to the loss). None when a row is not a prompt followed by one contiguous
    completion (valid = prompt + completion), which `pack_shared_prompts` needs."""
    groups: dict = {}
    for r in rows:
        c = np.flatnonzero(cmask_NxT[r])
        if len(c) == 0:
            continue
        P, L = int(c[0]), len(c)
        if c[-1] != P + L - 1 or not valid_NxT[r, :P + L].all() or valid_NxT[r, P + L:].any():
            return None
        key = (tokens_NxT[r, :P].tobytes(), positions_NxT[r, :P].tobytes())
        groups.setdefault(key, []).append(int(r))
    return list(groups.values())


def packed_micro_batches(groups, cmask_NxT: np.ndarray, size: int) -> list[list[list[int]]]:
    """The micro-batches of shared-prompt packed rows: each micro-batch a list of packed rows,
    each packed row a list of row indices of one group (its prompt and some of its completions).

    A packed row holds at most T tokens (the batch's padded length: prompt plus completions,
    each row of the batch fits) and a micro-batch at most `size` completions, so a packed
    micro-batch never holds more tokens, attention positions or scored completions than the
    padded micro-batch of `size` rows the memory plan sizes: a group too long or too large for
    one packed row is split into several, each repeating the prompt (a long-context group of 16
    completions no longer becomes one row of ~16 x T tokens). Groups keep their order; a
    micro-batch takes whole packed rows while they fit.

    Args:
      groups: lists of row indices with identical prompts (`shared_prompt_groups`).
      cmask_NxT: bool `[N, T]` completion mask (a row's completion is contiguous).
      size: completions per micro-batch, >= 1.
    """
    T = cmask_NxT.shape[1]
    lengths = cmask_NxT.sum(1)
    packed_rows = []
    for g in groups:
        P = int(np.argmax(cmask_NxT[g[0]]))
        row, n = [], P
        for r in g:
            L = int(lengths[r])
            if row and (n + L > T or len(row) == size):
                packed_rows.append(row)
                row, n = [], P
            row.append(int(r))
            n += L
        packed_rows.append(row)
    micro, n = [[]], 0
    for row in packed_rows:
        if micro[-1] and n + len(row) > size:
            micro.append([])
            n = 0
        micro[-1].append(row)
        n += len(row)
    return micro


def pack_shared_prompts(groups, cols: HostColumns, *,
                        bucket_counts: bool = True) -> PackedMicroBatch:
    """One micro-batch of shared-prompt packed rows: each group (rows with the same prompt) is
    one row `prompt ++ completion_1 ++ completion_2 ++ ...` (segments 0, 1, 2, ...: a completion
    attends to the prompt and to itself only, at its own positions), so the prompt's forward
    runs once per group instead of once per completion -- the same hidden states, so the same
    loss and gradient up to float rounding. Completion token j of row r is scored by the hidden
    state of its predecessor (the prompt's last token for j = 0).

    Args:
      groups: lists of row indices (`shared_prompt_groups`).
      cols: the batch's `HostColumns`.
      bucket_counts: pad G and R to `count_bucket`s of the group and completion counts (fewer
        compiled shapes): the extra packed rows repeat group 0's row, and the extra completion
        rows read it with an all-False completion mask and zero weight, advantage and log-probs,
        so they add exactly 0 to the loss, the gradient and every metric sum.

    Returns:
      a `PackedMicroBatch` with a leading micro-batch axis of 1; S and W are `length_bucket`s
      (64 / 32 floors).
    """
    cmask = cols.completion_mask
    spans = []  # (prompt length, [(row, completion length)]) per group
    for g in groups:
        P = int(np.argmax(cmask[g[0]]))
        spans.append((P, [(r, int(cmask[r].sum())) for r in g]))
    G, R = len(groups), sum(len(g) for g in groups)
    if bucket_counts:
        G, R = count_bucket(G), count_bucket(R)
    S = length_bucket(max(P + sum(L for _, L in rl) for P, rl in spans))
    W = length_bucket(max(L for _, rl in spans for _, L in rl), 32)
    out = PackedMicroBatch(
        tokens=np.zeros((G, S), np.int32), positions=np.zeros((G, S), np.int32),
        valid=np.zeros((G, S), bool), segments=np.zeros((G, S), np.int32),
        row_group=np.zeros((R,), np.int32), source=np.zeros((R, W), np.int32),
        targets=np.zeros((R, W), np.int32), completion_mask=np.zeros((R, W), bool),
        old_logprobs=np.zeros((R, W), np.float32), ref_logprobs=np.zeros((R, W), np.float32),
        advantages=np.zeros((R,), np.float32), weights=np.zeros((R, W), np.float32))
    _fill_packed(out, spans, cols)
    return jax.tree_util.tree_map(lambda x: x[None], out)


def _fill_packed(out: PackedMicroBatch, spans, cols: HostColumns) -> None:
    """Writes the groups `spans` ((prompt length, [(row, completion length)]) each) into the
    zeroed numpy leaves of `out`, in place."""
    tok, pos, val, seg = out.tokens, out.positions, out.valid, out.segments
    i = 0
    for gi, (P, rl) in enumerate(spans):
        r0 = rl[0][0]
        tok[gi, :P], pos[gi, :P], val[gi, :P] = cols.tokens[r0, :P], cols.positions[r0, :P], True
        off = P
        for si, (r, L) in enumerate(rl, start=1):
            sl = slice(P, P + L)
            tok[gi, off:off + L], pos[gi, off:off + L] = cols.tokens[r, sl], cols.positions[r, sl]
            val[gi, off:off + L], seg[gi, off:off + L] = True, si
            j = np.arange(L)
            out.row_group[i] = gi
            out.source[i, :L] = np.where(j == 0, P - 1, off + j - 1)
            out.targets[i, :L], out.completion_mask[i, :L] = cols.tokens[r, sl], True
            out.old_logprobs[i, :L] = cols.old_logprobs[r, sl]
            out.ref_logprobs[i, :L] = cols.ref_logprobs[r, sl]
            out.weights[i, :L], out.advantages[i] = cols.weights[r, sl], cols.advantages[r]
            off += L
            i += 1
    gi = len(spans)
    tok[gi:], pos[gi:], val[gi:], seg[gi:] = tok[0], pos[0], val[0], seg[0]
