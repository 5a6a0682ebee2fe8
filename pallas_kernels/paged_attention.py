"""Paged attention over a ragged batch of query tokens: a pure-jnp reference and a Pallas kernel.

Every query token carries its sequence's slot (which block-table row to read) and its position;
it attends causally to keys ``0..position`` of that slot. Prefill chunks, decode tokens and the
k+1 tokens of a speculative verify are all the same thing here: rows with positions.

Row invariance (the exactness contract, docs/design.md §1.2): a row's output bits must not depend on the
rows around it or on how many there are. So keys are processed in fixed chunks (``KEY_CHUNK`` for
the kernels, ``REFERENCE_CHUNK`` for the reference) in ascending order with an online softmax, and
rows in fixed shapes:
- the reference groups each slot's consecutive rows into query blocks of up to 8 rows, as the
  kernel does, and computes a block in one fixed shape (its slot's pages only, all KV heads in
  one batched dot);
- the kernel groups each slot's consecutive rows into query blocks of ``block_q`` rows (the
  ragged paged attention design: a block's rows share every page they read) and computes a
  block as fixed-shape [block_q * G, D] x [D, chunk] products, one row per product row.
A chunk past a row's position changes nothing exactly (alpha = exp(0) = 1, p = 0), so the number
of chunks a block needs (its longest row) and the block size of the pages (up to the chunk) do
not reach a row's bits.

Backends (``paged_attention(impl=...)``): TPU through Mosaic (page tables and block metadata
scalar-prefetched into SMEM, K/V pages left in HBM and DMA'd chunk by chunk into a double
buffer), GPU through the Pallas Triton lowering (no scalar prefetch or scratch there: the tables
are read as plain refs and the pages gathered by pointer), CPU through the reference. Both
kernels are flash-decoding: each program runs one fixed ``KV_SPLIT`` of a block's keys, so a
batch-1 decode runs on as many programs as its context has splits, and a second kernel joins a
block's splits in ascending order; a split past a row's keys holds exactly nothing, so the split
count a block needs doesn't reach a row's bits either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sfjax.rows import num_tiles_of, opaque_count, per_tile


KEY_CHUNK = 64          # the kernels' keys per online-softmax step
KV_SPLIT = 512          # keys per program of the kernels (flash-decoding); fixed, as a row's
                        # bits depend on it
REFERENCE_CHUNK = 256   # the reference's (fewer, larger steps: XLA:CPU pays per op, not per key)
REFERENCE_BLOCK = 8     # the reference's query rows of one slot per block
IMPLS = ("auto", "reference", "reference_tiles", "interpret", "triton", "mosaic_tpu")


def _online_update(s, carry, pv):
    """One key chunk of the references' online softmax. s: masked scores, keys on the last axis;
    carry (m, l, acc); ``pv(p)``: the chunk's probabilities times its values, acc's shape."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv(p)


