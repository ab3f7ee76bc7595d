"""Orbax checkpoints: round trip, max_to_keep, atomicity, mismatch and corruption errors."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from das_jax.models import ModelConfig, init_params
from das_jax.rl import CheckpointError, CheckpointManager, checkpoint_checksums

CFG = ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8)


def _params(config, seed=0):
    """`init_params`' tree (eval_shape, no compile) with numpy values: fast on 2 cores."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: init_params(config, k), jax.random.PRNGKey(0))
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), shapes)


@pytest.fixture(scope="module")
def state():
    params = _params(CFG)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    rng = np.random.default_rng(1)
    # non-trivial mu / nu / count without running (compiling) an update
    opt_state = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape) if x.dtype == jnp.float32
                              else np.full(x.shape, 7), x.dtype), opt.init(params))
    return params, opt_state


def _assert_tree_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip(tmp_path, state):
    params, opt_state = state
    drafter = {"trees": {3: [1, 2, 3]}, "epoch": 7, "blob": np.arange(5)}
    key = jax.random.key(42)
    with CheckpointManager(tmp_path) as mngr:
        assert mngr.latest_step() is None
        path = mngr.save(5, params, opt_state, {"data_position": 12, "seed": 0}, drafter,
                         rng_key=key)
        assert path.is_dir() and mngr.latest_step() == 5
    with CheckpointManager(tmp_path) as mngr:  # a fresh manager (a resumed run)
        p, s, meta, d = mngr.restore(params_like=params, opt_state_like=opt_state)
    _assert_tree_equal(p, params)
    _assert_tree_equal(s, opt_state)
    assert meta["step"] == 5 and meta["data_position"] == 12 and meta["seed"] == 0
    assert jnp.array_equal(jax.random.key_data(meta["rng_key"]), jax.random.key_data(key))
    assert d["trees"] == {3: [1, 2, 3]} and d["epoch"] == 7
    np.testing.assert_array_equal(d["blob"], np.arange(5))


def test_restore_abstract_targets_and_none_drafter(tmp_path, state):
    params, opt_state = state
    mngr = CheckpointManager(tmp_path)
    mngr.save(1, params, opt_state, {"x": [1, 2]}, rng_key=jax.random.PRNGKey(3))
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      (params, opt_state))
    p, s, meta, d = mngr.restore(1, *abstract)
    _assert_tree_equal(p, params)
    _assert_tree_equal(s, opt_state)
    assert d is None and meta["x"] == [1, 2]
    np.testing.assert_array_equal(np.asarray(meta["rng_key"]), np.asarray(jax.random.PRNGKey(3)))
    with pytest.raises(CheckpointError, match="already exists"):
        mngr.save(1, params, opt_state, {})
    with pytest.raises(CheckpointError, match="JSON"):
        mngr.save(2, params, opt_state, {"bad": object()})
    mngr.close()


def test_latest_step_with_max_to_keep(tmp_path, state):
    params, opt_state = state
    small = {"w": jnp.ones(3)}
    small_opt = optax.sgd(0.1).init(small)
    del params, opt_state
    with CheckpointManager(tmp_path, max_to_keep=2) as mngr:
        for step in (2, 4, 6, 8):
            mngr.save(step, jax.tree_util.tree_map(lambda x: x * step, small), small_opt,
                      {"step_seen": step})
        assert mngr.all_steps() == [6, 8] and mngr.latest_step() == 8
        p, _, meta, _ = mngr.restore(6, small, small_opt)
        np.testing.assert_array_equal(np.asarray(p["w"]), 6.0)
        assert meta["step_seen"] == 6
        with pytest.raises(CheckpointError,
                           match=r"no checkpoint for step 2 .*available steps: \[6, 8\]"):
            mngr.restore(2, small, small_opt)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, state):
    """A save killed mid-way leaves only orbax's temporary directory, never a half `<step>`."""
    small = {"w": jnp.arange(4.0)}
    small_opt = optax.sgd(0.1).init(small)
    mngr = CheckpointManager(tmp_path)
    mngr.save(3, small, small_opt, {"k": 1})
    mngr.close()
    # simulate a crash during the save of step 4: orbax writes into `<step>.orbax-checkpoint-tmp*`
    tmp = mngr.directory / "4.orbax-checkpoint-tmp-1234"
    shutil.copytree(mngr.directory / "3", tmp)
    (tmp / "commit_success.txt").unlink(missing_ok=True)
    mngr = CheckpointManager(tmp_path)
    assert mngr.latest_step() == 3
    p, _, meta, _ = mngr.restore(None, small, small_opt)
    assert meta["k"] == 1 and meta["step"] == 3
    mngr.close()


