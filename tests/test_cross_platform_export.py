"""The engine's programs and the train step lower for CUDA and TPU, checked on this CPU.

`jax.export.export(fn, platforms=[p])(*abstract_args)` traces a jitted program on
`jax.ShapeDtypeStruct`s (nothing is allocated) and lowers it to StableHLO with platform `p`'s
lowering rules. It fails when an op has no lowering for `p`, or lowers to a custom call that is
not guaranteed stable (e.g. a CPU-only LAPACK kernel). It does not run the XLA:GPU / TPU
compiler (there is none here), so it catches lowering faults, not compile-time ones (fusion or
memory limits of the device).

Covered, each for "cuda" and "tpu", in float32 and bfloat16, on a tiny model with every layout
feature of the shipped models (attention biases: Qwen2; q/k norms: Qwen3; untied head):

* Engine: every program of the engine's table (`das_jax.engine.programs.PROGRAMS`), fast and
  exact contraction modes (exact in float32 only). `ENGINE_EXAMPLES` gives each spec type its
  example specs, and `test_every_engine_program_has_an_example` fails for a program registered
  without one.
* Donation is kept for export: every exported program must keep each in-place update (a
  donated input aliased to an output, `tf.aliasing_output`) of its CPU lowering.
* Train step (`das_jax.rl.train_step.TrainStep`): the gradient kernel `accumulate_grads` on each
  micro-batch kind it is fed (packed shared-prompt and windowed rows on one device, padded rows
  with an accumulator on a mesh, and the reference path without an `ActivationConfig`), the
  unfused update (whole tree and leaf by leaf, float32 and bfloat16 master weights) and the
  fused update (`das_jax.rl.fused_update`, with and without the clip, tied and untied head;
  its driver traced whole under one jit, so its programs are lowered as nested calls).

Where the lowering itself needs the device: cuDNN flash attention
(`jax.nn.dot_product_attention(implementation="cudnn")`: the train step's attention with
`ActivationConfig.attention` "cudnn", or "auto" on a GPU with a 16-bit dtype) reads the
installed cuDNN's version while tracing, so without the jax CUDA plugin that test skips, saying
so. Exact mode probes its
row classes on the running backend while tracing, so an exact program exported here carries
this CPU's classes (it lowers; its shape invariance holds only where it was probed).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import das_jax.engine.reference  # noqa: F401 - registers the padded programs in PROGRAMS
from das_jax.config import GRPOSection
from das_jax.draft_head.head import HeadConfig, init_head
from das_jax.draft_head.runtime import (HeadAdmitSpec,  # registers the head's programs
                                        HeadExtendSpec, HeadGatherSpec)
from das_jax.engine.programs import PROGRAMS, Programs
from das_jax.engine.reference import PaddedPrefillSpec, PaddedVerifySpec
from das_jax.engine.specs import (DecodeSpec, GatherSpec, PrefillSpec, SharePagesSpec, ShareSpec,
                                  VerifySpec)
from das_jax.models import contraction as cx
from das_jax.models.paged_attention import TRITON_CUSTOM_CALL
from das_jax.models.transformer import ActivationConfig
from das_jax.rl.batches import PaddedMicroBatch, make_batch
from das_jax.rl.fused_update import FusedSpec, fused_update
from das_jax.rl.grads import accumulate_grads, zero_carry
from das_jax.rl.optimizer import make_optimizer
from das_jax.rl.train_step import TrainStep
from das_jax.testing import tiny_model_config, tiny_params

PLATFORMS = ("cuda", "tpu")
DTYPES = ("float32", "bfloat16")
# Every layout feature of the shipped models; tied (the tiny default) in the fused update's
# second case.
CFG = tiny_model_config(attention_bias=True, qk_norm=True, tie_word_embeddings=False)
HEAD = HeadConfig.for_policy(CFG, 24)   # a draft head of the tiny policy
TIED = tiny_model_config()
GREEDY, TOP_P = (0.0, 0, 1.0), (0.6, 20, 0.95)  # sampling keys: argmax; top-k + top-p sort


# ---------------------------------------------------------------------------------- helpers
def _abstract(tree, dtype=None):
    """`tree` as `jax.ShapeDtypeStruct`s (floating leaves in `dtype` when given)."""
    def leaf(x):
        dt = jnp.result_type(x)
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        return jax.ShapeDtypeStruct(np.shape(x), dt)
    return jax.tree_util.tree_map(leaf, tree)


@functools.lru_cache(maxsize=None)
def _params(config, dtype):
    return _abstract(jax.eval_shape(lambda: tiny_params(config)), dtype)


def _aliases(text: str) -> int:
    return text.count("tf.aliasing_output")


class Program:
    """A jitted `fn` and its abstract arguments, traced and lowered for the CPU once (cached by
    its test case); `export(platform)` lowers it for another platform and checks the result."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
        self.cpu = fn.lower(*args)

    def export(self, platform: str):
        """`fn`'s export for `platform`, checked: the platform recorded, the output avals those
        of the CPU lowering, every in-place update (donated input aliased to an output) of the
        CPU lowering kept."""
        # A Triton kernel (the paged attention's on CUDA) lowers to a custom call whose IR has
        # no stability guarantee: allowed by name, nothing else is.
        checks = ([jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
                  if platform == "cuda" else [])
        exported = jax.export.export(self.fn, platforms=[platform],
                                     disabled_checks=checks)(*self.args)
        assert exported.platforms == (platform,)
        expected = jax.tree_util.tree_leaves(self.cpu.out_info)
        assert [(a.shape, a.dtype) for a in exported.out_avals] == [(a.shape, a.dtype)
                                                                     for a in expected]
        assert _aliases(exported.mlir_module()) == _aliases(self.cpu.as_text())
        return exported


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_program_without_a_lowering_fails(platform):
    """The check can fail: a general eigendecomposition lowers on the CPU (LAPACK) but has no
    TPU lowering, and on CUDA only an unstable custom call, which export refuses."""
    eig = Program(jax.jit(lambda x: jnp.linalg.eig(x)[0].real),
                  jax.ShapeDtypeStruct((4, 4), jnp.float32))
    with pytest.raises((ValueError, NotImplementedError)):
        eig.export(platform)


# ---------------------------------------------------------------------------------- engine
def _engine_examples(config, dtype) -> dict[type, list]:
    """Example specs of each engine program: B=4 cache rows of 64 positions; verify with and
    without drafts and on the paged cache, 8 decode steps in one call, prefill with and without
    the sharing logits, compaction 4 -> 2 rows."""
    return {
        VerifySpec: [VerifySpec(config, TOP_P, 4, 16, 4, 64, 32, dtype),
                     VerifySpec(config, GREEDY, 4, 4, 1, 64, 64, dtype),
                     VerifySpec(config, TOP_P, 4, 16, 4, 64, 32, dtype, (16, 16)),   # paged
                     # paged, rollout.paged_attention: gather (no kernel on any platform)
                     VerifySpec(config, TOP_P, 4, 16, 4, 64, 32, dtype, (16, 16, "gather")),
                     # rollout.layer_loop: unroll, whole-layer reads
                     VerifySpec(dataclasses.replace(config, layer_loop="unroll"), TOP_P, 4, 16,
                                4, 64, 32, dtype)],
        DecodeSpec: [DecodeSpec(config, TOP_P, 4, 4, 8, 64, 64, (1, 2), dtype)],
        PrefillSpec: [PrefillSpec(config, TOP_P, 4, 32, 2, 16, 64, dtype),
                      PrefillSpec(config, GREEDY, 4, 32, 2, 16, 64, dtype, with_logits=True)],
        ShareSpec: [ShareSpec(config, TOP_P, 4, 16, 64, dtype)],
        SharePagesSpec: [SharePagesSpec(config, TOP_P, 4, 64, dtype, (16, 16))],
        GatherSpec: [GatherSpec(config, 4, 2, 64, dtype)],
        # the padded programs (the tests' oracle, run by `PaddedExecutor`)
        PaddedVerifySpec: [PaddedVerifySpec(config, TOP_P, 4, 4, 64, 32, dtype)],
        PaddedPrefillSpec: [PaddedPrefillSpec(config, GREEDY, 4, 2, 16, 3, 64, dtype)],
        # with a draft head: the steps also return its blocks' outputs, and its own programs
        # (float32 head weights; the policy's dtype is the embedding it reads)
        **({} if config.contraction.exact else {
            HeadAdmitSpec: [HeadAdmitSpec(HEAD, 4, 2, 16, 64, 3)],
            HeadExtendSpec: [HeadExtendSpec(HEAD, 4, 4, 64, 3, 36)],
            HeadGatherSpec: [HeadGatherSpec(HEAD, 4, 2, 64)]}),
    }


def _with_head_features(examples: dict, config, dtype) -> dict:
    """The verify and prefill examples again with the draft head's `feature_layers`."""
    layers = HEAD.feature_layers
    examples[VerifySpec] = examples[VerifySpec] + [
        VerifySpec(config, TOP_P, 4, 16, 4, 64, 32, dtype, (), layers)]
    examples[PrefillSpec] = examples[PrefillSpec] + [
        PrefillSpec(config, GREEDY, 4, 32, 2, 16, 64, dtype, True, (), layers)]
    return examples


def ENGINE_EXAMPLES(config, dtype) -> dict[type, list]:  # noqa: N802 - the table's name
    """(config, dtype) -> {spec type: [specs]}: `_engine_examples` and the head's features."""
    return _with_head_features(_engine_examples(config, dtype), config, dtype)
EXACT = dataclasses.replace(CFG, contraction=cx.EXACT)


def _engine_cases():
    # exact mode in float32 only: its bfloat16 programs are the same ops in another dtype, and
    # their trace-time probe compiles for ~20 s on this CPU
    for mode, config, dtypes in (("fast", CFG, DTYPES), ("exact", EXACT, ("float32",))):
        for dtype in dtypes:
            for kind, specs in ENGINE_EXAMPLES(config, dtype).items():
                for i, spec in enumerate(specs):
                    yield pytest.param(spec, id=f"{kind.__name__}{i}-{mode}-{dtype}")


def test_every_engine_program_has_an_example():
    missing = set(PROGRAMS) - set(ENGINE_EXAMPLES(CFG, "float32"))
    assert not missing, f"add example specs of {sorted(t.__name__ for t in missing)} to " \
                        "ENGINE_EXAMPLES, so that their programs are exported"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("spec", list(_engine_cases()))
def test_engine_program_exports(spec, platform):
    program = _engine_program(spec)
    exported = program.export(platform)
    if type(spec) not in (GatherSpec, HeadGatherSpec):  # the cache is donated, in place
        cache = program.args[1]
        assert _aliases(exported.mlir_module()) == len(jax.tree_util.tree_leaves(cache))
    if type(spec) is VerifySpec and spec.pages:
        # the paged verify reads each row's pages by the platform's Pallas kernel (Mosaic on
        # TPU, Triton on CUDA), unless exact or told to gather (`rollout.paged_attention:
        # gather`)
        kernel = {"cuda": TRITON_CUSTOM_CALL, "tpu": "tpu_custom_call"}[platform]
        gathers = spec.config.contraction.exact or spec.pages[2:] == ("gather",)
        assert (kernel in exported.mlir_module()) is not gathers


def test_paged_verify_exports_the_triton_kernel_by_name_for_cuda():
    """`PagedKVCache.kernel = "pallas_gpu"`: the Triton kernel by name lowers into the exported
    verify program (as "auto" picks it on CUDA)."""
    spec = VerifySpec(CFG, TOP_P, 4, 16, 4, 64, 32, "bfloat16", (16, 16, "pallas_gpu"))
    assert TRITON_CUSTOM_CALL in _engine_program(spec).export("cuda").mlir_module()


@functools.lru_cache(maxsize=None)
def _engine_program(spec) -> Program:
    if isinstance(spec, (HeadAdmitSpec, HeadExtendSpec, HeadGatherSpec)):
        params = {"head": jax.eval_shape(lambda: init_head(HEAD, jax.random.PRNGKey(0))),
                  "embed": jax.ShapeDtypeStruct((CFG.vocab_size, CFG.hidden_size), jnp.float32),
                  "draft_to_target": jax.ShapeDtypeStruct((HEAD.draft_vocab_size,), jnp.int32)}
        return Program(PROGRAMS[type(spec)], *Programs(CFG).abstract(spec, params))
    return Program(PROGRAMS[type(spec)],
                   *Programs(spec.config).abstract(spec, _params(spec.config, spec.dtype)))


# ---------------------------------------------------------------------------------- train step
def _grpo(**kw):
    base = dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28, micro_batch_size=8,
                max_completion_length=12, learning_rate=1e-2, max_grad_norm=1.0)
    return GRPOSection(**{**base, **kw})


