"""Position-keyed sampling: the rule that makes speculative decoding token-exact.

For a request seed `s` and the absolute index `t` of the token being sampled, the draw is one
uniform `u = U(s, t)` derived from `jax.random.fold_in(PRNGKey(s), t)`, and the token is the
inverse CDF of the processed distribution (temperature, then top-k, then top-p, in token-id
order) at `u`. The token is therefore a pure function of (processed logits at t, s, t): it never
depends on a draft, a batch position or a slot, so speculation changes only the number of forward
passes (see docs/design.md, "Sampling rule"). For a point-mass draft, accepting while the
draft equals the sampled token accepts draft token d with probability p(d), the same acceptance
probability as speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

Returned log-probs are those of the *policy*, not of the truncated sampling distribution: the
log-prob of the chosen token under the temperature-scaled full softmax ``log_softmax(logits / T)``
(top-k / top-p shape which token is drawn, not the reported log-prob). This is the distribution
the trainer scores tokens under (``models.transformer.token_logprobs``, as TRL and verl do), so
rollout log-probs can serve as the GRPO "old" log-probs and the importance ratio compares the same
distribution on both sides (see README, "Old log-probs"). :func:`processed_logprobs` gives the
sampling distribution itself. Temperature 0 is greedy (argmax, lowest id on ties) and its returned
log-prob is the model's temperature-1 log-prob of the chosen token.

Numerics of ``logits / T`` (:func:`tempered_log_softmax`): the row max is subtracted *before*
dividing by T, and the max entries are set to exactly 0, so no T > 0 overflows: as T -> 0+ the
distribution tends to a point mass on the argmax (uniform over exact ties) and, once the gaps over
T leave float range, it *is* that point mass -- the sampled token equals greedy's whenever the
argmax is unique, and the returned log-prob is 0. Masked tokens (-inf logits) get probability 0,
+inf logits share all the mass, and for large T the shifted logits are divided before they are
subtracted so that no finite gap overflows. Every returned log-prob is finite and <= 0, jitted or
not.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from das_jax.models import contraction as cx


class SamplingError(ValueError):
    """Invalid sampling parameters (names the parameter and its valid range)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled and when a rollout stops.

    Attributes:
      temperature: >= 0; 0 means greedy.
      top_k: keep the k most likely tokens (ties at the k-th value are kept); 0 disables.
      top_p: nucleus mass in (0, 1]; 1 disables. Keeps the smallest set of most likely tokens whose
        mass reaches top_p (ties at the threshold are kept).
      max_new_tokens: >= 1, generated tokens per rollout (the stop token counts).
      stop_token_ids: extra stop ids besides the tokenizer's eos ids; the stop token is emitted.
      seed: run seed; request seeds derive from (seed, problem id, sample index).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                                f"{self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1] (1 disables), got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got "
                                f"{self.max_new_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def static_key(self) -> tuple:
        """The part of the params that shapes the compiled sampling code."""
        return (float(self.temperature), int(self.top_k), float(self.top_p))


def request_seed(run_seed: int, problem_id: str | int, sample_index: int) -> int:
    """A 31-bit request seed from (run seed, problem id, sample index) only (stable across runs).

    Never derived from a slot, batch position or device, so none of them can change a rollout.
    """
    digest = hashlib.blake2b(f"{run_seed}\x1f{problem_id}\x1f{sample_index}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _float_bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _bisect_threshold(probs_NxV: jax.Array, enough) -> jax.Array:
    """Per row, the largest tau among the row's values with `enough(probs >= tau)` true.

    `enough(mask_NxV) -> bool[N]` must be monotone (true at tau = 0, false above the max).
    Bisection over the int32 bit patterns of non-negative float32 values (order-preserving), so
    32 masked reductions find tau exactly, without a sort (XLA's CPU sort and top_k cost
    milliseconds per row at V = 49152). Returns float32 `[N, 1]`.
    """
    lo = jnp.zeros(probs_NxV.shape[:1], jnp.int32)           # bits(0.0): always enough
    hi = _float_bits(jnp.max(probs_NxV, axis=-1)) + 1        # above the max: never enough

    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2
        tau = jax.lax.bitcast_convert_type(mid, jnp.float32)[:, None]
        ok = enough(probs_NxV >= tau)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)[:, None]


def _top_p_threshold(probs_NxV: jax.Array, top_p: float, policy=cx.FAST) -> jax.Array:
    """Exact nucleus threshold per row: the largest tau with sum(p[p >= tau]) >= top_p."""
    return _bisect_threshold(
        probs_NxV,
        lambda mask: cx.row_sum(policy, jnp.where(mask, probs_NxV, 0.0)) >= top_p)


def _top_k_threshold(probs_NxV: jax.Array, top_k: int) -> jax.Array:
    """The k-th largest probability per row: the largest tau with #(p >= tau) >= k."""
    return _bisect_threshold(probs_NxV, lambda mask: jnp.sum(mask, axis=-1) >= top_k)


