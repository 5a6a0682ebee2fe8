"""Llama as pure functions over a ragged token batch and a paged KV cache.

A call processes N query rows (N a multiple of ``row_tile``): prefill chunks, decode tokens and
verify tokens of many sequences alike, each row with its slot and position. Every dense op runs
per fixed tile of ``row_tile`` rows (``per_tile``), so a row's bits never depend on N or on the
other rows: XLA's GEMMs pick their code path by M, and a plain ``x @ W`` is not batch-invariant
(measured on XLA:CPU: M = 1 and M = 8 differ by 1.7e-6). Attention is row-invariant by
construction (pallas_kernels/paged_attention.py). A step whose rows fit a smaller tile runs in it
where that is certified to keep the bits (``certify_row_tiles``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rows import per_tile_sized
from sfjax.cache import KVCache
from sfjax import sharding
from sfjax.config import ModelConfig, rope_frequencies
from sfjax.weights import LAYER_FIELDS, Weights, split_layers


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope_angles(positions, inv_freq):
    """(cos, sin) [T, 1, D] for ``rope``, computed once per tile for q and k."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, None, :]
    return cos, sin


def _rounded(x, zero):
    """``x`` unchanged, through an integer op the compiler cannot see through (``zero`` is a
    traced 0): a float32 product passed here is rounded before it is added to anything."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) | zero, jnp.float32)


def rope(x, angles, zero=None):
    """HF's rotate-half RoPE. x [T, heads, D]; ``angles`` from ``rope_angles``. XLA:CPU contracts
    x * cos + rotated * sin into an FMA, and which product it rounds followed the fusion around
    it (a shard holding one head got other bits): both are rounded first when ``zero`` (a traced
    int32 0) is given."""
    cos, sin = angles
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    a, b = x.astype(jnp.float32) * cos, rotated.astype(jnp.float32) * sin
    if zero is not None:
        a, b = _rounded(a, zero), _rounded(b, zero)
    return (a + b).astype(x.dtype)


def block(w):
    """[.., K, N] -> [.., U, K, N / U]: the fixed column blocks of ``matmul``."""
    *lead, k, n = w.shape
    u = sharding.blocks_of(n)
    return jnp.moveaxis(w.reshape(*lead, k, u, n // u), -2, -3)


def unblock(w):
    """``block``'s inverse: [.., U, K, W] -> [.., K, U * W]."""
    *lead, u, k, width = w.shape
    return jnp.moveaxis(w, -3, -2).reshape(*lead, k, u * width)


def _relayout(weights: Weights, fn, blocked: bool) -> Weights:
    """``fn`` applied to every matrix that is in the blocked layout (``blocked``) or the plain one;
    stacked or split by layer."""
    def one(name, x):
        if x is None or name == "embed" or name.endswith("norm"):
            return x
        if isinstance(x, (tuple, list)):
            return tuple(fn(a) if (a.ndim == 3) == blocked else a for a in x)
        return fn(x) if (x.ndim > (3 if name in LAYER_FIELDS else 2)) == blocked else x
    return dataclasses.replace(weights, **{f.name: one(f.name, getattr(weights, f.name))
                                           for f in dataclasses.fields(weights)})


def block_weights(weights: Weights) -> Weights:
    """The weights with every matrix in ``matmul``'s blocked layout; blocked ones are kept. The
    engine and ``sfjax.functional`` block once (``place_weights``); model functions given plain
    weights block them on every call, a relayout of every matrix each time."""
    if weights.lm_head is None:      # tied: the head once as embed.T, not a transpose per step
        weights = dataclasses.replace(weights, lm_head=jnp.array(weights.embed.T))
    return _relayout(weights, block, blocked=False)


