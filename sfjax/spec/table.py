"""A corpus n-gram table: the prompt-lookup proposer's fallback when a sequence's own tokens hold
no match for its last token (a token new to the sequence, in code often a fresh name or idiom).

For each context of the last two tokens seen often enough in a corpus, the continuation of
``width`` tokens that most often followed it; for each single last token, likewise. Built once from
the corpus a model was trained on (``scripts/train_demo.py`` ships one beside the embedded target),
stored as safetensors, and looked up on the device by binary search: a cheap frozen drafter with no
forward pass. Like any proposer it only changes which drafts are verified, never the tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

TABLE_FILE = "ngram_table.safetensors"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramTable:
    unigram: jax.Array   # int32 [V, W] continuation after a last token t; -1 pads
    keys: jax.Array      # int32 [M] prev * V + last, sorted ascending
    values: jax.Array    # int32 [M, W] continuation after (prev, last); -1 pads

    @property
    def vocab_size(self) -> int:
        return self.unigram.shape[0]

    @property
    def width(self) -> int:
        return self.unigram.shape[1]


def build(sequences: Iterable[Sequence[int]], vocab_size: int, width: int = 3,
          min_count: int = 5) -> NgramTable:
    """The table of a corpus, as token id sequences. A context keeps its most frequent
    continuation (ties: the one seen first); a two-token context only when that continuation was
    seen at least ``min_count`` times. Deterministic for a given input order."""
    if width < 1 or min_count < 1:
        raise ValueError(f"ngram table: width ({width}) and min_count ({min_count}) must be >= 1")
    if vocab_size * vocab_size >= 2 ** 31:
        raise ValueError(f"ngram table: vocab_size {vocab_size} too large for int32 bigram keys")
    one: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    two: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for seq in sequences:
        ids = [int(t) for t in seq]
        for i in range(1, len(ids) - width + 1):
            cont = tuple(ids[i:i + width])
            one[ids[i - 1]][cont] += 1
            if i >= 2:
                two[ids[i - 2] * vocab_size + ids[i - 1]][cont] += 1
    unigram = np.full((vocab_size, width), -1, np.int32)
    for t, c in one.items():
        unigram[t] = c.most_common(1)[0][0]
    kept = sorted((key, c.most_common(1)[0]) for key, c in two.items())
    kept = [(key, cont) for key, (cont, n) in kept if n >= min_count]
    keys = np.array([key for key, _ in kept], np.int32).reshape(-1)
    values = np.array([cont for _, cont in kept], np.int32).reshape(-1, width)
    return NgramTable(unigram=unigram, keys=keys, values=values)


def save(table: NgramTable, path: str) -> None:
    arrays = {f.name: np.asarray(getattr(table, f.name), np.int32) for f in dataclasses.fields(table)}
    save_file(arrays, path, metadata={"format": "sfjax-ngram-table"})
    os.chmod(path, 0o644)                                  # safetensors writes it 0600


def load(path: str, vocab_size: int | None = None) -> NgramTable:
    """A saved table; with ``vocab_size``, checked against the model's vocabulary."""
    where = "speculative_config.prompt_lookup_table"
    try:
        arrays = load_file(path)
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"{where}: cannot read {path!r} ({e})") from None
    missing = sorted({f.name for f in dataclasses.fields(NgramTable)} - set(arrays))
    if missing:
        raise ValueError(f"{where}: {path!r} is not an n-gram table (no {missing})")
    table = NgramTable(**{k: jnp.asarray(arrays[k], jnp.int32) for k in ("unigram", "keys", "values")})
    if vocab_size is not None and table.vocab_size != vocab_size:
        raise ValueError(f"{where}: the table's vocabulary ({table.vocab_size}) differs from the "
                         f"model's ({vocab_size})")
    return table


def lookup(table: NgramTable, prev, last, k: int):
    """Drafts after each row's last two tokens: the (prev, last) continuation, else last's alone.

    Args:
      prev, last: int32 [S] (prev < 0: no two-token context).
    Returns:
      (drafts int32 [S, k], available int32 [S]: how many of them exist).
    """
    v = table.vocab_size
    key = jnp.where(prev >= 0, prev * v + last, -1)
    m = table.keys.shape[0]
    at = jnp.clip(jnp.searchsorted(table.keys, key), 0, max(m - 1, 0))
    hit = (key >= 0) & (table.keys[at] == key) if m else jnp.zeros_like(key, jnp.bool_)
    cont = table.values[at] if m else jnp.full((key.shape[0], table.width), -1, jnp.int32)
    cont = jnp.where(hit[:, None], cont, table.unigram[jnp.clip(last, 0, v - 1)])   # [S, W]
    w = min(k, table.width)
    have = jnp.sum(jnp.cumprod((cont[:, :w] >= 0).astype(jnp.int32), axis=1), axis=1)
    drafts = jnp.zeros((key.shape[0], k), jnp.int32).at[:, :w].set(jnp.maximum(cont[:, :w], 0))
    return drafts, have.astype(jnp.int32)
