"""The lease script: the project's one GPU check, sized for a 15-minute device lease (<= 8 min on
one H200), random-weight Qwen2-7B in bfloat16, nothing downloaded, all output under --out:

    PYTHONPATH=. python -m das_jax.bench.gpu_lease_check --out DIR [--smoke] [--parts LIST]

Parts (`--parts`, comma-separated, default all; each runs in its own try/except, so one that
fails records its error in the JSON and the others still run):

* env: jax / jaxlib versions, CUDA and cuDNN versions (null where the backend has none), device
  kind, allocator memory limit, `jax.print_environment_info()`.
* verify: four packed verify programs (`VerifySpec`, compiled by `Programs`) at a 17,408-position
  cache: (B rows, N slots, W width, A attended) = (32, 32, 1, 16K), (32, 256, 8, 16K),
  (32, 32, 1, 2K), (8, 8, 1, 16K): compile seconds, aliased / temporary bytes (XLA's memory
  analysis), the median of 10 steps and its ratio to the read floor (weights + B * A cached
  positions at the H200's 4.8 TB/s).
* hlo: the first program's optimised HLO (`DIR/verify0.hlo.txt`) with a labelled heuristic of
  whether the layer scan copies each layer's weights, and an A/B of that program in a
  subprocess with `--xla_gpu_enable_dynamic_slice_fusion=true` added to XLA_FLAGS.
* share: temporary bytes of prompt sharing and of compaction (32 -> 16 rows) at 32 x 17,408.
* train: the train step's gradient kernel (`accumulate_grads`, as `LossAndGrad` runs it) at
  micro-batch 1, T=4096, remat full, bf16 params with their Adam moments alive: cuDNN attention
  in the lowered kernel or not, step seconds, and the allocator's peak against the train phase
  of `das_jax.plan.plan_in_process` (run after the verify programs; JAX has no public reset of
  the peak, so the peak counts only when the kernel raised it above the earlier one).
* generate: `Engine.generate` with `none` and `das` on 32 requests (4 prompts x 8) x 128 tokens:
  host seconds per step (wall - device decode - prefill, per forward pass).

Writes `DIR/gpu_lease_check.json` after every part: {"parts": {part: result or {"error"}},
"seconds": {part: wall s}, "counts": {part: compiles by kind, steps}, "estimate": {...}}.
`--smoke` runs every part on the tests' tiny model in float32 with tiny shapes (B <= 4, cache 64;
generate keeps the full run's request layout), on the CPU (`tests/test_gpu_lease_check.py`).

Estimate (`das_jax.bench.lease_plan.estimate_seconds`): the full run's seconds from counts
(compiles by kind, steps per program, generate passes and token slots: what this run measured,
`expected_counts` for parts not run) times the stated GPU figures of `lease_plan.FIGURES`
(assumptions, not measurements: replace them with the JSON's measured compile and step seconds
after a lease) and the `h200-7b` step model of `das_jax.speculation.gpu_cost`. Printed at the
start (from `expected_counts`) and stored in the JSON (from the counts measured).

After the lease, on the CPU: `python -m das_jax.bench.gpu_check --from-json
DIR/gpu_lease_check.json` fits the cost model to the four verify timings and runs the
paper-scale replay under it (`gpu_check` itself is no longer a lease script).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from das_jax.bench.gpu_check import MODELS
from das_jax.bench.lease_plan import (BUDGET_S, FULL, SMOKE, Shapes, estimate_seconds,
                                      expected_counts, weight_copy_heuristic)
from das_jax.config import config_from_dict
from das_jax.models.config import ModelConfig
from das_jax.plan import device_memory_bytes, plan_in_process
from das_jax.speculation import CostModelConfig, DASSection, build_speculation
from das_jax.speculation.gpu_cost import H200
from das_jax.testing import paged_case, tiny_model_config

_ROOT = pathlib.Path(__file__).resolve().parents[2]
DSF_FLAG = "--xla_gpu_enable_dynamic_slice_fusion=true"

class CompileCounter:
    """Backend compiles of the process (`jax.monitoring`'s compile-duration event, a persistent
    cache hit included): the compiled functions' names and seconds; installed once (a listener
    cannot be removed on every jax version)."""

    names: list = []
    seconds, installed = 0.0, False

    @classmethod
    def install(cls) -> None:
        """Registers the listener (once; without the API the names stay empty)."""
        if cls.installed:
            return
        import jax  # deferred import: jax (not loaded by importing this module)

        def listen(event, duration, **kwargs):
            if event.endswith("backend_compile_duration"):
                name = str(kwargs.get("fun_name", ""))   # "jit(f)"; "jit_f" before
                cls.names.append(name.removeprefix("jit(").removesuffix(")")
                                 .removeprefix("jit_"))
                cls.seconds += float(duration)
        try:
            jax.monitoring.register_event_duration_secs_listener(listen)
            cls.installed = True
        except Exception:  # noqa: BLE001 - an API absent in this jax: counts stay 0
            pass


class Check:
    """One run: its shapes, output directory, model, params, `Programs` and counts."""

    def __init__(self, args, shapes: Shapes):
        import jax  # deferred import: jax (not loaded by importing this module)
        import jax.numpy as jnp

        from das_jax.engine import Programs, SamplingParams
        from das_jax.models.transformer import init_params

        self.args, self.shapes, self.out = args, shapes, pathlib.Path(args.out)
        # smoke: the tiny model with a vocabulary where random prompts rarely repeat (as on
        # the 7B's 152K), so the das drafter's suffix trees stay as small as there
        self.config = (tiny_model_config(vocab_size=1024) if args.smoke
                       else ModelConfig(**MODELS[shapes.model]))
        if args.layer_loop == "unroll":
            self.config = dataclasses.replace(self.config, layer_loop="unroll")
        self.dtype = jnp.dtype(shapes.dtype)
        self.device = jax.devices()[0]
        self.params = jax.jit(lambda k: init_params(self.config, k, self.dtype))(
            jax.random.PRNGKey(0))
        if args.layer_loop == "unstacked":   # per-layer buffers (`models.layer_loop.unstack`)
            from das_jax.models.layer_loop import unstack  # deferred import: jax
            self.params = {**self.params, "layers": unstack(self.params["layers"])}
        jax.block_until_ready(self.params)
        self.programs = Programs(self.config, device=self.device)
        self.skey = SamplingParams(temperature=0.6).static_key()
        self.counts: dict = {}
        self.results: dict = {}

    def verify_spec(self, B: int, N: int, W: int, A: int):
        """The `VerifySpec` of B rows x N slots (width W) attending A positions."""
        # deferred import: jax (not loaded by importing this module)
        from das_jax.engine import VerifySpec
        return VerifySpec(self.config, self.skey, B, N, W, self.shapes.cache_len, A,
                          self.dtype.name)

    def compile(self, spec) -> float:
        """Compiles `spec`'s program from abstract arguments; seconds (0 when compiled before)."""
        c0 = self.programs.compile_s
        self.programs.executable(spec, *self.programs.abstract(spec, self.params))
        return self.programs.compile_s - c0

    def read_floor_s(self, B: int, A: int) -> float:
        """Seconds to read the weights (all but an untied input embedding) and B x A cached
        positions once at the H200's datasheet bandwidth (4.8 TB/s)."""
        import jax  # deferred import: jax (not loaded by importing this module)

        from das_jax.models.kv_cache import KVCache
        w = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.params))
        if "lm_head" in self.params:
            w -= self.params["embed"].nbytes
        kv = B * A * KVCache.bytes_per_position(self.config, self.dtype)
        return (w + kv) / H200.hbm_bytes_per_s


