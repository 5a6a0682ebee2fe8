"""Sampling on the device: Gumbel-max with counter-based keys.

The draw at output position t of a request uses ``fold_in(fold_in(request_key, t), role)``: it
depends on (request key, position, logits) only, never on the batch or on earlier draws.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

ROLE_TARGET = 0   # the token drawn from the target model at a position
ROLE_DRAFT = 1    # reserved for drafters that couple with the target (same noise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per logit row: [R] arrays."""
    temperature: jax.Array   # float32; 0 = greedy
    key_data: jax.Array      # uint32 [R, 2] raw threefry request keys
    position: jax.Array      # int32 output position t of the draw
    suppress: jax.Array      # int32 [R, S] token ids that can't be drawn (-1: none)


def request_key_data(seed: int) -> tuple[int, int]:
    """Raw threefry key data of ``jax.random.key(seed)`` for a 64-bit seed, computed on the host."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def draw_keys(key_data, position, role: int):
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    return jax.vmap(lambda k, t: jax.random.fold_in(jax.random.fold_in(k, t), role))(keys, position)


def gumbel_noise(key_data, position, vocab: int, role: int = ROLE_TARGET):
    """float32 Gumbel noise [R, vocab]; row r depends only on its key and position."""
    keys = draw_keys(key_data, position, role)
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def suppress_tokens(logits, suppress):
    """Sets the listed ids to -inf (min_tokens); -1 entries are ignored."""
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(suppress >= 0, suppress, logits.shape[1])       # out of range: dropped
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def sample(logits, batch: SamplingBatch):
    """Greedy where temperature is 0, else argmax(logits / T + G(key_t)). logits: f32 [R, V]."""
    logits = suppress_tokens(logits, batch.suppress)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        g = gumbel_noise(batch.key_data, batch.position, logits.shape[-1])
        t = jnp.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
        drawn = jnp.argmax(logits / t + g, axis=-1).astype(jnp.int32)
        return jnp.where(batch.temperature > 0, drawn, greedy)

    return lax.cond(jnp.any(batch.temperature > 0), sampled, lambda _: greedy, None)
