"""Data-parallel rollouts: LPT vs contiguous placement, the locked shared drafter, and token
identity under multi-device placement (forced host devices, in a subprocess: this process already
initialised JAX with one device)."""
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

from das_jax.config import DASSection
from das_jax.drafter import Draft, Drafter, make_drafter
from das_jax.engine import (CostModelConfig, DASConfig, DASPolicy, Engine, EngineConfig,
                            GenerateError, Request, SamplingParams)
from das_jax.rollout import (LockedDrafter, Rollout, assign_contiguous, assign_lpt,
                             assignment_loads, generate_data_parallel)
from das_jax.testing import tiny_model_config, tiny_params

SKEWED = [1000, 900, 50, 40, 30, 20, 10, 5]


# ------------------------------------------------------------------------------ forced devices
MULTI_DEVICE_CHECK = textwrap.dedent('''
    import json, sys
    import jax, numpy as np
    from das_jax.config import DASSection
    from das_jax.engine import generate as gen
    from das_jax.engine import CostModelConfig, DASConfig, Engine, EngineConfig, Request
    from das_jax.engine import SamplingParams
    from das_jax.rollout import (Rollout, assign_contiguous, assign_lpt, assignment_loads,
                                 generate_data_parallel)
    from das_jax.testing import tiny_model_config, tiny_params

    N = int(sys.argv[1])
    devices = jax.devices()
    assert len(devices) == N, devices
    cfg = tiny_model_config()
    params = tiny_params(cfg)
    rng = np.random.default_rng(0)
    reqs = [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 20)))),
                    problem_id=f"p{p}", sample_index=s) for p in range(N + 1) for s in range(2)]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=16)
    # Few compiled shapes, each compiled once per device: widths 1 and 4, one prompt bucket, one
    # cache length; batch buckets 1 and 2 with 2 devices (continuous batching and compaction on
    # every device), batch 1 with 4.
    small = EngineConfig(max_slots=2 if N == 2 else 1, max_cache_len=128, draft_widths=(1, 4),
                         min_prompt_bucket=32)
    # The single-device reference runs on device 0 (so its executables are reused there).
    eng = Engine(cfg, params, eos_token_ids=[1], engine_config=small, device=devices[0])
    base = [o.token_ids for o in eng.generate(reqs, sampling)[0]]
    forks = Rollout(eng, sampling=sampling).forks()
    for d, r in enumerate(forks):
        assert r.engine.params["embed"].devices() == {devices[d]}
    report = {}

    # Plain decoding: both placements give the single-device tokens; every device works.
    for name in ("lpt", "contiguous"):
        out, st = generate_data_parallel(forks, reqs, assignment=name)
        assert [o.token_ids for o in out] == base, name
        assert all(st.assignment) and all(f > 0 for f in st.device_forward_passes), st.to_dict()
        assert st.devices == [str(d) for d in devices]
        report[name] = st.device_forward_passes
    # The executables were compiled for (and run on) every device.
    keyed = {k[-1] for k in gen._COMPILED_EXECUTABLES if isinstance(k[-1], tuple)}
    assert {("cpu", d.id) for d in devices} <= keyed, keyed

    # The shared suffix drafter with one DAS policy per device (unlimited: the width choice does
    # not depend on measured step times): epoch 2 drafts from epoch 1's
    # history (siblings placed on other devices included); tokens never change.
    das = DASSection(policy=DASConfig(min_history=4, unlimited=True),
                     cost_model=CostModelConfig(calibrate=False))
    forks = Rollout(eng, "das", das, sampling).forks()
    accepted = []
    for epoch in range(2):
        out, st = generate_data_parallel(forks, reqs)
        assert [o.token_ids for o in out] == base, epoch
        assert all(st.assignment) and all(f > 0 for f in st.device_forward_passes)
        accepted.append(st.combined.accepted_draft_tokens)
        forks[0].advance_epoch()   # one shared drafter: advance it once
    assert accepted[1] > 0, accepted
    # Epoch 2 placed by LPT on the history's predicted lengths.
    pred = forks[0].predicted_lengths(reqs)
    assert (pred >= 0).all()
    assert st.assignment == assign_lpt(pred, N)
    lpt_ms = max(assignment_loads(assign_lpt(pred, N), pred))
    assert lpt_ms <= max(assignment_loads(assign_contiguous(len(reqs), N), pred))

    # Skewed lengths sorted longest first: contiguous piles the long ones on device 0.
    skewed = sorted([1000, 900, 800, 700] + [50, 40, 30, 20, 10, 5, 5, 5] * N, reverse=True)
    lpt_ms = max(assignment_loads(assign_lpt(skewed, N), skewed))
    cont_ms = max(assignment_loads(assign_contiguous(len(skewed), N), skewed))
    assert lpt_ms < cont_ms, (lpt_ms, cont_ms)
    report.update(accepted=accepted, lpt_ms=lpt_ms, cont_ms=cont_ms)
    print("RESULT " + json.dumps(report))
''')


