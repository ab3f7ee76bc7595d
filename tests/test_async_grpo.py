"""Asynchronous GRPO (`train.async_steps`): the schedule of policy versions, the truncated
importance-sampling loss against a reference written here, resume with rollouts generated
ahead, and a synchronous run left bit for bit as it was.

Tiny random model, a character-level tokenizer and a parity reward (tests/test_trainer.py).
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.config import ConfigError, config_from_dict
from das_jax.models.transformer import forward
from test_trainer import CFG, flat, make_config, make_trainer


def _host_copy(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


def test_async_steps_zero_is_the_synchronous_loop(tmp_path):
    runs = []
    for extra in ({}, {"async_steps": 0}):
        trainer = make_trainer(make_config(tmp_path / str(len(runs)), steps=3, **extra))
        assert trainer.async_rollouts is None
        records = trainer.train(progress=False)
        runs.append((records, flat(trainer.params)))
    (r0, p0), (r1, p1) = runs
    np.testing.assert_array_equal(p0, p1)
    drop = {"rollout_s", "generation_s", "compile_s", "prefill_s", "decode_s", "draft_s",
            "policy_s", "host_s", "overlap_s", "train_s", "step_s", "jit_compile_s",
            "jit_compiles"}   # wall times and compiles (the second run finds them cached)
    assert [{k: v for k, v in r.items() if k not in drop} for r in r0] == \
           [{k: v for k, v in r.items() if k not in drop} for r in r1]
    assert "version_lag" not in r0[0]   # the synchronous records are unchanged


@pytest.mark.parametrize("old_logprobs, async_steps", [("recompute", 1), ("rollout", 1),
                                                       ("rollout", 2)])
def test_async_loss_is_the_off_policy_grpo_loss(tmp_path, old_logprobs, async_steps):
    """Every step's loss equals the truncated-IS GRPO loss computed here from the recorded
    behaviour log-probs and the pre-update params (dapo, beta 0, one iteration), whether the
    trainer recomputes the pre-update log-probs or the train step takes them from its own
    forward pass (`rollout`: the decoupled objective); so do the importance-weight metrics."""
    cap = 1.5   # low enough that some weights are truncated
    cfg = make_config(tmp_path, steps=4, save_every=0, async_steps=async_steps)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(
        cfg.grpo, importance_sampling_cap=cap, old_logprobs=old_logprobs, num_iterations=1))
    trainer = make_trainer(cfg)
    assert (trainer.train_step.loss_and_grad.loss_config.decoupled_is_cap ==
            (cap if old_logprobs == "rollout" else None))
    seen = []   # per step: (behaviour version, rollout batch, params before the update)
    take, step_fn = trainer.async_rollouts.take, trainer.train_step

    def recording_take(step):
        vb, waited = take(step)
        seen.append([vb.version, vb.batch])
        return vb, waited

    def recording_step(params, opt_state, batch):
        seen[-1].append(_host_copy(params))   # the update donates params
        return step_fn(params, opt_state, batch)

    trainer.async_rollouts.take, trainer.train_step = recording_take, recording_step
    records = trainer.train(progress=False)
    versions = [max(s - async_steps, 0) for s in range(4)]   # step s + 1 samples version s - k
    assert [r["policy_version"] for r in records] == versions
    assert [r["version_lag"] for r in records] == [s - v for s, v in enumerate(versions)]
    assert max(r["version_lag"] for r in records) == async_steps   # never more than async_steps
    T = cfg.rollout.temperature
    logits_fn = jax.jit(lambda p, t, q: forward(CFG, p, t, q)[0])
    truncated = 0
    for record, (version, rb, params) in zip(records, seen):
        prompts = [list(p) for p in rb.prompt_ids]
        L = max(len(p) + len(o.token_ids) for p, o in zip(prompts, rb.outputs))
        tokens = np.zeros((len(prompts), L), np.int32)
        for b, (p, o) in enumerate(zip(prompts, rb.outputs)):
            tokens[b, :len(p) + len(o.token_ids)] = p + list(o.token_ids)
        positions = np.broadcast_to(np.arange(L), tokens.shape).astype(np.int32)
        logits = logits_fn(params, tokens, positions)
        logp_all = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / T, -1))
        adv = np.asarray(trainer.advantage_fn(jnp.asarray(rb.rewards), cfg.grpo))
        num, count, ws, raws = 0.0, 0, [], []
        for b, (p, o) in enumerate(zip(prompts, rb.outputs)):
            for j, (tok, behaviour) in enumerate(zip(o.token_ids, o.logprobs)):
                t = len(p) + j                       # target position; predicted at t - 1
                old = logp_all[b, t - 1, tok]        # pre-update params
                w = min(np.exp(old - behaviour), cap)
                truncated += np.exp(old - behaviour) > cap
                ws.append(w)
                raws.append(np.exp(old - behaviour))
                num += -w * adv[b]                   # ratio 1 at the pre-update params
                count += 1
        assert record["loss"] == pytest.approx(num / count, abs=1e-6), record["step"]
        assert record["is_weight_mean"] == pytest.approx(np.mean(ws), abs=1e-5)
        assert record["is_weight_max"] == pytest.approx(np.max(raws), rel=1e-4)
        assert record["is_truncated_fraction"] == pytest.approx(np.mean(np.array(raws) > cap),
                                                                abs=1e-6)
        assert record["clip_fraction"] == 0.0        # the ratio is 1 at the pre-update params
    assert truncated > 0                             # the cap was exercised
    assert all(r["dropped_groups"] == 0 for r in records)


def test_async_resume_equals_uninterrupted(tmp_path):
    full = make_trainer(make_config(tmp_path / "a", steps=4, save_every=2, async_steps=1))
    full_records = full.train(progress=False)
    cfg = make_config(tmp_path / "b", steps=4, save_every=2, async_steps=1)
    first = make_trainer(cfg)
    first.train(progress=False, stop_after=2)        # stops after step 2's checkpoint
    resumed = make_trainer(cfg)
    records = resumed.train(resume=True, progress=False)
    assert [r["step"] for r in records] == [3, 4]
    # step 3 was generated ahead before the checkpoint (version 1) and restored, not redone
    assert [r["policy_version"] for r in records] == [1, 2]
    assert [r["loss"] for r in records] == [r["loss"] for r in full_records[2:]]
    np.testing.assert_array_equal(flat(resumed.params), flat(full.params))
    lines = (tmp_path / "b" / "run-none" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_a_stale_batch_is_dropped_and_generated_again(tmp_path):
    """A run saved with async_steps 2 and resumed with 1: the restored batch two versions old
    is dropped (counted), and the step samples from the current params instead."""
    cfg2 = make_config(tmp_path, steps=4, save_every=2, async_steps=2)
    make_trainer(cfg2).train(progress=False, stop_after=2)
    cfg1 = make_config(tmp_path, steps=4, save_every=2, async_steps=1)
    records = make_trainer(cfg1).train(resume=True, progress=False)
    # the saved steps 3 and 4 sampled from versions 0 and 1: both 2 versions old when taken
    assert [r["dropped_groups"] for r in records] == [2, 2]   # prompts_per_step groups each
    assert [r["policy_version"] for r in records] == [2, 3]
    assert [r["version_lag"] for r in records] == [0, 0]


@pytest.mark.parametrize("key, value, match", [
    ("train.async_steps", -1, "train.async_steps must be >= 0"),
    ("grpo.importance_sampling_cap", 0.5, "grpo.importance_sampling_cap must be >= 1"),
])
def test_bad_async_settings_are_one_line_errors(tmp_path, key, value, match):
    section, name = key.split(".")
    raw = {"output_dir": str(tmp_path), section: {name: value}}
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


# ------------------------------------------------------------------ kill -9 and --resume
# Each point: (where the process kills itself, at which 0-based train step). Checkpoints are
# written after steps 2 and 4 (save_every 2), so every kill resumes from one of them.
KILL_POINTS = {
    "rollout-ahead": ("rollout", 3),        # on the worker, generating step 3 during update 2
    "update": ("update", 2),               # inside the optimizer step of step 2
    "logged": ("logged", 3),               # step 3 written to metrics.jsonl, not checkpointed
    "checkpoint": ("save", 4),             # at the save after step 4 (after the drain)
    "after-checkpoint": ("take", 2),       # right after the checkpoint of step 2
}
KILL_STEPS = 5


def _kill_config(run_dir):
    return make_config(run_dir, steps=KILL_STEPS, save_every=2, async_steps=1)


def _run_and_kill(run_dir: str, point: str, at: int) -> None:
    """The child process: trains until `point` at step `at`, then kills itself (SIGKILL)."""
    import os
    import signal

    from das_jax.rl import checkpoint as ckpt
    from das_jax.rl import run_log

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    from pathlib import Path
    trainer = make_trainer(_kill_config(Path(run_dir)))
    if point == "rollout":
        orig_generate = trainer.generate

        def generate(step, params=None, progress=None, **kw):
            if step == at:
                die()
            return orig_generate(step, params, progress, **kw)
        trainer.generate = generate
    elif point == "update":
        orig_step = trainer.train_step

        def train_step(params, opt_state, batch):
            if trainer.step == at:
                die()
            return orig_step(params, opt_state, batch)
        trainer.train_step = train_step
    elif point == "logged":
        orig_log = run_log.RunLogger.log

        def log(self, record, samples=None):
            orig_log(self, record, samples)   # written and flushed
            if record["step"] == at:
                die()
        run_log.RunLogger.log = log
    elif point == "save":
        orig_save = ckpt.CheckpointManager.save

        def save(self, step, *a, **k):
            if step == at:
                die()
            return orig_save(self, step, *a, **k)
        ckpt.CheckpointManager.save = save
    elif point == "take":
        orig_take = trainer.async_rollouts.take

        def take(step):
            if step == at:
                die()
            return orig_take(step)
        trainer.async_rollouts.take = take
    trainer.train(progress=False)
    raise SystemExit("the kill point was never reached")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = make_trainer(_kill_config(tmp_path_factory.mktemp("full")))
    records = trainer.train(progress=False)
    return records, flat(trainer.params)


@pytest.mark.parametrize("name", list(KILL_POINTS))
def test_kill_9_and_resume_loses_and_repeats_no_step(tmp_path, uninterrupted, name):
    import os
    import subprocess
    import sys
    from pathlib import Path

    point, at = KILL_POINTS[name]
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, test_async_grpo as t; "
         "t._run_and_kill(sys.argv[1], sys.argv[2], int(sys.argv[3]))",
         str(tmp_path), point, str(at)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    resumed = make_trainer(_kill_config(tmp_path))
    records = resumed.train(resume=True, progress=False)
    full_records, full_params = uninterrupted
    lines = (tmp_path / "run-none" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines]
    assert steps == list(range(1, KILL_STEPS + 1))           # each step once, none lost
    first = records[0]["step"]
    assert [r["loss"] for r in records] == [r["loss"] for r in full_records[first - 1:]]
    assert [r["policy_version"] for r in records] == \
           [r["policy_version"] for r in full_records[first - 1:]]
    np.testing.assert_array_equal(flat(resumed.params), full_params)


# ------------------------------------------------------------------ disaggregated placement
def _run_disaggregated(run_dir: str) -> None:
    """The child process (2 forced host devices): an async run that trains on device 0 and
    generates on device 1; writes its records, its params and where things ran."""
    from pathlib import Path
    run_dir = Path(run_dir)
    cfg = _kill_config(run_dir)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rollout_devices=1))
    trainer = make_trainer(cfg)
    records = trainer.train(progress=False)
    placed = {"engine": trainer.rollouts.engine.device.id,
              "master": sorted({d.id for x in jax.tree_util.tree_leaves(trainer.params)
                                for d in x.devices()}),
              "mesh": trainer.mesh is not None}
    from das_jax.plan import plan_in_process
    p = plan_in_process(cfg, 2, int(1e9), model_config=CFG)
    plan = {"rows": p.rows, "phases": p.phases, "shapes": p.shapes}
    (run_dir / "child.json").write_text(json.dumps({"records": records, "placed": placed,
                                                    "plan": plan}))
    np.save(run_dir / "params.npy", flat(trainer.params))


def test_disaggregated_rollout_device_gives_the_colocated_run(tmp_path, uninterrupted):
    """mesh.rollout_devices: 1 on two devices: the rollouts run on the second device, the
    update on the first, concurrently; the run is the one-device asynchronous run (same
    version schedule, same tokens)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(here.parent), str(here),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, test_async_grpo as t; "
         "t._run_disaggregated(sys.argv[1])", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads((tmp_path / "child.json").read_text())
    assert child["placed"] == {"engine": 1, "master": [0], "mesh": False}
    # the memory plan: a rollout device holds the compute params and the engine, no train state
    plan = child["plan"]
    rows = plan["rows"]
    assert plan["phases"]["rollout"] == rows["params"] + rows["kv_cache"] + rows["rollout_scratch"]
    assert plan["shapes"]["rollout_devices"] == 1 and plan["shapes"]["mesh"] == "1"
    assert "train+rollout" not in plan["phases"]
    full_records, full_params = uninterrupted
    recs = child["records"]
    # the same tokens and rewards; the log-probs of another device's XLA:CPU threads round
    # differently (the importance weights are 1 +- 1e-7): the loss by as much, the params by
    # what Adam makes of it (lr 3e-3 on gradients near 0)
    assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in full_records]
    assert [r["policy_version"] for r in recs] == [r["policy_version"] for r in full_records]
    np.testing.assert_allclose([r["loss"] for r in recs], [r["loss"] for r in full_records],
                               atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "params.npy"), full_params, atol=1e-4)


