"""Opening a GGUF file and reading its metadata: the part of GGUF loading that both the model
loader (`gguf_file`) and the tokenizer cache (`gguf_tokenizer`) need, so neither imports the other
for it."""
from __future__ import annotations

from typing import Any

from das_jax.models.errors import ModelLoadError

REDOWNLOAD = "re-download or re-convert the file"


def open_gguf(path: str):
    """A `gguf.GGUFReader` over `path`.

    Raises:
      ModelLoadError: the file is not a GGUF or is truncated/corrupt.
    """
    # deferred import: gguf (not loaded by importing this module)
    import gguf
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot open ({e.strerror})") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r}); {REDOWNLOAD}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # IndexError / ValueError from a short memmap
        raise ModelLoadError(f"{path}: cannot read GGUF file ({type(e).__name__}: {e}); the file is "
                             f"truncated or corrupt: {REDOWNLOAD}") from None


def read_metadata(reader) -> dict[str, Any]:
    """All scalar / string / short-array metadata fields as Python values (skips the token list,
    merges and scores, which are large)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in (
                "tokens", "merges", "scores", "token_type"):
            out[key + ".count"] = len(field.data)
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an odd type: metadata we do not need
            continue
    return out
