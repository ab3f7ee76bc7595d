"""The trainer loop keeps runs safe: save_every 0, resume of a finished run and its extension,
a corrupt latest checkpoint, a full disk while checkpointing, a NaN loss.

A tiny random model and character tokenizer (from test_trainer); every run here has the same
shapes, so jit compiles once per module.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import pytest

from das_jax.config import config_from_dict
from das_jax.errors import user_error_message
from das_jax.models import init_params
from das_jax.rl import run_dir as rd
from das_jax.rl.trainer import GRPOTrainer, TrainError
from test_trainer import CFG, PROBLEMS, CharTokenizer, even_char_reward


def config(run_dir, steps=2, save_every=1):
    return config_from_dict({
        "output_dir": str(run_dir), "drafter": "none",
        "data": {"kind": "arithmetic", "chat": False, "instruction": ""},
        "rollout": {"max_new_tokens": 4, "max_slots": 4, "max_cache_len": 64,
                    "draft_widths": [1]},
        "grpo": {"num_generations": 2, "prompts_per_step": 1, "micro_batch_size": 2,
                 "learning_rate": 1e-3},
        "train": {"steps": steps, "save_every": save_every},
    })


def trainer(cfg, params=None):
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5) if params is None else params
    return GRPOTrainer(cfg, model=(CFG, params, CharTokenizer()), problems=PROBLEMS,
                       reward_fns=[even_char_reward])


def steps_logged(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    run = tmp_path_factory.mktemp("base") / "run"
    trainer(config(run)).train(progress=False)
    assert rd.checkpoint_steps(run) == [1, 2]
    return run


def copy_run(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def test_save_every_zero_disables_saving(tmp_path):
    run = tmp_path / "run"
    records = trainer(config(run, steps=1, save_every=0)).train(progress=False)
    assert [r["step"] for r in records] == [1]
    assert rd.checkpoint_steps(run) == [] and steps_logged(run) == [1]


def test_resume_of_a_finished_run_and_its_extension(finished_run, tmp_path, caplog):
    run = copy_run(finished_run, tmp_path)
    with caplog.at_level(logging.WARNING, logger="das_jax.train"):
        assert trainer(config(run, steps=2)).train(resume=True, progress=False) == []
    assert "is complete: its latest checkpoint is step 2" in caplog.text
    assert f"--resume {run} --set train.steps=N with N > 2" in caplog.text
    records = trainer(config(run, steps=3)).train(resume=True, progress=False)
    assert [r["step"] for r in records] == [3]
    assert steps_logged(run) == [1, 2, 3] and rd.checkpoint_steps(run) == [1, 2, 3]


def _corrupt(step_dir):
    """Overwrites every file of a checkpoint with garbage of the same size."""
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage" * (f.stat().st_size // 8 + 1))


def test_corrupt_latest_checkpoint_falls_back_to_the_newest_readable(finished_run, tmp_path,
                                                                      caplog):
    run = copy_run(finished_run, tmp_path)
    _corrupt(run / "checkpoints" / "2")
    t = trainer(config(run, steps=2))
    with caplog.at_level(logging.WARNING, logger="das_jax.train"):
        records = t.train(resume=True, progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "das_jax.train"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("checkpoint step 2 is unreadable (")
    assert "resuming from step 1, the newest readable checkpoint" in warnings[0]
    assert [r["step"] for r in records] == [2]            # step 2 redone from step 1
    assert rd.checkpoint_steps(run) == [1, 2]             # and saved again
    assert (run / "checkpoints.unreadable" / "2").is_dir()  # the corrupt one kept aside
    assert steps_logged(run) == [1, 2]


def test_no_readable_checkpoint_is_one_clear_error(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    for s in (1, 2):
        _corrupt(run / "checkpoints" / str(s))
    with pytest.raises(TrainError, match="no readable checkpoint under .*: all of steps 2, 1 are "
                                         "corrupt") as e:
        trainer(config(run, steps=3)).train(resume=True, progress=False)
    assert "\n" not in str(e.value)


def test_disk_full_while_checkpointing_says_so(tmp_path, monkeypatch):
    from das_jax.rl import checkpoint

    def full(self, directory, args):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "x.npz"))
    monkeypatch.setattr(checkpoint.StateCheckpointHandler, "save", full)
    run = tmp_path / "run"
    with pytest.raises(TrainError) as e:
        trainer(config(run, steps=1)).train(progress=False)
    msg = str(e.value)
    assert msg.startswith(f"disk full while checkpointing step 1 to {run.absolute()}/"
                          "checkpoints/1; free space on that disk")
    assert msg.endswith("start it again with --overwrite (it has no earlier checkpoint)")
    assert user_error_message(e.value) == msg        # the CLI prints it as is, one line
    assert steps_logged(run) == [1]                  # the step's metrics were kept
    assert rd.checkpoint_steps(run) == []


def test_a_nan_loss_stops_the_run_before_logging_or_saving(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    params = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), params)
    run = tmp_path / "run"
    with pytest.raises(TrainError, match=r"step 1: loss is nan, so the model's logits or the "
                                         r"update overflowed") as e:
        trainer(config(run, steps=2), params=params).train(progress=False)
    assert "no checkpoint was written" in str(e.value)
    assert (run / "metrics.jsonl").read_text() == "" and rd.checkpoint_steps(run) == []


def test_an_update_that_overflows_stops_the_run_before_saving(tmp_path):
    """A finite loss and gradient but an update that overflows (a learning rate of 1e38: the
    step's parameters become +-inf or NaN) stops the run at that step: nothing of it is logged
    and no checkpoint holds the overflowed parameters."""
    run = tmp_path / "run"
    cfg = config(run, steps=2)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, learning_rate=1e38))
    with pytest.raises(TrainError, match=r"step 1: update_norm is (inf|nan), so the model's "
                                         r"logits or the update overflowed") as e:
        trainer(cfg).train(progress=False)
    assert "no checkpoint was written" in str(e.value)
    assert (run / "metrics.jsonl").read_text() == "" and rd.checkpoint_steps(run) == []