def part_env(ck: Check) -> dict:
    """Versions (jax, jaxlib, CUDA / cuDNN: null without the CUDA plugin), device kind, the
    allocator's memory limit in bytes, the XLA environment, `jax.print_environment_info()`."""
    import jax  # deferred import: jax (not loaded by importing this module)
    import jaxlib

    dev = ck.device
    out = {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None),
           "backend": jax.default_backend(), "device_kind": dev.device_kind,
           "platform_version": getattr(getattr(dev, "client", None), "platform_version", None),
           "cuda": None, "cudnn": None, "versions": {},
           "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                  "XLA_CLIENT_MEM_FRACTION", "JAX_PLATFORMS")}}
    try:   # private module, absent without the CUDA plugin: versions stay null
        from jax._src.lib import cuda_versions  # deferred import: jax
        for name in dir(cuda_versions or object()):
            if name.endswith("_version") and callable(getattr(cuda_versions, name)):
                try:
                    out["versions"][name] = getattr(cuda_versions, name)()
                except Exception as e:  # noqa: BLE001 - one unavailable library
                    out["versions"][name] = repr(e)
        out["cuda"] = out["versions"].get("cuda_runtime_get_version")
        out["cudnn"] = out["versions"].get("cudnn_get_version")
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["versions_error"] = repr(e)
    stats = dev.memory_stats() or {}
    out["memory_limit_bytes"] = stats.get("bytes_limit")
    try:
        out["environment_info"] = jax.print_environment_info(return_string=True)
    except Exception as e:  # noqa: BLE001
        out["environment_info"] = repr(e)
    return out


def part_verify(ck: Check) -> dict:
    """Per program: compile_s, alias / temp / argument / output bytes, median_s of `repeats`
    steps (after one discarded), floor_s and median / floor."""
    rows = []
    programs = ck.shapes.verify[:1] if ck.args.first_verify_only else ck.shapes.verify
    for B, N, W, A in programs:
        spec = ck.verify_spec(B, N, W, A)
        compile_s = ck.compile(spec)
        mem = ck.programs.memory(spec, ck.params)
        med = ck.programs.time(spec, ck.params, repeats=ck.shapes.repeats)
        floor = ck.read_floor_s(B, A)
        rows.append({"B": B, "N": N, "W": W, "A": A, "cache_len": ck.shapes.cache_len,
                     "compile_s": compile_s, **{f"{k}_bytes": v for k, v in mem.items()},
                     "median_s": med, "floor_s": floor, "ratio_to_floor": med / floor})
        print(f"  verify B={B} N={N} W={W} A={A}: compile {compile_s:.1f}s, temp "
              f"{mem['temp'] / 1e9:.3f} GB, alias {mem['alias'] / 1e9:.3f} GB, median "
              f"{med * 1e3:.2f} ms = {med / floor:.2f}x the read floor", flush=True)
    ck.counts["verify"] = {"verify_steps": [ck.shapes.repeats + 1] * len(rows)}
    return {"programs": rows}


def part_hlo(ck: Check) -> dict:
    """The first verify program's HLO (file + heuristic) and its A/B with the GPU flag."""
    B, N, W, A = ck.shapes.verify[0]
    spec = ck.verify_spec(B, N, W, A)
    ck.compile(spec)
    text = ck.programs.executable(spec, *ck.programs.abstract(spec, ck.params)).as_text()
    path = ck.out / "verify0.hlo.txt"
    path.write_text(text)
    heur = weight_copy_heuristic(text, ck.params)
    counts = {"hlo_texts": 1, "subprocesses": 1, "verify_steps": [0]}
    done = ck.results.get("verify", {}).get("programs")
    base = done[0]["median_s"] if done else None
    if base is None:
        base = ck.programs.time(spec, ck.params, repeats=ck.shapes.repeats)
        counts["verify_steps"] = [ck.shapes.repeats + 1]
    ck.counts["hlo"] = counts
    ab = _ab_arm(ck, base, counts)
    print(f"  HLO {len(text)} chars -> {path.name}; materialised layer-weight slices "
          f"{heur['materialised_slices']} (heuristic); A/B speedup with the flag "
          f"{ab.get('speedup', float('nan')):.3f}x", flush=True)
    return {"hlo_file": str(path), "hlo_chars": len(text), "weight_copies": heur, "ab": ab}


