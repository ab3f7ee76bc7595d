"""Two processes on localhost under `jax.distributed` (CPU collectives, 2 forced devices each)
train GRPO on a tiny model as one process with 4 devices does (same losses and params), resume
from their orbax checkpoint (params, optimizer state and each process's drafter / DAS state),
refuse to run with different configs (one line), and exit with an error instead of hanging when
a peer dies."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

WORKER = textwrap.dedent('''
    import json, os, sys
    mode, pid, nproc, port, run_dir, steps = sys.argv[1:7]
    pid, nproc, steps = int(pid), int(nproc), int(steps)
    from das_jax.config import config_from_dict
    from das_jax.parallel import distributed as dist
    raw = {
        "output_dir": run_dir, "drafter": "das",
        "data": {"kind": "arithmetic", "num_problems": 4, "chat": False, "instruction": ""},
        "rollout": {"max_new_tokens": 10, "temperature": 1.0, "max_slots": 8,
                    "max_cache_len": 256, "draft_widths": [1, 4]},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "micro_batch_size": 4,
                 "learning_rate": 1e-4, "loss_type": "dapo"},
        "train": {"steps": steps, "save_every": 1, "log_samples": 0, "memory_check": False},
        "das": {"cost_model": {"calibrate": False}},
    }
    if mode == "mismatch" and pid == 1:
        raw["grpo"]["learning_rate"] = 2e-3
    if nproc > 1:
        raw["distributed"] = {"coordinator_address": f"localhost:{port}", "num_processes": nproc,
                              "process_id": pid, "initialization_timeout": 120,
                              "heartbeat_timeout": int(os.environ.get("HEARTBEAT", "60"))}
    config = config_from_dict(raw)
    dist.initialize_from_config(config.distributed)
    import jax, numpy as np
    from das_jax.parallel.sharding import replicated, to_host
    from das_jax.rl.trainer import GRPOTrainer
    from das_jax.testing import CharTokenizer, tiny_model_config, tiny_params
    def letters(prompts, completions, **kw):  # varied rewards from a random model
        return [float(len(set(c)) % 3) for c in completions]
    try:
        trainer = GRPOTrainer(config, model=(tiny_model_config(), tiny_params(scale=0.5),
                                             CharTokenizer()), reward_fns=[letters])
    except dist.DistributedError as e:
        print("ERROR " + str(e), flush=True)
        sys.exit(2)
    batches = []      # each step's gathered rollouts: completions and the rows this process made
    rollout = trainer.rollout
    def recording_rollout(step):
        rb = rollout(step)
        mine = (len(rb.stats.assignment[jax.process_index()]) if trainer.split is not None
                else len(rb.outputs))
        batches.append({"tokens": [o.token_ids for o in rb.outputs], "mine": mine})
        return rb
    trainer.rollout = recording_rollout
    if mode == "kill" and pid == 1:  # dies; process 0 goes on into the run's collectives
        print("DYING", flush=True)
        os.kill(os.getpid(), 9)
    records = trainer.train(resume=(mode == "resume"), progress=False)
    full = jax.jit(lambda p: p, out_shardings=replicated(trainer.mesh))(trainer.params)
    flat = np.concatenate([to_host(x).ravel() for x in jax.tree_util.tree_leaves(full)])
    np.save(os.path.join(run_dir, f"params.p{pid}.npy"), flat)
    print("RESULT " + json.dumps({"losses": [r["loss"] for r in records],
                                  "steps": [r["step"] for r in records],
                                  "mesh": dict(trainer.mesh.shape), "batches": batches,
                                  "processes": jax.process_count()}), flush=True)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(mode, pid, nproc, port, run_dir, steps, devices, **env_extra):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
               + os.environ.get("XLA_FLAGS", ""),  # keeps the suite's flags (conftest)
               JAX_PLATFORMS="cpu", **env_extra)
    return subprocess.Popen([sys.executable, "-c", WORKER, mode, str(pid), str(nproc), str(port),
                             str(run_dir), str(steps)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(mode, run_dir, steps, nproc=2, timeout=900):
    port = _free_port()
    procs = [_start(mode, i, nproc, port, run_dir, steps, 4 // nproc) for i in range(nproc)]
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _result(stdout: str) -> dict:
    return json.loads([x for x in stdout.splitlines() if x.startswith("RESULT ")][-1][7:])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 4 devices, 2 steps."""
    run_dir = tmp_path_factory.mktemp("ref")
    (rc, o, e), = _run("train", run_dir, 2, nproc=1)
    assert rc == 0, e[-3000:]
    return _result(o), np.load(run_dir / "params.p0.npy")