ACT = ActivationConfig(remat="full", attention="xla", attention_chunk=16, logits_chunk=64)


def _group_batch(config, T=32, groups=2, G=3, P=10):
    """`groups` GRPO groups of G completions (3-11 tokens) of a P-token prompt, T columns."""
    rng = np.random.default_rng(0)
    rows, comp = [], []
    for _ in range(groups):
        prompt = rng.integers(2, config.vocab_size, size=P)
        for _ in range(G):
            L = int(rng.integers(3, 12))
            row = np.zeros(T, np.int32)
            row[:P], row[P:P + L] = prompt, rng.integers(2, config.vocab_size, size=L)
            rows.append(row)
            comp.append(L)
    n = len(rows)
    return make_batch(np.stack(rows), [P] * n, comp, advantages_B=rng.normal(size=n))


def _step(config, dtype, act=ACT, **grpo):
    g = _grpo(**grpo)
    return TrainStep(config, g, make_optimizer(g, 10), donate=True, activation=act,
                     compute_dtype=dtype, leafwise=True, fused=True)


def _micro_batch(step: TrainStep, share_prompts: bool):
    """The first micro-batch the step's gradient kernel is fed (packed or windowed), abstract."""
    lag = step.loss_and_grad
    lag.share_prompts = share_prompts and lag.windowed
    cols, keep = lag.host_columns(_group_batch(step.loss_and_grad.model_config))
    return _abstract(next(lag.micro_batches(cols, keep, lag.micro_batch_size)))


