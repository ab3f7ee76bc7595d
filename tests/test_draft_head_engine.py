"""The draft head inside the engine: the prefill and verify programs return the head's
features, the head drafts on device after each of them, and the drafts the scheduler hands the
drafter at every step are the head's drafts from each row's last committed position, computed
from the whole sequence (`draft_all_anchors` over the policy's teacher-forced features). Rollouts
stay token-identical to plain decoding (dense and paged caches, prompt sharing, compaction,
refills, preemption)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.draft_head.drafter import HEAD_SOURCE, HeadDrafts
from das_jax.draft_head.features import block_features
from das_jax.draft_head.head import HeadConfig, draft_all_anchors, init_head
from das_jax.draft_head.runtime import HeadRuntime
from das_jax.draft_head.store import DraftHead
from das_jax.drafter import DRAFT_SOURCES, make_drafter
from das_jax.drafter.base import DraftBatch, append_batch
from das_jax.engine import Engine, EngineConfig, Request, SamplingParams
from das_jax.models.packed import forward_packed_hidden
from das_jax.models.transformer import KVCache
from das_jax.testing.models import tiny_model_config, tiny_params

CFG = tiny_model_config(num_layers=4)
PARAMS = tiny_params(CFG, scale=0.5)
VD = 40
STEPS = 3


def _head(seed=0, layers=None):
    hc = HeadConfig.for_policy(CFG, VD)
    if layers is not None:
        hc = dataclasses.replace(hc, feature_layers=layers)
    params = init_head(hc, jax.random.PRNGKey(seed), scale=0.3)
    d2t = (np.arange(VD, dtype=np.int32) * 3 + 2) % CFG.vocab_size
    return DraftHead(hc, {k: np.asarray(v) for k, v in params.items()}, d2t, {})


class Recording(HeadDrafts):
    """Records each row's head draft and how many tokens its request held when it got it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.held, self.seen = {}, []

    def begin(self, rid, problem_id, prompt_ids):
        self.held[rid] = list(prompt_ids)
        super().begin(rid, problem_id, prompt_ids)

    def append_batch(self, request_ids, tokens_AxW, n_A, index_later=False):
        for r, t, n in zip(request_ids, tokens_AxW, n_A):
            self.held[int(r)] += [int(x) for x in t[:n]]
        super().append_batch(request_ids, tokens_AxW, n_A, index_later)

    def set_model_drafts(self, req_A, tok_AxJ, probs_AxJ):
        for r, t, p in zip(req_A, tok_AxJ, probs_AxJ):
            self.seen.append((int(r), len(self.held[int(r)]), t.copy(), p.copy()))
        super().set_model_drafts(req_A, tok_AxJ, probs_AxJ)


class CountingRuntime(HeadRuntime):
    """Counts the head cache's compactions and admission calls."""

    def __init__(self, *a):
        super().__init__(*a)
        self.calls = {"compact": 0, "admit": 0}

    def compact(self, live, new_batch):
        self.calls["compact"] += 1
        super().compact(live, new_batch)

    def admit(self, *a):
        self.calls["admit"] += 1
        return super().admit(*a)


def _requests(n_prompts=3, group=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_prompts):
        prompt = tuple(int(t) for t in rng.integers(2, CFG.vocab_size, 5 + 3 * i))
        out += [Request(prompt, problem_id=f"p{i}", sample_index=g) for g in range(group)]
    return out


def _reference(head, seqs, T=64):
    """Per sequence, the head's draft from every anchor (`draft_all_anchors` over the policy's
    teacher-forced features), in one padded call: [(tokens `[T, J]`, probs `[T, J]`)]."""
    hc = head.config
    hp = jax.tree_util.tree_map(jnp.asarray, head.params)
    embed, d2t = jnp.asarray(PARAMS["embed"]), jnp.asarray(head.draft_to_target)
    tok = np.zeros((len(seqs), T), np.int32)
    valid = np.zeros((len(seqs), T), bool)
    nxt = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        tok[i, :len(s)] = s
        valid[i, :len(s) - 1] = True
        nxt[i, :len(s) - 1] = s[1:]
    real = np.arange(T)[None] < np.array([len(s) for s in seqs])[:, None]
    f = block_features(CFG, PARAMS, jnp.asarray(tok), jnp.asarray(real), hc.feature_layers)
    t, p = draft_all_anchors(hc, hp, embed, d2t, f, jnp.asarray(nxt), jnp.asarray(valid), STEPS)
    return [(np.asarray(t[i]), np.asarray(p[i])) for i in range(len(seqs))]