def _block(q, rowpos, table, last, *, k_cache, v_cache, layer, sm_scale):
    """One query block: up to ``REFERENCE_BLOCK`` consecutive rows of one slot, all KV heads at
    once. q [R, KVH, G, D]; rowpos [R] (-1: not the block's row, zeros out); table [max_blocks]
    the slot's page ids; last the block's last position; caches [L, blocks, bs, KVH, D]."""
    r, kvh, g, d = q.shape
    block_size = k_cache.shape[2]
    pages_per_chunk = max(REFERENCE_CHUNK // block_size, 1)
    chunk_len = pages_per_chunk * block_size
    # XLA drops a dot's batch dimension of size 1 and compiles a plain dot, with other bits: a
    # tensor-parallel shard holding one KV head computes it beside a zero head
    heads = max(kvh, 2)
    widen = lambda x, axis: x if kvh == heads else jnp.concatenate([x, jnp.zeros_like(x)], axis)
    q = widen(q.astype(jnp.float32), 1)

    def keys(cache, pages):
        """[heads, C, D] the chunk's keys (or values): whole pages, one gather."""
        return widen(cache[layer, pages].reshape(chunk_len, kvh, d).astype(jnp.float32)
                     .transpose(1, 0, 2), 0)

    def body(c, carry):
        pages = jnp.take(table, c * pages_per_chunk + jnp.arange(pages_per_chunk), mode="clip")
        kpos = c * chunk_len + jnp.arange(chunk_len)                              # [C]
        k = keys(k_cache, pages)
        # masked keys must not reach the output even as NaN (0 * NaN is NaN): zero their V
        v = jnp.where((kpos <= last)[None, :, None], keys(v_cache, pages), 0.0)
        # [heads, C, R, G] (keys as the dot's rows: no transposed copy of K), then keys minor
        s = jnp.einsum("hcd,rhgd->hcrg", k, q).transpose(0, 2, 3, 1) * sm_scale
        s = jnp.where((kpos[None, :] <= rowpos[:, None])[None, :, None, :], s, -jnp.inf)
        return _online_update(s, carry, lambda p: jnp.einsum("hrgc,hcd->hrgd", p, v))

    init = (jnp.full((heads, r, g), -jnp.inf, jnp.float32), jnp.zeros((heads, r, g), jnp.float32),
            jnp.zeros((heads, r, g, d), jnp.float32))
    n_chunks = jnp.where(last >= 0, last // chunk_len + 1, 0)
    _, l, acc = lax.fori_loop(0, n_chunks, body, init)
    return (acc / jnp.where(l == 0, 1.0, l)[..., None])[:kvh].transpose(1, 0, 2, 3)


def paged_attention_reference(q, k_cache, v_cache, layer, block_tables, slots, positions, *,
                              sm_scale: float):
    """Pure-jnp paged attention, row-invariant: by query blocks, as the kernel.

    Each slot's consecutive rows form blocks of up to ``REFERENCE_BLOCK`` rows (a decode row is a
    block alone; a verify or a prefill chunk shares one block per 8 rows), run in a loop over the
    blocks (a runtime trip count, so the body is compiled once whatever N is). A block reads only
    its slot's pages, once for all its rows, ``REFERENCE_CHUNK`` keys per online-softmax step,
    all KV heads in one batched dot (a head's bits do not depend on how many heads the shard
    holds: the heads are the dot's batch, never of size 1), every row in the same fixed shape
    whichever rows share its block. On XLA:CPU (the demo model, 4 layers, per token) a decode
    row alone costs 116 us and a 5-row verify 117 us, where tiles of 8 rows looped over heads and
    64-key chunks took 329 and 373 us; 8 decode rows of 8 slots cost more (869 against 385 us):
    ``paged_attention_tiles`` is that form.

    Args:
      q: [N, heads, head_dim] queries.
      k_cache, v_cache: [layers, num_blocks, block_size, kv_heads, head_dim] the page pools.
      layer: int32 scalar, the layer to read.
      block_tables: int32 [max_seqs, max_blocks] page ids per slot.
      slots: int32 [N] the slot of each query row (-1 for padding).
      positions: int32 [N] the position of each query row (-1 for padding: output zeros).
      sm_scale: softmax scale (a Python float).
    Returns:
      [N, heads, head_dim] float32.
    """
    q, k_cache, v_cache, block_tables, slots, positions = map(
        jnp.asarray, (q, k_cache, v_cache, block_tables, slots, positions))
    n, h, d = q.shape
    kvh, r = k_cache.shape[3], REFERENCE_BLOCK
    block, _, block_slot, block_last, num_blocks = _query_blocks(slots, positions, r)
    first = jnp.full(n, n, jnp.int32).at[block].min(jnp.arange(n, dtype=jnp.int32), mode="drop")
    pad = lambda x, fill: jnp.concatenate([x, jnp.full((r, *x.shape[1:]), fill, x.dtype)])
    q, block, positions = pad(q.reshape(n, kvh, h // kvh, d), 0), pad(block, -1), pad(positions, -1)
    run = functools.partial(_block, k_cache=k_cache, v_cache=v_cache, layer=layer,
                            sm_scale=sm_scale)

    def body(b, out):
        start = first[b]
        mine = lax.dynamic_slice_in_dim(block, start, r) == b                # [R]
        rowpos = jnp.where(mine, lax.dynamic_slice_in_dim(positions, start, r), -1)
        o = run(lax.dynamic_slice_in_dim(q, start, r), rowpos, block_tables[block_slot[b]],
                block_last[b])
        o = jnp.where(mine[:, None, None, None], o, lax.dynamic_slice_in_dim(out, start, r))
        return lax.dynamic_update_slice_in_dim(out, o, start, 0)

    out = lax.fori_loop(0, num_blocks, body, jnp.zeros((n + r, kvh, h // kvh, d), jnp.float32))
    return out[:n].reshape(n, h, d)


def _tile_head(q, head, positions, slots, *, k_cache, v_cache, layer, block_tables, sm_scale):
    """One KV head of one tile of rows. q [T, G, D]; head int32; positions, slots [T]; caches
    [L, blocks, bs, KVH, D]."""
    t, g, d = q.shape
    block_size = k_cache.shape[2]
    tables = block_tables[jnp.maximum(slots, 0)]                      # [T, max_blocks]
    q = q.astype(jnp.float32)
    n_chunks = (jnp.max(positions) + KEY_CHUNK) // KEY_CHUNK           # 0 when every row is padding

    def keys(cache, kpos):
        """[T, C, D] the chunk's keys (or values) of this head, from each row's pages."""
        if KEY_CHUNK % block_size == 0:      # whole pages: one gather of contiguous blocks
            pages = jnp.take(tables, kpos[::block_size] // block_size, axis=1, mode="clip")  # [T, P]
            return cache[layer, pages, :, head].reshape(t, KEY_CHUNK, d)
        page = jnp.take(tables, kpos // block_size, axis=1, mode="clip")    # [T, C]
        return cache[layer, page, jnp.broadcast_to(kpos % block_size, page.shape), head]

    def body(c, carry):
        kpos = c * KEY_CHUNK + jnp.arange(KEY_CHUNK)                   # [C]
        k = keys(k_cache, kpos).astype(jnp.float32)                    # [T, C, D]
        valid = kpos[None, :] <= positions[:, None]                    # [T, C]
        # masked keys must not reach the output even as NaN (0 * NaN is NaN): zero their V
        v = jnp.where(valid[..., None], keys(v_cache, kpos).astype(jnp.float32), 0.0)
        s = jnp.einsum("tgd,tcd->tgc", q, k) * sm_scale
        s = jnp.where(valid[:, None, :], s, -jnp.inf)
        return _online_update(s, carry, lambda p: jnp.einsum("tgc,tcd->tgd", p, v))

    init = (jnp.full((t, g), -jnp.inf, jnp.float32), jnp.zeros((t, g), jnp.float32),
            jnp.zeros((t, g, d), jnp.float32))
    _, l, acc = lax.fori_loop(0, n_chunks, body, init)
    return acc / jnp.where(l == 0, 1.0, l)[..., None]


def _tile(q, positions, slots, **kw):
    """One tile of rows, one KV head at a time in a loop whose trip count the compiler cannot
    see, so a head's bits do not depend on how many KV heads the cache holds (tensor parallelism
    shards them). q [T, KVH, G, D]; positions, slots [T]."""
    kvh = q.shape[1]
    count = opaque_count(kvh, positions)
    one = lambda qh, h: _tile_head(qh[0], h[0], positions, slots, **kw)[None]
    out = per_tile(one, 1, count, q.transpose(1, 0, 2, 3), jnp.arange(kvh, dtype=jnp.int32))
    return out.transpose(1, 0, 2, 3)


def paged_attention_tiles(q, k_cache, v_cache, layer, block_tables, slots, positions, *,
                          sm_scale: float, row_tile: int = 8):
    """The reference's other form (``impl="reference_tiles"``): fixed tiles of ``row_tile`` rows
    (N a multiple of it; fixed per engine so a row's bits never depend on N), one KV head at a
    time, ``KEY_CHUNK`` keys per step; ``paged_attention_reference``'s arguments and result, other
    bits.

    A tile reads every row's keys, its padding rows' too, in a loop per head, so a step costs by
    its tiles rather than its blocks: on XLA:CPU (the demo model, 4 layers) a decode row alone
    costs 2.8x the block reference, a 64-row prefill chunk 1.25x, while 8 decode rows of 8 slots
    cost 0.44x. For batched CPU serving.
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


# ------------------------------------------------------------------------------------------
# the kernel


def _online_step(q, k, v, valid, carry, sm_scale):
    """One key chunk of the online softmax, the math both kernels share.

    q [R, D] f32; k, v [C, D] f32 (v zero where no row of the block may read it); valid [R, C];
    carry (m [R, 1], l [R, 1], acc [R, D]).
    """
    m, l, acc = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(valid, s * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return m_new, l, acc


def _init(rows, d):
    return (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))


def _finish(l, acc):
    return acc / jnp.where(l == 0, 1.0, l)


def _gpu_kernel(meta_ref, slot_ref, last_ref, tables_ref, pos_ref, q_ref, k_ref, v_ref,
                acc_ref, m_ref, l_ref, *, sm_scale, chunk, max_blocks, split):
    # meta_ref: [2] (layer, number of blocks); slot_ref, last_ref: [NB] each block's slot and
    # last position; tables_ref: [max_seqs * max_blocks]; pos_ref: [R, 1] each row's position
    # (-1: padding); q_ref: [R, D] (one KV head's rows of one block: block_q * G rows padded to
    # a power of two >= 16); k_ref, v_ref: [layers, pages, block_size, KVH, D], whole (Triton
    # takes them as pointers). Program (b, h, s) runs keys [s * split, (s + 1) * split) of
    # block b, head h: acc_ref [R, D], m_ref, l_ref [R, 1] its online-softmax state, unscaled
    # (``_combine`` joins a block's splits).
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size = k_ref.shape[2]
    per = split // chunk
    live = (b < meta_ref[1]) & (s * split <= last_ref[b])

    @pl.when(live)
    def _():
        layer, slot, last = meta_ref[0], slot_ref[b], last_ref[b]
        q = q_ref[...].astype(jnp.float32)
        rowpos = pos_ref[...]

        def body(c, carry):
            kpos = c * chunk + lax.iota(jnp.int32, chunk)                        # [C]
            page = tables_ref[slot * max_blocks + jnp.minimum(kpos // block_size, max_blocks - 1)]
            off = kpos % block_size
            k = k_ref[layer, page, off, h, :].astype(jnp.float32)                # [C, D]
            v = v_ref[layer, page, off, h, :].astype(jnp.float32)
            v = jnp.where((kpos <= last)[:, None], v, 0.0)
            return _online_step(q, k, v, kpos[None, :] <= rowpos, carry, sm_scale)

        m, l, acc = lax.fori_loop(s * per, jnp.minimum(last // chunk + 1, (s + 1) * per), body,
                                  _init(*q.shape))
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    @pl.when(~live)
    def _():
        m_ref[...], l_ref[...], acc_ref[...] = _init(*acc_ref.shape)


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref):
    # acc_ref [S, R, D], m_ref, l_ref [S, R, 1]: one block and head's splits, joined in
    # ascending order (a split past a row's keys holds m = -inf, l = 0, acc = 0: exactly nothing)
    m = m_ref[0]
    for i in range(1, m_ref.shape[0]):
        m = jnp.maximum(m, m_ref[i])
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    l, acc = jnp.zeros(l_ref.shape[1:], jnp.float32), jnp.zeros(acc_ref.shape[1:], jnp.float32)
    for i in range(m_ref.shape[0]):
        w = jnp.exp(m_ref[i] - m_safe)
        l, acc = l + w * l_ref[i], acc + w * acc_ref[i]
    o_ref[...] = _finish(l, acc)


def _tpu_kernel(meta_ref, slot_ref, last_ref, tables_ref, pos_ref, q_ref, k_hbm, v_hbm,
                acc_out, m_out, l_out, kbuf, vbuf, sem, m_ref, l_ref, acc_ref, *, sm_scale, chunk,
                max_blocks, kvh, split):
    # Scalar prefetch (SMEM): meta_ref [2] (layer, number of blocks), slot_ref, last_ref [NB],
    # tables_ref [max_seqs * max_blocks]. pos_ref: [R, 1]; q_ref: [KVH, R, D] one block;
    # k_hbm, v_hbm: [layers, pages, block_size * KVH, D] in HBM (a page's rows are token-major,
    # head-minor); kbuf, vbuf: [2, chunk * KVH, D] the double buffer; sem: DMA [2];
    # m_ref, l_ref: [KVH, R, 1] and acc_ref [KVH, R, D] the online-softmax state. Program (b, s)
    # runs keys [s * split, (s + 1) * split) of block b, all KV heads: acc_out [KVH, R, D],
    # m_out, l_out [KVH, R, 1] its state, unscaled (``_combine`` joins a block's splits).
    b, s = pl.program_id(0), pl.program_id(1)
    page_rows = k_hbm.shape[2]
    pages_per_chunk = chunk * kvh // page_rows
    per = split // chunk

    def copies(c, buf):
        """The DMAs of chunk ``c``'s pages into buffer ``buf`` (start them, or wait on them)."""
        out = []
        for p in range(pages_per_chunk):
            col = jnp.minimum(c * pages_per_chunk + p, max_blocks - 1)
            page = tables_ref[slot_ref[b] * max_blocks + col]
            dst = pl.ds(p * page_rows, page_rows)
            for hbm, vmem in ((k_hbm, kbuf), (v_hbm, vbuf)):
                out.append(pltpu.make_async_copy(hbm.at[meta_ref[0], page], vmem.at[buf, dst],
                                                 sem.at[buf]))
        return out

    m_ref[...], l_ref[...], acc_ref[...] = (jnp.broadcast_to(x, (kvh, *x.shape))
                                            for x in _init(*q_ref.shape[1:]))

    @pl.when((b < meta_ref[1]) & (s * split <= last_ref[b]))
    def _():
        last = last_ref[b]
        first, end = s * per, jnp.minimum(last // chunk + 1, (s + 1) * per)
        for cp in copies(first, first % 2):
            cp.start()
        rowpos = pos_ref[...]

        @pl.loop(first, end)
        def _(c):
            buf = c % 2
            for cp in copies(c, buf):
                cp.wait()

            @pl.when(c + 1 < end)
            def _():
                for cp in copies(c + 1, 1 - buf):
                    cp.start()

            kpos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            vmask = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) <= last
            for h in range(kvh):
                keys = pl.ds(h, chunk, stride=kvh)
                k = kbuf[buf, keys, :].astype(jnp.float32)
                v = jnp.where(vmask, vbuf[buf, keys, :].astype(jnp.float32), 0.0)
                m_ref[h], l_ref[h], acc_ref[h] = _online_step(
                    q_ref[h].astype(jnp.float32), k, v, kpos <= rowpos,
                    (m_ref[h], l_ref[h], acc_ref[h]), sm_scale)

    acc_out[...], m_out[...], l_out[...] = acc_ref[...], m_ref[...], l_ref[...]


def _query_blocks(slots, positions, block_q):
    """Groups rows into query blocks: runs of consecutive valid rows of one slot, cut every
    ``block_q`` rows. Returns (block [N] (N for padding rows), offset in block [N], slot of each
    block [N], last position of each block [N], number of blocks)."""
    n = slots.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    valid = (slots >= 0) & (positions >= 0)
    shift = lambda x, fill: jnp.concatenate([jnp.full((1,), fill, x.dtype), x[:-1]])
    run = valid & (~shift(valid, False) | (slots != shift(slots, -1)))
    run_first = lax.cummax(jnp.where(run, idx, 0))
    start = valid & (run | ((idx - run_first) % block_q == 0))
    first = lax.cummax(jnp.where(start, idx, 0))
    block = jnp.where(valid, jnp.cumsum(start, dtype=jnp.int32) - 1, n)
    block_slot = jnp.zeros(n, jnp.int32).at[block].set(slots, mode="drop")
    block_last = jnp.full(n, -1, jnp.int32).at[block].max(positions, mode="drop")
    return block, idx - first, block_slot, block_last, jnp.sum(start, dtype=jnp.int32)


def _splits(max_blocks: int, block_size: int, split: int, pow2: bool) -> int:
    """How many splits of ``split`` keys cover a slot's whole table (a power of two if asked)."""
    n = -(-max_blocks * block_size // split)
    return 1 << (n - 1).bit_length() if pow2 else n


def _combine(acc, m, l, *, interpret, params):
    """Joins each (block, head)'s splits in ascending order (``_combine_kernel``): acc
    [NB, KVH, S, R, D], m and l [NB, KVH, S, R, 1] float32 -> [NB, KVH, R, D]."""
    nb, kvh, n_split, rows, d = acc.shape
    splits = lambda w: pl.BlockSpec((None, None, n_split, rows, w), lambda b, j: (b, j, 0, 0, 0))
    return pl.pallas_call(
        _combine_kernel, grid=(nb, kvh), in_specs=[splits(d), splits(1), splits(1)],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda b, j: (b, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nb, kvh, rows, d), jnp.float32), interpret=interpret,
        name="sfjax_paged_attention_combine", compiler_params=params,
    )(acc, m, l)


def _call_triton(scalars, pos, qb, k_cache, v_cache, *, sm_scale, chunk, max_blocks, interpret,
                 split):
    """The GPU kernel over query blocks, flash-decoding style: grid (query blocks, KV heads,
    splits of ``split`` keys), so batch 1 fills the GPU too, then one program per (block, head)
    joins its splits in a fixed order. scalars: (meta, block slot, block last, flat tables);
    pos [NB, R, 1]; qb [NB, KVH, R, D]. Returns [NB, KVH, R, D] float32."""
    from jax.experimental.pallas import triton as pltriton

    nb, kvh, rows, d = qb.shape
    # splits: a power of two (a Triton block), enough for a slot's whole table
    n_split = _splits(max_blocks, k_cache.shape[2], split, pow2=True)
    whole = pl.BlockSpec()
    params = None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=2)
    part = lambda w: pl.BlockSpec((None, None, None, rows, w), lambda b, j, s: (b, j, s, 0, 0))
    shape = lambda w: jax.ShapeDtypeStruct((nb, kvh, n_split, rows, w), jnp.float32)
    acc, m, l = pl.pallas_call(
        functools.partial(_gpu_kernel, sm_scale=sm_scale, chunk=chunk, max_blocks=max_blocks,
                          split=split),
        grid=(nb, kvh, n_split),
        in_specs=[whole] * 4 + [pl.BlockSpec((None, rows, 1), lambda b, j, s: (b, 0, 0)),
                                pl.BlockSpec((None, None, rows, d), lambda b, j, s: (b, j, 0, 0)),
                                whole, whole],
        out_specs=[part(d), part(1), part(1)], out_shape=[shape(d), shape(1), shape(1)],
        interpret=interpret, name="sfjax_paged_attention", compiler_params=params,
    )(*scalars, pos, qb, k_cache, v_cache)
    return _combine(acc, m, l, interpret=interpret, params=params)


def _call_tpu(scalars, pos, qb, k_cache, v_cache, *, sm_scale, chunk, max_blocks, interpret,
              split):
    """The TPU kernel over query blocks: grid (query blocks, splits of ``split`` keys), all KV
    heads per program (a page holds them all), its chunks' pages DMA'd from HBM; then the
    splits joined as on GPU. The same arguments and result as ``_call_triton``."""
    nb, kvh, rows, d = qb.shape
    page_rows = k_cache.shape[2] * kvh
    n_split = _splits(max_blocks, k_cache.shape[2], split, pow2=False)
    kv = lambda c: c.reshape(*c.shape[:2], page_rows, d)                    # a free reshape
    part = lambda w: pl.BlockSpec((None, kvh, None, rows, w), lambda b, s, *_: (b, 0, s, 0, 0))
    shape = lambda w: jax.ShapeDtypeStruct((nb, kvh, n_split, rows, w), jnp.float32)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(nb, n_split),
        in_specs=[pl.BlockSpec((None, rows, 1), lambda b, s, *_: (b, 0, 0)),
                  pl.BlockSpec((None, kvh, rows, d), lambda b, s, *_: (b, 0, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[part(d), part(1), part(1)],
        scratch_shapes=[pltpu.VMEM((2, chunk * kvh, d), k_cache.dtype),
                        pltpu.VMEM((2, chunk * kvh, d), v_cache.dtype),
                        pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((kvh, rows, 1), jnp.float32),
                        pltpu.VMEM((kvh, rows, 1), jnp.float32),
                        pltpu.VMEM((kvh, rows, d), jnp.float32)])
    params = None if interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel"))
    acc, m, l = pl.pallas_call(
        functools.partial(_tpu_kernel, sm_scale=sm_scale, chunk=chunk, max_blocks=max_blocks,
                          kvh=kvh, split=split),
        grid_spec=grid_spec, out_shape=[shape(d), shape(1), shape(1)],
        interpret=interpret, name="sfjax_paged_attention", compiler_params=params,
    )(*scalars, pos, qb, kv(k_cache), kv(v_cache))
    return _combine(acc, m, l, interpret=interpret,
                    params=None if interpret else pltpu.CompilerParams(
                        dimension_semantics=("parallel", "parallel")))


@functools.partial(jax.jit, static_argnames=("sm_scale", "backend", "interpret", "block_q",
                                             "key_chunk", "kv_split"))
def paged_attention_kernel(q, k_cache, v_cache, layer, block_tables, slots, positions, *,
                           sm_scale: float, backend: str = "triton", interpret: bool = False,
                           block_q: int = 8, key_chunk: int = KEY_CHUNK,
                           kv_split: int = KV_SPLIT):
    """The Pallas kernel: the reference's arguments and result (N need not be a multiple of
    anything), to 1e-6 in float32.

    ``backend``: "triton" (GPU; grid (query blocks, KV heads, splits), pages gathered by
    pointer) or "mosaic_tpu" (grid (query blocks, splits), all KV heads per program, pages DMA'd
    from HBM). ``interpret`` runs either in Pallas' interpreter. ``block_q``: query rows of one
    slot per block; ``key_chunk``: keys per online-softmax step (at least one page);
    ``kv_split``: keys per program (rounded down to whole chunks). They fix a row's arithmetic,
    so an engine keeps them constant.
    """
    call = {"triton": _call_triton, "mosaic_tpu": _call_tpu}.get(backend)
    if call is None:
        raise ValueError(f"kernel backend must be triton or mosaic_tpu; got {backend!r}")
    n, h, d = q.shape
    _, _, block_size, kvh, _ = k_cache.shape
    g = h // kvh
    max_seqs, max_blocks = block_tables.shape
    rows = block_q * g
    # Triton wants power-of-two shapes and a dot of at least 16 rows: pad with padding rows
    rows_k = rows if backend != "triton" else max(16, 1 << (rows - 1).bit_length())
    block, offset, block_slot, block_last, num_blocks = _query_blocks(slots, positions, block_q)
    qb = jnp.zeros((n, block_q, kvh, g, d), q.dtype).at[block, offset].set(
        q.reshape(n, kvh, g, d), mode="drop")
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(n, kvh, rows, d)                 # row r = t * G + g
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, rows_k - rows), (0, 0)))
    pos = jnp.full((n, block_q), -1, jnp.int32).at[block, offset].set(positions, mode="drop")
    pos = jnp.pad(jnp.repeat(pos, g, axis=1), ((0, 0), (0, rows_k - rows)),
                  constant_values=-1)[..., None]                             # [NB, R, 1]
    scalars = (jnp.stack([jnp.asarray(layer, jnp.int32), num_blocks]), block_slot, block_last,
               block_tables.astype(jnp.int32).reshape(max_seqs * max_blocks))
    chunk = max(key_chunk, block_size)
    split = max(kv_split // chunk, 1) * chunk
    ob = call(scalars, pos, qb, k_cache, v_cache, sm_scale=sm_scale, chunk=chunk,
              max_blocks=max_blocks, interpret=interpret, split=split)
    ob = ob[:, :, :rows].reshape(n, kvh, block_q, g, d)
    out = ob[jnp.minimum(block, n - 1), :, offset]                             # [N, KVH, G, D]
    return jnp.where((block < n)[:, None, None, None], out, 0.0).reshape(n, h, d)


def paged_attention(q, k_cache, v_cache, layer, block_tables, slots, positions, *,
                    sm_scale: float, row_tile: int = 8, impl: str = "auto",
                    interpret: bool = False):
    """Paged attention with the reference's arguments and result, by ``impl``: "auto" (the
    kernel through Triton on GPU and Mosaic on TPU, the reference on CPU), "reference",
    "triton", "mosaic_tpu", or "interpret" (the GPU kernel in the interpreter). ``interpret``
    runs a chosen kernel in the interpreter. "reference_tiles": the reference in tiles of
    ``row_tile`` rows (``paged_attention_tiles``; other bits)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "auto":
        impl = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(jax.default_backend(), "reference")
    if impl == "reference":
        return paged_attention_reference(q, k_cache, v_cache, layer, block_tables, slots,
                                         positions, sm_scale=sm_scale)
    if impl == "reference_tiles":
        return paged_attention_tiles(q, k_cache, v_cache, layer, block_tables, slots, positions,
                                     sm_scale=sm_scale, row_tile=row_tile)
    if impl == "interpret":
        impl, interpret = "triton", True
    return paged_attention_kernel(q, k_cache, v_cache, layer, block_tables, slots, positions,
                                  sm_scale=sm_scale, backend=impl, interpret=interpret)
