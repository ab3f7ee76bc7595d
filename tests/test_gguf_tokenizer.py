"""The GGUF tokenizer built without torch (`das_jax.models.loaders.gguf_tokenizer`) against
transformers' own GGUF conversion (which imports torch): token for token on GGUF files written here
(byte-level BPE with and without merges, a known split regex, a Llama 3 style vocabulary,
SentencePiece BPE from scores and from merges, BOS / EOS flags, user-defined tokens) and, marked
`slow`, on the real SmolLM2 GGUF; unsupported tokenizer models are refused in one line."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from das_jax.models.errors import ModelLoadError  # noqa: E402
from das_jax.models.loaders import gguf_tokenizer as gt  # noqa: E402
from das_jax.models.tokenizer import Tokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BYTES = list(gt.bytes_to_unicode().values())  # the 256 byte-level symbols, in byte order
SP_BYTES = [f"<0x{b:02X}>" for b in range(256)]
SP_PIECES = ["\u2581", "a", "b", "c", "t", "\u2581a", "ab", "abc", "\u2581t", "\u2581ab"]


def write_gguf(path, model: str, tokens, types, *, arch: str = "llama", merges=None, scores=None,
               pre: str | None = None, ids: dict | None = None, add_bos: bool | None = None,
               add_eos: bool | None = None, template: str | None = TEMPLATE) -> str:
    """A GGUF file with the given `tokenizer.*` metadata and one dummy tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens:
        w.add_token_list(tokens)
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for name, value in (ids or {}).items():
        getattr(w, f"add_{name}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((max(len(tokens), 1), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_tokenizer_gguf(path, template: str = TEMPLATE) -> str:
    """A qwen2 GGUF with a byte-level BPE tokenizer (4 control tokens, the 256 byte symbols, 3
    merges, one user-defined token) and the `qwen2` split regex."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"] + BYTES + ["ab", "abc", "Ġt",
                                                                                 "<think>"]
    return write_gguf(path, "gpt2", tokens, [3] * 4 + [1] * (len(tokens) - 5) + [4], arch="qwen2",
                      merges=["a b", "ab c", "Ġ t"], pre="qwen2", ids=dict(bos=1, eos=2, pad=3),
                      template=template)


# name -> (write_gguf arguments, {text: ids without special tokens}, ids of "a" with them).
# Ids: byte-level symbol of byte b = b + the control tokens before them; SentencePiece <0xNN> =
# 3 + NN, then "\u2581" 259, a, b, c, t, "\u2581a", ab, abc, "\u2581t", "\u2581ab" 268.
CASES = {
    "byte-level, qwen2 split": (None, {"abc abc t": [261, 36, 261, 262], "<think>x": [263, 124]},
                                [101]),
    "byte-level, GPT-2 regex, merges from scores, no template": (
        dict(model="gpt2", tokens=["<|endoftext|>"] + BYTES + ["ab", "abc"],
             types=[3] + [1] * 258, scores=[0.0] * 257 + [-1.0, -2.0], ids=dict(eos=0),
             template=None),
        {"abc ab": [258, 33, 257], "<|endoftext|>": [0]}, [98]),
    "byte-level, llama-bpe split, adds BOS": (
        dict(model="gpt2", tokens=BYTES + ["ab", "abc", "Ġt", "<|begin_of_text|>",
                                           "<|end_of_text|>", "<|eot_id|>", "<|im_start|>",
                                           "<|im_end|>"],
             types=[1] * 259 + [3] * 5, merges=["a b", "ab c", "Ġ t"], pre="llama-bpe",
             ids=dict(bos=259, eos=260), add_bos=True),
        {"abc t": [257, 258], "<|eot_id|>": [261]}, [259, 97]),
    "SentencePiece, merges from scores, adds BOS": (
        dict(model="llama", tokens=["<unk>", "<s>", "</s>"] + SP_BYTES + SP_PIECES
             + ["<|im_start|>", "<|im_end|>"], types=[2, 3, 3] + [6] * 256 + [1] * 10 + [3, 3],
             scores=[0.0] * 259 + [-float(i) for i in range(10)] + [0.0, 0.0],
             ids=dict(bos=1, eos=2, unk=0)),
        {"ab t": [268, 267], "é": [259, 3 + 0xC3, 3 + 0xA9]}, [1, 264]),
    "SentencePiece, merges, adds EOS not BOS, user-defined tokens": (
        dict(model="llama", tokens=["<unk>", "<s>", "</s>"] + SP_BYTES + SP_PIECES
             + ["<|im_start|>", "<|im_end|>"], types=[2, 3, 3] + [6] * 256 + [1] * 10 + [4, 4],
             merges=["\u2581 a", "a b", "ab c", "\u2581 t", "\u2581a b"],
             ids=dict(bos=1, eos=2, unk=0, pad=0), add_bos=False, add_eos=True),
        {"abc<|im_end|>": [268, 262, 270]}, [264, 2]),
}
LLAMA3 = "byte-level, llama-bpe split, adds BOS"


def _gguf_for(case: str, tmp_path) -> str:
    kwargs = CASES[case][0]
    path = tmp_path / "tok.gguf"
    return write_tokenizer_gguf(path) if kwargs is None else write_gguf(path, **kwargs)


def transformers_conversion(path: str):
    """transformers' GGUF tokenizer conversion, the reference (imports torch)."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)


def _pipeline(tok) -> dict:
    """The whole `tokenizers` pipeline as JSON (model, added tokens, normalizer, pre-tokenizer,
    post-processor, decoder)."""
    return json.loads(tok.backend_tokenizer.to_str())


@pytest.mark.parametrize("case", sorted(CASES))
def test_ids_of_written_vocabularies(case, tmp_path):
    tok = Tokenizer.from_gguf(_gguf_for(case, tmp_path)).hf
    for text, ids in CASES[case][1].items():
        assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.encode("a", add_special_tokens=True) == CASES[case][2]
    text = "Hello, wörld 中文!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("case", sorted(set(CASES) - {LLAMA3}))
def test_matches_transformers_conversion(case, tmp_path):
    path = _gguf_for(case, tmp_path)
    ours = Tokenizer.from_gguf(path).hf
    ref = transformers_conversion(path)
    assert _pipeline(ours) == _pipeline(ref)
    assert gt.behaviour(ours) == gt.behaviour(ref)


def test_wrapper_matches_transformers_conversion(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "tok.gguf")
    ours = Tokenizer.from_gguf(path, [2])
    ref = Tokenizer.from_hf(transformers_conversion(path), [2])
    assert (ours.eos_token_ids, ours.pad_token_id, ours.bos_token_id) == (
        ref.eos_token_ids, ref.pad_token_id, ref.bos_token_id) == ((2,), 3, 1)
    for text in ("abc abc t", "<|im_start|>x", "Sam has 11 - 6 = 5 sandwiches.\n"):
        for chat in (False, True):
            assert ours.encode_prompt(text, chat=chat) == ref.encode_prompt(text, chat=chat)
    assert ours.chat_prompt_ids("ab t", system="s") == ref.chat_prompt_ids("ab t", system="s")
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_class_default_special_outside_the_vocabulary_is_not_added(tmp_path):
    # transformers appends `<|endoftext|>` (its GPT-2 class default) to a vocabulary without it,
    # as an id past the model's vocabulary; everything else is the same.
    path = _gguf_for(LLAMA3, tmp_path)
    ours, ref = Tokenizer.from_gguf(path).hf, transformers_conversion(path)
    n = len(CASES[LLAMA3][0]["tokens"])
    assert len(ours) == n and len(ref) == n + 1
    assert ref.convert_ids_to_tokens(n) == "<|endoftext|>"
    assert ours.get_vocab() == {t: i for t, i in ref.get_vocab().items() if i < n}
    ours_json, ref_json = _pipeline(ours), _pipeline(ref)
    ref_json["added_tokens"] = [t for t in ref_json["added_tokens"] if t["id"] < n]
    assert ours_json == ref_json
    # here the text is its bytes (byte symbol i is id i), there the appended id
    assert ours.encode("<|endoftext|>", add_special_tokens=False) == list(b"<|endoftext|>")
    assert ref.encode("<|endoftext|>", add_special_tokens=False) == [n]
    for text in gt.PROBE_TEXTS:
        text = text.replace("<|endoftext|>", "")
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special)
            assert ours.decode(ids, skip_special_tokens=special) == ref.decode(
                ids, skip_special_tokens=special)
    for chat in gt.PROBE_CHATS:
        assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
            chat, tokenize=False)