def test_mismatched_model_gives_clear_error(tmp_path, state):
    params, opt_state = state
    mngr = CheckpointManager(tmp_path)
    mngr.save(1, params, opt_state, {})
    bigger = ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=32, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    other = _params(bigger)
    with pytest.raises(CheckpointError) as e:
        mngr.restore(1, other, optax.chain(optax.clip_by_global_norm(1.0),
                                           optax.adamw(1e-3)).init(other))
    msg = str(e.value)
    assert str(mngr.directory / "1") in msg
    assert "shape mismatch at 'params/layers/w_down'" in msg and "(2, 24, 16)" in msg
    # a different tree (untied lm_head present in the target) names the missing key
    untied = ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="missing in checkpoint: 'params/lm_head'"):
        mngr.restore(1, _params(untied), opt_state)
    # a different optimizer (plain adam without the clip wrapper) is a tree mismatch too
    with pytest.raises(CheckpointError, match="does not match"):
        mngr.restore(1, params, optax.adam(1e-3).init(params))
    mngr.close()


def test_missing_and_corrupt_checkpoints(tmp_path, state):
    small = {"w": jnp.arange(4.0)}
    small_opt = optax.sgd(0.1).init(small)
    mngr = CheckpointManager(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint found in .*empty"):
        mngr.restore(None, small, small_opt)
    mngr.close()
    mngr = CheckpointManager(tmp_path / "run")
    mngr.save(1, small, small_opt, {})
    mngr.save(2, small, small_opt, {})
    shutil.rmtree(mngr.directory / "2" / "state")  # array data gone
    with pytest.raises(CheckpointError, match=r"checkpoint .*run/checkpoints/2"):
        mngr.restore(2, small, small_opt)
    (mngr.directory / "1" / "drafter" / "drafter_state.json").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"drafter/drafter_state.json does not match the "
                                              r"checksum written at save"):
        mngr.restore(1, small, small_opt)
    (mngr.directory / "1" / "checksums.json").unlink()    # as an older version saved it
    with pytest.raises(CheckpointError, match=r"drafter_state.json is not valid JSON"):
        mngr.restore(1, small, small_opt)
    mngr.close()


def _data_files(step_dir):
    return sorted((step_dir / "state").rglob("ocdbt.process_0/d/*"), key=lambda f: -f.stat().st_size)


