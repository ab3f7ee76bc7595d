"""The GPU cost-model check script in its CPU smoke mode, its step layout, and gzip traces."""
import gzip
import json

import numpy as np
import pytest

from das_jax.bench import gpu_check
from das_jax.bench import replay as rp
from das_jax.speculation import load_cost_model

KB57 = 57_344   # Qwen2-7B bf16: K and V of one position, all 28 layers


def test_step_layout():
    # As many rows as N allows within the row cap and the cache budget; B * W = N.
    assert gpu_check.step_layout(16, 1024, KB57, 40e9, 256) == (16, 1)
    assert gpu_check.step_layout(4096, 1024, KB57, 40e9, 256) == (256, 16)
    assert gpu_check.step_layout(4096, 8192, KB57, 40e9, 256) == (64, 64)
    assert gpu_check.step_layout(256, 8192, KB57, 40e9, 256) == (64, 4)
    with pytest.raises(ValueError, match="--kv-memory-gb"):
        gpu_check.step_layout(16, 8192, KB57, 1e8, 256)


def _write_trace(path, epochs=2, problems=3, samples=2, seed=0):
    rng = np.random.default_rng(seed)
    base = {p: list(rng.integers(3, 40, 30)) for p in range(problems)}
    rolls = []
    for e in range(epochs):
        for p in range(problems):
            for s in range(samples):
                toks = base[p][: 10 + int(rng.integers(0, 20))] + [2]
                rolls.append(rp.TraceRollout(e, p, s, (1, 5, p + 7), tuple(int(t) for t in toks),
                                             "stop", 0.6))
    header = {"model": "synthetic", "cost_model": {"c_base": 0.01, "c_tok": 1e-3, "c_kv": 1e-6},
              "max_new_tokens": 64, "eos_token_ids": [2],
              "engine": {"max_slots": 4, "max_cache_len": 256, "draft_widths": [1, 4]}}
    if str(path).endswith(".gz"):
        plain = path.with_suffix("")
        rp.write_trace(plain, header, rolls)
        path.write_bytes(gzip.compress(plain.read_bytes()))
    else:
        rp.write_trace(path, header, rolls)
    return rolls


def test_gzip_trace_roundtrip_and_corrupt(tmp_path):
    rolls = _write_trace(tmp_path / "t.jsonl.gz")
    assert rp.read_trace(tmp_path / "t.jsonl.gz").rollouts == rolls
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="bad.jsonl.gz: not a readable gzip file"):
        rp.read_trace(tmp_path / "bad.jsonl.gz")


def test_gpu_check_smoke(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl.gz"
    _write_trace(trace)
    out = tmp_path / "out"
    rc = gpu_check.main(["--smoke", "--tokens", "2,4", "--kv", "16,32", "--repeats", "2",
                         "--max-rows", "2", "--out", str(out), "--trace", str(trace)])
    assert rc == 0
    res = json.loads((out / "gpu_check.json").read_text())
    r = res["models"]["tiny"]
    assert [(s["tokens"], s["kv_len"], s["rows"], s["width"]) for s in r["shapes"]] == [
        (2, 16, 2, 1), (4, 16, 2, 2), (2, 32, 2, 1), (4, 32, 2, 2)]
    for s in r["shapes"]:
        assert s["rows"] * s["width"] == s["tokens"] and s["seconds"] > 0
        assert s["attended_kv"] == s["rows"] * s["kv_len"]
    # The saved cost model is a cost-model file the replay and `--cost-model` read.
    coef = load_cost_model(r["file"])
    assert coef == pytest.approx(r["coef"]) and min(coef.values()) >= 0
    saved = json.loads(open(r["file"]).read())
    assert len(saved["shapes"]) == 4 and saved["device"] == res["device"]
    # The paper-scale replay ran under the measured model and a datasheet model.
    assert set(res["paper"]["summary"]) == {r["file"], "h100-7b"}
    per_epoch = res["paper"]["summary"]["h100-7b"]["summary"]["per_epoch"]
    assert len(per_epoch["das"]) == 2
    assert "das" in capsys.readouterr().out


def test_gpu_check_bad_input(tmp_path, capsys):
    assert gpu_check.main(["--models", "qwen9", "--trace", str(tmp_path)]) == 2
    assert gpu_check.main(["--tokens", "a,b"]) == 2
    assert gpu_check.main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "unknown qwen9" in err and "comma-separated integers" in err
    assert "missing.jsonl: no such file" in err
