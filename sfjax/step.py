"""What a round carries: the device state between rounds, the batch the caller plans, and the
helpers the round and its proposers share (``sfjax.round`` is the round itself)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax.sharding import NamedSharding, PartitionSpec as P

from sfjax import sampling, sharding
from sfjax.cache import KVCache
from sfjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    """What lives on the device between steps (donated through each step): the KV pages and,
    per slot, its tokens, its block table and its request's sampling settings. The host sends
    only what changed (``update_slots``; ``sfjax.engine.slots``)."""
    cache: KVCache
    history: jax.Array       # int32 [max_seqs, max_model_len]: each slot's tokens by position
    block_tables: jax.Array  # int32 [max_seqs, max_blocks]: each slot's pages
    table: sampling.Sampling  # [max_seqs] each slot's request's sampling settings


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """What the host plans for one step. N and R are padded to shape buckets."""
    tokens: jax.Array          # int32 [N]
    positions: jax.Array       # int32 [N]; -1 for padding
    slots: jax.Array           # int32 [N]; -1 for padding
    logit_rows: jax.Array      # int32 [R] rows of N whose logits are taken (padding: 0)
    num_logit_rows: jax.Array  # int32 scalar: the real ones come first
    with_logprobs: jax.Array   # bool scalar: compute raw logprobs this step
    draws: sampling.Draws      # [R] which slot and position each logit row draws at


def record_tokens(history, slots, positions, tokens):
    """Writes each valid row's token at (slot, position); padding rows are dropped."""
    valid = (slots >= 0) & (positions >= 0)
    return history.at[jnp.where(valid, slots, history.shape[0]), positions].set(tokens, mode="drop")


def replicated(tree, mesh):
    """``tree`` constrained to be whole on every device of ``mesh`` (what the host reads back,
    and the sampler's input); nothing off a mesh."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P()))


def keep_cache_sharding(cache: KVCache, cfg: ModelConfig, mesh) -> KVCache:
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(
        cache, NamedSharding(mesh, sharding.cache_spec(cfg, mesh)))


@functools.partial(jax.jit, donate_argnames=("state",))
def write_history(state: DeviceState, slot, row, n) -> DeviceState:
    """Sets ``slot``'s history at positions < ``n`` to ``row`` (tokens the prefix cache skipped).
    DONATES ``state``."""
    keep = jnp.arange(state.history.shape[1]) < n
    history = state.history.at[slot].set(jnp.where(keep, row, state.history[slot]))
    return dataclasses.replace(state, history=history)


@functools.partial(jax.jit, donate_argnames=("state",))
def update_slots(state: DeviceState, slots, block_rows, table_rows: sampling.Sampling) -> DeviceState:
    """Sets the block table and sampling rows of ``slots`` (int32 [U]; an index past the last
    slot is padding, dropped) to ``block_rows`` [U, max_blocks] and ``table_rows`` [U].
    DONATES ``state``."""
    put = lambda x, rows: x.at[slots].set(rows, mode="drop")
    return dataclasses.replace(state, block_tables=put(state.block_tables, block_rows),
                               table=jax.tree.map(put, state.table, table_rows))
