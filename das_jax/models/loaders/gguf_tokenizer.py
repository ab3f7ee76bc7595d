"""The tokenizer of a GGUF file, built from its `tokenizer.*` metadata with the `tokenizers` library
(no torch, no transformers conversion code, no child process).

A GGUF file carries no `tokenizer.json`: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`),
the merges (`.merges`, or `.scores` to rebuild them from), each token's type (`.token_type`:
1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte), the special ids (`.bos_token_id`,
`.eos_token_id`, `.unknown_token_id`, `.padding_token_id`), the pre-tokenizer name (`.pre`), the
`.add_bos_token` / `.add_eos_token` flags and `tokenizer.chat_template`. `build_tokenizer` turns
these into the same fast tokenizer as transformers' GGUF conversion
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, `transformers.integrations.gguf`), rebuilt
step by step here so that it needs neither torch nor a particular transformers version:

* `tokenizer.ggml.model == "gpt2"` (byte-level BPE: SmolLM2, Qwen2/3, Llama 3): a BPE model over
  the vocabulary (a token not spelled in the byte alphabet is respelled as the alphabet
  characters of its UTF-8 bytes) and the merges, a `ByteLevel` pre-tokenizer (or, when `.pre`
  names a known split such as `qwen2` or `llama-bpe`, that split regex followed by a `ByteLevel`
  without its own regex) and a `ByteLevel` decoder.
* `"llama"` (SentencePiece BPE: Llama 1/2, Mistral v0.1): a BPE model with byte fallback, a
  `Metaspace` pre-tokenizer that prepends "\u2581" to the first word only, and the matching decoder;
  BOS is added unless `.add_bos_token` says otherwise.
* Any other model (`t5`, `bert`, `rwkv`, Gemma's or Phi-3's SentencePiece variants, ...) raises
  `ModelLoadError` naming it.

Then the same added tokens as transformers: the class default specials (`<|endoftext|>` for
`gpt2`; `<s>`, `</s>`, `<unk>` for `llama`) when the vocabulary has them, every control token (for
`gpt2`, only those spelled in the byte alphabet) as a special token, every user-defined token as
a plain added token, and the named bos / eos / unk / pad tokens; the post-processor adds BOS / EOS
as the flags say. One deliberate difference: transformers also appends a class default special
that the vocabulary lacks (e.g. `<|endoftext|>` to a Llama 3 vocabulary) as a new id past the
model's vocabulary; here such a token is not added, so every id the tokenizer produces is one the
model has.

tests/test_gguf_tokenizer.py checks the result token for token against transformers' conversion
(`behaviour`: vocabulary, special ids, probe encodings with and without special tokens, decodings,
every added token, chat template output) on written GGUF files and, marked `slow`, on the SmolLM2
GGUF.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from das_jax.models.errors import ModelLoadError
from das_jax.models.loaders.gguf_reader import open_gguf

# llama.cpp token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

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

# Pre-tokenizer split regexes by `tokenizer.ggml.pre` (transformers' GGUF_PRE_TOKENIZER_SPLITS; the
# Qwen ones are its Qwen2 / Qwen3.5 tokenizers' PRETOKENIZE_REGEX). A name not listed keeps
# ByteLevel's own GPT-2 regex, as in transformers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

SUPPORTED_MODELS = ("gpt2", "llama")
# Architectures whose "llama" (SentencePiece) vocabulary transformers builds differently.
_OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")

_FIELDS = ("model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id",
           "eos_token_id", "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet): the 188 printable
    Latin-1 bytes map to themselves, the other 68 to U+0100 onwards, in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def tokenizer_metadata(reader) -> dict[str, Any]:
    """The tokenizer fields of an open `gguf.GGUFReader`: `architecture`, `chat_template` and
    every `tokenizer.ggml.<name>` of `_FIELDS` the file has (lists for tokens, token_type, merges,
    scores; ints / bools / strings otherwise)."""
    out: dict[str, Any] = {}
    fields = reader.fields
    for key, name in [("general.architecture", "architecture"),
                      ("tokenizer.chat_template", "chat_template")] + [
            (f"tokenizer.ggml.{n}", n) for n in _FIELDS]:
        field = fields.get(key)
        if field is not None:
            out[name] = field.contents()
    return out


def generate_merges(vocab: dict[str, int],
                    scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary without a merge list (transformers' `generate_merges`):
    every split of a token into two vocabulary tokens, ordered by the token's score (highest
    first) when `scores` is given, else by the token's id."""
    reverse = scores is not None
    ranking = dict(scores) if reverse else vocab
    merges = []
    for merge, score in ranking.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


def _merges(meta: dict[str, Any], source: str) -> list[tuple[str, str]]:
    """The file's merges, else those its vocabulary and scores imply."""
    if "merges" in meta:
        out = []
        for merge in meta["merges"]:
            pair = tuple(merge.split(" "))
            if len(pair) != 2:
                raise ModelLoadError(f"{source}: tokenizer.ggml.merges has the entry {merge!r}, "
                                     "not two tokens separated by one space; re-convert the file")
            out.append(pair)
        return out
    if "scores" not in meta:
        raise ModelLoadError(f"{source}: the GGUF tokenizer has neither tokenizer.ggml.merges nor "
                             "tokenizer.ggml.scores; re-convert the file with llama.cpp")
    tokens = meta["tokens"]
    return generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, meta["scores"])))


def _add_tokens(backend, tokens: list, special: bool) -> None:
    if tokens:
        (backend.add_special_tokens if special else backend.add_tokens)(tokens)


