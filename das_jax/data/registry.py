"""`load_dataset_from_config`: one entry point for every dataset kind (used by configs / CLI).

The kinds are `das_jax.registry.DATASETS`: name -> `load(path, **kw) -> list[Problem]`; the
built-ins register here."""

from __future__ import annotations

import os
from typing import Any

from das_jax.data.problems import DatasetError, Problem, load_gsm8k, load_hf_dataset, load_humaneval, load_math
from das_jax.data.synthetic import synthetic_arithmetic
from das_jax.registry import DATASETS

__all__ = ["DATASET_KINDS", "load_dataset_from_config", "problems_from_config"]


def _arithmetic(path, **kw: Any) -> list[Problem]:
    if path is not None:
        raise DatasetError("dataset kind 'arithmetic' is generated in memory and takes no path")
    kw.setdefault("num_problems", 256)
    limit = kw.pop("limit", None)
    if limit is not None:
        kw["num_problems"] = min(int(kw["num_problems"]), int(limit))
    try:
        return synthetic_arithmetic(**kw)
    except ValueError as e:   # settings no template can meet (data.templates / min / max_steps)
        raise DatasetError(f"data.kind 'arithmetic' with data.templates / data.min_steps / "
                           f"data.max_steps: {e}") from None


def _file_kind(kind: str, loader):
    def load(path, **kw: Any) -> list[Problem]:
        kw.pop("num_problems", None)
        kw.pop("seed", None)
        if path is None:
            raise DatasetError(f"dataset kind {kind!r} needs a path to a local jsonl file (got "
                               "path=None)")
        if not os.path.exists(os.fspath(path)):
            raise DatasetError(f"dataset kind {kind!r}: file not found: "
                               f"{os.path.abspath(os.fspath(path))!r}")
        return loader(path, **kw)
    return load


def _hf(path, **kw: Any) -> list[Problem]:
    kw.pop("num_problems", None)
    kw.pop("seed", None)
    name = kw.pop("name", None) or path
    if not name:
        raise DatasetError("dataset kind 'hf' needs a hub dataset name (path=... or name=...)")
    return load_hf_dataset(str(name), **kw)


DATASETS.register("arithmetic", _arithmetic)
DATASETS.register("gsm8k", _file_kind("gsm8k", load_gsm8k))
DATASETS.register("math", _file_kind("math", load_math))
DATASETS.register("humaneval", _file_kind("humaneval", load_humaneval))
DATASETS.register("hf", _hf)
DATASET_KINDS = DATASETS.names()  # the built-in kinds


def load_dataset_from_config(kind: str, path: str | os.PathLike | None = None, **kw: Any) -> list[Problem]:
    """Load problems of a given kind.

    Args:
        kind: ``arithmetic`` (built-in synthetic; kwargs ``num_problems`` (default 256), ``seed``
            (default 0), ``min_steps``, ``max_steps``, ``templates``; ``path`` must be None),
            ``gsm8k`` (kwargs ``split``, ``limit``), ``math`` (``limit``), ``humaneval``
            (``limit``), or ``hf`` (``path`` or kwarg ``name`` = hub dataset name; kwargs of
            :func:`load_hf_dataset`).
        path: the local jsonl(.gz) file for ``gsm8k``/``math``/``humaneval``.
        **kw: passed to the loader. So that one config section serves every kind, ``limit``
            also applies to ``arithmetic`` (truncates), and ``num_problems`` / ``seed`` are
            ignored by the file kinds; other unknown keywords raise ``TypeError``.

    Raises:
        DatasetError (a ``ValueError``): unknown kind (the message lists the valid kinds), a
            file kind without a path, a missing file (the message names the path), or a loader
            error.
        TypeError: a keyword the loader does not accept.
    """
    k = str(kind).lower().strip()
    if k not in DATASETS:
        raise DatasetError(f"unknown dataset kind {kind!r}; valid kinds: "
                           f"{', '.join(DATASETS.names())}")
    return DATASETS.get(k)(path, **kw)


def problems_from_config(data: Any) -> list[Problem]:
    """The training problems of a config's ``data:`` section (``das_jax.config.DataSection``):
    ``kind``, ``path``, ``num_problems``, ``limit``, ``seed`` and, for ``arithmetic``, the
    difficulty keys (``min_steps``, ``max_steps``, ``templates``). The one place the CLI and the
    trainer turn a config into problems, so that both train on the same set (and the held-out
    eval, which draws the problems after these with the same difficulty keys, is of that task).

    Raises:
        DatasetError / TypeError: as :func:`load_dataset_from_config`.
    """
    return load_dataset_from_config(data.kind, data.path, num_problems=data.num_problems,
                                    limit=data.limit, seed=data.seed, **data.task_kwargs())