@pytest.fixture(scope="module", autouse=True)
def forced_device_runs():
    """Both checks start with the module's first test and run while the in-process tests do
    (they are mostly XLA compiles); the last tests collect them."""
    procs = {}
    for N in (2, 4):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N}",
                   JAX_PLATFORMS="cpu")
        procs[N] = subprocess.Popen([sys.executable, "-c", MULTI_DEVICE_CHECK, str(N)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


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


def test_two_engines_on_one_device_in_threads_are_token_identical():
    """Threads, id mapping and the shared drafter without forced devices: two engines on the
    same device. The real multi-device runs are in the subprocess tests below."""
    params = tiny_params(CFG)
    dev = jax.devices()[0]
    eng = Engine(CFG, params, eos_token_ids=[1], engine_config=SMALL, device=dev)
    reqs = _requests(n_problems=4, group=2)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=16)
    base, _ = eng.generate(reqs, sampling)
    # Placing an engine on a device changes no token (vs JAX's default placement).
    plain = Engine(CFG, params, eos_token_ids=[1], engine_config=SMALL)
    assert plain.generate(reqs[:1], sampling)[0][0].token_ids == base[0].token_ids
    forks = Rollout(eng, sampling=sampling).forks([dev, dev])
    out, st = generate_data_parallel(forks, reqs, assignment="contiguous")
    assert [o.token_ids for o in out] == [o.token_ids for o in base]
    assert [o.request for o in out] == reqs
    assert st.assignment == assign_contiguous(len(reqs), 2) and all(st.device_forward_passes)
    das = DASSection(policy=DASConfig(min_history=4, unlimited=True),
                     cost_model=CostModelConfig(calibrate=False))
    template = Rollout(eng, "das", das, sampling)
    forks = template.forks([dev, dev])
    assert forks[0].drafter is forks[1].drafter is template.drafter     # one locked drafter
    assert isinstance(template.drafter, LockedDrafter)
    assert forks[0].policy is not forks[1].policy
    accepted = 0
    for _ in range(2):
        out, st = generate_data_parallel(forks, reqs)
        assert [o.token_ids for o in out] == [o.token_ids for o in base]
        accepted += st.combined.accepted_draft_tokens
        template.advance_epoch()
    assert accepted > 0
    assert st.combined.forward_passes == sum(st.device_forward_passes)
    assert st.makespan_s == max(st.device_wall_s) == st.combined.wall_s
    assert set(st.to_dict()) >= {"makespan_s", "makespan_forward_passes", "device_tokens"}


def test_bad_input_fails_before_threads():
    params = tiny_params(CFG)
    eng = Engine(CFG, params, engine_config=EngineConfig(max_slots=2, max_cache_len=64))
    sp = SamplingParams(max_new_tokens=4)
    r = Rollout(eng, sampling=sp)
    with pytest.raises(GenerateError, match="at least one rollout"):
        generate_data_parallel([], [Request((2,))])
    with pytest.raises(GenerateError, match="no requests"):
        generate_data_parallel([r], [])
    with pytest.raises(GenerateError, match="unknown assignment"):
        generate_data_parallel([r], [Request((2,))], assignment="random")
    with pytest.raises(GenerateError, match="exactly once"):
        generate_data_parallel([r, r], [Request((2,))] * 2, assignment=[[0], [0]])
    with pytest.raises(GenerateError, match="one entry per request"):
        generate_data_parallel([r], [Request((2,))], predicted_lengths=[1, 2])
    assert eng._compiled.compile_s == 0.0


@pytest.mark.parametrize("N", [2, 4])
def test_forced_host_devices_token_identity_and_placement(forced_device_runs, N):
    stdout, stderr = forced_device_runs[N].communicate(timeout=300)
    assert forced_device_runs[N].returncode == 0, stdout[-3000:] + stderr[-5000:]
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["lpt_ms"] < result["cont_ms"]
    assert result["accepted"][1] > 0