def _ab_arm(ck: Check, base: float, counts: dict) -> dict:
    """The first verify program timed by this script in a subprocess whose XLA_FLAGS add
    `DSF_FLAG` (flags are read when a backend starts), against `base` seconds without it; adds
    the subprocess's compiles and steps to `counts`. A failed arm records its error."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DSF_FLAG}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    sub = ck.out / "ab_dynamic_slice_fusion"
    (sub / "gpu_lease_check.json").unlink(missing_ok=True)    # never read an earlier run's
    cmd = [sys.executable, "-m", "das_jax.bench.gpu_lease_check", "--out", str(sub), "--parts",
           "verify", "--first-verify-only"] + (["--smoke"] if ck.args.smoke else [])
    print(f"  A/B arm: XLA_FLAGS += {DSF_FLAG} (subprocess)", flush=True)
    ab = {"flag": DSF_FLAG, "without_flag_median_s": base}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=ck.shapes.ab_timeout_s)
        ab.update(rc=proc.returncode, stderr_tail=proc.stderr[-3000:] or None)
        child = json.loads((sub / "gpu_lease_check.json").read_text())
        row = child["parts"]["verify"]["programs"][0]
        ab.update(with_flag=row, with_flag_median_s=row["median_s"],
                  speedup=base / row["median_s"], stderr_tail=None)
        sub_counts = child["counts"]["verify"]
        counts["compiles"] = sub_counts.get("compiles", {})
        counts["verify_steps"] = [counts["verify_steps"][0] + sub_counts["verify_steps"][0]]
    except Exception as e:  # noqa: BLE001 - the arm failed (timeout, its error): recorded
        ab["error"] = f"{type(e).__name__}: {e}"
    return ab


def part_share(ck: Check) -> dict:
    """Memory analysis of prompt sharing (`share_width` prompt positions per row) and of
    compaction (`share_rows` -> `gather_to` rows) on a share_rows x cache_len cache."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import GatherSpec, ShareSpec

    sh, out = ck.shapes, {}
    specs = {"share_prompt_rows": ShareSpec(ck.config, ck.skey, sh.share_rows, sh.share_width,
                                            sh.cache_len, ck.dtype.name),
             "gather_rows": GatherSpec(ck.config, sh.share_rows, sh.gather_to, sh.cache_len,
                                       ck.dtype.name)}
    for name, spec in specs.items():
        compile_s = ck.compile(spec)
        mem = ck.programs.memory(spec, ck.params)
        out[name] = {"compile_s": compile_s, **{f"{k}_bytes": v for k, v in mem.items()}}
        print(f"  {name} at {sh.share_rows} x {sh.cache_len}: temp {mem['temp'] / 1e9:.3f} GB, "
              f"output {mem['output'] / 1e9:.3f} GB", flush=True)
    out.update(rows=sh.share_rows, cache_len=sh.cache_len, share_width=sh.share_width,
               gather_to=sh.gather_to)
    ck.counts["share"] = {}
    return out


def _peak(dev) -> tuple[int | None, int | None]:
    """(peak bytes in use, bytes in use) of `dev`'s allocator; None where it keeps none (CPU)."""
    stats = dev.memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")


