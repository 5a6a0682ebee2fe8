"""Tokenizer loading and incremental detokenization (HF ``tokenizers``)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def load_tokenizer(path: str) -> Tokenizer:
    """``tokenizer.json`` from a model folder; a folder with only a slow tokenizer is converted
    once by transformers."""
    file = os.path.join(path, "tokenizer.json")
    if os.path.exists(file):
        try:
            return Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"model folder: cannot read {file}: {e}") from None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path).backend_tokenizer
    except Exception as e:
        raise ValueError(f"model folder: no usable tokenizer in {path} ({e})") from None


def generation_eos_ids(path: str, fallback: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json's."""
    file = os.path.join(path, "generation_config.json")
    if os.path.exists(file):
        with open(file) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return fallback


class IncrementalDetokenizer:
    """Text of the output tokens, built token by token (an incomplete UTF-8 tail waits)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        piece = self._stream.step(self._tok, token_id) or ""
        self.text += piece
        return piece

    def finish(self, ids: list[int]) -> None:
        """Flushes a held-back tail: the final text is exactly ``decode(ids)``."""
        self.text = self._tok.decode(ids, skip_special_tokens=self._skip)
