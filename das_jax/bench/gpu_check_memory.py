"""GPU check of the memory plan, one go, no downloads, under ~8 minutes on one H200:

    PYTHONPATH=. python -m das_jax.bench.gpu_check_memory [--out results.json]

A random-weight bf16 model of Qwen2-7B's shape (DeepSeek-R1-Distill-Qwen-7B):
  1. train: planned (`das_jax.plan.plan_in_process` on this GPU) vs measured peak device memory
     (`device.memory_stats()["peak_bytes_in_use"]`) and the time of one GRPO train step at
     T=4096, micro-batch 1, remat=full, cuDNN attention, bf16 compute. The master weights are
     bf16 here (pure bf16: 7.6B params x (2 + 2 x 2 moments) + f32 gradients fit one H200; f32
     master weights need the FSDP sharding of `das-jax plan --devices 8`).
  2. verify: time and peak of one B=32, W=8 verify step attending 16K cached positions.
Prints a table and one JSON line (also written to --out).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from das_jax.config import config_from_dict
from das_jax.models.config import ModelConfig
from das_jax.plan import KNOWN_MODELS, plan_in_process


def _peak(dev) -> int:
    return int((dev.memory_stats() or {}).get("peak_bytes_in_use", 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--train-len", type=int, default=4096)
    ap.add_argument("--verify-batch", type=int, default=32)
    ap.add_argument("--verify-context", type=int, default=16384)
    args = ap.parse_args(argv)

    # deferred import: jax, optax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    from das_jax.engine import Engine, EngineConfig
    from das_jax.models.kv_cache import DenseKVCache
    from das_jax.models.transformer import ActivationConfig, init_params
    from das_jax.rl.batches import make_batch
    from das_jax.rl.optimizer import make_optimizer
    from das_jax.rl.train_step import make_train_step

    dev = jax.devices()[0]
    res = {"device": str(dev), "jax": jax.__version__}
    mc = ModelConfig(**KNOWN_MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"])
    T = args.train_len
    config = config_from_dict({
        "model": {"dtype": "bfloat16"},
        "rollout": {"max_new_tokens": T - 64, "max_cache_len": T, "max_slots": 1,
                    "draft_widths": [1]},
        "grpo": {"num_generations": 2, "prompts_per_step": 1, "micro_batch_size": 1},
        "train": {"master_dtype": "bfloat16", "remat": "full"}})
    capacity = int(dev.memory_stats()["bytes_limit"])
    t0 = time.perf_counter()
    plan = plan_in_process(config, 1, capacity, model_config=mc)
    res["plan_s"] = time.perf_counter() - t0
    res["planned_train_peak_gb"] = plan.phases["train"] / 1e9
    res["planned_update_peak_gb"] = plan.phases["update"] / 1e9
    print(plan.table(), flush=True)

    params = jax.jit(lambda k: init_params(mc, k, dtype=jnp.bfloat16, scale=0.01))(
        jax.random.PRNGKey(0))
    opt = make_optimizer(config.grpo, 10)
    opt_state = opt.init(params)
    act = ActivationConfig(remat="full", logits_chunk=config.train.logits_chunk)
    step = make_train_step(mc, config.grpo, opt, temperature=1.0, donate=True, activation=act,
                           compute_dtype="bfloat16")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, mc.vocab_size, size=(1, T))
    batch = make_batch(tokens, [64], [T - 64], advantages_B=np.ones(1, np.float32))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        params, opt_state, m = step(params, opt_state, batch)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    res["train_step_s_first"], res["train_step_s"] = times
    res["measured_train_peak_gb"] = _peak(dev) / 1e9
    print(f"train step T={T} mb=1: {times[1]:.2f} s (first, with compile: {times[0]:.1f} s); "
          f"peak {res['measured_train_peak_gb']:.1f} GB, planned "
          f"{max(res['planned_train_peak_gb'], res['planned_update_peak_gb']):.1f} GB", flush=True)
    del opt_state, step

    B, S, W = args.verify_batch, args.verify_context, 8
    engine = Engine(mc, params, engine_config=EngineConfig(
        max_slots=B, max_cache_len=S + W, draft_widths=(1, W),
        kv_memory_gb=2 * DenseKVCache.nbytes_for(mc, B, S + W, jnp.bfloat16) / 1e9),
        dtype="bfloat16")
    res["verify_step_s"] = engine.time_verify_step(B, W, kv_len=S, cache_len=S + W, repeats=3)
    res["kv_cache_gb"] = DenseKVCache.nbytes_for(mc, B, S + W, jnp.bfloat16) / 1e9
    res["measured_peak_after_verify_gb"] = _peak(dev) / 1e9
    print(f"verify B={B} W={W} context {S}: {res['verify_step_s'] * 1e3:.1f} ms; KV "
          f"{res['kv_cache_gb']:.1f} GB", flush=True)
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
