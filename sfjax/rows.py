"""Row invariance in one place: a row's bits never depend on the call it is computed in.

XLA compiles an op differently by its shape (a GEMM picks its code path by M) and by what it is
fused with (the same elementwise math gave other last bits in two fusions on XLA:CPU); a plain
``x @ W`` is not batch-invariant (measured on XLA:CPU: M = 1 and M = 8 differ by 1.7e-6). A row
keeps its bits only if it is always computed by the same compiled code on operands of the same
shape. Everything that makes that so lives here, behind a small interface the model uses:

- ``Tiling``: how a call computes its rows (static: the tile, the certified small tiles, the
  matmul kernel), the one argument the model takes for it; ``Tiling.rows(valid)`` is a call's
  ``Rows``;
- ``Rows.apply(fn, *xs)``: ``fn`` over a call's rows in fixed tiles of ``tile`` rows (``per_tile``),
  or one certified smaller tile when the call's valid rows fit it (``per_tile_sized``);
- ``matmul(a, w)``: ``a @ w`` in ``COL_BLOCKS`` fixed column blocks of a ``block``-ed ``w``, so a
  device holding some blocks computes each with the shapes one device holding all would
  (tensor parallelism keeps the bits, ``sfjax.sharding``);
- ``opaque_zero`` / ``rounded``: a float product rounded before it is added (no FMA contraction
  that follows the surrounding fusion); ``opaque_count``: a loop trip count the compiler can't see;
- ``certify_row_tiles``: which smaller tiles this backend computes with ``tile``'s bits, probed
  on the model itself; ``tune_stage_tiles``: which of them each stage (``STAGES``) runs fastest
  in, timed on its weights, and the whole choice probed again.

The tile loop, per ``per_tile``:
- the body sees one tile of ``row_tile`` rows, whatever N is;
- the trip count is a runtime value, so XLA can neither unroll the loop nor drop it when N is one
  tile (it would then fuse the body with its neighbours);
- a call of one tile reads it from a buffer of two (a spare), so its dynamic slice is never
  proven loop-invariant and hoisted out of the loop; calls of more tiles read the rows in place
  and every output is written in place (a fusion fewer per array than copying them: XLA:CPU
  compiles each fusion on its own, about 10 ms each).
The runtime count also skips tiles that are all padding.

A smaller tile (a decode row of batch 1 in a tile of 2 costs a quarter of the GEMM work of a tile
of 8) keeps a row's bits only where its compiled body computes the same bits as ``row_tile``'s,
which is a property of the backend's GEMM library, not of XLA's contract: ``certify_row_tiles``
checks it on the model before it is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import matmul as kernels
from sfjax.config import ModelConfig
from sfjax.weights import LAYER_FIELDS, Weights, describe, layer_arrays, multiplied

COL_BLOCKS = 8          # column blocks of every matmul; a tensor-parallel size must divide it
SMALL_ROW_TILES = (2, 4)
PROBE_LAYERS = 2        # the layers a deeper model's certificate probe runs (``_certify``)
# The tile loops of a forward, by the weights they multiply: a layer's attention norm and
# q | k | v, its o projection, its MLP norm and gate | up, its down projection; the final norm
# and LM head. Each may run its one-tile calls in its own certified tiles (``Tiling.stages``).
STAGES = ("qkv", "o", "mlp", "down", "head")
STAGE_WEIGHTS = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "mlp": ("w_gate", "w_up"),
                 "down": ("w_down",), "head": ("lm_head",)}
TUNE_MARGIN = 0.8       # a larger tile is taken for a stage only if it is this much faster

# -- the tile loop ------------------------------------------------------------------------------


def per_tile(fn, row_tile: int, num_tiles, *xs):
    """``fn`` over the first ``num_tiles`` (traced int32) tiles of ``row_tile`` rows of each x.

    xs: pytrees of arrays [N, ...] with N a multiple of ``row_tile``; ``fn`` gets the same trees
    with [row_tile, ...] leaves and may return a pytree. Rows of skipped tiles come out zero.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    if n % row_tile:
        raise ValueError(f"rows ({n}) must be a multiple of row_tile ({row_tile})")
    count = n // row_tile
    # one tile: a spare one, so the tile's dynamic slice is not proven invariant and hoisted
    spare = count == 1
    tiles = jax.tree.map(lambda x: x.reshape(count, row_tile, *x.shape[1:]), xs)
    if spare:
        tiles = jax.tree.map(lambda t: jnp.concatenate([t, jnp.zeros_like(t)]), tiles)
    shapes, fn = traced(fn, *jax.tree.map(lambda t: t[0], tiles))
    out = jax.tree.map(lambda s: jnp.zeros((count, *s.shape), s.dtype), shapes)

    def body(i, out):
        y = fn(*jax.tree.map(lambda t: lax.dynamic_index_in_dim(t, i, keepdims=False), tiles))
        return jax.tree.map(lambda o, v: lax.dynamic_update_index_in_dim(o, v, i, 0), out, y)

    out = lax.fori_loop(0, jnp.minimum(num_tiles, count), body, out)
    return jax.tree.map(lambda o: o.reshape(n, *o.shape[2:]), out)


