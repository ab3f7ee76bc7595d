"""A small tokenizer wrapper around a `transformers` fast tokenizer (+ chat template, eos ids).

Built from a local HF directory (`tokenizer.json` / `tokenizer_config.json`, extra eos ids from
`generation_config.json` and `config.json`) or from a GGUF file's metadata (the vocabulary / merges
become a `tokenizers` tokenizer as transformers' GGUF conversion builds it, without torch; the chat
template is the `tokenizer.chat_template` key). Importing this module does not import transformers;
the constructors do.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

from das_jax.models.errors import ModelLoadError
from das_jax.models.loaders import gguf_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _as_id_list(value: Any) -> list[int]:
    """An eos/pad id field (None, int or list of ints) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _dedup(ids: Iterable[int]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text <-> token ids, the chat template and the stop ids of one model.

    Attributes:
      hf: the underlying `transformers` fast tokenizer (a `PreTrainedTokenizerFast` /
        `TokenizersBackend`).
      eos_token_ids: every id that ends a generation (tokenizer eos, plus `generation_config.json` /
        `config.json` / GGUF eos ids), tokenizer eos first. Non-empty.
      pad_token_id: id used for padding (the tokenizer's pad, else the first eos id).
    """

    hf: Any
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    # ----- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = (),
                pad_token_id: int | None = None, source: str = "tokenizer") -> "Tokenizer":
        """Wraps an HF tokenizer; eos ids = its eos id followed by `extra_eos_ids`.

        Raises:
          ModelLoadError: no eos id can be found (names `source`).
        """
        eos = _dedup(_as_id_list(hf_tokenizer.eos_token_id) + [int(i) for i in extra_eos_ids])
        if not eos:
            raise ModelLoadError(
                f"{source}: the tokenizer defines no eos token and no eos_token_id is configured; "
                "add eos_token to tokenizer_config.json or eos_token_id to generation_config.json")
        pad = hf_tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        return cls(hf=hf_tokenizer, eos_token_ids=eos, pad_token_id=int(eos[0] if pad is None else pad))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads the tokenizer of a local HF model directory.

        Extra eos ids come from `generation_config.json` and `config.json` (`eos_token_id`, an int or
        a list); the pad id from the tokenizer, else `generation_config.json`, else the first eos.

        Raises:
          ModelLoadError: no tokenizer files in `path`, or transformers cannot read them.
        """
        path = os.fspath(path)
        if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            raise ModelLoadError(
                f"{path}: no tokenizer files (expected tokenizer.json and tokenizer_config.json); "
                "copy them from the model's original repository into this directory")
        # no "PyTorch was not found" advice: das-jax uses transformers' tokenizers only
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        # deferred import: transformers (not loaded by importing this module)
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        tok_cfg = _read_json_if_exists(os.path.join(path, "tokenizer_config.json"))
        # A generic class means "tokenizer.json as written": AutoTokenizer would otherwise pick the
        # model type's class (from config.json), which may rebuild the pipeline differently.
        generic = tok_cfg.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
        loader = PreTrainedTokenizerFast if generic and os.path.isfile(
            os.path.join(path, "tokenizer.json")) else AutoTokenizer
        try:
            hf_tok = loader.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many types here
            raise ModelLoadError(f"{path}: cannot read the tokenizer ({type(e).__name__}: {e}); "
                                 "re-download tokenizer.json / tokenizer_config.json") from e
        extra: list[int] = []
        pad = None
        for name in ("generation_config.json", "config.json"):
            cfg = _read_json_if_exists(os.path.join(path, name))
            extra += _as_id_list(cfg.get("eos_token_id"))
            if pad is None and hf_tok.pad_token_id is None and name == "generation_config.json":
                pads = _as_id_list(cfg.get("pad_token_id"))
                pad = pads[0] if pads else None
        return cls.from_hf(hf_tok, extra, pad_token_id=pad, source=path)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, metadata_eos_ids: Iterable[int] = (), *,
                  reader: Any = None) -> "Tokenizer":
        """Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        The vocabulary, merges, special tokens and BOS / EOS flags become a `tokenizers`
        tokenizer as transformers' GGUF conversion builds it, without torch
        (`das_jax.models.loaders.gguf_tokenizer`); the chat template is the file's
        `tokenizer.chat_template`. `metadata_eos_ids` (e.g. `tokenizer.ggml.eos_token_id`,
        `eot_token_id`) are added to the eos ids. `reader`: the file's open `gguf.GGUFReader`,
        when the caller has one (saves parsing the file again).

        Raises:
          ModelLoadError: the file is not a readable GGUF, or its metadata describes no tokenizer
            das-jax can build (the message names the tokenizer model).
        """
        path = os.path.abspath(os.fspath(path))
        hf_tok = gguf_tokenizer.load(path, reader)
        return cls.from_hf(hf_tok, metadata_eos_ids, source=path)

    # ----- API ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (no BOS/EOS unless `add_special_tokens`). For prompts use
        :meth:`encode_prompt`."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's BOS id, or None."""
        bos = getattr(self.hf, "bos_token_id", None)
        return None if bos is None else int(bos)

    def prepends_bos(self) -> bool:
        """Whether the tokenizer's post-processor puts BOS in front of an encoded text (Llama-style
        tokenizers do, ChatML ones such as SmolLM2 / Qwen do not)."""
        bos = self.bos_token_id
        if bos is None:
            return False
        with_special = list(self.hf.encode("a", add_special_tokens=True))
        plain = list(self.hf.encode("a", add_special_tokens=False))
        return bool(with_special) and with_special[0] == bos and (not plain or plain[0] != bos)

    def encode_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt, as the model's tokenizer encodes it. The one function every
        prompt goes through (generate CLI with and without --chat, trainer, benches).

        Args:
          text: the prompt. With `chat`, a rendered chat template (see :meth:`apply_chat_template`).
          chat: False (a raw, completion-style prompt): special tokens are added as the
            tokenizer's post-processor is configured -- exactly `transformers`'
            `tokenizer(text)["input_ids"]` (a Llama-style tokenizer prepends BOS, a ChatML one
            adds nothing). True: the template writes its own special tokens, so nothing else is
            added, except that the result starts with exactly one BOS when the tokenizer
            prepends BOS (:meth:`prepends_bos`): a template that writes ``{{ bos_token }}``
            keeps its one BOS (not two, as encoding with special tokens would give), a template
            that writes none gets the one the tokenizer would add, and a BOS repeated at the
            start is kept once. Tokenizers that add no BOS get the template's ids unchanged.

        Returns:
          list of int ids.
        """
        if not chat:
            return list(self.hf.encode(text, add_special_tokens=True))
        ids = list(self.hf.encode(text, add_special_tokens=False))
        bos = self.bos_token_id
        if bos is None:
            return ids
        k = 0
        while k < len(ids) and ids[k] == bos:
            k += 1
        if k > 1:
            ids = ids[k - 1:]
        if k == 0 and self.prepends_bos():
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any int sequence or 1-D array)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """Renders `messages` ([{"role", "content"}, ...]) with the model's chat template.

        Returns the prompt text, or its ids when `tokenize`.

        Raises:
          ModelLoadError: the tokenizer has no chat template.
        """
        if not self.chat_template:
            raise ModelLoadError("this tokenizer has no chat template; format the prompt yourself "
                                 "and use encode()")
        out = self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                          tokenize=False)
        if not tokenize:
            return out
        # The template writes special tokens (e.g. <|im_start|>) itself: never add BOS on top.
        return self.encode_prompt(out, chat=True)

    def chat_prompt_ids(self, user_text: str, system: str | None = None) -> list[int]:
        """Ids of a one-turn chat prompt (optional system message) ending with the assistant header."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user_text})
        return self.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def __repr__(self) -> str:
        return (f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={self.eos_token_ids}, pad_token_id={self.pad_token_id})")


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Prompt ids through :meth:`Tokenizer.encode_prompt` -- the one way the generate CLI, the
    trainer and the benches encode prompts. Objects without ``encode_prompt`` (test doubles
    with only ``encode(text)``) fall back to ``encode(text)``."""
    fn = getattr(tokenizer, "encode_prompt", None)
    if fn is not None:
        return list(fn(text, chat=chat))
    return list(tokenizer.encode(text))


def _read_json_if_exists(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e}); re-download it") from None
    return data if isinstance(data, dict) else {}