def part_train(ck: Check) -> dict:
    """The gradient kernel of the train step (`accumulate_grads`, as `LossAndGrad` calls it) at
    micro-batch 1 x T, remat full, params and Adam moments in `dtype` (alive, as in the plan's
    train phase): the plan, two calls (the first compiles), cuDNN attention in the lowered
    kernel or not, the allocator's peak against the planned train phase (bytes)."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.models.transformer import ActivationConfig
    from das_jax.rl.batches import make_batch
    from das_jax.rl.grads import accumulate_grads, make_loss_and_grad
    from das_jax.rl.optimizer import make_optimizer

    T, mc, dt = ck.shapes.train_len, ck.config, ck.dtype.name
    prompt = max(1, T // 64)
    config = config_from_dict({
        "model": {"dtype": dt},
        "rollout": {"max_new_tokens": T - prompt, "max_cache_len": T, "max_slots": 1,
                    "draft_widths": [1]},
        "grpo": {"num_generations": 2, "prompts_per_step": 1, "micro_batch_size": 1},
        "train": {"master_dtype": dt, "remat": "full"}})
    t0 = time.perf_counter()
    plan = plan_in_process(config, 1, device_memory_bytes(config, None), model_config=mc)
    out = {"T": T, "plan_s": time.perf_counter() - t0, "planned_phases_bytes": plan.phases,
           "planned_train_bytes": plan.phases["train"]}
    act = ActivationConfig(remat="full", logits_chunk=config.train.logits_chunk)
    lg = make_loss_and_grad(mc, config.grpo, temperature=1.0, activation=act, compute_dtype=dt)
    tokens = np.random.default_rng(0).integers(0, mc.vocab_size, size=(1, T))
    cols, keep = lg.host_columns(make_batch(tokens, [prompt], [T - prompt],
                                            advantages_B=np.ones(1, np.float32)))
    xs = next(iter(lg.micro_batches(cols, keep, 1)))
    opt_state = make_optimizer(config.grpo, 10).init(ck.params)
    peak0, in_use0 = _peak(ck.device)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        float(accumulate_grads(mc, lg.loss_config, ck.params, xs, activation=act,
                               compute_dtype=dt)[0])
        times.append(time.perf_counter() - t0)
    peak1, _ = _peak(ck.device)
    del opt_state
    text = accumulate_grads.lower(mc, lg.loss_config, ck.params, xs, activation=act,
                                  compute_dtype=dt).as_text()
    raised = peak0 is not None and peak1 is not None and peak1 > peak0
    out.update(step_s=times[1], first_step_s=times[0], cudnn_attention="cudnn" in text.lower(),
               peak_before_bytes=peak0, in_use_before_bytes=in_use0, peak_after_bytes=peak1,
               train_peak_bytes=peak1 if raised else None,
               peak_vs_plan=peak1 / plan.phases["train"] if raised else None,
               peak_note="no public JAX reset of the peak: train_peak_bytes is the process peak "
                         "after the kernel when it raised the peak before (the verify "
                         "programs'), else null")
    # the plan's kernel and update (jitted lambdas there); this kernel counts by its name
    ck.counts["train"] = {"compiles": {"train_kernel": 1, "update": 1}, "train_steps": 2,
                          "lowerings": 1}
    print(f"  train kernel T={T}: {times[1]:.2f}s (first {times[0]:.1f}s), cuDNN attention "
          f"{out['cudnn_attention']}, peak {peak1} vs planned {plan.phases['train']}", flush=True)
    return out


def part_generate(ck: Check) -> dict:
    """`Engine.generate` with `none` (k plain decode steps per device call, the default), with
    `none` one step per call (`decode_steps=1`: the same tokens, the host waiting every step),
    and with `das` (its policy's compile prior: the measured verify compile seconds); host
    seconds per forward pass (`host_s`, and all the wall time outside the device calls) and the
    step counts."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import Engine, EngineConfig, Request, SamplingParams

    sh = ck.shapes
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(1, ck.config.vocab_size, sh.gen_prompt))
               for _ in range(sh.gen_problems)]
    requests = [Request(p, problem_id=i, sample_index=g) for i, p in enumerate(prompts)
                for g in range(sh.gen_samples)]
    sampling = SamplingParams(temperature=0.6, max_new_tokens=sh.gen_new)
    engines = {k: Engine(ck.config, ck.params, eos_token_ids=[], engine_config=EngineConfig(
        max_slots=sh.gen_slots, max_cache_len=2048, draft_widths=sh.gen_widths,
        decode_steps=k, kv_cache=ck.args.kv_cache)) for k in (1, EngineConfig.decode_steps)}
    done = ck.results.get("verify", {}).get("programs") or [{"compile_s": 1.0}]
    prior = float(np.mean([r["compile_s"] for r in done]))
    das = DASSection(cost_model=CostModelConfig(source=sh.cost_source, calibrate=False,
                                                compile_s=prior))
    out, steps = {"requests": len(requests), "new_tokens": sh.gen_new}, [0, 0, 0]
    prefill = [0, 0, 0]
    tokens = {}
    for name, k in (("none", EngineConfig.decode_steps), ("none-1step", 1),
                    ("das", EngineConfig.decode_steps)):
        drafter, policy = build_speculation(name.split("-")[0], das)
        outputs, st = engines[k].generate(requests, sampling, drafter=drafter, policy=policy)
        tokens[name] = [o.token_ids for o in outputs]
        n = max(st.forward_passes, 1)
        host = st.wall_s - st.decode_s - st.prefill_s
        out[name] = {**st.to_dict(), "decode_steps": k, "host_s_per_step": host / n,
                     "draft_policy_s_per_step": (st.draft_s + st.policy_s) / n,
                     "decode_s_per_step": st.decode_s / n}
        for s in st.steps:
            n_slots, attended = s.step_shape()
            steps[0] += n_slots
            steps[1] += attended
        steps[2] += st.forward_passes
        prefill = [prefill[0] + st.prefill_tokens, 0, prefill[2] + st.prefill_calls]
        print(f"  generate {name}: {st.forward_passes} steps, host {host / n * 1e3:.2f} ms/step, "
              f"decode {st.decode_s / n * 1e3:.2f} ms/step, compile {st.compile_s:.1f}s, "
              f"accept len {st.acceptance_length:.2f}", flush=True)
    # k steps per call vs one: the same tokens up to float rounding of the attended length
    out["none_identical_rollouts"] = float(np.mean(
        [a == b for a, b in zip(tokens["none"], tokens["none-1step"])]))
    out["kv_cache"], out["tokens"] = ck.args.kv_cache, {k: [list(map(int, t)) for t in v]
                                                        for k, v in tokens.items()}
    ck.counts["generate"] = {"device_steps": [steps, prefill], "host_steps": steps[2]}
    return out


