"""A character tokenizer for tiny-model tests: no files, no vocabulary to download."""
from __future__ import annotations


class CharTokenizer:
    """ids 2..63 <-> a fixed 62-character alphabet (other characters -> the last id); id 1 is
    eos, id 0 is never produced by `encode`. Matches `tiny_model_config()`'s vocab of 64."""

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ?"[:62]
    eos_token_ids = (1,)

    def encode(self, text: str) -> list[int]:
        return [2 + (self.alphabet.index(c) if c in self.alphabet else 61) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i - 2] for i in ids if i >= 2)
