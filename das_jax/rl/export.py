"""A training run's checkpoint -> a Hugging Face model directory (`das-jax export`).

    export_run("runs/smollm2-135m-arith", "exported/")          # the newest checkpoint
    export_run("runs/smollm2-135m-arith", "exported/", step=12, dtype="bfloat16")

Reads the run's `config.yaml` (its `model.source` and `model.dtype`), the params of one
checkpoint (not the optimizer or rollout state), and the source model's config and tokenizer (not
its weights), then writes the directory `das_jax.models.export.save_hf_model` describes. The
directory is written next to OUT under a temporary name and renamed into place when complete, so
a failed export (a full disk) leaves no half-written model behind. The run directory is only
read: a run that is still training can be exported from (its lock is not taken, and its
in-progress checkpoint is left alone).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from pathlib import Path

import yaml

from das_jax.config import ConfigError, config_from_dict
from das_jax.errors import disk_full_error, user_error_message
from das_jax.models import export as hf_export
from das_jax.models.export import EXPORT_DTYPES, ExportError, is_export_file
from das_jax.rl import model_loading
from das_jax.rl import run_dir as rd
from das_jax.rl.run_log import phase


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export_run` wrote: the directory, the checkpoint step, the model's architecture,
    its parameter count, the weights' dtype and the file names."""

    out: str
    step: int
    architecture: str
    num_params: int
    dtype: str
    files: tuple[str, ...]


def _check_out(out: Path, run: Path, overwrite: bool) -> None:
    """Refuses an OUT that is a file, inside the run directory's checkpoints, the run directory
    itself, non-empty without `overwrite`, or (with it) holding files an export does not write."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is a file; choose a directory for the exported "
                          "model")
    real_out, real_run = os.path.realpath(out), os.path.realpath(run)
    if real_out == real_run or real_out.startswith(os.path.join(real_run, "checkpoints") + os.sep):
        raise ExportError(f"{out}: is the run directory (or inside its checkpoints); choose "
                          "another directory for the exported model")
    if not out.is_dir():
        _check_creatable(out)
        return
    if not os.access(out.parent if out.parent != Path("") else Path("."), os.W_OK | os.X_OK):
        raise ExportError(f"{out}: its directory {out.parent} is not writable (the export "
                          "writes beside OUT, then renames); choose a directory you can write")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    if not overwrite:
        raise ExportError(f"{out}: exists and is not empty; pass --overwrite to replace the "
                          "exported model there, or choose another directory")
    foreign = [e for e in entries if not (is_export_file(e) and (out / e).is_file())]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ExportError(f"{out}: holds files an export does not write ({shown}); --overwrite "
                          "replaces only an exported model: remove them yourself or choose "
                          "another directory")


def _check_creatable(out: Path) -> None:
    """Refuses an OUT that cannot be created: a file among its parents, or its nearest
    existing parent not a writable directory (checked before the checkpoint is read)."""
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"{out}: cannot be created, {parent} is a file; choose a directory "
                          "path for the exported model")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{out}: cannot be created, {parent} is not writable; choose a "
                          "directory you can write")


def _run_model_section(cfg_path: Path):
    """A `Config` with the run's `model` section (source, dtype) and defaults elsewhere: the
    export needs nothing else, so a run whose other settings this process cannot validate (a
    reward function registered by the user's own code) still exports.

    Raises:
      ConfigError: config.yaml unreadable, or its model section invalid (names the file).
    """
    try:
        raw = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{cfg_path}: cannot read the run's config ({e}); restore it from the "
                          "run's checkpoints/<step>/meta (its \"config\")") from None
    model = raw.get("model") if isinstance(raw, dict) else None
    try:
        return config_from_dict({"model": model or {}})
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
               dtype: str | None = None, overwrite: bool = False,
               max_shard_bytes: int | None = None) -> ExportResult:
    """Exports one checkpoint of a `das-jax train` run as an HF model directory.

    Args:
      run_dir: the run's output directory (config.yaml + checkpoints/).
      out: the directory to write (created; its parents too).
      step: the checkpoint's step (default: the newest).
      dtype: "float32" or "bfloat16" (default: the run's model.dtype).
      overwrite: replace an existing exported model at `out` (only an HF model directory's files
        are removed; anything else there is refused).
      max_shard_bytes: largest safetensors file before sharding (default 5 GB).

    Returns:
      ExportResult.

    Raises:
      ExportError: no such run directory, no config.yaml, no checkpoint, an unknown step (the
        message names the steps there), an OUT that is not empty (without `overwrite`), a dtype
        other than float32 / bfloat16, or params that do not fit the run's model.
      CheckpointError: the checkpoint is corrupt or unreadable.
      ConfigError: the run's config.yaml is invalid.
      ModelLoadError / ModelConfigError: the run's model source cannot be read.
      OSError: OUT cannot be written (e.g. a full disk).
    """

    run, out = Path(run_dir), Path(out)
    if not run.is_dir():
        raise ExportError(f"{run}: no such directory; pass the output_dir of a run written by "
                          "'das-jax train'")
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise ExportError(f"{run}: no config.yaml there; pass the output_dir of a run written "
                          "by 'das-jax train'")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"unsupported export dtype {dtype!r}; use float32 or bfloat16")
    _check_out(out, run, overwrite)
    steps = rd.checkpoint_steps(run)
    if not steps:
        raise ExportError(f"{run}: no checkpoint under {run / 'checkpoints'}; let the run save "
                          "one (train.save_every, or let it finish) and export again")
    if step is not None and step not in steps:
        raise ExportError(f"{run}: no checkpoint for step {step}; it has steps "
                          f"{', '.join(map(str, steps))}")
    cfg = _run_model_section(cfg_path)
    dtype = dtype or cfg.model.dtype
    try:     # the model's config and tokenizer first: a bad source fails before the checkpoint
        model_config, tokenizer = model_loading.load_model_spec(cfg)
    except Exception as e:
        msg = user_error_message(e)
        if msg is None or disk_full_error(e) is not None:
            raise
        raise ExportError(f"{cfg_path}: the run's model.source {cfg.model.source!r}: {msg}"
                          ) from None

    # deferred import: jax, orbax (not loaded by importing this module)
    from das_jax.rl.checkpoint import CheckpointError, CheckpointManager
    with phase(f"reading checkpoint step {step if step is not None else steps[-1]}") as ph:
        try:
            with CheckpointManager(run, read_only=True) as manager:
                params, meta = manager.restore_params(step)
        except CheckpointError as e:
            if len(steps) < 2:
                raise
            raise CheckpointError(f"{e}; export another one with --step (steps there: "
                                  f"{', '.join(map(str, steps))})") from None
        step = int(meta.get("step", step if step is not None else steps[-1]))
        ph.detail = str(run / "checkpoints" / str(step))
    source = f"checkpoint {run / 'checkpoints' / str(step)} (model.source {cfg.model.source})"
    hf_export.check_params(model_config, params, source=source)
    hf_export.check_tokenizer(tokenizer)

    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        with phase(f"writing {out} ({dtype})"):
            files = hf_export.save_hf_model(
                tmp, model_config, params, tokenizer, dtype,
                **({} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}))
        if out.is_dir():   # empty, or an exported model that --overwrite replaces (checked)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise          # the CLI says "disk full" for it
        raise ExportError(f"{out}: cannot write the exported model there "
                          f"({e.strerror or e}); choose another directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out=str(out), step=step, architecture=model_config.architecture,
                        num_params=model_config.num_params(), dtype=dtype, files=tuple(files))
