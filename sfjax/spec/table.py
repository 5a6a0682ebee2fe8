"""An n-gram draft table: the prompt-lookup proposer's fallback when a sequence's own tokens hold
no match (in code, often a fresh name or idiom).

For each context of the last two tokens seen often enough, and for each single last token, the
``width`` tokens a next-token model predicts from there, each prediction feeding the next context
(a chained n-gram model). The predictions are counted on a corpus: by default each position's own
next token (the corpus's n-gram statistics); better, the target model's greedy token at each
position, so that the table drafts what the target itself would say (``scripts/train_demo.py``
ships such a table beside the embedded target). Stored as safetensors and looked up on the device
by binary search: a frozen drafter with no forward pass. Like any proposer it only changes which
drafts are verified, never the tokens.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
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


def _pairs(sequences, predictions, vocab_size: int):
    """(one-token contexts, their predictions, two-token context keys, their predictions), all
    int64 and flat over the corpus; ids checked against the vocabulary."""
    v = np.int64(vocab_size)
    seqs = [np.asarray(q, np.int64).reshape(-1) for q in sequences]
    if predictions is None:
        preds = [q[1:] for q in seqs]
        seqs = [q[:-1] for q in seqs]
    else:
        preds = [np.asarray(q, np.int64).reshape(-1) for q in predictions]
        if len(preds) != len(seqs) or any(a.shape != b.shape for a, b in zip(seqs, preds)):
            raise ValueError("ngram table: predictions must match the sequences' lengths")
    empty = np.zeros(0, np.int64)
    ctx1 = np.concatenate([empty, *seqs])
    pred1 = np.concatenate([empty, *preds])
    for name, x in (("sequences", ctx1), ("predictions", pred1)):
        if x.size and (x.min() < 0 or x.max() >= vocab_size):
            raise ValueError(f"ngram table: {name} hold ids outside 0..{vocab_size - 1}")
    ctx2 = np.concatenate([empty, *(q[:-1] * v + q[1:] for q in seqs)])
    pred2 = np.concatenate([empty, *(p[1:] for p in preds)])
    return ctx1, pred1, ctx2, pred2


def _most_frequent(ctx, pred, v):
    """(contexts ascending, their most frequent prediction, its count); ties: the smaller id."""
    codes, counts = np.unique(ctx * v + pred, return_counts=True)
    c, p = codes // v, codes % v
    order = np.lexsort((p, -counts, c))                    # by context, count down, id up
    first = order[np.r_[True, c[order][1:] != c[order][:-1]]] if codes.size else order
    return c[first], p[first], counts[first]


def build(sequences: Iterable[Sequence[int]], vocab_size: int, width: int = 3,
          min_count: int = 2, predictions: Iterable[Sequence[int]] | None = None) -> NgramTable:
    """The table of a corpus of token id sequences.

    Each context (a position's token, and the pair of it and the one before) keeps the prediction
    it was most often followed by (ties: the smaller token id); a two-token context only when
    that prediction was counted at least ``min_count`` times. ``predictions[i][j]`` is the token
    a model predicts after ``sequences[i][:j + 1]`` (same lengths); by default the sequence's
    own next token. A context's continuation then chains: each predicted token is looked up
    after the last two (else the last one) as the engine looks up a row, until ``width`` tokens
    or a token with no entry (-1 pads). Deterministic for a given input."""
    if width < 1 or min_count < 1:
        raise ValueError(f"ngram table: width ({width}) and min_count ({min_count}) must be >= 1")
    if vocab_size * vocab_size >= 2 ** 31:
        raise ValueError(f"ngram table: vocab_size {vocab_size} too large for int32 bigram keys")
    v = np.int64(vocab_size)
    ctx1, pred1, ctx2, pred2 = _pairs(sequences, predictions, vocab_size)
    k1, p1, _ = _most_frequent(ctx1, pred1, v)
    next1 = np.full(vocab_size, -1, np.int64)
    next1[k1] = p1
    keys, next2, n2 = _most_frequent(ctx2, pred2, v)
    keys, next2 = keys[n2 >= min_count], next2[n2 >= min_count]

    def predict(prev, last):
        """The table's next token after (prev, last) (prev < 0: after last alone); -1: none."""
        key = np.where(prev >= 0, prev * v + last, -1)
        at = np.clip(np.searchsorted(keys, key), 0, max(keys.size - 1, 0))
        hit = (key >= 0) & (keys[at] == key) if keys.size else np.zeros(key.shape, bool)
        return np.where(last < 0, -1, np.where(hit, next2[at] if keys.size else -1,
                                               next1[np.maximum(last, 0)]))

    def chain(prev, last):
        out = []
        for _ in range(width):
            t = predict(prev, last)
            out.append(t)
            prev, last = np.where(t >= 0, last, -1), t
        return np.stack(out, axis=1).astype(np.int32)

    tokens = np.arange(vocab_size, dtype=np.int64)
    return NgramTable(unigram=chain(np.full(vocab_size, -1, np.int64), tokens),
                      keys=keys.astype(np.int32), values=chain(keys // v, keys % v))


def save(table: NgramTable, path: str) -> None:
    arrays = {f.name: np.asarray(getattr(table, f.name), np.int32) for f in dataclasses.fields(table)}
    save_file(arrays, path, metadata={"format": "sfjax-ngram-table"})
    os.chmod(path, 0o644)                                  # safetensors writes it 0600


def load(path: str, vocab_size: int | None = None) -> NgramTable:
    """A saved table; with ``vocab_size``, checked against the model's vocabulary."""
    where = "speculative_config.prompt_lookup_table"
    try:
        arrays = load_file(path)
    except Exception as e:      # missing, unreadable, or not safetensors (safetensors' own errors)
        raise ValueError(f"{where}: cannot read {path!r} as safetensors "
                         f"({type(e).__name__}: {e})") from None
    missing = sorted({f.name for f in dataclasses.fields(NgramTable)} - set(arrays))
    if missing:
        raise ValueError(f"{where}: {path!r} is not an n-gram table (no {missing})")
    table = NgramTable(**{k: jnp.asarray(arrays[k], jnp.int32) for k in ("unigram", "keys", "values")})
    if vocab_size is not None and table.vocab_size != vocab_size:
        raise ValueError(f"{where}: the table's vocabulary ({table.vocab_size}) differs from the "
                         f"model's ({vocab_size})")
    return table


def lookup(table: NgramTable, prev, last, k: int):
    """Drafts after each row's last two tokens: the (prev, last) continuation, else last's alone;
    past the table's width, chained on: the continuation of its own last two tokens, block by
    block (a table built ``width`` * m wide stores those very tokens, ``build``'s chain), until
    k or a token with no entry.

    Args:
      prev, last: int32 [S] (prev < 0: no two-token context).
    Returns:
      (drafts int32 [S, k], available int32 [S]: how many of them exist).
    """
    w = table.width
    blocks = -(-k // w)
    # [prev, last, block 0, block 1, ...]: each block looked up after the two tokens before it
    seq = jnp.concatenate([prev[:, None], last[:, None], _block(table, prev, last)], axis=1)
    if blocks > 1:
        seq = jnp.concatenate([seq, jnp.full((seq.shape[0], (blocks - 1) * w), -1, jnp.int32)],
                              axis=1)

        def more(b, seq):       # block b after the two tokens before it, at 2 + b * w
            block = _block(table, seq[:, b * w], seq[:, b * w + 1])
            return lax.dynamic_update_slice_in_dim(seq, block, 2 + b * w, axis=1)
        seq = lax.fori_loop(1, blocks, more, seq)
    cont = seq[:, 2:2 + k]
    have = jnp.sum(jnp.cumprod((cont >= 0).astype(jnp.int32), axis=1), axis=1)
    return jnp.maximum(cont, 0), have.astype(jnp.int32)


def _block(table: NgramTable, prev, last):
    """int32 [S, W]: the table's continuation after (prev, last), else after last alone; all -1
    where last < 0 (a chain that ended)."""
    v = table.vocab_size
    keys, values, unigram = map(jnp.asarray, (table.keys, table.values, table.unigram))
    key = jnp.where((prev >= 0) & (last >= 0), prev * v + last, -1)
    m = keys.shape[0]
    at = jnp.clip(jnp.searchsorted(keys, key), 0, max(m - 1, 0))
    hit = (key >= 0) & (keys[at] == key) if m else jnp.zeros_like(key, jnp.bool_)
    cont = values[at] if m else jnp.full((key.shape[0], table.width), -1, jnp.int32)
    cont = jnp.where(hit[:, None], cont, unigram[jnp.clip(last, 0, v - 1)])   # [S, W]
    return jnp.where((last >= 0)[:, None], cont, -1).astype(jnp.int32)
