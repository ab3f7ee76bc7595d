"""Fitting a draft head offline to recorded rollouts of its policy (`das-jax draft-head fit`).

The data: each rollout's prompt + output run once through the policy (teacher-forced), keeping
the three blocks' features at every position and the policy's next-token distribution given the
draft vocabulary (its top M tokens there; the lm_head reads the draft vocabulary's rows only);
the loss is `head.draft_loss` (EAGLE-3's training-time test, soft targets) on the output
positions, optimised with AdamW (linear warm-up, cosine decay, global-norm clip).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.draft_head.features import sequence_features
from das_jax.draft_head.head import HeadConfig, draft_loss, init_head
from das_jax.draft_head.store import DraftHead, policy_fingerprint
from das_jax.errors import UserError


OUTPUT_BUCKET = 64    # fit batches pad their outputs to a multiple of this many tokens


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """epochs: passes over the rollouts; batch: rollouts per step; lr: peak AdamW learning rate;
    weight_decay; clip: global-norm gradient clip; steps: draft steps of the training-time test;
    top_m: teacher tokens kept per position; draft_vocab: Vd (the most frequent tokens of the
    rollouts, at most this many); seed."""
    epochs: int = 4
    batch: int = 8
    lr: float = 2e-3
    weight_decay: float = 0.0
    clip: float = 1.0
    steps: int = 3
    top_m: int = 16
    draft_vocab: int = 4096
    seed: int = 0


def draft_vocabulary(sequences: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """The `size` most frequent ids of `sequences` (ties to the smaller id), int32, most frequent
    first: the head's draft vocabulary."""
    counts = collections.Counter(t for s in sequences for t in s)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return np.array([t for t, _ in ranked[:size]], np.int32)


MIN_FIT_STEPS = 2     # the warm-up + cosine schedule needs a step after the warm-up