def tempered_log_softmax(logits_NxV: jax.Array, temperature: float,
                         policy=cx.FAST) -> jax.Array:
    """``log_softmax(logits / temperature)`` computed without overflow for any T > 0.

    Args:
      logits_NxV: logits, any float dtype (computed in float32); -inf marks a masked token.
      temperature: a Python float > 0 (static).
      policy: the model's `ContractionPolicy` (exact mode: row-count-invariant max and sum).

    Returns:
      float32 `[N, V]` log-probs, each <= 0; -inf exactly where the probability is 0 in float32
      (masked tokens, or gaps beyond float range at tiny T). A row whose entries are all -inf is
      uniform; rows with +inf entries are uniform over those entries.

    The row max ``m`` is subtracted first and the entries equal to ``m`` become exactly 0 (so
    ``inf - inf`` never appears); the others become ``(x - m) / T`` for ``T <= 1`` (an overflow
    to -inf there is the true limit) and ``(x a - m a) a`` with ``a = sqrt(1 / T)`` for
    ``T > 1`` (no finite gap overflows, and no subnormal ``1 / T`` is flushed to zero).
    """
    if not temperature > 0:
        raise SamplingError(f"temperature must be > 0 here (0 is greedy), got {temperature!r}")
    x = logits_NxV.astype(jnp.float32)
    m = cx.row_max(policy, x, keepdims=True)
    if temperature <= 1.0:
        z = (x - m) / jnp.float32(temperature)
    else:
        # XLA turns `/ T` into `* (1 / T)`, and 1 / T is subnormal (flushed to 0) above ~8.5e37:
        # scale by a = sqrt(1 / T) twice (normal for every finite T), with a barrier so XLA cannot
        # fold the two factors back into one. x * a - m * a cannot overflow where a finite z could.
        a = jnp.float32(math.sqrt(1.0 / temperature))
        z = jax.lax.optimization_barrier(x * a - m * a) * a
    # the max entries are exactly 0; below a +inf max everything is -inf (no inf - inf, and no
    # inf * 0 where XLA turns / T into * (1 / T) with 1 / T flushed to zero)
    z = jnp.where(x == m, 0.0, jnp.where(m == jnp.inf, -jnp.inf, z))
    logp = z - jnp.log(cx.row_sum(policy, jnp.exp(z), keepdims=True))
    return jnp.minimum(logp, 0.0)


def _renormalize(logp_NxV: jax.Array, policy) -> jax.Array:
    if policy.exact:
        return jnp.minimum(cx.log_softmax(policy, logp_NxV), 0.0)
    return jnp.minimum(logp_NxV - jax.nn.logsumexp(logp_NxV, axis=-1, keepdims=True), 0.0)


def processed_logprobs(logits_NxV: jax.Array, temperature: float, top_k: int, top_p: float,
                       policy=cx.FAST):
    """Log-probabilities of the sampling distribution: float32 `[N, V]`, -inf outside the support,
    every entry <= 0 (see :func:`tempered_log_softmax` for T -> 0+).

    temperature must be > 0 here (greedy is handled by the caller). policy: a
    `ContractionPolicy`; exact mode sums every normaliser with a row-count-invariant tree.
    """
    return _truncate(tempered_log_softmax(logits_NxV, temperature, policy), top_k, top_p, policy)


def _truncate(logp: jax.Array, top_k: int, top_p: float, policy=cx.FAST) -> jax.Array:
    """Top-k then top-p applied to log-probs `[N, V]`, renormalised; -inf outside the support."""
    if top_k and top_k < logp.shape[-1]:
        probs = jnp.exp(logp)
        logp = _renormalize(jnp.where(probs >= _top_k_threshold(probs, top_k), logp, -jnp.inf),
                            policy)
    if top_p < 1.0:
        probs = jnp.exp(logp)
        tau = _top_p_threshold(probs, top_p, policy)
        logp = _renormalize(jnp.where(probs >= tau, logp, -jnp.inf), policy)
    return logp


def uniforms(seeds_N: jax.Array, index_N: jax.Array) -> jax.Array:
    """u = U(seed, t) in (0, 1], float32 `[N]`: one draw per (request seed, absolute token index)."""
    def one(seed, t):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), t)
        return 1.0 - jax.random.uniform(key, (), jnp.float32)
    return jax.vmap(one)(seeds_N, index_N)


def sample(
    logits_NxV: jax.Array,
    seeds_N: jax.Array,
    index_N: jax.Array,
    sampling: SamplingParams | tuple,
    policy=cx.FAST,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row with the position-keyed rule.

    Args:
      logits_NxV: float32 logits.
      seeds_N: int32 request seeds.
      index_N: int32 absolute index (in prompt + completion) of the token being sampled.
      sampling: `SamplingParams` or its `static_key()` (temperature, top_k, top_p).
      policy: `ContractionPolicy` of the model (exact mode: row-count-invariant normalisers).

    Returns:
      (tokens_N int32, logprobs_N float32): the chosen tokens (drawn from the processed
      distribution) and their log-probs under the policy, the temperature-scaled *full* softmax
      (module docstring); finite and <= 0.
    """
    temperature, top_k, top_p = (sampling.static_key() if isinstance(sampling, SamplingParams)
                                 else sampling)
    if temperature == 0:
        tokens = jnp.argmax(logits_NxV, axis=-1).astype(jnp.int32)
        logp = tempered_log_softmax(logits_NxV, 1.0, policy)
        return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    policy_logp = tempered_log_softmax(logits_NxV, temperature, policy)
    logp = _truncate(policy_logp, top_k, top_p, policy)
    cdf_NxV = jnp.cumsum(jnp.exp(logp), axis=-1)
    u_N = uniforms(seeds_N, index_N)
    target = u_N * cdf_NxV[:, -1]
    # Inverse CDF in token-id order: the first token whose cumulative mass reaches u.
    tokens = jnp.sum(cdf_NxV < target[:, None], axis=-1).astype(jnp.int32)
    tokens = jnp.minimum(tokens, logits_NxV.shape[-1] - 1)
    return tokens, jnp.take_along_axis(policy_logp, tokens[:, None], axis=-1)[:, 0]


def validate_stop_ids(ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    out = tuple(int(i) for i in ids)
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise SamplingError(f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
    return out
