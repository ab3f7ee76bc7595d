"""The GGUF tokenizer cache (`das_jax.models.loaders.gguf_tokenizer`): the cached tokenizer
behaves exactly as transformers' in-process conversion, loading it keeps torch out of the
process, and a partial or corrupt cache folder is rebuilt, never used."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from das_jax.models.errors import ModelLoadError  # noqa: E402
from das_jax.models.loaders import gguf_tokenizer as gt  # noqa: E402
from das_jax.models.tokenizer import Tokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer_gguf(path, template: str = TEMPLATE) -> None:
    """A qwen2 GGUF with a byte-level BPE tokenizer (4 control tokens, the 256 byte symbols, 3
    merges) and one dummy tensor: enough for transformers' tokenizer conversion."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    symbols = list(bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"] + symbols + ["ab", "abc", "Ġt"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    w.add_token_merges(["a b", "ab c", "Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(3)
    w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh das-jax cache; conversions run in this process (same code as the child's `main`)
    and are counted."""
    monkeypatch.setenv("DAS_JAX_CACHE", str(tmp_path / "cache"))
    calls = []

    def in_process(gguf_path, out_dir, key):
        calls.append(gguf_path)
        return 0 if gt.write_conversion(gguf_path, out_dir, key) else gt.NOT_EXACT

    monkeypatch.setattr(gt, "_convert_in_child", in_process)
    return calls


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path)
    return str(path)


def test_cached_tokenizer_behaves_as_transformers_conversion(cache, tiny_gguf):
    cached = Tokenizer.from_gguf(tiny_gguf, [2])
    direct = Tokenizer.from_gguf(tiny_gguf, [2], cache=False)
    assert len(cache) == 1
    assert gt.behaviour(cached.hf) == gt.behaviour(direct.hf)
    assert (cached.eos_token_ids, cached.pad_token_id, cached.bos_token_id) == (
        direct.eos_token_ids, direct.pad_token_id, direct.bos_token_id) == ((2,), 3, 1)
    for text in ("abc abc t", "<|im_start|>x", "Sam has 11 - 6 = 5 sandwiches.\n"):
        for chat in (False, True):
            assert cached.encode_prompt(text, chat=chat) == direct.encode_prompt(text, chat=chat)
    assert cached.chat_prompt_ids("ab t", system="s") == direct.chat_prompt_ids("ab t", system="s")
    assert cached.encode("abc") == [260 + 1]  # the merged token "abc"
    # a second load reads the cache: no new conversion
    again = Tokenizer.from_gguf(tiny_gguf, [2])
    assert len(cache) == 1 and again.encode("ab t") == cached.encode("ab t")


def test_loading_from_gguf_does_not_import_torch(tmp_path, tiny_gguf):
    # a fresh process, cold cache: the conversion runs in a grandchild; then a warm cache
    code = ("import sys; from das_jax.models.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_gguf({tiny_gguf!r}, [2]); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "print(t.chat_prompt_ids('abc'))")
    env = dict(os.environ, DAS_JAX_CACHE=str(tmp_path / "cache"), PYTHONPATH=REPO)
    outs = [subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    for out in outs:
        assert out.returncode == 0, out.stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout
    assert len(list((tmp_path / "cache" / "gguf-tokenizers").iterdir())) == 1


def _corrupt_file(folder, name):
    path = os.path.join(folder, name)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def _append(folder, name):
    with open(os.path.join(folder, name), "a") as f:
        f.write("x")


def _rewrite_manifest(folder, **changes):
    path = os.path.join(folder, gt.MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest.update(changes)
    with open(path, "w") as f:
        json.dump(manifest, f)


DAMAGE = {
    "truncated tokenizer.json": lambda d: _corrupt_file(d, "tokenizer.json"),
    "edited chat template": lambda d: _append(d, "chat_template.jinja"),
    "missing file": lambda d: os.remove(os.path.join(d, "tokenizer_config.json")),
    "no manifest (partial write)": lambda d: os.remove(os.path.join(d, gt.MANIFEST)),
    "truncated manifest": lambda d: _corrupt_file(d, gt.MANIFEST),
    "other key": lambda d: _rewrite_manifest(d, key="0" * 64),
    "empty file list": lambda d: _rewrite_manifest(d, files={}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_cache_is_rebuilt(cache, tiny_gguf, damage):
    first = Tokenizer.from_gguf(tiny_gguf, [2])
    key = gt.cache_key(tiny_gguf)
    folder = gt.cache_folder(key)
    assert gt.verified(folder, key)
    DAMAGE[damage](folder)
    assert not gt.verified(folder, key)
    rebuilt = Tokenizer.from_gguf(tiny_gguf, [2])
    assert len(cache) == 2
    assert gt.verified(folder, key)
    assert gt.behaviour(rebuilt.hf) == gt.behaviour(first.hf)


def test_changed_metadata_is_a_new_cache_entry(cache, tmp_path, tiny_gguf):
    other = tmp_path / "other.gguf"
    write_tokenizer_gguf(other, template=TEMPLATE.replace("assistant", "bot"))
    assert gt.cache_key(str(other)) != gt.cache_key(tiny_gguf)
    a = Tokenizer.from_gguf(tiny_gguf, [2])
    b = Tokenizer.from_gguf(str(other), [2])
    assert len(cache) == 2
    assert a.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant\n")
    assert b.apply_chat_template([{"role": "user", "content": "x"}]).endswith("bot\n")


def test_inexact_or_unwritable_cache_converts_in_process(cache, tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setattr(gt, "_convert_in_child", lambda *a: gt.NOT_EXACT)
    tok = Tokenizer.from_gguf(tiny_gguf, [2])
    assert tok.encode("abc") == [261]
    assert not list((tmp_path / "cache" / "gguf-tokenizers").iterdir())  # nothing published
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DAS_JAX_CACHE", str(blocker))  # a file: the cache cannot be created
    assert gt.cached_tokenizer_dir(tiny_gguf) is None
    assert Tokenizer.from_gguf(tiny_gguf, [2]).encode("abc") == [261]


def test_child_failure_names_the_file(cache, tmp_path):
    bad = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(bad), "qwen2")
    w.add_tokenizer_model("no-such-model")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"notok\.gguf: cannot build a tokenizer"):
        Tokenizer.from_gguf(str(bad))
