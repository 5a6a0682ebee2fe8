"""Llama as pure functions over a ragged token batch and a paged KV cache.

A call processes N query rows (N a multiple of ``row_tile``): prefill chunks, decode tokens and
verify tokens of many sequences alike, each row with its slot and position. Every dense op runs
per fixed tile of ``row_tile`` rows (``per_tile``), so a row's bits never depend on N or on the
other rows: XLA's GEMMs pick their code path by M, and a plain ``x @ W`` is not batch-invariant
(measured on XLA:CPU: M = 1 and M = 8 differ by 1.7e-6). Attention is row-invariant by
construction (pallas_kernels/paged_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rows import num_tiles_of, per_tile
from sfjax.cache import KVCache
from sfjax.config import ModelConfig, rope_frequencies
from sfjax.weights import LAYER_FIELDS, Weights


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope(x, positions, inv_freq):
    """HF's rotate-half RoPE. x [T, heads, D]; positions [T]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _qkv(x, positions, lw, cfg: ModelConfig, inv_freq):
    t = x.shape[0]
    h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
    q = (h @ lw["wq"]).reshape(t, cfg.num_heads, cfg.head_dim)
    k = (h @ lw["wk"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ lw["wv"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    return rope(q, positions, inv_freq), rope(k, positions, inv_freq), v


def _out_and_mlp(x, attn, lw, cfg: ModelConfig):
    x = x + attn.reshape(x.shape[0], -1).astype(x.dtype) @ lw["wo"]
    h = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
    return x + (jax.nn.silu(h @ lw["w_gate"]) * (h @ lw["w_up"])) @ lw["w_down"]


def cache_slots(block_tables, slots, positions, block_size):
    """(page, offset) each query row writes; padding rows (slot < 0) go to the null block 0."""
    pad = (slots < 0) | (positions < 0)
    pos = jnp.maximum(positions, 0)
    page = block_tables[jnp.maximum(slots, 0), pos // block_size]
    return jnp.where(pad, 0, page), jnp.where(pad, 0, pos % block_size)




def forward(weights: Weights, cache: KVCache, tokens, positions, slots, block_tables,
            cfg: ModelConfig, row_tile: int = 8, *, attention: str = "auto"):
    """The ragged forward: writes each row's K/V to its page, returns hidden states.

    Stacked weights run by ``lax.scan`` over the layer axis; weights from ``split_layers`` (a
    tuple of per-layer arrays per field) run an unrolled layer loop. XLA:CPU copies a scanned
    layer's weight slices every step (12 ms of an 18 ms llama-68m step, measured), so the engine
    splits on CPU; GPU and TPU scan.

    Args:
      tokens, positions, slots: int32 [N] (N a multiple of ``row_tile``; padding: slot -1).
      block_tables: int32 [max_seqs, max_blocks].
      attention: ``pallas_kernels.paged_attention.paged_attention``'s impl ("auto": the Pallas
        kernel on GPU and TPU, the reference on CPU; "interpret": the kernel in the interpreter).
    Returns:
      (hidden [N, d], cache) with this call's K/V written.
    """
    inv_freq = rope_frequencies(cfg)
    tiles = num_tiles_of(positions >= 0, row_tile)
    x = weights.embed[tokens]
    page, off = cache_slots(block_tables, slots, positions, cache.k.shape[2])
    sm_scale = float(cfg.head_dim) ** -0.5

    def layer(carry, lw, i):
        x, kc, vc = carry
        q, k, v = per_tile(functools.partial(_qkv, lw=lw, cfg=cfg, inv_freq=inv_freq),
                           row_tile, tiles, x, positions)
        kc = kc.at[i, page, off].set(k.astype(kc.dtype))
        vc = vc.at[i, page, off].set(v.astype(vc.dtype))
        attn = paged_attention(q, kc, vc, i, block_tables, slots, positions, sm_scale=sm_scale,
                               row_tile=row_tile, impl=attention)
        x = per_tile(functools.partial(_out_and_mlp, lw=lw, cfg=cfg), row_tile, tiles, x, attn)
        return x, kc, vc

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


def logits(weights: Weights, hidden, cfg: ModelConfig, row_tile: int = 8, num_rows=None):
    """Final norm and LM head, per tile; float32 [R, vocab]. Rows past ``num_rows`` (traced;
    default all) are skipped by whole tiles and come out zero."""
    head = weights.embed.T if weights.lm_head is None else weights.lm_head

    def fn(h):
        h = rms_norm(h, weights.final_norm, cfg.rms_norm_eps)
        return jnp.dot(h, head, preferred_element_type=jnp.float32)

    n = hidden.shape[0]
    rows = jnp.arange(n) < (n if num_rows is None else num_rows)
    return per_tile(fn, row_tile, num_tiles_of(rows, row_tile), hidden)