def _buckets(token_lengths: Sequence[int]) -> np.ndarray:
    """Each rollout's output bucket (its output length rounded up to OUTPUT_BUCKET, >= one)."""
    return np.array([max(-(-int(n) // OUTPUT_BUCKET), 1) * OUTPUT_BUCKET for n in token_lengths],
                    dtype=np.int64)


def fit_steps(token_lengths: Sequence[int], batch: int, epochs: int) -> int:
    """Optimizer steps of a fit on rollouts of these output lengths: per epoch, each output
    bucket's rollouts in batches of `batch` (its last batch filled up), times `epochs`."""
    buckets = _buckets(token_lengths)
    return epochs * sum(-(-int((buckets == b).sum()) // batch) for b in np.unique(buckets))


def check_fit_size(rollouts, holdout_problems: Sequence[str], cfg: "FitConfig",
                   trace: str = "the trace") -> None:
    """Refuses, before any model loads, a fit with no rollouts left after the holdout or with
    fewer than MIN_FIT_STEPS optimizer steps (the learning-rate schedule needs them).

    Raises:
      UserError: naming the counts and the flags that change them."""
    hold = set(holdout_problems)
    rows = [r for r in rollouts if r.problem_id not in hold]
    if not rows:
        raise UserError(f"{trace}: no rollouts left to fit on after the holdout; lower "
                        "--holdout")
    total = fit_steps([len(r.token_ids) for r in rows], cfg.batch, cfg.epochs)
    if total < MIN_FIT_STEPS:
        raise UserError(f"{trace}: {len(rows)} rollout(s) to fit on make {total} optimizer "
                        f"step(s) (--epochs {cfg.epochs}, --batch {cfg.batch}); a fit needs at "
                        f"least {MIN_FIT_STEPS}: raise --epochs, lower --batch, or use a longer "
                        "trace")


def split_problems(problem_ids: Sequence[str], holdout: float) -> tuple[list, list]:
    """(fit problems, holdout problems): the last `ceil(holdout * n)` problems in order of first
    appearance are held out (never fitted on), so a benchmark can measure the head on problems
    it has not seen (an epoch 0 for it)."""
    seen = list(dict.fromkeys(problem_ids))
    n_hold = int(np.ceil(holdout * len(seen))) if holdout > 0 else 0
    return seen[:len(seen) - n_hold], seen[len(seen) - n_hold:]


def fit_head(model_config, params, model_name: str, rollouts, cfg: FitConfig,
             holdout_problems: Sequence[str] = (), log: Callable[[str], None] = print,
             bar=None, meta: dict | None = None) -> tuple[DraftHead, list]:
    """Fits a head to `rollouts` (`TraceRollout`s) of the policy (`model_config`, `params`),
    skipping those of `holdout_problems`.

    `bar(total, desc)` returns a progress bar (tqdm-like: `update(n)`, `set_postfix`, `close`);
    None: no bar. Returns (the head, per-epoch dicts of mean loss and top-1 agreement).
    """
    import optax   # deferred import: optax (only a fit needs it)

    check_fit_size(rollouts, holdout_problems, cfg)
    hold = set(holdout_problems)
    rows = [r for r in rollouts if r.problem_id not in hold]
    seqs = [list(r.prompt_ids) + list(r.token_ids) for r in rows]
    d2t = draft_vocabulary([r.token_ids for r in rows], cfg.draft_vocab)
    if not len(d2t):
        raise UserError("the rollouts to fit on hold no output tokens: nothing to draft")
    hc = HeadConfig.for_policy(model_config, len(d2t))

    log(f"draft head: {len(rows)} rollouts ({sum(map(len, seqs))} tokens) of "
        f"{len({r.problem_id for r in rows})} problems; draft vocabulary {len(d2t)}; features of "
        f"blocks {list(hc.feature_layers)}")
    pb = bar(len(seqs), "policy features") if bar else None
    # the teacher: the policy's next-token distribution given the draft vocabulary
    M = min(cfg.top_m, len(d2t))
    data = sequence_features(model_config, params, seqs, hc.feature_layers, M,
                             progress=pb.update if pb else None, vocab_ids=d2t)
    if pb:
        pb.close()

    B = cfg.batch
    D3 = 3 * model_config.hidden_size
    # Layout: every prompt left-padded to end at column P_pad (the longest prompt), outputs
    # after it, right-padded to the batch's output bucket (multiples of OUTPUT_BUCKET): one
    # compiled step per bucket. The loss's targets are output positions, so the head drafts
    # only from the anchors of columns >= P_pad - 1 - steps (`draft_loss`'s first_anchor): the
    # prompts cost their keys and values, not their queries, MLPs and logits.
    P_pad = max(len(r.prompt_ids) for r in rows)
    first_anchor = max(P_pad - 1 - cfg.steps, 0)
    bucket_of = _buckets([len(r.token_ids) for r in rows])

    def batch_arrays(idx):
        T = P_pad + int(bucket_of[idx].max())
        feats = np.zeros((B, T, D3), np.float32)
        tok = np.zeros((B, T), np.int32)
        pos = np.zeros((B, T), np.int32)
        valid = np.zeros((B, T), bool)
        target = np.zeros((B, T), bool)
        tid = np.full((B, T, M), -1, np.int32)
        tp = np.zeros((B, T, M), np.float32)
        for r, i in enumerate(idx):
            n, P = len(seqs[i]), len(rows[i].prompt_ids)
            c = P_pad - P                       # the row's left padding
            f, ids, p = data[i]
            feats[r, c:c + n], tok[r, c:c + n], valid[r, c:c + n] = f, seqs[i], True
            pos[r] = np.arange(T) - c
            target[r, c + max(P - 1, 0): c + n - 1] = True
            tid[r, c:c + n], tp[r, c:c + n] = ids, p
        return tuple(map(jnp.asarray, (feats, tok, valid, target, tid, tp, pos)))

    def epoch_batches(rng):
        """Batches of B rows of one length bucket each (a bucket's last batch filled with
        random rows of the same bucket), in random order."""
        out = []
        for T in np.unique(bucket_of):
            members = rng.permutation(np.flatnonzero(bucket_of == T))
            for s in range(0, len(members), B):
                idx = members[s:s + B]
                if len(idx) < B:
                    idx = np.concatenate([idx, rng.choice(members, B - len(idx))])
                out.append(idx)
        return [out[i] for i in rng.permutation(len(out))]

    embed = jnp.asarray(params["embed"], jnp.float32)
    rng = np.random.default_rng(cfg.seed)
    plan = [epoch_batches(rng) for _ in range(cfg.epochs)]
    total = sum(map(len, plan))
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, total // 20), total,
                                               cfg.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(cfg.clip),
                      optax.adamw(sched, weight_decay=cfg.weight_decay))
    hp = init_head(hc, jax.random.PRNGKey(cfg.seed))
    state = opt.init(hp)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(hp, state, feats, tok, valid, target, tid, tp, pos):
        (loss, m), g = jax.value_and_grad(
            lambda p: draft_loss(hc, p, embed, feats, tok, valid, target, tid, tp, cfg.steps,
                                 pos_BxT=pos, first_anchor=first_anchor),
            has_aux=True)(hp)
        up, state = opt.update(g, state, hp)
        return optax.apply_updates(hp, up), state, loss, m

    history = []
    pb = bar(total, "fit") if bar else None
    for epoch, batches in enumerate(plan):
        sums = collections.defaultdict(float)
        for idx in batches:
            hp, state, loss, m = step(hp, state, *batch_arrays(idx))
            sums["loss"] += float(loss)
            for k, v in m.items():
                sums[k] += float(v)
            if pb:
                pb.update(1)
                pb.set_postfix(loss=f"{float(loss):.3f}", top1=f"{float(m['top1_step1']):.2f}")
        rec = {"epoch": epoch, **{k: v / len(batches) for k, v in sums.items()}}
        history.append(rec)
        log(f"draft head epoch {epoch}: loss {rec['loss']:.3f}, top-1 agreement with the policy "
            + ", ".join(f"step {j} {rec[f'top1_step{j}']:.2f}" for j in range(1, cfg.steps + 1)))
    if pb:
        pb.close()
    info = dict(policy_fingerprint(model_name, model_config))
    info.update(meta or {})
    info.update({"fit_problems": sorted({r.problem_id for r in rows}),
                 "holdout_problems": list(holdout_problems), "fit_rollouts": len(rows),
                 "fit": dataclasses.asdict(cfg), "history": history})
    head = DraftHead(hc, jax.tree_util.tree_map(np.asarray, hp), d2t, info)
    return head, history
