"""The memory check of `das-jax train` is the run's plan: the shipped GPU configs fit 8 devices
(H200: 141 GB, 0.75 usable) with every program the run executes, and are refused in one line on
one device. Abstract shapes on forced host devices; no weights (the run stops at loading them).
Slow: about 70 s per 8-device run on a 2-core CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))
PROGRAMS = ("accumulate_grads", "optimizer_update", "verify_packed", "prefill_packed",
            "share_prompt_rows", "gather_rows")


def _train(tmp_path, config, devices):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "solution":
                                        f"\\boxed{{{i + 1}}}", "prompt": f"def f{i}():",
                                        "task_id": f"t{i}", "test": "", "entry_point": f"f{i}",
                                        "canonical_solution": "  pass\n"}) + "\n"
                            for i in range(2)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_MEM_FRACTION="0.75",
               JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
               + os.environ.get("XLA_FLAGS", ""))  # keeps the suite's flags (conftest)
    return subprocess.run(
        [sys.executable, "-m", "das_jax.cli", "train", "--config", str(config),
         "--set", "platform=cpu", "--set", "train.device_memory_gb=141",
         "--set", f"output_dir={tmp_path / 'run'}", "--set", f"data.path={data}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_gpu_config_passes_memory_check_on_8_devices(tmp_path, config):
    proc = _train(tmp_path, config, 8)
    err = proc.stderr
    assert "memory plan: 8 device(s) x 105.8 GB usable (0.75 of 141.0 GB" in err, err[-3000:]
    assert "  fits: peak" in err, err[-3000:]
    for name in PROGRAMS:
        assert f"program {name} " in err, name
    # No hidden second cache: the programs that update the cache in place (verify, prefill in
    # calls of rollout.max_prefill_tokens, prompt sharing) keep temporaries under 10% of it
    # (their aliased bytes), and the compaction under 10% of the cache it reads
    mem = {}
    for line in err.splitlines():
        f = line.split()
        if "program" in f and f[f.index("program") + 2:][:1] == ["temp"]:
            f = f[f.index("program"):]  # "program NAME temp X GB args X GB out X GB aliased X GB"
            mem[f[1]] = {"temp": float(f[3]), "args": float(f[6]), "aliased": float(f[12])}
    for name, cache in (("verify_packed", "aliased"), ("prefill_packed", "aliased"),
                        ("share_prompt_rows", "aliased"),
                        ("gather_rows", "args")):
        assert mem[name]["temp"] <= 0.10 * mem[name][cache], (name, mem[name])
    # past the check, the run stops only at loading the (absent) weights
    assert "hub cannot be reached" in err or "HF cache" in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_gpu_config_refused_on_one_device(tmp_path, config):
    proc = _train(tmp_path, config, 1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "per device" in lines[0] and "memory_check=false" in lines[0], \
        proc.stderr[-3000:]


@pytest.mark.slow
def test_plan_of_a_gpu_run_uses_the_paged_cache(tmp_path):
    """`rollout.kv_cache: auto` on a GPU run (platform: gpu, one device per replica) plans the
    paged pool: admission by shared pages, no compaction copy, every program's temporaries
    under 10% of the pool."""
    config = ROOT / "configs" / "gpu" / "deepseek-r1-distill-qwen-7b-deepscaler.yaml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               + os.environ.get("XLA_FLAGS", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "das_jax.cli", "plan", "--config", str(config), "--devices", "8",
         "--device-memory-gb", "141"], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "kv_cache=paged" in out, out[-3000:]
    mem = {}
    for line in out.splitlines():
        f = line.split()
        if f[:1] == ["program"]:
            mem[f[1]] = {"temp": float(f[3]), "aliased": float(f[12])}
    assert "gather_rows" not in mem and "share_prompt_rows" not in mem, mem
    for name in ("verify_packed", "prefill_packed", "share_prompt_pages"):
        assert mem[name]["temp"] <= 0.10 * mem[name]["aliased"], (name, mem[name])
