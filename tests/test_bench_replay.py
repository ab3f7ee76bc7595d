"""Trace replay: the simulator reproduces the real engine's scheduling exactly (forward passes,
accepted tokens, per-step batch/width/kv_len) for deterministic drafters and policies."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.bench import replay as rp
from das_jax.config import DASSection
from das_jax.speculation.das_policy import DASConfig
from das_jax.engine.generate import Engine, EngineConfig
from das_jax.engine.sampling import SamplingParams
from das_jax.rollout import build_speculation
from das_jax.testing import random_requests, tiny_model_config, tiny_params

CFG = tiny_model_config()
EOS = 1
COEF = {"c_base": 0.01, "c_tok": 0.002, "c_kv": 1e-5}


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def _run_real_and_replay(params, name, temperature, epochs=2, max_slots=4, das_config=None,
                         **engine):
    ec = EngineConfig(max_slots=max_slots, max_cache_len=256, draft_widths=(1, 4, 8), **engine)
    eng = Engine(CFG, params, eos_token_ids=[EOS], engine_config=ec)
    reqs = random_requests()
    das = DASSection(policy=das_config or DASConfig())
    drafter, policy = build_speculation(name, das, rp.FrozenCostModel.of(COEF))
    real, rollouts = [], {}
    for e in range(epochs):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=40, seed=e)
        outs, st = eng.generate(reqs, sampling, drafter=drafter, policy=policy)
        if drafter is not None:
            drafter.advance_epoch()
        real.append(st)
        rollouts[e] = [rp.TraceRollout(e, o.request.problem_id, o.request.sample_index,
                                       o.request.prompt_ids, tuple(o.token_ids), o.finish_reason,
                                       temperature) for o in outs]
    s_drafter, s_policy = build_speculation(name, das, rp.FrozenCostModel.of(COEF))
    sims = []
    for e in range(epochs):
        sim = rp.simulate(rollouts[e], ec, 40, rp.FrozenCostModel.of(COEF), s_drafter, s_policy)
        if s_drafter is not None:
            s_drafter.advance_epoch()
        sims.append(sim)
    return real, sims, rollouts


def _assert_same(real, sims):
    for st, sim in zip(real, sims):
        assert sim.forward_passes == st.forward_passes
        assert sim.generated_tokens == st.generated_tokens
        assert sim.drafted_tokens == st.drafted_tokens
        assert sim.accepted_draft_tokens == st.accepted_draft_tokens
        assert ([(s.batch, s.active, s.width, s.kv_len, s.emitted) for s in sim.steps]
                == [(s.batch, s.active, s.width, s.kv_len, s.emitted) for s in st.steps])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1.0"])
def test_replay_matches_engine_suffix(params, temperature):
    real, sims, _ = _run_real_and_replay(params, "suffix", temperature)
    _assert_same(real, sims)
    # The second epoch drafts from the first one's history.
    assert real[1].accepted_draft_tokens > 0 or temperature > 0


def test_replay_matches_engine_none(params):
    real, sims, _ = _run_real_and_replay(params, "none", 1.0, epochs=1)
    _assert_same(real, sims)
    assert sims[0].drafted_tokens == 0


def test_replay_matches_engine_das_frozen_cost_model(params):
    # Fixed class thresholds so the policy speculates from the first epoch; frozen cost model in
    # both, so the policy decisions are deterministic.
    cfg = DASConfig(short_threshold=5, long_threshold=20)
    real, sims, _ = _run_real_and_replay(params, "das", 0.0, das_config=cfg)
    _assert_same(real, sims)


@pytest.mark.parametrize("name", ["none", "das"])
def test_replay_prices_a_paged_cache_by_the_pages_rows_read(params, name):
    """A paged cache is priced as the GPU/TPU kernel reads it: each step's KV term is the pages
    its live rows hold (a multiple of the page, at most the bucket's B x kv_len), so the same
    rollouts take less predicted decode time than on the dense cache; the engine on this CPU
    (which gathers the bucket) records none."""
    from das_jax.engine import pages_read_kv
    real, _, rollouts = _run_real_and_replay(params, "none", 1.0, epochs=1)
    cfg = DASConfig(short_threshold=5, long_threshold=20)
    das = DASSection(policy=cfg)
    sims = {}
    for kind in ("dense", "paged"):
        ec = EngineConfig(max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8),
                          kv_cache=kind, page_size=8)
        drafter, policy = build_speculation(name, das, rp.FrozenCostModel.of(COEF))
        sims[kind] = rp.simulate(rollouts[0], ec, 40, rp.FrozenCostModel.of(COEF), drafter,
                                 policy)
    dense, paged = sims["dense"], sims["paged"]
    assert paged.generated_tokens == dense.generated_tokens
    assert all(s.read_kv is None for s in dense.steps)
    assert all(s.read_kv % 8 == 0 and 0 < s.read_kv <= s.attended_kv for s in paged.steps)
    assert any(s.read_kv < s.attended_kv for s in paged.steps)
    assert paged.decode_s < dense.decode_s
    assert pages_read_kv([3, 8, 9], 8) == 8 * 4
    eng = Engine(CFG, params, eos_token_ids=[EOS], engine_config=EngineConfig(
        max_slots=4, max_cache_len=256, kv_cache="paged", page_size=8))
    _, st = eng.generate(random_requests(problems=1, samples=2),
                         SamplingParams(temperature=1.0, max_new_tokens=8))
    assert all(s.read_kv is None for s in st.steps)    # the CPU gathers: the bucket is read


@pytest.mark.parametrize("name", ["none", "suffix"])
def test_replay_of_a_paged_pool_matches_the_engine(params, name):
    """A pool too small for every row (`kv_pages`): the replay admits by free pages, shares
    prompt pages and preempts as the engine's `PagedExecutor` does (the same bookkeeping),
    so steps, preemptions and prefill tokens match."""
    real, sims, _ = _run_real_and_replay(params, name, 1.0, epochs=2, max_slots=8,
                                         kv_cache="paged", page_size=4, kv_pages=24)
    _assert_same(real, sims)
    for st, sim in zip(real, sims):
        assert sim.preemptions == st.preemptions
        assert sim.prefill_tokens == st.prefill_tokens
    assert sum(st.preemptions for st in real) > 0


def test_trace_roundtrip_and_replay_epochs(params, tmp_path):
    _, _, rollouts = _run_real_and_replay(params, "none", 0.0, epochs=2)
    header = {"model": "tiny", "cost_model": COEF, "max_new_tokens": 40,
              "engine": {"max_slots": 4, "max_cache_len": 256, "draft_widths": [1, 4, 8]},
              "drafter_kwargs": {"window": 4, "max_depth": 16, "min_token_prob": 0.1}}
    path = tmp_path / "trace.jsonl"
    rp.write_trace(path, header, [r for e in rollouts for r in rollouts[e]])
    trace = rp.read_trace(path)
    assert trace.header["cost_model"] == COEF
    groups = trace.groups()
    assert list(groups) == [0.0] and list(groups[0.0]) == [0, 1]
    assert groups[0.0][1] == rollouts[1]
    ec = EngineConfig(max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8))
    # A trace of an older version holds "drafter_kwargs" instead of the "das" section.
    das = rp.das_from_header(trace.header)
    assert (das.window, das.max_depth, das.min_token_prob) == (4, 16, 0.1)
    assert rp.das_from_header({"das": {"window": 4, "max_depth": 16}}).max_depth == 16
    # `bench replay --set das.KEY=VALUE` overrides the recorded settings; only das.* ones
    over = rp.das_from_header(trace.header, ["das.policy.source_calibration=false",
                                             "das.window=8"])
    assert over.policy.source_calibration is False and over.window == 8
    from das_jax.config import ConfigError
    with pytest.raises(ConfigError, match="only das"):
        rp.das_from_header(trace.header, ["rollout.max_slots=4"])
    with pytest.raises(ConfigError, match="sourse_calibration"):
        rp.das_from_header(trace.header, ["das.policy.sourse_calibration=false"])
    pred = rp.replay_epochs(groups[0.0], ["none", "suffix", "das"], ec, 40, COEF, das)
    assert set(pred) == {"none", "suffix", "das"}
    for name, rows in pred.items():
        assert len(rows) == 2 and all(r["predicted_s"] > 0 for r in rows)
    # Greedy rollouts repeat every epoch: epoch 1 of the suffix drafter accepts a lot.
    assert pred["suffix"][1]["forward_passes"] < pred["none"][1]["forward_passes"]


def test_paper_workload_shapes(params):
    _, _, rollouts = _run_real_and_replay(params, "none", 1.0, epochs=2)
    trace = rp.Trace({"cost_model": COEF}, [r for e in rollouts for r in rollouts[e]])
    wl = rp.paper_workload(trace, problems=5, samples=4, max_tokens=300, median_len=100,
                           sigma=1.0, eos_id=EOS)
    assert list(wl) == [0, 1]
    for rs in wl.values():
        assert len(rs) == 20
        for r in rs:
            assert 1 <= len(r.token_ids) <= 300
            assert (r.finish_reason == "length") == (len(r.token_ids) == 300)
    ec = EngineConfig(max_slots=8, max_cache_len=1024, draft_widths=(1, 4, 8, 16))
    pred = rp.replay_epochs(wl, ["none", "das"], ec, 300, COEF, DASSection(window=4))
    assert pred["none"][0]["generated_tokens"] == sum(len(r.token_ids) for r in wl[0])



def test_paper_workload_draws_from_the_chosen_temperature():
    # A trace of two temperatures (disjoint tokens): the workload is built from the rollouts at
    # `temperature` (default: the lowest); a temperature the trace lacks is refused.
    rolls = [rp.TraceRollout(0, f"p{q}", s, (2, 3), tuple(range(base, base + 8)), "stop", t)
             for t, base in ((1.0, 20), (0.6, 10)) for q in range(2) for s in range(2)]
    trace = rp.Trace({"cost_model": COEF}, rolls)

    def tokens(**kw):
        wl = rp.paper_workload(trace, problems=2, samples=2, max_tokens=64, median_len=32, **kw)
        return {x for rs in wl.values() for r in rs for x in r.token_ids}

    assert tokens() == tokens(temperature=0.6) == set(range(10, 18))
    assert tokens(temperature=1.0) == set(range(20, 28))
    with pytest.raises(ValueError, match="no rollouts at temperature 0.7; it holds 0.6, 1"):
        tokens(temperature=0.7)

def test_gpu_cost_models_from_published_figures():
    from das_jax.speculation import gpu_cost as g
    # Qwen2-7B: 7.07 G streamed parameters (14.1 GB bf16), 57,344 B of K/V per position.
    assert g.QWEN2_7B.weight_bytes() == pytest.approx(14.14e9, rel=1e-3)
    assert g.QWEN2_7B.kv_bytes_per_position() == 57344
    h100, h200 = g.PRESETS["h100-7b"], g.PRESETS["h200-7b"]
    assert h100["c_base"] == pytest.approx(14.14e9 / (0.9 * 3.35e12) + 0.5e-3, rel=1e-3)
    assert h100["c_kv"] == pytest.approx(57344 / (0.9 * 3.35e12))
    assert h200["c_kv"] == pytest.approx(57344 / (0.9 * 4.8e12))
    # Same compute (same die): the token term barely differs; bandwidth terms scale 3.35 / 4.8.
    assert h200["c_tok"] == pytest.approx(h100["c_tok"], rel=0.05)
    assert h200["c_base"] < h100["c_base"]
    assert g.resolve_cost_model("cpu") == g.PRESETS["cpu"]


def test_cost_model_file_roundtrip_and_errors(tmp_path):
    from das_jax.speculation import (COST_MODEL_FORMAT, CostModel, CostModelConfig,
                                     load_cost_model, save_cost_model)
    from das_jax.speculation.gpu_cost import resolve_cost_model
    path = tmp_path / "gpu.json"
    save_cost_model(path, {"c_base": 0.004, "c_tok": 2e-5, "c_kv": 1e-8}, device="H200",
                    shapes=[[16, 1024]])
    assert load_cost_model(path) == {"c_base": 0.004, "c_tok": 2e-5, "c_kv": 1e-8}
    assert resolve_cost_model(str(path))["c_base"] == 0.004
    cm = CostModel.from_config(CostModelConfig(source=str(path), history=8))
    assert (cm.c_base, cm.c_tok, cm.c_kv, cm.history) == (0.004, 2e-5, 1e-8, 8)
    bad = {"notjson.json": "{", "format.json": '{"c_base": 1, "c_tok": 1, "c_kv": 1}',
           "neg.json": '{"format": "%s", "c_base": -1, "c_tok": 1, "c_kv": 1}' % COST_MODEL_FORMAT,
           "list.json": "[1, 2]"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"cost model file .*{name}") as e:
            load_cost_model(tmp_path / name)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cost model file .*missing.json: cannot read"):
        load_cost_model(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown cost model 'h300'.*h100-7b"):
        resolve_cost_model("h300")
    with pytest.raises(ValueError, match="unknown cost model"):
        CostModelConfig(source="h300")


def test_replay_cli_cost_model_flag(params, tmp_path, capsys):
    import argparse
    from das_jax.bench import arguments
    from das_jax.cli import bench_replay as replay_cli
    _, _, rollouts = _run_real_and_replay(params, "none", 0.0, epochs=1)
    header = {"model": "tiny", "cost_model": COEF, "max_new_tokens": 40,
              "engine": {"max_slots": 4, "max_cache_len": 256, "draft_widths": [1, 4, 8]}}
    trace = tmp_path / "trace.jsonl"
    rp.write_trace(trace, header, rollouts[0])
    p = argparse.ArgumentParser()
    arguments.add_replay_arguments(p)
    (tmp_path / "bad.json").write_text("{")
    assert replay_cli.main(p.parse_args([str(trace), "--cost-model", str(tmp_path / "bad.json")])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("das-jax bench replay: error: --cost-model ") and "\n" not in err
    assert "cost model file" in err
    out_json = tmp_path / "out.json"
    assert replay_cli.main(p.parse_args([str(trace), "--cost-model", "h200-7b", "--drafters",
                                         "none,das", "--json", str(out_json)])) == 0
    import json
    res = json.loads(out_json.read_text())["results"][0]
    assert res["cost_model"]["c_kv"] == pytest.approx(57344 / (0.9 * 4.8e12))
    # a paged pool with the memory of 2 dense rows of 256 positions, pages of 16
    assert replay_cli.main(p.parse_args([str(trace), "--drafters", "none", "--kv-cache",
                                         "paged", "--kv-rows", "2", "--json",
                                         str(out_json)])) == 0
    res = json.loads(out_json.read_text())["results"][0]
    assert (res["kv_cache"], res["page_size"], res["kv_pages"]) == ("paged", 16, 2 * 16)
    assert res["predicted"]["none"][0]["generated_tokens"] == sum(
        len(r.token_ids) for r in rollouts[0])
    # the memory bound of plain decoding on that pool: printed and stored, below none's time
    assert res["pool_positions"] == 2 * 16 * 16
    (bound,) = res["none_memory_bound"]
    assert 0 < bound["device_s"] <= res["predicted"]["none"][0]["device_s"]
    assert "memory bound for none (any schedule on a cache of 512 positions)" in capsys.readouterr().out
    assert res["predicted"]["none"][0]["token_slots"] >= res["predicted"]["none"][0][
        "live_token_slots"] == res["predicted"]["none"][0]["generated_tokens"] - len(rollouts[0])
    # the clairvoyant what-if: the same tokens, admitted longest first, the same bound
    assert replay_cli.main(p.parse_args([str(trace), "--drafters", "none", "--kv-cache",
                                         "paged", "--kv-rows", "2", "--admit-longest-first",
                                         "--json", str(out_json)])) == 0
    res2 = json.loads(out_json.read_text())["results"][0]
    assert res2["none_memory_bound"] == res["none_memory_bound"]
    assert (res2["predicted"]["none"][0]["generated_tokens"]
            == res["predicted"]["none"][0]["generated_tokens"])
    assert (res["overlap_host"], res["realtime"], res["draft_ahead"]) == (True, False, True)
    # the flags reach the simulated engine: appends completed before each draft, steps slept
    assert replay_cli.main(p.parse_args([str(trace), "--drafters", "suffix", "--no-overlap",
                                         "--realtime", "--no-draft-ahead",
                                         "--json", str(out_json)])) == 0
    res = json.loads(out_json.read_text())["results"][0]
    assert (res["overlap_host"], res["realtime"], res["draft_ahead"]) == (False, True, False)
    assert res["predicted"]["suffix"][0]["overlapped_host_s"] == 0.0


def test_das_budget_beats_unlimited_drafts_at_paper_scale_on_a_gpu_model():
    # Under a GPU cost model where verifying every draft is compute-bound (a 7B bf16
    # model on an H100, 128 long-tailed rollouts in one batch), the DAS budget lost to
    # das-unlimited (0.94-0.98x per epoch) because it discounted the tokens of rows not
    # predicted long. With the per-step cost shared among rows and each row's tokens valued at
    # their own expected cost, it is faster than every baseline in every epoch.
    from pathlib import Path

    from das_jax.bench import paper_replay as pr
    from das_jax.engine import cache_len_for
    from das_jax.speculation import resolve_cost_model

    trace = rp.read_trace(Path(__file__).parents[1] / "docs/traces/gsm8k-smollm2-135m.jsonl.gz")
    wl = rp.paper_workload(trace, problems=16, samples=8, max_tokens=8192, median_len=2000,
                           sigma=0.8, epochs=2)
    widths = (1, 4, 8, 16)
    ec = EngineConfig(max_slots=128, draft_widths=widths,
                      max_cache_len=cache_len_for(2048, widths, 512, 8192))
    models = {"h100-7b": resolve_cost_model("h100-7b")}
    r = pr.summarize(pr.replay_models(wl, ["none", "das", "das-unlimited"], ec, 8192, models,
                                      rp.das_from_header(trace.header)))["h100-7b"]
    assert r["compute_bound"]
    s = r["summary"]
    assert all(x >= 2.0 for x in s["per_epoch"]["das"]), s["per_epoch"]
    assert all(x >= 1.1 for x in s["subject_vs_best"]), s["subject_vs_best"]


def test_host_loop_bench_prints_host_time_per_row(capsys):
    import json
    from das_jax.bench import host_loop
    assert host_loop.main(["das", "8", "--problems", "2", "--max-tokens", "64",
                           "--median", "40"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["drafter"] == "das" and out["slots"] == 8
    assert out["host_us_per_row"] > out["draft_us_per_row"] > 0
    assert out["forward_passes"] > 0 and 0 < out["mean_live_rows"] <= 8
    # the trie's appends overlap the device steps: all host work = between + overlapped
    assert out["overlap"] and out["overlap_us_per_row"] > 0
    assert 0 < out["exposed_us_per_row"] < out["host_us_per_row"]


def test_replay_prices_or_lives_the_overlapped_host_work(params):
    """The suffix drafter's appends run while a step computes (`overlap_s`): the replay counts
    them exposed only past the step's predicted time, and with `realtime` sleeps each step on
    another thread and measures the overlapped work past the step's end (the wake-up after it
    apart); the decisions are the same, and the summary's host time holds both parts."""
    import time
    _, _, rollouts = _run_real_and_replay(params, "none", 1.0, epochs=2)
    fast = rp.FrozenCostModel.of({"c_base": 1e-3, "c_tok": 1e-4, "c_kv": 1e-7})
    ec = EngineConfig(max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8))
    runs = {}
    for realtime in (False, True):
        drafter, policy = build_speculation("suffix", DASSection(), fast)
        for e in (0, 1):
            t0 = time.perf_counter()
            st = rp.simulate(rollouts[e], ec, 40, fast, drafter, policy, realtime=realtime)
            runs[realtime] = (st, time.perf_counter() - t0)
            drafter.advance_epoch()
    (priced, _), (lived, wall) = runs[False], runs[True]
    assert (priced.forward_passes, priced.accepted_draft_tokens) == \
        (lived.forward_passes, lived.accepted_draft_tokens)
    assert priced.accepted_draft_tokens > 0 and priced.overlap_s > 0 and lived.overlap_s > 0
    assert 0.0 <= priced.exposed_overlap_s <= priced.overlap_s
    assert 0.0 <= lived.exposed_overlap_s <= lived.overlap_s
    assert lived.device_sync_s > 0.0                # the wake-ups after the steps' ends
    assert priced.device_sync_s == 0.0
    assert wall >= lived.decode_s                   # every step was slept
    s = priced.summary()
    assert s["host_s"] == pytest.approx(priced.host_s + priced.overlap_s)
    assert s["exposed_host_s"] == pytest.approx(priced.host_s + priced.exposed_overlap_s)
    assert s["total_s"] == pytest.approx(priced.device_s() + s["exposed_host_s"])