def plain_shapes(weights: Weights) -> Weights:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of ``weights`` in the plain layout, blocked or
    not; nothing is computed."""
    return jax.eval_shape(lambda w: _relayout(w, unblock, blocked=True), weights)


def place_weights(weights: Weights, cfg: ModelConfig, mesh=None, split: bool = False) -> Weights:
    """The engine's weights: blocked, split by layer if ``split`` (see ``forward``), and sharded
    over ``mesh`` by the rules table (each process placing only its own devices' shards)."""
    weights = block_weights(weights)
    if split:
        weights = split_layers(weights)
    if mesh is None:
        return weights
    return sharding.put(weights, sharding.weight_specs(weights, cfg, mesh), mesh)


def matmul(a, w, out_dtype=None):
    """a [T, K] @ w in fixed column blocks: one batched dot of [T, K] x [K, W] products, w blocked
    [U, K, W] (``block``). A device holding some of the blocks computes them with the same
    per-block shapes as one holding all, so tensor parallelism keeps the bits (sfjax.sharding)."""
    u, _, width = w.shape
    o = lax.dot_general(jnp.broadcast_to(a[None], (u, *a.shape)), w, (((2,), (1,)), ((0,), (0,))),
                        preferred_element_type=out_dtype)
    return jnp.moveaxis(o, 0, 1).reshape(a.shape[0], u * width)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How a call is split over the mesh (all 1 / False off a mesh)."""
    tp: int = 1
    dp: int = 1
    kv_replicated: bool = False
    vocab_sharded: bool = False

    @classmethod
    def of(cls, cfg: ModelConfig, mesh):
        if mesh is None:
            return cls()
        return cls(sharding.tp_of(mesh), sharding.dp_of(mesh), sharding.kv_replicated(cfg, mesh),
                   sharding.vocab_sharded(cfg, mesh))

    def columns(self, x, axis):
        """All model shards' columns of ``x`` (an all-gather; nothing on one device)."""
        return x if self.tp == 1 else lax.all_gather(x, sharding.MODEL, axis=axis, tiled=True)

    def own_slots(self, slots, num_slots: int):
        """``slots`` with rows of other data shards' slots made padding (-1). Rows come laid out
        by shard, so this changes nothing; a misplaced row can then not write another request's
        pages (its page ids are another shard's)."""
        if self.dp == 1:
            return slots
        mine = slots // (num_slots // self.dp) == lax.axis_index(sharding.DATA)
        return jnp.where(mine, slots, -1)


def _small_tiles(cfg: ModelConfig, sp: _Split) -> tuple[int, ...]:
    """The certified smaller row tiles, on one device only (a mesh's bodies are not certified)."""
    return cfg.small_row_tiles if sp == _Split() else ()


def _embed(embed, tokens, sp: _Split):
    """Embedding rows; with the vocabulary sharded, each shard looks up its own ids and the owner's
    row is selected from the gathered lookups (a selection, so the bits are the table's)."""
    if not sp.vocab_sharded:
        return embed[tokens]
    v = embed.shape[0]
    lo = lax.axis_index(sharding.MODEL) * v
    local = embed[jnp.clip(tokens - lo, 0, v - 1)]
    every = lax.all_gather(local, sharding.MODEL)                         # [tp, N, d]
    return every[tokens // v, jnp.arange(tokens.shape[0])]


def _qkv(x, positions, lw, cfg: ModelConfig, inv_freq):
    t = x.shape[0]
    h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
    q = matmul(h, lw["wq"]).reshape(t, -1, cfg.head_dim)
    k = matmul(h, lw["wk"]).reshape(t, -1, cfg.head_dim)
    v = matmul(h, lw["wv"]).reshape(t, -1, cfg.head_dim)
    angles, zero = rope_angles(positions, inv_freq), (positions[0] < -2**30).astype(jnp.int32)
    return rope(q, angles, zero), rope(k, angles, zero), v


def _mlp_in(x, delta, lw, cfg: ModelConfig):
    x = x + delta
    h = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
    return x, jax.nn.silu(matmul(h, lw["w_gate"])) * matmul(h, lw["w_up"])


def cache_slots(block_tables, slots, positions, block_size):
    """(page, offset) each query row writes; padding rows (slot < 0) go to the null block 0."""
    pad = (slots < 0) | (positions < 0)
    pos = jnp.maximum(positions, 0)
    page = block_tables[jnp.maximum(slots, 0), pos // block_size]
    return jnp.where(pad, 0, page), jnp.where(pad, 0, pos % block_size)


def _attention(q, kc, vc, i, block_tables, slots, positions, cfg, row_tile, attention,
               sp: _Split):
    """This shard's heads. With the KV cache replicated (kv_heads < tp) the shard's query heads are
    placed among zeros for all heads, so attention runs with the single-device shapes."""
    sm_scale = float(cfg.head_dim) ** -0.5
    run = lambda q: paged_attention(q, kc, vc, i, block_tables, slots, positions, sm_scale=sm_scale,
                                    row_tile=row_tile, impl=attention)
    if not sp.kv_replicated:
        return run(q)
    h = q.shape[1]
    lo = lax.axis_index(sharding.MODEL) * h
    full = lax.dynamic_update_slice_in_dim(
        jnp.zeros((q.shape[0], cfg.num_heads, cfg.head_dim), q.dtype), q, lo, 1)
    return lax.dynamic_slice_in_dim(run(full), lo, h, 1)


def _forward(weights: Weights, cache: KVCache, tokens, positions, slots, block_tables, *,
             cfg: ModelConfig, row_tile: int, attention: str, sp: _Split):
    """One shard's forward (the whole forward off a mesh). Stages are separate row-tile loops,
    with the all-gathers between them, the same on one device as on many. A data shard's rows
    are its own slots' (``sharding.slot_rows``), so it writes and reads only its own pages."""
    inv_freq = rope_frequencies(cfg)
    slots = sp.own_slots(slots, block_tables.shape[0])
    x = _embed(weights.embed, tokens, sp)
    page, off = cache_slots(block_tables, slots, positions, cache.k.shape[2])
    tiled = lambda fn, *xs: per_tile_sized(fn, row_tile, _small_tiles(cfg, sp), positions >= 0, *xs)

    def layer(carry, lw, i):
        x, kc, vc = carry
        q, k, v = tiled(functools.partial(_qkv, lw=lw, cfg=cfg, inv_freq=inv_freq), x, positions)
        kc = kc.at[i, page, off].set(k.astype(kc.dtype))
        vc = vc.at[i, page, off].set(v.astype(vc.dtype))
        attn = _attention(q, kc, vc, i, block_tables, slots, positions, cfg, row_tile, attention,
                          sp)
        attn = sp.columns(attn, 1).astype(x.dtype)                        # [N, heads, D]
        delta = sp.columns(tiled(lambda a: matmul(a.reshape(a.shape[0], -1), lw["wo"]), attn), 1)
        x, act = tiled(functools.partial(_mlp_in, lw=lw, cfg=cfg), x, delta)
        down = sp.columns(tiled(lambda a: matmul(a, lw["w_down"]), sp.columns(act, 1)), 1)
        return x + down, kc, vc

    carry = (x, cache.k, cache.v)
    if isinstance(weights.wq, (tuple, list)):       # split_layers: one array per layer, unrolled
        for i in range(cfg.num_layers):
            carry = layer(carry, {f: getattr(weights, f)[i] for f in LAYER_FIELDS}, i)
    else:                                           # stacked: lax.scan over the layer axis
        layers = {f: getattr(weights, f) for f in LAYER_FIELDS}
        carry, _ = lax.scan(lambda c, xs: (layer(c, *xs), None), carry,
                            (layers, jnp.arange(cfg.num_layers)))
    x, k, v = carry
    return x, KVCache(k=k, v=v)


def _pad_rows(mesh, row_tile, *xs):
    """Rows padded (as padding rows, -1) to whole tiles. Over dp > 1 data shards they must come
    laid out by shard already: dp equal segments of whole tiles."""
    n, dp = xs[0].shape[0], sharding.dp_of(mesh)
    if dp > 1 and n % (dp * row_tile):
        raise ValueError(f"{n} rows can't be laid out by data shard: over {dp} shards a step "
                         f"needs a multiple of {dp} x row_tile ({row_tile}) rows")
    m = sharding.pad_to(n, mesh, row_tile)
    return [jnp.pad(x, (0, m - n), constant_values=fill) for x, fill in zip(xs, (0, -1, -1))]


def forward(weights: Weights, cache: KVCache, tokens, positions, slots, block_tables,
            cfg: ModelConfig, row_tile: int = 8, *, attention: str = "auto", mesh=None):
    """The ragged forward: writes each row's K/V to its page, returns hidden states.

    Stacked weights run by ``lax.scan`` over the layer axis; weights from ``split_layers`` (a
    tuple of per-layer arrays per field) run an unrolled layer loop. XLA:CPU copies a scanned
    layer's weight slices every step (12 ms of an 18 ms llama-68m step, measured), so the engine
    splits on CPU; GPU and TPU scan.

    Args:
      tokens, positions, slots: int32 [N] (N a multiple of ``row_tile``; padding: slot -1).
      block_tables: int32 [max_seqs, max_blocks].
      attention: ``pallas_kernels.paged_attention.paged_attention``'s impl ("auto": the Pallas
        kernel on GPU and TPU, the reference by query blocks on CPU; "reference_tiles": the
        reference in row tiles, for batched CPU serving; "interpret": the kernel in the
        interpreter).
      mesh: a (data, model) mesh (``sfjax.sharding``): the forward runs under ``shard_map`` with
        the weights and cache sharded by the rules table (the cache's pages over ``data``) and
        the rows split over ``data``. Over dp > 1 data shards the rows come laid out by shard
        (N = dp equal segments of whole tiles, segment d only rows of shard d's slots, see
        ``sharding.slot_rows``) and ``block_tables`` hold each shard's local page ids.
    Returns:
      (hidden [N, d], cache) with this call's K/V written.
    """
    weights = block_weights(weights)
    fn = functools.partial(_forward, cfg=cfg, row_tile=row_tile, attention=attention,
                           sp=_Split.of(cfg, mesh))
    if mesh is None:
        return fn(weights, cache, tokens, positions, slots, block_tables)
    n = tokens.shape[0]
    rows, cs = P(sharding.DATA), sharding.cache_spec(cfg, mesh)
    kv = KVCache(k=cs, v=cs)
    hidden, cache = sharding.shard_map(
        fn, mesh, in_specs=(sharding.weight_specs(weights, cfg, mesh), kv, rows, rows, rows, P()),
        out_specs=(rows, kv))(weights, cache, *_pad_rows(mesh, row_tile, tokens, positions, slots),
                              block_tables)
    return hidden[:n], cache


def _logits(weights: Weights, hidden, num_rows, *, cfg: ModelConfig, row_tile: int, sp: _Split):
    n = hidden.shape[0]
    first = lax.axis_index(sharding.DATA) * n if sp.dp > 1 else 0

    def fn(h):
        h = rms_norm(h, weights.final_norm, cfg.rms_norm_eps)
        return matmul(h, weights.lm_head, jnp.float32)      # a tied head is embed.T (block_weights)

    rows = first + jnp.arange(n) < num_rows
    out = per_tile_sized(fn, row_tile, _small_tiles(cfg, sp), rows, hidden)
    return sp.columns(out, 1) if sp.vocab_sharded else out


def logits(weights: Weights, hidden, cfg: ModelConfig, row_tile: int = 8, num_rows=None, *,
           mesh=None):
    """Final norm and LM head, per tile; float32 [R, vocab]. Rows past ``num_rows`` (traced;
    default all) are skipped by whole tiles and come out zero. On a ``mesh``: under ``shard_map``,
    rows over ``data``, the vocabulary over ``model`` (gathered at the end)."""
    weights = block_weights(weights)
    n = hidden.shape[0]
    num_rows = n if num_rows is None else num_rows
    fn = functools.partial(_logits, cfg=cfg, row_tile=row_tile, sp=_Split.of(cfg, mesh))
    if mesh is None:
        return fn(weights, hidden, num_rows)
    m = sharding.pad_to(n, mesh, row_tile)
    head = dataclasses.replace(weights, **{f: None for f in LAYER_FIELDS})
    out = sharding.shard_map(fn, mesh, in_specs=(sharding.weight_specs(head, cfg, mesh),
                                                 P(sharding.DATA), P()),
                             out_specs=P(sharding.DATA))(head, jnp.pad(hidden, ((0, m - n), (0, 0))),
                                                         num_rows)
    return out[:n]


_CERTIFIED: dict = {}
SMALL_ROW_TILES = (2, 4)


def certify_row_tiles(weights: Weights, cfg: ModelConfig, row_tile: int = 8,
                      candidates: tuple[int, ...] = SMALL_ROW_TILES, *,
                      attention: str = "auto") -> tuple[int, ...]:
    """The tiles of ``candidates`` (below ``row_tile``, dividing it) that give, row for row, the
    bits of ``row_tile`` tiles: forward (hidden states and the K/V written) and logits of a probe
    step run both ways on this backend, compared bitwise. One device, no mesh.

    A GEMM library picks its kernels by M, so this is the library's property, not XLA's
    contract: XLA:CPU's (YNNPACK) computes M = 2, 4 and 8 with the same per-row arithmetic and
    M = 1 and 16 with other bits (measured on the demo model). The answer depends on shapes only,
    so it is kept per (model shape, row_tile, backend) for the process.
    """
    cands = tuple(sorted(t for t in set(candidates) if t < row_tile and row_tile % t == 0))
    base = dataclasses.replace(cfg, small_row_tiles=())
    key = (base, row_tile, cands, attention, jax.default_backend(),
           isinstance(weights.wq, (tuple, list)),
           tuple(str(x.dtype) for x in jax.tree.leaves(weights)))
    if key not in _CERTIFIED:
        _CERTIFIED[key] = _certify(weights, base, row_tile, cands, attention) if cands else ()
    return _CERTIFIED[key]


def _certify(weights: Weights, cfg: ModelConfig, row_tile: int, cands, attention: str):
    """One program with the candidate tiles, run twice per candidate t: slot 0's rows 0..t-1
    alone (a tile of t), then with a row of slot 1 at the step's last row (a tile of row_tile).
    Slot 0's logits, hidden states and pages must be the same bits."""
    n, block_size = row_tile, 16
    per_slot = -(-n // block_size)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, n), jnp.int32)
    tables = jnp.arange(1, 1 + 2 * per_slot, dtype=jnp.int32).reshape(2, per_slot)
    cache = KVCache.zeros(cfg, 1 + 2 * per_slot, block_size)
    small = dataclasses.replace(cfg, small_row_tiles=cands)

    @jax.jit
    def probe(m, other):
        i = jnp.arange(n)
        positions = jnp.where(i < m, i, jnp.where((i == n - 1) & other, 0, -1))
        slots = jnp.where(i < m, 0, jnp.where(positions >= 0, 1, -1))
        hidden, kv = forward(weights, cache, tokens, positions, slots, tables, small, row_tile,
                             attention=attention)
        out = logits(weights, hidden, small, row_tile, num_rows=jnp.where(other, n, m))
        return out, hidden, kv.k[:, 1:1 + per_slot], kv.v[:, 1:1 + per_slot]

    def same(t):
        (la, ha, ka, va), (lb, hb, kb, vb) = probe(t, False), probe(t, True)
        return all(bool((x == y).all()) for x, y in
                   [(la[:t], lb[:t]), (ha[:t], hb[:t]), (ka, kb), (va, vb)])
    return tuple(t for t in cands if same(t))


def with_certified_tiles(weights: Weights, cfg: ModelConfig, row_tile: int, *, attention: str,
                         mesh=None, enabled: bool = True) -> ModelConfig:
    """``cfg`` with the small row tiles this backend certifies (``certify_row_tiles``): on one CPU
    device only (a mesh's sharded bodies are not probed; on accelerators a step's few rows are
    not what a decode step costs)."""
    if not enabled or mesh is not None or jax.default_backend() != "cpu":
        return dataclasses.replace(cfg, small_row_tiles=())
    return dataclasses.replace(cfg, small_row_tiles=certify_row_tiles(
        weights, cfg, row_tile, attention=attention))
