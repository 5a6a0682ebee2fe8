"""The jitted step: one ragged forward over the paged cache, logits at chosen rows, sampling."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from sfjax import model, sampling
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.weights import Weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """What the host plans for one step. N and R are padded to shape buckets."""
    tokens: jax.Array        # int32 [N]
    positions: jax.Array     # int32 [N]; -1 for padding
    slots: jax.Array         # int32 [N]; -1 for padding
    block_tables: jax.Array  # int32 [max_seqs, max_blocks]
    logit_rows: jax.Array    # int32 [R] rows of N whose next token is drawn (padding: 0)
    num_logit_rows: jax.Array  # int32 scalar: the real ones come first
    sampling: sampling.SamplingBatch


@functools.partial(jax.jit, static_argnames=("cfg", "row_tile"), donate_argnames=("cache",))
def model_step(weights: Weights, cache: KVCache, batch: StepBatch, *, cfg: ModelConfig,
               row_tile: int):
    """Runs one step. DONATES ``cache``. Returns (cache, tokens int32 [R], logits f32 [R, V])."""
    hidden, cache = model.forward(weights, cache, batch.tokens, batch.positions, batch.slots,
                                  batch.block_tables, cfg, row_tile)
    logits = model.logits(weights, hidden[batch.logit_rows], cfg, row_tile, batch.num_logit_rows)
    return cache, sampling.sample(logits, batch.sampling), logits