def traced(fn, *args):
    """(the shapes ``fn(*args)`` returns, a function computing ``fn`` from one trace of it at
    ``args``' shapes): a loop or a branch that needs its body's output shapes before it traces
    the body (``per_tile``'s zeros, a skipped step's) traces ``fn`` once, not twice, and replays
    the recorded program (the same operations, so the same compiled code). A round traces
    dozens of these; tracing each body twice took a third of the time to trace a round."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    run, tree = _as_fun(closed), jax.tree.structure(shapes)
    return shapes, lambda *xs: jax.tree.unflatten(tree, run(*jax.tree.leaves(xs)))


def _as_fun(closed):
    """A closed jaxpr as a function of its inputs (``jax.extend``'s where this JAX has it)."""
    from jax import extend
    as_fun = getattr(getattr(extend, "core", None), "jaxpr_as_fun", None)
    if as_fun is not None:
        return as_fun(closed)
    return lambda *xs: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs)


def bucket(n: int, tile: int) -> int:
    """Smallest tile * 2**j >= n: few shapes, so few compilations (a step's rows, its logit
    rows, the sampling table's id lists)."""
    b = tile
    while b < n:
        b *= 2
    return b


def num_tiles_of(valid_rows, row_tile: int):
    """Tiles up to the last valid row: ceil((last valid index + 1) / row_tile), traced int32."""
    last = jnp.max(jnp.where(valid_rows, jnp.arange(1, valid_rows.shape[0] + 1), 0))
    return (last + row_tile - 1) // row_tile


