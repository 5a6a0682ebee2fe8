"""Paged attention over a ragged batch of query tokens.

Every query token carries its sequence's slot (which block-table row to read) and its position;
it attends causally to keys ``0..position`` of that slot. Prefill chunks, decode tokens and the
k+1 tokens of a speculative verify are all the same thing here: rows with positions.

Row invariance (the exactness contract, DESIGN §1.2): a row's output bits must not depend on the
rows around it or on how many there are. So rows are processed in fixed tiles of ``row_tile``
(``pallas_kernels.rows.per_tile``), and keys in fixed chunks of ``KEY_CHUNK`` in
ascending order with an online softmax. A chunk past a row's position changes nothing exactly
(alpha = exp(0) = 1, p = 0), so the number of chunks a tile needs (its longest row) and the
block size of the pages do not reach a row's bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.rows import num_tiles_of, per_tile

KEY_CHUNK = 64


def _tile(q, positions, slots, *, k_cache, v_cache, layer, block_tables, sm_scale):
    """One tile of rows. q [T, KVH, G, D]; positions, slots [T]; caches [L, blocks, bs, KVH, D]."""
    t, kvh, g, d = q.shape
    block_size = k_cache.shape[2]
    tables = block_tables[jnp.maximum(slots, 0)]                      # [T, max_blocks]
    q = q.astype(jnp.float32)
    n_chunks = (jnp.max(positions) + KEY_CHUNK) // KEY_CHUNK           # 0 when every row is padding

    def body(c, carry):
        m, l, acc = carry
        kpos = c * KEY_CHUNK + jnp.arange(KEY_CHUNK)                   # [C]
        page = jnp.take(tables, kpos // block_size, axis=1, mode="clip")  # [T, C]
        off = jnp.broadcast_to(kpos % block_size, page.shape)
        k = k_cache[layer, page, off].astype(jnp.float32)              # [T, C, KVH, D]
        valid = kpos[None, :] <= positions[:, None]                    # [T, C]
        # masked keys must not reach the output even as NaN (0 * NaN is NaN): zero their V
        v = jnp.where(valid[..., None, None], v_cache[layer, page, off].astype(jnp.float32), 0.0)
        s = jnp.einsum("tkgd,tckd->tkgc", q, k) * sm_scale
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l, acc

    init = (jnp.full((t, kvh, g), -jnp.inf, jnp.float32), jnp.zeros((t, kvh, g), jnp.float32),
            jnp.zeros((t, kvh, g, d), jnp.float32))
    _, l, acc = lax.fori_loop(0, n_chunks, body, init)
    return acc / jnp.where(l == 0, 1.0, l)[..., None]


def paged_attention_reference(q, k_cache, v_cache, layer, block_tables, slots, positions, *,
                              sm_scale: float, row_tile: int = 8):
    """Pure-jnp paged attention, row-invariant.

    Args:
      q: [N, heads, head_dim] queries, N a multiple of ``row_tile``.
      k_cache, v_cache: [layers, num_blocks, block_size, kv_heads, head_dim] the page pools.
      layer: int32 scalar, the layer to read.
      block_tables: int32 [max_seqs, max_blocks] page ids per slot.
      slots: int32 [N] the slot of each query row (-1 for padding).
      positions: int32 [N] the position of each query row (-1 for padding: output zeros).
      sm_scale: softmax scale (a Python float).
      row_tile: rows per tile; fixed per engine so a row's bits never depend on N.
    Returns:
      [N, heads, head_dim] float32.
    """
    q, k_cache, v_cache, block_tables, slots, positions = map(
        jnp.asarray, (q, k_cache, v_cache, block_tables, slots, positions))
    n, h, d = q.shape
    kvh = k_cache.shape[3]
    tile = functools.partial(_tile, k_cache=k_cache, v_cache=v_cache, layer=layer,
                             block_tables=block_tables, sm_scale=sm_scale)
    out = per_tile(tile, row_tile, num_tiles_of(positions >= 0, row_tile),
                   q.reshape(n, kvh, h // kvh, d), positions, slots)
    return out.reshape(n, h, d)