KERNELS = ("packed", "windowed", "padded_accumulate", "reference")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KERNELS)
def test_gradient_kernel_exports(kind, dtype, platform):
    _kernel_program(kind, dtype).export(platform)


@functools.lru_cache(maxsize=None)
def _kernel_program(kind: str, dtype: str) -> Program:
    act = None if kind == "reference" else ACT
    step = _step(CFG, dtype, act)
    params = _params(CFG, "float32")
    lc = step.loss_and_grad.loss_config
    if kind in ("packed", "windowed"):  # one device: the kernel starts from zero
        fn = jax.jit(lambda p, xs: accumulate_grads.__wrapped__(CFG, lc, p, xs, activation=act,
                                                                  compute_dtype=dtype))
        args = (params, _micro_batch(step, kind == "packed"))
    else:  # on a mesh (and the reference path): whole rows, a donated accumulator
        fn = jax.jit(lambda p, xs, c: accumulate_grads.__wrapped__(
            CFG, lc, p, xs, c, activation=act, compute_dtype=dtype), donate_argnums=(2,))
        args = (params, PaddedMicroBatch.abstract(1, 4, 32), jax.eval_shape(zero_carry, params))
    return Program(fn, *args)


def test_cudnn_train_attention_exports_for_cuda():
    """The GPU's bf16 train attention (`_train_attention` with cuDNN flash attention)."""
    act = dataclasses.replace(ACT, attention="cudnn")
    lc = _step(CFG, "bfloat16", act).loss_and_grad.loss_config
    params = _params(CFG, "float32")
    fn = jax.jit(lambda p, xs: accumulate_grads.__wrapped__(CFG, lc, p, xs, activation=act,
                                                              compute_dtype="bfloat16"))
    try:
        Program(fn, params, PaddedMicroBatch.abstract(1, 4, 32)).export("cuda")
    except RuntimeError as e:
        if "cuDNN is not detected" not in str(e):
            raise
        pytest.skip("cuDNN flash attention (jax.nn.dot_product_attention(implementation="
                    "'cudnn'), das_jax.models.transformer._train_attention) reads the cuDNN "
                    "version while tracing (jax._src.cudnn.fused_attention_stablehlo."
                    "check_cudnn_version): needs the jax CUDA plugin with cuDNN, absent here")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("master", DTYPES)