def per_tile_sized(fn, row_tile: int, small_tiles: tuple[int, ...], valid_rows, *xs):
    """``per_tile``, but for a step of one tile (N = ``row_tile``: decode at small batch) whose
    valid rows all fall in the first t rows for a t in ``small_tiles`` (the smallest such), ``fn``
    on those t rows alone instead, chosen at run time: one call in its own branch of a
    ``lax.switch``, with no tile loop around it (a branch is compiled on its own, as a loop's body
    is; the loops cost the demo target's batch-1 round 128 of its 623 operations). Rows past the
    tile come out zero; with no valid row nothing runs. Larger steps keep ``per_tile`` alone:
    each branch is compiled, and a step of more tiles rarely has only a few valid rows.

    small_tiles: tile sizes below ``row_tile`` that divide it, certified to give ``fn``'s bits of
    a ``row_tile`` tile row for row (``certify_row_tiles``, which probes this very call); () is
    ``per_tile``.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    small = sorted(t for t in set(small_tiles) if t < row_tile and row_tile % t == 0)
    last = jnp.max(jnp.where(valid_rows, jnp.arange(1, valid_rows.shape[0] + 1), 0))
    whole = lambda xs: per_tile(fn, row_tile, (last + row_tile - 1) // row_tile, *xs)
    if not small or n != row_tile:
        return whole(xs)
    head = lambda t, xs: jax.tree.map(lambda x: x[:t], xs)
    shapes, first = traced(fn, *head(small[0], xs))    # the smallest tile's trace, replayed
    pad = lambda t, y: jax.tree.map(
        lambda v: jnp.concatenate([v, jnp.zeros((n - t, *v.shape[1:]), v.dtype)]), y)
    none = lambda xs: jax.tree.map(lambda s: jnp.zeros((n, *s.shape[1:]), s.dtype), shapes)
    tiles = [lambda xs, t=t: pad(t, (first if t == small[0] else fn)(*head(t, xs)))
             for t in small]
    index = (last > 0).astype(jnp.int32) + sum((last > t).astype(jnp.int32) for t in small)
    return lax.switch(index, [none, *tiles, whole], xs)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a call computes its rows (static, hashable): in tiles of ``tile`` rows, or in one of
    the certified ``small`` tiles when its valid rows fit it, or, with a ``kernel`` (a
    ``pallas_kernels.matmul`` impl), each matmul as one Pallas launch over every row.
    ``stages``: (stage, tiles) pairs, the small tiles a stage of ``STAGES`` runs in where they
    are not all of ``small`` (``tune_stage_tiles``: the GEMM library is faster on some weight
    shapes in a larger tile); a stage not named runs in ``small``."""
    tile: int = 8
    small: tuple[int, ...] = ()
    kernel: str | None = None
    stages: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def rows(self, valid, split: bool = False) -> "Rows":
        """The ``Rows`` of a call whose ``valid`` rows are given; ``split``: the call runs under a
        mesh, whose bodies are not certified, so in whole tiles only."""
        return Rows(valid, dataclasses.replace(self, small=(), stages=()) if split else self)

    def small_for(self, stage: str | None) -> tuple[int, ...]:
        """The small tiles ``stage``'s one-tile calls run in."""
        return dict(self.stages).get(stage, self.small)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A call's rows: ``valid`` (bool [N], traced; N a multiple of the tile), computed as
    ``tiling`` says: in tiles, or in one of the certified small tiles when the valid rows fit
    it; or, with a kernel ("interpret", "triton", "mosaic_tpu"), all at once, each matmul one
    batch-invariant Pallas launch over every row (the accelerator path)."""
    valid: Any
    tiling: Tiling

    def apply(self, fn, *xs, stage: str | None = None):
        """``fn`` (row-local: row r of its output depends on row r of its inputs only) over the
        rows of ``xs`` (pytrees of [N, ...] arrays); rows of skipped tiles come out zero (with a
        kernel, the matmuls' rows past the last valid one). ``stage``: which of ``STAGES`` this
        is (its small tiles, ``Tiling.small_for``)."""
        t = self.tiling
        if t.kernel is not None:
            return fn(*xs)
        return per_tile_sized(fn, t.tile, t.small_for(stage), self.valid, *xs)

    def matmul(self, a, w, out_dtype=None, norm=None):
        """``a @ w`` (``w`` blocked, or a tuple of blocked weights: a tuple of products) for
        ``fn``s under ``apply``, ``a`` first RMS-normed by ``norm`` ((weight, eps)) if given:
        ``matmul`` on a tile, or one kernel launch over all rows (the norm its prologue),
        skipping row blocks past the last valid row."""
        if self.tiling.kernel is None:
            a = a if norm is None else rms_norm(a, *norm)
            return (tuple(matmul(a, x, out_dtype) for x in w) if isinstance(w, tuple)
                    else matmul(a, w, out_dtype))
        last = jnp.max(jnp.where(self.valid, jnp.arange(1, self.valid.shape[0] + 1), 0))
        return kernels.matmul(a, w, last, out_dtype=out_dtype, norm=norm, impl=self.tiling.kernel)


def rms_norm(x, w, eps):
    """RMSNorm: ``w * (x * rsqrt(mean(x**2) + eps))``, the product rounded to x's dtype first
    (the kernel's prologue computes the same, ``pallas_kernels.matmul``)."""
    return kernels.rms_normed(x, w, eps)


def kernel_for(matmul: str | None, *cfgs: ModelConfig) -> str | None:
    """A run's matmul impl: None (the tile loop) and the kernel impls as they are; "auto" the
    backend's kernel (Triton on GPU, Mosaic on TPU) when every weight of the models has a
    schedule there (``pallas_kernels.matmul.fits``), else None, and None on CPU, where the tile
    loop is faster (BENCHMARKS.md)."""
    if matmul != "auto":
        return matmul
    backend = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(jax.default_backend())
    if backend is None:
        return None
    shapes = [(*a.shape[-2:], np.dtype(c.jnp_dtype).itemsize) for c in cfgs
              for name, a in describe(c).items() if multiplied(name)]
    if any(c.tie_word_embeddings for c in cfgs):
        shapes += [(c.hidden_size, c.vocab_size, np.dtype(c.jnp_dtype).itemsize) for c in cfgs]
    fit = all(kernels.fits(k, n // blocks_of(n), backend, size) for k, n, size in shapes)
    return backend if fit else None


# -- the blocked matmul -------------------------------------------------------------------------


def blocks_of(n: int) -> int:
    """Column blocks of a matrix with ``n`` columns."""
    return math.gcd(n, COL_BLOCKS)


def block(w):
    """[.., K, N] -> [.., U, K, N / U]: the fixed column blocks of ``matmul``."""
    *lead, k, n = w.shape
    u = blocks_of(n)
    xp = np if isinstance(w, np.ndarray) else jnp       # host weights stay on the host
    return xp.moveaxis(w.reshape(*lead, k, u, n // u), -2, -3)


def unblock(w):
    """``block``'s inverse: [.., U, K, W] -> [.., K, U * W]."""
    *lead, u, k, width = w.shape
    return jnp.moveaxis(w, -3, -2).reshape(*lead, k, u * width)


def matmul(a, w, out_dtype=None):
    """a [T, K] @ w in fixed column blocks: one batched dot of [T, K] x [K, W] products, w blocked
    [U, K, W] (``block``). Called inside ``Rows.apply``, so T is a tile."""
    u, _, width = w.shape
    o = lax.dot_general(jnp.broadcast_to(a[None], (u, *a.shape)), w, (((2,), (1,)), ((0,), (0,))),
                        preferred_element_type=out_dtype)
    return jnp.moveaxis(o, 0, 1).reshape(a.shape[0], u * width)


def _relayout(weights: Weights, fn, blocked: bool) -> Weights:
    """``fn`` applied to every matrix that is in the blocked layout (``blocked``) or the plain one;
    stacked or split by layer."""
    def one(name, x):
        if x is None or not multiplied(name):
            return x
        if isinstance(x, (tuple, list)):
            return tuple(fn(a) if (a.ndim == 3) == blocked else a for a in x)
        return fn(x) if (x.ndim > (3 if name in LAYER_FIELDS else 2)) == blocked else x
    return dataclasses.replace(weights, **{f.name: one(f.name, getattr(weights, f.name))
                                           for f in dataclasses.fields(weights)})


def block_weights(weights: Weights) -> Weights:
    """The weights with every matrix in ``matmul``'s blocked layout; blocked ones are kept. The
    engine and ``sfjax.functional`` block once (``sharding.place_weights``); model functions given
    plain weights block them on every call, a relayout of every matrix each time."""
    if weights.lm_head is None:      # tied: the head once as embed.T, not a transpose per step
        e = weights.embed
        weights = dataclasses.replace(weights, lm_head=np.ascontiguousarray(e.T)
                                      if isinstance(e, np.ndarray) else jnp.array(e.T))
    return _relayout(weights, block, blocked=False)


def plain_shapes(weights: Weights) -> Weights:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of ``weights`` in the plain layout, blocked or
    not; nothing is computed."""
    return jax.eval_shape(lambda w: _relayout(w, unblock, blocked=True), weights)


# -- rounding the compiler cannot see through ---------------------------------------------------


def opaque_zero(positions):
    """An int32 0 computed from the call's positions (a real position is never below -2**30), so
    the compiler cannot fold it."""
    return (positions[0] < -2**30).astype(jnp.int32)


def opaque_count(n: int, positions):
    """``n`` as a traced count the compiler cannot see (a loop over it is neither unrolled nor
    specialised to how many there are, e.g. KV heads under tensor parallelism)."""
    return jnp.where(positions[0] > -2**30, n, 0)


def rounded(x, zero):
    """``x`` unchanged, through an integer op the compiler cannot see through (``zero`` from
    ``opaque_zero``): a float32 product passed here is rounded before it is added to anything."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) | zero, jnp.float32)


# -- certificates of smaller tiles --------------------------------------------------------------

_CERTIFIED: dict = {}


def certify_row_tiles(weights: Weights, cfg: ModelConfig, row_tile: int = 8,
                      candidates: tuple[int, ...] = SMALL_ROW_TILES, *,
                      attention: str = "auto",
                      compiler_options: tuple[tuple[str, Any], ...] = ()) -> tuple[int, ...]:
    """The tiles of ``candidates`` (below ``row_tile``, dividing it) that give, row for row, the
    bits of ``row_tile`` tiles: forward (hidden states and the K/V written) and logits of a probe
    step run both ways on this backend, compared bitwise. One device, no mesh.

    A GEMM library picks its kernels by M, so this is the library's property, not XLA's
    contract: XLA:CPU's (YNNPACK) computes M = 2, 4 and 8 with the same per-row arithmetic and
    M = 1 and 16 with other bits (measured on the demo model). The probe compiles with the
    engine's XLA ``compiler_options`` (sorted pairs), which change bits
    (``engine.compiler_options``), so a certificate holds for programs compiled like it. The
    answer depends on shapes and options only, so it is kept per
    (model shape, row_tile, backend, options) for the process, and across processes on this
    machine, jax and sfjax source (``sfjax.certificate_cache``).
    """
    from sfjax import certificate_cache

    cands = tuple(sorted(t for t in set(candidates) if t < row_tile and row_tile % t == 0))
    key = _probe_key(weights, cfg, row_tile, cands, attention, compiler_options)
    if key not in _CERTIFIED and cands:
        found = certificate_cache.recall(key)
        if found is None:
            found = _certify(weights, cfg, row_tile, cands, attention, dict(compiler_options))
            certificate_cache.remember(key, found)
        _CERTIFIED[key] = found
    return _CERTIFIED.get(key, ())


def _probe_key(weights: Weights, cfg: ModelConfig, row_tile: int, tiles, attention: str,
               compiler_options) -> tuple:
    """What a probe's answer follows (the certificate's, the stage tiles'): the model's shape
    (not its special token ids: engines that differ only there share programs), the tiles,
    attention, backend, layout, dtypes and XLA options."""
    shape = dataclasses.replace(cfg, bos_token_id=None, eos_token_ids=())
    return (shape, row_tile, tuple(tiles), attention, jax.default_backend(),
            isinstance(weights.wq, (tuple, list)),
            tuple(str(x.dtype) for x in jax.tree.leaves(weights)), tuple(compiler_options))


def _certify(weights: Weights, cfg: ModelConfig, row_tile: int, cands, attention: str,
             options: dict, stages: tuple = ()):
    """One program with the candidate tiles (each stage in its own, with ``stages``), run twice
    per candidate t: slot 0's rows 0..t-1 alone (a tile of t, or each stage's smallest tile that
    holds them), then with a row of slot 1 at the step's last row (a tile of row_tile).
    Slot 0's logits, hidden states and pages must be the same bits.

    A deeper model is probed on its first ``PROBE_LAYERS`` layers: every decoder layer is the
    same code on the same shapes, each in its own tile loops, so a layer fed the embedding and
    one fed a layer and feeding the head stand for the rest (llama-160m: 23.3 s to compile and
    run its 12 layers at the suite's settings, 5.9 s its first two, the same answer)."""
    from sfjax import model                 # the model is built on this module
    from sfjax.cache import KVCache

    if cfg.num_layers > PROBE_LAYERS:
        cfg = dataclasses.replace(cfg, num_layers=PROBE_LAYERS)
        weights = dataclasses.replace(weights, **{f: x[:PROBE_LAYERS]
                                                  for f, x in layer_arrays(weights).items()})
    n, block_size = row_tile, 16
    per_slot = -(-n // block_size)
    tokens, tables = jax.device_put((   # device arrays, as before; placed, not computed
        np.random.default_rng(0).integers(0, cfg.vocab_size, n).astype(np.int32),
        np.arange(1, 1 + 2 * per_slot, dtype=np.int32).reshape(2, per_slot)))
    cache = KVCache.zeros(cfg, 1 + 2 * per_slot, block_size)

    @functools.partial(jax.jit, compiler_options=options or None)
    def probe(m, other):
        i = jnp.arange(n)
        positions = jnp.where(i < m, i, jnp.where((i == n - 1) & other, 0, -1))
        slots = jnp.where(i < m, 0, jnp.where(positions >= 0, 1, -1))
        tiling = Tiling(row_tile, cands, stages=stages)
        hidden, kv = model.forward(weights, cache, tokens, positions, slots, tables, cfg, tiling,
                                   attention=attention)
        out = model.logits(weights, hidden, cfg, tiling, num_rows=jnp.where(other, n, m))
        return out, hidden, kv.k[:, 1:1 + per_slot], kv.v[:, 1:1 + per_slot]

    def same(t):                       # compared on the host: no eager op compiles per shape
        (la, ha, ka, va), (lb, hb, kb, vb) = jax.device_get((probe(t, False), probe(t, True)))
        return all(np.array_equal(x, y) for x, y in
                   [(la[:t], lb[:t]), (ha[:t], hb[:t]), (ka, kb), (va, vb)])
    return tuple(t for t in cands if same(t))


# -- each stage in its fastest certified tile ---------------------------------------------------

_TUNED: dict = {}


def tune_stage_tiles(weights: Weights, cfg: ModelConfig, row_tile: int, tiles: tuple[int, ...],
                     *, attention: str = "auto",
                     compiler_options: tuple[tuple[str, Any], ...] = ()) -> tuple:
    """``Tiling.stages`` for certified ``tiles``: each stage's weights multiplied by a tile of t
    rows, timed for every t in ``tiles`` and ``row_tile`` (``_stage_times``), and each stage given
    the tiles its one-tile calls are fastest in (``_stage_choice``). The GEMM library's speed
    follows the weight's shape: on the CPU box YNNPACK multiplies the demo model's gate and up
    blocks ([256, 80]) twice as fast at 4 rows as at 2, and its LM head blocks ([256, 512])
    faster at 2 (BENCHMARKS.md). The whole choice is then probed as the certificate probes a
    tile (``_certify``), and () is kept if it gives other bits. Kept like the certificate, per
    process and on disk (``sfjax.certificate_cache``, ``_probe_key``): timings differ between
    runs, the bits of any certified choice do not."""
    from sfjax import certificate_cache

    if not tiles:
        return ()
    key = ("stages", *_probe_key(weights, cfg, row_tile, tiles, attention, compiler_options))
    if key not in _TUNED:
        found = certificate_cache.recall(key, _as_stages)
        if found is None:
            options, sizes = dict(compiler_options), tiles + (row_tile,)
            found = _stage_choice(_stage_times(weights, sizes, options), tiles, row_tile)
            if found:                   # timed again: a choice noise made is not kept
                again = dict(_stage_choice(_stage_times(weights, sizes, options,
                                                        tuple(s for s, _ in found)),
                                           tiles, row_tile))
                found = tuple((s, t) for s, t in found if again.get(s) == t)
            if found and _certify(weights, cfg, row_tile, tiles, attention, options,
                                  found) != tuple(tiles):
                found = ()
            certificate_cache.remember(key, [[stage, list(t)] for stage, t in found])
        _TUNED[key] = found
    return _TUNED[key]


def _as_stages(stored):
    """A stored stage choice as ``Tiling.stages``, or None if it is not one."""
    try:
        found = tuple((str(stage), tuple(int(t) for t in ts)) for stage, ts in stored)
    except (TypeError, ValueError):
        return None
    return found if all(stage in STAGES for stage, _ in found) else None


FLUSH_BYTES = 64 << 20   # read between timed calls, to push the weights out of the caches


def stage_matrices(weights: Weights) -> dict[str, list]:
    """{stage: its blocked weight matrices, every layer's} (``STAGE_WEIGHTS``)."""
    weights = block_weights(weights)
    layers = layer_arrays(weights)
    out = {}
    for stage, names in STAGE_WEIGHTS.items():
        out[stage] = []
        for name in names:
            a = weights.lm_head if name == "lm_head" else layers[name]
            out[stage] += list(a) if isinstance(a, (tuple, list)) or a.ndim == 4 else [a]
    return out


def tile_through(t: int, options: dict | None = None):
    """A fresh jitted function: a tile of t rows (ones) times each of a list of blocked matrices
    (``matmul``), the products summed to a scalar; what ``_stage_times`` and the benchmarks'
    weight-read floor (``scripts/bench_host.py``) time."""
    return jax.jit(lambda ms: sum(jnp.sum(matmul(jnp.ones((t, m.shape[1]), m.dtype), m)[:, :1])
                                  for m in ms), compiler_options=options or None)


def _stage_times(weights: Weights, tiles: tuple[int, ...], options: dict,
                 stages: tuple[str, ...] = STAGES, repeats: int = 3, calls: int = 3) -> dict:
    """{(stage, t): seconds} for ``stages`` (the others: the same for every t): every weight of
    the stage (every layer's) times a tile of t rows, in one jitted call, the best of
    ``repeats`` x ``calls`` calls, the tiles taking turns. Each call starts with the weights out
    of the CPU's caches (``FLUSH_BYTES`` read before it), as in a round, whose other stages push
    them out: YNNPACK's speed on the demo model's gate and up blocks follows the tile only
    then."""
    mats = stage_matrices(weights)
    runs = {(stage, t): (tile_through(t, options), mats[stage]) for stage in stages for t in tiles}
    best = {(stage, t): 0.0 for stage in STAGES for t in tiles} | dict.fromkeys(runs, float("inf"))
    flush = jax.jit(lambda x: jnp.sum(x))       # a fresh closure: freed with this call
    junk = jnp.ones(FLUSH_BYTES // 4, jnp.float32)
    for _ in range(repeats):
        for key, (fn, ms) in runs.items():
            jax.block_until_ready(fn(ms))
            for _ in range(calls):
                jax.block_until_ready(flush(junk))
                start = time.perf_counter()
                jax.block_until_ready(fn(ms))
                best[key] = min(best[key], time.perf_counter() - start)
    return best


def _stage_choice(times: dict, tiles: tuple[int, ...], row_tile: int) -> tuple:
    """``Tiling.stages`` from ``_stage_times``: for the calls a tile t of ``tiles`` is the smallest
    to hold, the fastest tile of at least t rows where it beats t by ``TUNE_MARGIN`` (else t);
    a stage whose choices are ``tiles`` is left out."""
    out = []
    for stage in STAGES:
        chosen = set()
        for t in tiles:
            best = min((u for u in (*tiles, row_tile) if u >= t), key=lambda u: times[stage, u])
            pick = best if times[stage, best] < TUNE_MARGIN * times[stage, t] else t
            if pick != row_tile:
                chosen.add(pick)
        if tuple(sorted(chosen)) != tuple(tiles):
            out.append((stage, tuple(sorted(chosen))))
    return tuple(out)


def certified_tiles(weights: Weights, cfg: ModelConfig, row_tile: int, *, attention: str,
                    mesh=None, enabled: bool = True,
                    compiler_options: tuple[tuple[str, Any], ...] = ()) -> tuple[tuple, tuple]:
    """(the small row tiles this backend certifies for the model, ``certify_row_tiles``; each
    stage's among them, ``tune_stage_tiles``), the ``RunConfig``'s: on one CPU device only (a
    mesh's sharded bodies are not probed; on accelerators a step's few rows are not what a
    decode step costs)."""
    if not enabled or mesh is not None or jax.default_backend() != "cpu":
        return (), ()
    tiles = certify_row_tiles(weights, cfg, row_tile, attention=attention,
                              compiler_options=compiler_options)
    return tiles, tune_stage_tiles(weights, cfg, row_tile, tiles, attention=attention,
                                   compiler_options=compiler_options)
