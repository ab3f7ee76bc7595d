"""A fitted draft head on disk: one safetensors file holding the head's weights, its draft
vocabulary (`draft_to_target`) and, in the metadata, its config and the policy it was fitted to.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from das_jax.draft_head.head import HeadConfig
from das_jax.errors import UserError

FORMAT = "das-jax-draft-head/1"


@dataclasses.dataclass
class DraftHead:
    """config: `HeadConfig`; params: dict of float32 arrays (`head` module layout);
    draft_to_target: int32 `[Vd]` policy token id of each draft-vocabulary entry; meta: the
    policy it belongs to (`model`, `hidden_size`, `vocab_size`, `num_layers`), the trace and
    problems it was fitted on, and the holdout problems it never saw."""
    config: HeadConfig
    params: dict
    draft_to_target: np.ndarray
    meta: dict


def policy_fingerprint(model_name: str, model_config) -> dict:
    return {"model": str(model_name), "hidden_size": int(model_config.hidden_size),
            "vocab_size": int(model_config.vocab_size),
            "num_layers": int(model_config.num_layers)}


def save_head(path: str, head: DraftHead) -> None:
    """Writes `head` to `path` (a .safetensors file), atomically."""
    tensors = {f"params.{k}": np.asarray(v, np.float32) for k, v in head.params.items()}
    tensors["draft_to_target"] = np.asarray(head.draft_to_target, np.int32)
    meta = {"format": FORMAT, "config": json.dumps(head.config.to_dict()),
            "meta": json.dumps(head.meta)}
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def _read(path: str, tensors: bool):
    """(config, meta, params, draft_to_target) of the head file at `path`; without `tensors`
    the metadata only (params and draft_to_target None).

    Raises:
      UserError: a missing file, or one that is not a das-jax draft head."""
    if not os.path.isfile(path):
        raise UserError(f"draft head {path}: no such file; fit one with `das-jax draft-head fit "
                        "TRACE --out HEAD.safetensors`")
    params = d2t = None
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            if tensors:
                params = {k[len("params."):]: f.get_tensor(k) for k in f.keys()
                          if k.startswith("params.")}
                d2t = f.get_tensor("draft_to_target")
            config = HeadConfig.from_dict(json.loads(meta["config"]))
            info = json.loads(meta["meta"])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"draft head {path}: not a das-jax draft head ({type(e).__name__}: {e}); "
                        "fit one with `das-jax draft-head fit TRACE --out HEAD.safetensors`"
                        ) from None
    return config, info, params, d2t


def load_head(path: str) -> DraftHead:
    """Reads a head written by `save_head`.

    Raises:
      UserError: a missing file, or one that is not a das-jax draft head (names the file and
        how to make one).
    """
    config, info, params, d2t = _read(path, tensors=True)
    if d2t.shape != (config.draft_vocab_size,):
        raise UserError(f"draft head {path}: draft vocabulary has {d2t.shape} entries, its config "
                        f"says {config.draft_vocab_size}; refit it")
    return DraftHead(config, params, d2t.astype(np.int32), info)


def read_head_config(path: str) -> HeadConfig:
    """The `HeadConfig` of the head file at `path`, from its metadata only (no weights read:
    the memory plan's view of a head).

    Raises:
      UserError: a missing file or one that is not a das-jax draft head."""
    return _read(path, tensors=False)[0]


def check_head_for_policy(head: DraftHead, path: str, model_name: str, model_config) -> None:
    """Raises UserError when `head` was fitted to another policy (name, width, layers) or its
    draft vocabulary names ids outside the policy's vocabulary."""
    want = policy_fingerprint(model_name, model_config)
    got = {k: head.meta.get(k) for k in want}
    if got != want:
        diff = ", ".join(f"{k} {got[k]!r} != {want[k]!r}" for k in want if got[k] != want[k])
        raise UserError(f"draft head {path}: fitted to another model ({diff}); fit a head for "
                        f"{model_name} with `das-jax draft-head fit`")
    if head.draft_to_target.size and int(head.draft_to_target.max()) >= model_config.vocab_size:
        raise UserError(f"draft head {path}: its draft vocabulary holds token id "
                        f"{int(head.draft_to_target.max())}, outside {model_name}'s vocabulary of "
                        f"{model_config.vocab_size}; refit it for this tokenizer")
