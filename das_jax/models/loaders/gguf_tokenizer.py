"""The tokenizer of a GGUF file, converted once in a child process and cached, so that the
process that loads the model never imports torch.

transformers converts a GGUF file's `tokenizer.*` metadata into a fast tokenizer
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), but that conversion imports torch:
~0.3 GB of resident memory and 5-25 s of start-up in every process that loads the model.
Here the conversion runs once, in a child process (`python -m
das_jax.models.loaders.gguf_tokenizer GGUF OUT_DIR`), which

1. converts with transformers exactly as before and writes the result with `save_pretrained`
   (tokenizer.json, tokenizer_config.json, chat_template.jinja);
2. reloads the written folder with `load_saved` -- what the parent uses, the `tokenizers`
   backend only -- and checks that both tokenizers agree on everything das-jax reads: the
   vocabulary, the special ids, the ids of probe texts with and without special tokens, the
   decoded text of every added token, and the chat template's output;
3. writes `manifest.json` (the cache key and each file's SHA-256) last.

The parent moves the finished folder into place with one rename. Cache: `<das-jax cache
(sources.cache_dir())>/gguf-tokenizers/<key>/`, key = SHA-256 of the GGUF header (every
metadata field and the tensor index: the bytes before the tensor data) and of the transformers
and tokenizers versions. A folder whose manifest is missing or unreadable, whose key differs or
whose files do not match their recorded SHA-256 (a partial or corrupted write) is removed and
rebuilt, never used. When the reloaded tokenizer differs in any probe (`NOT_EXACT`) or the
cache folder cannot be written, the caller converts in its own process as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from typing import Any

from das_jax.models.errors import ModelLoadError
from das_jax.models.loaders.gguf_reader import open_gguf
from das_jax.models.sources import cache_dir, sha256_file

FORMAT = 1
MANIFEST = "manifest.json"
NOT_EXACT = 3  # the child's exit code when the reloaded tokenizer differs from transformers'

PROBE_TEXTS = (
    "", "a", " a", "Hello, world!", "  two  spaces\tand a tab\n\nnew lines\r\n",
    "Sam has 11 sandwiches. Sam gives 6 of them away. How many sandwiches does Sam have now?",
    "12345678901234567890 3.14159 -42 1e-5 #### 7 \\boxed{12}",
    "ÀÉÎõü ß ñ 中文 日本語 한국어 😀👍🏽 ∑∫√ — “quotes” «guillemets»",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><s></s><unk>",
)
PROBE_CHATS = (
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Count to 3.\nThen stop."},
     {"role": "assistant", "content": "1 2 3"},
     {"role": "user", "content": "Again, ÀÉÎ 中文."}],
)


def load_saved(path: str):
    """The `transformers` fast tokenizer of a folder written by `save_pretrained` (tokenizer.json
    + tokenizer_config.json + chat_template.jinja), built by the `tokenizers` backend without
    importing torch.

    Raises:
      Exception: whatever transformers raises for unreadable files.
    """
    # deferred import: transformers (not loaded by importing this module)
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def convert_with_transformers(gguf_path: str):
    """transformers' own GGUF tokenizer conversion (imports torch).

    Raises:
      ModelLoadError: the metadata describes no tokenizer transformers can build.
    """
    # deferred import: transformers (not loaded by importing this module)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                             gguf_file=os.path.basename(gguf_path),
                                             local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from the GGUF metadata "
                             f"({type(e).__name__}: {e})") from e


def behaviour(tok) -> dict[str, Any]:
    """Everything das-jax reads from a tokenizer, on the probe texts and chats: a JSON-able dict
    that two tokenizers share exactly when they behave the same for das-jax."""
    specials = sorted({int(i) for i in tok.all_special_ids}
                      | {int(i) for i in getattr(tok, "added_tokens_decoder", {})})
    texts = list(PROBE_TEXTS) + [tok.convert_ids_to_tokens(i) for i in specials]
    out: dict[str, Any] = {
        "len": len(tok),
        "vocab_sha256": hashlib.sha256(json.dumps(sorted(tok.get_vocab().items()))
                                       .encode()).hexdigest(),
        "special": {k: getattr(tok, k, None) for k in (
            "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")},
        "chat_template": getattr(tok, "chat_template", None),
        "encode": [[list(tok.encode(t, add_special_tokens=s)) for s in (False, True)]
                   for t in texts],
        "decode": [[tok.decode(tok.encode(t, add_special_tokens=False), skip_special_tokens=s)
                    for s in (False, True)] for t in texts],
        "decode_specials": [tok.decode([i], skip_special_tokens=False) for i in specials],
    }
    if out["chat_template"]:
        out["chat"] = [tok.apply_chat_template(m, add_generation_prompt=g, tokenize=False)
                       for m in PROBE_CHATS for g in (False, True)]
    return out


def cache_key(gguf_path: str, header_size: int | None = None) -> str:
    """Hex SHA-256 of the GGUF header (every byte before the tensor data: all metadata and the
    tensor index) and of the transformers / tokenizers versions (a new converter is a new key).

    `header_size`: the header's length in bytes (`gguf.GGUFReader(...).data_offset`), when the
    caller has a reader open already; None reads the file to find it (seconds for a large
    vocabulary: the reader parses every field).

    Raises:
      ModelLoadError: the file is not a readable GGUF.
    """

    end = header_size
    if end is None:
        reader = open_gguf(gguf_path)
        end = int(reader.data_offset)
        del reader
    h = hashlib.sha256(f"das-jax gguf tokenizer {FORMAT} transformers {version('transformers')} "
                       f"tokenizers {version('tokenizers')}\n".encode())
    with open(gguf_path, "rb") as f:
        while end > 0:
            chunk = f.read(min(end, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            end -= len(chunk)
    return h.hexdigest()


def cache_folder(key: str) -> str:
    """`<das-jax cache>/gguf-tokenizers/<key>` (not created)."""
    return os.path.join(cache_dir(), "gguf-tokenizers", key)


def verified(folder: str, key: str) -> bool:
    """True when `folder` holds a complete conversion for `key`: a readable manifest naming `key`
    and every file it lists present with its recorded SHA-256."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("key") != key or not files:
            return False
        return all(sha256_file(os.path.join(folder, name)) == digest
                   for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def write_conversion(gguf_path: str, out_dir: str, key: str) -> bool:
    """The child's job: converts `gguf_path`, saves it into `out_dir` (an empty folder), checks
    that `load_saved(out_dir)` behaves as the converted tokenizer, then writes the manifest.

    Returns:
      True when the saved tokenizer is exact (manifest written), False when it differs.
    Raises:
      ModelLoadError: transformers cannot convert the metadata.
    """
    tok = convert_with_transformers(gguf_path)
    tok.save_pretrained(out_dir)
    if behaviour(load_saved(out_dir)) != behaviour(tok):
        return False
    files = {name: sha256_file(os.path.join(out_dir, name)) for name in sorted(os.listdir(out_dir))}
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "key": key, "source": gguf_path, "files": files}, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return True


