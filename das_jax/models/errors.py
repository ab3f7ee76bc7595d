"""Errors raised while resolving and loading a model (all are `ValueError`s).

`ModelLoadError` is the base of the loader errors: a missing path, an unknown named source, a file
that cannot be read, an unsupported GGUF architecture, a failed download. `WeightsError`
(`convert.py`) subclasses it; `ModelConfigError` (`config.py`) stays a plain `ValueError` because a
config can be built without loading anything. `LOAD_ERRORS` catches all three.
"""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model source could not be loaded (the message names the path and the fix)."""