def test_simulated_device_exposes_only_host_work_past_the_steps_end():
    """`SimulatedDevice.run`: overlapped work that outlasts the step is exposed by what runs
    past the step's end; work done in time exposes nothing, and the step still takes its
    seconds (the wake-up after its end is reported apart)."""
    import time
    device = rp.SimulatedDevice()
    try:
        t0 = time.perf_counter()
        exposed, sync = device.run(0.01, lambda: time.sleep(0.04))
        assert exposed >= 0.03 - 1e-4 and sync >= 0.0
        exposed, sync = device.run(0.03, lambda: None)
        assert exposed == 0.0 and sync >= 0.0
        exposed, sync = device.run(0.02)
        assert exposed == 0.0
        # an overlap that did 5 ms of work in 40 ms of wall (preempted): at most its work
        exposed, sync = device.run(0.01, lambda: (time.sleep(0.04), 0.005)[1])
        assert exposed == 0.005
        assert time.perf_counter() - t0 >= 0.04 + 0.03 + 0.02 + 0.04
    finally:
        device.close()
    assert not device._thread.is_alive()


def test_drafter_batch_bench_runs_the_modes_side_by_side(capsys):
    """`bench drafter --batch`: every mode (per-row calls, batched on 1 and 2 threads) drafts
    and accepts the same tokens (the bench raises otherwise) and prints a line per rows x mode."""
    import argparse
    from das_jax.bench import drafter_batch_bench as bb
    ap = argparse.ArgumentParser()
    bb.add_batch_arguments(ap, standalone=True)
    args = ap.parse_args(["--problems", "3", "--rollouts", "3", "--length", "120", "--rows",
                          "4,70", "--threads", "1,2", "--steps", "3"])
    assert bb.batch_main(args) == 0
    lines = [x.split() for x in capsys.readouterr().out.splitlines() if x[:4].strip().isdigit()]
    assert [(x[0], x[1] + (x[2] if x[1] == "batch" else "")) for x in lines] == [
        (a, m) for a in ("4", "70") for m in ("per-row", "batcht=1", "batcht=2")]
    assert len({x[-1] for x in lines if x[0] == "70"}) == 1      # tokens per row per step
