"""Orbax checkpoints: round trip, max_to_keep, atomicity, mismatch and corruption errors."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from das_jax.models import ModelConfig, init_params
from das_jax.rl import CheckpointError, CheckpointManager

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
    (mngr.directory / "1" / "drafter" / "drafter_state.pkl").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"failed to restore checkpoint .*checkpoints/1"):
        mngr.restore(1, small, small_opt)
    mngr.close()


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
