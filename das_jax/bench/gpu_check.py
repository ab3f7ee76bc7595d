"""GPU cost model (measured step times against its coefficients) and the paper-scale replay
under it, no downloads:

    PYTHONPATH=. python -m das_jax.bench.gpu_check --from-json DIR/gpu_lease_check.json [--out DIR]
    PYTHONPATH=. python -m das_jax.bench.gpu_check [--out DIR] [--trace TRACE.jsonl[.gz]]

Not the lease script: a device lease runs `das_jax.bench.gpu_lease_check` (one JSON, <= 8 min on
one H200). `--from-json` then runs here, on the CPU: it fits the model (step 2) to the four verify
programs the lease check timed and runs the replay (step 3). Without it, step 1 measures the
shapes below on this machine's device first (longer than a lease allows for both models).

1. Random-weight bfloat16 models of Qwen2-1.5B and Qwen2-7B shapes. For N in {16, 64, 256,
   1024, 4096} token slots and 1K / 8K attended positions per row, times the engine's packed
   verify step (`Engine.time_verify_step`, as the cost-model calibration does: projections,
   MLP, lm_head and sampling on N slots, attention per row over its cache, the cache written in
   place). A shape's rows are as many as
   N allows (at most `--max-rows`) within `--kv-memory-gb` of cache; each row verifies
   N / rows slots (its pending token and N / rows - 1 draft tokens).
2. Fits `t = c_base + c_tok * N + c_kv * K` per model (K = rows x attended positions; the
   non-negative least squares of `das_jax.speculation.CostModel.fit`), prints measured against
   fitted times, and saves each model as a cost-model file (`DIR/cost-<model>-<device>.json`,
   the format `--cost-model PATH.json` reads, with the measurements as provenance).
3. Replays the first `--paper-epochs` (2) epochs of a recorded trace at paper scale
   (`bench.rollout_bench.run_paper`: 16 problems x 8 samples stretched to a long tail of up to
   16K tokens, 128 slots, widths 1/4/8/16) under the measured 7B model and
   the datasheet models `h100-7b` / `h200-7b`, and prints the table (das vs none, vs the best
   baseline, and the regime of each model).

The trace defaults to the long-tailed one shipped with the repository
(`docs/traces/gsm8k-longtail-smollm2-135m.jsonl.gz`, recorded by `das-jax bench rollout
--preset longtail` with SmolLM2-135M on GSM8K: rollouts of up to 1,024 tokens). `--smoke` runs every part on a tiny model
with small shapes (the unit test runs it on the CPU). Prints a JSON line with everything
(also written to `DIR/gpu_check.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from das_jax.bench import paper_replay as pr
from das_jax.bench.rollout_bench import PaperSpec, run_paper
from das_jax.models.config import ModelConfig
from das_jax.speculation import CostModel, save_cost_model
from das_jax.testing import tiny_model_config

_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TRACE = _ROOT / "docs" / "traces" / "gsm8k-longtail-smollm2-135m.jsonl.gz"

# Published configs (config.json of Qwen/Qwen2-1.5B and Qwen/Qwen2-7B on the Hugging Face hub).
MODELS = {
    "qwen2-1.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=1536,
                       intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                       head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attention_bias=True),
    "qwen2-7b": dict(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                     head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, attention_bias=True),
}
TOKENS = (16, 64, 256, 1024, 4096)
KV_LENS = (1024, 8192)


def step_layout(num_tokens: int, kv_len: int, bytes_per_position: int, kv_budget_bytes: float,
                max_rows: int) -> tuple[int, int]:
    """(rows B, slots per row W) of a timed step with B * W = num_tokens: B the largest power of
    two dividing num_tokens with B <= max_rows whose cache (B x (kv_len + W) positions) fits
    kv_budget_bytes.

    Raises:
      ValueError: not even one row fits the budget.
    """
    rows = 1
    while (num_tokens % (rows * 2) == 0 and rows * 2 <= max_rows
           and rows * 2 * (kv_len + num_tokens // (rows * 2)) * bytes_per_position
           <= kv_budget_bytes):
        rows *= 2
    width = num_tokens // rows
    if (kv_len + width) * bytes_per_position > kv_budget_bytes:
        raise ValueError(f"--kv-memory-gb {kv_budget_bytes / 1e9:g} holds no row of "
                         f"{kv_len + width} positions; raise it")
    return rows, width


def time_packed_step(engine, rows: int, width: int, kv_len: int, repeats: int
                     ) -> tuple[float, float]:
    """(median seconds of `repeats` timed calls, wall seconds of the whole measurement incl. the
    compile) of the engine's packed verify step (`Engine.time_verify_step`, the call the
    cost-model calibration times) on `rows` cache rows, each attending `kv_len` cached
    positions and verifying `width` slots (its pending token and `width - 1` drafts)."""
    t0 = time.perf_counter()
    sec = engine.time_verify_step(rows, width, kv_len, kv_len + width, repeats=repeats,
                                  sampling_key=(0.6, 0, 1.0))
    return sec, time.perf_counter() - t0


def measure_model(name: str, config, tokens, kv_lens, dtype, kv_budget_bytes: float,
                  max_rows: int, repeats: int, log=print) -> dict:
    """Times every (N, kv) shape of one model and fits its cost model; returns
    {"model", "shapes": [{tokens, kv_len, rows, width, attended_kv, seconds, wall_s}],
     "coef": {c_base, c_tok, c_kv}, "fit_error": max relative error of the fit}."""
    # deferred import: jax (not loaded by importing this module)
    import jax

    from das_jax.engine import Engine, EngineConfig
    from das_jax.models.kv_cache import KVCache
    from das_jax.models.transformer import init_params

    t0 = time.perf_counter()
    params = jax.jit(lambda k: init_params(config, k, dtype))(jax.random.PRNGKey(0))
    jax.block_until_ready(params)
    log(f"{name}: {config.num_params() / 1e9:.2f}B random {jax.numpy.dtype(dtype).name} params in "
        f"{time.perf_counter() - t0:.1f}s")
    bpp = KVCache.bytes_per_position(config, dtype)
    ec = EngineConfig(max_slots=max_rows, max_cache_len=max(kv_lens) + max(tokens),
                      draft_widths=(1,), kv_memory_gb=kv_budget_bytes / 1e9)
    engine = Engine(config, params, eos_token_ids=[0], engine_config=ec)
    shapes = []
    for kv in kv_lens:
        for n in tokens:
            rows, width = step_layout(n, kv, bpp, kv_budget_bytes, max_rows)
            sec, wall = time_packed_step(engine, rows, width, kv, repeats)
            shapes.append({"tokens": n, "kv_len": kv, "rows": rows, "width": width,
                           "attended_kv": rows * kv, "seconds": sec, "wall_s": wall})
            log(f"  N={n:5d} kv={kv:5d}: {rows:4d} rows x {width:3d} slots  {sec * 1e3:9.2f} ms"
                f"  ({wall:.1f}s with the compile)")
    del params, engine
    return fit_shapes(name, shapes, log)


def fit_shapes(name: str, shapes: list[dict], log=print) -> dict:
    """Fits `t = c_base + c_tok * N + c_kv * K` (non-negative least squares) to timed shapes
    ({tokens N, attended_kv K, seconds}; each gets its fitted_seconds); returns {"model",
    "shapes", "coef": {c_base, c_tok, c_kv}, "fit_error": max relative error of the fit}."""
    cm = CostModel(history=10_000)
    for s in shapes:
        cm.observe_step(s["tokens"], s["attended_kv"], s["seconds"], refit=False)
    cm.fit()
    coef = {"c_base": cm.c_base, "c_tok": cm.c_tok, "c_kv": cm.c_kv}
    err = 0.0
    for s in shapes:
        s["fitted_seconds"] = cm.predict_step(s["tokens"], s["attended_kv"])
        err = max(err, abs(s["fitted_seconds"] / s["seconds"] - 1))
    log(f"  fit: c_base {coef['c_base'] * 1e3:.3f} ms + c_tok {coef['c_tok'] * 1e6:.2f} us*N + "
        f"c_kv {coef['c_kv'] * 1e9:.3f} ns*K (max error {err:.0%})")
    return {"model": name, "shapes": shapes, "coef": coef, "fit_error": err}


def shapes_from_lease_json(path) -> tuple[str, list[dict]]:
    """(device kind, timed shapes) of the verify programs in a lease check's JSON
    (`das_jax.bench.gpu_lease_check`): {tokens N, kv_len A, rows B, width W, attended_kv B * A,
    seconds: the median step}.

    Raises:
      ValueError: the file has no verify timings (the part failed or was not run)."""
    res = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    rows = res.get("parts", {}).get("verify", {}).get("programs")
    if not rows:
        raise ValueError(f"{path}: no verify timings (parts.verify.programs); the lease check's "
                         "verify part failed or was not run")
    shapes = [{"tokens": r["N"], "kv_len": r["A"], "rows": r["B"], "width": r["W"],
               "attended_kv": r["B"] * r["A"], "seconds": r["median_s"]} for r in rows]
    return res.get("parts", {}).get("env", {}).get("device_kind", "unknown"), shapes


def _save(out: pathlib.Path, r: dict, device: str, jax_version: str, weights: str,
          source: str) -> str:
    """Saves model `r`'s coefficients as `DIR/cost-<model>-<device>.json`; returns the path."""
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    path = out / f"cost-{r['model']}-{slug}.json"
    save_cost_model(path, r["coef"], device=device, model=f"{r['model']} shapes, {weights}",
                    source=source, jax=jax_version, shapes=r["shapes"])
    r["file"] = str(path)
    print(f"  saved {path}")
    return str(path)