@pytest.mark.slow
def test_smollm2_matches_transformers_conversion(smollm2_gguf_path):
    ours = Tokenizer.from_gguf(smollm2_gguf_path).hf
    ref = transformers_conversion(smollm2_gguf_path)
    assert _pipeline(ours) == _pipeline(ref)
    assert gt.behaviour(ours) == gt.behaviour(ref)
    assert len(ours) == 49152 and (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        1, 2, 2)


def test_unsupported_tokenizer_model_is_refused_naming_it(tmp_path):
    path = write_gguf(tmp_path / "t5.gguf", "t5", ["<pad>", "</s>", "\u2581a"], [3, 3, 1],
                      scores=[0.0, 0.0, -1.0])
    with pytest.raises(ModelLoadError, match=r"t5\.gguf: cannot build a tokenizer for GGUF "
                                             r"tokenizer model 't5'"):
        Tokenizer.from_gguf(path)
    gemma = write_gguf(tmp_path / "gemma.gguf", "llama", ["<unk>", "<s>", "a"], [2, 3, 1],
                       arch="gemma", scores=[0.0, 0.0, -1.0])
    with pytest.raises(ModelLoadError, match=r"model 'llama' \(architecture 'gemma'\)"):
        Tokenizer.from_gguf(gemma)


def test_missing_vocabulary_or_merges_is_refused(tmp_path):
    empty = write_gguf(tmp_path / "empty.gguf", "gpt2", [], [])
    with pytest.raises(ModelLoadError, match=r"empty\.gguf: the GGUF file has no "
                                             r"tokenizer\.ggml\.tokens"):
        Tokenizer.from_gguf(empty)
    bare = write_gguf(tmp_path / "bare.gguf", "gpt2", ["<|endoftext|>"] + BYTES, [3] + [1] * 256)
    with pytest.raises(ModelLoadError, match=r"bare\.gguf: the GGUF tokenizer has neither "
                       r"tokenizer\.ggml\.merges nor tokenizer\.ggml\.scores"):
        Tokenizer.from_gguf(bare)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a GGUF file"):
        Tokenizer.from_gguf(junk)


def test_generate_merges_as_transformers():
    from transformers.tokenization_utils_base import generate_merges
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = {"ab": -1.0, "bc": -2.0, "abc": -0.5}
    assert gt.generate_merges(vocab, scores) == generate_merges(vocab, scores) == [
        ("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
    assert gt.generate_merges(vocab, None) == generate_merges(vocab) == [
        ("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]
