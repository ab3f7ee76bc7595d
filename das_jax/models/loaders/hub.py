"""HF hub ids ("org/name"): download config, safetensors and tokenizer files, then load the folder.

`huggingface_hub` is imported lazily. Offline (`HF_HUB_OFFLINE=1`, no network, or a connection
error) a snapshot already in the HF cache is still used; otherwise the error says how to pass a
local directory instead.
"""
from __future__ import annotations

import os
import re

from das_jax.models.errors import ModelLoadError

ALLOW_PATTERNS = ("config.json", "generation_config.json", "*.safetensors",
                  "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "chat_template.jinja", "chat_template.json")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_hub_id(source: str) -> bool:
    """True for "org/name" strings that are not an existing local path."""
    return bool(_HUB_ID.match(source)) and not os.path.exists(source)


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def snapshot(repo_id: str) -> str:
    """Local folder holding the model files of hub repo `repo_id` (downloaded when online).

    Raises:
      ModelLoadError: offline without a cached snapshot, a connection error, or an unknown / gated
        repository; the message says how to pass a local directory instead.
    """
    local_hint = (f"download it where you have access (e.g. `hf download {repo_id} --include "
                  f"'*.json' '*.safetensors'`) and pass that local directory instead of "
                  f"{repo_id!r}")
    try:
        # deferred import: huggingface_hub (not loaded by importing this module)
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise ModelLoadError(f"{repo_id}: huggingface_hub is not installed, so hub ids cannot be "
                             f"fetched; {local_hint}") from None
    offline = _offline_env()
    try:
        return snapshot_download(repo_id, allow_patterns=list(ALLOW_PATTERNS),
                                 local_files_only=offline)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise ModelLoadError(f"{repo_id}: not an accessible HF hub repository "
                             f"({type(e).__name__}); check the id, or {local_hint}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelLoadError(f"{repo_id}: {why} and the model is not in the HF cache; "
                             f"{local_hint}") from None
    except Exception as e:  # connection errors come from requests / httpx depending on versions
        try:
            return snapshot_download(repo_id, allow_patterns=list(ALLOW_PATTERNS),
                                     local_files_only=True)
        except Exception:
            pass
        raise ModelLoadError(f"{repo_id}: download from the HF hub failed ({type(e).__name__}: "
                             f"{e}); are you offline? {local_hint}") from None
