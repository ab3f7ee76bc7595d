"""The `bench rollout` pipeline end to end on a tiny random model: table, JSON, trace, PNGs,
identity 100%, replay predictions attached; plus CLI registration."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from das_jax.bench import replay as rp
from das_jax.bench.rollout_bench import BenchSetup, head_variant, run_bench
from das_jax.config import DASSection, load_config
from das_jax.engine import Engine, EngineConfig
from das_jax.rollout import Rollout
from das_jax.testing import tiny_model_config, tiny_params

CFG = tiny_model_config()
EOS = 1


def test_bench_rollout_core(tmp_path):
    params = tiny_params(CFG)
    rollout = Rollout(Engine(CFG, params, eos_token_ids=[EOS],
                             engine_config=EngineConfig(max_slots=4, max_cache_len=256,
                                                        draft_widths=(1, 4, 8))))
    rng = np.random.default_rng(1)
    prompts = [(f"p{i}", tuple(int(t) for t in rng.integers(2, 64, size=10))) for i in range(3)]
    setup = BenchSetup(rollout=rollout, prompts=prompts, drafters=["ngram", "suffix-global", "das"],
                       epochs=2, temperatures=[0.0, 1.0], num_generations=2, max_new_tokens=24,
                       das=DASSection(window=4, max_depth=16, min_token_prob=0.1),
                       model_name="tiny", calibrate=False)
    logs = []
    res = run_bench(setup, str(tmp_path), log=logs.append)
    runs = res["runs"]
    for r in runs:   # every drafter's lengths per epoch against the 24-token cap
        lengths = r["lengths"]
        assert 0 < lengths["median"] <= lengths["p90"] <= lengths["max"] <= 24
        assert 0 <= lengths["at_cap_share"] <= 1
    assert sum("lengths: median" in line for line in logs) == 2 * 2   # `none`, per epoch
    assert len(runs) == 2 * 2 * 4          # temperatures x epochs x drafters (none added)
    for r in runs:
        assert r["identity_rate"] == 1.0, r["identity_diffs"]
        assert r["replay"]["predicted_s"] > 0
        if r["drafter"] in ("none", "ngram", "suffix-global"):
            # Deterministic drafter + fixed policy: the replay reproduces the forward passes.
            assert r["replay_passes_match"], r
    for name in ("rollout.json", "trace.jsonl", "rollout_time.png", "batch_width.png",
                 "rollout.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "rollout.json") as f:
        data = json.load(f)
    assert data["drafters"][0] == "none" and "| T | epoch | drafter |" in data["table"]
    trace = rp.read_trace(tmp_path / "trace.jsonl")
    assert len(trace.rollouts) == 2 * 2 * 3 * 2
    assert set(trace.header["cost_model"]) >= {"c_base", "c_tok", "c_kv"}
    assert rp.das_from_header(trace.header) == setup.das
    assert set(trace.groups()) == {0.0, 1.0}
    assert (tmp_path / "rollout_time.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_cli_registration_imports_no_jax():
    code = ("import sys; import das_jax.cli.bench as c, argparse; p = argparse.ArgumentParser(); "
            "c.register(p.add_subparsers()); "
            "a = p.parse_args(['bench', 'rollout', '--epochs', '2']); "
            "assert a.epochs == 2 and callable(a.func); "
            "a = p.parse_args(['bench', 'replay', 't.jsonl', '--scale', 'paper']); "
            "assert a.scale == 'paper'; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "False"


def test_bench_rollout_report_with_reference_and_paper_replay(tmp_path):
    """The README benchmark's additions: the reference runs once after epoch 0 (same requests),
    per-epoch ratios, identity / divergence counts, the paper-scale replay per cost model, the
    report and the speed-up plot."""
    from das_jax.bench.rollout_bench import PaperSpec

    params = tiny_params(CFG)
    rollout = Rollout(Engine(CFG, params, eos_token_ids=[EOS],
                             engine_config=EngineConfig(max_slots=4, max_cache_len=256,
                                                        draft_widths=(1, 4, 8))))
    rng = np.random.default_rng(2)
    prompts = [(f"p{i}", tuple(int(t) for t in rng.integers(2, 64, size=8))) for i in range(2)]
    calls = []

    def reference(requests, sampling, batch):
        calls.append((len(requests), sampling.seed, batch))
        return {"batch": batch, "tokens": 100, "wall_s": 2.0, "tok_s": 50.0}

    setup = BenchSetup(rollout=rollout, prompts=prompts, drafters=["ngram", "das"], epochs=2,
                       temperatures=[0.6], num_generations=2, max_new_tokens=16,
                       das=DASSection(window=4, max_depth=16, min_token_prob=0.1),
                       model_name="tiny", calibrate=False, reference_fn=reference,
                       paper=PaperSpec(cost_models=("cpu", "h100-7b"), problems=2, samples=2,
                                       max_tokens=128, median=40.0, slots=4))
    logs = []
    res = run_bench(setup, str(tmp_path), log=logs.append)
    assert calls == [(4, 0, 4)]
    hf = res["hf_reference"]
    none0 = [r for r in res["runs"] if r["drafter"] == "none" and r["epoch"] == 0][0]
    assert hf["none_tok_s"] == pytest.approx(none0["generated_tokens"] / none0["wall_s"])
    assert any(line.startswith("T=0.6 epoch 1 vs none: ngram") for line in logs)
    summ = res["summary"]["0.6"]
    assert set(summ["identity"]) == {"ngram", "das"}
    for s in summ["identity"].values():
        assert s["identical_share"] == 1.0 and s["divergences_per_1k"] == 0.0
    assert len(summ["speedups"]["per_epoch"]["das"]) == 2
    models = res["paper"]["models"]
    assert set(models) == {"cpu", "h100-7b"}
    for m in models.values():
        assert set(m["drafters"]) == {"none", "ngram", "das"}
        assert len(m["drafters"]["das"]) == 2 and m["regime"]
    assert "### Targets" in res["report"] and "**h100-7b**" in res["report"]
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    with open(tmp_path / "rollout.json") as f:
        assert "paper" in json.load(f)


def test_count_until_stop():
    from das_jax.bench.hf_reference import count_until_stop
    assert count_until_stop([[5, 1, 7], [5, 6], [2]], [1, 2]) == [2, 2, 1]


def test_bench_rollout_preset_and_bad_paper_model():
    import argparse

    from das_jax.cli import bench as cli
    from das_jax.bench.rollout_bench import apply_preset
    p = argparse.ArgumentParser()
    cli.register(p.add_subparsers())
    a = apply_preset(p.parse_args(["bench", "rollout", "--preset", "readme",
                                   "--no-hf-reference"]))
    assert a.config.endswith("bench-readme.yaml") and a.hf_reference is False
    assert a.paper_replay == "cpu,h100-7b,h200-7b" and a.epochs == 4
    a = apply_preset(p.parse_args(["bench", "rollout", "--preset", "longtail"]))
    assert a.config.endswith("bench-longtail.yaml") and a.epochs == 3 and a.hf_reference
    assert a.paper_replay == "cpu,h100-7b,h200-7b" and a.hf_batches == 1
    a = apply_preset(p.parse_args(["bench", "rollout", "--preset", "longtail", "--epochs", "5"]))
    assert a.epochs == 5                                   # an explicit flag wins
    assert apply_preset(p.parse_args(["bench", "rollout"])).epochs == 4
    cfg = load_config(a.config)                             # the preset's config is valid
    assert cfg.rollout.max_new_tokens == 1024 and cfg.data.limit == 8
    assert cfg.rollout.max_cache_len > cfg.rollout.max_new_tokens
    out = subprocess.run([sys.executable, "-m", "das_jax.cli", "bench", "rollout",
                          "--load-cores", "-1"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "--load-cores must be >= 0" in out.stderr
    out = subprocess.run([sys.executable, "-m", "das_jax.cli", "bench", "rollout",
                          "--drafters", "none,ngram+head+tree"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "ngram+head+tree" in out.stderr and "das+head+tree" in \
        out.stderr and "Traceback" not in out.stderr


def test_co_tenant_spins_cores_for_the_block_and_stops():
    import time

    from das_jax.bench.co_tenant import CoTenant
    with CoTenant(1) as ct:
        assert len(ct.pids) == 1
        proc = ct._procs[0]
        time.sleep(0.5)
        assert proc.is_alive()
    assert not proc.is_alive() and ct.pids == []           # stopped and joined at the end
    assert ct.describe()["load_cores"] == 1
    with CoTenant(0) as ct:                                 # no co-tenant: nothing started
        assert ct.pids == []
    with pytest.raises(ValueError, match="--load-cores must be >= 0"):
        CoTenant(-1)
    out = subprocess.run([sys.executable, "-m", "das_jax.cli", "bench", "rollout",
                          "--paper-replay", "cpu,nope"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "nope" in out.stderr and "Traceback" not in out.stderr


def test_bench_rollout_with_a_draft_head(tmp_path):
    """`das+head` runs beside the others: measured, token-identical, drafting from the head,
    without replay columns (a trace holds no policy features)."""
    import jax

    from das_jax.draft_head.head import HeadConfig, init_head
    from das_jax.draft_head.store import DraftHead
    cfg = tiny_model_config(num_layers=4)
    params = tiny_params(cfg)
    hc = HeadConfig.for_policy(cfg, 32)
    head = DraftHead(hc, {k: np.asarray(v) for k, v in
                          init_head(hc, jax.random.PRNGKey(0), scale=0.3).items()},
                     np.arange(2, 34, dtype=np.int32), {})
    rollout = Rollout(Engine(cfg, params, eos_token_ids=[EOS],
                             engine_config=EngineConfig(max_slots=4, max_cache_len=128,
                                                        draft_widths=(1, 4))))
    rng = np.random.default_rng(3)
    prompts = [(f"p{i}", tuple(int(t) for t in rng.integers(2, 64, size=8))) for i in range(2)]
    setup = BenchSetup(rollout=rollout, prompts=prompts,
                       drafters=["das", "das+head", "das+head+tree"],
                       epochs=2, temperatures=[1.0], num_generations=2, max_new_tokens=16,
                       das=DASSection(window=4, max_depth=16, min_token_prob=0.1),
                       model_name="tiny", calibrate=False, head=(head, 3, 50.0))
    res = run_bench(setup, str(tmp_path), log=lambda s: None)
    for name in ("das+head", "das+head+tree"):
        rows = [r for r in res["runs"] if r["drafter"] == name]
        assert len(rows) == 2 and all(r["identity_rate"] == 1.0 for r in rows)
        assert all("replay" not in r and r["speedup"] > 0 for r in rows)
        assert sum(r["drafted_by_source"].get("head", 0) for r in rows) > 0
        assert f"| 1.0 | {name} |" in res["table"]
    # the tree variant is das+head with das.policy.tree on; plain das+head never verifies two
    assert all(r["tree_steps"] == 0 for r in res["runs"] if r["drafter"] != "das+head+tree")
    assert head_variant("das+head+tree") == ("das", True, True)
    assert head_variant("das+head") == ("das", True, False) and head_variant("ngram")[1:] == (
        False, False)