def test_features_of_the_packed_forward_are_the_blocks_outputs():
    """`forward_packed_hidden(feature_layers=...)` returns the named blocks' outputs: equal to
    the teacher-forced forward's (`block_features`) at the same positions."""
    seq = np.random.default_rng(1).integers(2, CFG.vocab_size, 9).astype(np.int32)
    layers = (0, 2, 3)
    want = block_features(CFG, PARAMS, jnp.asarray(seq)[None], jnp.ones((1, 9), bool), layers)
    cache = KVCache.zeros(CFG, 1, 16, jnp.float32)
    n = len(seq)
    _, _, feats = forward_packed_hidden(
        CFG, PARAMS, jnp.asarray(seq), jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32),
        cache, jnp.zeros(1, jnp.int32), width=n, kv_len=0, feature_layers=layers)
    np.testing.assert_allclose(feats, want[0], rtol=1e-4, atol=1e-3)   # values up to ~40
    with pytest.raises(ValueError, match="block 4 is outside the model's 4 blocks"):
        forward_packed_hidden(CFG, PARAMS, jnp.asarray(seq), jnp.zeros(n, jnp.int32),
                              jnp.arange(n, dtype=jnp.int32), cache, jnp.zeros(1, jnp.int32),
                              width=n, kv_len=0, feature_layers=(0, 1, 4))


@pytest.mark.parametrize("kv_cache,slots,share", [("dense", 4, True), ("paged", 8, True),
                                                  ("dense", 4, False)])
def test_engine_head_drafts_are_the_heads_drafts_and_tokens_are_unchanged(kv_cache, slots,
                                                                          share):
    """Every step, each row's head draft equals `draft_all_anchors` of the finished sequence at
    the row's last committed position (so the features of prefill, shared-prompt admissions,
    refills, verify steps and compaction are the right ones, in the right rows); the rollout's
    tokens and log-probs equal plain decoding's."""
    head = _head()
    reqs = _requests()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=14, seed=3)
    # without sharing, prefills of at most 16 slots: one admission runs several prefill calls
    ec = EngineConfig(max_slots=slots, max_cache_len=64, draft_widths=(1, 2, 4),
                      kv_cache=kv_cache, share_prompts=share,
                      max_prefill_tokens=None if share else 16)
    eng = Engine(CFG, PARAMS, eos_token_ids=(1,), engine_config=ec)
    plain, _ = eng.generate(reqs, sampling)
    runtime = CountingRuntime(head, STEPS)
    drafter = Recording(runtime)
    out, stats = eng.generate(reqs, sampling, drafter=drafter)
    assert runtime.calls["admit"] >= 2                      # refills
    if kv_cache == "dense":
        assert runtime.calls["compact"] >= 1                # the tail was compacted
    assert runtime.cache is None                            # freed when generate ended
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    for o, p in zip(out, plain):
        np.testing.assert_allclose(o.logprobs, p.logprobs, rtol=1e-5, atol=1e-5)
    assert stats.drafted_tokens > 0
    assert set(stats.drafted_by_source) == {"head"}
    # the reference: the head over each finished sequence's teacher-forced features
    want = _reference(head, [list(r.prompt_ids) + o.token_ids for r, o in zip(reqs, out)])
    assert len(drafter.seen) >= stats.forward_passes
    for rid, held, tok, p in drafter.seen:
        a = held - 2                     # the last committed position (the pending token next)
        np.testing.assert_array_equal(tok, want[rid][0][a], err_msg=f"request {rid} at {held}")
        np.testing.assert_allclose(p, want[rid][1][a], rtol=1e-4, atol=1e-6)


def test_paged_preemption_keeps_the_heads_rows_right():
    """A pool too small for every row preempts and resumes rows: the resumed row's head cache
    is rebuilt from its recomputed prefill, so its drafts stay the head's drafts."""
    head = _head(2)
    reqs = _requests(n_prompts=2, group=4, seed=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1)
    ec = EngineConfig(max_slots=8, max_cache_len=64, draft_widths=(1, 4), kv_cache="paged",
                      page_size=4, kv_pages=24)
    eng = Engine(CFG, PARAMS, eos_token_ids=(), engine_config=ec)
    plain, _ = eng.generate(reqs, sampling)
    drafter = Recording(HeadRuntime(head, STEPS))
    out, stats = eng.generate(reqs, sampling, drafter=drafter)
    assert stats.preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    want = _reference(head, [list(r.prompt_ids) + o.token_ids for r, o in zip(reqs, out)])
    for rid, held, tok, p in drafter.seen:
        np.testing.assert_array_equal(tok, want[rid][0][held - 2])
        np.testing.assert_allclose(p, want[rid][1][held - 2], rtol=1e-4, atol=1e-6)


