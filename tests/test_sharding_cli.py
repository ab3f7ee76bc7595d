"""`das-jax train --config configs/tiny.yaml` on 4 forced CPU devices with a `mesh:` logs the
same metrics as on one device (a tiny random model patched in for the model load; each run in
its own subprocess, since the device count is fixed when JAX starts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TINY_YAML = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"

RUN = textwrap.dedent('''
    import sys
    import jax
    from das_jax.cli import main
    from das_jax.rl import model_loading
    from das_jax.testing import CharTokenizer, tiny_model_config, tiny_params
    model_loading.load_model = lambda config: (tiny_model_config(), tiny_params(scale=0.5),
                                                CharTokenizer())
    print("DEVICES", jax.device_count(), flush=True)
    sys.exit(main(sys.argv[1:]))
''')

KEYS = ("loss", "grad_norm", "entropy", "reward_mean", "response_length_mean",
        "rollout_logprob_gap", "clip_fraction")


def _train(tmp_path, devices: int, *extra: str):
    run_dir = tmp_path / f"run-{devices}"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
               + os.environ.get("XLA_FLAGS", ""),  # keeps the suite's flags (conftest)
               JAX_PLATFORMS="cpu")
    p = subprocess.run(
        [sys.executable, "-c", RUN, "train", "--config", str(TINY_YAML), "--no-progress",
         "--set", f"output_dir={run_dir}", "--set", "drafter=none", "--set", "data.chat=false",
         "--set", "data.instruction=", "--set", "rollout.max_new_tokens=12",
         "--set", "rollout.draft_widths=[1]", "--set", "data.num_problems=2",
         "--set", "train.steps=2", "--set", "train.save_every=0", *extra],
        env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"DEVICES {devices}" in p.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind", "train") == "train"], p.stderr


def test_four_devices_with_a_mesh_log_the_same_metrics(tmp_path):
    one, _ = _train(tmp_path, 1)
    four, err = _train(tmp_path, 4, "--set", "mesh.data=2", "--set", "mesh.fsdp=-1")
    assert [r["step"] for r in one] == [r["step"] for r in four] == [1, 2]
    for a, b in zip(one, four):
        for k in KEYS:
            if a.get(k) is None:
                assert b.get(k) is None, k
                continue
            # rollout_logprob_gap is itself float rounding (~1e-6): compared in absolute terms
            tol = 1e-5 if k == "rollout_logprob_gap" else 1e-6
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=tol), (k, a[k], b[k])


def test_a_mesh_that_does_not_fit_is_a_one_line_error(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 "
               + os.environ.get("XLA_FLAGS", ""),  # keeps the suite's flags (conftest)
               JAX_PLATFORMS="cpu")
    p = subprocess.run(
        [sys.executable, "-c", RUN, "train", "--config", str(TINY_YAML), "--no-progress",
         "--set", f"output_dir={tmp_path / 'bad'}", "--set", "mesh.fsdp=3"],
        env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [x for x in p.stderr.splitlines() if "error" in x]
    assert len(err) == 1 and "mesh {data: 1, fsdp: 3, tensor: 1}" in err[0], p.stderr[-2000:]
    assert "4" in err[0] and "Traceback" not in p.stderr