def test_bytes_changed_on_disk_are_found_before_a_restore(tmp_path, state):
    """A byte flipped inside an array data file (which orbax restores silently as a wrong
    weight), a truncated file and a missing file: `restore` and `restore_params` raise naming
    the file; the untouched checkpoint restores; one without checksums.json (an older save)
    is not verified."""
    params, opt_state = state
    with CheckpointManager(tmp_path, max_to_keep=4) as mngr:
        for step in (1, 2, 3, 4):
            mngr.save(step, params, opt_state, {})
        assert checkpoint_checksums.verify(mngr.step_dir(1))
        big = _data_files(mngr.step_dir(2))[0]
        raw = bytearray(big.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        big.write_bytes(bytes(raw))
        rel = big.relative_to(mngr.step_dir(2)).as_posix()
        for restore in (lambda: mngr.restore(2, params, opt_state),
                        lambda: mngr.restore_params(2)):
            with pytest.raises(CheckpointError, match=rf"checkpoint .*/2 is corrupt: {rel} does "
                               r"not match the checksum written at save \(its CRC-32 differs; "
                               r"1 file\(s\) differ\); its bytes changed on disk after the "
                               r"save: restore the checkpoint from a copy, or remove that "
                               r"step's directory"):
                restore()
        big3 = _data_files(mngr.step_dir(3))[0]
        big3.write_bytes(big3.read_bytes()[:-10])
        with pytest.raises(CheckpointError, match="its size differs"):
            mngr.restore_params(3)
        (mngr.step_dir(4) / "meta" / "metadata").unlink()
        with pytest.raises(CheckpointError, match=r"/4 is corrupt: meta/metadata is missing"):
            mngr.restore(4, params, opt_state)
        p, _, _, _ = mngr.restore(1, params, opt_state)
        _assert_tree_equal(p, params)
        (mngr.step_dir(2) / "checksums.json").unlink()
        assert not checkpoint_checksums.verify(mngr.step_dir(2))
        mngr.restore_params(2)        # not verified: the flipped byte restores (orbax's way)


# ----- the rollout state is data: JSON + npz, never a pickle --------------------------------------

class _RunsCode:
    """Unpickling this touches a marker file (what a hostile checkpoint would do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_rollout_state_round_trips_exactly():
    from das_jax.rl.checkpoint import decode_state, encode_state
    state = {"kind": "suffix", "n": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True),
             "nan": float("nan"), "inf": -float("inf"), "none": None, "empty": {},
             "ints": {3: "a", -1: "b"}, "tuples": {("p", 1): (1, 2.5, "x")}, "__dunder": 1,
             "nested": [[1, [2, np.arange(3, dtype=np.int16)]], {"x": np.zeros((2, 0))}],
             "arrays": [np.arange(6, dtype=np.int32).reshape(2, 3), np.ones(2, np.float64),
                        np.array([1, 0], np.uint8), jnp.arange(3.0)]}
    tree, arrays = encode_state(state)
    import json as _json
    text = _json.dumps(tree, allow_nan=False)      # strict JSON
    out = decode_state(_json.loads(text), {f"a{i}": a for i, a in enumerate(arrays)})
    assert set(out) == set(state)
    assert out["n"] == 3 and type(out["n"]) is int and out["f"] == 0.5 and out["b"] is True
    assert np.isnan(out["nan"]) and out["inf"] == -float("inf") and out["none"] is None
    assert out["empty"] == {} and out["ints"] == {3: "a", -1: "b"} and out["__dunder"] == 1
    assert out["tuples"] == {("p", 1): (1, 2.5, "x")}
    assert out["nested"][0][0] == 1 and out["nested"][0][1][0] == 2
    got = out["nested"][0][1][1]
    assert got.dtype == np.int16 and got.tolist() == [0, 1, 2]
    assert out["nested"][1]["x"].shape == (2, 0)
    for a, b in zip(out["arrays"], state["arrays"]):
        assert a.dtype == np.asarray(b).dtype and np.array_equal(a, np.asarray(b))
    with pytest.raises(CheckpointError, match=r"state.bad\[0\] is a object"):
        encode_state({"bad": [object()]})
    with pytest.raises(CheckpointError, match="object array"):
        encode_state({"bad": np.array([None], dtype=object)})


def test_drafter_and_policy_state_round_trip_through_a_checkpoint(tmp_path):
    """A suffix drafter with history and live requests and a DAS policy with observations come
    back equal, and the restored drafter proposes what the saved one does."""
    from das_jax.drafter import SuffixDrafter
    from das_jax.speculation import DASPolicy
    drafter = SuffixDrafter()
    rid = 0
    for epoch in range(2):
        for pid, toks in (("arith-0-1", [5, 6, 7, 5, 6, 7, 8]), ("arith-0-2", [1, 2, 3, 1, 2])):
            for k in range(2):
                drafter.begin(rid, pid, [9, 9, 5])
                drafter.append(rid, toks[: len(toks) - k])
                if epoch == 0 or k == 0:
                    drafter.end(rid)
                rid += 1
        if epoch == 0:
            drafter.advance_epoch()
    policy = DASPolicy(drafter.lengths)
    policy.finished_lengths.extend([3, 9, 27])
    policy.depth_scale = np.array([0.9, 0.8, 0.7])
    state = {"rollout": {"drafter": drafter.state_dict(), "policy": policy.state_dict()}}
    small = {"w": jnp.arange(4.0)}
    with CheckpointManager(tmp_path) as mngr:
        mngr.save(1, small, optax.sgd(0.1).init(small), {}, state)
        _, _, _, back = mngr.restore(1)
    files = sorted(p.name for p in (tmp_path / "checkpoints" / "1" / "drafter").iterdir()
                   if p.name.startswith("drafter"))
    assert files == ["drafter_state.json", "drafter_state.npz"]
    _assert_state_equal(back, state)
    d2 = SuffixDrafter()
    d2.load_state_dict(back["rollout"]["drafter"])
    _assert_state_equal(d2.state_dict(), drafter.state_dict())
    p2 = DASPolicy(d2.lengths)
    p2.load_state_dict(back["rollout"]["policy"])
    _assert_state_equal(p2.state_dict(), policy.state_dict())
    for rid in drafter.state_dict()["requests"]:
        a, b = drafter.propose(rid[0], 4), d2.propose(rid[0], 4)
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.probs, b.probs)


def _assert_state_equal(a, b):
    assert type(a) is type(b) or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


def test_a_pickled_drafter_state_is_refused_never_unpickled(tmp_path):
    import pickle
    from das_jax.rl.checkpoint import CheckpointFormatError
    small = {"w": jnp.arange(4.0)}
    marker = tmp_path / "pwned"
    with CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, small, optax.sgd(0.1).init(small), {}, {"x": 1})
        d = mngr.directory / "1" / "drafter"
        for f in d.glob("drafter_state.*"):
            f.unlink()
        (d / "drafter_state.pkl").write_bytes(pickle.dumps(_RunsCode(marker)))
        (mngr.directory / "1" / "checksums.json").unlink()   # as an older version saved it
        with pytest.raises(CheckpointFormatError, match=r"drafter state as a pickle "
                           r"\(drafter_state.pkl\).*can run arbitrary code"):
            mngr.restore(1)
        assert not marker.exists()
        # a pickle hidden in the npz (an object array) is not loaded either
        mngr.save(2, small, optax.sgd(0.1).init(small), {}, {"x": np.arange(2)})
        npz = mngr.directory / "2" / "drafter" / "drafter_state.npz"
        np.savez(npz, a0=np.array([_RunsCode(marker)], dtype=object), allow_pickle=True)
        checkpoint_checksums.write(mngr.directory / "2")   # checksums match what is there
        with pytest.raises(CheckpointError, match="drafter_state.npz .*unreadable"):
            mngr.restore(2)
        assert not marker.exists()


def test_a_newer_state_schema_is_refused(tmp_path):
    import json as _json
    from das_jax.rl.checkpoint import CheckpointFormatError
    small = {"w": jnp.arange(4.0)}
    with CheckpointManager(tmp_path) as mngr:
        mngr.save(1, small, optax.sgd(0.1).init(small), {}, {"x": 1})
        path = mngr.directory / "1" / "drafter" / "drafter_state.json"
        head = _json.loads(path.read_text())
        path.write_text(_json.dumps({**head, "version": 99}))
        checkpoint_checksums.write(mngr.directory / "1")   # as that version would save it
        with pytest.raises(CheckpointFormatError, match="schema version 99; this das-jax reads "
                           "versions 1-1"):
            mngr.restore(1)


def test_aborted_save_echoes_are_filtered_other_errors_printed(monkeypatch, capsys):
    """A save aborted by a full disk left orbax's asyncio writers raising "Event loop is
    closed" from tensorstore callbacks (printed through sys.excepthook) and from collected
    coroutines (sys.unraisablehook) after the one-line error; both are dropped, nothing else."""
    import sys
    import types
    from das_jax.rl.checkpoint import _filter_aborted_save_noise
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    passed_on = []
    monkeypatch.setattr(sys, "unraisablehook", passed_on.append)
    _filter_aborted_save_noise()
    _filter_aborted_save_noise()  # installed once
    assert sys.excepthook.__closure__ is not None
    echo = RuntimeError("Event loop is closed")

    def unraisable(exc):
        return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None,
                                     err_msg=None, object="write_fragment")
    sys.excepthook(RuntimeError, echo, None)
    sys.unraisablehook(unraisable(echo))
    assert capsys.readouterr().err == ""
    sys.excepthook(ValueError, ValueError("a real error"), None)
    sys.unraisablehook(unraisable(RuntimeError("another")))
    assert "ValueError: a real error" in capsys.readouterr().err
    assert [str(u.exc_value) for u in passed_on] == ["another"]
