"""Llama as pure functions over a ragged token batch and a paged KV cache.

A call processes N query rows (N a multiple of ``row_tile``): prefill chunks, decode tokens and
verify tokens of many sequences alike, each row with its slot and position. Every dense op runs
through ``sfjax.rows`` (``Rows.apply`` over fixed tiles, ``rows.matmul`` in fixed column blocks),
so a row's bits never depend on N or on the other rows; attention is row-invariant by
construction (pallas_kernels/paged_attention.py). On a mesh the forward runs under ``shard_map``
(``sfjax.sharding``: ``Split`` says how one shard's part is split).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention import paged_attention
from sfjax import rows, sharding
from sfjax.cache import KVCache
from sfjax.config import ModelConfig, rope_frequencies
from sfjax.rows import matmul
from sfjax.sharding import Split
from sfjax.weights import PER_LAYER, Weights, layer_arrays


def rope_angles(positions, inv_freq):
    """(cos, sin) [T, 1, D] for ``rope``, computed once per tile for q and k."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, None, :]
    return cos, sin


def rope(x, angles, zero=None):
    """HF's rotate-half RoPE. x [T, heads, D]; ``angles`` from ``rope_angles``. XLA:CPU contracts
    x * cos + rotated * sin into an FMA, and which product it rounds followed the fusion around
    it (a shard holding one head got other bits): both are rounded first when ``zero``
    (``rows.opaque_zero``) is given."""
    cos, sin = angles
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    a, b = x.astype(jnp.float32) * cos, rotated.astype(jnp.float32) * sin
    if zero is not None:
        a, b = rows.rounded(a, zero), rows.rounded(b, zero)
    return (a + b).astype(x.dtype)


LAYER_LOOPS = ("auto", "scan", "unrolled")


def unrolled(layer_loop: str) -> bool:
    """Whether ``layer_loop`` runs the layers unrolled, on weights split by layer (``forward``):
    "auto" unrolls on CPU and scans on GPU and TPU."""
    return layer_loop == "unrolled" or (layer_loop == "auto" and jax.default_backend() == "cpu")


