"""The GPU lease check: its `--smoke` run on the CPU (every part, one JSON), the estimate of its
full run against the lease budget, the HLO heuristic, and the CPU replay from its JSON."""
import json

import numpy as np
import pytest

from das_jax.bench import gpu_check, gpu_lease_check
from das_jax.bench.lease_plan import (BUDGET_S, FULL, estimate_seconds, expected_counts,
                                      weight_copy_heuristic)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("lease")
    rc = gpu_lease_check.main(["--smoke", "--out", str(out), "--parts", "all"])
    return rc, out, json.loads((out / "gpu_lease_check.json").read_text())


def test_smoke_runs_every_part(smoke):
    rc, out, res = smoke
    assert rc == 0
    assert set(res["parts"]) == set(gpu_lease_check.PARTS) == set(gpu_lease_check.PRESETS["all"])
    assert not {p: r["error"] for p, r in res["parts"].items() if "error" in r}
    assert all(res["seconds"][p] > 0 for p in gpu_lease_check.PARTS)
    env = res["parts"]["env"]
    assert env["jax"] and env["device_kind"] and env["backend"] == "cpu"
    assert env["cuda"] is None and env["cudnn"] is None   # no CUDA plugin here

    programs = res["parts"]["verify"]["programs"]
    assert [(r["B"], r["N"], r["W"], r["A"]) for r in programs] == [
        tuple(v) for v in res["shapes"]["verify"]]
    for r in programs:
        for k in ("temp_bytes", "alias_bytes", "argument_bytes", "output_bytes"):
            assert isinstance(r[k], int) and r[k] >= 0
        assert r["alias_bytes"] > 0                        # the cache is updated in place
        assert r["median_s"] > 0 and r["compile_s"] > 0 and r["ratio_to_floor"] > 0

    hlo = res["parts"]["hlo"]
    assert (out / "verify0.hlo.txt").read_text().startswith("HloModule")
    assert hlo["weight_copies"]["stack_dynamic_slices"] > 0     # the layer scan's reads
    ab = hlo["ab"]
    assert ab["rc"] == 0 and ab["with_flag_median_s"] > 0 and ab["speedup"] > 0
    assert ab["flag"] == "--xla_gpu_enable_dynamic_slice_fusion=true"

    share = res["parts"]["share"]
    for name in ("share_prompt_rows", "gather_rows"):
        assert isinstance(share[name]["temp_bytes"], int) and share[name]["temp_bytes"] >= 0

    train = res["parts"]["train"]
    assert train["step_s"] > 0 and train["cudnn_attention"] is False    # XLA attention on CPU
    assert train["planned_train_bytes"] > 0
    assert train["train_peak_bytes"] is None           # the CPU has no allocator statistics

    gen = res["parts"]["generate"]
    for name in ("none", "das"):
        assert gen[name]["forward_passes"] >= gen["new_tokens"] - 1
        assert gen[name]["generated_tokens"] == gen["requests"] * gen["new_tokens"]
        assert gen[name]["host_s_per_step"] > 0 and gen[name]["decode_s_per_step"] > 0


def test_smoke_counts_give_a_full_run_within_the_budget(smoke):
    _, _, res = smoke
    counts = res["counts"]
    assert counts["verify"]["compiles"]["engine"] == len(FULL.verify)
    assert counts["verify"]["verify_steps"] == [FULL.repeats + 1] * len(FULL.verify)
    assert counts["hlo"]["subprocesses"] == 1 and counts["share"]["compiles"]["copy"] == 2
    assert counts["generate"]["host_steps"] > 0
    est = res["estimate"]
    assert set(est["counts_from"].values()) == {"measured"}
    assert est["seconds"] == pytest.approx(estimate_seconds(counts)["seconds"])
    # the parts of the second lease: the layer loop's arms, the host loop's runs, the kernel
    layers = {r["loop"] for r in res["parts"]["layers"]["programs"]}
    assert layers == {"scan", "unroll", "unstacked"}
    assert all(r["median_s"] > 0 and r["speedup_vs_scan"] > 0
               for r in res["parts"]["layers"]["programs"])
    host = res["parts"]["host"]
    for rows in map(str, res["shapes"]["host_rows"]):
        runs = host[rows]
        assert runs["none_k_identical_to_1step"] == 1.0      # float32: k steps == 1 step
        for name in ("none", "none-1step", "das-epoch0", "das-epoch1"):
            assert runs[name]["forward_passes"] > 0 and runs[name]["host_ms_per_step"] > 0
        assert runs["das-epoch1"]["exposed_host_ms_per_step"] >= 0
    for row in res["parts"]["paged"]["kernel"]:   # interpret mode == the gather to 1e-5
        assert row["float32"]["max_err_output"] < 1e-5 and row["float32"]["empty_rows_zero"]
    prof = res["parts"]["profile"]["programs"]
    assert len(prof) == len(res["shapes"]["profile_programs"]) + 1 and all(prof.values())
    for name in ("base", "loop"):   # each preset fits one lease
        preset = {p: c for p, c in counts.items() if p in gpu_lease_check.PRESETS[name]}
        est = estimate_seconds(preset)
        assert est["fits"] and est["seconds"] <= BUDGET_S == 480


