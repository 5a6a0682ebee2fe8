"""One speculative round as one jitted, static-shaped function: draft -> verify -> accept -> rollback.

Rows of the step: prefill chunks (and rows that don't speculate) as in the plain step, plus for each
speculating slot K + 1 verify rows ``[last token, d_1 .. d_K]`` at positions ``L-1 .. L-1+K``. The
host lays the verify rows out with their positions; the device fills in the drafts and turns the
rows past a slot's own k into padding. Rollback is a length: the host moves ``num_computed`` by
what was emitted, and K/V written past it is dead (never attended, overwritten later).

The round is specialised on a ``RoundConfig``: its proposer (``spec.proposers``: ``Ngram``,
``DraftModel``) and its acceptance rule (``spec.accept``: ``Exact``, ``Rejection``, ``Typical``),
frozen dataclasses with one method each; ``spec_step`` calls them and never names a method.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from sfjax import model, sampling
from sfjax.config import ModelConfig
from sfjax.spec import accept, proposers
from sfjax.step import DeviceState, StepBatch, keep_cache_sharding, record_tokens, replicated


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecBatch:
    """The speculating slots of a step (S padded to a bucket; padding slot -1)."""
    slots: jax.Array          # int32 [S]
    length: jax.Array         # int32 [S] sequence length L (last token at L-1)
    k: jax.Array              # int32 [S] drafts wanted this round (0: verify only the last token)
    verify_row: jax.Array     # int32 [S] row of N holding position L-1; K drafts follow it
    stop_ids: jax.Array       # int32 [S, B] tokens that end the sequence (-1 pad)
    min_left: jax.Array       # int32 [S] emitted index from which stop tokens count
    budget: jax.Array         # int32 [S] tokens the slot may still emit (max_tokens, max_model_len)
    draft_tokens: jax.Array   # int32 [NA] draft model rows: prefill rows + (L-2, L-1) per slot
    draft_positions: jax.Array
    draft_slots: jax.Array
    draft_last: jax.Array     # int32 [S] row of NA holding position L-1
    verify_start: jax.Array   # int32 scalar: the first verify logit row (they come last)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """What a round is specialised on: its proposer and its acceptance rule."""
    proposer: Any             # proposers.Ngram | proposers.DraftModel
    rule: Any                 # accept.Exact | accept.Rejection | accept.Typical

    @property
    def k_max(self) -> int:
        return self.proposer.k_max

    @classmethod
    def of(cls, spec) -> "RoundConfig":
        """The round of a ``SpeculativeConfig``."""
        k = spec.num_speculative_tokens
        proposer = (proposers.Ngram(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
                    if spec.method == "ngram" else proposers.DraftModel(k))
        rule = accept.RULES[spec.acceptance_method]
        rule = (rule(spec.posterior_threshold, spec.posterior_alpha) if rule is accept.Typical
                else rule())
        return cls(proposer, rule)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a round's proposer and rule read: this round's batch, its speculating slots, the
    token history, and the settings the step is specialised on."""
    batch: StepBatch
    spec: SpecBatch
    history: jax.Array
    k_max: int
    compares_distributions: bool   # the rule compares the draft's distribution (rejection)
    cfg: ModelConfig
    dcfg: ModelConfig | None
    row_tile: int
    sampler: str
    attention: str
    draft_mesh: Any


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "rc", "row_tile", "sampler",
                                             "attention", "mesh", "draft_mesh"),
                   donate_argnames=("state", "draft_cache"))
def spec_step(weights, draft_weights, state: DeviceState, draft_cache, batch: StepBatch,
              spec: SpecBatch, *, cfg: ModelConfig, dcfg: ModelConfig | None, rc: RoundConfig,
              row_tile: int, sampler: str = "auto", attention: str = "auto", mesh=None,
              draft_mesh=None):
    """One round for every slot. DONATES ``state`` and ``draft_cache``. ``draft_weights``: the
    draft model's, or for ``ngram`` its n-gram draft table (``sfjax.spec.table``) or None. On a
    ``mesh`` the models run under ``shard_map`` (the draft on ``draft_mesh``: the same devices,
    maybe a smaller tensor-parallel size) and everything else on whole arrays.

    Logit rows: the plain step's (prefill completions, prompt logprobs), then from
    ``spec.verify_start`` the S * (K + 1) verify rows, slot-major, live slots first. Returns (state, draft_cache, drawn [R],
    accepted [S], tokens [S, K+1], emitted [S], drafted [S]).
    """
    k1 = rc.k_max + 1
    live = spec.slots >= 0
    history = replicated(record_tokens(state.history, batch.slots, batch.positions, batch.tokens), mesh)
    ctx = Context(batch, spec, history, rc.k_max, rc.rule.compares_distributions, cfg, dcfg,
                  row_tile, sampler, attention, draft_mesh)
    drafts, k, logq, draft_cache = rc.proposer.propose(ctx, draft_weights, draft_cache)
    k = jnp.where(live, k, 0)
    # fill the verify rows: drafts past a slot's k become padding
    j = jnp.arange(1, k1)[None, :]
    rows = spec.verify_row[:, None] + j                                    # [S, K]
    keep = live[:, None] & (j <= k[:, None])
    rows = jnp.where(live[:, None], rows, batch.tokens.shape[0])
    tokens = batch.tokens.at[rows].set(drafts, mode="drop")
    positions = batch.positions.at[rows].set(jnp.where(keep, spec.length[:, None] - 1 + j, -1), mode="drop")
    slots = batch.slots.at[rows].set(jnp.where(keep, spec.slots[:, None], -1), mode="drop")
    history = replicated(record_tokens(history, slots, positions, tokens), mesh)
    hidden, cache = model.forward(weights, state.cache, tokens, positions, slots,
                                  batch.block_tables, cfg, row_tile, attention=attention, mesh=mesh)
    logits = replicated(model.logits(weights, hidden[batch.logit_rows], cfg, row_tile,
                                     batch.num_logit_rows, mesh=mesh), mesh)
    drawn = sampling.draw(logits, batch.sampling, history, batch.num_logit_rows, row_tile,
                          batch.with_logprobs, sampler)
    accepted, out, drawn = rc.rule.accept(dataclasses.replace(ctx, history=history), drafts, k,
                                          logq, logits, drawn)
    emitted = accept.truncate_at_stops(out, accepted, spec.stop_ids, spec.min_left, spec.budget)
    emitted = jnp.where(live, emitted, 0)
    outs = replicated((drawn, jnp.where(live, accepted, 0), out, emitted, k), mesh)
    return (DeviceState(cache=keep_cache_sharding(cache, cfg, mesh), history=history), draft_cache,
            *outs)
