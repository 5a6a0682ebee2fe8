"""Draft proposers on the device: prompt lookup (n-gram) over the token history, with an n-gram
draft table as its fallback (``sfjax.spec.table``), and a draft model run by ``lax.scan`` over its
own paged cache on the target's block tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sfjax.spec import table as T


def ngram(history, slots, length, k: int, n_min: int, n_max: int, table: T.NgramTable | None = None):
    """Prompt lookup: for each row, the longest suffix n-gram (n_max down to n_min) of its tokens
    [0, length) that occurred earlier, and the k tokens that followed its latest occurrence; a row
    with no match takes the ``table``'s continuation of its last two tokens, if given.

    Args:
      history: int32 [max_seqs, L] tokens by position; slots, length: int32 [S].
    Returns:
      (drafts int32 [S, k], available int32 [S]: how many of them exist, 0 if no match).
    """
    hist = history[jnp.maximum(slots, 0)]                       # [S, L]
    s, width = hist.shape
    p = jnp.arange(width)[None, :]                               # candidate match starts
    best_start = jnp.full((s,), -1, jnp.int32)
    for n in range(n_min, n_max + 1):                            # longer matches overwrite
        suffix_at = length - n                                   # [S]
        match = (p + n <= length[:, None] - 1) & (suffix_at[:, None] >= 0)
        for i in range(n):
            here = jnp.take_along_axis(hist, jnp.minimum(p + i, width - 1), axis=1)
            there = jnp.take_along_axis(hist, jnp.maximum(suffix_at + i, 0)[:, None], axis=1)
            match &= here == there
        latest = jnp.max(jnp.where(match, p, -1), axis=1)
        best_start = jnp.where(latest >= 0, latest + n, best_start)  # first token after the match
    idx = jnp.clip(best_start[:, None] + jnp.arange(k)[None, :], 0, width - 1)
    drafts = jnp.take_along_axis(hist, idx, axis=1)
    available = jnp.where(best_start >= 0, jnp.clip(length - best_start, 0, k), 0)
    if table is not None:
        at = lambda i: jnp.take_along_axis(hist, jnp.clip(i, 0, width - 1)[:, None], axis=1)[:, 0]
        prev = jnp.where(length >= 2, at(length - 2), -1)
        t_drafts, t_available = T.lookup(table, prev, at(length - 1), k)
        none = best_start < 0
        drafts = jnp.where(none[:, None], t_drafts, drafts)
        available = jnp.where(none & (length >= 1), t_available, available)
    return drafts, available.astype(jnp.int32)