@pytest.mark.parametrize("leafwise", [False, True], ids=["whole_tree", "leafwise"])
def test_unfused_update_exports(leafwise, master, platform):
    _unfused_program(leafwise, master).export(platform)


@functools.lru_cache(maxsize=None)
def _unfused_program(leafwise: bool, master: str) -> Program:
    g = _grpo()
    opt = make_optimizer(g, 10)
    step = TrainStep(CFG, g, opt, donate=True, activation=ACT, leafwise=leafwise)
    params = _params(CFG, master)
    fn = jax.jit(step.apply_update, donate_argnums=(0, 1))
    return Program(fn, params, jax.eval_shape(opt.init, params), params)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["clip_untied", "no_clip_tied"])
def test_fused_update_exports(case, dtype, platform):
    _fused_program(case, dtype).export(platform)


@functools.lru_cache(maxsize=None)
def _fused_program(case: str, dtype: str) -> Program:
    config = CFG if case == "clip_untied" else TIED
    step = _step(config, dtype, max_grad_norm=1.0 if case == "clip_untied" else None)
    opt = step.optimizer
    spec = FusedSpec(config, step.loss_and_grad.loss_config, ACT, dtype, opt)
    params = _params(config, "float32")
    fn = jax.jit(lambda p, s, xs: fused_update(spec, p, s, xs), donate_argnums=(0, 1))
    return Program(fn, params, jax.eval_shape(opt.init, params), _micro_batch(step, True))
