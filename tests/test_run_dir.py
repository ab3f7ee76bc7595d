"""Run-directory lock and foreign-state refusal (das_jax.rl.run_dir); no jax."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from das_jax.rl import run_dir as rd

ROOT = Path(__file__).resolve().parents[1]
HOLDER = ("import sys; from das_jax.rl.run_dir import lock_run_dir\n"
          "with lock_run_dir(sys.argv[1]):\n"
          "    print('locked', flush=True); sys.stdin.readline()\n")


class LockHolder:
    """Another process holding the lock of `path` until `release()` / `kill()`."""

    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def release(self):
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait()


@pytest.fixture
def holder():
    holders = []

    def start(path):
        h = LockHolder(path)
        holders.append(h)
        return h
    yield start
    for h in holders:
        if h.proc.poll() is None:
            h.kill()


def test_second_run_is_refused_and_a_dead_holder_leaves_no_stale_lock(tmp_path, holder):
    run = tmp_path / "run"
    h = holder(run)
    with pytest.raises(rd.RunDirError, match=rf"in use by another run \(pid {h.proc.pid} on "):
        with rd.lock_run_dir(run):
            pass
    h.kill()                                   # killed: the kernel drops its flock
    assert (run / rd.LOCK_FILE).exists()       # the file stays, but is not a lock any more
    with rd.lock_run_dir(run):
        pass
    h2 = holder(run)                           # and a released lock can be taken again
    h2.release()
    with rd.lock_run_dir(run):
        pass


def test_lock_is_reentrant_within_a_process_and_released_at_the_end(tmp_path, holder):
    run = tmp_path / "run"
    with rd.lock_run_dir(run):
        with rd.lock_run_dir(run):             # the trainer re-takes the CLI's lock
            pass
        with pytest.raises(AssertionError):    # still held after the inner block ends
            holder(run)
    holder(run).release()                      # free after the outer block


def test_a_new_directory_left_with_only_the_lock_is_removed(tmp_path, holder):
    """A run refused by a check inside the lock (bad platform, memory plan, --resume of a
    directory without a run) leaves no empty run directory and no lock file behind; one that
    wrote anything, or a directory that existed, stays; a run that started keeps its lock
    file."""
    run = tmp_path / "deep" / "run"
    with pytest.raises(ValueError):
        with rd.lock_run_dir(run):
            assert (run / rd.LOCK_FILE).exists()
            raise ValueError("refused")
    assert not run.exists() and (tmp_path / "deep").is_dir()
    with rd.lock_run_dir(run):
        (run / "config.yaml").write_text("x: 1\n")
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]   # not a run: no lock left
    empty = tmp_path / "empty"
    empty.mkdir()
    with rd.lock_run_dir(empty):
        pass
    assert [p.name for p in empty.iterdir()] == []
    with rd.lock_run_dir(empty):                 # a run that started keeps its lock file
        rd.write_manifest(empty)
    assert sorted(p.name for p in empty.iterdir()) == [rd.LOCK_FILE, rd.MANIFEST_FILE]
    with rd.lock_run_dir(empty):                 # and a lock file that was there stays
        pass
    assert sorted(p.name for p in empty.iterdir()) == [rd.LOCK_FILE, rd.MANIFEST_FILE]
    holder(tmp_path / "other").release()      # another process's new, empty directory too
    assert not (tmp_path / "other").exists()
    with rd.lock_run_dir(tmp_path / "other"):  # and the name can be locked again at once
        assert (tmp_path / "other" / rd.LOCK_FILE).exists()


def test_output_dir_that_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(rd.RunDirError, match="is an existing file, not a directory"):
        with rd.lock_run_dir(f):
            pass
    with pytest.raises(rd.RunDirError, match="cannot create output_dir"):
        with rd.lock_run_dir(f / "sub"):
            pass


def test_a_killed_runs_files_are_not_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rd.write_manifest(run)
    (run / "config.yaml").write_text("seed: 1\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(rd.RunDirError) as e:
        rd.check_new_run(run, has_checkpoint=False)
    msg = str(e.value)
    assert "config.yaml, metrics.jsonl" in msg and "cannot be resumed" in msg
    assert "another output_dir" in msg and "--overwrite" in msg and "\n" not in msg
    with pytest.raises(rd.RunDirError, match=f"pass --resume {run} to continue it"):
        rd.check_new_run(run, has_checkpoint=True)
    rd.check_new_run(run, has_checkpoint=True, overwrite=True)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (run / "notes.txt").write_text("mine")
    (run / "tb").mkdir()
    (run / "tb" / "events.out.tfevents.1.host").write_text("x")
    assert rd.clear_run(run) == ["config.yaml", "metrics.jsonl", "tb/events.out.tfevents.1.host"]
    assert sorted(os.listdir(run)) == ["notes.txt"]   # only the trainer's own files go
    rd.check_new_run(run, has_checkpoint=False)       # an unrelated file is not a run


def test_a_directory_is_a_run_only_with_das_jax_manifest(tmp_path):
    """A user's own config.yaml and plots/ (the current directory, say) are not a previous run:
    a run there is refused, --overwrite or not, and nothing of it is removed."""
    d = tmp_path / "project"
    (d / "plots").mkdir(parents=True)
    (d / "config.yaml").write_text("my: settings\n")
    (d / "plots" / "my_figure.png").write_bytes(b"png")
    assert not rd.is_run(d) and rd.run_files(d) == []
    for overwrite in (False, True):
        with pytest.raises(rd.RunDirError) as e:
            rd.check_new_run(d, has_checkpoint=False, overwrite=overwrite)
        msg = str(e.value)
        assert "holds config.yaml, which no das-jax run wrote there (it has no das-jax-run.json)" \
            in msg and "choose another output_dir" in msg and "--overwrite" not in msg, msg
    assert rd.clear_run(d) == []
    assert (d / "config.yaml").read_text() == "my: settings\n"
    assert (d / "plots" / "my_figure.png").read_bytes() == b"png"
    # plots/ of the user's alone is no clash (the run writes its own names next to them) ...
    (d / "config.yaml").unlink()
    rd.check_new_run(d, has_checkpoint=False)
    # ... but one of das-jax's plot names is
    (d / "plots" / "reward.png").write_bytes(b"mine too")
    with pytest.raises(rd.RunDirError, match="holds plots/reward.png"):
        rd.check_new_run(d, has_checkpoint=False, overwrite=True)


def test_overwrite_removes_only_what_das_jax_wrote(tmp_path):
    run = tmp_path / "run"
    for sub in ("plots", "tb", "checkpoints/3", "checkpoints/4.orbax-checkpoint-tmp-9",
                "checkpoints.unreadable/2.1"):
        (run / sub).mkdir(parents=True)
    rd.write_manifest(run)
    mine = {"config.yaml.bak": "x", "plots/my_figure.png": "fig", "tb/notes.md": "n",
            "checkpoints/README": "r"}
    ours = ["config.yaml", "metrics.jsonl", "samples.jsonl", "plots/reward.png",
            "plots/rollout_time.png", "tb/events.out.tfevents.7.h"]
    for name, text in mine.items():
        (run / name).write_text(text)
    for name in ours:
        (run / name).write_text("das-jax")
    (run / "checkpoints" / "3" / "state").write_text("arrays")
    assert rd.run_files(run) == ["checkpoints", "checkpoints.unreadable", "config.yaml",
                                 "metrics.jsonl", "plots", "samples.jsonl", "tb"]
    removed = rd.clear_run(run)
    assert sorted(removed) == sorted(ours + ["checkpoints/3", "checkpoints/4.orbax-checkpoint-"
                                             "tmp-9", "checkpoints.unreadable/2.1"])
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == sorted(mine)
    assert not (run / "checkpoints.unreadable").exists() and not rd.is_run(run)
    rd.check_new_run(run, has_checkpoint=False)


def test_checkpoint_steps_reads_committed_step_dirs_only(tmp_path):
    ck = tmp_path / "checkpoints"
    assert rd.checkpoint_steps(tmp_path) == []
    for name in ("2", "10", "12.orbax-checkpoint-tmp-1"):
        (ck / name).mkdir(parents=True)
    (ck / "7").write_text("not a dir")
    assert rd.checkpoint_steps(tmp_path) == [2, 10]


def test_complete_message_says_how_to_extend():
    msg = rd.complete_message("runs/x", 16, 16)
    assert "is complete" in msg and "--resume runs/x --set train.steps=N with N > 16" in msg


def test_a_users_own_lock_file_is_kept_and_refused(tmp_path):
    """A file named like das-jax's lock that das-jax did not write is neither truncated nor
    overwritten: the run is refused in one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / rd.LOCK_FILE).write_text("my notes\n")
    with pytest.raises(rd.RunDirError, match="did not write"):
        with rd.lock_run_dir(run):
            pass
    assert (run / rd.LOCK_FILE).read_text() == "my notes\n"
    (run / rd.LOCK_FILE).write_text("pid 12 on otherhost\n")   # a dead run's note: usable
    with rd.lock_run_dir(run):
        pass