def test_choice_between_head_and_history():
    """Per row the larger expected accepted length wins (the head's probabilities scaled);
    the policy sees the head's scaled probabilities capped at 1; sources are counted."""

    class History:
        def propose_batch(self, ids, k_A):
            n = len(ids)
            b = DraftBatch.empty(n, 2)
            b.tokens_AxK[:] = 9
            b.probs_AxK[:] = [[0.9, 0.8], [0.2, 0.1], [0.0, 0.0]][:n]
            b.lens_A[:] = [2, 2, 0][:n]
            return dataclasses.replace(b, source_A=np.array([0, 2, -1][:n], np.int8))

    class Runtime:
        steps = 3
    d = HeadDrafts(Runtime(), History(), head_scale=2.0)
    d.set_model_drafts([12, 10, 11], np.array([[5, 6, 7]] * 3, np.int32),
                       np.array([[0.4, 0.2, 0.1], [0.5, 0.4, 0.3], [0.3, 0.0, 0.0]], np.float32))
    out = d.propose_batch(np.array([10, 11, 12]), np.array([3, 3, 2]))
    # request 10: head 1.0 + 0.8 + 0.6 (2x, capped at 1) = 2.4 > 1.7; request 11: 0.6 > 0.3;
    # request 12: 2 x (0.4 + 0.2) = 1.2 > 0 (no history draft), cut to its 2 tokens
    assert out.source_A.tolist() == [HEAD_SOURCE] * 3
    np.testing.assert_allclose(out.probs_AxK[0], [1.0, 0.8, 0.6])
    np.testing.assert_allclose(out.probs_AxK[2], [0.8, 0.4, 0.0])
    assert out.lens_A.tolist() == [3, 3, 2]
    assert out.tokens_AxK[0].tolist() == [5, 6, 7] and not out.has_support_A.any()
    # each row's losing draft rides along for a policy that prices both (`pick_sources`)
    assert out.alternative.source_A.tolist() == [0, 2, -1]
    assert out.alternative.lens_A.tolist() == [2, 2, 0]
    assert out.alternative.tokens_AxK[:2, :2].tolist() == [[9, 9], [9, 9]]
    d.set_model_drafts([10, 11, 12], np.zeros((3, 3), np.int32),
                       np.array([[0.3, 0.1, 0.0], [0.0] * 3, [0.0] * 3], np.float32))
    out = d.propose_batch(np.array([10, 11, 12]), np.array([3, 3, 3]))
    assert out.source_A.tolist() == [0, 2, -1]          # 0.8 < 1.7; no head draft; none
    assert out.alternative.source_A.tolist() == [HEAD_SOURCE, -1, -1]
    assert out.alternative.tokens_AxK[0].tolist() == [0, 0, 0] and out.alternative.lens_A[0] == 3
    assert out.lens_A.tolist() == [2, 2, 0]
    assert out.tokens_AxK[:2, :2].tolist() == [[9, 9], [9, 9]]
    assert d.source_counts == {"head": 3, "history": 2, "none": 1}
    assert DRAFT_SOURCES[HEAD_SOURCE] == "head"
    out = d.propose_batch(np.array([99]), np.array([3]))   # a request it holds no draft of
    assert out.lens_A.tolist() == [2] and out.source_A.tolist() == [0]


def test_head_with_the_das_policy_pricing_both_sources_keeps_tokens():
    """das + head under the DAS policy: each step the policy picks per row between the head's
    draft and the history's (`pick_sources`), and the tokens equal plain decoding's."""
    from das_jax.speculation.cost_model import CostModel
    from das_jax.speculation.das_policy import DASConfig, DASPolicy

    reqs = _requests(n_prompts=2, group=4, seed=3) * 2
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)
    ec = EngineConfig(max_slots=8, max_cache_len=64, draft_widths=(1, 4))
    eng = Engine(CFG, PARAMS, eos_token_ids=(1,), engine_config=ec)
    plain, _ = eng.generate(reqs, sampling)
    policy = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0),
                       cost_model=CostModel(c_base=0.05, c_tok=1e-4))
    picked = []
    pick = policy.pick_sources

    def counting(rows, drafts, shape):
        out = pick(rows, drafts, shape)
        picked.append(int((out.source_A != drafts.source_A).sum()))
        return out
    policy.pick_sources = counting
    drafter = HeadDrafts(HeadRuntime(_head(1), STEPS), make_drafter("das"), head_scale=1.0)
    out, stats = eng.generate(reqs, sampling, drafter=drafter, policy=policy)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert picked and stats.forward_passes < sum(len(o.token_ids) for o in out)