def _measure_all(args, names, tokens, kv_lens, out: pathlib.Path) -> tuple[dict, dict]:
    """Times and fits every model on this machine's first device: (result, {model: file})."""
    # deferred import: jax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    device = getattr(dev, "device_kind", str(dev))
    res = {"device": device, "backend": jax.default_backend(), "jax": jax.__version__,
           "models": {}}
    print(f"device: {device} ({jax.default_backend()}), jax {jax.__version__}")
    dtype = jnp.dtype(args.dtype)
    if args.smoke:
        configs = {"tiny": tiny_model_config()}
        dtype = jnp.dtype("float32")
    else:
        configs = {m: ModelConfig(**MODELS[m]) for m in names}
    files = {}
    for name, mc in configs.items():
        r = measure_model(name, mc, tokens, kv_lens, dtype, args.kv_memory_gb * 1e9,
                          args.max_rows, args.repeats)
        files[name] = _save(out, r, device, jax.__version__, f"random {dtype.name} weights",
                            "das_jax.bench.gpu_check: the packed verify step timed per shape, "
                            "non-negative least squares")
        res["models"][name] = r
    return res, files


def _from_lease(path, out: pathlib.Path) -> tuple[dict, dict]:
    """Fits the cost model to the verify timings of a lease check's JSON (on any machine):
    (result, {model: file})."""
    lease = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    device, shapes = shapes_from_lease_json(path)
    env = lease.get("parts", {}).get("env", {})
    name = "tiny" if lease.get("smoke") else lease.get("shapes", {}).get("model", "qwen2-7b")
    print(f"device: {device} (from {path}), jax {env.get('jax')}")
    r = fit_shapes(name, shapes)
    file = _save(out, r, device, str(env.get("jax")), f"random {lease['shapes']['dtype']} "
                 "weights", f"das_jax.bench.gpu_lease_check ({path}): the verify programs' "
                 "median steps, non-negative least squares")
    return {"device": device, "backend": f"from {path}", "jax": env.get("jax"),
            "models": {name: r}}, {name: file}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m das_jax.bench.gpu_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out/gpu_check", help="output directory")
    ap.add_argument("--trace", default=None,
                    help=f"trace for the paper-scale replay (default: {DEFAULT_TRACE.name})")
    ap.add_argument("--models", default="qwen2-1.5b,qwen2-7b",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--kv", default=",".join(map(str, KV_LENS)),
                    help="attended positions per row, comma-separated")
    ap.add_argument("--kv-memory-gb", type=float, default=40.0)
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--paper-epochs", type=int, default=2,
                    help="epochs of the trace the paper-scale replay uses (the first ones)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model and small shapes (CPU smoke test of every part)")
    ap.add_argument("--from-json", default=None, metavar="DIR/gpu_lease_check.json",
                    help="fit the cost model to a lease check's verify timings instead of "
                         "measuring (no device needed), then replay")
    args = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    try:
        tokens = [int(x) for x in args.tokens.split(",") if x]
        kv_lens = [int(x) for x in args.kv.split(",") if x]
    except ValueError:
        return fail(f"--tokens {args.tokens!r} / --kv {args.kv!r}: comma-separated integers")
    if not tokens or not kv_lens or min(tokens + kv_lens) < 1:
        return fail("--tokens and --kv need positive integers")
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown and not args.smoke:
        return fail(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    trace_path = pathlib.Path(args.trace) if args.trace else DEFAULT_TRACE
    if not trace_path.is_file():
        return fail(f"--trace {trace_path}: no such file; pass a trace written by `das-jax bench "
                    "rollout` (DIR/trace.jsonl)")

    # deferred import: jax, through the replay (not loaded by importing this module)
    from das_jax.bench import replay as rp

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        try:
            res, files = _from_lease(args.from_json, out)
        except (OSError, ValueError, KeyError) as e:
            return fail(f"--from-json: {e}")
    else:
        res, files = _measure_all(args, names, tokens, kv_lens, out)

    # Paper-scale replay under the measured model of the largest model, beside the datasheet
    # models of a 7B on H100 / H200.
    measured = list(files)[-1]
    trace = rp.read_trace(trace_path)
    epochs = max(args.paper_epochs, 1)
    spec = PaperSpec(cost_models=(files[measured], "h100-7b", "h200-7b"), epochs=epochs)
    if args.smoke:
        spec = PaperSpec(cost_models=(files[measured], "h100-7b"), epochs=epochs, problems=2,
                         samples=2, max_tokens=256, median=64.0, slots=4, widths=(1, 4))
    names_r = ["none", "ngram", "suffix-global", "das", "das-unlimited"]
    t0 = time.perf_counter()
    paper = run_paper(trace, names_r, spec.max_tokens, rp.das_from_header(trace.header), spec)
    res["paper"] = {"trace": str(trace_path), "seconds": time.perf_counter() - t0,
                    "settings": paper["settings"], "workload": paper["workload"],
                    "summary": {m: {"regime": r["regime"], "summary": r["summary"],
                                    "cost_model": r["cost_model"]}
                                for m, r in paper["models"].items()}}
    table = pr.markdown(paper["models"])
    print(table)
    res["paper_table"] = table
    with open(out / "gpu_check.json", "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in res.items() if k != "paper_table"}, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
