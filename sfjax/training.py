"""The dense causal Llama the training scripts use (scripts/train_demo.py, scripts/train_eagle.py):
sfjax's ``Weights`` pytree (plain layout) over whole sequences, with sfjax's own RMSNorm and RoPE,
so trained arrays go straight to ``weights.save_hf`` and serve as they trained. Serving runs the
paged, row-invariant forward (``sfjax.model``); the two agree to float rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sfjax import weights as W
from sfjax.config import ModelConfig, rope_frequencies
from sfjax.model import rope, rope_angles
from sfjax.rows import rms_norm


def forward(w: W.Weights, tokens, cfg: ModelConfig, features: tuple[int, ...] = ()):
    """tokens int32 [B, T] -> logits float32 [B, T, vocab]; with ``features`` also the residual
    stream entering those layers, concatenated [B, T, len(features) x d] (as
    ``model.forward``'s: EAGLE-3's fused features)."""
    b, t = tokens.shape
    inv_freq, positions = rope_frequencies(cfg), jnp.arange(t)

    def layer(x, lw):
        h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
        q, k, v = h @ lw["wq"], h @ lw["wk"], h @ lw["wv"]
        if cfg.qkv_bias:
            q, k, v = q + lw["q_bias"], k + lw["k_bias"], v + lw["v_bias"]
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            eps = cfg.rms_norm_eps
            q, k = rms_norm(q, lw["q_norm"], eps), rms_norm(k, lw["k_norm"], eps)
        angles = rope_angles(positions, inv_freq)
        q, k = rope(q, angles), rope(k, angles)
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)   # [B, T, heads, hd]
        out = x + attn.reshape(b, t, -1) @ lw["wo"]
        h = rms_norm(out, lw["mlp_norm"], cfg.rms_norm_eps)
        return out + (jax.nn.silu(h @ lw["w_gate"]) * (h @ lw["w_up"])) @ lw["w_down"], x

    x, inputs = jax.lax.scan(layer, w.embed[tokens], W.layer_arrays(w))
    x = rms_norm(x, w.final_norm, cfg.rms_norm_eps)
    logits = x @ (w.embed.T if w.lm_head is None else w.lm_head)
    if not features:
        return logits
    return logits, jnp.concatenate([inputs[i] for i in features], axis=-1)