def part_layers(ck: Check) -> dict:
    """The layer loop (`das_jax.models.layer_loop`): the verify programs of
    `shapes.layer_programs` with `layer_loop="unroll"` (static slices of the stacked weights),
    and the first with the weights unstacked (one buffer per layer, a Python loop), against the
    scan: compile seconds, temporary bytes, median step, the weight-copy heuristic of each."""
    import jax  # deferred import: jax (not loaded by importing this module)

    from das_jax.engine import Programs
    from das_jax.models.layer_loop import unstack

    done = {(r["B"], r["N"], r["W"], r["A"]): r
            for r in ck.results.get("verify", {}).get("programs", [])}
    unrolled = dataclasses.replace(ck.config, layer_loop="unroll")
    arms = {"scan": (ck.config, ck.params), "unroll": (unrolled, ck.params)}
    rows, steps = [], []
    for i in ck.shapes.layer_programs:
        B, N, W, A = ck.shapes.verify[i]
        names = list(arms) + (["unstacked"] if i == ck.shapes.layer_programs[0] else [])
        for name in names:
            if name == "unstacked":
                params = {**ck.params, "layers": unstack(ck.params["layers"])}
                jax.block_until_ready(params)
                config = ck.config
            else:
                config, params = arms[name]
            programs = Programs(config, device=ck.device)
            spec = ck.verify_spec(B, N, W, A)
            spec = dataclasses.replace(spec, config=config)
            # Programs keys a program by its spec, not by the params' tree: the unstacked arm
            # compiles its own and leaves the stacked one cached for the other parts
            stacked = programs.swap(spec) if name == "unstacked" else None
            row = {"B": B, "N": N, "W": W, "A": A, "loop": name}
            if name == "scan" and (B, N, W, A) in done:
                row.update(median_s=done[(B, N, W, A)]["median_s"], from_verify_part=True)
            c0 = programs.compile_s
            exe = programs.executable(spec, *programs.abstract(spec, params))
            row["compile_s"] = programs.compile_s - c0
            row.update({f"{k}_bytes": v for k, v in programs.memory(spec, params).items()})
            if "median_s" not in row:
                row["median_s"] = programs.time(spec, params, repeats=ck.shapes.repeats)
                steps.append(ck.shapes.repeats + 1)
            row["weight_copies"] = weight_copy_heuristic(exe.as_text(), params)
            row["floor_s"] = ck.read_floor_s(B, A)
            row["ratio_to_floor"] = row["median_s"] / row["floor_s"]
            rows.append(row)
            print(f"  layers {name} B={B} N={N} W={W} A={A}: compile {row['compile_s']:.1f}s, "
                  f"median {row['median_s'] * 1e3:.2f} ms = {row['ratio_to_floor']:.2f}x the "
                  f"floor; materialised weight slices "
                  f"{row['weight_copies']['materialised_slices']} (heuristic)", flush=True)
            if name == "unstacked":
                programs.swap(spec, stacked)
                del params, exe
    base = {(r["B"], r["N"], r["W"], r["A"]): r["median_s"] for r in rows if r["loop"] == "scan"}
    for r in rows:
        r["speedup_vs_scan"] = base[(r["B"], r["N"], r["W"], r["A"])] / r["median_s"]
    ck.counts["layers"] = {"verify_steps": [sum(steps)], "hlo_texts": len(rows)}
    return {"programs": rows}


def _host_requests(ck: Check, rows: int) -> list:
    """rows // host_samples groups of host_samples samples of a random host_prompt-token
    prompt."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import Request

    sh = ck.shapes
    rng = np.random.default_rng(rows)
    prompts = [tuple(int(t) for t in rng.integers(1, ck.config.vocab_size, sh.host_prompt))
               for _ in range(rows // sh.host_samples)]
    return [Request(p, problem_id=i, sample_index=g) for i, p in enumerate(prompts)
            for g in range(sh.host_samples)]


def part_host(ck: Check) -> dict:
    """The host loop at GPU step times. For each of `shapes.host_rows` (all
    rows admitted at once, greedy, `host_new` tokens each): `none` with k decode steps per call
    and with one, and `das` twice on one drafter (epoch 0 drafts from the live siblings and
    prompts; epoch 1 also from epoch 0's rollouts: greedy on the same prompts, so its drafts
    are the synthetic history the random-weight model accepts). Per run: forward passes, host
    seconds per step (`host_s`, the scheduler + drafter + policy between device calls: exposed,
    the device waits for it), device-call seconds per step (`decode_s`: the step, plus the
    overlapped appends the step did not hide), the same program's step alone (`Programs.time`
    of the run's most frequent verify shape: the device's own time), exposed host time =
    wall - prefill - device-alone x steps, acceptance length, tokens identical across k."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine import Engine, EngineConfig, SamplingParams, bucket, verify_token_buckets
    from das_jax.rollout import exercise_kernels

    sh = ck.shapes
    done = ck.results.get("verify", {}).get("programs") or [{"compile_s": 1.0}]
    prior = float(np.mean([r["compile_s"] for r in done]))
    das = DASSection(cost_model=CostModelConfig(source=sh.cost_source, calibrate=False,
                                                compile_s=prior))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=sh.host_new)
    out, passes, slots = {}, 0, 0
    t0 = time.perf_counter()   # numba's kernels compiled before the first das step
    exercise_kernels(*build_speculation("das", das), EngineConfig(draft_widths=sh.gen_widths))
    out["kernel_warm_up_s"] = time.perf_counter() - t0
    for rows in sh.host_rows:
        requests = _host_requests(ck, rows)
        cache_len = sh.host_prompt + sh.host_new + max(sh.gen_widths)
        engines = {k: Engine(ck.config, ck.params, eos_token_ids=[], engine_config=EngineConfig(
            max_slots=rows, max_cache_len=cache_len, draft_widths=sh.gen_widths,
            decode_steps=k)) for k in (1, EngineConfig.decode_steps)}
        res, tokens = {}, {}
        drafter, policy = build_speculation("das", das)
        runs = (("none", EngineConfig.decode_steps, None), ("none-1step", 1, None),
                ("das-epoch0", EngineConfig.decode_steps, (drafter, policy)),
                ("das-epoch1", EngineConfig.decode_steps, (drafter, policy)))
        for name, k, spec in runs:
            d, p = spec if spec else build_speculation("none", das)
            outputs, st = engines[k].generate(requests, sampling, drafter=d, policy=p)
            tokens[name] = [o.token_ids for o in outputs]
            n = max(st.forward_passes, 1)
            calls = list(st.steps)
            shapes = {}
            for s in calls:   # the compiled slot bucket of the step's token slots
                n_slots = s.step_shape()[0]
                buckets = verify_token_buckets(s.batch, max(sh.gen_widths))
                key = (s.batch, bucket(n_slots, buckets), s.width, s.kv_len)
                shapes[key] = shapes.get(key, 0) + 1
            B, N, W, A = max(shapes, key=shapes.get) if shapes else (rows, rows, 1, cache_len)
            alone = None
            if name != "none":   # k steps per call: no single program to time alone
                spec = dataclasses.replace(ck.verify_spec(B, N, W, A),
                                           cache_len=max(cache_len, A))
                alone = ck.programs.time(spec, ck.params, repeats=5)
            r = {**st.to_dict(), "rows": rows, "decode_steps": k,
                 "host_ms_per_step": 1e3 * st.host_s / n,
                 "draft_policy_ms_per_step": 1e3 * (st.draft_s + st.policy_s) / n,
                 "device_call_ms_per_step": 1e3 * st.decode_s / n,
                 "host_us_per_row": 1e6 * st.host_s / max(sum(s.batch for s in calls), 1),
                 "common_shape": [B, N, W, A], "common_shape_steps": shapes.get((B, N, W, A)),
                 "step_alone_ms": None if alone is None else 1e3 * alone}
            if alone is not None:
                r["exposed_host_ms_per_step"] = 1e3 * max(
                    0.0, st.wall_s - st.prefill_s - st.compile_s - alone * n) / n
            res[name] = r
            passes += st.forward_passes
            slots += sum(s.step_shape()[0] for s in calls)
            print(f"  host {rows} rows {name}: {st.forward_passes} passes, host "
                  f"{r['host_ms_per_step']:.2f} ms/step ({r['host_us_per_row']:.1f} us/row), "
                  f"device call {r['device_call_ms_per_step']:.2f} ms/step, alone "
                  f"{r['step_alone_ms'] or float('nan'):.2f} ms, exposed "
                  f"{r.get('exposed_host_ms_per_step', float('nan')):.2f} ms/step, accept len "
                  f"{st.acceptance_length:.2f}, compile {st.compile_s:.1f}s", flush=True)
        res["none_k_identical_to_1step"] = float(np.mean(
            [a == b for a, b in zip(tokens["none"], tokens["none-1step"])]))
        res["das_epoch1_identical_to_none"] = float(np.mean(
            [a == b for a, b in zip(tokens["das-epoch1"], tokens["none-1step"])]))
        out[str(rows)] = res
    ck.counts["host"] = {"device_steps": [[slots, 0, passes]], "host_steps": passes}
    return out


