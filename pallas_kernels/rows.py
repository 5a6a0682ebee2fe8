"""Fixed row tiles: the one loop every row-invariant op runs in.

XLA compiles an op differently by its shape (a GEMM picks its code path by M) and by what it is
fused with (the same elementwise math gave different last bits in two fusions on XLA:CPU). A row
keeps its bits only if it is always computed by the same compiled loop body on a tile of the same
shape. ``per_tile`` makes that so:
- the body sees one tile of ``row_tile`` rows, whatever N is;
- the trip count is a runtime value, so XLA can neither unroll the loop nor drop it when N is one
  tile (it would then fuse the body with its neighbours);
- the tile buffers carry one spare tile, so a one-tile buffer's dynamic slice is never proven
  loop-invariant and hoisted out of the loop.
The runtime count also skips tiles that are all padding.

``per_tile_sized`` runs a step whose valid rows fit one smaller tile in that tile instead: a decode
row of batch 1 in a tile of 2 rows costs a quarter of the GEMM work of a tile of 8. That keeps a
row's bits only where the smaller tile's compiled body computes the same bits as ``row_tile``'s,
which is a property of the backend's GEMM library, not of XLA's contract: ``sfjax.model``
certifies it on the model before using it (``certify_row_tiles``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def per_tile(fn, row_tile: int, num_tiles, *xs):
    """``fn`` over the first ``num_tiles`` (traced int32) tiles of ``row_tile`` rows of each x.

    xs: pytrees of arrays [N, ...] with N a multiple of ``row_tile``; ``fn`` gets the same trees
    with [row_tile, ...] leaves and may return a pytree. Rows of skipped tiles come out zero.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    if n % row_tile:
        raise ValueError(f"rows ({n}) must be a multiple of row_tile ({row_tile})")
    tiles = jax.tree.map(lambda x: jnp.concatenate([
        x.reshape(n // row_tile, row_tile, *x.shape[1:]),
        jnp.zeros((1, row_tile, *x.shape[1:]), x.dtype)]), xs)
    shapes = jax.eval_shape(fn, *jax.tree.map(lambda t: t[0], tiles))
    out = jax.tree.map(lambda s: jnp.zeros((n // row_tile + 1, *s.shape), s.dtype), shapes)

    def body(i, out):
        y = fn(*jax.tree.map(lambda t: t[i], tiles))
        return jax.tree.map(lambda o, v: o.at[i].set(v), out, y)

    out = lax.fori_loop(0, jnp.minimum(num_tiles, n // row_tile), body, out)
    return jax.tree.map(lambda o: o[:-1].reshape(n, *o.shape[2:]), out)


def num_tiles_of(valid_rows, row_tile: int):
    """Tiles up to the last valid row: ceil((last valid index + 1) / row_tile), traced int32."""
    last = jnp.max(jnp.where(valid_rows, jnp.arange(1, valid_rows.shape[0] + 1), 0))
    return (last + row_tile - 1) // row_tile


def per_tile_sized(fn, row_tile: int, small_tiles: tuple[int, ...], valid_rows, *xs):
    """``per_tile``, but for a step of one tile (N = ``row_tile``: decode at small batch) whose
    valid rows all fall in the first t rows for a t in ``small_tiles`` (the smallest such), one
    tile of t rows instead, chosen at run time. Rows of skipped tiles come out zero; with no valid
    row nothing runs. Larger steps keep ``per_tile`` alone: each branch is compiled, and a step of
    more tiles rarely has only a few valid rows.

    small_tiles: tile sizes below ``row_tile`` that divide it, certified to give ``fn``'s bits of
    a ``row_tile`` tile row for row (``sfjax.model.certify_row_tiles``); () is ``per_tile``.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    small = sorted(t for t in set(small_tiles) if t < row_tile and row_tile % t == 0)
    last = jnp.max(jnp.where(valid_rows, jnp.arange(1, valid_rows.shape[0] + 1), 0))
    whole = lambda xs: per_tile(fn, row_tile, (last + row_tile - 1) // row_tile, *xs)
    if not small or n != row_tile:
        return whole(xs)
    branches = [lambda xs, t=t: per_tile(fn, t, jnp.minimum(last, 1), *xs) for t in small]
    index = sum((last > t).astype(jnp.int32) for t in small)
    return lax.switch(index, branches + [whole], xs)