def build_backend(meta: dict[str, Any], source: str = "GGUF"):
    """The `tokenizers.Tokenizer` described by `meta` (`tokenizer_metadata`'s dict), with its added
    tokens and post-processor. `source` names the file in errors.

    Raises:
      ModelLoadError: no token list, a tokenizer model other than `SUPPORTED_MODELS`, or merges
        that cannot be read.
    """
    # deferred import: tokenizers (not loaded by importing this module)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("model")
    arch = meta.get("architecture")
    if model not in SUPPORTED_MODELS or (model == "llama" and arch in _OTHER_SENTENCEPIECE):
        kind = f"{model!r}" + (f" (architecture {arch!r})" if model == "llama" else "")
        raise ModelLoadError(
            f"{source}: cannot build a tokenizer for GGUF tokenizer model {kind}; das-jax builds "
            f"{' and '.join(repr(m) for m in SUPPORTED_MODELS)} (byte-level and SentencePiece BPE) "
            "vocabularies; use a model with one of them or its Hugging Face directory")
    tokens = meta.get("tokens")
    if not tokens:
        raise ModelLoadError(f"{source}: the GGUF file has no tokenizer.ggml.tokens; re-convert "
                             "it with llama.cpp's convert script, which writes the vocabulary")
    types = list(meta.get("token_type") or ())

    if model == "gpt2":
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        backend = Tokenizer(BPE(vocab=vocab, merges=_merges(meta, source), dropout=None,
                                continuing_subword_prefix="", end_of_word_suffix="",
                                fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        class_specials = ["<|endoftext|>"]
        in_alphabet = lambda t: set(t) <= alphabet  # noqa: E731
    else:  # SentencePiece BPE
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = Tokenizer(BPE(vocab=vocab, merges=_merges(meta, source), fuse_unk=True,
                                byte_fallback=True, dropout=None))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                         prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                             decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
        class_specials = ["<s>", "</s>", "<unk>"]
        in_alphabet = lambda t: True  # noqa: E731

    # The class defaults transformers' GPT2Tokenizer / LlamaTokenizer register as specials; one the
    # vocabulary lacks is left out (transformers appends it past the model's vocabulary).
    _add_tokens(backend, [AddedToken(t, special=True) for t in class_specials if t in vocab],
                special=False)
    _add_tokens(backend, [AddedToken(t, normalized=False, special=True)
                          for t, k in zip(tokens, types) if k == _CONTROL and in_alphabet(t)],
                special=True)
    known = backend.get_vocab()
    _add_tokens(backend, [AddedToken(t, normalized=False, special=False)
                          for t, k in zip(tokens, types) if k == _USER_DEFINED and t in known],
                special=False)
    split = PRE_TOKENIZER_SPLITS.get(meta.get("pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    specials = special_tokens(meta)
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    _add_tokens(backend, [AddedToken(t, special=True) for t in dict.fromkeys(
        v for v in specials.values() if v is not None) if t not in added], special=False)

    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos, add_eos = add_flags(meta)
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None

    def template(seq: str, type_id: int) -> list[str]:
        return (([f"{bos}:{type_id}"] if add_bos else []) + [f"{seq}:{type_id}"]
                + ([f"{eos}:{type_id}"] if add_eos else []))
    single = " ".join(template("$A", 0))
    pair = " ".join(template("$A", 0) + template("$B", 1))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=([(bos, backend.token_to_id(bos))] if add_bos else [])
        + ([(eos, backend.token_to_id(eos))] if add_eos else []))
    return backend


def special_tokens(meta: dict[str, Any]) -> dict[str, str | None]:
    """`{"bos_token", "eos_token", "unk_token", "pad_token"}`: the token strings of the file's
    special ids, None where the file names none (or an id outside the vocabulary)."""
    tokens = meta.get("tokens") or ()
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(key)
        out[name] = tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None
    return out


def add_flags(meta: dict[str, Any]) -> tuple[bool, bool]:
    """(add BOS, add EOS) when encoding with special tokens: the file's flags; a SentencePiece
    vocabulary without the BOS flag adds BOS (llama.cpp's default)."""
    bos = meta.get("add_bos_token")
    if bos is None:
        bos = meta.get("model") == "llama"
    return bool(bos), bool(meta.get("add_eos_token", False))


def build_tokenizer(meta: dict[str, Any], source: str = "GGUF"):
    """The `transformers` fast tokenizer (`PreTrainedTokenizerFast`, backed by `build_backend`'s
    tokenizer; importing it imports no torch) with the file's special tokens, BOS / EOS flags and
    chat template.

    Raises:
      ModelLoadError: as `build_backend`.
    """
    # no "PyTorch was not found" advice: das-jax uses transformers' tokenizers only
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # deferred import: transformers (not loaded by importing this module)
    from transformers import PreTrainedTokenizerFast

    backend = build_backend(meta, source)
    add_bos, add_eos = add_flags(meta)
    kwargs: dict[str, Any] = dict(special_tokens(meta), add_bos_token=add_bos,
                                  add_eos_token=add_eos, clean_up_tokenization_spaces=False)
    if meta.get("chat_template"):
        kwargs["chat_template"] = meta["chat_template"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def load(path: str, reader=None):
    """`build_tokenizer` for the GGUF file at `path`; `reader`: its open `gguf.GGUFReader`, when
    the caller has one (opening one parses every metadata field: seconds for a large vocabulary).

    Raises:
      ModelLoadError: the file is not a readable GGUF, or its tokenizer cannot be built.
    """
    if reader is None:
        reader = open_gguf(path)
    return build_tokenizer(tokenizer_metadata(reader), path)


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