@pytest.mark.parametrize("preset", ["base", "loop"])
def test_expected_counts_fit_the_budget(preset):
    parts = gpu_lease_check.PRESETS[preset]
    est = estimate_seconds({p: c for p, c in expected_counts(FULL).items() if p in parts})
    assert 0 < est["seconds"] <= BUDGET_S and est["fits"]
    assert set(est["per_part"]) == {"startup", *parts} - {"env"}
    assert set(expected_counts(FULL)) == set(gpu_lease_check.PARTS) - {"env"}
    # every figure counts: a slower compile makes the estimate longer
    slow = {**est["figures"], "compile_s": {**est["figures"]["compile_s"], "engine": 60.0}}
    assert estimate_seconds(expected_counts(FULL), figures=slow)["seconds"] > est["seconds"]


class _Leaf:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)


def test_weight_copy_heuristic():
    params = {"layers": {"w_up": _Leaf((2, 32, 64), "float32")}}
    hlo = """HloModule m

%fused_slice (p0: f32[2,32,64], p1: s32[]) -> f32[32,64] {
  %p0 = f32[2,32,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,32,64]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,32,64}
  ROOT %b = f32[32,64]{1,0} bitcast(%ds)
}

%fused_dot (q0: f32[2,32,64], q1: s32[], q2: f32[4,32]) -> f32[4,64] {
  %q0 = f32[2,32,64]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = f32[4,32]{1,0} parameter(2)
  %d = s32[] constant(0)
  %ds2 = f32[1,32,64]{2,1,0} dynamic-slice(f32[2,32,64]{2,1,0} %q0, s32[] %q1, %d, %d)
  %b2 = f32[32,64]{1,0} bitcast(%ds2)
  ROOT %dot = f32[4,64]{1,0} dot(%q2, %b2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: f32[2,32,64], i: s32[], x: f32[4,32]) -> f32[4,64] {
  %w = f32[2,32,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[4,32]{1,0} parameter(2)
  %f = f32[32,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  ROOT %g = f32[4,64]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%fused_dot
}
"""
    h = weight_copy_heuristic(hlo, params)
    # both slices read the stack; only the slice-only fusion materialises the layer's weight
    assert h["stack_dynamic_slices"] == 2 and h["materialised_slices"] == 1
    assert h["materialised_bytes_per_layer"] == 32 * 64 * 4
    assert h["per_step_copy_bytes"] == 2 * 32 * 64 * 4
    assert h["likely_per_layer_weight_copies"] and h["heuristic"].startswith("regex")


def test_bad_parts(tmp_path, capsys):
    assert gpu_lease_check.main(["--out", str(tmp_path), "--parts", "verify,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_cost_model_and_replay_from_the_lease_json(tmp_path):
    rows = [{"B": b, "N": n, "W": w, "A": a,
             "median_s": 4e-3 + 25e-6 * n + 13e-9 * b * a} for b, n, w, a in FULL.verify]
    lease = {"smoke": False, "shapes": {"model": "qwen2-7b", "dtype": "bfloat16"},
             "parts": {"env": {"device_kind": "NVIDIA H200", "jax": "0.11.0"},
                       "verify": {"programs": rows}}}
    path = tmp_path / "gpu_lease_check.json"
    path.write_text(json.dumps(lease))
    out = tmp_path / "out"
    assert gpu_check.main(["--from-json", str(path), "--smoke", "--out", str(out)]) == 0
    res = json.loads((out / "gpu_check.json").read_text())
    r = res["models"]["qwen2-7b"]
    assert res["device"] == "NVIDIA H200" and r["fit_error"] < 1e-3
    assert r["coef"]["c_tok"] == pytest.approx(25e-6, rel=1e-3)
    assert r["file"].endswith("cost-qwen2-7b-nvidia-h200.json")
    assert set(res["paper"]["summary"]) == {r["file"], "h100-7b"}
    path.write_text(json.dumps({"parts": {"verify": {"error": "boom"}}}))
    assert gpu_check.main(["--from-json", str(path), "--smoke", "--out", str(out)]) == 2