def test_rollout_devices_that_leave_none_to_train_is_a_one_line_error(tmp_path):
    from das_jax.rl.trainer import TrainError
    cfg = make_config(tmp_path, async_steps=1)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rollout_devices=1))
    with pytest.raises(TrainError, match="mesh.rollout_devices=1 leaves no device to train on"):
        make_trainer(cfg)


def test_memory_plan_of_a_colocated_async_run_counts_both_sides():
    """Colocated, the update runs beside a rollout: the plan adds a phase holding the train
    peak, the KV cache, the engine's scratch and one params snapshot per step ahead."""
    from das_jax.plan import plan_in_process
    base = {"rollout": {"max_new_tokens": 16, "max_slots": 4, "max_cache_len": 64,
                        "draft_widths": [1, 4]},
            "grpo": {"num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 2}}
    sync = plan_in_process(config_from_dict(base), 1, int(1e9), model_config=CFG)
    for k in (1, 2):
        cfg = config_from_dict(base, [f"train.async_steps={k}"])
        p = plan_in_process(cfg, 1, int(1e9), model_config=CFG)
        train_peak = max(v for name, v in p.phases.items() if name in ("train", "update"))
        assert p.phases["train+rollout"] == (train_peak + k * p.rows["params"]
                                             + p.rows["kv_cache"] + p.rows["rollout_scratch"])
        assert p.peak == p.phases["train+rollout"] > sync.peak
        small = plan_in_process(cfg, 1, (sync.peak + p.peak) // 2, model_config=CFG)
        assert not small.fits and "mesh.rollout_devices" in small.advice(cfg)
        # taking turns (async_overlap: false): the update beside the snapshots, no rollout
        turns = config_from_dict(base, [f"train.async_steps={k}", "train.async_overlap=false"])
        q = plan_in_process(turns, 1, int(1e9), model_config=CFG)
        assert "train+rollout" not in q.phases
        assert q.phases["train+snapshots"] == train_peak + k * q.rows["params"]
        assert q.phases["train+snapshots"] < p.phases["train+rollout"]


def test_close_with_cancel_stops_a_running_rollout(tmp_path):
    """On an error or Ctrl-C the loop closes the worker with cancel=True: the running rollout
    stops at its next finished request instead of running to its end."""
    import threading

    from das_jax.rl.async_rollouts import RolloutCancelled

    trainer = make_trainer(make_config(tmp_path, steps=3, async_steps=1))
    started, calls = threading.Event(), [0]

    def endless_generate(requests, params, sampling, progress=None):
        for i in range(10 ** 6):      # ~1000 s if nothing stops it
            progress(i, 10 ** 6)
            calls[0] += 1
            started.set()
            threading.Event().wait(0.001)
        raise AssertionError("never cancelled")

    trainer.rollouts.generate = endless_generate
    ahead = trainer.async_rollouts
    ahead.schedule()
    futures = list(ahead._pending.values())
    assert started.wait(60)
    ahead.close(cancel=True)
    assert calls[0] < 10 ** 6
    ran = [f for f in futures if not f.cancelled()]   # the others never started
    assert len(ran) == 1 and isinstance(ran[0].exception(), RolloutCancelled)


def test_rewards_of_an_async_run_are_computed_on_the_main_thread(tmp_path):
    """Reward functions may need the main thread (math-verify's timeouts are signals): the
    worker only generates, the batch is scored when the update takes it."""
    import threading

    from test_trainer import even_char_reward

    threads = []

    def reward(prompts, completions, **kw):
        threads.append(threading.current_thread() is threading.main_thread())
        return even_char_reward(prompts, completions, **kw)

    trainer = make_trainer(make_config(tmp_path, steps=3, save_every=0, async_steps=1),
                           reward=reward)
    records = trainer.train(progress=False)
    assert len(threads) == 3 and all(threads)
    assert all(r["reward_mean"] > 0 for r in records)


@pytest.mark.parametrize("async_steps", [0, 1])
def test_the_drafter_history_is_tagged_with_the_sampling_policy_version(tmp_path, async_steps):
    """Each rollout the drafter indexes carries the version of the params that sampled it (the
    step in a synchronous run, max(step - k, 0) in an asynchronous one), so DAS's calibration
    sees how old the history it drafts from is."""
    trainer = make_trainer(make_config(tmp_path, "das", steps=4, save_every=0,
                                       async_steps=async_steps))
    records = trainer.train(progress=False)
    history = trainer.rollouts.drafter.history
    versions = sorted(v for p in history.problems() for v in history.versions(p))
    rows = 2 * 4     # prompts_per_step x num_generations
    assert versions == sorted(r["policy_version"] if async_steps else r["step"] - 1
                              for r in records for _ in range(rows))
    assert history.policy_version == (2 if async_steps else 3)
    assert trainer.rollouts.policy.support_by_age.shape == (6, 6)


def _timed_spans(trainer):
    import time
    spans = {"generate": [], "update": []}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[name].append((t0, time.perf_counter()))
        return wrapper
    trainer.generate = timed("generate", trainer.generate)
    trainer.update = timed("update", trainer.update)
    return spans


def test_colocated_with_async_overlap_false_a_rollout_and_an_update_never_run_at_once(
        tmp_path):
    """`train.async_overlap: false`: a colocated asynchronous run lets a whole rollout and a
    whole update take turns (`device_lock`); the versions stay those of the schedule, and the
    run equals the overlapping one (default) in everything but its times."""
    import threading

    from das_jax.rl.async_rollouts import AsyncRollouts
    overlap = make_trainer(make_config(tmp_path / "overlap", steps=4, save_every=0,
                                       async_steps=1))
    assert not isinstance(overlap.async_rollouts.device_lock, type(threading.Lock()))
    overlap_spans = _timed_spans(overlap)
    overlap_records = overlap.train(progress=False)
    cfg = make_config(tmp_path / "turns", steps=4, save_every=0, async_steps=1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, async_overlap=False))
    trainer = make_trainer(cfg)
    assert isinstance(trainer.async_rollouts.device_lock, type(threading.Lock()))
    spans = _timed_spans(trainer)
    records = trainer.train(progress=False)
    assert [r["policy_version"] for r in records] == [0, 0, 1, 2]
    assert len(spans["generate"]) == 4 and len(spans["update"]) == 4
    for g0, g1 in spans["generate"]:
        for u0, u1 in spans["update"]:
            assert g1 <= u0 or u1 <= g0, (spans, "a rollout overlapped an update")
    # overlapping: the same steps (versions, tokens, rewards, losses), and the rollouts of the
    # steps ahead ran during updates
    for key in ("policy_version", "reward_mean", "generated_tokens", "loss", "grad_norm"):
        assert [r[key] for r in overlap_records] == [r[key] for r in records], key
    assert any(g0 < u1 and u0 < g1 for g0, g1 in overlap_spans["generate"]
               for u0, u1 in overlap_spans["update"]), overlap_spans
    # elsewhere (a rollout engine with devices of its own) the lock is a no-op
    free = AsyncRollouts(trainer, 1, 4, serialize=False)
    with free.device_lock:
        with free.device_lock:    # not a lock: re-entering does not block
            pass
