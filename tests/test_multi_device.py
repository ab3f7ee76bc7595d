"""Rollouts on a device mesh: group placement (LPT vs contiguous), the locked shared drafter, and,
on 8 forced host devices (in subprocesses: this process already initialised JAX with one device),
data-parallel replicas and tensor parallelism over KV heads giving the tokens and log-probs of
one device, with the params resharded from a training (FSDP) sharding on device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest

from das_jax.config import DASSection, config_from_dict
from das_jax.drafter import Draft, Drafter, make_drafter
from das_jax.engine import Engine, EngineConfig, GenerateError, Request, SamplingParams
from das_jax.rollout import (DataParallelStats, LockedDrafter, Rollout, ShardedRollout,
                             assign_contiguous, assign_groups, assign_lpt, assignment_loads,
                             group_indices, replica_meshes, rollout_from_config)
from das_jax.speculation import CostModelConfig, DASConfig, DASPolicy
from das_jax.testing import tiny_model_config, tiny_params

SKEWED = [1000, 900, 50, 40, 30, 20, 10, 5]


# ------------------------------------------------------------------------------ forced devices
MESH_CHECK = textwrap.dedent('''
    import json, sys
    import jax, numpy as np
    from das_jax.config import DASSection
    from das_jax.engine import programs as programs_lib
    from das_jax.engine import DecodeSpec, VerifySpec
    from das_jax.engine import Engine, EngineConfig, Request
    from das_jax.speculation import CostModelConfig, DASConfig
    from das_jax.engine import SamplingParams
    from das_jax.parallel.sharding import make_mesh, param_shardings
    from das_jax.rollout import (Rollout, ShardedRollout, assign_groups, gather_to_local,
                                 replica_meshes, reshard_for_rollout)
    from das_jax.testing import tiny_model_config, tiny_params

    scenario = sys.argv[1]
    devices = jax.devices()
    assert len(devices) == 8, devices
    # GQA with 4 KV heads, so a 4-device replica splits the KV cache one head per device.
    cfg = (tiny_model_config(num_heads=8, num_kv_heads=4) if scenario == "tp"
           else tiny_model_config())
    params = tiny_params(cfg)
    rng = np.random.default_rng(0)
    # 5 problems x 2 samples (GRPO groups), prompts within one prompt bucket.
    reqs = [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 20)))),
                    problem_id=f"p{p}", sample_index=s) for p in range(5) for s in range(2)]
    pids = [r.problem_id for r in reqs]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=10)
    # Few compiled shapes (each compiled once per replica): one batch bucket, one prompt bucket,
    # one cache length.
    small = EngineConfig(max_slots=1, max_cache_len=128,
                         draft_widths=(1, 4) if scenario == "dp" else (1,), min_prompt_bucket=32)
    ref = Engine(cfg, params, eos_token_ids=[1], engine_config=small, device=devices[0])
    base = ref.generate(reqs, sampling)[0]
    # The trainer's sharding: FSDP x tensor over all 8 devices.
    train_mesh = make_mesh(fsdp=4, tensor=2)
    train_params = jax.device_put(params, param_shardings(params, train_mesh))
    assert train_params["layers"]["wq"].sharding.spec[1] == "fsdp"
    report = {}

    def template(speculation="none", das=None):
        return Rollout(Engine(cfg, None, eos_token_ids=[1], engine_config=small,
                              dtype="float32"), speculation, das, sampling)

    def same_as_base(out, exact_logprobs):
        assert [o.request for o in out] == reqs
        assert [o.token_ids for o in out] == [o.token_ids for o in base]
        gap = max(abs(a - b) for o, q in zip(out, base) for a, b in zip(o.logprobs, q.logprobs))
        assert gap == 0.0 if exact_logprobs else gap < 1e-4, gap
        return gap

    def groups_whole(assignment):
        where = {}
        for k, rep in enumerate(assignment):
            for i in rep:
                where.setdefault(pids[i], set()).add(k)
        assert all(len(v) == 1 for v in where.values()), where

    if scenario == "dp":
        # 4 data-parallel replicas of one device each (devices 0-3).
        rollout = ShardedRollout.from_rollout(template(), devices[:4])
        assert rollout.num_replicas == 4 and rollout.tensor_parallel == 1
        out, st = rollout.generate(reqs, train_params)
        report["plain_gap"] = same_as_base(out, exact_logprobs=True)
        groups_whole(st.assignment)
        assert all(st.assignment) and all(f > 0 for f in st.device_forward_passes), st.to_dict()
        assert st.devices == [[str(d)] for d in devices[:4]]
        for k, r in enumerate(rollout.replicas):
            assert r.engine.place_params(train_params)["embed"].devices() == {devices[k]}
        keyed = {k[-1] for k in programs_lib.COMPILED}
        assert {(("cpu", d.id), ("tensor", 1)) for d in devices[:4]} <= keyed, keyed

        # The shared suffix drafter, one DAS policy per replica (unlimited: the width choice does
        # not depend on measured step times): epoch 2 drafts from epoch 1's history and is
        # placed by LPT on it; tokens never change.
        das = DASSection(policy=DASConfig(min_history=2, unlimited=True),
                         cost_model=CostModelConfig(calibrate=False))
        # (Two replicas, on devices 0 and 1: their width-1 executables are compiled already.)
        rollout = ShardedRollout.from_rollout(template("das", das), devices[:2])
        assert rollout.replicas[0].drafter is rollout.replicas[1].drafter is rollout.drafter
        assert rollout.replicas[0].policy is not rollout.replicas[1].policy
        accepted = []
        for epoch in range(2):
            pred = rollout.predicted_lengths(reqs)
            out, st = rollout.generate(reqs, train_params)
            # Log-probs of drafted positions come from a width-4 step: float rounding apart.
            same_as_base(out, exact_logprobs=False)
            groups_whole(st.assignment)
            assert st.assignment == assign_groups(pids, pred, 2)
            accepted.append(st.accepted_draft_tokens)
            rollout.advance_epoch()     # one shared drafter: advance it once
        assert (pred >= 0).all() and accepted[1] > 0, (pred, accepted)
        state = rollout.state_dict()
        assert len(state["policy"]["replicas"]) == 2
        report.update(accepted=accepted, assignment=st.assignment)
    else:
        # 2 replicas of 4 devices, tensor-parallel over KV heads.
        meshes = replica_meshes(devices, replicas=2)
        rollout = ShardedRollout(template(), meshes)
        assert rollout.tensor_parallel == 4
        eng = rollout.replicas[1].engine
        cache = eng.zeros_cache(1, 128, "float32")
        assert cache.k.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None,
                                                                   None), cache.k.sharding
        assert cache.k.addressable_shards[0].data.shape[2] == 1   # one KV head per device
        # Resharding from the training sharding: on device only, values kept.
        with jax.transfer_guard("disallow"):
            placed = reshard_for_rollout(train_params, meshes[1])
        want = eng.placement.param_shardings(params)
        for (path, a), s, x in zip(jax.tree_util.tree_leaves_with_path(placed),
                                   jax.tree_util.tree_leaves(want),
                                   jax.tree_util.tree_leaves(params)):
            assert a.sharding == s, (path, a.sharding, s)
            assert a.devices() == set(meshes[1].devices.flat)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(x))
        # The multi-host path (all-gather on device, then a local copy), forced in one process.
        with jax.transfer_guard("disallow"):
            local = gather_to_local(train_params, force=True)
        for a, x in zip(jax.tree_util.tree_leaves(local), jax.tree_util.tree_leaves(params)):
            assert len(a.devices()) == 1
            np.testing.assert_array_equal(np.asarray(a), np.asarray(x))
        assert placed["layers"]["wk"].sharding.spec[2] == "tensor"
        assert placed["layers"]["wq"].sharding.spec[2] == "tensor"
        assert placed["embed"].sharding.spec == jax.sharding.PartitionSpec(None, None)
        out, st = rollout.generate(reqs, train_params)
        report["tp_gap"] = same_as_base(out, exact_logprobs=False)
        groups_whole(st.assignment)
        assert all(st.assignment)
        # The decode and verify executables were compiled with the KV-head sharding at the jit
        # boundary.
        verify = [c for k, c in programs_lib.COMPILED.items()
                  if isinstance(k[0], (VerifySpec, DecodeSpec)) and k[-1] == eng.placement.key]
        assert verify
        for c in verify:
            out_cache = c.output_shardings[0]
            assert out_cache.k.spec == cache.k.sharding.spec, out_cache
    print("RESULT " + json.dumps(report))
''')


@pytest.fixture(scope="module", autouse=True)
def forced_device_runs():
    """Both checks start with the module's first test and run while the in-process tests do
    (they are mostly XLA compiles); the last tests collect them."""
    procs = {}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               + os.environ.get("XLA_FLAGS", ""),  # keeps the suite's flags (conftest)
               JAX_PLATFORMS="cpu")
    for scenario in ("dp", "tp"):
        procs[scenario] = subprocess.Popen([sys.executable, "-c", MESH_CHECK, scenario], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _result(proc) -> dict:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# ------------------------------------------------------------------------------ assignment
@pytest.mark.parametrize("D", [2, 4])
def test_lpt_beats_contiguous_on_skewed_lengths(D):
    lpt, contiguous = assign_lpt(SKEWED, D), assign_contiguous(len(SKEWED), D)
    for a in (lpt, contiguous):
        assert sorted(i for dev in a for i in dev) == list(range(len(SKEWED)))
        assert len(a) == D and all(a)
    lpt_ms = max(assignment_loads(lpt, SKEWED))
    cont_ms = max(assignment_loads(contiguous, SKEWED))
    assert lpt_ms <= cont_ms
    # Within the smallest request of the lower bound max(longest, mean load) (for this input).
    assert lpt_ms <= max(max(SKEWED), sum(SKEWED) / D) + min(SKEWED)
    assert 0 in contiguous[0] and 1 in contiguous[0]  # contiguous piles both long ones on dev 0
    assert not any(0 in dev and 1 in dev for dev in lpt)  # LPT interleaves them
    assert [dev[0] for dev in lpt[:2]] == [0, 1]  # each device admits its longest first


def test_lpt_greedy_rule_and_unknown_lengths():
    # Textbook LPT: 7,6,5,4,3 on 2 machines -> {7,4,3} / {6,5}.
    a = assign_lpt([3, 7, 4, 6, 5], 2)
    assert a == [[1, 2, 0], [3, 4]]
    assert assignment_loads(a, [3, 7, 4, 6, 5]) == [14.0, 11.0]
    # Unknown (-1) counts as the mean of the known ones (here 100).
    lens = [150, 50, -1, -1]
    assert assignment_loads(assign_lpt(lens, 2), lens) == [200.0, 200.0]
    # Nothing known: a round-robin that balances counts.
    assert [len(d) for d in assign_lpt([-1] * 7, 3)] == [3, 2, 2]
    assert assign_contiguous(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert assign_contiguous(2, 4) == [[0], [1], [], []]
    with pytest.raises(ValueError):
        assign_lpt([1], 0)


def test_groups_stay_whole_and_long_groups_are_spread():
    # 6 groups of 4 (GRPO num_generations=4), listed hardest first, one request of each group
    # interleaved with the others' (the order does not matter: groups are by problem id).
    work = {"a": 900, "b": 800, "c": 700, "d": 60, "e": 50, "f": 40}
    pids = [p for _ in range(4) for p in work]
    lens = [work[p] + k for k, p in enumerate(pids)]   # siblings differ a little
    assert group_indices(pids)[0] == [0, 6, 12, 18]
    for R in (2, 3):
        lpt, cont = assign_groups(pids, lens, R), assign_groups(pids, lens, R, "contiguous")
        for a in (lpt, cont):
            assert sorted(i for rep in a for i in rep) == list(range(len(pids)))
            for rep in a:   # a replica holds whole groups
                held = {pids[i] for i in rep}
                assert sum(pids.count(p) for p in held) == len(rep)
        lpt_ms, cont_ms = max(assignment_loads(lpt, lens)), max(assignment_loads(cont, lens))
        assert lpt_ms < cont_ms, (R, lpt_ms, cont_ms)
        # The three long groups land on different replicas as far as there are replicas.
        homes = [next(k for k, rep in enumerate(lpt) if pids.index(p) in rep) for p in "abc"]
        assert len(set(homes)) == R
    # With one request per problem, group placement is request placement.
    assert assign_groups([f"q{i}" for i in range(8)], SKEWED, 3) == assign_lpt(SKEWED, 3)
    # Unknown lengths count as the mean of the known ones; nothing known balances group counts.
    assert [len(r) for r in assign_groups(pids, [-1] * len(pids), 3)] == [8, 8, 8]
    with pytest.raises(ValueError, match="unknown assignment"):
        assign_groups(pids, lens, 2, "random")


def test_replica_meshes_split_devices_and_check_the_count():
    dev = jax.devices()[0]
    meshes = replica_meshes([dev, dev], replicas=2)
    assert [m.shape["tensor"] for m in meshes] == [1, 1]
    assert len(replica_meshes([dev] * 4, replicas=1)[0].devices.flat) == 4
    with pytest.raises(GenerateError, match="rollout.replicas=3 must be >= 1 and divide the 4"):
        replica_meshes([dev] * 4, replicas=3)
    with pytest.raises(GenerateError, match="rollout.replicas"):
        replica_meshes([dev], replicas=0)


def test_predict_lengths_from_policy_or_drafter_history():
    reqs = [Request((2, 3), problem_id=p) for p in ("a", "b", "a", "c")]
    history = {"a": [10, 30, 20], "b": [5]}
    rollout = Rollout(Engine(CFG, None, dtype="float32"), "none")   # no params needed: nothing is generated
    assert rollout.predicted_lengths(reqs).tolist() == [-1.0] * 4
    rollout.policy = DASPolicy(lambda pid: history.get(pid, []))
    assert rollout.predicted_lengths(reqs).tolist() == [20.0, 5.0, 20.0, -1.0]

    class Hist:
        def lengths(self, pid):
            return history.get(pid, [])
    rollout.policy, rollout.drafter = None, Hist()
    assert rollout.predicted_lengths(reqs).tolist() == [20.0, 5.0, 20.0, -1.0]


# ------------------------------------------------------------------------------ locked drafter
class Recorder:
    def __init__(self):
        self.calls = []
        self.lock_held = []

    def begin(self, request_id, problem_id, prompt_ids):
        self.calls.append(("begin", request_id, problem_id))

    def propose(self, request_id, max_tokens):
        self.calls.append(("propose", request_id, max_tokens))
        return Draft.empty()

    def append(self, request_id, token_ids):
        self.calls.append(("append", request_id, list(token_ids)))

    def end(self, request_id):
        self.calls.append(("end", request_id))

    def advance_epoch(self):
        self.calls.append(("epoch",))

    def state_dict(self):
        return {"n": len(self.calls)}

    def load_state_dict(self, state):
        self.calls.append(("load", state["n"]))


def test_locked_drafter_maps_ids_and_shares_one_lock():
    inner = Recorder()
    locked = LockedDrafter(inner)
    assert isinstance(locked, Drafter)
    v0, v1 = locked.view([4, 0, 2]), locked.view([1, 3])
    assert v0.lock is v1.lock is locked.lock and v0.drafter is inner
    v0.begin(0, "p", [5])
    v1.begin(0, "q", [6])
    v0.append(2, [7, 8])
    v1.propose(1, 3)
    v1.end(1)
    assert inner.calls == [("begin", 4, "p"), ("begin", 1, "q"), ("append", 2, [7, 8]),
                           ("propose", 3, 3), ("end", 3)]
    assert locked.view([3, 1]).view([1])._ids == [1]  # views of views compose
    assert LockedDrafter(locked).lock is locked.lock  # no double wrapping
    locked.advance_epoch()
    assert v0.state_dict() == {"n": 6}
    v1.load_state_dict({"n": 1})
    assert inner.calls[-2:] == [("epoch",), ("load", 1)]
    assert not hasattr(locked, "lengths")  # Recorder has no history


def test_locked_drafter_lengths_and_concurrent_use():
    inner = make_drafter("suffix")
    locked = LockedDrafter(inner)
    views = [locked.view(list(range(d * 50, d * 50 + 50))) for d in range(4)]

    def worker(v, d):
        for k in range(50):
            v.begin(k, f"p{k % 5}", [2, 3, 4])
            for _ in range(4):
                v.propose(k, 4)
                v.append(k, [5, 6, 7 + d])
            v.end(k)
    threads = [threading.Thread(target=worker, args=(v, d)) for d, v in enumerate(views)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sum(len(locked.lengths(f"p{k}")) for k in range(5)) == 200
    assert locked.lengths("p0") == inner.lengths("p0")
    template = DASPolicy(inner.lengths, DASConfig(min_history=3))
    pols = [template.fork(locked) for _ in range(2)]
    assert pols[0] is not pols[1] and pols[0].predicted_length("p0") == 12.0
    assert pols[0].cost_model is not template.cost_model


# ------------------------------------------------------------------------------ in-process
CFG = tiny_model_config()
# Few compiled shapes (each is compiled once per device, and compiles are most of these tests'
# time): one batch bucket, widths 1 and 4, one prompt bucket, one cache length.
SMALL = EngineConfig(max_slots=1, max_cache_len=128, draft_widths=(1, 4), min_prompt_bucket=32)


def _requests(n_problems=4, group=3, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 20)))),
                    problem_id=f"p{p}", sample_index=s)
            for p in range(n_problems) for s in range(group)]


def test_two_replicas_on_one_device_in_threads_are_token_identical():
    """Threads, id mapping, group placement and the shared drafter without forced devices: two
    replicas on the same device. The real multi-device runs are in the subprocess tests."""
    params = tiny_params(CFG)
    dev = jax.devices()[0]
    # The reference: one engine on a one-device mesh (it shares the replicas' executables; the
    # subprocess test compares replicas with an engine placed on a plain device).
    eng = Engine(CFG, params, eos_token_ids=[1], engine_config=SMALL,
                 mesh=replica_meshes([dev])[0])
    reqs = _requests(n_problems=4, group=2)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=12)
    base, _ = eng.generate(reqs, sampling)
    template = Rollout(Engine(CFG, None, eos_token_ids=[1], engine_config=SMALL,
                              dtype="float32"), sampling=sampling)
    rollout = ShardedRollout.from_rollout(template, [dev, dev])
    out, st = rollout.generate(reqs, params, assignment="contiguous")
    assert [o.token_ids for o in out] == [o.token_ids for o in base]
    assert [o.logprobs for o in out] == [o.logprobs for o in base]
    assert [o.request for o in out] == reqs
    assert st.assignment == [[0, 1, 2, 3], [4, 5, 6, 7]] and all(st.device_forward_passes)
    assert isinstance(st, DataParallelStats)
    das = DASSection(policy=DASConfig(min_history=2, unlimited=True),
                     cost_model=CostModelConfig(calibrate=False))
    rollout = ShardedRollout.from_rollout(template.with_speculation("das", das), [dev, dev])
    assert rollout.replicas[0].drafter is rollout.replicas[1].drafter is rollout.drafter
    assert isinstance(rollout.drafter, LockedDrafter)
    assert rollout.replicas[0].policy is not rollout.replicas[1].policy
    accepted, done = 0, []
    for _ in range(2):
        out, st = rollout.generate(reqs, params, progress=lambda k, n: done.append((k, n)))
        assert [o.token_ids for o in out] == [o.token_ids for o in base]
        accepted += st.accepted_draft_tokens
        rollout.advance_epoch()
    assert accepted > 0
    assert done[-1] == (len(reqs), len(reqs)) and len(done) == 2 * len(reqs)
    assert st.forward_passes == sum(st.device_forward_passes)
    assert st.makespan_s == max(st.device_wall_s) == st.wall_s
    assert set(st.to_dict()) >= {"makespan_s", "makespan_forward_passes", "device_tokens",
                                 "acceptance_length", "assignment"}
    # Checkpoint state: one drafter, a policy per replica; a single rollout's state loads too.
    state = rollout.state_dict()
    assert len(state["policy"]["replicas"]) == 2
    rollout.load_state_dict(state)
    single = Rollout(Engine(CFG, None, dtype="float32"), "das", das)
    single.load_state_dict(state)
    rollout.load_state_dict(single.state_dict())


def test_rollout_from_config_builds_replicas_over_several_devices():
    dev = jax.devices()[0]
    cfg = config_from_dict({"rollout": {"max_slots": 1, "max_cache_len": 128, "max_new_tokens": 64,
                                      "replicas": 2}})
    r = rollout_from_config(cfg, CFG, None, [1], devices=[dev] * 4)
    assert isinstance(r, ShardedRollout) and r.num_replicas == 2 and r.tensor_parallel == 2
    assert r.replicas[1].engine.placement.devices == [dev, dev]
    one = rollout_from_config(config_from_dict({}), CFG, None, [1], devices=[dev])
    assert type(one) is Rollout
    with pytest.raises(Exception, match="rollout.replicas must be >= 1"):
        config_from_dict({"rollout": {"replicas": 0}})


def test_bad_input_fails_before_threads():
    params = tiny_params(CFG)
    dev = jax.devices()[0]
    eng = Engine(CFG, params, engine_config=EngineConfig(max_slots=2, max_cache_len=64))
    r = ShardedRollout.from_rollout(Rollout(eng, sampling=SamplingParams(max_new_tokens=4)),
                                    [dev, dev])
    with pytest.raises(GenerateError, match="no requests"):
        r.generate([])
    with pytest.raises(GenerateError, match="unknown assignment"):
        r.generate([Request((2,))], assignment="random")
    with pytest.raises(GenerateError, match="exactly once"):
        r.generate([Request((2,))] * 2, assignment=[[0], [0]])
    with pytest.raises(GenerateError, match="one entry per request"):
        r.generate([Request((2,))], predicted_lengths=[1, 2])
    with pytest.raises(GenerateError, match="device or a mesh"):
        Engine(CFG, params, device=dev, mesh=replica_meshes([dev])[0])
    assert all(x.engine.programs.compile_s == 0.0 for x in r.replicas)


# ------------------------------------------------------------------------------ 8 devices
def test_data_parallel_replicas_match_one_device(forced_device_runs):
    """4 replicas: tokens and log-probs identical to one device, groups whole, every replica
    busy; 2 replicas with the shared drafter drafting from epoch 1's history in epoch 2, placed
    by LPT on it, tokens unchanged."""
    result = _result(forced_device_runs["dp"])
    assert result["plain_gap"] == 0.0 and result["accepted"][1] > 0


def test_tensor_parallel_replicas_match_one_device(forced_device_runs):
    """2 replicas x 4 devices over KV heads: identical tokens, log-probs within float rounding,
    cache and params sharded on heads, resharded from FSDP without a host round trip."""
    result = _result(forced_device_runs["tp"])
    assert result["tp_gap"] < 1e-4