def test_head_beside_a_history_drafter_keeps_tokens():
    """das + head in the engine: both sources win rows, tokens equal plain decoding's."""
    head = _head(1)
    reqs = _requests(n_prompts=2, group=4, seed=2) * 2
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)
    ec = EngineConfig(max_slots=8, max_cache_len=64, draft_widths=(1, 4))
    eng = Engine(CFG, PARAMS, eos_token_ids=(1,), engine_config=ec)
    plain, plain_stats = eng.generate(reqs, sampling)
    drafter = HeadDrafts(HeadRuntime(head, STEPS), make_drafter("das"), head_scale=1.0)
    out, stats = eng.generate(reqs, sampling, drafter=drafter)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert drafter.source_counts["head"] > 0 and drafter.source_counts["history"] > 0
    assert stats.drafted_by_source.get("head", 0) > 0
    # the head's admissions are timed (their own counter: not host time, not a step's)
    assert 0 < stats.draft_model_s < stats.wall_s and plain_stats.draft_model_s == 0


def test_calibration_scores_both_sources_on_the_emitted_tokens():
    """After each step both proposals of a row are scored against the tokens it emitted,
    censored at the emitted count: the source whose drafts match gains, the other loses,
    whichever was chosen (so the losing source is still tested)."""

    class History:
        def propose_batch(self, ids, k_A):
            b = DraftBatch.empty(len(ids), 3)
            b.tokens_AxK[:] = [7, 8, 9]
            b.probs_AxK[:] = [0.5, 0.4, 0.3]
            b.lens_A[:] = 3
            return b

        def append_batch(self, ids, tokens, n):
            self.appended = (ids.tolist(), n.tolist())

    class Runtime:
        steps = 3
    hist = History()
    d = HeadDrafts(Runtime(), hist, head_scale=2.0, prior_tokens=4.0)
    np.testing.assert_allclose(d.calibration, [2.0, 1.0])
    for _ in range(20):   # the head wins while its prior holds (2 x 1.2 > 1.2), never matches
        d.set_model_drafts([0, 1], np.array([[3, 3, 3]] * 2, np.int32),
                           np.full((2, 3), 0.4, np.float32))
        out = d.propose_batch(np.array([0, 1]), np.array([3, 3]))
        # the step emitted 7 8 (row 0: the history's draft would have had 2 accepted) and 7
        append_batch(d, np.array([0, 1]), np.array([[7, 8, 5], [7, 0, 0]], np.int32),
                     np.array([3, 1], np.int32))
    assert hist.appended == ([0, 1], [3, 1])          # handed on to the history drafter
    c_head, c_hist = d.calibration
    # head: 0 matched of 20 x (3 x 0.4 + 1 x 0.4) predicted; history: 20 x (2 + 1) matched of
    # 20 x (1.2 + 0.5) predicted
    np.testing.assert_allclose(c_head, 8.0 / (4 + 20 * 1.6))
    np.testing.assert_allclose(c_hist, (4 + 60) / (4 + 20 * 1.7))
    out = d.propose_batch(np.array([0, 1]), np.array([3, 3]))
    assert out.tokens_AxK[:, 0].tolist() == [7, 7]   # the history's drafts win now
    assert out.source_A.tolist() == [DRAFT_SOURCES.index("other")] * 2

    # the calibration and source counts survive a checkpoint (encoded as the trainer saves it)
    from das_jax.rl.rollout_state_file import decode_state, encode_state
    hist.state_dict = lambda: {"kind": "stub"}
    hist.load_state_dict = lambda state: setattr(hist, "loaded", state)
    tree, arrays = encode_state(d.state_dict())
    resumed = HeadDrafts(Runtime(), hist, head_scale=2.0, prior_tokens=4.0)
    resumed.load_state_dict(decode_state(tree, {f"a{i}": a for i, a in enumerate(arrays)}))
    np.testing.assert_array_equal(resumed.calibration, d.calibration)
    assert resumed.source_counts == d.source_counts == {"head": 4, "history": 38, "none": 0}
    assert hist.loaded == {"kind": "stub"}
    # a checkpoint written before the calibration was kept: the history drafter's state alone
    old = HeadDrafts(Runtime(), hist, head_scale=2.0, prior_tokens=4.0)
    old.load_state_dict({"kind": "stub", "x": 1})
    assert hist.loaded == {"kind": "stub", "x": 1}
    np.testing.assert_allclose(old.calibration, [2.0, 1.0])


