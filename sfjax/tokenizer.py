"""Tokenizer loading and incremental detokenization (HF ``tokenizers``)."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from sfjax.config import generation_config, read_json, token_ids


def load_tokenizer(path: str) -> Tokenizer:
    """``tokenizer.json`` from a model folder; a folder with only a slow tokenizer is converted
    once by transformers."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"tokenizer = {path!r}: must be a folder holding tokenizer.json (or a "
                         f"tokenizer transformers can convert)")
    file = os.path.join(path, "tokenizer.json")
    if os.path.exists(file):
        try:
            return Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"model folder: cannot read {file}: {e}") from None
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path).backend_tokenizer
    except Exception as e:
        raise ValueError(f"model folder: no usable tokenizer in {path} ({e})") from None
    if not tok.get_vocab_size(with_added_tokens=False):   # transformers makes an empty one
        raise ValueError(f"model folder: no tokenizer in {path} (tokenizer.json, or a slow "
                         f"tokenizer's files: vocab.json and merges.txt, or tokenizer.model)")
    return tok


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The ids of ``text``, computed with the GIL released: ``tokenizers``' single ``encode``
    holds it for the whole text (1.6 s for 2.3 MB here), which stalls every other thread of the
    process (a server's event loop, the engine's steps); its batch call lets them run."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def eos_ids(model_path: str, tokenizer_path: str, tokenizer: Tokenizer, vocab_size: int,
            fallback: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a sequence, as vLLM takes them: generation_config.json's
    ``eos_token_id``, else config.json's (``fallback``), and the tokenizer's own ``eos_token``
    (special_tokens_map.json's, else tokenizer_config.json's: an instruct model's end of turn,
    where generation_config.json is missing or older than the tokenizer)."""
    eos = generation_config(model_path).get("eos_token_id")
    ids = fallback if eos is None else token_ids("generation_config.json: eos_token_id", eos)
    token = None          # special_tokens_map.json's wins over tokenizer_config.json's
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = os.path.join(tokenizer_path, name)
        if os.path.exists(file):
            token = read_json(file).get("eos_token") or token
    token = token.get("content") if isinstance(token, dict) else token
    own = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if own is not None and own < vocab_size and own not in ids:
        ids += (own,)
    return ids


class IncrementalDetokenizer:
    """The text of a request's output tokens, built token by token as vLLM builds it: decoded
    after the prompt's last tokens (a SentencePiece token's leading space stays), a character
    whose bytes have not all come held back, and the text only ever growing (what a stream has
    sent is always the start of the final text). Decodes windows of ids, so no id sequence
    raises (``tokenizers.DecodeStream`` raised on bytes that no longer decode as they did).

    The text is ``decode(context + ids)`` past ``decode(context)``, except where bytes that do
    not form UTF-8 follow text already given out: a decode of every id at once turns the bytes
    before them to U+FFFD too (HF's ByteFallback), the text keeps what it gave; and where the
    output completes a character the prompt ends inside, that character is the output's
    (vLLM's); the prompt's broken bytes are not, where it does not."""

    CONTEXT = (5, 24)       # prompt tokens decoded before the output's: the fewest that decode
    HOLD = 16               # ids held back for a character at most: a run of bytes that never
                            # makes one (a UTF-8 character has 4) is given out as U+FFFD, else
                            # each token decoded the whole run again (quadratic)

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | tuple[int, ...] = ()):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids = self._context(list(prompt_ids))
        self._start, self._read = 0, len(self._ids)    # the window's context; ids in the text
        self._undo = None
        self.text = ""

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it completes ("" while a character waits)."""
        self._undo = (len(self.text), self._start, self._read)
        self._ids.append(token_id)
        return self._advance(final=False)

    def finish(self, drop_last: bool = False) -> None:
        """Gives out any held-back text; ``drop_last``: without the last id's text (an EOS or a
        stop id that ended the request)."""
        if drop_last and self._undo is not None:
            size, self._start, self._read = self._undo
            self.text = self.text[:size]
            self._ids.pop()
        self._undo = None
        self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _context(self, prompt: list[int]) -> list[int]:
        """The prompt's last ids the output is decoded after: the fewest (5 to 24) that start at
        a character, so that their text has no U+FFFD (HF's ByteFallback turns a whole run of
        byte tokens to U+FFFD when the run starts inside a character, the output's bytes with
        it), but for the bytes of a character the prompt ends inside (1-3 ids); else 5."""
        low, high = self.CONTEXT
        sizes = range(min(low, len(prompt)), min(high, len(prompt)) + 1)
        for cut in (0, 1, 2, 3):
            for n in sizes:
                if n > cut and "\ufffd" not in self._decode(prompt[len(prompt) - n:len(prompt) - cut]):
                    return prompt[len(prompt) - n:]
        return prompt[len(prompt) - min(low, len(prompt)):]

    def _completed(self) -> tuple[str, int]:
        """(the output's first text, where its next window starts) when the prompt ends in the
        bytes of a character it does not finish: that character (in the prompt's last 1-3 ids,
        whose text ends in U+FFFD) completed by the output, and the rest, the window from those
        ids on; else the output's own text."""
        for k in range(1, min(3, self._read - self._start) + 1):
            tail = self._decode(self._ids[self._read - k:self._read])
            text = self._decode(self._ids[self._read - k:])
            text = text[len(os.path.commonprefix([tail, text])):]
            if tail.endswith("\ufffd") and not text.startswith("\ufffd"):
                return text, self._read - k
        return self._decode(self._ids[self._read:]), self._read

    def _advance(self, final: bool) -> str:
        decode = self._decode
        before, after = decode(self._ids[self._start:self._read]), decode(self._ids[self._start:])
        if after == before or (not final and after.endswith("\ufffd")
                               and len(self._ids) - self._read <= self.HOLD):
            return ""
        start = self._read       # the next window: from the ids just given out
        if after.startswith(before):
            piece = after[len(before):]
        elif not self.text:      # the prompt's last bytes may be a character the output completes
            piece, start = self._completed()
        else:                    # bytes that break the text already given: the new ids' own text
            piece = decode(self._ids[self._read:])
        self.text += piece
        self._start, self._read = start, len(self._ids)
        return piece
