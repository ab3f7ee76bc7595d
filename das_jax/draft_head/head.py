"""An EAGLE-3 draft head as pure functions over a params pytree.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", sections 3.1-3.2): the head drafts from the policy's own hidden states.
At an *anchor* position t (the last position whose policy features exist) it fuses the outputs
of a low, a middle and a high decoder block, `g_t = fc([h_low; h_mid; h_high])`, concatenates
`g_t` with the embedding of the token after t (`x_{t+1}`, the policy's input embedding, frozen),
and runs one decoder layer whose attention reads the same layer's keys and values at every
earlier anchor. Its output `a_t` gives the logits of `x_{t+2}` over a reduced *draft
vocabulary*, mapped back to the policy's vocabulary by `draft_to_target`. Further draft steps
feed the head its own output in place of `g`: step j (j >= 2) of anchor t takes
`(embed(d_{j-1}), a^{(j-1)}_t)` at position t + j - 1 and attends to the level-1 keys of anchors
<= t plus its own chain's earlier steps (the "training-time test" mask, the same in training and
drafting). The draft is the head's argmax at each step, so drafts are deterministic and the
verify rule keeps rollouts token-identical to decoding without drafts.

Params (D the policy's width, H / KVH / K the head's query heads, key/value heads and head width,
F its MLP width, Vd the draft vocabulary):

    fc             [3D, D]
    embed_norm     [D]        hidden_norm [D]
    wq             [2D, H, K]   wk, wv [2D, KVH, K]   wo [H, K, D]
    mlp_norm       [D]        w_gate, w_up [D, F]   w_down [F, D]
    final_norm     [D]        lm_head [Vd, D]

Tensor names carry their shapes: B rows, T anchors, J draft steps so far, D width.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.transformer import rms_norm, rope

Params = dict[str, Any]
_MASK = -1e30
WEIGHT_DTYPES = ("float32", "bfloat16")
# the matrices (`_mm`'s right-hand sides); the norms' weights stay float32
MATRICES = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The head's static shape (hashable: a jit static argument).

    hidden_size: D, the policy's width. feature_layers: the three decoder blocks (0-based) whose
    outputs are fused (EAGLE-3: low, middle, high). num_heads / num_kv_heads / head_dim /
    intermediate_size: the head's decoder layer. draft_vocab_size: Vd. rms_norm_eps and
    rope_theta: as the policy's. dtype: the dtype of its matrices where it drafts ("float32" or
    "bfloat16"; `cast_weights`): their products take inputs in that dtype and accumulate in
    float32. Fitting and online training keep float32 weights."""

    hidden_size: int
    feature_layers: tuple
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {self.dtype!r}")
        if len(self.feature_layers) != 3:
            raise ValueError(f"feature_layers must name 3 blocks, got {self.feature_layers}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @staticmethod
    def for_policy(model_config, draft_vocab_size: int) -> "HeadConfig":
        """The EAGLE-3 default for a policy `ModelConfig`: blocks 2, L/2 and L-3 fused (kept in
        order low <= middle <= high for small L), one decoder layer shaped as the policy's."""
        L = model_config.num_layers
        low = min(2, L - 1)
        high = max(low, L - 3)
        layers = (low, min(max(L // 2, low), high), high)
        return HeadConfig(model_config.hidden_size, layers, model_config.num_heads,
                          model_config.num_kv_heads, model_config.head_dim,
                          model_config.intermediate_size, int(draft_vocab_size),
                          float(model_config.rms_norm_eps), float(model_config.rope_theta))

    def inv_freq(self) -> np.ndarray:
        K = self.head_dim
        return (1.0 / (self.rope_theta ** (np.arange(0, K, 2, dtype=np.float64) / K))).astype(
            np.float32)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @staticmethod
    def from_dict(d: dict) -> "HeadConfig":
        d = dict(d)
        d["feature_layers"] = tuple(int(x) for x in d["feature_layers"])
        return HeadConfig(**d)


def init_head(hc: HeadConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random normal(0, scale) weights, norms 1 (float32)."""
    D, H, KVH, K, F, V = (hc.hidden_size, hc.num_heads, hc.num_kv_heads, hc.head_dim,
                          hc.intermediate_size, hc.draft_vocab_size)
    shapes = {"fc": (3 * D, D), "wq": (2 * D, H, K), "wk": (2 * D, KVH, K),
              "wv": (2 * D, KVH, K), "wo": (H, K, D), "w_gate": (D, F), "w_up": (D, F),
              "w_down": (F, D), "lm_head": (V, D)}
    keys = jax.random.split(key, len(shapes))
    p = {n: scale * jax.random.normal(k, s, jnp.float32)
         for k, (n, s) in zip(keys, sorted(shapes.items()))}
    for n in ("embed_norm", "hidden_norm", "mlp_norm", "final_norm"):
        p[n] = jnp.ones((D,), jnp.float32)
    return p


def cast_weights(params: Params, dtype: str) -> Params:
    """The head's params with its matrices (`MATRICES`) in `dtype` (one of `WEIGHT_DTYPES`):
    what a head drafting in bfloat16 reads, half the bytes of float32. Other params unchanged.
    Works on numpy and JAX arrays alike."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    dt = jnp.dtype(dtype)
    return {k: (v.astype(dt) if k in MATRICES else v) for k, v in params.items()}


def _mm(spec: str, x, w):
    """einsum(spec, x, w) with x cast to w's dtype, accumulated in float32."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _rms(x, w, eps):
    return rms_norm(x.astype(jnp.float32), w, eps)


def _paths(logits_BxTxJxV, draft_to_target):
    """(argmax tokens in the policy's vocabulary, path probabilities: the cumulative product of
    the head's softmax probability of its own argmax) of step logits."""
    probs = jax.nn.softmax(logits_BxTxJxV, axis=-1)
    idx = jnp.argmax(logits_BxTxJxV, axis=-1)
    p = jnp.take_along_axis(probs, idx[..., None], axis=-1)[..., 0]
    return draft_to_target[idx], jnp.cumprod(p, axis=-1)


def fuse(params: Params, feats_BxTx3D: jax.Array) -> jax.Array:
    """g = fc([h_low; h_mid; h_high]): float32 `[B, T, D]`."""
    return _mm("btf,fd->btd", feats_BxTx3D.astype(jnp.float32), params["fc"])


def _qkv_input(hc, p, emb_BxTxD, hid_BxTxD):
    """The layer's input `[norm(embed); norm(hidden)]`, float32 `[B, T, 2D]`."""
    return jnp.concatenate([_rms(emb_BxTxD, p["embed_norm"], hc.rms_norm_eps),
                            _rms(hid_BxTxD, p["hidden_norm"], hc.rms_norm_eps)], axis=-1)


def _q(hc, p, x_BxTx2D, pos_BxT):
    return rope(_mm("bte,ehk->bthk", x_BxTx2D, p["wq"]), pos_BxT, hc.inv_freq())


def _kv(hc, p, x_BxTx2D, pos_BxT):
    k = _mm("bte,ehk->bthk", x_BxTx2D, p["wk"])
    v = _mm("bte,ehk->bthk", x_BxTx2D, p["wv"])
    return rope(k, pos_BxT, hc.inv_freq()), v


def _qkv(hc, p, emb_BxTxD, hid_BxTxD, pos_BxT):
    x = _qkv_input(hc, p, emb_BxTxD, hid_BxTxD)
    return (_q(hc, p, x, pos_BxT),) + _kv(hc, p, x, pos_BxT)


def _finish(hc, p, hid_BxTxD, attn_BxTxHxK):
    h = hid_BxTxD + _mm("bthk,hkd->btd", attn_BxTxHxK, p["wo"])
    m = _rms(h, p["mlp_norm"], hc.rms_norm_eps)
    mlp = jax.nn.silu(_mm("btd,df->btf", m, p["w_gate"])) * _mm("btd,df->btf", m, p["w_up"])
    return h + _mm("btf,fd->btd", mlp, p["w_down"])


def logits(hc: HeadConfig, params: Params, a_BxTxD: jax.Array) -> jax.Array:
    """Draft-vocabulary logits, float32 `[B, T, Vd]`, of head outputs."""
    return _mm("btd,vd->btv", _rms(a_BxTxD, params["final_norm"], hc.rms_norm_eps),
               params["lm_head"])


def _attend(hc, q_BxTxHxK, k1_BxSxKVHxK, v1_BxSxKVHxK, mask_BxTxS, kd_JxBxTxKVHxK,
            vd_JxBxTxKVHxK):
    """Softmax attention over the level-1 keys under `mask` plus the chain's own keys (the
    diagonal: step i's key of the same anchor), float32."""
    B, T, H, K = q_BxTxHxK.shape
    N, G = hc.num_kv_heads, hc.num_heads // hc.num_kv_heads
    q = q_BxTxHxK.reshape(B, T, N, G, K) * (K ** -0.5)
    s_main = jnp.einsum("btngk,bsnk->bngts", q, k1_BxSxKVHxK)
    s_main = jnp.where(mask_BxTxS[:, None, None], s_main, _MASK)
    parts = [s_main]
    if kd_JxBxTxKVHxK is not None:
        parts.append(jnp.einsum("btngk,jbtnk->bngtj", q, kd_JxBxTxKVHxK))
    w = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
    S = k1_BxSxKVHxK.shape[1]
    out = jnp.einsum("bngts,bsnk->btngk", w[..., :S], v1_BxSxKVHxK)
    if kd_JxBxTxKVHxK is not None:
        out = out + jnp.einsum("bngtj,jbtnk->btngk", w[..., S:], vd_JxBxTxKVHxK)
    return out.reshape(B, T, H, K)


def run_levels(hc: HeadConfig, params: Params, embed_VxD: jax.Array, feats_BxTx3D: jax.Array,
               next_BxT: jax.Array, valid_BxT: jax.Array, steps: int,
               teacher_tokens_BxTxJ: jax.Array | None = None,
               draft_to_target: jax.Array | None = None, pos_BxT: jax.Array | None = None,
               first_anchor: int = 0):
    """Runs `steps` draft steps from every anchor of each row at once.

    Args:
      hc: head config. params: head params. embed_VxD: the policy's input embedding (frozen).
      feats_BxTx3D: the policy's fused-block features at each anchor (float).
      next_BxT: int32 policy token ids of the token after each anchor (`x_{t+1}`).
      valid_BxT: bool, anchors that exist (padding is never attended).
      steps: J >= 1 draft steps per anchor.
      teacher_tokens_BxTxJ: training only: int32 policy ids fed to steps 2..J (column j-1 is the
        token step j reads, `x_{t+j}`); None: each step reads the previous step's argmax, mapped
        through `draft_to_target` (drafting).
      pos_BxT: int32 the position of each column (rows may be left-padded: a column's position
        is its index less the row's padding); None: the column index. Columns are in position
        order within a row.
      first_anchor: static; draft only from the anchors of columns >= it (W = T - first_anchor
        of them). The level-1 keys and values of every column are still computed, as the
        drafting anchors attend to them, but the queries, MLPs, logits and later steps are
        computed for the W anchors only: training on output positions skips the prompt's.

    Returns:
      list of J float32 logits `[B, W, Vd]`: step j's prediction of token `x_{t+j+1}` for the
      anchors of columns first_anchor..T-1.
    """
    B, T = next_BxT.shape
    c0 = int(first_anchor)
    if not 0 <= c0 < T:
        raise ValueError(f"first_anchor must be in [0, {T}), got {first_anchor}")
    if pos_BxT is None:
        pos_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = ((jnp.arange(T)[None, :] <= jnp.arange(c0, T)[:, None])[None]
            & valid_BxT[:, None, :])                                      # [B, W, T]
    hid = fuse(params, feats_BxTx3D)
    emb = embed_VxD[next_BxT].astype(jnp.float32)
    k1, v1 = _kv(hc, params, _qkv_input(hc, params, emb, hid), pos_BxT)
    hid, emb, pos = hid[:, c0:], emb[:, c0:], pos_BxT[:, c0:]
    q = _q(hc, params, _qkv_input(hc, params, emb, hid), pos)
    a = _finish(hc, params, hid, _attend(hc, q, k1, v1, mask, None, None))
    outs = [logits(hc, params, a)]
    kd, vd = [], []
    for j in range(2, steps + 1):
        if teacher_tokens_BxTxJ is not None:
            tok = teacher_tokens_BxTxJ[:, c0:, j - 1]
        else:
            tok = draft_to_target[jnp.argmax(outs[-1], axis=-1)]
        emb = embed_VxD[tok].astype(jnp.float32)
        q, k, v = _qkv(hc, params, emb, a, pos + (j - 1))
        kd.append(k)
        vd.append(v)
        a = _finish(hc, params, a, _attend(hc, q, k1, v1, mask, jnp.stack(kd), jnp.stack(vd)))
        outs.append(logits(hc, params, a))
    return outs


def draft_all_anchors(hc: HeadConfig, params: Params, embed_VxD, draft_to_target,
                      feats_BxTx3D, next_BxT, valid_BxT, steps: int):
    """The head's draft from every anchor: (tokens int32 `[B, T, J]` in the policy's vocabulary,
    path probabilities float32 `[B, T, J]`, the product of the head's softmax probabilities of
    its own argmax up to each step: its estimate that the draft's first j tokens are accepted)."""
    outs = run_levels(hc, params, embed_VxD, feats_BxTx3D, next_BxT, valid_BxT, steps,
                      draft_to_target=draft_to_target)
    return _paths(jnp.stack(outs, axis=2), draft_to_target)


def draft_loss(hc: HeadConfig, params: Params, embed_VxD, feats_BxTx3D, tokens_BxT, valid_BxT,
               target_BxT, teacher_idx_BxTxM, teacher_p_BxTxM, steps: int = 3,
               decay: float = 0.8, pos_BxT=None, first_anchor: int = 0):
    """Training-time-test loss of EAGLE-3 (section 3.2): for each anchor t and step j, soft
    cross-entropy of the head's step-j logits against the policy's (detached) next-token
    distribution at position t + j (given the draft vocabulary), weighted decay^(j-1), averaged
    over the targets that exist.

    Args:
      tokens_BxT: int32 policy ids of each row's sequence (prompt + output); anchor t reads
        x_{t+1}. feats_BxTx3D: the policy's features at each position. valid_BxT: real positions.
      target_BxT: bool, positions whose next-token distribution is a training target (the
        output positions: the head drafts only there).
      teacher_idx_BxTxM: int32 draft-vocab ids of the policy's top-M tokens at each position
        (-1: none, e.g. padding); teacher_p_BxTxM: their probabilities.
      pos_BxT, first_anchor: as in `run_levels` (left-padded rows; only anchors of columns
        >= first_anchor are drafted from, so targets must lie past first_anchor: with the
        prompts left-padded to end at column P, first_anchor = P - 1 - steps loses none and
        skips the prompt's queries, MLPs and logits).

    Returns:
      (scalar loss, dict of per-step top-1 agreement with the teacher's argmax, float32).
    """
    B, T = tokens_BxT.shape
    M = teacher_idx_BxTxM.shape[-1]

    def shift(x, j, fill):
        return jnp.concatenate([x[:, j:], jnp.full((B, j) + x.shape[2:], fill, x.dtype)], 1)

    nxt = shift(tokens_BxT, 1, 0)
    teach = jnp.stack([shift(tokens_BxT, j, 0) for j in range(1, steps + 1)], axis=-1)
    anchor_ok = valid_BxT & shift(valid_BxT, 1, False)
    outs = run_levels(hc, params, embed_VxD, feats_BxTx3D, nxt, anchor_ok, steps,
                      teacher_tokens_BxTxJ=teach, pos_BxT=pos_BxT, first_anchor=first_anchor)
    c0 = int(first_anchor)
    total, weight, metrics = 0.0, 0.0, {}
    for j, lg in enumerate(outs, start=1):
        ok = (anchor_ok & shift(target_BxT & valid_BxT, j, False))[:, c0:]
        idx = shift(teacher_idx_BxTxM, j, -1)[:, c0:]
        p = shift(teacher_p_BxTxM, j, 0.0)[:, c0:]
        logp = jax.nn.log_softmax(lg, axis=-1)
        got = jnp.take_along_axis(logp, jnp.maximum(idx, 0), axis=-1)
        ce = -jnp.sum(jnp.where(idx >= 0, p * got, 0.0), axis=-1)
        n = jnp.maximum(jnp.sum(ok), 1)
        total = total + (decay ** (j - 1)) * jnp.sum(jnp.where(ok, ce, 0.0)) / n
        weight += decay ** (j - 1)
        hit = jnp.argmax(lg, axis=-1) == idx[..., 0]
        metrics[f"top1_step{j}"] = jnp.sum(ok & hit) / n
    del M
    return total / weight, metrics


@dataclasses.dataclass(frozen=True)
class HeadCache:
    """The head's KV cache, one layer: the level-1 keys / values of every anchor a row has
    committed. k, v: float32 `[B, S, KVH, K]`; length_B: int32 anchors held per row."""
    k: jax.Array
    v: jax.Array
    length_B: jax.Array

    @staticmethod
    def zeros(hc: HeadConfig, rows: int, max_len: int) -> "HeadCache":
        shape = (rows, max_len, hc.num_kv_heads, hc.head_dim)
        return HeadCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                         jnp.zeros((rows,), jnp.int32))


jax.tree_util.register_dataclass(HeadCache, data_fields=["k", "v", "length_B"], meta_fields=[])


def extend_and_draft(hc: HeadConfig, params: Params, embed_VxD, draft_to_target,
                     cache: HeadCache, feats_BxWx3D, next_BxW, n_B, steps: int,
                     kv_len: int | None = None):
    """One rollout step of the head, on device: commits each row's new anchors to its cache and
    drafts `steps` tokens from the last one.

    Args:
      cache: the rows' `HeadCache`. feats_BxWx3D: the policy's block features of the positions
        the verify step just committed (its first n_B[b] input positions; W its width).
      next_BxW: int32 the token after each of those positions (the accepted drafts, then the
        sampled token). n_B: int32 anchors committed per row this step (0 <= n_B <= W; a row
        with 0 keeps its cache and drafts nothing useful).
      steps: J draft tokens.
      kv_len: static; the drafts attend to the cache's first `kv_len` positions only (>= every
        row's length after the commit; None: all S). The attention's cost follows the rows'
        lengths, not the cache's size.

    Precondition: `length_B + n_B <= S` (anchors past the cache are dropped; the length stops
    at S), and `<= kv_len` when given.

    Returns:
      (new cache, draft tokens int32 `[B, J]` in the policy's vocabulary, path probabilities
      float32 `[B, J]`, 0 for a row that committed nothing). Equal to `draft_all_anchors` at each
      row's last anchor (a test checks).
    """
    B, W = next_BxW.shape
    S = cache.k.shape[1]
    pos_BxW = cache.length_B[:, None] + jnp.arange(W, dtype=jnp.int32)[None]
    hid = fuse(params, feats_BxWx3D)
    emb = embed_VxD[next_BxW].astype(jnp.float32)
    q, k, v = _qkv(hc, params, emb, hid, pos_BxW)
    keep_BxW = jnp.arange(W)[None] < n_B[:, None]
    idx_BxW = jnp.where(keep_BxW, pos_BxW, S)          # out of range: dropped

    def write(c, new):
        return jax.vmap(lambda cb, ib, nb: cb.at[ib].set(nb, mode="drop"))(c, idx_BxW, new)
    kc, vc = write(cache.k, k), write(cache.v, v)
    new_len = jnp.minimum(cache.length_B + n_B, S)
    A = S if kv_len is None else max(1, min(int(kv_len), S))
    ka, va = kc[:, :A], vc[:, :A]                       # the positions the drafts attend to
    # the last new anchor of each row: attends to its cache up to and including itself
    last = jnp.maximum(n_B - 1, 0)
    take = lambda x: jnp.take_along_axis(x, last[:, None, None, None], axis=1)  # noqa: E731
    q1 = take(q)
    mask_Bx1xA = (jnp.arange(A)[None] < new_len[:, None])[:, None]
    h1 = jnp.take_along_axis(hid, last[:, None, None], axis=1)
    a = _finish(hc, params, h1, _attend(hc, q1, ka, va, mask_Bx1xA, None, None))
    outs = [logits(hc, params, a)]
    pos = (new_len - 1)[:, None]
    kd, vd = [], []
    for j in range(2, steps + 1):
        tok = draft_to_target[jnp.argmax(outs[-1], axis=-1)]
        e = embed_VxD[tok].astype(jnp.float32)
        qj, kj, vj = _qkv(hc, params, e, a, pos + (j - 1))
        kd.append(kj)
        vd.append(vj)
        a = _finish(hc, params, a, _attend(hc, qj, ka, va, mask_Bx1xA, jnp.stack(kd),
                                           jnp.stack(vd)))
        outs.append(logits(hc, params, a))
    tok, path = _paths(jnp.concatenate(outs, axis=1), draft_to_target)
    return HeadCache(kc, vc, new_len), tok, jnp.where(n_B[:, None] > 0, path, 0.0)
