"""Per-device memory of a run (`das-jax plan`), from abstract shapes (no weights loaded).

    das-jax plan --config configs/gpu/qwen3-8b-code.yaml --devices 8 --device-memory-gb 141

Lowers and compiles, against `jax.ShapeDtypeStruct`s, the train step's gradient kernel
(`accumulate_grads`, one micro-batch at the longest length `rollout.max_cache_len`), its
optimizer update, and the engine's largest verify (slots x widest draft x full cache) and prefill
shapes, and reads `compiled.memory_analysis()`. With N devices the train state is FSDP-sharded by
the rules of `das_jax.parallel.sharding` and the micro-batch rows are split over the devices;
rollouts are data-parallel (one engine per device with a full compute-dtype copy of the params).
Since the device count is fixed when JAX starts, N > the local device count runs the analysis in
a subprocess on N forced host (CPU) devices (`--xla_force_host_platform_device_count`).

Per-device bytes (printed table):
  params        compute-dtype copy the engine samples from (replicated: one per device)
  master        master weights (train.master_dtype), sharded
  optimizer     Adam moments (master dtype), sharded
  gradients     float32 accumulator, sharded (0 with the fused update: one layer's at a time)
  activations   the gradient kernel's scratch (XLA temp: remat'd layer inputs, attention chunks,
                logits chunks, gathered weights); with the fused update its forward program's
  kv_cache      slots x max_cache_len positions (paged, `rollout.kv_cache: paged`: the pool's
                pages, from rollout.kv_memory_gb; the shapes give its pages, the rows it holds at
                max_cache_len each, and with `--lengths` the rows it holds at those lengths)
  logits        verify-step logits [slots, W, V] f32 + one train logits chunk (both included in
                the phases' scratch; shown for reference)
  rollout scratch / update scratch   XLA temp of the verify / prefill and optimizer executables
and the phase peaks: rollout, train and update, or rollout and update when the update is fused
(`fuses_update`: one device, `train.fused_update`, the whole batch one micro-batch; its programs
`das_jax.rl.fused_plan`). The run fits when the largest peak is at most the
device memory. Caveat: XLA's CPU memory analysis stands in for the GPU's (cuDNN flash attention
is replaced by the chunked XLA attention, which keeps one [B, H, chunk, T] f32 block).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any

import numpy as np

from das_jax.config import config_from_dict, config_to_dict
from das_jax.engine.schedule import bucket as size_bucket
from das_jax.engine.schedule import pow2_at_least, prefill_rows, token_buckets
from das_jax.errors import UserError
from das_jax.models.config import ModelConfig
from das_jax.models.loaders.gguf_file import config_from_gguf_metadata
from das_jax.models.loaders.gguf_reader import open_gguf, read_metadata
from das_jax.models.loaders.hf_dir import read_hf_config

GB = 1e9

# Architectures of hub ids the shipped configs name, so that planning needs no download.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": dict(
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
        max_position_embeddings=131072),
    "Qwen/Qwen3-8B": dict(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40960),
}


class PlanError(UserError):
    """The run does not fit (one line naming what to change) or cannot be planned."""


def model_config_for(source: str):
    """The `ModelConfig` of a model source without loading weights: a known hub id, an HF
    directory's config.json, a GGUF file's metadata, or a named source (fetched if needed)."""
    if source in KNOWN_MODELS:
        return ModelConfig(**KNOWN_MODELS[source])
    # deferred import: jax (not loaded by importing this module)
    from das_jax.models.loading import resolve_source
    kind, path = resolve_source(source)
    if kind == "hf_dir":
        return read_hf_config(path)
    reader = open_gguf(path)
    return config_from_gguf_metadata(read_metadata(reader), {t.name for t in reader.tensors}, path)


@dataclasses.dataclass
class MemoryPlan:
    """Per-device bytes of one run on `devices` devices of `device_bytes` each."""

    devices: int
    device_bytes: int
    rows: dict[str, int]
    phases: dict[str, int]
    shapes: dict[str, Any]
    mem_fraction: float = 1.0
    programs: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.device_bytes

    @property
    def headroom(self) -> float:
        return 1.0 - self.peak / self.device_bytes if self.device_bytes > 0 else -math.inf

    def table(self) -> str:
        usable = (f" usable ({self.mem_fraction:g} of {self.device_bytes / self.mem_fraction / GB:.1f}"
                  " GB: XLA_PYTHON_CLIENT_MEM_FRACTION)" if self.mem_fraction != 1.0 else "")
        lines = [f"memory plan: {self.devices} device(s) x {self.device_bytes / GB:.1f} GB{usable}  "
                 + "  ".join(f"{k}={v}" for k, v in self.shapes.items()),
                 f"  {'per device':<22}{'GB':>10}"]
        lines += [f"  {k:<22}{v / GB:>10.2f}" for k, v in self.rows.items()]
        lines += [f"  program {k:<26} temp {m['temp'] / GB:8.2f} GB  args {m['argument'] / GB:8.2f}"
                  f" GB  out {m['output'] / GB:8.2f} GB  aliased {m['alias'] / GB:8.2f} GB"
                  for k, m in self.programs.items()]
        lines += [f"  peak {k:<17}{v / GB:>10.2f}" for k, v in self.phases.items()]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {verdict}: peak {self.peak / GB:.2f} GB of {self.device_bytes / GB:.1f} GB "
                     f"({100 * self.headroom:.1f}% headroom)")
        return "\n".join(lines)

    def advice(self, config) -> str:
        """One line naming what to change (the largest phase decides)."""
        worst = max(self.phases, key=self.phases.get)
        need = f"peak {self.peak / GB:.1f} GB > {self.device_bytes / GB:.1f} GB per device"
        if worst == "train+rollout":
            return (f"{need} with the update and a rollout at once (train.async_steps="
                    f"{config.train.async_steps}, colocated: KV cache "
                    f"{self.rows['kv_cache'] / GB:.1f} GB beside the train state); give the "
                    "rollouts devices of their own (mesh.rollout_devices), lower "
                    "rollout.max_slots (or rollout.kv_memory_gb), or set train.async_steps: 0")
        if worst == "train+snapshots":
            return (f"{need} with the update beside the params snapshots of the rollouts ahead "
                    f"(train.async_steps={config.train.async_steps}); lower train.async_steps, "
                    "give the rollouts devices of their own (mesh.rollout_devices), or use more "
                    "devices (das-jax plan --devices N)")
        if worst == "rollout":
            return (f"{need} in the rollout phase (KV cache {self.rows['kv_cache'] / GB:.1f} GB for "
                    f"rollout.max_slots={self.shapes['slots']}); lower rollout.max_slots (or set "
                    "rollout.kv_memory_gb), or lower rollout.max_cache_len")
        if worst == "train":
            return (f"{need} in the train step (activations "
                    f"{self.rows['activations'] / GB:.1f} GB at grpo.micro_batch_size="
                    f"{config.grpo.micro_batch_size}); lower grpo.micro_batch_size, set "
                    "train.remat=full, or use more devices (das-jax plan --devices N)")
        if self.shapes.get("update") == "fused":
            return (f"{need} in the fused update (layer inputs and activations of the whole "
                    f"batch at grpo.micro_batch_size={config.grpo.micro_batch_size}); lower "
                    "grpo.micro_batch_size below the batch (several micro-batches, unfused "
                    "update), set train.remat=full, or use more devices (das-jax plan --devices N)")
        return (f"{need} in the optimizer update; use more devices (das-jax plan --devices N) or "
                "train.master_dtype=bfloat16 (lossy)")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _mem(compiled) -> dict[str, int]:
    # deferred import: jax (engine.programs loads it; not loaded by importing this module)
    from das_jax.engine import compiled_memory
    return compiled_memory(compiled)


def _tree_bytes(tree) -> int:
    # deferred import: jax (not loaded by importing this module)
    import jax
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def _shard_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s `jax.ShapeDtypeStruct` leaves (by their shardings)."""
    # deferred import: jax (not loaded by importing this module)
    import jax
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def plan_in_process(config, devices: int, device_bytes: int, model_config=None,
                    mem_fraction: float = 1.0) -> MemoryPlan:
    """The plan, compiled in this process (needs `devices` local JAX devices): the train state
    on the run's mesh (`config.mesh` over `devices`), every program the run executes at its
    largest shapes (gradient kernel, optimizer update, packed verify and prefill, prompt
    sharing, compaction), against `device_bytes` usable bytes per device (`mem_fraction` of
    the device's memory, stated in the table).

    Raises:
      PlanError: fewer local devices than `devices`; `sharding.MeshError`: the mesh section
        does not fit `devices`.
    """
    # deferred import: jax, optax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    from das_jax.engine.engine_config import kv_cache_for
    from das_jax.models.kv_cache import DenseKVCache
    from das_jax.models.transformer import ActivationConfig, init_params
    from das_jax.parallel import sharding as shard_lib
    from das_jax.rl import losses
    from das_jax.rl.batches import PaddedMicroBatch
    from das_jax.rl.fused_plan import fused_update_memory, packed_abstract
    from das_jax.rl.fused_update import FusedSpec
    from das_jax.rl.grads import zero_carry
    from das_jax.rl.optimizer import make_optimizer

    if len(jax.devices()) < devices:
        raise PlanError(f"planning for {devices} devices needs {devices} JAX devices, found "
                        f"{len(jax.devices())}; use plan() (it forces host devices in a subprocess)")
    mc = model_config or model_config_for(config.model.source)
    r, g, t = config.rollout, config.grpo, config.train
    compute = jnp.dtype(config.model.dtype)
    master = jnp.dtype(t.master_dtype)
    # mesh.rollout_devices > 0: the last devices only generate, the train mesh is the others
    r_dev = config.mesh.rollout_devices
    if r_dev >= devices:
        raise PlanError(f"mesh.rollout_devices={r_dev} leaves none of the {devices} devices to "
                        "train on; set it below the device count, or 0 to share them")
    n_train = devices - r_dev
    mesh = shard_lib.mesh_from_config(config.mesh, jax.devices()[:n_train])

    def abstract(tree, shardings):
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    params_shape = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0), dtype=master))
    p_shard = shard_lib.param_shardings(params_shape, mesh)
    params_abs = abstract(params_shape, p_shard)
    optimizer = make_optimizer(g, max(1, t.steps))
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    o_shard = shard_lib.like_params_shardings(opt_shape, params_shape, mesh)
    opt_abs = abstract(opt_shape, o_shard)
    carry_shape = jax.eval_shape(zero_carry, params_shape)
    c_shard = shard_lib.like_params_shardings(carry_shape, params_shape, mesh)
    carry_abs = abstract(carry_shape, c_shard)

    # ---- train: one micro-batch of the longest rows ----
    mb = max(g.micro_batch_size, n_train) if n_train > 1 else g.micro_batch_size
    mb = -(-mb // n_train) * n_train
    T = r.max_cache_len
    row_sh = shard_lib.batch_sharding(mesh, 3, leading=1)
    vec_sh = shard_lib.batch_sharding(mesh, 2, leading=1)
    xs_abs = PaddedMicroBatch.abstract(1, mb, T, row_sh, vec_sh)
    loss_cfg = losses.LossConfig.from_grpo(g, r.temperature or 1.0)
    act = ActivationConfig(remat=t.remat, logits_chunk=t.logits_chunk,
                           attention_chunk=t.attention_chunk)
    fused_peak = None
    if fuses_update(config, n_train):
        spec = FusedSpec(mc, loss_cfg, act, compute.name, optimizer)
        update_programs, fused_peak = fused_update_memory(
            spec, params_shape, opt_shape, packed_abstract(*packed_shape(config)))
    else:
        update_programs = dict(zip(("accumulate_grads", "optimizer_update"), _unfused_memory(
            mc, loss_cfg, act, compute, optimizer, mesh, params_abs, opt_abs, carry_abs, xs_abs,
            p_shard, o_shard, c_shard)))

    # ---- rollout: one engine per device, full compute-dtype params ----
    # (rollout.kv_cache: auto is paged on GPU / TPU with one device per replica)
    r_all = r_dev or devices   # the devices the engine replicas spread over
    kv_cache = kv_cache_for(r.kv_cache, run_platform(config) or "cpu",
                            r_all // max(1, r.replicas or r_all))
    slots, S, W, rdtype, engine_programs, pages = _rollout_memory(mc, r, g, params_shape,
                                                                  compute, kv_cache)

    n = n_train
    master_b = _shard_bytes(params_abs)
    opt_b = _shard_bytes(opt_abs)
    grads_b = _shard_bytes(carry_abs[1])
    cparams_b = _tree_bytes(params_shape) * compute.itemsize // master.itemsize
    kv_b = (DenseKVCache.nbytes_for(mc, pages[0], pages[1], compute) if pages
            else DenseKVCache.nbytes_for(mc, slots, S, compute))
    ref_b = master_b * compute.itemsize // master.itemsize if g.beta > 0 else 0
    train_rows, train_phases = _update_rows(update_programs, fused_peak, grads_b, opt_b, ref_b)
    head_rows, head_program = _draft_head_memory(config, mc, slots, S, params_shape, rdtype,
                                                 g.micro_batch_size, T)
    if head_program is not None:   # the online head's update: its state, one micro-batch
        shared = n == 1 and compute == master and t.async_steps == 0
        train_phases["draft_head_update"] = (
            master_b + opt_b + ref_b + head_rows["draft_head_optimizer"]
            + head_program["argument"] - (cparams_b if shared else 0)
            + head_program["temp"] + head_program["output"])
        update_programs = {**update_programs, "draft_head_grad": head_program}
    rows = {
        "params": cparams_b, "master": master_b, "optimizer": opt_b,
        "gradients": train_rows["gradients"], "ref_params": ref_b,
        "activations": train_rows["activations"], "kv_cache": kv_b,
        "logits": slots * W * mc.vocab_size * 4 + min(T, max(1, t.logits_chunk // max(1, mb // n)))
        * max(1, mb // n) * mc.vocab_size * 4,
        # the compaction's output (the smaller cache) is alive beside the full one
        "rollout_scratch": max(m["temp"] + (m["output"] * compute.itemsize // rdtype.itemsize
                                            if k == "gather_rows" else 0)
                               for k, m in engine_programs.items()),
        "update_scratch": train_rows["update_scratch"],
        **head_rows,
    }
    phases = _phases(config, n, compute == master, train_phases, master_b + opt_b + ref_b,
                     cparams_b, kv_b + rows["rollout_scratch"] + sum(head_rows.values()))
    shapes = _plan_shapes(config, mesh, slots, S, W, mb, T, compute, master, fused_peak, rdtype,
                          pages)
    all_programs = {**update_programs, **engine_programs}
    return MemoryPlan(devices, int(device_bytes), {k: int(v) for k, v in rows.items()},
                      {k: int(v) for k, v in phases.items()}, shapes, float(mem_fraction),
                      all_programs)


def _draft_head_memory(config, mc, slots: int, S: int, params_shape, rdtype, mb: int, T: int
                       ) -> tuple[dict[str, int], dict[str, int] | None]:
    """The draft head's rows (`draft_head:`; {} without one): "draft_head", its weights as the
    rollout places them (matrices in `draft_head.dtype`, default `model.dtype`), its cache (one
    layer's K/V per slot) and the prompts' features kept for admissions; with online training
    (`train.draft_loss_weight`) "draft_head_optimizer", its AdamW moments and accumulated
    gradient (float32), and its float32 weights where the rollout's are cast. And the memory of the online head's gradient program on one
    micro-batch of `mb` rows x `T` tokens (None without online training)."""
    h = getattr(config, "draft_head", None)
    if h is None or h.path is None:
        return {}, None
    # deferred import: jax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    # deferred import: jax, safetensors (the head's modules; not loaded by importing this one)
    from das_jax.draft_head.head import cast_weights, init_head
    from das_jax.draft_head.store import read_head_config

    hc = read_head_config(h.path)
    head_abs = jax.eval_shape(lambda: init_head(hc, jax.random.PRNGKey(0)))
    head_b = _tree_bytes(head_abs)
    placed_b = _tree_bytes(jax.eval_shape(
        lambda p: cast_weights(p, h.dtype or config.model.dtype), head_abs))
    cache_b = 2 * slots * S * hc.num_kv_heads * hc.head_dim * 4 + 4 * slots
    feats_b = min(slots, config.grpo.prompts_per_step) * S * 3 * hc.hidden_size * 4
    rows = {"draft_head": placed_b + cache_b + feats_b}
    if config.train.draft_loss_weight <= 0:
        return rows, None
    # deferred import: optax (the online head's optimizer; not loaded by importing this module)
    from das_jax.draft_head.online import OnlineConfig, micro_batch_grad

    rows["draft_head_optimizer"] = 3 * head_b + (head_b if placed_b != head_b else 0)
    cparams_abs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, rdtype),
                                         params_shape)
    row = jax.ShapeDtypeStruct((mb, T), jnp.int32)
    mask = jax.ShapeDtypeStruct((mb, T), jnp.bool_)
    compiled = micro_batch_grad.lower(
        mc, hc, config.draft_head.steps, OnlineConfig.top_m, cparams_abs, head_abs,
        jax.ShapeDtypeStruct((hc.draft_vocab_size,), jnp.int32), row, mask, mask,
        jax.ShapeDtypeStruct((), jnp.float32)).compile()
    return rows, _mem(compiled)


def _phases(config, n_train: int, same_dtype: bool, train_phases: dict, train_state_b: int,
            cparams_b: int, engine_b: int) -> dict:
    """Bytes per device of each phase of the run: the rollout (with the train state it keeps
    resident, when colocated) and the update's phases (`train_phases`); an asynchronous
    colocated run adds `train+rollout`, the update beside a rollout and k params snapshots
    (`train+snapshots`, without the rollout, when the two take turns: train.async_overlap
    false).
    train_state_b: master params + optimizer state + reference params; cparams_b: the compute
    dtype params; engine_b: the KV cache and the engine's scratch."""
    k, r_dev = config.train.async_steps, config.mesh.rollout_devices
    if r_dev:   # disaggregated: a rollout device holds the compute params and the engine only
        return {"rollout": cparams_b + engine_b, **train_phases}
    # With one device and compute dtype == master dtype the engine reads the master arrays
    # (not in an asynchronous run: each rollout samples from a snapshot, the update donates).
    shared = n_train == 1 and same_dtype and k == 0
    phases = {"rollout": train_state_b + (0 if shared else cparams_b) + engine_b, **train_phases}
    if k > 0 and config.train.async_overlap:
        # colocated async: the update runs beside a rollout and k params snapshots
        phases["train+rollout"] = max(train_phases.values()) + k * cparams_b + engine_b
    elif k > 0:  # taking turns: the update beside the k snapshots the rollouts ahead sample from
        phases["train+snapshots"] = max(train_phases.values()) + k * cparams_b
    return phases


def _plan_shapes(config, mesh, slots, S, W, mb, T, compute, master, fused_peak, rdtype,
                 pages) -> dict:
    """The shapes a plan was made for (the table's header line)."""
    t = config.train
    shapes = {"slots": slots, "cache_len": S, "width": W, "micro_batch": mb, "train_len": T,
              "remat": t.remat, "dtype": f"{compute.name}/{master.name}",
              "update": "unfused" if fused_peak is None else "fused",
              "rollout_analysis": rdtype.name,
              "mesh": "x".join(f"{a}{k}" for a, k in mesh.shape.items() if k > 1) or "1"}
    if config.mesh.rollout_devices:
        shapes["rollout_devices"] = config.mesh.rollout_devices
    if t.async_steps:
        shapes["async_steps"] = t.async_steps
    if pages:   # the paged pool, and the rows it holds when every row is max_cache_len long
        shapes.update(kv_cache="paged", kv_pages=pages[0], page_size=pages[1],
                      rows_worst_case=pages[0] // -(-S // pages[1]))
    return shapes



def _update_rows(programs: dict, fused_peak: int | None, grads_b: int, opt_b: int, ref_b: int
                 ) -> tuple[dict[str, int], dict[str, int]]:
    """(the gradients / activations / update-scratch rows, the train-side phase peaks) of the
    update's `programs`: the fused update's (`fused_peak` its peak) or the gradient kernel's
    and the optimizer update's (`fused_peak` None)."""
    if fused_peak is not None:
        return ({"gradients": 0, "activations": programs["fused_forward"]["temp"],
                 "update_scratch": max(m["temp"] for m in programs.values())},
                {"update": ref_b + fused_peak})
    train_mem, update_mem = programs["accumulate_grads"], programs["optimizer_update"]
    return ({"gradients": grads_b, "activations": train_mem["temp"],
             "update_scratch": update_mem["temp"]},
            {"train": opt_b + ref_b + train_mem["argument"] + train_mem["temp"]
             + max(0, train_mem["output"] - train_mem["alias"]),
             "update": ref_b + update_mem["argument"] + update_mem["temp"]
             + max(0, update_mem["output"] - update_mem["alias"])})


def fuses_update(config, devices: int) -> bool:
    """Whether the run trains with the fused update (`das_jax.rl.fused_update`): one device,
    `train.fused_update`, and every step's batch one shared-prompt packed micro-batch
    (`grpo.micro_batch_size` >= the batch's completions). Otherwise the gradient kernel and the
    optimizer update run apart."""
    g = config.grpo
    return (bool(config.train.fused_update) and devices == 1
            and g.prompts_per_step * g.num_generations <= g.micro_batch_size)


def packed_shape(config) -> tuple[int, int, int, int]:
    """(packed rows G, tokens per row S, completions R, window W) of the largest packed
    micro-batch of a run (`das_jax.rl.batches.packed_micro_batches`): a row holds at most
    `rollout.max_cache_len` tokens and at least one completion, so at most one row per
    completion; G and R are `count_bucket`s, S and W `length_bucket`s, as the trainer pads them."""
    # deferred import: jax (rl.batches loads it; not loaded by importing this module)
    from das_jax.rl.batches import count_bucket, length_bucket

    r, g = config.rollout, config.grpo
    R = count_bucket(g.prompts_per_step * g.num_generations)
    return R, length_bucket(r.max_cache_len), R, length_bucket(r.max_new_tokens, 32)


def _unfused_memory(mc, loss_cfg, act, compute, optimizer, mesh, params_abs, opt_abs, carry_abs,
                    xs_abs, p_shard, o_shard, c_shard):
    """(memory of the gradient kernel on one micro-batch, memory of the optimizer update),
    compiled on the run's mesh."""
    # deferred import: jax (not loaded by importing this module)
    import jax

    from das_jax.rl.grads import accumulate_grads

    kernel = accumulate_grads.__wrapped__
    train_fn = jax.jit(lambda p, xs, c: kernel(mc, loss_cfg, p, xs, c, activation=act,
                                                compute_dtype=compute.name),
                       out_shardings=c_shard, donate_argnums=(2,))
    with jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else mesh:
        train_mem = _mem(train_fn.lower(params_abs, xs_abs, carry_abs).compile())

        def apply(p, s, grads):
            updates, s = optimizer.update(grads, s, p)
            # deferred import: optax (not loaded by importing this module)
            import optax
            return optax.apply_updates(p, updates), s
        apply_fn = jax.jit(apply, out_shardings=(p_shard, o_shard), donate_argnums=(0, 1))
        # the gradients: the params' shapes, dtypes and shardings
        update_mem = _mem(apply_fn.lower(params_abs, opt_abs, params_abs).compile())
    return train_mem, update_mem


def mem_fraction(config) -> float:
    """The fraction of a device's memory the run may use: XLA's preallocation fraction
    (`XLA_CLIENT_MEM_FRACTION`, or its older name `XLA_PYTHON_CLIENT_MEM_FRACTION`; default 0.75
    on a GPU run: `platform: gpu`, or JAX's backend when the config names no platform), 1.0 on
    CPU and TPU.

    Raises:
      PlanError: the variable is not a number in (0, 1].
    """
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            f = float(raw)
        except ValueError:
            f = -1.0
        if not 0 < f <= 1:
            raise PlanError(f"{name}={raw!r} is not a fraction in (0, 1]; set it to e.g. 0.9 or "
                            "unset it")
        return f
    return 0.75 if run_platform(config) in ("gpu", "cuda", "rocm") else 1.0


def run_platform(config) -> str | None:
    """The platform the run computes on: `config.platform`, else JAX's default backend (when
    JAX is loaded; None otherwise)."""
    platform = config.platform
    if platform is None and "jax" in sys.modules:
        platform = sys.modules["jax"].default_backend()
    return platform


def _rollout_memory(mc, r, g, params_shape, compute, kv_cache: str):
    """The engine's side of `plan_in_process`: (slots, cache_len, widest draft, the dtype the
    rollout programs are analysed in, {program name: memory analysis} of every engine program the
    run executes at its largest shapes), for one engine on the first local device holding the
    full compute-dtype params; `kv_cache`: the cache the run resolves ("dense" or "paged")."""
    # deferred import: jax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from das_jax.engine import GatherSpec, PrefillSpec, Programs, ShareSpec, VerifySpec
    from das_jax.engine.specs import SharePagesSpec
    from das_jax.engine.engine_config import EngineConfig
    from das_jax.models.kv_cache import DenseKVCache
    from das_jax.parallel import sharding as shard_lib

    one = jax.devices()[0]
    single = NamedSharding(shard_lib.make_mesh(devices=[one]), PartitionSpec())
    # XLA:CPU upcasts bf16 matmuls and scatters to f32 (copies of the weights and of the whole
    # cache, ~2-4x their size), which a GPU does not: on CPU, 16-bit rollout executables are
    # analysed as their float32 stand-ins, whose scratch (f32 scores / logits as in bf16, f32
    # activations) bounds the bf16 program's from above.
    rdtype = (jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" and compute.itemsize < 4
              else compute)
    cparams_abs = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, rdtype, sharding=single), params_shape)
    W = max(r.draft_widths)
    S = r.max_cache_len
    slots = r.max_slots
    paged = kv_cache == "paged"
    if r.kv_memory_gb is not None and not paged:
        slots = max(0, min(slots, int(r.kv_memory_gb * GB) //
                           DenseKVCache.nbytes_for(mc, 1, S, compute)))
    slots = max(slots, 1)
    # The paged pool: pages of the KV budget (at most every slot's max_cache_len), else the
    # dense cache's positions.
    pages = EngineConfig(max_slots=slots, max_cache_len=S, kv_cache="paged",
                         page_size=r.page_size, paged_attention=r.paged_attention,
                         kv_pages=(int(r.kv_memory_gb * GB) // DenseKVCache.nbytes_for(
                             mc, 1, r.page_size, compute)) if r.kv_memory_gb is not None
                         else None).paging(slots, S) if paged else ()
    # The engine's programs at their largest shapes: the verify step with every row drafting
    # the widest width, and the prefill of a step's prompts at the longest prompt bucket.
    programs = Programs(mc, device=one)
    skey = (float(r.temperature), int(r.top_k), float(r.top_p))
    # (a step's prompts in prefill calls of at most rollout.max_prefill_tokens block slots)
    prompt_len = max(1, S - r.max_new_tokens - W)
    ec = EngineConfig(max_slots=slots)
    Tp = min(S, pow2_at_least(prompt_len, ec.min_prompt_bucket))
    U = prefill_rows(prompt_len, min(slots, g.prompts_per_step), ec.batch_buckets,
                     ec.min_prompt_bucket, S, r.max_prefill_tokens)
    Np = size_bucket(U * Tp, token_buckets(slots * Tp))
    # Prompt sharing copies the prompt positions of every slot; compaction gathers the live rows
    # into the next smaller batch bucket (a second, smaller cache while it runs).
    # (The trainer's engine always shares prompts: EngineConfig.share_prompts.)
    out = {
        "verify_packed": programs.memory(
            VerifySpec(mc, skey, slots, slots * W, W, S, S, rdtype.name, pages), cparams_abs),
        "prefill_packed": programs.memory(
            PrefillSpec(mc, skey, slots, Np, U, Tp, S, rdtype.name, True, pages), cparams_abs),
    }
    if paged:   # admission by shared pages; compaction is a table permutation (no program)
        out["share_prompt_pages"] = programs.memory(
            SharePagesSpec(mc, skey, slots, S, rdtype.name, pages), cparams_abs)
        return slots, S, W, rdtype, out, pages
    out["share_prompt_rows"] = programs.memory(
        ShareSpec(mc, skey, slots, Tp, S, rdtype.name), cparams_abs)
    smaller = [b for b in ec.batch_buckets if b < slots]
    if smaller:
        out["gather_rows"] = programs.memory(GatherSpec(mc, slots, max(smaller), S, rdtype.name),
                                             cparams_abs)
    return slots, S, W, rdtype, out, pages


def device_memory_bytes(config, device_memory_gb: float | None) -> int:
    """The per-device usable bytes: the argument or train.device_memory_gb (the device's
    memory, in GB) times `mem_fraction(config)`, else the local device's allocator limit
    (which already applies XLA's fraction; the host's total memory for a CPU device)."""
    gb = device_memory_gb if device_memory_gb is not None else config.train.device_memory_gb
    if gb is not None:
        what = ("--device-memory-gb" if device_memory_gb is not None else
                "train.device_memory_gb")
        if not (isinstance(gb, (int, float)) and math.isfinite(gb) and gb > 0):
            raise PlanError(f"{what} must be a number of GB > 0 (one device's memory), got "
                            f"{gb}")
        usable = int(gb * GB * mem_fraction(config))
        if usable < 1:
            raise PlanError(f"{what}={gb} leaves no usable bytes per device; give the device's "
                            "memory in GB (e.g. 80)")
        return usable
    # deferred import: jax (not loaded by importing this module)
    import jax
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        pass
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan(config, devices: int = 1, device_memory_gb: float | None = None,
         lengths: tuple | None = None) -> MemoryPlan:
    """`plan_in_process`, in a subprocess with `devices` forced host devices when this process
    has fewer devices (or JAX is already initialised on a different platform). With the paged
    KV cache and `lengths` = (prompt lengths, completion lengths) of a rollout workload, the
    plan's shapes also give `rows_expected` (the rows the pool holds at once under continuous
    batching, `pages.expected_rows`; a GRPO group shares its prompt's pages) and
    `dense_rows_same_memory` (the rows of max_cache_len the same bytes hold densely)."""
    p = _plan(config, devices, device_memory_gb)
    return with_rows_expected(p, config, lengths) if lengths is not None else p


def with_rows_expected(p: MemoryPlan, config, lengths: tuple) -> MemoryPlan:
    """`p` with `rows_expected` and `dense_rows_same_memory` in its shapes (a paged plan; any
    other is returned as it is); `lengths` = (prompt lengths, completion lengths)."""
    if p.shapes.get("kv_cache") != "paged":
        return p
    # deferred import: jax (engine.pages loads it through the paged cache)
    from das_jax.engine.pages import expected_rows
    P, page = p.shapes["kv_pages"], p.shapes["page_size"]
    p.shapes["rows_expected"] = round(expected_rows(
        P, page, lengths[0], lengths[1], group=config.grpo.num_generations), 1)
    p.shapes["dense_rows_same_memory"] = P * page // config.rollout.max_cache_len
    return p


def _plan(config, devices: int, device_memory_gb: float | None) -> MemoryPlan:
    device_bytes = device_memory_bytes(config, device_memory_gb)
    fraction = (mem_fraction(config) if (device_memory_gb if device_memory_gb is not None
                                         else config.train.device_memory_gb) is not None else 1.0)
    # deferred import: jax (not loaded by importing this module)
    import jax
    if len(jax.devices()) >= devices:
        return plan_in_process(config, devices, device_bytes, mem_fraction=fraction)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={devices}").strip())
    payload = json.dumps({"config": config_to_dict(config), "devices": devices,
                          "device_bytes": device_bytes, "mem_fraction": fraction})
    proc = subprocess.run([sys.executable, "-m", "das_jax.plan", "--subprocess"], input=payload,
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise PlanError(f"the memory analysis subprocess failed: {proc.stderr.strip()[-2000:]}")
    return MemoryPlan(**json.loads(proc.stdout.strip().splitlines()[-1]))


def estimate_bytes(config, model_config) -> int:
    """A quick upper estimate of one device's peak (no compile): master + 2 moments + grads in
    f32-ish bytes, a compute copy, the KV cache, the layer inputs kept by remat, the attention and
    logits chunks. Used by `das-jax train` to skip compiling when far below the capacity."""
    mc, r, g, t = model_config, config.rollout, config.grpo, config.train
    n = mc.num_params()
    mi = np.dtype(t.master_dtype).itemsize
    ci = np.dtype(config.model.dtype).itemsize
    state = n * (3 * mi + 4 + ci * (2 if g.beta > 0 else 1))
    T, mb = r.max_cache_len, g.micro_batch_size
    kv = r.max_slots * T * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * ci
    acts_per_layer = mb * T * (6 * mc.hidden_size + 3 * mc.intermediate_size) * 4
    kept = (mc.num_layers * mb * T * mc.hidden_size * ci if t.remat != "none"
            else mc.num_layers * acts_per_layer)
    attn = mb * mc.num_heads * min(T, t.attention_chunk) * T * 4 * 3
    logits = min(t.logits_chunk, mb * T) * mc.vocab_size * 4 * 4
    verify = r.max_slots * max(r.draft_widths) * (mc.vocab_size * 4 * 3 + mc.num_heads * T * 4 * 3)
    return int(state + kv + kept + acts_per_layer + attn + logits + verify)


def check_before_training(config) -> MemoryPlan | None:
    """Refuses (PlanError, one line naming the setting) a run whose plan does not fit its
    devices: the run's mesh (`config.mesh`) over every device of the run (`jax.device_count()`),
    each with its usable memory (`device_memory_bytes`). Skips compiling (returns None) when
    `estimate_bytes` is under half the capacity."""
    if not config.train.memory_check:
        return None
    capacity = device_memory_bytes(config, None)
    fraction = mem_fraction(config) if config.train.device_memory_gb is not None else 1.0
    try:
        mc = model_config_for(config.model.source)
    except Exception:  # noqa: BLE001 - an unloadable model is reported by the loader itself
        return None
    if estimate_bytes(config, mc) <= capacity // 2:
        return None
    # deferred import: jax (not loaded by importing this module)
    import jax
    p = plan_in_process(config, jax.device_count(), capacity, mc, mem_fraction=fraction)
    if not p.fits:
        raise PlanError(p.advice(config) + " (or set train.memory_check=false)")
    return p


def _subprocess_main() -> None:
    req = json.loads(sys.stdin.read())
    config = config_from_dict(req["config"])
    p = plan_in_process(config, req["devices"], req["device_bytes"],
                        mem_fraction=req["mem_fraction"])
    print(json.dumps(p.to_json()))


if __name__ == "__main__":
    if "--subprocess" in sys.argv:
        _subprocess_main()
