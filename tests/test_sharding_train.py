"""Sharded (FSDP / data / tensor) GRPO train step on forced host devices equals the one-device
step, for every registered loss; per-device train-state bytes shrink with the mesh; the `mesh:`
config section and its one-line errors. The device checks run in a subprocess (this process
already initialised JAX with one device)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from das_jax.config import ConfigError, MeshSection, config_from_dict
from das_jax.parallel.sharding import MESH_AXES, MeshError, resolve_mesh_shape

WORKER = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from das_jax.config import GRPOSection
    from das_jax.models.transformer import ActivationConfig
    from das_jax.parallel import sharding as S
    from das_jax.rl import (compute_logprobs, losses, make_batch, make_optimizer,
                            make_train_step)
    from das_jax.testing import tiny_model_config, tiny_params

    assert len(jax.devices()) == 8
    cfg = tiny_model_config()
    TEMP = 0.7
    rng = np.random.default_rng(0)
    B, T = 12, 24
    prompt = rng.integers(2, 6, size=B)
    comp = rng.integers(1, 15, size=B)
    tokens = rng.integers(0, cfg.vocab_size, size=(B, T))
    base = make_batch(tokens, prompt, comp)
    p0 = tiny_params(cfg, scale=0.2)
    cur = np.asarray(compute_logprobs(cfg, p0, base.tokens_BxT, base.positions_BxT,
                                      base.valid_BxT, TEMP))
    batch = make_batch(tokens, prompt, comp,
                       old_logprobs_BxT=cur + rng.normal(0, 0.3, size=cur.shape),
                       ref_logprobs_BxT=cur + rng.normal(0, 0.2, size=cur.shape),
                       advantages_B=rng.normal(0, 1, size=B))
    # the reference path (full logits) compiles fastest; the chunked path with tensor parallelism
    act = None
    chunked = ActivationConfig(remat="full", logits_chunk=32, attention_chunk=8)
    meshes = {"data2_fsdp4": dict(data=2, fsdp=4), "fsdp4_tensor2": dict(fsdp=4, tensor=2)}
    report = {}

    def run(grpo, mesh, steps=2, act=None):
        opt = make_optimizer(grpo, 10)
        params = tiny_params(cfg, scale=0.2)
        if mesh is not None:
            sh = S.TrainShardings(params, mesh)
            params = S.place(params, sh.params)
            o_sh = sh.like(jax.eval_shape(opt.init, params))
            opt_state = jax.jit(opt.init, out_shardings=o_sh)(params)
        else:
            opt_state = opt.init(params)
        step = make_train_step(cfg, grpo, opt, temperature=TEMP, donate=True, activation=act,
                               mesh=mesh)
        ms = []
        for _ in range(steps):
            params, opt_state, m = step(params, opt_state, batch)
            ms.append({k: float(v) for k, v in m.items()})
        return params, opt_state, ms

    # every loss on a data x fsdp mesh; tensor parallelism (heads / MLP) with one loss
    cases = [(loss, beta, "data2_fsdp4") for loss in losses.registered_losses()
             for beta in ((0.0, 0.04) if loss == "dapo" else (0.0,))]
    cases.append(("dapo", 0.0, "fsdp4_tensor2"))  # with the chunked (trainer's) path
    refs = {}
    for loss, beta, name in cases:
        grpo = GRPOSection(loss_type=loss, beta=beta, micro_batch_size=5,
                           max_completion_length=16, learning_rate=1e-3, max_grad_norm=1.0)
        a = chunked if name == "fsdp4_tensor2" else None
        if (loss, beta, a) not in refs:
            refs[(loss, beta, a)] = run(grpo, None, act=a)
        ref_p, _, ref_m = refs[(loss, beta, a)]
        p, o, m = run(grpo, S.mesh_from_config(meshes[name]), act=a)
        dp = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(jax.tree_util.tree_leaves(ref_p), jax.tree_util.tree_leaves(p)))
        dm = max(abs(a[k] - b[k]) for a, b in zip(ref_m, m) for k in a)
        dl = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref_m, m))
        report[f"{loss}/beta={beta}/{name}"] = dict(
            params=dp, metrics=dm, loss=dl, loss_value=ref_m[-1]["loss"],
            sharded=all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(p)))

    # per-device bytes of params + Adam state on the fsdp8 mesh vs the total
    grpo = GRPOSection(micro_batch_size=4, max_completion_length=16)
    mesh = S.mesh_from_config({"fsdp": 8})
    p, o, _ = run(grpo, mesh, steps=1)
    leaves = [x for x in jax.tree_util.tree_leaves((p, o)) if x.ndim]
    total = sum(x.nbytes for x in leaves)
    dev0 = jax.devices()[0]
    per_dev = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == dev0)
    report["bytes"] = dict(total=total, device0=per_dev)
    report["registered"] = list(losses.registered_losses())
    print("RESULT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def forced_8():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               + os.environ.get("XLA_FLAGS", ""),  # keeps the suite's flags (conftest)
               JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_sharded_train_step_equals_one_device(forced_8):
    # Every loss a fresh process registers (the built-ins; this process may also hold losses
    # that other test modules registered).
    cases = {k: v for k, v in forced_8.items() if k not in ("bytes", "registered")}
    assert {"grpo", "dr_grpo", "dapo"} <= set(forced_8["registered"])
    assert {k.split("/")[0] for k in cases} == set(forced_8["registered"])
    for name, r in cases.items():
        assert r["sharded"], name
        assert r["loss"] <= 1e-5 and r["params"] <= 1e-5 and r["metrics"] <= 1e-4, (name, r)
        assert abs(r["loss_value"]) > 1e-4, (name, r)  # a loss that can differ


def test_per_device_train_state_is_an_eighth(forced_8):
    b = forced_8["bytes"]
    assert b["device0"] <= b["total"] / 8 * 1.1, b


# ------------------------------------------------------------------------------ mesh config
def test_mesh_section_names_the_mesh_axes():
    # every field but rollout_devices (devices set apart for the rollouts) is a mesh axis
    assert tuple(f for f in MeshSection.__dataclass_fields__ if f != "rollout_devices") == MESH_AXES
    assert config_from_dict({}).mesh == MeshSection(data=1, fsdp=-1, tensor=1, rollout_devices=0)


@pytest.mark.parametrize("sizes, n, want", [
    ({"data": 1, "fsdp": -1, "tensor": 1}, 8, {"data": 1, "fsdp": 8, "tensor": 1}),
    ({"data": 2, "fsdp": -1, "tensor": 2}, 8, {"data": 2, "fsdp": 2, "tensor": 2}),
    ({"data": -1}, 4, {"data": 4, "fsdp": 1, "tensor": 1}),
    ({"data": 2, "fsdp": 4, "tensor": 1}, 8, {"data": 2, "fsdp": 4, "tensor": 1}),
])
def test_resolve_mesh_shape(sizes, n, want):
    assert resolve_mesh_shape(sizes, n) == want


@pytest.mark.parametrize("sizes, n, words", [
    ({"data": 2, "fsdp": 3, "tensor": 1}, 8, ["has 6 devices", "this run has 8"]),
    ({"data": 3, "fsdp": -1}, 8, ["do not divide", "8"]),
    ({"model": 2}, 2, ["unknown axis 'model'", "data, fsdp, tensor"]),
])
def test_mesh_that_does_not_fit_is_one_line(sizes, n, words):
    with pytest.raises(MeshError) as e:
        resolve_mesh_shape(sizes, n)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("override, words", [
    ("mesh.fsdp=0", ["mesh.fsdp=0", "-1"]),
    ("mesh.model=2", ["unknown key 'mesh.model'", "data, fsdp, tensor"]),
    ("distributed.process_id=-1", ["distributed.process_id"]),
])
def test_mesh_and_distributed_config_errors(override, words):
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, [override])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_two_minus_one_axes_are_rejected():
    with pytest.raises(ConfigError, match="only one axis may be -1"):
        config_from_dict({"mesh": {"data": -1, "fsdp": -1}})


def test_distributed_resolve_from_config_and_environment():
    from das_jax.config import DistributedSection
    from das_jax.parallel.distributed import DistributedError, resolve
    assert resolve(DistributedSection(), {}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    spec = resolve(DistributedSection(), env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("10.0.0.1:1234",
                                                                               2, 1)
    spec = resolve(DistributedSection(process_id=0), env)  # the config wins over the environment
    assert spec.process_id == 0
    with pytest.raises(DistributedError, match="JAX_PROCESS_ID"):
        resolve(DistributedSection(num_processes=2, coordinator_address="h:1"), {})
    with pytest.raises(DistributedError, match="not an integer"):
        resolve(DistributedSection(), {"JAX_NUM_PROCESSES": "two"})