def cache_slots(block_tables, slots, positions, block_size):
    """(page, offset) each query row writes; padding rows (slot < 0) go to the null block 0."""
    pad = (slots < 0) | (positions < 0)
    pos = jnp.maximum(positions, 0)
    page = block_tables[jnp.maximum(slots, 0), pos // block_size]
    return jnp.where(pad, 0, page), jnp.where(pad, 0, pos % block_size)


# -- one decoder layer --------------------------------------------------------------------------


def qkv(x, positions, lw, cfg: ModelConfig, inv_freq, mm=matmul):
    """Rows' queries, keys and values: the attention norm and the three projections (one fused
    product, ``mm``: ``Rows.matmul``), Qwen2's biases and Qwen3's head norms, RoPE."""
    t = x.shape[0]
    q, k, v = mm(x, (lw["wq"], lw["wk"], lw["wv"]), norm=(lw["attn_norm"], cfg.rms_norm_eps))
    if cfg.qkv_bias:
        q, k, v = q + lw["q_bias"], k + lw["k_bias"], v + lw["v_bias"]
    q, k, v = (a.reshape(t, -1, cfg.head_dim) for a in (q, k, v))
    if cfg.qk_norm:
        eps = cfg.rms_norm_eps
        q, k = rows.rms_norm(q, lw["q_norm"], eps), rows.rms_norm(k, lw["k_norm"], eps)
    angles, zero = rope_angles(positions, inv_freq), rows.opaque_zero(positions)
    return rope(q, angles, zero), rope(k, angles, zero), v


def mlp_input(x, attn, lw, cfg: ModelConfig, mm=matmul):
    """The residual after attention, and the MLP's gated activation of it:
    (x + attn, silu(gate(h)) * up(h)) with h = mlp_norm(x + attn), in one tile body."""
    x = x + attn
    gate, up = mm(x, (lw["w_gate"], lw["w_up"]), norm=(lw["mlp_norm"], cfg.rms_norm_eps))
    return x, jax.nn.silu(gate) * up


def attention_block(x, kc, vc, i, lw, ctx):
    """Layer ``i``'s attention: writes this call's K/V to the cache pages, attends, projects.
    Returns (the attention output projected to d [N, d], the caches)."""
    cfg, sp, r = ctx.cfg, ctx.sp, ctx.rows
    q, k, v = r.apply(functools.partial(qkv, lw=lw, cfg=cfg, inv_freq=ctx.inv_freq, mm=r.matmul),
                      x, ctx.positions, stage="qkv")
    kc = kc.at[i, ctx.page, ctx.offset].set(k.astype(kc.dtype))
    vc = vc.at[i, ctx.page, ctx.offset].set(v.astype(vc.dtype))
    run = lambda q: paged_attention(q, kc, vc, i, ctx.block_tables, ctx.slots, ctx.positions,
                                    sm_scale=float(cfg.head_dim) ** -0.5, row_tile=r.tiling.tile,
                                    impl=ctx.attention)
    attn = sp.columns(sp.heads(run, q, cfg.num_heads), 1).astype(x.dtype)     # [N, heads, D]
    out = r.apply(lambda a: r.matmul(a.reshape(a.shape[0], -1), lw["wo"]), attn, stage="o")
    return sp.columns(out, 1), kc, vc


def mlp(x, attn, lw, ctx):
    """Layer's MLP: (the residual x + attn, down(silu(gate(h)) * up(h))), h = mlp_norm(x + attn)."""
    sp, r = ctx.sp, ctx.rows
    x, act = r.apply(functools.partial(mlp_input, lw=lw, cfg=ctx.cfg, mm=r.matmul), x, attn,
                     stage="mlp")
    down = r.apply(lambda a: r.matmul(a, lw["w_down"]), sp.columns(act, 1), stage="down")
    return x, sp.columns(down, 1)


def decoder_layer(carry, lw, i, ctx):
    x, kc, vc = carry
    attn, kc, vc = attention_block(x, kc, vc, i, lw, ctx)
    x, down = mlp(x, attn, lw, ctx)
    return x + down, kc, vc


@dataclasses.dataclass(frozen=True)
class _Call:
    """What every layer of one call shares (one shard's, under ``shard_map``)."""
    cfg: ModelConfig
    sp: Split
    rows: rows.Rows
    attention: str
    inv_freq: jax.Array
    positions: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    page: jax.Array
    offset: jax.Array


def _forward(weights: Weights, cache: KVCache, tokens, positions, slots, block_tables, *,
             cfg: ModelConfig, tiling: rows.Tiling, attention: str, sp: Split,
             features: tuple[int, ...] = ()):
    """One shard's forward (the whole forward off a mesh). Stages are separate row-tile loops,
    with the all-gathers between them, the same on one device as on many. A data shard's rows
    are its own slots' (``sharding.slot_rows``), so it writes and reads only its own pages.
    With ``features``, also the residual stream entering each of those layers, concatenated."""
    slots = sp.own_slots(slots, block_tables.shape[0])
    page, offset = cache_slots(block_tables, slots, positions, cache.k.shape[2])
    ctx = _Call(cfg, sp, tiling.rows(positions >= 0, sp != Split()), attention,
                rope_frequencies(cfg), positions, slots, block_tables, page, offset)
    x = sp.embed(weights.embed, tokens)
    carry, taken = (x, cache.k, cache.v), jnp.zeros((len(features), *x.shape), x.dtype)
    take = lambda taken, x, i: jnp.where((jnp.asarray(features) == i)[:, None, None], x, taken)
    if isinstance(weights.wq, (tuple, list)):       # split_layers: one array per layer, unrolled
        for i in range(cfg.num_layers):
            taken = take(taken, carry[0], i) if i in features else taken
            carry = decoder_layer(carry, {f: x[i] for f, x in layer_arrays(weights).items()},
                                  i, ctx)
    else:                                           # stacked: lax.scan over the layer axis
        layers = layer_arrays(weights)

        def layer(c, xs):
            carry, taken = c
            taken = take(taken, carry[0], xs[1]) if features else taken
            return (decoder_layer(carry, *xs, ctx), taken), None
        (carry, taken), _ = lax.scan(layer, (carry, taken), (layers, jnp.arange(cfg.num_layers)))
    x, k, v = carry
    if not features:
        return x, KVCache(k=k, v=v)
    return x, KVCache(k=k, v=v), jnp.concatenate(list(taken), axis=-1)


def forward(weights: Weights, cache: KVCache, tokens, positions, slots, block_tables,
            cfg: ModelConfig, tiling: rows.Tiling = rows.Tiling(), *, attention: str = "auto",
            mesh=None, features: tuple[int, ...] = ()):
    """The ragged forward: writes each row's K/V to its page, returns hidden states.

    Stacked weights run by ``lax.scan`` over the layer axis; weights from ``split_layers`` (a
    tuple of per-layer arrays per field) run an unrolled layer loop. XLA:CPU copies a scanned
    layer's weight slices every step (12 ms of an 18 ms llama-68m step, measured), so the engine
    splits on CPU; GPU and TPU scan.

    Args:
      tokens, positions, slots: int32 [N] (N a multiple of ``tiling.tile``; padding: slot -1).
      tiling: how the rows are computed (``rows.Tiling``): row tiles, the certified smaller
        tiles a call whose valid rows fit one runs in (one device only), or a
        ``pallas_kernels.matmul`` impl ("interpret", "triton", "mosaic_tpu"): each matmul one
        batch-invariant Pallas launch over all rows.
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
      features: target layers (each in [0, num_layers)) whose input, the residual stream
        entering the layer, is also returned, concatenated in this order (EAGLE-3's fused
        features, ``sfjax.spec.eagle``).
    Returns:
      (hidden [N, d], cache) with this call's K/V written; with ``features``, (hidden, cache,
      features [N, len(features) * d]).
    """
    if not all(isinstance(i, int) and 0 <= i < cfg.num_layers for i in features):
        raise ValueError(f"features = {features!r} is out of range: must be layers in "
                         f"[0, {cfg.num_layers})")
    weights = rows.block_weights(weights)
    fn = functools.partial(_forward, cfg=cfg, tiling=tiling, attention=attention,
                           sp=Split.of(cfg, mesh), features=tuple(features))
    if mesh is None:
        return fn(weights, cache, tokens, positions, slots, block_tables)
    n = tokens.shape[0]
    data, cs = P(sharding.DATA), sharding.cache_spec(cfg, mesh)
    kv = KVCache(k=cs, v=cs)
    out = sharding.shard_map(
        fn, mesh, in_specs=(sharding.weight_specs(weights, cfg, mesh), kv, data, data, data, P()),
        out_specs=(data, kv, data)[:3 if features else 2])(
            weights, cache, *sharding.pad_rows(mesh, tiling.tile, tokens, positions, slots),
            block_tables)
    return (out[0][:n], out[1], *(x[:n] for x in out[2:]))


# -- the head -----------------------------------------------------------------------------------


def head(h, weights: Weights, cfg: ModelConfig, mm=matmul):
    """Final norm and LM head of rows' hidden states; float32 logits (a tied head is embed.T,
    ``rows.block_weights``)."""
    return mm(h, weights.lm_head, jnp.float32, norm=(weights.final_norm, cfg.rms_norm_eps))


def _logits(weights: Weights, hidden, num_rows, *, cfg: ModelConfig, tiling: rows.Tiling,
            sp: Split):
    n = hidden.shape[0]
    r = tiling.rows(sp.first_row(n) + jnp.arange(n) < num_rows, sp != Split())
    out = r.apply(functools.partial(head, weights=weights, cfg=cfg, mm=r.matmul), hidden,
                  stage="head")
    return sp.columns(out, 1) if sp.vocab_sharded else out


def logits(weights: Weights, hidden, cfg: ModelConfig, tiling: rows.Tiling = rows.Tiling(),
           num_rows=None, *, mesh=None):
    """Final norm and LM head, per tile; float32 [R, vocab]. Rows past ``num_rows`` (traced;
    default all) are skipped by whole tiles and come out zero. On a ``mesh``: under ``shard_map``,
    rows over ``data``, the vocabulary over ``model`` (gathered at the end)."""
    weights = rows.block_weights(weights)
    n = hidden.shape[0]
    num_rows = n if num_rows is None else num_rows
    fn = functools.partial(_logits, cfg=cfg, tiling=tiling, sp=Split.of(cfg, mesh))
    if mesh is None:
        return fn(weights, hidden, num_rows)
    m = sharding.pad_to(n, mesh, tiling.tile)
    lm = dataclasses.replace(weights, **{f: None for f in PER_LAYER})
    out = sharding.shard_map(fn, mesh, in_specs=(sharding.weight_specs(lm, cfg, mesh),
                                                 P(sharding.DATA), P()),
                             out_specs=P(sharding.DATA))(lm, jnp.pad(hidden, ((0, m - n), (0, 0))),
                                                         num_rows)
    return out[:n]