def _convert_in_child(gguf_path: str, out_dir: str, key: str) -> int:
    """Runs `write_conversion` in a fresh Python process; returns its exit code.

    Raises:
      ModelLoadError: the child failed (its last lines of stderr are in the message).
    """
    cmd = [sys.executable, "-m", "das_jax.models.loaders.gguf_tokenizer", gguf_path, out_dir, key]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, NOT_EXACT):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ModelLoadError(f"{gguf_path}: converting the tokenizer failed ({tail})")
    return proc.returncode


def cached_tokenizer_dir(gguf_path: str, header_size: int | None = None) -> str | None:
    """The cache folder holding the converted tokenizer of `gguf_path` (converted in a child
    process first when missing or not intact), or None when it cannot be cached exactly (the
    saved tokenizer differs from transformers' conversion, or the cache is not writable): the
    caller then converts in its own process. `header_size`: as in `cache_key`.

    Raises:
      ModelLoadError: the file is not a readable GGUF, or transformers cannot convert its
        tokenizer metadata.
    """
    gguf_path = os.path.abspath(gguf_path)
    key = cache_key(gguf_path, header_size)
    folder = cache_folder(key)
    if verified(folder, key):
        return folder
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(folder):  # partial or corrupt: never used, rebuilt
            shutil.rmtree(folder, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    except OSError:
        return None
    try:
        if _convert_in_child(gguf_path, tmp, key) != 0:
            return None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private
        try:
            os.rename(tmp, folder)
        except OSError:  # another process published the same key first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder if verified(folder, key) else None


def main(argv: list[str] | None = None) -> int:
    """`python -m das_jax.models.loaders.gguf_tokenizer GGUF OUT_DIR KEY`: the child process."""
    gguf_path, out_dir, key = (sys.argv[1:] if argv is None else argv)
    try:
        return 0 if write_conversion(gguf_path, out_dir, key) else NOT_EXACT
    except ModelLoadError as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
