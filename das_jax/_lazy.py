"""Lazy public surfaces (PEP 562) for the subpackages, so that `das-jax --help` and the CLI
registrations import no jax."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable, list[str]]:
    """(`__getattr__`, `__dir__`, `__all__`) for `package`, whose name `n` lives in the submodule
    `exports[n]` (or, when that starts with "das_jax.", in that module: a name another package
    owns); a name is imported on first use and then cached in the package namespace."""
    names = sorted(exports)

    def __getattr__(name: str):
        if name in exports:
            where = exports[name]
            module = where if where.startswith("das_jax.") else f"{package}.{where}"
            value = getattr(importlib.import_module(module), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return names

    return __getattr__, __dir__, names