def test_rollout_from_config_attaches_the_head_and_refuses_bad_ones(tmp_path):
    """`draft_head.path` in a config: the head drafts beside the config's drafter; a head of
    another model, a missing file, bad steps and several replicas are one-line errors."""
    from das_jax.config import ConfigError, config_from_dict
    from das_jax.draft_head.store import policy_fingerprint, save_head
    from das_jax.errors import UserError
    from das_jax.rollout import rollout_from_config

    head = _head()
    good, other = tmp_path / "good.safetensors", tmp_path / "other.safetensors"
    save_head(str(good), dataclasses.replace(
        head, meta=policy_fingerprint("smollm2-135m-instruct", CFG)))
    save_head(str(other), dataclasses.replace(
        head, meta=policy_fingerprint("smollm2-135m-instruct",
                                      tiny_model_config(num_layers=5))))
    # a fixed cost model where drafts pay (a calibrated one times this machine's steps, and
    # under load may find that no draft pays: then nothing is drafted)
    raw = {"rollout": {"max_slots": 4, "max_cache_len": 64, "max_new_tokens": 8,
                       "draft_widths": [1, 4]}, "draft_head": {"path": str(good), "steps": 6},
           "das": {"cost_model": {"c_base": 0.05, "c_tok": 1e-4, "calibrate": False}}}
    cfg = config_from_dict(raw)
    dev = jax.devices()[0]
    rollout = rollout_from_config(cfg, CFG, PARAMS, (1,), device=dev)
    assert isinstance(rollout.drafter, HeadDrafts)
    assert rollout.drafter.history is not None          # beside `das`, the default drafter
    assert rollout.drafter.draft_model.steps == 3       # cut to the widest width - 1
    reqs = _requests(n_prompts=2, group=2)
    out, stats = rollout.generate(reqs)
    assert stats.drafted_by_source.get("head", 0) > 0
    with pytest.raises(UserError, match="forks sharing its drafter are not supported"):
        rollout.generate(reqs, request_ids=list(range(10, 10 + len(reqs))))
    none = rollout_from_config(config_from_dict({**raw, "drafter": "none"}), CFG, PARAMS, (1,),
                               device=dev)
    assert none.drafter.history is None                  # the head alone
    raw_other = {**raw, "draft_head": {"path": str(other)}}
    with pytest.raises(UserError, match="fitted to another model .*num_layers 5 != 4"):
        rollout_from_config(config_from_dict(raw_other), CFG, PARAMS, (1,), device=dev)
    with pytest.raises(ConfigError, match="draft_head.path .*: no such file"):
        config_from_dict({**raw, "draft_head": {"path": str(tmp_path / "missing")}})
    with pytest.raises(ConfigError, match="draft_head.steps must be >= 1"):
        config_from_dict({**raw, "draft_head": {"path": str(good), "steps": 0}})
    with pytest.raises(UserError, match="one rollout engine per process"):
        rollout_from_config(cfg, CFG, PARAMS, (1,), devices=[dev, dev])   # two replicas


