"""What a round carries: the device state between rounds, the batch the caller plans, and the
helpers the round and its proposers share (``sfjax.round`` is the round itself)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec as P

from sfjax import sampling, sharding
from sfjax.cache import KVCache
from sfjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Progress:
    """Per slot, where the rounds the device lays out start from; int32 [slots] each (``live``
    bool). The rounds (``sfjax.functional``) advance the live slots' rows and end them. The
    engine's host sends a slot's row only when it differs from what the device holds
    (``sfjax.engine.slots``): an admission, an end, a stop string."""
    prompt_len: jax.Array
    length: jax.Array        # prompt + output tokens so far
    last: jax.Array          # the newest token (the history holds it at length - 1 once fed)
    live: jax.Array          # bool: the device lays out this slot's rows (it decodes)
    drafted: jax.Array       # the request's draft tokens so far
    accepted: jax.Array      # its accepted drafts that were emitted (adaptive_k reads them)
    spec_rounds: jax.Array   # its rounds that drafted (vLLM's num_drafts)
    rejected: jax.Array      # its rounds that rejected a draft (adaptive_k reads them)
    drafts: jax.Array        # bool: its request drafts (its strategy is the round's, not plain)
    copy_accepted: jax.Array  # of ``accepted``, those of rounds that drafted a copy (``ngram``'s
    copy_rejected: jax.Array  # match in the row's own tokens), and of ``rejected``: adaptive_k
                              # reads copies and the other drafts apart

    @classmethod
    def start(cls, prompt_len) -> "Progress":
        """Rows at their prompts (0: an empty row, not live), nothing drawn yet (each field an
        array of its own: a call outside jit donates them)."""
        zeros = lambda: jnp.zeros_like(prompt_len)
        return cls(prompt_len=jnp.array(prompt_len), length=jnp.array(prompt_len), last=zeros(),
                   live=prompt_len > 0, drafted=zeros(), accepted=zeros(), spec_rounds=zeros(),
                   rejected=zeros(), drafts=prompt_len > 0, copy_accepted=zeros(),
                   copy_rejected=zeros())

    @classmethod
    def of_rows(cls, rows: np.ndarray) -> "Progress":
        """The progress of int32 rows [U, 11], one column per field in order (the host's form:
        ``sfjax.engine.slots``)."""
        return cls(*(rows[:, i].astype(bool if name in ("live", "drafts") else np.int32)
                     for i, name in enumerate(PROGRESS_FIELDS)))


PROGRESS_FIELDS = tuple(f.name for f in dataclasses.fields(Progress))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    """The slot state, the one pytree that lives on the device between calls (donated through
    each): the KV pages, per slot its tokens, its block table, its request's sampling settings
    and its progress, and the proposer's state (the draft model's pages, an EAGLE head's
    ``HeadState``, or None). The engine's host sends only what changed (``update_slots``;
    ``sfjax.engine.slots``); ``sfjax.functional`` calls it ``State``."""
    cache: KVCache
    history: jax.Array       # int32 [slots, max_model_len]: each slot's tokens by position
    block_tables: jax.Array  # int32 [slots, max_blocks]: each slot's pages
    table: sampling.Sampling  # [slots] each slot's request's sampling settings
    progress: Progress
    draft_cache: Any = None  # KVCache | eagle.HeadState | None: the proposer's state

    @property
    def done(self) -> jax.Array:
        """bool [slots]: the rows the rounds do not advance (ended, empty, or the engine's host
        lays them out)."""
        return ~self.progress.live


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


@functools.partial(jax.jit, donate_argnames=("block_tables",))
def update_blocks(block_tables, slots, block_rows):
    """``block_tables`` with the rows of ``slots`` (int32 [U]; an index past the last slot is
    padding, dropped) set to ``block_rows`` [U, max_blocks]: what a call sends when only pages
    changed (a decoding request grew into a new block), a program of three arrays where
    ``update_slots`` takes the whole state. DONATES ``block_tables``."""
    return block_tables.at[slots].set(block_rows, mode="drop")


@functools.partial(jax.jit, donate_argnames=("state",))
def update_slots(state: DeviceState, slots, block_rows, table_rows: sampling.Sampling,
                 progress_rows: Progress) -> DeviceState:
    """Sets the block table, sampling and progress rows of ``slots`` (int32 [U]; an index past
    the last slot is padding, dropped) to ``block_rows`` [U, max_blocks], ``table_rows`` [U] and
    ``progress_rows`` [U]. DONATES ``state``."""
    put = lambda x, rows: x.at[slots].set(rows, mode="drop")
    return dataclasses.replace(state, block_tables=put(state.block_tables, block_rows),
                               table=jax.tree.map(put, state.table, table_rows),
                               progress=jax.tree.map(put, state.progress, progress_rows))