def part_paged(ck: Check) -> dict:
    """The paged cache on this backend: the platform's Pallas kernel (`prefix_partials_gpu` on
    CUDA; interpret mode in the smoke) against the XLA gather reference over random page
    tables and ragged lengths at each query width (float32: max errors of the normalised
    output and log-denominator, at the default launch shape and the fastest; the dtype's case
    timed: median of 10 calls each, the kernel at each of `shapes.paged_tunings`); the
    fastest launch shape (summed over the widths) becomes `paged_attention.GPU_TUNING` (or
    `--paged-tuning`'s, without the sweep); then the packed verify step on the paged pool
    (kernels "pallas_gpu" and "gather") against the dense cache at the first verify program's
    shape (every row on its own pages)."""
    import jax  # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp

    from das_jax.models import paged_attention as pa

    B, KVH, G, K, page, kv_len = ck.shapes.paged_case
    interpret = ck.args.smoke
    fixed = ck.args.paged_tuning
    tunings = [pa.GpuKernelTuning(*t) for t in ([fixed] if fixed else ck.shapes.paged_tunings)]
    out = {"case": dict(B=B, KVH=KVH, G=G, K=K, page=page, kv_len=kv_len),
           "tunings": [dataclasses.asdict(t) for t in tunings]}

    def timed(fn, args, repeats=10):
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    def kernel(t):
        return jax.jit(lambda *a: pa.prefix_partials_gpu(*a, kv_len, interpret=interpret,
                                                         tuning=t))

    def errors(fn, args):
        (o, m, l), (ow, mw, lw) = ((np.asarray(x, np.float64) for x in r) for r in
                                   (fn(*args), pa.prefix_partials_reference(*args, kv_len)))
        has = np.asarray(args[4]) > 0
        return {"max_err_output": float(np.max(np.abs(o[has] / l[has][..., None]
                                                      - ow[has] / lw[has][..., None]))),
                "max_err_log_denominator": float(np.max(np.abs(
                    np.log(l[has]) + m[has] - np.log(lw[has]) - mw[has]))),
                "empty_rows_zero": bool(np.all(l[~has] == 0) and np.all(o[~has] == 0))}

    cases = {}
    for i, T in enumerate(ck.shapes.paged_widths):
        cases[T] = {d: tuple(jnp.asarray(a, d) if a.dtype.kind == "f" else a
                             for a in paged_case(2 * i + j, B, KVH, G * T, K, page, kv_len))
                    for j, d in enumerate(("float32", ck.dtype.name))}
    kern, totals = [], np.zeros(len(tunings))
    gather = jax.jit(lambda *a: pa.prefix_partials_reference(*a, kv_len))
    for T, args in cases.items():
        row = {"T": T, "M": G * T, "float32": errors(kernel(tunings[0]), args["float32"])}
        low = args[ck.dtype.name]
        row["gather_median_s"] = timed(gather, low)
        row["pallas_median_s"] = [timed(kernel(t), low) for t in tunings]
        totals += row["pallas_median_s"]
        if T == 1 and not ck.args.smoke:
            row["jax_paged_attention_median_s"] = _jax_gpu_paged_attention_s(low, kv_len, timed)
        kern.append(row)
        print(f"  paged kernel T={T}: {ck.dtype.name} gather {row['gather_median_s'] * 1e3:.3f}"
              f" ms; jax's {row.get('jax_paged_attention_median_s')}; pallas " + ", ".join(
                  f"{t.pages_per_block}/{t.split_pages}/{t.max_splits}/{t.num_warps}/"
                  f"{t.num_stages} {s * 1e3:.3f}" for t, s in zip(tunings, row["pallas_median_s"]))
              + " ms (pages per block / split pages / max splits / warps / stages)", flush=True)
    best = tunings[int(np.argmin(totals))]
    pa.GPU_TUNING = best
    for row, (T, args) in zip(kern, cases.items()):
        row["float32_best"] = errors(kernel(best), args["float32"])
        print(f"  paged kernel T={T}: max err f32 {row['float32']['max_err_output']:.2e} "
              f"(first), {row['float32_best']['max_err_output']:.2e} (fastest)", flush=True)
    out["kernel"], out["best"] = kern, dataclasses.asdict(best)
    Bv, N, W, A = ck.shapes.verify[0]
    pages = Bv * -(-ck.shapes.cache_len // 16)
    steps = []
    for name, paging in (("dense", ()), ("paged-pallas", (pages, 16, "pallas_gpu")),
                         ("paged-gather", (pages, 16, "gather"))):
        spec = dataclasses.replace(ck.verify_spec(Bv, N, W, A), pages=paging)
        if ck.args.smoke and paging:   # no Triton on the CPU: the gather
            spec = dataclasses.replace(spec, pages=(pages, 16, "gather"))
        compile_s = ck.compile(spec)
        med = ck.programs.time(spec, ck.params, repeats=ck.shapes.repeats)
        steps.append(ck.shapes.repeats + 1)
        out[f"verify_{name}"] = {"B": Bv, "N": N, "W": W, "A": A, "compile_s": compile_s,
                                 "median_s": med, "layer_loop": ck.config.layer_loop}
        print(f"  verify {name} B={Bv} A={A} ({ck.config.layer_loop}): compile "
              f"{compile_s:.1f}s, median {med * 1e3:.2f} ms", flush=True)
    ck.counts["paged"] = {"verify_steps": [sum(steps)]}
    return out


def _jax_gpu_paged_attention_s(args, kv_len: int, timed) -> float | str:
    """Median seconds of JAX's own Pallas GPU paged attention (`jax.experimental.pallas.ops.gpu.
    paged_attention`: decode, one query token per row, its default launch shape) on the same
    pages in its layout (k and v `[KVH, P, page, K]`, transposed outside the timing): how fast
    a Triton kernel reads these pages. The error text where it fails."""
    import jax  # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    q, k, v, table, lens = args
    B, KVH, G, K = q.shape
    P, page = k.shape[0], k.shape[-1]
    try:
        kp = jnp.transpose(k, (1, 0, 3, 2))
        vp = jnp.transpose(v, (1, 0, 2, 3))
        tb = jnp.minimum(table[:, :-(-kv_len // page)], P - 1)
        fn = jax.jit(lambda q, kp, vp, tb, lens: jpa.paged_attention(
            q.reshape(B, KVH * G, K), kp, vp, tb, lens))
        return timed(fn, (q, kp, vp, tb, lens))
    except Exception as e:  # noqa: BLE001 - a reference point only
        return f"{type(e).__name__}: {e}"[:300]


def _profile_step(ck: Check, spec, steps: int) -> dict:
    """`steps` steps of `spec`'s program under `jax.profiler.trace`, read back with
    `jax.profiler.ProfileData`: per plane (the device's; the host's where the backend has none)
    and line, the summed duration per event name, the top `profile_top`, us per step."""
    import jax  # deferred import: jax (not loaded by importing this module)
    from jax.profiler import ProfileData

    ck.programs.time(spec, ck.params, repeats=1)   # compiled and warm outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            ck.programs.time(spec, ck.params, repeats=steps - 1)
        paths = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))
        data = ProfileData.from_serialized_xspace(paths[-1].read_bytes())
    planes = [p for p in data.planes if p.name.startswith("/device:")] or \
        [p for p in data.planes if p.name.startswith("/host:CPU")]
    out = {}
    for plane in planes:
        lines = {}
        for line in plane.lines:
            sums = {}
            for ev in line.events:
                t, n = sums.get(ev.name, (0.0, 0))
                sums[ev.name] = (t + ev.duration_ns, n + 1)
            top = sorted(sums.items(), key=lambda kv: -kv[1][0])[:ck.shapes.profile_top]
            lines[line.name] = {
                "total_us_per_step": sum(t for t, _ in sums.values()) / 1e3 / steps,
                "events": len(sums),
                "top": [{"name": k[:160], "us_per_step": t / 1e3 / steps, "calls": n}
                        for k, (t, n) in top]}
        out[plane.name] = lines
    return out


def part_profile(ck: Check) -> dict:
    """Where a verify step's time goes, from the profiler (`_profile_step`): the verify
    programs of `shapes.profile_programs` on the dense cache, and the first on the paged pool
    read by the Pallas GPU kernel (the gather in the smoke)."""
    steps, out = ck.shapes.repeats, {}
    programs = ck.shapes.profile_programs[:1] if ck.args.first_verify_only \
        else ck.shapes.profile_programs
    for i in programs:
        B, N, W, A = ck.shapes.verify[i]
        cases = [("dense", ck.verify_spec(B, N, W, A))]
        if i == ck.shapes.profile_programs[0]:
            pages = (B * -(-ck.shapes.cache_len // 16), 16,
                     "gather" if ck.args.smoke else "pallas_gpu")
            cases.append(("paged", dataclasses.replace(cases[0][1], pages=pages)))
        for kind, spec in cases:
            name = f"{kind} B={B} N={N} W={W} A={A}"
            out[name] = _profile_step(ck, spec, steps)
            for plane, lines in out[name].items():
                for line_name, line in lines.items():
                    print(f"  profile {name} {plane} / {line_name}: "
                          f"{line['total_us_per_step'] / 1e3:.2f} ms per step; top: " +
                          "; ".join(f"{e['name'][:50]} {e['us_per_step'] / 1e3:.2f} ms"
                                    for e in line["top"][:5]), flush=True)
    ck.counts["profile"] = {"verify_steps": [(steps + 2) * len(out)]}
    return {"steps": steps, "programs": out}


PARTS = {"env": part_env, "verify": part_verify, "hlo": part_hlo, "share": part_share,
         "train": part_train, "generate": part_generate, "layers": part_layers,
         "host": part_host, "paged": part_paged, "profile": part_profile}
#: Named sets of parts, each sized for one lease (`--parts NAME`): "base" (the default: the
#: first lease's), "loop" (the host loop, the paged kernel, the layer loop and a profile of the
#: verify step), "all" (every part: the smoke runs it).
PRESETS = {"base": ("env", "verify", "hlo", "share", "train", "generate"),
           "loop": ("env", "host", "paged", "layers", "profile"),
           "all": tuple(PARTS)}


# The kind of a compiled function, by its name (`estimate_seconds` prices compiles by kind).
KINDS = {"verify_packed": "engine", "decode_steps": "engine", "prefill_packed": "engine", "share_prompt_rows": "copy",
         "gather_rows": "copy", "accumulate_grads": "train_kernel"}


def _run_part(ck: Check, name: str, res: dict) -> None:
    """Runs one part into `res` (its result or error, wall seconds, counts incl. the compiles:
    by the compiled functions' names, plus the kinds a part names itself, the rest "other")."""
    print(f"[{name}]", flush=True)
    n0, t0 = len(CompileCounter.names), time.perf_counter()
    try:
        res["parts"][name] = ck.results[name] = PARTS[name](ck)
    except Exception as e:  # noqa: BLE001 - one failing part must not lose the others
        res["parts"][name] = {"error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-4000:]}
        print(f"  {name} failed: {type(e).__name__}: {e}", flush=True)
    res["seconds"][name] = time.perf_counter() - t0
    counts = ck.counts.setdefault(name, {})
    kinds = counts.setdefault("compiles", {})
    named = [KINDS.get(f, "other") for f in CompileCounter.names[n0:]]
    for kind in set(named) - {"other"}:
        kinds[kind] = kinds.get(kind, 0) + named.count(kind)
    explicit = sum(n for k, n in kinds.items() if k != "other")
    kinds["other"] = kinds.get("other", 0) + max(0, len(named) - explicit)
    res["counts"][name] = counts


def main(argv=None) -> int:
    """Runs the parts (module docstring); 0 when none failed, 1 otherwise, 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="python -m das_jax.bench.gpu_lease_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (everything goes there)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny shapes (CPU test)")
    ap.add_argument("--parts", default="base", help="a preset (" + ", ".join(PRESETS) +
                    ") or comma-separated parts, of " + ", ".join(PARTS))
    ap.add_argument("--first-verify-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layer-loop", choices=("scan", "unroll", "unstacked"), default="scan",
                    help="every part's layer loop: the scan (default), unrolled, or a Python "
                         "loop over unstacked weights (`ModelConfig.layer_loop`)")
    ap.add_argument("--kv-cache", choices=("dense", "paged"), default="dense",
                    help="the generate part's engines' KV cache (`EngineConfig.kv_cache`)")
    ap.add_argument("--paged-tuning", type=lambda v: tuple(int(x) for x in v.split(",")),
                    default=None, metavar="PPB,SPLIT,MAXSPLITS,WARPS,STAGES",
                    help="the paged part's Triton launch shape (no sweep of "
                         "`Shapes.paged_tunings`; `paged_attention.GpuKernelTuning`)")
    args = ap.parse_args(argv)
    parts = [p for name in args.parts.split(",") if name
             for p in PRESETS.get(name, (name,))]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"error: --parts: unknown {', '.join(bad)}; valid: the presets "
              f"{', '.join(PRESETS)} or the parts {', '.join(PARTS)}", file=sys.stderr)
        return 2
    shapes = SMOKE if args.smoke else FULL
    # The A/B arm runs in a second process beside this one: allocate on demand (before JAX
    # starts its backend; an explicit setting wins).
    if not args.smoke:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    est0 = estimate_seconds({p: c for p, c in expected_counts(FULL).items() if p in parts})
    print(f"gpu lease check ({'smoke' if args.smoke else 'full'}): parts {', '.join(parts)}; "
          f"estimated on one H200 {est0['seconds']:.0f}s (budget {BUDGET_S:.0f}s)",
          flush=True)
    CompileCounter.install()
    t0, n0 = time.perf_counter(), len(CompileCounter.names)
    ck = Check(args, shapes)
    res = {"smoke": args.smoke, "shapes": dataclasses.asdict(shapes), "parts": {},
           "seconds": {"setup": time.perf_counter() - t0}, "counts": {},
           "setup_compiles": len(CompileCounter.names) - n0}
    path = out / "gpu_lease_check.json"
    for name in parts + [None]:
        if name is not None:
            _run_part(ck, name, res)
        else:
            res["seconds"]["total"] = time.perf_counter() - t0
        # the counts of the parts that ran through, the expected ones for the others
        ran = {p: c for p, c in res["counts"].items() if "error" not in res["parts"][p]}
        full = {**{p: c for p, c in expected_counts(FULL).items() if p in parts}, **ran}
        res["estimate"] = estimate_seconds(full)
        res["estimate"]["counts_from"] = {p: "measured" if p in ran else "expected"
                                          for p in full}
        path.write_text(json.dumps(res, indent=1, default=str))
    print("seconds per part: " + ", ".join(f"{k} {v:.1f}" for k, v in res["seconds"].items()))
    print(f"estimated on one H200 from these counts: {res['estimate']['seconds']:.0f}s "
          f"(budget {BUDGET_S:.0f}s); wrote {path}", flush=True)
    return 1 if any("error" in r for r in res["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