@pytest.mark.slow  # 7 processes, each compiling the engine and the train step (~4 CPU-minutes)
def test_two_processes_train_resume_as_one(tmp_path, reference):
    ref, ref_params = reference
    assert ref["processes"] == 1 and ref["mesh"]["fsdp"] == 4
    first = _run("train", tmp_path, 1)
    for rc, o, e in first:
        assert rc == 0, e[-3000:]
    r0, r1 = (_result(o) for _, o, _ in first)
    assert r0["processes"] == 2 and r0["mesh"]["fsdp"] == 4
    assert r0["losses"] == r1["losses"]
    # each process generated one of the step's two groups; the gathered batch is the
    # one-process batch, token for token
    assert [b["mine"] for b in r0["batches"]] == [b["mine"] for b in r1["batches"]] == [4]
    assert r0["batches"][0]["tokens"] == r1["batches"][0]["tokens"] == \
        ref["batches"][0]["tokens"]
    assert abs(ref["losses"][0]) > 1e-3  # a loss that could differ
    assert r0["losses"][0] == pytest.approx(ref["losses"][0], abs=1e-5)
    ckpt = tmp_path / "checkpoints" / "1" / "drafter"
    assert (ckpt / "drafter_state.json").exists() and (ckpt / "drafter_state.p1.json").exists()
    assert (ckpt / "drafter_state.npz").exists() and (ckpt / "drafter_state.p1.npz").exists()
    # resume both processes from step 1 and take step 2
    second = _run("resume", tmp_path, 2)
    for rc, o, e in second:
        assert rc == 0, e[-3000:]
    s0, s1 = (_result(o) for _, o, _ in second)
    assert s0["steps"] == s1["steps"] == [2]
    assert s0["losses"][0] == pytest.approx(ref["losses"][1], abs=1e-5)
    assert s0["batches"][0]["tokens"] == ref["batches"][1]["tokens"]
    p0, p1 = (np.load(tmp_path / f"params.p{i}.npy") for i in range(2))
    np.testing.assert_array_equal(p0, p1)
    assert np.max(np.abs(p0 - ref_params)) <= 1e-5
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m.get("kind", "train") == "train"] == [1, 2]


def test_processes_with_different_configs_refuse_to_start(tmp_path):
    out = _run("mismatch", tmp_path, 1, timeout=200)
    for rc, o, e in out:
        assert rc == 2, e[-3000:]
        # exit code 2 comes only from the worker's `print("ERROR ..."); sys.exit(2)`; the line
        # is searched, not matched at the start: jax's C++ threads share the process's stdout
        # and can leave an unterminated line just before it
        lines = [x[x.index("ERROR "):] for x in o.splitlines() if "ERROR " in x]
        assert lines, (o[-2000:], e[-2000:])
        assert "configs differ" in lines[0] and "process 1" in lines[0], lines


def test_a_dead_peer_stops_the_other_process(tmp_path):
    port = _free_port()
    procs = [_start("kill", i, 2, port, tmp_path, 50, 2, HEARTBEAT="10") for i in range(2)]
    try:
        o1, _ = procs[1].communicate(timeout=600)
        assert "DYING" in o1
        died = time.monotonic()
        _, e0 = procs[0].communicate(timeout=120)  # heartbeat_timeout 10 s, then it exits
        waited = time.monotonic() - died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0
    assert "another task died" in e0 or "unhealthy" in e0, e0[-2000:]
    assert waited < 120