def test_calibration_times_the_step_with_the_head_beside_it():
    """With a draft head the cost model's calibration times the step `generate` runs: the
    verify step that returns the head's features, then the head's drafting on them; the
    executable it compiles is the one generate's steps reuse."""
    from das_jax.engine.programs import COMPILED
    from das_jax.engine.specs import VerifySpec
    from das_jax.speculation.cost_model import CostModel, calibrate

    head = _head(3)
    runtime = HeadRuntime(head, STEPS)
    ec = EngineConfig(max_slots=4, max_cache_len=64, draft_widths=(1, 4))
    eng = Engine(CFG, PARAMS, eos_token_ids=(1,), engine_config=ec)
    seen = []
    extend = runtime.extend

    def counting(live_B, feats, next_BxW, n_emit_B, kv_len=None):
        seen.append((tuple(feats.shape), tuple(next_BxW.shape), kv_len, int(live_B.sum())))
        return extend(live_B, feats, next_BxW, n_emit_B, kv_len)
    runtime.extend = counting
    FD = len(runtime.feature_layers) * CFG.hidden_size
    seconds = eng.time_verify_step(4, 4, 16, 64, repeats=2, draft_model=runtime)
    assert seconds > 0 and seen == [((4, 4, FD), (4, 4), 20, 4)] * 3   # 1 discarded + 2
    assert runtime.cache is None                       # stopped: nothing kept alive
    verify_layers = {k for k in COMPILED if isinstance(k, tuple)
                     and any(isinstance(x, VerifySpec) and x.feature_layers
                             == runtime.feature_layers for x in k)}
    assert verify_layers, "the feature-returning verify step was not compiled"
    # through the cost model: every calibration shape drafts with the head
    seen.clear()
    calibrate(eng, CostModel(), cache_len=64, kv_lens=(32,), repeats=1, draft_model=runtime)
    assert seen and all(s[0][2] == FD for s in seen)
    # and the tokens generate samples with the calibrated executables are plain decoding's
    reqs = _requests(n_prompts=1, group=4, seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    plain, _ = eng.generate(reqs, sampling)
    out, _ = eng.generate(reqs, sampling, drafter=HeadDrafts(runtime, head_scale=1.0))
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]


def test_a_bfloat16_head_drafts_from_bfloat16_matrices_and_keeps_tokens():
    """`HeadRuntime(dtype="bfloat16")` (`draft_head.dtype`) places the head's matrices in
    bfloat16 (norms float32) under its own compiled programs; its drafts stay close to the
    float32 head's and the rollout's tokens equal plain decoding's."""
    from das_jax.errors import UserError

    head = _head()
    reqs = _requests()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=14, seed=3)
    ec = EngineConfig(max_slots=4, max_cache_len=64, draft_widths=(1, 2, 4))
    eng = Engine(CFG, PARAMS, eos_token_ids=(1,), engine_config=ec)
    plain, _ = eng.generate(reqs, sampling)
    runtime = HeadRuntime(head, STEPS, "bfloat16")
    assert runtime.config.dtype == "bfloat16" and head.config.dtype == "float32"
    drafter = Recording(runtime)
    out, stats = eng.generate(reqs, sampling, drafter=drafter)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert stats.drafted_by_source.get("head", 0) > 0
    (placed,) = [p[1]["head"] for p in runtime._device_params.values()]
    assert placed["wq"].dtype == jnp.bfloat16 and placed["lm_head"].dtype == jnp.bfloat16
    assert placed["final_norm"].dtype == jnp.float32
    assert head.params["wq"].dtype == np.float32           # the head keeps float32 weights
    want = _reference(head, [list(r.prompt_ids) + o.token_ids for r, o in zip(reqs, out)])
    same, gap = 0, 0.0
    for rid, held, tok, p in drafter.seen:
        same += int(tok[0] == want[rid][0][held - 2][0])
        gap = max(gap, float(np.abs(p[0] - want[rid][1][held - 2][0])))
    assert same >= 0.9 * len(drafter.seen) and gap < 0.05
    with pytest.raises(UserError, match="draft_head.dtype='float16'"):
        HeadRuntime(head, STEPS, "float16")


def test_an_admissions_compile_is_not_charged_to_the_verify_step():
    """A step record's `compile_s` (what the DAS policy prices a new step shape by) holds the
    verify program's and the head's drafting compiles, not the compile of the head's admission
    call that runs before the step."""
    from das_jax.engine.policy import FixedPolicy

    class Recording(FixedPolicy):
        records = []

        def observe(self, record):
            self.records.append(record)

    class SlowAdmissions(HeadRuntime):
        def admit(self, *a):
            self.programs.compile_s += 100.0      # as if the admission compiled for 100 s
            return super().admit(*a)

    reqs = _requests()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    ec = EngineConfig(max_slots=4, max_cache_len=64, draft_widths=(1, 2, 4))
    eng = Engine(CFG, PARAMS, eos_token_ids=(1,), engine_config=ec)
    policy = Recording()
    _, stats = eng.generate(reqs, sampling, drafter=HeadDrafts(SlowAdmissions(_head(), STEPS)),
                            policy=policy)
    assert stats.compile_s >= 200.0                     # >= 2 admissions, counted in the run
    assert policy.records and max(r.compile_s for r in policy.records) < 100.0
    assert any(r.compile_s > 0 for r in policy.records)  # the verify steps' own compiles
